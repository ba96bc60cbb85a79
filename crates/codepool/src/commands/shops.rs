//! `codepool shops`: create, list, show a shop and set the pools it may
//! order from. A shop's API keys (`api-keys create --shop`) and the
//! purchases that name it act on its own pools and orders only.

use clap::{Args, Subcommand};
use codepool_issuance::shops;
use codepool_store::shops::ShopDoc;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool shops create --name acme --pools game-x,game-y
  codepool shops create --name everything --pools '*'
  codepool shops set --name acme --pools game-x,game-y,game-z
  codepool shops show --name acme
  codepool shops list --json
  codepool api-keys create --name acme-1 --shop acme --scopes orders:write,orders:read

A shop's key orders only from the shop's pools (another pool answers 403
pool-not-allowed), and reads, repeats, voids, redeems and resends only the
shop's orders (another shop's answer 404, or 409 conflicting-order when
posted again). A purchase over AMQP may name its \"shop\"; the same rules
apply. `--pools` replaces the whole list; '*' means every pool.")]
pub struct ShopsArgs {
    #[command(subcommand)]
    pub command: ShopsCommand,
}

#[derive(Debug, Subcommand)]
pub enum ShopsCommand {
    /// Create a shop with the pools it may order from.
    Create {
        /// The shop's name (letters, digits, '.', '_', '-').
        #[arg(long)]
        name: String,
        /// Comma-separated pools, or '*' for every pool.
        #[arg(long, value_delimiter = ',', required = true)]
        pools: Vec<String>,
        /// Comma-separated RabbitMQ users that may publish purchases for
        /// the shop (checked against each message's user_id); without
        /// them, no AMQP purchase may name the shop.
        #[arg(long, value_delimiter = ',', value_name = "USERS")]
        broker_users: Option<Vec<String>>,
    },
    /// Replace a shop's pools, or the broker users that publish for it.
    Set {
        #[arg(long)]
        name: String,
        /// Comma-separated pools, or '*' for every pool.
        #[arg(long, value_delimiter = ',', required_unless_present = "broker_users")]
        pools: Option<Vec<String>>,
        /// Comma-separated RabbitMQ users that may publish purchases for
        /// the shop; an empty value ("") allows none.
        #[arg(long, value_delimiter = ',', value_name = "USERS")]
        broker_users: Option<Vec<String>>,
    },
    /// Show one shop.
    Show {
        #[arg(long)]
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the shops.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn json_of(s: &ShopDoc) -> serde_json::Value {
    serde_json::json!({
        "name": s.name,
        "pools": s.pools,
        "broker_users": s.broker_users,
        "created_at": s.created_at.to_chrono().to_rfc3339(),
    })
}

/// The broker users that publish for a shop, as the end of a sentence.
fn publishers(s: &ShopDoc) -> String {
    if s.broker_users.is_empty() {
        "; no broker user may publish purchases for it (--broker-users)".into()
    } else {
        format!(
            "; broker users {} publish its AMQP purchases",
            s.broker_users.join(",")
        )
    }
}

fn print(shops: &[ShopDoc], json: bool) -> anyhow::Result<()> {
    if json {
        let rows: Vec<_> = shops.iter().map(json_of).collect();
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!("{:<24} {:<21} POOLS", "NAME", "CREATED");
    for s in shops {
        say!(
            "{:<24} {:<21} {}",
            s.name,
            super::target::when(Some(s.created_at)),
            s.pools.join(",")
        );
    }
    Ok(())
}

pub async fn run(cfg: &Config, args: ShopsArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    match args.command {
        ShopsCommand::Create {
            name,
            pools,
            broker_users,
        } => {
            let actor = super::actor("shops create");
            let mut shop = shops::create(&store, &name, &pools, &actor).await?;
            if let Some(users) = broker_users {
                shop = shops::set_broker_users(&store, &name, &users, &actor).await?;
            }
            say!(
                "created shop {:?}; it orders from {}{}",
                shop.name,
                shop.pools.join(","),
                publishers(&shop)
            );
        }
        ShopsCommand::Set {
            name,
            pools,
            broker_users,
        } => {
            let actor = super::actor("shops set");
            let mut shop = None;
            if let Some(pools) = pools {
                shop = Some(shops::set_pools(&store, &name, &pools, &actor).await?);
            }
            if let Some(users) = broker_users {
                shop = Some(shops::set_broker_users(&store, &name, &users, &actor).await?);
            }
            if let Some(shop) = shop {
                say!(
                    "shop {:?} now orders from {}{}",
                    shop.name,
                    shop.pools.join(","),
                    publishers(&shop)
                );
            }
        }
        ShopsCommand::Show { name, json } => match store.shop(&name).await? {
            Some(s) => print(&[s], json)?,
            None => anyhow::bail!(shops::ShopError::Unknown(name)),
        },
        ShopsCommand::List { json } => print(&store.shops().await?, json)?,
    }
    Ok(crate::exit::OK)
}
