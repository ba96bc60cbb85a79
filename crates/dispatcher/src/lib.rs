//! # codepool-dispatcher
//!
//! The AMQP door. It consumes the `purchases` queue with manual acks,
//! gathers what the prefetch window holds into batches, and places each
//! batch through the core ([`codepool_issuance`]): decide, claim, record
//! backorders, announce. It publishes the dead letters of invalid
//! purchases, and acks only once every outcome is durable and every event
//! confirmed ([`acks`]). A crash anywhere before the ack means a
//! redelivery, which the unique `order_id` index turns into a lookup.
//!
//! Beside purchases each session consumes SMS receipts and `code.redeemed`
//! messages and runs the core's upkeep ([`upkeep`]): the relay, backorder
//! fulfilment, the expiry sweep and stock alerts. Every outage (MongoDB,
//! RabbitMQ, Redis) is waited out and logged once, and the connection is
//! opened again ([`daemon`]).

pub mod acks;
mod batch;
pub mod daemon;
pub mod redemptions;
mod session;
pub mod upkeep;

pub use acks::AckWindow;
pub use daemon::{Dispatcher, DispatcherConfig};
