//! `codepool lookup`: who got which code and when, and what became of the
//! SMS that carried it (published, sent, failed, re-sent).

use bson::{doc, Document};
use clap::Args;
use codepool_domain::mask;
use codepool_store::lifecycle::SmsStatus;
use codepool_store::CodeDoc;
use futures::TryStreamExt;

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
    #[arg(long)]
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

/// One code document, read as its grant and its SMS side.
struct Found {
    code: CodeDoc,
    sms: SmsStatus,
}

impl Found {
    /// One word for where the SMS is.
    fn sms_state(&self) -> &'static str {
        if self.sms.is_sms == 1 {
            "sent"
        } else if self.sms.sms_failures > 0 {
            "failed"
        } else if self.sms.sms_published_at.is_some() {
            "queued"
        } else if self.code.order_id.is_some() {
            "pending"
        } else {
            "-"
        }
    }
}

pub async fn run(cfg: &Config, args: LookupArgs) -> anyhow::Result<u8> {
    let filter = match (&args.order, &args.uid, &args.code, &args.pool) {
        (Some(o), _, _, _) => doc! {"order_id": o},
        (_, Some(u), _, _) => doc! {"uid": u},
        (_, _, Some(c), Some(p)) => doc! {"pool": p, "code": c},
        (_, _, _, Some(p)) => doc! {"pool": p, "order_id": {"$type": "string"}},
        _ => {
            anyhow::bail!("say what to look up: --order O, --uid U, --code C --pool P, or --pool P")
        }
    };
    let store = crate::context::store(cfg).await?;
    let raw: Vec<Document> = store
        .database()
        .collection::<Document>("codes")
        .find(filter)
        .sort(doc! {"issued_at": -1})
        .limit(args.limit)
        .await?
        .try_collect()
        .await?;
    let mut found = Vec::with_capacity(raw.len());
    for d in raw {
        found.push(Found {
            code: bson::from_document(d.clone())?,
            sms: bson::from_document(d)?,
        });
    }
    let backorders = match &args.order {
        Some(o) => store.backorders_for_orders(&[o.as_str()]).await?,
        None => Vec::new(),
    };
    let show = |c: &str| if args.reveal { c.to_owned() } else { mask(c) };
    let iso = |t: Option<bson::DateTime>| t.map(|t| t.to_chrono().to_rfc3339());

    if args.json {
        let rows: Vec<serde_json::Value> = found
            .iter()
            .map(|f| {
                let (d, s) = (&f.code, &f.sms);
                serde_json::json!({
                    "pool": d.pool, "code": show(&d.code), "status": d.status().map(|s| s.name()),
                    "order_id": d.order_id, "uid": d.uid, "phone": d.phone, "grant_no": d.grant_no,
                    "issued_at": iso(d.issued_at),
                    "expires_at": iso(d.expires_at),
                    "used_at": iso(d.used_at),
                    "voided_at": iso(d.voided_at),
                    "void_reason": d.void_reason,
                    "sms": {
                        "state": f.sms_state(),
                        "is_sms": s.is_sms,
                        "published_at": iso(s.sms_published_at),
                        "sent_at": iso(s.sms_sent_at),
                        "failed_at": iso(s.sms_failed_at),
                        "error": s.sms_error,
                        "failures": s.sms_failures,
                        "resends": s.sms_resends,
                        "history": s.sms_history.iter().map(|h| serde_json::json!({
                            "event": h.event, "at": iso(Some(h.at)), "error": h.error,
                        })).collect::<Vec<_>>(),
                    },
                })
            })
            .collect();
        let bo: Vec<serde_json::Value> = backorders
            .iter()
            .map(|b| serde_json::json!({"order_id": b.order_id, "pool": b.pool, "status": b.status, "created_at": b.created_at.to_chrono().to_rfc3339()}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"codes": rows, "backorders": bo}))?
        );
        return Ok(if rows.is_empty() && bo.is_empty() {
            crate::exit::FAILURE
        } else {
            crate::exit::OK
        });
    }
    if found.is_empty() && backorders.is_empty() {
        println!("nothing found");
        return Ok(crate::exit::FAILURE);
    }
    println!(
        "{:<16} {:<20} {:<9} {:<14} {:<16} {:<21} {:<8}",
        "ORDER", "CODE", "STATUS", "POOL", "GRANT NO", "ISSUED AT", "SMS"
    );
    for f in &found {
        let d = &f.code;
        println!(
            "{:<16} {:<20} {:<9} {:<14} {:<16} {:<21} {:<8}",
            d.order_id.as_deref().unwrap_or("-"),
            show(&d.code),
            d.status().map_or("?", |s| s.name()),
            d.pool,
            d.grant_no.as_deref().unwrap_or("-"),
            when(d.issued_at),
            f.sms_state()
        );
        print_details(f);
    }
    for b in &backorders {
        println!(
            "backorder: order {} in pool {} is {} (since {})",
            b.order_id,
            b.pool,
            b.status,
            when(Some(b.created_at))
        );
    }
    Ok(crate::exit::OK)
}

/// The indented lines under a row: lifecycle times and the SMS story.
fn print_details(f: &Found) {
    let (d, s) = (&f.code, &f.sms);
    if let Some(t) = d.used_at {
        println!("    used      {}", when(Some(t)));
    }
    if let Some(t) = d.voided_at {
        println!(
            "    voided    {} ({})",
            when(Some(t)),
            d.void_reason.as_deref().unwrap_or("no reason given")
        );
    }
    if d.order_id.is_none() {
        return;
    }
    let mut sms = vec![format!("published {}", when(s.sms_published_at))];
    if s.sms_sent_at.is_some() {
        sms.push(format!("sent {}", when(s.sms_sent_at)));
    }
    if s.sms_failures > 0 {
        sms.push(format!(
            "{} failure(s), last {} ({})",
            s.sms_failures,
            when(s.sms_failed_at),
            s.sms_error.as_deref().unwrap_or("no error given")
        ));
    }
    if s.sms_resends > 0 {
        sms.push(format!("re-sent {} time(s)", s.sms_resends));
    }
    println!("    sms       {}", sms.join("; "));
    for h in &s.sms_history {
        match &h.error {
            Some(e) => println!("      {} {} ({e})", when(Some(h.at)), h.event),
            None => println!("      {} {}", when(Some(h.at)), h.event),
        }
    }
}
