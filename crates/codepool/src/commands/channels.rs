//! `codepool channels`: a shop's marketplace accounts (Eneba, G2A,
//! Kinguin). Add one with its credentials, map the marketplace's products
//! to the shop's pools, list, show, pause, resume and remove them; every
//! change is audited. The marketplace then calls `codepool api` under
//! `/channels/NAME/…` (docs/channels.md).

use std::path::PathBuf;

use clap::{Args, Subcommand};
use codepool_issuance::channels::{self, NewChannel};
use codepool_store::channels::{ChannelDoc, DealState};
use codepool_store::Store;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool channels add --name acme-eneba --kind eneba --shop acme --credentials eneba.json
  codepool channels map --name acme-eneba --product 8f2c1a52-6a1e-4b8e-9a55-0c9a3e1f0b7d --pool game-x
  codepool channels add --name acme-g2a --kind g2a --shop acme --credentials g2a.json --hold-ttl 1800
  codepool channels set --name acme-eneba --share 40 --max 500
  codepool channels list --json
  codepool channels pause --name acme-eneba

The credentials file is a JSON object. eneba: {\"token\": \"…\"}, the bearer
value registered with Eneba's P_registerCallback, and to declare stock
through Eneba's API \"api_client_id\", \"api_secret\" (optionally \"api_url\",
\"auth_url\"); g2a: {\"client_id\": \"…\",
\"client_secret\": \"…\"}, the client credentials given to G2A; kinguin:
{\"webhook_secret\": \"…\", \"client_id\": \"…\", \"client_secret\": \"…\",
\"base_url\": \"…\"}. What the marketplace presents is kept as its SHA-256
(at least 32 characters: `openssl rand -hex 32`); what codepool sends out is
sealed with the key file. What a channel declares of each product is its
pool's free codes under --share and --max (`channels set`). See
docs/channels.md.")]
pub struct ChannelsArgs {
    #[command(subcommand)]
    pub command: ChannelsCommand,
}

#[derive(Debug, Subcommand)]
pub enum ChannelsCommand {
    /// Add a marketplace account to a shop.
    Add {
        #[arg(long)]
        name: String,
        /// eneba, g2a or kinguin.
        #[arg(long)]
        kind: String,
        /// The shop whose pools the channel sells.
        #[arg(long)]
        shop: String,
        /// A JSON file of the channel's credentials (see below).
        #[arg(long)]
        credentials: PathBuf,
        /// How long a reservation holds its codes, in seconds (60 to
        /// 172800; eneba 172800, g2a 1800, kinguin 3600 unless given).
        #[arg(long, value_name = "SECONDS")]
        hold_ttl: Option<u64>,
        /// A cancellation after provision: burn (void the keys, answer
        /// 200) or resell (keep them sold, answer 500: the marketplace
        /// returns them to its own stock).
        #[arg(long, default_value = "burn")]
        after_provide: String,
        /// How long a G2A access token lives, in seconds.
        #[arg(long, value_name = "SECONDS")]
        token_ttl: Option<u64>,
        /// Declare at most this percent (0 to 100) of each pool's free
        /// codes to the marketplace.
        #[arg(long, value_name = "PERCENT")]
        share: Option<u32>,
        /// Declare at most this many codes of each product.
        #[arg(long, value_name = "N")]
        max: Option<u64>,
    },
    /// Cap what a channel declares of each product: a percent of its
    /// pool's free codes, a number of codes (`none`: no cap). Declared to
    /// the marketplace at once.
    Set {
        #[arg(long)]
        name: String,
        /// 0 to 100, or `none`.
        #[arg(long, value_name = "PERCENT|none")]
        share: Option<String>,
        /// A number of codes, or `none`.
        #[arg(long, value_name = "N|none")]
        max: Option<String>,
    },
    /// Sell a pool of the shop as a marketplace product (Eneba auction,
    /// G2A product, Kinguin offer).
    Map {
        #[arg(long)]
        name: String,
        #[arg(long)]
        product: String,
        #[arg(long)]
        pool: String,
    },
    /// List the channels.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show one channel: its products, reservations and provisions.
    Show {
        #[arg(long)]
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Reserve nothing new on a channel (what it reserved is still served).
    Pause {
        #[arg(long)]
        name: String,
    },
    /// Take reservations on a paused channel again.
    Resume {
        #[arg(long)]
        name: String,
    },
    /// Remove a channel: its marketplace's calls are refused from now on.
    Remove {
        #[arg(long)]
        name: String,
    },
}

fn json_of(c: &ChannelDoc) -> serde_json::Value {
    let mut v = serde_json::json!({
        "name": c.name,
        "kind": c.kind,
        "shop": c.shop,
        "state": if c.paused { "paused" } else { "active" },
        "products": c.products,
        "hold_ttl_seconds": c.hold_ttl_seconds,
        "after_provide": c.after_provide,
        "client_id": c.client_id,
        "base_url": c.base_url,
        "sealed_secrets": c.sealed.keys().collect::<Vec<_>>(),
        "share_percent": c.share_percent,
        "max_stock": c.max_stock,
        "api_url": c.api_url,
        "declared": c.declared,
        "created_at": c.created_at.to_chrono().to_rfc3339(),
    });
    // The token endpoint, named as the credentials file names it.
    let token_field = if c.kind == "kinguin" {
        "token_url"
    } else {
        "auth_url"
    };
    v[token_field] = serde_json::json!(c.auth_url);
    v
}

fn print(list: &[ChannelDoc], json: bool) -> anyhow::Result<()> {
    if json {
        let rows: Vec<_> = list.iter().map(json_of).collect();
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!(
        "{:<24} {:<8} {:<16} {:<7} PRODUCTS",
        "NAME",
        "KIND",
        "SHOP",
        "STATE"
    );
    for c in list {
        let products: Vec<String> = (c.products.iter())
            .map(|(p, pool)| format!("{p}→{pool}"))
            .collect();
        say!(
            "{:<24} {:<8} {:<16} {:<7} {}",
            c.name,
            c.kind,
            c.shop,
            if c.paused { "paused" } else { "active" },
            products.join(",")
        );
    }
    Ok(())
}

pub async fn run(cfg: &Config, args: ChannelsArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    match args.command {
        ChannelsCommand::Add {
            name,
            kind,
            shop,
            credentials,
            hold_ttl,
            after_provide,
            token_ttl,
            share,
            max,
        } => {
            let bytes = std::fs::read(&credentials).map_err(|e| {
                anyhow::anyhow!(
                    "cannot read the credentials file {}: {e}",
                    credentials.display()
                )
            })?;
            let new = NewChannel {
                name,
                kind: kind.parse()?,
                shop,
                credentials: bytes,
                hold_ttl_seconds: hold_ttl,
                after_provide: after_provide.parse()?,
                token_ttl_seconds: token_ttl,
                caps: channels::Caps {
                    share_percent: share,
                    max_stock: max,
                },
            };
            add(&store, new).await?;
        }
        ChannelsCommand::Map {
            name,
            product,
            pool,
        } => {
            let actor = super::actor("channels map");
            let c = channels::map(&store, &name, &product, &pool, &actor).await?;
            say!(
                "channel {:?} sells pool {pool:?} as product {product:?} ({} products)",
                c.name,
                c.products.len()
            );
            declare_now(&store, &c).await;
        }
        ChannelsCommand::Set { name, share, max } => set(&store, name, share, max).await?,
        ChannelsCommand::List { json } => print(&store.channels().await?, json)?,
        ChannelsCommand::Show { name, json } => show(&store, name, json).await?,
        ChannelsCommand::Pause { name } => {
            let actor = super::actor("channels pause");
            let c = channels::set_paused(&store, &name, true, &actor).await?;
            say!("channel {name:?} paused: it reserves nothing new and declares no stock");
            declare_now(&store, &c).await;
        }
        ChannelsCommand::Resume { name } => {
            let actor = super::actor("channels resume");
            let c = channels::set_paused(&store, &name, false, &actor).await?;
            say!("channel {name:?} takes reservations again");
            declare_now(&store, &c).await;
        }
        ChannelsCommand::Remove { name } => {
            channels::remove(&store, &name, &super::actor("channels remove")).await?;
            say!("channel {name:?} removed");
        }
    }
    Ok(crate::exit::OK)
}

/// `channels set`: a channel's share and most of a pool, `none` to lift
/// one; what is not named stays as it was.
async fn set(
    store: &Store,
    name: String,
    share: Option<String>,
    max: Option<String>,
) -> anyhow::Result<()> {
    let Some(before) = store.channel(&name).await? else {
        anyhow::bail!(channels::ChannelError::Unknown(name));
    };
    let caps =
        channels::Caps {
            share_percent: match share.as_deref() {
                None => before.share_percent.map(|p| p as u32),
                Some("none") => None,
                Some(p) => Some(p.parse().map_err(|_| {
                    anyhow::anyhow!("--share takes a percent from 0 to 100, or none")
                })?),
            },
            max_stock: match max.as_deref() {
                None => before.max_stock.map(|m| m as u64),
                Some("none") => None,
                Some(m) => Some(
                    m.parse()
                        .map_err(|_| anyhow::anyhow!("--max takes a number of codes, or none"))?,
                ),
            },
        };
    let c = channels::set_caps(store, &name, caps, &super::actor("channels set")).await?;
    say!(
        "channel {name:?}: share {}, max {}",
        c.share_percent.map_or("none".into(), |p| format!("{p} %")),
        c.max_stock.map_or("none".into(), |m| m.to_string())
    );
    declare_now(store, &c).await;
    Ok(())
}

/// Declares a channel's products to its marketplace now (a channel that
/// pushes its stock: Eneba with API credentials, Kinguin); a failure is
/// only said: every granting process declares again within a minute.
async fn declare_now(store: &Store, c: &ChannelDoc) {
    if !channels::stock::pushes(c) {
        return;
    }
    let declarer = channels::stock::Declarer::new(store.clone(), Default::default());
    match declarer.declare_channel(c, None, true).await {
        Ok(n) => say!("declared the stock of {n} products to the marketplace"),
        Err(e) => say!("the stock was not declared now ({e}); the API and dispatchers declare it within a minute"),
    }
}

/// `channels add`: the channel, and the path its marketplace calls.
async fn add(store: &Store, new: NewChannel) -> anyhow::Result<()> {
    let c = channels::add(store, new, &super::actor("channels add")).await?;
    say!(
        "added channel {:?} ({}) to shop {:?}; its marketplace calls /channels/{}/{}",
        c.name,
        c.kind,
        c.shop,
        c.name,
        c.kind
    );
    Ok(())
}

/// `channels show`: the channel, and how many of its marketplace orders
/// are in each state.
async fn show(store: &Store, name: String, json: bool) -> anyhow::Result<()> {
    let Some(c) = store.channel(&name).await? else {
        anyhow::bail!(channels::ChannelError::Unknown(name));
    };
    let mut counts = Vec::new();
    for state in [
        DealState::Reserved,
        DealState::Provided,
        DealState::Cancelled,
    ] {
        counts.push((state.as_str(), store.deals_in(&c.name, state).await?));
    }
    // Kinguin's keys go by upload: how many are waiting, sent, given up.
    let mut uploads = Vec::new();
    if c.kind == "kinguin" {
        use codepool_store::kinguin::UploadState;
        for state in [
            UploadState::Pending,
            UploadState::Uploaded,
            UploadState::Failed,
            UploadState::Cancelled,
        ] {
            uploads.push((
                state.as_str(),
                store.kinguin_uploads_in(&c.name, state).await?,
            ));
        }
    }
    if json {
        let mut v = json_of(&c);
        for (state, n) in counts {
            v[state] = n.into();
        }
        if !uploads.is_empty() {
            let map: serde_json::Map<String, serde_json::Value> = (uploads.iter())
                .map(|(s, n)| ((*s).to_owned(), (*n).into()))
                .collect();
            v["uploads"] = map.into();
        }
        say_json!(serde_json::to_string_pretty(&v)?);
    } else {
        print(std::slice::from_ref(&c), false)?;
        for (state, n) in counts {
            say!("{state}: {n}");
        }
        for (state, n) in uploads {
            say!("uploads {state}: {n}");
        }
        say!(
            "share: {}; max: {}",
            c.share_percent.map_or("none".into(), |p| format!("{p} %")),
            c.max_stock.map_or("none".into(), |m| m.to_string())
        );
        for (product, n) in &c.declared {
            say!("declared {product}: {n}");
        }
    }
    Ok(())
}
