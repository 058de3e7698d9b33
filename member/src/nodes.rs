//! The brokers' mail between cluster nodes (docs/cluster.md, "Queues live on one node"):
//! [`ClusterLink`] is the runtime's `NodeLink` over the cluster transport (one task per
//! peer, batching what waits, one batch in flight per peer: its answer comes once the
//! peer's broker took it), and [`serve_mail`] hands what peers send to this node's broker.
//! [`encode`] / [`decode`] are the batch's bytes (docs/storage.md, "Cluster mail").

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use warren_cluster::node::ClusterNode;
use warren_core::message::Message;
use warren_core::{NodeChannel, NodeConsumer, NodeGot, NodeMail, NodeRequest, NodeSettle};
use warren_runtime::{BrokerHandle, NodeLink};
use warren_store::record::{decode_message, encode_message};

/// Pieces of mail waiting for other nodes before the broker stops taking its clients'
/// requests (the back-pressure; as between shards).
const MAX_QUEUED: usize = 16 * 1024;

/// Pieces of mail in one batch at most.
const MAX_BATCH: usize = 1024;

/// Bytes of message records in one batch at most, well under the transport's 16 MiB
/// frame (its JSON writes each byte as up to 4).
const MAX_BATCH_BYTES: usize = 2 << 20;

/// How long a batch may take to reach a peer's broker before the peer counts as
/// unreachable.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// How often an idle peer task checks its peer with an empty batch: a peer that died or
/// restarted (a new incarnation) lost the answers this node waits for, which are then
/// nacked instead of waited for forever.
const PROBE_EVERY: Duration = Duration::from_secs(1);

const ENQUEUE: u8 = 1;
const ANSWERED: u8 = 2;
const CONSUME: u8 = 3;
const CONSUME_OK: u8 = 4;
const REFUSED: u8 = 5;
const DELIVER: u8 = 6;
const CREDIT: u8 = 7;
const SETTLE: u8 = 8;
const CANCEL: u8 = 9;
const CANCELLED: u8 = 10;
const CONSUMER_GONE: u8 = 11;
const REQUEST: u8 = 12;
const GOT: u8 = 13;
const PURGED: u8 = 14;
const DECLARED: u8 = 15;
/// The sending broker's incarnation; first in a batch, or absent (a bare probe).
const FROM: u8 = 16;

/// Writes a batch's pieces (docs/storage.md, "Cluster mail").
struct W {
    out: Vec<u8>,
    record: Vec<u8>,
}

impl W {
    fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    fn bool(&mut self, v: bool) {
        self.out.push(u8::from(v));
    }
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_be_bytes());
    }
    /// A u16 length and UTF-8 (names are short strings; longer is cut, never wrapped).
    fn str(&mut self, s: &str) {
        let b = s.as_bytes();
        let n = b.len().min(u16::MAX as usize);
        self.u16(n as u16);
        self.out.extend_from_slice(&b[..n]);
    }
    fn channel(&mut self, c: &NodeChannel) {
        self.u64(c.conn);
        self.u16(c.channel);
        self.u32(c.serial);
    }
    fn message(&mut self, m: &Message) {
        self.record.clear();
        encode_message(m, true, &mut self.record);
        self.u32(self.record.len() as u32);
        self.out.extend_from_slice(&self.record);
    }
}

