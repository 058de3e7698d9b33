//! Users and permissions in the broker: login, the user and permission verbs of `warren ctl`,
//! and the check every operation makes before it touches a resource (403 ACCESS_REFUSED with
//! RabbitMQ's text when it may not).

use super::{Broker, OpResult};
use crate::access::TOPIC_PERMISSIONS;
use crate::access::{
    Login, LoginError, Perm, PermissionDef, Permissions, Resource, TopicPermissionDef, UserDef,
};
use crate::admin::AdminError;
use crate::command::OpKind;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelRef, ConnId};
use crate::store::DefinitionChange;
use std::sync::Arc;

impl Broker {
    /// Checks a user's password (and that `guest` comes from loopback) and, given a vhost,
    /// that the user has permissions there. Hosts call it when a client logs in, before
    /// `Op::ConnectionOpen`.
    pub fn authenticate(
        &self,
        user: &str,
        password: &str,
        from_loopback: bool,
        vhost: Option<&str>,
    ) -> Result<Login, LoginError> {
        let login = self
            .topo
            .users
            .authenticate(user, password, from_loopback)?;
        self.login_vhost(login, vhost)
    }

    /// As [`Broker::authenticate`] for a user the host has proven by other means (a verified
    /// TLS client certificate): no password checked.
    pub fn authenticate_certified(
        &self,
        user: &str,
        from_loopback: bool,
        vhost: Option<&str>,
    ) -> Result<Login, LoginError> {
        let login = self
            .topo
            .users
            .authenticate_certified(user, from_loopback)?;
        self.login_vhost(login, vhost)
    }

    pub(super) fn login_vhost(
        &self,
        mut login: Login,
        vhost: Option<&str>,
    ) -> Result<Login, LoginError> {
        let user = login.user.as_str();
        if let Some(vhost) = vhost {
            if self.vhost_id(vhost).is_none() {
                return Err(LoginError::NoSuchVhost(vhost.to_string()));
            }
            let Some(perms) = self.topo.users.permissions(vhost, user) else {
                return Err(LoginError::VhostRefused {
                    user: user.to_string(),
                    vhost: vhost.to_string(),
                });
            };
            login.permissions = Some(perms.clone());
        }
        Ok(login)
    }

