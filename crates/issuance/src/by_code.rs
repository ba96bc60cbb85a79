//! Redemption by code as a door offers it to the platform's keys: the
//! [`Finder`] that checks and redeems codes by value, behind a budget of
//! codes named that matched nothing ([`Misses`]). Guessing codes must cost
//! the guesser time, whichever door it comes by: the rule is the core's,
//! the door only answers [`RedeemError::Slowed`] with its own status (429
//! and `Retry-After` over HTTP).
//!
//! The budget is kept per key AND per end user, when the platform names
//! the end user it asks for (its client's account or address): a
//! stranger typing wrong codes at the platform's activation page spends
//! his own budget, never the one of the buyer behind him. Every end user
//! of a key together may miss at most [`KEY_CEILING`] times one end
//! user's budget, so end user names made up by the thousand buy no more
//! guesses than that. A spent budget slows lookups, it does not refuse
//! them at once: a lookup waits (up to [`TURN_WAIT`]) for the budget to
//! hold one miss again, and a code that exists gives that miss back.

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

/// How many end users' budgets a key's end users share at most, together.
pub const KEY_CEILING: u32 = 10;

/// Longest end user name a platform may pass, in characters.
pub const MAX_END_USER_CHARS: usize = 128;

/// How many budgets [`Misses`] keeps before it forgets those full again.
const MOST_BUCKETS: usize = 100_000;

/// Checks and redemptions by code for API keys, each key held to its
/// budget of misses.
pub struct ByCode {
    finder: Finder,
    /// Per key, or per key and end user.
    misses: Misses,
    /// Per key, for lookups that name an end user: every end user of a key
    /// together.
    ceiling: Misses,
}

/// Whose budget a lookup spends: its key's, or its key's end user's (and
/// then the key's ceiling too).
struct Spender<'a> {
    key: &'a KeyDoc,
    end_user: Option<&'a str>,
}

impl ByCode {
    /// Finds codes in `core`'s store; each key may name `misses_per_minute`
    /// codes that match nothing a minute (all of them at once, refilled
    /// evenly).
    pub fn new(core: &Core, misses_per_minute: u32) -> Self {
        let per_minute = misses_per_minute.max(1);
        ByCode {
            finder: Finder::new(core.store().clone()),
            misses: Misses::new(per_minute),
            ceiling: Misses::new(per_minute.saturating_mul(KEY_CEILING)),
        }
    }

    /// Reserves a miss of the budgets `who` spends: the key's, or the end
    /// user's and the key's ceiling.
    async fn reserve(&self, who: &Spender<'_>) -> Result<Vec<Reserved<'_>>, RedeemError> {
        let deadline = tokio::time::Instant::now() + TURN_WAIT;
        Ok(match who.end_user {
            None => vec![self.misses.reserve(&who.key.id, deadline).await?],
            Some(user) => {
                let mine = format!("{}\u{1f}{user}", who.key.id);
                let first = self.misses.reserve(&mine, deadline).await?;
                vec![first, self.ceiling.reserve(&who.key.id, deadline).await?]
            }
        })
    }

    /// What became of the code `code` names, as `key` may see it; changes
    /// nothing ([`Finder::check`]). `end_user` is whom the platform asks
    /// for, if it says ([`end_user`]): that end user's misses are his own.
    pub async fn check(
        &self,
        key: &KeyDoc,
        end_user: Option<&str>,
        code: &str,
    ) -> Result<Seen, RedeemError> {
        let turns = self.reserve(&Spender { key, end_user }).await?;
        let owner = key.owner();
        let who = Platform {
            owner: &owner,
            shop: key.shop.as_deref(),
        };
        let found = self.finder.check(who, code).await;
        settle(turns, key, &found);
        found
    }

    /// Redeems the code `code` names, once, for `key` ([`Finder::redeem`]);
    /// the code as it is now. `end_user` as for [`ByCode::check`].
    pub async fn redeem(
        &self,
        key: &KeyDoc,
        end_user: Option<&str>,
        code: &str,
        redemption_id: &str,
        actor: &Actor,
    ) -> Result<Seen, RedeemError> {
        let turns = self.reserve(&Spender { key, end_user }).await?;
        let owner = key.owner();
        let who = Platform {
            owner: &owner,
            shop: key.shop.as_deref(),
        };
        let found =
            (self.finder.redeem(who, code, redemption_id, actor).await).map(|(seen, _)| seen);
        settle(turns, key, &found);
        found
    }
}

/// An end user's name as a platform passes it, trimmed and compared as
/// NFC; `None` when empty, too long or unreadable.
pub fn end_user(name: &str) -> Option<String> {
    codepool_domain::text::client_id(name, MAX_END_USER_CHARS)
}

/// The lookup is done: each budget it reserved a miss of keeps it if the
/// lookup found no code, and the miss is counted once.
fn settle<T>(turns: Vec<Reserved<'_>>, key: &KeyDoc, found: &Result<T, RedeemError>) {
    let missed = matches!(found, Err(RedeemError::Unknown));
    if missed {
        metrics::counter!("codepool_redeem_misses_total", "key" => key.name.clone()).increment(1);
    }
    for t in turns {
        t.end(missed);
    }
}

/// Budgets of codes named that matched nothing, one per name (a key, or a
/// key and an end user): `per_minute`, all of it at once, refilled evenly.
/// A lookup reserves one miss of the budget BEFORE it runs and gives it
/// back when it found the code, so however many requests are sent at once,
/// no more lookups than the budget can still miss are in flight: the
/// others wait their turn. A spent budget slows: a lookup waits for the
/// budget to hold a miss again, and is refused ([`RedeemError::Slowed`])
/// only when that is further off than its deadline. Guessing codes costs
/// time, not just requests; an honest platform's lookups only queue, and
/// a code that exists gives its miss back at once.
struct Misses {
    per_minute: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// Woken when a reservation ends.
    freed: tokio::sync::Notify,
}

struct Bucket {
    /// A lookup waits for this spent budget to refill: the others are
    /// refused at once, so a spent budget never holds a crowd of requests.
    refilling: bool,
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
    /// reserved; any other gives it back.
    fn end(mut self, missed: bool) {
        self.missed = missed;
    }
}

/// The one lookup waiting for a spent budget to refill.
struct Refilling<'a> {
    misses: &'a Misses,
    key: String,
}

