//! `codepool generate` on the real servers: generated codes are codes like
//! any other (sealed, keyed by HMAC, never a duplicate of any pool), a run
//! finishes by its id after a `kill -9` with exactly its count, the check
//! symbol catches what it promises (checked against the independent
//! `base32-crockford` Python package), weak patterns are refused, and the
//! API starts and reads a run.

use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use codepool_store::ObjectId;
use futures::TryStreamExt;

use crate::api::{http, key};
use crate::common::*;
use crate::fixtures::*;

/// Runs `codepool generate … --json`; panics unless it exits 0. Returns
/// the summary: the last of its JSON lines (the first names the run
/// before any code is made).
async fn generate(env: &TestEnv, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["generate", "--json"];
    all.extend_from_slice(args);
    let out = codepool_ok(env, &all).await;
    let last = out.lines().last().unwrap_or_default();
    serde_json::from_str(last).expect("a JSON summary")
}

/// The plaintext codes of run `run`, opened with the test's keys.
async fn codes_of_run(env: &TestEnv, run: ObjectId) -> Vec<String> {
    let docs: Vec<bson::Document> = find_docs(env, "codes", doc! {"batch_id": run}).await;
    docs.iter().map(|d| env.plain_code(d)).collect()
}

/// `codepool generate` of `count` codes into `pool` as the run `id`, in
/// batches of `batch`.
fn run_args<'a>(pool: &'a str, count: &'a str, id: &'a str, batch: &'a str) -> Vec<&'a str> {
    let what = ["generate", "--pool", pool, "--count", count];
    [&what[..], &["--run-id", id, "--batch-size", batch]].concat()
}

fn codes(env: &TestEnv) -> mongodb::Collection<bson::Document> {
    env.store.database().collection("codes")
}

/// The issue's size: 200,000 codes generated into a pool of 100,000.
const IMPORTED: usize = 100_000;
const GENERATED: usize = 200_000;

