//! A dispatcher run inside the benchmark process, on the scratch space:
//! started fresh (cold hot pools, cold caches), stopped once a given number
//! of purchases went end to end. Shared by `dispatch`, its scale variants
//! and `latency`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_dispatcher::{Dispatcher, DispatcherConfig};
use codepool_domain::Purchase;
use codepool_issuance::Health;
use codepool_store::ObjectId;
use futures::StreamExt;
use lapin::Connection;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{proc_status_kb, CpuSnapshot, Scratch};

/// Longest the dispatcher may go without progress before the run fails.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// Publishes in flight at once while preloading.
const PRELOAD_WINDOW: usize = 2000;

/// Has MongoDB write its dirty data to disk now (a checkpoint), so the run
/// that follows does not pay for flushing what came before it: a
/// 10,000,000-code import, or the other side's grants.
pub async fn checkpoint(scratch: &Scratch) -> anyhow::Result<()> {
    scratch
        .store
        .client()
        .database("admin")
        .run_command(bson::doc! {"fsync": 1})
        .await
        .context("fsync (checkpoint) before the run")?;
    Ok(())
}

/// A running in-process dispatcher.
pub struct Running {
    stop: CancellationToken,
    daemon: JoinHandle<Result<(), codepool_broker::BrokerError>>,
    /// Purchases done (end to end) before it started: the metrics are
    /// process-wide and several dispatchers run one after the other.
    done_before: u64,
    /// Codes issued before it started (same reason).
    issued_before: u64,
    pub started: Instant,
    cpu: CpuSnapshot,
}

/// What one dispatcher run measured.
pub struct DispatcherRun {
    pub elapsed: Duration,
    /// From the start until the last of the `n` codes was issued (its
    /// claim written), before its event and ack.
    pub issued: Duration,
    pub cpu: Vec<(&'static str, f64)>,
    pub rss_max_kb: u64,
}

/// Starts a fresh dispatcher with `config` (its AMQP URL and topology,
/// partitions included, are the scratch space's).
pub fn start(scratch: &Scratch, config: &DispatcherConfig) -> anyhow::Result<Running> {
    // The metrics recorder must be in place before the dispatcher records
    // anything: the reports' stage timings read it afterwards.
    let _ = crate::metrics();
    // The dispatcher's start is part of the measurement.
    let started = Instant::now();
    let cfg = &scratch.cfg;
    let dispatcher = Dispatcher::new(
        codepool::context::parts(cfg, &scratch.store)?,
        DispatcherConfig {
            amqp_url: cfg.amqp_url.clone(),
            topology: cfg.topology(),
            name: "codepool-bench-dispatcher".into(),
            ..config.clone()
        },
        Arc::new(Health::default()),
    );
    let stop = CancellationToken::new();
    let done_before = codepool_issuance::telemetry::settled_purchases();
    let issued_before = codepool_issuance::telemetry::issued_codes();
    let cpu = CpuSnapshot::take();
    let daemon = tokio::spawn(dispatcher.run(stop.clone()));
    Ok(Running {
        stop,
        daemon,
        done_before,
        issued_before,
        started,
        cpu,
    })
}

impl Running {
    /// Purchases this dispatcher took end to end so far (a counter read,
    /// so polling it costs nothing, however many pools the metrics hold).
    pub fn done(&self) -> u64 {
        codepool_issuance::telemetry::settled_purchases().saturating_sub(self.done_before)
    }

    /// Waits until `n` purchases are done, then stops the dispatcher.
    /// Also notes when the `n`th code was issued.
    pub async fn finish(self, n: u64) -> anyhow::Result<DispatcherRun> {
        let mut rss_max = 0u64;
        let mut last = (0u64, Instant::now());
        let mut issued = None;
        for tick in 0u64.. {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let now = codepool_issuance::telemetry::issued_codes();
            if issued.is_none() && now.saturating_sub(self.issued_before) >= n {
                issued = Some(self.started.elapsed());
            }
            if tick % 5 == 0 {
                rss_max = rss_max.max(proc_status_kb(None, "VmRSS").unwrap_or(0));
            }
            let done = self.done();
            if done >= n {
                break;
            }
            if done > last.0 {
                last = (done, Instant::now());
            } else if last.1.elapsed() > STALL_LIMIT {
                self.stop().await?;
                anyhow::bail!(
                    "the dispatcher made no progress for {STALL_LIMIT:?} at {done} of {n} purchases"
                );
            }
        }
        let elapsed = self.started.elapsed();
        let cpu = CpuSnapshot::take().since(&self.cpu);
        self.stop().await?;
        Ok(DispatcherRun {
            elapsed,
            // Fewer fresh codes than purchases (repeats, backorders):
            // the clock stops with the last purchase.
            issued: issued.unwrap_or(elapsed),
            cpu,
            rss_max_kb: rss_max,
        })
    }

    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        Ok(self.daemon.await.context("the dispatcher panicked")??)
    }
}

