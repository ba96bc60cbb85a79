//! `codepool lookup`: who got which code and when, and what became of the
//! SMS that carried it (published, sent, failed, re-sent).

use chrono::{DateTime, SecondsFormat, Utc};
use clap::Args;
use codepool_domain::{mask, Code, SetAside};
use codepool_issuance::ops;
use codepool_store::policies::RefusalDoc;
use codepool_store::CodeQuery;

use super::target::when;
use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool lookup --order O-1001
  codepool lookup --uid 123213
  codepool lookup --pool game-x --code QWER-1234 --reveal
  codepool lookup --pool game-x            (the latest grants of a pool)
  codepool lookup --order O-1001 --json

SMS status: pending (event not yet confirmed by RabbitMQ), queued (waiting
for the SMS service), sent, failed (see the error; `codepool resend --order O`
sends it again). Each code keeps its last 20 SMS events as history.
Exit code 1 when nothing is found.")]
pub struct LookupArgs {
    /// An order id.
    #[arg(long, value_parser = super::target::order_id)]
    pub order: Option<String>,
    /// A buyer's user id.
    #[arg(long)]
    pub uid: Option<String>,
    /// A code (with --pool).
    #[arg(long, requires = "pool")]
    pub code: Option<String>,
    /// A pool (alone: its latest grants).
    #[arg(long)]
    pub pool: Option<String>,
    /// Show codes in clear text (they are secrets: masked by default).
    #[arg(long)]
    pub reveal: bool,
    /// Most rows to show.
    #[arg(long, default_value_t = 50)]
    pub limit: i64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cfg: &Config, args: LookupArgs) -> anyhow::Result<u8> {
    let query = match (&args.order, &args.uid, &args.code, &args.pool) {
        (Some(o), _, _, _) => CodeQuery::Order(o),
        (_, Some(u), _, _) => CodeQuery::Uid(u),
        (_, _, Some(code), Some(pool)) => CodeQuery::Code { pool, code },
        (_, _, _, Some(p)) => CodeQuery::GrantsOf(p),
        _ => {
            anyhow::bail!("say what to look up: --order O, --uid U, --code C --pool P, or --pool P")
        }
    };
    let store = crate::context::store(cfg).await?;
    let found = ops::lookup(&store, query, args.limit).await?;
    if args.reveal && !found.codes.is_empty() {
        let shown = found.codes.iter().chain(&found.replaced);
        let ids = shown.map(|c| c.id).collect::<Vec<_>>();
        let n = ids.len() as u64;
        super::reveal::record(&store, "lookup --reveal", describe(&query), ids, n).await?;
    }
    let show = |c: &Code| {
        if args.reveal {
            c.code.clone()
        } else {
            c.masked()
        }
    };
    if args.json {
        let rows: Vec<_> = (found.codes.iter())
            .map(|c| code_json(c, found.set_aside(c), show(c)))
            .collect();
        let bo: Vec<_> = found
            .backorders
            .iter()
            .map(|b| serde_json::json!({"order_id": b.order_id, "pool": b.pool, "status": b.status, "quantity": b.quantity(), "waiting_lines": b.waiting_lines(), "created_at": b.created_at.to_chrono().to_rfc3339()}))
            .collect();
        let refused: Vec<_> = found.refusals.iter().map(refusal_json).collect();
        let holds: Vec<_> = found.holds.iter().map(hold_json).collect();
        let replaced: Vec<_> = (found.replaced.iter())
            .map(|c| code_json(c, found.set_aside(c), show(c)))
            .collect();
        let replacements: Vec<_> = found.replacements.iter().map(replacement_json).collect();
        say_json!(serde_json::to_string_pretty(&serde_json::json!({
            "codes": rows, "backorders": bo, "refusals": refused, "holds": holds,
            "replaced": replaced, "replacements": replacements,
        }))?);
    } else {
        print_table(&found, show);
    }
    Ok(if found.is_empty() {
        crate::exit::FAILURE
    } else {
        crate::exit::OK
    })
}

/// What was looked up, in words (a code masked).
fn describe(query: &CodeQuery<'_>) -> String {
    match query {
        CodeQuery::Order(o) => format!("order {o:?}"),
        CodeQuery::Uid(u) => format!("uid {u:?}"),
        CodeQuery::Phone(p) => format!("phone {p:?}"),
        CodeQuery::Code { pool, code } => format!("code {} in pool {pool:?}", mask(code)),
        CodeQuery::GrantsOf(p) => format!("latest grants of pool {p:?}"),
    }
}

fn iso(t: Option<DateTime<Utc>>) -> Option<String> {
    t.map(|t| t.to_rfc3339())
}

