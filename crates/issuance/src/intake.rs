//! The application core both doors share. A purchase that arrives by AMQP
//! (the dispatcher) or by HTTP (the API server) is decided here: known pool,
//! conflicting order, pause and per-user limit, the batched claim, and the
//! plan of what to publish, backorder and refuse. Only the last step
//! differs by door: an AMQP delivery is acked, an HTTP request answered.

use std::collections::{BTreeSet, HashMap, HashSet};

use codepool_domain::{CodeId, Purchase};
use codepool_store::{ObjectId, Store, StoreError};

use crate::claim::{ClaimEngine, ClaimError, ClaimOutcome};
use crate::plan::{
    admit, plan_batch, pools_of, reject_conflicting, settle_cancelled, to_claim, BatchPlan, Parsed,
    Step,
};
use crate::policy::PolicyCache;
use crate::{Door, Resend};

/// Decides batches of purchases. Cheap to share between tasks.
pub struct Intake {
    pub(crate) store: Store,
    pub(crate) engine: ClaimEngine,
    /// Pools that exist and their policies, re-read every second.
    pub(crate) policies: PolicyCache,
    /// Whether the key file opens every code there is.
    pub(crate) keys: crate::keywatch::KeyWatch,
    /// The shops purchases name, re-read every second.
    pub(crate) shops: crate::shops::Shops,
}

impl Intake {
    pub fn new(store: Store, engine: ClaimEngine) -> Self {
        Self {
            store,
            engine,
            policies: PolicyCache::default(),
            keys: Default::default(),
            shops: Default::default(),
        }
    }

