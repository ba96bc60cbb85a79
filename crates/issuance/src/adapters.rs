//! The production adapters of the [`crate::ports`]: MongoDB, Redis, the
//! daily sequence and RabbitMQ. Thin translations only; every decision is
//! in the core.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use codepool_broker::{BrokerError, Publisher};
use codepool_domain::{Code, CodeId, Purchase, PurchaseRefused, SmsPending};
use codepool_hotpool::{HeldRefill, HotPool, HotPoolError, Refilled};
use codepool_store::codes::ScanClaim;
use codepool_store::{CandidateAsk, ClaimAssignment, ClaimWrite, Store, StoreError};
use futures::future::join_all;
use tracing::warn;

use crate::claim::ClaimError;
use crate::ports::{Candidate, CandidatePool, ClaimStore, EventSink, Numbering, SmsLedger};
use crate::GrantNumbers;

#[async_trait]
impl ClaimStore for Store {
    async fn claim_candidates(&self, claims: &[ClaimAssignment]) -> Result<ClaimWrite, StoreError> {
        Store::claim_candidates(self, claims).await
    }

    async fn claim_by_scan(
        &self,
        pool: &str,
        claim: &ClaimAssignment,
    ) -> Result<ScanClaim, StoreError> {
        Store::claim_by_scan(self, pool, claim).await
    }

    async fn bind_orders(
        &self,
        orders: &[codepool_store::order_ids::Bound],
    ) -> Result<Vec<codepool_store::order_ids::Bound>, StoreError> {
        Store::bind_orders(self, orders).await
    }

    async fn grants_for_orders(
        &self,
        orders: &[&str],
    ) -> Result<HashMap<String, Vec<Code>>, StoreError> {
        Store::grants_for_orders(self, orders).await
    }

    async fn candidates_after_many(
        &self,
        asks: &[CandidateAsk<'_>],
    ) -> Result<Vec<Vec<Candidate>>, StoreError> {
        let found = Store::candidates_after_many(self, asks).await?;
        Ok(found
            .into_iter()
            .map(|codes| {
                codes
                    .into_iter()
                    .map(|(id, seq)| Candidate { id, seq })
                    .collect()
            })
            .collect())
    }
}

#[async_trait]
impl SmsLedger for Store {
    async fn mark_published(&self, ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
        self.mark_sms_published(ids).await
    }

    async fn mark_resent(&self, ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
        self.record_sms_resent(ids).await
    }
}

fn to_redis(c: &[Candidate]) -> Vec<codepool_hotpool::Candidate> {
    c.iter().copied().map(redis_candidate).collect()
}

fn redis_candidate(c: Candidate) -> codepool_hotpool::Candidate {
    codepool_hotpool::Candidate {
        id: c.id.to_hex(),
        seq: c.seq,
    }
}

/// Reads candidates from Redis. One that is not a code id was not written
/// by codepool: it is dropped (it is out of the set already), counted and
/// logged; its order simply draws another candidate.
fn from_redis(pool: &str, raw: Vec<codepool_hotpool::Candidate>) -> Vec<Candidate> {
    raw.into_iter()
        .filter_map(|c| match CodeId::parse(&c.id) {
            Ok(id) => Some(Candidate { id, seq: c.seq }),
            Err(e) => {
                warn!(pool, error = %e, "dropped a hot-pool entry that is not a code id");
                metrics::counter!("codepool_internal_errors_total", "kind" => "bad_candidate")
                    .increment(1);
                None
            }
        })
        .collect()
}

#[async_trait]
impl CandidatePool for HotPool {
    async fn pop(&self, pool: &str, k: usize) -> Result<(Vec<Candidate>, u64), HotPoolError> {
        let (raw, left) = HotPool::pop(self, pool, k).await?;
        Ok((from_redis(pool, raw), left))
    }

    async fn pop_many(
        &self,
        wants: &[(&str, usize)],
    ) -> Result<Vec<(Vec<Candidate>, u64)>, HotPoolError> {
        let popped = HotPool::pop_many(self, wants).await?;
        Ok(wants
            .iter()
            .zip(popped)
            .map(|((pool, _), (raw, left))| (from_redis(pool, raw), left))
            .collect())
    }

    async fn put_back(&self, pool: &str, candidates: &[Candidate]) -> Result<(), HotPoolError> {
        HotPool::put_back(self, pool, &to_redis(candidates)).await
    }

    async fn remove(&self, pool: &str, ids: &[CodeId]) -> Result<(), HotPoolError> {
        let ids: Vec<String> = ids.iter().map(CodeId::to_hex).collect();
        HotPool::remove(self, pool, &ids).await
    }

    async fn lock_refills(
        &self,
        pools: &[&str],
        ttl: Duration,
    ) -> Result<Vec<Option<HeldRefill>>, HotPoolError> {
        HotPool::lock_refills(self, pools, ttl).await
    }

    async fn finish_refills(&self, fills: Vec<Refilled<Candidate>>) -> Result<(), HotPoolError> {
        let fills = fills.into_iter().map(|f| f.map(redis_candidate)).collect();
        HotPool::finish_refills(self, fills).await
    }

    fn is_degraded(&self) -> bool {
        HotPool::is_degraded(self)
    }
}

#[async_trait]
impl Numbering for GrantNumbers {
    async fn for_purchases(
        &self,
        purchases: &[&Purchase],
    ) -> Result<Vec<Option<String>>, ClaimError> {
        GrantNumbers::for_purchases(self, purchases).await
    }
}

#[async_trait]
impl EventSink for Publisher {
    async fn publish_sms(&self, events: &[SmsPending]) -> Vec<Result<(), BrokerError>> {
        confirmed(join_all(events.iter().map(|e| self.publish_sms_pending(e))).await).await
    }

    async fn publish_refused(&self, events: &[PurchaseRefused]) -> Vec<Result<(), BrokerError>> {
        confirmed(join_all(events.iter().map(|e| Publisher::publish_refused(self, e))).await).await
    }
}

/// Waits for each publish's confirm, in order. The publishes themselves
/// are started together (`join_all` polls them in order, so their
/// delivery tags follow the input): the connection writes their frames in
/// one go instead of one hand-off to its I/O loop per message.
async fn confirmed(
    pending: Vec<Result<codepool_broker::PendingConfirm, BrokerError>>,
) -> Vec<Result<(), BrokerError>> {
    join_all(pending.into_iter().map(codepool_broker::confirmed)).await
}
