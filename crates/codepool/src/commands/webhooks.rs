//! `codepool webhooks`: a shop's endpoints, signed to the Standard Webhooks
//! specification: add (prints the secret once), list, disable, enable,
//! rotate-secret, deliveries and replay.

use clap::{Args, Subcommand};
use codepool_issuance::webhooks::{self, guard::AllowHosts};
use codepool_store::webhooks::{AttemptDoc, EndpointDoc};
use codepool_store::Store;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool webhooks add --shop acme --url https://shop.example/hooks \\
      --events order.granted,order.voided,pool.low_stock
  codepool webhooks list --shop acme
  codepool webhooks rotate-secret --id ep_0123456789abcdef0123
  codepool webhooks disable --id ep_0123456789abcdef0123
  codepool webhooks deliveries --shop acme --limit 20
  codepool webhooks replay --shop acme --event msg_3f2a…
  codepool webhooks replay --shop acme --since 2026-11-25T10:00:00Z
  codepool webhooks replay --shop acme --event msg_3f2a… --id ep_… --include-before-endpoint

A replay sends an endpoint only the events recorded since it was added;
--include-before-endpoint sends the older ones too (an endpoint added later
never had their codes), and audits the codes sent that way as a reveal.

Event types: order.granted, order.partly_granted, order.voided,
order.refused, pool.low_stock, pool.exhausted, pool.replenished ('*' for
all). Every delivery carries webhook-id, webhook-timestamp and
webhook-signature headers; verify them with your language's
standardwebhooks library and the secret `add` printed. Only https to public
addresses; CODEPOOL_WEBHOOK_ALLOW_HOSTS=host1,host2 lets named hosts
through, over http too (development). Failed deliveries are retried after
5 s, 5 min, 30 min, 2 h, 5 h, 10 h and 10 h; an endpoint answering 410, or
failing for 5 days, is disabled.")]
pub struct WebhooksArgs {
    #[command(subcommand)]
    pub command: WebhooksCommand,
}

