//! `codepool bench import`: `codepool import` on a generated CSV file
//! against raw `insert_many` of the same documents built in memory
//! beforehand (in rounds, so 10,000,000 fit), into two pools of one
//! database, in one run.
//!
//! Both sides use unordered inserts of 1000 documents, three in flight,
//! journaled with majority acknowledgement. The import runs as a child
//! process (this very binary, `codepool import FILE --pool P --json`) so its
//! peak memory is its own: `VmHWM` of the child, read until it exits.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_importer::ImportOptions;
use codepool_store::codes::code_documents;
use codepool_store::{durable, NewCode, ObjectId};
use futures::StreamExt;
use mongodb::bson::{doc, Document};
use serde_json::json;
use tokio::io::AsyncReadExt;

use super::inproc::checkpoint;
use super::{describe_cpu, proc_status_kb, CpuSnapshot, Scratch};

/// Peak memory the import may use (issue target, for 1,000,000 codes).
const MEMORY_TARGET_MB: f64 = 100.0;

/// Measure `codepool import` against raw insert_many.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:\n  codepool-bench import --codes 200000 --rounds 3 --json")]
pub struct ImportBenchArgs {
    /// Codes in the generated file (and documents in the raw baseline).
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1000..=20_000_000))]
    pub codes: u64,
    /// Rounds, each a raw insert and an import into pools of their own,
    /// the side that goes first alternating; the median round is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub rounds: u32,
    /// Pass `--allow-cross-pool` to the import: its codes are still claimed
    /// across pools (the claims record both pools), but no claim refuses
    /// one.
    #[arg(long)]
    pub allow_cross_pool: bool,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Removes the generated file however the benchmark ends.
pub(crate) struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Issue 10, goal 5: the import at least this fraction of raw insert_many.
const RATE_TARGET: f64 = 0.8;

