//! The supervisor: follows the broker's runtime parameters (polled, and at once when told
//! they changed), runs one task per shovel, restarts a failed one after a backoff, deletes
//! a shovel's parameter once `src-delete-after` is reached, and keeps the status. Static
//! shovels (the config file's `[[shovel]]` tables) run the same way from the start, with no
//! parameter behind them; a dynamic one of the same vhost and name is refused.
//!
//! In a cluster the dynamic shovels run on one node only, the metadata group's leader
//! ([`LocalBroker::leads`], re-checked on every change; a local-exchange source excepted:
//! `on_every_node`); docs/bridges.md, "Clusters".
//!
//! One log line per state change: a shovel that keeps failing the same way logs once, not
//! once per retry.

use crate::backoff::{self, Backoff};
use crate::bridge::Bridges;
use crate::shovel::amqp::{self, Ended};
use crate::shovel::config::ShovelConfig;
use crate::shovel::link::{Identity, Link};
use crate::shovel::uri;
use crate::shovel::{Kind, Shovels};
use crate::status::{Entry, Registry, State};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{Notify, watch};
use warren_core::escape::Escaped;
use warren_core::parameter::ParameterDef;
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};

/// How often the parameters are read when nobody said they changed (a cluster peer's
/// change arrives this way).
const POLL: Duration = Duration::from_secs(1);

/// The broker the links run in: where "the local broker" of a URI is.
#[derive(Clone, Debug)]
pub struct LocalBroker {
    /// Its plain AMQP listener, if it has one.
    pub amqp: Option<SocketAddr>,
    /// Its plain MQTT listener, if it has one (the local end of MQTT bridges).
    pub mqtt: Option<SocketAddr>,
    /// Its node name (`shovelled-by`, the status's `node`).
    pub node: String,
    /// In a cluster, "this node leads the metadata group": dynamic shovels run only while
    /// it is true, on one node of the cluster (their parameters are on every node). `None`:
    /// a single node, which runs them all. Static shovels and MQTT bridges ignore it.
    pub leads: Option<watch::Receiver<bool>>,
}

/// The running links.
pub struct Supervisor {
    broker: BrokerHandle,
    local: LocalBroker,
    status: Registry,
    changed: Notify,
    /// The MQTT bridges' status, in the order of the config file.
    bridges: Vec<Arc<crate::bridge::status::Entry>>,
    /// The static shovels' (vhost, name): no dynamic shovel may take them.
    statics: BTreeSet<(String, String)>,
}

struct Running {
    value: String,
    stop: watch::Sender<bool>,
}

/// Logs a shovel's state change.
pub(crate) fn log_state(name: &str, state: State, reason: Option<&str>) {
    match (state, reason) {
        (State::Terminated, Some(r)) => {
            tracing::warn!(shovel = %Escaped(name), "shovel terminated: {}", Escaped(r))
        }
        (s, _) => tracing::info!(shovel = %Escaped(name), "shovel {}", s.as_str()),
    }
}

fn unix_ms() -> u64 {
    warren_runtime::unix_ms()
}

impl Supervisor {
    /// Starts following `broker`'s parameters, and the MQTT `bridges` and static
    /// `shovels` of the config file, until `stopped` turns true.
    pub fn start(
        broker: BrokerHandle,
        local: LocalBroker,
        (bridges, shovels): (Bridges, Shovels),
        stopped: watch::Receiver<bool>,
    ) -> Arc<Supervisor> {
        let hostname = crate::bridge::hostname();
        let mut entries = Vec::new();
        for cfg in bridges.0 {
            let entry = crate::bridge::status::Entry::new(&cfg.name, unix_ms());
            entries.push(entry.clone());
            let (mqtt, host) = (local.mqtt, hostname.clone());
            let run =
                crate::bridge::run(Arc::new(cfg), mqtt, host, entry, unix_ms, stopped.clone());
            tokio::spawn(run);
        }
        let s = Arc::new(Supervisor {
            broker,
            local,
            status: Registry::default(),
            changed: Notify::new(),
            bridges: entries,
            statics: shovels
                .0
                .iter()
                .map(|x| (x.vhost.clone(), x.name.clone()))
                .collect(),
        });
        for x in shovels.0 {
            let key = (x.vhost.as_str(), x.name.as_str());
            let entry = s.status.add(key, x.cfg.clone(), Kind::Static, unix_ms());
            let run = s.clone().run(
                (x.vhost, x.name),
                x.cfg,
                Kind::Static,
                entry,
                stopped.clone(),
            );
            tokio::spawn(run);
        }
        let leads = s.local.leads.clone();
        tokio::spawn(s.clone().follow(stopped, leads));
        s
    }

