//! `codepool void`: take a code back (a refund, a withdrawn batch). Status
//! 0 or 1 → 3. A voided issued code never returns to the pool: its buyer
//! has already seen it.

use clap::Args;
use codepool_dispatcher::ops;
use codepool_domain::when;
use codepool_store::lifecycle::VoidOutcome;

use super::target::CodeTarget;
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
    let target = args.target.code_ref()?;
    let store = crate::context::store(cfg).await?;
    let hot = crate::context::hot_pool(cfg)?;
    let reason = args.reason.trim();
    match ops::void(&store, &hot, target, reason).await? {
        VoidOutcome::Voided(t) => {
            let c = &t.before;
            match &c.holder {
                None => println!(
                    "voided unissued code {} in pool {} ({reason}); it will never be issued",
                    c.masked(),
                    c.pool
                ),
                Some(h) => println!(
                    "voided code {} in pool {} ({reason}); it was issued to order {} at {} and will never be issued again",
                    c.masked(),
                    c.pool,
                    h.order_id,
                    when(Some(h.issued_at)),
                ),
            }
        }
        VoidOutcome::BackorderCancelled { order_id } => {
            println!("order {order_id} had no code yet; its backorder is cancelled and will not be fulfilled");
        }
    }
    Ok(crate::exit::OK)
}
