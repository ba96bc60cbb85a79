//! codepool's integration suite: every test talks to real MongoDB, Redis
//! and RabbitMQ on 127.0.0.1 (started by `make services`), each in its own
//! database, queue prefix and Redis key prefix, so tests run in parallel
//! and can be re-run. One test binary keeps the build to a single link.

mod api;
mod api_load;
mod broker_users;
mod channels;
mod checker;
mod claims;
mod cli_audit;
mod common;
mod console;
mod deploy;
mod dispatcher;
mod export_rules;
mod fixtures;
mod generate;
mod hold_caps;
mod holds;
mod hotpool;
mod importer;
mod layers;
mod lookups;
mod marketplaces;
mod messages;
mod monitoring;
mod openapi;
mod ops;
mod policies;
mod quantity;
mod readable;
mod recall_runs;
mod redeem;
mod replace;
mod replay;
mod schemas;
mod scratch;
mod secrets;
mod sharding;
mod shops;
mod spans;
mod statements;
mod strays;
mod webhooks;
mod webhooks_fair;
