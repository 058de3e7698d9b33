//! What operators see and ask (`warren ctl`, the HTTP API): the listings' records, the
//! requests and their answers, and which shards a request goes to (`AdminRequest::gathered`,
//! `AdminRequest::replica`), so the multi-shard composition (`crate::shards`) and the
//! runtime apply one rule, exercised by the deterministic tests.

use crate::access::{PermissionDef, TopicPermissionDef, UserDef, VhostDef};
use crate::command::Op;
use crate::ids::ConnId;
use crate::message::FieldTable;
use crate::stats::MessageStats;

/// What an import did: how many definitions of each kind it imported, and what it could
/// not, as RabbitMQ-style texts (a summary says what was imported, not what was asked).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportReport {
    /// Vhosts imported.
    pub vhosts: usize,
    /// Users imported.
    pub users: usize,
    /// Permissions imported.
    pub permissions: usize,
    /// Topic permissions imported.
    pub topic_permissions: usize,
    /// Policies imported.
    pub policies: usize,
    /// Runtime parameters imported.
    pub parameters: usize,
    /// Exchanges imported.
    pub exchanges: usize,
    /// Queues imported.
    pub queues: usize,
    /// Bindings imported.
    pub bindings: usize,
    /// What could not be imported, as RabbitMQ-style texts.
    pub errors: Vec<String>,
}

/// A queue, as `list_queues` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueInfo {
    /// The vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// Its type (`x-queue-type`).
    pub queue_type: crate::queue_type::QueueType,
    /// It survives a restart.
    pub durable: bool,
    /// Deleted with its last consumer (queue) or binding (exchange).
    pub auto_delete: bool,
    /// It is exclusive to its connection (a queue), or an exclusive consumer.
    pub exclusive: bool,
    /// Its arguments.
    pub arguments: FieldTable,
    /// Ready messages (in memory and paged out).
    pub messages_ready: u64,
    /// Deliveries awaiting an ack.
    pub messages_unacked: u64,
    /// Consumers.
    pub consumers: usize,
    /// Body bytes of the ready messages held in memory.
    pub memory: u64,
    /// Ready messages only on disk.
    pub paged_out: u64,
    /// Dead letters a quorum queue holds until their targets confirm them (at-least-once
    /// dead-lettering; RabbitMQ's `messages_dlx`).
    pub messages_dlx: u64,
    /// Enqueued, delivered, acked (counts since the queue was created).
    pub stats: MessageStats,
    /// The policy that applies to it, if any.
    pub policy: Option<String>,
}

/// An exchange, as `list_exchanges` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeInfo {
    /// The vhost.
    pub vhost: String,
    /// Its name.
    pub name: String,
    /// Its type.
    pub kind: &'static str,
    /// It survives a restart.
    pub durable: bool,
    /// Deleted with its last consumer (queue) or binding (exchange).
    pub auto_delete: bool,
    /// Clients may not publish to it.
    pub internal: bool,
    /// Its arguments.
    pub arguments: FieldTable,
}

/// A binding, as `list_bindings` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct BindingInfo {
    /// The vhost.
    pub vhost: String,
    /// The exchange bound from.
    pub source: String,
    /// The queue or exchange bound.
    pub destination: String,
    /// `destination` names an exchange.
    pub destination_is_exchange: bool,
    /// The routing key.
    pub routing_key: String,
    /// Its arguments.
    pub arguments: FieldTable,
}

/// A client connection, as `list_connections` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ConnectionInfo {
    /// The connection.
    pub conn: ConnId,
    /// The vhost.
    pub vhost: String,
    /// The user.
    pub user: String,
    /// Open channels.
    pub channels: usize,
    /// Consumers.
    pub consumers: u32,
    /// Deliveries handed to the host and not yet written.
    pub in_flight: u32,
    /// Queues pausing it (flow control).
    pub paused_by: usize,
    /// Published, delivered, acked over its life (its channels', open and closed).
    pub stats: MessageStats,
}

