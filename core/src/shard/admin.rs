//! What operators see and do (`warren ctl`): read-only listings of queues, exchanges,
//! bindings, connections and consumers, the definitions for export, and operations run on the
//! broker's own admin channel (purge, delete, declare for import), which go through the same
//! checks as a client's.

use super::{Broker, RESTORE_CONN};
use crate::admin::AdminError;
pub use crate::admin::{
    AdminRequest, AdminResponse, BindingInfo, ChannelInfo, ConnectionInfo, ConsumerInfo,
    ExchangeInfo, ImportReport, MemoryStatus, QueueInfo,
};
use crate::command::{Bind, ExchangeDeclare, Op, QueueDeclare};
use crate::effect::{Effect, Reply};
use crate::error::ProtocolError;
use crate::ids::{ChannelRef, ConnId, Destination};
use crate::queue::kind::QueueBehaviour;
use crate::stats::MessageStats;
use crate::store::Definitions;

/// The channel admin operations run on (the restore connection, never a host's).
const ADMIN_CHANNEL: u16 = 2;
/// The channel the broker's messages about itself are published on
/// ([`AdminRequest::StatusPublish`]); its publishes are not counted (`route_and_enqueue`).
pub(crate) const STATUS_CHANNEL: u16 = 3;

impl Broker {
    /// Every queue, by vhost and name.
    pub fn list_queues(&self) -> Vec<QueueInfo> {
        let mut out: Vec<QueueInfo> = self
            .qs
            .queues
            .values()
            .map(|q| QueueInfo {
                vhost: self.vhost_name(q.vhost).to_string(),
                name: q.name.to_string(),
                queue_type: q.kind(),
                durable: q.durable,
                auto_delete: q.auto_delete,
                exclusive: q.exclusive_owner.is_some(),
                arguments: q.arguments().clone(),
                messages_ready: q.messages.len() as u64,
                messages_unacked: q.unacked,
                consumers: q.consumers.len(),
                memory: q.messages.bytes(),
                paged_out: q.messages.paged().count,
                messages_dlx: q.dead_held().0,
                stats: q.stats,
                policy: self
                    .topo
                    .policy(q.vhost, &q.name, true)
                    .map(|p| p.def.name.clone()),
            })
            .collect();
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        out
    }

    /// Every exchange, by vhost and name (the default exchange is `""`).
    pub fn list_exchanges(&self) -> Vec<ExchangeInfo> {
        let mut out: Vec<ExchangeInfo> = self
            .topo
            .exchanges()
            .map(|(_, x)| ExchangeInfo {
                vhost: self.vhost_name(x.vhost).to_string(),
                name: x.name.to_string(),
                kind: match x.delayed {
                    Some(_) => crate::routing::DELAYED_TYPE,
                    None => x.kind.as_str(),
                },
                durable: x.durable,
                auto_delete: x.auto_delete,
                internal: x.internal,
                arguments: x.arguments.clone(),
            })
            .collect();
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        out
    }

    /// Every explicit binding (not the default exchange's implicit ones), by source.
    pub fn list_bindings(&self) -> Vec<BindingInfo> {
        let mut out = Vec::new();
        for (_, x) in self.topo.exchanges() {
            for b in x.bindings.list() {
                let (destination, destination_is_exchange) = match b.destination {
                    Destination::Queue(q) => match self.topo.queue(q) {
                        Some(q) => (q.name.to_string(), false),
                        None => continue,
                    },
                    Destination::Exchange(d) => match self.topo.exchange(d) {
                        Some(d) => (d.name.to_string(), true),
                        None => continue,
                    },
                };
                out.push(BindingInfo {
                    vhost: self.vhost_name(x.vhost).to_string(),
                    source: x.name.to_string(),
                    destination,
                    destination_is_exchange,
                    routing_key: b.routing_key.to_string(),
                    arguments: b.arguments,
                });
            }
        }
        out.sort_by(|a, b| {
            (&a.vhost, &a.source, &a.destination, &a.routing_key).cmp(&(
                &b.vhost,
                &b.source,
                &b.destination,
                &b.routing_key,
            ))
        });
        out
    }