/// A purchase of `pool`, numbered `i` (order ids are unique per tag).
pub fn purchase(tag: &str, pool: &str, i: usize) -> Purchase {
    Purchase {
        order_id: format!("{tag}-o{i}"),
        uid: format!("u{i}"),
        phone: format!("+86138{:08}", i % 100_000_000),
        pool: pool.to_owned(),
        purchased_at: None,
        quantity: 1,
        owner: None,
        hold_id: None,
        items: Vec::new(),
        shop: None,
    }
}

/// Publishes `n` messages, `PRELOAD_WINDOW` confirms in flight at a time.
pub async fn preload<F, Fut>(n: usize, publish: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<codepool_broker::PendingConfirm>>,
{
    let mut start = 0;
    while start < n {
        let end = (start + PRELOAD_WINDOW).min(n);
        let mut confirms = Vec::with_capacity(end - start);
        for i in start..end {
            confirms.push(publish(i).await?);
        }
        for c in confirms {
            c.wait().await?;
        }
        start = end;
    }
    Ok(())
}

/// Connects to the scratch space's broker as `name` and publishes the `n`
/// purchases `make` builds, confirmed ([`preload`]). The connection stays
/// open for the caller's checks.
pub async fn preload_purchases(
    scratch: &Scratch,
    name: &str,
    n: usize,
    make: impl Fn(usize) -> Purchase,
) -> anyhow::Result<Connection> {
    let conn = codepool_broker::connect(&scratch.cfg.amqp_url, name).await?;
    let publisher = codepool_broker::Publisher::new(&conn, scratch.cfg.topology())
        .await?
        .as_user(&codepool_broker::Publisher::user_of(&scratch.cfg.amqp_url));
    preload(n, |i| {
        let p = make(i);
        let publisher = publisher.clone();
        async move { Ok(publisher.publish_purchase(&p).await?) }
    })
    .await?;
    Ok(conn)
}

/// Ready messages in `queue` (a passive declare; unacked ones are not counted).
pub async fn depth(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    let ch = conn.create_channel().await?;
    let n = codepool_broker::queue_depth(&ch, queue)
        .await
        .with_context(|| format!("reading the depth of {queue}"))?;
    let _ = ch.close(200, "done").await;
    Ok(n)
}

/// Fills several pools at once: `(pool, codes)` pairs, written with the
/// store's own insert path, `parallel` batches in flight.
pub async fn fill_pools(
    scratch: &Scratch,
    sizes: &[(String, usize)],
    parallel: usize,
) -> anyhow::Result<()> {
    const CHUNK: usize = 5000;
    let store = &scratch.store;
    let batch_id = ObjectId::new();
    let mut work: Vec<(&str, usize, usize)> = Vec::new();
    for (pool, n) in sizes {
        store.ensure_pool(pool).await?;
        work.extend(
            (0..*n)
                .step_by(CHUNK)
                .map(|s| (pool.as_str(), s, (s + CHUNK).min(*n))),
        );
    }
    let mut stream = futures::stream::iter(work)
        .map(|(pool, from, to)| async move {
            let codes: Vec<codepool_store::NewCode> = (from..to)
                .map(|i| codepool_store::NewCode {
                    code: format!("{pool}-{i:09}"),
                    line: None,
                    expires_at: None,
                })
                .collect();
            let done = store.insert_codes(pool, batch_id, &codes).await;
            done.with_context(|| format!("filling pool {pool}"))
                .map(|o| (o.inserted, (to - from) as u64))
        })
        .buffer_unordered(parallel.max(1));
    while let Some(r) = stream.next().await {
        let (inserted, wanted) = r?;
        anyhow::ensure!(
            inserted == wanted,
            "filling: {inserted} of {wanted} codes inserted"
        );
    }
    Ok(())
}