/// A client channel, as `list_channels` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ChannelInfo {
    /// The connection.
    pub conn: ConnId,
    /// The channel number.
    pub channel: u16,
    /// The vhost.
    pub vhost: String,
    /// The user.
    pub user: String,
    /// Consumers.
    pub consumers: usize,
    /// Deliveries awaiting an ack.
    pub unacked: usize,
    /// basic.qos per consumer (global = false) and for the channel (global = true).
    pub prefetch: u16,
    /// basic.qos global.
    pub global_prefetch: u16,
    /// In confirm mode.
    pub confirm: bool,
    /// In transaction mode.
    pub transactional: bool,
    /// Message counts.
    pub stats: MessageStats,
}

/// The memory alarm's state (`rabbitmqctl status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStatus {
    /// Message body bytes held (by every shard, when they share a count).
    pub held: u64,
    /// The alarm's threshold.
    pub watermark: u64,
    /// The memory alarm is raised.
    pub alarm: bool,
}

/// A consumer, as `list_consumers` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ConsumerInfo {
    /// The vhost.
    pub vhost: String,
    /// The queue, by name (`""`: the channel's last declared queue).
    pub queue: String,
    /// The consumer tag.
    pub tag: String,
    /// The connection.
    pub conn: ConnId,
    /// The channel number.
    pub channel: u16,
    /// Deliveries need an ack.
    pub ack_required: bool,
    /// It is exclusive to its connection (a queue), or an exclusive consumer.
    pub exclusive: bool,
    /// Its prefetch.
    pub prefetch: u16,
    /// Its priority (`x-priority` for a consumer; the message priority).
    pub priority: i64,
    /// Deliveries awaiting an ack.
    pub unacked: u32,
}

