//! The host's own noise in a run: a loop of empty journaled writes beside
//! the measured load. Each write changes one tiny document, acknowledged
//! by a majority and journaled, as a claim is, and is timed from when it
//! was due, as the load's requests are: a stall shows on every write it
//! held up. It shares the journal, the MongoDB client and the runtime with
//! the load, so it is the floor one journaled write has under that load
//! in that process; a tail of the load that the probe's tail matches comes
//! from below the code (the disk, the journal, the host), not from it.

use std::time::Duration;

use bson::doc;
use codepool_store::Store;
use mongodb::options::{Acknowledgment, WriteConcern};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The scratch database's collection the probe writes to.
const COLLECTION: &str = "bench_journal_probe";
/// One write due every this long: 50 a second, beside 100 to 1,000 and
/// more grants a second (their batches make 10 to 220 journaled writes
/// a second).
const EVERY: Duration = Duration::from_millis(20);

/// The probe's loop, running until [`JournalProbe::finish`].
pub(crate) struct JournalProbe {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Probed>,
}

/// The times of the writes that succeeded, and the failures.
#[derive(Default)]
struct Probed {
    took: Vec<Duration>,
    failed: usize,
}

impl JournalProbe {
    /// Starts writing; one write at a time, every [`EVERY`].
    pub(crate) fn start(store: &Store) -> Self {
        let probes = store.database().collection::<bson::Document>(COLLECTION);
        let concern = WriteConcern::builder()
            .w(Acknowledgment::Majority)
            .journal(true)
            .build();
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let mut probed = Probed::default();
            // Missed ticks come at once after a stall, each timed from
            // when it was due.
            let mut tick = tokio::time::interval(EVERY);
            loop {
                let due = tokio::select! {
                    _ = &mut stopped => break,
                    due = tick.tick() => due,
                };
                let wrote = probes
                    .update_one(doc! {"_id": "probe"}, doc! {"$inc": {"n": 1}})
                    .upsert(true)
                    .write_concern(concern.clone())
                    .await;
                match wrote {
                    Ok(_) => probed.took.push(due.elapsed()),
                    Err(_) => probed.failed += 1,
                }
            }
            probed
        });
        JournalProbe { stop, task }
    }

    /// Stops the loop: how many writes it made (and how many failed:
    /// the probe is a side measurement, and never fails the phase), and
    /// their p50, p99 and longest, in ms.
    pub(crate) async fn finish(self) -> Value {
        let _ = self.stop.send(());
        let mut probed = self.task.await.unwrap_or_default();
        probed.took.sort();
        summary(&probed.took, probed.failed)
    }
}

/// The writes' count and times (sorted), and the failures, as JSON.
fn summary(sorted: &[Duration], failed: usize) -> Value {
    let p = |q: f64| crate::ms(crate::percentile(sorted, q));
    json!({
        "writes": sorted.len(), "failed": failed,
        "p50_ms": p(0.50), "p99_ms": p(0.99), "max_ms": p(1.0),
    })
}

/// Takes the probe's own writes out of a phase's mongod counts per item
/// (`update` and `documents updated`, from `serverStatus` around it), so
/// they stay the load's.
pub(crate) fn uncount(per_item: &mut Value, probe: &Value, items: usize) {
    let writes =
        (probe["writes"].as_u64().unwrap_or(0) + probe["failed"].as_u64().unwrap_or(0)) as f64;
    for key in ["update", "documents updated"] {
        if let Some(v) = per_item.get_mut(key) {
            if let Some(n) = v.as_f64() {
                *v = json!((n - writes / items.max(1) as f64).max(0.0));
            }
        }
    }
}

/// One line for the terminal.
pub(crate) fn describe(probe: &Value) -> String {
    let f = |k: &str| probe[k].as_f64().unwrap_or(0.0);
    format!(
        "host noise: {} empty journaled writes ({} failed), p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        probe["writes"].as_u64().unwrap_or(0),
        probe["failed"].as_u64().unwrap_or(0),
        f("p50_ms"),
        f("p99_ms"),
        f("max_ms")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_reads_the_sorted_times() {
        let times: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let s = summary(&times, 2);
        assert_eq!(s["writes"], 100);
        assert_eq!(s["failed"], 2);
        assert!((s["max_ms"].as_f64().unwrap() - 100.0).abs() < 1e-9);
        assert!(s["p50_ms"].as_f64().unwrap() <= s["p99_ms"].as_f64().unwrap());
        assert!(describe(&s).contains("100 empty journaled writes (2 failed)"));
    }

    #[test]
    fn the_probes_own_writes_are_taken_out_of_the_loads_counts() {
        let probe = json!({"writes": 499, "failed": 1});
        let mut per = json!({"update": 0.3, "documents updated": 1.05, "insert": 0.2});
        uncount(&mut per, &probe, 10_000);
        assert!((per["update"].as_f64().unwrap() - 0.25).abs() < 1e-9);
        assert!((per["documents updated"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(per["insert"], 0.2);
    }
}
