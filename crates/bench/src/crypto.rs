//! `codepool-bench crypto`: what encryption at rest costs per code, next to
//! what a code costs anyway.
//!
//! codepool has no "encryption off" mode to compare against (it must never
//! store a plaintext code), so this measures the added work itself, in
//! process, per code, exactly as the store does it:
//!
//! - import: seal (XChaCha20-Poly1305, AAD = pool + `_id`) and HMAC-SHA-256,
//!   built into the BSON fields `insert_codes` writes;
//! - dispatch: open one sealed code (the claim's read-back decrypts each
//!   granted code once).
//!
//! It then reads `import.json` and `dispatch.json` from the same output
//! folder (written by `import` and `dispatch` earlier in the same `make
//! bench`) and bounds the throughput without encryption: if every
//! nanosecond of crypto sat serially on the critical path, the measured
//! rate `r` would have been `1 / (1/r − t_crypto)` without it, so
//! `with / without = 1 − r · t_crypto`. Work actually overlaps with I/O, so
//! the real ratio is at least this one.

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use codepool_store::crypto::{code_aad, sealed_fields};
use codepool_store::ObjectId;
use codepool_vault::Keyring;
use serde_json::json;

/// Measure the per-code cost of encryption at rest.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:\n  codepool-bench crypto --codes 200000")]
pub struct CryptoBenchArgs {
    /// Codes sealed, hashed and opened.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1000..=20_000_000))]
    pub codes: u64,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Nanoseconds per code of `f` over `n` codes: (wall, CPU of this
/// process). On a loaded machine wall time includes waiting for a core;
/// CPU time is the work itself (10 ms resolution, so `n` must be large).
fn per_code(n: usize, mut f: impl FnMut(usize)) -> (f64, f64) {
    let cpu = || super::cpu_seconds(std::process::id()).unwrap_or(0.0);
    let (started, cpu_before) = (Instant::now(), cpu());
    for i in 0..n {
        f(i);
    }
    let wall = started.elapsed().as_nanos() as f64 / n as f64;
    (wall, (cpu() - cpu_before) * 1e9 / n as f64)
}

/// A measured rate from an earlier report, if that report is there.
fn rate(
    out_dir: &Path,
    file: &str,
    pick: impl Fn(&serde_json::Value) -> Option<f64>,
) -> Option<f64> {
    let text = std::fs::read_to_string(out_dir.join(file)).ok()?;
    pick(&serde_json::from_str(&text).ok()?)
}

/// `with / without` if `ns` per code were serial on a path running at `per_sec`.
fn bound(per_sec: Option<f64>, ns: f64) -> serde_json::Value {
    match per_sec {
        Some(r) => {
            json!({"measured_per_sec": r, "ratio_with_over_without_at_least": 1.0 - r * ns * 1e-9})
        }
        None => json!(null),
    }
}

pub fn run(args: CryptoBenchArgs, out_dir: &Path) -> anyhow::Result<()> {
    let n = args.codes as usize;
    let ring = Keyring::generate();
    let ids: Vec<ObjectId> = (0..n).map(|_| ObjectId::new()).collect();
    let codes: Vec<String> = (0..n)
        .map(|i| format!("BN{:04X}-{i:011}", i & 0xFFFF))
        .collect();
    let (seal_ns, seal_cpu) = per_code(n, |i| {
        black_box(sealed_fields(&ring, "bench", ids[i], &codes[i]));
    });
    let sealed: Vec<Vec<u8>> = (0..n)
        .map(|i| ring.seal(&code_aad("bench", ids[i]), &codes[i]).bytes)
        .collect();
    let (open_ns, open_cpu) = per_code(n, |i| {
        let aad = code_aad("bench", ids[i]);
        black_box(ring.open("k1", &aad, &sealed[i]).ok());
    });
    let (hmac_ns, _) = per_code(n, |i| {
        black_box(ring.code_hmac("bench", &codes[i]));
    });
    let import = rate(out_dir, "import.json", |v| {
        v["import"]["codes_per_sec"].as_f64()
    });
    let dispatch = rate(out_dir, "dispatch.json", |v| {
        v["results"][0]["per_sec"].as_f64()
    });
    let report = json!({
        "benchmark": "crypto",
        "codes": n,
        "cipher": "XChaCha20-Poly1305 (random 24-byte nonce, AAD pool+_id) + HMAC-SHA-256",
        "ns_per_code": {"import_seal_and_hmac": seal_ns, "hmac_alone": hmac_ns, "dispatch_open": open_ns},
        "cpu_ns_per_code": {"import_seal_and_hmac": seal_cpu, "dispatch_open": open_cpu},
        "import": bound(import, seal_ns),
        "dispatch": bound(dispatch, open_ns),
        "import_by_cpu_time": bound(import, seal_cpu),
        "dispatch_by_cpu_time": bound(dispatch, open_cpu),
        "target": 0.9,
        "note": "ratio = 1 - measured_rate x crypto_time_per_code: the bound if all crypto were serial on the critical path; import.json / dispatch.json must come from the same run (make bench runs crypto last)",
    });
    let (rendered, path) = super::write_report(out_dir, "crypto.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        println!("encryption at rest, per code over {n} codes:");
        println!("  import:   seal + HMAC  {seal_ns:>8.0} ns wall, {seal_cpu:>6.0} ns CPU (HMAC alone {hmac_ns:.0} ns)");
        println!("  dispatch: open         {open_ns:>8.0} ns wall, {open_cpu:>6.0} ns CPU");
        let cases = [
            ("import", import, seal_ns, seal_cpu),
            ("dispatch", dispatch, open_ns, open_cpu),
        ];
        for (name, r, ns, cpu) in cases {
            match r {
                Some(r) => println!(
                    "  {name}: measured {r:.0}/s with encryption; without it at most {:.0}/s; ratio >= {:.3} by wall time, {:.3} by CPU time (target 0.9)",
                    1.0 / (1.0 / r - ns * 1e-9),
                    1.0 - r * ns * 1e-9,
                    1.0 - r * cpu * 1e-9
                ),
                None => println!("  {name}: no {name}.json in {} yet (run `codepool-bench {name}` first)", out_dir.display()),
            }
        }
        println!("results: {}", path.display());
    }
    Ok(())
}
