//! `codepool publish`: send purchases to the queue, publisher-confirmed.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use codepool_broker::{PendingConfirm, Publisher};
use codepool_domain::Purchase;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool publish --pool game-x --order-id O-1001 --uid 123213 --phone +8613800000000
  codepool publish --pool game-x --order-id O-1002 --uid 123213 --phone +8613800000000 --quantity 3
  codepool publish --file purchases.jsonl

A JSON-lines file holds one purchase per line (\"quantity\" is optional, 1 to 100):
  {\"order_id\":\"O-1001\",\"uid\":\"123213\",\"phone\":\"+8613800000000\",\"pool\":\"game-x\"}
  {\"order_id\":\"O-1002\",\"uid\":\"123213\",\"phone\":\"+8613800000000\",\"pool\":\"game-x\",\"quantity\":3}
Lines are validated first and invalid lines are reported with their number
(nothing is sent if any is invalid), unless --raw sends them as they are.")]
pub struct PublishArgs {
    /// Pool of the purchase.
    #[arg(long, required_unless_present = "file")]
    pub pool: Option<String>,
    /// Order id (unique per purchase; also the AMQP message id).
    #[arg(long, required_unless_present = "file")]
    pub order_id: Option<String>,
    /// Buyer's user id.
    #[arg(long, required_unless_present = "file")]
    pub uid: Option<String>,
    /// Buyer's phone number, international format.
    #[arg(long, required_unless_present = "file")]
    pub phone: Option<String>,
    /// Purchase time (RFC 3339); default now.
    #[arg(long)]
    pub purchased_at: Option<String>,
    /// How many codes the order gets, 1 to 100.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(codepool_domain::MAX_QUANTITY)))]
    pub quantity: u32,
    /// The shop the order is for (`codepool shops`): it must be allowed the
    /// pool, and the order is then the shop's.
    #[arg(long)]
    pub shop: Option<String>,
    /// JSON-lines file of purchases.
    #[arg(long, conflicts_with_all = ["pool", "order_id", "uid", "phone", "quantity", "shop"])]
    pub file: Option<PathBuf>,
    /// Send file lines unvalidated (to test dead-lettering).
    #[arg(long, requires = "file")]
    pub raw: bool,
}

pub async fn run(cfg: &Config, args: PublishArgs) -> anyhow::Result<u8> {
    let bodies: Vec<(Vec<u8>, Option<String>)> = match &args.file {
        Some(path) => read_file(path, args.raw)?,
        None => {
            let purchase = Purchase {
                order_id: args.order_id.clone().unwrap_or_default(),
                uid: args.uid.clone().unwrap_or_default(),
                phone: args.phone.clone().unwrap_or_default(),
                pool: args.pool.clone().unwrap_or_default(),
                purchased_at: Some(args.purchased_at.clone().unwrap_or_else(|| {
                    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                })),
                quantity: args.quantity,
                owner: None,
                hold_id: None,
                items: Vec::new(),
                shop: args.shop.clone(),
            };
            let body = purchase.to_json();
            if let Err(e) = Purchase::parse(&body) {
                bail!("invalid purchase: {e}");
            }
            vec![(body, Some(purchase.order_id))]
        }
    };
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-publish").await?;
    // Purchases carry the connection's broker user, which a shop names
    // among those that may publish for it.
    let publisher = Publisher::new(&conn, cfg.topology())
        .await?
        .as_user(&Publisher::user_of(&cfg.amqp_url));
    if let Err(e) = declare_if_allowed(&conn, cfg).await {
        codepool_broker::close(conn, "refused").await;
        bail!("nothing was published: {e}");
    }
    let n = publish_all(&publisher, &bodies).await?;
    codepool_broker::close(conn, "done").await;
    let topology = cfg.topology();
    match topology.is_partitioned() {
        false => say!(
            "published {n} purchase(s) to exchange {:?} (queue {:?})",
            topology.purchases_exchange,
            topology.purchases
        ),
        true => say!(
            "published {n} purchase(s) to exchange {:?} (each to its pool's partition of {})",
            topology.purchases_exchange,
            topology.partitions
        ),
    }
    Ok(crate::exit::OK)
}

/// Declares the topology where the broker user may (an operator's user
/// may; a shop's backend, allowed to write to the purchases exchange and
/// nothing else, may not, and needs not: a dispatcher declared it). On a
/// channel of its own, since a refusal closes the channel. Fails only when
/// the broker's purchase queues are of another partition count: the
/// purchases would not go to their pools' partitions.
async fn declare_if_allowed(
    conn: &lapin::Connection,
    cfg: &Config,
) -> Result<(), codepool_broker::BrokerError> {
    let Ok(channel) = conn.create_channel().await else {
        return Ok(());
    };
    match cfg.topology().declare_checked(conn, &channel).await {
        Ok(()) => {
            let _ = channel.close(200, "declared").await;
        }
        Err(e @ codepool_broker::BrokerError::Partitions { .. }) => return Err(e),
        Err(e) => {
            tracing::debug!(error = %e, "not declaring the topology; publishing to it as it is")
        }
    }
    Ok(())
}

/// Publishes with up to 1000 confirms in flight.
pub async fn publish_all(
    publisher: &Publisher,
    bodies: &[(Vec<u8>, Option<String>)],
) -> anyhow::Result<usize> {
    let mut window: Vec<PendingConfirm> = Vec::with_capacity(1000);
    let mut done = 0;
    for (body, id) in bodies {
        window.push(
            publisher
                .publish_purchase_bytes(body, id.as_deref())
                .await?,
        );
        if window.len() >= 1000 {
            for c in window.drain(..) {
                c.wait().await?;
                done += 1;
            }
        }
    }
    for c in window {
        c.wait().await?;
        done += 1;
    }
    Ok(done)
}

fn read_file(path: &PathBuf, raw: bool) -> anyhow::Result<Vec<(Vec<u8>, Option<String>)>> {
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open {}; check the path", path.display()))?;
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for (n, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
        let mut line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if raw {
            out.push((line, None));
            continue;
        }
        match Purchase::parse(&line) {
            Ok(p) => out.push((line, Some(p.order_id))),
            Err(e) => errors.push(format!("line {}: {e}", n + 1)),
        }
    }
    if !errors.is_empty() {
        bail!(
            "{} invalid line(s) in {}, nothing was published:\n  {}",
            errors.len(),
            path.display(),
            errors.join("\n  ")
        );
    }
    Ok(out)
}
