//! `codepool expire`: void unissued codes whose `expires_at` has passed.

use clap::Args;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool expire
  codepool expire --pool game-x

Expired codes are never issued, whether or not this runs: the claim checks
expires_at. Running dispatchers do this every minute; this command does it
now, so `codepool stats` shows them as void (reason `expired`).")]
pub struct ExpireArgs {
    /// Only this pool (default: every pool).
    #[arg(long)]
    pub pool: Option<String>,
}

pub async fn run(cfg: &Config, args: ExpireArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let hot = crate::context::hot_pool(cfg)?;
    let n = codepool_issuance::ops::expire(&store, &hot, args.pool.as_deref()).await?;
    say!("voided {n} expired code(s)");
    Ok(crate::exit::OK)
}
