//! The browser store: the core's [`Store`] for a broker whose durable state lives in
//! IndexedDB. The core is synchronous and IndexedDB is not, so reads are served from an
//! in-memory mirror and every durable change is appended to a bounded pending batch;
//! [`Store::sync`] seals the batch, the JS side writes it in one IndexedDB transaction (group
//! commit) and reports the commit, and only then does the core confirm (`Broker::synced`).
//! On open, JS reads every record back and [`restore`] rebuilds the mirror and the
//! definitions the broker replays, as the native broker does on restart.
//!
//! Batch bytes (both directions: sealed batches to JS, stored records from JS at open): a
//! sequence of ops, each an op byte then u32-LE-length-prefixed fields: `1` put (key,
//! value), `2` delete (key), `3` delete every key in [lo, hi] (lo, hi). A transaction
//! applies them in order, the order they were made in.
//!
//! Small on purpose (the JS module has a size budget, issue 39): the mirror is a `VecDeque`
//! per open queue and the definitions a `Vec`, not maps (each map type instantiated costs
//! kilobytes of wasm).

use crate::record::{self, RecordError};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use warren_core::ids::QueueId;
use warren_core::message::Message;
use warren_core::store::{DefinitionChange, QueueRecovery, Store, StoreError, StoredMessage};

/// The pending batch's bound: past it appends fail (their publishers get nacks) until a sync
/// drains it, so a store that cannot write (quota) does not grow without limit.
pub const MAX_PENDING_BYTES: usize = 64 << 20;

pub const PUT: u8 = 1;
pub const DEL: u8 = 2;
pub const RANGE: u8 = 3;

fn op(out: &mut Vec<u8>, code: u8, fields: &[&[u8]]) {
    out.push(code);
    for f in fields {
        out.extend_from_slice(&(f.len() as u32).to_le_bytes());
        out.extend_from_slice(f);
    }
}

/// What the store and its host (the JS broker) share: the batches and where they are.
#[derive(Default)]
pub struct Shared {
    pending: Vec<u8>,
    /// The sealed batch in IndexedDB's hands: (epoch, bytes), kept until it commits.
    inflight: Option<(u64, Vec<u8>)>,
    /// Sealed and not yet taken by the host.
    sealed: Option<u64>,
    /// A write failed: no new sync starts until the host retries.
    pub paused: bool,
    /// The broker is replaying what was read back: nothing to write.
    restoring: bool,
    /// Chunks to write or rewrite at the next sync (messages appended or removed).
    chunks: bool,
}

impl Shared {
    /// Changes wait for a sync (the host asks the core for one).
    pub fn has_pending(&self) -> bool {
        !self.paused && !self.is_empty()
    }

    /// Nothing waits to be written (paused or not).
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty() && !self.chunks
    }

    /// The batch the last `Store::sync` sealed: (epoch, batch bytes).
    pub fn take_sealed(&mut self) -> Option<(u64, Vec<u8>)> {
        let epoch = self.sealed.take()?;
        let (_, bytes) = self.inflight.as_ref()?;
        Some((epoch, bytes.clone()))
    }

    /// The transaction of `epoch` committed.
    pub fn committed(&mut self, epoch: u64) {
        if self.inflight.as_ref().is_some_and(|(e, _)| *e == epoch) {
            self.inflight = None;
        }
    }

    /// The transaction of `epoch` failed: its changes go before the newer ones, to be
    /// written once the host says so (`paused`).
    pub fn failed(&mut self, epoch: u64) {
        if let Some((e, mut bytes)) = self.inflight.take() {
            if e == epoch {
                bytes.append(&mut self.pending);
                self.pending = bytes;
            } else {
                self.inflight = Some((e, bytes));
            }
        }
        self.paused = true;
    }
}

pub type SharedRef = Arc<Mutex<Shared>>;

pub fn lock(s: &SharedRef) -> MutexGuard<'_, Shared> {
    // Single-threaded (wasm): a panic while holding the lock ends the broker anyway.
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// One queue's mirror: its stored messages in sequence order.
struct Mirror {
    id: QueueId,
    vhost: String,
    name: String,
    prefix: Vec<u8>,
    durable: bool,
    keep_all: bool,
    messages: VecDeque<StoredMessage>,
    /// The queue's chunk records in IndexedDB, in sequence order.
    chunks: Vec<Chunk>,
    /// The first kept message not yet in a chunk (appended since the last sync).
    unsealed: Option<u64>,
}

