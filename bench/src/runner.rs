//! What every workload shares, whatever the protocol: the clock in payload timestamps, the
//! sent/received counters, the timeline behind the SVG plots, and the supervisor that shows
//! progress, samples the broker's /proc figures and turns the finished tasks into a row.

use super::report::{self, Histogram, Point, Row};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};

/// Tasks get this long past the deadline to stop and close before they are abandoned.
const GRACE: Duration = Duration::from_secs(5);
/// The timeline has at most this many slots (bounds its memory: ~15 KiB per used slot).
const MAX_SLOTS: u64 = 600;
/// Finest timeline resolution.
const MIN_SLOT: Duration = Duration::from_millis(100);

/// Send timestamps are nanoseconds since this process-wide instant; producers and consumers
/// run in the same process, so no clock agreement is needed.
pub fn now_nanos() -> u64 {
    static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_nanos() as u64
}

#[derive(Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub received: AtomicU64,
}

/// Received messages and latencies per time slot of one run.
pub struct Timeline {
    start: u64,
    slot: u64,
    slots: Mutex<Vec<(u64, Option<Histogram>)>>,
}

impl Timeline {
    pub fn new(seconds: u64) -> Arc<Timeline> {
        let slot = (Duration::from_secs(seconds) / MAX_SLOTS as u32).max(MIN_SLOT);
        Arc::new(Timeline {
            start: now_nanos(),
            slot: slot.as_nanos() as u64,
            slots: Mutex::new(Vec::new()),
        })
    }

    fn index(&self, now: u64) -> usize {
        // Deliveries after the deadline (the grace period) land in the last slot.
        (now.saturating_sub(self.start) / self.slot).min(MAX_SLOTS - 1) as usize
    }

    fn add(&self, index: usize, count: u64, hist: &Histogram) {
        let Ok(mut slots) = self.slots.lock() else {
            return;
        };
        if slots.len() <= index {
            slots.resize_with(index + 1, || (0, None));
        }
        let slot = &mut slots[index];
        slot.0 += count;
        if hist.max().is_some() {
            slot.1.get_or_insert_with(Histogram::default).merge(hist);
        }
    }

    /// One point per slot: received msg/s and latency quantiles.
    pub fn points(&self) -> Vec<Point> {
        let secs = self.slot as f64 / 1e9;
        let Ok(slots) = self.slots.lock() else {
            return Vec::new();
        };
        slots
            .iter()
            .enumerate()
            .map(|(i, (n, h))| Point {
                t: (i + 1) as f64 * secs,
                received_per_sec: *n as f64 / secs,
                p50_us: h.as_ref().and_then(|h| h.quantile(0.5)),
                p99_us: h.as_ref().and_then(|h| h.quantile(0.99)),
            })
            .collect()
    }
}

/// A consumer's view of the timeline: it accumulates the current slot locally and hands it
/// over when the slot changes (and when dropped), so the lock is taken ~10 times a second.
pub struct Recorder {
    timeline: Arc<Timeline>,
    index: usize,
    count: u64,
    hist: Histogram,
}

impl Recorder {
    pub fn new(timeline: Arc<Timeline>) -> Recorder {
        Recorder {
            timeline,
            index: 0,
            count: 0,
            hist: Histogram::default(),
        }
    }

    fn at(&mut self, now: u64) {
        let i = self.timeline.index(now);
        if i != self.index {
            self.flush();
            self.index = i;
        }
    }

    fn flush(&mut self) {
        if self.count > 0 || self.hist.max().is_some() {
            self.timeline.add(self.index, self.count, &self.hist);
            self.count = 0;
            self.hist = Histogram::default();
        }
    }

    pub fn received(&mut self, now: u64, n: u64) {
        self.at(now);
        self.count += n;
    }

