//! Statements: what became of every import's codes, one row per import run
//! (a file or a generation run), for an operator to check a partner's bill.
//!
//! A row has two halves:
//! - the **balance at the period's end**: every code the run put in by then
//!   is in stock, held, issued, used or void (void split by reason). The
//!   row ties out when they add up to what was received, and to what the
//!   run itself recorded when it finished before the end;
//! - the **moves in the period**, counted by the time of each move (a code
//!   imported in March and sold in April counts as issued in April): two
//!   back-to-back periods add up to the period that spans both.
//!
//! Everything is read at one snapshot: the aggregation's parts (run side
//! by side, each in a session of its own at the same cluster time) and
//! the import records see the database at one point in time, so a claim
//! made while the statement runs is either in every figure or in none.
//!
//! A balance at an end in the past is worked out from the moves' times. A
//! code's hold leaves no time once it ends, so "held" at a past end counts
//! the codes held then and still held now, and those a recall or expiry
//! voided out of their hold since (the void keeps the time they were held
//! as `held_at`); a hold that ended otherwise since is counted in stock.

use std::ops::ControlFlow;

use bson::oid::ObjectId;
use bson::{doc, Bson, DateTime, Document};
use codepool_domain::CodeStatus;
use mongodb::ClientSession;
use serde::Serialize;

use crate::codes::{int_field, CODES, SEQUENCES};
use crate::crypto::open_code;
use crate::imports::{ImportRecord, IMPORTS, SOURCE_GENERATED};
use crate::moves::HELD_AT;
use crate::replacements::REPLACED_REASON;
use crate::{lifecycle::EXPIRED_REASON, Store, StoreError};

/// Why codes became void, as a statement splits them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Voids {
    /// Voided by an operator or a shop for a refund (`--reason refund`).
    pub refund: u64,
    /// Voided because a replacement took their line.
    pub replaced: u64,
    /// Voided by a recall of their import.
    pub recalled: u64,
    /// Voided by the expiry sweep.
    pub expired: u64,
    /// Voided for any other reason.
    pub other: u64,
}

impl Voids {
    pub fn total(&self) -> u64 {
        self.refund + self.replaced + self.recalled + self.expired + self.other
    }

    fn add(&mut self, o: &Voids) {
        self.refund += o.refund;
        self.replaced += o.replaced;
        self.recalled += o.recalled;
        self.expired += o.expired;
        self.other += o.other;
    }
}

/// Where the codes of a run stand at the period's end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Balance {
    pub in_stock: u64,
    pub held: u64,
    /// Sold and not (yet) used or void.
    pub issued: u64,
    pub used: u64,
    pub void: Voids,
}

impl Balance {
    pub fn total(&self) -> u64 {
        self.in_stock + self.held + self.issued + self.used + self.void.total()
    }
}

/// What happened to a run's codes within the period.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Moves {
    /// Codes the run put in.
    pub received: u64,
    /// Codes sold to an order (a replacement's new code included).
    pub issued: u64,
    pub used: u64,
    pub void: Voids,
}

/// One import run's row.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct StatementRow {
    /// The run (its id is `codepool import`'s and `codepool generate`'s run
    /// id); `None` for codes imported before runs were recorded.
    pub import: Option<String>,
    /// `file` or `generated`.
    pub source: String,
    /// The file's name (a generation run's pattern).
    pub file: Option<String>,
    pub started_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The run's state: `done`, `running` (a process is making it now),
    /// `killed` (it says running, but no process holds it: it never
    /// finished), `interrupted`, `failed`.
    pub run: Option<String>,
    /// The run finished (`done`), so its row is its whole delivery; false
    /// for a run that is running, was killed, interrupted or failed: its
    /// row ties out over the codes it put in, not over its file or count.
    /// The total's is true when every row's is.
    pub finished: bool,
    /// Rows of the file refused as duplicates by the run.
    pub duplicates: u64,
    /// Codes of the run in the pool by the period's end.
    pub received: u64,
    /// How many codes the run recorded it put in, when it finished before
    /// the period's end (else the run is not finished then, and only the
    /// codes count).
    pub recorded: Option<u64>,
    pub balance: Balance,
    pub moves: Moves,
    /// Codes in no state (a sold code with no time of sale, a void one with
    /// no time of void, an unknown status): each is a bug.
    pub unaccounted: u64,
    /// By how much the row fails to tie out (0 when it does): its codes in
    /// no state, and the difference between its codes and the count the
    /// run recorded. The total's is the sum of the rows'.
    pub off_by: u64,
}

impl StatementRow {
    /// What [`Self::off_by`] holds for a run's row.
    fn count_off(&self) -> u64 {
        let found = self.balance.total() + self.unaccounted;
        let recorded = self.recorded.map_or(0, |n| n.abs_diff(found));
        self.unaccounted + recorded
    }

