//! The decision for a batch of purchases, as pure functions. Given what
//! the deliveries say and what the claim engine answered, [`plan_batch`]
//! returns what to publish, backorder and dead-letter; after the daemon has
//! done that, [`settle`] says which deliveries to ack and which to requeue.
//! Nothing here does I/O, so every branch is tested without servers.
//!
//! The one rule all of this serves: a purchase is acked only once its
//! outcome is durable — its SMS-pending event or dead letter confirmed by
//! the broker, or its backorder journaled — and never otherwise.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use codepool_domain::{Grant, Purchase, PurchaseError, Refusal};
use codepool_store::backorders::Waiting;

use crate::claim::ClaimOutcome;
pub use crate::claim_error::OutcomeMismatch;

/// What a delivery turned out to be before any claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// A valid purchase of a known pool: claim a code for it.
    Claim(Purchase),
    /// Its pool is paused: it waits as a backorder, nothing is claimed.
    Hold(Purchase),
    /// A pool policy refused it: no code, a `purchase.refused` event.
    Refuse(Box<Refusal>),
    /// Invalid, or of an unknown pool: dead-letter it with this reason.
    Reject(PurchaseError),
    /// The order was voided while it waited: its backorder is cancelled,
    /// and a cancelled order is final. Nothing is claimed or published.
    Cancelled(Purchase),
}

/// A delivery's body, parsed and validated.
pub type Parsed = Result<Purchase, PurchaseError>;

/// Parses every body of a batch.
pub fn parse_all<'a>(bodies: impl IntoIterator<Item = &'a [u8]>) -> Vec<Parsed> {
    bodies.into_iter().map(Purchase::parse).collect()
}

/// The distinct pools a batch needs to know about (every item's of a
/// bundle), in first-seen order.
pub fn pools_of(parsed: &[Parsed]) -> Vec<&str> {
    let mut seen = HashSet::new();
    parsed
        .iter()
        .filter_map(|p| p.as_ref().ok())
        .flat_map(|p| p.pools())
        .filter(|pool| seen.insert(*pool))
        .collect()
}

/// Turns purchases of pools that do not exist into `unknown_pool`
/// rejections. `known` answers for every pool of [`pools_of`].
pub fn admit(parsed: Vec<Parsed>, known: impl Fn(&str) -> bool) -> Vec<Admission> {
    parsed
        .into_iter()
        .map(|p| match p {
            // A bundle with one unknown pool is refused whole.
            Ok(p) => match p.pools().into_iter().find(|x| !known(x)) {
                None => Admission::Claim(p),
                Some(unknown) => Admission::Reject(PurchaseError::unknown_pool(unknown)),
            },
            Err(e) => Admission::Reject(e),
        })
        .collect()
}

/// The purchases to claim codes for, in order.
pub fn to_claim(intake: &[Admission]) -> Vec<&Purchase> {
    intake
        .iter()
        .filter_map(|i| match i {
            Admission::Claim(p) => Some(p),
            _ => None,
        })
        .collect()
}

/// What the database said about a batch's purchases in pools with a policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdicts {
    /// Orders that already hold a code: they get it again, whatever the
    /// policy says now (a redelivery must never lose its grant).
    pub holders: HashSet<String>,
    /// Orders over their buyer's limit (now or before), by order id.
    pub refused: HashMap<String, Refusal>,
    /// Pools that are paused.
    pub paused: HashSet<String>,
}

/// Applies the pool policies to the purchases to claim: an order that
/// holds a code is claimed (and finds it); a refused order is refused, even
/// in a paused pool (it would be refused on resume); a purchase of a paused
/// pool is held as a backorder.
pub fn apply_policies(intake: Vec<Admission>, verdicts: &Verdicts) -> Vec<Admission> {
    intake
        .into_iter()
        .map(|i| match i {
            Admission::Claim(p) if verdicts.holders.contains(&p.order_id) => Admission::Claim(p),
            Admission::Claim(p) => match verdicts.refused.get(&p.order_id) {
                Some(r) => Admission::Refuse(Box::new(Refusal {
                    purchase: p,
                    ..r.clone()
                })),
                // A bundle waits whole while any of its pools is paused.
                None if p.pools().iter().any(|x| verdicts.paused.contains(*x)) => {
                    Admission::Hold(p)
                }
                None => Admission::Claim(p),
            },
            other => other,
        })
        .collect()
}

