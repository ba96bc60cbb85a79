//! `codepool export`: a pool's codes as CSV for reconciliation with the
//! partner, streamed (flat memory), codes masked unless --reveal.

use std::io::{BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::Args;
use codepool_domain::{Code, CodeStatus};
use codepool_store::export::ExportFilter;
use futures::TryStreamExt;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool export --pool game-x --out game-x.csv
  codepool export --pool game-x --status used --since 2026-11-01T00:00:00Z --out used.csv
  codepool export --pool game-x --status issued,used,void --reveal --out reconcile.csv
  codepool export --import RUN_ID --reveal --out for-the-platform.csv

With --import, only the codes of that import or generation run, of every
status unless --status says otherwise, codes held by a checkout included
(a generation run's file for the platform that honours its codes: a held
code is sold once its hold is paid); --pool may then be left out. An
export of a pool never shows a held code.

Columns: pool, code, status, order_id, line, uid, grant_no, issued_at,
used_at, voided_at, void_reason, sms: one row per code, so an order of
several codes has a row for each of its lines (0 to quantity - 1). Codes are masked unless --reveal; a reveal is
recorded in the audit collection (user, host, what, when) before the file is
written. The file is created with mode 0600 and appears only when complete:
rows go to a new temporary file beside it (created exclusively), which is
removed on any error, SIGINT or SIGTERM. A target that exists and is not a
regular file (a directory, a device, a FIFO) is refused before anything is
written; an existing file is replaced only with --force, and the key file
(CODEPOOL_KEY_FILE) never. A cell that starts
with =, +, -, @, a tab or a carriage return gets a leading ' so that a
spreadsheet shows it as text instead of running it (OWASP CSV injection).")]
pub struct ExportArgs {
    /// The pool to export.
    #[arg(long, required_unless_present = "import")]
    pub pool: Option<String>,
    /// Only the codes of this import or generation run (its id).
    #[arg(long, value_name = "ID", value_parser = parse_import_id)]
    pub import: Option<bson::oid::ObjectId>,
    /// Statuses to include, comma-separated: unissued, issued, used, void,
    /// and held with --import (default issued,used,void; every status with
    /// --import).
    #[arg(long, value_delimiter = ',', value_parser = parse_status)]
    pub status: Vec<CodeStatus>,
    /// Only codes created, issued, used or voided at or after this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Write codes in clear text (recorded in the audit collection).
    #[arg(long)]
    pub reveal: bool,
    /// The CSV file to write.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Replace --out if it is an existing regular file.
    #[arg(long)]
    pub force: bool,
}

fn parse_status(s: &str) -> Result<CodeStatus, String> {
    CodeStatus::from_name(s).ok_or_else(|| {
        format!("{s:?} is not a status; use unissued, issued, used, void or (with --import) held")
    })
}

fn parse_import_id(s: &str) -> Result<bson::oid::ObjectId, String> {
    bson::oid::ObjectId::parse_str(s).map_err(|_| {
        format!("{s:?} is not an import id; give the 24 hexadecimal digits an import or generation run printed")
    })
}

/// The filter of the export: the pool (the run's, with --import) and the
/// statuses (every one for a run, unless named).
async fn filter_of(
    store: &codepool_store::Store,
    args: &ExportArgs,
) -> anyhow::Result<ExportFilter> {
    let mut statuses = args.status.clone();
    let pool = match (args.import, &args.pool) {
        (Some(id), pool) => {
            let Some(run) = store.import_record(id).await? else {
                anyhow::bail!("no import or generation run {id}; `codepool stats` and the imports of a pool list them");
            };
            if pool.as_ref().is_some_and(|p| *p != run.pool) {
                anyhow::bail!(
                    "run {id} is in pool {:?}, not {:?}; leave --pool out or name its pool",
                    run.pool,
                    pool.as_deref().unwrap_or_default()
                );
            }
            if statuses.is_empty() {
                statuses = CodeStatus::ALL.to_vec();
            }
            run.pool
        }
        (None, Some(pool)) => pool.clone(),
        (None, None) => anyhow::bail!("give --pool NAME or --import ID"),
    };
    if statuses.is_empty() {
        statuses = vec![CodeStatus::Issued, CodeStatus::Used, CodeStatus::Void];
    }
    Ok(ExportFilter {
        pool,
        statuses,
        since: args.since,
        import: args.import,
    })
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{s:?} is not an RFC 3339 time like 2026-11-01T00:00:00Z: {e}"))
}

const HEADER: [&str; 12] = [
    "pool",
    "code",
    "status",
    "order_id",
    "line",
    "uid",
    "grant_no",
    "issued_at",
    "used_at",
    "voided_at",
    "void_reason",
    "sms",
];

/// One code's row. A code a checkout hold or a bundle set aside (voided
/// while held) has no order: its holder cells are empty, never the
/// hold's internal key.
fn row(c: &Code, reveal: bool) -> [String; 12] {
    let h = c.order_holder();
    let t = |t: Option<DateTime<Utc>>| t.map(|t| t.to_rfc3339()).unwrap_or_default();
    let cells = [
        c.pool.clone(),
        if reveal { c.code.clone() } else { c.masked() },
        c.status.name().to_owned(),
        h.map(|h| h.order_id.clone()).unwrap_or_default(),
        h.map(|h| h.line.to_string()).unwrap_or_default(),
        h.map(|h| h.uid.clone()).unwrap_or_default(),
        h.and_then(|h| h.grant_no.clone()).unwrap_or_default(),
        t(h.map(|h| h.issued_at)),
        t(c.used_at),
        t(c.voided_at),
        c.void_reason.clone().unwrap_or_default(),
        c.sms_state().name().to_owned(),
    ];
    cells.map(|cell| codepool_domain::spreadsheet_cell(&cell).into_owned())
}

/// Refuses a target that is not a place for a new CSV file: one that
/// exists and is not a regular file (a directory, a device such as
/// /dev/full, a FIFO), or an existing file without `--force`. Checked
/// before anything is revealed or written, and again before the rename.
fn check_target(out: &Path, force: bool, key_file: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let key = std::fs::metadata(key_file).ok();
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => anyhow::bail!("cannot check {}: {e}; give a writable file path", out.display()),
        Ok(m) if m.is_dir() => anyhow::bail!(
            "{} is a directory; give the path of a file to create, e.g. {}",
            out.display(),
            out.join("export.csv").display()
        ),
        Ok(m) if !m.is_file() => anyhow::bail!(
            "{} exists and is not a regular file (a device, a FIFO or a link); nothing was written. Give the path of a new file",
            out.display()
        ),
        Ok(m) if key.is_some_and(|k| (k.dev(), k.ino()) == (m.dev(), m.ino())) => anyhow::bail!(
            "{} is the key file that encrypts the codes (CODEPOOL_KEY_FILE); replacing it would make every code unreadable, so it is never an export target, not even with --force. Give another path",
            out.display()
        ),
        Ok(_) if !force => anyhow::bail!(
            "{} exists; nothing was written. Give a new path, or --force to replace it",
            out.display()
        ),
        Ok(_) => Ok(()),
    }
}

