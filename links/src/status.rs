//! What every link is doing, for `GET /api/shovels`, `warren ctl shovel-status` and
//! Prometheus: RabbitMQ's status shape (state `starting` / `running` / `terminated` with
//! the reason) plus the counters Warren keeps (messages moved, reconnects).

use crate::shovel::Kind;
use crate::shovel::config::{ShovelConfig, Source};
use crate::shovel::link::redact;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// A link's state, RabbitMQ's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Connecting both ends.
    Starting,
    /// Moving messages.
    Running,
    /// Stopped by a failure (a reconnect follows) or done.
    Terminated,
}

impl State {
    /// RabbitMQ's name.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Terminated => "terminated",
        }
    }
}

/// One shovel's status.
pub struct Entry {
    cfg: Arc<ShovelConfig>,
    kind: Kind,
    state: Mutex<(State, Option<String>, u64)>,
    /// Messages moved (as the ack mode counts), over the shovel's life on this node.
    pub moved: AtomicU64,
    /// Reconnects after a failure.
    pub reconnects: AtomicU64,
}

impl Entry {
    /// Sets the state (and the reason of a termination) at `now_ms`; whether it changed.
    pub fn set(&self, state: State, reason: Option<String>, now_ms: u64) -> bool {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.0 == state && s.1 == reason {
            return false;
        }
        *s = (state, reason, now_ms);
        true
    }

    /// The state now.
    pub fn state(&self) -> State {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }
}

/// Every link's status, by (vhost, name).
#[derive(Default)]
pub struct Registry {
    entries: Mutex<BTreeMap<(String, String), Arc<Entry>>>,
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of Unix milliseconds, RabbitMQ's `timestamp` format.
fn timestamp(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// A Prometheus label value, escaped.
fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Registry {
    /// The entry of a shovel that starts now (replacing an older one of the same name).
    pub fn add(
        &self,
        (vhost, name): (&str, &str),
        cfg: Arc<ShovelConfig>,
        kind: Kind,
        now_ms: u64,
    ) -> Arc<Entry> {
        let e = Arc::new(Entry {
            cfg,
            kind,
            state: Mutex::new((State::Starting, None, now_ms)),
            moved: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
        });
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((vhost.to_string(), name.to_string()), e.clone());
        e
    }

    /// Forgets a shovel (its parameter was cleared), if `entry` is still its entry.
    pub fn remove(&self, vhost: &str, name: &str, entry: &Arc<Entry>) {
        let mut map = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (vhost.to_string(), name.to_string());
        if map.get(&key).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            map.remove(&key);
        }
    }

    fn snapshot(&self) -> Vec<((String, String), Arc<Entry>)> {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect()
    }

    /// `GET /api/shovels`' rows, RabbitMQ's shape, by vhost and name.
    pub fn rows(&self, node: &str) -> Vec<Value> {
        self.snapshot()
            .into_iter()
            .map(|((vhost, name), e)| {
                let (state, reason, since) = e
                    .state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                let mut row = json!({
                    "node": node, "timestamp": timestamp(since), "name": name,
                    "vhost": vhost, "type": e.kind.as_str(), "state": state.as_str(),
                    "messages_moved": e.moved.load(Ordering::Relaxed),
                    "reconnects": e.reconnects.load(Ordering::Relaxed),
                });
                if let Some(r) = reason {
                    row["reason"] = json!(r);
                }
                if state == State::Running {
                    let c = &e.cfg;
                    let first = |u: &[String]| redact(u.first().map_or("", String::as_str));
                    row["src_uri"] = json!(first(&c.src_uris));
                    row["src_protocol"] = json!("amqp091");
                    row["dest_protocol"] = json!("amqp091");
                    row["dest_uri"] = json!(first(&c.dest_uris));
                    match &c.source {
                        Source::Queue(q) => row["src_queue"] = json!(q),
                        Source::Exchange { exchange, key } => {
                            row["src_exchange"] = json!(exchange);
                            row["src_exchange_key"] = json!(key);
                        }
                    }
                    if let Some(q) = &c.dest_queue {
                        row["dest_queue"] = json!(q);
                    }
                    if let Some(x) = &c.dest_exchange {
                        row["dest_exchange"] = json!(x);
                    }
                    if let Some(k) = &c.dest_exchange_key {
                        row["dest_exchange_key"] = json!(k);
                    }
                }
                row
            })
            .collect()
    }

    /// The `warren_shovel_*` metrics, Prometheus text.
    pub fn metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let all = self.snapshot();
        let _ = writeln!(
            out,
            "# HELP warren_shovel_state Shovels by state (1 for the state it is in)\n\
             # TYPE warren_shovel_state gauge"
        );
        for ((vhost, name), e) in &all {
            let now = e.state();
            for s in [State::Starting, State::Running, State::Terminated] {
                let _ = writeln!(
                    out,
                    "warren_shovel_state{{vhost=\"{}\",shovel=\"{}\",state=\"{}\"}} {}",
                    label(vhost),
                    label(name),
                    s.as_str(),
                    u8::from(s == now)
                );
            }
        }
        for (metric, help, read) in [
            (
                "warren_shovel_messages_moved_total",
                "Messages a shovel moved (settled as its ack mode says)",
                (|e: &Entry| e.moved.load(Ordering::Relaxed)) as fn(&Entry) -> u64,
            ),
            (
                "warren_shovel_reconnects_total",
                "Reconnects of a shovel after a failure",
                |e: &Entry| e.reconnects.load(Ordering::Relaxed),
            ),
        ] {
            let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} counter");
            for ((vhost, name), e) in &all {
                let _ = writeln!(
                    out,
                    "{metric}{{vhost=\"{}\",shovel=\"{}\"}} {}",
                    label(vhost),
                    label(name),
                    read(e)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_as_rabbitmq_prints_them() {
        assert_eq!(super::timestamp(1_796_161_083_000), "2026-12-01 21:38:03");
        assert_eq!(super::timestamp(0), "1970-01-01 00:00:00");
    }
}
