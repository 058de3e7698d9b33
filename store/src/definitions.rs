//! Durable definitions (vhosts, users, permissions, policies, exchanges, queues, bindings)
//! in redb. The broker's changes are written by the sync thread in the next sync's
//! `Durability::Immediate` commit (`crate::pending`; group commit, as for messages): a
//! declare costs no fsync of its own, and no wait on the broker task. Value encodings: docs/storage.md ("Definitions").

use crate::record::{DecodeError, Reader, Writer};
use bytes::Bytes;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::Path;
use std::sync::Arc;
use warren_core::access::{PermissionDef, TopicPermissionDef, UserDef, VhostDef};
use warren_core::command::{Bind, ExchangeDeclare, QueueDeclare};
use warren_core::parameter::ParameterDef;
use warren_core::policy::{ApplyTo, PolicyDef};
use warren_core::store::{DefinitionChange, Definitions};

/// Keys of exchanges, queues and policies: vhost NUL name (see [`scoped`]).
const EXCHANGES: TableDefinition<&str, &[u8]> = TableDefinition::new("exchanges");
const QUEUES: TableDefinition<&str, &[u8]> = TableDefinition::new("queues");
/// Key: the encoded binding, vhost first; value: unused (1).
const BINDINGS: TableDefinition<&[u8], u8> = TableDefinition::new("bindings");
const POLICIES: TableDefinition<&str, &[u8]> = TableDefinition::new("policies");
/// Runtime parameters: key vhost NUL component NUL name; value the JSON text (UTF-8). A
/// table added without a format version change (as topic permissions).
const PARAMETERS: TableDefinition<&str, &[u8]> = TableDefinition::new("parameters");
/// Key: vhost name; value: its description (UTF-8).
const VHOSTS: TableDefinition<&str, &[u8]> = TableDefinition::new("vhosts");
/// Key: user name; value: password hash and tags.
const USERS: TableDefinition<&str, &[u8]> = TableDefinition::new("users");
/// Key: vhost NUL user; value: the configure, write and read patterns.
const PERMISSIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("permissions");
/// Key: vhost NUL user NUL exchange; value: the write and read patterns (topic permissions;
/// a table added without a format version change: an older database has none, an older
/// Warren never opens it).
const TOPIC_PERMISSIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("topic_permissions");
/// MQTT retained messages (the core's `DefinitionChange::RetainedSet`/`RetainedCleared`):
/// key vhost NUL topic, value in `retained.rs`.
const RETAINED: TableDefinition<&[u8], &[u8]> = TableDefinition::new("retained");
/// MQTT sessions: key vhost NUL client id (see `sessions.rs`).
const MQTT_SESSIONS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("mqtt_sessions");
/// Format version of the values, under key "version".
const META: TableDefinition<&str, u32> = TableDefinition::new("meta");
/// 1: one vhost, keys were bare names. 2: keys scoped by vhost; vhosts, users, permissions.
const VERSION: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum DefinitionsError {
    #[error("definitions database: {0}")]
    Db(String),
    #[error("definitions database has format version {0}; this warren reads {VERSION}")]
    Version(u32),
    #[error("corrupt definition: {0}")]
    Decode(#[from] DecodeError),
    /// Another process holds the database open.
    #[error("definitions database: {0}")]
    Locked(String),
    /// redb panicked on what it read (a damaged file).
    #[error("definitions database is damaged (the database library failed on it: {0})")]
    Panicked(String),
}

impl DefinitionsError {
    /// Whether the database could not be opened because another process holds it.
    pub fn is_lock(&self) -> bool {
        matches!(self, DefinitionsError::Locked(_))
    }
}

fn dberr<E: std::fmt::Display>(e: E) -> DefinitionsError {
    DefinitionsError::Db(e.to_string())
}

/// Runs a call into redb on a file that may be damaged (see `guard`).
fn guarded<T>(f: impl FnOnce() -> Result<T, DefinitionsError>) -> Result<T, DefinitionsError> {
    crate::guard::catch_quietly(f).unwrap_or_else(|panic| Err(DefinitionsError::Panicked(panic)))
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

fn decode_policy(vhost: &str, name: &str, v: &[u8]) -> Result<PolicyDef, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let pattern = r.string()?;
    let apply_to = ApplyTo::parse(&r.string()?).unwrap_or_default();
    Ok(PolicyDef {
        vhost: vhost.to_string(),
        name: name.to_string(),
        pattern,
        apply_to,
        priority: r.u64()? as i64,
        definition: r.table(0)?,
    })
}

/// The key of an entity `name` of `vhost`: vhost NUL name (NUL cannot occur in a vhost name
/// that came through `warren ctl` or AMQP's connection.open as a usable name).
fn scoped(vhost: &str, name: &str) -> String {
    format!("{vhost}\0{name}")
}

/// The key of a runtime parameter: vhost NUL component NUL name.
fn parameter_key(vhost: &str, component: &str, name: &str) -> String {
    format!("{vhost}\0{component}\0{name}")
}

fn split_scoped(key: &str) -> Result<(&str, &str), DecodeError> {
    key.split_once('\0').ok_or(DecodeError::Truncated)
}

fn encode_binding(vhost: &str, b: &Bind, to_exchange: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.bytes(vhost.as_bytes());
    w.u8(u8::from(to_exchange));
    w.bytes(b.source.as_bytes());
    w.bytes(b.destination.as_bytes());
    w.bytes(b.routing_key.as_bytes());
    w.table(&b.arguments);
    out
}

fn decode_binding(v: &[u8]) -> Result<(String, Bind, bool), DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let vhost = r.string()?;
    let to_exchange = r.u8()? != 0;
    Ok((
        vhost,
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

fn encode_user(u: &UserDef) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.bytes(&u.password_hash);
    w.u32(u32::try_from(u.tags.len()).unwrap_or(u32::MAX));
    for t in &u.tags {
        w.bytes(t.as_bytes());
    }
    out
}

fn decode_user(name: &str, v: &[u8]) -> Result<UserDef, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let password_hash = r.bytes()?.to_vec();
    let n = r.u32()?;
    let mut tags = Vec::new();
    for _ in 0..n.min(1024) {
        tags.push(r.string()?);
    }
    Ok(UserDef {
        name: name.to_string(),
        password_hash,
        tags,
    })
}

fn encode_permission(p: &PermissionDef) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.bytes(p.configure.as_bytes());
    w.bytes(p.write.as_bytes());
    w.bytes(p.read.as_bytes());
    out
}