    /// Why the row does not tie out, in words; `None` when it does.
    pub fn discrepancy(&self) -> Option<String> {
        if self.off_by == 0 {
            return None;
        }
        let name = self.import.as_deref().unwrap_or("(codes without a run)");
        let mut why = Vec::new();
        if let Some(n) = self.recorded {
            let found = self.balance.total() + self.unaccounted;
            if n != found {
                why.push(format!(
                    "the run recorded {n} codes put in, and {found} of it are in the pool"
                ));
            }
        }
        if self.unaccounted > 0 {
            why.push(format!(
                "{} of its codes are in no state (sold with no time of sale, void with no time of void, or an unknown status)",
                self.unaccounted
            ));
        }
        Some(format!(
            "import {name} is off by {}: {}",
            self.off_by,
            why.join("; ")
        ))
    }
}

/// How long after a move's time its write may still be committing (the
/// time is taken as the write is sent): a statement whose period ends less
/// than this before it is read is provisional.
pub const SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// A statement: its period, its rows, and their sum.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Statement {
    pub pool: String,
    pub from: chrono::DateTime<chrono::Utc>,
    pub to: chrono::DateTime<chrono::Utc>,
    /// The period ends less than [`SETTLE`] (10 s) before the statement was
    /// read: a move stamped just before its end may still have been
    /// committing, and the same period read again later may count more.
    /// Read it again later for final figures.
    pub provisional: bool,
    pub rows: Vec<StatementRow>,
    pub total: StatementRow,
}

impl Statement {
    /// The rows that do not tie out.
    pub fn discrepancies(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter_map(StatementRow::discrepancy)
            .collect()
    }
}

/// One code's move in the period, by the statement HMAC of the code
/// (never the code): a partner matches it with its own HMACs.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct StatementLine {
    pub at: chrono::DateTime<chrono::Utc>,
    /// `received`, `issued`, `used` or `void`.
    #[serde(rename = "move")]
    pub kind: String,
    /// Why it became void (`refund`, `replaced`, `recalled`, `expired` or
    /// the operator's words); `None` for the other moves.
    pub reason: Option<String>,
    pub import: Option<String>,
    /// HMAC-SHA-256 of the code under the pool's statement key, in hex.
    pub code_hmac: String,
    /// The marketplace channel that sold the code (Eneba, G2A, Kinguin),
    /// for a sold code's moves; `None` for the shop's own doors' sales.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
}

/// Which statement.
#[derive(Debug, Clone, Copy)]
pub struct Period<'a> {
    pub pool: &'a str,
    /// Only this run.
    pub import: Option<ObjectId>,
    pub from: DateTime,
    pub to: DateTime,
    /// Only the codes this marketplace channel sold (its orders' ids are
    /// `KIND:CHANNEL:…`).
    pub channel: Option<&'a str>,
}

impl Period<'_> {
    fn codes(&self) -> Document {
        let mut q = doc! {"pool": self.pool, "created_at": {"$lt": self.to}};
        if let Some(i) = self.import {
            q.insert("batch_id", i);
        }
        if let Some(c) = self.channel {
            let prefixes: Vec<Bson> = codepool_domain::purchase::CHANNEL_ORDER_PREFIXES
                .iter()
                .map(|k| {
                    Bson::RegularExpression(bson::Regex {
                        pattern: format!("^{}", regex_escape(&format!("{k}{c}:"))),
                        options: String::new(),
                    })
                })
                .collect();
            q.insert("order_id", doc! {"$in": prefixes});
        }
        q
    }
}

/// `s` with every character a regular expression reads as syntax escaped.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if !ch.is_ascii_alphanumeric() && ch != ':' && ch != '_' {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

fn is_date(f: &str) -> Bson {
    Bson::from(doc! {"$eq": [{"$type": format!("${f}")}, "date"]})
}

fn before(f: &str, t: DateTime) -> Bson {
    Bson::from(doc! {"$and": [is_date(f), {"$lt": [format!("${f}"), t]}]})
}

fn not_before(f: &str, t: DateTime) -> Bson {
    Bson::from(doc! {"$and": [is_date(f), {"$gte": [format!("${f}"), t]}]})
}

fn within(f: &str, from: DateTime, to: DateTime) -> Bson {
    Bson::from(
        doc! {"$and": [is_date(f), {"$gte": [format!("${f}"), from]}, {"$lt": [format!("${f}"), to]}]},
    )
}

fn status_is(s: CodeStatus) -> Bson {
    Bson::from(doc! {"$eq": ["$status", s.as_i32()]})
}

/// A void made by codepool itself on a code nobody bought: a recall and
/// the expiry sweep void only codes in stock or held (their reasons are
/// reserved: an operator's void cannot use them).
fn voided_unsold() -> Bson {
    Bson::from(doc! {"$or": [
        {"$eq": [{"$type": "$recalled_by"}, "objectId"]},
        {"$eq": ["$void_reason", EXPIRED_REASON]},
    ]})
}

