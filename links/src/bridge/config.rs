//! A `[[bridge]]` table of `warren.toml`: Mosquitto's `connection` block (mosquitto.conf(5),
//! "Configuring Bridges") with its key names, defaults and topic lines, checked when the file
//! is read. A key Warren does not serve (TLS-PSK, `start_type` other than `automatic`, ...)
//! is refused with a message naming it, never ignored: serde's `deny_unknown_fields` for
//! unknown keys, [`Raw`]'s checks for known ones.

use serde::de::{self, IgnoredAny};
use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// Which way a topic line moves messages (Mosquitto's `in`, `out`, `both`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Local subscription, published to the remote broker.
    Out,
    /// Remote subscription, published to the local broker.
    In,
    /// Both.
    Both,
}

impl Direction {
    /// Whether it moves messages out (local to remote).
    pub fn out(self) -> bool {
        matches!(self, Direction::Out | Direction::Both)
    }

    /// Whether it moves messages in (remote to local).
    pub fn inward(self) -> bool {
        matches!(self, Direction::In | Direction::Both)
    }
}

/// One `topic` line: `PATTERN [in|out|both [QOS [LOCAL_PREFIX REMOTE_PREFIX]]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicLine {
    /// The pattern, `None` for Mosquitto's `""` (then both prefixes are the topics).
    pub pattern: Option<String>,
    pub direction: Direction,
    /// The subscription's QoS (0 or 1; 2 is refused, see docs/bridges.md).
    pub qos: u8,
    /// Prepended on the local side (Mosquitto: `None` for `""`).
    pub local_prefix: Option<String>,
    /// Prepended on the remote side.
    pub remote_prefix: Option<String>,
}

/// A bad topic line, with Mosquitto's rule it breaks.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopicError {
    #[error("empty topic line")]
    Empty,
    #[error("topic line {0:?}: direction must be in, out or both, not {1:?}")]
    Direction(String, String),
    #[error("topic line {0:?}: QoS must be 0 or 1, not {1:?} (QoS 2 bridges are not built)")]
    Qos(String, String),
    #[error("topic line {0:?}: give both prefixes or neither (\"\" is an empty one)")]
    OnePrefix(String),
    #[error("topic line {0:?}: too many fields (PATTERN DIRECTION QOS LOCAL_PREFIX REMOTE_PREFIX)")]
    TooMany(String),
    #[error("topic line {0:?}: an empty pattern (\"\") needs a local and a remote prefix")]
    EmptyPattern(String),
    #[error("topic line {0:?}: prefix {1:?} must not contain + or #")]
    WildPrefix(String, String),
    #[error("topic line {0:?}: {1:?} is not a valid topic filter")]
    Filter(String, String),
}

/// Mosquitto's `""` place marker: empty.
fn field(s: &str) -> Option<String> {
    (s != "\"\"" && !s.is_empty()).then(|| s.to_string())
}

/// Whether `f` is a valid MQTT topic filter (`#` last and alone in its level, `+` alone),
/// by the broker's own check.
pub fn valid_filter(f: &str) -> bool {
    warren_core::mqtt::topic::validate_filter(f).is_ok()
}

impl TopicLine {
    /// Parses a line as Mosquitto does (`topic` keyword left out): the direction defaults to
    /// `out`, the QoS to 0.
    pub fn parse(line: &str) -> Result<TopicLine, TopicError> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let err_line = || line.trim().to_string();
        let Some(first) = fields.first() else {
            return Err(TopicError::Empty);
        };
        if fields.len() > 5 {
            return Err(TopicError::TooMany(err_line()));
        }
        let direction = match fields.get(1).copied() {
            None | Some("out") => Direction::Out,
            Some("in") => Direction::In,
            Some("both") => Direction::Both,
            Some(d) => return Err(TopicError::Direction(err_line(), d.into())),
        };
        let qos = match fields.get(2).copied() {
            None | Some("0") => 0,
            Some("1") => 1,
            Some(q) => return Err(TopicError::Qos(err_line(), q.into())),
        };
        if fields.len() == 4 {
            return Err(TopicError::OnePrefix(err_line()));
        }
        let pattern = field(first);
        let (local_prefix, remote_prefix) = if fields.len() == 5 {
            (field(fields[3]), field(fields[4]))
        } else {
            (None, None)
        };
        for p in [&local_prefix, &remote_prefix].into_iter().flatten() {
            if p.contains(['+', '#']) || p.contains('\0') {
                return Err(TopicError::WildPrefix(err_line(), p.clone()));
            }
        }
        if pattern.is_none() && (local_prefix.is_none() || remote_prefix.is_none()) {
            return Err(TopicError::EmptyPattern(err_line()));
        }
        let t = TopicLine {
            pattern,
            direction,
            qos,
            local_prefix,
            remote_prefix,
        };
        for f in [t.local_topic(), t.remote_topic()] {
            if !valid_filter(&f) {
                return Err(TopicError::Filter(err_line(), f));
            }
        }
        Ok(t)
    }

    /// The filter on the local broker: local prefix + pattern.
    pub fn local_topic(&self) -> String {
        format!(
            "{}{}",
            self.local_prefix.as_deref().unwrap_or(""),
            self.pattern.as_deref().unwrap_or("")
        )
    }

    /// The filter on the remote broker: remote prefix + pattern.
    pub fn remote_topic(&self) -> String {
        format!(
            "{}{}",
            self.remote_prefix.as_deref().unwrap_or(""),
            self.pattern.as_deref().unwrap_or("")
        )
    }
}