/// One code as `--json` prints it.
/// A code a checkout hold set aside (voided while held: a held one is
/// never listed) shows its hold's id as `hold_id` (`aside`, which the hold
/// lists), and no order: the code keeps nothing of its hold.
fn code_json(c: &Code, aside: Option<SetAside>, shown: String) -> serde_json::Value {
    let h = c.order_holder();
    let s = &c.sms;
    let hold_id = match aside {
        Some(SetAside::Hold { hold_id }) => Some(hold_id),
        _ => None,
    };
    serde_json::json!({
        "pool": c.pool, "code": shown, "status": c.status.name(),
        "order_id": h.map(|h| &h.order_id), "hold_id": hold_id,
        "channel": h.and_then(|h| codepool_domain::purchase::channel_of(&h.order_id)),
        "uid": h.map(|h| &h.uid), "phone": h.map(|h| &h.phone),
        "line": h.map(|h| h.line), "quantity": h.map(|h| h.quantity),
        "grant_no": h.and_then(|h| h.grant_no.as_ref()),
        "issued_at": iso(h.map(|h| h.issued_at)),
        "expires_at": iso(c.expires_at),
        "used_at": iso(c.used_at),
        "voided_at": iso(c.voided_at),
        "void_reason": c.void_reason,
        "sms": {
            "state": c.sms_state().name(),
            "is_sms": i32::from(s.sent),
            "published_at": iso(s.published_at),
            "awaiting_relay": s.awaiting_relay,
            "sent_at": iso(s.sent_at),
            "failed_at": iso(s.failed_at),
            "error": s.error,
            "failures": s.failures,
            "resends": s.resends,
            "history": s.history.iter().map(|h| serde_json::json!({
                "event": h.event, "at": iso(Some(h.at)), "error": h.error,
            })).collect::<Vec<_>>(),
        },
    })
}

fn print_table(found: &ops::Lookup, show: impl Fn(&Code) -> String) {
    if found.is_empty() {
        say!("nothing found");
        return;
    }
    say!(
        "{:<16} {:<7} {:<20} {:<9} {:<14} {:<16} {:<21} {:<8}",
        "ORDER",
        "CODE #",
        "CODE",
        "STATUS",
        "POOL",
        "GRANT NO",
        "ISSUED AT",
        "SMS"
    );
    for c in &found.codes {
        print_row(c, found.set_aside(c), &show);
    }
    print_replacements(found, &show);
    print_channels(found);
    print_waiting(found);
}

/// The marketplace channel of each order a marketplace placed, once.
fn print_channels(found: &ops::Lookup) {
    let mut seen: Vec<&str> = Vec::new();
    for h in found.codes.iter().filter_map(Code::order_holder) {
        let Some(channel) = codepool_domain::purchase::channel_of(&h.order_id) else {
            continue;
        };
        if !seen.contains(&h.order_id.as_str()) {
            seen.push(&h.order_id);
            say!(
                "order {} was sold through channel {channel} (`codepool channels show --name {channel}`)",
                h.order_id
            );
        }
    }
}

/// An order's backorders and refusals, and a buyer's holds, one line each.
fn print_waiting(found: &ops::Lookup) {
    for b in &found.backorders {
        let waiting = b.waiting_lines().len();
        let of = if b.quantity() > 1 {
            format!(" for {waiting} of its {} codes", b.quantity())
        } else {
            String::new()
        };
        say!(
            "backorder: order {} in pool {} is {}{of} (since {})",
            b.order_id,
            b.pool,
            b.status,
            when(Some(b.created_at))
        );
    }
    for r in &found.refusals {
        say!(
            "refused: order {} of user {} in pool {}: {} (limit {}) at {}; it gets no code",
            r.order_id,
            r.uid,
            r.pool,
            r.reason.as_str(),
            r.limit.map_or("-".into(), |n| n.to_string()),
            when(Some(r.refused_at))
        );
    }
    for h in &found.holds {
        let items: Vec<String> = (h.items.iter())
            .map(|i| format!("{} × {}", i.quantity, i.pool))
            .collect();
        say!(
            "hold: {} of {} for user {} holds {} ({}); expires {}{}",
            h.hold_id,
            h.owner.as_deref().unwrap_or("no owner"),
            h.uid,
            items.join(", "),
            codepool_issuance::holds::state_now(h),
            when(Some(h.expires_at)),
            h.order_id
                .as_deref()
                .map_or(String::new(), |o| format!("; paid by order {o}"))
        );
    }
}