    /// Checks a parameter as [`crate::validate`] does, and refuses a shovel parameter that
    /// would take a static shovel's vhost and name (RabbitMQ's text shape, one reason).
    pub fn validate(
        &self,
        component: &str,
        vhost: &str,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<(), String> {
        crate::validate(component, name, value)?;
        if component == crate::shovel::COMPONENT && self.is_static(vhost, name) {
            return Err(format!(
                "Validation failed\n\n{name} in vhost {vhost} is a static shovel of this \
                 broker's config file ([[shovel]]); a dynamic shovel needs another name\n"
            ));
        }
        Ok(())
    }

    fn is_static(&self, vhost: &str, name: &str) -> bool {
        self.statics
            .contains(&(vhost.to_string(), name.to_string()))
    }

    /// The MQTT bridges' status rows.
    pub fn bridges(&self) -> Vec<serde_json::Value> {
        self.bridges.iter().map(|e| e.row()).collect()
    }

    /// The parameters changed: read them now.
    pub fn changed(&self) {
        self.changed.notify_one();
    }

    /// `GET /api/shovels`' rows.
    pub fn shovels(&self) -> Vec<serde_json::Value> {
        self.status.rows(&self.local.node)
    }

    /// The `warren_shovel_*` and `warren_bridge_*` metrics.
    pub fn metrics(&self, out: &mut String) {
        self.status.metrics(out);
        crate::bridge::status::metrics(&self.bridges, out);
    }

    async fn follow(
        self: Arc<Self>,
        mut stopped: watch::Receiver<bool>,
        mut leads: Option<watch::Receiver<bool>>,
    ) {
        let mut running: BTreeMap<(String, String), Running> = BTreeMap::new();
        // Dynamic shovels not run because a static one has their name, warned about once.
        let mut shadowed: BTreeSet<(String, String)> = BTreeSet::new();
        // Whether this node runs the dynamic shovels (a cluster's metadata leader only).
        // A cluster node starts as none (logged once it leads).
        let mut here = leads.is_none();
        // The signal's sender went (the cluster stopped): none run here from then on.
        let mut lead_gone = false;
        loop {
            let now = !lead_gone && leads.as_mut().is_none_or(|l| *l.borrow_and_update());
            if now != here && leads.is_some() {
                tracing::info!(
                    "dynamic shovels: {}",
                    if now {
                        "this node leads the metadata group; it runs them"
                    } else {
                        "this node does not lead the metadata group; it runs none"
                    }
                );
            }
            here = now;
            if !here {
                // Stopped at once, without waiting for the parameters.
                running.retain(|_, r| {
                    let keep = on_every_node(&r.value);
                    if !keep {
                        let _ = r.stop.send(true);
                    }
                    keep
                });
            }
            if let Ok(AdminResponse::Parameters(ps)) =
                self.broker.admin(AdminRequest::ListParameters).await
            {
                // Read again: it may have turned while the parameters were read.
                let here = here && !lead_gone && leads.as_mut().is_none_or(|l| *l.borrow());
                self.reconcile(&mut running, &mut shadowed, ps, here);
            }
            tokio::select! {
                _ = stopped.changed() => break,
                _ = self.changed.notified() => {}
                ok = lead_changed(leads.as_mut()) => if !ok {
                    leads = None;
                    lead_gone = true;
                },
                _ = tokio::time::sleep(POLL) => {}
            }
            if *stopped.borrow() {
                break;
            }
        }
        for (_, r) in running {
            let _ = r.stop.send(true);
        }
    }

    /// Starts the shovels that are new or changed, stops those that are gone.
    fn reconcile(
        self: &Arc<Self>,
        running: &mut BTreeMap<(String, String), Running>,
        shadowed: &mut BTreeSet<(String, String)>,
        ps: Vec<ParameterDef>,
        leading: bool,
    ) {
        let mut wanted: BTreeMap<(String, String), String> = ps
            .into_iter()
            .filter(|p| p.component == crate::shovel::COMPONENT)
            .filter(|p| leading || on_every_node(&p.value))
            .map(|p| ((p.vhost, p.name), p.value))
            .collect();
        // Refused when set here; one can still come from a cluster peer with another
        // config file or a store written before the [[shovel]] table was added. It stays
        // stored, not run: the static shovel owns the name (its status row, its headers).
        shadowed.retain(|k| wanted.contains_key(k));
        wanted.retain(|k, _| {
            if !self.statics.contains(k) {
                return true;
            }
            if shadowed.insert(k.clone()) {
                tracing::warn!(shovel = %Escaped(&format!("{}/{}", k.0, k.1)), "dynamic shovel not started: a static shovel ([[shovel]] in the config file) has its vhost and name");
            }
            false
        });
        running.retain(|key, r| {
            let keep = wanted.get(key) == Some(&r.value);
            if !keep {
                let _ = r.stop.send(true);
            }
            keep
        });
        for (key, value) in wanted {
            if running.contains_key(&key) {
                continue;
            }
            let cfg = serde_json::from_str(&value)
                .map_err(|e| e.to_string())
                .and_then(|v| ShovelConfig::parse(&key.1, &v));
            let cfg = match cfg {
                Ok(c) => Arc::new(c),
                Err(e) => {
                    // Validated when set: only a definitions file written elsewhere gets
                    // here. It stays, not run, as RabbitMQ's would fail to start.
                    tracing::warn!(shovel = %Escaped(&key.1), "shovel not started: {}", Escaped(&e));
                    continue;
                }
            };
            let (stop, stop_rx) = watch::channel(false);
            let entry = self
                .status
                .add((&key.0, &key.1), cfg.clone(), Kind::Dynamic, unix_ms());
            let run = self
                .clone()
                .run(key.clone(), cfg, Kind::Dynamic, entry, stop_rx);
            tokio::spawn(run);
            running.insert(key, Running { value, stop });
        }
    }

    /// One shovel's life: sessions, backoff between failures, the end.
    async fn run(
        self: Arc<Self>,
        (vhost, name): (String, String),
        cfg: Arc<ShovelConfig>,
        kind: Kind,
        entry: Arc<Entry>,
        mut stop: watch::Receiver<bool>,
    ) {
        let id = Identity {
            name: name.clone(),
            vhost: vhost.clone(),
            node: self.local.node.clone(),
            kind,
        };
        let label = format!("{vhost}/{name}");
        log_state(&label, State::Starting, None);
        // The last failure logged: the same one again, without a run between, is a retry.
        let mut logged: Option<String> = None;
        let mut link = Link::new(cfg.clone(), id);
        let mut backoff = Backoff::new(cfg.reconnect_delay);
        let mut attempt = 0usize;
        loop {
            let started = tokio::time::Instant::now();
            let src = pick(&cfg.src_uris, attempt);
            let dest = pick(&cfg.dest_uris, attempt);
            attempt = attempt.wrapping_add(1);
            let dial = |u: &str| uri::parse(u).and_then(|t| t.dial(self.local.amqp, &vhost));
            let outcome = match (dial(src), dial(dest)) {
                (Ok(s), Ok(d)) => {
                    amqp::session(&mut link, &s, &d, &label, &entry, unix_ms, &mut stop).await
                }
                (Err(e), _) | (_, Err(e)) => Err(amqp::SessionError::Uri(e)),
            };
            match outcome {
                Ok(Ended::Stopped) => break,
                Ok(Ended::Done) if kind == Kind::Static => {
                    // No parameter to delete: it stays in the status, terminated, until
                    // the broker starts again and runs it from the config file anew.
                    tracing::info!(shovel = %Escaped(&label), moved = link.moved(), "static shovel moved what src-delete-after asked; stopped");
                    let why = "src-delete-after reached".to_string();
                    entry.set(State::Terminated, Some(why), unix_ms());
                    return;
                }
                Ok(Ended::Done) => {
                    tracing::info!(shovel = %Escaped(&label), moved = link.moved(), "shovel moved what src-delete-after asked; deleting it");
                    entry.set(State::Terminated, None, unix_ms());
                    let clear = AdminRequest::ClearParameter {
                        vhost: vhost.clone(),
                        component: crate::shovel::COMPONENT.to_string(),
                        name: name.clone(),
                    };
                    let _ = self.broker.admin(clear).await;
                    self.changed();
                    break;
                }
                Err(e) => {
                    let reason = e.to_string();
                    let was_running = entry.state() == State::Running;
                    entry.set(State::Terminated, Some(reason.clone()), unix_ms());
                    if was_running || logged.as_ref() != Some(&reason) {
                        log_state(&label, State::Terminated, Some(&reason));
                        logged = Some(reason.clone());
                    }
                    // A session that ran a while was not part of a storm.
                    if started.elapsed() > cfg.reconnect_delay.max(Duration::from_secs(1)) * 2 {
                        backoff.reset();
                    }
                    let wait = backoff.next(backoff::draw());
                    tokio::select! {
                        _ = stop.changed() => break,
                        _ = tokio::time::sleep(wait) => {}
                    }
                    entry.reconnects.fetch_add(1, Ordering::Relaxed);
                    entry.set(State::Starting, Some(reason), unix_ms());
                }
            }
        }
        self.status.remove(&vhost, &name, &entry);
    }
}

/// Whether a dynamic shovel of this value runs on every node of a cluster, not on the
/// metadata leader only: one from an exchange of the local broker. Its queue is
/// server-named and exclusive, which a Warren cluster keeps local with its binding
/// (docs/cluster.md, "What stays local"), so each node's copy moves what was published on
/// that node: once each, all of them moved. Run on one node, it would miss the others'.
fn on_every_node(value: &str) -> bool {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(value) else {
        return false;
    };
    let Ok(cfg) = ShovelConfig::parse("", &v) else {
        return false;
    };
    matches!(cfg.source, crate::shovel::config::Source::Exchange { .. })
        && !cfg.src_uris.is_empty()
        && cfg
            .src_uris
            .iter()
            .all(|u| uri::parse(u).is_ok_and(|t| t.host.is_none()))
}

/// The leadership signal changed (`false`: its sender went); never, without one.
async fn lead_changed(leads: Option<&mut watch::Receiver<bool>>) -> bool {
    match leads {
        Some(l) => l.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// The URI of attempt `n` (a list is tried in turn, as RabbitMQ picks among them).
fn pick(uris: &[String], n: usize) -> &str {
    if uris.is_empty() {
        return "";
    }
    &uris[n % uris.len()]
}

#[cfg(test)]
mod tests {
    use super::on_every_node;

    #[test]
    fn only_a_local_exchange_source_runs_on_every_node() {
        let v = |src: &str, uri: &str| {
            serde_json::json!({"src-uri": uri, src: "x", "dest-uri": "amqp://", "dest-queue": "d"})
                .to_string()
        };
        assert!(on_every_node(&v("src-exchange", "amqp://")));
        assert!(on_every_node(&v("src-exchange", "amqp://u:p@")));
        assert!(!on_every_node(&v("src-exchange", "amqp://10.0.0.1:5672")));
        assert!(!on_every_node(&v("src-queue", "amqp://")));
        let mixed = serde_json::json!({"src-uri": ["amqp://", "amqp://h"], "src-exchange": "x",
            "dest-uri": "amqp://", "dest-queue": "d"});
        assert!(!on_every_node(&mixed.to_string()));
        assert!(!on_every_node("not json"));
    }
}
