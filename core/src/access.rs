//! Users, vhosts' permissions and password hashes, as RabbitMQ's internal auth backend keeps
//! them: a user has a salted SHA-256 password hash (`rabbit_password_hashing_sha256`: 4 random
//! salt bytes, then `SHA-256(salt ++ utf8(password))`, so hashes exported by RabbitMQ import
//! unchanged) and tags; per vhost, three regular expressions say which resources it may
//! configure (declare, delete), write (publish to, bind to) and read (consume, get, purge,
//! bind from).
//!
//! The default exchange is named `amq.default` when matched against a permission, as in
//! RabbitMQ.

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;

/// `guest`'s password hash in a new broker: the one a fresh RabbitMQ 3.10 node exported
/// (salt `27 56 70 43`). Its password is public anyway, so a fixed salt loses nothing, and
/// a new broker then needs no SHA-256 (hosts that never log users in leave it out).
pub const DEFAULT_GUEST_HASH: [u8; 36] = [
    0x27, 0x56, 0x70, 0x43, 0x7b, 0xc1, 0x13, 0x71, 0xfe, 0xdf, 0x40, 0x69, 0x0f, 0x0d, 0xcc, 0x53,
    0xd8, 0xa3, 0xca, 0xcf, 0x1a, 0xb2, 0x8c, 0x5c, 0x98, 0x2e, 0xcf, 0x70, 0x6b, 0x09, 0xa9, 0xe2,
    0xd7, 0xce, 0x5b, 0x73,
];

/// The hashing algorithm name RabbitMQ writes into definitions.
pub const HASHING_ALGORITHM: &str = "rabbit_password_hashing_sha256";

/// A user as operators define it and stores keep it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserDef {
    /// The user's name.
    pub name: String,
    /// Salt (4 bytes) followed by the SHA-256 digest; empty: no password login (as a
    /// RabbitMQ user created without a password).
    pub password_hash: Vec<u8>,
    /// Management tags (`administrator`, `monitoring`, ...), as RabbitMQ's.
    pub tags: Vec<String>,
}

/// A user's permissions in one vhost, as regular expressions over resource names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermissionDef {
    /// The user they apply to.
    pub user: String,
    /// The vhost they apply in.
    pub vhost: String,
    /// Regex of the resources the user may declare and delete.
    pub configure: String,
    /// Regex of the resources the user may publish to (and bind from).
    pub write: String,
    /// Regex of the resources the user may consume from (and bind to).
    pub read: String,
}

/// A user's topic permissions on one topic exchange of a vhost (RabbitMQ's
/// `set_topic_permissions`): regular expressions over routing keys, `write` checked against
/// the routing key of a publish, `read` against the binding key of a bind from the exchange
/// (and an MQTT subscription's filter). `{username}`, `{vhost}` and, for MQTT connections,
/// `{client_id}` in them are replaced by the connection's own (regex-escaped), as RabbitMQ's
/// `expand_topic_permission`. No topic permission for an exchange: everything is allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicPermissionDef {
    /// The user they apply to.
    pub user: String,
    /// The vhost they apply in.
    pub vhost: String,
    /// The topic exchange they apply to.
    pub exchange: String,
    /// Regex of the routing keys the user may publish with (`""`: only the empty key).
    pub write: String,
    /// Regex of the binding keys the user may bind (subscribe) with.
    pub read: String,
}

/// A vhost as operators define it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VhostDef {
    /// The vhost's name.
    pub name: String,
    /// Free text for operators.
    pub description: String,
}

/// The kind of access an operation needs on a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Perm {
    /// Declare, delete (and bind, for the destination's side).
    Configure,
    /// Publish to, bind from.
    Write,
    /// Consume, get, purge, bind to.
    Read,
}

/// The kind of resource a permission is checked on (for the error text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    /// An exchange.
    Exchange,
    /// A queue.
    Queue,
}

impl Resource {
    /// RabbitMQ's name of the permission (`configure`, `write`, `read`).
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::Exchange => "exchange",
            Resource::Queue => "queue",
        }
    }
}

/// `SHA-256(salt ++ password)` prefixed with `salt`: RabbitMQ's stored form.
pub fn hash_password(salt: [u8; 4], password: &str) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut out = salt.to_vec();
    out.extend_from_slice(&h.finalize());
    out
}

