//! Named pauses for the suite's crash tests, so that a `kill -9` lands
//! between two steps: `CODEPOOL_FAILPOINTS=bundle-pause=60000,...`
//! (milliseconds). Compiled only with the `failpoints` feature; every
//! other build has no pause and reads no variable.

use std::time::Duration;

/// How long to pause at failpoint `name`, if the suite set one.
#[cfg(feature = "failpoints")]
pub(crate) fn pause(name: &str) -> Option<Duration> {
    static SET: std::sync::OnceLock<Vec<(String, Duration)>> = std::sync::OnceLock::new();
    let set = SET.get_or_init(|| {
        let spec = std::env::var("CODEPOOL_FAILPOINTS").unwrap_or_default();
        (spec.split(','))
            .filter_map(|p| p.split_once('='))
            .filter_map(|(n, ms)| {
                Some((
                    n.trim().to_owned(),
                    Duration::from_millis(ms.trim().parse().ok()?),
                ))
            })
            .collect()
    });
    set.iter().find(|(n, _)| n == name).map(|(_, d)| *d)
}

/// Without the `failpoints` feature there is no pause.
#[cfg(not(feature = "failpoints"))]
pub(crate) fn pause(_name: &str) -> Option<Duration> {
    None
}
