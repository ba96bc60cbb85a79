//! `codepool statement --pool NAME`: what became of every import's codes,
//! one row per run, each checked to tie out; with `--lines`, every move in
//! the period by the code's statement HMAC, never the code.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;

use chrono::{DateTime, Utc};
use clap::Args;
use codepool_issuance::statements::{self, Asked, Statement, StatementRow};
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool statement --pool game-x
  codepool statement --pool game-x --from 2026-11-01 --to 2026-12-01
  codepool statement --pool game-x --from 2026-11-01 --to 2026-12-01 --csv > november.csv
  codepool statement --pool game-x --import 6566b0c2f1a2b3c4d5e6f708 --json
  codepool statement --pool game-x --from 2026-11-01 --to 2026-12-01 --lines > moves.csv
  codepool statement --pool game-x --channel acme-eneba --from 2026-11-01 --to 2026-12-01
  codepool statement --pool game-x --key

One row per import run (a file or a generation run). The balance columns say
where the run's codes stand at the period's end: in stock, held, issued (sold,
not used), used, or void by reason (refund, replaced, recalled, expired,
other). The moved columns count what happened within the period, by the
time of each move: two back-to-back periods add up to the one spanning
both. A row ties out when its codes add up to what the run received (and to
what the run recorded, once it finished); one that does not is a bug, and
the command says which row is off and by how much.

--lines lists every move in the period (received, issued, used, void) by
the HMAC-SHA-256 of the code under the pool's statement key (--key prints
it; give it to the partner that supplies the pool). The partner computes
the same HMAC over its own codes to match them; no code is ever printed.
A move of a code a marketplace channel sold names the channel.

--channel NAME cuts the statement to the codes that channel (Eneba, G2A,
Kinguin) sold, to match the marketplace's sales report: its rows count
those codes only (no run's whole delivery), and tie out when each is in
one state.

Dates are UTC days (2026-11-01, its start) or RFC 3339 times. --from
defaults to the beginning, --to to now; --to is not included.

Exit codes: 0 every row ties out; 1 failure (an unknown pool or run, a
server down); 2 usage error; 3 a row does not tie out (named on stderr).")]
pub struct StatementArgs {
    /// The pool.
    #[arg(long)]
    pub pool: String,
    /// Only this import run (its id, as `codepool import` printed it).
    #[arg(long)]
    pub import: Option<String>,
    /// The period's start (included): 2026-11-01 or an RFC 3339 time.
    #[arg(long, value_parser = statements::parse_instant)]
    pub from: Option<DateTime<Utc>>,
    /// The period's end (not included); now when absent.
    #[arg(long, value_parser = statements::parse_instant)]
    pub to: Option<DateTime<Utc>>,
    /// Only the codes this marketplace channel sold (`codepool channels
    /// list`), to match the marketplace's sales report.
    #[arg(long, value_name = "NAME")]
    pub channel: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print CSV instead of a table.
    #[arg(long)]
    pub csv: bool,
    /// List every move in the period by the code's statement HMAC (CSV,
    /// or JSON lines with --json).
    #[arg(long, conflicts_with = "key")]
    pub lines: bool,
    /// Print the pool's statement key (hex) for the partner, and nothing
    /// else. Audited.
    #[arg(long)]
    pub key: bool,
}

pub async fn run(cfg: &Config, args: StatementArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    if args.key {
        let key = statements::statement_key(&store, &args.pool).await?;
        let what = format!("statement key of pool {:?} shown", args.pool);
        codepool_issuance::audit::record(
            &store,
            &super::actor("statement --key"),
            codepool_issuance::audit::AuditKind::StatementKey,
            what,
        )
        .await?;
        say!("{key}");
        return Ok(crate::exit::OK);
    }
    let asked = Asked {
        pool: args.pool.clone(),
        import: args.import.clone(),
        from: args.from,
        to: args.to,
        channel: args.channel.clone(),
    };
    if args.lines {
        return print_lines(&store, &asked, args.json).await;
    }
    let s = statements::statement(&store, &asked).await?;
    if args.json {
        say_json!(serde_json::to_string_pretty(&s)?);
    } else if args.csv {
        print!(
            "{}",
            codepool_domain::terminal_text(&statements::csv(&s), false)
        );
    } else {
        print_table(&s);
    }
    for u in statements::unfinished(&s) {
        eprintln!("warning: {u}");
    }
    let off = s.discrepancies();
    for d in &off {
        eprintln!("error: {d}");
    }
    if off.is_empty() {
        Ok(crate::exit::OK)
    } else {
        eprintln!("error: {} row(s) do not tie out: a bug in codepool or a change made outside it; keep this output and report it", off.len());
        Ok(crate::exit::PARTIAL)
    }
}

async fn print_lines(
    store: &codepool_store::Store,
    asked: &Asked,
    json: bool,
) -> anyhow::Result<u8> {
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new_spinner();
        b.set_style(ProgressStyle::with_template(
            "{spinner} {pos} moves listed ({per_sec})",
        )?);
        b
    } else {
        ProgressBar::hidden()
    };
    let mut rows = (!json).then(|| csv::Writer::from_writer(std::io::stdout()));
    let mut out = std::io::BufWriter::new(std::io::stdout());
    if let Some(w) = rows.as_mut() {
        w.write_record(statements::LINES_HEADER)?;
    }
    let mut each = |l: statements::StatementLine| {
        match rows.as_mut() {
            Some(w) => {
                if w.write_record(statements::line_cells(&l)).is_err() {
                    return ControlFlow::Break(());
                }
            }
            None => {
                let text = serde_json::to_string(&l).unwrap_or_default();
                if writeln!(out, "{}", codepool_domain::terminal_text(&text, true)).is_err() {
                    return ControlFlow::Break(());
                }
            }
        }
        bar.inc(1);
        ControlFlow::Continue(())
    };
    let n = statements::lines(store, asked, &mut each).await?;
    if let Some(mut w) = rows {
        w.flush()?;
    }
    out.flush()?;
    bar.finish_and_clear();
    eprintln!("{n} move(s) listed, each by the code's HMAC under the pool's statement key (`codepool statement --pool {} --key`)", asked.pool);
    Ok(crate::exit::OK)
}