    pub fn engine(&self) -> &ClaimEngine {
        &self.engine
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Whether this process's key file opens every code (see
    /// [`crate::keywatch`]).
    pub fn keys(&self) -> &crate::keywatch::KeyWatch {
        &self.keys
    }

    /// The plan for a batch of parsed purchases. `relay` names orders whose
    /// purchase is settled without publishing (dead-lettered at its
    /// delivery limit): a grant an earlier delivery made for one is handed
    /// to the relay, which sends its event. `resend` says what sends a
    /// fresh grant's event again if this process stops before it is
    /// confirmed: the redelivered message (AMQP) or the relay (HTTP).
    ///
    /// One line per order at info ([`crate::placing::log_step`]: granted,
    /// refused, cancelled), in this step's `decide` span: each names its
    /// order, the span the `door` the batch came by and its size.
    #[tracing::instrument(
        name = "decide",
        skip_all,
        fields(door = door.as_str(), size = parsed.len())
    )]
    pub async fn decide(
        &self,
        parsed: Vec<Parsed>,
        relay: &[&str],
        resend: Resend,
        door: Door,
    ) -> Result<BatchPlan, ClaimError> {
        // Nothing is claimed that this process could not open.
        self.keys.ensure(&self.store).await??;
        let decided = match self.decide_checked(parsed, relay, resend).await {
            // A key added since the last check (within RECHECK): checked
            // now, so the process is not ready from this batch on (the
            // watch is what /readyz asks) and the batch is refused as one
            // this process cannot open, to be retried, not as a fault.
            Err(e) if e.is_unknown_key() => match self.keys.recheck(&self.store).await {
                Ok(Err(missing)) => Err(missing.into()),
                _ => Err(e),
            },
            decided => decided,
        };
        if let Ok(plan) = &decided {
            plan.steps.iter().for_each(crate::placing::log_step);
        }
        decided
    }

    /// [`Intake::decide`] once the keys were checked.
    async fn decide_checked(
        &self,
        parsed: Vec<Parsed>,
        relay: &[&str],
        resend: Resend,
    ) -> Result<BatchPlan, ClaimError> {
        // The batch's backorders are read with its pools' policies: an
        // order id that waits as a backorder of another order is a
        // conflict, and gets nothing.
        let orders: Vec<&str> = (parsed.iter().filter_map(|p| p.as_ref().ok()))
            .map(|p| p.order_id.as_str())
            .collect();
        let pools = pools_of(&parsed);
        // What the orders hold already is read alongside: a retry or a
        // redelivery of an order that holds all its codes is answered from
        // this read and claims nothing, and a holder passes its pool's
        // policy.
        let (relayed, policies, backordered, held) = futures::join!(
            self.store.hand_to_relay(relay),
            self.policies.get_many(&self.store, &pools),
            self.store.backorders_for_orders(&orders),
            self.store.grants_for_orders(&orders),
        );
        relayed?;
        let policies = policies?;
        let mut held = held?;
        let backordered = backordered?;
        let owed = self.owe_events(&parsed, &held, resend).await?;
        // Orders that pay for a checkout hold take its codes first (a new
        // order only: one that holds codes or waits already is placed as
        // it stands).
        let committed = self
            .commit_holds(&parsed, &policies, &backordered, &mut held, resend)
            .await?;
        // A void is final: an order whose backorder was cancelled gets
        // nothing again, whichever door it comes back through.
        let cancelled: std::collections::HashSet<String> = (backordered.iter())
            .filter(|b| b.status == codepool_store::backorders::BackorderState::Cancelled)
            .map(|b| b.order_id.clone())
            .collect();
        let waited: std::collections::HashSet<String> = (backordered.iter())
            .filter(|b| b.status == codepool_store::backorders::BackorderState::Waiting)
            .map(|b| b.order_id.clone())
            .collect();
        let backordered = backordered
            .into_iter()
            .map(|b| {
                let q = b.quantity();
                (b.order_id, (b.pool, b.uid, q, b.owner))
            })
            .collect();
        // A shop's purchase orders from its own pools, and its order is
        // the shop's (shops.rs).
        let admitted = admit(parsed, |p| policies.contains_key(p));
        let admitted = self.shops.admit(&self.store, admitted).await?;
        let intake = reject_conflicting(admitted, &backordered);
        let intake = settle_cancelled(intake, &cancelled);
        // Per-user limits and pauses (policy.rs); refusals are durable now.
        let intake = crate::policy::enforce(&self.store, intake, &policies, &held).await?;
        let claims = to_claim(&intake);
        let claims_began = bson::DateTime::now();
        let (outcomes, short_pools) = self.claim(&claims, resend, &held).await?;
        let mut plan = plan_batch(intake, outcomes)?;
        plan.exhausted_pools.extend(short_pools);
        plan.claims_began = Some(claims_began);
        plan.owed = owed;
        plan.credit_committed(&committed);
        self.withdraw_if_cancelled(&mut plan, &waited).await?;
        Ok(plan)
    }

    /// Claims for the batch's orders, outcomes aligned with `claims`:
    /// orders of one pool in one batched claim, bundles whole or not at
    /// all (bundles.rs). Also returns the pools that left a bundle short.
    async fn claim(
        &self,
        claims: &[&Purchase],
        resend: Resend,
        held: &HashMap<String, Vec<codepool_domain::Code>>,
    ) -> Result<(Vec<ClaimOutcome>, BTreeSet<String>), ClaimError> {
        type At<'a> = Vec<(usize, &'a Purchase)>;
        let (bundles, plain): (At, At) = claims
            .iter()
            .copied()
            .enumerate()
            .partition(|(_, p)| p.is_bundle());
        let mut outcomes: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        let mut short = BTreeSet::new();
        if !plain.is_empty() {
            let ps: Vec<&Purchase> = plain.iter().map(|(_, p)| *p).collect();
            let got = self.engine.claim_known(&ps, resend, held).await?;
            for ((i, _), o) in plain.iter().zip(got) {
                outcomes[*i] = Some(o);
            }
        }
        if !bundles.is_empty() {
            let bs: Vec<&Purchase> = bundles.iter().map(|(_, p)| *p).collect();
            let got =
                crate::bundles::claim_bundles(&self.engine, &self.store, &bs, resend, held).await?;
            short = got.short_pools;
            for ((i, _), o) in bundles.iter().zip(got.outcomes) {
                outcomes[*i] = Some(o);
            }
        }
        Ok((outcomes.into_iter().flatten().collect(), short))
    }

    /// For a batch whose events a record owes ([`Resend::ByRecord`]):
    /// records, before anything is granted, the orders that may be (all
    /// but those that hold every code they asked for: a repeat grants
    /// nothing). A batch of repeats writes nothing. Returns the record.
    async fn owe_events(
        &self,
        parsed: &[Parsed],
        held: &HashMap<String, Vec<codepool_domain::Code>>,
        resend: Resend,
    ) -> Result<Option<ObjectId>, StoreError> {
        if resend != Resend::ByRecord {
            return Ok(None);
        }
        // A bundle's quantity is its items' sum: every order's is its codes.
        let fresh: Vec<&str> = (parsed.iter().flatten())
            .filter(|p| held.get(&p.order_id).map_or(0, Vec::len) < p.quantity as usize)
            .map(|p| p.order_id.as_str())
            .collect();
        if fresh.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.store.owe_events(&fresh).await?))
    }

    /// Commits the holds the batch's new orders pay for, and adds what
    /// they now hold to `held`. Returns the codes committed.
    async fn commit_holds(
        &self,
        parsed: &[Parsed],
        policies: &HashMap<String, codepool_domain::PoolPolicy>,
        backordered: &[codepool_store::backorders::BackorderDoc],
        held: &mut HashMap<String, Vec<codepool_domain::Code>>,
        resend: Resend,
    ) -> Result<HashSet<CodeId>, StoreError> {
        // Most batches pay for no hold: they cost nothing here.
        if !(parsed.iter().flatten()).any(|p| p.hold_id.is_some()) {
            return Ok(HashSet::new());
        }
        let waiting: HashSet<&str> = backordered.iter().map(|b| b.order_id.as_str()).collect();
        // A retry of an order that holds its codes already finishes the
        // hold it paid for, if a process died before it ended it.
        for p in (parsed.iter().filter_map(|p| p.as_ref().ok()))
            .filter(|p| held.contains_key(&p.order_id))
        {
            if let Some(h) = &p.hold_id {
                (self.store)
                    .finish_bound_hold(h, p.owner.as_deref(), &p.order_id)
                    .await?;
            }
        }
        // The gate (held.rs) decides each: paid, bound to a waiting order
        // (a paused pool), released (a per-user limit) or left alone.
        let paying: Vec<&Purchase> = (parsed.iter().filter_map(|p| p.as_ref().ok()))
            .filter(|p| p.hold_id.is_some())
            .filter(|p| !held.contains_key(&p.order_id) && !waiting.contains(p.order_id.as_str()))
            .collect();
        if paying.is_empty() {
            return Ok(HashSet::new());
        }
        // A purchase that names a shop pays only if the shop lets its
        // publisher name it and orders from every pool of the order (the
        // shop admission refuses it after this, and its hold stays held).
        let mut names: Vec<&str> = paying.iter().filter_map(|p| p.shop.as_deref()).collect();
        names.sort_unstable();
        names.dedup();
        let shops = self.shops.get_many(&self.store, &names).await?;
        // Admitted, such an order is the shop's: its codes carry the
        // shop's owner from the commit on, as the shop admission would
        // stamp them.
        let paying: Vec<Purchase> = (paying.into_iter())
            .filter(|p| match &p.shop {
                None => true,
                Some(s) => (shops.get(s).and_then(Option::as_ref)).is_some_and(|shop| {
                    crate::shops::may_name(shop, p).is_ok()
                        && p.pools().iter().all(|x| shop.allows(x))
                }),
            })
            .map(|p| {
                let mut p = p.clone();
                if let Some(shop) = &p.shop {
                    p.owner = Some(crate::shops::owner_of(shop));
                }
                p
            })
            .collect();
        let paying: Vec<&Purchase> = paying.iter().collect();
        let paid = crate::held::commit_paid(&self.store, &paying, policies, resend).await?;
        self.engine.offer(&paid.released).await;
        if !paid.committed.is_empty() {
            let orders: Vec<&str> = paying.iter().map(|p| p.order_id.as_str()).collect();
            held.extend(self.store.grants_for_orders(&orders).await?);
        }
        Ok(paid.committed)
    }

    /// An order that waited when this batch read it may have been voided
    /// (its backorder cancelled) while the batch claimed its missing lines:
    /// those codes are voided again before any event, and the order is
    /// settled as cancelled (see [`Store::withdraw_cancelled`]).
    async fn withdraw_if_cancelled(
        &self,
        plan: &mut BatchPlan,
        waited: &std::collections::HashSet<String>,
    ) -> Result<(), StoreError> {
        if waited.is_empty() {
            return Ok(());
        }
        let issued: Vec<(codepool_domain::CodeId, String)> = (plan.steps.iter())
            .filter_map(|s| match s {
                Step::Grant { grants, .. } => Some(grants),
                _ => None,
            })
            .flatten()
            .filter(|g| !g.revoked && waited.contains(&g.order_id))
            .map(|g| (g.code_id, g.order_id.clone()))
            .collect();
        if issued.is_empty() {
            return Ok(());
        }
        let refs: Vec<(codepool_domain::CodeId, &str)> =
            issued.iter().map(|(id, o)| (*id, o.as_str())).collect();
        let withdrawn: std::collections::HashSet<_> = self
            .store
            .withdraw_cancelled(&refs)
            .await?
            .into_iter()
            .collect();
        for step in &mut plan.steps {
            if let Step::Grant {
                purchase, grants, ..
            } = step
            {
                if grants.iter().any(|g| withdrawn.contains(&g.code_id)) {
                    *step = Step::Cancelled((**purchase).clone());
                }
            }
        }
        Ok(())
    }

    /// Records the plan's backorders durably (one try), and the
    /// `order.refused` webhook events of its shops' refused orders. A
    /// backorder that finds another order's under its id turns its step
    /// into a `conflicting_order` dead letter. Returns how many are new.
    pub async fn record_backorders(&self, plan: &mut BatchPlan) -> Result<u64, StoreError> {
        let refused: Vec<_> = (plan.refusals().into_iter())
            .filter_map(|(_, r)| crate::webhooks::events::order_refused(r))
            .collect();
        self.store.record_webhook_events(&refused).await?;
        let backorders = plan.backorders();
        if backorders.is_empty() {
            return Ok(0);
        }
        let waiting: Vec<_> = backorders.iter().map(|(_, w)| *w).collect();
        let recorded = self.store.record_backorders(&waiting).await?;
        let position: HashMap<&str, usize> = (backorders.iter())
            .map(|(i, w)| (w.purchase.order_id.as_str(), *i))
            .collect();
        let conflicts: Vec<(usize, &'static str)> = (recorded.conflicts.iter())
            .filter_map(|(order, what)| Some((*position.get(order.as_str())?, *what)))
            .collect();
        drop(backorders);
        plan.reject_conflicts(&conflicts);
        for step in &plan.steps {
            if let Step::Backorder { purchase, lines } = step {
                tracing::info!(order_id = %purchase.order_id, pool = %purchase.pool, waiting = lines.len(), "order waits for codes");
            }
        }
        metrics::counter!("codepool_backorders_total").increment(recorded.new);
        Ok(recorded.new)
    }
}

/// Why a batch could not be placed: nothing of it was claimed, or what
/// was claimed is owed by the relay.
#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error("the backorders were not recorded: {0}")]
    Backorders(#[source] codepool_store::StoreError),
}

impl PlaceError {
    /// MongoDB is away, or this process misses a key: the same batch may
    /// be tried again (here or by another process).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Claim(e) => e.is_unavailable() || matches!(e, ClaimError::KeysMissing(_)),
            Self::Backorders(e) => e.is_unavailable(),
        }
    }
}
