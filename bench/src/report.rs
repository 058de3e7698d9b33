//! Measurement and output: a fixed-size latency histogram, broker RSS/CPU from /proc, and the
//! results as an aligned table, JSON or CSV.

use serde_json::json;

/// Values below this many microseconds get a bucket each; above, 32 buckets per power of two
/// (about 3 % precision), up to u64::MAX: a fixed 1,920 counters whatever the run length.
const LINEAR: u64 = 64;
const SUB_BITS: u32 = 5;
const BUCKETS: usize = 64 + (64 - 6) * 32;

pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            max: 0,
        }
    }
}

fn bucket(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= 6
    let sub = (v >> (exp - SUB_BITS)) & ((1 << SUB_BITS) - 1);
    64 + (exp as usize - 6) * 32 + sub as usize
}

/// The lowest value of bucket `i` (what a percentile reports).
fn bucket_low(i: usize) -> u64 {
    if i < LINEAR as usize {
        return i as u64;
    }
    let exp = (i - 64) / 32 + 6;
    let sub = ((i - 64) % 32) as u64;
    (1u64 << exp) | (sub << (exp as u32 - SUB_BITS))
}

impl Histogram {
    pub fn record(&mut self, micros: u64) {
        self.counts[bucket(micros)] += 1;
        self.total += 1;
        self.max = self.max.max(micros);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }

    /// The `q` quantile (0..=1) in microseconds; None without samples.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(bucket_low(i).min(self.max));
            }
        }
        Some(self.max)
    }

    pub fn max(&self) -> Option<u64> {
        (self.total > 0).then_some(self.max)
    }
}

/// The broker's resident memory and cumulative CPU time, from /proc/<pid>.
pub struct ProcSample {
    pub rss_bytes: u64,
    pub cpu_ticks: u64,
}

/// /proc reports CPU time in USER_HZ, which the Linux ABI fixes at 100 per second.
pub const TICKS_PER_SEC: f64 = 100.0;

pub fn sample_proc(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields after its ')' are fixed.
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(ProcSample {
        rss_bytes: kib * 1024,
        cpu_ticks: utime + stime,
    })
}

/// One slot of a run's timeline (the SVG plots): `t` is the slot's end, seconds from start.
pub struct Point {
    pub t: f64,
    pub received_per_sec: f64,
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
}

/// One result line.
pub struct Row {
    pub workload: String,
    pub seconds: f64,
    pub sent: u64,
    pub received: u64,
    pub latency: Option<Histogram>,
    pub rss_peak: Option<u64>,
    pub cpu_pct: Option<f64>,
    pub errors: Vec<String>,
    pub timeline: Vec<Point>,
}

impl Row {
    pub fn sent_rate(&self) -> f64 {
        rate(self.sent, self.seconds)
    }
    pub fn received_rate(&self) -> f64 {
        rate(self.received, self.seconds)
    }
    fn lat(&self, q: f64) -> Option<u64> {
        self.latency.as_ref().and_then(|h| h.quantile(q))
    }
    fn lat_max(&self) -> Option<u64> {
        self.latency.as_ref().and_then(Histogram::max)
    }
}

fn rate(n: u64, secs: f64) -> f64 {
    if secs > 0.0 { n as f64 / secs } else { 0.0 }
}

fn ms(us: Option<u64>) -> String {
    us.map_or("-".into(), |v| format!("{:.3}", v as f64 / 1000.0))
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Csv,
}

const COLUMNS: [&str; 11] = [
    "workload",
    "seconds",
    "sent msg/s",
    "received msg/s",
    "sent",
    "received",
    "p50 ms",
    "p99 ms",
    "max ms",
    "broker RSS MiB",
    "broker CPU %",
];

fn cells(r: &Row) -> Vec<String> {
    vec![
        r.workload.clone(),
        format!("{:.1}", r.seconds),
        format!("{:.0}", r.sent_rate()),
        format!("{:.0}", r.received_rate()),
        r.sent.to_string(),
        r.received.to_string(),
        ms(r.lat(0.5)),
        ms(r.lat(0.99)),
        ms(r.lat_max()),
        opt(r.rss_peak.map(|b| format!("{:.1}", b as f64 / 1048576.0))),
        opt(r.cpu_pct.map(|c| format!("{c:.0}"))),
    ]
}

pub fn render(rows: &[Row], format: Format) -> String {
    match format {
        Format::Table => {
            let mut all: Vec<Vec<String>> = vec![COLUMNS.iter().map(|c| c.to_string()).collect()];
            all.extend(rows.iter().map(cells));
            let widths: Vec<usize> = (0..COLUMNS.len())
                .map(|i| all.iter().map(|r| r[i].len()).max().unwrap_or(0))
                .collect();
            let mut out = String::new();
            for r in &all {
                let line: Vec<String> = r
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        if i == 0 {
                            format!("{c:<w$}", w = widths[i])
                        } else {
                            format!("{c:>w$}", w = widths[i])
                        }
                    })
                    .collect();
                out.push_str(line.join("  ").trim_end());
                out.push('\n');
            }
            for r in rows {
                for e in r.errors.iter().take(5) {
                    out.push_str(&format!("error in {}: {e}\n", r.workload));
                }
            }
            out
        }
        Format::Csv => {
            let mut out = COLUMNS.join(",");
            out.push_str(",errors\n");
            for r in rows {
                out.push_str(&cells(r).join(","));
                out.push_str(&format!(",{}\n", r.errors.len()));
            }
            out
        }
        Format::Json => {
            let v: Vec<_> = rows
                .iter()
                .map(|r| {
                    json!({
                        "workload": r.workload,
                        "seconds": r.seconds,
                        "sent": r.sent,
                        "received": r.received,
                        "sent_per_sec": r.sent_rate().round(),
                        "received_per_sec": r.received_rate().round(),
                        "latency_us": {
                            "p50": r.lat(0.5),
                            "p99": r.lat(0.99),
                            "max": r.lat_max(),
                        },
                        "broker_rss_bytes": r.rss_peak,
                        "broker_cpu_pct": r.cpu_pct.map(|c| (c * 10.0).round() / 10.0),
                        "errors": r.errors,
                    })
                })
                .collect();
            let mut s = serde_json::to_string_pretty(&v).unwrap_or_default();
            s.push('\n');
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_trip() {
        for v in [
            0,
            1,
            63,
            64,
            65,
            100,
            1000,
            123_456,
            10_000_000,
            u64::MAX / 3,
        ] {
            let low = bucket_low(bucket(v));
            assert!(low <= v, "{v}: {low}");
            assert!(v - low <= v / 32 + 1, "{v}: {low}");
        }
        assert!(bucket(u64::MAX) < BUCKETS);
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.5), None);
        for v in 1..=1000 {
            h.record(v);
        }
        let p50 = h.quantile(0.5).unwrap();
        assert!((480..=500).contains(&p50), "{p50}");
        assert_eq!(h.max(), Some(1000));
        assert!(h.quantile(1.0).unwrap() <= 1000);
    }
}
