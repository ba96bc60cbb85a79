//! The command line: one subcommand per job, each in `commands/`.

use clap::{Parser, Subcommand};

use crate::commands;
use crate::config::Config;

const EXAMPLES: &str = "\
Examples:
  codepool keys init
  codepool migrate
  codepool import codes.csv --pool game-x
  codepool dispatch --http 127.0.0.1:9464
  codepool publish --pool game-x --order-id O-1001 --uid 123213 --phone +8613800000000
  codepool publish --file purchases.jsonl
  codepool stats --pool game-x
  codepool lookup --order O-1001
  codepool void --order O-1001 --reason refund
  codepool replace --order O-1001 --line 0 --reason \"code rejected\"
  codepool pool create --pool game-x
  codepool pool set --pool game-x --low-stock 500
  codepool export --pool game-x --out game-x.csv
  codepool statement --pool game-x --from 2026-11-01 --to 2026-12-01

Every server is configured by flag or environment (CODEPOOL_MONGODB_URI,
CODEPOOL_DB, CODEPOOL_REDIS_URL, CODEPOOL_AMQP_URL); the defaults are local
servers on 127.0.0.1, which `make services` starts. Codes are encrypted at
rest with the key file CODEPOOL_KEY_FILE (`codepool keys init`); back it up:
losing it loses the codes.

Exit codes: 0 success; 1 failure (the message says what to do next); 2 usage
error (a wrong or missing flag); 3 partial success (import skipped invalid
rows; a statement row does not tie out); 130 or 143 stopped by SIGINT or SIGTERM (import).";

/// Hands out pre-issued activation codes: one per purchase, never twice.
#[derive(Debug, Parser)]
#[command(name = "codepool", version, about, after_help = EXAMPLES)]
pub struct Cli {
    #[command(flatten)]
    pub config: Config,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply migrations/ (idempotent) and encrypt codes stored in plaintext.
    Migrate(commands::migrate::MigrateArgs),
    /// The key file that encrypts codes at rest: init, add, rotate, status.
    Keys(commands::keys::KeysArgs),
    /// Export a pool's codes as CSV for reconciliation (masked unless --reveal).
    Export(commands::export::ExportArgs),
    /// Stream a CSV file of codes into a pool.
    Import(commands::import::ImportArgs),
    /// Make codes in a pool (random Crockford base-32 of a pattern), as a run recall and export see like an import.
    Generate(commands::generate::GenerateArgs),
    /// Run the daemon: consume purchases, claim codes, publish SMS-pending events.
    Dispatch(commands::dispatch::DispatchArgs),
    /// Serve the HTTP API for shop backends (orders, with API keys).
    Api(commands::api::ApiArgs),
    /// Create, list and revoke the HTTP API's keys.
    #[command(name = "api-keys")]
    ApiKeys(commands::api_keys::ApiKeysArgs),
    /// Shops: the pools each may order from; their keys see only their orders.
    Shops(commands::shops::ShopsArgs),
    /// Channels: a shop's Eneba, G2A and Kinguin accounts, selling its pools.
    Channels(commands::channels::ChannelsArgs),
    /// Webhooks: a shop's endpoints, signed deliveries, retries and replays.
    Webhooks(commands::webhooks::WebhooksArgs),
    /// Add, list, disable operators of the console (/console) and set their passwords.
    Operators(commands::operators::OperatorsArgs),
    /// Publish purchases (one from flags, or many from a JSON-lines file).
    Publish(commands::publish::PublishArgs),
    /// Inventory per pool: unissued, issued, used, void, expired, backorders, hot-pool size.
    Stats(commands::stats::StatsArgs),
    /// What became of every import's codes in a period, one row per run, each checked to tie out.
    Statement(commands::statement::StatementArgs),
    /// The look-alike pairs stored across pools (a code sits in one pool), to act on.
    Lookalikes(commands::lookalikes::LookalikesArgs),
    /// Who got which code and when (codes masked unless --reveal).
    Lookup(commands::lookup::LookupArgs),
    /// Inspect and replay dead-lettered (invalid) purchases.
    #[command(name = "dead-letters")]
    DeadLetters(commands::dead_letters::DeadLettersArgs),
    /// Peek at SMS-pending events waiting for the SMS service (codes masked).
    #[command(name = "sms-pending")]
    SmsPending(commands::sms_pending::SmsPendingArgs),
    /// Redeem an issued code: it was used by its buyer.
    Redeem(commands::redeem::RedeemArgs),
    /// Void a code (refund, withdrawal); it is never issued again.
    Void(commands::void::VoidArgs),
    /// Replace one code of an order that does not work: void it, text a fresh one.
    Replace(commands::replace::ReplaceArgs),
    /// Void unissued codes whose expiry date has passed.
    Expire(commands::expire::ExpireArgs),
    /// Publish an order's SMS-pending event again.
    Resend(commands::resend::ResendArgs),
    /// Create a pool, change its settings (low-stock threshold, grant prefix), show stock.
    Pool(commands::pool::PoolArgs),
    /// Sequence generators: segments, daily numbers, cyclic counters, time ids.
    Seq(commands::seq::SeqArgs),
}

pub async fn run(cli: Cli) -> anyhow::Result<u8> {
    let cfg = cli.config;
    match cli.command {
        Command::Migrate(args) => commands::migrate::run(&cfg, args).await,
        Command::Keys(args) => commands::keys::run(&cfg, args).await,
        Command::Export(args) => commands::export::run(&cfg, args).await,
        Command::Import(args) => commands::import::run(&cfg, args).await,
        Command::Generate(args) => commands::generate::run(&cfg, args).await,
        Command::Dispatch(args) => commands::dispatch::run(&cfg, args).await,
        Command::Api(args) => commands::api::run(&cfg, args).await,
        Command::ApiKeys(args) => commands::api_keys::run(&cfg, args).await,
        Command::Operators(args) => commands::operators::run(&cfg, args).await,
        Command::Shops(args) => commands::shops::run(&cfg, args).await,
        Command::Channels(args) => commands::channels::run(&cfg, args).await,
        Command::Webhooks(args) => commands::webhooks::run(&cfg, args).await,
        Command::Publish(args) => commands::publish::run(&cfg, args).await,
        Command::Stats(args) => commands::stats::run(&cfg, args).await,
        Command::Lookalikes(args) => commands::lookalikes::run(&cfg, args).await,
        Command::Statement(args) => commands::statement::run(&cfg, args).await,
        Command::Lookup(args) => commands::lookup::run(&cfg, args).await,
        Command::DeadLetters(args) => commands::dead_letters::run(&cfg, args).await,
        Command::SmsPending(args) => commands::sms_pending::run(&cfg, args).await,
        Command::Redeem(args) => commands::redeem::run(&cfg, args).await,
        Command::Void(args) => commands::void::run(&cfg, args).await,
        Command::Replace(args) => commands::replace::run(&cfg, args).await,
        Command::Expire(args) => commands::expire::run(&cfg, args).await,
        Command::Resend(args) => commands::resend::run(&cfg, args).await,
        Command::Pool(args) => commands::pool::run(&cfg, args).await,
        Command::Seq(args) => {
            // The generators stand alone: their counters may start a
            // database of their own.
            let store = crate::context::store_creating(&cfg).await?;
            commands::seq::run(
                args,
                store.database().clone(),
                &cfg.redis_url,
                &cfg.redis_prefix,
            )
            .await?;
            Ok(crate::exit::OK)
        }
    }
}