/// A chunk record: the kept messages of one queue appended between two syncs (at most
/// [`CHUNK_MAX`]), stored under the first one's key. IndexedDB costs about as much per
/// request as per 100 KB (6,164 puts/s of 120 B in Chromium here, 330,033 messages/s as
/// chunks of 1,000), so a message is not a record of its own; a removal rewrites its chunk,
/// or deletes it once its last message is gone, at the next sync.
struct Chunk {
    first: u64,
    last: u64,
    dirty: bool,
}

/// Messages in one chunk at most: bounds what a removal rewrites.
pub const CHUNK_MAX: usize = 512;

impl Mirror {
    fn at(&self, seq: u64) -> usize {
        self.messages.partition_point(|m| m.seq < seq)
    }

    fn kept(&self, m: &Message) -> bool {
        self.durable && (self.keep_all || m.properties.is_persistent())
    }

    /// A stored message left: its chunk is rewritten at the next sync (one not yet in a
    /// chunk just goes).
    fn removed(&mut self, seq: u64) {
        if self.unsealed.is_some_and(|u| seq >= u) {
            return;
        }
        let i = self.chunks.partition_point(|c| c.last < seq);
        if let Some(c) = self.chunks.get_mut(i).filter(|c| c.first <= seq) {
            c.dirty = true;
        }
    }

    /// The kept messages from `from` on, as chunk payloads of at most `CHUNK_MAX` (each
    /// entry: seq and expiry, u64 LE, then the AMQP 1.0 message, u32-LE-length-prefixed).
    fn encode(&self, from: u64, to: u64) -> Vec<(u64, u64, Vec<u8>)> {
        let mut out: Vec<(u64, u64, Vec<u8>)> = Vec::new();
        let mut n = 0;
        for s in self.messages.range(self.at(from)..) {
            if s.seq > to {
                break;
            }
            if !self.kept(&s.message) {
                continue;
            }
            if n % CHUNK_MAX == 0 {
                out.push((s.seq, s.seq, Vec::new()));
            }
            n += 1;
            if let Some((_, last, p)) = out.last_mut() {
                *last = s.seq;
                p.extend_from_slice(&s.seq.to_le_bytes());
                p.extend_from_slice(&record::message_entry(&s.message, s.expires_at));
            }
        }
        out
    }

    /// The chunk ops of the batch being sealed: rewrites and deletes of the chunks that lost
    /// messages, then the new chunks.
    fn seal(&mut self, out: &mut Vec<u8>) {
        let mut chunks = std::mem::take(&mut self.chunks);
        chunks.retain_mut(|c| {
            if !c.dirty {
                return true;
            }
            c.dirty = false;
            let key = record::message_key(&self.prefix, c.first);
            match self.encode(c.first, c.last).pop() {
                Some((_, _, payload)) => {
                    op(out, PUT, &[&key, &record::seal(&key, &payload)]);
                    true
                }
                None => {
                    op(out, DEL, &[&key]);
                    false
                }
            }
        });
        if let Some(from) = self.unsealed.take() {
            for (first, last, payload) in self.encode(from, u64::MAX) {
                let key = record::message_key(&self.prefix, first);
                op(out, PUT, &[&key, &record::seal(&key, &payload)]);
                chunks.push(Chunk {
                    first,
                    last,
                    dirty: false,
                });
            }
        }
        self.chunks = chunks;
    }
}

/// A durable definition: enough to find what a delete takes with it.
struct Definition {
    key: Vec<u8>,
    kind: u8,
    vhost: String,
    /// An exchange's or queue's name; a binding's source.
    name: String,
    /// A binding's destination, and whether it is an exchange.
    destination: String,
    to_exchange: bool,
}

/// See the module docs.
pub struct IdbStore {
    queues: Vec<Mirror>,
    /// Messages read back at open, by (vhost, queue), until the broker opens their queue.
    recovered: Vec<Mirror>,
    definitions: Vec<Definition>,
    shared: SharedRef,
    /// What the messages not yet in a chunk will add to the batch (about): counts against
    /// [`MAX_PENDING_BYTES`].
    unsealed_bytes: usize,
}

impl IdbStore {
    fn record(&self, code: u8, fields: &[&[u8]]) {
        let mut s = lock(&self.shared);
        if !s.restoring {
            op(&mut s.pending, code, fields);
        }
    }

    fn queue(&mut self, q: QueueId) -> Option<&mut Mirror> {
        self.queues.iter_mut().find(|m| m.id == q)
    }

