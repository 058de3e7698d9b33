//! `warren serve --node-id N --cluster ADDR --peers ID=ADDR,... --cluster-secret-file FILE`:
//! the cluster node (warren-cluster's metadata group) beside the broker, and what
//! `warren ctl cluster-status` shows. The group carries the broker's metadata changes
//! (`meta.rs`): the broker proposes them there and applies the committed ones
//! (docs/cluster.md).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::settings::{Settings, SettingsError};
use warren_cluster::node::{ClusterNode, NodeOptions};
use warren_cluster::transport::{ClusterTls, Secret};

/// The running node, for the admin socket's `cluster_status` (set once by `serve`; a
/// static keeps the admin module's signature, shared with other work, unchanged).
static NODE: OnceLock<ClusterNode> = OnceLock::new();

/// The metadata group's proposer and this node's id, once the node runs.
static REPLICATOR: OnceLock<(crate::meta::MetaReplicator, u64)> = OnceLock::new();

/// Proposes a change that is no `AdminRequest` (`meta::takeover_change`) and waits for its
/// apply here.
pub async fn propose_change(change: Vec<u8>) -> Result<(), String> {
    let (r, _) = REPLICATOR
        .get()
        .ok_or_else(|| "this node is not in a cluster".to_string())?;
    r.propose_change(change).await
}

/// The cluster's MQTT session registry for `vhost`, on a cluster node (after `start`).
pub fn mqtt_sessions(vhost: &str) -> Option<crate::mqtt_cluster::MqttCluster> {
    let node = NODE.get()?;
    let (_, me) = REPLICATOR.get()?;
    Some(crate::mqtt_cluster::MqttCluster::new(node, *me, vhost))
}

/// The quorum-queue replication (`qq.rs`), attached to the node once it runs.
static REPLICATION: OnceLock<crate::qq::Replication> = OnceLock::new();

/// The cluster port's TLS files (certificate, key, CA bundle), read again on SIGHUP.
static TLS_FILES: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();

/// The leader of quorum queue `name`'s group as this node knows it (`None`: not a replicated
/// quorum queue here, or no leader now).
pub fn quorum_leader(vhost: &str, name: &str) -> Option<u64> {
    REPLICATION.get()?.leader(vhost, name)
}

/// The quorum-queue replication, on a cluster node.
pub fn replication() -> Option<&'static crate::qq::Replication> {
    REPLICATION.get()
}

/// Sets the quorum-queue replication the node drives once started (before `start`).
pub fn set_replication(repl: crate::qq::Replication) {
    let _ = REPLICATION.set(repl);
}

/// The cluster settings, checked; `None` when `--node-id` is not given (a single node).
pub fn options(s: &Settings) -> Result<Option<NodeOptions>, SettingsError> {
    let Some(id) = s.node_id else {
        if s.cluster.is_some()
            || !s.peers.is_empty()
            || s.cluster_secret_file.is_some()
            || s.join
            || s.cluster_tls_cert.is_some()
            || s.cluster_tls_key.is_some()
            || s.cluster_tls_ca.is_some()
        {
            return Err(SettingsError(
                "--cluster, --peers, --cluster-secret-file, --cluster-tls-* and --join need --node-id".into(),
            ));
        }
        return Ok(None);
    };
    if s.in_memory {
        return Err(SettingsError(
            "--node-id: a cluster node keeps its Raft log in the data dir; not with --in-memory"
                .into(),
        ));
    }
    let listen: SocketAddr = s
        .cluster
        .as_deref()
        .ok_or_else(|| SettingsError("--node-id needs --cluster ADDR (this node's cluster listener, e.g. 10.0.0.1:25672)".into()))?
        .parse()
        .map_err(|e| SettingsError(format!("--cluster: {e}; expected IP:PORT")))?;
    if listen.ip().is_unspecified() {
        return Err(SettingsError(format!(
            "--cluster {listen}: peers dial this address, so it must be this node's own IP, not {}",
            listen.ip()
        )));
    }
    let mut members = BTreeMap::new();
    members.insert(id, listen.to_string());
    for entry in s
        .peers
        .iter()
        .flat_map(|p| p.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let (pid, addr) = entry.split_once('=').ok_or_else(|| {
            SettingsError(format!(
                "--peers {entry:?}: expected ID=IP:PORT, e.g. 2=10.0.0.2:25672"
            ))
        })?;
        let pid: u64 = pid
            .parse()
            .map_err(|e| SettingsError(format!("--peers {entry:?}: node id: {e}")))?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|e| SettingsError(format!("--peers {entry:?}: address: {e}")))?;
        if members.insert(pid, addr.to_string()).is_some() {
            return Err(SettingsError(format!(
                "--peers: node {pid} given twice (or is this node)"
            )));
        }
    }
    let file = s.cluster_secret_file.as_deref().ok_or_else(|| {
        SettingsError(
            "--node-id needs --cluster-secret-file FILE (the same secret on every node)".into(),
        )
    })?;
    let secret = read_secret(file)?;
    let mut opts = NodeOptions::new(id, listen, members, Secret::new(secret), s.data_dir.clone());
    opts.join = s.join;
    opts.tls = match (&s.cluster_tls_cert, &s.cluster_tls_key, &s.cluster_tls_ca) {
        (None, None, None) => None,
        (Some(cert), Some(key), Some(ca)) => {
            let tls = ClusterTls::from_pem_files(cert, key, ca)
                .map_err(|e| SettingsError(format!("--cluster-tls-*: {e}")))?;
            let _ = TLS_FILES.set((cert.clone(), key.clone(), ca.clone()));
            Some(tls)
        }
        _ => {
            return Err(SettingsError(
                "--cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together (TLS on the cluster port is mutual: every node has a certificate of the CA)".into(),
            ));
        }
    };
    Ok(Some(opts))
}