/// Whether `password` matches a stored hash. An empty or malformed hash matches nothing.
pub fn verify_password(hash: &[u8], password: &str) -> bool {
    if hash.len() != 4 + 32 {
        return false;
    }
    let mut salt = [0u8; 4];
    salt.copy_from_slice(&hash[..4]);
    let expected = hash_password(salt, password);
    // Constant time: a timing side channel must not reveal how much of the digest matched.
    expected
        .iter()
        .zip(hash)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

/// One compiled permission regex. `.*` (the common case) short-cuts the match; `""` matches
/// nothing, as in RabbitMQ.
#[derive(Clone, Debug)]
enum Pattern {
    All,
    Nothing,
    Regex(regex_lite::Regex),
}

impl Pattern {
    fn compile(s: &str) -> Result<Pattern, String> {
        Ok(match s {
            ".*" | "^.*$" | "^.*" => Pattern::All,
            "" => Pattern::Nothing,
            // Anchored as RabbitMQ's `re:run` with `anchored`-free semantics: a match anywhere
            // counts, so operators write `^...$` themselves.
            s => Pattern::Regex(
                regex_lite::Regex::new(s)
                    .map_err(|e| format!("invalid regular expression '{s}': {e}"))?,
            ),
        })
    }

    fn is_match(&self, name: &str) -> bool {
        match self {
            Pattern::All => true,
            Pattern::Nothing => false,
            Pattern::Regex(r) => r.is_match(name),
        }
    }
}

/// One topic permission regex: compiled once with `{username}` and `{vhost}` expanded;
/// one that names `{client_id}` is kept as text too and compiled once per connection that
/// names its client (MQTT: [`Permissions::for_client`]); RabbitMQ expands it per check.
#[derive(Clone, Debug)]
struct TopicPattern {
    /// With `{client_id}` left as literal text (no client id: an AMQP connection, for which
    /// RabbitMQ leaves the placeholder in the regex, where PCRE reads it literally).
    fixed: Pattern,
    /// The expanded text still holding `{client_id}`, when it does.
    per_client: Option<String>,
}

const CLIENT_ID: &str = "{client_id}";

/// Topic permissions are checked (cargo feature `topic-permissions`, on by default, off in the
/// wasm builds, whose hosts set no permissions: the checks were ~3 KB of a JS module at its
/// size gate). Without it they are kept and listed but never attached to a connection.
pub(crate) const TOPIC_PERMISSIONS: bool = cfg!(feature = "topic-permissions");

impl TopicPattern {
    fn compile(s: &str, user: &str, vhost: &str) -> Result<TopicPattern, String> {
        // RabbitMQ: an empty topic permission is `^$` (only the empty routing key).
        let s = if s.is_empty() { "^$" } else { s };
        let expanded = s
            .replace("{username}", &regex_lite::escape(user))
            .replace("{vhost}", &regex_lite::escape(vhost));
        let per_client = expanded.contains(CLIENT_ID).then(|| expanded.clone());
        let fixed = Pattern::compile(&expanded.replace(CLIENT_ID, "\\{client_id\\}"))?;
        Ok(TopicPattern { fixed, per_client })
    }

    /// This pattern with `{client_id}` expanded to `id`, compiled once (for a connection's
    /// life, rather than per check).
    fn for_client(&self, id: &str) -> TopicPattern {
        match &self.per_client {
            None => self.clone(),
            Some(text) => TopicPattern {
                // Compiled before with a placeholder in the same place: a failure here is
                // not expected, and refuses everything.
                fixed: Pattern::compile(&text.replace(CLIENT_ID, &regex_lite::escape(id)))
                    .unwrap_or(Pattern::Nothing),
                per_client: None,
            },
        }
    }

    /// `{client_id}`, if the pattern names it, is matched literally unless the pattern was
    /// made for one client ([`TopicPattern::for_client`]).
    fn is_match(&self, key: &str) -> bool {
        self.fixed.is_match(key)
    }
}

/// The compiled topic permissions of one user in one vhost, by exchange.
#[derive(Clone, Debug)]
pub struct TopicPermissions {
    rules: Vec<(TopicPermissionDef, TopicPattern, TopicPattern)>,
}

impl TopicPermissions {
    /// Compiles `defs` (one user's in one vhost); an error names the regex that does not
    /// compile.
    pub fn compile(defs: Vec<TopicPermissionDef>) -> Result<TopicPermissions, String> {
        let mut rules = Vec::with_capacity(defs.len());
        for d in defs {
            let write = TopicPattern::compile(&d.write, &d.user, &d.vhost)?;
            let read = TopicPattern::compile(&d.read, &d.user, &d.vhost)?;
            rules.push((d, write, read));
        }
        Ok(TopicPermissions { rules })
    }

    /// Whether some pattern names `{client_id}`.
    fn per_client(&self) -> bool {
        self.rules
            .iter()
            .any(|(_, w, r)| w.per_client.is_some() || r.per_client.is_some())
    }

    /// These permissions for the connection of client `id`: the patterns that name
    /// `{client_id}` compiled with it (escaped).
    pub fn for_client(&self, id: &str) -> TopicPermissions {
        TopicPermissions {
            rules: self
                .rules
                .iter()
                .map(|(d, w, r)| (d.clone(), w.for_client(id), r.for_client(id)))
                .collect(),
        }
    }

    /// Whether `perm` (write: publish, read: bind or subscribe) is allowed with `key` on
    /// `exchange` (a topic exchange).
    pub fn allows(&self, perm: Perm, exchange: &str, key: &str) -> bool {
        let Some((_, write, read)) = self.rules.iter().find(|(d, _, _)| d.exchange == exchange)
        else {
            return true;
        };
        match perm {
            Perm::Write => write.is_match(key),
            Perm::Read => read.is_match(key),
            Perm::Configure => true,
        }
    }
}

/// A user's compiled permissions in one vhost (equal when their definitions are).
#[derive(Clone, Debug)]
pub struct Permissions {
    /// The permissions as defined.
    pub def: PermissionDef,
    configure: Pattern,
    write: Pattern,
    read: Pattern,
    /// The user's topic permissions in the vhost, if any (kept here so a connection's
    /// permissions, refreshed on every change, carry them).
    topics: Option<Arc<TopicPermissions>>,
}

impl PartialEq for Permissions {
    fn eq(&self, other: &Permissions) -> bool {
        self.def == other.def
            && self
                .topics
                .as_ref()
                .map(|t| t.rules.iter().map(|r| &r.0).collect::<Vec<_>>())
                == other
                    .topics
                    .as_ref()
                    .map(|t| t.rules.iter().map(|r| &r.0).collect())
    }
}

impl Eq for Permissions {}

impl Permissions {
    /// Compiles the regexes of `def`; an error names the one that does not compile.
    pub fn compile(def: PermissionDef) -> Result<Permissions, String> {
        Ok(Permissions {
            configure: Pattern::compile(&def.configure)?,
            write: Pattern::compile(&def.write)?,
            read: Pattern::compile(&def.read)?,
            def,
            topics: None,
        })
    }

    /// Whether the user may publish with (`Perm::Write`) or bind from (`Perm::Read`) routing
    /// key `key` on the topic exchange `exchange` (true when no topic permission names it).
    pub fn topic_allows(&self, perm: Perm, exchange: &str, key: &str) -> bool {
        self.topics
            .as_ref()
            .is_none_or(|t| t.allows(perm, exchange, key))
    }

    /// These permissions for the connection of client `id` (MQTT's client identifier): the
    /// topic patterns that name `{client_id}` compiled with it once, so a check compiles
    /// nothing. The same `Arc` when none does.
    pub fn for_client(self: &Arc<Self>, id: &str) -> Arc<Permissions> {
        match &self.topics {
            Some(t) if t.per_client() => {
                let mut p = Permissions::clone(self);
                p.topics = Some(Arc::new(t.for_client(id)));
                Arc::new(p)
            }
            _ => self.clone(),
        }
    }

    /// Whether any topic permission applies (so the exchange's type must be looked at).
    pub fn has_topic_permissions(&self) -> bool {
        self.topics.is_some()
    }

    /// Everything (`.*` for configure, write and read), as the default user has on the
    /// default vhost. Built without the regex compiler, which hosts that never set
    /// permissions (the JS package) then leave out of their binary.
    pub fn full(vhost: &str, user: &str) -> Permissions {
        Permissions {
            def: PermissionDef {
                user: user.to_string(),
                vhost: vhost.to_string(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            },
            configure: Pattern::All,
            write: Pattern::All,
            read: Pattern::All,
            topics: None,
        }
    }

    /// No access at all (permissions cleared while connections are open).
    pub fn deny_all(vhost: &str, user: &str) -> Permissions {
        Permissions {
            def: PermissionDef {
                user: user.to_string(),
                vhost: vhost.to_string(),
                configure: String::new(),
                write: String::new(),
                read: String::new(),
            },
            configure: Pattern::Nothing,
            write: Pattern::Nothing,
            read: Pattern::Nothing,
            topics: None,
        }
    }

    /// Whether `perm` is granted on the resource `name` (`""` is the default exchange).
    pub fn allows(&self, perm: Perm, name: &str) -> bool {
        let name = if name.is_empty() { "amq.default" } else { name };
        match perm {
            Perm::Configure => self.configure.is_match(name),
            Perm::Write => self.write.is_match(name),
            Perm::Read => self.read.is_match(name),
        }
    }
}

/// Why a login was refused. The text goes to the broker's log, never to the client (RabbitMQ
/// tells clients only "login refused").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoginError {
    /// No user of that name.
    #[error("user '{0}' does not exist")]
    NoSuchUser(String),
    /// The password does not match the stored hash.
    #[error("wrong password for user '{0}'")]
    WrongPassword(String),
    #[error(
        "user '{0}' can only connect via localhost (as RabbitMQ's loopback_users; create \
         another user with `warren ctl add_user` for remote clients)"
    )]
    /// The user may connect from loopback only (`guest`).
    LoopbackOnly(String),
    /// The login named a vhost that does not exist.
    #[error("vhost '{0}' not found")]
    NoSuchVhost(String),
    /// The user has no permissions in the vhost.
    #[error("access to vhost '{vhost}' refused for user '{user}'")]
    VhostRefused {
        /// The user.
        user: String,
        /// The vhost.
        vhost: String,
    },
}

