//! `warren-member`: a broker as a member of a cluster. [`Cluster`] is one running node
//! (warren-cluster's metadata group and transport) joined to one broker: the broker proposes
//! its metadata changes there and applies the committed ones (`meta`), replicates its quorum
//! queues through their own groups (`qq`), forwards to queues on other nodes by node mail
//! (`nodes`), keeps one MQTT session per client id across the nodes (`mqtt`), and asks the
//! other nodes before a conditional delete (`queue_use`). docs/cluster.md says what a cluster
//! does; `warren serve` makes one value per process, a test may make several.
//!
//! Why a crate of its own: warren-cluster knows Raft groups, their logs and the transport,
//! and nothing of the broker; this crate is where the two meet (it depends on both, and on
//! the store's record codec and the MQTT registry), so nothing depends back on it but the
//! binary and tests.

mod meta;
mod mqtt;
mod nodes;
mod options;
mod qq;
mod queue_use;

use std::sync::Arc;

use warren_cluster::node::{ClusterNode, NodeError};
use warren_cluster::transport::ClusterTls;
use warren_core::escape::Escaped;
use warren_runtime::BrokerHandle;

pub use mqtt::MqttCluster;
pub use options::{ClusterArgs, ClusterOptions, OptionsError, TlsFiles, options};
pub use qq::Replication;

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The node's groups or transport refused (or could not start). Boxed: openraft's
    /// errors inside make it 128 bytes and more.
    #[error(transparent)]
    Node(Box<NodeError>),
    /// The broker stopped.
    #[error(transparent)]
    Broker(#[from] warren_runtime::BrokerGone),
    /// The recorded queue homes (`<data-dir>/cluster/queue-homes.json`) do not read.
    #[error("{0}")]
    Homes(String),
    /// `join`'s address is no IP:PORT.
    #[error("{addr}: {error}; expected the new node's --cluster IP:PORT")]
    Address {
        addr: String,
        error: std::net::AddrParseError,
    },
    /// The cluster port's TLS files do not read or parse (the old ones stay in use).
    #[error("{0}")]
    Tls(String),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl From<NodeError> for ClusterError {
    fn from(e: NodeError) -> Self {
        ClusterError::Node(Box::new(e))
    }
}

/// A running cluster node joined to a broker. Cheap to clone (a handle); the process (or a
/// test) holds one per node, made by [`Cluster::start`].
#[derive(Clone)]
pub struct Cluster(Arc<Inner>);

struct Inner {
    node: Arc<ClusterNode>,
    /// The metadata group's proposer.
    replicator: meta::MetaReplicator,
    /// The quorum-queue replication, attached to the node.
    replication: Replication,
    /// The cluster port's TLS files, read again by `reload_tls`.
    tls_files: Option<TlsFiles>,
    /// What this node does when another takes an MQTT client id (set by `serve_mqtt`).
    takeover: meta::TakeoverSlot,
}

impl Cluster {
    /// Starts the node and makes `broker` a member: its metadata changes go through the
    /// group, and it applies the committed ones (`meta.rs`). `replication` is the store
    /// layer the broker was started with (its quorum queues' writes go through their groups).
    /// Call before clients and operators can reach the broker.
    pub async fn start(
        opts: ClusterOptions,
        broker: &BrokerHandle,
        replication: Replication,
    ) -> Result<Cluster, ClusterError> {
        let listen = opts.node.listen;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| NodeError::Listen(listen, e))?;
        Self::start_on(opts, listener, broker, replication).await
    }

    /// As [`Cluster::start`] on a cluster listener already bound (tests bind port 0 first
    /// to learn every member's address).
    pub async fn start_on(
        opts: ClusterOptions,
        listener: tokio::net::TcpListener,
        broker: &BrokerHandle,
        replication: Replication,
    ) -> Result<Cluster, ClusterError> {
        let ClusterOptions {
            node: opts,
            tls_files,
            delete_delay,
        } = opts;
        let id = opts.id;
        let members = opts.members.len();
        let data_dir = opts.data_dir.clone();
        let tls = opts.tls.is_some();
        let node = Arc::new(ClusterNode::start_on(opts, listener).await?);
        tracing::info!(
            node_id = id,
            members,
            tls,
            "listening on {} (cluster)",
            node.addr
        );
        tokio::spawn(log_leaders(&node));
        let (replicator, pending) = meta::MetaReplicator::new(
            node.clone(),
            id,
            broker.clone(),
            Some(replication.clone()),
            delete_delay,
        );
        // Where queues live, as recorded, before the broker serves anyone: a publish to a
        // queue of another node is forwarded there from the first one on.
        let homes = meta::Homes::load(&data_dir).map_err(ClusterError::Homes)?;
        for request in homes.requests(id) {
            broker.admin_local(request).await?;
        }
        let incarnations = Arc::new(nodes::Incarnations::new());
        broker.set_node_link(Arc::new(nodes::ClusterLink::new(
            node.clone(),
            broker.clone(),
            incarnations.clone(),
        )));
        nodes::serve_mail(&node, broker.clone(), incarnations);
        queue_use::serve(&node, broker.clone());
        let takeover = meta::TakeoverSlot::default();
        tokio::spawn(meta::run_applier(
            node.clone(),
            broker.clone(),
            id,
            pending,
            data_dir,
            homes,
            takeover.clone(),
        ));
        broker.set_replicator(Arc::new(replicator.clone()));
        tokio::spawn(publish_alarms(node.clone(), broker.clone()));
        replication.attach(node.clone(), broker.clone());
        Ok(Cluster(Arc::new(Inner {
            node,
            replicator,
            replication,
            tls_files,
            takeover,
        })))
    }

    /// "This node leads the metadata group": true while it is the group's leader and a
    /// majority answered it within its lease (`election_timeout_max`, as a quorum queue's
    /// leader serves: `qq.rs`), false otherwise and once the group shuts down. Node-wide
    /// duties that must run on one node only follow it (dynamic shovels: docs/bridges.md).
    /// Re-read on every change of the group's metrics and every `LEAD_CHECK`, 200 ms (a leader
    /// cut off by a partition sees no change: only its lease running out).
    pub fn leads_metadata(&self) -> tokio::sync::watch::Receiver<bool> {
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(follow_lead(self.0.node.clone(), tx));
        rx
    }

    /// This node's id.
    pub fn id(&self) -> u64 {
        self.0.node.id()
    }

    /// The cluster node (its groups, its replicated map), for hosts and tests.
    pub fn node(&self) -> &ClusterNode {
        &self.0.node
    }

    /// The quorum-queue replication (placement, `quorum grow/shrink`, members).
    pub fn replication(&self) -> &Replication {
        &self.0.replication
    }

    /// The leader of quorum queue `name`'s group as this node knows it (`None`: not a
    /// replicated quorum queue here, or no leader now).
    pub fn quorum_leader(&self, vhost: &str, name: &str) -> Option<u64> {
        self.0.replication.leader(vhost, name)
    }

    /// One MQTT session per client id across the nodes for `registry`'s `vhost`
    /// (docs/cluster.md, "MQTT sessions across nodes"): the registry claims and records its
    /// sessions through the cluster, a gone member's sessions still expire (the metadata
    /// leader ends them), and a session another node took closes here. Once per registry.
    pub fn serve_mqtt(&self, registry: &Arc<warren_mqtt::Registry>, vhost: &str) -> MqttCluster {
        let sessions = MqttCluster::new(
            self.0.node.clone(),
            self.0.replicator.clone(),
            self.id(),
            vhost,
        );
        registry.set_cluster(Arc::new(sessions.clone()));
        sessions.adopt_gone(Arc::downgrade(registry));
        let (mine, weak) = (sessions.clone(), Arc::downgrade(registry));
        let vhost = vhost.to_string();
        let _ = self.0.takeover.set(Box::new(move |v, client_id| {
            if v == vhost
                && !mine.owned_here(client_id)
                && let Some(r) = weak.upgrade()
                && r.taken_elsewhere(client_id)
            {
                tracing::info!(client_id = %Escaped(client_id), "MQTT session taken over by a connection on another node");
            }
        }));
        sessions
    }

    /// SIGHUP and `warren ctl reload-tls`: reads the cluster port's TLS files again; the
    /// cluster connections made and accepted from then on use them (open ones keep theirs).
    /// `Ok(false)`: no cluster TLS. A file that does not read or parse leaves the old
    /// certificate in use.
    pub fn reload_tls(&self) -> Result<bool, ClusterError> {
        let Some(f) = &self.0.tls_files else {
            return Ok(false);
        };
        let fresh = ClusterTls::from_pem_files(&f.cert, &f.key, &f.ca)
            .map_err(|e| ClusterError::Tls(e.to_string()))?;
        self.0.node.reload_tls(&fresh).map_err(ClusterError::Tls)?;
        Ok(true)
    }

    /// Stops the node (before the process exits, or a test's node "dies").
    pub async fn stop(&self) {
        self.0.node.shutdown().await;
    }

    /// Stops the node as the process's exit would: its metadata group, its listener and
    /// every quorum queue's group here (a node that dies, in a test of several nodes in one
    /// process). `stop` leaves the quorum queues' groups running for the broker's last sync.
    pub async fn halt(&self) {
        self.stop().await;
        self.0.replication.shutdown_groups().await;
    }

    /// `warren ctl forget-node ID`: removes a member gone for good.
    pub async fn forget(&self, id: u64) -> Result<(), ClusterError> {
        self.0.node.forget(id).await?;
        tracing::info!(
            node_id = id,
            "warren ctl forget-node: node removed from the cluster"
        );
        Ok(())
    }

    /// `warren ctl join ID ADDR`: adds node ID (started with --join, listening at ADDR).
    pub async fn join(&self, id: u64, addr: &str) -> Result<(), ClusterError> {
        let parsed: std::net::SocketAddr = addr.parse().map_err(|error| ClusterError::Address {
            addr: addr.to_string(),
            error,
        })?;
        self.0.node.join(id, &parsed.to_string()).await?;
        tracing::info!(node_id = id, addr = %parsed, "warren ctl join: node added to the cluster");
        Ok(())
    }

    /// `warren ctl leave`: this node leaves the cluster.
    pub async fn leave(&self) -> Result<(), ClusterError> {
        self.0.node.leave().await?;
        // Its group stops here too: a metadata change on this node now fails at once instead
        // of reaching the others through a leader it no longer follows.
        self.0.node.shutdown().await;
        tracing::warn!(
            "warren ctl leave: this node left the cluster; stop it and clear its data dir before reusing it"
        );
        Ok(())
    }

    /// `warren ctl cluster-status`'s data: the metadata group as this node sees it (its
    /// role, term, leader, indexes and members, at the top level as before), `groups`: every
    /// group (the metadata group first, then each quorum queue's, with its members and, where
    /// this node is a member, its status), and `alarms`: every node's resource alarms
    /// (`alarms`: this node's, as its broker says now).
    pub fn status(&self, alarms: &[&str]) -> Result<serde_json::Value, ClusterError> {
        let node = &self.0.node;
        let meta = node.status();
        let mut out = serde_json::to_value(&meta)?;
        let mut groups = vec![serde_json::json!({
            "type": "metadata",
            "group": format!("{:016x}", warren_cluster::META_GROUP),
            "members": meta.members.iter().map(|m| m.id).collect::<Vec<_>>(),
            "status": meta,
        })];
        groups.extend(self.0.replication.groups_status());
        out["groups"] = serde_json::Value::Array(groups);
        out["alarms"] = serde_json::Value::Array(all_alarms(node, alarms));
        Ok(out)
    }
}