    /// Every client connection, by id.
    pub fn list_connections(&self) -> Vec<ConnectionInfo> {
        let mut out: Vec<ConnectionInfo> = self
            .chans
            .conns
            .iter()
            .filter(|(id, _)| **id != RESTORE_CONN)
            .map(|(id, c)| ConnectionInfo {
                conn: *id,
                vhost: self.vhost_name(c.vhost).to_string(),
                user: c.user().to_string(),
                channels: c.channels.len(),
                consumers: c.consumers,
                in_flight: c.in_flight.get(),
                paused_by: c.paused_in.len(),
                stats: self.conn_stats(*id, c),
            })
            .collect();
        out.sort_by_key(|c| c.conn);
        out
    }

    /// A connection's counts: its closed channels' plus its open ones'.
    pub(super) fn conn_stats(&self, id: ConnId, c: &crate::channel::conn::Conn) -> MessageStats {
        let mut stats = c.closed_stats;
        for &n in c.channels.iter() {
            if let Some(ch) = self.chans.channels.get(&ChannelRef::new(id, n)) {
                stats.add(&ch.stats);
            }
        }
        stats
    }

    /// Every client channel, by connection and number.
    pub fn list_channels(&self) -> Vec<ChannelInfo> {
        let mut out: Vec<ChannelInfo> = self
            .chans
            .channels
            .iter()
            .filter(|(ch, _)| ch.conn != RESTORE_CONN)
            .filter_map(|(ch, c)| {
                let conn = self.chans.conns.get(&ch.conn)?;
                Some(ChannelInfo {
                    conn: ch.conn,
                    channel: ch.channel,
                    vhost: self.vhost_name(conn.vhost).to_string(),
                    user: conn.user().to_string(),
                    consumers: c.consumer_count(),
                    unacked: c.unacked.len(),
                    prefetch: c.prefetch_count,
                    global_prefetch: c.global_prefetch,
                    confirm: c.confirms(),
                    transactional: c.tx.is_some(),
                    stats: c.stats,
                })
            })
            .collect();
        out.sort_by_key(|c| (c.conn, c.channel));
        out
    }