/// A successful login: who, their tags, and (when the login named a vhost) their permissions
/// there as of the login, for gateways that answer refusals in their own protocol's terms
/// (MQTT's SUBACK failure codes) before the core would refuse the operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Login {
    /// The user's name.
    pub user: String,
    /// Its management tags.
    pub tags: Vec<String>,
    /// Its permissions in the vhost the login named, if it named one.
    pub permissions: Option<Arc<Permissions>>,
}

/// Makes a user's permissions for one client id ([`Permissions::for_client`]).
type ClientExpander = fn(&Arc<Permissions>, &str) -> Arc<Permissions>;

/// The user database: users and, per (vhost, user), permissions.
#[derive(Default)]
pub struct Users {
    users: BTreeMap<String, UserDef>,
    /// Keyed by (vhost, user).
    permissions: BTreeMap<(String, String), Arc<Permissions>>,
    /// Topic permissions, compiled, keyed by (vhost, user), one rule per exchange: what
    /// [`Users::set_permissions`] attaches.
    topics: BTreeMap<(String, String), Arc<TopicPermissions>>,
    /// Specialises permissions for a client id ([`Permissions::for_client`]), installed by
    /// hosts that serve MQTT (`Broker::expand_client_ids`): it compiles regexes, which hosts
    /// that never set permissions (the JS package) then leave out of their binary. Without
    /// it `{client_id}` is matched literally, as for an AMQP connection.
    client_expander: Option<ClientExpander>,
    /// Users that may only log in from loopback (RabbitMQ's `loopback_users`, default guest).
    loopback_only: Vec<String>,
}

