//! Codes a buyer can read: invisible characters are invalid rows, and
//! look-alike codes (equal under NFKC and case folding) are one code,
//! enforced by MongoDB's unique index even when imports race.

use std::io::Write;

use bson::doc;

use crate::common::*;
use crate::importer::run_import as import_json;

fn csv_file(content: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(content.as_bytes()).expect("write");
    f
}

/// The invalid rows of a summary: line → reason.
fn invalid_rows(s: &serde_json::Value) -> Vec<(u64, String)> {
    s["invalid_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["line"].as_u64().unwrap(),
                r["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn invisible_characters_are_invalid_rows_and_look_alikes_are_refused_with_their_line() {
    let env = TestEnv::new("readable_partner_file").await;
    // The partner file of the issue: seven spellings of one code.
    let file = csv_file(
        "code\nLOOK123\nlook123\nＬＯＯＫ１２３\nLOOK\u{200b}123\nLO\u{ad}OK123\n\u{202e}LOOK123\nLOOK123\u{a0}\nOTHER-1\n",
    );
    let (code, s) = import_json(&env, file.path(), "lk").await;
    assert_eq!(code, 3, "some rows refused: {s}");
    assert_eq!(s["inserted"], 2, "LOOK123 and OTHER-1: {s}");
    assert_eq!(s["duplicates"], 0, "{s}");
    assert_eq!(s["lookalikes"], 2, "{s}");
    assert_eq!(s["invalid"], 6, "{s}");
    let rows = invalid_rows(&s);
    let lines: Vec<u64> = rows.iter().map(|(l, _)| *l).collect();
    assert_eq!(lines, vec![3, 4, 5, 6, 7, 8], "{rows:?}");
    for (line, reason) in &rows[..2] {
        assert!(
            reason.starts_with("lookalike:") && reason.contains("line 2 of this file"),
            "line {line}: {reason}"
        );
    }
    for ((line, reason), point) in rows[2..]
        .iter()
        .zip(["U+200B", "U+00AD", "U+202E", "U+00A0"])
    {
        assert!(reason.contains(point), "line {line}: {reason}");
    }
    // A second file: its look-alike names the first import's line.
    let again = csv_file("code\nlook123\nNEW-1\n");
    let (code, s) = import_json(&env, again.path(), "lk").await;
    assert_eq!(code, 3, "{s}");
    assert_eq!(
        (s["inserted"].as_u64(), s["lookalikes"].as_u64()),
        (Some(1), Some(1))
    );
    let (_, reason) = &invalid_rows(&s)[0];
    assert!(reason.contains("line 2 of import"), "{reason}");
    // The same code again is a plain duplicate, not a look-alike.
    let same = csv_file("code\nLOOK123\n");
    let (code, s) = import_json(&env, same.path(), "lk").await;
    assert_eq!(code, 0, "{s}");
    assert_eq!(
        (s["duplicates"].as_u64(), s["lookalikes"].as_u64()),
        (Some(1), Some(0))
    );
    // Another pool holds the same code only when the operator says so
    // (a code sits in one pool).
    let (code, s) = import_json(&env, same.path(), "lk2").await;
    assert_eq!((code, s["cross_pool"].as_u64()), (1, Some(1)), "{s}");
    let out = env
        .run(&[
            "import",
            same.path().to_str().unwrap(),
            "--pool",
            "lk2",
            "--allow-cross-pool",
        ])
        .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    env.cleanup().await;
}

#[tokio::test]
async fn two_concurrent_imports_of_look_alike_files_insert_each_code_once() {
    let env = TestEnv::new("readable_race").await;
    let upper: String = (0..2000).map(|i| format!("RACE-{i:05}\n")).collect();
    let lower: String = (0..2000).map(|i| format!("race-{i:05}\n")).collect();
    let a = csv_file(&format!("code\n{upper}"));
    let b = csv_file(&format!("code\n{lower}"));
    let (ra, rb) = tokio::join!(
        import_json(&env, a.path(), "race"),
        import_json(&env, b.path(), "race")
    );
    let inserted = ra.1["inserted"].as_u64().unwrap() + rb.1["inserted"].as_u64().unwrap();
    let refused = ra.1["lookalikes"].as_u64().unwrap() + rb.1["lookalikes"].as_u64().unwrap();
    assert_eq!(inserted, 2000, "{} / {}", ra.1, rb.1);
    assert_eq!(refused, 2000);
    let codes = env.coll("codes");
    assert_eq!(
        codes.count_documents(doc! {"pool": "race"}).await.unwrap(),
        2000
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_case_sensitive_pool_folds_by_nfkc_only_and_the_rule_is_fixed_once_it_holds_codes() {
    let env = TestEnv::new("readable_case").await;
    let run = |args: &'static [&'static str]| {
        let mut cmd = env.command(args);
        async move { cmd.output().await.expect("run codepool") }
    };
    let created = run(&["pool", "create", "--pool", "cs"]).await;
    assert!(created.status.success(), "{created:?}");
    let set = run(&["pool", "set", "--pool", "cs", "--case-sensitive-codes"]).await;
    assert!(set.status.success(), "{set:?}");
    let file = csv_file("code\nLOOK123\nlook123\nＬＯＯＫ１２３\n");
    let (code, s) = import_json(&env, file.path(), "cs").await;
    assert_eq!(code, 3, "{s}");
    assert_eq!(
        (s["inserted"].as_u64(), s["lookalikes"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(invalid_rows(&s)[0].0, 4, "the full-width one: {s}");
    let change = run(&[
        "pool",
        "set",
        "--pool",
        "cs",
        "--case-sensitive-codes=false",
    ])
    .await;
    assert_eq!(change.status.code(), Some(1));
    let err = String::from_utf8_lossy(&change.stderr);
    assert!(err.contains("holds codes already"), "{err}");
    env.cleanup().await;
}

#[tokio::test]
async fn migrate_reports_look_alike_pairs_a_pool_already_holds_and_voids_neither() {
    let env = TestEnv::new("readable_migrate").await;
    let codes = env.coll("codes");
    let migrations = env.coll("_migrations");
    // As imported before look-alike checks: no look-alike key.
    let forget = || async {
        codes
            .update_many(doc! {}, doc! {"$unset": {"code_fold_hmac": ""}})
            .await
            .unwrap();
    };
    let first = csv_file("code\nOLD-CODE\nSOLO-1\n");
    assert_eq!(import_json(&env, first.path(), "old").await.0, 0);
    forget().await;
    let second = csv_file("code\nold-code\n");
    assert_eq!(import_json(&env, second.path(), "old").await.0, 0);
    forget().await;
    migrations
        .delete_one(doc! {"_id": "0011_codes_lookalike_backfill"})
        .await
        .unwrap();

    let out = env.run(&["migrate"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("checked 2 code(s)"), "{text}");
    assert!(text.contains("1 look-alike pair(s)"), "{text}");
    assert!(
        !text.contains("OLD-CODE") && !text.contains("old-code"),
        "masked: {text}"
    );
    assert_eq!(
        codes
            .count_documents(doc! {"pool": "old", "status": 0})
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        codes
            .count_documents(doc! {"lookalike_of": {"$exists": true}})
            .await
            .unwrap(),
        1
    );
    // Keyed now: a third spelling is refused at import.
    let third = csv_file("code\nＯＬＤ-ＣＯＤＥ\n");
    let (_, s) = import_json(&env, third.path(), "old").await;
    assert_eq!(s["lookalikes"], 1, "{s}");
    // A second run has nothing left to check.
    let out = env.run(&["migrate"]).await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains("look-alike pair"));
    env.cleanup().await;
}

#[tokio::test]
async fn a_pool_name_starts_with_a_letter_or_a_digit() {
    let env = TestEnv::new("readable_pool_name").await;
    for name in [".", "-x", "_x"] {
        let flag = format!("--pool={name}");
        let out = env.run(&["pool", "create", &flag]).await;
        assert_ne!(out.status.code(), Some(0), "pool {name:?} was created");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("starting with a letter or a digit"), "{err}");
    }
    env.cleanup().await;
}
