//! What operators see and ask (`warren ctl`, the HTTP API): the listings' records, the
//! requests and their answers, and which shards a request goes to (`AdminRequest::gathered`,
//! `AdminRequest::replica`), so the multi-shard composition (`crate::shards`) and the
//! runtime apply one rule, exercised by the deterministic tests.

use crate::access::{PermissionDef, UserDef, VhostDef};
use crate::command::Op;
use crate::ids::ConnId;
use crate::message::FieldTable;
use crate::stats::MessageStats;

/// What an import did: how many definitions of each kind it imported, and what it could
/// not, as RabbitMQ-style texts (a summary says what was imported, not what was asked).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportReport {
    pub vhosts: usize,
    pub users: usize,
    pub permissions: usize,
    pub policies: usize,
    pub exchanges: usize,
    pub queues: usize,
    pub bindings: usize,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct QueueInfo {
    pub vhost: String,
    pub name: String,
    /// Its type (`x-queue-type`).
    pub queue_type: crate::queue_type::QueueType,
    pub durable: bool,
    pub auto_delete: bool,
    pub exclusive: bool,
    pub arguments: FieldTable,
    /// Ready messages (in memory and paged out).
    pub messages_ready: u64,
    pub messages_unacked: u64,
    pub consumers: usize,
    /// Body bytes of the ready messages held in memory.
    pub memory: u64,
    /// Ready messages only on disk.
    pub paged_out: u64,
    /// Enqueued, delivered, acked (counts since the queue was created).
    pub stats: MessageStats,
    /// The policy that applies to it, if any.
    pub policy: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeInfo {
    pub vhost: String,
    pub name: String,
    pub kind: &'static str,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BindingInfo {
    pub vhost: String,
    pub source: String,
    pub destination: String,
    pub destination_is_exchange: bool,
    pub routing_key: String,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ConnectionInfo {
    pub conn: ConnId,
    pub vhost: String,
    pub user: String,
    pub channels: usize,
    pub consumers: u32,
    /// Deliveries handed to the host and not yet written.
    pub in_flight: u32,
    /// Queues pausing it (flow control).
    pub paused_by: usize,
    /// Published, delivered, acked over its life (its channels', open and closed).
    pub stats: MessageStats,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChannelInfo {
    pub conn: ConnId,
    pub channel: u16,
    pub vhost: String,
    pub user: String,
    pub consumers: usize,
    /// Deliveries awaiting an ack.
    pub unacked: usize,
    /// basic.qos per consumer (global = false) and for the channel (global = true).
    pub prefetch: u16,
    pub global_prefetch: u16,
    pub confirm: bool,
    pub transactional: bool,
    pub stats: MessageStats,
}

/// The memory alarm's state (`rabbitmqctl status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStatus {
    /// Message body bytes held (by every shard, when they share a count).
    pub held: u64,
    /// The alarm's threshold.
    pub watermark: u64,
    pub alarm: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ConsumerInfo {
    pub vhost: String,
    pub queue: String,
    pub tag: String,
    pub conn: ConnId,
    pub channel: u16,
    pub ack_required: bool,
    pub exclusive: bool,
    pub prefetch: u16,
    pub priority: i64,
    pub unacked: u32,
}

/// What `warren ctl` can ask the broker.
#[derive(Debug)]
#[non_exhaustive]
pub enum AdminRequest {
    ListQueues,
    ListExchanges,
    ListBindings,
    ListConnections,
    ListConsumers,
    /// The durable definitions, for export.
    Definitions,
    /// One operation in a vhost on the broker's admin channel (purge, delete, declare, bind).
    Op {
        vhost: String,
        op: Op,
    },
    /// Declares everything in the definitions; answers with the errors.
    Import(crate::store::Definitions),
    SetPolicy(crate::policy::PolicyDef),
    ClearPolicy {
        vhost: String,
        name: String,
    },
    ListPolicies,
    AddVhost(VhostDef),
    DeleteVhost(String),
    ListVhosts,
    /// Adds a user; refused when it exists.
    AddUser(UserDef),
    /// Replaces the password hash of an existing user.
    ChangePassword {
        user: String,
        password_hash: Vec<u8>,
    },
    SetUserTags {
        user: String,
        tags: Vec<String>,
    },
    DeleteUser(String),
    ListUsers,
    SetPermissions(PermissionDef),
    ClearPermissions {
        vhost: String,
        user: String,
    },
    ListPermissions,
    /// Every client channel (gathered from every shard).
    ListChannels,
    /// Message counts per vhost (summed over the shards).
    VhostStats,
    /// The memory alarm's state.
    MemoryStatus,
    /// Sets the memory alarm's threshold in bytes, on every shard.
    SetMemoryWatermark(u64),
    /// Closes a client connection with CONNECTION_FORCED and the reason (on its shard).
    CloseConnection {
        conn: ConnId,
        reason: String,
    },
}

impl AdminRequest {
    /// The same request, if each shard answers it for what it owns (queues and their
    /// consumers live on their owners' shards, connections on theirs).
    pub fn gathered(&self) -> Option<AdminRequest> {
        match self {
            AdminRequest::ListQueues => Some(AdminRequest::ListQueues),
            AdminRequest::ListConsumers => Some(AdminRequest::ListConsumers),
            AdminRequest::ListConnections => Some(AdminRequest::ListConnections),
            AdminRequest::ListChannels => Some(AdminRequest::ListChannels),
            AdminRequest::VhostStats => Some(AdminRequest::VhostStats),
            _ => None,
        }
    }

    /// The same request, for the other shards, if every shard must apply it: users,
    /// permissions and vhosts, which every shard checks at connection.open (a deleted
    /// vhost closes each shard's connections and deletes its queues), and policies, which
    /// each shard applies to the queues it owns (of an import, those parts).
    pub fn replica(&self) -> Option<AdminRequest> {
        Some(match self {
            AdminRequest::AddUser(u) => AdminRequest::AddUser(u.clone()),
            AdminRequest::ChangePassword {
                user,
                password_hash,
            } => AdminRequest::ChangePassword {
                user: user.clone(),
                password_hash: password_hash.clone(),
            },
            AdminRequest::SetUserTags { user, tags } => AdminRequest::SetUserTags {
                user: user.clone(),
                tags: tags.clone(),
            },
            AdminRequest::DeleteUser(name) => AdminRequest::DeleteUser(name.clone()),
            AdminRequest::SetPermissions(p) => AdminRequest::SetPermissions(p.clone()),
            AdminRequest::ClearPermissions { vhost, user } => AdminRequest::ClearPermissions {
                vhost: vhost.clone(),
                user: user.clone(),
            },
            // The other shards take an import's vhosts, users, permissions and policies;
            // its exchanges, queues and bindings are topology's, shard 0's.
            AdminRequest::Import(d) => AdminRequest::Import(crate::store::Definitions {
                vhosts: d.vhosts.clone(),
                users: d.users.clone(),
                permissions: d.permissions.clone(),
                policies: d.policies.clone(),
                ..Default::default()
            }),
            AdminRequest::AddVhost(v) => AdminRequest::AddVhost(v.clone()),
            AdminRequest::DeleteVhost(name) => AdminRequest::DeleteVhost(name.clone()),
            AdminRequest::SetPolicy(p) => AdminRequest::SetPolicy(p.clone()),
            AdminRequest::ClearPolicy { vhost, name } => AdminRequest::ClearPolicy {
                vhost: vhost.clone(),
                name: name.clone(),
            },
            AdminRequest::SetMemoryWatermark(bytes) => AdminRequest::SetMemoryWatermark(*bytes),
            _ => return None,
        })
    }
}

impl AdminRequest {
    /// One answer made of every shard's answer to a `gathered` request (each lists what
    /// it owns), sorted as one broker lists it; any other answer is passed on as it is.
    pub fn merge(&self, answers: impl IntoIterator<Item = AdminResponse>) -> AdminResponse {
        let (mut queues, mut consumers, mut connections) = (Vec::new(), Vec::new(), Vec::new());
        let mut channels = Vec::new();
        let mut stats = std::collections::BTreeMap::<String, MessageStats>::new();
        for answer in answers {
            match answer {
                AdminResponse::Queues(q) => queues.extend(q),
                AdminResponse::Consumers(c) => consumers.extend(c),
                AdminResponse::Connections(c) => connections.extend(c),
                AdminResponse::Channels(c) => channels.extend(c),
                AdminResponse::VhostStats(s) => {
                    for (vhost, s) in s {
                        stats.entry(vhost).or_default().add(&s);
                    }
                }
                other => return other,
            }
        }
        match self {
            AdminRequest::ListChannels => {
                channels.sort_by_key(|c| (c.conn, c.channel));
                AdminResponse::Channels(channels)
            }
            AdminRequest::VhostStats => AdminResponse::VhostStats(stats.into_iter().collect()),
            AdminRequest::ListQueues => {
                queues.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
                AdminResponse::Queues(queues)
            }
            AdminRequest::ListConsumers => {
                consumers.sort_by(|a, b| {
                    (&a.vhost, &a.queue, &a.tag).cmp(&(&b.vhost, &b.queue, &b.tag))
                });
                AdminResponse::Consumers(consumers)
            }
            _ => {
                connections.sort_by_key(|c| c.conn);
                AdminResponse::Connections(connections)
            }
        }
    }
}

/// The broker's answer to an [`AdminRequest`].
#[derive(Debug)]
#[non_exhaustive]
pub enum AdminResponse {
    Queues(Vec<QueueInfo>),
    Exchanges(Vec<ExchangeInfo>),
    Bindings(Vec<BindingInfo>),
    Connections(Vec<ConnectionInfo>),
    Consumers(Vec<ConsumerInfo>),
    Definitions(crate::store::Definitions),
    Op(Result<Option<crate::effect::Reply>, crate::error::ProtocolError>),
    /// What was imported, and what could not be (RabbitMQ-style error texts).
    Imported(ImportReport),
    /// A change (policy, vhost, user, permissions) was made, or why not.
    Done(Result<(), String>),
    Policies(Vec<crate::policy::PolicyDef>),
    Vhosts(Vec<VhostDef>),
    Users(Vec<UserDef>),
    Permissions(Vec<PermissionDef>),
    Channels(Vec<ChannelInfo>),
    VhostStats(Vec<(String, crate::stats::MessageStats)>),
    Memory(MemoryStatus),
    /// Whether the connection to close existed.
    Closed(bool),
}