impl Drop for Refilling<'_> {
    fn drop(&mut self) {
        let mut buckets = (self.misses.buckets.lock()).unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(&self.key) {
            b.refilling = false;
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
            refilling: false,
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
    /// waiting while the misses left are all held by lookups in flight, or
    /// while the budget is spent and refills before `deadline`; refused
    /// with the seconds to wait when it does not.
    async fn reserve(
        &self,
        key: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Reserved<'_>, RedeemError> {
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
                Turn::Spent(wait) => {
                    let refilled = tokio::time::Instant::now() + self.refill_time();
                    if refilled > deadline {
                        return Err(RedeemError::Slowed { wait });
                    }
                    // One lookup waits for the refill; any other is
                    // refused at once.
                    let Some(waiting) = self.refilling(key) else {
                        return Err(RedeemError::Slowed { wait });
                    };
                    let woken = tokio::time::timeout_at(refilled, freed).await;
                    drop((waiting, woken));
                }
                // Woken by a lookup that ends.
                Turn::Wait => {
                    if tokio::time::timeout_at(deadline, freed).await.is_err() {
                        let wait = TURN_WAIT.as_secs();
                        return Err(RedeemError::Slowed { wait });
                    }
                }
            }
        }
    }

    /// Marks `key`'s spent budget as waited for by one lookup, until the
    /// mark is dropped; `None` when another lookup waits already.
    fn refilling(&self, key: &str) -> Option<Refilling<'_>> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let b = buckets.get_mut(key)?;
        if b.refilling {
            return None;
        }
        b.refilling = true;
        Some(Refilling {
            misses: self,
            key: key.to_owned(),
        })
    }

    /// How long a spent budget takes to hold one miss again, at most.
    fn refill_time(&self) -> Duration {
        Duration::from_secs_f64(60.0 / self.per_minute)
    }

    fn release(&self, key: &str, missed: bool) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(key) {
            b.reserved = b.reserved.saturating_sub(1);
            if missed {
                b.left = (b.left - 1.0).max(0.0);
            }
        }
        if buckets.len() > MOST_BUCKETS {
            // Forget the budgets that are full again: they hold nothing a
            // new one would not.
            let now = Instant::now();
            let per_minute = self.per_minute;
            buckets.retain(|_, b| {
                let refill = now.duration_since(b.at).as_secs_f64() * per_minute / 60.0;
                b.reserved > 0 || b.refilling || b.left + refill < per_minute
            });
        }
        drop(buckets);
        self.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> tokio::time::Instant {
        tokio::time::Instant::now() + TURN_WAIT
    }

    #[tokio::test]
    async fn a_key_is_slowed_once_its_misses_are_spent_and_others_are_not() {
        let misses = Misses::new(2);
        for _ in 0..2 {
            let turn = misses.reserve("a", soon()).await.expect("a miss is left");
            let mut turn = turn;
            turn.missed = true;
        }
        match misses.reserve("a", soon()).await {
            Err(RedeemError::Slowed { wait }) => assert!(wait >= 1, "{wait}"),
            other => panic!("expected slowed, got {:?}", other.map(|_| ())),
        }
        // A lookup that found its code gives its miss back.
        let b = misses.reserve("b", soon()).await.expect("b's own budget");
        drop(b);
        for _ in 0..2 {
            (misses.reserve("b", soon()).await).expect("found codes cost nothing");
        }
    }

    #[tokio::test]
    async fn a_spent_budget_that_refills_in_time_slows_a_lookup_and_never_refuses_it() {
        // 60 a minute: one miss back each second, well within the wait.
        let misses = Misses::new(60);
        for _ in 0..60 {
            let mut turn = misses.reserve("a", soon()).await.expect("a miss is left");
            turn.missed = true;
        }
        let asked = tokio::time::Instant::now();
        let turn = misses
            .reserve("a", soon())
            .await
            .expect("slowed, not refused");
        let waited = asked.elapsed();
        assert!(waited <= Duration::from_secs(2), "{waited:?}");
        // It found its code: the miss goes back, and the next one goes at once.
        drop(turn);
        let asked = tokio::time::Instant::now();
        let _ = misses
            .reserve("a", soon())
            .await
            .expect("the miss given back");
        assert!(asked.elapsed() < Duration::from_millis(200));
    }
}
