//! `codepool generate --pool NAME --count N`: make codes in a pool instead
//! of importing them, as a run that recall, stats and export see like a
//! file.

use std::io::IsTerminal;

use chrono::{DateTime, Utc};
use clap::Args;
use codepool_domain::pattern::{DEFAULT_PATTERN, SAFE_RANDOM_BITS};
use codepool_domain::CodePattern;
use codepool_importer::{GenerateOptions, GenerateProgress, GenerateSummary, Generation};
use codepool_store::imports::RunState;
use codepool_store::ObjectId;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;
use crate::shutdown::Interrupt;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool generate --pool game-x --count 200000
  codepool generate --pool game-x --count 50000 --pattern 'GX-{random:12}' --check-char
  codepool generate --pool game-x --count 1000 --pattern 'GX-{number}-{random:12}'
  codepool generate --pool game-x --count 200000 --run-id 6566b0c2f1a2b3c4d5e6f708
  codepool export --pool game-x --import RUN_ID --reveal --out for-the-platform.csv

A pattern is fixed text (letters, digits, '-', '_', '.') and tokens:
{random:N} N random Crockford base-32 symbols (0-9, A-Z without I, L, O, U;
5 bits each) from the operating system's random generator; {number} the
pool's daily number (yyyyMMdd and a counter); {check} a Crockford mod-37
check symbol over the whole code before it, hyphens ignored (--check-char
appends it; the fixed text must then be base-32 symbols and hyphens).
A pattern under 40 random bits is refused; under 60 bits codes can be
guessed by someone who tries many.

A code that collides with one of any pool (or a look-alike of one) is drawn
again. The run is an import with its own id: `codepool void --import ID`
recalls it. Its id is printed before any code is made (on stderr, and with
--json as the first line on stdout, with its run_id and status running; the
summary is the last line). Run the same command again after a failure or a
kill: it takes up the unfinished run of the same pool, pattern, count, check
symbol and expiry (as an import takes up its file's), counts the codes the
run made and makes only the rest. --run-id names the run to make or finish;
--new-run makes a second run of the same codes' pattern and count instead.

Exit codes: 0 the run holds its count; 1 failure (run it again with the same
--run-id); 2 usage error or a refused pattern (nothing written); 130/143
stopped by SIGINT/SIGTERM (run it again with the same --run-id).")]
pub struct GenerateArgs {
    /// Pool to generate into (created when its first code lands).
    #[arg(long)]
    pub pool: String,
    /// How many codes the run makes in all.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub count: u64,
    /// The codes' pattern.
    #[arg(long, default_value = DEFAULT_PATTERN)]
    pub pattern: String,
    /// End every code with a Crockford check symbol.
    #[arg(long)]
    pub check_char: bool,
    /// When the codes expire (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    pub expires_at: Option<DateTime<Utc>>,
    /// The run to make or finish (24 hexadecimal digits); when absent, the
    /// unfinished run of the same pool, pattern and count, else a new one.
    #[arg(long, value_parser = parse_run_id)]
    pub run_id: Option<ObjectId>,
    /// A new run even when an unfinished run of the same pool, pattern and
    /// count exists (that run stays unfinished).
    #[arg(long, conflicts_with = "run_id")]
    pub new_run: bool,
    /// Codes per insert (1 to 100000).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{s:?} is not an RFC 3339 time like 2027-01-31T00:00:00Z: {e}"))
}

fn parse_run_id(s: &str) -> Result<ObjectId, String> {
    ObjectId::parse_str(s).map_err(|_| {
        format!(
            "{s:?} is not a run id; give 24 hexadecimal digits, e.g. one an earlier run printed"
        )
    })
}

pub async fn run(cfg: &Config, args: GenerateArgs) -> anyhow::Result<u8> {
    let pattern = match CodePattern::parse(&args.pattern, args.check_char) {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "error: pattern {:?} refused: {e}; nothing was generated",
                args.pattern
            );
            return Ok(crate::exit::USAGE);
        }
    };
    if pattern.random_bits() < SAFE_RANDOM_BITS {
        eprintln!("warning: {} random bits; under {SAFE_RANDOM_BITS} codes can be guessed by someone who tries many (use {{random:12}} or more)", pattern.random_bits());
    }
    let store = crate::context::store_creating(cfg).await?;
    store.check_keys().await?;
    if store.pool_has_plaintext(&args.pool).await? {
        anyhow::bail!("pool {:?} still holds codes in plaintext; run `codepool migrate` to encrypt them first, then generate again", args.pool);
    }
    let numbers = codepool_sequence::DailyNumbers::from_url(
        Some(&cfg.redis_url),
        store.database().clone(),
        &cfg.redis_prefix,
        chrono_tz::UTC,
    )?;
    let interrupt = Interrupt::on_signals();
    let mut generation = Generation {
        pool: args.pool.clone(),
        count: args.count,
        pattern,
        expires_at: args.expires_at,
        run_id: args.run_id,
    };
    let resumed = match run_to_take_up(&store, &generation, args.new_run).await? {
        Ok(resumed) => resumed,
        Err(exit) => return Ok(exit),
    };
    let id = resumed.unwrap_or_else(|| generation.run_id.unwrap_or_default());
    generation.run_id = Some(id);
    // The record first, so that the id printed next names a run even if
    // this process dies before its first code.
    codepool_importer::generate::open_run(&store, &generation).await?;
    name_the_run(args.json, &generation.pool, id, resumed.is_some())?;
    let options = GenerateOptions {
        batch_size: args.batch_size as usize,
        stop: interrupt.token.clone(),
        ..GenerateOptions::default()
    };
    let bar = progress_bar(args.count, std::io::stderr().is_terminal() && !args.json);
    let summary = codepool_importer::generate(
        &store,
        Some(&numbers),
        &generation,
        &options,
        &|p: GenerateProgress| bar.set_position(p.inserted),
    )
    .await;
    bar.finish_and_clear();
    let summary = summary?;
    let actor = super::actor("generate");
    codepool_issuance::generations::record(&store, &summary, &actor).await?;
    super::import::announce_replenished(cfg, &store, &summary.pool, summary.inserted_now).await;
    if args.json {
        say_json!(serde_json::to_string(&summary)?);
    } else {
        print_summary(&summary);
    }
    Ok(interrupted(&interrupt, &summary).unwrap_or(crate::exit::OK))
}