#[tokio::test(flavor = "multi_thread")]
async fn generated_codes_join_an_imported_pool_unique_sealed_and_found_by_hmac() {
    let env = TestEnv::new("gen_into_imported").await;
    let imported = env.fill_pool("gx", IMPORTED).await;
    env.fill_pool("other", 10).await;
    let out = generate(
        &env,
        &[
            "--pool",
            "gx",
            "--count",
            &GENERATED.to_string(),
            "--pattern",
            "GX-{random:12}",
        ],
    )
    .await;
    assert_eq!(out["status"], "done");
    assert_eq!(out["inserted"], GENERATED);
    assert_eq!(out["random_bits"], 60);
    let run = ObjectId::parse_str(out["run_id"].as_str().unwrap()).unwrap();

    assert_eq!(
        codes(&env)
            .count_documents(doc! {"pool": "gx"})
            .await
            .unwrap(),
        (IMPORTED + GENERATED) as u64
    );
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"code": {"$exists": true}})
            .await
            .unwrap(),
        0,
        "no code is stored in plaintext"
    );
    let generated = codes_of_run(&env, run).await;
    assert_eq!(generated.len(), GENERATED);
    let distinct: HashSet<&String> = generated.iter().chain(&imported).collect();
    assert_eq!(
        distinct.len(),
        IMPORTED + GENERATED,
        "no generated code equals another"
    );
    let alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    for c in &generated {
        let random = c.strip_prefix("GX-").expect("the fixed text");
        assert!(
            random.len() == 12 && random.chars().all(|s| alphabet.contains(s)),
            "{c}"
        );
    }

    // Every generated code is found by its keyed hash, as a lookup finds it.
    let ring = env.store.keys().ring().unwrap();
    let mut found = 0;
    for chunk in generated.chunks(1000) {
        let hmacs: Vec<bson::Bson> = chunk
            .iter()
            .map(|c| {
                bson::Bson::Binary(bson::Binary {
                    subtype: bson::spec::BinarySubtype::Generic,
                    bytes: ring.code_hmac("gx", c).to_vec(),
                })
            })
            .collect();
        found += codes(&env)
            .count_documents(doc! {"pool": "gx", "code_hmac": {"$in": hmacs}, "batch_id": run})
            .await
            .unwrap();
    }
    assert_eq!(found as usize, GENERATED);

    // The run is an import: its record says so, and export gives the file
    // for the platform, every code in clear text.
    let record = env.store.import_record(run).await.unwrap().unwrap();
    assert_eq!(record.source.as_deref(), Some("generated"));
    assert_eq!(
        (record.status.as_str(), record.inserted as usize),
        ("done", GENERATED)
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("platform.csv");
    let id = run.to_hex();
    codepool_ok(
        &env,
        &[
            "export",
            "--import",
            &id,
            "--reveal",
            "--out",
            file.to_str().unwrap(),
        ],
    )
    .await;
    let mut reader = csv::Reader::from_path(&file).unwrap();
    let exported: HashSet<String> = reader.records().map(|r| r.unwrap()[1].to_owned()).collect();
    assert_eq!(exported, generated.iter().cloned().collect::<HashSet<_>>());
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_killed_halfway_and_run_again_ends_with_exactly_its_count() {
    let env = TestEnv::new("gen_killed").await;
    let run = ObjectId::new();
    let id = run.to_hex();
    let args = run_args("gx", "20000", &id, "500");
    let mut child = env.command(&args).spawn().unwrap();
    let of_run = doc! {"batch_id": run};
    eventually(
        Duration::from_secs(120),
        "the run's first codes land",
        || {
            let c = codes(&env);
            let f = of_run.clone();
            async move { c.count_documents(f).await.unwrap() > 0 }
        },
    )
    .await;
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    // An insert the process sent before it died may still be landing (a
    // run keeps three in flight): count once the count holds still.
    let mut at_kill = codes(&env).count_documents(of_run.clone()).await.unwrap();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = codes(&env).count_documents(of_run.clone()).await.unwrap();
        if now == at_kill {
            break;
        }
        at_kill = now;
    }
    assert!(at_kill > 0 && at_kill < 20_000, "killed halfway: {at_kill}");
    let record = env.store.import_record(run).await.unwrap().unwrap();
    assert_eq!(
        record.status,
        codepool_store::imports::RunState::Running,
        "the killed run never closed its record"
    );

    let out = generate(&env, &args[1..]).await;
    assert_eq!(out["inserted"], 20_000);
    assert_eq!(out["inserted_now"], 20_000 - at_kill);
    assert_eq!(
        codes(&env).count_documents(of_run.clone()).await.unwrap(),
        20_000
    );

    let again = generate(&env, &args[1..]).await;
    assert_eq!(
        again["inserted_now"], 0,
        "a finished run makes nothing more"
    );
    assert_eq!(
        codes(&env).count_documents(of_run.clone()).await.unwrap(),
        20_000
    );

    // The same id for another count is another run: refused.
    let other = env
        .run(&[
            "generate", "--pool", "gx", "--count", "30000", "--run-id", &id,
        ])
        .await;
    assert_eq!(other.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&other.stderr).contains("makes 20000 codes"));
    assert_eq!(codes(&env).count_documents(of_run).await.unwrap(), 20_000);
    env.cleanup().await;
}