/// How often [`Cluster::leads_metadata`] checks the lease when nothing else changed.
const LEAD_CHECK: std::time::Duration = std::time::Duration::from_millis(200);

async fn follow_lead(node: Arc<ClusterNode>, tx: tokio::sync::watch::Sender<bool>) {
    let lease_ms = u64::try_from(node.election_timeout_max().as_millis()).unwrap_or(u64::MAX);
    let mut metrics = node.raft.metrics();
    drop(node);
    loop {
        let leads = {
            let m = metrics.borrow_and_update();
            m.state == warren_cluster::openraft::ServerState::Leader
                && m.current_leader == Some(m.id)
                && m.millis_since_quorum_ack.is_none_or(|ms| ms <= lease_ms)
        };
        tx.send_if_modified(|v| std::mem::replace(v, leads) != leads);
        tokio::select! {
            r = metrics.changed() => if r.is_err() { break },
            _ = tokio::time::sleep(LEAD_CHECK) => {}
            // Nobody follows it any more.
            _ = tx.closed() => return,
        }
    }
    tx.send_replace(false);
}

/// One line per change of leader or of this node's role, for operators (openraft's own logs
/// are filtered to errors by default). Ends when the group shuts down.
fn log_leaders(node: &ClusterNode) -> impl std::future::Future<Output = ()> + use<> {
    let id = node.id();
    let mut metrics = node.raft.metrics();
    async move {
        let mut seen = None;
        loop {
            let now = {
                let m = metrics.borrow_and_update();
                (m.current_leader, m.state, m.current_term)
            };
            if seen.map(|(l, s, _)| (l, s)) != Some((now.0, now.1)) {
                tracing::info!(
                    node_id = id,
                    leader = ?now.0,
                    role = ?now.1,
                    term = now.2,
                    "cluster: metadata group leader {}",
                    now.0.map_or("unknown (election)".to_string(), |l| format!("is node {l}"))
                );
                seen = Some(now);
            }
            // Ends when the group shuts down (the sender is dropped).
            if metrics.changed().await.is_err() {
                return;
            }
        }
    }
}

