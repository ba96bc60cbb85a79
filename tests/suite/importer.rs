//! `codepool import`: CSV shapes, invalid rows, idempotency, flat memory.

use std::io::Write;
use std::time::Duration;

use bson::doc;

use crate::common::TestEnv;

fn csv_file(content: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(content).expect("write");
    f
}

async fn run_import(env: &TestEnv, path: &std::path::Path, pool: &str) -> (i32, serde_json::Value) {
    let out = env
        .command(&["import", path.to_str().unwrap(), "--pool", pool, "--json"])
        .output()
        .await
        .expect("run codepool import");
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
    let codes = env.store.database().collection::<bson::Document>("codes");
    for c in ["AAA-1", "BB,B-2", "CCC-3"] {
        let d = codes
            .find_one(doc! {"pool": "shapes", "code": c})
            .await
            .unwrap();
        let d = d.unwrap_or_else(|| panic!("{c} missing"));
        assert_eq!(d.get_i32("status").unwrap(), 0);
        assert_eq!(d.get_i32("is_sms").unwrap(), 0);
    }
    let with_expiry = codes
        .find_one(doc! {"code": "BB,B-2"})
        .await
        .unwrap()
        .unwrap();
    assert!(with_expiry.get_datetime("expires_at").is_ok());
    env.cleanup().await;
}

#[tokio::test]
async fn invalid_rows_are_reported_by_line_and_skipped_with_exit_2() {
    let env = TestEnv::new("import_invalid").await;
    let long = "x".repeat(129);
    let content = format!("code,batch\nGOOD-1,a\n,b\n{long},c\n\"A\u{7}B\",d\nGOOD-2,e\n");
    let f = csv_file(content.as_bytes());
    let (code, s) = run_import(&env, f.path(), "invalid").await;
    assert_eq!(code, 2, "{s}");
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
    let codes = env.store.database().collection::<bson::Document>("codes");
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
        .all(|a| a.status == "done" && a.sha256.is_some()));
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
    let codes = env.store.database().collection::<bson::Document>("codes");
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
