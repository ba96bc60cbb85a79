//! How each channel's reservations and provisions come out, kept where
//! every process can read them: a marketplace judges a seller by its last
//! hour (Eneba hides an auction for two hours when
//! `log(failed)/log(completed)` passes 0.4 for reservations or 0.2 for
//! provisions), so the console shows that hour for every channel, whichever
//! API process served the calls.
//!
//! Each call is counted twice: as the Prometheus counter the alert rules
//! read (`codepool_channel_reservations_total`,
//! `codepool_channel_provisions_total`, per process), and in this
//! process's [`Counter`], added up per channel and minute in memory and
//! written to `channel_outcomes` every [`FLUSH_EVERY`] (one upsert per
//! channel and minute, never one per call: the calls' latency does not
//! pay for it). A process killed loses at most its last few seconds of
//! counts; the console's view flushes its own process's first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::DateTime;
use codepool_store::channel_outcomes::Outcomes;
use codepool_store::Store;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How often a process writes the counts it added up.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);
/// The span a marketplace judges (and the console shows).
pub const WINDOW: Duration = Duration::from_secs(3600);
/// Eneba hides an auction when a ratio reaches these (reservations,
/// provisions).
pub const ENEBA_HIDES_AT: (f64, f64) = (0.4, 0.2);
/// The alert rules fire at these, before Eneba does
/// (deploy/prometheus/alerts.yml).
pub const WARN_AT: (f64, f64) = (0.3, 0.15);

/// What a marketplace asked of a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// A reservation (Eneba's RESERVE, G2A's reservation, Kinguin's
    /// BUYING), or a replacement's RESERVE.
    Reservation,
    /// A provision (Eneba's PROVIDE, G2A's order, Kinguin's upload).
    Provision,
}

/// The calls this process counted and has not written yet, per channel
/// and minute.
#[derive(Debug, Default)]
pub struct Counter {
    pending: Mutex<HashMap<(String, i64), Outcomes>>,
}

impl Counter {
    /// Counts one call of `channel` by its outcome.
    pub fn count(&self, channel: &str, call: Call, ok: bool) {
        let outcome = if ok { "completed" } else { "failed" };
        let label = channel.to_owned();
        match call {
            Call::Reservation => metrics::counter!("codepool_channel_reservations_total", "channel" => label, "outcome" => outcome).increment(1),
            Call::Provision => metrics::counter!("codepool_channel_provisions_total", "channel" => label, "outcome" => outcome).increment(1),
        }
        let minute = DateTime::now().timestamp_millis() / 60_000 * 60_000;
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        let o = pending.entry((channel.to_owned(), minute)).or_default();
        match (call, ok) {
            (Call::Reservation, true) => o.reservations_completed += 1,
            (Call::Reservation, false) => o.reservations_failed += 1,
            (Call::Provision, true) => o.provisions_completed += 1,
            (Call::Provision, false) => o.provisions_failed += 1,
        }
    }

    /// Writes what was counted; what could not be written is kept for the
    /// next flush.
    pub async fn flush(&self, store: &Store) {
        let taken = self
            .pending
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default();
        for ((channel, minute), counts) in taken {
            let at = DateTime::from_millis(minute);
            if let Err(e) = store.add_channel_outcomes(&channel, at, &counts).await {
                warn!(channel = %channel, error = %e, "channel outcomes not written; kept for the next flush");
                if let Ok(mut p) = self.pending.lock() {
                    p.entry((channel, minute)).or_default().add(&counts);
                }
            }
        }
    }
}

/// Writes the counts every [`FLUSH_EVERY`] until `stop`, then once more.
pub async fn run(counter: Arc<Counter>, store: Store, stop: CancellationToken) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                counter.flush(&store).await;
                return;
            }
            _ = tick.tick() => counter.flush(&store).await,
        }
    }
}

/// Eneba's hide ratio, `log(failed)/log(completed)`, as the alert rules
/// compute it: fewer than 2 completed count as 2 (log 1 is 0), no failure
/// as 1 (a ratio of 0).
pub fn hide_ratio(failed: u64, completed: u64) -> f64 {
    (failed.max(1) as f64).ln() / (completed.max(2) as f64).ln()
}

