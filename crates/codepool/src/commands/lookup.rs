//! `codepool lookup`: who got which code, and when.

use bson::doc;
use clap::Args;
use codepool_domain::mask;
use codepool_store::CodeDoc;
use futures::TryStreamExt;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool lookup --order O-1001
  codepool lookup --uid 123213
  codepool lookup --pool game-x --code QWER-1234 --reveal
  codepool lookup --pool game-x            (the latest grants of a pool)")]
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

pub async fn run(cfg: &Config, args: LookupArgs) -> anyhow::Result<u8> {
    let filter = match (&args.order, &args.uid, &args.code, &args.pool) {
        (Some(o), _, _, _) => doc! {"order_id": o},
        (_, Some(u), _, _) => doc! {"uid": u},
        (_, _, Some(c), Some(p)) => doc! {"pool": p, "code": c},
        (_, _, _, Some(p)) => doc! {"pool": p, "order_id": {"$type": "string"}},
        _ => anyhow::bail!("say what to look up: --order O, --uid U, --code C --pool P, or --pool P"),
    };
    let store = crate::context::store(cfg).await?;
    let docs: Vec<CodeDoc> = store
        .database()
        .collection::<CodeDoc>("codes")
        .find(filter)
        .sort(doc! {"issued_at": -1})
        .limit(args.limit)
        .await?
        .try_collect()
        .await?;
    let backorders = match &args.order {
        Some(o) => store.backorders_for_orders(&[o.as_str()]).await?,
        None => Vec::new(),
    };
    let show = |c: &str| if args.reveal { c.to_owned() } else { mask(c) };
    if args.json {
        let rows: Vec<serde_json::Value> = docs
            .iter()
            .map(|d| {
                serde_json::json!({
                    "pool": d.pool, "code": show(&d.code), "status": d.status().map(|s| s.name()),
                    "order_id": d.order_id, "uid": d.uid, "phone": d.phone, "grant_no": d.grant_no,
                    "issued_at": d.issued_at.map(|t| t.to_chrono().to_rfc3339()),
                    "sms_published_at": d.sms_published_at.map(|t| t.to_chrono().to_rfc3339()),
                    "is_sms": d.is_sms,
                    "used_at": d.used_at.map(|t| t.to_chrono().to_rfc3339()),
                    "voided_at": d.voided_at.map(|t| t.to_chrono().to_rfc3339()),
                    "void_reason": d.void_reason,
                })
            })
            .collect();
        let bo: Vec<serde_json::Value> = backorders
            .iter()
            .map(|b| serde_json::json!({"order_id": b.order_id, "pool": b.pool, "status": b.status, "created_at": b.created_at.to_chrono().to_rfc3339()}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"codes": rows, "backorders": bo}))?);
        return Ok(crate::exit::OK);
    }
    if docs.is_empty() && backorders.is_empty() {
        println!("nothing found");
        return Ok(crate::exit::FAILURE);
    }
    println!(
        "{:<16} {:<20} {:<9} {:<14} {:<16} {:<24} {:<10}",
        "ORDER", "CODE", "STATUS", "POOL", "GRANT NO", "ISSUED AT", "SMS"
    );
    for d in &docs {
        let sms = if d.is_sms == 1 {
            "sent"
        } else if d.sms_published_at.is_some() {
            "queued"
        } else if d.order_id.is_some() {
            "pending"
        } else {
            "-"
        };
        println!(
            "{:<16} {:<20} {:<9} {:<14} {:<16} {:<24} {:<10}",
            d.order_id.as_deref().unwrap_or("-"),
            show(&d.code),
            d.status().map_or("?", |s| s.name()),
            d.pool,
            d.grant_no.as_deref().unwrap_or("-"),
            d.issued_at
                .map(|t| t.to_chrono().to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
                .unwrap_or_else(|| "-".into()),
            sms
        );
    }
    for b in &backorders {
        println!(
            "backorder: order {} in pool {} is {} (since {})",
            b.order_id,
            b.pool,
            b.status,
            b.created_at.to_chrono().to_rfc3339()
        );
    }
    Ok(crate::exit::OK)
}
