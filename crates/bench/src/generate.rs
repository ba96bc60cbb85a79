//! `codepool-bench generate`: `codepool generate` against `codepool import`
//! of a file of as many codes, each a child process of its own (so its peak
//! memory is its own), in one run on the same servers, each run into the
//! emptied database; then a statement of the imported pool, timed, which
//! must tie out.
//!
//! Issue 56's goals: generation at least as fast as the import, each under
//! 100 MB of peak memory, and a statement over 1,000,000 codes under 5 s.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use codepool_issuance::statements::{self, Asked};
use serde_json::json;

use crate::import::{codepool_child, write_csv_from, Child, TempFile};
use crate::inproc::checkpoint;
use crate::Scratch;

const RATE_TARGET: f64 = 1.0;
const MEMORY_TARGET_MB: f64 = 100.0;
const STATEMENT_TARGET_SECONDS: f64 = 5.0;

/// Measure generation against import, and a statement over the codes.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:\n  codepool-bench generate --codes 1000000")]
pub struct GenerateBenchArgs {
    /// Codes generated, and codes in the imported file.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1000..=10_000_000))]
    pub codes: u64,
    /// Statements timed (the median is reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub statements: u32,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A child's run: seconds by its own summary, codes, peak MB.
struct Side {
    child: Child,
    summary: serde_json::Value,
}

impl Side {
    fn of(child: Child, what: &str) -> anyhow::Result<Side> {
        let summary = serde_json::from_slice(&child.stdout).with_context(|| {
            format!(
                "codepool {what} printed no JSON summary; its output was:\n{}",
                String::from_utf8_lossy(&child.stderr)
            )
        })?;
        Ok(Side { child, summary })
    }
    fn codes(&self) -> u64 {
        self.summary["inserted"].as_u64().unwrap_or(0)
    }
    fn seconds(&self) -> f64 {
        self.summary["seconds"].as_f64().unwrap_or(0.0)
    }
    fn rate(&self) -> f64 {
        self.codes() as f64 / self.seconds().max(1e-9)
    }
    fn peak_mb(&self) -> Option<f64> {
        self.child.peak_kb.map(|k| k as f64 / 1024.0)
    }
    /// mongod's CPU seconds while this run went.
    fn mongod_s(&self) -> f64 {
        (self.child.servers_s.iter())
            .filter(|(n, _)| *n == "mongod")
            .map(|(_, s)| s)
            .sum()
    }
    fn json(&self) -> serde_json::Value {
        json!({
            "codepool_cpu_seconds": self.child.cpu_s,
            "servers_cpu_seconds": self.child.servers_s.iter().map(|(n, s)| (n.to_string(), json!(s))).collect::<serde_json::Map<_, _>>(),
            "codes": self.codes(),
            "seconds": self.seconds(),
            "codes_per_sec": self.rate(),
            "process_wall_seconds": self.child.wall.as_secs_f64(),
            "peak_rss_mb": self.peak_mb(),
            "exit_ok": self.child.status_ok,
        })
    }
}

/// Runs the benchmark; writes `out_dir/generate.json`.
pub async fn run(
    args: GenerateBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let n = args.codes;
    let say = |s: String| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    let (import, generate) = both_runs(scratch, n, &say).await?;
    if let Err(e) = crate::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    say(format!("{} statements of pool imported …", args.statements));
    let (times, s) = statements_timed(scratch, args.statements).await?;
    let median = times[times.len() / 2];
    let ties_out = s.discrepancies().is_empty() && s.total.received == n;
    let ratio = generate.rate() / import.rate().max(1e-9);
    let ok = import.ok(n) && generate.ok(n) && ties_out;
    let mem_ok = [import.peak_mb(), generate.peak_mb()]
        .iter()
        .all(|m| m.is_some_and(|m| m < MEMORY_TARGET_MB));
    let report = json!({
        "benchmark": "generate",
        "codes": n,
        "import": import.json(),
        "generate": generate.json(),
        "generate_over_import": ratio,
        "target": RATE_TARGET,
        "target_met": ratio >= RATE_TARGET,
        "memory_target_mb": MEMORY_TARGET_MB,
        "memory_target_met": mem_ok,
        "statement": {
            "codes": s.total.received,
            "seconds_median": median,
            "seconds_each": times,
            "ties_out": ties_out,
            "target_seconds": STATEMENT_TARGET_SECONDS,
            "target_met": median < STATEMENT_TARGET_SECONDS,
        },
        "ok": ok,
    });
    let (rendered, written) = crate::write_report(out_dir, "generate.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_table(n, &import, &generate, median, ties_out);
        println!("written to {}", written.display());
    }
    anyhow::ensure!(
        ok,
        "the runs did not make every code or the statement did not tie out: import {}, generate {}; generate's output:\n{}",
        import.codes(),
        generate.codes(),
        generate.stderr()
    );
    Ok(())
}

/// Import and generation in turn, A B B A, each run from the same state:
/// the scratch database emptied and migrated again, then a checkpoint
/// ([`fresh_database`]). `codepool import` of a file of `n` codes into
/// pool `imported`, `codepool generate` of `n` codes into pool
/// `generated`, twice each. Each side is both its runs. The last import's
/// codes stay for the statement.
///
/// Before, the runs went one after the other into one database. mongod's
/// cost per code grows with the collection, so the later runs paid more,
/// and the order of the runs decided the ratio. An untimed warm-up goes
/// first, as before: the first run after the servers start is the
/// cheapest of all.
async fn both_runs(
    scratch: &Scratch,
    n: u64,
    say: &dyn Fn(String),
) -> anyhow::Result<(Sides, Sides)> {
    let files: Vec<TempFile> = (0..2)
        .map(|k| TempFile(std::env::temp_dir().join(format!("{}-gen{k}.csv", scratch.cfg.db))))
        .collect();
    for (k, file) in files.iter().enumerate() {
        say(format!("writing {} with {n} codes …", file.0.display()));
        write_csv_from(&file.0, k * n as usize, n as usize).context("writing the CSV file")?;
    }
    let import = |k: usize| {
        let path = files[k].0.to_string_lossy().into_owned();
        say("codepool import into pool imported of an empty database (child process) …".into());
        async move {
            fresh_database(scratch).await?;
            Side::of(
                codepool_child(scratch, &["import", &path, "--pool", "imported", "--json"]).await?,
                "import",
            )
        }
    };
    let generate = |count: u64| {
        say(format!("codepool generate of {count} codes into pool generated of an empty database (child process) …"));
        async move {
            fresh_database(scratch).await?;
            let count = count.to_string();
            let args = [
                "generate",
                "--pool",
                "generated",
                "--count",
                &count,
                "--json",
            ];
            Side::of(codepool_child(scratch, &args).await?, "generate")
        }
    };
    // Untimed: the first run after the servers start runs faster than
    // any after it, emptied database or not (mongod's cache and its
    // lazily dropped files), more than A B B A cancels. Measured by hand
    // at 1659ade, 200,000 codes each: 11.1 CPU s of mongod for the first
    // run, 14.1-16.7 s for the next nine, generation and import alike.
    say("warm-up, untimed:".into());
    let warmed = generate((n / 4).max(1)).await?;
    anyhow::ensure!(
        warmed.child.status_ok,
        "the warm-up generation failed: {}",
        String::from_utf8_lossy(&warmed.child.stderr)
    );
    let a1 = import(0).await?;
    let b1 = generate(n).await?;
    let b2 = generate(n).await?;
    let a2 = import(1).await?;
    Ok((Sides([a1, a2]), Sides([b1, b2])))
}

/// Empties the scratch database, migrates it again (its indexes, empty)
/// and has MongoDB write its dirty pages: every timed run starts from the
/// same state, and none pays for the pages of the run before.
async fn fresh_database(scratch: &Scratch) -> anyhow::Result<()> {
    (scratch.store.drop_database().await).context("emptying the benchmark database")?;
    codepool::context::store_creating(&scratch.cfg)
        .await
        .context("migrating the emptied benchmark database")?;
    checkpoint(scratch).await
}

/// A side's two runs.
struct Sides([Side; 2]);

impl Sides {
    fn codes(&self) -> u64 {
        self.0.iter().map(Side::codes).sum()
    }
    fn seconds(&self) -> f64 {
        self.0.iter().map(Side::seconds).sum()
    }
    /// Both runs' codes over both runs' seconds.
    fn rate(&self) -> f64 {
        self.codes() as f64 / self.seconds().max(1e-9)
    }
    fn peak_mb(&self) -> Option<f64> {
        let peaks: Option<Vec<f64>> = self.0.iter().map(Side::peak_mb).collect();
        peaks.and_then(|p| p.into_iter().reduce(f64::max))
    }
    /// mongod's and the command's own CPU, microseconds per code.
    fn cpu_us_per_code(&self) -> (f64, f64) {
        let n = self.codes().max(1) as f64;
        let mongod: f64 = self.0.iter().map(Side::mongod_s).sum();
        let own: f64 = self.0.iter().filter_map(|s| s.child.cpu_s).sum();
        (mongod * 1e6 / n, own * 1e6 / n)
    }
    /// mongod's cores busy, on average, while the runs went.
    fn mongod_cores(&self) -> f64 {
        let mongod: f64 = self.0.iter().map(Side::mongod_s).sum();
        let wall: f64 = self.0.iter().map(|s| s.child.wall.as_secs_f64()).sum();
        mongod / wall.max(1e-9)
    }
    fn ok(&self, n: u64) -> bool {
        self.0.iter().all(|s| s.child.status_ok && s.codes() == n)
    }
    fn json(&self) -> serde_json::Value {
        let (mongod_us, own_us) = self.cpu_us_per_code();
        json!({
            "codes_per_sec": self.rate(),
            "peak_rss_mb": self.peak_mb(),
            "mongod_cpu_us_per_code": mongod_us,
            "own_cpu_us_per_code": own_us,
            "mongod_cores_busy": self.mongod_cores(),
            "runs": self.0.iter().map(Side::json).collect::<Vec<_>>(),
        })
    }
    fn stderr(&self) -> String {
        (self.0.iter())
            .map(|s| String::from_utf8_lossy(&s.child.stderr).into_owned())
            .collect()
    }
}

/// `rounds` statements of pool `imported`: their seconds, sorted, and the
/// last statement.
async fn statements_timed(
    scratch: &Scratch,
    rounds: u32,
) -> anyhow::Result<(Vec<f64>, statements::Statement)> {
    let asked = Asked {
        pool: "imported".into(),
        import: None,
        from: None,
        to: None,
        channel: None,
    };
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..rounds {
        let started = Instant::now();
        let s = statements::statement(&scratch.store, &asked).await?;
        times.push(started.elapsed().as_secs_f64());
        last = Some(s);
    }
    times.sort_by(f64::total_cmp);
    Ok((times, last.context("no statement was made")?))
}

fn print_table(n: u64, import: &Sides, generate: &Sides, statement: f64, ties_out: bool) {
    let tick = |ok: bool| if ok { "✓" } else { "✗" };
    println!("{n} codes generated against {n} imported from a file, twice each (import, generate, generate, import) after an untimed warm-up, each a child process into an emptied database, journaled (w:majority, j:true)\n");
    println!(
        "{:<22} {:>9} {:>10} {:>12} {:>14} {:>14} {:>12}",
        "", "seconds", "codes/s", "peak RSS MB", "mongod µs/code", "own µs/code", "mongod cores"
    );
    for (name, side) in [("codepool import", import), ("codepool generate", generate)] {
        let (mongod_us, own_us) = side.cpu_us_per_code();
        println!(
            "{name:<22} {:>9.2} {:>10.0} {:>12} {:>14.1} {:>14.1} {:>12.2}",
            side.seconds(),
            side.rate(),
            side.peak_mb().map_or("-".into(), |m| format!("{m:.1}")),
            mongod_us,
            own_us,
            side.mongod_cores()
        );
    }
    let ratio = generate.rate() / import.rate().max(1e-9);
    println!(
        "\ngenerate / import = {ratio:.2}x (target >= {RATE_TARGET}x {})",
        tick(ratio >= RATE_TARGET)
    );
    let mem_ok = [import.peak_mb(), generate.peak_mb()]
        .iter()
        .all(|m| m.is_some_and(|m| m < MEMORY_TARGET_MB));
    println!(
        "peak memory under {MEMORY_TARGET_MB} MB each {}",
        tick(mem_ok)
    );
    println!(
        "statement over the {n} imported codes: {statement:.2} s median (target < {STATEMENT_TARGET_SECONDS} s {}); ties out {}",
        tick(statement < STATEMENT_TARGET_SECONDS),
        tick(ties_out)
    );
}
