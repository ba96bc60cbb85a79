//! Where an open-loop request's time went, split at its claim (issue 57's
//! "where each tail comes from"): from its scheduled start to its grant's
//! `issued_at`, which the claim stamps as it sends its write (sending,
//! the broker's queue and the consumer's prefetch or the HTTP batcher's
//! queue, batching, the reads before the claim), and from there to its
//! event or answer (the claim's journal wait, what follows it: the answer,
//! or the event's publish, confirm and delivery).
//!
//! `issued_at` comes back in the event or answer with millisecond
//! precision, truncated: the first part reads up to 1 ms short.

use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use crate::{ms, percentile};

/// A wall-clock time and the monotonic instant taken with it, to place
/// the server's `issued_at` on the bench's clock (same host).
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    instant: Instant,
    system: SystemTime,
}

impl Clock {
    pub fn now() -> Self {
        Self {
            instant: Instant::now(),
            system: SystemTime::now(),
        }
    }

    /// The instant of an RFC 3339 time, or `None` if it does not parse.
    pub fn instant_of(&self, rfc3339: &str) -> Option<Instant> {
        let at: SystemTime = chrono::DateTime::parse_from_rfc3339(rfc3339)
            .ok()?
            .with_timezone(&chrono::Utc)
            .into();
        match at.duration_since(self.system) {
            Ok(after) => self.instant.checked_add(after),
            Err(e) => self.instant.checked_sub(e.duration()),
        }
    }
}

/// One request's latency and the part of it before its claim.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    pub total: Duration,
    pub before_claim: Duration,
}

impl Split {
    /// From `scheduled` to `done`, split at `claimed` (held inside the
    /// request's span: a clock step cannot make a part negative).
    pub fn new(scheduled: Instant, claimed: Instant, done: Instant) -> Self {
        let total = done.saturating_duration_since(scheduled);
        let before_claim = claimed.saturating_duration_since(scheduled).min(total);
        Self {
            total,
            before_claim,
        }
    }

    fn after_claim(&self) -> Duration {
        self.total - self.before_claim
    }
}

/// What the part before the claim holds besides queueing and batching.
#[derive(Debug, Clone, Copy)]
pub enum Door {
    /// A purchase: the broker's queue, the consumer's prefetch, the
    /// batch's reads.
    Amqp,
    /// An HTTP order: the batcher's queue, the batch's reads, and its
    /// journaled record of the events it owes (`sms_owed`), written
    /// before the claim.
    Http,
}

impl Door {
    fn note(self) -> &'static str {
        match self {
            Door::Amqp => "before the claim: scheduled start to issued_at (the broker's queue, the consumer's prefetch, batching, the batch's reads); after: issued_at to the event (the claim's journal wait, the event's publish, confirm and delivery). issued_at has ms precision, truncated",
            Door::Http => "before the claim: scheduled start to issued_at (the batcher's queue behind the batch in flight, the batch's reads, and its journaled sms_owed record); after: issued_at to the answer (the claim's journal wait, the answer). issued_at has ms precision, truncated",
        }
    }
}

/// The two parts' p50 and p99 over every request, and their means over
/// the tail: the slowest hundredth of the requests.
pub fn summary(splits: &[Split], door: Door) -> Value {
    if splits.is_empty() {
        return Value::Null;
    }
    let quantiles = |part: &dyn Fn(&Split) -> Duration| {
        let mut v: Vec<Duration> = splits.iter().map(part).collect();
        v.sort();
        json!({"p50_ms": ms(percentile(&v, 0.5)), "p99_ms": ms(percentile(&v, 0.99))})
    };
    // The slowest hundredth (at least one request).
    let mut by_total: Vec<&Split> = splits.iter().collect();
    by_total.sort_by_key(|s| std::cmp::Reverse(s.total));
    let tail = &by_total[..splits.len().div_ceil(100)];
    let from = tail.last().map_or(Duration::ZERO, |s| s.total);
    let mean = |part: &dyn Fn(&Split) -> Duration| {
        tail.iter().map(|s| ms(part(s))).sum::<f64>() / tail.len().max(1) as f64
    };
    json!({
        "requests": splits.len(),
        "before_claim_ms": quantiles(&|s| s.before_claim),
        "after_claim_ms": quantiles(&|s| s.after_claim()),
        "tail": {
            "requests": tail.len(),
            "from_ms": ms(from),
            "mean_total_ms": mean(&|s| s.total),
            "mean_before_claim_ms": mean(&|s| s.before_claim),
            "mean_after_claim_ms": mean(&|s| s.after_claim()),
        },
        "note": door.note(),
    })
}

