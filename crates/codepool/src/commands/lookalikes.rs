//! `codepool lookalikes`: the look-alike pairs stored across pools, for an
//! operator to act on. A code sits in one pool as codepool compares codes
//! (case, width and, where either pool folds them, O/0 and I/L/1): imports
//! and generation refuse a look-alike of another pool's code since claims
//! came (migration 0025), but pairs stored before, found by `codepool
//! migrate`, and those imported on purpose with `--allow-cross-pool` stay
//! until an operator voids one code of each.

use clap::Args;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool lookalikes
  codepool lookalikes --json
  codepool lookalikes --after KEY --limit 100

Each pair is two stored codes of two pools that are one code as codepool
compares codes: equal under Unicode NFKC and case folding, and with O as 0,
I and L as 1 wherever either pool folds confusables. A platform that redeems
by code finds both; one may be sold twice. Keep the code the partner meant
and void the other while it is unsold:
  codepool void --pool POOL --code CODE --reason lookalike
A pair already sold twice is for support (`codepool lookup --order ORDER`).

The pairs come from `codepool migrate` (which claims every code stored
before claims existed, and marks pairs it finds) and from imports run with
--allow-cross-pool. Codes are masked; `codepool lookup --pool POOL --code
...` finds one by value.

Exit codes: 0 the list (empty or not; stderr says how many pairs); 1 failure.")]
pub struct LookalikesArgs {
    /// Print JSON lines, one pair a line.
    #[arg(long)]
    pub json: bool,
    /// Claim keys listed at most (a key may hold more than one pair).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub limit: i64,
    /// Go on after this key (the last `key` of an earlier page).
    #[arg(long)]
    pub after: Option<String>,
}

pub async fn run(cfg: &Config, args: LookalikesArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let store = store.with_keys(crate::context::code_keys(cfg)?);
    if !store.claims_complete().await? {
        eprintln!("warning: codes stored before cross-pool claims are not all claimed yet; run `codepool migrate` first, then this again");
    }
    let pairs = store
        .cross_pool_lookalikes(args.after.as_deref(), args.limit)
        .await?;
    for p in &pairs {
        if args.json {
            say_json!(serde_json::to_string(p)?);
            continue;
        }
        let side = |c: &codepool_store::claims::ClaimedCode| {
            let order = c
                .order_id
                .as_deref()
                .map(|o| format!(", order {o}"))
                .unwrap_or_default();
            let import = c.import.as_deref().unwrap_or("-");
            format!(
                "pool {:?} {} (id {}, {}{order}, import {import})",
                c.pool, c.masked, c.code, c.status
            )
        };
        say!(
            "{}  reads like  {}  [key {}]",
            side(&p.first),
            side(&p.second),
            p.key
        );
    }
    if pairs.is_empty() {
        eprintln!("no look-alike pair is stored across pools");
        return Ok(crate::exit::OK);
    }
    eprintln!(
        "{} look-alike pair(s) across pools: void the code the partner did not mean while it is unsold (`codepool void --pool POOL --code CODE --reason lookalike`); see --help",
        pairs.len()
    );
    Ok(crate::exit::OK)
}
