//! Operating codepool: the code lifecycle (redeem, void, expiry), SMS
//! receipts, low-stock alerts, `/metrics` and `/readyz`, against the real
//! servers and the built binary. A void's reason must be visible text, and
//! a void is final: a cancelled backorder never comes back through either
//! door.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bson::doc;
use codepool_broker::topology::{SMS_FAILED_KEY, SMS_SENT_KEY};
use codepool_broker::{Publisher, Topology};
use codepool_domain::{CodeStatus, Grant, PoolEvent, SmsPending};
use codepool_hotpool::Candidate;
use codepool_issuance::{ClaimOutcome, Resend, StockConfig, StockLevel, StockWatch};
use codepool_store::lifecycle::{CodeRef, LifecycleError, VoidOutcome, EXPIRED_REASON};
use codepool_store::pool_settings::PoolSettings;
use codepool_store::{CodeDoc, NewCode, ObjectId, Store};
use futures::StreamExt;
use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::BasicProperties;

use crate::common::*;
use crate::fixtures::*;

// ---------------------------------------------------------------- helpers

/// Claims a code for `order` through the real claim engine.
async fn grant(env: &TestEnv, order: &str, pool: &str) -> Grant {
    let p = purchase(order, pool);
    let outcomes = env
        .engine()
        .claim_batch(&[&p], Resend::ByRedelivery)
        .await
        .expect("claim");
    match outcomes.into_iter().next() {
        Some(o) if o.single().is_some() => o.single().unwrap().0,
        other => panic!("pool {pool} gave no code to {order}: {other:?}"),
    }
}

/// Codes `PREFIX-00000`… numbered from `from`, `n` of them, all with
/// the same expiry.
fn numbered_codes(
    prefix: &str,
    from: usize,
    n: usize,
    expires_at: Option<chrono::DateTime<chrono::Utc>>,
) -> Vec<NewCode> {
    (from..from + n)
        .map(|i| NewCode {
            code: format!("{prefix}-{i:05}"),
            line: None,
            expires_at,
        })
        .collect()
}

async fn code_doc(store: &Store, pool: &str, code: &str) -> CodeDoc {
    store
        .database()
        .collection::<CodeDoc>("codes")
        .find_one(store.code_filter(pool, code).await.expect("keys"))
        .await
        .expect("find")
        .expect("the code exists")
}

/// Runs `work` with mongod's profiler on for the test's database, and
/// returns its result with the profiled operations that match `filter`
/// (what the store really sent, and what mongod examined for it).
async fn profiled<T>(
    store: &Store,
    filter: bson::Document,
    work: impl std::future::Future<Output = T>,
) -> (T, Vec<bson::Document>) {
    use futures::TryStreamExt;
    let db = store.database();
    db.run_command(doc! {"profile": 2}).await.unwrap();
    let out = work.await;
    db.run_command(doc! {"profile": 0}).await.unwrap();
    let profile = db.collection::<bson::Document>("system.profile");
    let ops: Vec<bson::Document> = profile
        .find(filter)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    profile.drop().await.unwrap();
    (out, ops)
}

/// An integer field of a profiler entry (mongod writes Int32 or Int64).
fn profiled_int(op: &bson::Document, key: &str) -> i64 {
    match op.get(key) {
        Some(bson::Bson::Int32(v)) => i64::from(*v),
        Some(bson::Bson::Int64(v)) => *v,
        other => panic!("{key} is {other:?} in {op:?}"),
    }
}

/// Drops what [`TestEnv::cleanup`] does not know about, then cleans up.
async fn cleanup(env: TestEnv) {
    if let Ok(conn) = codepool_broker::connect(AMQP_URL, "cleanup").await {
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .queue_delete(&env.topology().code_redeemed, QueueDeleteOptions::default())
                .await;
        }
        let _ = conn.close(200, "bye").await;
    }
    env.cleanup().await;
}

/// Declares the topology and binds a test queue (durable, named after the
/// test's prefix, so a dropped connection does not lose what it counted)
/// to `routing_key` on the events exchange; returns the queue name.
async fn listen_events(ch: &lapin::Channel, topology: &Topology, routing_key: &str) -> String {
    topology.declare(ch).await.expect("declare");
    let name = format!(
        "{}test.{routing_key}",
        topology.purchases.trim_end_matches("purchases")
    );
    let q = ch
        .queue_declare(
            &name,
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue");
    ch.queue_bind(
        q.name().as_str(),
        &topology.events_exchange,
        routing_key,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .expect("bind");
    q.name().to_string()
}

/// One sample of a Prometheus text page.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Parses the Prometheus text exposition format strictly enough to catch
/// a broken page: `# HELP`/`# TYPE` lines, metric and label names, quoted
/// label values with escapes, float values; returns the samples.
fn parse_prometheus(page: &str) -> Result<(Vec<Sample>, HashMap<String, String>), String> {
    fn is_name(s: &str) -> bool {
        let mut chars = s.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }
    let mut samples = Vec::new();
    let mut types = HashMap::new();
    for (n, line) in page.lines().enumerate() {
        let err = |what: &str| format!("line {}: {what}: {line:?}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), _) if is_name(name) => {}
                (Some("TYPE"), Some(name), Some(t)) if is_name(name) => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&t) {
                        return Err(err("unknown type"));
                    }
                    types.insert(name.to_owned(), t.to_owned());
                }
                _ => return Err(err("bad comment")),
            }
            continue;
        }
        let (name_labels, value) = match line.find('}') {
            Some(end) => (&line[..=end], line[end + 1..].trim()),
            None => line.split_once(' ').ok_or_else(|| err("no value"))?,
        };
        let (name, labels) = match name_labels.split_once('{') {
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .ok_or_else(|| err("unclosed labels"))?;
                let mut labels = Vec::new();
                let mut rest = body;
                while !rest.is_empty() {
                    let (key, after) = rest.split_once("=\"").ok_or_else(|| err("bad label"))?;
                    if !is_name(key) {
                        return Err(err("bad label name"));
                    }
                    let mut value = String::new();
                    let mut chars = after.char_indices();
                    let mut end = None;
                    while let Some((i, c)) = chars.next() {
                        match c {
                            '\\' => match chars.next() {
                                Some((_, 'n')) => value.push('\n'),
                                Some((_, c @ ('\\' | '"'))) => value.push(c),
                                _ => return Err(err("bad escape")),
                            },
                            '"' => {
                                end = Some(i);
                                break;
                            }
                            c => value.push(c),
                        }
                    }
                    let end = end.ok_or_else(|| err("unterminated label value"))?;
                    labels.push((key.to_owned(), value));
                    rest = after[end + 1..].trim_start_matches(',');
                }
                (name, labels)
            }
            None => (name_labels, Vec::new()),
        };
        if !is_name(name) {
            return Err(err("bad metric name"));
        }
        let value = value
            .split_whitespace()
            .next()
            .ok_or_else(|| err("no value"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse::<f64>().map_err(|_| err("bad value"))?,
        };
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    Ok((samples, types))
}

/// The value of `name` with exactly these labels (0 if absent).
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && s.labels.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
        .map_or(0.0, |s| s.value)
}

async fn scrape(addr: &str) -> Vec<Sample> {
    let (status, body) = http_get(addr, "/metrics").await.expect("/metrics answers");
    assert_eq!(status, 200);
    parse_prometheus(&body)
        .expect("/metrics is Prometheus text")
        .0
}

/// Waits up to `secs` seconds until `name{labels}` at `addr` is `want`.
async fn wait_metric(addr: &str, name: &str, labels: &[(&str, &str)], want: f64, secs: u64) {
    let what = format!("{name}{labels:?} at {want}");
    eventually(Duration::from_secs(secs), &what, || async {
        value(&scrape(addr).await, name, labels) == want
    })
    .await;
}