impl<'de> Deserialize<'de> for TopicLine {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TopicLine, D::Error> {
        let s = String::deserialize(d)?;
        TopicLine::parse(&s).map_err(de::Error::custom)
    }
}

/// The MQTT version spoken to the remote broker (`bridge_protocol_version`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    V311,
    V5,
}

/// `restart_timeout`: Mosquitto's constant wait, or decorrelated jitter from base to cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    Constant(Duration),
    Jitter { base: Duration, cap: Duration },
}

/// One remote address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// `host`, `host:port`, `[v6]:port` (Mosquitto's default port 1883).
pub fn parse_address(s: &str) -> Result<Address, String> {
    let bad = || format!("address {s:?}: expected HOST or HOST:PORT ([V6]:PORT)");
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        match after.strip_prefix(':') {
            Some(p) => (h, Some(p)),
            None if after.is_empty() => (h, None),
            None => return Err(bad()),
        }
    } else if s.matches(':').count() > 1 {
        (s, None)
    } else {
        match s.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    let port = match port {
        None => 1883,
        Some(p) => p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(bad)?,
    };
    Ok(Address {
        host: host.to_string(),
        port,
    })
}

/// A bridge, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BridgeConfig {
    pub name: String,
    pub addresses: Vec<Address>,
    pub round_robin: bool,
    pub topics: Vec<TopicLine>,
    /// `None`: Mosquitto's default, `HOSTNAME.NAME` ([`BridgeConfig::remote_clientid`]).
    pub remote_clientid: Option<String>,
    pub remote_username: Option<String>,
    pub remote_password: Option<String>,
    /// `None`: `local.` + the remote client id.
    pub local_clientid: Option<String>,
    pub local_username: Option<String>,
    pub local_password: Option<String>,
    pub cleansession: bool,
    pub local_cleansession: bool,
    pub keepalive: Duration,
    pub restart: Restart,
    pub protocol: Protocol,
    pub notifications: bool,
    pub notifications_local_only: bool,
    /// `None`: `$SYS/broker/connection/<remote_clientid>/state`.
    pub notification_topic: Option<String>,
    /// Largest packet either end sends or takes (`bridge_max_packet_size`, 0: MQTT's limit).
    pub max_packet_size: u32,
    /// TLS to the remote broker (`bridge_cafile` or `bridge_capath` given).
    pub tls: Option<super::tls::TlsSettings>,
}

/// MQTT's largest packet (a 4-byte remaining length).
pub const MQTT_MAX_PACKET: u32 = 268_435_455;

impl BridgeConfig {
    /// The remote client id: the configured one, or Mosquitto's `HOSTNAME.NAME`.
    pub fn remote_clientid(&self, hostname: &str) -> String {
        self.remote_clientid
            .clone()
            .unwrap_or_else(|| format!("{hostname}.{}", self.name))
    }

    /// The local client id: the configured one, or Mosquitto's `local.<remote_clientid>`.
    pub fn local_clientid(&self, hostname: &str) -> String {
        self.local_clientid
            .clone()
            .unwrap_or_else(|| format!("local.{}", self.remote_clientid(hostname)))
    }

