//! Cluster metadata: the broker's durable metadata changes go through the metadata group
//! (warren-cluster) before any node applies them, and every node applies the committed ones
//! to its own core, in log order (docs/cluster.md, "What is replicated").
//!
//! - [`MetaReplicator`] is the runtime's `Replicator`: it proposes a change (an
//!   `AdminRequest`, encoded by [`encode`]) as a `DefCommand::Change`, forwarded to the
//!   leader by the cluster node, and answers once this node's applier applied it, within
//!   [`COMMIT_TIMEOUT`].
//! - [`run_applier`] follows the group's window of committed changes
//!   (`Definitions::changes_after`) and applies each with `BrokerHandle::admin_local` (the
//!   admin path: no client checks; every node takes the same path on the same state). The
//!   index it reached is kept in `<data-dir>/cluster/meta.applied`, so a restart does not
//!   apply again what this node's own store already restored.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use warren_cluster::definitions::{DefCommand, DefReply};
use warren_cluster::node::{ClusterNode, NodeError};
use warren_cluster::state_machine::write_atomic;
use warren_core::access::{PermissionDef, TopicPermissionDef, UserDef, VhostDef};
use warren_core::command::{Bind, ExchangeDeclare, Op, QueueDeclare};
use warren_core::parameter::ParameterDef;
use warren_core::policy::{ApplyTo, PolicyDef};
use warren_runtime::replicate::ReplicateFuture;
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle, Replicator};
use warren_store::record::{decode_table, encode_table};

/// How long a metadata change may take to commit and apply here before the client gets an
/// error: a leader election (about a second with the default timings) fits; a minority
/// side of a partition, which cannot commit at all, answers after it.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a passive declare waits for the read barrier before it is answered from what
/// this node knows: short, so that a node cut off from the majority still answers reads
/// promptly (a little stale), as a RabbitMQ node answers from its local copy.
pub const BARRIER_TIMEOUT: Duration = Duration::from_secs(1);

/// Changes the applier takes from the window per look (it applies them one by one).
const APPLY_BATCH: usize = 64;

/// How many recently applied (origin, seq) pairs the applier remembers, to apply a change
/// proposed twice (a forward retried after its first try did commit) only once.
const SEEN: usize = 4096;

// ----- the wire form of a change (JSON in the Raft log; field tables in the store's
// lossless encoding, so an argument's type survives the trip) -----