/// One line for the terminal.
pub fn describe(v: &Value) -> String {
    if v.is_null() {
        return "split at the claim: no issued_at came back".to_owned();
    }
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let t = &v["tail"];
    format!(
        "split at the claim: before p50 {:.1} / p99 {:.1} ms, after p50 {:.1} / p99 {:.1} ms; the slowest {} (≥ {:.1} ms) averaged {:.1} ms before and {:.1} ms after",
        f(&v["before_claim_ms"]["p50_ms"]),
        f(&v["before_claim_ms"]["p99_ms"]),
        f(&v["after_claim_ms"]["p50_ms"]),
        f(&v["after_claim_ms"]["p99_ms"]),
        t["requests"],
        f(&t["from_ms"]),
        f(&t["mean_before_claim_ms"]),
        f(&t["mean_after_claim_ms"]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_issued_at_lands_where_it_was_on_the_clock() {
        let clock = Clock::now();
        let later =
            chrono::DateTime::<chrono::Utc>::from(clock.system + Duration::from_millis(250));
        let text = later.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let at = clock.instant_of(&text).expect("parses");
        let off = at.saturating_duration_since(clock.instant);
        // Millisecond text: up to 1 ms short of the true offset.
        assert!(
            off <= Duration::from_millis(250) && off >= Duration::from_millis(249),
            "{off:?}"
        );
        let earlier =
            chrono::DateTime::<chrono::Utc>::from(clock.system - Duration::from_millis(40));
        let at = clock
            .instant_of(&earlier.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
            .expect("parses");
        assert!(at < clock.instant);
        assert_eq!(clock.instant_of("not a time"), None);
    }

    #[test]
    fn the_tail_is_the_slowest_hundredth_and_its_parts_add_up() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // 99 quick requests, claimed after 2 ms and done after 5 ms; one
        // slow one that waited 40 ms for its claim and 10 ms after it.
        let mut splits: Vec<Split> = (0..99).map(|_| Split::new(t0, at(2), at(5))).collect();
        splits.push(Split::new(t0, at(40), at(50)));
        let s = summary(&splits, Door::Amqp);
        assert_eq!(s["requests"], 100);
        assert_eq!(s["before_claim_ms"]["p50_ms"], 2.0);
        assert_eq!(s["after_claim_ms"]["p50_ms"], 3.0);
        assert_eq!(s["tail"]["requests"], 1);
        assert_eq!(s["tail"]["from_ms"], 50.0);
        assert_eq!(s["tail"]["mean_before_claim_ms"], 40.0);
        assert_eq!(s["tail"]["mean_after_claim_ms"], 10.0);
        assert!(describe(&s)
            .contains("the slowest 1 (≥ 50.0 ms) averaged 40.0 ms before and 10.0 ms after"));
    }

    #[test]
    fn a_claim_stamped_outside_the_request_is_held_inside_it() {
        let t0 = Instant::now();
        let early = Split::new(
            t0 + Duration::from_millis(3),
            t0,
            t0 + Duration::from_millis(8),
        );
        assert_eq!(early.before_claim, Duration::ZERO);
        assert_eq!(early.total, Duration::from_millis(5));
        let late = Split::new(
            t0,
            t0 + Duration::from_millis(9),
            t0 + Duration::from_millis(8),
        );
        assert_eq!(late.before_claim, late.total);
        assert!(summary(&[], Door::Http).is_null());
    }
}
