//! The on-disk time index of scheduled (delayed) messages: `schedule.redb`, one per shard's
//! store (byte layout: docs/storage.md, "Schedule").
//!
//! One table, `scheduled`, keyed by the 16 bytes of a [`ScheduleKey`] (due time, then id,
//! both big-endian u64: byte order is due order), each value a message with the exchange it
//! is routed through. The broker thread never opens a write transaction: what it adds,
//! removes and purges gathers in a [`Batch`] that the next sync hands to the sync thread,
//! which commits it after the journal's fdatasync (so a removal, which follows the enqueues
//! of its message, is never durable before them). Until that commit, reads merge the batches
//! in flight with the table.

use crate::guard;
use crate::record;
use bytes::Bytes;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound::{Excluded, Unbounded};
use std::path::Path;
use std::sync::{Arc, Mutex};
use warren_core::store::{ScheduleKey, ScheduleRecovery, ScheduledMessage, StoreError};

const SCHEDULED: TableDefinition<&[u8], &[u8]> = TableDefinition::new("scheduled");

/// The value's format version (its first byte).
const VALUE_VERSION: u8 = 1;
/// Flag bit 0 of a value: the message survives a restart.
const DURABLE: u8 = 1;

/// redb's page cache for this file: the window is in the broker's memory already, and the
/// table is read in key order, so a small cache serves it.
const CACHE_BYTES: usize = 16 << 20;

/// The key's bytes: due time, then id, big-endian.
pub fn encode_key(k: ScheduleKey) -> [u8; 16] {
    let mut out = [0; 16];
    out[..8].copy_from_slice(&k.due.to_be_bytes());
    out[8..].copy_from_slice(&k.id.to_be_bytes());
    out
}

fn decode_key(b: &[u8]) -> Option<ScheduleKey> {
    let due = u64::from_be_bytes(b.get(..8)?.try_into().ok()?);
    let id = u64::from_be_bytes(b.get(8..16)?.try_into().ok()?);
    Some(ScheduleKey { due, id })
}

/// A value's bytes: version, flags, vhost and exchange (u16 big-endian length, UTF-8), then
/// the message record (`record::encode_message`, body inline).
pub fn encode_value(m: &ScheduledMessage, out: &mut Vec<u8>) {
    out.push(VALUE_VERSION);
    out.push(if m.durable { DURABLE } else { 0 });
    for name in [&m.vhost, &m.exchange] {
        // Names are short strings on the wire (at most 255 bytes).
        let len = u16::try_from(name.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&name.as_bytes()[..usize::from(len)]);
    }
    record::encode_message(&m.message, true, out);
}

/// The names and flags at the start of a value, and where the message record begins.
fn decode_head(v: &[u8]) -> Result<(bool, &str, &str, usize), String> {
    let bad = || "truncated scheduled message".to_string();
    if v.first() != Some(&VALUE_VERSION) {
        return Err(format!("unknown scheduled message version {:?}", v.first()));
    }
    let durable = v.get(1).ok_or_else(bad)? & DURABLE != 0;
    let mut at = 2;
    let mut names = [""; 2];
    for name in &mut names {
        let len = usize::from(u16::from_be_bytes(
            v.get(at..at + 2)
                .ok_or_else(bad)?
                .try_into()
                .map_err(|_| bad())?,
        ));
        at += 2;
        let bytes = v.get(at..at + len).ok_or_else(bad)?;
        *name = std::str::from_utf8(bytes).map_err(|_| "scheduled message name is not UTF-8")?;
        at += len;
    }
    Ok((durable, names[0], names[1], at))
}

fn decode_value(key: ScheduleKey, v: &[u8]) -> Result<ScheduledMessage, String> {
    let (durable, vhost, exchange, at) = decode_head(v)?;
    let record = Bytes::copy_from_slice(&v[at..]);
    let message = record::decode_message(&record, None).map_err(|e| e.to_string())?;
    Ok(ScheduledMessage {
        key,
        vhost: Arc::from(vhost),
        exchange: Arc::from(exchange),
        message: Arc::new(message),
        durable,
    })
}