#[derive(Serialize, Deserialize)]
struct WExchange {
    name: String,
    kind: String,
    durable: bool,
    auto_delete: bool,
    internal: bool,
    nowait: bool,
    arguments: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
struct WQueue {
    name: String,
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
    nowait: bool,
    arguments: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
struct WBind {
    source: String,
    destination: String,
    routing_key: String,
    nowait: bool,
    arguments: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
enum WOp {
    ExchangeDeclare(WExchange),
    ExchangeDelete {
        name: String,
        if_unused: bool,
        nowait: bool,
    },
    QueueDeclare(WQueue),
    QueueDelete {
        name: String,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    },
    QueueBind(WBind),
    QueueUnbind(WBind),
    ExchangeBind(WBind),
    ExchangeUnbind(WBind),
    /// An MQTT retained message (its record as the store keeps it, docs/storage.md).
    Retain {
        message: Vec<u8>,
        durable: bool,
    },
}

#[derive(Serialize, Deserialize)]
struct WPolicy {
    vhost: String,
    name: String,
    pattern: String,
    apply_to: u8,
    priority: i64,
    definition: Vec<u8>,
}

/// A runtime parameter (its value JSON text, as the core keeps it).
#[derive(Serialize, Deserialize)]
struct WParameter {
    component: String,
    vhost: String,
    name: String,
    value: String,
}

#[derive(Serialize, Deserialize)]
struct WUser {
    name: String,
    password_hash: Vec<u8>,
    tags: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct WPermission {
    vhost: String,
    user: String,
    configure: String,
    write: String,
    read: String,
}

#[derive(Serialize, Deserialize)]
struct WTopicPermission {
    vhost: String,
    user: String,
    exchange: String,
    write: String,
    read: String,
}

#[derive(Serialize, Deserialize, Default)]
struct WDefinitions {
    vhosts: Vec<(String, String)>,
    users: Vec<WUser>,
    permissions: Vec<WPermission>,
    /// Absent from entries written before topic permissions.
    #[serde(default)]
    topic_permissions: Vec<WTopicPermission>,
    policies: Vec<WPolicy>,
    /// Absent from entries written before runtime parameters.
    #[serde(default)]
    parameters: Vec<WParameter>,
    exchanges: Vec<(String, WExchange)>,
    queues: Vec<(String, WQueue)>,
    bindings: Vec<(String, WBind, bool)>,
}

#[derive(Serialize, Deserialize)]
enum Wire {
    Op {
        vhost: String,
        op: WOp,
    },
    Import(WDefinitions),
    SetPolicy(WPolicy),
    ClearPolicy {
        vhost: String,
        name: String,
    },
    SetParameter(WParameter),
    ClearParameter {
        vhost: String,
        component: String,
        name: String,
    },
    AddVhost {
        name: String,
        description: String,
    },
    DeleteVhost(String),
    AddUser(WUser),
    ChangePassword {
        user: String,
        password_hash: Vec<u8>,
    },
    SetUserTags {
        user: String,
        tags: Vec<String>,
    },
    DeleteUser(String),
    SetPermissions(WPermission),
    ClearPermissions {
        vhost: String,
        user: String,
    },
    SetTopicPermissions(WTopicPermission),
    ClearTopicPermissions {
        vhost: String,
        user: String,
        exchange: Option<String>,
    },
}

fn w_exchange(d: &ExchangeDeclare) -> WExchange {
    WExchange {
        name: d.exchange.clone(),
        kind: d.kind.clone(),
        durable: d.durable,
        auto_delete: d.auto_delete,
        internal: d.internal,
        nowait: d.nowait,
        arguments: encode_table(&d.arguments),
    }
}

fn w_queue(d: &QueueDeclare) -> WQueue {
    WQueue {
        name: d.queue.clone(),
        durable: d.durable,
        exclusive: d.exclusive,
        auto_delete: d.auto_delete,
        nowait: d.nowait,
        arguments: encode_table(&d.arguments),
    }
}

fn w_bind(b: &Bind) -> WBind {
    WBind {
        source: b.source.clone(),
        destination: b.destination.clone(),
        routing_key: b.routing_key.clone(),
        nowait: b.nowait,
        arguments: encode_table(&b.arguments),
    }
}

fn w_parameter(p: &ParameterDef) -> WParameter {
    WParameter {
        component: p.component.clone(),
        vhost: p.vhost.clone(),
        name: p.name.clone(),
        value: p.value.clone(),
    }
}

fn r_parameter(p: WParameter) -> ParameterDef {
    ParameterDef {
        component: p.component,
        vhost: p.vhost,
        name: p.name,
        value: p.value,
    }
}

fn w_policy(p: &PolicyDef) -> WPolicy {
    WPolicy {
        vhost: p.vhost.clone(),
        name: p.name.clone(),
        pattern: p.pattern.clone(),
        apply_to: match p.apply_to {
            ApplyTo::All => 0,
            ApplyTo::Queues => 1,
            ApplyTo::Exchanges => 2,
        },
        priority: p.priority,
        definition: encode_table(&p.definition),
    }
}

fn w_user(u: &UserDef) -> WUser {
    WUser {
        name: u.name.clone(),
        password_hash: u.password_hash.clone(),
        tags: u.tags.clone(),
    }
}

fn w_permission(p: &PermissionDef) -> WPermission {
    WPermission {
        vhost: p.vhost.clone(),
        user: p.user.clone(),
        configure: p.configure.clone(),
        write: p.write.clone(),
        read: p.read.clone(),
    }
}

fn w_topic_permission(p: &TopicPermissionDef) -> WTopicPermission {
    WTopicPermission {
        vhost: p.vhost.clone(),
        user: p.user.clone(),
        exchange: p.exchange.clone(),
        write: p.write.clone(),
        read: p.read.clone(),
    }
}

fn r_topic_permission(p: WTopicPermission) -> TopicPermissionDef {
    TopicPermissionDef {
        vhost: p.vhost,
        user: p.user,
        exchange: p.exchange,
        write: p.write,
        read: p.read,
    }
}

fn w_op(op: &Op) -> Option<WOp> {
    Some(match op {
        Op::ExchangeDeclare(d) => WOp::ExchangeDeclare(w_exchange(d)),
        Op::ExchangeDelete {
            exchange,
            if_unused,
            nowait,
        } => WOp::ExchangeDelete {
            name: exchange.clone(),
            if_unused: *if_unused,
            nowait: *nowait,
        },
        Op::QueueDeclare(d) => WOp::QueueDeclare(w_queue(d)),
        Op::QueueDelete {
            queue,
            if_unused,
            if_empty,
            nowait,
        } => WOp::QueueDelete {
            name: queue.clone(),
            if_unused: *if_unused,
            if_empty: *if_empty,
            nowait: *nowait,
        },
        Op::QueueBind(b) => WOp::QueueBind(w_bind(b)),
        Op::QueueUnbind(b) => WOp::QueueUnbind(w_bind(b)),
        Op::ExchangeBind(b) => WOp::ExchangeBind(w_bind(b)),
        Op::ExchangeUnbind(b) => WOp::ExchangeUnbind(w_bind(b)),
        Op::Retain { message, durable } => WOp::Retain {
            message: warren_store::retained::encode(message),
            durable: *durable,
        },
        _ => return None,
    })
}

/// The bytes of a replicated change; `None` for a request that is not one.
pub fn encode(request: &AdminRequest) -> Option<Vec<u8>> {
    let wire = match request {
        AdminRequest::Op { vhost, op } => Wire::Op {
            vhost: vhost.clone(),
            op: w_op(op)?,
        },
        AdminRequest::Import(d) => Wire::Import(WDefinitions {
            vhosts: d
                .vhosts
                .iter()
                .map(|v| (v.name.clone(), v.description.clone()))
                .collect(),
            users: d.users.iter().map(w_user).collect(),
            permissions: d.permissions.iter().map(w_permission).collect(),
            topic_permissions: d.topic_permissions.iter().map(w_topic_permission).collect(),
            policies: d.policies.iter().map(w_policy).collect(),
            parameters: d.parameters.iter().map(w_parameter).collect(),
            exchanges: d
                .exchanges
                .iter()
                .map(|(v, x)| (v.clone(), w_exchange(x)))
                .collect(),
            queues: d
                .queues
                .iter()
                .map(|(v, q)| (v.clone(), w_queue(q)))
                .collect(),
            bindings: d
                .bindings
                .iter()
                .map(|(v, b, x)| (v.clone(), w_bind(b), *x))
                .collect(),
        }),
        AdminRequest::SetPolicy(p) => Wire::SetPolicy(w_policy(p)),
        AdminRequest::ClearPolicy { vhost, name } => Wire::ClearPolicy {
            vhost: vhost.clone(),
            name: name.clone(),
        },
        AdminRequest::SetParameter(p) => Wire::SetParameter(w_parameter(p)),
        AdminRequest::ClearParameter {
            vhost,
            component,
            name,
        } => Wire::ClearParameter {
            vhost: vhost.clone(),
            component: component.clone(),
            name: name.clone(),
        },
        AdminRequest::AddVhost(v) => Wire::AddVhost {
            name: v.name.clone(),
            description: v.description.clone(),
        },
        AdminRequest::DeleteVhost(name) => Wire::DeleteVhost(name.clone()),
        AdminRequest::AddUser(u) => Wire::AddUser(w_user(u)),
        AdminRequest::ChangePassword {
            user,
            password_hash,
        } => Wire::ChangePassword {
            user: user.clone(),
            password_hash: password_hash.clone(),
        },
        AdminRequest::SetUserTags { user, tags } => Wire::SetUserTags {
            user: user.clone(),
            tags: tags.clone(),
        },
        AdminRequest::DeleteUser(name) => Wire::DeleteUser(name.clone()),
        AdminRequest::SetPermissions(p) => Wire::SetPermissions(w_permission(p)),
        AdminRequest::ClearPermissions { vhost, user } => Wire::ClearPermissions {
            vhost: vhost.clone(),
            user: user.clone(),
        },
        AdminRequest::SetTopicPermissions(p) => Wire::SetTopicPermissions(w_topic_permission(p)),
        AdminRequest::ClearTopicPermissions {
            vhost,
            user,
            exchange,
        } => Wire::ClearTopicPermissions {
            vhost: vhost.clone(),
            user: user.clone(),
            exchange: exchange.clone(),
        },
        _ => return None,
    };
    serde_json::to_vec(&wire).ok()
}

type Decoded<T> = Result<T, String>;

fn table(v: &[u8]) -> Decoded<warren_core::message::FieldTable> {
    decode_table(v).map_err(|e| format!("field table: {e}"))
}

fn r_exchange(x: WExchange) -> Decoded<ExchangeDeclare> {
    Ok(ExchangeDeclare {
        exchange: x.name,
        kind: x.kind,
        passive: false,
        durable: x.durable,
        auto_delete: x.auto_delete,
        internal: x.internal,
        nowait: x.nowait,
        arguments: table(&x.arguments)?,
    })
}

fn r_queue(q: WQueue) -> Decoded<QueueDeclare> {
    Ok(QueueDeclare {
        queue: q.name,
        passive: false,
        durable: q.durable,
        exclusive: q.exclusive,
        auto_delete: q.auto_delete,
        nowait: q.nowait,
        arguments: table(&q.arguments)?,
    })
}

fn r_bind(b: WBind) -> Decoded<Bind> {
    Ok(Bind {
        source: b.source,
        destination: b.destination,
        routing_key: b.routing_key,
        nowait: b.nowait,
        arguments: table(&b.arguments)?,
    })
}

fn r_policy(p: WPolicy) -> Decoded<PolicyDef> {
    Ok(PolicyDef {
        vhost: p.vhost,
        name: p.name,
        pattern: p.pattern,
        apply_to: match p.apply_to {
            1 => ApplyTo::Queues,
            2 => ApplyTo::Exchanges,
            _ => ApplyTo::All,
        },
        priority: p.priority,
        definition: table(&p.definition)?,
    })
}

fn r_user(u: WUser) -> UserDef {
    UserDef {
        name: u.name,
        password_hash: u.password_hash,
        tags: u.tags,
    }
}

fn r_permission(p: WPermission) -> PermissionDef {
    PermissionDef {
        vhost: p.vhost,
        user: p.user,
        configure: p.configure,
        write: p.write,
        read: p.read,
    }
}

fn r_op(op: WOp) -> Decoded<Op> {
    Ok(match op {
        WOp::ExchangeDeclare(x) => Op::ExchangeDeclare(r_exchange(x)?),
        WOp::ExchangeDelete {
            name,
            if_unused,
            nowait,
        } => Op::ExchangeDelete {
            exchange: name,
            if_unused,
            nowait,
        },
        WOp::QueueDeclare(q) => Op::QueueDeclare(r_queue(q)?),
        WOp::QueueDelete {
            name,
            if_unused,
            if_empty,
            nowait,
        } => Op::QueueDelete {
            queue: name,
            if_unused,
            if_empty,
            nowait,
        },
        WOp::QueueBind(b) => Op::QueueBind(r_bind(b)?),
        WOp::QueueUnbind(b) => Op::QueueUnbind(r_bind(b)?),
        WOp::ExchangeBind(b) => Op::ExchangeBind(r_bind(b)?),
        WOp::ExchangeUnbind(b) => Op::ExchangeUnbind(r_bind(b)?),
        WOp::Retain { message, durable } => Op::Retain {
            message: Box::new(
                warren_store::retained::decode(&message)
                    .map_err(|e| format!("retained message: {e}"))?,
            ),
            durable,
        },
    })
}

// ----- MQTT sessions (mqtt.rs) -----

/// A change that tells every node that a connection on the proposing node took an MQTT
/// client id: a node whose connection (or offline copy) had it lets it go. Not an
/// `AdminRequest`: no broker applies it. Its own type, so a node reads it apart from
/// [`Wire`].
#[derive(Serialize, Deserialize)]
enum MqttWire {
    MqttTakeover { vhost: String, client_id: String },
}

/// The bytes of an MQTT takeover change.
pub fn takeover_change(vhost: &str, client_id: &str) -> Vec<u8> {
    serde_json::to_vec(&MqttWire::MqttTakeover {
        vhost: vhost.to_string(),
        client_id: client_id.to_string(),
    })
    .unwrap_or_default()
}

/// The (vhost, client id) of an MQTT takeover change, if `bytes` is one.
fn decode_takeover(bytes: &[u8]) -> Option<(String, String)> {
    match serde_json::from_slice(bytes).ok()? {
        MqttWire::MqttTakeover { vhost, client_id } => Some((vhost, client_id)),
    }
}

/// Told of every MQTT takeover another node made: (vhost, client id).
pub type TakeoverHook = Box<dyn Fn(&str, &str) + Send + Sync>;

/// Where the applier finds the takeover hook: set once, after the applier started (the MQTT
/// registry it tells is made after the cluster joins), shared by the `Cluster` and its applier.
pub type TakeoverSlot = Arc<std::sync::OnceLock<TakeoverHook>>;

/// The request a change's bytes stand for. Bytes this version cannot read are an error
/// (every node refuses them alike), never a panic.
pub fn decode(bytes: &[u8]) -> Decoded<AdminRequest> {
    let wire: Wire = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    Ok(match wire {
        Wire::Op { vhost, op } => AdminRequest::Op {
            vhost,
            op: r_op(op)?,
        },
        Wire::Import(d) => {
            let mut defs = warren_core::store::Definitions {
                vhosts: d
                    .vhosts
                    .into_iter()
                    .map(|(name, description)| VhostDef { name, description })
                    .collect(),
                users: d.users.into_iter().map(r_user).collect(),
                permissions: d.permissions.into_iter().map(r_permission).collect(),
                topic_permissions: d
                    .topic_permissions
                    .into_iter()
                    .map(r_topic_permission)
                    .collect(),
                parameters: d.parameters.into_iter().map(r_parameter).collect(),
                ..Default::default()
            };
            for p in d.policies {
                defs.policies.push(r_policy(p)?);
            }
            for (v, x) in d.exchanges {
                defs.exchanges.push((v, r_exchange(x)?));
            }
            for (v, q) in d.queues {
                defs.queues.push((v, r_queue(q)?));
            }
            for (v, b, x) in d.bindings {
                defs.bindings.push((v, r_bind(b)?, x));
            }
            AdminRequest::Import(defs)
        }
        Wire::SetPolicy(p) => AdminRequest::SetPolicy(r_policy(p)?),
        Wire::ClearPolicy { vhost, name } => AdminRequest::ClearPolicy { vhost, name },
        Wire::SetParameter(p) => AdminRequest::SetParameter(r_parameter(p)),
        Wire::ClearParameter {
            vhost,
            component,
            name,
        } => AdminRequest::ClearParameter {
            vhost,
            component,
            name,
        },
        Wire::AddVhost { name, description } => {
            AdminRequest::AddVhost(VhostDef { name, description })
        }
        Wire::DeleteVhost(name) => AdminRequest::DeleteVhost(name),
        Wire::AddUser(u) => AdminRequest::AddUser(r_user(u)),
        Wire::ChangePassword {
            user,
            password_hash,
        } => AdminRequest::ChangePassword {
            user,
            password_hash,
        },
        Wire::SetUserTags { user, tags } => AdminRequest::SetUserTags { user, tags },
        Wire::DeleteUser(name) => AdminRequest::DeleteUser(name),
        Wire::SetPermissions(p) => AdminRequest::SetPermissions(r_permission(p)),
        Wire::ClearPermissions { vhost, user } => AdminRequest::ClearPermissions { vhost, user },
        Wire::SetTopicPermissions(p) => AdminRequest::SetTopicPermissions(r_topic_permission(p)),
        Wire::ClearTopicPermissions {
            vhost,
            user,
            exchange,
        } => AdminRequest::ClearTopicPermissions {
            vhost,
            user,
            exchange,
        },
    })
}

// ----- proposing -----

/// The proposals of this node waiting for their apply here, by seq. Each is removed by
/// the applier or by its proposer's timeout: bounded by the proposals in flight.
type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Option<AdminResponse>>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The runtime's `Replicator` on a cluster node.
#[derive(Clone)]
pub struct MetaReplicator(Arc<Inner>);

struct Inner {
    node: Arc<ClusterNode>,
    me: u64,
    /// This node's broker (a conditional delete's check reads its instance of the queue).
    broker: BrokerHandle,
    /// The quorum-queue replication: a new quorum queue's declare-ok waits for its group.
    replication: Option<crate::qq::Replication>,
    /// Tests' pause after a conditional delete's check (`queue_use::precheck`).
    delete_delay: Option<Duration>,
    /// Unique per proposal across restarts (it starts at the clock in microseconds), so
    /// the applier's duplicate filter never mistakes a new proposal for an old one.
    seq: std::sync::atomic::AtomicU64,
    pending: Pending,
}

impl MetaReplicator {
    pub fn new(
        node: Arc<ClusterNode>,
        me: u64,
        broker: BrokerHandle,
        replication: Option<crate::qq::Replication>,
        delete_delay: Option<Duration>,
    ) -> (Self, Pending) {
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_micros() as u64);
        let pending = Pending::default();
        let this = Self(Arc::new(Inner {
            node,
            me,
            broker,
            replication,
            delete_delay,
            seq: std::sync::atomic::AtomicU64::new(start),
            pending: pending.clone(),
        }));
        (this, pending)
    }
}

impl Inner {
    /// Proposes `change` (empty: a barrier) and waits for its apply on this node, within
    /// `bound`. `Ok(None)` for a barrier or a change this node could not apply.
    async fn propose(
        &self,
        change: Vec<u8>,
        bound: Duration,
    ) -> Result<Option<AdminResponse>, String> {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(seq, tx);
        let cmd = DefCommand::Change {
            origin: self.me,
            seq,
            change,
        };
        let result = tokio::time::timeout(bound, async {
            let mut backoff = Duration::from_millis(20);
            loop {
                match self.node.write(&cmd).await {
                    Ok(DefReply::Logged { .. }) => break,
                    Ok(other) => return Err(format!("refused by the metadata group: {other:?}")),
                    // No leader known (an election), or the one known cannot be reached
                    // (it died, or this node is cut off): ask again until the bound.
                    Err(NodeError::NotLeader(_) | NodeError::Forward(..)) => {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(250));
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            rx.await.map_err(|_| "the applier stopped".to_string())
        })
        .await;
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(format!(
                "no quorum within {} ms (is this node cut off from most of the cluster?)",
                bound.as_millis()
            )),
        };
        if result.is_err() {
            lock(&self.pending).remove(&seq);
        }
        result
    }
}

impl MetaReplicator {
    /// Proposes a change that is no `AdminRequest` (an MQTT takeover) and waits until this
    /// node applied it, within [`COMMIT_TIMEOUT`].
    pub async fn propose_change(&self, change: Vec<u8>) -> Result<(), String> {
        self.0.propose(change, COMMIT_TIMEOUT).await.map(|_| ())
    }
}

impl Replicator for MetaReplicator {
    fn replicate(&self, change: AdminRequest) -> ReplicateFuture {
        let Some(bytes) = encode(&change) else {
            let why = "not a replicated change".to_string();
            return Box::pin(async move { Err(why) });
        };
        let this = self.0.clone();
        // A new quorum queue's declare-ok waits for its group to have a leader serving it
        // (bounded), as RabbitMQ's waits for its Ra cluster: a publish right after it is
        // taken rather than nacked.
        let quorum = match &change {
            AdminRequest::Op {
                vhost,
                op: Op::QueueDeclare(d),
            } if !d.passive && is_quorum(d) => Some((vhost.clone(), d.queue.clone())),
            _ => None,
        };
        Box::pin(async move {
            match this.propose(bytes, COMMIT_TIMEOUT).await? {
                Some(answer) => {
                    if let Some((vhost, queue)) = quorum
                        && !failed(&answer)
                        && let Some(repl) = &this.replication
                    {
                        repl.wait_ready(&vhost, &queue, crate::qq::READY_TIMEOUT)
                            .await;
                    }
                    Ok(answer)
                }
                None => Err("this node could not apply the committed change".into()),
            }
        })
    }

