//! The broker task: applies op batches to the core and routes effects to connections.

use crate::{AdminResponse, Control, Request};
use std::collections::HashMap;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until};
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::{Broker, ShardMail};

/// Request batches applied before effects are flushed: bounds the latency a busy broker adds
/// to replies while still amortising the flush over many publishes.
const BATCHES_PER_TURN: usize = 64;

/// A shard's links to the other shards (ARCHITECTURE.md, "warren-runtime"): the mail they
/// send it, and where to send its own (`peers[i]` is shard `i`'s inbox; with one shard, only
/// its own, never used).
pub(crate) struct ShardIo {
    pub(crate) mail: mpsc::UnboundedReceiver<Vec<ShardMail>>,
    pub(crate) peers: Vec<mpsc::UnboundedSender<Vec<ShardMail>>>,
    /// Pieces of mail sent to each shard and not yet handled there (by shard index).
    pub(crate) backlog: std::sync::Arc<Vec<std::sync::atomic::AtomicUsize>>,
    /// This shard's index.
    pub(crate) shard: usize,
}

/// Mail a shard may have waiting at another before it stops taking its connections'
/// requests (mail and control it still handles): the back-pressure between shards. At
/// ~100 bytes a piece (the message is shared), ~1.6 MB per pair of shards.
const MAX_BACKLOG: usize = 16 * 1024;

impl ShardIo {
    /// Whether some other shard has more of this one's mail waiting than it may.
    fn backlogged(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.backlog
            .iter()
            .enumerate()
            .any(|(i, n)| i != self.shard && n.load(Ordering::Acquire) > MAX_BACKLOG)
    }

    /// Pieces of mail sent here and not handled yet.
    fn pending(&self) -> usize {
        use std::sync::atomic::Ordering;
        self.backlog
            .get(self.shard)
            .map_or(0, |n| n.load(Ordering::Acquire))
    }

    /// Handled `n` pieces of the mail sent here.
    fn handled(&self, n: usize) {
        use std::sync::atomic::Ordering;
        if let Some(b) = self.backlog.get(self.shard) {
            b.fetch_sub(n, Ordering::AcqRel);
        }
    }
}