async fn publish_receipt(publisher: &Publisher, key: &str, body: &[u8], message_id: Option<&str>) {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = message_id {
        props = props.with_message_id(id.into());
    }
    let exchange = publisher.topology().sms_exchange.clone();
    publish_to(publisher, &exchange, key, body, props).await;
}

// ---------------------------------------------------------------- lifecycle

#[tokio::test]
async fn every_allowed_lifecycle_transition_is_recorded() {
    let env = TestEnv::new("ops_transitions").await;
    let codes = env.fill_pool("lc", 6).await;
    let store = &env.store;

    // 1 → 2 by code and pool.
    let g1 = grant(&env, "LC-1", "lc").await;
    let t = store
        .redeem(CodeRef::Code {
            pool: "lc",
            code: &g1.code,
        })
        .await
        .expect("redeem by code");
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].before.status, CodeStatus::Issued);
    let d = code_doc(store, "lc", &g1.code).await;
    assert_eq!(d.status(), Some(CodeStatus::Used));
    assert!(d.used_at.is_some());
    assert_eq!(d.order_id.as_deref(), Some("LC-1"));

    // 1 → 2 by order.
    let g2 = grant(&env, "LC-2", "lc").await;
    store
        .redeem(CodeRef::Order("LC-2"))
        .await
        .expect("redeem by order");
    assert_eq!(
        code_doc(store, "lc", &g2.code).await.status(),
        Some(CodeStatus::Used)
    );

    // 1 → 3 by order (a refund) and by code.
    let g3 = grant(&env, "LC-3", "lc").await;
    match store
        .void(CodeRef::Order("LC-3"), "refund")
        .await
        .expect("void")
    {
        VoidOutcome::Voided { applied, .. } => {
            assert_eq!(applied.len(), 1);
            assert_eq!(applied[0].before.status, CodeStatus::Issued)
        }
        other => panic!("expected a void, got {other:?}"),
    }
    let d = code_doc(store, "lc", &g3.code).await;
    assert_eq!(d.status(), Some(CodeStatus::Void));
    assert_eq!(d.void_reason.as_deref(), Some("refund"));
    assert!(d.voided_at.is_some());
    assert_eq!(
        d.order_id.as_deref(),
        Some("LC-3"),
        "the order stays on the void code"
    );
    let g4 = grant(&env, "LC-4", "lc").await;
    store
        .void(
            CodeRef::Code {
                pool: "lc",
                code: &g4.code,
            },
            "fraud",
        )
        .await
        .expect("void by code");
    assert_eq!(
        code_doc(store, "lc", &g4.code).await.status(),
        Some(CodeStatus::Void)
    );

    // 0 → 3: an unissued code withdrawn.
    let unissued: Vec<&String> = codes
        .iter()
        .filter(|c| ![&g1.code, &g2.code, &g3.code, &g4.code].contains(c))
        .collect();
    store
        .void(
            CodeRef::Code {
                pool: "lc",
                code: unissued[0],
            },
            "withdrawn by partner",
        )
        .await
        .expect("void unissued");
    let d = code_doc(store, "lc", unissued[0]).await;
    assert_eq!(d.status(), Some(CodeStatus::Void));
    assert!(d.order_id.is_none());

    // The CLI says the same in words, masking the code.
    let out = env
        .run(&[
            "void",
            "--pool",
            "lc",
            "--code",
            unissued[1],
            "--reason",
            "test",
        ])
        .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("voided unissued code") && !stdout.contains(unissued[1].as_str()),
        "{stdout}"
    );
    cleanup(env).await;
}

#[tokio::test]
async fn forbidden_lifecycle_transitions_are_refused_with_the_reason() {
    let env = TestEnv::new("ops_forbidden").await;
    let codes = env.fill_pool("fb", 4).await;
    let store = &env.store;
    let used = grant(&env, "FB-USED", "fb").await;
    store
        .redeem(CodeRef::Order("FB-USED"))
        .await
        .expect("redeem");
    let void = grant(&env, "FB-VOID", "fb").await;
    store
        .void(CodeRef::Order("FB-VOID"), "refund")
        .await
        .expect("void");
    let unissued = codes
        .iter()
        .find(|c| **c != used.code && **c != void.code)
        .expect("an unissued code");
    let code = |c: &'static str| CodeRef::Code {
        pool: "fb",
        code: c,
    };
    let unissued_ref = CodeRef::Code {
        pool: "fb",
        code: unissued,
    };

    // Redeem: only issued codes.
    assert!(matches!(
        store.redeem(unissued_ref).await,
        Err(LifecycleError::Unissued { .. })
    ));
    assert!(matches!(
        store.redeem(CodeRef::Order("FB-USED")).await,
        Err(LifecycleError::AlreadyUsed { .. })
    ));
    let e = store.redeem(CodeRef::Order("FB-VOID")).await.unwrap_err();
    assert!(matches!(e, LifecycleError::Void { .. }), "{e}");
    assert!(e.to_string().contains("refund"), "{e}");
    assert!(matches!(
        store.redeem(code("NO-SUCH-CODE")).await,
        Err(LifecycleError::NotFound { .. })
    ));
    assert!(matches!(
        store.redeem(CodeRef::Order("NO-SUCH-ORDER")).await,
        Err(LifecycleError::NotFound { .. })
    ));

    // Void: not a used code, not twice.
    assert!(matches!(
        store.void(CodeRef::Order("FB-USED"), "x").await,
        Err(LifecycleError::Used { .. })
    ));
    assert!(matches!(
        store.void(CodeRef::Order("FB-VOID"), "x").await,
        Err(LifecycleError::Void { .. })
    ));
    assert!(matches!(
        store.void(CodeRef::Order("NO-SUCH-ORDER"), "x").await,
        Err(LifecycleError::NotFound { .. })
    ));

    // Nothing moved.
    assert_eq!(
        code_doc(store, "fb", &used.code).await.status(),
        Some(CodeStatus::Used)
    );
    let v = code_doc(store, "fb", &void.code).await;
    assert_eq!(
        (v.status(), v.void_reason.as_deref()),
        (Some(CodeStatus::Void), Some("refund"))
    );
    assert_eq!(
        code_doc(store, "fb", unissued).await.status(),
        Some(CodeStatus::Unissued)
    );

    // The CLI fails with exit code 1 and a sentence that says what to do.
    for (args, expect) in [
        (
            vec!["redeem", "--pool", "fb", "--code", unissued.as_str()],
            "never issued",
        ),
        (vec!["redeem", "--order", "FB-USED"], "already redeemed"),
        (vec!["redeem", "--order", "FB-VOID"], "voided"),
        (
            vec!["redeem", "--order", "NO-SUCH-ORDER"],
            "codepool lookup",
        ),
        (
            vec!["void", "--order", "FB-USED", "--reason", "x"],
            "cannot be voided",
        ),
        (
            vec!["pool", "set", "--pool", "nope", "--low-stock", "5"],
            "codepool import",
        ),
        (vec!["resend", "--order", "FB-VOID"], "never sent again"),
    ] {
        let out = env.run(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
        assert!(
            !stderr.contains(unissued.as_str()),
            "codes are masked: {stderr}"
        );
    }
    cleanup(env).await;
}