/// Changes made between two syncs, committed together.
#[derive(Default)]
pub(crate) struct Batch {
    adds: BTreeMap<ScheduleKey, ScheduledMessage>,
    removes: BTreeSet<ScheduleKey>,
    /// (vhost, exchange): every row of it goes.
    purges: Vec<(String, String)>,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.adds.is_empty() && self.removes.is_empty() && self.purges.is_empty()
    }

    fn purged(&self, m_vhost: &str, m_exchange: &str) -> bool {
        self.purges
            .iter()
            .any(|(v, x)| v == m_vhost && x == m_exchange)
    }
}

/// Batches handed to a sync and not committed yet (shared with the sync thread).
type InFlight = Arc<Mutex<Vec<Arc<Batch>>>>;

/// See the module docs.
pub(crate) struct ScheduleIndex {
    db: Arc<Database>,
    pending: Batch,
    in_flight: InFlight,
}

/// A batch for the sync thread to commit (`commit`), after the journal's fdatasync.
pub(crate) struct ScheduleSync {
    db: Arc<Database>,
    batch: Arc<Batch>,
    in_flight: InFlight,
    durable: bool,
}

fn dberr(e: impl std::fmt::Display) -> String {
    format!("schedule: {e}")
}

fn lock(f: &InFlight) -> std::sync::MutexGuard<'_, Vec<Arc<Batch>>> {
    // Plain data: a panic elsewhere leaves nothing half-updated that matters here.
    f.lock().unwrap_or_else(|e| e.into_inner())
}

impl ScheduleIndex {
    /// Opens (creating it) `schedule.redb` under `root`, dropping what does not survive a
    /// restart (transient messages paged here by the last run).
    pub(crate) fn open(root: &Path) -> Result<(ScheduleIndex, ScheduleRecovery), String> {
        let path = root.join("schedule.redb");
        // A damaged file may make redb panic: one clear error instead (`guard`).
        guard::catch_quietly(move || {
            let db = Database::builder()
                .set_cache_size(CACHE_BYTES)
                .create(&path)
                .map_err(dberr)?;
            let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
            let mut next_id = 1;
            let mut tx = db.begin_write().map_err(dberr)?;
            tx.set_durability(Durability::Immediate).map_err(dberr)?;
            {
                let mut t = tx.open_table(SCHEDULED).map_err(dberr)?;
                let mut drop = Vec::new();
                for row in t.iter().map_err(dberr)? {
                    let (k, v) = row.map_err(dberr)?;
                    let Some(key) = decode_key(k.value()) else {
                        drop.push(k.value().to_vec());
                        continue;
                    };
                    match decode_head(v.value()) {
                        Ok((true, vhost, exchange, _)) => {
                            next_id = next_id.max(key.id + 1);
                            *counts
                                .entry((vhost.to_string(), exchange.to_string()))
                                .or_default() += 1;
                        }
                        Ok((false, ..)) => drop.push(k.value().to_vec()),
                        Err(e) => {
                            tracing::warn!(error = %e, due = key.due, "a damaged scheduled message is dropped");
                            drop.push(k.value().to_vec());
                        }
                    }
                }
                for k in drop {
                    t.remove(k.as_slice()).map_err(dberr)?;
                }
            }
            tx.commit().map_err(dberr)?;
            let rec = ScheduleRecovery {
                next_id,
                counts: counts.into_iter().map(|((v, x), n)| (v, x, n)).collect(),
            };
            Ok((
                ScheduleIndex {
                    db: Arc::new(db),
                    pending: Batch::default(),
                    in_flight: InFlight::default(),
                },
                rec,
            ))
        })
        .map_err(|e| format!("schedule.redb: {e}"))?
    }

    pub(crate) fn add(&mut self, m: &ScheduledMessage) {
        self.pending.adds.insert(m.key, m.clone());
    }

    pub(crate) fn remove(&mut self, key: ScheduleKey) {
        if self.pending.adds.remove(&key).is_none() {
            self.pending.removes.insert(key);
        }
    }

    pub(crate) fn purge(&mut self, vhost: &str, exchange: &str) -> u64 {
        let before = self.pending.adds.len();
        self.pending
            .adds
            .retain(|_, m| &*m.vhost != vhost || &*m.exchange != exchange);
        self.pending
            .purges
            .push((vhost.to_string(), exchange.to_string()));
        (before - self.pending.adds.len()) as u64
    }