    /// The notification topic (Mosquitto's `notification_topic` default).
    pub fn notification_topic(&self, hostname: &str) -> String {
        self.notification_topic.clone().unwrap_or_else(|| {
            format!(
                "$SYS/broker/connection/{}/state",
                self.remote_clientid(hostname)
            )
        })
    }
}

/// A string or a list of strings (Mosquitto's `address a b` is one line).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `restart_timeout = 20`, `= [10, 30]` or `= "10 30"`.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawRestart {
    Secs(u64),
    Pair(Vec<u64>),
    Text(String),
}

/// The table as written; [`BridgeConfig`] is it checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    name: String,
    #[serde(alias = "addresses")]
    address: Option<OneOrMany>,
    #[serde(default)]
    round_robin: bool,
    #[serde(default)]
    topic: Vec<TopicLine>,
    #[serde(alias = "clientid")]
    remote_clientid: Option<String>,
    #[serde(alias = "username")]
    remote_username: Option<String>,
    #[serde(alias = "password")]
    remote_password: Option<String>,
    local_clientid: Option<String>,
    local_username: Option<String>,
    local_password: Option<String>,
    cleansession: Option<bool>,
    local_cleansession: Option<bool>,
    keepalive_interval: Option<u64>,
    restart_timeout: Option<RawRestart>,
    #[serde(alias = "bridge_protocol_version")]
    protocol_version: Option<String>,
    notifications: Option<bool>,
    notifications_local_only: Option<bool>,
    notification_topic: Option<String>,
    bridge_max_packet_size: Option<u32>,
    start_type: Option<String>,
    try_private: Option<bool>,
    bridge_cafile: Option<std::path::PathBuf>,
    bridge_capath: Option<std::path::PathBuf>,
    bridge_certfile: Option<std::path::PathBuf>,
    bridge_keyfile: Option<std::path::PathBuf>,
    bridge_insecure: Option<bool>,
    bridge_tls_version: Option<String>,
    bridge_alpn: Option<String>,
    // Known to Mosquitto, not served yet: refused by name below.
    bridge_identity: Option<IgnoredAny>,
    bridge_psk: Option<IgnoredAny>,
    bridge_require_ocsp: Option<IgnoredAny>,
    bridge_bind_address: Option<IgnoredAny>,
    bridge_attempt_unsubscribe: Option<IgnoredAny>,
    bridge_outgoing_retain: Option<IgnoredAny>,
    idle_timeout: Option<IgnoredAny>,
    threshold: Option<IgnoredAny>,
}

