//! Definition changes waiting for the next sync. The broker task records a durable change
//! (`Store::define`) here, owned, and the sync thread writes every change of the epoch in
//! the one `Durability::Immediate` transaction that makes them durable
//! (`DefinitionStore::commit_changes`). The broker task never opens a redb write
//! transaction: redb has one writer at a time, and the sync thread's durable commit holds
//! it through its fsync, so a declare, bind or policy written on the broker task while a
//! sync ran used to wait for that fsync (with every connection of the shard): an MQTT 5 ms
//! SUBACK for a persistent session's SUBSCRIBE, 75-190 ms tails.

use warren_core::access::{PermissionDef, TopicPermissionDef, UserDef, VhostDef};
use warren_core::command::{Bind, ExchangeDeclare, QueueDeclare};
use warren_core::mqtt::RetainedMessage;
use warren_core::parameter::ParameterDef;
use warren_core::policy::PolicyDef;
use warren_core::store::DefinitionChange;

/// A `DefinitionChange` with what it borrows copied.
#[derive(Clone, Debug)]
pub(crate) enum PendingChange {
    VhostAdded(VhostDef),
    VhostDeleted(String),
    UserPut(UserDef),
    UserDeleted(String),
    PermissionSet(PermissionDef),
    PermissionCleared {
        vhost: String,
        user: String,
    },
    TopicPermissionSet(TopicPermissionDef),
    TopicPermissionCleared {
        vhost: String,
        user: String,
        exchange: Option<String>,
    },
    ExchangeDeclared {
        vhost: String,
        def: ExchangeDeclare,
    },
    ExchangeDeleted {
        vhost: String,
        name: String,
    },
    QueueDeclared {
        vhost: String,
        def: QueueDeclare,
    },
    QueueDeleted {
        vhost: String,
        name: String,
    },
    Bound {
        vhost: String,
        bind: Bind,
        to_exchange: bool,
    },
    Unbound {
        vhost: String,
        bind: Bind,
        to_exchange: bool,
    },
    PolicySet(PolicyDef),
    PolicyCleared {
        vhost: String,
        name: String,
    },
    ParameterSet(ParameterDef),
    ParameterCleared {
        vhost: String,
        component: String,
        name: String,
    },
    RetainedSet {
        vhost: String,
        // Boxed: a retained message is the largest change by far.
        message: Box<RetainedMessage>,
    },
    RetainedCleared {
        vhost: String,
        topic: String,
    },
}

impl PendingChange {
    pub(crate) fn new(change: &DefinitionChange<'_>) -> PendingChange {
        use DefinitionChange as C;
        use PendingChange as P;
        let s = |x: &str| x.to_string();
        match *change {
            C::VhostAdded(v) => P::VhostAdded(v.clone()),
            C::VhostDeleted(name) => P::VhostDeleted(s(name)),
            C::UserPut(u) => P::UserPut(u.clone()),
            C::UserDeleted(name) => P::UserDeleted(s(name)),
            C::PermissionSet(p) => P::PermissionSet(p.clone()),
            C::PermissionCleared { vhost, user } => P::PermissionCleared {
                vhost: s(vhost),
                user: s(user),
            },
            C::TopicPermissionSet(p) => P::TopicPermissionSet(p.clone()),
            C::TopicPermissionCleared {
                vhost,
                user,
                exchange,
            } => P::TopicPermissionCleared {
                vhost: s(vhost),
                user: s(user),
                exchange: exchange.map(s),
            },
            C::ExchangeDeclared { vhost, def } => P::ExchangeDeclared {
                vhost: s(vhost),
                def: def.clone(),
            },
            C::ExchangeDeleted { vhost, name } => P::ExchangeDeleted {
                vhost: s(vhost),
                name: s(name),
            },
            C::QueueDeclared { vhost, def } => P::QueueDeclared {
                vhost: s(vhost),
                def: def.clone(),
            },
            C::QueueDeleted { vhost, name } => P::QueueDeleted {
                vhost: s(vhost),
                name: s(name),
            },
            C::Bound {
                vhost,
                bind,
                to_exchange,
            } => P::Bound {
                vhost: s(vhost),
                bind: bind.clone(),
                to_exchange,
            },
            C::Unbound {
                vhost,
                bind,
                to_exchange,
            } => P::Unbound {
                vhost: s(vhost),
                bind: bind.clone(),
                to_exchange,
            },
            C::PolicySet(p) => P::PolicySet(p.clone()),
            C::PolicyCleared { vhost, name } => P::PolicyCleared {
                vhost: s(vhost),
                name: s(name),
            },
            C::ParameterSet(p) => P::ParameterSet(p.clone()),
            C::ParameterCleared {
                vhost,
                component,
                name,
            } => P::ParameterCleared {
                vhost: s(vhost),
                component: s(component),
                name: s(name),
            },
            C::RetainedSet { vhost, message } => P::RetainedSet {
                vhost: s(vhost),
                message: Box::new(message.clone()),
            },
            C::RetainedCleared { vhost, topic } => P::RetainedCleared {
                vhost: s(vhost),
                topic: s(topic),
            },
        }
    }

