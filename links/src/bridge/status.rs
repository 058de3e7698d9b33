//! What every bridge is doing: its state (the shovels' names: `starting`, `running`,
//! `terminated` with the reason), the address it is connected to, messages moved each way,
//! messages dropped (echoes, no topic line), reconnects; the `warren_bridge_*` metrics.

use super::link::Side;
use crate::status::State;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// A bridge's counters, over its life in this process.
#[derive(Default)]
pub struct Counters {
    /// Copies moved out (local to remote) and in: QoS 1 once the far side acknowledged
    /// them, QoS 0 once written.
    pub out: AtomicU64,
    pub inward: AtomicU64,
    /// Messages not forwarded (echoes of a 3.1.1 remote, no topic line).
    pub dropped: AtomicU64,
    /// Reconnects after a failure.
    pub reconnects: AtomicU64,
}

impl Counters {
    /// A copy of a message from `from` moved.
    pub fn moved(&self, from: Side) {
        match from {
            Side::Local => &self.out,
            Side::Remote => &self.inward,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// A message from `from` was not forwarded.
    pub fn dropped(&self, _from: Side) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// One bridge's status.
pub struct Entry {
    pub name: String,
    /// (state, reason, since ms, connected address).
    state: Mutex<(State, Option<String>, u64, Option<String>)>,
    pub counters: Counters,
}

impl Entry {
    /// A bridge starting at `now_ms`.
    pub fn new(name: &str, now_ms: u64) -> Arc<Entry> {
        Arc::new(Entry {
            name: name.to_string(),
            state: Mutex::new((State::Starting, None, now_ms, None)),
            counters: Counters::default(),
        })
    }

    /// Sets the state; whether it changed.
    pub fn set(
        &self,
        state: State,
        reason: Option<String>,
        address: Option<String>,
        now_ms: u64,
    ) -> bool {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.0 == state && s.1 == reason && s.3 == address {
            return false;
        }
        *s = (state, reason, now_ms, address);
        true
    }

    /// The state now.
    pub fn state(&self) -> State {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// The status row (`warren_links::Supervisor::bridges`).
    pub fn row(&self) -> Value {
        let (state, reason, since, address) = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let c = &self.counters;
        let mut row = json!({
            "name": self.name, "type": "mqtt-bridge", "state": state.as_str(),
            "since_ms": since,
            "messages_out": c.out.load(Ordering::Relaxed),
            "messages_in": c.inward.load(Ordering::Relaxed),
            "messages_dropped": c.dropped.load(Ordering::Relaxed),
            "reconnects": c.reconnects.load(Ordering::Relaxed),
        });
        if let Some(r) = reason {
            row["reason"] = json!(r);
        }
        if let Some(a) = address {
            row["address"] = json!(a);
        }
        row
    }
}

fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The `warren_bridge_*` metrics of `all`, Prometheus text.
pub fn metrics(all: &[Arc<Entry>], out: &mut String) {
    use std::fmt::Write;
    if all.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "# HELP warren_bridge_state MQTT bridges by state (1 for the state it is in)\n\
         # TYPE warren_bridge_state gauge"
    );
    for e in all {
        let now = e.state();
        for s in [State::Starting, State::Running, State::Terminated] {
            let _ = writeln!(
                out,
                "warren_bridge_state{{bridge=\"{}\",state=\"{}\"}} {}",
                label(&e.name),
                s.as_str(),
                u8::from(s == now)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP warren_bridge_messages_total Messages an MQTT bridge moved (QoS 1: acknowledged by the far side)\n\
         # TYPE warren_bridge_messages_total counter"
    );
    for e in all {
        for (dir, n) in [("out", &e.counters.out), ("in", &e.counters.inward)] {
            let _ = writeln!(
                out,
                "warren_bridge_messages_total{{bridge=\"{}\",direction=\"{dir}\"}} {}",
                label(&e.name),
                n.load(Ordering::Relaxed)
            );
        }
    }
    for (metric, help, read) in [
        (
            "warren_bridge_messages_dropped_total",
            "Messages an MQTT bridge did not forward (echoes of its own, no topic line)",
            (|c: &Counters| c.dropped.load(Ordering::Relaxed)) as fn(&Counters) -> u64,
        ),
        (
            "warren_bridge_reconnects_total",
            "Reconnects of an MQTT bridge after a failure",
            |c: &Counters| c.reconnects.load(Ordering::Relaxed),
        ),
    ] {
        let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} counter");
        for e in all {
            let _ = writeln!(
                out,
                "{metric}{{bridge=\"{}\"}} {}",
                label(&e.name),
                read(&e.counters)
            );
        }
    }
}
