//! `codepool import FILE --pool NAME`: stream a CSV file of codes into a pool.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Args;
use codepool_importer::csv_rows::CODE_COLUMN;
use codepool_importer::{import_file, Header, ImportOptions, ImportProgress, ImportSummary};
use indicatif::{ProgressBar, ProgressStyle};
use tracing::warn;

use crate::config::Config;
use crate::shutdown::Interrupt;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool import codes.csv --pool game-x
  codepool import partner.csv --pool game-x --column serial
  codepool import plain-list.txt --pool game-x --no-header
  codepool import partner-2026-11.csv --pool game-x --json > summary.json

The first row is a header, and it must name the code column: `code` (any
case), or the name given with --column. An `expires_at` column (2027-01-31 or
RFC 3339) is optional. A file without a header must be a single column of
codes and needs --no-header. Any other first row (no such column, the column
named twice, a UTF-16 file, an empty file) is refused: nothing is imported.

Invalid rows (empty, longer than 128 characters, control characters, bad
dates) are reported with their line number and skipped. So is a code that
another pool holds already (a cross-pool duplicate: a code sits in one
pool), unless --allow-cross-pool says it is meant for both. Importing the same
file again inserts nothing new. The pool is created when its first code is
imported (or beforehand with `codepool pool create`).

Exit codes: 0 every row imported or already present; 3 some rows invalid (the
valid ones are imported); 1 failure or refused file (nothing more to import
from it as is; the message says what to do); 2 usage error; 130/143 stopped
by SIGINT/SIGTERM (the codes so far are kept; run the same command again).")]
pub struct ImportArgs {
    /// CSV file of codes; - reads standard input (e.g. `gunzip -c codes.csv.gz |
    /// codepool import - --pool game-x`).
    pub file: PathBuf,
    /// Pool to import into (created when its first code lands), e.g. game-x.
    #[arg(long)]
    pub pool: String,
    /// The header's name of the column that holds the codes.
    #[arg(long, value_name = "NAME", default_value = CODE_COLUMN, conflicts_with = "no_header")]
    pub column: String,
    /// The file has no header row: a single column of codes.
    #[arg(long)]
    pub no_header: bool,
    /// Codes per insert (1 to 100000).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Import codes that another pool holds already. By default they are
    /// refused as cross-pool duplicates: a code sits in one pool.
    #[arg(long)]
    pub allow_cross_pool: bool,
}