fn voids(v: &statements::Voids) -> String {
    format!(
        "{}/{}/{}/{}/{}",
        v.refund, v.replaced, v.recalled, v.expired, v.other
    )
}

fn print_row(r: &StatementRow) {
    let (b, m) = (&r.balance, &r.moves);
    say!(
        "{:<24} {:<9} {:>9} {:>6} {:>9} {:>6} {:>8} {:>7} {:>17} | {:>8} {:>8} {:>7} {:>17} | {}",
        r.import
            .as_deref()
            .unwrap_or(if r.source == "total" { "TOTAL" } else { "-" }),
        r.source,
        r.received,
        r.duplicates,
        b.in_stock,
        b.held,
        b.issued,
        b.used,
        voids(&b.void),
        m.received,
        m.issued,
        m.used,
        voids(&m.void),
        match r.off_by {
            0 => statements::check_words(r),
            _ => statements::check_words(r).to_uppercase(),
        },
    );
}

fn print_table(s: &Statement) {
    say!(
        "statement of pool {}: balances at {}, moves from {} to then",
        s.pool,
        s.to.to_rfc3339(),
        s.from.to_rfc3339()
    );
    say!(
        "{:<24} {:<9} {:>9} {:>6} {:>9} {:>6} {:>8} {:>7} {:>17} | {:>8} {:>8} {:>7} {:>17} |",
        "IMPORT",
        "SOURCE",
        "RECEIVED",
        "DUPS",
        "IN STOCK",
        "HELD",
        "ISSUED",
        "USED",
        "VOID r/rp/rc/e/o",
        "+RECV",
        "+ISSUED",
        "+USED",
        "+VOID r/rp/rc/e/o"
    );
    for r in s.rows.iter().chain([&s.total]) {
        print_row(r);
    }
    say!("VOID: refund/replaced/recalled/expired/other. +: moves within the period.");
    if s.provisional {
        say!("PROVISIONAL: the period ends less than 10 s ago; a move stamped just before its end may still be committing. Run it again later (with the same --to) for final figures.");
    }
}
