//! `codepool api`: the HTTP door for shop backends.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use codepool_api::{Api, ApiConfig, Broker};
use codepool_broker::Publisher;
use codepool_issuance::{Core, Health};
use tracing::info;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool api --listen 127.0.0.1:8080
  curl -H \"Authorization: Bearer $KEY\" -H 'Content-Type: application/json' -d '{\"order_id\":\"O-1\",\"uid\":\"u1\",\"phone\":\"+8613800000000\",\"pool\":\"game-x\"}' \\
       http://127.0.0.1:8080/v1/orders

Stateless: run as many as you like behind a load balancer, with or without
`codepool dispatch`: each API process runs the same background work as a
dispatcher. Every 10 s it re-sends the SMS-pending events of grants whose
confirm no process saw for 30 s (the same event ids, so a crash between a
claim and its confirm loses no SMS) and serves waiting orders; every 5 s
it returns expired holds' codes to stock; every minute it voids expired
codes and re-checks stock; and it delivers the shops' webhooks.
Every request needs an API key
(`codepool api-keys create`). /healthz, /readyz and /metrics are served on
the same port, without a key. SIGTERM finishes in-flight requests, refuses
new ones and exits 0. Routes: docs/http-api.md.")]
pub struct ApiArgs {
    /// Address to listen on (port 0 picks a free port, logged).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = ApiConfig::default().body_limit)]
    pub body_limit: usize,
    /// Longest a request may take, in seconds (reading it included), on
    /// every route of the port: /v1, /console, the probes (an import
    /// upload: an hour); then 408.
    #[arg(long, default_value_t = ApiConfig::default().request_timeout.as_secs())]
    pub request_timeout: u64,
    /// Requests per second per API key (bursts of twice as many); over it,
    /// 429 with Retry-After.
    #[arg(long, default_value_t = ApiConfig::default().rate_per_key)]
    pub rate_per_key: u32,
    /// Codes per minute a platform's key may name that match nothing
    /// (POST /v1/codes/check and /v1/codes/redeem); past it the key is
    /// slowed: 429 with Retry-After on every code it names.
    #[arg(long, default_value_t = ApiConfig::default().redeem_misses_per_minute)]
    pub redeem_misses_per_minute: u32,
    /// Seconds a client may take to send a request's head; a slower or
    /// idle connection is closed.
    #[arg(long, default_value_t = ApiConfig::default().header_timeout.as_secs())]
    pub header_timeout: u64,
    /// Connections served at once; further ones wait to be accepted.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    /// Without it, serve plain HTTP behind a TLS-terminating proxy.
    #[arg(long, requires = "tls_key", env = "CODEPOOL_API_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The certificate's private key (PEM, PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert", env = "CODEPOOL_API_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Hours an operator's console session lasts (/console).
    #[arg(long, default_value_t = 8)]
    pub console_session_hours: u64,
    /// Mark console cookies Secure behind a TLS-terminating proxy (always
    /// with --tls-cert).
    #[arg(long, env = "CODEPOOL_CONSOLE_SECURE_COOKIE")]
    pub console_secure_cookie: bool,
    /// Seconds each call to a marketplace's API may take (a Kinguin key's
    /// upload, its token, its check); a call cut short is tried again.
    #[arg(long, default_value_t = 20)]
    pub channel_call_timeout: u64,
}

