//! Statements, whichever door asks (`codepool statement`, `GET
//! /v1/statements`, the console's statement page): one row per import run
//! of a pool, with where its codes stand at the period's end and what moved
//! in the period ([`codepool_store::statements`]), each row checked to tie
//! out; and, line by line, every move by the code's statement HMAC, never
//! the code.

use chrono::{DateTime, NaiveDate, Utc};
use codepool_domain::text::spreadsheet_cell;
use codepool_store::{ObjectId, Store, StoreError};

pub use codepool_store::statements::{
    Balance, Moves, Period, Statement, StatementLine, StatementRow, Voids,
};

/// Why a statement cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum StatementError {
    #[error("pool {0:?} does not exist; `codepool stats` lists the pools")]
    UnknownPool(String),
    #[error("import {import} is not a run of pool {pool:?}; `codepool statement --pool {pool}` lists its runs")]
    UnknownImport { import: String, pool: String },
    #[error("{0:?} is not an import run id (24 hex digits, as `codepool import` prints it)")]
    BadImport(String),
    #[error("no channel {0:?} (and none of that name sold codes of the pool); `codepool channels list` shows the channels")]
    UnknownChannel(String),
    #[error("the period is empty: --from {from} is not before --to {to} (to the millisecond)")]
    EmptyPeriod { from: String, to: String },
    /// Every statement this process may run at once is running, and none
    /// ended within [`STATEMENT_WAIT`].
    #[error("{STATEMENTS_AT_ONCE} statements are being made already; ask again in {wait} s")]
    Busy { wait: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Statements (and statement listings) one process makes at once: each
/// keeps MongoDB busy for as long as the pool is big, and orders must not
/// wait behind them.
pub const STATEMENTS_AT_ONCE: usize = 2;

/// How long a statement waits for one of the [`STATEMENTS_AT_ONCE`] turns
/// before it is refused ([`StatementError::Busy`]).
pub const STATEMENT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The turns of this process's statements: one for every door.
static TURNS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(STATEMENTS_AT_ONCE);

/// One of this process's statement turns, held while a statement runs;
/// [`StatementError::Busy`] when none comes within [`STATEMENT_WAIT`].
async fn turn() -> Result<tokio::sync::SemaphorePermit<'static>, StatementError> {
    match tokio::time::timeout(STATEMENT_WAIT, TURNS.acquire()).await {
        Ok(Ok(permit)) => Ok(permit),
        _ => {
            metrics::counter!("codepool_statements_refused_total").increment(1);
            Err(StatementError::Busy { wait: 5 })
        }
    }
}

/// What a statement covers, as a door read it.
#[derive(Debug, Clone)]
pub struct Asked {
    pub pool: String,
    /// An import run's id (hex), for its row alone.
    pub import: Option<String>,
    /// The period's start (inclusive); the beginning of time when absent.
    pub from: Option<DateTime<Utc>>,
    /// The period's end (exclusive); now when absent.
    pub to: Option<DateTime<Utc>>,
    /// Only the codes this marketplace channel sold, so a seller matches
    /// the marketplace's sales report.
    pub channel: Option<String>,
}

/// A moment as a door takes it: RFC 3339 (`2026-11-01T00:00:00Z`) or a day
/// (`2026-11-01`, its start in UTC).
pub fn parse_instant(s: &str) -> Result<DateTime<Utc>, String> {
    let s = s.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    match NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        Ok(d) => Ok(d.and_hms_opt(0, 0, 0).expect("midnight exists").and_utc()),
        Err(_) => Err(format!(
            "{s:?} is not a date: write 2026-11-01 (its start, UTC) or 2026-11-01T09:30:00Z"
        )),
    }
}