/// The secret file's contents without surrounding whitespace (a trailing newline from an
/// editor or `echo` must not change the secret).
fn read_secret(path: &Path) -> Result<Vec<u8>, SettingsError> {
    let text = std::fs::read(path)
        .map_err(|e| SettingsError(format!("--cluster-secret-file {}: {e}", path.display())))?;
    let trimmed = text.trim_ascii();
    if trimmed.len() < 16 {
        return Err(SettingsError(format!(
            "--cluster-secret-file {}: the secret must be at least 16 bytes (e.g. `head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'`)",
            path.display()
        )));
    }
    Ok(trimmed.to_vec())
}

/// Starts the node and makes `broker` a member: its metadata changes go through the
/// group, and it applies the committed ones (`meta.rs`). Call before clients and
/// operators can reach the broker. Its status is served on the admin socket from then on.
pub async fn start(opts: NodeOptions, broker: &warren_runtime::BrokerHandle) -> anyhow::Result<()> {
    let listen = opts.listen;
    let id = opts.id;
    let members = opts.members.len();
    let data_dir = opts.data_dir.clone();
    let tls = opts.tls.is_some();
    let node = ClusterNode::start(opts).await?;
    tracing::info!(
        node_id = id,
        members,
        tls,
        "listening on {listen} (cluster)"
    );
    // One line per change of leader or of this node's role, for operators (openraft's own
    // logs are filtered to errors by default).
    let mut metrics = node.raft.metrics();
    tokio::spawn(async move {
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
    });
    if NODE.set(node).is_err() {
        anyhow::bail!("cluster node started twice");
    }
    let node = NODE
        .get()
        .ok_or_else(|| anyhow::anyhow!("cluster node not set"))?;
    let (replicator, pending) = crate::meta::MetaReplicator::new(node, id, broker.clone());
    // Where queues live, as recorded, before the broker serves anyone: a publish to a
    // queue of another node is forwarded there from the first one on.
    let homes = crate::meta::Homes::load(&data_dir).map_err(|e| anyhow::anyhow!(e))?;
    for request in homes.requests(id) {
        broker.admin_local(request).await?;
    }
    let incarnations = std::sync::Arc::new(crate::nodes::Incarnations::new());
    broker.set_node_link(std::sync::Arc::new(crate::nodes::ClusterLink::new(
        node,
        broker.clone(),
        incarnations.clone(),
    )));
    crate::nodes::serve_mail(node, broker.clone(), incarnations);
    crate::queue_use::serve(node, broker.clone());
    tokio::spawn(crate::meta::run_applier(
        node,
        broker.clone(),
        id,
        pending,
        data_dir,
        homes,
    ));
    let _ = REPLICATOR.set((replicator.clone(), id));
    broker.set_replicator(std::sync::Arc::new(replicator));
    tokio::spawn(publish_alarms(node, broker.clone()));
    if let Some(repl) = REPLICATION.get() {
        repl.attach(node, broker.clone());
    }
    Ok(())
}