    /// The batch for the sync starting now (`None`: nothing changed).
    pub(crate) fn take_sync(&mut self, durable: bool) -> Option<ScheduleSync> {
        if self.pending.is_empty() {
            return None;
        }
        let batch = Arc::new(std::mem::take(&mut self.pending));
        lock(&self.in_flight).push(Arc::clone(&batch));
        Some(ScheduleSync {
            db: Arc::clone(&self.db),
            batch,
            in_flight: Arc::clone(&self.in_flight),
            durable,
        })
    }

    /// Up to `max` messages with keys above `after`, in key order: the table's rows not
    /// removed or purged since, merged with the adds not committed yet.
    pub(crate) fn read(
        &self,
        after: Option<ScheduleKey>,
        max: usize,
        out: &mut Vec<ScheduledMessage>,
    ) -> Result<(), StoreError> {
        let in_flight = lock(&self.in_flight).clone();
        let batches: Vec<&Batch> = in_flight
            .iter()
            .map(|b| &**b)
            .chain(std::iter::once(&self.pending))
            .collect();
        // A batch's removes and purges hide what earlier batches and the table hold.
        let hidden = |m_key: ScheduleKey, vhost: &str, exchange: &str, from: usize| {
            batches[from..]
                .iter()
                .any(|b| b.removes.contains(&m_key) || b.purged(vhost, exchange))
        };
        let lower = after.map_or(Unbounded, Excluded);
        let mut added: Vec<ScheduledMessage> = Vec::new();
        for (i, b) in batches.iter().enumerate() {
            for m in b.adds.range((lower, Unbounded)).take(max).map(|(_, m)| m) {
                if !hidden(m.key, &m.vhost, &m.exchange, i + 1) {
                    added.push(m.clone());
                }
            }
        }
        added.sort_by_key(|m| m.key);
        added.truncate(max);
        let mut table = Vec::new();
        let db = &self.db;
        (|| -> Result<(), String> {
            let tx = db.begin_read().map_err(dberr)?;
            let t = tx.open_table(SCHEDULED).map_err(dberr)?;
            let from = after.map(encode_key);
            let range = match &from {
                Some(k) => t.range::<&[u8]>((Excluded(k.as_slice()), Unbounded)),
                None => t.range::<&[u8]>(..),
            }
            .map_err(dberr)?;
            for row in range {
                if table.len() >= max {
                    break;
                }
                let (k, v) = row.map_err(dberr)?;
                let Some(key) = decode_key(k.value()) else {
                    continue;
                };
                let (_, vhost, exchange, _) = decode_head(v.value())?;
                if hidden(key, vhost, exchange, 0) {
                    continue;
                }
                table.push(decode_value(key, v.value())?);
            }
            Ok(())
        })()
        .map_err(StoreError)?;
        // Merge the two sorted lists.
        let mut a = added.into_iter().peekable();
        let mut b = table.into_iter().peekable();
        while out.len() < max {
            let next = match (a.peek(), b.peek()) {
                (Some(x), Some(y)) if x.key <= y.key => a.next(),
                (Some(_), Some(_)) => b.next(),
                (Some(_), None) => a.next(),
                (None, Some(_)) => b.next(),
                (None, None) => None,
            };
            match next {
                Some(m) => out.push(m),
                None => break,
            }
        }
        Ok(())
    }
}

impl ScheduleSync {
    /// Commits the batch (purges first: an add made after a purge was not purged, and
    /// those made before it left the batch then).
    pub(crate) fn commit(&self) -> Result<(), String> {
        let (db, batch, durable) = (&self.db, &self.batch, self.durable);
        (|| -> Result<(), String> {
            let mut tx = db.begin_write().map_err(dberr)?;
            let durability = if durable {
                Durability::Immediate
            } else {
                Durability::None
            };
            tx.set_durability(durability).map_err(dberr)?;
            {
                let mut t = tx.open_table(SCHEDULED).map_err(dberr)?;
                for (vhost, exchange) in &batch.purges {
                    let mut drop = Vec::new();
                    for row in t.iter().map_err(dberr)? {
                        let (k, v) = row.map_err(dberr)?;
                        if let Ok((_, v_vhost, v_exchange, _)) = decode_head(v.value())
                            && v_vhost == vhost
                            && v_exchange == exchange
                        {
                            drop.push(k.value().to_vec());
                        }
                    }
                    for k in drop {
                        t.remove(k.as_slice()).map_err(dberr)?;
                    }
                }
                let mut value = Vec::new();
                for (k, m) in &batch.adds {
                    value.clear();
                    encode_value(m, &mut value);
                    t.insert(encode_key(*k).as_slice(), value.as_slice())
                        .map_err(dberr)?;
                }
                for k in &batch.removes {
                    t.remove(encode_key(*k).as_slice()).map_err(dberr)?;
                }
            }
            tx.commit().map_err(dberr)
        })()
    }
}

