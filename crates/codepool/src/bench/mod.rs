//! `codepool bench …`: side-by-side benchmarks. Each compares approaches in
//! one process and one run, because absolute times drift on shared
//! machines; results are printed and written as JSON under target/bench/.

pub mod seq;

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::config::Config;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Where JSON results go.
    #[arg(long, default_value = "target/bench", global = true)]
    pub out_dir: PathBuf,
    #[command(subcommand)]
    pub which: Which,
}

#[derive(Debug, Subcommand)]
pub enum Which {
    /// Sequence generators against the classic read-then-update loop.
    Seq(seq::SeqBenchArgs),
}

pub async fn run(cfg: &Config, args: BenchArgs) -> anyhow::Result<u8> {
    std::fs::create_dir_all(&args.out_dir)?;
    match args.which {
        Which::Seq(a) => {
            let store = codepool_store::Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
            seq::run(a, store.database().clone(), &cfg.redis_url, &args.out_dir).await?;
        }
    }
    Ok(crate::exit::OK)
}