pub async fn run(cfg: &Config, args: ApiArgs) -> anyhow::Result<u8> {
    // A bad certificate is found before any server is contacted.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(codepool_api::tls_config(cert, key).map_err(|e| {
            anyhow::anyhow!("{e}; give --tls-cert and --tls-key as PEM files, or leave both out to serve plain HTTP behind a proxy")
        })?),
        _ => None,
    };
    let stop = crate::shutdown::on_signals();
    let health = Arc::new(Health::default());
    let metrics = crate::http::install_metrics()?;
    let Some(store) = super::dispatch::ready_store(cfg, &stop).await? else {
        return Ok(crate::exit::OK);
    };
    health.set_mongo(true);
    let name = connection_name();
    let broker = connect(cfg, &name).await?;
    health.set_amqp(true);
    let parts = crate::context::parts(cfg, &store)?;
    let config = ApiConfig {
        tls,
        ..api_config(&args)
    };
    let core = Core::new(parts, broker.conn, broker.publisher);
    let api = Api::new(core.clone(), config);
    let console = codepool_console::router(core.clone(), console_config(&args));
    let extra = crate::http::routes_checking_keys(health.clone(), metrics, core).merge(console);
    let (addr, server) = codepool_api::serve(args.listen, api.clone(), extra, stop.clone())
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}; pick another address with --listen (port 0 picks a free one)", args.listen))?;
    info!(%addr, "serving the HTTP API, /metrics, /healthz and /readyz");
    // Scripts and tests read the port from here.
    crate::telemetry::announce_listening(cfg.log_format, "api", addr);
    // The connection's state shows in /readyz; a lost one is replaced.
    let watch = tokio::spawn(keep_connected(
        cfg.clone(),
        name,
        api.clone(),
        health.clone(),
        stop.clone(),
    ));
    // Every process that grants runs the same background work (relay,
    // expired holds, backorders, expiry and stock, webhooks): a grant
    // never waits on a dispatcher that may not exist.
    let current = api.clone();
    let mut background = codepool_issuance::background::start(
        api.core().parts(),
        Arc::new(move || codepool_issuance::background::connected(current.broker().publisher)),
        health.clone(),
        Default::default(),
        stop.clone(),
    );
    // Kinguin's keys, uploaded from the staged uploads of every process.
    let uploader = codepool_issuance::channels::kinguin::Uploader::new(
        api.core().clone(),
        api.clone(),
        Duration::from_secs(args.channel_call_timeout.clamp(1, 300)),
    );
    let uploads = tokio::spawn(uploader.run(stop.clone()));
    let served = server.await;
    info!("stop requested; in-flight requests finished");
    watch.abort();
    // Stopped with `stop`; a sweep in the middle of a write is not cut.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while background.join_next().await.is_some() {}
    })
    .await;
    background.abort_all();
    let _ = tokio::time::timeout(Duration::from_secs(2), uploads).await;
    // The events of the orders answered last go out now, not by a relay
    // 30 seconds after.
    if !api.settle(Duration::from_secs(10)).await {
        tracing::warn!("some answered orders' events were not sent before stopping; the relay of any API process sends them");
    }
    let broker = api.broker();
    broker.publisher.settle().await;
    let _ = broker.conn.close(200, "api stopped").await;
    served??;
    Ok(crate::exit::OK)
}

/// The console's settings as the flags give them.
fn console_config(args: &ApiArgs) -> codepool_console::ConsoleConfig {
    codepool_console::ConsoleConfig {
        session_ttl: Duration::from_secs(args.console_session_hours.clamp(1, 24 * 30) * 3600),
        secure_cookie: args.console_secure_cookie || args.tls_cert.is_some(),
        ..codepool_console::ConsoleConfig::default()
    }
}

/// The API's limits as the flags give them.
fn api_config(args: &ApiArgs) -> ApiConfig {
    ApiConfig {
        body_limit: args.body_limit,
        request_timeout: Duration::from_secs(args.request_timeout.max(1)),
        rate_per_key: args.rate_per_key,
        header_timeout: Duration::from_secs(args.header_timeout.max(1)),
        max_connections: args.max_connections as usize,
        tls: None,
        redeem_misses_per_minute: args.redeem_misses_per_minute,
    }
}

/// This process's broker connection name, as RabbitMQ lists it.
fn connection_name() -> String {
    format!("codepool-api-{}", std::process::id())
}

/// A connection, its confirm-mode publisher, and the topology declared.
async fn connect(cfg: &Config, name: &str) -> anyhow::Result<Broker> {
    let conn = Arc::new(codepool_broker::connect(&cfg.amqp_url, name).await?);
    // Its dead-letter replays are vouched for by this broker user.
    let publisher = Publisher::new(&conn, cfg.topology())
        .await?
        .as_user(&Publisher::user_of(&cfg.amqp_url));
    cfg.topology()
        .declare_checked(&conn, publisher.channel())
        .await?;
    Ok(Broker { conn, publisher })
}

/// Checks the broker connection every second; when it is lost, reports
/// unready and connects again with backoff. Events not confirmed meanwhile
/// stay with the relay, which sends them.
async fn keep_connected(
    cfg: Config,
    name: String,
    api: Arc<Api>,
    health: Arc<Health>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut retry = codepool_issuance::outage::Retry::new();
    while !stop.is_cancelled() {
        let up = api.broker().publisher.channel().status().connected();
        health.set_amqp(up);
        let pause = if up {
            retry.reset();
            Duration::from_secs(1)
        } else {
            if retry.tries() == 0 {
                tracing::warn!("lost RabbitMQ; orders are still granted, their events wait for the relay; reconnecting");
            }
            let pause = retry.delay();
            match connect(&cfg, &name).await {
                Ok(broker) => {
                    api.set_broker(broker);
                    health.set_amqp(true);
                    info!(attempts = retry.tries(), "RabbitMQ connection restored");
                    retry.reset();
                }
                Err(e) => tracing::debug!(error = %e, "RabbitMQ still unreachable"),
            }
            pause
        };
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}
