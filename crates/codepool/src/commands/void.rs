//! `codepool void`: take a code back (a refund, a withdrawn batch). Status
//! 0 or 1 → 3. A voided issued code never returns to the pool: its buyer
//! has already seen it.

use clap::Args;
use codepool_domain::{mask, CodeStatus};
use codepool_store::lifecycle::VoidOutcome;

use super::target::{when, CodeTarget};
use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool void --order O-1001 --reason refund
  codepool void --code QWER-1234 --pool game-x --reason \"leaked in a forum\"

An unissued code is withdrawn from the pool (and from the Redis hot pool).
An issued code stays with its order but is void: it is never issued again,
and the order can never receive another code. An order that is still
waiting for stock (a backorder) has its backorder cancelled instead.
A used code cannot be voided.")]
pub struct VoidArgs {
    #[command(flatten)]
    pub target: CodeTarget,
    /// Why (stored with the code, shown by `codepool lookup`).
    #[arg(long)]
    pub reason: String,
}

pub async fn run(cfg: &Config, args: VoidArgs) -> anyhow::Result<u8> {
    let reason = args.reason.trim();
    if reason.is_empty() || reason.chars().count() > 200 {
        anyhow::bail!("--reason must say why in 1 to 200 characters, e.g. --reason refund");
    }
    let target = args.target.code_ref()?;
    let store = crate::context::store(cfg).await?;
    match store.void(target, reason).await? {
        VoidOutcome::Voided(t) => {
            let d = &t.before;
            if d.status() == Some(CodeStatus::Unissued) {
                // Best effort: the claim's condition refuses void codes anyway.
                let hot = crate::context::hot_pool(cfg)?;
                let _ = hot.remove(&d.pool, &[d.id.to_hex()]).await;
                println!(
                    "voided unissued code {} in pool {} ({reason}); it will never be issued",
                    mask(&d.code),
                    d.pool
                );
            } else {
                println!(
                    "voided code {} in pool {} ({reason}); it was issued to order {} at {} and will never be issued again",
                    mask(&d.code),
                    d.pool,
                    d.order_id.as_deref().unwrap_or("-"),
                    when(d.issued_at),
                );
            }
        }
        VoidOutcome::BackorderCancelled { order_id } => {
            println!("order {order_id} had no code yet; its backorder is cancelled and will not be fulfilled");
        }
    }
    Ok(crate::exit::OK)
}