impl Users {
    /// No users.
    pub fn new() -> Users {
        Users {
            loopback_only: vec!["guest".to_string()],
            ..Users::default()
        }
    }

    /// Checks a password (RabbitMQ's salted SHA-256; `None`: the host proved the
    /// identity) and the loopback rule.
    pub fn authenticate(
        &self,
        user: &str,
        password: &str,
        from_loopback: bool,
    ) -> Result<Login, LoginError> {
        self.login(user, Some(password), from_loopback)
    }

    /// Logs in a user whose identity the host has already proven (a verified TLS client
    /// certificate: AMQP EXTERNAL, MQTT `use_identity_as_username`): the user must exist and
    /// the loopback rule holds, but no password is checked.
    pub fn authenticate_certified(
        &self,
        user: &str,
        from_loopback: bool,
    ) -> Result<Login, LoginError> {
        self.login(user, None, from_loopback)
    }

    fn login(
        &self,
        user: &str,
        password: Option<&str>,
        from_loopback: bool,
    ) -> Result<Login, LoginError> {
        let u = self
            .users
            .get(user)
            .ok_or_else(|| LoginError::NoSuchUser(user.to_string()))?;
        if let Some(password) = password
            && !verify_password(&u.password_hash, password)
        {
            return Err(LoginError::WrongPassword(user.to_string()));
        }
        if !from_loopback && self.loopback_only.iter().any(|l| l == user) {
            return Err(LoginError::LoopbackOnly(user.to_string()));
        }
        Ok(Login {
            user: user.to_string(),
            tags: u.tags.clone(),
            permissions: None,
        })
    }