fn decode_permission(key: &str, v: &[u8]) -> Result<PermissionDef, DecodeError> {
    let (vhost, user) = split_scoped(key)?;
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    Ok(PermissionDef {
        vhost: vhost.to_string(),
        user: user.to_string(),
        configure: r.string()?,
        write: r.string()?,
        read: r.string()?,
    })
}

fn topic_key(vhost: &str, user: &str, exchange: &str) -> String {
    format!("{vhost}\0{user}\0{exchange}")
}

fn encode_topic_permission(p: &TopicPermissionDef) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.bytes(p.write.as_bytes());
    w.bytes(p.read.as_bytes());
    out
}

fn decode_topic_permission(key: &str, v: &[u8]) -> Result<TopicPermissionDef, DecodeError> {
    let mut parts = key.splitn(3, '\0');
    let (Some(vhost), Some(user), Some(exchange)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(DecodeError::Truncated);
    };
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    Ok(TopicPermissionDef {
        vhost: vhost.to_string(),
        user: user.to_string(),
        exchange: exchange.to_string(),
        write: r.string()?,
        read: r.string()?,
    })
}

/// Removes the topic permissions `pred` picks.
fn drop_topic_permissions(
    table: &mut redb::Table<'_, &'static str, &'static [u8]>,
    pred: &dyn Fn(&TopicPermissionDef) -> bool,
) -> Result<(), DefinitionsError> {
    let mut doomed = Vec::new();
    for row in table.iter().map_err(dberr)? {
        let (k, v) = row.map_err(dberr)?;
        if pred(&decode_topic_permission(k.value(), v.value())?) {
            doomed.push(k.value().to_string());
        }
    }
    for k in doomed {
        table.remove(k.as_str()).map_err(dberr)?;
    }
    Ok(())
}