pub(crate) async fn run(
    mut broker: Broker,
    mut requests: mpsc::Receiver<Request>,
    mut control: mpsc::UnboundedReceiver<Control>,
    routes: crate::Routes,
    mut io: ShardIo,
) {
    // The core's clock: wall-clock milliseconds (so message expiries stored on disk mean the
    // same after a restart), advanced monotonically from one reading at start.
    let epoch = Instant::now();
    let unix_at_epoch = crate::unix_ms();
    let now_ms = |at: Instant| unix_at_epoch + at.duration_since(epoch).as_millis() as u64;
    let mut conns: HashMap<ConnId, Link> = HashMap::new();
    let mut effects = Vec::new();
    let mut outboxes: HashMap<ConnId, Vec<Effect>> = HashMap::new();
    let mut held = HeldAnswers::default();
    let mut outbox = Vec::new();
    let mut alarms = (broker.publishers_blocked(), broker.alarms());
    let mut stopping = Stopping::default();
    // Mail pieces sent to other shards so far (a clean stop waits until this settles).
    let mut mail_sent = 0u64;
    // A clustered host's link to the other nodes (`Control::NodeLink`) and this turn's mail
    // for them.
    let mut node_link: Option<std::sync::Arc<dyn crate::NodeLink>> = None;
    let mut node_out = Vec::new();
    let mut notices = Vec::new();
    // A sync right after the restore: it ends the store's recovery (dead space found
    // there is reclaimed) whether or not a client writes anything.
    broker.request_sync();
    broker.start_sync();
    loop {
        let deadline = broker
            .next_deadline()
            .map(|ms| epoch + std::time::Duration::from_millis(ms.saturating_sub(unix_at_epoch)));
        tokio::select! {
            biased;
            msg = control.recv() => match msg {
                Some(Control::NodeLink(link)) => node_link = Some(link),
                Some(msg) => apply_control(
                    &mut broker,
                    &mut conns,
                    &mut held,
                    &mut stopping,
                    msg,
                    now_ms(Instant::now()),
                ),
                None => return,
            },
            mail = io.mail.recv() => {
                // Every shard holds a sender of every inbox (its own too): never closed
                // while this task runs.
                let Some(batch) = mail else { return };
                adopt_routes(&mut broker, &routes);
                let now = now_ms(Instant::now());
                io.handled(batch.len());
                broker.receive_mails(now, batch);
                for _ in 1..BATCHES_PER_TURN {
                    let Ok(batch) = io.mail.try_recv() else { break };
                    io.handled(batch.len());
                    broker.receive_mails(now, batch);
                }
            }
            // Another shard is behind with this one's mail: its connections wait (their
            // request channel fills, their sockets stop being read) until it catches up.
            // The same for mail waiting for other nodes (the cluster transport is slow or
            // a peer is down and its mail is being failed).
            _ = tokio::time::sleep(std::time::Duration::from_millis(1)), if io.backlogged() || node_link.as_ref().is_some_and(|l| l.backlogged()) => {}
            req = requests.recv(), if !io.backlogged() && !node_link.as_ref().is_some_and(|l| l.backlogged()) => {
                let Some(req) = req else { return };
                adopt_routes(&mut broker, &routes);
                // Registrations sent before these ops must be applied first.
                while let Ok(msg) = control.try_recv() {
                    let now = now_ms(Instant::now());
                    apply_control(&mut broker, &mut conns, &mut held, &mut stopping, msg, now);
                }
                let now = now_ms(Instant::now());
                apply(&mut broker, &mut conns, req, now);
                for _ in 1..BATCHES_PER_TURN {
                    match requests.try_recv() {
                        Ok(req) => {
                            // A connection registered after the drain above may have sent
                            // this batch: its registration must be applied first too.
                            while let Ok(msg) = control.try_recv() {
                                apply_control(
                                    &mut broker,
                                    &mut conns,
                                    &mut held,
                                    &mut stopping,
                                    msg,
                                    now,
                                );
                            }
                            apply(&mut broker, &mut conns, req, now)
                        }
                        Err(_) => break,
                    }
                }
            }
            _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                broker.tick(now_ms(Instant::now()));
            }
        }
        // Group commit: everything applied this turn (and while the previous sync ran)
        // rides on one sync.
        broker.start_sync();
        // Publish the routing changes of this turn before its replies leave: a client that
        // saw a bind-ok (or told another client of it) routes on a table holding the bind.
        if broker.shard() == 0 && broker.routes().version() != routes.load().version() {
            routes.store(std::sync::Arc::clone(broker.routes()));
        }
        // After the table: a shard adopts the published table before it reads mail that
        // shard 0 sent after publishing it.
        mail_sent += send_mail(&mut broker, &mut outbox, &io);
        broker.take_node_mail(&mut node_out);
        match &node_link {
            Some(link) => crate::nodes::send_all(link.as_ref(), &mut node_out),
            // Only a cluster member places queues on other nodes: never without a link.
            None => node_out.clear(),
        }
        broker.poll_effects(&mut effects);
        held.answer_late(&mut broker);
        flush(&mut effects, &mut outboxes, &conns);
        let dropped = broker.take_notices(&mut notices);
        log_notices(&mut notices, dropped, broker.shard());
        let now_alarms = (broker.publishers_blocked(), broker.alarms());
        if now_alarms != alarms {
            log_alarms(alarms, now_alarms, broker.shard());
            alarms = now_alarms;
        }
        if let Some(reply) = stopping.stop.take() {
            // Closes the store: its sync thread finishes what it was given first.
            drop(broker);
            let _ = reply.send(());
            return;
        }
        if !stopping.flushes.is_empty()
            && broker.all_synced()
            && requests.is_empty()
            && io.mail.is_empty()
            && io.pending() == 0
        {
            for reply in stopping.flushes.drain(..) {
                let _ = reply.send(mail_sent);
            }
        }
    }
}

