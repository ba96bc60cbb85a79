//! `codepool migrate`: apply migrations/ (also done at every start), then
//! encrypt codes stored in plaintext by versions before encryption.

use clap::Args;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool migrate
  codepool migrate --batch-size 5000

Codes stored in plaintext (by versions before encryption at rest) are
encrypted in place with the active key of the key file, in batches. It is
resumable (run it again after an interruption) and safe while dispatchers
run: claims never read the code, so none is skipped or issued twice.

Codes imported before look-alike checks get their look-alike key, and any
look-alike pairs a pool already holds (codes equal under Unicode NFKC and
case folding) are listed. Neither code of a pair is voided.

Codes stored before cross-pool claims are claimed for their pools (a code
sits in one pool as codepool compares codes); the look-alike pairs found
across pools are counted here and listed by `codepool lookalikes`.")]
pub struct MigrateArgs {
    /// Plaintext codes encrypted per batch.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
}

pub async fn run(cfg: &Config, args: MigrateArgs) -> anyhow::Result<u8> {
    let store = codepool_store::Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
    crate::context::remember(&store);
    let report = codepool_store::migrate::migrate(&store).await?;
    for name in &report.applied {
        say!("applied  {name}");
    }
    for name in &report.already_applied {
        say!("present  {name}");
    }
    say!(
        "migrations: {} applied, {} already present (database {:?})",
        report.applied.len(),
        report.already_applied.len(),
        cfg.db
    );
    let store = store.with_keys(crate::context::code_keys(cfg)?);
    let plaintext = store.count_plaintext(None, None).await?;
    if plaintext > 0 {
        seal_plaintext(&store, plaintext, args.batch_size).await?;
    }
    key_lookalikes(&store, args.batch_size).await?;
    claim_codes(&store, args.batch_size).await?;
    Ok(crate::exit::OK)
}

/// Claims every code stored before cross-pool claims for its pool
/// (resumable: it goes on where an interrupted run stopped), and says how
/// many look-alike pairs across pools it found; `codepool lookalikes`
/// lists them.
async fn claim_codes(store: &codepool_store::Store, batch_size: i64) -> anyhow::Result<()> {
    if store.claims_complete().await? {
        return Ok(());
    }
    store.keys().ring().map_err(|e| {
        anyhow::anyhow!("codes stored before cross-pool claims need a key to be claimed: {e}")
    })?;
    let (mut after, mut read, mut shared) = (store.claims_backfill_after().await?, 0u64, 0u64);
    loop {
        let (n, pairs, next) = store.claims_backfill_batch(after, batch_size).await?;
        if n == 0 {
            break;
        }
        (read, shared, after) = (read + n, shared + pairs, next);
        store.save_claims_backfill(after, false).await?;
    }
    store.save_claims_backfill(after, true).await?;
    say!("claimed {read} code(s) stored before cross-pool claims for their pools");
    if shared > 0 {
        say!(
            "{shared} of them read the same as a code of another pool (a code sits in one pool): \
             `codepool lookalikes` lists the pairs, to void the code the partner did not mean"
        );
    }
    Ok(())
}

/// Gives every code imported before look-alikes were refused its
/// look-alike key, and lists the look-alike pairs pools already hold.
/// Nothing is voided: which code the partner meant is an operator's call.
async fn key_lookalikes(store: &codepool_store::Store, batch_size: i64) -> anyhow::Result<()> {
    if !store.has_unkeyed_folds().await? {
        return store.finish_fold_backfill().await.map_err(Into::into);
    }
    store.keys().ring().map_err(|e| {
        anyhow::anyhow!("codes imported before look-alike checks need a key to be checked: {e}")
    })?;
    let (mut after, mut keyed, mut pairs) = (None, 0u64, Vec::new());
    loop {
        let batch = store.fold_backfill_batch(after, batch_size).await?;
        if batch.read == 0 {
            break;
        }
        keyed += batch.keyed;
        pairs.extend(batch.pairs);
        after = batch.next_after;
    }
    store.finish_fold_backfill().await?;
    say!("checked {keyed} code(s) imported before look-alike checks");
    if pairs.is_empty() {
        return Ok(());
    }
    say!(
        "{} look-alike pair(s): codes that read the same to a buyer (Unicode NFKC and case folding). \
         Both stay issuable; void the one the partner did not mean with \
         `codepool void --pool POOL --code CODE --reason lookalike`:",
        pairs.len()
    );
    for p in &pairs {
        say!(
            "  pool {:?}: {} (id {}) reads like {} (id {})",
            p.pool,
            p.lookalike_masked,
            p.lookalike,
            p.kept_masked,
            p.kept
        );
    }
    Ok(())
}

async fn seal_plaintext(
    store: &codepool_store::Store,
    plaintext: u64,
    batch_size: i64,
) -> anyhow::Result<()> {
    store.keys().ring().map_err(|e| {
        anyhow::anyhow!(
            "{plaintext} code(s) are stored in plaintext and need a key to be encrypted: {e}"
        )
    })?;
    let sealed = super::keys::in_batches(
        "encrypting",
        plaintext,
        || store.seal_plaintext_batch(batch_size),
        || store.has_plaintext(),
    )
    .await?;
    say!("encrypted {sealed} plaintext code(s) in place; no plaintext code is left");
    Ok(())
}