/// A void code that was sold first (it has a time of sale, and was not
/// voided by a recall or expiry, which void held codes with the hold's
/// time on them).
fn sold_then_void() -> Bson {
    Bson::from(doc! {"$and": [
        status_is(CodeStatus::Void), is_date("issued_at"), {"$not": [voided_unsold()]},
    ]})
}

/// A code ever sold: issued, used, or void after it was sold.
fn ever_sold() -> Bson {
    Bson::from(doc! {"$or": [
        status_is(CodeStatus::Issued), status_is(CodeStatus::Used), sold_then_void(),
    ]})
}

/// The void reason's class, as a `$switch`: `recalled` for a code its
/// import's recall voided, `expired` for the sweep's, `replaced` for a
/// replacement's, `refund` for a void that says so (in any case), else
/// `other`.
fn void_class() -> Bson {
    Bson::from(doc! {"$cond": [
        {"$eq": [{"$type": "$recalled_by"}, "objectId"]},
        "recalled",
        {"$ifNull": [reason_class(), "other"]},
    ]})
}

/// Whether a code's document holds the times its status needs (a sold
/// code its time of sale, a used one its time of use, a void one its time
/// of void, a held one the hold's time); one that does not is counted
/// `unaccounted`.
fn well_formed() -> Bson {
    Bson::from(doc! {"$switch": {
        "branches": [
            {"case": status_is(CodeStatus::Unissued), "then": true},
            {"case": status_is(CodeStatus::Issued), "then": is_date("issued_at")},
            {"case": status_is(CodeStatus::Used), "then": {"$and": [is_date("issued_at"), is_date("used_at")]}},
            {"case": status_is(CodeStatus::Void), "then": is_date("voided_at")},
            {"case": status_is(CodeStatus::Held), "then": is_date("issued_at")},
        ],
        "default": false,
    }})
}

/// Each code's state at `to`, as a `$switch` (see the module's words).
fn state_at(to: DateTime) -> Bson {
    let void_later =
        Bson::from(doc! {"$and": [status_is(CodeStatus::Void), not_before("voided_at", to)]});
    let used_later =
        Bson::from(doc! {"$and": [status_is(CodeStatus::Used), not_before("used_at", to)]});
    let sold_void_later = Bson::from(doc! {"$and": [void_later.clone(), sold_then_void()]});
    // A held code a recall or expiry voided keeps the time it was held
    // as `held_at` (one voided before that rule kept it as `issued_at`).
    let held_void_later = Bson::from(doc! {"$and": [
        void_later, voided_unsold(),
        {"$or": [before(HELD_AT, to), before("issued_at", to)]},
    ]});
    let held_then = Bson::from(doc! {"$or": [
        {"$and": [before("issued_at", to), status_is(CodeStatus::Held)]},
        held_void_later,
    ]});
    Bson::from(doc! {"$switch": {
        "branches": [
            {"case": {"$not": [well_formed()]}, "then": "unaccounted"},
            {"case": {"$and": [status_is(CodeStatus::Void), before("voided_at", to)]}, "then": "void"},
            {"case": {"$and": [before("used_at", to), {"$or": [status_is(CodeStatus::Used), sold_void_later.clone()]}]}, "then": "used"},
            {"case": {"$and": [before("issued_at", to), {"$or": [status_is(CodeStatus::Issued), used_later, sold_void_later]}]}, "then": "issued"},
            {"case": held_then, "then": "held"},
        ],
        "default": "in_stock",
    }})
}

/// The codes `cond` holds for, of a group of `$n` codes alike.
fn count_if(cond: Bson) -> Bson {
    Bson::from(doc! {"$sum": {"$cond": [cond, "$n", 0]}})
}

/// The time fields a statement compares with its period.
const TIMES: [&str; 5] = ["created_at", "issued_at", "used_at", "voided_at", HELD_AT];

/// Where the time `f` falls against the period, all that the figures ask
/// of it: -1 when it is not a time (missing), else 2 if before `from`
/// plus 1 if before `to`.
fn time_class(f: &str, from: DateTime, to: DateTime) -> Bson {
    let at = format!("${f}");
    let lt = |t: DateTime, yes: i32| Bson::from(doc! {"$cond": [{"$lt": [&at, t]}, yes, 0]});
    Bson::from(doc! {"$cond": [is_date(f), {"$add": [lt(from, 2), lt(to, 1)]}, -1]})
}

/// A time of each class [`time_class`] can give for the period (a class
/// no time can fall in has none).
fn class_times(from: DateTime, to: DateTime) -> Vec<(i32, DateTime)> {
    let (lo, hi) = (from.min(to), from.max(to));
    let candidates = [
        DateTime::from_millis(lo.timestamp_millis().saturating_sub(1)),
        lo,
        hi,
    ];
    (0..4)
        .filter_map(|class| {
            let t = candidates
                .into_iter()
                .find(|t| 2 * i32::from(*t < from) + i32::from(*t < to) == class)?;
            Some((class, t))
        })
        .collect()
}