/// Which of `codes` the `base32-crockford` package accepts with their check
/// symbol (`decode(code, checksum=True)` raises on a wrong one).
async fn accepted_by_the_python_library(codes: &[String]) -> Vec<bool> {
    let script = r#"
import json, sys
import base32_crockford
out = []
for code in json.load(sys.stdin):
    try:
        base32_crockford.decode(code, checksum=True)
        out.append(True)
    except ValueError:
        out.append(False)
print(json.dumps(out))
"#;
    let input = serde_json::to_string(codes).unwrap();
    let out = with_stdin(&mut python(script, &[]), input.as_bytes()).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every code one symbol away from `code`, and every code with two
/// neighbouring symbols (hyphens ignored) swapped.
fn one_slip_away(code: &str) -> Vec<String> {
    let symbols = "0123456789ABCDEFGHJKMNPQRSTVWXYZ*~$=U";
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let at: Vec<usize> = (0..chars.len()).filter(|&i| chars[i] != '-').collect();
    for &i in &at {
        for s in symbols.chars().filter(|&s| s != chars[i]) {
            let mut c = chars.clone();
            c[i] = s;
            out.push(c.into_iter().collect());
        }
    }
    for w in at.windows(2) {
        if chars[w[0]] != chars[w[1]] {
            let mut c = chars.clone();
            c.swap(w[0], w[1]);
            out.push(c.into_iter().collect());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_check_symbol_catches_every_single_change_and_every_swap_of_neighbours() {
    let env = TestEnv::new("gen_check").await;
    let out = generate(
        &env,
        &[
            "--pool",
            "gx",
            "--count",
            "40",
            "--check-char",
            "--pattern",
            "GX-{random:4}-{random:4}-{random:4}",
        ],
    )
    .await;
    assert_eq!(out["pattern"], "GX-{random:4}-{random:4}-{random:4}{check}");
    let run = ObjectId::parse_str(out["run_id"].as_str().unwrap()).unwrap();
    let generated = codes_of_run(&env, run).await;
    assert_eq!(generated.len(), 40);
    assert!(
        accepted_by_the_python_library(&generated)
            .await
            .iter()
            .all(|ok| *ok),
        "the library accepts every generated code: {generated:?}"
    );
    let slips: Vec<String> = generated.iter().flat_map(|c| one_slip_away(c)).collect();
    assert!(slips.len() > 40 * 14 * 31);
    for slip in &slips {
        assert!(
            !codepool_domain::crockford::check_ok(slip),
            "check_ok passes {slip}"
        );
    }
    let verdicts = accepted_by_the_python_library(&slips).await;
    let missed: Vec<&String> = slips
        .iter()
        .zip(&verdicts)
        .filter(|(_, ok)| **ok)
        .map(|(s, _)| s)
        .collect();
    assert!(missed.is_empty(), "the library accepts slips: {missed:?}");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pattern_under_forty_random_bits_is_refused_and_nothing_is_written() {
    let env = TestEnv::new("gen_weak").await;
    let out = env
        .run(&[
            "generate",
            "--pool",
            "gx",
            "--count",
            "10",
            "--pattern",
            "GX-{random:7}",
        ])
        .await;
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("35 random bits") && err.contains("at least 40"),
        "{err}"
    );
    assert!(err.contains("nothing was generated"), "{err}");
    let db = env.store.database();
    assert_eq!(codes(&env).count_documents(doc! {}).await.unwrap(), 0);
    let imports = db.collection::<bson::Document>("imports");
    assert_eq!(
        imports.count_documents(doc! {}).await.unwrap(),
        0,
        "no run record"
    );
    let pools = db.collection::<bson::Document>("pools");
    assert_eq!(pools.count_documents(doc! {}).await.unwrap(), 0, "no pool");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_starts_a_run_and_reads_it() {
    let env = TestEnv::new("gen_api").await;
    let admin = key(&env, "gen-admin", "admin").await;
    let (api, orders) = api_with_key(&env, "gen-orders", "orders:write").await;
    let body = br#"{"count":500,"pattern":"GX-{random:12}","check_char":true}"#;
    let path = "/v1/pools/gx/generations";
    let (status, _, _) = api.post(path, &orders, body).await;
    assert_eq!(status, 403, "the admin scope only");
    let weak = br#"{"count":5,"pattern":"GX-{random:4}"}"#;
    let (status, _, answer) = api.post(path, &admin, weak).await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&answer));

    let (status, _, answer) = api.post(path, &admin, body).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&answer));
    let started: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    let id = started["run_id"].as_str().unwrap().to_owned();
    let run_path = format!("/v1/generations/{id}");
    let mut done = serde_json::Value::Null;
    for _ in 0..600 {
        let (status, _, answer) = api.get(&run_path, &admin).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        done = serde_json::from_slice(&answer).unwrap();
        if done["status"] == "done" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(done["inserted"], 500);
    assert_eq!(done["count"], 500);
    assert_eq!(done["pool"], "gx");
    assert_eq!(done["check_char"], true);
    assert_eq!(done["pattern"], "GX-{random:12}{check}");
    let run = ObjectId::parse_str(&id).unwrap();
    let made = codes_of_run(&env, run).await;
    assert_eq!(made.len(), 500);
    assert!(made.iter().all(|c| codepool_domain::crockford::check_ok(c)));
    let (status, _, _) = api
        .get("/v1/generations/0123456789abcdef01234567", &admin)
        .await;
    assert_eq!(status, 404);
    api.stop().await;
    env.cleanup().await;
}

/// The lookups of a code by value (a find by its keyed hashes, as
/// `Store::find_by_value` makes it) MongoDB's profiler saw on this test's
/// `codes` since `t`. Background work (the relay, the stock sweep) reads
/// `codes` too, by other filters: those are not counted.
async fn lookups_by_value_since(env: &TestEnv, t: bson::DateTime) -> usize {
    let profile = env
        .store
        .database()
        .collection::<bson::Document>("system.profile");
    let ns = format!("{}.codes", env.db);
    let seen: Vec<bson::Document> = profile
        .find(doc! {"ns": ns, "ts": {"$gte": t}})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    seen.iter()
        .filter(|d| {
            let filter = d
                .get_document("command")
                .and_then(|c| c.get_document("filter"));
            filter.is_ok_and(|f| f.to_string().contains("code_any_hmac"))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_code_failing_its_check_is_refused_like_an_unknown_code_before_any_lookup() {
    let env = TestEnv::new("gen_redeem_check").await;
    let out = generate(
        &env,
        &[
            "--pool",
            "gc",
            "--count",
            "50",
            "--pattern",
            "GC-{random:12}",
            "--check-char",
        ],
    )
    .await;
    assert_eq!(out["inserted"], 50);
    let pool = env.store.pool("gc").await.unwrap().unwrap();
    assert!(
        pool.check_symbols,
        "every code of the pool carries a check symbol"
    );
    let shop = key(&env, "gen-shop", "orders:write").await;
    let (api, platform) = api_with_key(&env, "gen-platform", "codes:redeem").await;
    let order = br#"{"order_id":"O-1","uid":"u1","phone":"+8613800000000","pool":"gc"}"#;
    let (status, _, _) = api.post("/v1/orders", &shop, order).await;
    assert_eq!(status, 201);
    let issued = codes(&env)
        .find_one(doc! {"pool": "gc", "order_id": "O-1"})
        .await
        .unwrap()
        .unwrap();
    let code = env.plain_code(&issued);
    let ask = |c: &str| serde_json::json!({"code": c}).to_string().into_bytes();
    let (status, _, _) = api.post("/v1/codes/check", &platform, &ask(&code)).await;
    assert_eq!(status, 200, "the issued code, as printed");

    // One symbol changed: the check fails.
    let mut slip: Vec<char> = code.chars().collect();
    slip[4] = if slip[4] == '7' { '8' } else { '7' };
    let slip: String = slip.into_iter().collect();
    assert!(!codepool_domain::crockford::check_ok(&slip));
    // A code that passes the check but does not exist.
    let body = "GC-0123456789AB";
    let unknown = format!(
        "{body}{}",
        codepool_domain::crockford::check_symbol(body).unwrap()
    );

    let db = env.store.database();
    db.run_command(doc! {"profile": 2}).await.unwrap();
    let t = bson::DateTime::now();
    let (status, _, refused) = api.post("/v1/codes/check", &platform, &ask(&slip)).await;
    assert_eq!(status, 404);
    assert_eq!(
        lookups_by_value_since(&env, t).await,
        0,
        "no lookup for a code failing its check"
    );
    let t = bson::DateTime::now();
    let (status, _, missing) = api.post("/v1/codes/check", &platform, &ask(&unknown)).await;
    assert_eq!(status, 404);
    assert!(
        lookups_by_value_since(&env, t).await > 0,
        "the profiler sees a lookup"
    );
    db.run_command(doc! {"profile": 0}).await.unwrap();
    let problem = |b: &[u8]| {
        let mut v: serde_json::Value = serde_json::from_slice(b).unwrap();
        v.as_object_mut()
            .unwrap()
            .retain(|k, _| k != "instance" && k != "request_id");
        v
    };
    assert_eq!(
        problem(&refused),
        problem(&missing),
        "the same answer as an unknown code"
    );

    // A file's codes in the pool end the promise: no code is refused unlooked.
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("plain.csv");
    std::fs::write(&csv, "code\nPLAIN-CODE-0001\n").unwrap();
    codepool_ok(&env, &["import", csv.to_str().unwrap(), "--pool", "gc"]).await;
    assert!(!env.store.pool("gc").await.unwrap().unwrap().check_symbols);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn daily_numbers_number_the_codes_and_a_run_is_recalled_like_an_import() {
    let env = TestEnv::new("gen_number").await;
    let out = generate(
        &env,
        &[
            "--pool",
            "gn",
            "--count",
            "30",
            "--pattern",
            "GN-{number}-{random:8}",
        ],
    )
    .await;
    let id = out["run_id"].as_str().unwrap().to_owned();
    let made = codes_of_run(&env, ObjectId::parse_str(&id).unwrap()).await;
    let today = chrono::Utc::now().format("%Y%m%d").to_string();
    let numbers: HashSet<&str> = made.iter().map(|c| c.split('-').nth(1).unwrap()).collect();
    assert_eq!(numbers.len(), 30, "one number a code: {made:?}");
    assert!(
        numbers
            .iter()
            .all(|n| n.starts_with(&today) && n.len() >= 12),
        "{numbers:?}"
    );

    let recalled = codepool_ok(
        &env,
        &["void", "--import", &id, "--reason", "test recall", "--json"],
    )
    .await;
    let recalled: serde_json::Value = serde_json::from_str(&recalled).unwrap();
    assert_eq!(recalled["voided"], 30, "{recalled}");
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"pool": "gn", "status": 3})
            .await
            .unwrap(),
        30
    );
    env.cleanup().await;
}

/// Bytes for `P-{random:8}` codes `P-0000000X`, X from `values` in turn
/// (then 31 forever): chosen collisions.
fn chosen(values: Vec<u8>) -> codepool_importer::ByteSource {
    let next = std::sync::Mutex::new(values.into_iter());
    codepool_importer::ByteSource::Chosen(std::sync::Arc::new(move |bytes: &mut [u8]| {
        for code in bytes.chunks_mut(8) {
            code.fill(0);
            code[7] = next.lock().unwrap().next().unwrap_or(31);
        }
    }))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_collision_is_drawn_again_until_the_run_holds_its_count() {
    use codepool_importer::{generate, GenerateError, GenerateOptions, Generation};
    let env = TestEnv::new("gen_collide").await;
    let new = |code: &str| codepool_store::NewCode {
        code: code.into(),
        expires_at: None,
        line: None,
    };
    let store = &env.store;
    store
        .insert_codes("p", ObjectId::new(), &[new("P-00000000")])
        .await
        .unwrap();
    store
        .insert_codes("q", ObjectId::new(), &[new("P-00000001")])
        .await
        .unwrap();
    // A look-alike of a code of the pool (case folded).
    store
        .insert_codes("p", ObjectId::new(), &[new("p-0000000a")])
        .await
        .unwrap();
    // A look-alike of a code of another pool (issue 73, item 2).
    store
        .insert_codes("q", ObjectId::new(), &[new("p-00000006")])
        .await
        .unwrap();
    let g = Generation {
        pool: "p".into(),
        count: 4,
        pattern: codepool_domain::CodePattern::parse("P-{random:8}", false).unwrap(),
        expires_at: None,
        run_id: None,
    };
    // 0: in the pool; 1: in another pool; 10 (A): a look-alike; 2 lands;
    // 6: a look-alike of another pool's code; then 3, 4, 5 land.
    let options = GenerateOptions {
        batch_size: 5,
        random: chosen(vec![0, 1, 10, 2, 6, 3, 4, 5]),
        ..GenerateOptions::default()
    };
    let s = generate(store, None, &g, &options, &|_| {}).await.unwrap();
    assert_eq!((s.inserted, s.redrawn, s.status.as_str()), (4, 4, "done"));
    let run = ObjectId::parse_str(&s.run_id).unwrap();
    let mut made = codes_of_run(&env, run).await;
    made.sort();
    assert_eq!(
        made,
        ["P-00000002", "P-00000003", "P-00000004", "P-00000005"]
    );

    // A pattern whose draws only ever collide stops, saying so.
    let stuck = GenerateOptions {
        random: chosen(vec![]),
        ..GenerateOptions::default()
    };
    let g = Generation {
        count: 3,
        run_id: None,
        ..g
    };
    let err = generate(store, None, &g, &stuck, &|_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, GenerateError::Exhausted(_)), "{err}");
    env.cleanup().await;
}

/// A killed `codepool generate --json` (issue 73, item 4): its first line
/// named the run before any code was made, and the same command again
/// takes that run up (as an import takes up its file) instead of making a
/// second full run; `--new-run` makes a second one on purpose, and a run
/// another process is making now is not taken from under it.
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_json_run_named_itself_first_and_the_same_command_finishes_it() {
    let env = TestEnv::new("gen_json_killed").await;
    let args = ["--pool", "gj", "--count", "20000", "--batch-size", "500"];
    let all = [&["generate", "--json"][..], &args[..]].concat();
    let mut child = env
        .command(&all)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let in_pool = doc! {"pool": "gj"};
    eventually(
        Duration::from_secs(120),
        "the run's first codes land",
        || {
            let (c, f) = (codes(&env), in_pool.clone());
            async move { c.count_documents(f).await.unwrap() > 0 }
        },
    )
    .await;
    child.start_kill().unwrap(); // SIGKILL
    let out = child.wait_with_output().await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text
        .lines()
        .next()
        .expect("the run id is printed before any code");
    let first: serde_json::Value = serde_json::from_str(first).unwrap();
    assert_eq!(first["status"], "running", "{first}");
    let run = ObjectId::parse_str(first["run_id"].as_str().unwrap()).unwrap();
    let mut made = codes(&env).count_documents(in_pool.clone()).await.unwrap();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = codes(&env).count_documents(in_pool.clone()).await.unwrap();
        if now == made {
            break;
        }
        made = now;
    }
    assert!(made > 0 && made < 20_000, "killed halfway: {made}");
    // The dead process's lease is made to have lapsed (it would in 20 s).
    env.coll("imports")
        .update_one(
            doc! {"_id": run},
            doc! {"$set": {"lease_until": bson::DateTime::from_millis(0)}},
        )
        .await
        .unwrap();

    let again = generate(&env, &args).await;
    assert_eq!(
        again["run_id"],
        run.to_hex(),
        "the same run, taken up: {again}"
    );
    assert_eq!(again["inserted"], 20_000);
    assert_eq!(again["inserted_now"], 20_000 - made);
    assert_eq!(
        codes(&env).count_documents(in_pool.clone()).await.unwrap(),
        20_000,
        "one run's codes, not a second run's"
    );

    // An unfinished run of another count is another run; one of the same
    // count is taken up unless --new-run says otherwise.
    let small = ["--pool", "gj", "--count", "30"];
    let unfinished = codepool_importer::Generation {
        pool: "gj".into(),
        count: 30,
        pattern: codepool_domain::CodePattern::parse(
            codepool_domain::pattern::DEFAULT_PATTERN,
            false,
        )
        .unwrap(),
        expires_at: None,
        run_id: Some(ObjectId::new()),
    };
    codepool_importer::generate::open_run(&env.store, &unfinished)
        .await
        .unwrap();
    let left = unfinished.run_id.unwrap();
    // Being made by another process now: refused, nothing made.
    env.coll("imports")
        .update_one(
            doc! {"_id": left},
            doc! {"$set": {"lease_owner": "elsewhere", "lease_until": bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + 60_000)}},
        )
        .await
        .unwrap();
    let busy = env.run(&[&["generate"][..], &small[..]].concat()).await;
    let err = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(busy.status.code(), Some(1), "{err}");
    // Its process may have died a moment ago: the way out it names is the
    // run's own id (which waits for the lease), not a second run.
    assert!(
        err.contains(&format!("--run-id {}", left.to_hex())),
        "{err}"
    );
    let second = generate(&env, &[&small[..], &["--new-run"][..]].concat()).await;
    assert_ne!(second["run_id"], left.to_hex(), "{second}");
    assert_eq!(second["inserted"], 30);
    env.coll("imports")
        .update_one(
            doc! {"_id": left},
            doc! {"$unset": {"lease_owner": "", "lease_until": ""}},
        )
        .await
        .unwrap();
    let taken = generate(&env, &small).await;
    assert_eq!(taken["run_id"], left.to_hex(), "{taken}");
    assert_eq!(codes(&env).count_documents(in_pool).await.unwrap(), 20_060);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn one_run_id_sent_at_once_by_the_api_and_two_commands_makes_its_count_once() {
    let env = TestEnv::new("gen_once").await;
    let (api, admin) = api_with_key(&env, "gen-admin", "admin").await;
    let run = ObjectId::new();
    let body = json_body(&run, 20_000);
    let path = "/v1/pools/gw/generations";
    let posts = (0..3).map(|_| http(&api.addr, "POST", path, Some(&admin), &body));
    for (status, _, answer) in futures::future::join_all(posts).await {
        assert_eq!(status, 202, "{}", String::from_utf8_lossy(&answer));
    }
    let (status, _, _) = api.post(path, &admin, &body).await;
    assert_eq!(status, 202, "a retry is answered as the first");
    let of_run = doc! {"batch_id": run};
    let imports = env.coll("imports");
    eventually(
        Duration::from_secs(180),
        "the run done, its lease given up",
        || {
            let imports = imports.clone();
            async move {
                let r = imports.find_one(doc! {"_id": run}).await.unwrap().unwrap();
                r.get_str("status") == Ok("done") && !r.contains_key("lease_owner")
            }
        },
    )
    .await;
    assert_eq!(
        codes(&env).count_documents(of_run.clone()).await.unwrap(),
        20_000,
        "four requests of one run make its count once"
    );
    api.stop().await;

    // Two commands with one run id at once: one makes the codes; the other
    // waits for it, or says another process is making them.
    let run = ObjectId::new();
    let id = run.to_hex();
    let args = run_args("gv", "20000", &id, "500");
    let (a, b) = tokio::join!(env.command(&args).output(), env.command(&args).output());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(a.status.success() || b.status.success());
    for out in [&a, &b] {
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("being made by another process"), "{err}");
        }
    }
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"batch_id": run})
            .await
            .unwrap(),
        20_000
    );
    let past = env
        .run(&[
            "generate",
            "--pool",
            "gv",
            "--count",
            "5",
            "--expires-at",
            "2000-01-01T00:00:00Z",
        ])
        .await;
    assert_eq!(past.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&past.stderr).contains("not in the future"));
    env.cleanup().await;
}

