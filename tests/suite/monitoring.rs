//! The dashboard and the alert rules in `deploy/` work on real metrics: a
//! real Prometheus (Debian's package, `scripts/deploy-tools.sh`) scrapes a
//! real dispatcher and API server every second while they grant, back
//! order, refuse and dead-letter, loads `deploy/prometheus/alerts.yml`
//! and raises the alerts that traffic calls for, and answers every query
//! of `deploy/grafana/codepool.json` with data. The logs, in JSON, are
//! one object a line and never carry a code.

use std::time::Duration;

use codepool_broker::Publisher;
use serde_json::Value;

use crate::api::{http, key, order, ApiServer};
use crate::common::*;
use crate::deploy::{repo, tool};
use crate::fixtures::*;

/// A Prometheus of this test's own: its own folder, a free port, a
/// one-second scrape and evaluation interval, codepool's alert rules.
struct Prometheus {
    child: tokio::process::Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(targets: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let rules = repo().join("deploy/prometheus/alerts.yml");
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n",
            rules.display()
        );
        for (job, addr) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [\"{addr}\"]\n"
            ));
        }
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).expect("write the configuration");
        let addr = format!("127.0.0.1:{}", free_port());
        let child = tokio::process::Command::new(tool("prometheus"))
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("prometheus starts");
        let prometheus = Self {
            child,
            addr,
            _dir: dir,
        };
        eventually(Duration::from_secs(30), "prometheus ready", || async {
            matches!(http_get(&prometheus.addr, "/-/ready").await, Some((200, _)))
        })
        .await;
        prometheus
    }

    /// An instant query through the HTTP API: its `data.result`, or why not.
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        self.get_result(&format!("/api/v1/query?query={}", percent_encode(expr)))
            .await
    }

    /// An instant query evaluated at `time` (RFC 3339, as Prometheus
    /// reports a rule's `lastEvaluation`).
    async fn query_at(&self, expr: &str, time: &str) -> Result<Vec<Value>, String> {
        self.get_result(&format!(
            "/api/v1/query?query={}&time={}",
            percent_encode(expr),
            percent_encode(time)
        ))
        .await
    }

    async fn get_result(&self, path: &str) -> Result<Vec<Value>, String> {
        let (status, body) = http_get(&self.addr, path)
            .await
            .ok_or("prometheus does not answer")?;
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || v["status"] != "success" {
            return Err(format!("{status} {body}"));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every query of the dashboard, with Grafana's variables as Grafana
/// would fill them in: every pool, a one-minute rate window.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = repo().join("deploy/grafana/codepool.json");
    let text = std::fs::read_to_string(path).expect("the dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("an expr").to_owned();
            let filled = expr
                .replace("$__rate_interval", "1m")
                .replace("$pool", ".+");
            assert!(!filled.contains('$'), "an unknown variable in {expr}");
            out.push((panel["title"].as_str().unwrap_or("").to_owned(), filled));
        }
    }
    out
}