    /// Adds or replaces a user (the password is already hashed: see
    /// [`crate::access::hash_password`]).
    pub fn put_user(&mut self, now: u64, user: UserDef) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        if user.name.is_empty() {
            return Err(AdminError::Invalid("a user name must not be empty".into()));
        }
        self.define(DefinitionChange::UserPut(&user));
        self.topo.users.put(user);
        Ok(())
    }

    /// Deletes a user with its permissions and closes its connections (320).
    pub fn delete_user(&mut self, now: u64, name: &str) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        if !self.topo.users.remove(name) {
            return Err(AdminError::NotFound(format!(
                "user '{name}' does not exist"
            )));
        }
        self.define(DefinitionChange::UserDeleted(name));
        let mut conns: Vec<ConnId> = self
            .chans
            .conns
            .iter()
            .filter(|(_, c)| c.perms.is_some() && c.user() == name)
            .map(|(id, _)| *id)
            .collect();
        conns.sort_unstable();
        for conn in conns {
            self.force_close(conn, format!("user '{name}' was deleted"));
        }
        self.after_op();
        Ok(())
    }

    /// A user, if it exists.
    pub fn user(&self, name: &str) -> Option<&UserDef> {
        self.topo.users.get(name)
    }

    /// Every user, by name.
    pub fn list_users(&self) -> Vec<UserDef> {
        self.topo.users.list().cloned().collect()
    }

    /// Sets a user's permissions in a vhost; they apply to its open connections at once.
    pub fn set_permissions(&mut self, now: u64, def: PermissionDef) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        if self.topo.users.get(&def.user).is_none() {
            return Err(AdminError::NotFound(format!(
                "user '{}' does not exist",
                def.user
            )));
        }
        let vhost = self
            .vhost_id(&def.vhost)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{}' does not exist", def.vhost)))?;
        let compiled = Permissions::compile(def)?;
        self.define(DefinitionChange::PermissionSet(&compiled.def));
        let user = compiled.def.user.clone();
        self.topo.users.set_permissions(compiled);
        self.refresh_permissions(vhost, &user);
        Ok(())
    }

    /// Removes a user's permissions in a vhost: its open connections there may do nothing
    /// more (RabbitMQ keeps them open too, refusing each operation).
    pub fn clear_permissions(
        &mut self,
        now: u64,
        vhost: &str,
        user: &str,
    ) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let id = self
            .vhost_id(vhost)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{vhost}' does not exist")))?;
        if !self.topo.users.clear_permissions(vhost, user) {
            return Err(AdminError::NotFound(format!(
                "user '{user}' has no permissions in vhost '{vhost}'"
            )));
        }
        self.define(DefinitionChange::PermissionCleared { vhost, user });
        self.refresh_permissions(id, user);
        Ok(())
    }

    /// Every (vhost, user) permission, by vhost then user.
    pub fn list_permissions(&self) -> Vec<PermissionDef> {
        self.topo.users.list_permissions().cloned().collect()
    }

    /// Sets a user's topic permissions on one exchange of a vhost (RabbitMQ's
    /// `set_topic_permissions`); they apply to its open connections at once.
    pub fn set_topic_permissions(
        &mut self,
        now: u64,
        def: TopicPermissionDef,
    ) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        if self.topo.users.get(&def.user).is_none() {
            return Err(AdminError::NotFound(format!(
                "user '{}' does not exist",
                def.user
            )));
        }
        let vhost = self
            .vhost_id(&def.vhost)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{}' does not exist", def.vhost)))?;
        if def.exchange.is_empty() {
            return Err(AdminError::Invalid(
                "an exchange name must not be empty".into(),
            ));
        }
        let user = def.user.clone();
        self.topo.users.set_topic_permissions(def.clone())?;
        self.define(DefinitionChange::TopicPermissionSet(&def));
        self.refresh_permissions(vhost, &user);
        Ok(())
    }

    /// Clears a user's topic permissions in a vhost, on `exchange` or (`None`) on every
    /// exchange, as RabbitMQ's `clear_topic_permissions`.
    pub fn clear_topic_permissions(
        &mut self,
        now: u64,
        vhost: &str,
        user: &str,
        exchange: Option<&str>,
    ) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let id = self
            .vhost_id(vhost)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{vhost}' does not exist")))?;
        if self.topo.users.get(user).is_none() {
            return Err(AdminError::NotFound(format!(
                "user '{user}' does not exist"
            )));
        }
        if self
            .topo
            .users
            .clear_topic_permissions(vhost, user, exchange)
        {
            self.define(DefinitionChange::TopicPermissionCleared {
                vhost,
                user,
                exchange,
            });
            self.refresh_permissions(id, user);
        }
        Ok(())
    }

    /// Every topic permission, by vhost, user, then exchange.
    pub fn list_topic_permissions(&self) -> Vec<TopicPermissionDef> {
        self.topo.users.list_topic_permissions().cloned().collect()
    }

    /// Expands `{client_id}` in topic permissions for connections that name their client id
    /// (`Op::ClientId`): hosts that serve MQTT call it once. Without it the placeholder is
    /// matched literally, and the regex compiler stays out of hosts that never set
    /// permissions (the JS package).
    pub fn expand_client_ids(&mut self) {
        self.topo.users.expand_client_ids();
    }

    /// Re-resolves the permissions of `user`'s connections in `vhost` after a change.
    pub(super) fn refresh_permissions(&mut self, vhost: crate::ids::VhostId, user: &str) {
        let name = self.vhost_name(vhost).to_string();
        let current = self
            .topo
            .users
            .permissions(&name, user)
            .cloned()
            .unwrap_or_else(|| Arc::new(Permissions::deny_all(&name, user)));
        let users = &self.topo.users;
        for conn in self.chans.conns.values_mut() {
            if conn.vhost == vhost && conn.user() == user && conn.perms.is_some() {
                conn.perms = Some(match &conn.client_id {
                    Some(id) => users.for_client(&current, id),
                    None => current.clone(),
                });
            }
        }
    }

    /// Whether the connection of `ch` may publish with (`Perm::Write`) or bind from
    /// (`Perm::Read`) routing key `key` on exchange `exchange` (a topic permission applies to
    /// topic exchanges only; none for the exchange allows everything): 403 with RabbitMQ's
    /// text when it may not.
    pub(super) fn check_topic_access(
        &self,
        ch: ChannelRef,
        op: OpKind,
        perm: Perm,
        exchange: &str,
        key: &str,
    ) -> OpResult {
        if !TOPIC_PERMISSIONS {
            return Ok(());
        }
        let Some(conn) = self.chans.conns.get(&ch.conn) else {
            return Ok(());
        };
        let Some(perms) = &conn.perms else {
            return Ok(());
        };
        if !perms.has_topic_permissions() {
            return Ok(());
        }
        let topic = self
            .find_exchange(conn.vhost, exchange)
            .is_some_and(|id| self.topo.routes().is_topic(id));
        // `{client_id}` was expanded when the connection's permissions were resolved.
        if !topic || perms.topic_allows(perm, exchange, key) {
            return Ok(());
        }
        Err(ProtocolError::new(
            ErrorCode::AccessRefused,
            op,
            format!(
                "{} access to topic '{key}' in exchange '{exchange}' in vhost '{}' refused for \
                 user '{}'",
                if perm == Perm::Write { "write" } else { "read" },
                self.vhost_name(conn.vhost),
                conn.user()
            ),
        ))
    }

    /// The permissions a client connection gets when it opens `vhost` as `user`, or why it
    /// may not open it (530 NOT_ALLOWED, as RabbitMQ).
    pub(super) fn vhost_access(
        &self,
        vhost: &str,
        user: &str,
    ) -> Result<Arc<Permissions>, ProtocolError> {
        self.topo
            .users
            .permissions(vhost, user)
            .cloned()
            .ok_or_else(|| {
                ProtocolError::new(
                    ErrorCode::NotAllowed,
                    OpKind::ConnectionOpen,
                    format!("access to vhost '{vhost}' refused for user '{user}'"),
                )
            })
    }

    /// Whether the connection of `ch` may `perm` the resource `name`; internal connections
    /// (restore, admin) may do anything.
    pub(super) fn check_access(
        &self,
        ch: ChannelRef,
        op: OpKind,
        perm: Perm,
        resource: Resource,
        name: &str,
    ) -> OpResult {
        let Some(conn) = self.chans.conns.get(&ch.conn) else {
            return Ok(());
        };
        let Some(perms) = &conn.perms else {
            return Ok(());
        };
        if perms.allows(perm, name) {
            return Ok(());
        }
        let shown = if name.is_empty() { "amq.default" } else { name };
        Err(ProtocolError::new(
            ErrorCode::AccessRefused,
            op,
            format!(
                "access to {} '{shown}' in vhost '{}' refused for user '{}'",
                resource.as_str(),
                self.vhost_name(conn.vhost),
                conn.user()
            ),
        ))
    }
}