/// The metadata group's key of node `id`'s resource alarms (a JSON list of names).
fn alarms_key(id: u64) -> String {
    use warren_cluster::definitions::{Kind, key};
    key(Kind::Node, &["alarms", &id.to_string()])
}

/// Keeps this node's resource alarms in the metadata group (checked every second, written
/// when they change), so `cluster-status` on any node shows every node's, as rabbitmqctl's
/// does. A write that fails (no quorum) is tried again at the next change or tick.
async fn publish_alarms(node: Arc<ClusterNode>, broker: BrokerHandle) {
    use warren_cluster::definitions::DefCommand;
    use warren_runtime::{AdminRequest, AdminResponse};
    let key = alarms_key(node.id());
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now: Vec<&str> = match broker.admin(AdminRequest::MemoryStatus).await {
            Ok(AdminResponse::Memory(m)) if m.alarm => vec!["memory"],
            Ok(_) => Vec::new(),
            // The broker stopped.
            Err(_) => return,
        };
        let recorded: Vec<String> = node.definitions.with(|d| {
            d.get(&key)
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or_default()
        });
        if recorded == now {
            continue;
        }
        let put = DefCommand::Put {
            key: key.clone(),
            record: serde_json::to_vec(&now).unwrap_or_default(),
        };
        if let Err(e) = node.write(&put).await {
            tracing::debug!(error = %e, "cluster: this node's alarms not recorded");
        }
    }
}

/// Every node's alarms as `[{"node": ID, "resource": NAME}]`: the metadata group's records,
/// this node's from `local` (what its broker says now).
fn all_alarms(node: &ClusterNode, local: &[&str]) -> Vec<serde_json::Value> {
    let me = node.id();
    let prefix = format!(
        "{}/",
        warren_cluster::definitions::key(warren_cluster::definitions::Kind::Node, &["alarms"])
    );
    let mut out: Vec<serde_json::Value> = node.definitions.with(|d| {
        d.scan(&prefix)
            .filter_map(|(k, v)| {
                let id: u64 = k.rsplit(':').next()?.parse().ok()?;
                let names: Vec<String> = serde_json::from_slice(v).ok()?;
                Some((id, names))
            })
            .filter(|(id, _)| *id != me)
            .flat_map(|(id, names)| {
                names
                    .into_iter()
                    .map(move |n| serde_json::json!({"node": id, "resource": n}))
            })
            .collect()
    });
    out.extend(
        local
            .iter()
            .map(|n| serde_json::json!({"node": me, "resource": n})),
    );
    out.sort_by_key(|a| {
        (
            a["node"].as_u64(),
            a["resource"].as_str().map(str::to_string),
        )
    });
    out
}
