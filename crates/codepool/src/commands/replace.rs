//! `codepool replace`: the buyer says a code does not work; void that one
//! code and give its line a fresh one from the same pool, texted by SMS.
//! The core's `replace` does it, as the API and the console do.

use std::sync::Arc;

use clap::Args;
use codepool_issuance::replace::{self, Replaced};
use codepool_issuance::Outbox;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool replace --order O-1001 --line 0 --reason \"code rejected by the platform\"
  codepool replace --order O-1001 --line 2 --reason leaked --replacement-id T-4711
  codepool replace --order O-1001 --line 0 --reason \"code rejected\" --replacement-id T-4711 --json
  codepool lookup --order O-1001      (the lines, their codes and the replacements)

The old code becomes void (reason `replaced`) and is never issued again;
the line gets a fresh code from the same pool, with a new grant number and
its own sms.pending event (confirmed by RabbitMQ, or re-sent by the relay
of a running dispatcher or API). The shop's webhooks get code.replaced.

The replacement id makes a retry safe: the same id again prints the same
new code and changes nothing; the id with another order, line or reason is
refused. Without --replacement-id one is made up and printed: give it to
run the same replacement again (after a crash, or when unsure it ran).

A pool that is empty or paused: the old code is void at once, and the line
waits; it gets its code after the next import (or resume), before the
pool's backorders. A pool allows 3 replacements per order unless set
otherwise (`codepool pool set --replacements-per-order N`); the next one is
refused and changes nothing. Used and void codes are not replaced.")]
pub struct ReplaceArgs {
    /// The order whose code does not work.
    #[arg(long, value_parser = super::target::order_id)]
    pub order: String,
    /// The order's line whose code is replaced: 0 for an order of one code
    /// (`codepool lookup --order` shows the lines).
    #[arg(long, value_name = "N")]
    pub line: u32,
    /// Why (stored with the void code, audited, told to the shop).
    #[arg(long)]
    pub reason: String,
    /// Your id for this replacement; made up and printed when left out.
    #[arg(long, value_name = "ID")]
    pub replacement_id: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cfg: &Config, args: ReplaceArgs) -> anyhow::Result<u8> {
    let made_up = args.replacement_id.is_none();
    let id = (args.replacement_id.clone())
        .unwrap_or_else(|| format!("rpl-{}", bson::oid::ObjectId::new().to_hex()));
    if made_up && !args.json {
        say!("replacement id {id} (give it as --replacement-id to run this replacement again)");
    }
    let store = crate::context::store(cfg).await?;
    let engine = crate::context::claim_engine(cfg, &store)?;
    let outbox = Outbox::new(Arc::new(store.clone()));
    let (conn, publisher) = crate::context::publisher(cfg, "codepool-replace").await?;
    let services = replace::Services {
        store: &store,
        engine: &engine,
        outbox: &outbox,
        sink: &publisher,
    };
    let ask = replace::Ask {
        order_id: &args.order,
        line: args.line,
        replacement_id: &id,
        reason: &args.reason,
    };
    let actor = super::actor("replace");
    let done = replace::replace(&services, &ask, &actor).await;
    codepool_broker::close(conn, "done").await;
    let done = done?;
    if args.json {
        say_json!(serde_json::to_string_pretty(&as_json(&done))?);
    } else {
        print(&done);
    }
    Ok(crate::exit::OK)
}

fn as_json(done: &Replaced) -> serde_json::Value {
    let d = &done.doc;
    let h = done.code.as_ref().and_then(|c| c.holder.as_ref());
    serde_json::json!({
        "replacement_id": d.id, "order_id": d.order_id, "line": d.line(), "pool": d.pool,
        "state": if done.code.is_some() { "replaced" } else { "waiting" },
        "again": !done.began, "reason": d.reason, "old_grant_no": d.old_grant_no,
        "code": done.code.as_ref().map(|c| c.masked()),
        "new_grant_no": h.and_then(|h| h.grant_no.clone()),
    })
}

fn print(done: &Replaced) {
    let d = &done.doc;
    let old = d.old_grant_no.as_deref().unwrap_or("no grant number");
    if !done.began {
        say!(
            "replacement {} was made before (order {} line {}); nothing more was done",
            d.id,
            d.order_id,
            d.line()
        );
    }
    match &done.code {
        Some(c) => say!(
            "order {} line {}: the code of grant {old} is void (replaced); the new code {} (grant {}) goes to the buyer by SMS",
            d.order_id,
            d.line(),
            c.masked(),
            (c.holder.as_ref().and_then(|h| h.grant_no.as_deref())).unwrap_or("-")
        ),
        None => say!(
            "order {} line {}: the code of grant {old} is void (replaced); pool {} has no code to give now, so the line waits: its new code goes by SMS after the next import or resume, before the pool's backorders",
            d.order_id,
            d.line(),
            d.pool
        ),
    }
}