impl Drop for ScheduleSync {
    /// Committed, or failed (the sync reports it: the epoch's confirms became nacks): no
    /// longer in flight either way.
    fn drop(&mut self) {
        lock(&self.in_flight).retain(|b| !Arc::ptr_eq(b, &self.batch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::message::Message;

    fn m(due: u64, id: u64, exchange: &str, durable: bool) -> ScheduledMessage {
        ScheduledMessage {
            key: ScheduleKey { due, id },
            vhost: Arc::from("/"),
            exchange: Arc::from(exchange),
            message: Arc::new(Message {
                exchange: Arc::from(exchange),
                routing_key: Arc::from("k"),
                properties: Default::default(),
                body: Bytes::from(format!("{due}-{id}")),
            }),
            durable,
        }
    }

    fn keys(idx: &ScheduleIndex, after: Option<ScheduleKey>, max: usize) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        idx.read(after, max, &mut out).expect("read");
        out.iter().map(|m| (m.key.due, m.key.id)).collect()
    }

    fn dir(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("warren-schedule-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[test]
    fn reads_merge_pending_in_flight_and_the_table_in_key_order() {
        let d = dir("merge");
        let (mut idx, rec) = ScheduleIndex::open(&d).expect("open");
        assert_eq!(rec.counts, []);
        idx.add(&m(30, 1, "x", true));
        idx.add(&m(10, 2, "x", true));
        let committed = idx.take_sync(true).expect("a batch");
        committed.commit().expect("commit");
        drop(committed);
        idx.add(&m(20, 3, "x", true));
        let in_flight = idx.take_sync(true).expect("a batch");
        idx.add(&m(5, 4, "y", false));
        idx.remove(ScheduleKey { due: 10, id: 2 });
        assert_eq!(keys(&idx, None, 10), [(5, 4), (20, 3), (30, 1)]);
        assert_eq!(
            keys(&idx, Some(ScheduleKey { due: 5, id: 4 }), 1),
            [(20, 3)]
        );
        assert_eq!(idx.purge("/", "y"), 1);
        assert_eq!(keys(&idx, None, 10), [(20, 3), (30, 1)]);
        in_flight.commit().expect("commit");
        drop(in_flight);
        idx.take_sync(true)
            .expect("a batch")
            .commit()
            .expect("commit");
        assert_eq!(keys(&idx, None, 10), [(20, 3), (30, 1)]);
        drop(idx);
        let (idx, rec) = ScheduleIndex::open(&d).expect("reopen");
        assert_eq!(rec.counts, [("/".to_string(), "x".to_string(), 2)]);
        assert_eq!(rec.next_id, 4);
        let mut out = Vec::new();
        idx.read(None, 10, &mut out).expect("read");
        assert_eq!(&out[0].message.body[..], b"20-3");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn transient_rows_are_dropped_at_open_and_purge_clears_the_table() {
        let d = dir("transient");
        let (mut idx, _) = ScheduleIndex::open(&d).expect("open");
        idx.add(&m(1, 1, "x", false));
        idx.add(&m(2, 2, "x", true));
        idx.add(&m(3, 3, "z", true));
        idx.take_sync(true)
            .expect("a batch")
            .commit()
            .expect("commit");
        drop(idx);
        let (mut idx, rec) = ScheduleIndex::open(&d).expect("reopen");
        assert_eq!(
            rec.counts,
            [
                ("/".to_string(), "x".to_string(), 1),
                ("/".to_string(), "z".to_string(), 1)
            ]
        );
        idx.purge("/", "x");
        assert_eq!(keys(&idx, None, 10), [(3, 3)], "hidden before the commit");
        idx.take_sync(true)
            .expect("a batch")
            .commit()
            .expect("commit");
        assert_eq!(keys(&idx, None, 10), [(3, 3)]);
        let _ = std::fs::remove_dir_all(&d);
    }
}
