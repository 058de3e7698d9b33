//! Mosquitto's MQTT bridges (`connection` blocks in mosquitto.conf), configured as
//! `[[bridge]]` tables of `warren.toml`: `config` is the table's format and checks, `link`
//! the bridge's logic without I/O, `mqtt` one session over rumqttc, `status` what the
//! operator sees; [`run`] is one bridge's life (sessions, the next address, the wait).
//!
//! The local end is a client of this broker's own MQTT listener over loopback (MQTT 5, a
//! persistent session unless `local_cleansession`), as a shovel's local end is a client of
//! its AMQP listener: the broker's sessions, permissions and queues apply to the bridge as
//! to any client, and the same link runs against any broker. docs/bridges.md is the user's
//! side.

pub mod config;
pub mod link;
pub mod mqtt;
pub mod status;
pub mod tls;

pub use config::{BridgeConfig, Bridges};

use crate::backoff;
use crate::status::State;
use config::Restart;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use warren_core::escape::Escaped;

/// This host's name (Mosquitto's default client ids are `HOSTNAME.NAME`).
pub fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty() && h.len() <= 253)
        .unwrap_or_else(|| "warren".to_string())
}

fn log_state(name: &str, state: State, reason: Option<&str>, address: Option<&str>) {
    match (state, reason) {
        (State::Terminated, Some(r)) => {
            tracing::warn!(bridge = %Escaped(name), "bridge terminated: {}", Escaped(r))
        }
        (State::Running, _) => tracing::info!(
            bridge = %Escaped(name),
            "bridge running, connected to {}",
            address.unwrap_or("?")
        ),
        (s, _) => tracing::info!(bridge = %Escaped(name), "bridge {}", s.as_str()),
    }
}

/// One bridge's life until `stop`: sessions to its addresses (in order after failures;
/// with `round_robin` false a session on a secondary ends when the primary is back), a
/// `restart_timeout` wait between them, one log line per state change.
pub async fn run(
    cfg: Arc<BridgeConfig>,
    local: Option<SocketAddr>,
    hostname: String,
    entry: Arc<status::Entry>,
    now_ms: fn() -> u64,
    mut stop: watch::Receiver<bool>,
) {
    let name = cfg.name.clone();
    log_state(&name, State::Starting, None, None);
    let mut logged: Option<String> = None;
    let mut index = 0usize;
    let mut last_wait = Duration::ZERO;
    // The local state topic may hold the `1` of a process before this one.
    let mut stale = cfg.notifications;
    loop {
        let addr = &cfg.addresses[index % cfg.addresses.len()];
        let started = tokio::time::Instant::now();
        let running_entry = entry.clone();
        let running_name = name.clone();
        let running = move |a: &config::Address| {
            let a = a.to_string();
            if running_entry.set(State::Running, None, Some(a.clone()), now_ms()) {
                log_state(&running_name, State::Running, None, Some(&a));
            }
        };
        let ctx = mqtt::Ctx {
            cfg: &cfg,
            hostname: &hostname,
            local,
            counters: &entry.counters,
            running: &running,
            now_ms,
        };
        let outcome = mqtt::session(&ctx, addr, index, &mut stop).await;
        let err = match outcome {
            Ok(mqtt::Ended::Stopped) => break,
            Err(e) => e,
        };
        let reason = err.to_string();
        let was_running = entry.state() == State::Running;
        if std::mem::take(&mut stale)
            && !was_running
            && let Err(e) = mqtt::notify_down(&ctx).await
        {
            tracing::debug!(bridge = %Escaped(&name), "state topic not set to 0: {e}");
        }
        entry.set(State::Terminated, Some(reason.clone()), None, now_ms());
        if was_running || logged.as_ref() != Some(&reason) {
            log_state(&name, State::Terminated, Some(&reason), None);
            logged = Some(reason.clone());
        }
        let wait = match err {
            mqtt::SessionError::PrimaryBack(_) => {
                index = 0;
                Duration::from_millis(100)
            }
            _ => {
                index = (index + 1) % cfg.addresses.len();
                match cfg.restart {
                    Restart::Constant(d) => d,
                    Restart::Jitter { base, cap } => {
                        // A session that ran longer than the cap was not part of a storm.
                        if started.elapsed() > cap {
                            last_wait = Duration::ZERO;
                        }
                        last_wait = link::decorrelated(base, cap, last_wait, backoff::draw());
                        last_wait
                    }
                }
            }
        };
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        if *stop.borrow() {
            break;
        }
        entry
            .counters
            .reconnects
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        entry.set(State::Starting, Some(reason), None, now_ms());
    }
}