/// The bytes of a batch: per piece a tag byte, then its fields in declaration order:
/// names and texts as u16 length + UTF-8, integers big-endian, flags one byte, a channel
/// as conn (u64), channel (u16), serial (u32), a message as u32 length +
/// `warren_store::record::encode_message` with its body, an option as a flag byte and the
/// value if set, a list as u32 count and the items.
pub fn encode(mails: &[NodeMail]) -> Vec<u8> {
    let mut w = W {
        out: Vec::new(),
        record: Vec::new(),
    };
    for m in mails {
        match m {
            NodeMail::Enqueue {
                vhost,
                queue,
                message,
                token,
            } => {
                w.u8(ENQUEUE);
                w.str(vhost);
                w.str(queue);
                match token {
                    Some(t) => {
                        w.u8(1);
                        w.u64(*t);
                    }
                    None => w.u8(0),
                }
                w.message(message);
            }
            NodeMail::Answered { token, taken } => {
                w.u8(ANSWERED);
                w.u64(*token);
                w.bool(*taken);
            }
            NodeMail::Consume {
                vhost,
                queue,
                from,
                consumer,
                nowait,
            } => {
                w.u8(CONSUME);
                w.str(vhost);
                w.str(queue);
                w.channel(from);
                w.str(&consumer.tag);
                w.bool(consumer.no_ack);
                w.bool(consumer.exclusive);
                w.u16(consumer.prefetch);
                w.u16(consumer.global_prefetch);
                w.u32(consumer.priority as u32);
                w.bool(*nowait);
            }
            NodeMail::ConsumeOk {
                to,
                vhost,
                queue,
                consumer,
                tag,
                nowait,
            } => {
                w.u8(CONSUME_OK);
                w.channel(to);
                w.str(vhost);
                w.str(queue);
                w.u64(*consumer);
                w.str(tag);
                w.bool(*nowait);
            }
            NodeMail::Refused { to, code, text } => {
                w.u8(REFUSED);
                w.channel(to);
                w.u16(*code);
                w.str(text);
            }
            NodeMail::Deliver {
                to,
                vhost,
                queue,
                consumer,
                tag,
                no_ack,
                seq,
                redelivered,
                message,
                window,
            } => {
                w.u8(DELIVER);
                w.channel(to);
                w.str(vhost);
                w.str(queue);
                w.u64(*consumer);
                w.str(tag);
                w.bool(*no_ack);
                w.u64(*seq);
                w.bool(*redelivered);
                w.message(message);
                w.u32(*window);
            }
            NodeMail::Credit { window, count } => {
                w.u8(CREDIT);
                w.u32(*window);
                w.u32(*count);
            }
            NodeMail::Settle {
                vhost,
                queue,
                seqs,
                how,
            } => {
                w.u8(SETTLE);
                w.str(vhost);
                w.str(queue);
                w.u32(seqs.len() as u32);
                for s in seqs {
                    w.u64(*s);
                }
                w.u8(match how {
                    NodeSettle::Ack => 0,
                    NodeSettle::Requeue => 1,
                    NodeSettle::Discard => 2,
                });
            }
            NodeMail::Cancel {
                vhost,
                queue,
                consumer,
                reply,
            } => {
                w.u8(CANCEL);
                w.str(vhost);
                w.str(queue);
                w.u64(*consumer);
                match reply {
                    Some((to, tag, nowait)) => {
                        w.u8(1);
                        w.channel(to);
                        w.str(tag);
                        w.bool(*nowait);
                    }
                    None => w.u8(0),
                }
            }
            NodeMail::Cancelled { to, tag, nowait } => {
                w.u8(CANCELLED);
                w.channel(to);
                w.str(tag);
                w.bool(*nowait);
            }
            NodeMail::ConsumerGone { to, consumer, tag } => {
                w.u8(CONSUMER_GONE);
                w.channel(to);
                w.u64(*consumer);
                w.str(tag);
            }
            NodeMail::Request {
                vhost,
                queue,
                from,
                request,
            } => {
                w.u8(REQUEST);
                w.str(vhost);
                w.str(queue);
                w.channel(from);
                let (kind, flag) = match request {
                    NodeRequest::Get { no_ack } => (0, *no_ack),
                    NodeRequest::Purge { nowait } => (1, *nowait),
                    NodeRequest::Declare { nowait } => (2, *nowait),
                };
                w.u8(kind);
                w.bool(flag);
            }
            NodeMail::Got {
                to,
                vhost,
                queue,
                no_ack,
                got,
            } => {
                w.u8(GOT);
                w.channel(to);
                w.str(vhost);
                w.str(queue);
                w.bool(*no_ack);
                match got {
                    Some(g) => {
                        w.u8(1);
                        w.u64(g.seq);
                        w.bool(g.redelivered);
                        w.message(&g.message);
                        w.u32(g.remaining);
                    }
                    None => w.u8(0),
                }
            }
            NodeMail::Purged { to, count, nowait } => {
                w.u8(PURGED);
                w.channel(to);
                w.u32(*count);
                w.bool(*nowait);
            }
            NodeMail::Declared {
                to,
                queue,
                messages,
                consumers,
                nowait,
            } => {
                w.u8(DECLARED);
                w.channel(to);
                w.str(queue);
                w.u32(*messages);
                w.u32(*consumers);
                w.bool(*nowait);
            }
        }
    }
    w.out
}