    fn delete_range(&self, prefix: &[u8], from: u64) {
        let (lo, hi) = (
            record::message_key(prefix, from),
            record::message_key(prefix, u64::MAX),
        );
        self.record(RANGE, &[&lo, &hi]);
    }

    fn delete_definitions(&mut self, gone: impl Fn(&Definition) -> bool) {
        let mut kept = Vec::with_capacity(self.definitions.len());
        for d in std::mem::take(&mut self.definitions) {
            if gone(&d) {
                self.record(DEL, &[&d.key]);
            } else {
                kept.push(d);
            }
        }
        self.definitions = kept;
    }
}

/// A binding's key: two bindings differing in their arguments alone are two bindings, so
/// the key ends with their encoding (AMQP 1.0, as in values).
fn binding_key(vhost: &str, b: &warren_core::command::Bind, to_exchange: bool) -> Vec<u8> {
    let flag = if to_exchange { "x" } else { "q" };
    let mut k = record::key(
        record::BINDING,
        &[vhost, &b.source, &b.destination, flag, &b.routing_key],
    );
    if !b.arguments.is_empty() {
        let props = warren_core::message::Properties {
            headers: Some(b.arguments.clone()),
            ..Default::default()
        };
        let m = Message {
            exchange: "".into(),
            routing_key: "".into(),
            properties: props,
            body: bytes::Bytes::new(),
        };
        k.extend_from_slice(&warren_core::amqp10::encode(&m));
    }
    k
}

impl Store for IdbStore {
    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError> {
        use DefinitionChange as C;
        use record::{BINDING, EXCHANGE, QUEUE};
        let (kind, vhost, def) = match change {
            C::ExchangeDeclared { vhost, def: x } => (
                EXCHANGE,
                vhost,
                record::Def {
                    vhost,
                    names: [&x.exchange, &x.kind],
                    destination: None,
                    flags: [x.durable, x.auto_delete, x.internal],
                    arguments: &x.arguments,
                },
            ),
            C::QueueDeclared { vhost, def: q } => (
                QUEUE,
                vhost,
                record::Def {
                    vhost,
                    names: ["", &q.queue],
                    destination: None,
                    flags: [q.durable, q.exclusive, q.auto_delete],
                    arguments: &q.arguments,
                },
            ),
            C::Bound {
                vhost,
                bind,
                to_exchange,
            } => (
                BINDING,
                vhost,
                record::Def {
                    vhost,
                    names: [&bind.source, &bind.routing_key],
                    destination: Some(&bind.destination),
                    flags: [to_exchange, false, false],
                    arguments: &bind.arguments,
                },
            ),
            C::Unbound {
                vhost,
                bind,
                to_exchange,
            } => {
                let key = binding_key(vhost, bind, to_exchange);
                self.delete_definitions(|d| d.key == key);
                return Ok(());
            }
            // Also every binding from or to it.
            C::ExchangeDeleted { vhost, name } => {
                self.delete_definitions(|d| {
                    d.vhost == vhost
                        && (d.kind != QUEUE && d.name == name
                            || d.kind == BINDING && d.to_exchange && d.destination == name)
                });
                return Ok(());
            }
            // Also every binding to it, and its messages.
            C::QueueDeleted { vhost, name } => {
                self.delete_definitions(|d| {
                    d.vhost == vhost
                        && (d.kind == QUEUE && d.name == name
                            || d.kind == BINDING && !d.to_exchange && d.destination == name)
                });
                self.delete_range(&record::queue_prefix(vhost, name), 0);
                return Ok(());
            }
            C::RetainedSet { vhost, message } => {
                let key = record::key(record::RETAINED, &[vhost, &message.topic]);
                self.record(PUT, &[&key, &record::retained(&key, message)]);
                return Ok(());
            }
            C::RetainedCleared { vhost, topic } => {
                self.record(DEL, &[&record::key(record::RETAINED, &[vhost, topic])]);
                return Ok(());
            }
            // Vhosts, users, permissions, policies, parameters: the JS API sets none, and
            // the broker starts with its defaults at every open.
            _ => return Ok(()),
        };
        let key = match change {
            C::Bound {
                vhost,
                bind,
                to_exchange,
            } => binding_key(vhost, bind, to_exchange),
            _ => record::key(kind, &[vhost, def.names[0], def.names[1]]),
        };
        let value = record::definition(&key, &def);
        self.record(PUT, &[&key, &value]);
        self.definitions.retain(|x| x.key != key);
        self.definitions.push(Definition {
            key,
            kind,
            vhost: vhost.into(),
            // An exchange's name, a queue's name, a binding's source.
            name: if kind == QUEUE {
                def.names[1]
            } else {
                def.names[0]
            }
            .into(),
            destination: def.destination.unwrap_or_default().into(),
            to_exchange: def.flags[0],
        });
        Ok(())
    }