    fn barrier(&self) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> {
        let this = self.0.clone();
        Box::pin(async move { this.propose(Vec::new(), BARRIER_TIMEOUT).await.map(|_| ()) })
    }

    fn precheck(
        &self,
        vhost: &str,
        op: &Op,
    ) -> Pin<Box<dyn Future<Output = Option<warren_core::error::ProtocolError>> + Send>> {
        crate::queue_use::precheck(
            self.0.node.clone(),
            self.0.me,
            self.0.broker.clone(),
            vhost,
            op,
            self.0.delete_delay,
        )
    }
}

// ----- queue locations -----

/// Where each classic queue lives (docs/cluster.md, "Queues live on one node"): the node
/// that proposed the declare that created it (the change's origin), so every node, applying
/// the same log in the same order, agrees. Kept in `<data-dir>/cluster/queue-homes.json`
/// (written, synced and renamed before the applied index passes the change), told to the
/// broker at start and on every change (`AdminRequest::QueueHome`).
#[derive(Default, Serialize, Deserialize)]
pub struct Homes {
    /// (vhost, queue) -> node.
    homes: Vec<(String, String, u64)>,
    #[serde(skip)]
    map: HashMap<(String, String), u64>,
}

fn homes_path(data_dir: &Path) -> PathBuf {
    data_dir.join("cluster").join("queue-homes.json")
}

impl Homes {
    /// The recorded homes (none if the file is missing; an unreadable file is an error:
    /// guessing would put messages on the wrong node).
    pub fn load(data_dir: &Path) -> Result<Homes, String> {
        let path = homes_path(data_dir);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Homes::default()),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let mut h: Homes =
            serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        h.map = h.homes.drain(..).map(|(v, q, n)| ((v, q), n)).collect();
        Ok(h)
    }

