//! `codepool keys`: the key file that encrypts codes at rest, and moving
//! codes from one key to the next. Adding a key and a rotation are
//! written to the `audit` collection with the OS user and host (the key
//! id, never the key): `keys add` reaches the database before it touches
//! the key file, so a key is not added where it cannot be recorded.

use std::future::Future;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::{Args, Subcommand};
use codepool_issuance::audit;
use codepool_store::StoreError;
use codepool_vault::keyfile;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool keys init                      create the key file (once)
  codepool keys add                       a new key, active for new codes
  codepool keys rotate                    re-encrypt existing codes under it
  codepool keys status                    codes per key id

The key file (CODEPOOL_KEY_FILE or --key-file, default
~/.config/codepool/keys.json) holds every key the codes were encrypted with
and the HMAC key that finds them. Back it up: losing it loses the codes.
Keep old keys in the file until `keys status` shows no code under them.
`keys add` and `keys rotate` are written to the audit collection with the
OS user and host, so they need the database.")]
pub struct KeysArgs {
    #[command(subcommand)]
    pub command: KeysCommand,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create the key file (mode 0600); an existing one is never overwritten.
    Init,
    /// Add a random key and make it active; old keys stay to decrypt old codes.
    Add,
    /// Re-encrypt codes under the active key: batched, resumable, safe while dispatchers run.
    Rotate(RotateArgs),
    /// Codes per key id (and plaintext codes left from before encryption).
    Status,
}

#[derive(Debug, Args)]
pub struct RotateArgs {
    /// Codes re-encrypted per batch.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
}

pub async fn run(cfg: &Config, args: KeysArgs) -> anyhow::Result<u8> {
    let path = cfg.key_path();
    match args.command {
        KeysCommand::Init => {
            let ring = keyfile::init(&path)?;
            say!(
                "created key file {} (mode 0600, active key {})",
                path.display(),
                ring.active_id()
            );
            say!("back it up now: losing this file loses every code encrypted with it");
        }
        KeysCommand::Add => {
            // The database first: a key that cannot be recorded is not added.
            let store = crate::context::store(cfg).await?;
            let (_, id) = keyfile::add_key(&path)?;
            let what = format!(
                "key {id} added to key file {} and made active for new codes",
                path.display()
            );
            audit::record(
                &store,
                &super::actor("keys add"),
                audit::AuditKind::KeyAdd,
                what,
            )
            .await?;
            say!(
                "added key {id} to {}; new codes are encrypted with it",
                path.display()
            );
            say!("next: `codepool keys rotate` re-encrypts existing codes (keep the old keys until `codepool keys status` shows none left under them)");
        }
        KeysCommand::Rotate(a) => rotate(cfg, a.batch_size).await?,
        KeysCommand::Status => status(cfg).await?,
    }
    Ok(crate::exit::OK)
}

/// A progress bar on a terminal, nothing otherwise.
pub fn progress(total: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

/// Runs `batch` until it changes nothing and `more` says none is left,
/// with a progress bar of `total`; returns how many documents changed.
pub async fn in_batches<B, BF, M, MF>(
    what: &str,
    total: u64,
    mut batch: B,
    mut more: M,
) -> Result<u64, StoreError>
where
    B: FnMut() -> BF,
    BF: Future<Output = Result<u64, StoreError>>,
    M: FnMut() -> MF,
    MF: Future<Output = Result<bool, StoreError>>,
{
    let bar = progress(total, what);
    let mut done = 0;
    loop {
        let n = batch().await?;
        if n == 0 && !more().await? {
            break;
        }
        done += n;
        bar.inc(n);
    }
    bar.finish_and_clear();
    Ok(done)
}

async fn rotate(cfg: &Config, batch: i64) -> anyhow::Result<()> {
    let store = crate::context::store(cfg).await?;
    store.check_keys().await?;
    let ring = store.keys().ring()?;
    let total = store.count_to_rotate().await?;
    // Counted as the batches land, so a rotation cut short is recorded
    // with what it did.
    let moved = AtomicU64::new(0);
    let (s, m) = (&store, &moved);
    let result = in_batches(
        "re-encrypting",
        total,
        move || async move {
            let n = s.rotate_batch(batch).await?;
            m.fetch_add(n, Ordering::Relaxed);
            Ok(n)
        },
        || async { Ok(store.count_to_rotate().await? > 0) },
    )
    .await;
    let (done, active) = (moved.load(Ordering::Relaxed), ring.active_id());
    let what = match &result {
        Ok(_) => format!("{done} code(s) re-encrypted under key {active}; every code now uses it"),
        Err(e) => format!("{done} code(s) re-encrypted under key {active}, then stopped: {e}"),
    };
    let recorded = audit::record(
        &store,
        &super::actor("keys rotate"),
        audit::AuditKind::KeyRotate,
        what,
    )
    .await;
    result?;
    recorded?;
    say!("re-encrypted {done} code(s) under key {active}; every code now uses it");
    Ok(())
}

async fn status(cfg: &Config) -> anyhow::Result<()> {
    let store = crate::context::store(cfg).await?;
    let ring = store.keys().ring().ok();
    say!("key file {}", cfg.key_path().display());
    say!("{:<12} {:>12}  NOTE", "KEY", "CODES");
    let usage = store.codes_per_key().await?;
    for u in &usage {
        let note = match (&u.key_id, &ring) {
            (None, _) => "plaintext: run `codepool migrate` to encrypt".to_owned(),
            (Some(id), Some(r)) if r.active_id() == id => "active".to_owned(),
            (Some(id), Some(r)) if r.has_key(id) => "rotate with `codepool keys rotate`".into(),
            (Some(_), _) => "MISSING from the key file: restore it from your backup".into(),
        };
        let id = u.key_id.as_deref().unwrap_or("-");
        say!("{id:<12} {:>12}  {note}", u.codes);
    }
    if let Some(r) = &ring {
        let unused = r
            .key_ids()
            .filter(|k| !usage.iter().any(|u| u.key_id.as_deref() == Some(*k)));
        for k in unused {
            let note = if k == r.active_id() {
                "active"
            } else {
                "no codes"
            };
            say!("{k:<12} {:>12}  {note}", 0);
        }
    }
    Ok(())
}