/// The codes an order's replacements replaced, and the replacements.
fn print_replacements(found: &ops::Lookup, show: &impl Fn(&Code) -> String) {
    if !found.replaced.is_empty() {
        say!("replaced codes (void; each line's code now is above):");
        for c in &found.replaced {
            print_row(c, found.set_aside(c), show);
        }
    }
    for r in &found.replacements {
        say!(
            "replacement: {} of line {} ({} of the order) by {} at {}: {}; reason {:?}; grant {} replaced by {}",
            r.id,
            r.line(),
            r.number(),
            r.who,
            when(Some(r.created_at)),
            r.state.as_str(),
            r.reason,
            r.old_grant_no.as_deref().unwrap_or("-"),
            r.new_grant_no.as_deref().unwrap_or("(waiting)")
        );
    }
}

/// One code as a row of the table, with its details beneath.
fn print_row(c: &Code, aside: Option<SetAside>, show: &impl Fn(&Code) -> String) {
    let h = c.order_holder();
    // A code a hold or bundle set aside names it, never its key.
    let order = match (h, aside) {
        (Some(h), _) => h.order_id.clone(),
        (None, Some(aside)) => aside.to_string(),
        (None, None) => "-".to_owned(),
    };
    say!(
        "{:<16} {:<7} {:<20} {:<9} {:<14} {:<16} {:<21} {:<8}",
        order,
        h.map_or_else(
            || "-".to_owned(),
            |h| format!("{}/{}", h.line + 1, h.quantity)
        ),
        show(c),
        c.status.name(),
        c.pool,
        h.and_then(|h| h.grant_no.as_deref()).unwrap_or("-"),
        h.map_or_else(|| "-".to_owned(), |h| short(Some(h.issued_at))),
        c.sms_state().name()
    );
    print_details(c);
}

/// A replacement as `--json` prints it.
fn replacement_json(r: &codepool_issuance::model::ReplacementDoc) -> serde_json::Value {
    serde_json::json!({
        "replacement_id": r.id, "order_id": r.order_id, "line": r.line(), "number": r.number(),
        "state": r.state.as_str(), "reason": r.reason, "by": r.who,
        "old_grant_no": r.old_grant_no, "new_grant_no": r.new_grant_no,
        "created_at": r.created_at.to_chrono().to_rfc3339(),
        "served_at": r.served_at.map(|t| t.to_chrono().to_rfc3339()),
    })
}

/// A hold as `--json` prints it (its codes are never shown). Hold ids are
/// each owner's own, so the owner (`shop:NAME`, `api-key-id:ID`) says whose.
fn hold_json(h: &codepool_store::holds::HoldDoc) -> serde_json::Value {
    serde_json::json!({
        "hold_id": h.hold_id, "owner": h.owner, "uid": h.uid, "state": codepool_issuance::holds::state_now(h),
        "items": h.items, "expires_at": h.expires_at.to_chrono().to_rfc3339(),
        "order_id": h.order_id,
    })
}

/// A refused order as `--json` prints it.
fn refusal_json(r: &RefusalDoc) -> serde_json::Value {
    serde_json::json!({"order_id": r.order_id, "pool": r.pool, "uid": r.uid, "reason": r.reason.as_str(), "limit": r.limit, "refused_at": r.refused_at.to_chrono().to_rfc3339()})
}

/// A time in a table cell.
fn short(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| t.to_rfc3339_opts(SecondsFormat::Secs, true),
    )
}

/// The indented lines under a row: lifecycle times and the SMS story.
fn print_details(c: &Code) {
    let s = &c.sms;
    if let Some(t) = c.used_at {
        say!("    used      {}", short(Some(t)));
    }
    if let Some(t) = c.voided_at {
        say!(
            "    voided    {} ({})",
            short(Some(t)),
            c.void_reason.as_deref().unwrap_or("no reason given")
        );
    }
    if c.order_holder().is_none() {
        return;
    }
    let mut sms = vec![match (s.published_at, s.awaiting_relay) {
        (Some(t), _) => format!("published {}", short(Some(t))),
        (None, true) => "not confirmed yet; the relay re-sends it".to_owned(),
        // An AMQP purchase is acked only once its event is confirmed; an
        // HTTP batch's record of owed events stays until they are.
        (None, false) => "published with its order".to_owned(),
    }];
    if s.sent_at.is_some() {
        sms.push(format!("sent {}", short(s.sent_at)));
    }
    if s.failures > 0 {
        sms.push(format!(
            "{} failure(s), last {} ({})",
            s.failures,
            short(s.failed_at),
            s.error.as_deref().unwrap_or("no error given")
        ));
    }
    if s.resends > 0 {
        sms.push(format!("re-sent {} time(s)", s.resends));
    }
    say!("    sms       {}", sms.join("; "));
    for h in &s.history {
        match &h.error {
            Some(e) => say!("      {} {} ({e})", short(Some(h.at)), h.event),
            None => say!("      {} {}", short(Some(h.at)), h.event),
        }
    }
}
