//! Durable definitions (exchanges, queues, bindings) in redb. Changes are committed with
//! `Durability::None` as they happen and made durable by the next sync's
//! `Durability::Immediate` commit (group commit, as for messages): a declare costs no fsync
//! of its own. Value encodings: docs/storage.md ("Definitions").

use crate::record::{DecodeError, Reader, Writer};
use bytes::Bytes;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::Path;
use std::sync::Arc;
use warren_core::command::{Bind, ExchangeDeclare, QueueDeclare};
use warren_core::policy::{ApplyTo, PolicyDef};
use warren_core::store::{DefinitionChange, Definitions};

const EXCHANGES: TableDefinition<&str, &[u8]> = TableDefinition::new("exchanges");
const QUEUES: TableDefinition<&str, &[u8]> = TableDefinition::new("queues");
/// Key: the encoded binding; value: unused (1).
const BINDINGS: TableDefinition<&[u8], u8> = TableDefinition::new("bindings");
const POLICIES: TableDefinition<&str, &[u8]> = TableDefinition::new("policies");
/// MQTT retained messages: key vhost NUL topic (see `retained.rs`).
const RETAINED: TableDefinition<&[u8], &[u8]> = TableDefinition::new("retained");
/// Format version of the values, under key "version".
const META: TableDefinition<&str, u32> = TableDefinition::new("meta");
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum DefinitionsError {
    #[error("definitions database: {0}")]
    Db(String),
    #[error("definitions database has format version {0}; this warren reads {VERSION}")]
    Version(u32),
    #[error("corrupt definition: {0}")]
    Decode(#[from] DecodeError),
}

fn dberr<E: std::fmt::Display>(e: E) -> DefinitionsError {
    DefinitionsError::Db(e.to_string())
}

/// The redb database of definitions. Cheap to clone (shared with the sync thread).
#[derive(Clone)]
pub struct DefinitionStore {
    db: Arc<Database>,
}

fn encode_exchange(d: &ExchangeDeclare) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.bytes(d.kind.as_bytes());
    w.u8(u8::from(d.durable) | u8::from(d.auto_delete) << 1 | u8::from(d.internal) << 2);
    w.table(&d.arguments);
    out
}

fn decode_exchange(name: &str, v: &[u8]) -> Result<ExchangeDeclare, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let kind = r.string()?;
    let flags = r.u8()?;
    Ok(ExchangeDeclare {
        exchange: name.to_string(),
        kind,
        passive: false,
        durable: flags & 1 != 0,
        auto_delete: flags & 2 != 0,
        internal: flags & 4 != 0,
        nowait: false,
        arguments: r.table(0)?,
    })
}

fn encode_queue(d: &QueueDeclare) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.u8(u8::from(d.durable) | u8::from(d.auto_delete) << 1);
    w.table(&d.arguments);
    out
}

fn decode_queue(name: &str, v: &[u8]) -> Result<QueueDeclare, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let flags = r.u8()?;
    Ok(QueueDeclare {
        queue: name.to_string(),
        passive: false,
        durable: flags & 1 != 0,
        exclusive: false,
        auto_delete: flags & 2 != 0,
        nowait: false,
        arguments: r.table(0)?,
    })
}

fn encode_policy(p: &PolicyDef) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.bytes(p.pattern.as_bytes());
    w.bytes(p.apply_to.as_str().as_bytes());
    w.u64(p.priority as u64);
    w.table(&p.definition);
    out
}

fn decode_policy(name: &str, v: &[u8]) -> Result<PolicyDef, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let pattern = r.string()?;
    let apply_to = ApplyTo::parse(&r.string()?).unwrap_or_default();
    Ok(PolicyDef {
        name: name.to_string(),
        pattern,
        apply_to,
        priority: r.u64()? as i64,
        definition: r.table(0)?,
    })
}

fn encode_binding(b: &Bind, to_exchange: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.u8(u8::from(to_exchange));
    w.bytes(b.source.as_bytes());
    w.bytes(b.destination.as_bytes());
    w.bytes(b.routing_key.as_bytes());
    w.table(&b.arguments);
    out
}

fn decode_binding(v: &[u8]) -> Result<(Bind, bool), DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let to_exchange = r.u8()? != 0;
    Ok((
        Bind {
            source: r.string()?,
            destination: r.string()?,
            routing_key: r.string()?,
            nowait: false,
            arguments: r.table(0)?,
        },
        to_exchange,
    ))
}

impl DefinitionStore {
    pub fn open(path: &Path) -> Result<DefinitionStore, DefinitionsError> {
        let database = Database::create(path).map_err(dberr)?;
        let store = DefinitionStore {
            db: Arc::new(database),
        };
        let mut tx = store.db.begin_write().map_err(dberr)?;
        tx.set_durability(Durability::Immediate).map_err(dberr)?;
        {
            let mut meta = tx.open_table(META).map_err(dberr)?;
            let version = meta.get("version").map_err(dberr)?.map(|v| v.value());
            match version {
                None => {
                    meta.insert("version", VERSION).map_err(dberr)?;
                }
                Some(VERSION) => {}
                Some(v) => return Err(DefinitionsError::Version(v)),
            }
            tx.open_table(EXCHANGES).map_err(dberr)?;
            tx.open_table(QUEUES).map_err(dberr)?;
            tx.open_table(BINDINGS).map_err(dberr)?;
            tx.open_table(POLICIES).map_err(dberr)?;
            tx.open_table(RETAINED).map_err(dberr)?;
        }
        tx.commit().map_err(dberr)?;
        Ok(store)
    }