/// The API's generation without a run id (a retry after the process that
/// made it died, or a console form sent again) takes up the unfinished
/// run of the same pool, pattern and count, as `codepool generate` does,
/// instead of making a second full run; `new_run` asks for a second one.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_takes_up_an_unfinished_run_of_the_same_kind_instead_of_a_second() {
    let env = TestEnv::new("gen_api_take_up").await;
    let (api, admin) = api_with_key(&env, "gen-admin", "admin").await;
    let unfinished = codepool_importer::Generation {
        pool: "gu".into(),
        count: 30,
        pattern: codepool_domain::CodePattern::parse("GU-{random:12}", false).unwrap(),
        expires_at: None,
        run_id: Some(ObjectId::new()),
    };
    codepool_importer::generate::open_run(&env.store, &unfinished)
        .await
        .unwrap();
    let left = unfinished.run_id.unwrap();
    let path = "/v1/pools/gu/generations";
    let body = br#"{"count":30,"pattern":"GU-{random:12}"}"#;
    let (status, _, answer) = api.post(path, &admin, body).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&answer));
    let started: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(started["run_id"], left.to_hex(), "taken up: {started}");
    assert_eq!(started["resumed"], true, "{started}");
    let imports = env.coll("imports");
    let done = |id: ObjectId| {
        let imports = imports.clone();
        async move {
            let r = imports.find_one(doc! {"_id": id}).await.unwrap().unwrap();
            r.get_str("status") == Ok("done") && !r.contains_key("lease_owner")
        }
    };
    eventually(Duration::from_secs(60), "the run done", || done(left)).await;
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"pool": "gu"})
            .await
            .unwrap(),
        30,
        "one run's codes, not a second run's"
    );
    let both = br#"{"count":30,"pattern":"GU-{random:12}","new_run":true,"run_id":"0123456789abcdef01234567"}"#;
    let (status, _, _) = api.post(path, &admin, both).await;
    assert_eq!(status, 422, "a run id or a new run, not both");
    let second = br#"{"count":30,"pattern":"GU-{random:12}","new_run":true}"#;
    let (status, _, answer) = api.post(path, &admin, second).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&answer));
    let started: serde_json::Value = serde_json::from_slice(&answer).unwrap();
    assert_ne!(started["run_id"], left.to_hex(), "{started}");
    assert_eq!(started["resumed"], false, "{started}");
    let id = ObjectId::parse_str(started["run_id"].as_str().unwrap()).unwrap();
    eventually(Duration::from_secs(60), "the second run done", || done(id)).await;
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"pool": "gu"})
            .await
            .unwrap(),
        60
    );
    api.stop().await;
    env.cleanup().await;
}

