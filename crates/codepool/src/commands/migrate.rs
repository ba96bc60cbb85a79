//! `codepool migrate`: apply migrations/ (also done at every start).

use crate::config::Config;

pub async fn run(cfg: &Config) -> anyhow::Result<u8> {
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
    Ok(crate::exit::OK)
}