pub async fn run(cfg: &Config, args: ImportArgs) -> anyhow::Result<u8> {
    let store = crate::context::store_creating(cfg).await?;
    // A wrong key file would seal codes nobody else can open, and its HMAC
    // would not see duplicates: check it against the stored codes first.
    store.check_keys().await?;
    if store.pool_has_plaintext(&args.pool).await? {
        anyhow::bail!("pool {:?} still holds codes in plaintext; run `codepool migrate` to encrypt them first, then import again (a plaintext and an encrypted copy of one code would not be recognised as duplicates)", args.pool);
    }
    let interrupt = Interrupt::on_signals();
    let options = ImportOptions {
        header: if args.no_header {
            Header::None
        } else {
            Header::Named(args.column.clone())
        },
        batch_size: args.batch_size as usize,
        stop: interrupt.token.clone(),
        allow_cross_pool: args.allow_cross_pool,
        ..ImportOptions::default()
    };
    let reporter = Reporter::new(std::io::stderr().is_terminal() && !args.json);
    let summary = import_file(&store, &args.file, &args.pool, &options, &|p| {
        reporter.update(p)
    })
    .await;
    reporter.finish();
    let summary = summary?;
    codepool_issuance::imports::record(&store, &summary, &super::actor("import")).await?;
    announce_replenished(cfg, &store, &summary.pool, summary.inserted).await;

    if args.json {
        say_json!(serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(&summary);
    }
    Ok(exit_code(&summary, &interrupt))
}

/// Maps what the import did to an exit code, saying why on stderr.
fn exit_code(s: &ImportSummary, interrupt: &Interrupt) -> u8 {
    if let (true, Some(code)) = (s.interrupted(), interrupt.exit_code()) {
        eprintln!(
            "import interrupted by {} after {} codes inserted; run the same command again to finish (codes already imported count as duplicates)",
            interrupt.name(),
            s.inserted
        );
        return code;
    }
    if s.cross_pool > 0 {
        eprintln!(
            "warning: {} code(s) refused because pool(s) {} hold them already; a code sits in one pool (pass --allow-cross-pool to import them anyway)",
            s.cross_pool,
            s.cross_pool_pools.join(", ")
        );
    }
    if codepool_issuance::imports::all_rows_invalid(s) {
        eprintln!(
            "error: every row of {} was invalid, nothing was imported; fix the rows listed above and import the file again",
            s.file
        );
        return crate::exit::FAILURE;
    }
    if s.invalid > 0 {
        return crate::exit::PARTIAL;
    }
    crate::exit::OK
}

/// Tells dispatchers that `inserted` new codes arrived in `pool` (they
/// fulfil backorders). Best effort: dispatchers also sweep backorders
/// periodically.
pub(crate) async fn announce_replenished(
    cfg: &Config,
    store: &codepool_store::Store,
    pool: &str,
    inserted: u64,
) {
    if inserted == 0 {
        return;
    }
    let result = async {
        let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-import").await?;
        let publisher = codepool_broker::Publisher::new(&conn, cfg.topology()).await?;
        cfg.topology()
            .declare_checked(&conn, publisher.channel())
            .await?;
        let announced =
            codepool_issuance::controls::announce_replenished(store, &publisher, pool, inserted)
                .await;
        codepool_broker::close(conn, "done").await;
        announced
    }
    .await;
    if let Err(e) = result {
        warn!(error = %e, "could not publish pool.replenished; dispatchers will still fulfil backorders at their next sweep");
    }
}

fn print_summary(s: &ImportSummary) {
    let verb = if s.interrupted() {
        "partly imported (interrupted)"
    } else {
        "imported"
    };
    say!("{verb} {} into pool {:?}", s.file, s.pool);
    say!("  rows        {}", s.rows);
    say!("  inserted    {}", s.inserted);
    say!("  duplicates  {}", s.duplicates);
    say!("  invalid     {}", s.invalid);
    if s.lookalikes > 0 {
        say!("  lookalikes  {} (of the invalid)", s.lookalikes);
    }
    if s.cross_pool > 0 {
        say!(
            "  cross-pool  {} (of the invalid; held by pool {})",
            s.cross_pool,
            s.cross_pool_pools.join(", ")
        );
    }
    say!("  seconds     {:.2}", s.seconds);
    say!("  codes/s     {:.0}", s.codes_per_second);
    say!("  sha256      {}", s.sha256);
    if !s.invalid_rows.is_empty() {
        say!("invalid rows (skipped; fix them and import the file again):");
        for row in s.invalid_rows.iter().take(20) {
            say!("  line {}: {}", row.line, row.reason);
        }
        if s.invalid > 20 {
            say!(
                "  … and {} more (use --json for up to 1000)",
                s.invalid - 20
            );
        }
    }
}

/// A progress bar on a terminal, a line every few seconds otherwise.
struct Reporter {
    bar: Option<ProgressBar>,
    last_line: Mutex<Instant>,
}

impl Reporter {
    fn new(terminal: bool) -> Self {
        let bar = terminal.then(|| {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        Self {
            bar,
            last_line: Mutex::new(Instant::now()),
        }
    }

    fn update(&self, p: ImportProgress) {
        let msg = format!(
            "{} rows, {} inserted, {} duplicates, {} invalid",
            p.rows, p.inserted, p.duplicates, p.invalid
        );
        if let Some(bar) = &self.bar {
            bar.set_length(p.total_bytes);
            bar.set_position(p.bytes_read);
            bar.set_message(msg);
        } else if let Ok(mut last) = self.last_line.lock() {
            if last.elapsed() >= Duration::from_secs(2) {
                *last = Instant::now();
                let pct = if p.total_bytes > 0 {
                    100.0 * p.bytes_read as f64 / p.total_bytes as f64
                } else {
                    100.0
                };
                eprintln!("import: {pct:5.1}% {msg}");
            }
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