/// What a channel sells and how it fares, as the console shows it.
#[derive(Debug, Clone)]
pub struct ChannelView {
    pub channel: codepool_store::channels::ChannelDoc,
    /// Each mapped product, by product id.
    pub products: Vec<ProductView>,
    /// Reservations whose hold holds codes now, and those codes.
    pub open_reservations: u64,
    pub held_codes: u64,
    /// The calls of the last [`WINDOW`], every process's.
    pub last_hour: Outcomes,
}

/// One mapped product of a channel.
#[derive(Debug, Clone)]
pub struct ProductView {
    pub product: String,
    pub pool: String,
    /// What the channel last declared of it (told Eneba, answered G2A);
    /// `None` before its first declaration.
    pub declared: Option<i64>,
    /// What it may declare now: its pool's free codes, capped by the
    /// channel's share and maximum.
    pub declarable: u64,
}

impl ChannelView {
    /// Eneba's hide ratios of the last hour (reservations, provisions).
    pub fn hide_ratios(&self) -> (f64, f64) {
        let o = &self.last_hour;
        (
            hide_ratio(o.reservations_failed, o.reservations_completed),
            hide_ratio(o.provisions_failed, o.provisions_completed),
        )
    }
}

/// The views of `channels`: their products' declared stock, their open
/// reservations and their last hour (after this process's counts are
/// written).
pub async fn views(
    store: &Store,
    counter: &Counter,
    channels: Vec<codepool_store::channels::ChannelDoc>,
) -> Result<Vec<ChannelView>, codepool_store::StoreError> {
    counter.flush(store).await;
    let names: Vec<&str> = channels.iter().map(|c| c.name.as_str()).collect();
    let since =
        DateTime::from_millis(DateTime::now().timestamp_millis() - WINDOW.as_millis() as i64);
    let hours = store.channel_outcomes_since(&names, since).await?;
    let mut free: HashMap<String, u64> = HashMap::new();
    let mut out = Vec::with_capacity(channels.len());
    for c in channels {
        let mut products = Vec::with_capacity(c.products.len());
        for (product, pool) in &c.products {
            let n = match free.get(pool) {
                Some(n) => *n,
                None => {
                    let n = store.unissued_stock(pool).await?;
                    free.insert(pool.clone(), n);
                    n
                }
            };
            products.push(ProductView {
                product: product.clone(),
                pool: pool.clone(),
                declared: c.declared.get(product).copied(),
                declarable: super::stock::cap(&c, n),
            });
        }
        let (open, held) = store.held_under(&format!("{}:{}:", c.kind, c.name)).await?;
        out.push(ChannelView {
            last_hour: hours.get(&c.name).copied().unwrap_or_default(),
            products,
            open_reservations: open,
            held_codes: held,
            channel: c,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hide_ratio_is_computed_as_the_alert_rules_do() {
        assert_eq!(hide_ratio(0, 0), 0.0, "nothing failed: 0");
        assert_eq!(hide_ratio(1, 500), 0.0, "one failure: log 1 = 0");
        assert!((hide_ratio(10, 100) - 0.5).abs() < 1e-9);
        assert!(
            (hide_ratio(4, 1) - 2.0).abs() < 1e-9,
            "fewer than 2 completed count as 2"
        );
        assert!(hide_ratio(2, 100) < ENEBA_HIDES_AT.1);
        assert!(hide_ratio(3, 100) > ENEBA_HIDES_AT.1);
        assert!(hide_ratio(3, 10) > ENEBA_HIDES_AT.0);
    }

    #[test]
    fn calls_add_up_per_channel_and_minute() {
        let c = Counter::default();
        c.count("en", Call::Reservation, true);
        c.count("en", Call::Reservation, false);
        c.count("en", Call::Provision, true);
        c.count("g2", Call::Provision, false);
        let p = c.pending.lock().unwrap();
        let sum = |ch: &str| {
            let mut o = Outcomes::default();
            for ((name, _), v) in p.iter() {
                if name == ch {
                    o.add(v);
                }
            }
            o
        };
        let en = sum("en");
        assert_eq!(
            (
                en.reservations_completed,
                en.reservations_failed,
                en.provisions_completed,
                en.provisions_failed
            ),
            (1, 1, 1, 0)
        );
        assert_eq!(sum("g2").provisions_failed, 1);
    }
}