    /// Message counts per vhost over the broker's life (publishes, deliveries and acks of
    /// every connection, closed ones included; the admin channel's too), by vhost name.
    pub fn vhost_stats(&self) -> Vec<(String, MessageStats)> {
        let mut by_vhost = self.closed_stats.clone();
        for (id, c) in self.chans.conns.iter() {
            by_vhost
                .entry(c.vhost)
                .or_default()
                .add(&self.conn_stats(*id, c));
        }
        let mut out: Vec<(String, MessageStats)> = by_vhost
            .into_iter()
            .map(|(vh, s)| (self.vhost_name(vh).to_string(), s))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The memory alarm: bytes held, threshold, raised or not.
    pub fn memory_status(&self) -> MemoryStatus {
        MemoryStatus {
            held: self.memory_held(),
            watermark: self.config.memory_high_watermark,
            alarm: self.alarm,
        }
    }

    /// Sets the memory alarm's threshold at run time (rabbitmqctl
    /// set_vm_memory_high_watermark): the alarm is raised or cleared at once.
    pub fn set_memory_high_watermark(&mut self, now: u64, bytes: u64) {
        self.now = self.now.max(now);
        self.config.memory_high_watermark = bytes;
        self.update_alarm();
    }

    /// Closes a client connection from the broker's side (320 CONNECTION_FORCED with the
    /// operator's reason, as rabbitmqctl close_connection). False if there is no such
    /// connection on this broker.
    pub fn close_connection(&mut self, conn: ConnId, reason: &str) -> bool {
        if conn == RESTORE_CONN || !self.chans.conns.contains_key(&conn) {
            return false;
        }
        self.force_close(conn, reason.to_string());
        self.after_op();
        true
    }

    /// Every consumer, by queue then tag.
    pub fn list_consumers(&self) -> Vec<ConsumerInfo> {
        let mut out: Vec<ConsumerInfo> = self
            .qs
            .queues
            .values()
            .flat_map(|q| q.consumers.iter().map(move |c| (q, c)))
            .map(|(q, c)| ConsumerInfo {
                vhost: self.vhost_name(q.vhost).to_string(),
                queue: q.name.to_string(),
                tag: c.tag.to_string(),
                conn: c.ch.conn,
                channel: c.ch.channel,
                ack_required: !c.no_ack,
                exclusive: c.exclusive,
                prefetch: c.prefetch,
                priority: i64::from(c.priority),
                unacked: c.unacked,
            })
            .collect();
        out.sort_by(|a, b| (&a.vhost, &a.queue, &a.tag).cmp(&(&b.vhost, &b.queue, &b.tag)));
        out
    }

    /// The durable definitions as they are now (for export): vhosts, users, permissions,
    /// policies, durable exchanges other than the predeclared ones, durable non-exclusive
    /// queues, bindings between durable ends.
    pub fn durable_definitions(&self) -> Definitions {
        let mut defs = Definitions {
            vhosts: self.list_vhosts(),
            users: self.list_users(),
            permissions: self.list_permissions(),
            topic_permissions: self.list_topic_permissions(),
            policies: self.list_policies(),
            parameters: self.list_parameters(),
            ..Definitions::default()
        };
        for x in self.list_exchanges() {
            if !x.durable || x.name.is_empty() || x.name.starts_with("amq.") {
                continue;
            }
            defs.exchanges.push((
                x.vhost,
                ExchangeDeclare {
                    exchange: x.name,
                    kind: x.kind.to_string(),
                    passive: false,
                    durable: true,
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    nowait: false,
                    arguments: x.arguments,
                },
            ));
        }
        for q in self.list_queues() {
            if !q.durable || q.exclusive {
                continue;
            }
            defs.queues.push((
                q.vhost,
                QueueDeclare {
                    queue: q.name,
                    passive: false,
                    durable: true,
                    exclusive: false,
                    auto_delete: q.auto_delete,
                    nowait: false,
                    arguments: q.arguments,
                },
            ));
        }
        let durable_exchange = |vhost: &str, name: &str| {
            self.vhost_id(vhost)
                .and_then(|vh| self.find_exchange(vh, name))
                .and_then(|id| self.topo.exchange(id))
                .is_some_and(|x| x.durable)
        };
        let durable_queue = |vhost: &str, name: &str| {
            self.vhost_id(vhost)
                .and_then(|vh| self.find_queue(vh, name))
                .and_then(|id| self.topo.queue(id))
                .is_some_and(|q| q.stored)
        };
        for b in self.list_bindings() {
            let destination_durable = if b.destination_is_exchange {
                durable_exchange(&b.vhost, &b.destination)
            } else {
                durable_queue(&b.vhost, &b.destination)
            };
            if !durable_exchange(&b.vhost, &b.source) || !destination_durable {
                continue;
            }
            defs.bindings.push((
                b.vhost,
                Bind {
                    destination: b.destination,
                    source: b.source,
                    routing_key: b.routing_key,
                    nowait: false,
                    arguments: b.arguments,
                },
                b.destination_is_exchange,
            ));
        }
        defs
    }

    /// Imports definitions (RabbitMQ's `import_definitions`): adds their vhosts, users (with
    /// their password hashes), permissions and policies, then declares their exchanges,
    /// queues and bindings in each vhost with a client's checks. What exists stays; the
    /// answer counts what was imported and lists what could not be, as RabbitMQ-style
    /// texts.
    pub fn import(&mut self, now: u64, defs: &Definitions) -> ImportReport {
        let mut report = ImportReport::default();
        let errors = &mut report.errors;
        for v in &defs.vhosts {
            match self.add_vhost(now, v.clone()) {
                Ok(()) => report.vhosts += 1,
                Err(e) => errors.push(format!("vhost '{}': {e}", v.name)),
            }
        }
        for u in &defs.users {
            match self.put_user(now, u.clone()) {
                Ok(()) => report.users += 1,
                Err(e) => errors.push(format!("user '{}': {e}", u.name)),
            }
        }
        for p in &defs.permissions {
            match self.set_permissions(now, p.clone()) {
                Ok(()) => report.permissions += 1,
                Err(e) => errors.push(format!(
                    "permissions of '{}' in vhost '{}': {e}",
                    p.user, p.vhost
                )),
            }
        }
        for p in &defs.topic_permissions {
            match self.set_topic_permissions(now, p.clone()) {
                Ok(()) => report.topic_permissions += 1,
                Err(e) => errors.push(format!(
                    "topic permissions of '{}' in vhost '{}' on exchange '{}': {e}",
                    p.user, p.vhost, p.exchange
                )),
            }
        }
        for p in &defs.policies {
            match self.set_policy(now, p.clone()) {
                Ok(()) => report.policies += 1,
                Err(e) => errors.push(format!("policy '{}' in vhost '{}': {e}", p.name, p.vhost)),
            }
        }
        // Only shard 0 keeps parameters (the replica of an import carries none).
        for p in &defs.parameters {
            match self.set_parameter(now, p.clone()) {
                Ok(()) => report.parameters += 1,
                Err(e) => errors.push(format!(
                    "parameter '{}' of component '{}' in vhost '{}': {e}",
                    p.name, p.component, p.vhost
                )),
            }
        }
        let ops = defs
            .exchanges
            .iter()
            .map(|(v, x)| (v, Op::ExchangeDeclare(x.clone())))
            .chain(
                defs.queues
                    .iter()
                    .map(|(v, q)| (v, Op::QueueDeclare(q.clone()))),
            )
            .chain(defs.bindings.iter().map(|(v, b, to_exchange)| {
                let op = if *to_exchange {
                    Op::ExchangeBind(b.clone())
                } else {
                    Op::QueueBind(b.clone())
                };
                (v, op)
            }));
        for (vhost, op) in ops {
            let count = match op {
                Op::ExchangeDeclare(_) => &mut report.exchanges,
                Op::QueueDeclare(_) => &mut report.queues,
                _ => &mut report.bindings,
            };
            match self.admin(now, vhost, op) {
                Ok(_) => *count += 1,
                Err(e) => errors.push(e.to_string()),
            }
        }
        report
    }

    /// Runs one operation in `vhost` on the broker's admin channel with a client's checks;
    /// returns its reply, or the error a client would have got (the admin channel reopens
    /// after it).
    pub fn admin(&mut self, now: u64, vhost: &str, op: Op) -> Result<Option<Reply>, ProtocolError> {
        self.admin_on(now, vhost, ADMIN_CHANNEL, op)
    }

    /// Publishes a message the broker makes about itself (see
    /// [`AdminRequest::StatusPublish`]): as [`Broker::admin`], on the status channel.
    pub fn publish_status(
        &mut self,
        now: u64,
        vhost: &str,
        publish: Box<crate::command::Publish>,
    ) -> Result<Option<Reply>, ProtocolError> {
        self.admin_on(now, vhost, STATUS_CHANNEL, Op::Publish(publish))
    }

    fn admin_on(
        &mut self,
        now: u64,
        vhost: &str,
        channel: u16,
        op: Op,
    ) -> Result<Option<Reply>, ProtocolError> {
        let Some(channel) = self.admin_channel_for(now, channel) else {
            return Err(ProtocolError::new(
                crate::error::ErrorCode::ResourceError,
                op.kind(),
                format!(
                    "{} operator ops wait for their queues' answers",
                    super::admin_late::MAX_PENDING
                ),
            ));
        };
        let ch = ChannelRef::new(RESTORE_CONN, channel);
        let mark = self.effects.len();
        let Some(vh) = self.vhost_id(vhost) else {
            return Err(ProtocolError::new(
                crate::error::ErrorCode::NotFound,
                op.kind(),
                format!("vhost '{vhost}' does not exist"),
            ));
        };
        if self
            .chans
            .conns
            .get(&RESTORE_CONN)
            .is_some_and(|c| c.vhost != vh)
        {
            self.admin_released();
            self.release_connection(RESTORE_CONN);
        }
        if !self.chans.conns.contains_key(&RESTORE_CONN) {
            self.handle(
                now,
                ChannelRef::new(RESTORE_CONN, 0),
                Op::ConnectionOpen {
                    vhost: vhost.to_string(),
                    user: "warren-admin".into(),
                    cancel_notify: false,
                },
            );
        }
        if !self.chans.channels.contains_key(&ch) {
            self.handle(now, ch, Op::ChannelOpen);
        }
        let kind = op.kind();
        self.handle(now, ch, op);
        let mut reply = None;
        let mut error = None;
        for effect in self.effects.drain(mark..).collect::<Vec<_>>() {
            match effect {
                Effect::Reply { ch: c, reply: r } if c == ch && r != Reply::ChannelOpenOk => {
                    reply = Some(r);
                }
                Effect::ChannelError { ch: c, error: e } if c == ch => error = Some(e),
                Effect::ConnectionError { conn, error: e } if conn == RESTORE_CONN => {
                    error = Some(e)
                }
                // Effects for clients (deliveries after a purge freed credit, cancels after a
                // delete) go out as usual.
                other if other.conn() != RESTORE_CONN => self.effects.push(other),
                _ => {}
            }
        }
        match error {
            Some(e) => {
                if self.chans.channels.contains_key(&ch) {
                    self.handle(now, ch, Op::ChannelCloseOk);
                }
                Err(e)
            }
            None => {
                if reply.is_none() {
                    self.admin_maybe_deferred(ch, kind);
                }
                Ok(reply)
            }
        }
    }

    /// Applies an operator's request to this shard and answers it (for the parts of it
    /// this shard owns: see `AdminRequest::gathered` and `AdminRequest::replica` for how a
    /// sharded broker sends it to every shard, `crate::shards::Shards::admin`).
    pub fn apply_admin(&mut self, now: u64, request: AdminRequest) -> AdminResponse {
        let broker = self;
        broker.admin_late_reset();
        use AdminResponse::Done;
        match request {
            AdminRequest::ListQueues => AdminResponse::Queues(broker.list_queues()),
            AdminRequest::ListExchanges => AdminResponse::Exchanges(broker.list_exchanges()),
            AdminRequest::ListBindings => AdminResponse::Bindings(broker.list_bindings()),
            AdminRequest::ListConnections => AdminResponse::Connections(broker.list_connections()),
            AdminRequest::ListScheduled => AdminResponse::Scheduled(
                broker
                    .list_scheduled()
                    .into_iter()
                    .map(
                        |(vhost, exchange, messages, next_due)| crate::admin::ScheduledInfo {
                            vhost,
                            exchange,
                            messages,
                            next_due,
                        },
                    )
                    .collect(),
            ),
            AdminRequest::PurgeScheduled { vhost, exchange } => {
                AdminResponse::Dropped(broker.purge_scheduled(&vhost, &exchange))
            }
            AdminRequest::ListConsumers => AdminResponse::Consumers(broker.list_consumers()),
            AdminRequest::Definitions => AdminResponse::Definitions(broker.durable_definitions()),
            AdminRequest::Op { vhost, op } => {
                AdminResponse::Op(broker.admin_deferrable(now, &vhost, op))
            }
            AdminRequest::StatusPublish { vhost, publish } => {
                AdminResponse::Op(broker.publish_status(now, &vhost, publish))
            }
            AdminRequest::SetPolicy(p) => Done(broker.set_policy(now, p)),
            AdminRequest::ClearPolicy { vhost, name } => {
                Done(broker.clear_policy(now, &vhost, &name))
            }
            AdminRequest::ListPolicies => AdminResponse::Policies(broker.list_policies()),
            AdminRequest::SetParameter(p) => Done(broker.set_parameter(now, p)),
            AdminRequest::ClearParameter {
                vhost,
                component,
                name,
            } => Done(broker.clear_parameter(now, &vhost, &component, &name)),
            AdminRequest::ListParameters => AdminResponse::Parameters(broker.list_parameters()),
            AdminRequest::Import(defs) => AdminResponse::Imported(broker.import(now, &defs)),
            AdminRequest::AddVhost(v) => Done(broker.add_vhost(now, v)),
            AdminRequest::DeleteVhost(name) => Done(broker.delete_vhost(now, &name)),
            AdminRequest::ListVhosts => AdminResponse::Vhosts(broker.list_vhosts()),
            AdminRequest::AddUser(u) => Done(if broker.user(&u.name).is_some() {
                Err(AdminError::Invalid(format!(
                    "user '{}' already exists",
                    u.name
                )))
            } else {
                broker.put_user(now, u)
            }),
            AdminRequest::ChangePassword {
                user,
                password_hash,
            } => Done(match broker.user(&user).cloned() {
                Some(mut u) => {
                    u.password_hash = password_hash;
                    broker.put_user(now, u)
                }
                None => Err(AdminError::NotFound(format!(
                    "user '{user}' does not exist"
                ))),
            }),
            AdminRequest::SetUserTags { user, tags } => Done(match broker.user(&user).cloned() {
                Some(mut u) => {
                    u.tags = tags;
                    broker.put_user(now, u)
                }
                None => Err(AdminError::NotFound(format!(
                    "user '{user}' does not exist"
                ))),
            }),
            AdminRequest::DeleteUser(name) => Done(broker.delete_user(now, &name)),
            AdminRequest::ListUsers => AdminResponse::Users(broker.list_users()),
            AdminRequest::SetPermissions(p) => Done(broker.set_permissions(now, p)),
            AdminRequest::ClearPermissions { vhost, user } => {
                Done(broker.clear_permissions(now, &vhost, &user))
            }
            AdminRequest::ListPermissions => AdminResponse::Permissions(broker.list_permissions()),
            AdminRequest::SetTopicPermissions(p) => Done(broker.set_topic_permissions(now, p)),
            AdminRequest::ClearTopicPermissions {
                vhost,
                user,
                exchange,
            } => Done(broker.clear_topic_permissions(now, &vhost, &user, exchange.as_deref())),
            AdminRequest::ListTopicPermissions => {
                AdminResponse::TopicPermissions(broker.list_topic_permissions())
            }
            AdminRequest::ListChannels => AdminResponse::Channels(broker.list_channels()),
            AdminRequest::VhostStats => AdminResponse::VhostStats(broker.vhost_stats()),
            AdminRequest::MemoryStatus => AdminResponse::Memory(broker.memory_status()),
            AdminRequest::SetMemoryWatermark(bytes) => {
                broker.set_memory_high_watermark(now, bytes);
                Done(Ok(()))
            }
            AdminRequest::CloseConnection { conn, reason } => {
                AdminResponse::Closed(broker.close_connection(conn, &reason))
            }
            AdminRequest::RetainedStats => AdminResponse::Retained(broker.retained_stats()),
            AdminRequest::ReloadQueue { vhost, name } => {
                Done(if broker.reload_queue(&vhost, &name) {
                    Ok(())
                } else {
                    Err(AdminError::NotFound(format!(
                        "no queue '{name}' in vhost '{vhost}' on this shard"
                    )))
                })
            }
            AdminRequest::QueueHome { .. } if !super::nodes::NODES => {
                Done(Err(AdminError::Invalid(
                    "this build of the core has no cluster nodes (feature `nodes` off)".into(),
                )))
            }
            AdminRequest::QueueHome { vhost, queue, node } => {
                broker.set_queue_home(&vhost, &queue, node);
                // Its consumers attach where it is now (`nodes_consume.rs`).
                broker.after_op();
                Done(Ok(()))
            }
            AdminRequest::Qos0Dropped => AdminResponse::Dropped(broker.qos0_dropped()),
        }
    }
}
