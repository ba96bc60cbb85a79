//! `codepool void`: take a code back (a refund, a withdrawn batch). Status
//! 0 or 1 → 3. A voided issued code never returns to the pool: its buyer
//! has already seen it. `--import` recalls a whole delivery.

use clap::{ArgGroup, Args};
use codepool_domain::when;
use codepool_issuance::{controls, ops};
use codepool_store::lifecycle::VoidOutcome;

use super::target::CodeTarget;
use crate::config::Config;

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("what").required(true).args(["order", "code", "import"])))]
#[command(after_help = "\
Examples:
  codepool void --order O-1001 --reason refund
  codepool void --code QWER-1234 --pool game-x --reason \"leaked in a forum\"
  codepool void --import 6740a1b2c3d4e5f601234567 --reason \"partner leak\"
  codepool void --import 6740a1b2c3d4e5f601234567 --reason leak --json

An unissued code is withdrawn from the pool (and from the Redis hot pool).
An issued code stays with its order but is void: it is never issued again,
and the order can never receive another code. --order voids every code of
the order (an order may hold several) and cancels what it still waits for
(its backorder); --code voids that one code only. A used code cannot be
voided.

--import recalls a delivery: every still-unissued code of that import run
(the import_id `codepool import --json` prints) is voided. Codes already
issued are left with their buyers and listed, masked, so they can be
contacted. Safe while dispatchers run: each code is either issued before
the recall or voided, never both. Running it again voids nothing more.")]
pub struct VoidArgs {
    #[command(flatten)]
    pub target: CodeTarget,
    /// Recall every unissued code of this import run (its import_id).
    #[arg(long, value_name = "IMPORT_ID", conflicts_with_all = ["order", "code", "pool"])]
    pub import: Option<String>,
    /// Why (stored with the code, shown by `codepool lookup`).
    #[arg(long)]
    pub reason: String,
    /// Print JSON (only with --import).
    #[arg(long, conflicts_with_all = ["order", "code"])]
    pub json: bool,
}

pub async fn run(cfg: &Config, args: VoidArgs) -> anyhow::Result<u8> {
    if let Some(import) = &args.import {
        return recall(cfg, import, &args.reason, args.json).await;
    }
    let target = args.target.code_ref()?;
    let store = crate::context::store(cfg).await?;
    let hot = crate::context::hot_pool(cfg)?;
    let reason = args.reason.trim();
    let actor = super::actor("void");
    match ops::void(&store, &hot, target, reason, &actor).await? {
        VoidOutcome::Voided {
            applied,
            backorder_cancelled,
        } => {
            for t in &applied {
                let c = &t.before;
                match &c.holder {
                    None => say!(
                        "voided unissued code {} in pool {} ({reason}); it will never be issued",
                        c.masked(),
                        c.pool
                    ),
                    Some(h) => say!(
                        "voided code {} in pool {} ({reason}); it was issued to order {} (line {}) at {} and will never be issued again",
                        c.masked(),
                        c.pool,
                        h.order_id,
                        h.line,
                        when(Some(h.issued_at)),
                    ),
                }
            }
            if backorder_cancelled {
                say!("the order's backorder for the codes it still waited for is cancelled too");
            }
        }
        VoidOutcome::BackorderCancelled { order_id } => {
            say!("order {order_id} holds no issued code to void; its backorder is cancelled (and any replacement it waited for) and will not be fulfilled (`codepool lookup --order {order_id}` shows its codes)");
        }
    }
    Ok(crate::exit::OK)
}

/// `--import`: recall the import's unissued codes (every run of the file
/// in that pool), list the issued ones.
async fn recall(cfg: &Config, import: &str, reason: &str, json: bool) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let hot = crate::context::hot_pool(cfg)?;
    let actor = super::actor("void --import");
    let r = controls::recall_import(&store, &hot, import, reason, &actor).await?;
    if json {
        return print_recall_json(&r);
    }
    let runs: Vec<String> = (r.runs.iter())
        .map(|run| {
            format!(
                "{} ({}, {} code(s), {} voided)",
                run.id.to_hex(),
                run.status,
                run.codes,
                run.voided
            )
        })
        .collect();
    say!(
        "import {} ({} into pool {}): {} unissued code(s) voided ({}); {} already issued, left with their buyers:",
        r.import.id.to_hex(),
        r.import.file,
        r.import.pool,
        r.voided,
        reason.trim(),
        r.held.len()
    );
    for c in &r.held {
        if let Some(h) = &c.holder {
            say!(
                "  {:<20} {:<9} order {} uid {} phone {} issued {}",
                c.masked(),
                c.status.name(),
                h.order_id,
                h.uid,
                h.phone,
                when(Some(h.issued_at))
            );
        }
    }
    say!(
        "the recall covered {} run(s) of the file in pool {}: {}",
        r.runs.len(),
        r.import.pool,
        runs.join(", ")
    );
    Ok(left_runs(&r))
}

/// Runs the recall could not prove to be of another file: named on
/// stderr, and the exit code says the recall is partial.
fn left_runs(r: &controls::Recall) -> u8 {
    if r.left.is_empty() {
        return crate::exit::OK;
    }
    for (id, codes) in &r.left {
        eprintln!(
            "codepool: left run {} of a file named {:?} in pool {} ({codes} code(s)): it never finished and is not chained to this import, so it may be the same file; check it with `codepool imports` and recall it with `codepool void --import {} --reason ...`",
            id.to_hex(),
            r.import.file,
            r.import.pool,
            id.to_hex()
        );
    }
    crate::exit::PARTIAL
}

fn print_recall_json(r: &controls::Recall) -> anyhow::Result<u8> {
    let held: Vec<_> = (r.held.iter())
        .map(|c| {
            let h = c.holder.as_ref();
            serde_json::json!({
                "code": c.masked(), "status": c.status.name(),
                "order_id": h.map(|h| &h.order_id), "uid": h.map(|h| &h.uid),
                "phone": h.map(|h| &h.phone), "issued_at": h.map(|h| when(Some(h.issued_at))),
            })
        })
        .collect();
    let runs: Vec<_> = (r.runs.iter())
        .map(|run| {
            serde_json::json!({
                "import_id": run.id.to_hex(), "status": run.status,
                "codes": run.codes, "voided": run.voided,
            })
        })
        .collect();
    let left: Vec<_> = (r.left.iter())
        .map(|(id, codes)| serde_json::json!({"import_id": id.to_hex(), "codes": codes}))
        .collect();
    let out = serde_json::json!({
        "import_id": r.import.id.to_hex(), "pool": r.import.pool, "file": r.import.file,
        "voided": r.voided, "issued": held.len(), "held": held, "runs": runs, "left": left,
    });
    say_json!(serde_json::to_string_pretty(&out)?);
    Ok(left_runs(r))
}