    fn save(&mut self, data_dir: &Path) -> std::io::Result<()> {
        let path = homes_path(data_dir);
        let mut list: Vec<(String, String, u64)> = self
            .map
            .iter()
            .map(|((v, q), n)| (v.clone(), q.clone(), *n))
            .collect();
        list.sort();
        let body = serde_json::to_vec(&serde_json::json!({ "homes": list }))
            .map_err(std::io::Error::other)?;
        write_atomic(&path, &body)
    }

    /// The broker's requests that place every recorded queue (`me`: this node).
    pub fn requests(&self, me: u64) -> Vec<AdminRequest> {
        self.map
            .iter()
            .filter(|(_, n)| **n != me)
            .map(|((vhost, queue), n)| AdminRequest::QueueHome {
                vhost: vhost.clone(),
                queue: queue.clone(),
                node: Some(*n as u32),
            })
            .collect()
    }

    /// The placements `change` (from `origin`) makes before it is applied: a declare of a
    /// classic queue with no home yet puts it on `origin`. Returns the broker's requests,
    /// and whether anything changed.
    fn before(&mut self, change: &AdminRequest, origin: u64, me: u64) -> Vec<AdminRequest> {
        let mut placed = Vec::new();
        let mut place =
            |map: &mut HashMap<(String, String), u64>, vhost: &str, d: &QueueDeclare| {
                if d.passive || !is_classic(d) {
                    return;
                }
                let key = (vhost.to_string(), d.queue.clone());
                // A durable queue stays where it was first declared; an MQTT clean session's
                // (exclusive) queue moves to the node of the newest session of its client id.
                if map.get(&key).is_some_and(|n| !d.exclusive || *n == origin) {
                    return;
                }
                map.insert(key, origin);
                placed.push(AdminRequest::QueueHome {
                    vhost: vhost.to_string(),
                    queue: d.queue.clone(),
                    node: (origin != me).then_some(origin as u32),
                });
            };
        match change {
            AdminRequest::Op {
                vhost,
                op: Op::QueueDeclare(d),
            } => place(&mut self.map, vhost, d),
            AdminRequest::Import(defs) => {
                for (vhost, d) in &defs.queues {
                    place(&mut self.map, vhost, d);
                }
            }
            _ => {}
        }
        placed
    }