/// Rewrites a version-1 database (one vhost, bare-name keys) into version 2: every
/// exchange, queue, policy and binding moves into vhost `/`.
fn migrate_v1(tx: &redb::WriteTransaction) -> Result<(), DefinitionsError> {
    for table in [EXCHANGES, QUEUES, POLICIES] {
        let mut t = tx.open_table(table).map_err(dberr)?;
        let mut rows = Vec::new();
        for row in t.iter().map_err(dberr)? {
            let (k, v) = row.map_err(dberr)?;
            rows.push((k.value().to_string(), v.value().to_vec()));
        }
        for (k, v) in rows {
            t.remove(k.as_str()).map_err(dberr)?;
            t.insert(scoped("/", &k).as_str(), v.as_slice())
                .map_err(dberr)?;
        }
    }
    let mut t = tx.open_table(BINDINGS).map_err(dberr)?;
    let mut keys = Vec::new();
    for row in t.iter().map_err(dberr)? {
        let (k, _) = row.map_err(dberr)?;
        keys.push(k.value().to_vec());
    }
    for k in keys {
        t.remove(k.as_slice()).map_err(dberr)?;
        // Version 1 keys are a version 2 key without the vhost in front.
        let mut v2 = Vec::with_capacity(k.len() + 5);
        Writer(&mut v2).bytes(b"/");
        v2.extend_from_slice(&k);
        t.insert(v2.as_slice(), 1).map_err(dberr)?;
    }
    Ok(())
}

impl DefinitionStore {
    /// Opens (creating if needed) the database at `path`. Never panics on a damaged file:
    /// every failure, a panic inside redb included, is an error.
    pub fn open(path: &Path) -> Result<DefinitionStore, DefinitionsError> {
        guarded(|| DefinitionStore::open_unguarded(path))
    }