    pub fn latency(&mut self, now: u64, micros: u64) {
        self.at(now);
        self.hist.record(micros);
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A client task's result: its latency histogram if it consumed.
pub type Task = JoinHandle<anyhow::Result<Option<Histogram>>>;

/// Shows progress and samples the broker until the deadline, or until every task finished
/// (drains and count-bounded runs), then collects the tasks into a row.
pub async fn supervise(
    name: String,
    (start, deadline): (Instant, Instant),
    broker_pid: Option<u32>,
    counters: &Counters,
    timeline: &Timeline,
    tasks: Vec<Task>,
) -> Row {
    let seconds = deadline.duration_since(start).as_secs();
    let cpu_start = broker_pid.and_then(report::sample_proc);
    let bar = ProgressBar::new(seconds);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>26} [{bar:30}] {pos:>3}/{len}s {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(name.clone());
    let mut rss_peak = None;
    let mut last = (start, 0u64, 0u64);
    let mut tick = tokio::time::interval(MIN_SLOT);
    tick.tick().await;
    let mut ticks = 0u64;
    let end = loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = sleep_until(deadline) => break deadline,
        }
        if tasks.iter().all(JoinHandle::is_finished) {
            break Instant::now();
        }
        ticks += 1;
        if !ticks.is_multiple_of(10) {
            continue;
        }
        let now = Instant::now();
        let (s, r) = (
            counters.sent.load(Ordering::Relaxed),
            counters.received.load(Ordering::Relaxed),
        );
        let dt = now.duration_since(last.0).as_secs_f64().max(1e-3);
        bar.set_position(now.duration_since(start).as_secs());
        bar.set_message(format!(
            "sent {:.0}/s, received {:.0}/s",
            (s - last.1) as f64 / dt,
            (r - last.2) as f64 / dt
        ));
        last = (now, s, r);
        if let Some(p) = broker_pid.and_then(report::sample_proc) {
            rss_peak = Some(rss_peak.unwrap_or(0).max(p.rss_bytes));
        }
    };
    let cpu_end = broker_pid.and_then(report::sample_proc);
    if let Some(p) = &cpu_end {
        rss_peak = Some(rss_peak.unwrap_or(0).max(p.rss_bytes));
    }
    bar.finish_and_clear();

    let mut latency = Histogram::default();
    let mut errors = Vec::new();
    for t in tasks {
        let abort = t.abort_handle();
        match tokio::time::timeout_at(deadline.max(Instant::now()) + GRACE, t).await {
            Ok(Ok(Ok(Some(h)))) => latency.merge(&h),
            Ok(Ok(Ok(None))) => {}
            Ok(Ok(Err(e))) => errors.push(format!("{e:#}")),
            Ok(Err(e)) => errors.push(format!("task failed: {e}")),
            Err(_) => {
                abort.abort();
                errors.push("a client did not stop within 5 s of the deadline".into());
            }
        }
    }
    let seconds = end.duration_since(start).as_secs_f64();
    let cpu_pct = match (cpu_start, cpu_end) {
        (Some(a), Some(b)) if seconds > 0.0 => Some(
            (b.cpu_ticks.saturating_sub(a.cpu_ticks)) as f64 / report::TICKS_PER_SEC / seconds
                * 100.0,
        ),
        _ => None,
    };
    Row {
        workload: name,
        seconds,
        sent: counters.sent.load(Ordering::Relaxed),
        received: counters.received.load(Ordering::Relaxed),
        latency: Some(latency),
        rss_peak,
        cpu_pct,
        errors,
        timeline: timeline.points(),
    }
}

/// Pacing for `--rate` (per producer) and `--count`: how many more messages may go now.
pub struct Pace {
    start: Instant,
    rate: u64,
    count: u64,
}

impl Pace {
    pub fn new(rate: u64, count: u64) -> Pace {
        Pace {
            start: Instant::now(),
            rate,
            count,
        }
    }

    /// Messages allowed now after `sent` (u64::MAX: no limit); 0 with `done` = count reached.
    pub fn room(&self, sent: u64) -> u64 {
        let mut room = u64::MAX;
        if self.count > 0 {
            room = self.count.saturating_sub(sent);
        }
        if self.rate > 0 {
            let due = (self.start.elapsed().as_secs_f64() * self.rate as f64) as u64 + 1;
            room = room.min(due.saturating_sub(sent));
        }
        room
    }

    pub fn done(&self, sent: u64) -> bool {
        self.count > 0 && sent >= self.count
    }

    /// When message number `sent` is due (rate limited runs).
    pub fn next_due(&self, sent: u64) -> Instant {
        if self.rate == 0 {
            return Instant::now();
        }
        self.start + Duration::from_secs_f64(sent as f64 / self.rate as f64)
    }
}