/// Reads a batch's pieces; every read checks the length (the bytes come from the
/// network, if from an authenticated peer).
struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("batch cut short".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool, String> {
        Ok(self.u8()? != 0)
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        Ok(u64::from_be_bytes(b.try_into().map_err(|_| "u64")?))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.u16()? as usize;
        let s = std::str::from_utf8(self.take(n)?).map_err(|e| e.to_string())?;
        Ok(s.to_string())
    }
    fn name(&mut self) -> Result<Arc<str>, String> {
        Ok(self.string()?.into())
    }
    fn channel(&mut self) -> Result<NodeChannel, String> {
        Ok(NodeChannel {
            conn: self.u64()?,
            channel: self.u16()?,
            serial: self.u32()?,
        })
    }
    fn message(&mut self) -> Result<Arc<Message>, String> {
        let n = self.u32()? as usize;
        let record = Bytes::copy_from_slice(self.take(n)?);
        let message = decode_message(&record, None).map_err(|e| e.to_string())?;
        Ok(Arc::new(message))
    }
}

/// The mail of a batch's bytes; an error for bytes this version cannot read (never a
/// panic: they come from the network, if from an authenticated peer).
/// A batch as a peer task sends it: the sender's incarnation first (a `FROM` piece), so
/// that the receiver learns of this broker's restart from its first mail, then the pieces.
pub fn encode_batch(from: u64, mails: &[NodeMail]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9);
    out.push(FROM);
    out.extend_from_slice(&from.to_be_bytes());
    out.extend_from_slice(&encode(mails));
    out
}

/// A batch's sender incarnation (if it names one) and its pieces.
pub fn decode_batch(bytes: &[u8]) -> Result<(Option<u64>, Vec<NodeMail>), String> {
    match bytes.split_first() {
        Some((&FROM, rest)) => {
            let mut r = R(rest);
            let from = r.u64()?;
            Ok((Some(from), decode(r.0)?))
        }
        _ => Ok((None, decode(bytes)?)),
    }
}

