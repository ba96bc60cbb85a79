//! `codepool-bench dispatch --webhook-endpoints N` (issue 45): the same
//! purchases, of no shop, then of a shop whose N webhook endpoints are
//! subscribed to every event, delivered by the dispatcher's own deliverer
//! to a receiver in this process that answers 200 at once. Webhooks must
//! not slow grants: the target is 0.9× the rate without them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use codepool_issuance::audit::Actor;
use codepool_issuance::webhooks::{self, guard::AllowHosts};
use serde_json::json;

use crate::Scratch;

pub const SHOP: &str = "bench-shop";
pub const TARGET: f64 = 0.9;

/// Deliveries the receiver answered, over the whole benchmark.
static RECEIVED: AtomicU64 = AtomicU64::new(0);
static RECEIVER: OnceLock<String> = OnceLock::new();

/// Starts the receiver once; its URL.
async fn receiver() -> anyhow::Result<String> {
    if let Some(url) = RECEIVER.get() {
        return Ok(url.clone());
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/hooks", listener.local_addr()?);
    let app = axum::Router::new().route(
        "/hooks",
        axum::routing::post(|| async {
            RECEIVED.fetch_add(1, Ordering::Relaxed);
            "ok"
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(RECEIVER.get_or_init(|| url).clone())
}

/// The shop (every pool) and its `endpoints` endpoints, made once; lets
/// the deliverer post to 127.0.0.1.
pub async fn prepare(scratch: &Scratch, shop: &str, endpoints: u32) -> anyhow::Result<()> {
    // The dispatcher's deliverer reads this when it starts.
    std::env::set_var("CODEPOOL_WEBHOOK_ALLOW_HOSTS", "127.0.0.1");
    let store = &scratch.store;
    let actor = Actor::os_user("bench", "localhost", "codepool-bench");
    if store.shop(shop).await?.is_none() {
        codepool_issuance::shops::create(store, shop, &["*".to_owned()], &actor).await?;
    }
    // The bench publishes its purchases as the broker user of its URL.
    let user = codepool_broker::Publisher::user_of(&scratch.cfg.amqp_url);
    codepool_issuance::shops::set_broker_users(store, shop, &[user], &actor).await?;
    let have = store.webhook_endpoints(Some(shop)).await?.len() as u32;
    let url = receiver().await?;
    let allow = AllowHosts::parse("127.0.0.1");
    for _ in have..endpoints {
        webhooks::add(store, shop, &url, "*", &allow, &actor).await?;
    }
    Ok(())
}

/// How long the catch-up after a run is watched.
const CATCH_UP: std::time::Duration = std::time::Duration::from_secs(10);

/// What the last run's webhooks came to (events recorded and deliveries
/// made during the run; then, with the grants over, how many deliveries a
/// fresh deliverer makes per second over [`CATCH_UP`], staging included),
/// then removes the events and tasks so that the next run starts without
/// a backlog.
pub async fn settle(scratch: &Scratch) -> anyhow::Result<serde_json::Value> {
    let db = scratch.store.database();
    let during_run = RECEIVED.swap(0, Ordering::Relaxed);
    let stop = tokio_util::sync::CancellationToken::new();
    let deliverer = webhooks::Deliverer::new(scratch.store.clone(), AllowHosts::parse("127.0.0.1"));
    let catching_up = tokio::spawn(deliverer.run(stop.clone()));
    tokio::time::sleep(CATCH_UP).await;
    let caught_up = RECEIVED.load(Ordering::Relaxed);
    stop.cancel();
    let _ = catching_up.await;
    let count = |c: &'static str, f: bson::Document| async move {
        db.collection::<bson::Document>(c).count_documents(f).await
    };
    let events = count("webhook_events", bson::doc! {}).await?;
    let due = count("webhook_tasks", bson::doc! {"state": "pending"}).await?;
    let flagged = count("codes", bson::doc! {"hook_pending": true}).await?;
    RECEIVED.store(0, Ordering::Relaxed);
    for c in ["webhook_events", "webhook_tasks", "webhook_attempts"] {
        db.collection::<bson::Document>(c)
            .delete_many(bson::doc! {})
            .await?;
    }
    db.collection::<bson::Document>("codes")
        .update_many(
            bson::doc! {"hook_pending": true},
            bson::doc! {"$unset": {"hook_pending": ""}},
        )
        .await?;
    Ok(json!({
        "events_recorded": events,
        "grants_not_yet_staged": flagged,
        "deliveries_during_run": during_run,
        "catch_up_seconds": CATCH_UP.as_secs(),
        "catch_up_deliveries_per_second": caught_up as f64 / CATCH_UP.as_secs_f64(),
        "deliveries_still_due": due,
    }))
}
