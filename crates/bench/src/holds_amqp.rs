//! The AMQP door's side of `holds` (issue 57: CPU per code at both doors):
//! 2-item bundles against orders of 2 through the dispatcher, each side's
//! purchases preloaded before its clock, as `dispatch` runs them. Holds
//! have no AMQP door.

use codepool_dispatcher::DispatcherConfig;
use codepool_domain::{Item, Purchase};
use serde_json::{json, Value};

use crate::api::Meter;
use crate::{inproc, Scratch};

const BUNDLE_POOLS: [&str; 2] = ["ab1", "ab2"];
const PAIR_POOL: &str = "aq";

/// The pools it takes, for `n` purchases of each side in all.
pub(crate) fn pools(n: usize) -> Vec<(String, usize)> {
    vec![
        (BUNDLE_POOLS[0].to_owned(), n),
        (BUNDLE_POOLS[1].to_owned(), n),
        (PAIR_POOL.to_owned(), 2 * n),
    ]
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Pairs,
    Bundles,
}

impl Side {
    /// Purchase `i` of round tag `tag`: 2 codes either way.
    fn purchase(self, tag: &str, i: usize) -> Purchase {
        let mut p = inproc::purchase(tag, PAIR_POOL, i);
        p.quantity = 2;
        if self == Side::Bundles {
            p.pool = BUNDLE_POOLS[0].to_owned();
            p.items = (BUNDLE_POOLS.iter())
                .map(|pool| Item {
                    pool: (*pool).to_owned(),
                    quantity: 1,
                })
                .collect();
        }
        p
    }
}

/// One side's run: codes per second, the servers' CPU per code, and
/// where it went (CPU by process, mongod's commands per code).
async fn run_side(
    scratch: &'static Scratch,
    side: Side,
    tag: &str,
    n: usize,
) -> anyhow::Result<Value> {
    let conn = inproc::preload_purchases(scratch, "codepool-bench-holds-amqp", n, |i| {
        side.purchase(tag, i)
    })
    .await?;
    inproc::checkpoint(scratch).await?;
    let codes = 2 * n;
    let meter = Meter::start(&scratch.store).await;
    let run = inproc::start(scratch, &DispatcherConfig::default())?
        .finish(n as u64)
        .await?;
    let (_, mut detail) = meter.finish(&scratch.store, codes).await;
    let _ = conn.close(200, "benchmark done").await;
    let per_code = |s: f64| s * 1000.0 / codes as f64;
    // As the HTTP side counts it: the load generator's threads left out.
    let (server_ms, _) = crate::server_and_clients_ms(&run.cpu, codes);
    detail["cpu_ms_per_code"] = (run.cpu.iter())
        .map(|(p, s)| ((*p).to_owned(), json!(per_code(*s))))
        .collect::<serde_json::Map<_, _>>()
        .into();
    detail["codes_per_sec"] = json!(codes as f64 / run.elapsed.as_secs_f64().max(1e-9));
    detail["server_cpu_ms_per_code"] = json!(server_ms);
    Ok(detail)
}

/// `rounds` alternating rounds of `n` purchases a side: the medians of
/// bundles / orders of 2 in codes per second and in servers' CPU per code,
/// and whether every code was granted.
pub(crate) async fn compare(
    scratch: &'static Scratch,
    rounds: usize,
    n: usize,
    say: impl Fn(String),
) -> anyhow::Result<Value> {
    let mut rows = Vec::new();
    for round in 0..rounds {
        let mut order = [Side::Pairs, Side::Bundles];
        if round % 2 == 1 {
            order.reverse();
        }
        let (mut pairs, mut bundles) = (Value::Null, Value::Null);
        for side in order {
            let (name, tag) = match side {
                Side::Pairs => ("orders of 2", format!("ap{round}")),
                Side::Bundles => ("2-item bundles", format!("abn{round}")),
            };
            say(format!("round {}: AMQP {name} × {n} …", round + 1));
            let got = run_side(scratch, side, &tag, n).await?;
            match side {
                Side::Pairs => pairs = got,
                Side::Bundles => bundles = got,
            }
        }
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        rows.push(json!({
            "round": round + 1,
            "ratio": f(&bundles, "codes_per_sec") / f(&pairs, "codes_per_sec"),
            "cpu_ratio": f(&bundles, "server_cpu_ms_per_code") / f(&pairs, "server_cpu_ms_per_code"),
            "pairs": pairs,
            "bundles": bundles,
        }));
    }
    let median_of = |key: &str| {
        let mut v: Vec<f64> = rows.iter().filter_map(|r| r[key].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let (median, cpu) = (median_of("ratio"), median_of("cpu_ratio"));
    let issued = |pools: &[&str]| {
        crate::count_codes(
            &scratch.store,
            mongodb::bson::doc! {"pool": {"$in": pools}, "status": 1},
        )
    };
    let (bundled, paired) = (issued(&BUNDLE_POOLS).await?, issued(&[PAIR_POOL]).await?);
    let want = (2 * n * rounds) as u64;
    Ok(json!({
        "a": "AMQP orders of 2", "b": "AMQP 2-item bundles",
        "rounds": rows, "median_ratio": median, "median_cpu_ratio": cpu,
        "checks": {"bundled_codes": bundled, "paired_codes": paired, "expected_each": want,
                   "ok": bundled == want && paired == want},
    }))
}