#[derive(Debug, Subcommand)]
pub enum WebhooksCommand {
    /// Add an endpoint to a shop; prints its signing secret once.
    Add {
        #[arg(long)]
        shop: String,
        /// Where to post events (https, a public address).
        #[arg(long)]
        url: String,
        /// Comma-separated event types, or '*' for all.
        #[arg(long)]
        events: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List endpoints (of one shop, or all).
    List {
        #[arg(long)]
        shop: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Stop delivering to an endpoint; its events wait until it is enabled.
    Disable {
        #[arg(long)]
        id: String,
    },
    /// Deliver to an endpoint again, and what waited for it.
    Enable {
        #[arg(long)]
        id: String,
    },
    /// Give an endpoint a new secret; the old one signs too for 24 hours.
    RotateSecret {
        #[arg(long)]
        id: String,
    },
    /// The latest delivery attempts of a shop or an endpoint.
    Deliveries {
        #[arg(long, required_unless_present = "id")]
        shop: Option<String>,
        /// One endpoint.
        #[arg(long)]
        id: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Send events again: one (--event) or all since a time (--since).
    Replay {
        #[arg(long)]
        shop: String,
        /// One event id (msg_…).
        #[arg(long, conflicts_with = "since", required_unless_present = "since")]
        event: Option<String>,
        /// Every event since this time (RFC 3339).
        #[arg(long)]
        since: Option<String>,
        /// Only to this endpoint (default: every endpoint that wants them).
        #[arg(long)]
        id: Option<String>,
        /// Send events recorded before the endpoint was added too; the
        /// codes they carry are audited as a reveal.
        #[arg(long)]
        include_before_endpoint: bool,
    },
}

fn endpoint_json(e: &EndpointDoc) -> serde_json::Value {
    serde_json::json!({
        "id": e.id, "shop": e.shop, "url": e.url, "events": e.events, "enabled": e.enabled,
        "disabled_reason": e.disabled_reason,
        "failing_since": e.failing_since.map(|t| t.to_chrono().to_rfc3339()),
        "created_at": e.created_at.to_chrono().to_rfc3339(),
    })
}

fn attempt_json(a: &AttemptDoc) -> serde_json::Value {
    serde_json::json!({
        "event": a.event, "endpoint": a.endpoint, "type": a.kind, "attempt": a.attempt,
        "at": a.at.to_chrono().to_rfc3339(), "outcome": a.outcome, "status": a.status,
        "latency_ms": a.latency_ms, "response": a.response,
    })
}

fn print_endpoints(list: &[EndpointDoc], json: bool) -> anyhow::Result<()> {
    if json {
        let rows: Vec<_> = list.iter().map(endpoint_json).collect();
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!(
        "{:<27} {:<16} {:<9} {:<40} EVENTS",
        "ID",
        "SHOP",
        "STATE",
        "URL"
    );
    for e in list {
        let state = if e.enabled { "enabled" } else { "disabled" };
        say!(
            "{:<27} {:<16} {:<9} {:<40} {}",
            e.id,
            e.shop,
            state,
            e.url,
            e.events.join(",")
        );
        if let Some(why) = &e.disabled_reason {
            say!("{:<27} ({why})", "");
        }
    }
    Ok(())
}

fn print_attempts(list: &[AttemptDoc], json: bool) -> anyhow::Result<()> {
    if json {
        let rows: Vec<_> = list.iter().map(attempt_json).collect();
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    say!(
        "{:<21} {:<38} {:<22} {:<3} {:<10} {:>6} {:>7}",
        "AT",
        "EVENT",
        "TYPE",
        "TRY",
        "OUTCOME",
        "STATUS",
        "MS"
    );
    for a in list {
        let status = a.status.map_or_else(|| "-".to_owned(), |s| s.to_string());
        say!(
            "{:<21} {:<38} {:<22} {:<3} {:<10} {:>6} {:>7}",
            super::target::when(Some(a.at)),
            a.event,
            a.kind,
            a.attempt,
            a.outcome,
            status,
            a.latency_ms
        );
    }
    Ok(())
}

pub async fn run(cfg: &Config, args: WebhooksArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    match args.command {
        WebhooksCommand::Add {
            shop,
            url,
            events,
            json,
        } => add(&store, &cfg.allow_hosts(), (&shop, &url, &events), json).await?,
        WebhooksCommand::List { shop, json } => {
            print_endpoints(&store.webhook_endpoints(shop.as_deref()).await?, json)?
        }
        WebhooksCommand::Disable { id } => set_enabled(&store, &id, false).await?,
        WebhooksCommand::Enable { id } => set_enabled(&store, &id, true).await?,
        WebhooksCommand::RotateSecret { id } => {
            let actor = super::actor("webhooks rotate-secret");
            let secret = webhooks::rotate_secret(&store, &id, &actor).await?;
            say!("new secret for webhook {id} (shown once): {secret}");
            say!("deliveries carry both signatures for 24 hours; switch the receiver to the new secret within that time");
        }
        WebhooksCommand::Deliveries {
            shop,
            id,
            limit,
            json,
        } => {
            if let Some(id) = &id {
                webhooks::endpoint(&store, id, shop.as_deref()).await?;
            }
            let limit = limit.clamp(1, 1000);
            let list = webhooks::deliveries(&store, shop.as_deref(), id.as_deref(), limit).await?;
            print_attempts(&list, json)?
        }
        WebhooksCommand::Replay {
            shop,
            event,
            since,
            id,
            include_before_endpoint,
        } => {
            let scope = webhooks::replay_scope(&event.or(since).unwrap_or_default())?;
            let actor = super::actor("webhooks replay");
            let r = webhooks::replay(
                &store,
                &shop,
                &scope,
                id.as_deref(),
                include_before_endpoint,
                &actor,
            )
            .await?;
            say!("{} deliveries due again for shop {shop:?}", r.due);
            if r.left_out > 0 {
                say!(
                    "{} deliveries left out: events older than the endpoint they would go to; --include-before-endpoint sends them (audited as a reveal of their codes)",
                    r.left_out
                );
            }
        }
    }
    Ok(crate::exit::OK)
}

async fn add(
    store: &Store,
    allow: &AllowHosts,
    (shop, url, events): (&str, &str, &str),
    json: bool,
) -> anyhow::Result<()> {
    let actor = super::actor("webhooks add");
    let added = webhooks::add(store, shop, url, events, allow, &actor).await?;
    let e = &added.endpoint;
    if json {
        let mut v = endpoint_json(e);
        v["secret"] = added.secret.clone().into();
        say_json!(serde_json::to_string_pretty(&v)?);
    } else {
        say!(
            "added webhook {} for shop {shop:?}: {} ({})",
            e.id,
            e.url,
            e.events.join(",")
        );
        say!(
            "secret (shown once; verify webhook-signature with it): {}",
            added.secret
        );
    }
    Ok(())
}

async fn set_enabled(store: &Store, id: &str, on: bool) -> anyhow::Result<()> {
    let command = if on {
        "webhooks enable"
    } else {
        "webhooks disable"
    };
    let e = webhooks::set_enabled(store, id, on, &super::actor(command)).await?;
    if on {
        say!(
            "webhook {} of shop {:?} enabled; what waited for it is due now",
            e.id,
            e.shop
        );
    } else {
        say!("webhook {} of shop {:?} disabled; its events wait until `codepool webhooks enable --id {}`", e.id, e.shop, e.id);
    }
    Ok(())
}