/// What both sides measured.
struct Outcome {
    n: usize,
    file_mb: f64,
    raw_seconds: f64,
    raw_cpu: Vec<(&'static str, f64)>,
    import_cpu: Vec<(&'static str, f64)>,
    child: Child,
    summary: serde_json::Value,
    inserted: u64,
    import_seconds: f64,
    in_raw: u64,
    in_import: u64,
    ok: bool,
    /// Whether the import ran first in its round.
    import_first: bool,
}

impl Outcome {
    fn raw_rate(&self) -> f64 {
        self.n as f64 / self.raw_seconds.max(1e-9)
    }
    fn import_rate(&self) -> f64 {
        self.inserted as f64 / self.import_seconds.max(1e-9)
    }
    fn wall_rate(&self) -> f64 {
        self.inserted as f64 / self.child.wall.as_secs_f64().max(1e-9)
    }
    fn ratio(&self) -> f64 {
        self.import_rate() / self.raw_rate().max(1e-9)
    }
    fn peak_mb(&self) -> Option<f64> {
        self.child.peak_kb.map(|k| k as f64 / 1024.0)
    }
}

/// Runs `codepool bench import`; writes `out_dir/import.json`.
pub async fn run(
    args: ImportBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let options = ImportOptions::default();
    let mut rounds = Vec::new();
    for round in 0..args.rounds as usize {
        let o = measure(&args, scratch, &options, round).await?;
        if !args.json {
            eprintln!(
                "round {}: import / raw insert_many = {:.2}x ({:.0} vs {:.0} codes/s, {} first)",
                round + 1,
                o.ratio(),
                o.import_rate(),
                o.raw_rate(),
                if o.import_first { "import" } else { "raw" }
            );
        }
        rounds.push(o);
    }
    rounds.sort_by(|a, b| a.ratio().total_cmp(&b.ratio()));
    let ratios: Vec<f64> = rounds.iter().map(Outcome::ratio).collect();
    let o = rounds.swap_remove(rounds.len() / 2);
    let mut report = report_json(&o, &options);
    report["rounds"] = json!(args.rounds);
    report["round_ratios_sorted"] = json!(ratios);
    report["allow_cross_pool"] = json!(args.allow_cross_pool);
    let (rendered, path) = super::write_report(out_dir, "import.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_table(&o, &options);
        println!("rounds (sorted): {ratios:.2?}; the median round is shown");
        if args.allow_cross_pool {
            println!(
                "the import ran with --allow-cross-pool: no lookup of its codes in other pools"
            );
        }
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        o.ok,
        "the import did not insert every code (exit ok: {}, inserted {}); its output was:\n{}",
        o.child.status_ok,
        o.inserted,
        String::from_utf8_lossy(&o.child.stderr)
    );
    Ok(())
}

/// One round: generates the file, runs raw insert_many and the import
/// (the import first in odd rounds), each into a pool of the round's own
/// and with codes of its own, then counts.
async fn measure(
    args: &ImportBenchArgs,
    scratch: &'static Scratch,
    options: &ImportOptions,
    round: usize,
) -> anyhow::Result<Outcome> {
    let n = args.codes as usize;
    let say = |s: String| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    let (raw_pool, import_pool) = (format!("raw{round}"), format!("import{round}"));
    let file = TempFile(std::env::temp_dir().join(format!("{}.csv", scratch.cfg.redis_prefix)));
    say(format!("generating {} with {n} codes …", file.0.display()));
    // The file's codes, then the raw side's: none seen in an earlier round.
    let first = 2 * n * round;
    write_csv_from(&file.0, first, n).context("writing the generated CSV file")?;
    let file_mb = std::fs::metadata(&file.0).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
    let import_first = round % 2 == 1;
    // Each side starts after a checkpoint, so neither pays for the pages
    // the other left dirty (whichever went second ran up to 1.5x slower).
    let raw = || async {
        checkpoint(scratch).await?;
        say(format!(
            "raw insert_many of {n} documents into pool {raw_pool} …"
        ));
        let sizes = (options.batch_size, options.concurrency);
        raw_insert_many(scratch, &raw_pool, first + n, n, sizes).await
    };
    let raw_first = match import_first {
        false => Some(raw().await?),
        true => None,
    };
    checkpoint(scratch).await?;
    say(format!(
        "codepool import into pool {import_pool} (child process) …"
    ));
    let cpu = CpuSnapshot::take();
    let file_arg = file.0.to_string_lossy().into_owned();
    let mut import = vec!["import", &file_arg, "--pool", &import_pool, "--json"];
    if args.allow_cross_pool {
        import.push("--allow-cross-pool");
    }
    let child = codepool_child(scratch, &import).await?;
    // "codepool" includes the child process, reaped by now.
    let import_cpu = CpuSnapshot::take().since(&cpu);
    // The import announces `pool.replenished`, which declares the topology.
    if let Err(e) = super::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    let summary = summary_of(&child)?;
    let inserted = summary["inserted"].as_u64().unwrap_or(0);
    let import_seconds = summary["seconds"].as_f64().unwrap_or(0.0);
    let (raw_seconds, raw_cpu) = match raw_first {
        Some(r) => r,
        None => raw().await?,
    };
    let in_raw = count_pool(scratch, &raw_pool).await?;
    let in_import = count_pool(scratch, &import_pool).await?;
    let ok = child.status_ok && inserted == n as u64 && in_import == n as u64 && in_raw == n as u64;
    Ok(Outcome {
        n,
        file_mb,
        raw_seconds,
        raw_cpu,
        import_cpu,
        child,
        summary,
        inserted,
        import_seconds,
        in_raw,
        in_import,
        ok,
        import_first,
    })
}

/// The JSON summary `codepool import --json` printed.
fn summary_of(child: &Child) -> anyhow::Result<serde_json::Value> {
    serde_json::from_slice(&child.stdout).with_context(|| {
        format!(
            "codepool import did not print a JSON summary; its output was:\n{}",
            String::from_utf8_lossy(&child.stderr)
        )
    })
}

async fn count_pool(scratch: &Scratch, pool: &str) -> anyhow::Result<u64> {
    Ok(scratch
        .store
        .database()
        .collection::<Document>(codepool_store::codes::CODES)
        .count_documents(doc! {"pool": pool})
        .await?)
}

fn report_json(o: &Outcome, options: &ImportOptions) -> serde_json::Value {
    let ratio = o.ratio();
    json!({
        "benchmark": "import",
        "codes": o.n,
        "file_mb": o.file_mb,
        "write_concern": {"w": "majority", "j": true},
        "batch_size": options.batch_size,
        "concurrency": options.concurrency,
        "order": if o.import_first { "import first, then raw insert_many" } else { "raw insert_many first, then the import" },
        "raw_insert_many": {"seconds": o.raw_seconds, "codes_per_sec": o.raw_rate(), "cpu_seconds": super::cpu_json(&o.raw_cpu)},
        "import": {
            "seconds": o.import_seconds,
            "codes_per_sec": o.import_rate(),
            "process_wall_seconds": o.child.wall.as_secs_f64(),
            "codes_per_sec_process_wall": o.wall_rate(),
            "peak_rss_mb": o.peak_mb(),
            "cpu_seconds": super::cpu_json(&o.import_cpu),
            "summary": o.summary,
        },
        "import_over_raw": ratio,
        "import_wall_over_raw": o.wall_rate() / o.raw_rate().max(1e-9),
        "target": RATE_TARGET,
        "target_met": ratio >= RATE_TARGET,
        "memory_target_mb": MEMORY_TARGET_MB,
        "memory_target_met": o.peak_mb().map(|m| m < MEMORY_TARGET_MB),
        "checks": {"in_pool_raw": o.in_raw, "in_pool_import": o.in_import, "ok": o.ok},
    })
}

fn print_table(o: &Outcome, options: &ImportOptions) {
    let (n, file_mb, ratio) = (o.n, o.file_mb, o.ratio());
    println!(
        "import of {n} codes ({file_mb:.1} MB CSV) vs raw insert_many of the same documents built in memory; both unordered, {} per insert, {} in flight, journaled (w:majority, j:true)\n",
        options.batch_size, options.concurrency
    );
    println!("{:<34} {:>9} {:>10}", "", "seconds", "codes/s");
    let rows = [
        ("raw insert_many", o.raw_seconds, o.raw_rate()),
        (
            "codepool import (import_file)",
            o.import_seconds,
            o.import_rate(),
        ),
        (
            "codepool import (whole process)",
            o.child.wall.as_secs_f64(),
            o.wall_rate(),
        ),
    ];
    for (name, secs, rate) in rows {
        println!("{name:<34} {secs:>9.2} {rate:>10.0}");
    }
    println!(
        "\nCPU seconds: raw insert_many {}; import {}",
        describe_cpu(&o.raw_cpu),
        describe_cpu(&o.import_cpu)
    );
    let tick = |ok: bool| if ok { "✓" } else { "✗" };
    println!(
        "\nimport / raw insert_many = {ratio:.2}x (target >= {RATE_TARGET}x {}); whole process {:.2}x",
        tick(ratio >= RATE_TARGET),
        o.wall_rate() / o.raw_rate().max(1e-9)
    );
    match o.peak_mb() {
        Some(mb) => println!(
            "import peak memory (VmHWM of the child process): {mb:.1} MB (target < {MEMORY_TARGET_MB} MB {})",
            tick(mb < MEMORY_TARGET_MB)
        ),
        None => println!("import peak memory: not measurable here (no /proc)"),
    }
    println!(
        "checks {}: {} codes in the raw side's pool, {} in the import's",
        tick(o.ok),
        o.in_raw,
        o.in_import
    );
    println!(
        "({} ran first in this round; the side that goes first alternates by round)",
        if o.import_first { "the import" } else { "raw" }
    );
}

/// One code per line under a `code` header, unique, 18 characters: the
/// codes numbered `from` to `from + n` (files of other numbers share none).
pub(crate) fn write_csv_from(path: &Path, from: usize, n: usize) -> std::io::Result<()> {
    use std::io::Write;
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(w, "code")?;
    for i in from..from + n {
        writeln!(w, "{}", code(i))?;
    }
    w.flush()
}

fn code(i: usize) -> String {
    format!("BN{:04X}-{i:011}", (i.wrapping_mul(2_654_435_761)) & 0xFFFF)
}

/// Documents the baseline builds before each timed round: all of them at
/// once would not fit in memory at 10,000,000.
const RAW_ROUND: usize = 250_000;

/// The baseline: the same sealed documents `Store::insert_codes` writes
/// ([`code_documents`]), of as many other codes, built before the clock runs, inserted unordered in batches of `batch`,
/// `concurrency` in flight. Built and inserted in rounds of
/// [`RAW_ROUND`]; only the inserting is timed. Returns seconds and CPU
/// seconds per process of the inserting.
async fn raw_insert_many(
    scratch: &Scratch,
    pool: &str,
    first: usize,
    n: usize,
    (batch, concurrency): (usize, usize),
) -> anyhow::Result<(f64, Vec<(&'static str, f64)>)> {
    let batch_id = ObjectId::new();
    let coll = scratch
        .store
        .database()
        .collection::<mongodb::bson::RawDocumentBuf>(codepool_store::codes::CODES);
    let (mut seconds, mut cpu_total) = (0.0, Vec::new());
    let mut inserted = 0;
    let ring = scratch.store.keys().ring()?;
    let rule = scratch.store.fix_lookalike_rule(pool).await?;
    for round in (0..n).step_by(RAW_ROUND) {
        // Other codes than the file's (numbered from `first` on): the
        // import's cross-pool lookup would refuse the file's own otherwise.
        let codes: Vec<NewCode> = (round..(round + RAW_ROUND).min(n))
            .map(|i| NewCode {
                code: code(first + i),
                expires_at: None,
                line: Some(i as u64 + 2),
            })
            .collect();
        let docs = code_documents(&ring, pool, batch_id, &codes, round as i64 + 1, rule);
        drop(codes);
        let mut chunks: Vec<Vec<_>> = Vec::with_capacity(docs.len() / batch.max(1) + 1);
        let mut docs = docs.into_iter().peekable();
        while docs.peek().is_some() {
            chunks.push(docs.by_ref().take(batch.max(1)).collect());
        }
        let cpu = CpuSnapshot::take();
        let started = Instant::now();
        let mut stream = futures::stream::iter(chunks)
            .map(|chunk| {
                let coll = coll.clone();
                async move {
                    coll.insert_many(chunk)
                        .ordered(false)
                        .write_concern(durable())
                        .await
                }
            })
            .buffer_unordered(concurrency.max(1));
        while let Some(r) = stream.next().await {
            inserted += r.context("raw insert_many failed")?.inserted_ids.len();
        }
        seconds += started.elapsed().as_secs_f64();
        add_cpu(&mut cpu_total, CpuSnapshot::take().since(&cpu));
    }
    anyhow::ensure!(
        inserted == n,
        "raw insert_many inserted {inserted} instead of {n}"
    );
    Ok((seconds, cpu_total))
}

/// Adds CPU seconds per process of one round to the total.
fn add_cpu(total: &mut Vec<(&'static str, f64)>, round: Vec<(&'static str, f64)>) {
    for (name, secs) in round {
        match total.iter_mut().find(|(n, _)| *n == name) {
            Some((_, t)) => *t += secs,
            None => total.push((name, secs)),
        }
    }
}

/// The `codepool` binary built next to this one (`make bench` builds both).
fn codepool_binary() -> anyhow::Result<std::path::PathBuf> {
    let me = std::env::current_exe().context("cannot find the benchmark binary's own path")?;
    let exe = me.with_file_name("codepool");
    anyhow::ensure!(
        exe.exists(),
        "{} not found; build it first with `cargo build --release -p codepool` (make bench does)",
        exe.display()
    );
    Ok(exe)
}

/// What a `codepool` child process did.
pub(crate) struct Child {
    pub status_ok: bool,
    pub wall: Duration,
    pub peak_kb: Option<u64>,
    /// The child's own CPU seconds (its last reading before it exited).
    pub cpu_s: Option<f64>,
    /// The servers' CPU seconds while it ran, by process name (mongod,
    /// rabbitmq, redis).
    pub servers_s: Vec<(&'static str, f64)>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `codepool ARGS…` (e.g. `import FILE --pool POOL --json`) against
/// the scratch servers, reading its `VmHWM` every few milliseconds until
/// it exits.
pub(crate) async fn codepool_child(scratch: &Scratch, args: &[&str]) -> anyhow::Result<Child> {
    let cfg = &scratch.cfg;
    let exe = codepool_binary()?;
    let servers_before = crate::CpuSnapshot::take();
    let started = Instant::now();
    let mut child = tokio::process::Command::new(exe)
        .args(["--mongodb-uri", &cfg.mongodb_uri, "--db", &cfg.db])
        .args([
            "--redis-url",
            &cfg.redis_url,
            "--redis-prefix",
            &cfg.redis_prefix,
        ])
        .args([
            "--amqp-url",
            &cfg.amqp_url,
            "--amqp-prefix",
            &cfg.amqp_prefix,
        ])
        .arg("--key-file")
        .args(cfg.key_file.iter())
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting codepool {}", args.join(" ")))?;
    let pid = child.id();
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let stdout = tokio::spawn(async move {
        let mut buf = Vec::new();
        if let Some(o) = out.as_mut() {
            let _ = o.read_to_end(&mut buf).await;
        }
        buf
    });
    let stderr = tokio::spawn(async move {
        let mut buf = Vec::new();
        if let Some(e) = err.as_mut() {
            let _ = e.read_to_end(&mut buf).await;
        }
        buf
    });
    let (mut peak_kb, mut cpu_s): (Option<u64>, Option<f64>) = (None, None);
    let status = loop {
        // VmHWM and the CPU time only grow, so the last readings before
        // exit are the totals (give or take the last few milliseconds).
        if let Some(kb) = proc_status_kb(pid, "VmHWM") {
            peak_kb = Some(peak_kb.unwrap_or(0).max(kb));
        }
        if let Some(s) = pid.and_then(crate::cpu_seconds) {
            cpu_s = Some(s);
        }
        tokio::select! {
            status = child.wait() => break status?,
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    };
    let wall = started.elapsed();
    let mut servers_s = crate::CpuSnapshot::take().since(&servers_before);
    servers_s.retain(|(name, _)| *name != "codepool" && *name != crate::CLIENTS);
    Ok(Child {
        status_ok: status.success(),
        wall,
        peak_kb,
        cpu_s,
        servers_s,
        stdout: stdout.await.unwrap_or_default(),
        stderr: stderr.await.unwrap_or_default(),
    })
}