/// What to do with one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The order holds `grants` (by line): publish their SMS-pending
    /// events (one per part; none for a revoked grant), ack once confirmed.
    /// `missing` lines got no code (stock ran short): they wait as a
    /// backorder, recorded durably before the ack.
    Grant {
        purchase: Box<Purchase>,
        grants: Vec<Grant>,
        /// How many of the grants this batch issued (not a redelivery or a
        /// duplicate).
        fresh: u32,
        missing: Vec<u32>,
    },
    /// The pool is empty or paused: record a backorder for `lines` durably,
    /// then ack.
    Backorder { purchase: Purchase, lines: Vec<u32> },
    /// Refused by a pool policy: publish `purchase.refused` (the refusal is
    /// already recorded); ack once confirmed.
    Refused(Box<Refusal>),
    /// Publish to the dead-letter queue with the reason; ack once confirmed.
    DeadLetter(PurchaseError),
    /// The order was voided (its backorder cancelled): it gets nothing
    /// again, whichever door it comes back through. Acked at once.
    Cancelled(Purchase),
}

/// The plan for a batch: one step per delivery, in delivery order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchPlan {
    pub steps: Vec<Step>,
    /// Pools that ran dry in this batch (`pool.exhausted` events).
    pub exhausted_pools: BTreeSet<String>,
    /// When the batch's claims began: a pool found short was short at
    /// some moment after this (codes that came in since may have ended
    /// the shortage).
    pub claims_began: Option<bson::DateTime>,
    /// Fresh grants (codes) per pool (their stock goes down).
    pub granted_pools: BTreeMap<String, u64>,
    /// Codes this batch issued.
    pub fresh_grants: u64,
    /// Deliveries of orders that already held their codes.
    pub repeats: u64,
    /// Purchases held as backorders because their pool is paused.
    pub held: u64,
    /// The record that owes this batch's events ([`crate::Resend::ByRecord`]),
    /// to take away once they are all confirmed; `None` when the batch
    /// may grant nothing, or its events are owed otherwise.
    pub owed: Option<bson::oid::ObjectId>,
}

impl BatchPlan {
    /// Counts the codes `committed` from paid holds as this batch's fresh
    /// grants: the order got them now, like a claim's.
    pub fn credit_committed(&mut self, committed: &HashSet<codepool_domain::CodeId>) {
        if committed.is_empty() {
            return;
        }
        for step in &mut self.steps {
            let Step::Grant { grants, fresh, .. } = step else {
                continue;
            };
            let n = grants
                .iter()
                .filter(|g| committed.contains(&g.code_id))
                .count() as u32;
            if n == 0 {
                continue;
            }
            if *fresh == 0 {
                self.repeats = self.repeats.saturating_sub(1);
            }
            *fresh += n;
            self.fresh_grants += u64::from(n);
            for g in grants.iter().filter(|g| committed.contains(&g.code_id)) {
                *self.granted_pools.entry(g.pool.clone()).or_default() += 1;
            }
        }
    }

