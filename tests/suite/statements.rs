//! Statements (issue 56 item 2) on the real servers, through real `codepool`
//! and `codepool api` processes: after a mix of orders, holds, a refund, a
//! redemption, a replacement, an expiry and a recall, every row ties out,
//! its balance matches the codes' own statuses, two back-to-back periods
//! add up to the whole, the `--lines` HMACs match Python's HMAC-SHA256
//! under the statement key, no output holds a code, and a row broken
//! behind codepool's back exits 3 naming the row and the difference.

use std::collections::{BTreeMap, HashSet};

use bson::doc;
use futures::TryStreamExt;
use serde_json::{json, Value};

use crate::api::{json_of, key, order, ApiServer};
use crate::common::*;
use crate::fixtures::*;

/// `codepool statement …` with its exit code, stdout and stderr.
async fn statement(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["statement"];
    all.extend_from_slice(args);
    let out = env.run(&all).await;
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The JSON statement of `pool` over `[from, to)`; panics unless it ties out.
async fn rows(env: &TestEnv, pool: &str, from: &str, to: &str) -> Value {
    let (rc, out, err) =
        statement(env, &["--pool", pool, "--from", from, "--to", to, "--json"]).await;
    assert_eq!(rc, 0, "the statement ties out: {err}{out}");
    serde_json::from_str(&out).expect("JSON")
}

/// Each run's row by import id.
fn by_import(s: &Value) -> BTreeMap<String, Value> {
    s["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["import"].as_str().unwrap_or("-").to_owned(), r.clone()))
        .collect()
}

/// Adds the numbers of two JSON objects of the same shape.
fn add(a: &Value, b: &Value) -> Value {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            Value::Object(x.iter().map(|(k, v)| (k.clone(), add(v, &y[k]))).collect())
        }
        (Value::Number(x), Value::Number(y)) => json!(x.as_u64().unwrap() + y.as_u64().unwrap()),
        _ => panic!("not the same shape: {a} {b}"),
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Waits until the clock is past `t` (moves in the same millisecond as a
/// period's boundary would fall in one period or the other by chance).
async fn boundary() -> String {
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let t = now();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    t
}

async fn post(api: &ApiServer, key: &str, path: &str, body: &[u8]) -> Value {
    let (status, _, b) = api.post(path, key, body).await;
    assert!(
        (200..300).contains(&status),
        "{path}: {status} {}",
        String::from_utf8_lossy(&b)
    );
    json_of(&b)
}

/// Imports `rows` (a CSV body) into `pool` as file `name`; its run id.
async fn import(env: &TestEnv, pool: &str, name: &str, rows: &str) -> String {
    let dir = std::env::temp_dir().join(format!("statements-{}", suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(name);
    std::fs::write(&file, rows).unwrap();
    let out = env
        .run(&["import", file.to_str().unwrap(), "--pool", pool, "--json"])
        .await;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    v["import_id"]
        .as_str()
        .or(v["run_id"].as_str())
        .expect("a run id")
        .to_owned()
}

/// The codes of `pool` now, counted by run and status (as the checker
/// counts them), independently of the statement's own reading.
async fn statuses(env: &TestEnv, pool: &str) -> BTreeMap<String, [u64; 5]> {
    let docs = codes_of_pool(env, pool).await;
    let mut out: BTreeMap<String, [u64; 5]> = BTreeMap::new();
    for d in docs {
        let run = d.get_object_id("batch_id").unwrap().to_hex();
        out.entry(run).or_default()[d.get_i32("status").unwrap() as usize] += 1;
    }
    out
}

fn total_void(v: &Value) -> u64 {
    ["refund", "replaced", "recalled", "expired", "other"]
        .iter()
        .map(|r| v[r].as_u64().unwrap())
        .sum()
}

/// Every code document of `pool`.
async fn codes_of_pool(env: &TestEnv, pool: &str) -> Vec<bson::Document> {
    find_docs(env, "codes", doc! {"pool": pool}).await
}

/// Every plaintext code of `pool`.
async fn plaintexts(env: &TestEnv, pool: &str) -> Vec<String> {
    let docs = codes_of_pool(env, pool).await;
    docs.iter().map(|d| env.plain_code(d)).collect()
}

/// Python's own HMAC-SHA256 of each code under `key_hex`.
async fn python_hmacs(key_hex: &str, codes: &[String]) -> HashSet<String> {
    let script = "import hmac, hashlib, sys\nk = bytes.fromhex(sys.argv[1])\nfor c in sys.stdin.read().split('\\n'):\n    if c: print(hmac.new(k, c.encode(), hashlib.sha256).hexdigest())\n";
    let input = codes.join("\n");
    let out = with_stdin(&mut python(script, &[key_hex]), input.as_bytes()).await;
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_row_ties_out_after_a_mix_and_two_periods_add_up_to_the_whole() {
    let env = TestEnv::new("statements_mix").await;
    let past = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let mut a = String::from("code,expires_at\n");
    for i in 1..=20 {
        let exp = if i <= 3 { past.as_str() } else { "" };
        a.push_str(&format!("STA-{i:04},{exp}\n"));
    }
    a.push_str("STA-0005,\n");
    let run_a = import(&env, "st", "a.csv", &a).await;
    let b: String = std::iter::once("code\n".to_owned())
        .chain((1..=6).map(|i| format!("STB-{i:04}\n")))
        .collect();
    let run_b = import(&env, "st", "b.csv", &b).await;
    let t0 = boundary().await;

    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    for i in 1..=6 {
        let body = order(&format!("O-{i}"), "st", 1);
        post(&api, &shop, "/v1/orders", &body).await;
    }
    let hold = |id: &str| {
        json!({"hold_id": id, "uid": format!("buyer-{id}"), "items": [{"pool": "st", "quantity": 1}]})
            .to_string()
            .into_bytes()
    };
    for id in ["H-1", "H-2", "H-3"] {
        post(&api, &shop, "/v1/holds", &hold(id)).await;
    }
    let (s, _, _) = api.call("DELETE", "/v1/holds/H-3", &shop, b"").await;
    assert!((200..300).contains(&s), "H-3 released: {s}");
    post(
        &api,
        &shop,
        "/v1/orders/O-1/void",
        br#"{"reason":"refund"}"#,
    )
    .await;
    codepool_ok(&env, &["redeem", "--order", "O-2"]).await;
    post(
        &api,
        &shop,
        "/v1/orders/O-3/lines/0/replace",
        br#"{"replacement_id":"R-1","reason":"code rejected"}"#,
    )
    .await;
    let t1 = boundary().await;

    codepool_ok(&env, &["expire", "--pool", "st"]).await;
    codepool_ok(&env, &["void", "--import", &run_b, "--reason", "leak"]).await;
    for i in 7..=8 {
        let body = order(&format!("O-{i}"), "st", 1);
        post(&api, &shop, "/v1/orders", &body).await;
    }
    let t2 = boundary().await;

    let whole = rows(&env, "st", "2000-01-01", &t2).await;
    let first = rows(&env, "st", "2000-01-01", &t1).await;
    let second = rows(&env, "st", &t1, &t2).await;
    let before = rows(&env, "st", "2000-01-01", &t0).await;
    let (w, f, s) = (by_import(&whole), by_import(&first), by_import(&second));
    assert_eq!(w.keys().collect::<Vec<_>>().len(), 2, "{whole}");

    // The balance at the end matches the codes' statuses, counted apart.
    let now = statuses(&env, "st").await;
    for (run, row) in &w {
        let [unissued, issued, used, void, held] = now[run];
        let bal = &row["balance"];
        assert_eq!(bal["in_stock"], unissued, "{run}: {row}");
        assert_eq!(bal["issued"], issued, "{run}: {row}");
        assert_eq!(bal["used"], used, "{run}: {row}");
        assert_eq!(total_void(&bal["void"]), void, "{run}: {row}");
        assert_eq!(bal["held"], held, "{run}: {row}");
        assert_eq!(row["received"], unissued + issued + used + void + held);
        assert_eq!(
            row["recorded"], row["received"],
            "the run's own count: {row}"
        );
        assert_eq!(row["unaccounted"], 0);
    }
    assert_eq!(w[&run_a]["received"], 20);
    assert_eq!(w[&run_a]["duplicates"], 1);
    assert_eq!(w[&run_b]["received"], 6);

    // What moved, counted by the move's time.
    let total = &whole["total"];
    assert_eq!(
        total["moves"]["issued"], 9,
        "8 orders and a replacement: {total}"
    );
    assert_eq!(total["moves"]["used"], 1);
    assert_eq!(
        total["balance"]["held"], 2,
        "H-1 and H-2 are live; H-3's code is back"
    );
    let voids = &total["moves"]["void"];
    assert_eq!(voids["refund"], 1, "{total}");
    assert_eq!(voids["replaced"], 1, "{total}");
    assert_eq!(voids["expired"], 3, "{total}");
    assert_eq!(voids["other"], 0, "{total}");
    let recalled = now[&run_b][3];
    assert!(recalled > 0);
    assert_eq!(
        voids["recalled"].as_u64().unwrap(),
        recalled
            - w[&run_b]["moves"]["void"]["refund"].as_u64().unwrap()
            - w[&run_b]["moves"]["void"]["replaced"].as_u64().unwrap()
    );
    // The API's own sweep may void the expired codes before t1, or
    // `codepool expire` after it: each is counted in the period of its void.
    let expired = |s: &Value| s["total"]["moves"]["void"]["expired"].as_u64().unwrap();
    assert_eq!(expired(&first) + expired(&second), 3);
    assert_eq!(second["total"]["moves"]["received"], 0);
    assert_eq!(before["total"]["moves"]["issued"], 0);
    assert_eq!(
        before["total"]["balance"]["in_stock"], 26,
        "nothing sold before t0"
    );

    // Two back-to-back periods add up to the whole; the later one's
    // balance is the whole's.
    for run in w.keys() {
        assert_eq!(
            add(&f[run]["moves"], &s[run]["moves"]),
            w[run]["moves"],
            "{run}"
        );
        assert_eq!(s[run]["balance"], w[run]["balance"], "{run}");
        assert_eq!(
            f[run]["balance"]["in_stock"].as_u64().unwrap()
                + f[run]["balance"]["held"].as_u64().unwrap()
                + f[run]["balance"]["issued"].as_u64().unwrap()
                + f[run]["balance"]["used"].as_u64().unwrap()
                + total_void(&f[run]["balance"]["void"]),
            f[run]["received"].as_u64().unwrap(),
            "{run}: the first period's balance ties out"
        );
    }

    // The API gives the same statement.
    let admin = key(&env, "ops", "admin").await;
    let path = format!(
        "/v1/statements?pool=st&from=2000-01-01&to={}",
        t2.replace('+', "%2B")
    );
    let (status, _, body) = api.get(&path, &admin).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let from_api = json_of(&body);
    assert_eq!(from_api["rows"], whole["rows"]);
    assert_eq!(from_api["discrepancies"], json!([]));
    let (status, _, _) = api.get(&path, &shop).await;
    assert_eq!(status, 403, "a shop's key gets no statement");
    let (status, _, body) = api.get("/v1/statements?pool=nope", &admin).await;
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
    let (status, _, body) = api
        .get("/v1/statements?pool=st&from=yesterday", &admin)
        .await;
    assert_eq!(status, 422);
    assert_eq!(json_of(&body)["field"], "from");

    // No output holds a code.
    let codes = plaintexts(&env, "st").await;
    let mut outputs = vec![
        whole.to_string(),
        String::from_utf8_lossy(&body).into_owned(),
    ];
    for args in [
        vec!["--pool", "st"],
        vec!["--pool", "st", "--csv"],
        vec!["--pool", "st", "--lines"],
        vec!["--pool", "st", "--lines", "--json"],
    ] {
        let (rc, out, err) = statement(&env, &args).await;
        assert_eq!(rc, 0, "{args:?}: {err}");
        outputs.push(out + &err);
    }
    for fmt in ["csv", "json"] {
        let (_, _, b) = api
            .get(&format!("/v1/statements?pool=st&format={fmt}"), &admin)
            .await;
        outputs.push(String::from_utf8_lossy(&b).into_owned());
    }
    let (_, _, b) = api.get("/v1/statements/lines?pool=st", &admin).await;
    let lines_api = json_of(&b);
    outputs.push(lines_api.to_string());
    for out in &outputs {
        for c in &codes {
            assert!(!out.contains(c.as_str()), "a statement shows code {c}");
        }
    }

    // The lines name every code by its HMAC under the statement key,
    // exactly as Python computes it.
    let (rc, key_hex, _) = statement(&env, &["--pool", "st", "--key"]).await;
    assert_eq!(rc, 0);
    let key_hex = key_hex.trim().to_owned();
    assert_eq!(key_hex.len(), 64);
    let shown = count_docs(&env, "audit", doc! {"kind": "statement-key"}).await;
    assert_eq!(shown, 1, "showing the statement key is audited");
    let expected = python_hmacs(&key_hex, &codes).await;
    let listed: HashSet<String> = lines_api["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["code_hmac"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, expected);
    let moves = lines_api["lines"].as_array().unwrap();
    let count = |m: &str| moves.iter().filter(|l| l["move"] == m).count() as u64;
    assert_eq!(count("received"), 26);
    assert_eq!(count("issued"), total["moves"]["issued"].as_u64().unwrap());
    assert_eq!(count("void"), total_void(&total["moves"]["void"]));
    let (rc, _, _) = statement(&env, &["--pool", "other", "--key"]).await;
    assert_eq!(rc, 1, "no key for a pool that does not exist");
    api.stop().await;
    grouped_figures_equal_each_code_read_alone(&env, "st", &run_a).await;
    env.cleanup().await;
}

/// The statement counts groups of codes alike, each group standing in for
/// its codes: over periods bounded by the codes' own times (a move at the
/// very start or end of a period), empty and reversed periods included,
/// for the whole pool and one run, it gives what every code read alone
/// gives.
/// `docs` with every 32-bit number 64-bit: the server gives a count the
/// width it fits in.
fn widened(docs: &[bson::Document]) -> Vec<bson::Document> {
    let widen = |v: &bson::Bson| match v {
        bson::Bson::Int32(n) => bson::Bson::Int64(i64::from(*n)),
        other => other.clone(),
    };
    (docs.iter())
        .map(|d| d.iter().map(|(k, v)| (k.clone(), widen(v))).collect())
        .collect()
}

async fn grouped_figures_equal_each_code_read_alone(env: &TestEnv, pool: &str, run: &str) {
    let mut times: Vec<bson::DateTime> = codes_of_pool(env, pool)
        .await
        .iter()
        .flat_map(|d| {
            ["created_at", "issued_at", "used_at", "voided_at"]
                .into_iter()
                .filter_map(|f| d.get_datetime(f).ok().copied())
        })
        .collect();
    times.sort();
    times.dedup();
    let step = times.len().div_ceil(6).max(1);
    let mut bounds: Vec<bson::DateTime> = times.iter().step_by(step).copied().collect();
    bounds.extend([
        bson::DateTime::from_millis(0),
        bson::DateTime::now(),
        bson::DateTime::MAX,
    ]);
    let run = bson::oid::ObjectId::parse_str(run).unwrap();
    let mut compared = 0;
    for &from in &bounds {
        for &to in &bounds {
            for import in [None, Some(run)] {
                let p = codepool_store::statements::Period {
                    pool,
                    import,
                    from,
                    to,
                    channel: None,
                };
                let (grouped, alone) = env.store.statement_figures_both_ways(&p).await.unwrap();
                assert_eq!(
                    widened(&grouped),
                    widened(&alone),
                    "from {from} to {to}, run {import:?}"
                );
                compared += usize::from(!alone.is_empty());
            }
        }
    }
    assert!(compared > 30, "{compared} periods with codes compared");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_broken_behind_codepools_back_exits_3_naming_it() {
    let env = TestEnv::new("statements_off").await;
    let run = import(&env, "so", "s.csv", "code\nSO-1\nSO-2\nSO-3\nSO-4\n").await;
    let (rc, _, err) = statement(&env, &["--pool", "so"]).await;
    assert_eq!(rc, 0, "{err}");
    let codes = env.coll("codes");
    // A sold code with no time of sale, and a code gone.
    codes
        .update_one(
            doc! {"pool": "so", "status": 0},
            doc! {"$set": {"status": 1}},
        )
        .await
        .unwrap();
    let r = codes
        .delete_one(doc! {"pool": "so", "status": 0})
        .await
        .unwrap();
    assert_eq!(r.deleted_count, 1);
    let (rc, out, err) = statement(&env, &["--pool", "so"]).await;
    assert_eq!(rc, 3, "{out}{err}");
    assert!(err.contains(&format!("import {run} is off by 2")), "{err}");
    assert!(
        err.contains("the run recorded 4 codes put in, and 3 of it are in the pool"),
        "{err}"
    );
    assert!(err.contains("1 of its codes are in no state"), "{err}");
    assert!(out.contains("OFF BY 2"), "{out}");
    let total = out.lines().find(|l| l.starts_with("TOTAL")).unwrap();
    assert!(
        total.contains("OFF BY 2"),
        "the total names what its rows are off by: {total}"
    );
    let (rc, out, _) = statement(&env, &["--pool", "so", "--csv"]).await;
    assert_eq!(rc, 3);
    assert!(
        out.lines().nth(1).unwrap().ends_with(",1,2"),
        "unaccounted 1, off by 2: {out}"
    );
    let (rc, _, err) = statement(
        &env,
        &["--pool", "so", "--import", "0123456789abcdef01234567"],
    )
    .await;
    assert_eq!(rc, 1);
    assert!(err.contains("is not a run of pool \"so\""), "{err}");

    // Documents no codepool writes, past its validator: a status of
    // another number type or none known, a reason in odd case, a recall
    // that is no id, a time that is text, no run or a null one. The
    // statement's groups still read them as each code alone does.
    let run_id = bson::oid::ObjectId::parse_str(&run).unwrap();
    let at = |mins: i64| {
        bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - mins * 60_000)
    };
    let odd = vec![
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 1_i64, "issued_at": at(60)},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 3, "issued_at": at(60), "voided_at": at(30), "void_reason": "  ReFund "},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 3, "voided_at": at(30), "void_reason": bson::Bson::Null, "recalled_by": "not-an-id"},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 3, "issued_at": at(60), "voided_at": at(20), "void_reason": "expired"},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 3, "issued_at": at(60), "voided_at": at(20), "void_reason": "Expired"},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 3, "issued_at": at(60), "voided_at": at(10), "void_reason": "replaced"},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(90), "status": 1, "issued_at": "yesterday"},
        doc! {"pool": "so", "created_at": at(80), "status": 0},
        doc! {"pool": "so", "batch_id": bson::Bson::Null, "created_at": at(80), "status": 2, "issued_at": at(50), "used_at": at(40)},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 7},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 0.0},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 3, "voided_at": at(5), "recalled_by": run_id},
        // A statement reads its codes in parts cut by `seq`: these belong
        // to one part each all the same.
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 0, "seq": "3"},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 0, "seq": 2.5},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 0, "seq": 5_i64},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 0, "seq": f64::NAN},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 1, "issued_at": at(60), "seq": -1},
        doc! {"pool": "so", "batch_id": run_id, "created_at": at(70), "status": 0, "seq": [10, 1, 2.5]},
        // One run as the server groups runs, in two parts.
        doc! {"pool": "so", "batch_id": 7, "created_at": at(70), "status": 0, "seq": 1},
        doc! {"pool": "so", "batch_id": 7_i64, "created_at": at(70), "status": 0, "seq": "x"},
    ];
    codes
        .insert_many(odd)
        .bypass_document_validation(true)
        .await
        .unwrap();
    grouped_figures_equal_each_code_read_alone(&env, "so", &run).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn held_codes_recalled_or_expired_were_never_sold_and_codepools_reasons_are_its_own() {
    let env = TestEnv::new("statements_held").await;
    let run = import(
        &env,
        "sh",
        "h.csv",
        "code\nSH-1\nSH-2\nSH-3\nSH-4\nSH-5\nSH-6\n",
    )
    .await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    for i in 1..=4 {
        let body = json!({"hold_id": format!("HH-{i}"), "uid": format!("u{i}"), "items": [{"pool": "sh", "quantity": 1}]});
        post(&api, &shop, "/v1/holds", body.to_string().as_bytes()).await;
    }
    post(&api, &shop, "/v1/orders", &order("SOLD-1", "sh", 1)).await;
    // Two held codes pass their expiry and the sweep voids them; then the
    // run is recalled (the other held ones and the stock).
    let codes = env.coll("codes");
    let past = bson::DateTime::from_chrono(chrono::Utc::now() - chrono::Duration::hours(1));
    let held: Vec<bson::Document> = codes
        .find(doc! {"pool": "sh", "status": 4})
        .limit(2)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    for d in &held {
        codes
            .update_one(
                doc! {"_id": d.get_object_id("_id").unwrap()},
                doc! {"$set": {"expires_at": past}},
            )
            .await
            .unwrap();
    }
    codepool_ok(&env, &["expire", "--pool", "sh"]).await;
    let t = boundary().await;
    codepool_ok(&env, &["void", "--import", &run, "--reason", "leak"]).await;
    let s = rows(&env, "sh", "2000-01-01", &now()).await;
    let total = &s["total"];
    assert_eq!(total["moves"]["issued"], 1, "only SOLD-1 was sold: {total}");
    assert_eq!(total["balance"]["issued"], 1, "{total}");
    assert_eq!(total["balance"]["void"]["expired"], 2, "{total}");
    assert_eq!(
        total["balance"]["void"]["recalled"], 3,
        "two held and one in stock: {total}"
    );
    let before = rows(&env, "sh", "2000-01-01", &t).await;
    assert_eq!(
        before["total"]["balance"]["held"], 2,
        "two holds were live before the recall: {before}"
    );
    assert_eq!(before["total"]["balance"]["issued"], 1, "{before}");
    let (_, lines, _) = statement(&env, &["--pool", "sh", "--lines"]).await;
    assert_eq!(
        lines.lines().filter(|l| l.contains(",issued,")).count(),
        1,
        "{lines}"
    );

    // A shop's void cannot pass for codepool's own.
    for reason in ["expired", " Replaced ", "RECALLED"] {
        let body = json!({ "reason": reason }).to_string();
        let (status, _, b) = api
            .post("/v1/orders/SOLD-1/void", &shop, body.as_bytes())
            .await;
        assert_eq!(status, 422, "{reason}: {}", String::from_utf8_lossy(&b));
        assert_eq!(
            json_of(&b)["type"].as_str().unwrap().rsplit('/').next(),
            Some("reserved-reason")
        );
    }
    post(
        &api,
        &shop,
        "/v1/orders/SOLD-1/void",
        br#"{"reason":"Refund"}"#,
    )
    .await;
    let s = rows(&env, "sh", "2000-01-01", &now()).await;
    assert_eq!(
        s["total"]["moves"]["void"]["refund"], 1,
        "refund in any case: {s}"
    );
    assert_eq!(s["provisional"], true, "a period ending now is provisional");
    let (rc, out, _) = statement(&env, &["--pool", "sh"]).await;
    assert_eq!(rc, 0);
    assert!(out.contains("PROVISIONAL"), "{out}");
    let old = rows(&env, "sh", "2000-01-01", "2001-01-01").await;
    assert_eq!(old["provisional"], false);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_part_of_a_statement_reads_at_the_one_snapshot() {
    let env = TestEnv::new("statements_snapshot").await;
    let p = codepool_store::statements::Period {
        pool: "sn",
        import: None,
        from: bson::DateTime::from_millis(0),
        to: bson::DateTime::MAX,
        channel: None,
    };
    // Before any code: the counters' collection does not exist, and a
    // read of it fixes no snapshot. The statement is empty all the same.
    let db = env.store.database();
    db.collection::<bson::Document>("sequences")
        .drop()
        .await
        .unwrap();
    let (none, _) = env.store.statement_figures_both_ways(&p).await.unwrap();
    assert!(none.is_empty(), "{none:?}");
    let rows: String = (1..=40).map(|i| format!("SN-{i:03}\n")).collect();
    import(&env, "sn", "sn.csv", &format!("code\n{rows}")).await;
    let (before, _) = env.store.statement_figures_both_ways(&p).await.unwrap();
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].get_i64("b_in_stock").unwrap(), 40);
    // Moves in every part (the parts are cut by `seq`, 1 to 40), made
    // after the snapshot is fixed and before the parts are read.
    let codes = env.coll("codes");
    let meanwhile = async {
        codes
            .update_many(
                doc! {"pool": "sn", "seq": {"$in": [2, 12, 22, 32, 40]}},
                doc! {"$set": {"status": 3, "voided_at": bson::DateTime::now(), "void_reason": "refund"}},
            )
            .await
            .unwrap();
        codes
            .delete_many(doc! {"pool": "sn", "seq": {"$in": [5, 15, 25, 35]}})
            .await
            .unwrap();
    };
    let fixed = (env.store)
        .statement_figures_fixed_before(&p, meanwhile)
        .await
        .unwrap();
    assert_eq!(fixed, before, "a part saw a write made after the snapshot");
    let (after, alone) = env.store.statement_figures_both_ways(&p).await.unwrap();
    assert_eq!(widened(&after), widened(&alone));
    assert_eq!(after[0].get_i64("b_in_stock").unwrap(), 31);
    assert_eq!(after[0].get_i64("bv_refund").unwrap(), 5);
    env.cleanup().await;
}

