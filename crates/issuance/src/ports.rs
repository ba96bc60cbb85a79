//! The ports of the claim engine and the dispatcher: what the core needs
//! from the outside world, as traits the core owns. The adapters in
//! [`crate::adapters`] implement them over MongoDB ([`Store`]), Redis
//! ([`HotPool`]), the daily sequence ([`GrantNumbers`]) and RabbitMQ
//! ([`Publisher`]); unit tests implement them in memory, so every rule of
//! the claim engine (race rounds, put-back, fallback) runs without servers.
//!
//! [`Store`]: codepool_store::Store
//! [`HotPool`]: codepool_hotpool::HotPool
//! [`GrantNumbers`]: crate::GrantNumbers
//! [`Publisher`]: codepool_broker::Publisher

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use codepool_broker::BrokerError;
use codepool_domain::{Code, CodeId, Purchase, PurchaseRefused, SmsPending};
use codepool_hotpool::{HeldRefill, HotPoolError, Refilled};
use codepool_store::codes::ScanClaim;
use codepool_store::order_ids::Bound;
use codepool_store::{CandidateAsk, ClaimAssignment, ClaimWrite, StoreError};

use crate::claim_error::ClaimError;

/// A code offered to claimers: its id and its `seq` (import order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Candidate {
    pub id: CodeId,
    pub seq: i64,
}

/// The source of truth for claims: conditional writes and reads by order.
#[async_trait]
pub trait ClaimStore: Send + Sync {
    /// All assignments in one journaled write, each "if still unissued".
    async fn claim_candidates(&self, claims: &[ClaimAssignment]) -> Result<ClaimWrite, StoreError>;
    /// Claims the oldest unissued code of `pool` (its `code_id` is ignored).
    async fn claim_by_scan(
        &self,
        pool: &str,
        claim: &ClaimAssignment,
    ) -> Result<ScanClaim, StoreError>;
    /// Binds each order id to its order's identity unless it is bound
    /// already; the identity each id is bound to now, aligned with
    /// `orders` (see [`codepool_store::order_ids`]).
    async fn bind_orders(&self, orders: &[Bound]) -> Result<Vec<Bound>, StoreError>;
    /// The codes these orders hold, by order id, each order's by line.
    async fn grants_for_orders(
        &self,
        orders: &[&str],
    ) -> Result<HashMap<String, Vec<Code>>, StoreError>;
    /// Unissued codes after each ask's `after_seq` in its pool, oldest
    /// first, aligned with `asks` (one round trip in production).
    async fn candidates_after_many(
        &self,
        asks: &[CandidateAsk<'_>],
    ) -> Result<Vec<Vec<Candidate>>, StoreError>;
}

/// Where claimers draw distinct candidates from (Redis in production). It
/// holds no truth: any error means "claim from the store instead".
#[async_trait]
pub trait CandidatePool: Send + Sync {
    /// Up to `k` candidates, oldest first, and how many remain.
    async fn pop(&self, pool: &str, k: usize) -> Result<(Vec<Candidate>, u64), HotPoolError>;
    /// [`CandidatePool::pop`] for several pools at once (one round trip in
    /// production), aligned with `wants`.
    async fn pop_many(
        &self,
        wants: &[(&str, usize)],
    ) -> Result<Vec<(Vec<Candidate>, u64)>, HotPoolError> {
        let mut out = Vec::with_capacity(wants.len());
        for (pool, k) in wants {
            out.push(self.pop(pool, *k).await?);
        }
        Ok(out)
    }
    /// Returns unused candidates.
    async fn put_back(&self, pool: &str, candidates: &[Candidate]) -> Result<(), HotPoolError>;
    /// Drops candidates that must never be offered again.
    async fn remove(&self, pool: &str, ids: &[CodeId]) -> Result<(), HotPoolError>;
    /// One refiller per pool at a time: takes each pool's refill lock and
    /// reads its high-water mark and set size (one round trip in
    /// production). `None` where someone else holds the lock.
    async fn lock_refills(
        &self,
        pools: &[&str],
        ttl: Duration,
    ) -> Result<Vec<Option<HeldRefill>>, HotPoolError>;
    /// Adds what each refill loaded, raises its high-water mark, and
    /// releases its lock.
    async fn finish_refills(&self, fills: Vec<Refilled<Candidate>>) -> Result<(), HotPoolError>;
    /// True while the pool is unreachable (claims are on the fallback).
    fn is_degraded(&self) -> bool;
}

/// Grant numbers for purchases, aligned with the input.
#[async_trait]
pub trait Numbering: Send + Sync {
    async fn for_purchases(
        &self,
        purchases: &[&Purchase],
    ) -> Result<Vec<Option<String>>, ClaimError>;
}

/// Where SMS-pending events go (RabbitMQ in production).
#[async_trait]
pub trait EventSink: Send + Sync {
    /// Publishes every event with confirms in flight together, then waits
    /// for each: one result per event, aligned with the input.
    async fn publish_sms(&self, events: &[SmsPending]) -> Vec<Result<(), BrokerError>>;
    /// Publishes `purchase.refused` events the same way. Sinks that carry
    /// only SMS refuse them, so the refused backorders wait for a sink that
    /// can announce them.
    async fn publish_refused(&self, events: &[PurchaseRefused]) -> Vec<Result<(), BrokerError>> {
        events.iter().map(|_| Err(BrokerError::Nacked)).collect()
    }
}

/// How it is recorded that an SMS-pending event was confirmed.
#[async_trait]
pub trait SmsLedger: Send + Sync {
    /// The events of these codes were confirmed: off the relay's list.
    /// Each code is named by its pool and id (the pool targets the write).
    async fn mark_published(&self, ids: &[(&str, CodeId)]) -> Result<(), StoreError>;
    /// An operator re-sent these codes' events (`codepool resend`).
    async fn mark_resent(&self, ids: &[(&str, CodeId)]) -> Result<(), StoreError>;
}