    /// The purchases to record as backorders before anything is acked,
    /// with the lines each still needs, and their positions.
    pub fn backorders(&self) -> Vec<(usize, Waiting<'_>)> {
        self.steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Step::Backorder { purchase, lines } => Some((i, Waiting { purchase, lines })),
                Step::Grant {
                    purchase, missing, ..
                } if !missing.is_empty() => Some((
                    i,
                    Waiting {
                        purchase,
                        lines: missing,
                    },
                )),
                _ => None,
            })
            .collect()
    }

    /// The grants whose SMS-pending events to publish (the outbox groups
    /// them into events), with their delivery positions.
    pub fn sms_events(&self) -> Vec<(usize, &Grant)> {
        self.steps
            .iter()
            .enumerate()
            .flat_map(|(i, s)| match s {
                Step::Grant { grants, .. } => grants.iter().map(|g| (i, g)).collect(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// The `purchase.refused` events to publish, with their positions.
    pub fn refusals(&self) -> Vec<(usize, &Refusal)> {
        self.steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Step::Refused(r) => Some((i, &**r)),
                _ => None,
            })
            .collect()
    }

    /// The dead letters to publish, with their delivery positions.
    pub fn dead_letters(&self) -> Vec<(usize, &PurchaseError)> {
        self.steps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Step::DeadLetter(e) => Some((i, e)),
                _ => None,
            })
            .collect()
    }

    /// Turns the steps at `conflicts` (positions, with what differs) into
    /// `conflicting_order` dead letters: recording their backorder found
    /// another order under the same id.
    pub fn reject_conflicts(&mut self, conflicts: &[(usize, &'static str)]) {
        for &(i, what) in conflicts {
            let order_id = match &self.steps[i] {
                Step::Backorder { purchase, .. } => purchase.order_id.clone(),
                Step::Grant { purchase, .. } => purchase.order_id.clone(),
                _ => continue,
            };
            self.steps[i] = Step::DeadLetter(PurchaseError::conflicting_order(&order_id, what));
        }
    }
}

/// What a backorder says of its order: pool, buyer, quantity and owner.
pub type Backordered = (String, String, u32, Option<String>);

/// Turns purchases whose order id already has a backorder of a different
/// order (another pool, buyer or quantity) into `conflicting_order`
/// rejections, before anything is claimed for them: the first order
/// stands. `backordered` holds, by order id, the pool, buyer, quantity
/// and owner of the backorders of the batch's orders.
pub fn reject_conflicting(
    intake: Vec<Admission>,
    backordered: &HashMap<String, Backordered>,
) -> Vec<Admission> {
    intake
        .into_iter()
        .map(|i| match i {
            Admission::Claim(p) => match backordered.get(&p.order_id) {
                Some((pool, uid, q, owner)) => {
                    match p.conflicts_with(pool, uid, *q, owner.as_deref()) {
                        Some(what) => {
                            Admission::Reject(PurchaseError::conflicting_order(&p.order_id, what))
                        }
                        None => Admission::Claim(p),
                    }
                }
                None => Admission::Claim(p),
            },
            other => other,
        })
        .collect()
}

/// Turns purchases of orders whose backorder was cancelled (the order was
/// voided while it waited) into [`Admission::Cancelled`]: a void is final, so
/// the same order sent again is neither claimed nor backordered.
pub fn settle_cancelled(intake: Vec<Admission>, cancelled: &HashSet<String>) -> Vec<Admission> {
    if cancelled.is_empty() {
        return intake;
    }
    intake
        .into_iter()
        .map(|i| match i {
            Admission::Claim(p) if cancelled.contains(&p.order_id) => Admission::Cancelled(p),
            other => other,
        })
        .collect()
}

/// Decides every delivery's step. `outcomes` holds one claim outcome per
/// [`Admission::Claim`], in order.
pub fn plan_batch(
    intake: Vec<Admission>,
    outcomes: Vec<ClaimOutcome>,
) -> Result<BatchPlan, OutcomeMismatch> {
    let expected = intake
        .iter()
        .filter(|i| matches!(i, Admission::Claim(_)))
        .count();
    if expected != outcomes.len() {
        return Err(OutcomeMismatch {
            expected,
            got: outcomes.len(),
        });
    }
    let mut plan = BatchPlan::default();
    let mut outcomes = outcomes.into_iter();
    let mut granted_orders: HashSet<String> = HashSet::new();
    for item in intake {
        let step = match item {
            Admission::Reject(e) => Step::DeadLetter(e),
            Admission::Refuse(r) => Step::Refused(r),
            Admission::Cancelled(p) => Step::Cancelled(p),
            Admission::Hold(p) => {
                plan.held += 1;
                let lines = (0..p.quantity).collect();
                Step::Backorder { purchase: p, lines }
            }
            // Counted above: there is an outcome for every claim.
            Admission::Claim(p) => match outcomes.next() {
                Some(outcome) => plan.decide(p, outcome, &mut granted_orders),
                None => unreachable!("outcome count checked"),
            },
        };
        plan.steps.push(step);
    }
    Ok(plan)
}

impl BatchPlan {
    /// The step of one claimed purchase.
    fn decide(
        &mut self,
        p: Purchase,
        outcome: ClaimOutcome,
        granted: &mut HashSet<String>,
    ) -> Step {
        let (grants, fresh, missing) = match outcome {
            ClaimOutcome::Conflict { what } => {
                return Step::DeadLetter(PurchaseError::conflicting_order(&p.order_id, what))
            }
            ClaimOutcome::Claimed {
                grants,
                fresh,
                missing,
            } => (grants, fresh, missing),
        };
        // A bundle's short pools are added by its claim (bundles.rs).
        if !missing.is_empty() && !p.is_bundle() {
            self.exhausted_pools.insert(p.pool.clone());
        }
        if grants.is_empty() {
            return Step::Backorder {
                purchase: p,
                lines: missing,
            };
        }
        // A second delivery of the same order in this batch is a repeat.
        let fresh = if fresh > 0 && granted.insert(p.order_id.clone()) {
            fresh
        } else {
            0
        };
        if fresh > 0 && p.is_bundle() {
            self.fresh_grants += u64::from(fresh);
            for g in &grants {
                *self.granted_pools.entry(g.pool.clone()).or_default() += 1;
            }
        } else if fresh > 0 {
            self.fresh_grants += u64::from(fresh);
            *self.granted_pools.entry(p.pool.clone()).or_default() += u64::from(fresh);
        } else {
            self.repeats += 1;
        }
        Step::Grant {
            purchase: Box::new(p),
            grants,
            fresh,
            missing,
        }
    }
}

/// What finally happens to a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settlement {
    Ack,
    /// Back to the queue: a redelivery re-publishes the same grant's event.
    Requeue,
}