/// What the figures ask of a void reason, as a `$switch`: codepool's own
/// `expired` or `replaced`, an operator's `refund` (in any case), or null
/// for anything else: never the operator's words themselves, so free-text
/// reasons do not split a statement's groups ([`alike`]), and
/// [`void_class`] reads the same three questions.
fn reason_class() -> Bson {
    let said = doc! {"$toLower": {"$trim": {"input": {"$ifNull": ["$void_reason", ""]}}}};
    Bson::from(doc! {"$switch": {
        "branches": [
            {"case": {"$eq": ["$void_reason", EXPIRED_REASON]}, "then": EXPIRED_REASON},
            {"case": {"$eq": ["$void_reason", REPLACED_REASON]}, "then": REPLACED_REASON},
            {"case": {"$eq": [said, "refund"]}, "then": "refund"},
        ],
        "default": Bson::Null,
    }})
}

/// Stage 1 of a statement: the codes counted by what the figures read of
/// them (run, status, recall, void reason, and where each time falls
/// against the period). A pool's million codes come to a few dozen groups.
fn alike(p: &Period) -> Document {
    let mut key = doc! {
        "b": "$batch_id",
        "st": "$status",
        "rb": {"$eq": [{"$type": "$recalled_by"}, "objectId"]},
        "vr": reason_class(),
    };
    for f in TIMES {
        key.insert(f, time_class(f, p.from, p.to));
    }
    doc! {"_id": key, "n": {"$sum": 1}}
}

/// Stage 2: each group as one code standing for all of it, with times of
/// the same classes as theirs ([`class_times`]), so the figures'
/// expressions read it as they would read each of its codes.
fn standing_in(p: &Period) -> Document {
    let times = class_times(p.from, p.to);
    let mut d = doc! {
        "_id": 0,
        "n": "$n",
        "batch_id": "$_id.b",
        "status": "$_id.st",
        "recalled_by": {"$cond": ["$_id.rb", ObjectId::from_bytes([0; 12]), "$$REMOVE"]},
        // The reason's class stands for its words ([`reason_class`]).
        "void_reason": {"$ifNull": ["$_id.vr", "$$REMOVE"]},
    };
    for f in TIMES {
        let class = format!("$_id.{f}");
        let branches: Vec<Bson> = (times.iter())
            .map(|(c, t)| Bson::from(doc! {"case": {"$eq": [&class, *c]}, "then": *t}))
            .collect();
        d.insert(
            f,
            doc! {"$switch": {"branches": branches, "default": "$$REMOVE"}},
        );
    }
    d
}

/// The `$group` stage: one document per run with every figure.
fn group(p: &Period) -> Document {
    let (from, to) = (p.from, p.to);
    let mut g = doc! {"_id": "$batch_id"};
    for s in ["in_stock", "held", "issued", "used", "unaccounted"] {
        g.insert(
            format!("b_{s}"),
            count_if(Bson::from(doc! {"$eq": ["$s", s]})),
        );
    }
    let sold = ever_sold();
    g.insert("m_received", count_if(within("created_at", from, to)));
    g.insert(
        "m_issued",
        count_if(Bson::from(
            doc! {"$and": [sold, within("issued_at", from, to)]},
        )),
    );
    g.insert("m_used", count_if(within("used_at", from, to)));
    for r in ["refund", "replaced", "recalled", "expired", "other"] {
        let is = Bson::from(doc! {"$eq": ["$v", r]});
        g.insert(
            format!("bv_{r}"),
            count_if(Bson::from(
                doc! {"$and": [{"$eq": ["$s", "void"]}, is.clone()]},
            )),
        );
        g.insert(
            format!("mv_{r}"),
            count_if(Bson::from(
                doc! {"$and": [status_is(CodeStatus::Void), within("voided_at", from, to), is]},
            )),
        );
    }
    g.insert("received", doc! {"$sum": "$n"});
    g
}

/// A statement's codes are read in up to this many parts side by side,
/// each an aggregation of its own (fewer when the pool's counter is below
/// it): mongod runs an aggregation on one core, and a pool of a million
/// codes kept one core busy for seconds.
const PARTS: i64 = 4;

/// The codes of part `i` of the parts `bounds` cut: `seq` below the first
/// bound, below the next but not below the last one, or not below the
/// last. A code goes to the part of its smallest numeric `seq` (an array
/// of them too), and a code with no number there (none, text, NaN) to the
/// last or the first part: the parts hold every code once, so their
/// figures sum to the whole's.
fn part_filter(bounds: &[i64], i: usize) -> Option<Document> {
    let low = i.checked_sub(1).and_then(|j| bounds.get(j));
    match (low, bounds.get(i)) {
        (None, None) => None,
        (None, Some(high)) => Some(doc! {"seq": {"$lt": high}}),
        (Some(low), Some(high)) => Some(doc! {"seq": {"$lt": high, "$not": {"$lt": low}}}),
        (Some(low), None) => Some(doc! {"seq": {"$not": {"$lt": low}}}),
    }
}