/// What `warren ctl` can ask the broker.
#[derive(Debug)]
#[non_exhaustive]
pub enum AdminRequest {
    /// Every queue.
    ListQueues,
    /// Every exchange.
    ListExchanges,
    /// Every binding.
    ListBindings,
    /// Every client connection.
    ListConnections,
    /// Every consumer.
    ListConsumers,
    /// The durable definitions, for export.
    Definitions,
    /// One operation in a vhost on the broker's admin channel (purge, delete, declare, bind).
    Op {
        /// The vhost.
        vhost: String,
        /// The operation.
        op: Op,
    },
    /// A message the broker publishes about itself (the MQTT gateway's `$SYS` topics) in a
    /// vhost: routed and delivered as an [`AdminRequest::Op`] publish, but on a channel of
    /// its own whose publishes the message stats leave out, since those count what clients
    /// publish (RabbitMQ's `message_stats`, Mosquitto's `messages/received`). Answered with
    /// `Op`.
    StatusPublish {
        /// The vhost.
        vhost: String,
        /// The message.
        publish: Box<crate::command::Publish>,
    },
    /// Declares everything in the definitions; answers with the errors.
    Import(crate::store::Definitions),
    /// Sets a policy.
    SetPolicy(crate::policy::PolicyDef),
    /// Clears a policy.
    ClearPolicy {
        /// The vhost.
        vhost: String,
        /// Its name.
        name: String,
    },
    /// Every policy.
    ListPolicies,
    /// Sets a runtime parameter (its value validated by the host first).
    SetParameter(crate::parameter::ParameterDef),
    /// Clears a runtime parameter.
    ClearParameter {
        /// The vhost.
        vhost: String,
        /// Its component.
        component: String,
        /// Its name.
        name: String,
    },
    /// Every runtime parameter.
    ListParameters,
    /// Adds a vhost.
    AddVhost(VhostDef),
    /// Deletes a vhost and everything in it.
    DeleteVhost(String),
    /// Every vhost.
    ListVhosts,
    /// Adds a user; refused when it exists.
    AddUser(UserDef),
    /// Replaces the password hash of an existing user.
    ChangePassword {
        /// The user.
        user: String,
        /// The new hash (RabbitMQ's salted SHA-256).
        password_hash: Vec<u8>,
    },
    /// Replaces the tags of an existing user.
    SetUserTags {
        /// The user.
        user: String,
        /// The new tags.
        tags: Vec<String>,
    },
    /// Deletes a user.
    DeleteUser(String),
    /// Every user.
    ListUsers,
    /// Sets a user's permissions in a vhost.
    SetPermissions(PermissionDef),
    /// Clears a user's permissions in a vhost.
    ClearPermissions {
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
    },
    /// Every permission.
    ListPermissions,
    /// Sets a user's topic permissions on an exchange of a vhost.
    SetTopicPermissions(TopicPermissionDef),
    /// Clears a user's topic permissions in a vhost (on one exchange, or all).
    ClearTopicPermissions {
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
        /// The exchange; `None`: every exchange.
        exchange: Option<String>,
    },
    /// Every topic permission.
    ListTopicPermissions,
    /// Every client channel (gathered from every shard).
    ListChannels,
    /// Message counts per vhost (summed over the shards).
    VhostStats,
    /// The memory alarm's state.
    MemoryStatus,
    /// Sets the memory alarm's threshold in bytes, on every shard.
    SetMemoryWatermark(u64),
    /// MQTT retained messages per vhost (topology's: shard 0 answers).
    RetainedStats,
    /// A replicated quorum queue changed hands on this node (it now leads the queue's group,
    /// or no longer does): the queue drops the ready messages it holds and takes what the
    /// store recovers for it (docs/cluster.md, "Quorum queues"). Answered `Done(Err)` when
    /// the queue is not on this broker (shard 0's).
    ReloadQueue {
        /// The vhost.
        vhost: String,
        /// The queue.
        name: String,
    },
    /// Queue `queue` of `vhost` lives on cluster node `node` (`None`: on this node): this
    /// node keeps a stub of it and sends what it routes there to that node
    /// (`NodeMail`). Every shard applies it.
    QueueHome {
        /// The queue's vhost.
        vhost: String,
        /// Its name.
        queue: String,
        /// The node it lives on; `None`: this one.
        node: Option<u32>,
    },
    /// Messages `mqtt-qos0` queues dropped since the start, their subscribers being too
    /// slow (summed over the shards).
    Qos0Dropped,
    /// Delayed messages per exchange (docs/delayed.md; gathered from every shard, each
    /// schedules its own connections' publishes).
    ListScheduled,
    /// Drops every delayed message of an exchange, on every shard; answered `Dropped(n)`.
    PurgeScheduled {
        /// The vhost.
        vhost: String,
        /// The exchange.
        exchange: String,
    },
    /// Closes a client connection with CONNECTION_FORCED and the reason (on its shard).
    CloseConnection {
        /// The connection.
        conn: ConnId,
        /// Why (sent to the client with 320 CONNECTION_FORCED).
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
            AdminRequest::Qos0Dropped => Some(AdminRequest::Qos0Dropped),
            AdminRequest::ListScheduled => Some(AdminRequest::ListScheduled),
            AdminRequest::PurgeScheduled { vhost, exchange } => {
                Some(AdminRequest::PurgeScheduled {
                    vhost: vhost.clone(),
                    exchange: exchange.clone(),
                })
            }
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
            AdminRequest::SetTopicPermissions(p) => AdminRequest::SetTopicPermissions(p.clone()),
            AdminRequest::ClearTopicPermissions {
                vhost,
                user,
                exchange,
            } => AdminRequest::ClearTopicPermissions {
                vhost: vhost.clone(),
                user: user.clone(),
                exchange: exchange.clone(),
            },
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
                topic_permissions: d.topic_permissions.clone(),
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
            AdminRequest::QueueHome { vhost, queue, node } => AdminRequest::QueueHome {
                vhost: vhost.clone(),
                queue: queue.clone(),
                node: *node,
            },
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
        let mut dropped = 0u64;
        let mut scheduled =
            std::collections::BTreeMap::<(String, String), (u64, Option<u64>)>::new();
        for answer in answers {
            match answer {
                AdminResponse::Scheduled(list) => {
                    for s in list {
                        let e = scheduled.entry((s.vhost, s.exchange)).or_default();
                        e.0 += s.messages;
                        e.1 = match (e.1, s.next_due) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                    }
                }
                AdminResponse::Queues(q) => queues.extend(q),
                AdminResponse::Consumers(c) => consumers.extend(c),
                AdminResponse::Connections(c) => connections.extend(c),
                AdminResponse::Channels(c) => channels.extend(c),
                AdminResponse::Dropped(n) => dropped += n,
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
            AdminRequest::Qos0Dropped | AdminRequest::PurgeScheduled { .. } => {
                AdminResponse::Dropped(dropped)
            }
            AdminRequest::ListScheduled => AdminResponse::Scheduled(
                scheduled
                    .into_iter()
                    .map(|((vhost, exchange), (messages, next_due))| ScheduledInfo {
                        vhost,
                        exchange,
                        messages,
                        next_due,
                    })
                    .collect(),
            ),
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
    /// The queues.
    Queues(Vec<QueueInfo>),
    /// The exchanges.
    Exchanges(Vec<ExchangeInfo>),
    /// The bindings.
    Bindings(Vec<BindingInfo>),
    /// The connections.
    Connections(Vec<ConnectionInfo>),
    /// The consumers.
    Consumers(Vec<ConsumerInfo>),
    /// The durable definitions.
    Definitions(crate::store::Definitions),
    /// The admin op's reply, or its error.
    Op(Result<Option<crate::effect::Reply>, crate::error::ProtocolError>),
    /// What was imported, and what could not be (RabbitMQ-style error texts).
    Imported(ImportReport),
    /// A change (policy, vhost, user, permissions) was made, or why not.
    Done(Result<(), AdminError>),
    /// The policies.
    Policies(Vec<crate::policy::PolicyDef>),
    /// The runtime parameters.
    Parameters(Vec<crate::parameter::ParameterDef>),
    /// The vhosts.
    Vhosts(Vec<VhostDef>),
    /// The users.
    Users(Vec<UserDef>),
    /// The permissions.
    Permissions(Vec<PermissionDef>),
    /// The topic permissions.
    TopicPermissions(Vec<TopicPermissionDef>),
    /// The channels.
    Channels(Vec<ChannelInfo>),
    /// Message counts per vhost.
    VhostStats(Vec<(String, crate::stats::MessageStats)>),
    /// The memory alarm's state.
    Memory(MemoryStatus),
    /// Whether the connection to close existed.
    Closed(bool),
    /// MQTT retained messages per vhost: (vhost, messages, payload bytes), by vhost name.
    Retained(Vec<(String, u64, u64)>),
    /// Messages dropped by `mqtt-qos0` queues.
    Dropped(u64),
    /// Delayed messages per exchange, in (vhost, exchange) order.
    Scheduled(Vec<ScheduledInfo>),
}

/// Why an admin change (a vhost, user, permission, policy, parameter) was not made. The
/// text is RabbitMQ's where it has one; the kind is what a host answers with (HTTP 404, 400
/// or 503; `rabbitmqctl`'s exit codes), so no host matches on the text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// What the change names does not exist (a vhost, user, policy, parameter, permission).
    #[error("{0}")]
    NotFound(String),
    /// The value is refused as it is (empty name, bad pattern, over a limit).
    #[error("{0}")]
    Invalid(String),
    /// The change could not be made durable or agreed on now (the metadata store or the
    /// cluster's metadata group is unavailable): the same change may succeed later.
    #[error("{0}")]
    Unavailable(String),
}

impl From<String> for AdminError {
    /// A validator's refusal (`Policy::new`, `Permissions::compile`): the value is invalid.
    fn from(text: String) -> AdminError {
        AdminError::Invalid(text)
    }
}

/// One exchange's delayed messages (`AdminRequest::ListScheduled`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledInfo {
    /// The vhost.
    pub vhost: String,
    /// The exchange they are routed through when due.
    pub exchange: String,
    /// How many are scheduled.
    pub messages: u64,
    /// The earliest due time known in memory (ms since the Unix epoch); `None` when every
    /// one of them is paged out to the store (the operator sees the count only).
    pub next_due: Option<u64>,
}
