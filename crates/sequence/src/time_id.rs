//! Time-ordered ids: `yyyyMMddHHmmssSSSSSS` (UTC, microseconds) + a 2-digit serial.
//!
//! The serial comes from a [`CyclicCounter`] over `0..=99` shared by every
//! process, so two ids can only collide if the serial comes round (100 draws)
//! within the same microsecond. Each draw is a MongoDB round trip, so that
//! cannot happen in one process; across machines it assumes clocks that do
//! not step back onto an instant already used with the same serial.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use mongodb::Database;

use crate::clock::{Clock, SystemClock};
use crate::cyclic::CyclicCounter;
use crate::SequenceError;

/// The serial runs `0..=SERIAL_MAX`: two digits.
pub const SERIAL_MAX: u64 = 99;
/// Name of the serial counter used when none is given.
pub const DEFAULT_NAME: &str = "timeid";

/// Makes 22-character ids that sort by creation time.
#[derive(Clone)]
pub struct TimeId {
    serial: CyclicCounter,
    clock: Arc<dyn Clock>,
}

impl TimeId {
    /// Ids whose serial is the cyclic counter `name` (0..=99). Does no I/O.
    pub fn new(db: Database, name: &str) -> Result<Self, SequenceError> {
        Ok(TimeId {
            serial: CyclicCounter::new(db, name, SERIAL_MAX)?,
            clock: Arc::new(SystemClock),
        })
    }

    /// Reads the time from `clock` instead of the system clock.
    pub fn with_clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The next id.
    pub async fn next(&self) -> Result<String, SequenceError> {
        let serial = self.serial.next().await?;
        Ok(format_time_id(self.clock.now(), serial))
    }
}

/// `yyyyMMddHHmmssSSSSSS` of `at` in UTC followed by `serial` as two digits.
pub fn format_time_id(at: DateTime<Utc>, serial: u64) -> String {
    format!("{}{serial:02}", at.format("%Y%m%d%H%M%S%6f"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn a_time_id_is_the_utc_time_to_the_microsecond_then_the_serial() {
        let at = Utc.with_ymd_and_hms(2026, 11, 20, 15, 59, 59).single();
        let at = at.map(|t| t + chrono::Duration::microseconds(123_456));
        let Some(at) = at else {
            panic!("valid test instant");
        };
        assert_eq!(format_time_id(at, 7), "2026112015595912345607");
        assert_eq!(format_time_id(at, 99).len(), 22);
    }
}