    fn open_unguarded(path: &Path) -> Result<DefinitionStore, DefinitionsError> {
        let database = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => DefinitionsError::Locked(e.to_string()),
            e => dberr(e),
        })?;
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
                Some(1) => {
                    migrate_v1(&tx)?;
                    meta.insert("version", VERSION).map_err(dberr)?;
                    tracing::info!("definitions database migrated from format 1 to {VERSION}");
                }
                Some(v) => return Err(DefinitionsError::Version(v)),
            }
            tx.open_table(VHOSTS).map_err(dberr)?;
            tx.open_table(USERS).map_err(dberr)?;
            tx.open_table(PERMISSIONS).map_err(dberr)?;
            tx.open_table(TOPIC_PERMISSIONS).map_err(dberr)?;
            tx.open_table(EXCHANGES).map_err(dberr)?;
            tx.open_table(QUEUES).map_err(dberr)?;
            tx.open_table(BINDINGS).map_err(dberr)?;
            tx.open_table(POLICIES).map_err(dberr)?;
            tx.open_table(PARAMETERS).map_err(dberr)?;
            tx.open_table(RETAINED).map_err(dberr)?;
            tx.open_table(MQTT_SESSIONS).map_err(dberr)?;
        }
        tx.commit().map_err(dberr)?;
        Ok(store)
    }

    /// Everything stored, in replay order (a panic inside redb is an error).
    pub fn load(&self) -> Result<Definitions, DefinitionsError> {
        guarded(|| self.load_unguarded())
    }

    fn load_unguarded(&self) -> Result<Definitions, DefinitionsError> {
        let tx = self.db.begin_read().map_err(dberr)?;
        let mut defs = Definitions::default();
        for row in tx
            .open_table(VHOSTS)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            defs.vhosts.push(VhostDef {
                name: k.value().to_string(),
                description: String::from_utf8_lossy(v.value()).into_owned(),
            });
        }
        for row in tx.open_table(USERS).map_err(dberr)?.iter().map_err(dberr)? {
            let (k, v) = row.map_err(dberr)?;
            defs.users.push(decode_user(k.value(), v.value())?);
        }
        for row in tx
            .open_table(PERMISSIONS)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            defs.permissions
                .push(decode_permission(k.value(), v.value())?);
        }
        for row in tx
            .open_table(TOPIC_PERMISSIONS)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            defs.topic_permissions
                .push(decode_topic_permission(k.value(), v.value())?);
        }
        for row in tx
            .open_table(EXCHANGES)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            let (vhost, name) = split_scoped(k.value())?;
            defs.exchanges
                .push((vhost.to_string(), decode_exchange(name, v.value())?));
        }
        for row in tx
            .open_table(QUEUES)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            let (vhost, name) = split_scoped(k.value())?;
            defs.queues
                .push((vhost.to_string(), decode_queue(name, v.value())?));
        }
        for row in tx
            .open_table(POLICIES)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            let (vhost, name) = split_scoped(k.value())?;
            defs.policies.push(decode_policy(vhost, name, v.value())?);
        }
        for row in tx
            .open_table(PARAMETERS)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            let (vhost, rest) = split_scoped(k.value())?;
            let (component, name) = split_scoped(rest)?;
            defs.parameters.push(ParameterDef {
                component: component.to_string(),
                vhost: vhost.to_string(),
                name: name.to_string(),
                value: String::from_utf8(v.value().to_vec()).map_err(|_| DecodeError::Utf8)?,
            });
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
        for row in tx
            .open_table(RETAINED)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            // A key that is not vhost NUL topic in UTF-8 was never written by Warren.
            let Some((vhost, _)) = crate::retained::split_key(k.value()) else {
                continue;
            };
            defs.retained
                .push((vhost, crate::retained::decode(v.value())?));
        }
        Ok(defs)
    }

    /// Applies a change (durable at the next [`DefinitionStore::commit_durable`]).
    pub fn apply(&self, change: DefinitionChange<'_>) -> Result<(), DefinitionsError> {
        self.apply_all([change], Durability::None)
    }

    /// Applies the broker's changes of a sync, in order, in the one commit that makes them
    /// (and every change before them) durable (`crate::pending`).
    pub(crate) fn commit_changes(
        &self,
        changes: &[crate::pending::PendingChange],
    ) -> Result<(), DefinitionsError> {
        self.apply_all(
            changes.iter().map(crate::pending::PendingChange::as_change),
            Durability::Immediate,
        )
    }

    fn apply_all<'a>(
        &self,
        changes: impl IntoIterator<Item = DefinitionChange<'a>>,
        durability: Durability,
    ) -> Result<(), DefinitionsError> {
        let mut tx = self.db.begin_write().map_err(dberr)?;
        tx.set_durability(durability).map_err(dberr)?;
        {
            let mut exchanges = tx.open_table(EXCHANGES).map_err(dberr)?;
            let mut queues = tx.open_table(QUEUES).map_err(dberr)?;
            let mut bindings = tx.open_table(BINDINGS).map_err(dberr)?;
            let mut policies = tx.open_table(POLICIES).map_err(dberr)?;
            let mut parameters = tx.open_table(PARAMETERS).map_err(dberr)?;
            let mut vhosts = tx.open_table(VHOSTS).map_err(dberr)?;
            let mut users = tx.open_table(USERS).map_err(dberr)?;
            let mut permissions = tx.open_table(PERMISSIONS).map_err(dberr)?;
            let mut topic_permissions = tx.open_table(TOPIC_PERMISSIONS).map_err(dberr)?;
            let mut retained = tx.open_table(RETAINED).map_err(dberr)?;
            for change in changes {
                let mut drop_bindings =
                    |pred: &dyn Fn(&str, &Bind, bool) -> bool| -> Result<(), DefinitionsError> {
                        let mut doomed = Vec::new();
                        for row in bindings.iter().map_err(dberr)? {
                            let (k, _) = row.map_err(dberr)?;
                            let (v, b, to_x) = decode_binding(k.value())?;
                            if pred(&v, &b, to_x) {
                                doomed.push(k.value().to_vec());
                            }
                        }
                        for k in doomed {
                            bindings.remove(k.as_slice()).map_err(dberr)?;
                        }
                        Ok(())
                    };
                match change {
                    DefinitionChange::VhostAdded(v) => {
                        vhosts
                            .insert(v.name.as_str(), v.description.as_bytes())
                            .map_err(dberr)?;
                    }
                    DefinitionChange::VhostDeleted(name) => {
                        vhosts.remove(name).map_err(dberr)?;
                        drop_topic_permissions(&mut topic_permissions, &|p| p.vhost == name)?;
                    }
                    DefinitionChange::UserPut(u) => {
                        users
                            .insert(u.name.as_str(), encode_user(u).as_slice())
                            .map_err(dberr)?;
                    }
                    DefinitionChange::UserDeleted(name) => {
                        users.remove(name).map_err(dberr)?;
                        let mut doomed = Vec::new();
                        for row in permissions.iter().map_err(dberr)? {
                            let (k, _) = row.map_err(dberr)?;
                            if split_scoped(k.value()).is_ok_and(|(_, u)| u == name) {
                                doomed.push(k.value().to_string());
                            }
                        }
                        for k in doomed {
                            permissions.remove(k.as_str()).map_err(dberr)?;
                        }
                        drop_topic_permissions(&mut topic_permissions, &|p| p.user == name)?;
                    }
                    DefinitionChange::TopicPermissionSet(p) => {
                        topic_permissions
                            .insert(
                                topic_key(&p.vhost, &p.user, &p.exchange).as_str(),
                                encode_topic_permission(p).as_slice(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::TopicPermissionCleared {
                        vhost,
                        user,
                        exchange,
                    } => {
                        drop_topic_permissions(&mut topic_permissions, &|x| {
                            x.vhost == vhost
                                && x.user == user
                                && exchange.is_none_or(|e| e == x.exchange)
                        })?;
                    }
                    DefinitionChange::PermissionSet(p) => {
                        permissions
                            .insert(
                                scoped(&p.vhost, &p.user).as_str(),
                                encode_permission(p).as_slice(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::PermissionCleared { vhost, user } => {
                        permissions
                            .remove(scoped(vhost, user).as_str())
                            .map_err(dberr)?;
                    }
                    DefinitionChange::ExchangeDeclared { vhost, def } => {
                        exchanges
                            .insert(
                                scoped(vhost, &def.exchange).as_str(),
                                encode_exchange(def).as_slice(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::ExchangeDeleted { vhost, name } => {
                        exchanges
                            .remove(scoped(vhost, name).as_str())
                            .map_err(dberr)?;
                        drop_bindings(&|v, b, to_x| {
                            v == vhost && (b.source == name || (to_x && b.destination == name))
                        })?;
                    }
                    DefinitionChange::QueueDeclared { vhost, def } => {
                        queues
                            .insert(
                                scoped(vhost, &def.queue).as_str(),
                                encode_queue(def).as_slice(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::QueueDeleted { vhost, name } => {
                        queues.remove(scoped(vhost, name).as_str()).map_err(dberr)?;
                        drop_bindings(&|v, b, to_x| v == vhost && !to_x && b.destination == name)?;
                    }
                    DefinitionChange::Bound {
                        vhost,
                        bind,
                        to_exchange,
                    } => {
                        bindings
                            .insert(encode_binding(vhost, bind, to_exchange).as_slice(), 1)
                            .map_err(dberr)?;
                    }
                    DefinitionChange::PolicySet(p) => {
                        policies
                            .insert(
                                scoped(&p.vhost, &p.name).as_str(),
                                encode_policy(p).as_slice(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::PolicyCleared { vhost, name } => {
                        policies
                            .remove(scoped(vhost, name).as_str())
                            .map_err(dberr)?;
                    }
                    DefinitionChange::ParameterSet(p) => {
                        parameters
                            .insert(
                                parameter_key(&p.vhost, &p.component, &p.name).as_str(),
                                p.value.as_bytes(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::ParameterCleared {
                        vhost,
                        component,
                        name,
                    } => {
                        parameters
                            .remove(parameter_key(vhost, component, name).as_str())
                            .map_err(dberr)?;
                    }
                    DefinitionChange::Unbound {
                        vhost,
                        bind,
                        to_exchange,
                    } => {
                        bindings
                            .remove(encode_binding(vhost, bind, to_exchange).as_slice())
                            .map_err(dberr)?;
                    }
                    DefinitionChange::RetainedSet { vhost, message } => {
                        retained
                            .insert(
                                crate::retained::key(vhost, &message.topic).as_slice(),
                                crate::retained::encode(message).as_slice(),
                            )
                            .map_err(dberr)?;
                    }
                    DefinitionChange::RetainedCleared { vhost, topic } => {
                        retained
                            .remove(crate::retained::key(vhost, topic).as_slice())
                            .map_err(dberr)?;
                    }
                }
            }
        }
        tx.commit().map_err(dberr)
    }

    /// Every stored MQTT session: (vhost, client id, session).
    pub fn load_mqtt_sessions(
        &self,
    ) -> Result<Vec<(String, String, warren_core::mqtt::StoredSession)>, DefinitionsError> {
        guarded(|| self.load_mqtt_sessions_unguarded())
    }

    fn load_mqtt_sessions_unguarded(
        &self,
    ) -> Result<Vec<(String, String, warren_core::mqtt::StoredSession)>, DefinitionsError> {
        let tx = self.db.begin_read().map_err(dberr)?;
        let mut out = Vec::new();
        for row in tx
            .open_table(MQTT_SESSIONS)
            .map_err(dberr)?
            .iter()
            .map_err(dberr)?
        {
            let (k, v) = row.map_err(dberr)?;
            let Some((vhost, client_id)) = crate::retained::split_key(k.value()) else {
                continue;
            };
            out.push((vhost, client_id, crate::sessions::decode(v.value())?));
        }
        Ok(out)
    }

    /// Applies MQTT session changes in order, in one durable commit.
    pub fn write_mqtt(
        &self,
        changes: &[crate::retained::MqttChange],
    ) -> Result<(), DefinitionsError> {
        use crate::retained::MqttChange;
        let mut tx = self.db.begin_write().map_err(dberr)?;
        tx.set_durability(Durability::Immediate).map_err(dberr)?;
        {
            let mut sessions = tx.open_table(MQTT_SESSIONS).map_err(dberr)?;
            for change in changes {
                match change {
                    MqttChange::Session(vhost, client_id, session) => {
                        let key = crate::retained::key(vhost, client_id);
                        match session {
                            Some(s) => {
                                sessions
                                    .insert(key.as_slice(), crate::sessions::encode(s).as_slice())
                                    .map_err(dberr)?;
                            }
                            None => {
                                sessions.remove(key.as_slice()).map_err(dberr)?;
                            }
                        }
                    }
                }
            }
        }
        tx.commit().map_err(dberr)
    }

    /// A write transaction held by a test (another writer, as the sync thread's commit).
    #[cfg(test)]
    pub(crate) fn begin_write_for_test(&self) -> redb::WriteTransaction {
        self.db.begin_write().expect("begin a write transaction")
    }

    /// Makes every change so far durable (one fsync'd commit).
    pub fn commit_durable(&self) -> Result<(), DefinitionsError> {
        let mut tx = self.db.begin_write().map_err(dberr)?;
        tx.set_durability(Durability::Immediate).map_err(dberr)?;
        tx.commit().map_err(dberr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::message::FieldTable;

    fn temp_db(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("warren-defs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir.join("definitions.redb")
    }

    fn bind(source: &str, destination: &str) -> Bind {
        Bind {
            source: source.into(),
            destination: destination.into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: FieldTable::new(),
        }
    }

    /// Retained messages go through `apply` (the core's `Store::define`) into the
    /// `retained` table and come back with `load`; a row in the documented layout (as the
    /// gateway's writer wrote it before the core owned retained messages) is read as is.
    #[test]
    fn retained_messages_round_trip_and_the_documented_row_reads() {
        use warren_core::mqtt::RetainedMessage;
        let path = temp_db("retained");
        let store = DefinitionStore::open(&path).expect("open");
        let m = RetainedMessage {
            topic: Arc::from("a/b"),
            qos: 1,
            payload: Bytes::from_static(b"hi"),
            properties: Default::default(),
            stored_at: 7,
            expiry_ms: Some(60_000),
        };
        store
            .apply(DefinitionChange::RetainedSet {
                vhost: "/",
                message: &m,
            })
            .expect("set");
        store
            .apply(DefinitionChange::RetainedSet {
                vhost: "dev",
                message: &m,
            })
            .expect("set");
        store
            .apply(DefinitionChange::RetainedCleared {
                vhost: "dev",
                topic: "a/b",
            })
            .expect("clear");
        // A row written byte by byte as docs/storage.md describes it.
        let mut row = vec![2u8];
        row.extend_from_slice(&5u64.to_le_bytes());
        row.extend_from_slice(&u64::MAX.to_le_bytes());
        row.push(1); // message record version
        row.extend_from_slice(&0u32.to_le_bytes()); // exchange ""
        row.extend_from_slice(&3u32.to_le_bytes());
        row.extend_from_slice(b"c/d"); // routing key = topic
        row.extend_from_slice(&[0, 0, 0, 0, 0]); // content type/encoding, headers, mode, priority
        row.extend_from_slice(&[0, 0, 0, 0, 0]); // correlation id .. timestamp
        row.extend_from_slice(&[0, 0, 0, 0]); // type, user id, app id, cluster id
        row.push(1);
        row.extend_from_slice(&1u32.to_le_bytes());
        row.push(b'x');
        {
            let tx = store.db.begin_write().expect("tx");
            tx.open_table(RETAINED)
                .expect("table")
                .insert(b"/\0c/d".as_slice(), row.as_slice())
                .expect("insert");
            tx.commit().expect("commit");
        }
        let mut got = store.load().expect("load").retained;
        got.sort_by(|a, b| a.1.topic.cmp(&b.1.topic));
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0], ("/".to_string(), m));
        let old = &got[1].1;
        assert_eq!(
            (
                &*old.topic,
                old.qos,
                old.stored_at,
                old.expiry_ms,
                &old.payload[..]
            ),
            ("c/d", 2, 5, None, &b"x"[..])
        );
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    #[test]
    fn a_version_1_database_moves_into_vhost_slash() {
        let path = temp_db("v1");
        {
            // Written as format 1 did: bare names as keys, bindings without a vhost.
            let db = Database::create(&path).expect("create");
            let tx = db.begin_write().expect("tx");
            {
                tx.open_table(META)
                    .expect("meta")
                    .insert("version", 1)
                    .expect("version");
                let q = QueueDeclare {
                    queue: "orders".into(),
                    passive: false,
                    durable: true,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: FieldTable::new(),
                };
                tx.open_table(QUEUES)
                    .expect("queues")
                    .insert("orders", encode_queue(&q).as_slice())
                    .expect("queue");
                let x = ExchangeDeclare {
                    exchange: "ex".into(),
                    kind: "topic".into(),
                    passive: false,
                    durable: true,
                    auto_delete: false,
                    internal: false,
                    nowait: false,
                    arguments: FieldTable::new(),
                };
                tx.open_table(EXCHANGES)
                    .expect("exchanges")
                    .insert("ex", encode_exchange(&x).as_slice())
                    .expect("exchange");
                let v2 = encode_binding("/", &bind("ex", "orders"), false);
                // Format 1 is format 2 without the length-prefixed vhost in front.
                tx.open_table(BINDINGS)
                    .expect("bindings")
                    .insert(&v2[4 + 1..], 1)
                    .expect("binding");
            }
            tx.commit().expect("commit");
        }
        let store = DefinitionStore::open(&path).expect("migrates");
        let defs = store.load().expect("load");
        assert_eq!(defs.queues.len(), 1);
        assert_eq!(
            (defs.queues[0].0.as_str(), defs.queues[0].1.queue.as_str()),
            ("/", "orders")
        );
        assert_eq!(
            (
                defs.exchanges[0].0.as_str(),
                defs.exchanges[0].1.exchange.as_str()
            ),
            ("/", "ex")
        );
        assert_eq!(
            defs.bindings,
            vec![("/".into(), bind("ex", "orders"), false)]
        );
        assert!(defs.vhosts.is_empty() && defs.users.is_empty());
        drop(store);
        // Opening again finds format 2 and changes nothing.
        let again = DefinitionStore::open(&path)
            .expect("reopen")
            .load()
            .expect("load");
        assert_eq!(again, defs);
    }

    #[test]
    fn topic_permissions_round_trip_and_go_with_their_user_and_vhost() {
        let path = temp_db("topic-perms");
        let store = DefinitionStore::open(&path).expect("open");
        let tp = |user: &str, vhost: &str, exchange: &str| TopicPermissionDef {
            user: user.into(),
            vhost: vhost.into(),
            exchange: exchange.into(),
            write: "^{username}\\.".into(),
            read: "".into(),
        };
        for p in [
            tp("bob", "dev", "amq.topic"),
            tp("bob", "dev", "events"),
            tp("bob", "prod", "amq.topic"),
            tp("amy", "dev", "amq.topic"),
        ] {
            store
                .apply(DefinitionChange::TopicPermissionSet(&p))
                .expect("set");
        }
        // Replacing one keeps one record.
        let mut changed = tp("bob", "dev", "events");
        changed.read = "^x$".into();
        store
            .apply(DefinitionChange::TopicPermissionSet(&changed))
            .expect("set");
        drop(store);
        let store = DefinitionStore::open(&path).expect("reopen");
        let defs = store.load().expect("load");
        assert_eq!(defs.topic_permissions.len(), 4);
        assert!(defs.topic_permissions.contains(&changed));
        store
            .apply(DefinitionChange::TopicPermissionCleared {
                vhost: "dev",
                user: "bob",
                exchange: Some("events"),
            })
            .expect("clear one");
        assert_eq!(store.load().expect("load").topic_permissions.len(), 3);
        store
            .apply(DefinitionChange::VhostDeleted("prod"))
            .expect("vhost");
        store
            .apply(DefinitionChange::UserDeleted("amy"))
            .expect("user");
        assert_eq!(
            store.load().expect("load").topic_permissions,
            vec![tp("bob", "dev", "amq.topic")]
        );
        store
            .apply(DefinitionChange::TopicPermissionCleared {
                vhost: "dev",
                user: "bob",
                exchange: None,
            })
            .expect("clear all");
        assert!(store.load().expect("load").topic_permissions.is_empty());
    }

    #[test]
    fn vhosts_users_and_permissions_round_trip() {
        let path = temp_db("users");
        let store = DefinitionStore::open(&path).expect("open");
        let vhost = VhostDef {
            name: "dev".into(),
            description: "d".into(),
        };
        let user = UserDef {
            name: "bob".into(),
            password_hash: warren_core::access::hash_password([1, 2, 3, 4], "pw"),
            tags: vec!["monitoring".into()],
        };
        let perm = PermissionDef {
            user: "bob".into(),
            vhost: "dev".into(),
            configure: "^bob".into(),
            write: ".*".into(),
            read: "".into(),
        };
        store
            .apply(DefinitionChange::VhostAdded(&vhost))
            .expect("vhost");
        store.apply(DefinitionChange::UserPut(&user)).expect("user");
        store
            .apply(DefinitionChange::PermissionSet(&perm))
            .expect("perm");
        let b = bind("ex", "q");
        store
            .apply(DefinitionChange::Bound {
                vhost: "dev",
                bind: &b,
                to_exchange: false,
            })
            .expect("bind");
        let defs = store.load().expect("load");
        assert_eq!(defs.vhosts, vec![vhost]);
        assert_eq!(defs.users, vec![user]);
        assert_eq!(defs.permissions, vec![perm]);
        assert_eq!(defs.bindings, vec![("dev".into(), b.clone(), false)]);
        // A queue deleted in another vhost leaves dev's binding alone.
        store
            .apply(DefinitionChange::QueueDeleted {
                vhost: "/",
                name: "q",
            })
            .expect("delete");
        assert_eq!(store.load().expect("load").bindings.len(), 1);
        store
            .apply(DefinitionChange::UserDeleted("bob"))
            .expect("delete user");
        let defs = store.load().expect("load");
        assert!(defs.users.is_empty() && defs.permissions.is_empty());
    }
}
