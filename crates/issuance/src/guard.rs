//! The one guard of every path that gives a code.
//!
//! Whatever path hands a buyer a code (a claim from stock, a backorder's
//! fulfilment, a checkout hold, a hold's commit, a bundle, a reissue),
//! who may get one is decided here, from one read of the pools' policies,
//! by the gate's rules ([`gate::admit`]):
//!
//! - [`Guard::stopped`]: a pause stops every move that gives a code;
//! - [`Guard::take_slots`]: the per-user limit, holds counted, for the
//!   moves that take a slot (a reissue takes none: its order holds one);
//! - [`Guard::may_pay`]: a shop's hold is paid only by that shop, a key's
//!   by that key (or the operator);
//! - expiry and recall are the code's own guards, checked by the one
//!   writer of a code's status in the same conditional write that moves it
//!   ([`codepool_store::moves`]): no read can race them.
//!
//! A path calls these and acts on the verdict its own way (an order waits,
//! a hold is refused, a payment releases the hold); none keeps its own
//! copy of a rule.

use std::collections::{HashMap, HashSet};

use codepool_domain::gate::{self, Move, Refused};
use codepool_domain::{Item, PoolPolicy, Purchase};
use codepool_store::policies::QuotaAsk;
use codepool_store::{Store, StoreError};

/// What [`Guard::take_slots`] did: the slots asked, and the orders that
/// may take their codes.
#[derive(Debug)]
pub struct Slots<'a> {
    pub asks: Vec<QuotaAsk<'a>>,
    pub allowed: HashSet<&'a str>,
}

/// The pools' policies, read once for a batch, and the rules over them.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    policies: HashMap<String, PoolPolicy>,
}

impl Guard {
    /// The guard of a batch, over the policies it read.
    pub fn new(policies: HashMap<String, PoolPolicy>) -> Self {
        Self { policies }
    }

    /// The guard of one pool, read now (a missing pool has no policy).
    pub async fn of_pool(store: &Store, pool: &str) -> Result<Self, StoreError> {
        let mut policies = HashMap::new();
        if let Some(doc) = store.pool(pool).await? {
            policies.insert(pool.to_owned(), doc.policy());
        }
        Ok(Self { policies })
    }

    /// The policy of `pool` (none set: the default, which guards nothing).
    pub fn policy(&self, pool: &str) -> PoolPolicy {
        self.policies.get(pool).copied().unwrap_or_default()
    }

    /// The policies read.
    pub fn policies(&self) -> &HashMap<String, PoolPolicy> {
        &self.policies
    }

