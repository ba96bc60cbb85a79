//! The stock-over-time picture: a pool's unissued stock at each hour of
//! the last day, drawn as an inline SVG by the server. It is rebuilt from
//! what exists cheaply: the stock now, the grants per hour (one covered
//! scan of the `(pool, issued_at)` index over the day's grants) and the
//! day's imports, walking back from now: stock an hour ago = stock now +
//! codes granted since − codes imported since.

use chrono::{DateTime, Duration, Utc};
use maud::{html, Markup};

/// Hours the chart covers.
pub const HOURS: i64 = 24;

const W: f64 = 640.0;
const H: f64 = 180.0;
const PAD_L: f64 = 64.0;
const PAD_B: f64 = 24.0;
const PAD_T: f64 = 10.0;

/// The stock at the start of each of the last [`HOURS`] hours and now,
/// oldest first (`HOURS + 1` points).
pub fn stock_points(
    now: DateTime<Utc>,
    stock_now: u64,
    grants_by_hour: &[(DateTime<Utc>, u64)],
    imports: &[(DateTime<Utc>, u64)],
) -> Vec<(DateTime<Utc>, u64)> {
    (0..=HOURS)
        .map(|k| {
            let t = now - Duration::hours(HOURS - k);
            // Grants are bucketed by the hour they fell in: count a bucket
            // once its hour starts at or after `t`'s hour.
            let hour = t - Duration::seconds(t.timestamp().rem_euclid(3600));
            let granted: u64 = grants_by_hour
                .iter()
                .filter(|(h, _)| *h >= hour && k < HOURS)
                .map(|(_, n)| n)
                .sum();
            let imported: u64 = imports
                .iter()
                .filter(|(at, _)| *at > t)
                .map(|(_, n)| n)
                .sum();
            (t, (stock_now + granted).saturating_sub(imported))
        })
        .collect()
}

/// The picture, with its highest value and both ends of time labelled.
pub fn svg(pool: &str, points: &[(DateTime<Utc>, u64)]) -> Markup {
    let top = points.iter().map(|p| p.1).max().unwrap_or(0).max(1);
    let n = points.len().max(2) - 1;
    let x = |i: usize| PAD_L + (W - PAD_L - 8.0) * i as f64 / n as f64;
    let y = |v: u64| PAD_T + (H - PAD_T - PAD_B) * (1.0 - v as f64 / top as f64);
    let line: Vec<String> = points
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{:.1},{:.1}", x(i), y(p.1)))
        .collect();
    let area = format!(
        "{:.1},{:.1} {} {:.1},{:.1}",
        x(0),
        y(0),
        line.join(" "),
        x(n),
        y(0)
    );
    html! {
        svg.chart viewBox={"0 0 " (W) " " (H)} role="img"
            aria-label={"unissued stock of pool " (pool) " over the last 24 hours"} {
            title { "Unissued stock of " (pool) ", last 24 hours" }
            line x1=(PAD_L) y1=(y(0)) x2=(W - 8.0) y2=(y(0)) stroke="#9aa4b2" {}
            line x1=(PAD_L) y1=(PAD_T) x2=(PAD_L) y2=(y(0)) stroke="#9aa4b2" {}
            text x=(PAD_L - 6.0) y=(PAD_T + 10.0) text-anchor="end" font-size="11" { (crate::layout::count(top)) }
            text x=(PAD_L - 6.0) y=(y(0)) text-anchor="end" font-size="11" { "0" }
            text x=(PAD_L) y=(H - 6.0) font-size="11" { "24 h ago" }
            text x=(W - 8.0) y=(H - 6.0) text-anchor="end" font-size="11" { "now" }
            polygon points=(area) fill="#dbe7ff" stroke="none" {}
            polyline points=(line.join(" ")) fill="none" stroke="#2f5fd0" stroke-width="2" {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn stock_walks_back_from_now_through_grants_and_imports() {
        let now = Utc.with_ymd_and_hms(2026, 11, 25, 12, 30, 0).unwrap();
        let hour = |h| Utc.with_ymd_and_hms(2026, 11, 25, h, 0, 0).unwrap();
        // 10 granted in the 11:00 hour, 5 in the 12:00 hour; 100 imported at 11:10.
        let grants = [(hour(11), 10), (hour(12), 5)];
        let imports = [(hour(11) + Duration::minutes(10), 100)];
        let points = stock_points(now, 50, &grants, &imports);
        assert_eq!(points.len() as i64, HOURS + 1);
        assert_eq!(points.last().unwrap().1, 50, "now");
        // 11:30: 5 granted since 12:00 and 10 in the 11:00 hour counted
        // (its bucket starts at 11:00), nothing imported after 11:30.
        assert_eq!(points[HOURS as usize - 1].1, 65);
        // 10:30: before the import of 100.
        assert_eq!(points[HOURS as usize - 2].1, 0);
        let svg = svg("p<1>", &points).into_string();
        assert!(
            svg.contains("<polyline") && svg.contains("p&lt;1&gt;"),
            "{svg}"
        );
    }
}