/// One log line per change of the resource alarms or of whether publishers are blocked
/// (not one per connection told): each changes at most about once a second
/// (`warren_core::broker::ALARM_HOLD_MS`).
/// Logs what the broker noted this turn (`warren_core::Notice`).
fn log_notices(notices: &mut Vec<warren_core::Notice>, dropped: u64, shard: u32) {
    use warren_core::Notice;
    use warren_core::escape::Escaped;
    for n in notices.drain(..) {
        match n {
            Notice::DeadLettersHeld {
                vhost,
                queue,
                held,
                unroutable,
            } => {
                let why = if unroutable {
                    "a dead letter reached no queue (its dead-letter exchange is missing or routes it nowhere)"
                } else {
                    "a target refused a dead letter (its length limit, its store, or a quorum queue without a leader)"
                };
                tracing::warn!(shard, vhost = %Escaped(&vhost), queue = %Escaped(&queue), held, "at-least-once dead letters of queue {} held: {why}; retried every second until taken", Escaped(&queue));
            }
            Notice::DeadLettersReleased { vhost, queue, held } => {
                tracing::info!(shard, vhost = %Escaped(&vhost), queue = %Escaped(&queue), held, "at-least-once dead letters of queue {} taken again by their targets", Escaped(&queue));
            }
            Notice::DeadLetterFallback { vhost, queue, text } => {
                tracing::warn!(shard, vhost = %Escaped(&vhost), queue = %Escaped(&queue), "policy on queue {}: {}", Escaped(&queue), Escaped(text));
            }
        }
    }
    if dropped > 0 {
        tracing::warn!(shard, dropped, "broker notices dropped (too many at once)");
    }
}

fn log_alarms(before: (bool, warren_core::Alarms), now: (bool, warren_core::Alarms), shard: u32) {
    let (blocked, alarms) = now;
    let (memory, disk, store) = (alarms.memory, alarms.disk, alarms.store);
    if blocked && !before.0 {
        tracing::warn!(
            shard,
            memory,
            disk,
            store,
            "resource alarm: publishers blocked"
        );
    } else if !blocked && before.0 {
        tracing::info!(shard, "resource alarms cleared: publishers unblocked");
    } else {
        tracing::info!(
            shard,
            blocked,
            memory,
            disk,
            store,
            "resource alarms changed"
        );
    }
}

/// A shard other than 0 routes, and resolves names, on the table shard 0 published last.
fn adopt_routes(broker: &mut Broker, routes: &crate::Routes) {
    if broker.shard() == 0 {
        return;
    }
    let published = routes.load();
    if !std::sync::Arc::ptr_eq(&published, broker.routes()) {
        broker.adopt_routes(arc_swap::Guard::into_inner(published));
    }
}

/// Sends the turn's mail for other shards, one batch per shard, in the order sent;
/// returns how many pieces it sent.
fn send_mail(broker: &mut Broker, outbox: &mut Vec<ShardMail>, io: &ShardIo) -> u64 {
    broker.take_outbox(outbox);
    if outbox.is_empty() {
        return 0;
    }
    let sent = outbox.len() as u64;
    let mut batches: Vec<Vec<ShardMail>> = io.peers.iter().map(|_| Vec::new()).collect();
    for m in outbox.drain(..) {
        if let Some(batch) = batches.get_mut(m.shard() as usize) {
            batch.push(m);
        }
    }
    for ((peer, batch), backlog) in io.peers.iter().zip(batches).zip(io.backlog.iter()) {
        if !batch.is_empty() {
            backlog.fetch_add(batch.len(), std::sync::atomic::Ordering::AcqRel);
            // Fails only when that shard's task is gone (shutdown).
            let _ = peer.send(batch);
        }
    }
    sent
}

/// Answers to operators held until the sync that makes their change durable completes,
/// and operators whose op another shard answers (`Broker::take_admin_deferral`).
#[derive(Default)]
struct HeldAnswers {
    durable: Vec<(
        u64,
        tokio::sync::oneshot::Sender<AdminResponse>,
        AdminResponse,
    )>,
    /// By the core's token. Bounded by the core, which refuses admin ops beyond its
    /// bound of deferred ones.
    late: Vec<(u16, tokio::sync::oneshot::Sender<AdminResponse>)>,
}

