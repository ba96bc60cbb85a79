//! # codepool-dispatcher
//!
//! The daemon that turns purchases into grants. It consumes the
//! `purchases` queue with manual acks, gathers what the prefetch window
//! holds into batches, claims one code per purchase ([`claim`]), publishes
//! each grant's SMS-pending event with publisher confirms in flight
//! together, and only then acks. A crash anywhere before the ack means a
//! redelivery, which the unique `order_id` index turns into a lookup.
//!
//! Around that core: invalid purchases are dead-lettered with a reason, an
//! empty pool turns purchases into backorders ([`backorders`]) that are
//! fulfilled when codes arrive, a relay ([`relay`]) re-publishes the events
//! of grants no purchase will be redelivered for, and every outage
//! (MongoDB, RabbitMQ, Redis) is waited out and logged once ([`outage`]). Beside purchases each session
//! runs its [`upkeep`]: SMS receipts, `code.redeemed` events, the expiry
//! sweep and low-stock alerts ([`stock`]).
//!
//! Before any claim, the pools' policies apply ([`policy`]): a buyer over
//! the pool's per-user limit is refused (`purchase.refused`), and a paused
//! pool's purchases wait as backorders. [`controls`] holds the operator's
//! pause, resume and recall of an import.

pub mod acks;
pub mod adapters;
pub mod audit;
pub mod backorders;
pub mod batch;
pub mod claim;
pub mod claim_error;
pub mod controls;
pub mod daemon;
mod demand;
pub mod expiry;
pub mod grant_no;
pub mod health;
pub mod intake;
pub mod keywatch;
pub mod ops;
pub mod outage;
pub mod outbox;
pub mod plan;
pub mod policy;
pub mod ports;
pub mod receipts;
pub mod redemptions;
pub mod relay;
mod session;
pub mod stock;
pub mod telemetry;
pub mod upkeep;

pub use acks::AckWindow;
pub use claim::{ClaimConfig, ClaimEngine, ClaimError, ClaimOutcome};
pub use codepool_store::Resend;
pub use daemon::{Dispatcher, DispatcherConfig};
pub use grant_no::GrantNumbers;
pub use health::Health;
pub use intake::Intake;
pub use outbox::{Marking, Outbox};
pub use stock::{StockConfig, StockLevel, StockWatch};

#[cfg(test)]
mod claim_tests;
#[cfg(test)]
mod fakes;