impl Raw {
    fn check(self) -> Result<BridgeConfig, String> {
        let name = self.name;
        let unsupported = [
            ("bridge_identity", self.bridge_identity.is_some()),
            ("bridge_psk", self.bridge_psk.is_some()),
            ("bridge_require_ocsp", self.bridge_require_ocsp.is_some()),
        ];
        if let Some((key, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(format!(
                "bridge {name:?}: {key}: TLS-PSK and OCSP are not supported (docs/bridges.md); \
                 use bridge_cafile with certificates"
            ));
        }
        let tls = tls_settings(
            &name,
            self.bridge_cafile,
            self.bridge_capath,
            self.bridge_certfile,
            self.bridge_keyfile,
            self.bridge_insecure,
            self.bridge_tls_version,
            self.bridge_alpn,
        )?;
        for (key, set) in [
            ("bridge_bind_address", self.bridge_bind_address.is_some()),
            (
                "bridge_attempt_unsubscribe",
                self.bridge_attempt_unsubscribe.is_some(),
            ),
            (
                "bridge_outgoing_retain",
                self.bridge_outgoing_retain.is_some(),
            ),
            ("idle_timeout", self.idle_timeout.is_some()),
            ("threshold", self.threshold.is_some()),
        ] {
            if set {
                return Err(format!(
                    "bridge {name:?}: {key} is not supported yet (docs/bridges.md); remove it"
                ));
            }
        }
        if name.is_empty() || name.contains(['/', '+', '#', '\0']) || name.len() > 64 {
            return Err(format!(
                "bridge name {name:?}: must be 1 to 64 characters without /, + or #"
            ));
        }
        let addresses: Vec<String> = match self.address {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => s.split_whitespace().map(str::to_string).collect(),
            Some(OneOrMany::Many(v)) => v,
        };
        if addresses.is_empty() {
            return Err(format!(
                "bridge {name:?}: address: at least one remote address is needed"
            ));
        }
        if addresses.len() > 64 {
            return Err(format!("bridge {name:?}: address: at most 64 addresses"));
        }
        let addresses = addresses
            .iter()
            .map(|a| parse_address(a).map_err(|e| format!("bridge {name:?}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        if self.topic.is_empty() {
            return Err(format!(
                "bridge {name:?}: topic: at least one topic line is needed (\"PATTERN in|out|both QOS\")"
            ));
        }
        if self.topic.len() > 1024 {
            return Err(format!("bridge {name:?}: topic: at most 1024 lines"));
        }
        let keepalive = self.keepalive_interval.unwrap_or(60);
        if !(5..=65_535).contains(&keepalive) {
            return Err(format!(
                "bridge {name:?}: keepalive_interval {keepalive}: must be 5 to 65535 seconds"
            ));
        }
        let secs = |s: u64, what: &str| {
            if (1..=86_400).contains(&s) {
                Ok(Duration::from_secs(s))
            } else {
                Err(format!(
                    "bridge {name:?}: restart_timeout {what} {s}: must be 1 to 86400 seconds"
                ))
            }
        };
        let restart = match self.restart_timeout {
            None => Restart::Jitter {
                base: Duration::from_secs(5),
                cap: Duration::from_secs(30),
            },
            Some(r) => {
                let parts: Vec<u64> = match r {
                    RawRestart::Secs(s) => vec![s],
                    RawRestart::Pair(v) => v,
                    RawRestart::Text(t) => t
                        .split_whitespace()
                        .map(|p| p.parse::<u64>())
                        .collect::<Result<_, _>>()
                        .map_err(|_| {
                            format!("bridge {name:?}: restart_timeout {t:?}: expected \"SECONDS\" or \"BASE CAP\"")
                        })?,
                };
                match parts[..] {
                    [s] => Restart::Constant(secs(s, "")?),
                    [b, c] if b <= c => Restart::Jitter {
                        base: secs(b, "base")?,
                        cap: secs(c, "cap")?,
                    },
                    _ => {
                        return Err(format!(
                            "bridge {name:?}: restart_timeout: expected SECONDS or [BASE, CAP] with BASE <= CAP"
                        ));
                    }
                }
            }
        };
        let protocol = match self.protocol_version.as_deref() {
            None | Some("mqttv311") => Protocol::V311,
            Some("mqttv50") => Protocol::V5,
            Some(other) => {
                return Err(format!(
                    "bridge {name:?}: protocol_version {other:?}: expected \"mqttv311\" or \"mqttv50\" (mqttv31 is not supported)"
                ));
            }
        };
        match self.start_type.as_deref() {
            None | Some("automatic") => {}
            Some(other) => {
                return Err(format!(
                    "bridge {name:?}: start_type {other:?}: only \"automatic\" is supported"
                ));
            }
        }
        if self.try_private == Some(true) {
            return Err(format!(
                "bridge {name:?}: try_private = true is not supported: Warren does not send \
                 Mosquitto's bridge bit and prevents loops with no_local (MQTT 5) or an echo \
                 filter (docs/bridges.md); remove the key"
            ));
        }
        if let Some(t) = &self.notification_topic
            && (t.is_empty() || t.contains(['+', '#', '\0']))
        {
            return Err(format!(
                "bridge {name:?}: notification_topic {t:?}: must be a topic without wildcards"
            ));
        }
        for (key, id) in [
            ("remote_clientid", &self.remote_clientid),
            ("local_clientid", &self.local_clientid),
        ] {
            if id
                .as_ref()
                .is_some_and(|i| i.is_empty() || i.len() > 65_535)
            {
                return Err(format!("bridge {name:?}: {key} must not be empty"));
            }
        }
        if self.remote_password.is_some() && self.remote_username.is_none() {
            return Err(format!(
                "bridge {name:?}: remote_password needs remote_username"
            ));
        }
        if self.local_password.is_some() && self.local_username.is_none() {
            return Err(format!(
                "bridge {name:?}: local_password needs local_username"
            ));
        }
        let max_packet_size = match self.bridge_max_packet_size {
            None | Some(0) => MQTT_MAX_PACKET,
            Some(n) if n < 128 => {
                return Err(format!(
                    "bridge {name:?}: bridge_max_packet_size {n}: at least 128 bytes (0: no limit)"
                ));
            }
            Some(n) => n.min(MQTT_MAX_PACKET),
        };
        let cleansession = self.cleansession.unwrap_or(false);
        Ok(BridgeConfig {
            name,
            addresses,
            round_robin: self.round_robin,
            topics: self.topic,
            remote_clientid: self.remote_clientid,
            remote_username: self.remote_username,
            remote_password: self.remote_password,
            local_clientid: self.local_clientid,
            local_username: self.local_username,
            local_password: self.local_password,
            cleansession,
            local_cleansession: self.local_cleansession.unwrap_or(cleansession),
            keepalive: Duration::from_secs(keepalive),
            restart,
            protocol,
            notifications: self.notifications.unwrap_or(true),
            notifications_local_only: self.notifications_local_only.unwrap_or(false),
            notification_topic: self.notification_topic,
            max_packet_size,
            tls,
        })
    }
}

/// The TLS keys, checked (files read once now: a bad one fails the config load).
#[allow(clippy::too_many_arguments)] // the table's keys, one call site
fn tls_settings(
    name: &str,
    cafile: Option<std::path::PathBuf>,
    capath: Option<std::path::PathBuf>,
    certfile: Option<std::path::PathBuf>,
    keyfile: Option<std::path::PathBuf>,
    insecure: Option<bool>,
    version: Option<String>,
    alpn: Option<String>,
) -> Result<Option<super::tls::TlsSettings>, String> {
    let err = |e: String| format!("bridge {name:?}: {e}");
    if cafile.is_none() && capath.is_none() {
        for (key, set) in [
            ("bridge_certfile", certfile.is_some()),
            ("bridge_keyfile", keyfile.is_some()),
            ("bridge_insecure", insecure.is_some()),
            ("bridge_tls_version", version.is_some()),
            ("bridge_alpn", alpn.is_some()),
        ] {
            if set {
                return Err(err(format!(
                    "{key} needs bridge_cafile or bridge_capath (either turns TLS on, as in Mosquitto)"
                )));
            }
        }
        return Ok(None);
    }
    let client = match (certfile, keyfile) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            return Err(err(
                "bridge_certfile and bridge_keyfile go together (a client certificate and its key)"
                    .into(),
            ));
        }
    };
    if let Some(v) = &version {
        super::tls::version(v).map_err(err)?;
    }
    if alpn.as_ref().is_some_and(|a| a.is_empty() || a.len() > 255) {
        return Err(err("bridge_alpn must be 1 to 255 bytes".into()));
    }
    let s = super::tls::TlsSettings {
        cafile,
        capath,
        client,
        insecure: insecure.unwrap_or(false),
        version,
        alpn,
    };
    super::tls::client_config(&s).map_err(err)?;
    Ok(Some(s))
}

impl<'de> Deserialize<'de> for BridgeConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<BridgeConfig, D::Error> {
        Raw::deserialize(d)?.check().map_err(de::Error::custom)
    }
}