impl HeldAnswers {
    /// Hands the late answers the broker has to the operators who wait for them.
    fn answer_late(&mut self, broker: &mut Broker) {
        if self.late.is_empty() {
            return;
        }
        let mut answers = Vec::new();
        broker.take_admin_answers(&mut answers);
        for (token, answer) in answers {
            if let Some(at) = self.late.iter().position(|(t, _)| *t == token) {
                let (_, reply) = self.late.swap_remove(at);
                // The requester may have given up (ctl timed out).
                let _ = reply.send(AdminResponse::Op(answer));
            }
        }
    }

    fn release(&mut self, epoch: u64, durable: bool) {
        let (due, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.durable)
            .into_iter()
            .partition(|(e, _, _)| *e <= epoch);
        self.durable = rest;
        for (_, reply, answer) in due {
            let answer = match answer {
                AdminResponse::Done(Ok(())) if !durable => {
                    AdminResponse::Done(Err(warren_core::admin::AdminError::Unavailable(
                        "applied, but the store could not make it durable (see the broker log)"
                            .into(),
                    )))
                }
                other => other,
            };
            let _ = reply.send(answer);
        }
    }
}

/// A registered connection, as the broker task knows it.
pub(crate) struct Link {
    effects: crate::mailbox::MailboxSender,
    /// Op batches of this connection applied so far.
    applied: u64,
    /// Its sender is gone after sending this many batches: disconnect once they are applied
    /// (the control channel may deliver the news before the last batches). `STILL_SENDING`
    /// while the sender lives: a plain `u64`, as an `Option` made every live connection's
    /// entry in the shard's map 8 bytes larger (issue 42).
    disconnect_after: u64,
}

/// `Link::disconnect_after` of a connection whose sender lives (no count of batches reaches
/// it).
const STILL_SENDING: u64 = u64::MAX;