/// The exit code of a run a signal interrupted, said with how to finish it.
fn interrupted(interrupt: &Interrupt, summary: &GenerateSummary) -> Option<u8> {
    let code = interrupt.exit_code()?;
    if summary.status != RunState::Interrupted {
        return None;
    }
    eprintln!(
        "generation interrupted by {} with {} of {} codes made; run it again with --run-id {} to finish",
        interrupt.name(),
        summary.inserted,
        summary.count,
        summary.run_id
    );
    Some(code)
}

/// The unfinished run of the same pool, pattern and count that this
/// command takes up (none without one, with `--run-id` or `--new-run`);
/// `Err(exit code)` when another process is making it now.
async fn run_to_take_up(
    store: &codepool_store::Store,
    generation: &Generation,
    new_run: bool,
) -> anyhow::Result<Result<Option<ObjectId>, u8>> {
    if generation.run_id.is_some() || new_run {
        return Ok(Ok(None));
    }
    let Some(r) = codepool_importer::generate::unfinished_run(store, generation).await? else {
        return Ok(Ok(None));
    };
    if r.being_made() {
        // Its process may be alive, or killed a moment ago (its lease has
        // not lapsed yet): either way the run is finished by its id, never
        // by a second run beside it.
        let until = (r.lease_until)
            .and_then(|t| t.try_to_rfc3339_string().ok())
            .unwrap_or_default();
        eprintln!(
            "error: run {id} of the same pool, pattern and count is being made by another process, \
             or was until that process died (its lease runs to {until}); to finish it, pass \
             --run-id {id}, which waits for a dead process's lease to lapse, or run the same \
             command again after then. (--new-run makes a second full run beside it.)",
            id = r.id
        );
        return Ok(Err(crate::exit::FAILURE));
    }
    eprintln!(
        "taking up run {} of the same pool, pattern and count, which did not finish ({}, {} of {} codes recorded); pass --new-run for a second run instead",
        r.id, r.status, r.inserted, generation.count
    );
    Ok(Ok(Some(r.id)))
}

/// Names the run before any code is made: a first JSON line with
/// `--json`, else a line on stderr.
fn name_the_run(json: bool, pool: &str, id: ObjectId, resumed: bool) -> anyhow::Result<()> {
    if json {
        let first = serde_json::json!({
            "run_id": id.to_hex(),
            "pool": pool,
            "status": RunState::Running,
            "resumed": resumed,
        });
        say_json!(first.to_string());
        use std::io::Write;
        std::io::stdout().flush()?;
    } else {
        eprintln!("generation run {id} (run the same command to finish it if it stops)");
    }
    Ok(())
}

/// A bar of codes made on a terminal; hidden otherwise.
fn progress_bar(count: u64, terminal: bool) -> ProgressBar {
    if !terminal {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(count);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} codes")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

fn print_summary(s: &GenerateSummary) {
    say!("generated into pool {:?} (run {})", s.pool, s.run_id);
    say!("  pattern     {}", s.pattern);
    say!("  status      {}", s.status);
    say!("  codes       {} of {}", s.inserted, s.count);
    say!("  made now    {}", s.inserted_now);
    say!("  redrawn     {}", s.redrawn);
    say!("  random bits {}", s.random_bits);
    say!("  seconds     {:.2}", s.seconds);
}