/// Every `[[bridge]]` table, names unique.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bridges(pub Vec<BridgeConfig>);

impl<'de> Deserialize<'de> for Bridges {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Bridges, D::Error> {
        let all = Vec::<BridgeConfig>::deserialize(d)?;
        if all.len() > 256 {
            return Err(de::Error::custom("at most 256 [[bridge]] tables"));
        }
        for (i, b) in all.iter().enumerate() {
            if all[..i].iter().any(|o| o.name == b.name) {
                return Err(de::Error::custom(format!(
                    "bridge name {:?} is used twice; every [[bridge]] needs its own name",
                    b.name
                )));
            }
        }
        Ok(Bridges(all))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_lines_as_mosquitto_reads_them() {
        let t = TopicLine::parse("sensors/#").unwrap();
        assert_eq!((t.direction, t.qos), (Direction::Out, 0));
        assert_eq!(t.local_topic(), "sensors/#");
        let t = TopicLine::parse("# both 1 local/ remote/").unwrap();
        assert_eq!(t.local_topic(), "local/#");
        assert_eq!(t.remote_topic(), "remote/#");
        let t = TopicLine::parse("x in 1 \"\" r/").unwrap();
        assert_eq!(
            (t.local_topic().as_str(), t.remote_topic().as_str()),
            ("x", "r/x")
        );
        let t = TopicLine::parse("\"\" out 0 a/b c/d").unwrap();
        assert_eq!(
            (t.local_topic().as_str(), t.remote_topic().as_str()),
            ("a/b", "c/d")
        );
        for bad in [
            "",
            "a sideways 1",
            "a in 2",
            "a in 1 l/",
            "\"\" in 1 l/ \"\"",
            "\"\" in 1 \"\" \"\"",
            "a in 1 l/+ r/",
            "a/#/b in 1",
            "a in 1 l r x",
        ] {
            assert!(TopicLine::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn addresses() {
        let a = parse_address("127.0.0.1:1884").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 1884));
        assert_eq!(parse_address("broker").unwrap().port, 1883);
        assert_eq!(parse_address("[::1]:9").unwrap().host, "::1");
        assert_eq!(parse_address("::1").unwrap().port, 1883);
        for bad in ["", "h:0", "h:x", "h:70000", "[::1"] {
            assert!(parse_address(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn defaults_are_mosquittos() {
        let v = serde_json::json!({"name": "edge", "address": ["127.0.0.1:1884"],
            "topic": ["sensors/# out 1", "commands/# in 1"]});
        let b: BridgeConfig = serde_json::from_value(v).unwrap();
        assert!(!b.cleansession && b.notifications && !b.round_robin);
        assert_eq!(b.keepalive, Duration::from_secs(60));
        assert_eq!(b.remote_clientid("host"), "host.edge");
        assert_eq!(b.local_clientid("host"), "local.host.edge");
        assert_eq!(
            b.notification_topic("host"),
            "$SYS/broker/connection/host.edge/state"
        );
        let bad = serde_json::json!({"name": "e", "address": "h", "topic": ["#"], "bridge_cafile": "/nonexistent/ca.pem"});
        let e = serde_json::from_value::<BridgeConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bridge_cafile /nonexistent/ca.pem"), "{e}");
        let bad = serde_json::json!({"name": "e", "address": "h", "topic": ["#"], "bridge_insecure": true});
        let e = serde_json::from_value::<BridgeConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bridge_insecure needs bridge_cafile"), "{e}");
        let bad =
            serde_json::json!({"name": "e", "address": "h", "topic": ["#"], "bridge_psk": "00"});
        let e = serde_json::from_value::<BridgeConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bridge_psk"), "{e}");
        let bad = serde_json::json!({"name": "e", "address": "h", "topic": ["#"], "bogus": 1});
        let e = serde_json::from_value::<BridgeConfig>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
    }

    #[test]
    fn every_key_from_toml() {
        #[derive(serde::Deserialize)]
        struct File {
            bridge: Bridges,
        }
        let text = r#"
[[bridge]]
name = "edge"
addresses = "10.0.0.1:1884 [::1]:1885 broker"
round_robin = true
topic = ["sensors/# out 1", "commands/# in 1 local/ remote/", "\"\" both 0 a/b c/d"]
clientid = "edge-1"
username = "u"
password = "p"
local_clientid = "l"
local_username = "lu"
local_password = "lp"
cleansession = true
local_cleansession = false
keepalive_interval = 30
restart_timeout = "10 60"
bridge_protocol_version = "mqttv50"
notifications = false
notifications_local_only = true
notification_topic = "state/edge"
bridge_max_packet_size = 4096
start_type = "automatic"
try_private = false

[[bridge]]
name = "two"
address = ["h"]
topic = ["x"]
restart_timeout = 7
"#;
        let f: File = toml::from_str(text).unwrap();
        let [a, b] = &f.bridge.0[..] else {
            panic!("two bridges")
        };
        assert_eq!(a.addresses.len(), 3);
        assert_eq!(a.addresses[1].to_string(), "[::1]:1885");
        assert_eq!(a.addresses[2].port, 1883);
        assert_eq!(a.topics[2].local_topic(), "a/b");
        assert_eq!(a.remote_clientid("h"), "edge-1");
        assert_eq!((a.cleansession, a.local_cleansession), (true, false));
        assert_eq!(a.protocol, Protocol::V5);
        assert_eq!(
            a.restart,
            Restart::Jitter {
                base: Duration::from_secs(10),
                cap: Duration::from_secs(60)
            }
        );
        assert_eq!(a.notification_topic("h"), "state/edge");
        assert_eq!(a.max_packet_size, 4096);
        assert_eq!(b.restart, Restart::Constant(Duration::from_secs(7)));
        assert!(b.tls.is_none() && b.notifications && !b.cleansession);
        let e = toml::from_str::<File>(
            "[[bridge]]\nname = \"x\"\naddress = \"h\"\ntopic = [\"a\"]\nkeepalive_interval = 2\n",
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(e.contains("keepalive_interval 2"), "{e}");
    }
}
