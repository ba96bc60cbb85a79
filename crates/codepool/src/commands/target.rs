//! `--code C --pool P | --order O`: how `redeem` and `void` name a code.

use clap::Args;
use codepool_store::lifecycle::CodeRef;

/// Which code a lifecycle command acts on. The command requires one of
/// `--order`/`--code` (a group of its own, so `void` can add `--import`).
#[derive(Debug, Args)]
#[group(id = "target", required = false, multiple = true)]
pub struct CodeTarget {
    /// The code, as printed on the buyer's SMS (with --pool).
    #[arg(long, requires = "pool", conflicts_with = "order")]
    pub code: Option<String>,
    /// The pool of --code.
    #[arg(long, requires = "code")]
    pub pool: Option<String>,
    /// The order whose code is meant.
    #[arg(long, conflicts_with_all = ["code", "pool"], value_parser = order_id)]
    pub order: Option<String>,
}

impl CodeTarget {
    pub fn code_ref(&self) -> anyhow::Result<CodeRef<'_>> {
        match (&self.order, &self.code, &self.pool) {
            (Some(order), _, _) => Ok(CodeRef::Order(order)),
            (None, Some(code), Some(pool)) => Ok(CodeRef::Code { pool, code }),
            _ => anyhow::bail!("say which code: --code C --pool P, or --order O"),
        }
    }
}

/// An order id as given on the command line, compared as stored: NFC.
pub fn order_id(s: &str) -> Result<String, String> {
    Ok(codepool_domain::text::nfc(s.trim()))
}

/// A time as shown to operators (UTC, seconds).
pub fn when(t: Option<bson::DateTime>) -> String {
    t.map(|t| {
        t.to_chrono()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    })
    .unwrap_or_else(|| "-".into())
}
