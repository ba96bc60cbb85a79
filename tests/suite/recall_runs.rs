//! A recall covers every run of the leaked file (issue 54, item 1): a run
//! stopped by SIGINT, then a run killed with `kill -9`, then a run to the
//! end. Runs are chained when they start, so the killed run links the
//! first to the last; a run the recall cannot link or prove to be another
//! file is named, and the exit code says the recall is partial. Recalling
//! a re-import voids every run of the file; recalling a run without codes
//! names the runs that hold them.

use std::time::Duration;

use bson::doc;
use bson::oid::ObjectId;
use codepool_store::NewCode;
use serde_json::Value;

use crate::common::*;
use crate::fixtures::*;

const CODES: usize = 60_000;

/// The newest run of the pool once it has inserted some codes.
async fn running_run(env: &TestEnv, pool: &str, not: &[ObjectId]) -> ObjectId {
    let imports = env.coll("imports");
    let started = std::time::Instant::now();
    loop {
        let d = imports
            .find_one(doc! {"pool": pool, "_id": {"$nin": not}, "inserted": {"$gt": 0}})
            .await
            .unwrap();
        if let Some(id) = d.and_then(|d| d.get_object_id("_id").ok()) {
            return id;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the run never recorded codes inserted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts `codepool import FILE --pool POOL`, waits until its run has
/// inserted codes, and stops it with `signal`. Returns the run's id.
async fn stopped_run(
    env: &TestEnv,
    file: &str,
    pool: &str,
    signal: &str,
    not: &[ObjectId],
) -> ObjectId {
    let mut child = env
        .command(&["import", file, "--pool", pool])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let id = running_run(env, pool, not).await;
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap();
    let _ = child.wait().await;
    id
}

#[tokio::test]
async fn a_recall_covers_an_interrupted_run_a_killed_run_and_the_run_that_finished() {
    let env = TestEnv::new("recall_runs").await;
    let file = tempfile::NamedTempFile::new().unwrap();
    let mut text = String::from("code\n");
    for i in 0..CODES {
        text.push_str(&format!("RC-{i:08}\n"));
    }
    std::fs::write(file.path(), text).unwrap();
    let path = file.path().to_str().unwrap();
    let first = stopped_run(&env, path, "rc", "-INT", &[]).await;
    let second = stopped_run(&env, path, "rc", "-KILL", &[first]).await;
    let out = codepool_ok(&env, &["import", path, "--pool", "rc", "--json"]).await;
    let third: Value = serde_json::from_str(&out).unwrap();
    let third_id = third["import_id"].as_str().unwrap().to_owned();
    assert_eq!(
        count_codes(&env, doc! {"pool": "rc"}).await,
        CODES as u64,
        "three runs, one file"
    );
    // The killed run's lease holds a recall off until it lapses (20 s, as
    // `generate::a_run_still_making_codes_is_not_recalled_under_it` waits
    // out); here it is made to have lapsed.
    env.coll("imports")
        .update_one(
            doc! {"_id": second},
            doc! {"$set": {"lease_until": bson::DateTime::from_millis(0)}},
        )
        .await
        .unwrap();
    let out = codepool_ok(
        &env,
        &["void", "--import", &third_id, "--reason", "leak", "--json"],
    )
    .await;
    let r: Value = serde_json::from_str(&out).unwrap();
    let runs: Vec<&str> = (r["runs"].as_array().unwrap().iter())
        .map(|run| run["import_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        runs,
        [first.to_hex().as_str(), second.to_hex().as_str(), &third_id],
        "{r}"
    );
    assert_eq!(r["voided"], CODES, "{r}");
    assert_eq!(count_codes(&env, doc! {"pool": "rc", "status": 0}).await, 0);
    env.cleanup().await;
}

#[tokio::test]
async fn a_run_the_recall_cannot_link_is_named_and_the_exit_code_says_partial() {
    let env = TestEnv::new("recall_left").await;
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "code\nLEFT-0001\nLEFT-0002\n").unwrap();
    let name = file.path().display().to_string();
    // A run of a file of that name that never finished and names no
    // earlier run (what an older version's killed run left).
    let orphan = env.store.start_import("lf", &name, None).await.unwrap();
    env.store.ensure_pool("lf").await.unwrap();
    let codes = vec![NewCode {
        code: "ORPHAN-0001".into(),
        expires_at: None,
        line: Some(2),
    }];
    env.store
        .insert_codes("lf", orphan.id, &codes)
        .await
        .unwrap();
    // A later run that started, inserted nothing and named no run either:
    // the import that finishes the file chains to it, not to the orphan.
    env.store.start_import("lf", &name, None).await.unwrap();
    let out = codepool_ok(
        &env,
        &[
            "import",
            file.path().to_str().unwrap(),
            "--pool",
            "lf",
            "--json",
        ],
    )
    .await;
    let done: Value = serde_json::from_str(&out).unwrap();
    let done_id = done["import_id"].as_str().unwrap();
    let out = env
        .run(&["void", "--import", done_id, "--reason", "leak", "--json"])
        .await;
    assert_eq!(out.status.code(), Some(3), "a partial recall exits 3");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let left: Vec<&str> = (r["left"].as_array().unwrap().iter())
        .map(|l| l["import_id"].as_str().unwrap())
        .collect();
    assert_eq!(left, [orphan.id.to_hex().as_str()], "{r}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&orphan.id.to_hex()) && err.contains("codepool void --import"),
        "{err}"
    );
    // The orphan's code was not voided: the operator decides.
    assert_eq!(
        count_codes(&env, doc! {"batch_id": orphan.id, "status": 0}).await,
        1
    );
    env.cleanup().await;
}

/// A file still being imported holds its run (issue 56): a recall is
/// refused while it inserts. A run that stalls past its lease can be
/// recalled; when it wakes, it stops, and the codes it inserted after the
/// recall are voided as the recall voided the rest.
#[tokio::test]
async fn a_file_still_importing_is_not_recalled_under_it_and_a_stalled_one_stops() {
    use std::process::Stdio;
    use tokio::io::AsyncWriteExt;
    let env = TestEnv::new("recall_importing").await;
    let rows = |from: usize, to: usize| -> String {
        (from..to).map(|i| format!("LIVE-{i:06}\n")).collect()
    };
    let mut child = env
        .command(&["import", "-", "--pool", "li", "--batch-size", "100"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"code\n").await.unwrap();
    stdin.write_all(rows(0, 300).as_bytes()).await.unwrap();
    stdin.flush().await.unwrap();
    let imports = env.coll("imports");
    eventually(Duration::from_secs(60), "300 codes land", || async {
        count_codes(&env, doc! {"pool": "li"}).await == 300
    })
    .await;
    let record = imports
        .find_one(doc! {"pool": "li"})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.get_str("status").unwrap(), "running");
    let run = record.get_object_id("_id").unwrap();
    let id = run.to_hex();

    // Still running, lease held: refused, nothing voided.
    let out = env
        .run(&["void", "--import", &id, "--reason", "leak"])
        .await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("still inserting codes"), "{err}");
    assert_eq!(
        count_codes(&env, doc! {"batch_id": run, "status": 3}).await,
        0
    );

    // The run stalls past its lease (as if stopped for 20 s): the recall
    // goes through and voids the 300.
    imports
        .update_one(
            doc! {"_id": run},
            doc! {"$set": {"lease_until": bson::DateTime::from_millis(0)}},
        )
        .await
        .unwrap();
    codepool_ok(&env, &["void", "--import", &id, "--reason", "leak"]).await;
    assert_eq!(
        count_codes(&env, doc! {"batch_id": run, "status": 3}).await,
        300
    );

    // It wakes: more rows come. It stops at its next renewal, inserts
    // nothing live, and says why.
    tokio::time::sleep(Duration::from_secs(6)).await;
    stdin.write_all(rows(300, 1000).as_bytes()).await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("was recalled while it ran"), "{err}");
    assert_eq!(
        count_codes(&env, doc! {"batch_id": run, "status": 0}).await,
        0,
        "no code of the recalled run is left in stock"
    );
    let record = imports.find_one(doc! {"_id": run}).await.unwrap().unwrap();
    assert_eq!(record.get_str("recall_reason").unwrap(), "leak");
    assert!(record.get_datetime("recalled_at").is_ok(), "{record}");
    env.cleanup().await;
}

/// A recalled run makes no more codes (issue 56): a generation run of a
/// recalled id is refused, and so is an import that would finish a
/// recalled run of its file; nothing of either goes on sale.
#[tokio::test]
async fn a_recalled_run_is_neither_resumed_nor_generated_into() {
    let env = TestEnv::new("recall_resume").await;
    let run = ObjectId::new().to_hex();
    let gen = [
        "generate", "--pool", "rg", "--count", "300", "--run-id", &run,
    ];
    codepool_ok(&env, &gen).await;
    codepool_ok(&env, &["void", "--import", &run, "--reason", "leak"]).await;
    let out = env.run(&gen).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("was recalled (leak)"), "{err}");
    assert_eq!(count_codes(&env, doc! {"pool": "rg", "status": 0}).await, 0);

    // A file killed halfway, then recalled: importing it again would put
    // the rest of a leaked file on sale.
    let file = tempfile::NamedTempFile::new().unwrap();
    let text: String = std::iter::once("code\n".to_owned())
        .chain((0..CODES).map(|i| format!("RR-{i:08}\n")))
        .collect();
    std::fs::write(file.path(), text).unwrap();
    let path = file.path().to_str().unwrap();
    let killed = stopped_run(&env, path, "rr", "-KILL", &[]).await;
    env.coll("imports")
        .update_one(
            doc! {"_id": killed},
            doc! {"$set": {"lease_until": bson::DateTime::from_millis(0)}},
        )
        .await
        .unwrap();
    codepool_ok(
        &env,
        &["void", "--import", &killed.to_hex(), "--reason", "leak"],
    )
    .await;
    let out = env.run(&["import", path, "--pool", "rr"]).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("the whole file is taken as leaked"), "{err}");
    assert_eq!(count_codes(&env, doc! {"pool": "rr", "status": 0}).await, 0);
    env.cleanup().await;
}