    /// The first of `pools` from which `mv` may not give a code now (its
    /// pool is paused), as the gate's refusal; `None` when every pool
    /// lets it.
    pub fn stopped<'p>(
        &self,
        mv: Move,
        pools: impl IntoIterator<Item = &'p str>,
    ) -> Option<Refused> {
        pools.into_iter().find_map(|pool| {
            let ask = gate::Ask {
                pool,
                policy: self.policy(pool),
                slot: None,
            };
            gate::admit(mv, &ask).err()
        })
    }

    /// The pools of this guard that stop `mv`.
    pub fn stopping(&self, mv: Move) -> HashSet<String> {
        (self.policies.keys())
            .filter(|p| self.stopped(mv, [p.as_str()]).is_some())
            .cloned()
            .collect()
    }

    /// Takes the per-user slots `mv` needs for each order and the items it
    /// takes (one slot per item of a pool with a limit; holds and both
    /// doors count against one limit). The orders that may take their
    /// codes: an order of no limited pool, or a move that takes no slot,
    /// passes.
    pub async fn take_slots<'a>(
        &self,
        store: &Store,
        mv: Move,
        items: &'a [(&'a Purchase, Vec<Item>)],
    ) -> Result<Slots<'a>, StoreError> {
        let asks = if mv.takes_slot() {
            self.quota_asks(items)
        } else {
            Vec::new()
        };
        let taken = if asks.is_empty() {
            HashSet::new()
        } else {
            store.take_quota_slots(&asks).await?
        };
        let allowed = (items.iter())
            .map(|(p, _)| p.order_id.as_str())
            .filter(|o| !asks.iter().any(|a| a.order_id == *o) || taken.contains(*o))
            .collect();
        Ok(Slots { asks, allowed })
    }

    /// The per-user slots `items` (each order with the items it takes) ask,
    /// one per item of a pool with a per-user limit: a claim from stock and
    /// the commit of a paid hold take them alike.
    fn quota_asks<'a>(&self, items: &'a [(&'a Purchase, Vec<Item>)]) -> Vec<QuotaAsk<'a>> {
        (items.iter())
            .flat_map(|(p, items)| {
                (items.iter())
                    .filter(|i| self.policy(&i.pool).limits_users())
                    .map(|i| QuotaAsk {
                        pool: &i.pool,
                        uid: &p.uid,
                        order_id: &p.order_id,
                        codes: i.quantity,
                        limit: self.policy(&i.pool).per_user,
                    })
            })
            .collect()
    }

    /// The per-user limit for holds: for each hold asked (its buyer and
    /// items, in order), the first pool whose limit the buyer's codes
    /// would pass once the hold is paid, as the gate's refusal, or `None`.
    /// Counted are the codes the buyer took already (orders, paid holds),
    /// the codes it holds in open holds (`open`: codes by `(pool, buyer
    /// key)`) and the holds asked before it. A hold whose payment would be
    /// refused is refused itself: the buyer learns it before paying.
    pub async fn hold_room(
        &self,
        store: &Store,
        asks: &[(&str, &[Item])],
        open: &HashMap<(String, String), u64>,
    ) -> Result<Vec<Option<Refused>>, StoreError> {
        let limited: Vec<(&str, &str)> = (asks.iter())
            .flat_map(|(uid, items)| items.iter().map(move |i| (i.pool.as_str(), *uid)))
            .filter(|(pool, _)| self.policy(pool).limits_users())
            .collect();
        if limited.is_empty() {
            return Ok(vec![None; asks.len()]);
        }
        let mut counted = store.quota_taken(&limited).await?;
        for (key, n) in open {
            *counted.entry(key.clone()).or_default() += n;
        }
        let mut out = Vec::with_capacity(asks.len());
        for (uid, items) in asks {
            let buyer = codepool_domain::buyer_key(uid);
            let over = items.iter().find_map(|i| {
                let ask = gate::Ask {
                    pool: &i.pool,
                    policy: self.policy(&i.pool),
                    slot: None,
                };
                let had = (counted.get(&(i.pool.clone(), buyer.clone()))).copied();
                let fits =
                    had.unwrap_or(0) + u64::from(i.quantity) <= u64::from(ask.policy.per_user);
                let ask = gate::Ask {
                    slot: Some(fits),
                    ..ask
                };
                gate::admit(Move::Hold, &ask).err()
            });
            if over.is_none() {
                for i in items.iter() {
                    *counted.entry((i.pool.clone(), buyer.clone())).or_default() +=
                        u64::from(i.quantity);
                }
            }
            out.push(over);
        }
        Ok(out)
    }

    /// Whether `payer` may pay (or act on) what `owner` holds.
    pub fn may_pay(owner: Option<&str>, payer: Option<&str>) -> bool {
        gate::may_pay(owner, payer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(paused: bool, per_user: u32) -> Guard {
        Guard::new(HashMap::from([(
            "p".to_owned(),
            PoolPolicy { per_user, paused },
        )]))
    }

    #[test]
    fn a_pause_stops_every_path_that_gives_a_code() {
        let g = guard(true, 0);
        for mv in Move::ALL {
            assert_eq!(g.stopped(mv, ["p"]).is_some(), mv.gives(), "{mv:?}");
        }
        assert_eq!(g.stopping(Move::Claim), HashSet::from(["p".to_owned()]));
        assert!(guard(false, 0).stopped(Move::Claim, ["p"]).is_none());
        // A pool with no policy stops nothing.
        assert!(g.stopped(Move::Claim, ["other"]).is_none());
    }

    /// Every path that gives a code asks this guard: no other module of
    /// the core calls the gate's admission or takes per-user slots itself.
    #[test]
    fn no_path_keeps_its_own_copy_of_the_rules() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src];
        let mut copies = Vec::new();
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") || path.ends_with("guard.rs") {
                    continue;
                }
                // What a channel declares to its marketplace gives no
                // code: a paused channel declares 0 (its own pause, not a
                // pool's); its reservations still go through the guard.
                if path.ends_with("channels/stock.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                for rule in [
                    "gate::admit(",
                    ".take_quota_slots(",
                    "policy.paused",
                    ".paused {",
                ] {
                    if text.contains(rule) {
                        copies.push(format!("{}: {rule}", path.display()));
                    }
                }
            }
        }
        assert!(
            copies.is_empty(),
            "a path decides who may get a code itself; ask crate::guard::Guard instead:\n{}",
            copies.join("\n")
        );
    }
}
