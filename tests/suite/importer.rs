//! `codepool import`: CSV shapes, invalid rows, idempotency, flat memory;
//! one file in two pools, stray quotes, repeated codes, gzip files, and
//! file names of visible text.

use std::io::Write;
use std::time::{Duration, Instant};

use bson::doc;

use crate::common::*;
use crate::fixtures::*;

pub(crate) async fn run_import(
    env: &TestEnv,
    path: &std::path::Path,
    pool: &str,
) -> (i32, serde_json::Value) {
    let out = env
        .run(&["import", path.to_str().unwrap(), "--pool", pool, "--json"])
        .await;
    let code = out.status.code().unwrap_or(-1);
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON summary (exit {code}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (code, json)
}

#[tokio::test]
async fn import_handles_bom_crlf_quotes_blank_lines_and_spaces() {
    let env = TestEnv::new("import_shapes").await;
    let f = csv_file(b"\xEF\xBB\xBFcode,expires_at\r\n  AAA-1 ,\r\n\r\n\"BB,B-2\",2030-01-01\r\n\" CCC-3 \",\r\n");
    let (code, s) = run_import(&env, f.path(), "shapes").await;
    assert_eq!(code, 0, "{s}");
    assert_eq!(s["inserted"], 3);
    assert_eq!(s["invalid"], 0);
    let codes = env.coll("codes");
    for c in ["AAA-1", "BB,B-2", "CCC-3"] {
        let d = codes.find_one(env.code_filter("shapes", c)).await.unwrap();
        let d = d.unwrap_or_else(|| panic!("{c} missing"));
        assert_eq!(d.get_i32("status").unwrap(), 0);
        assert_eq!(d.get_i32("is_sms").unwrap(), 0);
    }
    let with_expiry = codes
        .find_one(env.code_filter("shapes", "BB,B-2"))
        .await
        .unwrap()
        .unwrap();
    assert!(with_expiry.get_datetime("expires_at").is_ok());
    env.cleanup().await;
}

#[tokio::test]
async fn invalid_rows_are_reported_by_line_and_skipped_with_exit_3() {
    let env = TestEnv::new("import_invalid").await;
    let long = "x".repeat(129);
    let content = format!("code,batch\nGOOD-1,a\n,b\n{long},c\n\"A\u{7}B\",d\nGOOD-2,e\n");
    let f = csv_file(content.as_bytes());
    let (code, s) = run_import(&env, f.path(), "invalid").await;
    assert_eq!(code, 3, "partial success has its own exit code: {s}");
    assert_eq!(s["inserted"], 2);
    assert_eq!(s["invalid"], 3);
    let lines: Vec<u64> = s["invalid_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["line"].as_u64().unwrap())
        .collect();
    assert_eq!(lines, vec![3, 4, 5]);
    let reasons: Vec<&str> = s["invalid_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons[0].contains("empty")
            && reasons[1].contains("129")
            && reasons[2].contains("control"),
        "{reasons:?}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn importing_the_same_file_twice_inserts_nothing_the_second_time() {
    let env = TestEnv::new("import_twice").await;
    let mut content = String::from("code\n");
    for i in 0..2500 {
        content.push_str(&format!("TWICE-{i:05}\n"));
    }
    content.push_str("TWICE-00007\n"); // repeated inside the file
    let f = csv_file(content.as_bytes());
    let (code, first) = run_import(&env, f.path(), "twice").await;
    assert_eq!(code, 0);
    assert_eq!(first["inserted"], 2500);
    assert_eq!(first["duplicates"], 1);
    let (code, second) = run_import(&env, f.path(), "twice").await;
    assert_eq!(code, 0);
    assert_eq!(second["inserted"], 0);
    assert_eq!(second["duplicates"], 2501);
    assert_eq!(first["sha256"], second["sha256"]);
    let codes = env.coll("codes");
    assert_eq!(
        codes.count_documents(doc! {"pool": "twice"}).await.unwrap(),
        2500
    );
    // seq increases per pool and is unique.
    let seqs: Vec<i64> = codes
        .distinct("seq", doc! {"pool": "twice"})
        .await
        .unwrap()
        .iter()
        .filter_map(|b| b.as_i64())
        .collect();
    assert_eq!(seqs.len(), 2500);
    let audits = env.store.recent_imports(10).await.unwrap();
    assert_eq!(audits.len(), 2);
    assert!(audits
        .iter()
        .all(|a| a.status == codepool_store::imports::RunState::Done && a.sha256.is_some()));
    env.cleanup().await;
}

/// Peak resident memory of a child process, polled from /proc.
async fn import_peak_rss_mb(env: &TestEnv, path: &std::path::Path, pool: &str) -> f64 {
    let mut child = env
        .command(&["import", path.to_str().unwrap(), "--pool", pool, "--json"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn import");
    let pid = child.id().expect("pid");
    let mut peak_kb = 0u64;
    loop {
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if let Some(kb) = status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
            {
                peak_kb = peak_kb.max(kb);
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            assert!(
                status.success() || status.code() == Some(0),
                "import failed: {status}"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    peak_kb as f64 / 1024.0
}

#[tokio::test]
async fn a_200k_code_file_imports_with_flat_memory() {
    let env = TestEnv::new("import_memory").await;
    let write = |n: usize| {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut w = std::io::BufWriter::new(f.as_file_mut());
        writeln!(w, "code").unwrap();
        for i in 0..n {
            writeln!(w, "MEM{n}-{i:08}-ABCDEFGHIJKLMNOP").unwrap();
        }
        drop(w);
        f
    };
    let small = write(20_000);
    let big = write(200_000);
    let small_mb = import_peak_rss_mb(&env, small.path(), "mem-small").await;
    let big_mb = import_peak_rss_mb(&env, big.path(), "mem-big").await;
    let codes = env.coll("codes");
    assert_eq!(
        codes
            .count_documents(doc! {"pool": "mem-big"})
            .await
            .unwrap(),
        200_000
    );
    // Ten times the rows must not mean noticeably more memory.
    assert!(
        big_mb < small_mb + 25.0 && big_mb < 100.0,
        "peak RSS grew with the file: 20k rows {small_mb:.1} MB, 200k rows {big_mb:.1} MB"
    );
    env.cleanup().await;
}

/// Nothing at all happened: no code, no pool, no audit record.
async fn assert_nothing_imported(env: &TestEnv, pool: &str) {
    assert_eq!(count_codes(env, doc! {}).await, 0, "no code is stored");
    assert!(
        env.store.pool(pool).await.unwrap().is_none(),
        "pool {pool} must not exist"
    );
}

#[tokio::test]
async fn a_first_row_that_does_not_name_the_code_column_is_refused_and_nothing_is_imported() {
    let env = TestEnv::new("import_header_rule").await;
    let codes = csv_file(b"codes\nHDR-01\n");
    let serial = csv_file(b"serial,expires_at\nSER-01,2030-01-01\n");
    let headerless = csv_file(b"AAA-1\nBBB-2\n");
    for f in [&codes, &serial, &headerless] {
        let path = f.path().to_str().unwrap();
        let (code, _, err) = codepool(&env, &["import", path, "--pool", "p"]).await;
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("--column") && err.contains("--no-header"),
            "the message says which flag to use: {err}"
        );
    }
    assert_nothing_imported(&env, "p").await;
    assert!(env.store.recent_imports(10).await.unwrap().is_empty());

    // --column picks the code column and keeps expires_at.
    let path = serial.path().to_str().unwrap();
    let (code, _, err) =
        codepool(&env, &["import", path, "--pool", "p", "--column", "serial"]).await;
    assert_eq!(code, 0, "{err}");
    let d = env
        .coll("codes")
        .find_one(doc! {"pool": "p"})
        .await
        .unwrap()
        .expect("SER-01 stored");
    assert_eq!(env.plain_code(&d), "SER-01");
    assert!(d.get_datetime("expires_at").is_ok(), "expires_at kept: {d}");
    assert_eq!(count_codes(&env, env.code_filter("p", "serial")).await, 0);

    // --no-header is for a single column without a header.
    let path = headerless.path().to_str().unwrap();
    let (code, _, err) = codepool(&env, &["import", path, "--pool", "p", "--no-header"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(count_codes(&env, doc! {"pool": "p"}).await, 3);
    let path = serial.path().to_str().unwrap();
    let (code, _, err) = codepool(&env, &["import", path, "--pool", "q", "--no-header"]).await;
    assert_eq!(code, 1, "a two-column file is not for --no-header: {err}");
    assert!(env.store.pool("q").await.unwrap().is_none());
    env.cleanup().await;
}

#[tokio::test]
async fn an_ambiguous_header_is_refused() {
    let env = TestEnv::new("import_ambiguous").await;
    let f = csv_file(b"code,batch,code\nA-1,x,B-1\n");
    let (code, _, err) = codepool(
        &env,
        &["import", f.path().to_str().unwrap(), "--pool", "amb"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("ambiguous"), "{err}");
    assert_nothing_imported(&env, "amb").await;
    env.cleanup().await;
}

#[tokio::test]
async fn failed_and_all_invalid_imports_create_no_pool() {
    let env = TestEnv::new("import_no_ghost").await;
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = codepool(
        &env,
        &["import", dir.path().to_str().unwrap(), "--pool", "ghost"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    let utf16: Vec<u8> = "\u{feff}code\nAAA-1\nBBB-2\n"
        .encode_utf16()
        .flat_map(u16::to_le_bytes)
        .collect();
    let f = csv_file(&utf16);
    for extra in [&[][..], &["--no-header"][..]] {
        let mut args = vec!["import", f.path().to_str().unwrap(), "--pool", "ghost"];
        args.extend_from_slice(extra);
        let (code, _, err) = codepool(&env, &args).await;
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("UTF-16"), "{err}");
    }
    let all_invalid = csv_file(b"code\n\"A\x01\"\n\"B\x02\"\n");
    let (code, _, err) = codepool(
        &env,
        &[
            "import",
            all_invalid.path().to_str().unwrap(),
            "--pool",
            "ghost",
        ],
    )
    .await;
    assert_eq!(code, 1, "every row invalid is a failure: {err}");
    assert_nothing_imported(&env, "ghost").await;
    let (code, out, _) = codepool(&env, &["pool", "show", "--json"]).await;
    assert_eq!(code, 0);
    assert!(!out.contains("ghost"), "{out}");

    // Created on purpose, an empty pool exists.
    let (code, out, err) = codepool(&env, &["pool", "create", "--pool", "later"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("created"), "{out}");
    assert!(env.store.pool("later").await.unwrap().is_some());
    env.cleanup().await;
}

#[tokio::test]
async fn usage_errors_exit_2_and_partial_imports_exit_3() {
    let env = TestEnv::new("import_exit_codes").await;
    let f = csv_file(b"code\nGOOD-1\n\"BAD\x07\"\n");
    let path = f.path().to_str().unwrap();
    let (code, _, err) = codepool(&env, &["import", path]).await;
    assert_eq!(code, 2, "a missing --pool is a usage error: {err}");
    let (code, _, err) =
        codepool(&env, &["import", path, "--pool", "x", "--batch-size", "0"]).await;
    assert_eq!(code, 2, "--batch-size 0 is refused: {err}");
    assert!(err.contains("batch-size"), "{err}");
    assert_nothing_imported(&env, "x").await;
    let (code, _, err) = codepool(&env, &["import", path, "--pool", "x"]).await;
    assert_eq!(code, 3, "{err}");
    for help in [&["--help"][..], &["import", "--help"][..]] {
        let (code, out, _) = codepool(&env, help).await;
        assert_eq!(code, 0);
        assert!(
            out.contains("3 partial") || out.contains("3 some rows invalid"),
            "{out}"
        );
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_missing_file_is_reported_once_with_what_to_do() {
    let env = TestEnv::new("import_missing").await;
    let (code, _, err) = codepool(&env, &["import", "/nonexistent/codes.csv", "--pool", "m"]).await;
    assert_eq!(code, 1);
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
    assert!(err.contains("check the path"), "{err}");
    assert_nothing_imported(&env, "m").await;
    env.cleanup().await;
}

/// Writes a file of `rows` codes, starts `codepool import` on it, and
/// sends `signal` once `at` codes are in. Returns the file (kept until
/// dropped), the child, and the addresses of its connections to MongoDB
/// as the server names them (`127.0.0.1:PORT`), taken while it was
/// stopped just before the signal.
async fn signal_an_import(
    env: &TestEnv,
    pool: &str,
    rows: u64,
    at: u64,
    signal: &str,
) -> (tempfile::NamedTempFile, tokio::process::Child, Vec<String>) {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    {
        let mut w = std::io::BufWriter::new(f.as_file_mut());
        writeln!(w, "code").unwrap();
        for i in 0..rows {
            writeln!(w, "{pool}-{i:08}").unwrap();
        }
    }
    let path = f.path().to_str().unwrap().to_owned();
    let child = env
        .command(&["import", &path, "--pool", pool, "--batch-size", "500"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().unwrap().to_string();
    let started = std::time::Instant::now();
    while count_codes(env, doc! {"pool": pool}).await < at {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "import too slow"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Stopped, it opens no connection between the look and the signal.
    let kill = |signal: &str| {
        let sent = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal} {pid}");
    };
    kill("-STOP");
    let clients = mongo_clients(&pid);
    kill(signal);
    // A TERM or an INT is handled once it runs again (a KILL needs not).
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    (f, child, clients)
}

/// The local addresses of process `pid`'s TCP connections to MongoDB's
/// port, from `/proc`.
fn mongo_clients(pid: &str) -> Vec<String> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, remote, inode) = (f.get(1)?, f.get(2)?, f.get(9)?);
            let port = |a: &str| u16::from_str_radix(a.split_once(':')?.1, 16).ok();
            (port(remote)? == 27017 && inodes.contains(*inode))
                .then(|| format!("127.0.0.1:{}", port(local).unwrap_or(0)))
        })
        .collect()
}

/// Waits until MongoDB has no connection from `clients` (a killed
/// process's): each ends only once the operation it was running, and
/// any it had been sent in full, is done.
async fn connections_gone(env: &TestEnv, clients: &[String]) {
    assert!(!clients.is_empty(), "the import talked to MongoDB");
    let admin = env.store.client().database("admin");
    let open = || async {
        let ops = admin
            .aggregate(vec![
                doc! {"$currentOp": {"allUsers": true, "idleConnections": true}},
                doc! {"$match": {"client": {"$in": clients}}},
            ])
            .await
            .unwrap();
        futures::TryStreamExt::try_collect::<Vec<_>>(ops)
            .await
            .unwrap()
            .len()
    };
    eventually(
        Duration::from_secs(60),
        "the killed import's connections closed",
        || async { open().await == 0 },
    )
    .await;
}

/// Starts a big import, signals it once codes are landing, and checks the
/// exit code and the audit record against the database.
async fn interrupt_an_import(env: &TestEnv, signal: &str, pool: &str) -> (i32, u64) {
    let (_file, mut child, _) = signal_an_import(env, pool, 400_000, 5_000, signal).await;
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the import stops within 20s of the signal")
        .unwrap();
    let stored = count_codes(env, doc! {"pool": pool}).await;
    assert!(stored < 400_000, "it stopped early ({stored} codes)");
    (status.code().unwrap_or(-1), stored)
}

#[tokio::test]
async fn sigterm_and_sigint_during_an_import_record_interrupted_with_the_true_counts() {
    let env = TestEnv::new("import_sigterm").await;
    let (code, stored) = interrupt_an_import(&env, "-TERM", "sigterm").await;
    assert_eq!(code, 143);
    let (code_int, stored_int) = interrupt_an_import(&env, "-INT", "sigint").await;
    assert_eq!(code_int, 130);
    let audits = env.store.recent_imports(10).await.unwrap();
    for (pool, stored) in [("sigterm", stored), ("sigint", stored_int)] {
        let a = audits
            .iter()
            .find(|a| a.pool == pool)
            .expect("audit record");
        assert_eq!(
            a.status,
            codepool_store::imports::RunState::Interrupted,
            "{a:?}"
        );
        assert_eq!(a.inserted, stored, "the record holds the true count: {a:?}");
        assert!(a.finished_at.is_some() && a.sha256.is_none(), "{a:?}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn an_import_killed_halfway_is_finished_by_the_same_command_without_inserting_twice() {
    let env = TestEnv::new("import_kill9").await;
    let (f, mut child, clients) = signal_an_import(&env, "kill9", 100_000, 20_000, "-KILL").await;
    child.wait().await.unwrap();
    let path = f.path().to_str().unwrap().to_owned();
    // The server still finishes the inserts the killed process had sent:
    // count once it has closed every connection of that process.
    connections_gone(&env, &clients).await;
    let stored = count_codes(&env, doc! {"pool": "kill9"}).await;
    assert!(stored < 100_000, "killed before the end ({stored} codes)");
    let killed = env.store.recent_imports(1).await.unwrap().remove(0);
    assert_eq!(
        killed.status,
        codepool_store::imports::RunState::Running,
        "a killed run cannot close its record"
    );

    // The same command finishes it: each code once, the codes already in
    // looked up and skipped (not rejected one by one), the record linked.
    let out = env
        .run(&["import", &path, "--pool", "kill9", "--json"])
        .await;
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{log}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["status"], "done");
    assert_eq!(summary["inserted"], 100_000 - stored);
    assert_eq!(summary["duplicates"], stored);
    assert_eq!(summary["resumed_from"], killed.id.to_hex());
    assert!(log.contains("looked up and skipped"), "{log}");
    assert!(log.contains("plain inserts from here"), "{log}");
    assert_eq!(count_codes(&env, doc! {"pool": "kill9"}).await, 100_000);
    let codes = env.coll("codes");
    let distinct = codes
        .distinct("code_hmac", doc! {"pool": "kill9"})
        .await
        .unwrap();
    assert_eq!(distinct.len(), 100_000, "no code twice");
    env.cleanup().await;
}

#[tokio::test]
async fn import_reads_standard_input_and_a_fifo_and_a_rerun_is_idempotent() {
    let env = TestEnv::new("import_stdin").await;
    let body: String = std::iter::once("code\n".to_owned())
        .chain((0..500).map(|i| format!("STDIN-{i:04}\n")))
        .collect();
    let mut counts = Vec::new();
    for _ in 0..2 {
        let mut cmd = env.command(&["import", "-", "--pool", "in", "--json"]);
        let out = with_stdin(&mut cmd, body.as_bytes()).await;
        assert_eq!(out.status.code(), Some(0));
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(s["file"], "(stdin)");
        assert_eq!(
            s["sha256"].as_str().unwrap().len(),
            64,
            "hashed as it streamed"
        );
        counts.push((
            s["inserted"].as_u64().unwrap(),
            s["duplicates"].as_u64().unwrap(),
        ));
    }
    assert_eq!(counts, vec![(500, 0), (0, 500)]);
    let imports = env.coll("imports");
    assert_eq!(
        imports
            .count_documents(doc! {"file": "(stdin)", "status": "done"})
            .await
            .unwrap(),
        2
    );

    // A FIFO streams like a file.
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("codes.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::write(fifo, "code\nFIFO-1\nFIFO-2\n").unwrap())
    };
    let (code, s) = run_import(&env, &fifo, "in").await;
    writer.join().unwrap();
    assert_eq!((code, s["inserted"].as_u64()), (0, Some(2)), "{s}");
    env.cleanup().await;
}

#[tokio::test]
async fn one_file_imported_into_two_pools_is_refused_in_the_second_unless_allowed() {
    let env = TestEnv::new("import_cross_pool").await;
    let file = codes_file("XP", 50);
    let (code, first) = import_json(&env, file.path(), "xa", &[]).await;
    assert_eq!((code, first["inserted"].as_u64()), (0, Some(50)), "{first}");
    // Into a second pool: every code is a cross-pool duplicate, named.
    let (code, second) = import_json(&env, file.path(), "xb", &[]).await;
    assert_eq!(code, 1, "{second}");
    assert_eq!(second["inserted"], 0, "{second}");
    assert_eq!(second["cross_pool"], 50, "{second}");
    assert_eq!(second["cross_pool_pools"], serde_json::json!(["xa"]));
    let reason = second["invalid_rows"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("cross_pool") && reason.contains("\"xa\""),
        "{reason}"
    );
    assert_eq!(count_codes(&env, doc! {"pool": "xb"}).await, 0);
    // A file with some new codes: those go in, exit 3 (rows skipped).
    let mixed = csv_file(b"code\nXP-00001\nNEW-1\n");
    let (code, s) = import_json(&env, mixed.path(), "xb", &[]).await;
    assert_eq!(
        (code, s["inserted"].as_u64(), s["cross_pool"].as_u64()),
        (3, Some(1), Some(1)),
        "{s}"
    );
    // On purpose: the operator says so.
    let (code, third) = import_json(&env, file.path(), "xc", &["--allow-cross-pool"]).await;
    assert_eq!((code, third["inserted"].as_u64()), (0, Some(50)), "{third}");
    env.cleanup().await;
}

/// A code sits in one pool as codepool compares codes (issue 73, item 2):
/// a partner's file re-sent in lower case, or in full width, is the same
/// codes, refused in a second pool like an exact copy; O/0 and I/L/1 are
/// one wherever either pool folds confusables, and two only where
/// neither does.
#[tokio::test]
async fn a_look_alike_of_another_pools_code_is_refused_like_an_exact_copy() {
    let env = TestEnv::new("import_cross_fold").await;
    let file = csv_file("code\nRACE-1\nRACE-2\n".as_bytes());
    let (code, first) = import_json(&env, file.path(), "la", &[]).await;
    assert_eq!((code, first["inserted"].as_u64()), (0, Some(2)), "{first}");
    for (pool, text) in [
        ("lb", "code\nrace-1\nrace-2\n"),
        ("lc", "code\nＲＡＣＥ-1\nｒａｃｅ－２\n"),
    ] {
        let again = csv_file(text.as_bytes());
        let (code, s) = import_json(&env, again.path(), pool, &[]).await;
        assert_eq!(code, 1, "{s}");
        assert_eq!(
            (s["inserted"].as_u64(), s["cross_pool"].as_u64()),
            (Some(0), Some(2)),
            "{s}"
        );
        assert_eq!(s["cross_pool_pools"], serde_json::json!(["la"]), "{s}");
        assert_eq!(count_codes(&env, doc! {"pool": pool}).await, 0);
    }

    // Confusables: GOLD-O1 in a pool that folds them; G0LD-01 is that code
    // in any pool. Between two pools that keep them apart, two codes.
    codepool_ok(&env, &["pool", "create", "--pool", "conf"]).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "conf", "--fold-confusables"],
    )
    .await;
    let gold = csv_file(b"code\nGOLD-O1\nSILVER-L1\n");
    let (code, s) = import_json(&env, gold.path(), "conf", &[]).await;
    assert_eq!((code, s["inserted"].as_u64()), (0, Some(2)), "{s}");
    let misread = csv_file(b"code\nG0LD-01\nsilver-11\n");
    let (code, s) = import_json(&env, misread.path(), "plain1", &[]).await;
    assert_eq!((code, s["cross_pool"].as_u64()), (1, Some(2)), "{s}");
    let apart = csv_file(b"code\nKEEP-O1\n");
    let (code, s) = import_json(&env, apart.path(), "plain1", &[]).await;
    assert_eq!((code, s["inserted"].as_u64()), (0, Some(1)), "{s}");
    let other = csv_file(b"code\nKEEP-01\n");
    let (code, s) = import_json(&env, other.path(), "plain2", &[]).await;
    assert_eq!(
        (code, s["inserted"].as_u64()),
        (0, Some(1)),
        "neither pool folds O/0: {s}"
    );
    env.cleanup().await;
}

/// Two imports of one file into two pools at once (issue 73, item 2):
/// each code goes into exactly one of them, however the imports
/// interleave; the claims decide, not a lookup before the insert.
#[tokio::test(flavor = "multi_thread")]
async fn one_file_imported_into_two_pools_at_once_puts_each_code_in_one() {
    let env = TestEnv::new("import_cross_race").await;
    const N: usize = 6_000;
    let file = codes_file("RACE", N);
    let path = file.path().to_str().unwrap().to_owned();
    let runs = ["ra", "rb"].map(|pool| {
        let cmd = env
            .command(&[
                "import",
                &path,
                "--pool",
                pool,
                "--batch-size",
                "200",
                "--json",
            ])
            .output();
        async move { cmd.await.unwrap() }
    });
    let outs = futures::future::join_all(runs).await;
    let mut inserted = 0;
    for out in &outs {
        let s: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
        inserted += s["inserted"].as_u64().unwrap();
        assert_eq!(
            s["inserted"].as_u64().unwrap() + s["cross_pool"].as_u64().unwrap(),
            N as u64,
            "{s}"
        );
    }
    assert_eq!(inserted, N as u64, "each code once");
    assert_eq!(
        count_codes(&env, doc! {}).await,
        N as u64,
        "no code in both pools"
    );
    env.cleanup().await;
}

/// The report of look-alike pairs stored across pools (issue 73, item 2):
/// pairs from before claims, found by `codepool migrate`, and pairs
/// imported on purpose, each listed with both pools.
#[tokio::test]
async fn codepool_lookalikes_lists_the_pairs_stored_across_pools() {
    let env = TestEnv::new("import_lookalike_report").await;
    let file = csv_file(b"code\nPAIR-1\nALONE-1\n");
    import_json(&env, file.path(), "pa", &[]).await;
    let (code, out, err) = codepool(&env, &["lookalikes", "--json"]).await;
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    // On purpose: the operator's own pair.
    let lower = csv_file(b"code\npair-1\n");
    let (code, s) = import_json(&env, lower.path(), "pb", &["--allow-cross-pool"]).await;
    assert_eq!((code, s["inserted"].as_u64()), (0, Some(1)), "{s}");
    // From before claims: stored with no claim, then `codepool migrate`.
    let old = [codepool_store::NewCode {
        code: "ＡＬＯＮＥ-1".into(),
        expires_at: None,
        line: Some(2),
    }];
    env.store.ensure_pool("pc").await.unwrap();
    env.store
        .insert_claimed("pc", bson::oid::ObjectId::new(), &old)
        .await
        .unwrap();
    env.coll("_migrations")
        .update_one(
            doc! {"_id": "0025_code_claims_backfill"},
            doc! {"$set": {"done": false}, "$unset": {"after": ""}},
        )
        .await
        .unwrap();
    let migrated = codepool_ok(&env, &["migrate"]).await;
    assert!(
        migrated.contains("1 of them read the same as a code of another pool"),
        "{migrated}"
    );
    let (code, out, err) = codepool(&env, &["lookalikes", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let mut pairs: Vec<(String, String)> = out
        .lines()
        .map(|l| {
            let p: serde_json::Value = serde_json::from_str(l).unwrap();
            let mut two = [
                p["first"]["pool"].as_str().unwrap(),
                p["second"]["pool"].as_str().unwrap(),
            ];
            two.sort();
            assert!(
                !out.contains("PAIR-1") && !out.contains("ALONE"),
                "codes masked: {out}"
            );
            (two[0].to_owned(), two[1].to_owned())
        })
        .collect();
    pairs.sort();
    assert_eq!(
        pairs,
        [("pa".into(), "pb".into()), ("pa".into(), "pc".into())],
        "{out}"
    );
    assert!(err.contains("2 look-alike pair(s)"), "{err}");
    // Once claimed, the old code refuses its look-alikes like any other.
    let again = csv_file(b"code\nalone-1\n");
    let (code, s) = import_json(&env, again.path(), "pd", &[]).await;
    assert_eq!((code, s["cross_pool"].as_u64()), (1, Some(1)), "{s}");
    env.cleanup().await;
}

#[tokio::test]
async fn a_stray_quote_refuses_the_file_naming_its_line_and_the_lines_it_swallowed() {
    let env = TestEnv::new("import_stray_quote").await;
    let mut content = String::from("code\nOK-0002\n\"STRAY-0003\n");
    for i in 4..=2001 {
        content.push_str(&format!("CODE-{i:04}\n"));
    }
    let file = csv_file(content.as_bytes());
    let (code, _, err) = codepool(
        &env,
        &["import", file.path().to_str().unwrap(), "--pool", "sq"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("line 3") && err.contains("1998 line(s)") && err.contains("line 2001"),
        "{err}"
    );
    let record = (env.store.recent_imports(1).await.unwrap()).pop().unwrap();
    assert_eq!(record.status, codepool_store::imports::RunState::Failed);
    env.cleanup().await;
}

#[tokio::test]
async fn a_file_repeating_one_code_imports_in_bounded_time_counting_the_repeats() {
    let env = TestEnv::new("import_repeats").await;
    let content = format!("code\n{}", "SAME-CODE-1\n".repeat(100_000));
    let file = csv_file(content.as_bytes());
    let started = Instant::now();
    let (code, s) = import_json(&env, file.path(), "rep", &[]).await;
    let took = started.elapsed();
    assert_eq!(code, 0, "{s}");
    assert_eq!(
        (s["inserted"].as_u64(), s["duplicates"].as_u64()),
        (Some(1), Some(99_999)),
        "{s}"
    );
    assert!(
        took < Duration::from_secs(10),
        "100,000 repeats took {took:?}"
    );
    let record = env.store.recent_imports(1).await.unwrap().pop().unwrap();
    assert_eq!((record.inserted, record.duplicates), (1, 99_999));
    env.cleanup().await;
}

#[tokio::test]
async fn a_gzip_file_is_refused_as_gzip() {
    let env = TestEnv::new("import_gzip").await;
    let file =
        csv_file(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x4b\xce\x4f\x49\xe5\x02\x00\x00\x00");
    let (code, _, err) = codepool(
        &env,
        &["import", file.path().to_str().unwrap(), "--pool", "gz"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("gzip") && !err.contains("UTF-16"), "{err}");
    env.cleanup().await;
}

#[tokio::test]
async fn uploaded_file_names_are_base_names_of_visible_text() {
    use codepool_importer::{import_reader, ImportError, ImportOptions};
    let env = TestEnv::new("import_file_names").await;
    for name in [
        "../../etc/passwd",
        "a/b.csv",
        "x\u{1b}[2J.csv",
        "gpj.\u{202e}exe.csv",
    ] {
        let body: &'static [u8] = b"code\nFN-1\n";
        let r = import_reader(
            &env.store,
            body,
            name,
            0,
            "fn",
            &ImportOptions::default(),
            &|_| {},
        )
        .await;
        assert!(
            matches!(r, Err(ImportError::FileName(_))),
            "{name:?}: {r:?}"
        );
    }
    assert!(
        env.store.recent_imports(5).await.unwrap().is_empty(),
        "no run recorded"
    );
    let r = import_reader(
        &env.store,
        &b"code\nFN-1\n"[..],
        "partner.csv",
        0,
        "fn",
        &ImportOptions::default(),
        &|_| {},
    )
    .await;
    assert_eq!(r.unwrap().file, "partner.csv");
    env.cleanup().await;
}