/// Grants in two pools, backorders in a pool of one code, a refusal, a
/// dead letter, and API orders with one unauthorized request.
async fn traffic(publisher: &Publisher, api: &str, api_key: &str, round: usize) {
    let mut purchases: Vec<_> = (0..5)
        .map(|i| purchase(&format!("M-{round}-{i}"), "m"))
        .collect();
    purchases.push(purchase(&format!("T-{round}"), "tiny"));
    let mut limited = purchase(&format!("L-{round}"), "lim");
    limited.uid = "one-buyer".into();
    purchases.push(limited);
    publish_confirmed(publisher, &purchases).await;
    let junk = format!("not json {round}");
    publish_bytes(publisher, junk.as_bytes(), Some(&junk)).await;
    let (status, _, _) = http(
        api,
        "POST",
        "/v1/orders",
        Some(api_key),
        &order(&format!("API-{round}"), "m", 1),
    )
    .await;
    assert!(status < 500, "API order: {status}");
    // A checkout hold: the held codes' series has something to show.
    let hold = serde_json::json!({"hold_id": format!("HOLD-{round}"), "uid": format!("holder-{round}"),
                                  "items": [{"pool": "m", "quantity": 1}]});
    let (status, _, _) = http(
        api,
        "POST",
        "/v1/holds",
        Some(api_key),
        hold.to_string().as_bytes(),
    )
    .await;
    assert_eq!(status, 201, "a hold");
    let (status, _, _) = http(api, "POST", "/v1/orders", None, &order("API-X", "m", 1)).await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn a_real_prometheus_answers_every_dashboard_query_and_raises_the_right_alerts() {
    let env = TestEnv::with_pools("monitoring", &[("m", 300), ("tiny", 1), ("lim", 20)]).await;
    pool_set(&env, "m", &["--low-stock", "50"]).await;
    pool_set(&env, "lim", &["--per-user", "1"]).await;
    // Already below its threshold: the low-stock alert has something to say.
    pool_set(&env, "lim", &["--low-stock", "25"]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let api = ApiServer::start(&env, &[]).await;
    let api_key = key(&env, "monitoring", "orders:write,orders:read").await;
    let prometheus = Prometheus::start(&[
        ("codepool-dispatch", daemon.addr.as_str()),
        ("codepool-api", api.addr.as_str()),
    ])
    .await;
    let (conn, publisher) = env.amqp().await;

    // Traffic until the dispatcher's backorder sweep (every 10 s) has seen
    // the empty pool's backorders, and every dashboard query has data.
    let queries = dashboard_queries();
    assert!(queries.len() >= 15, "{queries:?}");
    let mut round = 0;
    let mut empty: Vec<String> = Vec::new();
    for _ in 0..40 {
        traffic(&publisher, &api.addr, &api_key, round).await;
        round += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
        empty.clear();
        for (title, expr) in &queries {
            match prometheus.query(expr).await {
                Ok(result) if result.is_empty() => empty.push(format!("{title}: {expr}")),
                Ok(_) => {}
                Err(e) => panic!("dashboard panel {title:?}: {expr} does not run: {e}"),
            }
        }
        if empty.is_empty() && round >= 4 {
            break;
        }
    }
    assert!(empty.is_empty(), "queries without data: {empty:#?}");

    check_alert_rules(&prometheus).await;
    check_alerts_fire(&prometheus).await;

    prometheus.stop().await;
    codepool_broker::close(conn, "done").await;
    api.stop().await;
    daemon.stop().await;
    env.cleanup().await;
}

/// Prometheus loaded every rule of alerts.yml (alerts and recording
/// rules), evaluated each without an error, and each rule's expression
/// runs as a query.
async fn check_alert_rules(prometheus: &Prometheus) {
    let text = std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yml")).expect("rules");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            l.strip_prefix("- alert: ")
                .or_else(|| l.strip_prefix("- record: "))
        })
        .collect();
    assert!(names.len() >= 9, "{names:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let rules = loop {
        let rules = loaded_rules(prometheus).await;
        if rules.len() == names.len() && rules.iter().all(|r| r["health"] != "unknown") {
            break rules;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "prometheus did not load and evaluate {names:?}: {rules:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for rule in &rules {
        let name = rule["name"].as_str().unwrap_or("");
        assert!(names.contains(&name), "{name} is not in alerts.yml");
        assert_eq!(rule["health"], "ok", "{name}: {}", rule["lastError"]);
        let expr = rule["query"].as_str().expect("the rule's query");
        if let Err(e) = prometheus.query(expr).await {
            panic!("{name}: {expr} does not run: {e}");
        }
    }
}

/// The rules Prometheus has loaded, from `/api/v1/rules`.
async fn loaded_rules(prometheus: &Prometheus) -> Vec<Value> {
    let Some((200, body)) = http_get(&prometheus.addr, "/api/v1/rules").await else {
        return Vec::new();
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// Grants of one code and of three, a low-stock crossing, two dead
/// letters, then a redemption, with `--log-format json`.
async fn logged_traffic(env: &TestEnv, publisher: &Publisher) {
    let mut three = purchase("J-2", "j");
    three.quantity = 3;
    publish_confirmed(publisher, &[purchase("J-1", "j"), three]).await;
    let _t = env.topology();
    let dead = [
        (b"not json".to_vec(), "J-junk"),
        (
            serde_json::json!({"order_id": "J-\u{202e}3", "uid": "u", "phone": "+8613800000000", "pool": "j"})
                .to_string()
                .into_bytes(),
            "J-bidi",
        ),
    ];
    for (body, id) in dead {
        publish_bytes(publisher, &body, Some(id)).await;
    }
    let granted = || async {
        env.coll("codes")
            .count_documents(bson::doc! {"pool": "j", "order_id": {"$exists": true}})
            .await
            .unwrap_or(0)
            == 4
    };
    eventually(Duration::from_secs(30), "4 codes granted", granted).await;
    // J-1's code is used: the redemption logs it, masked.
    publish_redeemed(publisher, env, "J-1", Some("guest")).await;
}

#[tokio::test]
async fn json_logs_are_one_object_a_line_and_never_carry_a_code() {
    let env = TestEnv::new("monitoring_logs").await;
    let codes = env.fill_pool("j", 6).await;
    pool_set(&env, "j", &["--low-stock", "4"]).await;
    let daemon = start_daemon(env.command(&["--log-format", "json"])).await;
    let (conn, publisher) = env.amqp().await;
    logged_traffic(&env, &publisher).await;
    eventually(
        Duration::from_secs(20),
        "the redemption, the dead letters and the low-stock alert",
        || async {
            let log = daemon.log_text();
            // The stock check runs after the grants, in the background.
            log.contains("code redeemed")
                && log.matches("purchase dead-lettered").count() == 2
                && log.contains("low stock")
        },
    )
    .await;
    let log = daemon.log.clone();
    codepool_broker::close(conn, "done").await;
    daemon.stop().await;

    let lines = log.lock().map(|l| l.clone()).unwrap_or_default();
    let mut granted = 0;
    for line in &lines {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
        for field in ["timestamp", "level", "message"] {
            assert!(v[field].is_string(), "no {field}: {line}");
        }
        for code in &codes {
            assert!(
                !line.contains(code.as_str()),
                "a plaintext code in the log: {line}"
            );
        }
        if v["message"] == "granted" {
            granted += 1;
            let masked = v["code"].as_str().expect("a granted line names its code");
            assert!(masked.contains('*'), "{line}");
            assert!(v["order_id"].is_string() && v["pool"] == "j", "{line}");
        }
    }
    assert_eq!(granted, 4, "one line per code granted: {lines:#?}");
    let text = lines.join("\n");
    for message in [
        "low stock",
        "code redeemed",
        "purchase dead-lettered",
        "dispatcher stopped",
    ] {
        assert!(text.contains(message), "no {message:?} line");
    }
    assert!(!text.contains('\u{202e}'), "a raw bidi control in the log");
    env.cleanup().await;
}

/// The alerts this traffic should raise, and only those: dead letters
/// (firing at once), the empty pool with backorders and the pool below its
/// threshold (pending: their `for` is minutes). Nothing is down, unready,
/// on Redis fallback or failing.
///
/// Whether the end-to-end latency alert belongs among them depends on how
/// fast this machine served the traffic: on one busy with the rest of the
/// suite some batches take longer than the rule's 0.5 s, and then the
/// alert is right to be pending, and must be. It is judged against the
/// rule's own evaluation: the alerts are read from `/api/v1/rules`, and
/// the rule's expression (the p99 over 0.5 s) is queried at the latency
/// rule's `lastEvaluation` in that same answer, never at a later moment
/// whose data the rule has not seen.
async fn check_alerts_fire(prometheus: &Prometheus) {
    let expected = [
        ("CodepoolDeadLettersRising", "reason", "not_json", "firing"),
        (
            "CodepoolPoolExhaustedWithBackorders",
            "pool",
            "tiny",
            "pending",
        ),
        ("CodepoolPoolLowStock", "pool", "lim", "pending"),
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut rules = loaded_rules(prometheus).await;
    loop {
        let alerts = rule_alerts(&rules);
        let raised = |(name, label, value, state): &(&str, &str, &str, &str)| {
            alerts.iter().any(|a| {
                a["labels"]["alertname"] == *name
                    && a["labels"][*label] == *value
                    && a["state"] == *state
            })
        };
        if expected.iter().all(raised) || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        rules = loaded_rules(prometheus).await;
    }
    // The latency rule's state and the p99 it was evaluated on may differ
    // only by a scrape that landed while the rule was being evaluated: then
    // the next evaluation is judged. A difference that stays is a failure.
    let mut evaluations = 0;
    loop {
        let latency = latency_rule(&rules);
        let at = latency["lastEvaluation"].as_str().unwrap_or("").to_owned();
        // The rule's own expression (`p99 > 0.5`), at that moment.
        let expr = latency["query"].as_str().expect("the rule's query");
        let p99 = prometheus.query_at(expr, &at).await;
        let slow = p99.as_ref().is_ok_and(|r| !r.is_empty());
        let rule_says_slow = latency["state"] != "inactive";
        evaluations += 1;
        if slow == rule_says_slow || evaluations == 10 {
            assert_eq!(
                rule_says_slow, slow,
                "the latency rule evaluated at {at} ({}) against its expression then: {p99:?}",
                latency["state"]
            );
            break;
        }
        while latency_rule(&rules)["lastEvaluation"].as_str() == Some(at.as_str()) {
            assert!(
                std::time::Instant::now() < deadline + Duration::from_secs(30),
                "no new evaluation of the latency rule since {at}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            rules = loaded_rules(prometheus).await;
        }
    }
    let alerts = rule_alerts(&rules);
    let mut names: Vec<String> = alerts
        .iter()
        .map(|a| {
            format!(
                "{} {} {} {}",
                a["labels"]["alertname"].as_str().unwrap_or(""),
                a["labels"]["pool"].as_str().unwrap_or(""),
                a["labels"]["reason"].as_str().unwrap_or(""),
                a["state"].as_str().unwrap_or("")
            )
        })
        .collect();
    names.sort();
    let mut want = vec![
        "CodepoolDeadLettersRising  not_json firing",
        "CodepoolPoolExhaustedWithBackorders tiny  pending",
        "CodepoolPoolLowStock lim  pending",
    ];
    let latency = latency_rule(&rules);
    if latency["state"] != "inactive" {
        want.insert(1, "CodepoolEndToEndLatencyHigh   pending");
    }
    assert_eq!(names, want, "the alerts raised: {alerts:#?}");
}

/// The latency rule among `rules`, from `/api/v1/rules`.
fn latency_rule(rules: &[Value]) -> Value {
    rules
        .iter()
        .find(|r| r["name"] == "CodepoolEndToEndLatencyHigh")
        .cloned()
        .expect("the end-to-end latency rule is loaded")
}

/// Every alert of every rule, as the rules' last evaluations left them.
fn rule_alerts(rules: &[Value]) -> Vec<Value> {
    rules
        .iter()
        .flat_map(|r| r["alerts"].as_array().cloned().unwrap_or_default())
        .collect()
}
