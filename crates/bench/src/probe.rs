//! The host's own noise in a run: a loop of empty journaled writes beside
//! the measured load. Each write changes one tiny document, acknowledged
//! by a majority and journaled, as a claim is; its time is what the disk,
//! the journal and the scheduler alone add. A tail of the measured load
//! that the probe's tail matches is the host's, not the code's.

use std::time::{Duration, Instant};

use bson::doc;
use codepool_store::Store;
use mongodb::options::{Acknowledgment, WriteConcern};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The scratch database's collection the probe writes to.
const COLLECTION: &str = "bench_journal_probe";
/// One write every this long (100 a second: a load too small to move the
/// measured one).
const EVERY: Duration = Duration::from_millis(10);

/// The probe's loop, running until [`JournalProbe::finish`].
pub(crate) struct JournalProbe {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<Vec<Duration>, mongodb::error::Error>>,
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
            let mut took = Vec::new();
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                let started = Instant::now();
                probes
                    .update_one(doc! {"_id": "probe"}, doc! {"$inc": {"n": 1}})
                    .upsert(true)
                    .write_concern(concern.clone())
                    .await?;
                took.push(started.elapsed());
            }
            Ok(took)
        });
        JournalProbe { stop, task }
    }

    /// Stops the loop: how many writes it made, and their p50, p99 and
    /// longest, in ms.
    pub(crate) async fn finish(self) -> anyhow::Result<Value> {
        let _ = self.stop.send(());
        let mut took = self.task.await??;
        took.sort();
        Ok(summary(&took))
    }
}

/// The writes' count and times (sorted), as JSON.
fn summary(sorted: &[Duration]) -> Value {
    let p = |q: f64| crate::ms(crate::percentile(sorted, q));
    json!({
        "writes": sorted.len(),
        "p50_ms": p(0.50), "p99_ms": p(0.99), "max_ms": p(1.0),
    })
}

/// One line for the terminal.
pub(crate) fn describe(probe: &Value) -> String {
    let f = |k: &str| probe[k].as_f64().unwrap_or(0.0);
    format!(
        "host noise: {} empty journaled writes, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        probe["writes"],
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
        let s = summary(&times);
        assert_eq!(s["writes"], 100);
        assert!((s["max_ms"].as_f64().unwrap() - 100.0).abs() < 1e-9);
        assert!(s["p50_ms"].as_f64().unwrap() <= s["p99_ms"].as_f64().unwrap());
        assert!(describe(&s).contains("100 empty journaled writes"));
    }
}
