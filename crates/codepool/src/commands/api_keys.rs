//! `codepool api-keys`: create, list and revoke the keys of the HTTP API.

use clap::{Args, Subcommand};
use codepool_api::keys::{self, Scope};

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool api-keys create --name shop --scopes orders:write,orders:read
  codepool api-keys create --name support --scopes orders:read,codes:reveal
  codepool api-keys create --name acme-1 --shop acme --scopes orders:write,orders:read
  codepool api-keys list
  codepool api-keys revoke --name shop

Scopes: orders:write (place, redeem, void and resend orders; the answer to
placing one carries its codes), orders:read (read orders, codes masked),
codes:reveal (read codes in plaintext, each reveal audited with the key's
name), admin (pools, imports, dead letters). The secret is printed once and
only its SHA-256 is stored: keep it in the shop's secret store. A revoked
key stops working within a second on every API process. Creating and
revoking a key are written to the audit collection with the OS user and
host (never the secret).")]
pub struct ApiKeysArgs {
    #[command(subcommand)]
    pub command: ApiKeysCommand,
}

#[derive(Debug, Subcommand)]
pub enum ApiKeysCommand {
    /// Create a key and print its secret, once.
    Create {
        /// A name for the key, e.g. the shop it belongs to.
        #[arg(long)]
        name: String,
        /// Comma-separated scopes.
        #[arg(long, value_delimiter = ',', required = true, value_parser = parse_scope)]
        scopes: Vec<Scope>,
        /// The shop the key belongs to (`codepool shops`): it acts on the
        /// shop's pools and orders only.
        #[arg(long)]
        shop: Option<String>,
    },
    /// List keys: name, scopes, created, revoked.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by name.
    Revoke {
        #[arg(long)]
        name: String,
    },
}

fn parse_scope(s: &str) -> Result<Scope, String> {
    Scope::parse(s).ok_or_else(|| {
        format!(
            "unknown scope {s:?}; use {}",
            Scope::ALL.map(Scope::as_str).join(", ")
        )
    })
}

pub async fn run(cfg: &Config, args: ApiKeysArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    match args.command {
        ApiKeysCommand::Create { name, scopes, shop } => {
            let actor = super::actor("api-keys create");
            let new = keys::create_for(&store, &name, &scopes, shop.as_deref(), &actor).await?;
            eprintln!(
                "created API key {:?}{} with scopes {}; its secret (shown once, only a hash is kept):",
                new.key.name,
                shop.map(|s| format!(" of shop {s:?}")).unwrap_or_default(),
                new.key.scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",")
            );
            say!("{}", new.token);
        }
        ApiKeysCommand::List { json } => {
            let all = keys::list(&store).await?;
            if json {
                let rows: Vec<_> = all
                    .iter()
                    .map(|k| {
                        serde_json::json!({
                            "name": k.name, "id": k.id,
                            "scopes": k.scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                            "created_at": k.created_at.to_chrono().to_rfc3339(),
                            "revoked_at": k.revoked_at.map(|t| t.to_chrono().to_rfc3339()),
                            "shop": k.shop,
                        })
                    })
                    .collect();
                say_json!(serde_json::to_string_pretty(&rows)?);
            } else {
                say!(
                    "{:<24} {:<16} {:<44} {:<21} REVOKED",
                    "NAME",
                    "ID",
                    "SCOPES",
                    "CREATED"
                );
                for k in &all {
                    say!(
                        "{:<24} {:<16} {:<44} {:<21} {}",
                        k.name,
                        k.id,
                        k.scopes
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(","),
                        super::target::when(Some(k.created_at)),
                        k.revoked_at
                            .map_or("-".to_owned(), |t| super::target::when(Some(t))),
                    );
                }
            }
        }
        ApiKeysCommand::Revoke { name } => {
            let k = keys::revoke(&store, &name, &super::actor("api-keys revoke")).await?;
            say!(
                "revoked API key {:?} ({}); it stops working within a second",
                k.name,
                k.id
            );
        }
    }
    Ok(crate::exit::OK)
}