/// SIGHUP: reads the cluster port's TLS files again; the cluster connections made and
/// accepted from then on use them (open ones keep theirs). `Ok(false)`: no cluster TLS. A
/// file that does not read or parse leaves the old certificate in use.
pub fn reload_tls() -> Result<bool, String> {
    let (Some(node), Some((cert, key, ca))) = (NODE.get(), TLS_FILES.get()) else {
        return Ok(false);
    };
    let fresh = ClusterTls::from_pem_files(cert, key, ca).map_err(|e| e.to_string())?;
    node.reload_tls(&fresh)?;
    Ok(true)
}

/// Stops the node (before the process exits).
pub async fn stop() {
    if let Some(node) = NODE.get() {
        node.shutdown().await;
    }
}

/// `warren ctl forget-node ID`: removes a member gone for good.
pub async fn forget(id: u64) -> anyhow::Result<serde_json::Value> {
    let node = NODE.get().ok_or_else(|| {
        anyhow::anyhow!("this node is not in a cluster (start it with --node-id)")
    })?;
    node.forget(id).await?;
    tracing::info!(
        node_id = id,
        "warren ctl forget-node: node removed from the cluster"
    );
    Ok(serde_json::json!({}))
}

/// `warren ctl join ID ADDR`: adds node ID (started with --join, listening at ADDR).
pub async fn join(id: u64, addr: &str) -> anyhow::Result<serde_json::Value> {
    let node = NODE.get().ok_or_else(|| {
        anyhow::anyhow!("this node is not in a cluster (start it with --node-id)")
    })?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| anyhow::anyhow!("{addr}: {e}; expected the new node's --cluster IP:PORT"))?;
    node.join(id, &addr.to_string()).await?;
    tracing::info!(node_id = id, %addr, "warren ctl join: node added to the cluster");
    Ok(serde_json::json!({}))
}

/// `warren ctl leave`: this node leaves the cluster.
pub async fn leave() -> anyhow::Result<serde_json::Value> {
    let node = NODE.get().ok_or_else(|| {
        anyhow::anyhow!("this node is not in a cluster (start it with --node-id)")
    })?;
    node.leave().await?;
    // Its group stops here too: a metadata change on this node now fails at once instead of
    // reaching the others through a leader it no longer follows.
    node.shutdown().await;
    tracing::warn!(
        "warren ctl leave: this node left the cluster; stop it and clear its data dir before reusing it"
    );
    Ok(serde_json::json!({}))
}

/// The metadata group's key of node `id`'s resource alarms (a JSON list of names).
fn alarms_key(id: u64) -> String {
    use warren_cluster::definitions::{Kind, key};
    key(Kind::Node, &["alarms", &id.to_string()])
}