/// A run that was killed and never finished (issue 73, item 12): its row
/// shows its state (`killed`) in the JSON, the CSV and the table, which
/// says it is not finished instead of "ties out"; stderr says what
/// finishes it. A finished run beside it still ties out.
#[tokio::test]
async fn a_killed_run_shows_its_state_and_is_never_said_to_tie_out() {
    let env = TestEnv::new("statement_killed").await;
    let done = import(&env, "sk", "done.csv", "code\nDONE-1\nDONE-2\n").await;
    // What `kill -9` leaves: a record that says running, held by no
    // process, and the codes it put in.
    let killed = env
        .store
        .start_import("sk", "partner.csv", None)
        .await
        .unwrap();
    let codes: Vec<codepool_store::NewCode> = (0..5)
        .map(|i| codepool_store::NewCode {
            code: format!("KILLED-{i}"),
            expires_at: None,
            line: Some(i + 2),
        })
        .collect();
    env.store
        .insert_codes("sk", killed.id, &codes)
        .await
        .unwrap();
    let killed = killed.id.to_hex();

    let (rc, out, err) = statement(&env, &["--pool", "sk", "--json"]).await;
    assert_eq!(rc, 0, "{err}");
    let s: Value = serde_json::from_str(&out).unwrap();
    let rows = by_import(&s);
    assert_eq!(rows[&killed]["run"], "killed", "{s}");
    assert_eq!(rows[&killed]["finished"], false, "{s}");
    assert_eq!(rows[&killed]["received"], 5, "{s}");
    assert_eq!(rows[&done]["run"], "done", "{s}");
    assert_eq!(rows[&done]["finished"], true, "{s}");
    assert_eq!(s["total"]["finished"], false, "{s}");
    assert!(
        err.contains(&killed) && err.contains("never finished"),
        "stderr names the run: {err}"
    );

    let (rc, table, _) = statement(&env, &["--pool", "sk"]).await;
    assert_eq!(rc, 0);
    let line = |id: &str| {
        table
            .lines()
            .find(|l| l.starts_with(id))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(line(&killed).contains("killed: not finished"), "{table}");
    assert!(!line(&killed).contains("ties out"), "{table}");
    assert!(line(&done).contains("ties out"), "{table}");

    let (rc, csv, _) = statement(&env, &["--pool", "sk", "--csv"]).await;
    assert_eq!(rc, 0);
    let killed_line = csv.lines().find(|l| l.starts_with(&killed)).unwrap();
    assert!(killed_line.split(',').any(|c| c == "killed"), "{csv}");
    env.cleanup().await;
}
