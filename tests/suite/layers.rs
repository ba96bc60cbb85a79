//! The doors depend on the core, not on what the core is built from: the
//! HTTP API, the console and the AMQP dispatcher name none of the storage
//! crates (`codepool-store`, `codepool-importer`, `codepool-hotpool`,
//! `codepool-sequence`) nor a database driver in their Cargo.toml. What
//! they read comes from `codepool_issuance::model`; what they change goes
//! through a core function. The AMQP door keeps `codepool-broker`, its
//! transport.

use std::collections::BTreeMap;
use std::process::Command;

const DOORS: [&str; 3] = ["codepool-api", "codepool-console", "codepool-dispatcher"];
const BELOW_THE_CORE: [&str; 6] = [
    "codepool-store",
    "codepool-importer",
    "codepool-hotpool",
    "codepool-sequence",
    "mongodb",
    "redis",
];

/// Each workspace package's direct dependencies, as `cargo metadata`
/// reads the manifests.
fn direct_dependencies() -> BTreeMap<String, Vec<String>> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    packages
        .iter()
        .map(|p| {
            let deps = (p["dependencies"].as_array().into_iter().flatten())
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap_or_default().to_owned())
                .collect();
            (p["name"].as_str().unwrap_or_default().to_owned(), deps)
        })
        .collect()
}

#[test]
fn the_doors_name_no_crate_below_the_core() {
    let deps = direct_dependencies();
    let mut edges = Vec::new();
    for door in DOORS {
        let Some(theirs) = deps.get(door) else {
            panic!("no package {door} in the workspace: {:?}", deps.keys());
        };
        assert!(
            theirs.iter().any(|d| d == "codepool-issuance"),
            "{door} does not depend on the core"
        );
        for below in BELOW_THE_CORE {
            if theirs.iter().any(|d| d == below) {
                edges.push(format!("{door} -> {below}"));
            }
        }
    }
    assert!(
        edges.is_empty(),
        "doors that reach past the core (take what they need from codepool_issuance instead): {edges:?}"
    );
    // The check itself sees edges: the CLI, the composition root, builds
    // the core from its parts.
    let cli = &deps["codepool"];
    assert!(cli.iter().any(|d| d == "codepool-store"), "{cli:?}");
}