/// The export's temporary file, beside the target: created exclusively
/// (never an existing file or a link), and removed when dropped unless
/// the export was moved into place.
struct Partial {
    path: PathBuf,
    kept: bool,
}

impl Partial {
    fn create(out: &Path) -> anyhow::Result<(Self, std::fs::File)> {
        let name = out.file_name().unwrap_or_default().to_string_lossy();
        let tag = format!(
            ".{name}.{}.{:08x}.partial",
            std::process::id(),
            rand::random::<u32>()
        );
        let path = out.with_file_name(tag);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| {
                format!(
                    "cannot create a file in the folder of {}; check the folder exists and is writable",
                    out.display()
                )
            })?;
        Ok((Self { path, kept: false }, file))
    }

    fn move_to(mut self, out: &Path, force: bool, key_file: &Path) -> anyhow::Result<()> {
        check_target(out, force, key_file)?;
        std::fs::rename(&self.path, out)
            .with_context(|| format!("cannot move the export to {}", out.display()))?;
        self.kept = true;
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

pub async fn run(cfg: &Config, args: ExportArgs) -> anyhow::Result<u8> {
    let key_file = cfg.key_path();
    check_target(&args.out, args.force, &key_file)?;
    let store = crate::context::store(cfg).await?;
    store.keys().ring()?;
    let filter = filter_of(&store, &args).await?;
    let total = store.count_export(&filter).await?;
    if args.reveal {
        let statuses: Vec<&str> = filter.statuses.iter().map(|s| s.name()).collect();
        let run = (args.import).map_or(String::new(), |id| format!(" import {id}"));
        let what = format!(
            "pool {:?}{run} statuses {} since {} to {}",
            filter.pool,
            statuses.join(","),
            args.since.map_or("-".into(), |t| t.to_rfc3339()),
            args.out.display()
        );
        super::reveal::record(&store, "export --reveal", what, Vec::new(), total).await?;
    }
    let (partial, file) = Partial::create(&args.out)?;
    let interrupt = crate::shutdown::Interrupt::on_signals();
    let bar = super::keys::progress(total, "exporting");
    let written = tokio::select! {
        written = write_rows(&store, &filter, file, args.reveal, &bar) => written,
        () = interrupt.token.cancelled() => {
            bar.finish_and_clear();
            drop(partial);
            eprintln!("export stopped by {}; nothing was written to {}", interrupt.name(), args.out.display());
            return Ok(interrupt.exit_code().unwrap_or(crate::exit::FAILURE));
        }
    };
    bar.finish_and_clear();
    let written = written.with_context(|| {
        format!(
            "the export to {} failed and left nothing behind",
            args.out.display()
        )
    })?;
    partial.move_to(&args.out, args.force, &key_file)?;
    let shown = if args.reveal {
        "in clear text"
    } else {
        "masked"
    };
    say!(
        "exported {written} code(s) of pool {:?} to {} (codes {shown}; formula-like cells start with ')",
        filter.pool,
        args.out.display()
    );
    Ok(crate::exit::OK)
}

/// Streams the filtered codes into `file` as CSV; the number of rows.
async fn write_rows(
    store: &codepool_store::Store,
    filter: &ExportFilter,
    file: std::fs::File,
    reveal: bool,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<u64> {
    let mut csv = csv::Writer::from_writer(BufWriter::new(file));
    csv.write_record(HEADER)?;
    let mut codes = std::pin::pin!(store.export_codes(filter).await?);
    let mut written = 0u64;
    while let Some(code) = codes.try_next().await? {
        csv.write_record(row(&code, reveal))?;
        written += 1;
        bar.inc(1);
    }
    let mut inner = csv
        .into_inner()
        .map_err(|e| anyhow::anyhow!("cannot write: {}", e.error()))?;
    inner.flush()?;
    inner.get_ref().sync_all()?;
    Ok(written)
}
