//! The doors hold no store: the HTTP API, the console and the AMQP
//! dispatcher (their manifests and every Rust file of theirs) neither name
//! the storage crate nor ask for a store; they call the views and
//! operations of this module's parent instead.

use std::path::{Path, PathBuf};

/// The door crates, beside this one in `crates/`.
const DOORS: [&str; 3] = ["api", "console", "dispatcher"];

/// What a door's files may not hold: the storage crate, as a manifest or
/// a path names it, and a call that hands out a store.
const FORBIDDEN: [&str; 3] = ["codepool_store", "codepool-store", ".store()"];

/// The manifest and every `.rs` file under `dir`.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "target") {
                files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs")
            || path.file_name().is_some_and(|n| n == "Cargo.toml")
        {
            out.push(path);
        }
    }
}

/// `file:line: text` for each line of the door files that holds a
/// forbidden string.
fn reaches_of(crates: &Path) -> (usize, Vec<String>) {
    let mut all = Vec::new();
    for door in DOORS {
        let dir = crates.join(door);
        assert!(dir.join("Cargo.toml").is_file(), "no door at {dir:?}");
        files(&dir, &mut all);
    }
    let mut found = Vec::new();
    for path in &all {
        let text = std::fs::read_to_string(path).expect("a door's file reads");
        for (n, line) in text.lines().enumerate() {
            if FORBIDDEN.iter().any(|f| line.contains(f)) {
                let shown = path.strip_prefix(crates).unwrap_or(path).display();
                found.push(format!("crates/{shown}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    (all.len(), found)
}

#[test]
fn the_doors_hold_no_store() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crates/")
        .to_path_buf();
    let (read, found) = reaches_of(&crates);
    assert!(read > DOORS.len(), "only {read} files of the doors read");
    assert!(
        found.is_empty(),
        "the doors reach the store; read a view or call an operation of the core instead (codepool_issuance::doors):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_sees_a_door_that_reaches_the_store() {
    let dir = std::env::temp_dir().join(format!("codepool-doors-check-{}", std::process::id()));
    for door in DOORS {
        let src = dir.join(door).join("src");
        std::fs::create_dir_all(&src).expect("temp dir");
        std::fs::write(dir.join(door).join("Cargo.toml"), "[package]\n").expect("manifest");
        std::fs::write(src.join("lib.rs"), "fn f() {}\n").expect("source");
    }
    assert_eq!(reaches_of(&dir).1, Vec::<String>::new());
    std::fs::write(
        dir.join("console/src/lib.rs"),
        "fn f(core: &Core) {\n    core.store().shops();\n}\n",
    )
    .expect("source");
    std::fs::write(
        dir.join("api/Cargo.toml"),
        "[dependencies]\ncodepool-store.workspace = true\n",
    )
    .expect("manifest");
    let (_, found) = reaches_of(&dir);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found
        .iter()
        .any(|f| f.starts_with("crates/console/src/lib.rs:2:")));
    assert!(found
        .iter()
        .any(|f| f.starts_with("crates/api/Cargo.toml:2:")));
}
