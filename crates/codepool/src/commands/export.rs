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

Columns: pool, code, status, order_id, uid, grant_no, issued_at, used_at,
voided_at, void_reason, sms. Codes are masked unless --reveal; a reveal is
recorded in the audit collection (user, host, what, when) before the file is
written. The file is created with mode 0600 and appears only when complete.")]
pub struct ExportArgs {
    /// The pool to export.
    #[arg(long)]
    pub pool: String,
    /// Statuses to include, comma-separated: unissued, issued, used, void.
    #[arg(long, value_delimiter = ',', value_parser = parse_status, default_value = "issued,used,void")]
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
}

fn parse_status(s: &str) -> Result<CodeStatus, String> {
    CodeStatus::from_name(s)
        .ok_or_else(|| format!("{s:?} is not a status; use unissued, issued, used or void"))
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{s:?} is not an RFC 3339 time like 2026-11-01T00:00:00Z: {e}"))
}

const HEADER: [&str; 11] = [
    "pool",
    "code",
    "status",
    "order_id",
    "uid",
    "grant_no",
    "issued_at",
    "used_at",
    "voided_at",
    "void_reason",
    "sms",
];

fn row(c: &Code, reveal: bool) -> [String; 11] {
    let h = c.holder.as_ref();
    let t = |t: Option<DateTime<Utc>>| t.map(|t| t.to_rfc3339()).unwrap_or_default();
    [
        c.pool.clone(),
        if reveal { c.code.clone() } else { c.masked() },
        c.status.name().to_owned(),
        h.map(|h| h.order_id.clone()).unwrap_or_default(),
        h.map(|h| h.uid.clone()).unwrap_or_default(),
        h.and_then(|h| h.grant_no.clone()).unwrap_or_default(),
        t(h.map(|h| h.issued_at)),
        t(c.used_at),
        t(c.voided_at),
        c.void_reason.clone().unwrap_or_default(),
        c.sms_state().name().to_owned(),
    ]
}

fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

pub async fn run(cfg: &Config, args: ExportArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    store.keys().ring()?;
    let filter = ExportFilter {
        pool: args.pool.clone(),
        statuses: args.status.clone(),
        since: args.since,
    };
    let total = store.count_export(&filter).await?;
    if args.reveal {
        let statuses: Vec<&str> = args.status.iter().map(|s| s.name()).collect();
        let what = format!(
            "pool {:?} statuses {} since {} to {}",
            args.pool,
            statuses.join(","),
            args.since.map_or("-".into(), |t| t.to_rfc3339()),
            args.out.display()
        );
        super::reveal::record(&store, "export --reveal", what, Vec::new(), total).await?;
    }
    let tmp = partial_path(&args.out);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| {
            format!(
                "cannot write {}; check the folder exists and is writable",
                tmp.display()
            )
        })?;
    let mut csv = csv::Writer::from_writer(BufWriter::new(file));
    csv.write_record(HEADER)?;
    let bar = super::keys::progress(total, "exporting");
    let mut codes = std::pin::pin!(store.export_codes(&filter).await?);
    let mut written = 0u64;
    while let Some(code) = codes.try_next().await? {
        csv.write_record(row(&code, args.reveal))?;
        written += 1;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mut inner = csv
        .into_inner()
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", tmp.display()))?;
    inner.flush()?;
    std::fs::rename(&tmp, &args.out)
        .with_context(|| format!("cannot move {} to {}", tmp.display(), args.out.display()))?;
    let shown = if args.reveal {
        "in clear text"
    } else {
        "masked"
    };
    println!(
        "exported {written} code(s) of pool {:?} to {} (codes {shown})",
        args.pool,
        args.out.display()
    );
    Ok(crate::exit::OK)
}
