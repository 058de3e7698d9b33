//! `--svg DIR`: one hand-written SVG per workload (no plotting dependency): received msg/s
//! over time on top, latency p50/p99 over time below on a log scale (latencies span
//! microseconds to seconds within one run).

use super::report::{Point, Row};
use anyhow::Context;
use std::fmt::Write;
use std::path::{Path, PathBuf};

const W: f64 = 800.0;
const PANEL: f64 = 200.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 50.0;

/// Writes `<dir>/<workload>.svg` for every row with a timeline; returns the paths.
pub fn write_all(dir: &Path, rows: &[Row]) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    for r in rows.iter().filter(|r| !r.timeline.is_empty()) {
        let file: String = r
            .workload
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let path = dir.join(format!("{file}.svg"));
        std::fs::write(&path, render(r)).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn render(r: &Row) -> String {
    let pts = &r.timeline;
    let t_max = pts.last().map_or(1.0, |p| p.t).max(1e-3);
    let x = |t: f64| LEFT + (W - LEFT - RIGHT) * t / t_max;
    let h = TOP + 2.0 * PANEL + GAP + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="20" font-size="14">{} — sent {:.0} msg/s, received {:.0} msg/s</text>"#,
        escape(&r.workload),
        r.sent_rate(),
        r.received_rate()
    );

    // Rate panel, linear from 0.
    let top = TOP;
    let r_max = pts.iter().map(|p| p.received_per_sec).fold(1.0, f64::max);
    let y_rate = |v: f64| top + PANEL - PANEL * v / r_max;
    frame(&mut s, top, "received msg/s", &format!("{r_max:.0}"), "0");
    polyline(
        &mut s,
        pts.iter().map(|p| (x(p.t), y_rate(p.received_per_sec))),
        "#1f77b4",
    );

    // Latency panel, log10 of milliseconds between the run's extremes.
    let top = TOP + PANEL + GAP;
    let lat = |p: &Point| [p.p50_us, p.p99_us];
    let all: Vec<f64> = pts
        .iter()
        .flat_map(lat)
        .flatten()
        .map(|us| (us.max(1) as f64 / 1000.0).log10())
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min).floor();
    let hi = all.iter().copied().fold(f64::NEG_INFINITY, f64::max).ceil();
    if lo.is_finite() && hi.is_finite() {
        let span = (hi - lo).max(1.0);
        let y_lat =
            |us: u64| top + PANEL - PANEL * ((us.max(1) as f64 / 1000.0).log10() - lo) / span;
        frame(
            &mut s,
            top,
            "latency ms (log)",
            &fmt_ms(10f64.powf(lo + span)),
            &fmt_ms(10f64.powf(lo)),
        );
        for (i, (name, color)) in [("p50", "#2ca02c"), ("p99", "#d62728")].iter().enumerate() {
            polyline(
                &mut s,
                pts.iter()
                    .filter_map(|p| lat(p)[i].map(|us| (x(p.t), y_lat(us)))),
                color,
            );
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" fill="{color}">{name}</text>"#,
                W - RIGHT - 60.0 + 30.0 * i as f64,
                top - 5.0
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">seconds (0 - {t_max:.1})</text>"#,
        LEFT + (W - LEFT - RIGHT) / 2.0,
        top + PANEL + 30.0
    );
    s.push_str("</svg>\n");
    s
}

fn frame(s: &mut String, top: f64, label: &str, y_hi: &str, y_lo: &str) {
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{top}" width="{}" height="{PANEL}" fill="none" stroke="#888"/>"##,
        W - LEFT - RIGHT
    );
    let _ = writeln!(s, r#"<text x="{LEFT}" y="{}">{label}</text>"#, top - 5.0);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">{y_hi}</text>"#,
        LEFT - 5.0,
        top + 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="end">{y_lo}</text>"#,
        LEFT - 5.0,
        top + PANEL
    );
}

fn polyline(s: &mut String, points: impl Iterator<Item = (f64, f64)>, color: &str) {
    let mut p = String::new();
    for (x, y) in points {
        let _ = write!(p, "{x:.1},{y:.1} ");
    }
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
        p.trim_end()
    );
}

fn fmt_ms(ms: f64) -> String {
    if ms < 1.0 {
        format!("{ms:.3}")
    } else {
        format!("{ms:.0}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_both_panels() {
        let row = Row {
            workload: "a<b".into(),
            seconds: 1.0,
            sent: 10,
            received: 10,
            latency: None,
            rss_peak: None,
            cpu_pct: None,
            errors: vec![],
            timeline: vec![
                Point {
                    t: 0.1,
                    received_per_sec: 100.0,
                    p50_us: Some(50),
                    p99_us: Some(900),
                },
                Point {
                    t: 0.2,
                    received_per_sec: 0.0,
                    p50_us: None,
                    p99_us: None,
                },
            ],
        };
        let svg = render(&row);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains("a&lt;b"));
    }
}