    /// The user named `user`.
    pub fn get(&self, user: &str) -> Option<&UserDef> {
        self.users.get(user)
    }

    /// Adds or replaces a user.
    pub fn put(&mut self, user: UserDef) {
        self.users.insert(user.name.clone(), user);
    }

    /// Removes the user and its permissions; whether it existed.
    pub fn remove(&mut self, user: &str) -> bool {
        self.permissions.retain(|(_, u), _| u != user);
        self.topics.retain(|(_, u), _| u != user);
        self.users.remove(user).is_some()
    }

    /// Every user, by name.
    pub fn list(&self) -> impl Iterator<Item = &UserDef> {
        self.users.values()
    }

    /// The user's permissions in `vhost`.
    pub fn permissions(&self, vhost: &str, user: &str) -> Option<&Arc<Permissions>> {
        self.permissions.get(&(vhost.to_string(), user.to_string()))
    }

    /// Sets a user's permissions in a vhost (replacing any).
    pub fn set_permissions(&mut self, mut p: Permissions) {
        let key = (p.def.vhost.clone(), p.def.user.clone());
        if TOPIC_PERMISSIONS {
            p.topics = self.topics.get(&key).cloned();
        }
        self.permissions.insert(key, Arc::new(p));
    }

    /// Expands `{client_id}` in topic permissions from now on ([`Users::for_client`]).
    pub fn expand_client_ids(&mut self) {
        self.client_expander = Some(Permissions::for_client);
    }

    /// `p` for the connection of client `id` (the same when `{client_id}` is not expanded
    /// or not used).
    pub fn for_client(&self, p: &Arc<Permissions>, id: &str) -> Arc<Permissions> {
        match self.client_expander {
            Some(f) => f(p, id),
            None => p.clone(),
        }
    }

    /// Sets a user's topic permissions on one exchange of a vhost (replacing any); an error
    /// names a regex that does not compile.
    pub fn set_topic_permissions(&mut self, def: TopicPermissionDef) -> Result<(), String> {
        // Checked with a client id too: the text compiled per connection must compile.
        let probe = TopicPermissions::compile(vec![def.clone()])?;
        for (_, w, r) in &probe.rules {
            for p in [w, r] {
                if let Some(text) = &p.per_client {
                    regex_lite::Regex::new(&text.replace(CLIENT_ID, "x"))
                        .map_err(|e| format!("invalid regular expression '{text}': {e}"))?;
                }
            }
        }
        let (vhost, user) = (def.vhost.clone(), def.user.clone());
        let mut defs = self.topic_defs(&vhost, &user);
        defs.retain(|d| d.exchange != def.exchange);
        defs.push(def);
        defs.sort_by(|a, b| a.exchange.cmp(&b.exchange));
        self.rebuild_topics(&vhost, &user, defs);
        Ok(())
    }

    /// Clears a user's topic permissions in a vhost, on one exchange or (`None`) all;
    /// whether there were any.
    pub fn clear_topic_permissions(
        &mut self,
        vhost: &str,
        user: &str,
        exchange: Option<&str>,
    ) -> bool {
        let mut defs = self.topic_defs(vhost, user);
        let before = defs.len();
        defs.retain(|d| exchange.is_some_and(|e| e != d.exchange));
        let cleared = defs.len() != before;
        if cleared {
            self.rebuild_topics(vhost, user, defs);
        }
        cleared
    }

