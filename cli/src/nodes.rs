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
use warren_core::NodeMail;
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

/// The bytes of a batch: per piece a tag, then for `Enqueue` the vhost and queue (u16
/// length + UTF-8 each), a token flag (u8) and token (u64 BE, if flagged), the message
/// record (u32 length + `warren_store::record::encode_message` with its body); for
/// `Answered` the token (u64 BE) and taken (u8).
pub fn encode(mails: &[NodeMail]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut record = Vec::new();
    for m in mails {
        match m {
            NodeMail::Enqueue {
                vhost,
                queue,
                message,
                token,
            } => {
                out.push(ENQUEUE);
                for s in [vhost, queue] {
                    let b = s.as_bytes();
                    // Names are at most 255 bytes (AMQP short strings).
                    out.extend_from_slice(&(b.len().min(u16::MAX as usize) as u16).to_be_bytes());
                    out.extend_from_slice(&b[..b.len().min(u16::MAX as usize)]);
                }
                match token {
                    Some(t) => {
                        out.push(1);
                        out.extend_from_slice(&t.to_be_bytes());
                    }
                    None => out.push(0),
                }
                record.clear();
                encode_message(message, true, &mut record);
                out.extend_from_slice(&(record.len() as u32).to_be_bytes());
                out.extend_from_slice(&record);
            }
            NodeMail::Answered { token, taken } => {
                out.push(ANSWERED);
                out.extend_from_slice(&token.to_be_bytes());
                out.push(u8::from(*taken));
            }
        }
    }
    out
}

/// The mail of a batch's bytes; an error for bytes this version cannot read (never a
/// panic: they come from the network, if from an authenticated peer).
pub fn decode(bytes: &[u8]) -> Result<Vec<NodeMail>, String> {
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
        fn u64(&mut self) -> Result<u64, String> {
            let b = self.take(8)?;
            Ok(u64::from_be_bytes(b.try_into().map_err(|_| "u64")?))
        }
        fn name(&mut self) -> Result<Arc<str>, String> {
            let n = self.take(2)?;
            let n = u16::from_be_bytes([n[0], n[1]]) as usize;
            let s = std::str::from_utf8(self.take(n)?).map_err(|e| e.to_string())?;
            Ok(s.into())
        }
    }
    let mut r = R(bytes);
    let mut out = Vec::new();
    while !r.0.is_empty() {
        match r.u8()? {
            ENQUEUE => {
                let vhost = r.name()?;
                let queue = r.name()?;
                let token = match r.u8()? {
                    0 => None,
                    _ => Some(r.u64()?),
                };
                let n = r.take(4)?;
                let n = u32::from_be_bytes([n[0], n[1], n[2], n[3]]) as usize;
                let record = Bytes::copy_from_slice(r.take(n)?);
                let message = decode_message(&record, None).map_err(|e| e.to_string())?;
                out.push(NodeMail::Enqueue {
                    vhost,
                    queue,
                    message: Arc::new(message),
                    token,
                });
            }
            ANSWERED => {
                let token = r.u64()?;
                let taken = r.u8()? != 0;
                out.push(NodeMail::Answered { token, taken });
            }
            t => return Err(format!("unknown mail tag {t}")),
        }
    }
    Ok(out)
}

/// The runtime's `NodeLink` over the cluster transport.
pub struct ClusterLink {
    node: &'static ClusterNode,
    broker: BrokerHandle,
    /// One task per peer, fed in order.
    peers: Mutex<HashMap<u32, mpsc::UnboundedSender<Vec<NodeMail>>>>,
    /// Pieces handed to `send` and not yet sent (or failed).
    queued: Arc<AtomicUsize>,
}

impl ClusterLink {
    pub fn new(node: &'static ClusterNode, broker: BrokerHandle) -> Self {
        Self {
            node,
            broker,
            peers: Mutex::default(),
            queued: Arc::default(),
        }
    }
}

impl NodeLink for ClusterLink {
    fn send(&self, node: u32, mails: Vec<NodeMail>) {
        self.queued.fetch_add(mails.len(), Ordering::AcqRel);
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let tx = peers.entry(node).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(peer_task(
                self.node,
                self.broker.clone(),
                node,
                rx,
                self.queued.clone(),
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
    node: &'static ClusterNode,
    broker: BrokerHandle,
    target: u32,
    mut rx: mpsc::UnboundedReceiver<Vec<NodeMail>>,
    queued: Arc<AtomicUsize>,
) {
    let mut reachable = true;
    let mut incarnation: Option<u64> = None;
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
                            NodeMail::Enqueue { message, .. } => message.body.len() + 64,
                            NodeMail::Answered { .. } => 9,
                        })
                        .sum::<usize>();
                    batch.extend(more);
                }
                Err(_) => break,
            }
        }
        let n = batch.len();
        let result = node
            .send_mail(u64::from(target), encode(&batch), SEND_TIMEOUT)
            .await;
        queued.fetch_sub(n, Ordering::AcqRel);
        match result {
            Ok(now) => {
                if incarnation.is_some_and(|i| i != now) {
                    // It restarted: what it took before and had not answered is gone.
                    tracing::warn!(
                        node = target,
                        "cluster: node {target} restarted; publishes forwarded to it and not yet confirmed are nacked"
                    );
                    broker.node_unreachable(target);
                }
                incarnation = Some(now);
                if !reachable {
                    tracing::info!(node = target, "cluster: forwarding to node {target} again");
                    reachable = true;
                }
            }
            Err(e) => {
                if reachable {
                    tracing::warn!(
                        node = target,
                        error = %e,
                        "cluster: cannot forward to node {target}: its queues are unavailable (publishes to them are nacked)"
                    );
                    reachable = false;
                }
                broker.node_unreachable(target);
            }
        }
    }
}

/// Serves the mail peers send with this node's broker.
pub fn serve_mail(node: &'static ClusterNode, broker: BrokerHandle) {
    // This broker's incarnation: the clock at start, in nanoseconds (a restart draws
    // another).
    let incarnation = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    node.set_mail_handler(Arc::new(move |from, bytes| {
        let broker = broker.clone();
        Box::pin(async move {
            let mails = decode(&bytes).inspect_err(|e| {
                tracing::warn!(
                    node = from,
                    "cluster: unreadable mail from node {from}: {e}"
                );
            })?;
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
}
