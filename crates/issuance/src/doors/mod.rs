//! The core as the doors reach it. The HTTP API, the console and the AMQP
//! dispatcher hold no store: they read views and call operations of the
//! [`Core`](crate::Core) they share (the dispatcher, of its
//! [`Parts`](crate::background::Parts)), each a method that hands the
//! process's store to the core function that does the work. What they
//! read are the core's types ([`crate::model`] and the modules' own);
//! what goes wrong is the core's errors, a [`StoreError`](crate::StoreError)
//! among them when MongoDB did.
//!
//! One module per resource:
//!
//! - [`pools`]: pools, their stock, settings, pause and resume, imports,
//!   generations, recalls, statements, dead letters;
//! - [`orders`]: lookups, reveals, redemption, void, resend, replacement,
//!   holds;
//! - [`shops`]: shops and their webhook endpoints;
//! - [`channels`]: the marketplaces' calls on a shop's channels;
//! - [`access`]: API keys, operators, console sessions and the audit log;
//! - [`amqp`]: what the dispatcher applies (SMS receipts, `code.redeemed`)
//!   and the checks it makes (the key registry, MongoDB's pulse).
//!
//! A test ([`tests`]) reads the doors' sources and manifests: none names
//! the storage crate or asks for a store.

pub mod access;
pub mod amqp;
pub mod channels;
pub mod orders;
pub mod pools;
pub mod shops;

#[cfg(test)]
mod tests;