/// A clean stop in progress (`BrokerHandle::stop`): flushes to answer once this shard is
/// idle and synced, then the stop itself.
#[derive(Default)]
struct Stopping {
    flushes: Vec<tokio::sync::oneshot::Sender<u64>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

fn apply_control(
    broker: &mut Broker,
    conns: &mut HashMap<ConnId, Link>,
    held: &mut HeldAnswers,
    stopping: &mut Stopping,
    msg: Control,
    now: u64,
) {
    match msg {
        Control::Flush { reply } => {
            // What was written so far waits for no timer: the sync starts at the end of
            // this turn (or right after the one in flight). Later removals (requests still
            // queued) get theirs within `removal_sync_ms`.
            broker.request_sync();
            stopping.flushes.push(reply);
        }
        Control::Stop { reply } => stopping.stop = Some(reply),
        Control::Register { conn, effects } => {
            conns.insert(
                conn,
                Link {
                    effects,
                    applied: 0,
                    disconnect_after: STILL_SENDING,
                },
            );
        }
        Control::Disconnect { conn, after } => {
            let Some(link) = conns.get_mut(&conn) else {
                return;
            };
            if link.applied < after {
                link.disconnect_after = after;
                return;
            }
            if conns.remove(&conn).is_some() {
                broker.handle(now, ChannelRef::new(conn, 0), Op::ConnectionClose);
            }
        }
        Control::Admin { request, reply } => {
            let answer = broker.apply_admin(now, request);
            // An op on a queue of another shard is answered by that shard, later.
            if let Some(token) = broker.take_admin_deferral() {
                held.late.push((token, reply));
                return;
            }
            // A change answers once it is durable (the sync starts at the end of this turn).
            match broker.unsynced_epoch() {
                Some(epoch) => held.durable.push((epoch, reply, answer)),
                // The requester may have given up (ctl timed out): nothing to do then.
                None => {
                    let _ = reply.send(answer);
                }
            }
        }
        Control::Authenticate {
            user,
            password,
            from_loopback,
            vhost,
            reply,
        } => {
            let login = match password {
                Some(password) => {
                    broker.authenticate(&user, &password, from_loopback, vhost.as_deref())
                }
                None => broker.authenticate_certified(&user, from_loopback, vhost.as_deref()),
            };
            let _ = reply.send(login);
        }
        Control::Resources(resources) => broker.report_resources(now, resources),
        Control::StreamsGrew(wakes) => broker.streams_grew(now, &wakes.take()),
        // Taken by the task loop itself.
        Control::NodeLink(_) => {}
        Control::NodeMail { from, mails, done } => {
            broker.receive_node_mail(now, from, mails);
            let _ = done.send(());
        }
        Control::NodeUnreachable(node) => broker.node_unreachable(now, node),
        Control::NodeReachable(node) => broker.node_reachable(now, node),
        Control::Synced { epoch, result } => {
            match result {
                Ok(()) => broker.synced(now, epoch),
                // A quorum queue's leadership moved: its writes were not committed, which
                // says nothing about this node's store (no alarm, RabbitMQ raises none).
                Err(warren_store::SyncError::NotReplicated(_)) => {
                    broker.sync_not_replicated(now, epoch)
                }
                Err(warren_store::SyncError::Store(_)) => broker.sync_failed(now, epoch),
            }
            held.release(epoch, result.is_ok());
        }
    }
}

fn apply(broker: &mut Broker, conns: &mut HashMap<ConnId, Link>, req: Request, now: u64) {
    let Some(link) = conns.get_mut(&req.conn) else {
        return;
    };
    link.applied += 1;
    let done = link.applied >= link.disconnect_after;
    for (channel, op) in req.ops {
        broker.handle(now, ChannelRef::new(req.conn, channel), op);
    }
    link.effects.applied(link.applied);
    if done {
        conns.remove(&req.conn);
        broker.handle(now, ChannelRef::new(req.conn, 0), Op::ConnectionClose);
    }
}

fn flush(
    effects: &mut Vec<Effect>,
    outboxes: &mut HashMap<ConnId, Vec<Effect>>,
    conns: &HashMap<ConnId, Link>,
) {
    if effects.is_empty() {
        return;
    }
    // The effects of the turn's first few connections (a turn nearly always has few) are
    // counted first, so their batches are allocated once at their size rather than grown by
    // doubling (a reallocation and a copy of every effect so far at 4, 8, 16...).
    const COUNTED: usize = 8;
    let mut counts = [(ConnId(0), 0usize); COUNTED];
    let mut counted = 0;
    for e in effects.iter() {
        let conn = e.conn();
        if let Some(c) = counts[..counted].iter_mut().find(|c| c.0 == conn) {
            c.1 += 1;
        } else if counted < COUNTED {
            counts[counted] = (conn, 1);
            counted += 1;
        }
    }
    for effect in effects.drain(..) {
        let conn = effect.conn();
        let batch = outboxes.entry(conn).or_default();
        if batch.capacity() == 0
            && let Some(c) = counts[..counted].iter().find(|c| c.0 == conn)
        {
            batch.reserve_exact(c.1);
        }
        batch.push(effect);
    }
    for (conn, batch) in outboxes.iter_mut() {
        if batch.is_empty() {
            continue;
        }
        let batch = std::mem::take(batch);
        // A send fails only when the connection task is gone; its Disconnect follows and
        // releases the connection in the core.
        if let Some(link) = conns.get(conn) {
            link.effects.send(batch);
        }
    }
    // Keep the map from growing with connections that come and go.
    if outboxes.len() > 1024 {
        outboxes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn io(shard: usize, shards: usize) -> ShardIo {
        let (_tx, mail) = mpsc::unbounded_channel();
        ShardIo {
            mail,
            peers: Vec::new(),
            backlog: std::sync::Arc::new((0..shards).map(|_| Default::default()).collect()),
            shard,
        }
    }

    #[test]
    fn a_shard_holds_its_requests_while_another_is_behind_with_its_mail() {
        let a = io(0, 2);
        let b = ShardIo {
            backlog: a.backlog.clone(),
            ..io(1, 2)
        };
        a.backlog[1].store(MAX_BACKLOG, Ordering::Release);
        assert!(!a.backlogged(), "at the bound: still taking requests");
        a.backlog[1].fetch_add(1, Ordering::AcqRel);
        assert!(a.backlogged(), "past it: shard 1 is behind");
        assert!(!b.backlogged(), "a shard's own inbox does not hold it");
        b.handled(1);
        assert!(!a.backlogged(), "caught up");
    }
}