/// A run's export is the platform's file of the codes it must honour: a
/// code held by a checkout is in it (the hold is paid within minutes and
/// the buyer gets that code), while an export of the pool still shows no
/// held code.
#[tokio::test(flavor = "multi_thread")]
async fn a_runs_export_for_the_platform_lists_its_held_codes_too() {
    let env = TestEnv::new("gen_export_held").await;
    let run = ObjectId::new();
    let id = run.to_hex();
    codepool_ok(&env, &run_args("gh", "20", &id, "1000")).await;
    pool_set(&env, "gh", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let hold = br#"{"hold_id":"cart-1","uid":"buyer-1","items":[{"pool":"gh","quantity":5}]}"#;
    let (status, _, answer) = api.post("/v1/holds", &k, hold).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&answer));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("platform.csv");
    let path = file.to_str().unwrap();
    codepool_ok(
        &env,
        &["export", "--import", &id, "--reveal", "--out", path],
    )
    .await;
    let mut reader = csv::Reader::from_path(&file).unwrap();
    let rows: Vec<(String, String)> = (reader.records())
        .map(|r| {
            let r = r.unwrap();
            (r[1].to_owned(), r[2].to_owned())
        })
        .collect();
    let exported: HashSet<String> = rows.iter().map(|(c, _)| c.clone()).collect();
    let made: HashSet<String> = codes_of_run(&env, run).await.into_iter().collect();
    assert_eq!(exported, made, "every code of the run, held ones too");
    assert_eq!(rows.iter().filter(|(_, s)| s == "held").count(), 5);
    // An export of the pool shows no held code, as before.
    let file = dir.path().join("pool.csv");
    let path = file.to_str().unwrap();
    codepool_ok(
        &env,
        &[
            "export",
            "--pool",
            "gh",
            "--status",
            "held,unissued",
            "--reveal",
            "--out",
            path,
        ],
    )
    .await;
    let pool_rows = csv::Reader::from_path(&file).unwrap().records().count();
    assert_eq!(pool_rows, 15, "the pool's export leaves the held codes out");
    api.stop().await;
    env.cleanup().await;
}