#[tokio::test]
async fn recalling_a_resumed_import_voids_every_run_of_the_file() {
    let env = TestEnv::new("recall_recall_runs").await;
    let file = codes_file("LEAK", 300);
    let name = file.path().display().to_string();
    // Run 1 was interrupted after 120 codes (what a SIGINT leaves).
    let mut first = env.store.start_import("leak", &name, None).await.unwrap();
    let codes: Vec<NewCode> = (0..120)
        .map(|i| NewCode {
            code: format!("LEAK-{i:05}"),
            expires_at: None,
            line: Some(i + 2),
        })
        .collect();
    env.store.ensure_pool("leak").await.unwrap();
    let o = env
        .store
        .insert_codes("leak", first.id, &codes)
        .await
        .unwrap();
    assert_eq!(o.inserted, 120);
    first.status = codepool_store::imports::RunState::Interrupted;
    first.inserted = 120;
    env.store.finish_import(&first).await.unwrap();
    // Run 2 finishes it; run 3 is a later re-import that inserts nothing.
    let (code, second) = import_json(&env, file.path(), "leak", &[]).await;
    assert_eq!(code, 0, "{second}");
    assert_eq!(second["inserted"], 180, "{second}");
    assert_eq!(second["resumed_from"], first.id.to_hex());
    let (code, third) = import_json(&env, file.path(), "leak", &[]).await;
    assert_eq!((code, third["inserted"].as_u64()), (0, Some(0)), "{third}");
    let third_id = third["import_id"].as_str().unwrap().to_owned();

    // Recalling the re-import voids the whole file, and says which runs.
    let out = codepool_ok(
        &env,
        &[
            "void",
            "--import",
            &third_id,
            "--reason",
            "partner leak",
            "--json",
        ],
    )
    .await;
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["voided"], 300, "{r}");
    let runs: Vec<&str> = (r["runs"].as_array().unwrap().iter())
        .map(|run| run["import_id"].as_str().unwrap())
        .collect();
    let second_id = second["import_id"].as_str().unwrap();
    assert_eq!(runs, [first.id.to_hex().as_str(), second_id, &third_id]);
    assert_eq!(
        count_codes(&env, doc! {"pool": "leak", "status": 0}).await,
        0
    );
    // Text output names the runs too.
    let (code, text, err) =
        codepool(&env, &["void", "--import", &third_id, "--reason", "again"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        text.contains("3 run(s)") && text.contains(&first.id.to_hex()),
        "{text}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_recall_of_a_run_without_codes_names_the_runs_that_hold_them_and_fails() {
    let env = TestEnv::new("recall_recall_empty").await;
    let name = "partner.csv";
    // Two unlinked runs of a file named partner.csv: one holds codes.
    let holder = env.store.start_import("rp", name, None).await.unwrap();
    env.store.ensure_pool("rp").await.unwrap();
    let codes = [NewCode {
        code: "RP-1".into(),
        expires_at: None,
        line: Some(2),
    }];
    env.store
        .insert_codes("rp", holder.id, &codes)
        .await
        .unwrap();
    let mut empty = env.store.start_import("rp", name, None).await.unwrap();
    empty.status = codepool_store::imports::RunState::Done;
    empty.sha256 = Some("ab".repeat(32));
    env.store.finish_import(&empty).await.unwrap();
    let (code, _, err) = codepool(
        &env,
        &["void", "--import", &empty.id.to_hex(), "--reason", "leak"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&holder.id.to_hex()), "{err}");
    assert_eq!(
        count_codes(&env, doc! {"status": 0}).await,
        1,
        "nothing voided"
    );
    env.cleanup().await;
}

/// A generation run recalled while its process stalled (issue 73, item
/// 10): when it wakes it stops, saying it was recalled (not that another
/// process took it), its record counts every code it put in, and none of
/// them is left in stock.
#[tokio::test(flavor = "multi_thread")]
async fn a_generation_run_recalled_while_it_stalled_records_every_code_and_says_so() {
    let env = TestEnv::new("recall_stalled_gen").await;
    let run = ObjectId::new();
    let id = run.to_hex();
    let child = env
        .command(&[
            "generate",
            "--pool",
            "rs",
            "--count",
            "200000",
            "--batch-size",
            "500",
            "--run-id",
            &id,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually(
        Duration::from_secs(120),
        "the run's first codes land",
        || async { count_codes(&env, doc! {"batch_id": run}).await > 1000 },
    )
    .await;
    let pid = child.id().unwrap().to_string();
    let signal = |s: &str| {
        std::process::Command::new("kill")
            .args([s, &pid])
            .status()
            .unwrap()
    };
    signal("-STOP");
    // Stalled past its lease (made to have lapsed): the recall goes through.
    env.coll("imports")
        .update_one(
            doc! {"_id": run},
            doc! {"$set": {"lease_until": bson::DateTime::from_millis(0)}},
        )
        .await
        .unwrap();
    codepool_ok(&env, &["void", "--import", &id, "--reason", "leak"]).await;
    // Past the time a run renews its lease (5 s), then it wakes.
    tokio::time::sleep(Duration::from_secs(6)).await;
    signal("-CONT");
    let out = child.wait_with_output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("was recalled (leak) while this process stalled"),
        "{err}"
    );
    assert!(!err.contains("another process"), "{err}");
    let stored = count_codes(&env, doc! {"batch_id": run}).await;
    let record = env
        .coll("imports")
        .find_one(doc! {"_id": run})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record
            .get_i64("inserted")
            .map(|n| n as u64)
            .unwrap_or_else(|_| record.get_i32("inserted").unwrap() as u64),
        stored,
        "the record counts every code of the run: {record}"
    );
    assert_eq!(
        count_codes(&env, doc! {"batch_id": run, "status": 0}).await,
        0,
        "no code of the recalled run is left in stock"
    );
    env.cleanup().await;
}