pub fn decode(bytes: &[u8]) -> Result<Vec<NodeMail>, String> {
    let mut r = R(bytes);
    let mut out = Vec::new();
    while !r.0.is_empty() {
        let mail = match r.u8()? {
            ENQUEUE => {
                let vhost = r.name()?;
                let queue = r.name()?;
                let token = match r.u8()? {
                    0 => None,
                    _ => Some(r.u64()?),
                };
                let message = r.message()?;
                NodeMail::Enqueue {
                    vhost,
                    queue,
                    message,
                    token,
                }
            }
            ANSWERED => NodeMail::Answered {
                token: r.u64()?,
                taken: r.bool()?,
            },
            CONSUME => NodeMail::Consume {
                vhost: r.name()?,
                queue: r.name()?,
                from: r.channel()?,
                consumer: NodeConsumer {
                    tag: r.name()?,
                    no_ack: r.bool()?,
                    exclusive: r.bool()?,
                    prefetch: r.u16()?,
                    global_prefetch: r.u16()?,
                    priority: r.u32()? as i32,
                },
                nowait: r.bool()?,
            },
            CONSUME_OK => NodeMail::ConsumeOk {
                to: r.channel()?,
                vhost: r.name()?,
                queue: r.name()?,
                consumer: r.u64()?,
                tag: r.name()?,
                nowait: r.bool()?,
            },
            REFUSED => NodeMail::Refused {
                to: r.channel()?,
                code: r.u16()?,
                text: r.string()?,
            },
            DELIVER => NodeMail::Deliver {
                to: r.channel()?,
                vhost: r.name()?,
                queue: r.name()?,
                consumer: r.u64()?,
                tag: r.name()?,
                no_ack: r.bool()?,
                seq: r.u64()?,
                redelivered: r.bool()?,
                message: r.message()?,
                window: r.u32()?,
            },
            CREDIT => NodeMail::Credit {
                window: r.u32()?,
                count: r.u32()?,
            },
            SETTLE => {
                let vhost = r.name()?;
                let queue = r.name()?;
                let n = r.u32()? as usize;
                // Each seq is 8 bytes: a count beyond what is left is a bad batch, not
                // an allocation.
                if n > r.0.len() / 8 {
                    return Err("settle count beyond the batch".into());
                }
                let seqs = (0..n).map(|_| r.u64()).collect::<Result<Vec<u64>, _>>()?;
                let how = match r.u8()? {
                    0 => NodeSettle::Ack,
                    1 => NodeSettle::Requeue,
                    2 => NodeSettle::Discard,
                    h => return Err(format!("unknown settle {h}")),
                };
                NodeMail::Settle {
                    vhost,
                    queue,
                    seqs,
                    how,
                }
            }
            CANCEL => NodeMail::Cancel {
                vhost: r.name()?,
                queue: r.name()?,
                consumer: r.u64()?,
                reply: match r.u8()? {
                    0 => None,
                    _ => Some((r.channel()?, r.name()?, r.bool()?)),
                },
            },
            CANCELLED => NodeMail::Cancelled {
                to: r.channel()?,
                tag: r.name()?,
                nowait: r.bool()?,
            },
            CONSUMER_GONE => NodeMail::ConsumerGone {
                to: r.channel()?,
                consumer: r.u64()?,
                tag: r.name()?,
            },
            REQUEST => {
                let vhost = r.name()?;
                let queue = r.name()?;
                let from = r.channel()?;
                let kind = r.u8()?;
                let flag = r.bool()?;
                let request = match kind {
                    0 => NodeRequest::Get { no_ack: flag },
                    1 => NodeRequest::Purge { nowait: flag },
                    2 => NodeRequest::Declare { nowait: flag },
                    k => return Err(format!("unknown request {k}")),
                };
                NodeMail::Request {
                    vhost,
                    queue,
                    from,
                    request,
                }
            }
            GOT => NodeMail::Got {
                to: r.channel()?,
                vhost: r.name()?,
                queue: r.name()?,
                no_ack: r.bool()?,
                got: match r.u8()? {
                    0 => None,
                    _ => Some(NodeGot {
                        seq: r.u64()?,
                        redelivered: r.bool()?,
                        message: r.message()?,
                        remaining: r.u32()?,
                    }),
                },
            },
            PURGED => NodeMail::Purged {
                to: r.channel()?,
                count: r.u32()?,
                nowait: r.bool()?,
            },
            DECLARED => NodeMail::Declared {
                to: r.channel()?,
                queue: r.name()?,
                messages: r.u32()?,
                consumers: r.u32()?,
                nowait: r.bool()?,
            },
            t => return Err(format!("unknown mail tag {t}")),
        };
        out.push(mail);
    }
    Ok(out)
}

/// The runtime's `NodeLink` over the cluster transport.
pub struct ClusterLink {
    node: Arc<ClusterNode>,
    broker: BrokerHandle,
    /// One task per peer, fed in order.
    peers: Mutex<HashMap<u32, mpsc::UnboundedSender<Vec<NodeMail>>>>,
    /// Pieces handed to `send` and not yet sent (or failed).
    queued: Arc<AtomicUsize>,
    incarnations: Arc<Incarnations>,
}

impl ClusterLink {
    pub fn new(
        node: Arc<ClusterNode>,
        broker: BrokerHandle,
        incarnations: Arc<Incarnations>,
    ) -> Self {
        Self {
            node,
            broker,
            peers: Mutex::default(),
            queued: Arc::default(),
            incarnations,
        }
    }
}

/// This broker's incarnation and the last one each peer's broker showed, learnt from mail
/// in either direction: the answer to a batch sent, and the `FROM` piece of a batch taken.
/// A peer that restarted lost the answers this node waits for and the consumers it had
/// here; whichever direction shows the new incarnation first clears them, before any mail
/// of the new incarnation is handed to the broker. (Learning it only from answers let a
/// restarted peer's first consume be taken here, then cleared with the old ones when the
/// next answer came back: its new MQTT session lost its queue, 0x98.)
pub struct Incarnations {
    own: u64,
    peers: Mutex<HashMap<u32, u64>>,
}

impl Incarnations {
    /// A new broker's: the clock at start in nanoseconds (a restart draws another).
    pub fn new() -> Self {
        let own = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self {
            own,
            peers: Mutex::default(),
        }
    }

    /// Peer `node` showed incarnation `now`. If it showed another before, it restarted:
    /// the broker clears what it held for the old one (answers it waited for are nacked,
    /// consumers it had are gone) and deals with the node afresh. The broker's controls are
    /// sent under the lock, so mail of the new incarnation taken in the other direction
    /// meanwhile reaches the broker after them. True if it restarted.
    fn seen(&self, broker: &BrokerHandle, node: u32, now: u64) -> bool {
        self.seen_then(node, now, || {
            broker.node_unreachable(node);
            broker.node_reachable(node);
        })
    }