    pub(crate) fn as_change(&self) -> DefinitionChange<'_> {
        use DefinitionChange as C;
        use PendingChange as P;
        match self {
            P::VhostAdded(v) => C::VhostAdded(v),
            P::VhostDeleted(name) => C::VhostDeleted(name),
            P::UserPut(u) => C::UserPut(u),
            P::UserDeleted(name) => C::UserDeleted(name),
            P::PermissionSet(p) => C::PermissionSet(p),
            P::PermissionCleared { vhost, user } => C::PermissionCleared { vhost, user },
            P::TopicPermissionSet(p) => C::TopicPermissionSet(p),
            P::TopicPermissionCleared {
                vhost,
                user,
                exchange,
            } => C::TopicPermissionCleared {
                vhost,
                user,
                exchange: exchange.as_deref(),
            },
            P::ExchangeDeclared { vhost, def } => C::ExchangeDeclared { vhost, def },
            P::ExchangeDeleted { vhost, name } => C::ExchangeDeleted { vhost, name },
            P::QueueDeclared { vhost, def } => C::QueueDeclared { vhost, def },
            P::QueueDeleted { vhost, name } => C::QueueDeleted { vhost, name },
            P::Bound {
                vhost,
                bind,
                to_exchange,
            } => C::Bound {
                vhost,
                bind,
                to_exchange: *to_exchange,
            },
            P::Unbound {
                vhost,
                bind,
                to_exchange,
            } => C::Unbound {
                vhost,
                bind,
                to_exchange: *to_exchange,
            },
            P::PolicySet(p) => C::PolicySet(p),
            P::PolicyCleared { vhost, name } => C::PolicyCleared { vhost, name },
            P::ParameterSet(p) => C::ParameterSet(p),
            P::ParameterCleared {
                vhost,
                component,
                name,
            } => C::ParameterCleared {
                vhost,
                component,
                name,
            },
            P::RetainedSet { vhost, message } => C::RetainedSet { vhost, message },
            P::RetainedCleared { vhost, topic } => C::RetainedCleared { vhost, topic },
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{DiskConfig, DiskStore};
    use std::time::{Duration, Instant};
    use warren_core::command::Bind;
    use warren_core::message::FieldTable;
    use warren_core::store::{DefinitionChange, Store};

    /// A durable bind recorded while another redb writer (the sync thread's fsync'd
    /// commit, the MQTT session writer) holds the write transaction returns at once: it
    /// waited for that writer before (here 1.5 s), and with it the shard's every
    /// connection. Made durable by the next sync, and restored after a reopen.
    #[test]
    fn a_definition_change_never_waits_for_another_redb_writer() {
        let dir = std::env::temp_dir().join(format!("warren-pending-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (synced_tx, synced) = std::sync::mpsc::channel();
        let on_synced = Box::new(move |epoch: u64, r: Result<(), crate::SyncError>| {
            let _ = synced_tx.send((epoch, r));
        });
        let (mut store, _) = DiskStore::open(&dir, DiskConfig::default(), on_synced).expect("open");
        let defs = store.definitions();
        let (held_tx, held) = std::sync::mpsc::channel();
        let writer = std::thread::spawn(move || {
            let tx = defs.begin_write_for_test();
            held_tx.send(()).expect("main thread waits");
            std::thread::sleep(Duration::from_millis(1500));
            drop(tx);
        });
        held.recv().expect("the writer holds the transaction");
        let bind = Bind {
            destination: "q".into(),
            source: "amq.topic".into(),
            routing_key: "a.b".into(),
            nowait: false,
            arguments: FieldTable::new(),
        };
        let started = Instant::now();
        store
            .define(DefinitionChange::Bound {
                vhost: "/",
                bind: &bind,
                to_exchange: false,
            })
            .expect("define");
        let took = started.elapsed();
        assert!(took < Duration::from_millis(500), "define waited {took:?}");
        writer.join().expect("writer");
        store.sync(1);
        let (epoch, result) = synced
            .recv_timeout(Duration::from_secs(10))
            .expect("synced");
        assert_eq!(epoch, 1);
        assert!(result.is_ok(), "{result:?}");
        drop(store);
        let (_, loaded) =
            DiskStore::open(&dir, DiskConfig::default(), Box::new(|_, _| {})).expect("reopen");
        assert_eq!(loaded.bindings, vec![("/".to_string(), bind, false)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
