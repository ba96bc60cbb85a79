//! # codepool-issuance
//!
//! The core of codepool: every promise it makes, kept once, whichever door
//! a request came in by. The doors (the AMQP dispatcher, the HTTP API, the
//! console and the CLI) only translate to and from it.
//!
//! - Placing orders: [`intake::Intake`] decides a batch of purchases
//!   ([`plan`]) with the pools' policies ([`policy`]) and one batched,
//!   journaled claim ([`claim`]); waiting orders become backorders
//!   ([`backorders`]); [`placing`] publishes what a placed batch owes
//!   (refusals, `pool.exhausted`, `sms.pending` through the [`outbox`]) and
//!   counts it.
//! - The relay ([`relay`]) re-publishes the events of grants no one saw
//!   confirmed; every process that grants runs it.
//! - Operations on orders ([`ops`]: void, redeem, resend, lookup;
//!   [`replace`]: one code of an order replaced by a fresh one) and on
//!   pools and imports ([`controls`]: pause, resume, settings, recall,
//!   imports announced, dead letters replayed) take an [`audit::Actor`] and
//!   write their own audit record.
//! - The doors reach all of it through [`doors`]: views and operations on
//!   the [`Core`] they share (and on the dispatcher's [`background::Parts`]);
//!   none holds the store. Redemption by code keeps each key to its budget
//!   of misses ([`by_code`]); SMS receipts are decoded here ([`receipts`]).
//! - Around them: stock alerts ([`stock`]), expiry ([`expiry`]), grant
//!   numbers ([`grant_no`]), the key watch ([`keywatch`]), outage logging
//!   and retry policy ([`outage`]) and metrics ([`telemetry`]).
//! - Spans: each step above runs in a `tracing` span (`decide`, `claim`,
//!   `announce`, `place_holds`, `hold_commit`, `bundle`, `fulfil`,
//!   `relay`, `webhook_attempt`, and one per background sweep) whose
//!   fields name the [`Door`], the order, the hold, the pool and the shop
//!   where they apply; see docs/monitoring.md.

pub mod adapters;
pub mod api_keys;
pub mod audit;
pub mod background;
pub mod backorders;
pub mod batcher;
mod bundles;
pub mod by_code;
pub mod channels;
pub mod claim;
pub mod claim_error;
pub mod clock;
pub mod controls;
pub mod core;
mod demand;
pub mod doors;
pub mod expiry;
mod failpoint;
pub mod generations;
pub mod grant_no;
pub mod guard;
pub mod health;
mod held;
pub mod holds;
pub mod imports;
pub mod intake;
pub mod keywatch;
pub mod operators;
pub mod ops;
pub mod outage;
pub mod outbox;
pub mod placement;
pub mod placing;
pub mod plan;
pub mod policy;
pub mod ports;
pub mod receipts;
pub mod redeem;
pub mod relay;
pub mod replace;
pub mod sessions;
pub mod shops;
pub mod statements;
pub mod stock;
pub mod telemetry;
pub mod webhooks;

/// What the doors read and show, as the store keeps it: pools, their
/// settings and counts, shops, holds, webhook endpoints and attempts,
/// import runs and audit records. The doors take these from the core and
/// name no storage crate of their own (a suite test reads `cargo
/// metadata` to keep it so).
pub mod model {
    pub use codepool_store::audit::{Action, AuditEntry, AuditFilter, AuditKind, RecordedKind};
    pub use codepool_store::channel_outcomes::Outcomes;
    pub use codepool_store::channels::{ChannelDoc, DealDoc, DealLine, DealState};
    pub use codepool_store::holds::HoldDoc;
    pub use codepool_store::imports::ImportRecord;
    pub use codepool_store::lifecycle::{
        CodeRef, LifecycleError, ReceiptKind, ReceiptOutcome, Redeemed, RedemptionTag, VoidOutcome,
    };
    pub use codepool_store::pool_settings::{PoolSettings, PoolSettingsError};
    pub use codepool_store::pools::PoolDoc;
    pub use codepool_store::replacements::{ReplacementDoc, ReplacementState};
    pub use codepool_store::shops::ShopDoc;
    pub use codepool_store::stats::PoolStats;
    pub use codepool_store::webhooks::{AttemptDoc, EndpointDoc};
    pub use codepool_store::{CodeQuery, ObjectId};
}

/// The door a step came in by, as the `door` field of its spans and
/// lines names it: one grep for an order id shows its path through
/// whichever door it came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// The HTTP API (`codepool api`).
    Http,
    /// The AMQP dispatcher (`codepool dispatch`).
    Amqp,
    /// The operator console.
    Console,
    /// A `codepool` command.
    Cli,
    /// A granting process's own background work ([`background`]).
    Background,
}

impl Door {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Amqp => "amqp",
            Self::Console => "console",
            Self::Cli => "cli",
            Self::Background => "background",
        }
    }
}

/// What goes wrong when MongoDB did, in the core's answers. The store
/// itself is the core's: the doors read views and call operations of the
/// [`Core`] ([`doors`]), and never hold it.
pub use codepool_store::StoreError;

pub use claim::{ClaimConfig, ClaimEngine, ClaimError, ClaimOutcome};
pub use codepool_store::{ClaimWay, Resend};
pub use core::{Broker, Core};
pub use grant_no::GrantNumbers;
pub use health::Health;
pub use intake::Intake;
pub use outbox::{Marking, Outbox};
pub use stock::{StockConfig, StockLevel, StockWatch};

#[cfg(test)]
mod claim_tests;
#[cfg(test)]
mod fakes;