/// The ack decision, once backorders are durable and publishes have been
/// waited for (a refusal needs its event confirmed, like a grant): `unconfirmed` holds the positions whose publish the broker
/// did not confirm.
pub fn settle(plan: &BatchPlan, unconfirmed: &HashSet<usize>) -> Vec<Settlement> {
    plan.steps
        .iter()
        .enumerate()
        .map(|(i, step)| match step {
            Step::Grant { .. } | Step::DeadLetter(_) | Step::Refused(_)
                if unconfirmed.contains(&i) =>
            {
                Settlement::Requeue
            }
            _ => Settlement::Ack,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use codepool_domain::{CodeId, RefusalReason, RejectReason};
    use proptest::prelude::*;

    fn refusal(order: &str, pool: &str) -> Refusal {
        Refusal {
            purchase: purchase(order, pool),
            reason: RefusalReason::PerUserLimit,
            limit: Some(1),
            at: Utc::now(),
        }
    }

    fn refused(order: &str, pool: &str) -> Admission {
        Admission::Refuse(Box::new(refusal(order, pool)))
    }

    fn body(order: &str, pool: &str) -> Vec<u8> {
        format!(r#"{{"order_id":"{order}","uid":"u1","phone":"+8613800000000","pool":"{pool}"}}"#)
            .into_bytes()
    }

    fn purchase(order: &str, pool: &str) -> Purchase {
        Purchase::parse(&body(order, pool)).unwrap()
    }

    fn grant(order: &str, pool: &str, revoked: bool) -> Grant {
        Grant {
            code_id: CodeId::from_bytes([1; 12]),
            pool: pool.into(),
            code: "QWER-1234".into(),
            order_id: order.into(),
            uid: "u1".into(),
            phone: "+8613800000000".into(),
            grant_no: Some("G202611200001".into()),
            issued_at: Utc::now(),
            revoked,
            line: 0,
            quantity: 1,
            part: 0,
            owner: None,
            replacement: 0,
        }
    }

    fn granted(order: &str, pool: &str, fresh: bool) -> ClaimOutcome {
        ClaimOutcome::Claimed {
            grants: vec![grant(order, pool, false)],
            fresh: u32::from(fresh),
            missing: Vec::new(),
        }
    }

    fn revoked(order: &str, pool: &str) -> ClaimOutcome {
        ClaimOutcome::Claimed {
            grants: vec![grant(order, pool, true)],
            fresh: 0,
            missing: Vec::new(),
        }
    }

    fn exhausted() -> ClaimOutcome {
        ClaimOutcome::exhausted(vec![0])
    }

    /// The kind of a step, in a word.
    fn kind(step: &Step) -> &'static str {
        match step {
            Step::Grant { grants, .. } if grants.iter().all(|g| g.revoked) => "revoked",
            Step::Grant { .. } => "sms",
            Step::Backorder { .. } => "backorder",
            Step::DeadLetter(_) => "dead",
            Step::Refused(_) => "refused",
            Step::Cancelled(_) => "cancelled",
        }
    }

    #[test]
    fn an_order_whose_backorder_was_cancelled_is_settled_as_cancelled() {
        let intake = vec![
            Admission::Claim(purchase("O-1", "a")),
            Admission::Claim(purchase("O-2", "a")),
        ];
        let cancelled: HashSet<String> = ["O-1".to_owned()].into();
        let intake = settle_cancelled(intake, &cancelled);
        assert_eq!(to_claim(&intake).len(), 1);
        let plan = plan_batch(intake, vec![granted("O-2", "a", true)]).unwrap();
        assert_eq!(kind(&plan.steps[0]), "cancelled");
        assert_eq!(kind(&plan.steps[1]), "sms");
        assert!(plan.backorders().is_empty() && plan.sms_events().len() == 1);
        assert_eq!(settle(&plan, &HashSet::new()), vec![Settlement::Ack; 2]);
    }

    #[test]
    fn admit_parses_and_rejects_unknown_pools_and_garbage() {
        let bodies = [body("O-1", "game-x"), body("O-2", "nope"), b"{".to_vec()];
        let intake = admit(parse_all(bodies.iter().map(Vec::as_slice)), |p| {
            p == "game-x"
        });
        assert_eq!(to_claim(&intake).len(), 1);
        assert!(matches!(&intake[0], Admission::Claim(p) if p.order_id == "O-1"));
        assert!(
            matches!(&intake[1], Admission::Reject(e) if e.reason == RejectReason::UnknownPool)
        );
        assert!(matches!(&intake[2], Admission::Reject(e) if e.reason == RejectReason::NotJson));
    }

    #[test]
    fn pools_are_asked_about_once_each() {
        let bodies = [
            body("1", "a"),
            body("2", "b"),
            body("3", "a"),
            b"x".to_vec(),
        ];
        let parsed = parse_all(bodies.iter().map(Vec::as_slice));
        assert_eq!(pools_of(&parsed), vec!["a", "b"]);
    }

    /// (intake, outcome) → step kind, one row per branch.
    #[test]
    fn every_branch_of_the_plan() {
        let rows: Vec<(Admission, Option<ClaimOutcome>, &str)> = vec![
            (
                Admission::Claim(purchase("O-1", "x")),
                Some(granted("O-1", "x", true)),
                "sms",
            ),
            (
                Admission::Claim(purchase("O-2", "x")),
                Some(granted("O-2", "x", false)),
                "sms",
            ),
            (
                Admission::Claim(purchase("O-3", "x")),
                Some(revoked("O-3", "x")),
                "revoked",
            ),
            (
                Admission::Claim(purchase("O-4", "y")),
                Some(exhausted()),
                "backorder",
            ),
            (
                Admission::Reject(PurchaseError::unknown_pool("z")),
                None,
                "dead",
            ),
            (refused("O-5", "x"), None, "refused"),
            (Admission::Hold(purchase("O-6", "p")), None, "backorder"),
        ];
        for (intake, outcome, want) in rows {
            let plan = plan_batch(vec![intake], outcome.into_iter().collect()).unwrap();
            assert_eq!(kind(&plan.steps[0]), want);
        }
    }

    #[test]
    fn counts_fresh_grants_repeats_and_pools() {
        let intake = vec![
            Admission::Claim(purchase("O-1", "x")),
            Admission::Claim(purchase("O-1", "x")),
            Admission::Claim(purchase("O-2", "x")),
            Admission::Claim(purchase("O-3", "y")),
        ];
        let outcomes = vec![
            granted("O-1", "x", true),
            granted("O-1", "x", true),
            granted("O-2", "x", false),
            exhausted(),
        ];
        let plan = plan_batch(intake, outcomes).unwrap();
        assert_eq!(
            plan.fresh_grants, 1,
            "a duplicate in the batch is not a second grant"
        );
        assert_eq!(plan.repeats, 2);
        assert_eq!(plan.granted_pools, BTreeMap::from([("x".to_owned(), 1)])); // one fresh grant in x
        assert_eq!(plan.exhausted_pools, BTreeSet::from(["y".to_owned()]));
        assert_eq!(plan.backorders().len(), 1);
        assert_eq!(
            plan.sms_events().len(),
            3,
            "repeats get the same event again"
        );
    }

    #[test]
    fn a_wrong_number_of_outcomes_is_an_error_not_a_guess() {
        let intake = vec![Admission::Claim(purchase("O-1", "x"))];
        assert_eq!(
            plan_batch(intake, vec![]),
            Err(OutcomeMismatch {
                expected: 1,
                got: 0
            })
        );
    }

    #[test]
    fn unconfirmed_publishes_are_requeued_and_the_rest_acked() {
        let intake = vec![
            Admission::Claim(purchase("O-1", "x")),
            Admission::Reject(PurchaseError::unknown_pool("z")),
            Admission::Claim(purchase("O-2", "y")),
            Admission::Claim(purchase("O-3", "x")),
        ];
        let outcomes = vec![
            granted("O-1", "x", true),
            exhausted(),
            granted("O-3", "x", true),
        ];
        let plan = plan_batch(intake, outcomes).unwrap();
        let all_ok = settle(&plan, &HashSet::new());
        assert!(all_ok.iter().all(|s| *s == Settlement::Ack));
        let failed = settle(&plan, &HashSet::from([0, 1, 2]));
        assert_eq!(
            failed,
            vec![
                Settlement::Requeue,
                Settlement::Requeue,
                Settlement::Ack,
                Settlement::Ack
            ],
            "a backorder is settled by its durable record, not by a publish"
        );
    }

    #[test]
    fn a_refusal_is_acked_only_once_its_event_is_confirmed() {
        let plan = plan_batch(vec![refused("O-1", "x")], vec![]).unwrap();
        assert_eq!(plan.refusals().len(), 1);
        assert!(plan.backorders().is_empty() && plan.sms_events().is_empty());
        assert_eq!(settle(&plan, &HashSet::new()), vec![Settlement::Ack]);
        assert_eq!(
            settle(&plan, &HashSet::from([0])),
            vec![Settlement::Requeue]
        );
        let event = plan.refusals()[0].1.event();
        assert_eq!(event.reason, RefusalReason::PerUserLimit);
        assert_eq!(event.event_id, "refused:O-1");
    }

    #[test]
    fn a_paused_pool_holds_purchases_without_claiming_and_is_not_exhausted() {
        let plan = plan_batch(vec![Admission::Hold(purchase("O-1", "p"))], vec![]).unwrap();
        assert_eq!(plan.backorders().len(), 1);
        assert_eq!(plan.held, 1);
        assert!(plan.exhausted_pools.is_empty(), "a pause is not a shortage");
    }

    #[test]
    fn an_order_holding_a_code_is_claimed_whatever_the_policy() {
        let verdicts = Verdicts {
            holders: HashSet::from(["O-1".to_owned()]),
            refused: HashMap::from([("O-1".to_owned(), refusal("O-1", "p"))]),
            paused: HashSet::from(["p".to_owned()]),
        };
        let out = apply_policies(vec![Admission::Claim(purchase("O-1", "p"))], &verdicts);
        assert!(matches!(&out[0], Admission::Claim(_)));
    }

    #[test]
    fn a_revoked_grant_is_acked_without_any_event() {
        let plan = plan_batch(
            vec![Admission::Claim(purchase("O-1", "x"))],
            vec![revoked("O-1", "x")],
        )
        .unwrap();
        assert!(
            plan.sms_events().iter().all(|(_, g)| g.revoked),
            "the outbox sends nothing for it"
        );
        assert!(plan.backorders().is_empty());
    }

    /// A random batch: per delivery, 0 invalid, 1 unknown pool, 2 exhausted,
    /// 3 granted fresh, 4 granted before, 5 revoked, 6 refused by a policy,
    /// 7 held (paused pool); orders drawn from a small set so duplicates
    /// happen.
    fn batch() -> impl Strategy<Value = Vec<(u8, u8)>> {
        proptest::collection::vec((0u8..8, 0u8..5), 0..40)
    }

    fn build(rows: &[(u8, u8)]) -> (Vec<Admission>, Vec<ClaimOutcome>) {
        let mut intake = Vec::new();
        let mut outcomes = Vec::new();
        for (kind, order) in rows {
            let order = format!("O-{order}");
            match kind {
                0 => intake.push(Admission::Reject(PurchaseError::unknown_pool("bad"))),
                1 => intake.push(Admission::Reject(PurchaseError::unknown_pool("gone"))),
                6 => intake.push(refused(&order, "x")),
                7 => intake.push(Admission::Hold(purchase(&order, "x"))),
                k => {
                    intake.push(Admission::Claim(purchase(&order, "x")));
                    outcomes.push(match k {
                        2 => exhausted(),
                        3 => granted(&order, "x", true),
                        4 => granted(&order, "x", false),
                        _ => revoked(&order, "x"),
                    });
                }
            }
        }
        (intake, outcomes)
    }

    proptest! {
        #[test]
        fn every_delivery_gets_exactly_one_step(rows in batch()) {
            let (intake, outcomes) = build(&rows);
            let plan = plan_batch(intake, outcomes).unwrap();
            prop_assert_eq!(plan.steps.len(), rows.len());
            let kinds: Vec<&str> = plan.steps.iter().map(kind).collect();
            let published = kinds.iter().filter(|k| **k == "sms").count() + plan.dead_letters().len() + plan.refusals().len();
            let silent = kinds.iter().filter(|k| matches!(**k, "revoked" | "backorder")).count();
            prop_assert_eq!(published + silent, rows.len());
        }

        #[test]
        fn nothing_unconfirmed_is_ever_acked(rows in batch(), fail in proptest::collection::hash_set(0usize..40, 0..40)) {
            let (intake, outcomes) = build(&rows);
            let plan = plan_batch(intake, outcomes).unwrap();
            let settled = settle(&plan, &fail);
            for (i, step) in plan.steps.iter().enumerate() {
                let needs_confirm = matches!(step, Step::Grant { .. } | Step::DeadLetter(_) | Step::Refused(_));
                if needs_confirm && fail.contains(&i) {
                    prop_assert_eq!(settled[i], Settlement::Requeue);
                } else {
                    prop_assert_eq!(settled[i], Settlement::Ack);
                }
            }
        }

        #[test]
        fn an_order_counts_as_fresh_at_most_once(rows in batch()) {
            let (intake, outcomes) = build(&rows);
            let plan = plan_batch(intake, outcomes).unwrap();
            let mut fresh_orders = HashSet::new();
            for step in &plan.steps {
                if let Step::Grant { purchase, fresh, .. } = step {
                    if *fresh > 0 {
                        prop_assert!(fresh_orders.insert(purchase.order_id.clone()));
                    }
                }
            }
            prop_assert_eq!(fresh_orders.len() as u64, plan.fresh_grants);
        }

        #[test]
        fn exactly_the_exhausted_and_held_purchases_are_backordered(rows in batch()) {
            let (intake, outcomes) = build(&rows);
            let exhausted = outcomes.iter().filter(|o| o.is_exhausted()).count();
            let held = rows.iter().filter(|(k, _)| *k == 7).count();
            let plan = plan_batch(intake, outcomes).unwrap();
            prop_assert_eq!(plan.backorders().len(), exhausted + held);
            prop_assert_eq!(plan.held as usize, held);
        }

        #[test]
        fn a_refused_purchase_never_gets_a_code_or_a_backorder(rows in batch()) {
            let (intake, outcomes) = build(&rows);
            let plan = plan_batch(intake, outcomes).unwrap();
            for ((kind, _), step) in rows.iter().zip(&plan.steps) {
                prop_assert_eq!(*kind == 6, matches!(step, Step::Refused(_)));
            }
        }

        #[test]
        fn policies_only_ever_narrow_what_is_claimed(
            rows in proptest::collection::vec((0u8..5, 0u8..3), 0..30),
            refused_orders in proptest::collection::hash_set(0u8..5, 0..5),
            holder_orders in proptest::collection::hash_set(0u8..5, 0..5),
            paused in any::<bool>(),
        ) {
            let intake: Vec<Admission> = rows.iter().map(|(o, pool)| Admission::Claim(purchase(&format!("O-{o}"), &format!("p{pool}")))).collect();
            let verdicts = Verdicts {
                holders: holder_orders.iter().map(|o| format!("O-{o}")).collect(),
                refused: refused_orders.iter().map(|o| (format!("O-{o}"), refusal(&format!("O-{o}"), "p0"))).collect(),
                paused: if paused { HashSet::from(["p1".to_owned()]) } else { HashSet::new() },
            };
            let out = apply_policies(intake, &verdicts);
            prop_assert_eq!(out.len(), rows.len());
            for ((o, pool), i) in rows.iter().zip(&out) {
                let order = format!("O-{o}");
                let want = if holder_orders.contains(o) {
                    "claim"
                } else if refused_orders.contains(o) {
                    "refuse"
                } else if paused && *pool == 1 {
                    "hold"
                } else {
                    "claim"
                };
                let got = match i {
                    Admission::Claim(p) => { prop_assert_eq!(&p.order_id, &order); "claim" }
                    Admission::Refuse(r) => { prop_assert_eq!(&r.purchase.order_id, &order); "refuse" }
                    Admission::Hold(_) => "hold",
                    Admission::Reject(_) => "reject",
                    Admission::Cancelled(_) => "cancelled",
                };
                prop_assert_eq!(got, want);
            }
        }
    }
}
