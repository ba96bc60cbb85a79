//! The files in `deploy/` work with the tools that will read them: the
//! systemd units pass `systemd-analyze verify` and keep their hardening,
//! the alert rules pass `promtool check` and their own unit tests, and the
//! example environment file lists every setting with its default.
//! `scripts/deploy-tools.sh` (`make deploy-tools`, run by `make test`)
//! installs the tools.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::bin;

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A tool on PATH, else where `scripts/deploy-tools.sh` unpacks it.
pub fn tool(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file());
    let unpacked = repo().join(".services/prometheus/usr/bin").join(name);
    on_path
        .or_else(|| unpacked.is_file().then_some(unpacked))
        .unwrap_or_else(|| {
            panic!("{name} is not installed: run `make deploy-tools` (scripts/deploy-tools.sh)")
        })
}

/// Runs a tool; returns (success, stdout, stderr).
fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.output().expect("the tool runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const UNITS: &[&str] = &["codepool-dispatch.service", "codepool-api.service"];

/// The units as installed, but with `ExecStart` on the binary under test
/// (verify insists the binary exists).
fn units_for_this_build(dir: &Path) -> Vec<PathBuf> {
    UNITS
        .iter()
        .map(|name| {
            let text = std::fs::read_to_string(repo().join("deploy/systemd").join(name))
                .expect("the unit file");
            assert!(
                text.contains("ExecStart=/usr/local/bin/codepool "),
                "{name} starts /usr/local/bin/codepool"
            );
            let path = dir.join(name);
            std::fs::write(&path, text.replace("/usr/local/bin/codepool", bin())).expect("write");
            path
        })
        .collect()
}

#[test]
fn systemd_units_pass_verify_without_a_warning() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    for unit in units_for_this_build(dir.path()) {
        let (ok, out, err) = run(Command::new(tool("systemd-analyze"))
            .arg("verify")
            .arg(&unit)
            .current_dir(dir.path()));
        // verify exits 0 on a directive it cannot parse and only warns:
        // a unit that is right says nothing at all.
        assert!(ok, "systemd-analyze verify {unit:?} failed:\n{out}{err}");
        assert_eq!(
            err.trim(),
            "",
            "systemd-analyze verify {unit:?} warns:\n{err}"
        );
        // The exposure score of `systemd-analyze security` (0 best, 10
        // worst): the sandbox keeps it at "OK".
        let (ok, out, err) = run(Command::new(tool("systemd-analyze"))
            .args(["security", "--offline=yes", "--threshold=20"])
            .arg(&unit)
            .current_dir(dir.path()));
        assert!(ok, "{unit:?} is exposed above 2.0:\n{out}{err}");
    }
}

/// `Key=value` lines of a unit (the last one wins, as in systemd, except
/// for settings that accumulate, which are all returned).
fn settings<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    text.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .collect()
}

#[test]
fn systemd_units_run_sandboxed_with_the_key_file_as_a_credential() {
    for name in UNITS {
        let text = std::fs::read_to_string(repo().join("deploy/systemd").join(name)).expect("unit");
        let one = |key: &str| -> String {
            settings(&text, key)
                .last()
                .unwrap_or_else(|| panic!("{name} has no {key}="))
                .to_string()
        };
        assert_eq!(one("User"), "codepool", "{name}: a dedicated user");
        for (key, want) in [
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("PrivateTmp", "yes"),
            ("Restart", "on-failure"),
            ("KillSignal", "SIGTERM"),
            ("UMask", "0077"),
        ] {
            assert_eq!(one(key), want, "{name}: {key}");
        }
        // codepool writes no file: no path is opened for writing.
        assert!(settings(&text, "ReadWritePaths").is_empty(), "{name}");
        // The key file comes in as a credential, and codepool reads it there.
        assert_eq!(
            settings(&text, "LoadCredential"),
            ["keys.json:/etc/codepool/keys.json"],
            "{name}"
        );
        assert!(
            settings(&text, "Environment").contains(&"CODEPOOL_KEY_FILE=%d/keys.json"),
            "{name} points CODEPOOL_KEY_FILE at the credential"
        );
        // A stop waits for the graceful shutdown (the suite's daemons stop
        // within 10 s of SIGTERM).
        let stop = one("TimeoutStopSec");
        let secs: u64 = stop
            .trim_end_matches('s')
            .parse()
            .expect("TimeoutStopSec in seconds");
        assert!(secs >= 30, "{name}: TimeoutStopSec={stop}");
    }
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    let dir = repo().join("deploy/prometheus");
    for args in [
        &["check", "rules", "alerts.yml"][..],
        &["check", "config", "prometheus.yml"],
        &["test", "rules", "alerts_test.yml"],
    ] {
        let (ok, out, err) = run(Command::new(tool("promtool")).args(args).current_dir(&dir));
        assert!(ok, "promtool {args:?} failed:\n{out}{err}");
    }
    // Every rule has a test that fires it.
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).expect("alerts.yml");
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).expect("alerts_test.yml");
    let fired: Vec<&str> = tests
        .split("- eval_time:")
        .filter(|case| case.contains("exp_alerts:"))
        .filter_map(|case| case.split("alertname:").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap_or(""))
        .collect();
    for line in rules.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert: ") {
            assert!(fired.contains(&name), "no test fires {name}");
        }
    }
}

/// Every `[env: CODEPOOL_…]` of the daemons' help, with its `[default: …]`.
fn settings_in_help() -> Vec<(String, Option<String>)> {
    let mut found = Vec::new();
    for command in ["dispatch", "api", "import"] {
        let out = Command::new(bin())
            .args([command, "--help"])
            .output()
            .expect("codepool --help");
        let help = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for part in help.split("[env: ").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let after = part
                .split_once(']')
                .map(|(_, a)| a.trim_start())
                .unwrap_or("");
            let default = after
                .strip_prefix("[default: ")
                .and_then(|d| d.split_once(']'))
                .map(|(d, _)| d.replace(' ', "").trim_matches('"').to_owned());
            if !found.iter().any(|(n, _)| *n == name) {
                found.push((name, default));
            }
        }
    }
    found
}

#[test]
fn the_example_environment_file_lists_every_setting_with_its_default() {
    let example =
        std::fs::read_to_string(repo().join("deploy/codepool.env.example")).expect("example");
    let lines: Vec<&str> = example.lines().collect();
    let found = settings_in_help();
    assert!(found.len() >= 10, "settings found in --help: {found:?}");
    // Every `env = "CODEPOOL_…"` in the sources is in the help too.
    let src_dir = repo().join("crates/codepool/src");
    let commands = std::fs::read_dir(src_dir.join("commands")).expect("commands/");
    let files = commands
        .filter_map(|e| e.ok().map(|e| e.path()))
        .chain([src_dir.join("config.rs"), src_dir.join("cli.rs")]);
    for file in files {
        let src = std::fs::read_to_string(&file).expect("src");
        for part in src.split("env = \"").skip(1) {
            let name = part.split('"').next().unwrap_or("");
            assert!(
                found.iter().any(|(n, _)| n == name),
                "{name} ({file:?}) is not in the daemons' --help"
            );
        }
    }
    for (name, default) in found {
        let line = lines
            .iter()
            .find(|l| l.trim_start_matches('#').starts_with(&format!("{name}=")))
            .unwrap_or_else(|| panic!("deploy/codepool.env.example does not list {name}"));
        if let Some(default) = default {
            let value = line.split_once('=').map(|(_, v)| v).unwrap_or("");
            assert_eq!(value, default, "{name}'s default in the example");
        }
    }
}