    /// [`Incarnations::seen`] with what a restart does as `clear`, run under the lock.
    fn seen_then(&self, node: u32, now: u64, clear: impl FnOnce()) -> bool {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let before = peers.insert(node, now);
        let restarted = before.is_some_and(|b| b != now);
        if restarted {
            tracing::warn!(
                node,
                "cluster: node {node} restarted; publishes forwarded to it and not yet confirmed are nacked"
            );
            clear();
        }
        restarted
    }
}

impl NodeLink for ClusterLink {
    fn send(&self, node: u32, mails: Vec<NodeMail>) {
        self.queued.fetch_add(mails.len(), Ordering::AcqRel);
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let tx = peers.entry(node).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(peer_task(
                self.node.clone(),
                self.broker.clone(),
                node,
                rx,
                self.queued.clone(),
                self.incarnations.clone(),
            ));
            tx
        });
        let n = mails.len();
        if tx.send(mails).is_err() {
            self.queued.fetch_sub(n, Ordering::AcqRel);
        }
    }

    fn backlogged(&self) -> bool {
        self.queued.load(Ordering::Acquire) > MAX_QUEUED
    }
}

/// Sends what waits for `target`, a batch at a time (what queued meanwhile rides on the
/// next), in order. A batch that cannot be handed over makes the broker nack what it
/// forwarded to `target` and waits an answer for (RabbitMQ: a classic queue on a node that
/// is down is unavailable); the next batch tries again.
async fn peer_task(
    node: Arc<ClusterNode>,
    broker: BrokerHandle,
    target: u32,
    mut rx: mpsc::UnboundedReceiver<Vec<NodeMail>>,
    queued: Arc<AtomicUsize>,
    incarnations: Arc<Incarnations>,
) {
    let mut reachable = true;
    loop {
        let mut batch = match tokio::time::timeout(PROBE_EVERY, rx.recv()).await {
            Ok(Some(b)) => b,
            Ok(None) => return,
            // Idle: an empty batch checks the peer is the one that took what came before.
            Err(_) => Vec::new(),
        };
        let mut bytes = 0usize;
        while batch.len() < MAX_BATCH && bytes < MAX_BATCH_BYTES {
            match rx.try_recv() {
                Ok(more) => {
                    bytes += more
                        .iter()
                        .map(|m| match m {
                            NodeMail::Enqueue { message, .. }
                            | NodeMail::Deliver { message, .. } => message.body.len() + 64,
                            NodeMail::Got { got: Some(g), .. } => g.message.body.len() + 64,
                            NodeMail::Settle { seqs, .. } => seqs.len() * 8 + 16,
                            _ => 32,
                        })
                        .sum::<usize>();
                    batch.extend(more);
                }
                Err(_) => break,
            }
        }
        let n = batch.len();
        let send = node.send_mail(
            u64::from(target),
            encode_batch(incarnations.own, &batch),
            SEND_TIMEOUT,
        );
        let (result, early) = send_or_nack_early(&node, &broker, target, reachable, send).await;
        queued.fetch_sub(n, Ordering::AcqRel);
        match result {
            Ok(now) => {
                // A restart: what it took before and had not answered is gone.
                incarnations.seen(&broker, target, now);
                // (Told early it was unreachable, the broker dropped what crossed to it.)
                if !reachable || early {
                    tracing::info!(node = target, "cluster: forwarding to node {target} again");
                    reachable = true;
                    broker.node_reachable(target);
                }
            }
            Err(e) => {
                if reachable && !early {
                    tracing::warn!(
                        node = target,
                        error = %e,
                        "cluster: cannot forward to node {target}: its queues are unavailable (publishes to them are nacked)"
                    );
                }
                reachable = false;
                broker.node_unreachable(target);
            }
        }
    }
}

/// A batch slower than this to reach its peer while the cluster transport already found
/// that peer unreachable (its Raft connection failed since) has the broker nack what it
/// forwarded there now, rather than after the whole [`SEND_TIMEOUT`]: a partition cost a
/// far-side publisher 5.1 s. A healthy peer takes a batch in milliseconds.
const SLOW_SEND: Duration = Duration::from_millis(300);

