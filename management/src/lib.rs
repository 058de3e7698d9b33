//! Warren's management side, served by `warren serve` itself: the HTTP API in RabbitMQ
//! 3.10's shapes (`/api/...`, basic auth against Warren's users, RabbitMQ's user tags) and
//! Prometheus metrics (`/metrics`, rabbitmq_prometheus's names).
//!
//! Everything here goes through the runtime's admin path (`BrokerHandle::admin`, the one
//! `warren ctl` uses): listings and changes are answered by the broker task between op
//! batches, and nothing here runs on the message path. Rates are computed here from
//! samples of the core's plain counters (`warren_core::stats`).

#![warn(missing_docs, unreachable_pub)]

mod api;
pub mod definitions;
mod health;
mod metrics;
mod rates;
mod ui;

pub use health::QuorumCritical;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::sync::watch;
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};

/// A listener of the node, as `/api/overview` and `/api/nodes` show it.
#[derive(Clone, Debug)]
pub struct Listener {
    /// RabbitMQ's protocol names: `amqp`, `mqtt`, `http`, `http/prometheus`.
    pub protocol: &'static str,
    /// The address it listens on.
    pub addr: SocketAddr,
}

/// What the management side knows of the node that the broker task does not.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// The node name shown in every object (`warren@<host>`, as RabbitMQ's `rabbit@<host>`).
    pub name: String,
    /// Every listener of the node (`/api/overview`'s `listeners`).
    pub listeners: Vec<Listener>,
    /// Where data lives (disk free space is measured there); `None` in memory.
    pub data_dir: Option<std::path::PathBuf>,
}

impl NodeInfo {
    /// `warren@<hostname>`.
    pub fn local(listeners: Vec<Listener>, data_dir: Option<std::path::PathBuf>) -> NodeInfo {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        NodeInfo {
            name: format!("warren@{host}"),
            listeners,
            data_dir,
        }
    }
}

/// A gauge a part of the binary the broker does not see reports (MQTT sessions,
/// retained messages): read at each scrape.
pub struct Gauge {
    /// The metric's name (`# TYPE` line).
    pub name: &'static str,
    /// The `# HELP` text.
    pub help: &'static str,
    /// Reads the current value.
    pub value: Box<dyn Fn() -> u64 + Send + Sync>,
}

/// The management side of one broker: shared by the API and metrics servers.
pub struct Management {
    broker: BrokerHandle,
    node: NodeInfo,
    started: std::time::Instant,
    started_at_ms: u64,
    rates: Mutex<rates::Rates>,
    gauges: Vec<Gauge>,
    placement: std::sync::OnceLock<Placement>,
    quorum_critical: std::sync::OnceLock<QuorumCritical>,
    links: std::sync::OnceLock<Arc<dyn Links>>,
}

/// The host's links to other brokers (warren-links' supervisor, in `warren serve`): the
/// parameters of their components are checked by it, it hears when they change, and it
/// has their status and metrics. Without one, every component is unknown.
pub trait Links: Send + Sync {
    /// Checks a parameter's value for its component (and its vhost and name against the
    /// host's own links, such as static shovels): `Err` is RabbitMQ's text ("Validation
    /// failed ...", or "component X not found").
    fn validate(
        &self,
        component: &str,
        vhost: &str,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<(), String>;
    /// The parameters changed.
    fn changed(&self);
    /// `GET /api/shovels`' rows (RabbitMQ's shape).
    fn shovels(&self) -> Vec<serde_json::Value>;
    /// `GET /api/bridges`' rows (the MQTT bridges of the config file).
    fn bridges(&self) -> Vec<serde_json::Value> {
        Vec::new()
    }
    /// Metrics to append, Prometheus text.
    fn metrics(&self, out: &mut String);
}

/// Where a replicated queue is served, as the host knows it (a cluster node's quorum
/// queues): the fields it adds to the queue's object (RabbitMQ's `leader`, `members`,
/// `online`), or `None` for a queue it does not replicate.
pub type Placement =
    Box<dyn Fn(&str, &str) -> Option<serde_json::Map<String, serde_json::Value>> + Send + Sync>;

/// The broker went away while a request was answered.
#[derive(Debug, thiserror::Error)]
#[error("the broker is shutting down")]
pub struct Stopped;

impl Management {
    /// The management side of `broker`, with what the node knows and the gauges to export.
    pub fn new(broker: BrokerHandle, node: NodeInfo, gauges: Vec<Gauge>) -> Arc<Management> {
        Arc::new(Management {
            broker,
            node,
            started: std::time::Instant::now(),
            started_at_ms: warren_runtime::unix_ms(),
            rates: Mutex::new(rates::Rates::default()),
            gauges,
            placement: std::sync::OnceLock::new(),
            quorum_critical: std::sync::OnceLock::new(),
            links: std::sync::OnceLock::new(),
        })
    }

