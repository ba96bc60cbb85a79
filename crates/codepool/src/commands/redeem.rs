//! `codepool redeem`: an issued code was used by its buyer (status 1 → 2).

use clap::Args;
use codepool_domain::mask;

use super::target::CodeTarget;
use crate::config::Config;

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["order", "code"])))]
#[command(after_help = "\
Examples:
  codepool redeem --code QWER-1234 --pool game-x
  codepool redeem --order O-1001

--order redeems every issued code of the order; --code that one code.
Only an issued code can be redeemed. Redeeming an unissued, void or already
used code is an error that says which (exit code 1). The platform can also
send `code.redeemed` events ({\"pool\":…,\"code\":…} or {\"order_id\":…}) on the
codepool.events exchange; running dispatchers apply them.")]
pub struct RedeemArgs {
    #[command(flatten)]
    pub target: CodeTarget,
}

pub async fn run(cfg: &Config, args: RedeemArgs) -> anyhow::Result<u8> {
    let target = args.target.code_ref()?;
    let store = crate::context::store(cfg).await?;
    let actor = super::actor("redeem");
    let done = codepool_issuance::ops::redeem(&store, target, None, &actor).await?;
    let codepool_issuance::model::Redeemed::Now(done) = done else {
        // Only a redemption with an id is ever "made before".
        anyhow::bail!("{} was redeemed before", target.describe());
    };
    for t in done {
        let holder = t.before.holder.as_ref();
        say!(
            "redeemed {} in pool {} (order {}, issued {}) at {}",
            mask(&t.before.code),
            t.before.pool,
            holder.map_or("-", |h| h.order_id.as_str()),
            codepool_domain::when(holder.map(|h| h.issued_at)),
            super::target::when(Some(t.at)),
        );
    }
    Ok(crate::exit::OK)
}