/// The figures of each run, summed over `parts`: every figure is a count.
/// Runs are told apart as the server's `$group` tells them (a number is
/// one run whatever its width) and sorted as its `$sort` sorts them.
/// Counts come out 64-bit, whatever width the server gave.
fn summed(parts: Vec<Vec<Document>>) -> Vec<Document> {
    let mut runs: Vec<(Bson, Document)> = Vec::new();
    for d in parts.into_iter().flatten() {
        let id = d.get("_id").cloned().unwrap_or(Bson::Null);
        let key = run_key(&id);
        let at = match runs.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                runs.push((key, doc! {"_id": id}));
                runs.len() - 1
            }
        };
        let run = &mut runs[at].1;
        for (k, _) in d.iter().filter(|(k, _)| k.as_str() != "_id") {
            let total = n(run, k) + n(&d, k);
            run.insert(k.clone(), total as i64);
        }
    }
    runs.sort_by_key(|(a, _)| run_order(a));
    runs.into_iter().map(|(_, d)| d).collect()
}

/// A run's id as the server compares it: numbers by value (NaN equal to
/// itself), anything else as it is. Runs are ObjectIds or none; the
/// rest are documents written past the validator.
fn run_key(id: &Bson) -> Bson {
    let number = match id {
        Bson::Int32(v) => f64::from(*v),
        Bson::Int64(v) => *v as f64,
        Bson::Double(v) => *v,
        other => return other.clone(),
    };
    if number.is_nan() {
        Bson::Symbol("NaN".into())
    } else {
        Bson::Double(number)
    }
}

/// The server's order of run ids ([`run_key`]s): none, numbers, text,
/// ObjectIds, then any other kind of value.
fn run_order(key: &Bson) -> (u8, Vec<u8>) {
    match key {
        Bson::Null => (0, Vec::new()),
        Bson::Symbol(_) => (1, Vec::new()),
        // An f64's bits made to sort as the number does.
        Bson::Double(v) => {
            let bits = v.to_bits();
            let order = if bits >> 63 == 1 {
                !bits
            } else {
                bits | 1 << 63
            };
            (2, order.to_be_bytes().to_vec())
        }
        Bson::String(t) => (3, t.as_bytes().to_vec()),
        Bson::ObjectId(o) => (4, o.bytes().to_vec()),
        other => (5, other.to_string().into_bytes()),
    }
}

fn n(d: &Document, k: &str) -> u64 {
    match d.get(k) {
        Some(Bson::Int32(v)) => *v as u64,
        Some(Bson::Int64(v)) => *v as u64,
        Some(Bson::Double(v)) => *v as u64,
        _ => 0,
    }
}

fn voids(d: &Document, prefix: &str) -> Voids {
    let v = |r: &str| n(d, &format!("{prefix}{r}"));
    Voids {
        refund: v("refund"),
        replaced: v("replaced"),
        recalled: v("recalled"),
        expired: v("expired"),
        other: v("other"),
    }
}

fn row_of(d: &Document, run: Option<&ImportRecord>, to: DateTime) -> StatementRow {
    let import = d.get_object_id("_id").ok().map(|i| i.to_hex());
    let finished = run.filter(|r| {
        r.status == crate::imports::RunState::Done && r.finished_at.is_some_and(|f| f < to)
    });
    let mut row = StatementRow {
        import,
        source: run
            .map_or("file", |r| match r.source.as_deref() {
                Some(SOURCE_GENERATED) => "generated",
                _ => "file",
            })
            .to_owned(),
        file: run.map(|r| match &r.generation {
            Some(g) => g.pattern.clone(),
            None => r.file.clone(),
        }),
        started_at: run.map(|r| r.started_at.to_chrono()),
        run: run.map(|r| r.state()),
        finished: run.is_none_or(|r| r.status == crate::imports::RunState::Done),
        duplicates: run.map_or(0, |r| r.duplicates),
        received: n(d, "received"),
        recorded: finished.map(|r| r.inserted),
        balance: Balance {
            in_stock: n(d, "b_in_stock"),
            held: n(d, "b_held"),
            issued: n(d, "b_issued"),
            used: n(d, "b_used"),
            void: voids(d, "bv_"),
        },
        moves: Moves {
            received: n(d, "m_received"),
            issued: n(d, "m_issued"),
            used: n(d, "m_used"),
            void: voids(d, "mv_"),
        },
        unaccounted: n(d, "b_unaccounted"),
        off_by: 0,
    };
    row.off_by = row.count_off();
    row
}