impl Asked {
    async fn period(&self, store: &Store) -> Result<Period<'_>, StatementError> {
        if store.pool(&self.pool).await?.is_none() {
            return Err(StatementError::UnknownPool(self.pool.clone()));
        }
        let import = match self.import.as_deref() {
            None => None,
            Some(i) => {
                let id = ObjectId::parse_str(i.trim())
                    .map_err(|_| StatementError::BadImport(i.to_owned()))?;
                match store.import_record(id).await? {
                    Some(r) if r.pool == self.pool => Some(id),
                    _ => {
                        return Err(StatementError::UnknownImport {
                            import: i.to_owned(),
                            pool: self.pool.clone(),
                        })
                    }
                }
            }
        };
        let from = self.from.unwrap_or(DateTime::UNIX_EPOCH);
        let to = self.to.unwrap_or_else(Utc::now);
        // Times are stored to the millisecond: the period is compared so.
        let (from_ms, to_ms) = (
            bson::DateTime::from_chrono(from),
            bson::DateTime::from_chrono(to),
        );
        if from_ms >= to_ms {
            return Err(StatementError::EmptyPeriod {
                from: from.to_rfc3339(),
                to: to.to_rfc3339(),
            });
        }
        if let Some(c) = self.channel.as_deref() {
            if store.channel(c).await?.is_none() && !store.sold_by_channel(&self.pool, c).await? {
                return Err(StatementError::UnknownChannel(c.chars().take(80).collect()));
            }
        }
        Ok(Period {
            pool: &self.pool,
            import,
            from: from_ms,
            to: to_ms,
            channel: self.channel.as_deref(),
        })
    }
}

/// The statement `a` asks for, read in one snapshot.
#[tracing::instrument(skip(store), fields(pool = %a.pool))]
pub async fn statement(store: &Store, a: &Asked) -> Result<Statement, StatementError> {
    let p = a.period(store).await?;
    let _turn = turn().await?;
    Ok(store.statement(&p).await?)
}

/// Every move in the period `a` asks for, by statement HMAC, given to
/// `each` one by one until it answers `Break`; returns how many it got.
#[tracing::instrument(skip(store, each), fields(pool = %a.pool))]
pub async fn lines(
    store: &Store,
    a: &Asked,
    each: &mut (dyn FnMut(StatementLine) -> std::ops::ControlFlow<()> + Send),
) -> Result<u64, StatementError> {
    let p = a.period(store).await?;
    let key = store.statement_key(&a.pool)?;
    let _turn = turn().await?;
    Ok(store.statement_lines(&p, &key, each).await?)
}

/// The pool's statement key, in hex, for the operator to hand to the
/// partner who supplies the pool.
pub async fn statement_key(store: &Store, pool: &str) -> Result<String, StatementError> {
    if store.pool(pool).await?.is_none() {
        return Err(StatementError::UnknownPool(pool.to_owned()));
    }
    Ok(hex::encode(store.statement_key(pool)?))
}

/// A row's check in words, as the table and the console show it: `ties
/// out` only for a finished run (or the total of finished runs); a run
/// that did not finish says so with its state (`killed: not finished`),
/// since its row counts the codes it put in, not its delivery; a row that
/// does not tie out says by how much.
pub fn check_words(r: &StatementRow) -> String {
    let state = r.run.as_deref().unwrap_or("unfinished runs");
    match (r.off_by, r.finished) {
        (0, true) => "ties out".to_owned(),
        (0, false) if r.source == "total" => "ties out; some runs not finished".to_owned(),
        (0, false) => format!("{state}: not finished"),
        (n, true) => format!("off by {n}"),
        (n, false) => format!("off by {n}; {state}: not finished"),
    }
}

/// The rows of runs that did not finish, in words, with what finishes
/// each.
pub fn unfinished(s: &Statement) -> Vec<String> {
    (s.rows.iter())
        .filter(|r| !r.finished)
        .map(|r| {
            let id = r.import.as_deref().unwrap_or("-");
            let how = match r.source.as_str() {
                "generated" => format!("`codepool generate --run-id {id}` with its pool, pattern and count"),
                _ => "the same import of the same file into the same pool".to_owned(),
            };
            format!(
                "run {id} is {}: it never finished, and its row counts the {} code(s) it put in; {how} finishes it",
                r.run.as_deref().unwrap_or("unfinished"),
                r.received
            )
        })
        .collect()
}

/// The CSV header of a statement's rows.
pub const CSV_HEADER: [&str; 25] = [
    "import",
    "source",
    "file",
    "started_at",
    "run",
    "duplicates",
    "received",
    "recorded",
    "in_stock",
    "held",
    "issued",
    "used",
    "void_refund",
    "void_replaced",
    "void_recalled",
    "void_expired",
    "void_other",
    "moved_received",
    "moved_issued",
    "moved_used",
    "moved_void_refund",
    "moved_void_replaced",
    "moved_void_recalled",
    "moved_void_expired",
    "moved_void_other",
];

