//! Vhosts: creating one (with its predeclared exchanges), deleting one (closing its
//! connections and deleting everything in it), and the defaults a new broker starts with
//! (vhost `/`, user `guest` or the configured default user with full permissions there, as
//! a fresh RabbitMQ node).

use super::Broker;
use crate::access::{PermissionDef, UserDef, VhostDef};
use crate::admin::AdminError;
use crate::command::OpKind;
use crate::effect::Effect;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ConnId, ExchangeId, QueueId, VhostId};
use crate::store::DefinitionChange;
use std::sync::Arc;

impl Broker {
    /// The default vhost and user, in memory (a store gets them from [`Broker::restore`]
    /// when it holds none yet).
    pub(super) fn create_defaults(&mut self) {
        let name = self.config.default_vhost.clone();
        self.topo.default_vhost = self.insert_vhost(VhostDef {
            name: name.clone(),
            description: "Default virtual host".into(),
        });
        let user = self.config.default_user.clone();
        self.topo.users.put(UserDef {
            name: user.clone(),
            password_hash: self.config.default_pass_hash.clone(),
            tags: vec!["administrator".into()],
        });
        self.topo
            .users
            .set_permissions(crate::access::Permissions::full(&name, &user));
    }

    /// Writes the in-memory defaults to the store (a fresh data directory).
    pub(super) fn store_defaults(&mut self) {
        let vhosts: Vec<VhostDef> = self.list_vhosts();
        for v in &vhosts {
            self.define(DefinitionChange::VhostAdded(v));
        }
        let users: Vec<UserDef> = self.topo.users.list().cloned().collect();
        for u in &users {
            self.define(DefinitionChange::UserPut(u));
        }
        let perms: Vec<PermissionDef> = self.topo.users.list_permissions().cloned().collect();
        for p in &perms {
            self.define(DefinitionChange::PermissionSet(p));
        }
    }

    pub(super) fn insert_vhost(&mut self, def: VhostDef) -> VhostId {
        // From a counter of their own: every shard applies the same vhost changes in the
        // same order, so a vhost has one id on every shard.
        self.next_vhost += 1;
        let id = VhostId(self.next_vhost);
        let next_id = &mut self.next_id;
        self.topo.insert_vhost(id, def, || {
            let n = *next_id;
            *next_id += 1;
            n
        });
        id
    }

    /// The id of a vhost by name.
    pub(super) fn vhost_id(&self, name: &str) -> Option<VhostId> {
        self.topo.vhost_id(name)
    }

    /// Creates a vhost; an existing one is left as it is (as `rabbitmqctl add_vhost` on an
    /// existing name, which is idempotent).
    pub fn add_vhost(&mut self, now: u64, def: VhostDef) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        if def.name.is_empty() {
            return Err(AdminError::Invalid("a vhost name must not be empty".into()));
        }
        if self.topo.vhost_id(&def.name).is_some() {
            return Ok(());
        }
        self.define(DefinitionChange::VhostAdded(&def));
        self.insert_vhost(def);
        Ok(())
    }

    /// Deletes a vhost: its connections are closed (320), its queues with their messages,
    /// its exchanges, policies and permissions are gone.
    pub fn delete_vhost(&mut self, now: u64, name: &str) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let id = self
            .vhost_id(name)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{name}' does not exist")))?;
        let mut conns: Vec<ConnId> = self
            .chans
            .conns
            .iter()
            .filter(|(c, conn)| conn.vhost == id && **c != crate::mail::mailbox::RESTORE_CONN)
            .map(|(c, _)| *c)
            .collect();
        conns.sort_unstable();
        for conn in conns {
            self.force_close(conn, format!("vhost '{name}' is deleted"));
        }
        if self
            .chans
            .conns
            .get(&crate::mail::mailbox::RESTORE_CONN)
            .is_some_and(|c| c.vhost == id)
        {
            self.release_connection(crate::mail::mailbox::RESTORE_CONN);
        }
        let mut queues: Vec<QueueId> = self
            .qs
            .queues
            .iter()
            .filter(|(_, q)| q.vhost == id)
            .map(|(q, _)| *q)
            .collect();
        queues.sort_unstable();
        for q in queues {
            self.delete_queue(q);
        }
        let mut exchanges: Vec<ExchangeId> = self
            .topo
            .exchanges()
            .filter(|(_, x)| x.vhost == id)
            .map(|(x, _)| x)
            .collect();
        exchanges.sort_unstable();
        for x in exchanges {
            self.delete_exchange(x);
        }
        let retained: Vec<(Arc<str>, bool)> = self
            .topo
            .retained_mut(id)
            .map(|r| r.topics().map(|(t, d)| (t.clone(), d)).collect())
            .unwrap_or_default();
        self.forget_retained(name, &retained);
        let (policies, parameters) = self.topo.remove_vhost(id);
        for p in policies {
            self.define(DefinitionChange::PolicyCleared {
                vhost: name,
                name: &p,
            });
        }
        for (component, p) in parameters {
            self.define(DefinitionChange::ParameterCleared {
                vhost: name,
                component: &component,
                name: &p,
            });
        }
        self.define(DefinitionChange::VhostDeleted(name));
        self.after_op();
        Ok(())
    }

    /// Every vhost, by name.
    pub fn list_vhosts(&self) -> Vec<VhostDef> {
        self.topo.list_vhosts()
    }

    /// Closes a connection from the broker's side with CONNECTION_FORCED.
    pub(super) fn force_close(&mut self, conn: ConnId, reason: String) {
        if !self.chans.conns.contains_key(&conn) {
            return;
        }
        self.release_connection(conn);
        self.effects.push(Effect::ConnectionError {
            conn,
            error: ProtocolError::new(ErrorCode::ConnectionForced, OpKind::ConnectionOpen, reason),
        });
    }
}