    fn open_queue(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> QueueRecovery {
        let found = self
            .recovered
            .iter()
            .position(|m| m.vhost == vhost && m.name == name);
        let (messages, chunks) = match found {
            Some(i) => {
                let r = self.recovered.swap_remove(i);
                (r.messages, r.chunks)
            }
            None => (VecDeque::new(), Vec::new()),
        };
        let mut m = Mirror {
            id: queue,
            vhost: vhost.into(),
            name: name.into(),
            prefix: record::queue_prefix(vhost, name),
            durable,
            keep_all: false,
            messages: if durable { messages } else { VecDeque::new() },
            chunks: if durable { chunks } else { Vec::new() },
            unsealed: None,
        };
        if !durable && found.is_some() {
            // A transient queue starts empty: what a durable one of that name left goes.
            self.delete_range(&m.prefix, 0);
        }
        let recovery = QueueRecovery {
            count: m.messages.len() as u64,
            bytes: m.messages.iter().map(|s| s.message.body_len() as u64).sum(),
            first_seq: m.messages.front().map_or(0, |s| s.seq),
            next_seq: m.messages.back().map_or(0, |s| s.seq + 1),
        };
        m.messages.shrink_to_fit();
        self.queues.retain(|x| x.id != queue);
        self.queues.push(m);
        recovery
    }

    fn append(
        &mut self,
        queue: QueueId,
        seq: u64,
        message: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError> {
        if lock(&self.shared).pending.len() + self.unsealed_bytes > MAX_PENDING_BYTES {
            return Err(StoreError(
                "the browser store's pending writes are full".into(),
            ));
        }
        let Some(m) = self.queue(queue) else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        m.messages.push_back(StoredMessage {
            seq,
            message: message.clone(),
            redelivered: false,
            expires_at,
        });
        if m.kept(message) {
            m.unsealed.get_or_insert(seq);
            self.unsealed_bytes += message.body_len() + 64;
            lock(&self.shared).chunks = true;
        }
        Ok(())
    }

    fn keep_every_message(&mut self, queue: QueueId) {
        if let Some(m) = self.queue(queue) {
            m.keep_all = true;
        }
    }

    fn remove(&mut self, queue: QueueId, seq: u64) {
        let Some(m) = self.queue(queue) else { return };
        let i = m.at(seq);
        let Some(s) = m.messages.get(i).filter(|s| s.seq == seq) else {
            return;
        };
        let kept = m.kept(&s.message);
        if kept {
            m.removed(seq);
        }
        m.messages.remove(i);
        if kept {
            lock(&self.shared).chunks = true;
        }
    }

    fn remove_from(&mut self, queue: QueueId, from_seq: u64) {
        let Some(m) = self.queue(queue) else { return };
        let i = m.at(from_seq);
        m.messages.truncate(i);
        for c in m.chunks.iter_mut().filter(|c| c.last >= from_seq) {
            c.dirty = true;
        }
        lock(&self.shared).chunks = true;
    }

    fn read(
        &mut self,
        queue: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError> {
        let Some(m) = self.queue(queue) else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        let i = m.at(from_seq);
        out.extend(m.messages.range(i..).take(max).cloned());
        Ok(())
    }

    fn delete_queue(&mut self, queue: QueueId) {
        if let Some(i) = self.queues.iter().position(|m| m.id == queue) {
            let m = self.queues.swap_remove(i);
            if m.durable {
                self.delete_range(&m.prefix, 0);
            }
        }
    }

    fn sync(&mut self, epoch: u64) {
        let mut s = lock(&self.shared);
        for m in self.queues.iter_mut().filter(|m| m.durable) {
            m.seal(&mut s.pending);
        }
        self.unsealed_bytes = 0;
        s.chunks = false;
        let batch = std::mem::take(&mut s.pending);
        // The core starts no sync while one is in flight, so there is none to keep.
        s.inflight = Some((epoch, batch));
        s.sealed = Some(epoch);
    }
}

/// What the records read back at open hold: the store (mirror filled), the definitions to
/// replay (kind, decoded message: `record::definition`), in key order, and the records that
/// could not be read (skipped, with why).
pub struct Restored {
    pub store: IdbStore,
    pub shared: SharedRef,
    pub definitions: Vec<(u8, Message)>,
    /// "<key in hex>: <reason>", the first [`MAX_REPORTED`].
    pub skipped: Vec<String>,
    pub skipped_count: usize,
}

/// Skipped records named in a report at most (the count has them all).
pub const MAX_REPORTED: usize = 100;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Reads one record into the definitions or the recovered messages.
fn load(
    key: &[u8],
    payload: &[u8],
    definitions: &mut Vec<(u8, Message)>,
    recovered: &mut Vec<Mirror>,
) -> Result<(), RecordError> {
    let mut k = Reader(key);
    let kind = k.take(1)?[0];
    if kind != record::MESSAGE {
        let m = warren_core::amqp10::decode(&bytes::Bytes::copy_from_slice(payload))
            .map_err(|_| "bad AMQP 1.0 message")?;
        definitions.push((kind, m));
        return Ok(());
    }
    let (vhost, name) = (k.name()?, k.name()?);
    let first = k.u64_be()?;
    let mut p = Reader(payload);
    let mut messages = VecDeque::new();
    while !p.0.is_empty() {
        let seq = u64::from_le_bytes(p.take(8)?.try_into().map_err(|_| "truncated")?);
        let n = p.u32_le()?;
        let (expires_at, m) = record::read_message(p.take(n)?)?;
        messages.push_back(StoredMessage {
            seq,
            message: Arc::new(m),
            // It may have been delivered before the restart (delivery is not stored).
            redelivered: true,
            expires_at,
        });
    }
    let chunk = Chunk {
        first,
        last: messages.back().map_or(first, |m| m.seq),
        dirty: false,
    };
    // Keys come sorted: one queue's chunks are consecutive, in order.
    match recovered.last_mut() {
        Some(q) if q.vhost == vhost && q.name == name => {
            q.messages.append(&mut messages);
            q.chunks.push(chunk);
        }
        _ => recovered.push(Mirror {
            id: QueueId(0),
            prefix: Vec::new(),
            vhost,
            name,
            durable: true,
            keep_all: false,
            messages,
            chunks: vec![chunk],
            unsealed: None,
        }),
    }
    Ok(())
}

/// Reads keys and batches from the front.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        let (a, b) = self.0.split_at_checked(n).ok_or("truncated")?;
        self.0 = b;
        Ok(a)
    }
    fn u32_le(&mut self) -> Result<usize, RecordError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    fn u64_be(&mut self) -> Result<u64, RecordError> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
    fn name(&mut self) -> Result<String, RecordError> {
        let b = self.take(2)?;
        let n = usize::from(u16::from_be_bytes([b[0], b[1]]));
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "bad name")
    }
}

