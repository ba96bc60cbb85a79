//! Sign-in attempts are rationed before the slow password check, never
//! after it, so a burst of guesses is refused as surely as a sequence:
//!
//! - **per client** (the peer's IP address): at most [`CLIENT_BURST`]
//!   attempts at once, then one every [`CLIENT_PERIOD`], whatever names
//!   they try (known or not);
//! - **per name**: after [`FREE_FAILURES`] failures, each further attempt
//!   must wait twice as long as the one before, up to [`MAX_WAIT`]. An
//!   attempt is counted as a failure when it is let through, under the
//!   same lock that read the count; a success clears the name. Operator
//!   names are not secret, so a stranger's failures must not keep the
//!   operator out: an address the name has signed in from before (in this
//!   process) is judged by its own failures for the name only, not by the
//!   name's. Any other address, however many an attacker has, shares the
//!   name's wait, so a right password never slips in among guesses.
//!   `codepool_console_names_locked` counts the names waiting now, for an
//!   alert on sustained guessing;
//! - **at once**: at most [`CHECKS`] argon2id checks run (19 MiB each);
//!   an attempt beyond them is refused at once, uncounted.
//!
//! A refused attempt's password is never checked. Kept per process:
//! several API processes each slow an attacker down on their own.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use tokio::sync::{Semaphore, SemaphorePermit};

/// Failures allowed before the waits begin.
pub const FREE_FAILURES: u32 = 3;
/// Longest wait between two attempts.
pub const MAX_WAIT: Duration = Duration::from_secs(300);
/// Attempts a client may make at once.
pub const CLIENT_BURST: u32 = 10;
/// Then one attempt per this long.
pub const CLIENT_PERIOD: Duration = Duration::from_secs(6);
/// Password checks running at once.
pub const CHECKS: usize = 2;
/// Names and clients kept at most (the stale ones are dropped past it).
const MOST_KEYS: usize = 100_000;

#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
}

/// Why an attempt was refused without checking its password.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Too many attempts for the name or from the client: wait this long.
    Throttled(Duration),
    /// Every password check slot is busy: try again in a moment.
    Busy,
}

/// Sign-in attempts by name and by client, and the password check slots.
pub struct Throttle {
    /// By name, and by (name, address) for an address the name signed in
    /// from before (`None` address: the name's own count).
    failures: Mutex<HashMap<(String, Option<IpAddr>), Failures>>,
    /// The addresses each name has signed in from.
    trusted: Mutex<HashMap<String, Vec<IpAddr>>>,
    clients: DefaultKeyedRateLimiter<IpAddr>,
    checks: Semaphore,
}

impl Default for Throttle {
    fn default() -> Self {
        let burst = NonZeroU32::new(CLIENT_BURST).unwrap_or(NonZeroU32::MIN);
        let quota = Quota::with_period(CLIENT_PERIOD)
            .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
            .allow_burst(burst);
        Self {
            failures: Mutex::new(HashMap::new()),
            trusted: Mutex::new(HashMap::new()),
            clients: DefaultKeyedRateLimiter::keyed(quota),
            checks: Semaphore::new(CHECKS),
        }
    }
}

/// How long after the last failure the next attempt may come.
pub fn wait_after(count: u32) -> Duration {
    if count < FREE_FAILURES {
        return Duration::ZERO;
    }
    let doublings = (count - FREE_FAILURES).min(16);
    Duration::from_secs(1u64 << doublings).min(MAX_WAIT)
}

/// An attempt let through: it holds a password check slot, and counts as
/// a failure of its name unless [`Attempt::succeeded`] says otherwise.
pub struct Attempt<'a> {
    throttle: &'a Throttle,
    name: String,
    client: Option<IpAddr>,
    _check: SemaphorePermit<'a>,
}

/// Addresses remembered per name at most.
const MOST_TRUSTED: usize = 16;

impl Attempt<'_> {
    /// The password was right: the name's failures are forgotten, and its
    /// address is one the name signs in from.
    pub fn succeeded(self) {
        let mut map = self.throttle.lock();
        map.retain(|(name, _), _| *name != self.name);
        record_locked(&map);
        drop(map);
        if let Some(ip) = self.client {
            let mut trusted = self
                .throttle
                .trusted
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if trusted.len() > MOST_KEYS {
                trusted.clear();
            }
            let known = trusted.entry(self.name.clone()).or_default();
            if !known.contains(&ip) {
                if known.len() >= MOST_TRUSTED {
                    known.remove(0);
                }
                known.push(ip);
            }
        }
    }
}