fn voids(v: &Voids) -> [String; 5] {
    [v.refund, v.replaced, v.recalled, v.expired, v.other].map(|n| n.to_string())
}

/// A row as CSV cells (in [`CSV_HEADER`]'s order, then `unaccounted` and
/// `off_by`); text a spreadsheet would run as a formula is neutered.
pub fn csv_cells(r: &StatementRow) -> Vec<String> {
    let (b, m) = (&r.balance, &r.moves);
    let mut cells = vec![
        r.import.clone().unwrap_or_default(),
        r.source.clone(),
        spreadsheet_cell(r.file.as_deref().unwrap_or_default()).into_owned(),
        r.started_at.map(|t| t.to_rfc3339()).unwrap_or_default(),
        r.run.clone().unwrap_or_default(),
        r.duplicates.to_string(),
        r.received.to_string(),
        r.recorded.map(|n| n.to_string()).unwrap_or_default(),
        b.in_stock.to_string(),
        b.held.to_string(),
        b.issued.to_string(),
        b.used.to_string(),
    ];
    cells.extend(voids(&b.void));
    cells.extend([m.received, m.issued, m.used].map(|n| n.to_string()));
    cells.extend(voids(&m.void));
    cells.extend([r.unaccounted.to_string(), r.off_by.to_string()]);
    cells
}

/// Rows of cells as CSV text under `header`.
fn csv_text<R, I>(header: &[&str], rows: I) -> String
where
    R: IntoIterator<Item = String>,
    I: IntoIterator<Item = R>,
{
    let mut w = csv::Writer::from_writer(Vec::new());
    let _ = w.write_record(header);
    for r in rows {
        let _ = w.write_record(r);
    }
    String::from_utf8(w.into_inner().unwrap_or_default()).unwrap_or_default()
}

/// The whole statement as CSV: a header, a row per run, and the total.
pub fn csv(s: &Statement) -> String {
    let mut header: Vec<&str> = CSV_HEADER.to_vec();
    header.extend(["unaccounted", "off_by"]);
    csv_text(&header, s.rows.iter().chain([&s.total]).map(csv_cells))
}

/// The CSV header of a statement's lines.
pub const LINES_HEADER: [&str; 6] = ["at", "move", "reason", "import", "code_hmac", "channel"];

/// Lines as CSV, under [`LINES_HEADER`].
pub fn lines_csv(lines: &[StatementLine]) -> String {
    csv_text(&LINES_HEADER, lines.iter().map(line_cells))
}

/// A moment a door may leave empty: `None` for nothing (or blanks), else
/// [`parse_instant`].
pub fn parse_optional(s: Option<&str>) -> Result<Option<DateTime<Utc>>, String> {
    match s.map(str::trim) {
        None | Some("") => Ok(None),
        Some(s) => parse_instant(s).map(Some),
    }
}

/// A line as CSV cells (in [`LINES_HEADER`]'s order).
pub fn line_cells(l: &StatementLine) -> [String; 6] {
    [
        l.at.to_rfc3339(),
        l.kind.clone(),
        spreadsheet_cell(l.reason.as_deref().unwrap_or_default()).into_owned(),
        l.import.clone().unwrap_or_default(),
        l.code_hmac.clone(),
        l.channel.clone().unwrap_or_default(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_statement_beyond_the_two_at_once_waits_then_is_refused_busy() {
        let first = turn().await.expect("one turn");
        let second = turn().await.expect("two turns");
        let asked = std::time::Instant::now();
        match turn().await {
            Err(StatementError::Busy { wait }) => assert!(wait >= 1),
            other => panic!("a third statement ran at once: {:?}", other.map(|_| ())),
        }
        assert!(asked.elapsed() >= STATEMENT_WAIT, "it waited first");
        // One ends while another waits: the waiting one runs.
        let waiting = tokio::spawn(async { turn().await.map(|_| ()) });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        drop(first);
        waiting.await.unwrap().expect("the freed turn");
        drop(second);
    }
}