/// Rebuilds the store from the records read back (`records`: put ops in key order, as in
/// the module docs). A record that fails its checks is skipped and reported, never
/// half-applied.
pub fn restore(records: &[u8]) -> Result<Restored, RecordError> {
    let mut definitions = Vec::new();
    let mut recovered = Vec::new();
    let mut skipped = Vec::new();
    let mut skipped_count = 0;
    let mut r = Reader(records);
    while !r.0.is_empty() {
        if r.take(1)?[0] != PUT {
            return Err("not a put");
        }
        let n = r.u32_le()?;
        let key = r.take(n)?;
        let n = r.u32_le()?;
        let value = r.take(n)?;
        let loaded =
            record::open(key, value).and_then(|p| load(key, p, &mut definitions, &mut recovered));
        if let Err(e) = loaded {
            skipped_count += 1;
            if skipped.len() < MAX_REPORTED {
                skipped.push(format!("{}: {e}", hex(key)));
            }
        }
    }
    let shared = SharedRef::default();
    lock(&shared).restoring = true;
    Ok(Restored {
        store: IdbStore {
            queues: Vec::new(),
            recovered,
            definitions: Vec::new(),
            shared: shared.clone(),
            unsealed_bytes: 0,
        },
        shared,
        definitions,
        skipped,
        skipped_count,
    })
}

/// The broker has replayed the definitions: changes are recorded from now on. Messages of
/// queues not restored (their record was skipped) stay in IndexedDB, unread.
pub fn restored(shared: &SharedRef) {
    lock(shared).restoring = false;
}
