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
run: claims never read the code, so none is skipped or issued twice.")]
pub struct MigrateArgs {
    /// Plaintext codes encrypted per batch.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
}

pub async fn run(cfg: &Config, args: MigrateArgs) -> anyhow::Result<u8> {
    let store = codepool_store::Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
    let report = codepool_store::migrate::migrate(&store).await?;
    for name in &report.applied {
        println!("applied  {name}");
    }
    for name in &report.already_applied {
        println!("present  {name}");
    }
    println!(
        "migrations: {} applied, {} already present (database {:?})",
        report.applied.len(),
        report.already_applied.len(),
        cfg.db
    );
    let store = store.with_keys(crate::context::code_keys(cfg)?);
    let plaintext = store.count_plaintext(None, None).await?;
    if plaintext == 0 {
        return Ok(crate::exit::OK);
    }
    store.keys().ring().map_err(|e| {
        anyhow::anyhow!(
            "{plaintext} code(s) are stored in plaintext and need a key to be encrypted: {e}"
        )
    })?;
    let sealed = super::keys::in_batches(
        "encrypting",
        plaintext,
        || store.seal_plaintext_batch(args.batch_size),
        || store.has_plaintext(),
    )
    .await?;
    println!("encrypted {sealed} plaintext code(s) in place; no plaintext code is left");
    Ok(crate::exit::OK)
}