#[tokio::test]
async fn a_refund_voided_code_is_never_issued_again() {
    let env = TestEnv::with_pools("ops_refund", &[("rf", 5)]).await;
    let engine = env.engine();
    let refunded = grant(&env, "RF-REFUND", "rf").await;
    env.store
        .void(CodeRef::Order("RF-REFUND"), "refund")
        .await
        .expect("void");

    // Even if a stale hot pool still offers the void code…
    let id = codepool_store::object_id(refunded.code_id);
    let hot = env.hot_pool();
    hot.put_back(
        "rf",
        &[Candidate {
            id: id.to_hex(),
            seq: 0,
        }],
    )
    .await
    .expect("redis");

    // …every other order gets one of the other four codes, then the pool is empty.
    let purchases: Vec<_> = (0..6).map(|i| purchase(&format!("RF-{i}"), "rf")).collect();
    let refs: Vec<_> = purchases.iter().collect();
    let outcomes = engine
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .expect("claim");
    let granted: Vec<&Grant> = outcomes.iter().flat_map(|o| o.grants()).collect();
    assert_eq!(granted.len(), 4);
    assert!(granted.iter().all(|g| g.code != refunded.code));
    // A redelivered purchase of the refunded order never gets a new code.
    let again = purchase("RF-REFUND", "rf");
    let _ = engine
        .claim_batch(&[&again], Resend::ByRedelivery)
        .await
        .expect("claim");
    let codes = env.store.database().collection::<CodeDoc>("codes");
    assert_eq!(
        codes
            .count_documents(doc! {"order_id": "RF-REFUND"})
            .await
            .unwrap(),
        1
    );
    let d = code_doc(&env.store, "rf", &refunded.code).await;
    assert_eq!(
        (d.status(), d.order_id.as_deref()),
        (Some(CodeStatus::Void), Some("RF-REFUND"))
    );
    cleanup(env).await;
}

#[tokio::test]
async fn voiding_an_order_still_waiting_for_stock_cancels_its_backorder() {
    let env = TestEnv::with_pools("ops_cancel_bo", &[("cb", 1)]).await;
    grant(&env, "CB-1", "cb").await;
    let p = purchase("CB-2", "cb");
    assert_eq!(
        env.engine()
            .claim_batch(&[&p], Resend::ByRedelivery)
            .await
            .unwrap(),
        vec![ClaimOutcome::exhausted(vec![0])]
    );
    env.store
        .record_backorders(&[codepool_store::backorders::Waiting {
            purchase: &p,
            lines: &[0],
        }])
        .await
        .expect("backorder");
    let out = output_ok(&mut env.command(&["void", "--order", "CB-2", "--reason", "refund"])).await;
    assert!(String::from_utf8_lossy(&out.stdout).contains("backorder is cancelled"));
    assert!(env
        .store
        .waiting_backorders("cb", 10)
        .await
        .unwrap()
        .is_empty());
    cleanup(env).await;
}