/// How often a slow send looks at the peer's reachability.
const REACH_CHECK: Duration = Duration::from_millis(100);

/// Awaits `send` (a batch to `target`); once it is slower than [`SLOW_SEND`] and the
/// transport says `target` is unreachable, the broker nacks what waits for `target`
/// (`node_unreachable`) at once, and the send is still awaited (what it carried may reach
/// the peer after all: a nack means "maybe not", at least once as always). The send's
/// result, and whether the broker was told early.
async fn send_or_nack_early<
    F: std::future::Future<Output = Result<u64, E>>,
    E: std::fmt::Display,
>(
    node: &ClusterNode,
    broker: &BrokerHandle,
    target: u32,
    reachable: bool,
    send: F,
) -> (Result<u64, E>, bool) {
    tokio::pin!(send);
    let started = tokio::time::Instant::now();
    let mut early = false;
    loop {
        tokio::select! {
            r = &mut send => return (r, early),
            _ = tokio::time::sleep(REACH_CHECK), if !early && reachable => {
                if started.elapsed() >= SLOW_SEND && !node.reachable(u64::from(target)) {
                    tracing::warn!(
                        node = target,
                        "cluster: node {target} unreachable: its queues are unavailable (publishes to them are nacked)"
                    );
                    broker.node_unreachable(target);
                    early = true;
                }
            }
        }
    }
}