/// Keeps this node's resource alarms in the metadata group (checked every second, written
/// when they change), so `cluster-status` on any node shows every node's, as rabbitmqctl's
/// does. A write that fails (no quorum) is tried again at the next change or tick.
async fn publish_alarms(node: &'static ClusterNode, broker: warren_runtime::BrokerHandle) {
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
fn all_alarms(node: &ClusterNode, local: &[&'static str]) -> Vec<serde_json::Value> {
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

/// `warren ctl cluster-status`'s data: the metadata group as this node sees it (its role,
/// term, leader, indexes and members, at the top level as before), `groups`: every group
/// (the metadata group first, then each quorum queue's, with its members and, where this
/// node is a member, its status), and `alarms`: every node's resource alarms (`alarms`:
/// this node's, as its broker says now).
pub fn status(alarms: Vec<&'static str>) -> anyhow::Result<serde_json::Value> {
    let node = NODE.get().ok_or_else(|| {
        anyhow::anyhow!("this node is not in a cluster (start it with --node-id)")
    })?;
    let meta = node.status();
    let mut out = serde_json::to_value(&meta)?;
    let mut groups = vec![serde_json::json!({
        "type": "metadata",
        "group": format!("{:016x}", warren_cluster::META_GROUP),
        "members": meta.members.iter().map(|m| m.id).collect::<Vec<_>>(),
        "status": meta,
    })];
    if let Some(repl) = REPLICATION.get() {
        groups.extend(repl.groups_status());
    }
    out["groups"] = serde_json::Value::Array(groups);
    out["alarms"] = serde_json::Value::Array(all_alarms(node, &alarms));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(dir: &Path, secret: &str) -> Settings {
        let file = dir.join("secret");
        std::fs::write(&file, secret).expect("write secret");
        let toml = format!(
            "node_id = 1\ncluster = \"10.0.0.1:25672\"\npeers = [\"2=10.0.0.2:25672\", \"3=10.0.0.3:25672\"]\ncluster_secret_file = {:?}\ndata_dir = {:?}\n",
            file, dir
        );
        let path = dir.join("warren.toml");
        std::fs::write(&path, toml).expect("write config");
        Settings::from_file(&path).expect("config parses").0
    }

    #[test]
    fn cluster_keys_from_the_config_file() {
        let dir = std::env::temp_dir().join(format!("warren-cluster-opts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let s = settings(&dir, "0123456789abcdef0123\n");
        let o = options(&s).expect("valid").expect("a cluster node");
        assert_eq!(o.id, 1);
        assert_eq!(o.members.len(), 3);
        assert_eq!(o.members[&3], "10.0.0.3:25672");

        // Each mistake is named, never a panic or a silent single node.
        let mut bad = s.clone();
        bad.peers = vec!["2:10.0.0.2:25672".into()];
        assert!(options(&bad).unwrap_err().0.contains("ID=IP:PORT"));
        let mut bad = s.clone();
        bad.peers = vec!["1=10.0.0.9:25672".into()];
        assert!(options(&bad).unwrap_err().0.contains("twice"));
        let mut bad = s.clone();
        bad.cluster = Some("0.0.0.0:25672".into());
        assert!(options(&bad).unwrap_err().0.contains("own IP"));
        let mut bad = s.clone();
        bad.cluster_secret_file = None;
        assert!(
            options(&bad)
                .unwrap_err()
                .0
                .contains("--cluster-secret-file")
        );
        let mut bad = s.clone();
        bad.node_id = None;
        assert!(options(&bad).unwrap_err().0.contains("need --node-id"));
        // --join is passed to the node (it then proposes no membership of its own).
        let mut joining = s.clone();
        joining.join = true;
        assert!(options(&joining).expect("valid").expect("a node").join);
        assert!(!o.join);
        let short = settings(&dir, "short\n");
        assert!(options(&short).unwrap_err().0.contains("at least 16 bytes"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cluster_tls_keys_from_the_config_file() {
        let dir =
            std::env::temp_dir().join(format!("warren-cluster-tls-opts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut ca = rcgen::CertificateParams::new(vec!["10.0.0.1".into()]).expect("params");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = ca.self_signed(&key).expect("cert");
        let (c, k) = (dir.join("node.pem"), dir.join("node.key"));
        std::fs::write(&c, cert.pem()).expect("write");
        std::fs::write(&k, key.serialize_pem()).expect("write");
        let secret = dir.join("secret");
        std::fs::write(&secret, "0123456789abcdef0123").expect("write");
        let toml = format!(
            "node_id = 1\ncluster = \"10.0.0.1:25672\"\ncluster_secret_file = {secret:?}\ndata_dir = {dir:?}\ncluster_tls_cert = {c:?}\ncluster_tls_key = {k:?}\ncluster_tls_ca = {c:?}\n",
        );
        let path = dir.join("warren.toml");
        std::fs::write(&path, toml).expect("write config");
        let s = Settings::from_file(&path).expect("config parses").0;
        assert!(options(&s).expect("valid").expect("a node").tls.is_some());
        let mut plain = s.clone();
        (
            plain.cluster_tls_cert,
            plain.cluster_tls_key,
            plain.cluster_tls_ca,
        ) = (None, None, None);
        assert!(
            options(&plain)
                .expect("valid")
                .expect("a node")
                .tls
                .is_none()
        );
        // All three or none: a node half-configured for TLS is refused, not run in plain TCP.
        let mut bad = s.clone();
        bad.cluster_tls_ca = None;
        assert!(options(&bad).unwrap_err().0.contains("go together"));
        // Unreadable files are named.
        let mut bad = s.clone();
        bad.cluster_tls_key = Some(dir.join("missing.key"));
        let e = options(&bad).unwrap_err().0;
        assert!(
            e.contains("--cluster-tls-*") && e.contains("missing.key"),
            "{e}"
        );
        // A key that is not the certificate's.
        let mut bad = s.clone();
        let other = dir.join("other.key");
        std::fs::write(
            &other,
            rcgen::KeyPair::generate().expect("key").serialize_pem(),
        )
        .expect("write");
        bad.cluster_tls_key = Some(other);
        assert!(options(&bad).unwrap_err().0.contains("certificate and key"));
        let mut bad = s.clone();
        bad.node_id = None;
        assert!(options(&bad).unwrap_err().0.contains("need --node-id"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