#[tokio::test]
async fn expired_codes_are_never_issued_and_the_sweep_voids_them() {
    let env = TestEnv::new("ops_expiry").await;
    let store = &env.store;
    store.ensure_pool("ex").await.unwrap();
    let past = chrono::Utc::now() - chrono::Duration::hours(1);
    let future = chrono::Utc::now() + chrono::Duration::days(30);
    let mut new = Vec::new();
    for i in 0..20 {
        new.push(NewCode {
            code: format!("EXP-{i:03}"),
            line: None,
            expires_at: Some(past),
        });
    }
    for i in 0..5 {
        new.push(NewCode {
            code: format!("LIVE-{i:03}"),
            line: None,
            expires_at: Some(future),
        });
    }
    for i in 0..5 {
        new.push(NewCode {
            code: format!("FOREVER-{i:03}"),
            line: None,
            expires_at: None,
        });
    }
    store
        .insert_codes("ex", ObjectId::new(), &new)
        .await
        .unwrap();

    // The hot pool may hold expired candidates loaded before they expired.
    let codes = store.database().collection::<bson::Document>("codes");
    let mut expired_ids = Vec::new();
    let mut cursor = codes.find(doc! {"pool": "ex"}).await.unwrap();
    while let Some(d) = cursor.next().await {
        let d = d.unwrap();
        if !env.plain_code(&d).starts_with("EXP-") {
            continue;
        }
        expired_ids.push(Candidate {
            id: d.get_object_id("_id").unwrap().to_hex(),
            seq: d.get_i64("seq").unwrap(),
        });
    }
    let hot = env.hot_pool();
    hot.put_back("ex", &expired_ids).await.unwrap();

    // 40 orders: exactly the 10 live codes are issued, never an expired one.
    let purchases: Vec<_> = (0..40)
        .map(|i| purchase(&format!("EX-{i:02}"), "ex"))
        .collect();
    let engine = env.engine();
    let mut granted = Vec::new();
    for chunk in purchases.chunks(8) {
        let refs: Vec<_> = chunk.iter().collect();
        for o in engine
            .claim_batch(&refs, Resend::ByRedelivery)
            .await
            .unwrap()
        {
            if let Some((grant, _)) = o.single() {
                granted.push(grant.code);
            }
        }
    }
    granted.sort();
    assert_eq!(granted.len(), 10, "{granted:?}");
    assert!(
        granted.iter().all(|c| !c.starts_with("EXP-")),
        "{granted:?}"
    );

    // The sweep (as `codepool expire`) voids the expired ones with reason
    // `expired` and drops them from the hot pool.
    hot.put_back("ex", &expired_ids).await.unwrap();
    let out = env.run(&["expire", "--pool", "ex"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("voided 20 expired code(s)"), "{stdout}");
    assert_eq!(
        codes
            .count_documents(doc! {"pool": "ex", "status": 3, "void_reason": EXPIRED_REASON})
            .await
            .unwrap(),
        20
    );
    assert_eq!(hot.len("ex").await.unwrap(), 0);
    // The daemon's sweep covers every pool in one query: another pool's
    // expired codes are voided, its live one is kept.
    store.ensure_pool("ex2").await.unwrap();
    let other: Vec<NewCode> = (0..4)
        .map(|i| NewCode {
            code: format!("EX2-{i}"),
            line: None,
            expires_at: Some(if i == 0 { future } else { past }),
        })
        .collect();
    store
        .insert_codes("ex2", ObjectId::new(), &other)
        .await
        .unwrap();
    let swept = store.expire(None, bson::DateTime::now()).await.unwrap();
    let by_pool: Vec<(&str, usize)> = swept
        .by_pool
        .iter()
        .map(|(p, ids)| (p.as_str(), ids.len()))
        .collect();
    assert_eq!(by_pool, [("ex2", 3)]);
    // A second run finds nothing.
    assert_eq!(
        codepool_issuance::expiry::expire_codes(store, &hot, None)
            .await
            .unwrap(),
        0
    );
    // The expiry query uses the partial index, not a collection scan.
    let plan = store
        .database()
        .run_command(doc! {"explain": {"find": "codes", "filter": {"pool": {"$in": ["ex", "ex2"]}, "status": {"$in": [0]}, "expires_at": {"$exists": true, "$lte": bson::DateTime::now()}}}, "verbosity": "queryPlanner"})
        .await
        .unwrap();
    assert!(plan.to_string().contains("unissued_expiry"), "{plan}");
    cleanup(env).await;
}

// ---------------------------------------------------------------- stock

#[tokio::test]
async fn low_stock_fires_exactly_once_per_crossing_under_concurrent_claims() {
    let env = TestEnv::with_pools("ops_low_stock", &[("ls", 60)]).await;
    let settings = PoolSettings {
        low_stock: Some(20),
        ..PoolSettings::default()
    };
    env.store.set_pool_settings("ls", &settings).await.unwrap();

    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let topology = env.topology();
    let queue = listen_events(&ch, &topology, "pool.low_stock").await;
    let publisher = Publisher::new(&conn, topology).await.unwrap();
    // Three "dispatchers", each with its own stock watch.
    let watches: Vec<Arc<StockWatch>> = (0..3)
        .map(|_| StockWatch::new(env.store.clone(), StockConfig::default()))
        .collect();

    // 45 claims by 9 concurrent claimers, each checking stock after every
    // batch without throttling: stock crosses 20 once, on the way to 15.
    let claim_and_check = |from: usize, batches: usize, throttled: bool| {
        let mut tasks = Vec::new();
        for t in 0..9 {
            let engine = env.engine();
            let watch = watches[t % 3].clone();
            let publisher = publisher.clone();
            tasks.push(tokio::spawn(async move {
                let mut alerts = 0;
                for b in 0..batches {
                    let ps: Vec<_> = (0..1)
                        .map(|i| purchase(&format!("LS-{from}-{t}-{b}-{i}"), "ls"))
                        .collect();
                    let refs: Vec<_> = ps.iter().collect();
                    engine
                        .claim_batch(&refs, Resend::ByRedelivery)
                        .await
                        .unwrap();
                    if throttled {
                        watch.after_grants([("ls", 1)], &publisher);
                    } else if let StockLevel::Low { alerted: true, .. } =
                        watch.check("ls", &publisher).await.unwrap()
                    {
                        alerts += 1;
                    }
                }
                alerts
            }));
        }
        tasks
    };
    let mut alerts = 0;
    for t in claim_and_check(1, 5, false) {
        alerts += t.await.unwrap();
    }
    assert_eq!(alerts, 1, "one check, among all, publishes the crossing");
    assert_eq!(env.store.unissued_count("ls").await.unwrap(), 15);
    eventually(Duration::from_secs(5), "the low-stock event", || async {
        queue_depth(&ch, &queue).await == 1
    })
    .await;

    // More checks below the threshold publish nothing new.
    for w in &watches {
        assert_eq!(
            w.check("ls", &publisher).await.unwrap(),
            StockLevel::Low {
                unissued: 15,
                alerted: false
            }
        );
    }

    // An import re-arms the alert once stock is back at or above 20.
    let more: Vec<NewCode> = (0..30)
        .map(|i| NewCode {
            code: format!("ls-more-{i:03}"),
            line: None,
            expires_at: None,
        })
        .collect();
    env.store
        .insert_codes("ls", ObjectId::new(), &more)
        .await
        .unwrap();
    assert_eq!(
        watches[0].check("ls", &publisher).await.unwrap(),
        StockLevel::Ok { unissued: 45 }
    );
    assert!(
        !env.store
            .pool("ls")
            .await
            .unwrap()
            .unwrap()
            .low_stock_alerted
    );

    // The second crossing (45 → 18) goes through the throttled path the
    // dispatcher uses; the trailing check still catches it, once.
    for t in claim_and_check(2, 3, true) {
        t.await.unwrap();
    }
    assert_eq!(env.store.unissued_count("ls").await.unwrap(), 18);
    checks_done(&watches).await;
    let events = drain(&ch, &queue).await;
    assert_eq!(events.len(), 2, "one event per crossing");
    let unissued: Vec<u64> = events
        .iter()
        .map(|e| {
            serde_json::from_slice::<PoolEvent>(&e.body)
                .unwrap()
                .unissued
                .unwrap()
        })
        .collect();
    assert!(unissued.iter().all(|n| *n < 20), "{unissued:?}");
    let _ = ch.queue_delete(&queue, QueueDeleteOptions::default()).await;
    let _ = conn.close(200, "bye").await;
    cleanup(env).await;
}

/// Waits until every stock check the `watches` scheduled in the
/// background has run (and published what it found, confirmed): such a
/// check holds its watch (`after_grants` takes `&Arc<Self>`), so each
/// watch is then held by the test alone. Events are counted after it, not
/// after a pause.
async fn checks_done(watches: &[Arc<StockWatch>]) {
    eventually(
        Duration::from_secs(30),
        "the scheduled stock checks",
        || async { watches.iter().all(|w| Arc::strong_count(w) == 1) },
    )
    .await;
}

/// The dispatcher checks the pools of a batch together (their documents
/// in one query, their counts in one): each pool still gets its own
/// verdict, and its own alert.
#[tokio::test]
async fn a_batch_over_several_pools_raises_one_low_stock_alert_for_each_pool_that_crossed() {
    let env = TestEnv::new("ops_low_stock_many").await;
    let settings = PoolSettings {
        low_stock: Some(8),
        ..PoolSettings::default()
    };
    for pool in ["la", "lb", "lc", "ld"] {
        env.fill_pool(pool, 10).await;
        if pool != "ld" {
            env.store.set_pool_settings(pool, &settings).await.unwrap();
        }
    }
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let topology = env.topology();
    let queue = listen_events(&ch, &topology, "pool.low_stock").await;
    let publisher = Publisher::new(&conn, topology).await.unwrap();
    let watch = StockWatch::new(env.store.clone(), StockConfig::default());

    // la and lb fall to 7, below 8; lc to 9, still above; ld has no threshold.
    let taken = [("la", 3), ("lb", 3), ("lc", 1), ("ld", 5)];
    let ps: Vec<_> = taken
        .iter()
        .flat_map(|&(pool, n)| (0..n).map(move |i| purchase(&format!("LM-{pool}-{i}"), pool)))
        .collect();
    let refs: Vec<_> = ps.iter().collect();
    env.engine()
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .unwrap();
    watch.after_grants(taken.map(|(p, n)| (p, n as u64)), &publisher);
    checks_done(std::slice::from_ref(&watch)).await;
    let mut alerted: Vec<(String, u64)> = drain(&ch, &queue)
        .await
        .iter()
        .map(|e| {
            let event: PoolEvent = serde_json::from_slice(&e.body).unwrap();
            (event.pool, event.unissued.unwrap())
        })
        .collect();
    alerted.sort();
    assert_eq!(alerted, vec![("la".into(), 7), ("lb".into(), 7)]);
    for (pool, level) in [
        ("lc", StockLevel::Ok { unissued: 9 }),
        ("ld", StockLevel::Ok { unissued: 5 }),
        ("nowhere", StockLevel::UnknownPool),
    ] {
        assert_eq!(
            watch.check(pool, &publisher).await.unwrap(),
            level,
            "{pool}"
        );
    }
    let _ = ch.queue_delete(&queue, QueueDeleteOptions::default()).await;
    let _ = conn.close(200, "bye").await;
    cleanup(env).await;
}

// ---------------------------------------------------------------- over AMQP

#[tokio::test]
async fn receipts_and_redemptions_over_amqp_update_the_code() {
    let env = TestEnv::with_pools("ops_receipts", &[("rc", 10)]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    for i in 0..3 {
        publisher
            .publish_purchase(&purchase(&format!("RC-{i}"), "rc"))
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
    }
    let grants = env.store.clone();
    eventually(Duration::from_secs(20), "three grants", || {
        let s = grants.clone();
        async move {
            s.grants_for_orders(&["RC-0", "RC-1", "RC-2"])
                .await
                .unwrap()
                .line0()
                .len()
                == 3
        }
    })
    .await;

    // sms.sent sets is_sms; a redelivered copy changes nothing.
    let sent = br#"{"event_id":"sms:RC-0","order_id":"RC-0"}"#;
    publish_receipt(&publisher, SMS_SENT_KEY, sent, Some("r-1")).await;
    publish_receipt(&publisher, SMS_SENT_KEY, sent, Some("r-1")).await;
    // sms.failed twice (distinct receipts) and once redelivered.
    let failed = br#"{"event_id":"sms:RC-1","order_id":"RC-1","error":"carrier timeout"}"#;
    publish_receipt(&publisher, SMS_FAILED_KEY, failed, Some("f-1")).await;
    publish_receipt(&publisher, SMS_FAILED_KEY, failed, Some("f-2")).await;
    publish_receipt(&publisher, SMS_FAILED_KEY, failed, Some("f-2")).await;
    // Malformed receipts are acked and dropped.
    publish_receipt(&publisher, SMS_SENT_KEY, b"not json", None).await;
    // code.redeemed by order and by code; repeated.
    let rc2 = env
        .store
        .grants_for_orders(&["RC-2"])
        .await
        .unwrap()
        .line0()["RC-2"]
        .code
        .clone();
    let events = env.topology().events_exchange;
    for body in [
        serde_json::json!({"order_id": "RC-0"}).to_string(),
        serde_json::json!({"pool": "rc", "code": rc2}).to_string(),
        serde_json::json!({"order_id": "RC-0"}).to_string(),
        "{}".to_string(),
    ] {
        let guest = BasicProperties::default().with_user_id("guest".into());
        publish_to(&publisher, &events, "code.redeemed", body.as_bytes(), guest).await;
    }

    let t = env.topology();
    eventually(
        Duration::from_secs(20),
        "receipts and redemptions consumed",
        || {
            let (ch, t) = (ch.clone(), t.clone());
            async move {
                queue_depth(&ch, &t.sms_receipts).await == 0
                    && queue_depth(&ch, &t.code_redeemed).await == 0
            }
        },
    )
    .await;
    let store = env.store.clone();
    eventually(Duration::from_secs(10), "receipts applied", || {
        let s = store.clone();
        async move {
            let g = s
                .grants_for_orders(&["RC-0", "RC-1", "RC-2"])
                .await
                .unwrap()
                .line0();
            // Ready-queue depth 0 does not mean the last receipts are
            // applied (they may be in flight): wait for what is asserted.
            g["RC-0"].sms.sent
                && g["RC-0"].status == CodeStatus::Used
                && g["RC-2"].status == CodeStatus::Used
                && g["RC-1"].sms.failures >= 2
        }
    })
    .await;
    let g = env
        .store
        .grants_for_orders(&["RC-0", "RC-1"])
        .await
        .unwrap()
        .line0();
    let s0 = &g["RC-0"].sms;
    assert!(s0.sent_at.is_some());
    assert_eq!(s0.history.iter().filter(|h| h.event == "sent").count(), 1);
    let s1 = &g["RC-1"].sms;
    assert!(!s1.sent);
    assert_eq!(s1.failures, 2, "a redelivered failure counts once");
    assert_eq!(s1.error.as_deref(), Some("carrier timeout"));
    assert!(s1.failed_at.is_some());

    // `codepool resend` publishes the same event again, confirmed.
    let _ = drain(&ch, &t.sms_pending).await;
    codepool_ok(&env, &["resend", "--order", "RC-1"]).await;
    let again = drain(&ch, &t.sms_pending).await;
    assert_eq!(again.len(), 1);
    let event: SmsPending = serde_json::from_slice(&again[0].body).unwrap();
    assert_eq!(
        (event.event_id.as_str(), event.order_id.as_str()),
        ("sms:RC-1", "RC-1")
    );

    // `codepool lookup` tells the SMS story, with the code masked.
    let out = env.run(&["lookup", "--order", "RC-1"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("2 failure(s)")
            && stdout.contains("carrier timeout")
            && stdout.contains("re-sent 1 time(s)"),
        "{stdout}"
    );
    assert!(!stdout.contains(&g["RC-1"].code), "{stdout}");
    let out = env.run(&["lookup", "--order", "RC-0", "--json"]).await;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["codes"][0]["sms"]["state"], "sent");
    assert_eq!(json["codes"][0]["status"], "used");

    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    cleanup(env).await;
}

// ---------------------------------------------------------------- monitoring

#[tokio::test]
async fn metrics_parse_as_prometheus_text_and_count_what_happened() {
    let env = TestEnv::with_pools("ops_metrics", &[("mx", 20)]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let addr = daemon.addr.clone();

    // Before any purchase, the counters are there at zero, and the stock
    // gauge appears with the first sweep.
    wait_metric(&addr, "codepool_pool_unissued", &[("pool", "mx")], 20.0, 10).await;
    let before = scrape(&addr).await;
    assert!(before
        .iter()
        .any(|s| s.name == "codepool_grants_total" && s.value == 0.0));
    assert!(before
        .iter()
        .any(|s| s.name == "codepool_dead_letters_total"
            && s.labels == [("reason".to_owned(), "not_json".to_owned())]
            && s.value == 0.0));

    let (conn, publisher) = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let orders: Vec<_> = (0..20)
        .map(|i| purchase(&format!("MX-{i:02}"), "mx"))
        .collect();
    publish_confirmed(&publisher, &orders).await;
    wait_metric(&addr, "codepool_grants_total", &[], 20.0, 30).await;
    // Then: 5 duplicates, 5 purchases of an empty pool, 4 invalid messages.
    publish_confirmed(&publisher, &orders[..5]).await;
    for i in 0..5 {
        let p = purchase(&format!("MX-LATE-{i}"), "mx");
        publish_one(&publisher, &p).await;
    }
    let invalid: [&[u8]; 4] = [
        b"not json",
        b"{also not json",
        br#"{"uid":"u","phone":"+8613800000000","pool":"mx"}"#,
        br#"{"order_id":"MX-NOPOOL","uid":"u","phone":"+8613800000000","pool":"no-such-pool"}"#,
    ];
    for body in invalid {
        publish_bytes(&publisher, body, None).await;
    }
    wait_metric(&addr, "codepool_end_to_end_seconds_count", &[], 34.0, 30).await;
    // The stock gauge follows within the check interval.
    wait_metric(&addr, "codepool_pool_unissued", &[("pool", "mx")], 0.0, 10).await;

    let (status, page) = http_get(&addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    let (m, types) = parse_prometheus(&page).expect("Prometheus text");
    assert_eq!(value(&m, "codepool_purchases_consumed_total", &[]), 34.0);
    assert_eq!(value(&m, "codepool_grants_total", &[]), 20.0);
    assert_eq!(value(&m, "codepool_duplicate_deliveries_total", &[]), 5.0);
    assert_eq!(value(&m, "codepool_backorders_total", &[]), 5.0);
    assert_eq!(
        value(&m, "codepool_dead_letters_total", &[("reason", "not_json")]),
        2.0
    );
    assert_eq!(
        value(
            &m,
            "codepool_dead_letters_total",
            &[("reason", "missing_field")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "codepool_dead_letters_total",
            &[("reason", "unknown_pool")]
        ),
        1.0
    );
    assert_eq!(value(&m, "codepool_redis_fallback_active", &[]), 0.0);
    for h in [
        "codepool_claim_batch_seconds",
        "codepool_end_to_end_seconds",
    ] {
        assert_eq!(types.get(h).map(String::as_str), Some("histogram"), "{h}");
        let buckets: Vec<&Sample> = m
            .iter()
            .filter(|s| s.name == format!("{h}_bucket"))
            .collect();
        assert!(buckets.len() > 3, "{h} has buckets");
        let mut last = 0.0;
        for b in &buckets {
            assert!(b.value >= last, "{h} buckets are cumulative");
            last = b.value;
        }
        let inf = value(&m, &format!("{h}_bucket"), &[("le", "+Inf")]);
        assert_eq!(
            inf,
            value(&m, &format!("{h}_count"), &[]),
            "{h}: +Inf bucket = count"
        );
        assert!(inf > 0.0);
    }
    assert_eq!(
        types.get("codepool_grants_total").map(String::as_str),
        Some("counter")
    );
    assert_eq!(
        types.get("codepool_pool_unissued").map(String::as_str),
        Some("gauge")
    );
    // Codes never appear in metrics.
    assert!(!page.contains("mx-0000"), "a code leaked into /metrics");
    assert_eq!(queue_depth(&ch, &env.topology().purchases).await, 0);

    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    cleanup(env).await;
}

/// A dispatcher started on a backlog serves it before its sweep counts the
/// catalogue (issue 47): the count of a pool nobody buys from, which only
/// the sweep makes, comes after the backlog's last grant, and its gauge
/// still appears. mongod's profiler dates the count; the codes date the
/// grants.
#[tokio::test]
async fn a_dispatcher_started_on_a_backlog_serves_it_before_sweeping_the_catalogue() {
    let env = TestEnv::with_pools("ops_sweep_yields", &[("bk-busy", 2000), ("bk-idle", 5)]).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    // The queues exist before any dispatcher does: the backlog waits there.
    let ch = conn.create_channel().await.unwrap();
    env.topology().declare(&ch).await.unwrap();
    let publisher = Publisher::new(&conn, env.topology())
        .await
        .unwrap()
        .as_user("guest");
    let backlog: Vec<_> = (0..2000)
        .map(|i| purchase(&format!("BK-{i:04}"), "bk-busy"))
        .collect();
    publish_confirmed(&publisher, &backlog).await;
    // Every aggregate the daemon runs, while it serves the backlog.
    let (daemon, counts) = profiled(
        &env.store,
        doc! {"command.aggregate": "codes", "command.pipeline": {"$exists": true}},
        async {
            let daemon = start_daemon(env.command(&[])).await;
            let a = daemon.addr.clone();
            eventually(
                Duration::from_secs(60),
                "the backlog granted and the idle pool's gauge",
                || {
                    let a = a.clone();
                    async move {
                        let m = scrape(&a).await;
                        value(&m, "codepool_grants_total", &[]) == 2000.0
                            && value(&m, "codepool_pool_unissued", &[("pool", "bk-idle")]) == 5.0
                    }
                },
            )
            .await;
            daemon
        },
    )
    .await;

    let last_grant = env
        .coll("codes")
        .find_one(doc! {"pool": "bk-busy", "status": 1})
        .sort(doc! {"issued_at": -1})
        .await
        .unwrap()
        .expect("a grant")
        .get_datetime("issued_at")
        .copied()
        .unwrap();
    // Every stock count that named the idle pool: the sweep's.
    let idle: Vec<bson::DateTime> = counts
        .iter()
        .filter(|op| {
            let text = op.get_document("command").unwrap().to_string();
            text.contains("\"bk-idle\"") && text.contains("$sum")
        })
        .map(|op| *op.get_datetime("ts").unwrap())
        .collect();
    assert!(!idle.is_empty(), "the sweep counted the idle pool");
    assert!(
        idle.iter().all(|t| *t > last_grant),
        "the catalogue was counted at {idle:?}, while the backlog was served until {last_grant}"
    );
    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    cleanup(env).await;
}

/// A `mongod` of this test's own, so it can be stopped without disturbing
/// the other tests.
struct PrivateMongo {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
}

impl PrivateMongo {
    fn binary() -> std::path::PathBuf {
        if let Ok(p) = std::env::var("CODEPOOL_TEST_MONGOD") {
            return p.into();
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let venv = root.join(".services/venv/lib");
        if let Ok(entries) = std::fs::read_dir(&venv) {
            for e in entries.flatten() {
                let p = e.path().join("site-packages/fiftyone/db/bin/mongod");
                if p.exists() {
                    return p;
                }
            }
        }
        // The binary services.sh recorded, then the one already serving.
        let recorded = root.join(".services/mongo/mongod.bin");
        if let Ok(p) = std::fs::read_to_string(recorded) {
            let p = std::path::PathBuf::from(p.trim());
            if p.exists() {
                return p;
            }
        }
        Self::running().unwrap_or_else(|| "mongod".into())
    }

    /// The executable of a mongod this machine already runs (a checkout
    /// whose services.sh found the default ports served installs none).
    fn running() -> Option<std::path::PathBuf> {
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let exe = std::fs::read_link(e.path().join("exe")).ok()?;
            (exe.file_name()? == "mongod").then_some(exe)
        })
    }

    async fn start() -> Self {
        let mut m = Self {
            port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
        };
        m.restart().await;
        m
    }

    fn uri(&self) -> String {
        format!(
            "mongodb://127.0.0.1:{}/?directConnection=true&serverSelectionTimeoutMS=2000",
            self.port
        )
    }

    async fn restart(&mut self) {
        let child = std::process::Command::new(Self::binary())
            .arg("--dbpath")
            .arg(self.dir.path())
            .args(["--port", &self.port.to_string(), "--bind_ip", "127.0.0.1", "--wiredTigerCacheSizeGB", "0.25"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mongod must be installed (make services installs it into .services/venv; or set CODEPOOL_TEST_MONGOD)");
        self.child = Some(child);
        let uri = self.uri();
        eventually(Duration::from_secs(30), "private mongod to answer", || {
            let uri = uri.clone();
            async move {
                match Store::connect_lazy(&uri, "ping").await {
                    Ok(s) => s.ping().await.is_ok(),
                    Err(_) => false,
                }
            }
        })
        .await;
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateMongo {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test]
async fn readyz_turns_unready_while_mongodb_is_stopped_and_ready_when_it_returns() {
    let env = TestEnv::new("ops_readyz").await;
    let mut mongo = PrivateMongo::start().await;
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_MONGODB_URI", mongo.uri());
    let daemon = start_daemon(cmd).await;
    let addr = daemon.addr.clone();

    let readyz_is = |code: u16| {
        let addr = addr.clone();
        move || {
            let addr = addr.clone();
            async move { http_get(&addr, "/readyz").await.map(|(s, _)| s) == Some(code) }
        }
    };
    eventually(Duration::from_secs(15), "ready", readyz_is(200)).await;
    assert_eq!(http_get(&addr, "/healthz").await.map(|(s, _)| s), Some(200));

    mongo.stop();
    eventually(
        Duration::from_secs(30),
        "unready while MongoDB is down",
        readyz_is(503),
    )
    .await;
    let (_, body) = http_get(&addr, "/readyz").await.unwrap();
    assert!(body.contains("mongodb: down"), "{body}");
    assert_eq!(
        http_get(&addr, "/healthz").await.map(|(s, _)| s),
        Some(200),
        "alive all along"
    );

    mongo.restart().await;
    eventually(
        Duration::from_secs(30),
        "ready again once MongoDB is back",
        readyz_is(200),
    )
    .await;

    daemon.stop().await;
    drop(mongo);
    cleanup(env).await;
}

/// `codepool stats` (and `pool show`) take a pool's unissued stock from
/// the pool's total in the import ledger minus its codes handed out, never
/// by counting the stock. The answer must equal a count of the documents
/// after every kind of change, including inserts whose range was never
/// recorded (a process killed in between, or codes older than the ledger).
#[tokio::test]
async fn stats_count_the_stock_exactly_without_counting_it() {
    let env = TestEnv::new("ops_ledger").await;
    let store = &env.store;
    store.ensure_pool("lg").await.unwrap();
    let batch = |from, n, expires| numbered_codes("LG", from, n, expires);
    let past = Some(chrono::Utc::now() - chrono::Duration::hours(1));
    let import = ObjectId::new();
    store
        .insert_codes("lg", import, &batch(0, 100, None))
        .await
        .unwrap();
    // 10 duplicates and 20 new codes, 5 of them expired.
    store
        .insert_codes("lg", import, &batch(90, 25, None))
        .await
        .unwrap();
    store
        .insert_codes("lg", import, &batch(115, 5, past))
        .await
        .unwrap();
    let stock = |want: u64| async move {
        let exact = store.unissued_count("lg").await.unwrap();
        assert_eq!(exact, want, "the documents themselves");
        let stats = store.pool_stats(Some("lg")).await.unwrap();
        assert_eq!(stats[0].unissued, want, "stats: {stats:?}");
        assert_eq!(store.unissued_stock("lg").await.unwrap(), want);
        // The bounded counts of the stock watch: exact below their cap, the
        // cap at or above it, several pools in one call. While the 5
        // expired codes are not voided, a cap of 6 is counted from the
        // indexes and a cap of 3 document by document.
        let bounded = store
            .unissued_counts_upto(&[
                ("lg", 1000),
                ("lg", 50),
                ("lg", 6),
                ("lg", 3),
                ("no-such-pool", 10),
            ])
            .await
            .unwrap();
        let expect = vec![want, want.min(50), want.min(6), want.min(3), 0];
        assert_eq!(bounded, expect, "bounded counts");
        stats[0].clone()
    };
    let s = stock(115).await;
    assert_eq!((s.expired, s.issued, s.void), (5, 0, 0), "{s:?}");

    // Grants, a redemption and voids, issued and unissued.
    for i in 0..7 {
        grant(&env, &format!("LG-O{i}"), "lg").await;
    }
    store.redeem(CodeRef::Order("LG-O0")).await.unwrap();
    store.void(CodeRef::Order("LG-O1"), "refund").await.unwrap();
    let last_unissued = format!("LG-{:05}", 114);
    store
        .void(
            CodeRef::Code {
                pool: "lg",
                code: &last_unissued,
            },
            "withdrawn",
        )
        .await
        .unwrap();
    let s = stock(107).await;
    assert_eq!((s.issued, s.used, s.void), (5, 1, 2), "{s:?}");

    // The expiry sweep turns the 5 expired codes into void ones.
    store
        .expire(Some("lg"), bson::DateTime::now())
        .await
        .unwrap();
    let s = stock(107).await;
    assert_eq!((s.expired, s.void), (0, 7), "{s:?}");

    // An insert whose range was never recorded is counted from the index.
    store
        .insert_codes("lg", import, &batch(200, 30, None))
        .await
        .unwrap();
    let ranges = store.database().collection::<bson::Document>("code_ranges");
    let last = ranges
        .find_one(doc! {"pool": "lg"})
        .sort(doc! {"first": -1})
        .await
        .unwrap()
        .unwrap();
    ranges
        .delete_one(doc! {"_id": last.get_object_id("_id").unwrap()})
        .await
        .unwrap();
    stock(137).await;

    // So are codes from before the ledger: no range recorded at all.
    ranges.delete_many(doc! {"pool": "lg"}).await.unwrap();
    stock(137).await;

    // A range recorded after the pool's last seq was read (an import
    // running meanwhile) must not stand in for the gap below it.
    ranges
        .insert_one(
            doc! {"pool": "lg", "first": 100_000_i64, "last": 100_999_i64, "codes": 1000_i64},
        )
        .await
        .unwrap();
    stock(137).await;
    ranges.delete_many(doc! {"pool": "lg"}).await.unwrap();
    assert_eq!(store.codes_in_pool("lg").await.unwrap(), 150);
    store
        .insert_codes("lg", import, &batch(300, 3, None))
        .await
        .unwrap();
    stock(140).await;
    assert_eq!(store.codes_in_pool("lg").await.unwrap(), 153);
    env.cleanup().await;
}

/// `codepool stats` counts the grants of the last hour and day that are
/// issued or used now (not voided since, not held) from the partial
/// `(pool, status, issued_at)` index: exactly, and reading the keys of the
/// period only, not every grant the pool ever made. `codepool lookup
/// --pool` reads the newest grants from the `(pool, issued_at)` index,
/// without sorting the pool's grants.
#[tokio::test]
async fn stats_count_recent_grants_from_the_grant_time_index_alone() {
    let env = TestEnv::new("ops_recent").await;
    let store = &env.store;
    env.fill_pool("rc", 40).await;
    env.fill_pool("rc-other", 5).await;
    for i in 0..30 {
        grant(&env, &format!("RC-O{i}"), "rc").await;
    }
    for i in 0..5 {
        grant(&env, &format!("RC-X{i}"), "rc-other").await;
    }
    let now = bson::DateTime::now().timestamp_millis();
    let ago = |hours: i64| bson::DateTime::from_millis(now - hours * 3_600_000);
    // 10 grants two hours old, 10 two days old, 10 of now; one of each
    // redeemed, voided after the grant, or still issued.
    let codes = store.database().collection::<bson::Document>("codes");
    for (from, hours) in [(0, 2), (10, 48)] {
        let orders: Vec<String> = (from..from + 10).map(|i| format!("RC-O{i}")).collect();
        let moved = codes
            .update_many(
                doc! {"order_id": {"$in": orders}},
                doc! {"$set": {"issued_at": ago(hours)}},
            )
            .await
            .unwrap();
        assert_eq!(moved.modified_count, 10);
    }
    for order in ["RC-O1", "RC-O11", "RC-O21"] {
        store.redeem(CodeRef::Order(order)).await.unwrap();
    }
    for order in ["RC-O2", "RC-O12", "RC-O22"] {
        store.void(CodeRef::Order(order), "refund").await.unwrap();
    }
    // What stats sent for the two periods: counts of the grant-time index
    // by status that read the period's keys only (and the ones that end
    // the two ranges), not the pool's 30 grants, and no document.
    let (stats, counts) = profiled(
        store,
        doc! {"command.count": "codes", "command.query.issued_at": {"$exists": true}},
        store.pool_stats(Some("rc")),
    )
    .await;
    let s = &stats.unwrap()[0];
    // The hour's 10 less one voided; the day's 20 less two voided.
    assert_eq!((s.issued_last_hour, s.issued_last_day), (9, 18), "{s:?}");
    assert_eq!((s.issued, s.used, s.void), (24, 3, 3), "{s:?}");
    assert_eq!(counts.len(), 2, "{counts:?}");
    let mut keys = Vec::new();
    for op in &counts {
        let plan = op.get_str("planSummary").unwrap_or_default();
        assert!(
            plan.starts_with("IXSCAN { pool: 1, status: 1, issued_at: 1 }"),
            "{op:?}"
        );
        assert_eq!(profiled_int(op, "docsExamined"), 0, "{op:?}");
        keys.push(profiled_int(op, "keysExamined"));
    }
    keys.sort_unstable();
    assert!(
        (9..=12).contains(&keys[0]) && (18..=21).contains(&keys[1]),
        "keys examined for the hour and the day: {keys:?}"
    );

    // `lookup --pool`: the newest grants first, read in the index's order
    // with no sort stage.
    let (newest, finds) = profiled(
        store,
        doc! {"command.find": "codes"},
        store.find_codes(&codepool_store::CodeQuery::GrantsOf("rc"), 12),
    )
    .await;
    let times: Vec<_> = newest
        .unwrap()
        .iter()
        .map(|c| c.holder.as_ref().unwrap().issued_at)
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {times:?}"
    );
    let two_hours = chrono::Utc::now() - chrono::Duration::minutes(119);
    assert_eq!(
        times.iter().filter(|t| **t > two_hours).count(),
        10,
        "{times:?}"
    );
    assert_eq!(finds.len(), 1, "{finds:?}");
    let plan = finds[0].get_str("planSummary").unwrap_or_default();
    assert!(
        plan.starts_with("IXSCAN { pool: 1, issued_at: 1 }"),
        "{finds:?}"
    );
    assert!(
        !finds[0].get_bool("hasSortStage").unwrap_or(false),
        "{finds:?}"
    );
    env.cleanup().await;
}

/// The dispatcher's bounded stock counts (checks after grants, the sweep,
/// backorders) read no code of the stock, only the expired ones the expiry
/// sweep has not voided yet, and stop near their cap, however large the
/// pool and however many of its codes were claimed: mongod's profiler
/// records what each count examined (its one batch ends the cursor, so
/// every `$unionWith` branch is in the one entry).
#[tokio::test]
async fn bounded_stock_counts_read_only_unswept_expired_codes_and_stop_at_their_cap() {
    let env = TestEnv::new("ops_cover").await;
    let store = &env.store;
    store.ensure_pool("big").await.unwrap();
    let codes = |from, n, expires| numbered_codes("BG", from, n, expires);
    let past = Some(chrono::Utc::now() - chrono::Duration::hours(1));
    store
        .insert_codes("big", ObjectId::new(), &codes(0, 5000, None))
        .await
        .unwrap();
    store
        .insert_codes("big", ObjectId::new(), &codes(5000, 7, past))
        .await
        .unwrap();
    // Claims take the oldest codes; their index keys become tombstones.
    for i in 0..20 {
        grant(&env, &format!("BG-O{i}"), "big").await;
    }

    let examined = |cap: u64| async move {
        let (n, counts) = profiled(
            store,
            doc! {"command.aggregate": "codes", "command.pipeline.$group": {"$exists": true}},
            store.unissued_counts_upto(&[("big", cap)]),
        )
        .await;
        assert_eq!(counts.len(), 1, "one aggregate per count: {counts:?}");
        let n = n.unwrap();
        (
            n[0],
            profiled_int(&counts[0], "docsExamined"),
            profiled_int(&counts[0], "keysExamined"),
        )
    };
    // Below the cap: 5,000 - 20 claimed; the 7 expired ones are not stock,
    // and they are the only documents read.
    let (n, docs, _) = examined(10_000).await;
    assert_eq!((n, docs), (4980, 7), "an exact count from the indexes");
    // At the cap: the 7 expired keys and up to twice the cap of unissued
    // ones (and a key or two where a scan stops), never the pool's 5,007.
    let (n, docs, keys) = examined(100).await;
    assert_eq!((n, docs), (100, 7), "the cap, from the indexes");
    assert!(keys < 250, "{keys} keys examined for a cap of 100");
    cleanup(env).await;
}

/// Stock counts of several pools are budgeted scans of each index, from
/// the highest pool name down; the pools a scan's budget did not reach, or
/// cut short, are scanned again, or counted one by one.
/// Each case below is built so that taking a cut-short or unreached pool's
/// partial count as its answer gives a different number.
#[tokio::test]
async fn stock_counts_of_many_pools_are_exact_where_the_scan_budget_runs_out() {
    let env = TestEnv::new("ops_across").await;
    let store = &env.store;
    // (pool, expired codes, codes, cap), highest name first as scanned.
    // Unissued keys: the budget is 2 × (10 + 5 + 50 + 10) = 150. "e" and
    // "d" take 103 of it, so the scan stops 47 keys into "b" (stock 50,
    // not 47) and never reaches "a" (stock 5, not 0).
    let unissued_cut = [
        ("e", 0, 3, 10),
        ("d", 0, 100, 5),
        ("b", 0, 120, 50),
        ("a", 0, 5, 10),
    ];
    // Expired keys: the budget is 5 + 100 = 105. "z" holds 60, so the scan
    // stops 45 into "y"'s 50 (stock 120 - 50 = 70, not 75). "z" is all
    // expired: 0, counted document by document past its cap.
    let expired_cut = [("z", 60, 60, 5), ("y", 50, 120, 100)];
    // The budget (10 per pool) ends inside "w6", the first pool scanned:
    // one pool of six answered, so "w5" to "w1" (stock 5, not 0) are
    // counted one by one.
    let scans_run_out: Vec<(&str, usize, usize, u64)> = ["w1", "w2", "w3", "w4", "w5", "w6"]
        .map(|w| (w, 0, 100, 5))
        .to_vec();
    for case in [&unissued_cut[..], &expired_cut[..], &scans_run_out[..]] {
        for &(pool, expired, n, _) in case {
            env.fill_pool_expiring(pool, expired, n).await;
        }
        let asks: Vec<(&str, u64)> = case.iter().map(|&(p, _, _, cap)| (p, cap)).collect();
        let together = store.unissued_counts_upto(&asks).await.unwrap();
        let mut exact = Vec::new();
        for &(pool, cap) in &asks {
            exact.push(store.unissued_count(pool).await.unwrap().min(cap));
        }
        assert_eq!(
            together, exact,
            "counted together vs the documents: {asks:?}"
        );
    }
    assert_eq!(
        store
            .unissued_counts_upto(&[("b", 50), ("y", 100), ("a", 10), ("no-such-pool", 3)])
            .await
            .unwrap(),
        vec![50, 70, 5, 0]
    );
    cleanup(env).await;
}

#[tokio::test]
async fn void_reasons_with_control_or_bidi_characters_are_refused() {
    let env = TestEnv::new("ops_reason").await;
    let codes = env.fill_pool("vr", 2).await;
    for reason in [EVIL, "refund\u{202e}", "a\u{200b}b"] {
        let (code, _, err) = codepool(
            &env,
            &[
                "void", "--pool", "vr", "--code", &codes[0], "--reason", reason,
            ],
        )
        .await;
        assert_eq!(code, 1, "{reason:?}: {err}");
        assert!(err.contains("visible text"), "{err}");
        assert_no_raw_escapes(&err);
    }
    assert_eq!(
        count_codes(&env, doc! {"status": 3}).await,
        0,
        "nothing voided"
    );
    env.cleanup().await;
}

/// A void is final: a waiting order voided, and a partly granted one
/// voided as a refund, get nothing when they come back after stock
/// arrives, over HTTP (409 `order-cancelled`) or over AMQP (no event).
#[tokio::test]
async fn a_cancelled_backorder_never_comes_back_through_either_door() {
    use crate::api::{http, json_of, order};
    let env = TestEnv::with_pools("ops_cancelled", &[("few", 2)]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    let place = |id: &'static str, q: u32| {
        let addr = api.addr.clone();
        let shop = shop.clone();
        async move {
            http(
                &addr,
                "POST",
                "/v1/orders",
                Some(&shop),
                &order(id, "few", q),
            )
            .await
        }
    };
    let (status, _, body) = place("P-5", 5).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["state"], "partly_granted");
    let (status, _, _) = place("W-1", 1).await;
    assert_eq!(status, 202);
    for id in ["P-5", "W-1"] {
        let (status, _, body) = api
            .post(
                &format!("/v1/orders/{id}/void"),
                &shop,
                br#"{"reason":"refund"}"#,
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(json_of(&body)["backorder_cancelled"], true);
    }
    add_codes(&env, "few", "more", 10).await;
    for (id, q) in [("P-5", 5), ("W-1", 1)] {
        let (status, _, body) = place(id, q).await;
        assert_eq!(status, 409, "{id}: {}", String::from_utf8_lossy(&body));
        let b = json_of(&body);
        assert!(
            b["type"].as_str().unwrap().ends_with("order-cancelled"),
            "{b}"
        );
        assert!(
            body.windows(5).all(|w| w != b"more-"),
            "no code in the answer"
        );
    }
    api.stop().await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // P-5's first two codes were texted when they were granted.
    let first = drain(&ch, &t.sms_pending).await;
    assert!(first
        .iter()
        .all(|m| String::from_utf8_lossy(&m.body).contains("P-5")));

    // The same purchases over AMQP: acked, nothing granted, nothing texted.
    let daemon = start_daemon(env.command(&[])).await;
    let publisher = Publisher::new(&conn, env.topology())
        .await
        .unwrap()
        .as_user("guest");
    let mut again = vec![
        purchase("W-1", "few"),
        purchase("P-5", "few"),
        purchase("FRESH", "few"),
    ];
    for p in &mut again {
        p.uid = "u-api".into();
    }
    again[1].quantity = 5;
    publish_confirmed(&publisher, &again).await;
    // The fresh order's event.
    wait_depth(&ch, &t.sms_pending, 30, |n| n >= 1).await;
    // Every purchase acked.
    wait_depth(&ch, &t.purchases, 30, |n| n == 0).await;
    let sms = drain(&ch, &t.sms_pending).await;
    assert_eq!(sms.len(), 1, "only FRESH is texted");
    assert!(String::from_utf8_lossy(&sms[0].body).contains("FRESH"));
    assert_eq!(order_statuses(&env, "W-1").await, Vec::<i32>::new());
    assert_eq!(
        order_statuses(&env, "P-5").await,
        vec![3, 3],
        "the two voided codes, nothing new"
    );
    daemon.stop().await;
    env.cleanup().await;
}