    /// The (vhost, user) topic permissions as defined.
    fn topic_defs(&self, vhost: &str, user: &str) -> Vec<TopicPermissionDef> {
        self.topics
            .get(&(vhost.to_string(), user.to_string()))
            .map(|t| t.rules.iter().map(|r| r.0.clone()).collect())
            .unwrap_or_default()
    }

    /// Every topic permission, by vhost, user, then exchange.
    pub fn list_topic_permissions(&self) -> impl Iterator<Item = &TopicPermissionDef> {
        self.topics
            .values()
            .flat_map(|t| t.rules.iter().map(|r| &r.0))
    }

    /// Compiles `defs` (the (vhost, user) topic permissions) and attaches them to the user's
    /// permissions there.
    fn rebuild_topics(&mut self, vhost: &str, user: &str, defs: Vec<TopicPermissionDef>) {
        let key = (vhost.to_string(), user.to_string());
        // Each was compiled when set.
        let compiled = if defs.is_empty() {
            None
        } else {
            TopicPermissions::compile(defs).ok().map(Arc::new)
        };
        match &compiled {
            Some(t) => self.topics.insert(key.clone(), t.clone()),
            None => self.topics.remove(&key),
        };
        if TOPIC_PERMISSIONS && let Some(p) = self.permissions.get_mut(&key) {
            let mut p2 = Permissions::clone(p);
            p2.topics = compiled;
            *p = Arc::new(p2);
        }
    }

    /// Whether there were permissions to clear.
    pub fn clear_permissions(&mut self, vhost: &str, user: &str) -> bool {
        self.permissions
            .remove(&(vhost.to_string(), user.to_string()))
            .is_some()
    }

    /// Drops every permission in a deleted vhost.
    pub fn forget_vhost(&mut self, vhost: &str) {
        self.permissions.retain(|(v, _), _| v != vhost);
        self.topics.retain(|(v, _), _| v != vhost);
    }

    /// Every permission definition, by vhost then user.
    pub fn list_permissions(&self) -> impl Iterator<Item = &PermissionDef> {
        self.permissions.values().map(|p| &p.def)
    }

