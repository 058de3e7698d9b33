//! The mailbox: mail sent and not delivered yet, FIFO, and the outbox of mail for other
//! shards.

use super::{Dest, Mail};
use crate::ids::ConnId;
use std::collections::VecDeque;

/// The connection id the core uses to replay stored definitions and run admin ops; hosts
/// never issue it. It is every shard's own (shard 0's mail).
pub(crate) const RESTORE_CONN: ConnId = ConnId(u64::MAX);

/// Connection ids from here up (below the restore connection's) stand for cluster nodes:
/// `NODE_CONN_BASE + node` is the address a publish forwarded from that node is answered
/// to (`shard/nodes.rs`). Hosts number their connections from 1 and never reach them.
pub(crate) const NODE_CONN_BASE: u64 = u64::MAX - (1 << 32) - 1;

/// Connection ids from here up to the cluster nodes' are the shards' dead-letter forwarders:
/// `DLX_CONN_BASE + shard` is where the targets of a dead letter that shard forwards
/// answer (`shard/dlx.rs`).
pub(crate) const DLX_CONN_BASE: u64 = NODE_CONN_BASE - (1 << 16);

/// Whether `conn` is a shard's dead-letter forwarder (see [`DLX_CONN_BASE`]).
pub(crate) fn is_dlx_conn(conn: ConnId) -> bool {
    conn.0 >= DLX_CONN_BASE && conn.0 < NODE_CONN_BASE
}

/// Whether this build serves other nodes (cargo feature `nodes`, on by default). Off, as in
/// the wasm builds, no queue lives elsewhere and no channel consumes there: every path into
/// `shard/nodes.rs` and `shard/nodes_consume.rs` is then a constant branch the compiler
/// removes (about 30 KB of the JS module). Here, beside the node connections' numbering.
pub(crate) const NODES: bool = cfg!(feature = "nodes");

/// Whether `conn` stands for a cluster node (see [`NODE_CONN_BASE`]).
pub(crate) fn is_node_conn(conn: ConnId) -> bool {
    NODES && conn.0 >= NODE_CONN_BASE && conn != RESTORE_CONN
}

/// Mail sent and not delivered yet. With scheduled mail it also keeps where each piece
/// came from, so `deliver_mail` keeps the order of each (source, destination) pair only,
/// as FIFO links between shards do (they keep more order than that: a link carries the
/// mail of many pairs).
pub(crate) struct Mailbox {
    queue: VecDeque<Mail>,
    /// Scheduled mail only: each piece's source, in step with `queue`.
    sources: Option<VecDeque<Dest>>,
    /// The source of what is sent now.
    from: Dest,
    /// This broker's shard, and how many there are: mail for a queue or connection of
    /// another shard, or for topology (shard 0's), waits in `outbox` for the host.
    shard: u32,
    shards: u32,
    outbox: Vec<ShardMail>,
}

impl Default for Mailbox {
    fn default() -> Mailbox {
        Mailbox {
            queue: VecDeque::new(),
            sources: None,
            from: Dest::Host,
            shard: 0,
            shards: 1,
            outbox: Vec::new(),
        }
    }
}

/// Mail from one shard to another (ARCHITECTURE.md, "warren-runtime"). The host takes it
/// from the sender's outbox (`Broker::take_outbox`) and hands it to shard [`Self::shard`]
/// (`Broker::receive_mail`), in the order sent between each pair of shards.
pub struct ShardMail {
    pub(crate) shard: u32,
    pub(crate) mail: Mail,
}

impl ShardMail {
    /// The shard it goes to.
    pub fn shard(&self) -> u32 {
        self.shard
    }
}

impl Mailbox {
    /// Makes this the mailbox of shard `shard` of `shards`.
    pub(crate) fn set_shard(&mut self, shard: u32, shards: u32) {
        assert!(shards >= 1 && shard < shards, "shard {shard} of {shards}");
        self.shard = shard;
        self.shards = shards;
    }

    /// The shard that owns `dest`: a queue's or connection's id says it (`id % shards`);
    /// topology, and the internal connection that restores definitions and runs admin
    /// ops, are shard 0's; the host is everyone's own.
    pub(crate) fn shard_of(&self, dest: Dest) -> u32 {
        let k = u64::from(self.shards);
        match dest {
            Dest::Queue(q) => (q.0 % k) as u32,
            // A cluster node's address: the shard that answers it hands the answer to the
            // host (`shard/nodes.rs`).
            Dest::Conn(c) if is_node_conn(c) => self.shard,
            // A shard's dead-letter forwarder (`shard/dlx.rs`): that shard.
            Dest::Conn(c) if is_dlx_conn(c) => (c.0 - DLX_CONN_BASE) as u32,
            Dest::Conn(c) if c != RESTORE_CONN => (c.0 % k) as u32,
            Dest::Topology | Dest::Conn(_) => 0,
            Dest::Host => self.shard,
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn outbox_len(&self) -> usize {
        self.outbox.len()
    }

    pub(crate) fn take_outbox(&mut self, out: &mut Vec<ShardMail>) {
        out.append(&mut self.outbox);
    }

    #[inline]
    pub(crate) fn push_back(&mut self, mail: Mail) {
        if self.shards > 1 {
            let shard = self.shard_of(mail.dest());
            if shard != self.shard {
                self.outbox.push(ShardMail { shard, mail });
                return;
            }
        }
        if let Some(sources) = &mut self.sources {
            sources.push_back(self.from);
        }
        self.queue.push_back(mail);
    }

    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<Mail> {
        if let Some(sources) = &mut self.sources {
            sources.pop_front();
        }
        self.queue.pop_front()
    }

    /// Sends `mail` as `source` (with scheduled mail, it keeps order with what `source`
    /// sends, whoever runs now).
    pub(crate) fn push_from(&mut self, source: Dest, mail: Mail) {
        let now = std::mem::replace(&mut self.from, source);
        self.push_back(mail);
        self.from = now;
    }

    #[cfg(test)]
    pub(crate) fn front(&self) -> Option<&Mail> {
        self.queue.front()
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Who sends what is pushed from now on.
    #[inline]
    pub(crate) fn from(&mut self, source: Dest) {
        self.from = source;
    }

    pub(crate) fn set_scheduled(&mut self, on: bool) {
        self.sources = on.then(|| self.queue.iter().map(|_| Dest::Host).collect());
    }

    /// The oldest piece with the source and destination of the `pick`-th one.
    pub(crate) fn take(&mut self, pick: usize) -> Option<Mail> {
        let n = self.queue.len();
        let sources = self.sources.as_mut()?;
        if n == 0 {
            return None;
        }
        let key = (sources[pick % n], self.queue[pick % n].dest());
        let first = (0..n).find(|&i| (sources[i], self.queue[i].dest()) == key)?;
        sources.remove(first);
        self.queue.remove(first)
    }
}
