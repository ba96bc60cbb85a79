//! Where "now" comes from, so that day boundaries can be tested.

use chrono::{DateTime, Utc};

/// A source of the current time.
///
/// Generators that put a date or a timestamp into their values read the time
/// through this trait, so tests can move across midnight without waiting for
/// it. Any `Fn() -> DateTime<Utc>` closure is a clock.
pub trait Clock: Send + Sync {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;
}

/// The machine's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

impl<F> Clock for F
where
    F: Fn() -> DateTime<Utc> + Send + Sync,
{
    fn now(&self) -> DateTime<Utc> {
        self()
    }
}