    /// Whether the queue `change` declares lives on another node now (this node has a
    /// stub of it).
    fn remote(&self, change: &AdminRequest, me: u64) -> bool {
        match change {
            AdminRequest::Op {
                vhost,
                op: Op::QueueDeclare(d),
            } => self
                .map
                .get(&(vhost.clone(), d.queue.clone()))
                .is_some_and(|n| *n != me),
            _ => false,
        }
    }

    /// What `change` may remove once applied, noted before it is applied.
    fn watch(change: &AdminRequest) -> Watch {
        match change {
            AdminRequest::Op {
                vhost,
                op: Op::QueueDelete { queue, .. },
            } => Watch::Delete(vhost.clone(), queue.clone()),
            // A stub's declare may fail where the session's old queue still is (405): the
            // queue still lives on the newest session's node.
            AdminRequest::Op {
                vhost,
                op: Op::QueueDeclare(d),
            } if !d.exclusive => Watch::Declare(vhost.clone(), d.queue.clone()),
            AdminRequest::DeleteVhost(v) => Watch::Vhost(v.clone()),
            _ => Watch::Nothing,
        }
    }

    /// The homes `watch`'s change removed (`failed`: it changed nothing, so a home its
    /// declare placed goes too; `missing`: it failed because the queue is not there).
    fn after(&mut self, watch: Watch, failed: bool, missing: bool) -> Vec<AdminRequest> {
        let gone: Vec<(String, String)> = match watch {
            Watch::Delete(v, q) if !failed || missing => vec![(v, q)],
            Watch::Declare(v, q) if failed => vec![(v, q)],
            Watch::Vhost(v) if !failed => self
                .map
                .keys()
                .filter(|(hv, _)| *hv == v)
                .cloned()
                .collect(),
            _ => Vec::new(),
        };
        gone.into_iter()
            .filter(|k| self.map.remove(k).is_some())
            .map(|(vhost, queue)| AdminRequest::QueueHome {
                vhost,
                queue,
                node: None,
            })
            .collect()
    }
}

/// What a change may remove from the homes, once applied.
enum Watch {
    Delete(String, String),
    Declare(String, String),
    Vhost(String),
    Nothing,
}

/// Classic queues (and MQTT QoS 0 sessions' `mqtt-qos0` queues) live on one node; quorum
/// queues and streams are placed by their own mechanisms (their groups), not here.
fn is_classic(d: &QueueDeclare) -> bool {
    d.arguments
        .get("x-queue-type")
        .and_then(|v| v.as_str())
        .is_none_or(|t| t == "classic" || t == "mqtt-qos0")
}

fn is_quorum(d: &QueueDeclare) -> bool {
    d.arguments
        .get("x-queue-type")
        .and_then(|v| v.as_str())
        .is_some_and(|t| t == "quorum")
}

/// Whether the broker's answer to a change says it changed nothing.
fn failed(answer: &AdminResponse) -> bool {
    match answer {
        AdminResponse::Op(r) => r.is_err(),
        AdminResponse::Done(r) => r.is_err(),
        _ => false,
    }
}

/// Whether the broker's answer says the entity was not there.
fn missing(answer: &AdminResponse) -> bool {
    matches!(answer, AdminResponse::Op(Err(e)) if e.code == warren_core::error::ErrorCode::NotFound)
}

/// How this node applies an MQTT clean session's (exclusive) queue declare: the session's
/// node leaves it to the session's own declare, which follows the commit (the queue is
/// the session connection's), after removing a stub of it left from an earlier session
/// elsewhere; every other node keeps a stub (transient, owned by no connection) that
/// forwards to it. `None`: not such a declare.
fn session_declare(request: &AdminRequest, origin: u64, me: u64) -> Option<Option<AdminRequest>> {
    let AdminRequest::Op {
        vhost,
        op: Op::QueueDeclare(d),
    } = request
    else {
        return None;
    };
    if !d.exclusive {
        return None;
    }
    if origin == me {
        return Some(None);
    }
    let mut stub = d.clone();
    stub.exclusive = false;
    stub.durable = false;
    stub.auto_delete = false;
    Some(Some(AdminRequest::Op {
        vhost: vhost.clone(),
        op: Op::QueueDeclare(stub),
    }))
}

// ----- applying -----

fn applied_path(data_dir: &Path) -> PathBuf {
    data_dir.join("cluster").join("meta.applied")
}

/// The index this node's broker applied up to, as last recorded (0: none).
fn read_applied(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Records `index` durably (temporary file, fsync, rename).
fn write_applied(path: &Path, index: u64) -> std::io::Result<()> {
    write_atomic(path, format!("{index}\n").as_bytes())
}

/// Applies the committed changes to this node's broker, in log order, until the broker
/// stops. The recorded index lags the applied one by one tick (500 ms): the core makes a
/// definition durable with its next sync (milliseconds), so a change is recorded as
/// applied only once the store has it; a crash re-applies at most the last tick's
/// changes, which are idempotent declares, binds and deletes of the same state.
pub async fn run_applier(
    node: Arc<ClusterNode>,
    broker: BrokerHandle,
    me: u64,
    pending: Pending,
    data_dir: PathBuf,
    mut homes: Homes,
    takeover: TakeoverSlot,
) {
    let path = applied_path(&data_dir);
    let mut applied = read_applied(&path);
    let mut recorded = applied;
    let mut previous_tick = applied;
    let mut metrics = node.raft.metrics();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen: VecDeque<(u64, u64)> = VecDeque::new();
    let mut seen_set: HashSet<(u64, u64)> = HashSet::new();
    let mut gap_reported = false;
    tracing::info!(
        node_id = me,
        applied,
        "cluster: applying metadata changes from index {}",
        applied + 1
    );
    loop {
        let _ = metrics.borrow_and_update();
        let (evicted, batch) = node
            .definitions
            .with(|d| d.changes_after(applied, APPLY_BATCH));
        if evicted > applied && !gap_reported {
            // Changes this node never applied left the window (it was behind by more than
            // the window, or joined by snapshot): its broker misses them.
            tracing::error!(
                applied,
                evicted,
                "cluster: metadata changes up to index {evicted} left the window before this node applied them; its topology may differ (docs/cluster.md)",
            );
            gap_reported = true;
        }
        if batch.is_empty() {
            tokio::select! {
                changed = metrics.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = tick.tick() => {
                    if previous_tick > recorded {
                        match write_applied(&path, previous_tick) {
                            Ok(()) => recorded = previous_tick,
                            Err(e) => tracing::warn!("cluster: cannot record the applied index in {}: {e}", path.display()),
                        }
                    }
                    previous_tick = applied;
                }
            }
            continue;
        }
        for change in batch {
            applied = change.index;
            let id = (change.origin, change.seq);
            if !seen_set.insert(id) {
                continue;
            }
            seen.push_back(id);
            if seen.len() > SEEN
                && let Some(old) = seen.pop_front()
            {
                seen_set.remove(&old);
            }
            let answer = if change.change.is_empty() {
                // A barrier: nothing to apply.
                None
            } else if let Some((vhost, client_id)) = decode_takeover(&change.change) {
                if change.origin != me
                    && let Some(hook) = takeover.get()
                {
                    hook(&vhost, &client_id);
                }
                Some(AdminResponse::Done(Ok(())))
            } else {
                match decode(&change.change) {
                    Ok(request) => {
                        let had_stub = homes.remote(&request, me);
                        let placed = homes.before(&request, change.origin, me);
                        let moved = !placed.is_empty();
                        for p in placed {
                            if broker.admin_local(p).await.is_err() {
                                return;
                            }
                        }
                        let request = match session_declare(&request, change.origin, me) {
                            None => request,
                            Some(Some(stub)) => stub,
                            Some(None) => {
                                // The session's own declare creates it here.
                                if let (
                                    true,
                                    AdminRequest::Op {
                                        vhost,
                                        op: Op::QueueDeclare(d),
                                    },
                                ) = (had_stub, &request)
                                {
                                    let delete = AdminRequest::Op {
                                        vhost: vhost.clone(),
                                        op: Op::QueueDelete {
                                            queue: d.queue.clone(),
                                            if_unused: false,
                                            if_empty: false,
                                            nowait: true,
                                        },
                                    };
                                    if broker.admin_local(delete).await.is_err() {
                                        return;
                                    }
                                }
                                if moved && let Err(e) = homes.save(&data_dir) {
                                    tracing::error!("cluster: cannot record queue locations: {e}");
                                }
                                if change.origin == me
                                    && let Some(tx) = lock(&pending).remove(&change.seq)
                                {
                                    let _ = tx.send(Some(AdminResponse::Op(Ok(None))));
                                }
                                continue;
                            }
                        };
                        let watch = match Homes::watch(&request) {
                            // A declare that placed nothing (the queue had its home)
                            // removes nothing if it fails (an inequivalent redeclare).
                            Watch::Declare(..) if !moved => Watch::Nothing,
                            w => w,
                        };
                        let answer = match broker.admin_local(request).await {
                            Ok(answer) => answer,
                            Err(_) => return,
                        };
                        let gone = homes.after(watch, failed(&answer), missing(&answer));
                        let moved = moved || !gone.is_empty();
                        for g in gone {
                            if broker.admin_local(g).await.is_err() {
                                return;
                            }
                        }
                        // Durable before the applied index can pass this change.
                        if moved && let Err(e) = homes.save(&data_dir) {
                            tracing::error!(
                                "cluster: cannot record queue locations in {}: {e}",
                                homes_path(&data_dir).display()
                            );
                        }
                        Some(answer)
                    }
                    Err(e) => {
                        tracing::error!(
                            index = change.index,
                            "cluster: cannot read metadata change: {e}"
                        );
                        None
                    }
                }
            };
            if change.origin == me
                && let Some(tx) = lock(&pending).remove(&change.seq)
            {
                let _ = tx.send(answer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::message::{FieldTable, FieldValue};

    #[test]
    fn changes_round_trip_losslessly() {
        let mut args = FieldTable::new();
        args.insert("x-max-length".into(), FieldValue::I8(5));
        args.insert("x-queue-mode".into(), FieldValue::LongString("lazy".into()));
        let declare = AdminRequest::Op {
            vhost: "/v".into(),
            op: Op::QueueDeclare(QueueDeclare {
                queue: "q".into(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: args.clone(),
            }),
        };
        let back = decode(&encode(&declare).expect("a change")).expect("decodes");
        let AdminRequest::Op { vhost, op } = back else {
            panic!("not an op: {back:?}");
        };
        assert_eq!(vhost, "/v");
        let Op::QueueDeclare(q) = op else {
            panic!("not a declare: {op:?}");
        };
        // An I8 stays an I8 (JSON would make it a long, and a redeclare inequivalent).
        assert_eq!(q.arguments, args);
        let user = AdminRequest::AddUser(UserDef {
            name: "u".into(),
            password_hash: vec![1, 2, 3],
            tags: vec!["administrator".into()],
        });
        assert!(matches!(
            decode(&encode(&user).expect("a change")),
            Ok(AdminRequest::AddUser(u)) if u.password_hash == [1, 2, 3]
        ));
        assert!(encode(&AdminRequest::ListQueues).is_none());
        assert!(decode(b"{not json").is_err());
    }
}