/// Sets `codepool_console_names_locked`: the names waiting now.
fn record_locked(map: &HashMap<(String, Option<IpAddr>), Failures>) {
    let mut names: Vec<&str> = (map.iter())
        .filter(|(_, f)| {
            !wait_after(f.count)
                .saturating_sub(f.last.elapsed())
                .is_zero()
        })
        .map(|((n, _), _)| n.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    metrics::gauge!("codepool_console_names_locked").set(names.len() as f64);
}

impl Throttle {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, Option<IpAddr>), Failures>> {
        self.failures.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets an attempt for `name` from `client` through, or says why not.
    pub fn attempt(&self, name: &str, client: Option<IpAddr>) -> Result<Attempt<'_>, Refusal> {
        if let Some(ip) = client {
            if self.clients.len() > MOST_KEYS {
                self.clients.retain_recent();
            }
            if let Err(not_until) = self.clients.check_key(&ip) {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                return Err(Refusal::Throttled(wait));
            }
        }
        // An address the name signed in from counts on its own.
        let trusted = client.filter(|ip| {
            (self.trusted.lock().unwrap_or_else(|e| e.into_inner()))
                .get(name)
                .is_some_and(|known| known.contains(ip))
        });
        let key = (name.to_owned(), trusted);
        let mut map = self.lock();
        let wait = map
            .get(&key)
            .map(|f| wait_after(f.count).saturating_sub(f.last.elapsed()))
            .unwrap_or(Duration::ZERO);
        if !wait.is_zero() {
            record_locked(&map);
            return Err(Refusal::Throttled(wait));
        }
        let check = self.checks.try_acquire().map_err(|_| Refusal::Busy)?;
        if map.len() > MOST_KEYS {
            map.retain(|_, f| f.last.elapsed() < MAX_WAIT * 2);
        }
        let f = map.entry(key).or_insert(Failures {
            count: 0,
            last: Instant::now(),
        });
        f.count += 1;
        f.last = Instant::now();
        record_locked(&map);
        Ok(Attempt {
            throttle: self,
            name: name.to_owned(),
            client,
            _check: check,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_after_the_free_failures_and_stop_at_the_cap() {
        assert_eq!(wait_after(0), Duration::ZERO);
        assert_eq!(wait_after(FREE_FAILURES - 1), Duration::ZERO);
        assert_eq!(wait_after(FREE_FAILURES), Duration::from_secs(1));
        assert_eq!(wait_after(FREE_FAILURES + 3), Duration::from_secs(8));
        assert_eq!(wait_after(1000), MAX_WAIT);
    }

    #[test]
    fn a_name_waits_once_it_failed_too_often_and_is_free_after_a_success() {
        let t = Throttle::default();
        for _ in 0..FREE_FAILURES {
            drop(t.attempt("alice", None).expect("a free attempt"));
        }
        assert!(
            matches!(t.attempt("alice", None), Err(Refusal::Throttled(w)) if w > Duration::from_millis(500))
        );
        assert!(t.attempt("bob", None).is_ok());
        t.lock().remove(&("alice".to_owned(), None));
        t.attempt("alice", None).expect("free again").succeeded();
        assert!(t.lock().keys().all(|(n, _)| n != "alice"));
    }

    #[test]
    fn attempts_held_at_once_count_before_their_check_and_beyond_the_slots_are_busy() {
        let t = Throttle::default();
        let held: Vec<_> = (0..CHECKS)
            .map(|_| t.attempt("carol", None).expect("a slot"))
            .collect();
        assert_eq!(t.attempt("dave", None).err(), Some(Refusal::Busy));
        let count = |n: &str| t.lock().get(&(n.to_owned(), None)).map(|f| f.count);
        assert_eq!(count("carol"), Some(CHECKS as u32));
        assert!(count("dave").is_none(), "a busy refusal is not counted");
        drop(held);
        assert!(t.attempt("dave", None).is_ok());
    }

    #[test]
    fn a_strangers_failures_never_keep_the_operator_out_of_an_address_it_signed_in_from() {
        let t = Throttle::default();
        let operator: IpAddr = [10, 0, 0, 7].into();
        t.attempt("admin1", Some(operator))
            .expect("first")
            .succeeded();
        for n in 0..FREE_FAILURES {
            let stranger: IpAddr = [203, 0, 113, n as u8].into();
            drop(t.attempt("admin1", Some(stranger)).expect("a free attempt"));
        }
        // Every other address waits, fresh or not: no right password
        // slips in among a stranger's guesses.
        assert!(matches!(
            t.attempt("admin1", Some([198, 51, 100, 1].into())),
            Err(Refusal::Throttled(_))
        ));
        t.attempt("admin1", Some(operator))
            .expect("the operator's own address is not locked")
            .succeeded();
    }

    #[test]
    fn a_client_gets_its_burst_then_waits_whatever_names_it_tries() {
        let t = Throttle::default();
        let ip: IpAddr = [10, 0, 0, 1].into();
        for n in 0..CLIENT_BURST {
            drop(
                t.attempt(&format!("nobody-{n}"), Some(ip))
                    .expect("within the burst"),
            );
        }
        assert!(matches!(
            t.attempt("someone-else", Some(ip)),
            Err(Refusal::Throttled(w)) if w > Duration::ZERO
        ));
        assert!(t
            .attempt("someone-else", Some([10, 0, 0, 2].into()))
            .is_ok());
    }
}