fn sum(pool: &str, rows: &[StatementRow]) -> StatementRow {
    let mut t = StatementRow {
        import: None,
        source: "total".into(),
        file: Some(format!("pool {pool}")),
        started_at: None,
        run: None,
        finished: rows.iter().all(|r| r.finished),
        duplicates: 0,
        received: 0,
        recorded: None,
        balance: Balance::default(),
        moves: Moves::default(),
        unaccounted: 0,
        off_by: 0,
    };
    for r in rows {
        t.off_by += r.off_by;
        t.duplicates += r.duplicates;
        t.received += r.received;
        t.unaccounted += r.unaccounted;
        let (b, m) = (&r.balance, &r.moves);
        t.balance.in_stock += b.in_stock;
        t.balance.held += b.held;
        t.balance.issued += b.issued;
        t.balance.used += b.used;
        t.balance.void.add(&b.void);
        t.moves.received += m.received;
        t.moves.issued += m.issued;
        t.moves.used += m.used;
        t.moves.void.add(&m.void);
    }
    t
}

impl Store {
    /// The statement key of `pool` ([`codepool_vault::Keyring::statement_key`]).
    pub fn statement_key(&self, pool: &str) -> Result<[u8; 32], StoreError> {
        Ok(self.keys.ring()?.statement_key(pool))
    }

    /// The figures of each run of `p`, read in one snapshot twice: by
    /// groups of codes alike in parts side by side (what
    /// [`Store::statement`] reads), and with every code read alone in one
    /// aggregation, the plain form the other must equal (its counts as
    /// the server gave them, 32-bit where they fit). For tests.
    #[doc(hidden)]
    pub async fn statement_figures_both_ways(
        &self,
        p: &Period<'_>,
    ) -> Result<(Vec<Document>, Vec<Document>), StoreError> {
        let mut session = self.client().start_session().snapshot(true).await?;
        let grouped = self
            .figures_in_parts(p, &mut session, std::future::ready(()))
            .await?;
        Ok((grouped, self.figures(p, true, None, &mut session).await?))
    }

    /// The figures of each run of `p`, read at `session`'s snapshot in
    /// parts side by side ([`PARTS`]) and summed: mongod runs one
    /// aggregation on one core. The first read fixes the snapshot, and
    /// every part reads at that time, in a session of its own, once
    /// `meanwhile` has run (tests write there; a statement passes nothing).
    async fn figures_in_parts(
        &self,
        p: &Period<'_>,
        session: &mut ClientSession,
        meanwhile: impl std::future::Future<Output = ()>,
    ) -> Result<Vec<Document>, StoreError> {
        let bounds = self.part_bounds(p.pool, session).await?;
        meanwhile.await;
        self.parts_read(p, session, &bounds).await
    }

    /// The figures of `p` as [`Store::statement`] reads them, at a
    /// snapshot fixed before `meanwhile` runs. For tests: no part may see
    /// what `meanwhile` writes.
    #[doc(hidden)]
    pub async fn statement_figures_fixed_before(
        &self,
        p: &Period<'_>,
        meanwhile: impl std::future::Future<Output = ()>,
    ) -> Result<Vec<Document>, StoreError> {
        let mut session = self.client().start_session().snapshot(true).await?;
        self.figures_in_parts(p, &mut session, meanwhile).await
    }

    /// The parts `bounds` cut, read side by side at `session`'s snapshot.
    async fn parts_read(
        &self,
        p: &Period<'_>,
        session: &mut ClientSession,
        bounds: &[i64],
    ) -> Result<Vec<Document>, StoreError> {
        let Some(at) = session.snapshot_time() else {
            // The counter's collection does not exist yet (nothing was
            // ever imported or generated), and a read of a collection
            // that does not exist fixes no snapshot: one part, in this
            // session, fixes it.
            return Ok(summed(vec![self.figures(p, false, None, session).await?]));
        };
        let mut others = Vec::with_capacity(bounds.len());
        for _ in 0..bounds.len() {
            let s = self.client().start_session().snapshot(true);
            others.push(s.snapshot_time(at).await?);
        }
        let sessions = std::iter::once(session).chain(others.iter_mut());
        let reads = sessions
            .enumerate()
            .map(|(i, s)| self.figures(p, false, part_filter(bounds, i), s));
        Ok(summed(futures::future::try_join_all(reads).await?))
    }

    /// The `seq` values that cut `pool`'s codes into [`PARTS`] parts of
    /// about one size, from the pool's sequence counter (read in
    /// `session`). Any cut is correct ([`part_filter`]); this one is even.
    async fn part_bounds(
        &self,
        pool: &str,
        session: &mut ClientSession,
    ) -> Result<Vec<i64>, StoreError> {
        let counter = self
            .collection(SEQUENCES)
            .find_one(doc! {"_id": format!("codes.seq:{pool}")})
            .session(session)
            .await?;
        let last = counter.and_then(|d| int_field(&d, "value")).unwrap_or(0);
        let mut bounds: Vec<i64> = (1..PARTS).map(|i| 1 + last / PARTS * i).collect();
        bounds.dedup();
        Ok(bounds)
    }