fn json_body(run: &ObjectId, count: u64) -> Vec<u8> {
    serde_json::json!({"count": count, "pattern": "GW-{random:12}", "run_id": run.to_hex()})
        .to_string()
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_still_making_codes_is_not_recalled_under_it() {
    let env = TestEnv::new("gen_recall_running").await;
    let run = ObjectId::new();
    let id = run.to_hex();
    let args = run_args("gr", "200000", &id, "200");
    let mut child = env.command(&args).spawn().unwrap();
    eventually(
        Duration::from_secs(120),
        "the run's first codes land",
        || {
            let c = codes(&env);
            async move { c.count_documents(doc! {"batch_id": run}).await.unwrap() > 0 }
        },
    )
    .await;
    let out = env
        .run(&["void", "--import", &id, "--reason", "leak"])
        .await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("still inserting codes"), "{err}");
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"batch_id": run, "status": 3})
            .await
            .unwrap(),
        0
    );
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    // Killed: its lease lapses, and the recall goes through.
    eventually(
        Duration::from_secs(60),
        "the dead run's lease lapses",
        || async {
            let r = env.store.import_record(run).await.unwrap().unwrap();
            !r.being_made()
        },
    )
    .await;
    codepool_ok(&env, &["void", "--import", &id, "--reason", "leak"]).await;
    assert_eq!(
        codes(&env)
            .count_documents(doc! {"batch_id": run, "status": 0})
            .await
            .unwrap(),
        0
    );
    env.cleanup().await;
}