/// Serves the mail peers send with this node's broker.
pub fn serve_mail(node: &ClusterNode, broker: BrokerHandle, incarnations: Arc<Incarnations>) {
    let incarnation = incarnations.own;
    node.set_mail_handler(Arc::new(move |from, bytes| {
        let broker = broker.clone();
        let incarnations = incarnations.clone();
        Box::pin(async move {
            let (sender, mails) = decode_batch(&bytes).inspect_err(|e| {
                tracing::warn!(
                    node = from,
                    "cluster: unreadable mail from node {from}: {e}"
                );
            })?;
            if let (Some(sender), Ok(peer)) = (sender, u32::try_from(from)) {
                // Before its mail: a restarted sender's old consumers and answers are
                // cleared first, never the ones this mail brings.
                incarnations.seen(&broker, peer, sender);
            }
            if !mails.is_empty() {
                broker
                    .receive_node_mail(from as u32, mails)
                    .await
                    .map_err(|_| "broker stopped".to_string())?;
            }
            Ok(incarnation)
        })
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::message::{Message, Properties};

    #[test]
    fn a_batch_names_its_senders_incarnation_and_a_bare_one_is_still_read() {
        let mails = vec![NodeMail::Answered {
            token: 9,
            taken: true,
        }];
        let (from, back) = decode_batch(&encode_batch(42, &mails)).expect("decodes");
        assert_eq!(from, Some(42));
        assert_eq!(format!("{back:?}"), format!("{mails:?}"));
        // A probe (mqtt.rs's handover check) sends a bare empty batch.
        let (from, back) = decode_batch(&encode(&[])).expect("decodes");
        assert_eq!((from, back.len()), (None, 0));
        assert!(decode_batch(&[FROM, 0, 0, 1]).is_err(), "a cut incarnation");
    }

    #[test]
    fn a_peer_showing_another_incarnation_restarted_once() {
        // No broker here: this test binary's footprint test counts the process's heap, and
        // a broker left running would count in it.
        let known = Incarnations::new();
        let cleared = std::cell::Cell::new(0);
        let see = |node, now| known.seen_then(node, now, || cleared.set(cleared.get() + 1));
        assert!(!see(2, 10), "first sight");
        assert!(!see(2, 10), "the same broker");
        // The answer to a batch and the batch of the peer show the new one: one restart.
        assert!(see(2, 11), "restarted");
        assert!(!see(2, 11), "already cleared");
        assert!(!see(3, 11), "another node's own count");
        assert_eq!(cleared.get(), 1, "cleared once");
    }

    #[test]
    fn batches_round_trip_and_bad_bytes_are_errors() {
        let message = Arc::new(Message {
            exchange: "x".into(),
            routing_key: "k".into(),
            properties: Properties {
                delivery_mode: Some(2),
                ..Default::default()
            },
            body: Bytes::from_static(b"hello"),
        });
        let mails = vec![
            NodeMail::Enqueue {
                vhost: "/".into(),
                queue: "q".into(),
                message,
                token: Some(7),
            },
            NodeMail::Answered {
                token: 9,
                taken: false,
            },
        ];
        let bytes = encode(&mails);
        let back = decode(&bytes).expect("decodes");
        assert_eq!(back.len(), 2);
        match &back[0] {
            NodeMail::Enqueue {
                vhost,
                queue,
                message,
                token,
            } => {
                assert_eq!((&**vhost, &**queue, *token), ("/", "q", Some(7)));
                assert_eq!(&message.body[..], b"hello");
                assert_eq!(message.properties.delivery_mode, Some(2));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            back[1],
            NodeMail::Answered {
                token: 9,
                taken: false
            }
        ));
        // Cut anywhere but between the two pieces: an error, never a panic.
        let first = encode(&mails[..1]).len();
        for cut in (1..bytes.len()).filter(|c| *c != first) {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(decode(&bytes[..first]).expect("one piece").len(), 1);
        assert!(decode(&[9]).is_err());
    }

    #[test]
    fn consumer_mail_round_trips_and_cut_batches_are_errors() {
        let message = Arc::new(Message {
            exchange: "".into(),
            routing_key: "q".into(),
            properties: Properties::default(),
            body: Bytes::from_static(b"body"),
        });
        let ch = NodeChannel {
            conn: 7,
            channel: 3,
            serial: 2,
        };
        let mails = vec![
            NodeMail::Consume {
                vhost: "/".into(),
                queue: "q".into(),
                from: ch,
                consumer: NodeConsumer {
                    tag: "c".into(),
                    no_ack: false,
                    exclusive: true,
                    prefetch: 10,
                    global_prefetch: 20,
                    priority: -5,
                },
                nowait: false,
            },
            NodeMail::ConsumeOk {
                to: ch,
                vhost: "/".into(),
                queue: "q".into(),
                consumer: 99,
                tag: "c".into(),
                nowait: true,
            },
            NodeMail::Refused {
                to: ch,
                code: 404,
                text: "NOT_FOUND - no queue".into(),
            },
            NodeMail::Deliver {
                to: ch,
                vhost: "/".into(),
                queue: "q".into(),
                consumer: 99,
                tag: "c".into(),
                no_ack: false,
                seq: 12,
                redelivered: true,
                message: message.clone(),
                window: 4,
            },
            NodeMail::Credit {
                window: 4,
                count: 3,
            },
            NodeMail::Settle {
                vhost: "/".into(),
                queue: "q".into(),
                seqs: vec![12, 13],
                how: NodeSettle::Requeue,
            },
            NodeMail::Cancel {
                vhost: "/".into(),
                queue: "q".into(),
                consumer: 99,
                reply: Some((ch, "c".into(), false)),
            },
            NodeMail::Cancelled {
                to: ch,
                tag: "c".into(),
                nowait: false,
            },
            NodeMail::ConsumerGone {
                to: ch,
                consumer: 99,
                tag: "c".into(),
            },
            NodeMail::Request {
                vhost: "/".into(),
                queue: "q".into(),
                from: ch,
                request: NodeRequest::Purge { nowait: false },
            },
            NodeMail::Got {
                to: ch,
                vhost: "/".into(),
                queue: "q".into(),
                no_ack: false,
                got: Some(NodeGot {
                    seq: 5,
                    redelivered: false,
                    message,
                    remaining: 8,
                }),
            },
            NodeMail::Purged {
                to: ch,
                count: 30,
                nowait: false,
            },
            NodeMail::Declared {
                to: ch,
                queue: "q".into(),
                messages: 1,
                consumers: 2,
                nowait: false,
            },
        ];
        let bytes = encode(&mails);
        let back = decode(&bytes).expect("decodes");
        // Each piece comes back as it went (compared by its debug form: messages carry no
        // PartialEq).
        assert_eq!(format!("{mails:?}"), format!("{back:?}"));
        let ends: Vec<usize> = (1..=mails.len())
            .map(|n| encode(&mails[..n]).len())
            .collect();
        for cut in (1..bytes.len()).filter(|c| !ends.contains(c)) {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        // A settle that claims more seqs than the batch holds is an error, not an allocation.
        let mut huge = vec![SETTLE, 0, 1, b'/', 0, 1, b'q'];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&huge).is_err());
    }
}