    async fn figures(
        &self,
        p: &Period<'_>,
        each_code: bool,
        part: Option<Document>,
        session: &mut ClientSession,
    ) -> Result<Vec<Document>, StoreError> {
        let mut codes = p.codes();
        if let Some(part) = part {
            codes.extend(part);
        }
        // The figures' expressions run once per group of codes alike, not
        // once per code.
        let mut pipeline = vec![doc! {"$match": codes}];
        if each_code {
            pipeline.push(doc! {"$set": {"n": 1}});
        } else {
            pipeline.push(doc! {"$group": alike(p)});
            pipeline.push(doc! {"$project": standing_in(p)});
        }
        pipeline.extend([
            doc! {"$set": {"s": state_at(p.to), "v": void_class()}},
            doc! {"$group": group(p)},
            doc! {"$sort": {"_id": 1}},
        ]);
        let mut cursor = self
            .collection(CODES)
            .aggregate(pipeline)
            .session(&mut *session)
            .await?;
        let mut groups = Vec::new();
        while let Some(d) = cursor.next(&mut *session).await {
            groups.push(d?);
        }
        Ok(groups)
    }

    /// The statement of `p`, read in one snapshot.
    /// Whether channel `channel` sold any code of `pool` (a removed
    /// channel's sales are still cut by its name).
    pub async fn sold_by_channel(&self, pool: &str, channel: &str) -> Result<bool, StoreError> {
        let p = Period {
            pool,
            import: None,
            from: DateTime::from_millis(0),
            to: DateTime::from_millis(i64::MAX),
            channel: Some(channel),
        };
        let mut q = p.codes();
        q.remove("created_at");
        Ok(self.collection(CODES).find_one(q).await?.is_some())
    }

    pub async fn statement(&self, p: &Period<'_>) -> Result<Statement, StoreError> {
        let mut session = self.client().start_session().snapshot(true).await?;
        let groups = self
            .figures_in_parts(p, &mut session, std::future::ready(()))
            .await?;
        let mut q = doc! {"pool": p.pool, "started_at": {"$lt": p.to}};
        if let Some(i) = p.import {
            q.insert("_id", i);
        }
        let mut runs_cursor = self
            .typed::<ImportRecord>(IMPORTS)
            .find(q)
            .sort(doc! {"_id": 1})
            .session(&mut session)
            .await?;
        let mut runs = Vec::new();
        while let Some(r) = runs_cursor.next(&mut session).await {
            runs.push(r?);
        }
        let mut rows: Vec<StatementRow> = groups
            .iter()
            .map(|g| {
                let id = g.get_object_id("_id").ok();
                let run = runs.iter().find(|r| Some(r.id) == id);
                row_of(g, run, p.to)
            })
            .collect();
        // Runs that put no code in (every row a duplicate, or a run that
        // failed before its first batch) still have their row.
        for r in &runs {
            if !rows.iter().any(|row| row.import == Some(r.id.to_hex())) {
                rows.push(row_of(&doc! {"_id": r.id}, Some(r), p.to));
            }
        }
        if p.channel.is_some() {
            // A channel's cut counts the codes it sold: a run's whole
            // delivery is not its to tie out with, and runs it sold
            // nothing of have no row.
            rows.retain(|r| r.received > 0);
            for r in &mut rows {
                r.recorded = None;
                r.duplicates = 0;
                r.off_by = r.count_off();
            }
        }
        rows.sort_by(|a, b| (a.started_at, &a.import).cmp(&(b.started_at, &b.import)));
        let total = sum(p.pool, &rows);
        let settled = chrono::Utc::now() - chrono::Duration::from_std(SETTLE).unwrap_or_default();
        Ok(Statement {
            provisional: p.to.to_chrono() > settled,
            pool: p.pool.to_owned(),
            from: p.from.to_chrono(),
            to: p.to.to_chrono(),
            rows,
            total,
        })
    }

