//! `codepool dispatch`: the daemon.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use codepool_dispatcher::{Dispatcher, DispatcherConfig};
use codepool_issuance::Health;
use tracing::info;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool dispatch
  codepool dispatch --http 127.0.0.1:0 --workers 8
  CODEPOOL_AMQP_URL=amqp://user:pass@rabbit:5672/shop codepool dispatch --no-http

Run as many dispatchers as you like on one queue. With --partitions N
(CODEPOOL_PARTITIONS) each consumes every partition and the broker gives
each partition to one of them at a time:
  CODEPOOL_PARTITIONS=2 codepool dispatch --prefer-partitions 0
  CODEPOOL_PARTITIONS=2 codepool dispatch --prefer-partitions 1
A dispatcher whose partition count differs from the queues it finds stops
with exit status 1 and says what to do.

SIGINT/SIGTERM stops consuming, finishes what is in flight and exits 0; a
second signal exits at once (unacked purchases are redelivered, never lost
or granted twice).")]
pub struct DispatchArgs {
    /// Address for /metrics, /healthz and /readyz (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub http: SocketAddr,
    /// Seconds a client of --http may take for a request, its head
    /// included; a slower or idle connection is closed.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..), env = "CODEPOOL_HTTP_TIMEOUT")]
    pub http_timeout: u64,
    /// Do not serve /metrics, /healthz and /readyz.
    #[arg(long)]
    pub no_http: bool,
    /// Unacked purchases the broker may hand this dispatcher at once.
    #[arg(long, default_value_t = DispatcherConfig::DEFAULT_PREFETCH, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,
    /// Purchases claimed together in one bulk write.
    #[arg(long, default_value_t = DispatcherConfig::DEFAULT_BATCH_SIZE, value_parser = positive)]
    pub batch_size: usize,
    /// Batches processed concurrently.
    #[arg(long, default_value_t = DispatcherConfig::DEFAULT_WORKERS, value_parser = positive)]
    pub workers: usize,
    /// Most milliseconds a batch waits for more purchases: when it is
    /// filling fast, or when other batches are in flight (it then stops
    /// waiting as soon as one of them finishes). A purchase that arrives
    /// while nothing is in flight goes at once.
    #[arg(long, default_value_t = DispatcherConfig::DEFAULT_LINGER_MS)]
    pub linger_ms: u64,
    /// Broker users whose code.redeemed events are applied, comma
    /// separated (RabbitMQ checks a message's user_id against the user
    /// that published it). Without it, redemption events are refused: a
    /// purchase producer must not be able to mark codes used.
    #[arg(long, env = "CODEPOOL_REDEEMERS", value_delimiter = ',')]
    pub redeemers: Vec<String>,
    /// With --partitions N: the partitions this dispatcher subscribes to
    /// first, comma separated (0 to N-1); it stands by for the others
    /// --standby-secs later. Dispatchers started together with different
    /// preferences each take their own. Default: every partition at once.
    #[arg(
        long,
        env = "CODEPOOL_PREFER_PARTITIONS",
        value_delimiter = ',',
        value_name = "PARTITIONS"
    )]
    pub prefer_partitions: Vec<u16>,
    /// With --prefer-partitions: seconds before standing by for the others.
    #[arg(long, env = "CODEPOOL_STANDBY_SECS", default_value_t = DispatcherConfig::DEFAULT_STANDBY_SECS)]
    pub standby_secs: u64,
}

pub async fn run(cfg: &Config, args: DispatchArgs) -> anyhow::Result<u8> {
    if let Some(p) = args
        .prefer_partitions
        .iter()
        .find(|&&p| p >= cfg.partitions)
    {
        anyhow::bail!(
            "--prefer-partitions names partition {p}, but there are {} (0 to {}); set --partitions (CODEPOOL_PARTITIONS) to the deployment's count",
            cfg.partitions,
            cfg.partitions - 1
        );
    }
    let stop = crate::shutdown::on_signals();
    let health = Arc::new(Health::default());
    if !args.no_http {
        let handle = crate::http::install_metrics()?;
        let addr = crate::http::serve(
            args.http,
            health.clone(),
            handle,
            Duration::from_secs(args.http_timeout),
            stop.clone(),
        )
        .await?;
        info!(%addr, "serving /metrics, /healthz and /readyz");
        // Scripts starting several dispatchers read the port from here.
        crate::telemetry::announce_listening(cfg.log_format, "http", addr);
    }
    let Some(store) = ready_store(cfg, &stop).await? else {
        return Ok(crate::exit::OK);
    };
    health.set_mongo(true);
    let parts = crate::context::parts(cfg, &store)?;
    let config = DispatcherConfig {
        amqp_url: cfg.amqp_url.clone(),
        topology: cfg.topology(),
        prefetch: args.prefetch,
        batch_size: args.batch_size,
        workers: args.workers,
        linger: Duration::from_millis(args.linger_ms),
        redeemers: args.redeemers.clone(),
        standby: codepool_broker::Standby {
            prefer: args.prefer_partitions.clone(),
            after: Duration::from_secs(args.standby_secs),
        },
        ..DispatcherConfig::default()
    };
    let dispatcher = Dispatcher::new(parts, config, health);
    dispatcher.run(stop).await?;
    Ok(crate::exit::OK)
}

/// The store, migrated and with a key file that opens its codes: what a
/// daemon needs before it takes any work. Starts even if MongoDB is down:
/// waits (the caller reports unready) and migrates as soon as it answers.
/// `None` when stopped first.
pub async fn ready_store(
    cfg: &Config,
    stop: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Option<codepool_store::Store>> {
    let store = codepool_store::Store::connect_lazy(&cfg.mongodb_uri, &cfg.db).await?;
    crate::context::remember(&store);
    let mut attempt = 0;
    loop {
        match codepool_store::migrate::migrate(&store).await {
            Ok(_) => break,
            Err(e) if e.is_unavailable() => {
                if attempt == 0 {
                    tracing::warn!(error = %e, "waiting for MongoDB");
                }
                attempt += 1;
                tokio::select! {
                    _ = stop.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Before anything is consumed: the key file must open the codes.
    let store = store.with_keys(crate::context::code_keys(cfg)?);
    let keys = store
        .check_keys()
        .await
        .map_err(|e| anyhow::anyhow!("refusing to start, nothing was consumed: {e}"))?;
    if keys.plaintext {
        tracing::warn!(
            "some codes are still stored in plaintext; run `codepool migrate` to encrypt them"
        );
    }
    info!(keys = ?keys.key_ids, "key file verified against the stored codes");
    Ok(Some(store))
}

/// A count of at least 1.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}
