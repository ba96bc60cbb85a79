//! Redemption by code as a door offers it to the platform's keys: the
//! [`Finder`] that checks and redeems codes by value, behind each key's
//! budget of codes named that matched nothing ([`Misses`]). Guessing codes
//! must cost a key time, whichever door it comes by: the rule is the
//! core's, the door only answers [`RedeemError::Slowed`] with its own
//! status (429 and `Retry-After` over HTTP).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::api_keys::KeyDoc;
use crate::audit::Actor;
use crate::redeem::{Finder, Platform, RedeemError, Seen};
use crate::Core;

/// Longest a lookup waits for its turn before it is refused
/// ([`RedeemError::Slowed`]).
pub const TURN_WAIT: Duration = Duration::from_secs(5);

/// Checks and redemptions by code for API keys, each key held to its
/// budget of misses.
pub struct ByCode {
    finder: Finder,
    misses: Misses,
}

impl ByCode {
    /// Finds codes in `core`'s store; each key may name `misses_per_minute`
    /// codes that match nothing a minute (all of them at once, refilled
    /// evenly).
    pub fn new(core: &Core, misses_per_minute: u32) -> Self {
        ByCode {
            finder: Finder::new(core.store().clone()),
            misses: Misses::new(misses_per_minute),
        }
    }

    /// What became of the code `code` names, as `key` may see it; changes
    /// nothing ([`Finder::check`]).
    pub async fn check(&self, key: &KeyDoc, code: &str) -> Result<Seen, RedeemError> {
        let turn = self.misses.reserve(&key.id).await?;
        let owner = key.owner();
        let who = Platform {
            owner: &owner,
            shop: key.shop.as_deref(),
        };
        let found = self.finder.check(who, code).await;
        turn.settle(key, &found);
        found
    }

    /// Redeems the code `code` names, once, for `key` ([`Finder::redeem`]);
    /// the code as it is now.
    pub async fn redeem(
        &self,
        key: &KeyDoc,
        code: &str,
        redemption_id: &str,
        actor: &Actor,
    ) -> Result<Seen, RedeemError> {
        let turn = self.misses.reserve(&key.id).await?;
        let owner = key.owner();
        let who = Platform {
            owner: &owner,
            shop: key.shop.as_deref(),
        };
        let found =
            (self.finder.redeem(who, code, redemption_id, actor).await).map(|(seen, _)| seen);
        turn.settle(key, &found);
        found
    }
}

/// Each key's budget of codes named that matched nothing: `per_minute`,
/// all of it at once, refilled evenly. A lookup reserves one miss of the
/// budget BEFORE it runs and gives it back when it found the code, so
/// however many requests a key sends at once, no more lookups than the
/// budget can still miss are in flight: the others wait their turn. A key
/// whose budget is spent by misses is slowed: every code it names is
/// refused ([`RedeemError::Slowed`]) until the budget holds one again.
/// Guessing codes costs a key time, not just requests; an honest
/// platform's lookups only queue.
struct Misses {
    per_minute: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// Woken when a reservation ends.
    freed: tokio::sync::Notify,
}

struct Bucket {
    /// Misses left (reserved ones included).
    left: f64,
    /// Lookups in flight, each holding one of `left`.
    reserved: u32,
    at: Instant,
}

/// Whether a lookup may start now.
enum Turn {
    Go,
    /// Every miss left is held by a lookup in flight: wait for one.
    Wait,
    /// The budget is spent: the seconds until it holds a miss again.
    Spent(u64),
}

/// A miss reserved for one lookup: given back when dropped, unless the
/// lookup found nothing ([`Reserved::settle`]).
struct Reserved<'a> {
    misses: &'a Misses,
    key: String,
    missed: bool,
}

impl Reserved<'_> {
    /// The lookup is done: one that found no code keeps the miss it
    /// reserved, and is counted; any other gives it back.
    fn settle<T>(mut self, key: &KeyDoc, found: &Result<T, RedeemError>) {
        if matches!(found, Err(RedeemError::Unknown)) {
            metrics::counter!("codepool_redeem_misses_total", "key" => key.name.clone())
                .increment(1);
            self.missed = true;
        }
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.misses.release(&self.key, self.missed);
    }
}

impl Misses {
    fn new(per_minute: u32) -> Self {
        Misses {
            per_minute: f64::from(per_minute.max(1)),
            buckets: Default::default(),
            freed: tokio::sync::Notify::new(),
        }
    }

    fn turn(&self, key: &str) -> Turn {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let b = buckets.entry(key.to_owned()).or_insert(Bucket {
            left: self.per_minute,
            reserved: 0,
            at: now,
        });
        let refill = now.duration_since(b.at).as_secs_f64() * self.per_minute / 60.0;
        b.left = (b.left + refill).min(self.per_minute);
        b.at = now;
        if b.left - f64::from(b.reserved) >= 1.0 {
            b.reserved += 1;
            return Turn::Go;
        }
        if b.left >= 1.0 {
            return Turn::Wait;
        }
        let wait = (1.0 - b.left) * 60.0 / self.per_minute;
        Turn::Spent(wait.ceil().max(1.0) as u64)
    }

    /// Reserves one miss of `key`'s budget for a lookup about to run,
    /// waiting while the misses left are all held by lookups in flight;
    /// refused with the seconds to wait when the budget is spent.
    async fn reserve(&self, key: &str) -> Result<Reserved<'_>, RedeemError> {
        let deadline = tokio::time::Instant::now() + TURN_WAIT;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.turn(key) {
                Turn::Go => {
                    return Ok(Reserved {
                        misses: self,
                        key: key.to_owned(),
                        missed: false,
                    })
                }
                Turn::Spent(wait) => return Err(RedeemError::Slowed { wait }),
                Turn::Wait => {
                    if tokio::time::timeout_at(deadline, freed).await.is_err() {
                        let wait = TURN_WAIT.as_secs();
                        return Err(RedeemError::Slowed { wait });
                    }
                }
            }
        }
    }

    fn release(&self, key: &str, missed: bool) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(key) {
            b.reserved = b.reserved.saturating_sub(1);
            if missed {
                b.left = (b.left - 1.0).max(0.0);
            }
        }
        drop(buckets);
        self.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_key_is_slowed_once_its_misses_are_spent_and_others_are_not() {
        let misses = Misses::new(2);
        for _ in 0..2 {
            let turn = misses.reserve("a").await.expect("a miss is left");
            let mut turn = turn;
            turn.missed = true;
        }
        match misses.reserve("a").await {
            Err(RedeemError::Slowed { wait }) => assert!(wait >= 1, "{wait}"),
            other => panic!("expected slowed, got {:?}", other.map(|_| ())),
        }
        // A lookup that found its code gives its miss back.
        let b = misses.reserve("b").await.expect("b's own budget");
        drop(b);
        for _ in 0..2 {
            misses.reserve("b").await.expect("found codes cost nothing");
        }
    }
}