    /// Every move of `p`'s codes in the period, code by code (in the order
    /// the codes were stored, each code's moves in time order), with the
    /// code's HMAC under `key` (the pool's statement key): `each` is called
    /// once per move, and stops the listing by answering `Break`. Read in
    /// one snapshot. Returns how many moves `each` was given.
    pub async fn statement_lines(
        &self,
        p: &Period<'_>,
        key: &[u8; 32],
        each: &mut (dyn FnMut(StatementLine) -> ControlFlow<()> + Send),
    ) -> Result<u64, StoreError> {
        let mut session = self.client().start_session().snapshot(true).await?;
        let mut q = p.codes();
        let moved: Vec<Document> = ["created_at", "issued_at", "used_at", "voided_at"]
            .iter()
            .map(|f| doc! {*f: {"$gte": p.from, "$lt": p.to}})
            .collect();
        q.insert("$or", moved);
        let fields = doc! {
            "pool": 1, "code": 1, "code_enc": 1, "key_id": 1, "status": 1, "batch_id": 1,
            "created_at": 1, "issued_at": 1, "used_at": 1, "voided_at": 1, "void_reason": 1,
            "recalled_by": 1, "order_id": 1,
        };
        let mut cursor = self
            .collection(CODES)
            .find(q)
            .projection(fields)
            .sort(doc! {"_id": 1})
            .session(&mut session)
            .await?;
        let mut count = 0;
        while let Some(d) = cursor.next(&mut session).await {
            for line in moves_of(self, &d?, p, key)? {
                count += 1;
                if each(line).is_break() {
                    return Ok(count);
                }
            }
        }
        Ok(count)
    }
}

/// One code's moves within `p`'s period.
fn moves_of(
    store: &Store,
    d: &Document,
    p: &Period,
    key: &[u8; 32],
) -> Result<Vec<StatementLine>, StoreError> {
    let id = d
        .get_object_id("_id")
        .map_err(|_| corrupt("a code without an _id"))?;
    let sealed = match (d.get_str("key_id"), d.get_binary_generic("code_enc")) {
        (Ok(k), Ok(b)) => Some((k, b.as_slice())),
        _ => None,
    };
    let code = open_code(&store.keys, p.pool, id, sealed, d.get_str("code").ok())?;
    let code_hmac = hex::encode(codepool_vault::statement_hmac(key, &code));
    let status = d.get_i32("status").ok().and_then(CodeStatus::from_i32);
    let time = |f: &str| {
        d.get_datetime(f)
            .ok()
            .copied()
            .filter(|t| *t >= p.from && *t < p.to)
    };
    // As `ever_sold`: a recall or the expiry sweep voids only codes
    // nobody bought (a held one keeps the hold's time).
    let voided_unsold =
        d.get_object_id("recalled_by").is_ok() || d.get_str("void_reason") == Ok(EXPIRED_REASON);
    let sold = match status {
        Some(CodeStatus::Issued | CodeStatus::Used) => true,
        Some(CodeStatus::Void) => !voided_unsold,
        _ => false,
    };
    let reason = || {
        if d.get_object_id("recalled_by").is_ok() {
            "recalled".to_owned()
        } else {
            d.get_str("void_reason").unwrap_or("other").to_owned()
        }
    };
    let channel = (d.get_str("order_id").ok())
        .filter(|_| sold)
        .and_then(codepool_domain::purchase::channel_of)
        .map(str::to_owned);
    let mut out = Vec::new();
    let mut add = |at: Option<DateTime>, kind: &str, reason: Option<String>| {
        if let Some(at) = at {
            out.push(StatementLine {
                at: at.to_chrono(),
                kind: kind.to_owned(),
                reason,
                import: d.get_object_id("batch_id").ok().map(|i| i.to_hex()),
                code_hmac: code_hmac.clone(),
                channel: if kind == "received" {
                    None
                } else {
                    channel.clone()
                },
            });
        }
    };
    add(time("created_at"), "received", None);
    add(time("issued_at").filter(|_| sold), "issued", None);
    add(time("used_at"), "used", None);
    if status == Some(CodeStatus::Void) {
        add(time("voided_at"), "void", Some(reason()));
    }
    out.sort_by_key(|l| l.at);
    Ok(out)
}

fn corrupt(message: &str) -> StoreError {
    StoreError::Corrupt {
        collection: CODES.into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_told_apart_and_sorted_as_the_server_groups_and_sorts_them() {
        let id = ObjectId::new();
        let part = |ids: &[Bson]| -> Vec<Document> {
            ids.iter()
                .map(|i| doc! {"_id": i.clone(), "received": 1})
                .collect()
        };
        let one = part(&[Bson::ObjectId(id), Bson::Int32(7), Bson::Double(-2.5)]);
        let two = part(&[
            Bson::Int64(7),
            Bson::Null,
            Bson::Double(7.0),
            Bson::Int32(-3),
        ]);
        let runs = summed(vec![one, two]);
        let ids: Vec<&Bson> = runs.iter().filter_map(|r| r.get("_id")).collect();
        assert_eq!(
            ids,
            [
                &Bson::Null,
                &Bson::Int32(-3),
                &Bson::Double(-2.5),
                &Bson::Int32(7),
                &Bson::ObjectId(id)
            ]
        );
        let received: Vec<i64> = runs
            .iter()
            .map(|r| r.get_i64("received").unwrap())
            .collect();
        assert_eq!(received, [1, 1, 1, 3, 1]);
    }
}