    /// Everything stored, in replay order.
    pub fn load(&self) -> Result<Definitions, DefinitionsError> {
        let tx = self.db.begin_read().map_err(dberr)?;
        let mut defs = Definitions::default();
        for row in tx
            .open_table(EXCHANGES)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            defs.exchanges.push(decode_exchange(k.value(), v.value())?);
        }
        for row in tx
            .open_table(QUEUES)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            defs.queues.push(decode_queue(k.value(), v.value())?);
        }
        for row in tx
            .open_table(POLICIES)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            defs.policies.push(decode_policy(k.value(), v.value())?);
        }
        for row in tx
            .open_table(BINDINGS)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, _) = row.map_err(dberr)?;
            defs.bindings.push(decode_binding(k.value())?);
        }
        Ok(defs)
    }

    /// Applies a change (durable at the next [`DefinitionStore::commit_durable`]).
    pub fn apply(&self, change: DefinitionChange<'_>) -> Result<(), DefinitionsError> {
        let mut tx = self.db.begin_write().map_err(dberr)?;
        tx.set_durability(Durability::None).map_err(dberr)?;
        {
            let mut exchanges = tx.open_table(EXCHANGES).map_err(dberr)?;
            let mut queues = tx.open_table(QUEUES).map_err(dberr)?;
            let mut bindings = tx.open_table(BINDINGS).map_err(dberr)?;
            let mut policies = tx.open_table(POLICIES).map_err(dberr)?;
            let mut drop_bindings =
                |pred: &dyn Fn(&Bind, bool) -> bool| -> Result<(), DefinitionsError> {
                    let mut doomed = Vec::new();
                    for row in bindings.iter().map_err(dberr)? {
                        let (k, _) = row.map_err(dberr)?;
                        let (b, to_x) = decode_binding(k.value())?;
                        if pred(&b, to_x) {
                            doomed.push(k.value().to_vec());
                        }
                    }
                    for k in doomed {
                        bindings.remove(k.as_slice()).map_err(dberr)?;
                    }
                    Ok(())
                };
            match change {
                DefinitionChange::ExchangeDeclared(d) => {
                    exchanges
                        .insert(d.exchange.as_str(), encode_exchange(d).as_slice())
                        .map_err(dberr)?;
                }
                DefinitionChange::ExchangeDeleted(name) => {
                    exchanges.remove(name).map_err(dberr)?;
                    drop_bindings(&|b, to_x| b.source == name || (to_x && b.destination == name))?;
                }
                DefinitionChange::QueueDeclared(d) => {
                    queues
                        .insert(d.queue.as_str(), encode_queue(d).as_slice())
                        .map_err(dberr)?;
                }
                DefinitionChange::QueueDeleted(name) => {
                    queues.remove(name).map_err(dberr)?;
                    drop_bindings(&|b, to_x| !to_x && b.destination == name)?;
                }
                DefinitionChange::Bound { bind, to_exchange } => {
                    bindings
                        .insert(encode_binding(bind, to_exchange).as_slice(), 1)
                        .map_err(dberr)?;
                }
                DefinitionChange::PolicySet(p) => {
                    policies
                        .insert(p.name.as_str(), encode_policy(p).as_slice())
                        .map_err(dberr)?;
                }
                DefinitionChange::PolicyCleared(name) => {
                    policies.remove(name).map_err(dberr)?;
                }
                DefinitionChange::Unbound { bind, to_exchange } => {
                    bindings
                        .remove(encode_binding(bind, to_exchange).as_slice())
                        .map_err(dberr)?;
                }
            }
        }
        tx.commit().map_err(dberr)
    }

    /// Every stored retained message, with its vhost.
    pub fn load_retained(
        &self,
    ) -> Result<Vec<(String, warren_core::mqtt::RetainedMessage)>, DefinitionsError> {
        let tx = self.db.begin_read().map_err(dberr)?;
        let mut out = Vec::new();
        for row in tx
            .open_table(RETAINED)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            let Some((vhost, _)) = crate::retained::split_key(k.value()) else {
                continue;
            };
            out.push((vhost, crate::retained::decode(v.value())?));
        }
        Ok(out)
    }

    /// Applies retained-message changes in order, in one durable commit.
    pub fn write_retained(
        &self,
        changes: &[(String, warren_core::mqtt::RetainedMessage)],
    ) -> Result<(), DefinitionsError> {
        let mut tx = self.db.begin_write().map_err(dberr)?;
        tx.set_durability(Durability::Immediate).map_err(dberr)?;
        {
            let mut table = tx.open_table(RETAINED).map_err(dberr)?;
            for (vhost, m) in changes {
                let key = crate::retained::key(vhost, &m.topic);
                if m.payload.is_empty() {
                    table.remove(key.as_slice()).map_err(dberr)?;
                } else {
                    table
                        .insert(key.as_slice(), crate::retained::encode(m).as_slice())
                        .map_err(dberr)?;
                }
            }
        }
        tx.commit().map_err(dberr)
    }

    /// Makes every change so far durable (one fsync'd commit).
    pub fn commit_durable(&self) -> Result<(), DefinitionsError> {
        let mut tx = self.db.begin_write().map_err(dberr)?;
        tx.set_durability(Durability::Immediate).map_err(dberr)?;
        tx.commit().map_err(dberr)
    }
}