    /// Forgets everything (before a restore replaces it).
    pub fn clear(&mut self) {
        self.users.clear();
        self.permissions.clear();
        self.topics.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rabbitmq_exported_hash_verifies() {
        // guest/guest as RabbitMQ 3.10.8 exported it (tests/fixtures): base64 of salt + digest.
        let hash = DEFAULT_GUEST_HASH;
        assert!(verify_password(&hash, "guest"));
        assert!(!verify_password(&hash, "guesT"));
        assert!(!verify_password(&hash[..35], "guest"));
    }

    #[test]
    fn hash_round_trip_and_login_rules() {
        let mut users = Users::new();
        users.put(UserDef {
            name: "guest".into(),
            password_hash: hash_password([1, 2, 3, 4], "guest"),
            tags: vec!["administrator".into()],
        });
        users.put(UserDef {
            name: "bob".into(),
            password_hash: hash_password([9, 9, 9, 9], "s3cret"),
            tags: vec![],
        });
        assert!(users.authenticate("guest", "guest", true).is_ok());
        assert_eq!(
            users.authenticate("guest", "guest", false),
            Err(LoginError::LoopbackOnly("guest".into()))
        );
        assert!(users.authenticate("bob", "s3cret", false).is_ok());
        // A certificate proves who bob is; an unknown name and guest from afar stay refused.
        assert!(users.authenticate_certified("bob", false).is_ok());
        assert!(matches!(
            users.authenticate_certified("mallory", true),
            Err(LoginError::NoSuchUser(_))
        ));
        assert!(matches!(
            users.authenticate_certified("guest", false),
            Err(LoginError::LoopbackOnly(_))
        ));
        assert_eq!(
            users.authenticate("bob", "nope", true),
            Err(LoginError::WrongPassword("bob".into()))
        );
        assert_eq!(
            users.authenticate("eve", "x", true),
            Err(LoginError::NoSuchUser("eve".into()))
        );
    }

    #[test]
    fn topic_permissions_expand_variables_and_read_empty_as_only_the_empty_key() {
        let mut users = Users::new();
        users.put(UserDef {
            name: "a.b".into(),
            password_hash: vec![],
            tags: vec![],
        });
        users.set_permissions(Permissions::full("/", "a.b"));
        let tp = |exchange: &str, write: &str, read: &str| TopicPermissionDef {
            user: "a.b".into(),
            vhost: "/".into(),
            exchange: exchange.into(),
            write: write.into(),
            read: read.into(),
        };
        users
            .set_topic_permissions(tp("amq.topic", "^{username}\\.{client_id}$", ""))
            .expect("valid");
        // Set after the permissions, seen through them (what connections hold).
        let p = users.permissions("/", "a.b").expect("set").clone();
        assert!(p.has_topic_permissions());
        // `{username}` is escaped: its dot is no wildcard.
        assert!(
            p.for_client("dev1")
                .topic_allows(Perm::Write, "amq.topic", "a.b.dev1")
        );
        assert!(
            !p.for_client("dev1")
                .topic_allows(Perm::Write, "amq.topic", "aXb.dev1")
        );
        assert!(
            !p.for_client("dev1")
                .topic_allows(Perm::Write, "amq.topic", "a.b.dev2")
        );
        // No client id (AMQP): the placeholder stays, literal, as PCRE reads it in RabbitMQ.
        assert!(!p.topic_allows(Perm::Write, "amq.topic", "a.b.dev1"));
        assert!(p.topic_allows(Perm::Write, "amq.topic", "a.b.{client_id}"));
        // An empty pattern allows only the empty key.
        assert!(!p.topic_allows(Perm::Read, "amq.topic", "x"));
        assert!(p.topic_allows(Perm::Read, "amq.topic", ""));
        // Another exchange has none: anything goes.
        assert!(p.topic_allows(Perm::Write, "other", "x"));
        // A client id with regex characters is matched literally.
        users
            .set_topic_permissions(tp("amq.topic", "^{client_id}$", ".*"))
            .expect("valid");
        let p = users.permissions("/", "a.b").expect("set").clone();
        let mine = p.for_client("c+1");
        assert!(mine.topic_allows(Perm::Write, "amq.topic", "c+1"));
        assert!(!mine.topic_allows(Perm::Write, "amq.topic", "cc1"));
        // Without the expander installed, Users leaves the placeholder literal.
        assert!(Arc::ptr_eq(&users.for_client(&p, "c+1"), &p));
        users.expand_client_ids();
        let mine = users.for_client(&p, "c+1");
        assert!(mine.topic_allows(Perm::Write, "amq.topic", "c+1"));
        assert!(users.set_topic_permissions(tp("x", "(", "")).is_err());
        assert!(
            users
                .set_topic_permissions(tp("x", "{client_id}(", ""))
                .is_err()
        );
        // Permissions set again keep the topic permissions; clearing drops them.
        users.set_permissions(Permissions::full("/", "a.b"));
        assert!(
            users
                .permissions("/", "a.b")
                .expect("set")
                .has_topic_permissions()
        );
        assert!(users.clear_topic_permissions("/", "a.b", None));
        assert!(
            !users
                .permissions("/", "a.b")
                .expect("set")
                .has_topic_permissions()
        );
        assert!(!users.clear_topic_permissions("/", "a.b", None));
    }

    #[test]
    fn permission_patterns() {
        let p = Permissions::compile(PermissionDef {
            user: "bob".into(),
            vhost: "/".into(),
            configure: "^bob-.*".into(),
            write: ".*".into(),
            read: "".into(),
        })
        .expect("valid");
        assert!(p.allows(Perm::Configure, "bob-q"));
        assert!(!p.allows(Perm::Configure, "alice-q"));
        assert!(p.allows(Perm::Write, ""));
        assert!(!p.allows(Perm::Read, "bob-q"));
        let d = Permissions::compile(PermissionDef {
            user: "u".into(),
            vhost: "/".into(),
            configure: "^amq\\.default$".into(),
            write: "(".into(),
            read: ".*".into(),
        });
        assert!(d.is_err());
    }
}