    /// Sets the host's [`Links`] (once; a later call changes nothing).
    pub fn set_links(&self, links: Arc<dyn Links>) {
        let _ = self.links.set(links);
    }

    /// Checks a parameter as the host's links do (every component is unknown without).
    pub fn validate_parameter(
        &self,
        component: &str,
        vhost: &str,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<(), String> {
        match self.links.get() {
            Some(l) => l.validate(component, vhost, name, value),
            None => Err(format!(
                "Validation failed\n\ncomponent {component} not found\n"
            )),
        }
    }

    /// The shovels' status rows (empty without links).
    pub fn shovel_status(&self) -> Vec<serde_json::Value> {
        self.links.get().map(|l| l.shovels()).unwrap_or_default()
    }

    /// The MQTT bridges' status rows (empty without links).
    pub fn bridge_status(&self) -> Vec<serde_json::Value> {
        self.links.get().map(|l| l.bridges()).unwrap_or_default()
    }

    /// Tells the host's links that the parameters changed.
    pub fn parameters_changed(&self) {
        if let Some(l) = self.links.get() {
            l.changed();
        }
    }

    /// Sets the host's [`Placement`] (once; a later call changes nothing).
    pub fn set_placement(&self, placement: Placement) {
        let _ = self.placement.set(placement);
    }

    /// Sets the host's [`QuorumCritical`] (a cluster member's; once).
    pub fn set_quorum_critical(&self, critical: QuorumCritical) {
        let _ = self.quorum_critical.set(critical);
    }

    async fn ask(&self, request: AdminRequest) -> Result<AdminResponse, Stopped> {
        self.broker.admin(request).await.map_err(|_| Stopped)
    }

    fn uptime_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The node's status (`warren ctl status`, `/api/nodes`): version, uptime, listeners,
    /// memory and its alarm, free disk.
    pub async fn status(&self) -> Result<serde_json::Value, Stopped> {
        self.node_json().await.map_err(|_| Stopped)
    }
}

/// A password hash as RabbitMQ makes it (salted SHA-256), with a fresh random salt.
pub fn hash_password(password: &str) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut salt = [0u8; 4];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut salt))?;
    Ok(warren_core::access::hash_password(salt, password))
}

/// Serves the HTTP API on `listener` until `stopped` turns true.
pub async fn serve_api(
    listener: TcpListener,
    management: Arc<Management>,
    stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let api = api::router(management).layer(axum::middleware::from_fn(ui::no_browser_prompt));
    let app = ui::router().merge(api);
    // Around the router, not in it: a Router's own layers run after routing.
    let app = tower_layer::Layer::layer(&axum::middleware::from_fn(trim_trailing_slash), app);
    axum::serve(
        listener,
        axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<
            SocketAddr,
        >(app),
    )
    .with_graceful_shutdown(until(stopped))
    .await
}

/// `/api/queues/` is `/api/queues`: RabbitMQ's router takes both spellings of every path and
/// clients write both (amqp091-go's recovery tests list `/api/connections/`); axum's router
/// matches paths exactly, so the slash goes before routing. `/` itself stays.
async fn trim_trailing_slash(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let uri = request.uri();
    let path = uri.path();
    if path.len() > 1 && path.ends_with('/') {
        let trimmed = path.trim_end_matches('/');
        let trimmed = if trimmed.is_empty() { "/" } else { trimmed };
        let path_and_query = match uri.query() {
            Some(q) => format!("{trimmed}?{q}"),
            None => trimmed.to_string(),
        };
        let mut parts = uri.clone().into_parts();
        // Cannot fail: a prefix of a valid path and the same query; if it did, the request
        // goes on as it came and gets its 404.
        if let Ok(pq) = path_and_query.parse() {
            parts.path_and_query = Some(pq);
            if let Ok(new) = axum::http::Uri::from_parts(parts) {
                *request.uri_mut() = new;
            }
        }
    }
    next.run(request).await
}

/// Serves Prometheus metrics (`/metrics`) on `listener` until `stopped` turns true.
pub async fn serve_metrics(
    listener: TcpListener,
    management: Arc<Management>,
    stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let app = metrics::router(management);
    axum::serve(listener, app)
        .with_graceful_shutdown(until(stopped))
        .await
}

async fn until(mut stopped: watch::Receiver<bool>) {
    while !*stopped.borrow() {
        if stopped.changed().await.is_err() {
            return;
        }
    }
}
