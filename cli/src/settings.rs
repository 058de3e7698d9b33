//! `warren serve`'s settings: one key per flag, from three sources. Precedence (the issue's):
//! the config file (`--config FILE`, TOML) is the base, command-line flags override it, and
//! `WARREN_<KEY>` environment variables override both (`WARREN_AMQP=0.0.0.0:5672`; lists
//! comma-separated). Unknown keys and bad values are refused with the file, line and a hint.

use serde::{Deserialize, Deserializer};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use warren_runtime::tls::LoginFrom;

/// Whether confirms wait for fsync.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fsync {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Every setting of `warren serve`; the TOML keys are these field names (a flag's name with
/// `_` for `-`). See `warren.toml` at the repository's root for each key's meaning.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub amqp: Vec<String>,
    pub amqps: Vec<String>,
    pub mqtt: Vec<String>,
    pub mqtts: Vec<String>,
    pub mqtt_ws: Vec<String>,
    pub mqtt_wss: Vec<String>,
    pub mqtt_ws_path: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    /// Per TLS listener, over `tls_cert`, `tls_key` and `tls_ca` (e.g. a device CA on
    /// mqtts only, or another certificate for the browsers' wss).
    pub amqps_tls_cert: Option<PathBuf>,
    pub amqps_tls_key: Option<PathBuf>,
    pub amqps_tls_ca: Option<PathBuf>,
    pub mqtts_tls_cert: Option<PathBuf>,
    pub mqtts_tls_key: Option<PathBuf>,
    pub mqtts_tls_ca: Option<PathBuf>,
    pub mqtt_wss_tls_cert: Option<PathBuf>,
    pub mqtt_wss_tls_key: Option<PathBuf>,
    pub mqtt_wss_tls_ca: Option<PathBuf>,
    pub tls_verify_peer: bool,
    pub tls_fail_if_no_peer_cert: bool,
    #[serde(deserialize_with = "parsed")]
    pub tls_login_from: LoginFrom,
    pub mqtt_use_identity_as_username: bool,
    pub mqtt_max_packet_size: u32,
    pub mqtt_max_inflight: u16,
    pub mqtt_server_keep_alive: Option<u16>,
    pub mqtt_max_offline_messages: u64,
    /// MQTT retained messages per vhost at most (`BrokerConfig::max_retained_messages`).
    pub mqtt_max_retained: usize,
    /// MQTT retained payload bytes per vhost at most.
    pub mqtt_max_retained_bytes: u64,
    /// Seconds between publications of the `$SYS/broker/...` topics; 0 disables them.
    pub sys_interval: u64,
    pub data_dir: PathBuf,
    /// The user a new broker starts with (RabbitMQ's default_user; first start only).
    pub default_user: String,
    /// Its password (RabbitMQ's default_pass).
    pub default_pass: String,
    /// A fraction of RAM (`0.4`) or a size (`"512MiB"`); see [`parse_watermark`].
    #[serde(deserialize_with = "number_or_string")]
    pub memory_high_watermark: String,
    /// A size (`"50MB"`, or bytes); `0` turns the check off.
    #[serde(deserialize_with = "number_or_string")]
    pub disk_free_limit: String,
    pub fsync: Fsync,
    pub embed_msgs_below: usize,
    pub in_memory: bool,
    pub shards: u32,
    /// The HTTP management API's address, or `none`.
    pub management: String,
    /// The Prometheus metrics' address, or `none`.
    pub prometheus: String,
    /// The stream protocol's address (RabbitMQ's 5552), or `none`.
    pub stream: String,
    /// Bytes a stream reader reads ahead past a small chunk (0: off).
    pub stream_read_ahead: usize,
    /// Large stream chunks go to the socket with sendfile(2).
    pub stream_sendfile: bool,
    /// The stream protocol over TLS (RabbitMQ's 5551), or `none` (the default).
    pub stream_tls: String,
    /// The stream TLS listener's own certificate chain, key and client CA bundle (default:
    /// `tls_cert`, `tls_key`, `tls_ca`).
    pub stream_tls_cert: Option<PathBuf>,
    pub stream_tls_key: Option<PathBuf>,
    pub stream_tls_ca: Option<PathBuf>,
    /// What stream clients are told to connect to (RabbitMQ's stream.advertised_host and
    /// advertised_port); `None`: the listener's own address.
    pub stream_advertised_host: Option<String>,
    pub stream_advertised_port: Option<u16>,
    /// `None`: RUST_LOG when set, else `info`.
    pub log_level: Option<String>,
    pub log_format: LogFormat,
    pub log_file: Option<PathBuf>,
    /// This node's id in a cluster (docs/cluster.md); none: a single node.
    pub node_id: Option<u64>,
    /// The cluster listener's address (this node's own IP: peers dial it).
    pub cluster: Option<String>,
    /// The other members, `ID=IP:PORT` each.
    pub peers: Vec<String>,
    /// A file holding the shared cluster secret.
    pub cluster_secret_file: Option<PathBuf>,
    /// TLS on the cluster port (all three or none): this node's certificate chain, its key,
    /// and the CA every peer's certificate must chain to.
    pub cluster_tls_cert: Option<PathBuf>,
    pub cluster_tls_key: Option<PathBuf>,
    pub cluster_tls_ca: Option<PathBuf>,
    /// Start as a new member of an existing cluster: propose no first membership; a
    /// member adds this node with `warren ctl join`.
    pub join: bool,
    /// MQTT bridges, Mosquitto's `connection` blocks (warren-links checks them).
    pub bridge: warren_links::Bridges,
    /// Static shovels, RabbitMQ's shovel keys (warren-links checks them).
    pub shovel: warren_links::Shovels,
}

impl Default for Settings {
    fn default() -> Settings {
        let mqtt = warren_mqtt::MqttConfig::default();
        let core = warren_core::BrokerConfig::default();
        Settings {
            amqp: vec!["127.0.0.1:5672".into()],
            amqps: Vec::new(),
            mqtt: vec!["127.0.0.1:1883".into()],
            mqtts: Vec::new(),
            mqtt_ws: Vec::new(),
            mqtt_wss: Vec::new(),
            mqtt_ws_path: "/mqtt".into(),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            amqps_tls_cert: None,
            amqps_tls_key: None,
            amqps_tls_ca: None,
            mqtts_tls_cert: None,
            mqtts_tls_key: None,
            mqtts_tls_ca: None,
            mqtt_wss_tls_cert: None,
            mqtt_wss_tls_key: None,
            mqtt_wss_tls_ca: None,
            tls_verify_peer: false,
            tls_fail_if_no_peer_cert: false,
            tls_login_from: LoginFrom::CommonName,
            mqtt_use_identity_as_username: false,
            mqtt_max_packet_size: mqtt.max_packet_size,
            mqtt_max_inflight: mqtt.max_inflight,
            mqtt_server_keep_alive: mqtt.server_keep_alive,
            mqtt_max_offline_messages: mqtt.max_offline_messages,
            mqtt_max_retained: core.max_retained_messages,
            mqtt_max_retained_bytes: core.max_retained_bytes,
            sys_interval: mqtt.sys_interval.map_or(0, |d| d.as_secs()),
            data_dir: "./warren-data".into(),
            default_user: "guest".into(),
            default_pass: "guest".into(),
            memory_high_watermark: "0.4".into(),
            disk_free_limit: "50MB".into(),
            fsync: Fsync::On,
            embed_msgs_below: 4096,
            in_memory: false,
            shards: 1,
            management: "127.0.0.1:15672".into(),
            prometheus: "127.0.0.1:15692".into(),
            stream: "127.0.0.1:5552".into(),
            stream_read_ahead: 4096,
            stream_sendfile: true,
            stream_tls: "none".into(),
            stream_tls_cert: None,
            stream_tls_key: None,
            stream_tls_ca: None,
            stream_advertised_host: None,
            stream_advertised_port: None,
            log_level: None,
            log_format: LogFormat::Text,
            log_file: None,
            node_id: None,
            cluster: None,
            peers: Vec::new(),
            cluster_secret_file: None,
            cluster_tls_cert: None,
            cluster_tls_key: None,
            cluster_tls_ca: None,
            join: false,
            bridge: Default::default(),
            shovel: Default::default(),
        }
    }
}

/// A bad setting: the operator fixes the file, a flag or a variable (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SettingsError(pub String);

/// The line (1-based) where `key = ...` is set in `text`, for errors found after parsing.
fn line_of(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            l.trim_start()
                .strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        })
        .map(|i| i + 1)
}

impl Settings {
    /// The cluster settings, for `warren_member::options` to check. The test hook
    /// `WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS` (a pause after a conditional delete's check,
    /// `cluster/tests/conditional_delete.rs`) is read here, so the library reads no
    /// environment.
    pub fn cluster_args(&self) -> warren_member::ClusterArgs {
        warren_member::ClusterArgs {
            node_id: self.node_id,
            cluster: self.cluster.clone(),
            peers: self.peers.clone(),
            secret_file: self.cluster_secret_file.clone(),
            join: self.join,
            tls_cert: self.cluster_tls_cert.clone(),
            tls_key: self.cluster_tls_key.clone(),
            tls_ca: self.cluster_tls_ca.clone(),
            in_memory: self.in_memory,
            data_dir: self.data_dir.clone(),
            delete_delay: std::env::var("WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(std::time::Duration::from_millis),
        }
    }

    /// Reads a config file; every key is optional, unknown ones are refused.
    pub fn from_file(path: &Path) -> Result<(Settings, String), SettingsError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SettingsError(format!(
                "cannot read config file {}: {e}; pass --config with a readable TOML file",
                path.display()
            ))
        })?;
        let settings = toml::from_str::<Settings>(&text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text.as_bytes()[..s.start.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1);
            let hint = if e.message().contains("unknown field") {
                "; the keys are the serve flags' names with _ for - (see warren.toml in the repository)"
            } else {
                ""
            };
            SettingsError(format!(
                "{}{}: {}{hint}",
                path.display(),
                line.map_or(String::new(), |l| format!(":{l}")),
                e.message().trim_end(),
            ))
        })?;
        Ok((settings, text))
    }

    /// Applies `WARREN_<KEY>` variables from `vars` (the process environment in `serve`).
    pub fn apply_env(
        &mut self,
        vars: impl Fn(&str) -> Option<String>,
    ) -> Result<(), SettingsError> {
        fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, SettingsError>
        where
            T::Err: std::fmt::Display,
        {
            value
                .parse()
                .map_err(|e| SettingsError(format!("{name}={value:?}: {e}")))
        }
        fn boolean(name: &str, value: &str) -> Result<bool, SettingsError> {
            match value {
                "true" | "1" | "on" | "yes" => Ok(true),
                "false" | "0" | "off" | "no" => Ok(false),
                _ => Err(SettingsError(format!(
                    "{name}={value:?}: expected true or false"
                ))),
            }
        }
        fn list(value: &str) -> Vec<String> {
            value
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        }
        macro_rules! env {
            ($key:ident, |$name:ident, $v:ident| $conv:expr) => {{
                let $name = concat!("WARREN_", stringify!($key)).to_ascii_uppercase();
                if let Some($v) = vars(&$name) {
                    let $v = $v.as_str();
                    self.$key = $conv;
                }
            }};
        }
        env!(amqp, |n, v| list(v));
        env!(amqps, |n, v| list(v));
        env!(mqtt, |n, v| list(v));
        env!(mqtts, |n, v| list(v));
        env!(mqtt_ws, |n, v| list(v));
        env!(mqtt_wss, |n, v| list(v));
        env!(mqtt_ws_path, |n, v| v.to_string());
        env!(tls_cert, |n, v| Some(v.into()));
        env!(tls_key, |n, v| Some(v.into()));
        env!(tls_ca, |n, v| Some(v.into()));
        env!(amqps_tls_cert, |n, v| Some(v.into()));
        env!(amqps_tls_key, |n, v| Some(v.into()));
        env!(amqps_tls_ca, |n, v| Some(v.into()));
        env!(mqtts_tls_cert, |n, v| Some(v.into()));
        env!(mqtts_tls_key, |n, v| Some(v.into()));
        env!(mqtts_tls_ca, |n, v| Some(v.into()));
        env!(mqtt_wss_tls_cert, |n, v| Some(v.into()));
        env!(mqtt_wss_tls_key, |n, v| Some(v.into()));
        env!(mqtt_wss_tls_ca, |n, v| Some(v.into()));
        env!(tls_verify_peer, |n, v| boolean(&n, v)?);
        env!(tls_fail_if_no_peer_cert, |n, v| boolean(&n, v)?);
        env!(tls_login_from, |n, v| v
            .parse()
            .map_err(|e| SettingsError(format!("{n}: {e}")))?);
        env!(mqtt_use_identity_as_username, |n, v| boolean(&n, v)?);
        env!(mqtt_max_packet_size, |n, v| parse(&n, v)?);
        env!(mqtt_max_inflight, |n, v| parse(&n, v)?);
        env!(mqtt_server_keep_alive, |n, v| Some(parse(&n, v)?));
        env!(mqtt_max_offline_messages, |n, v| parse(&n, v)?);
        env!(mqtt_max_retained, |n, v| parse(&n, v)?);
        env!(mqtt_max_retained_bytes, |n, v| parse(&n, v)?);
        env!(sys_interval, |n, v| parse(&n, v)?);
        env!(data_dir, |n, v| v.into());
        env!(default_user, |n, v| v.to_string());
        env!(default_pass, |n, v| v.to_string());
        env!(memory_high_watermark, |n, v| v.to_string());
        env!(disk_free_limit, |n, v| v.to_string());
        env!(fsync, |n, v| match v {
            "on" => Fsync::On,
            "off" => Fsync::Off,
            _ => return Err(SettingsError(format!("{n}={v:?}: expected on or off"))),
        });
        env!(embed_msgs_below, |n, v| parse(&n, v)?);
        env!(in_memory, |n, v| boolean(&n, v)?);
        env!(shards, |n, v| parse(&n, v)?);
        env!(management, |n, v| v.to_string());
        env!(prometheus, |n, v| v.to_string());
        env!(stream, |n, v| v.to_string());
        env!(stream_read_ahead, |n, v| parse(&n, v)?);
        env!(stream_sendfile, |n, v| boolean(&n, v)?);
        env!(stream_tls, |n, v| v.to_string());
        env!(stream_tls_cert, |n, v| Some(v.into()));
        env!(stream_tls_key, |n, v| Some(v.into()));
        env!(stream_tls_ca, |n, v| Some(v.into()));
        env!(stream_advertised_host, |n, v| Some(v.to_string()));
        env!(stream_advertised_port, |n, v| Some(parse(&n, v)?));
        env!(log_level, |n, v| Some(v.to_string()));
        env!(log_format, |n, v| match v {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            _ => return Err(SettingsError(format!("{n}={v:?}: expected text or json"))),
        });
        env!(log_file, |n, v| Some(v.into()));
        env!(node_id, |n, v| Some(parse(&n, v)?));
        env!(cluster, |n, v| Some(v.to_string()));
        env!(peers, |n, v| list(v));
        env!(cluster_secret_file, |n, v| Some(v.into()));
        env!(cluster_tls_cert, |n, v| Some(v.into()));
        env!(cluster_tls_key, |n, v| Some(v.into()));
        env!(cluster_tls_ca, |n, v| Some(v.into()));
        env!(join, |n, v| boolean(&n, v)?);
        Ok(())
    }

    /// Checks values no type rules out; `source` (file path and text) locates the key.
    pub fn validate(&self, source: Option<(&Path, &str)>) -> Result<(), SettingsError> {
        let at = |key: &str| match source {
            Some((path, text)) => match line_of(text, key) {
                Some(line) => format!("{}:{line}: ", path.display()),
                None => String::new(),
            },
            None => String::new(),
        };
        if let Err(e) = parse_watermark(&self.memory_high_watermark) {
            return Err(SettingsError(format!(
                "{}{}",
                at("memory_high_watermark"),
                e.0
            )));
        }
        if let Err(e) = disk_free_limit(&self.disk_free_limit) {
            return Err(SettingsError(format!("{}{}", at("disk_free_limit"), e.0)));
        }
        if let Err(e) = self.management_addr() {
            return Err(SettingsError(format!("{}{}", at("management"), e.0)));
        }
        if let Err(e) = self.prometheus_addr() {
            return Err(SettingsError(format!("{}{}", at("prometheus"), e.0)));
        }
        if let Err(e) = self.stream_addr() {
            return Err(SettingsError(format!("{}{}", at("stream"), e.0)));
        }
        if let Err(e) = self.stream_tls_addr() {
            return Err(SettingsError(format!("{}{}", at("stream_tls"), e.0)));
        }
        if self.default_user.is_empty() {
            return Err(SettingsError(format!(
                "{}default_user must not be empty",
                at("default_user")
            )));
        }
        if !(1..=256).contains(&self.shards) {
            return Err(SettingsError(format!(
                "{}shards {} must be in 1..=256",
                at("shards"),
                self.shards
            )));
        }
        if !self.mqtt_ws_path.starts_with('/') {
            return Err(SettingsError(format!(
                "{}mqtt_ws_path {:?} must start with /, e.g. /mqtt",
                at("mqtt_ws_path"),
                self.mqtt_ws_path
            )));
        }
        if let Some(level) = &self.log_level
            && let Err(e) = tracing_subscriber::EnvFilter::try_new(level)
        {
            return Err(SettingsError(format!(
                "{}log_level {level:?}: {e}; e.g. \"info\" or \"info,warren_mqtt=debug\"",
                at("log_level"),
            )));
        }
        for (key, listeners) in self.listeners_raw() {
            if let Err(e) = parse_addrs(key, listeners, 0) {
                return Err(SettingsError(format!("{}{}", at(key), e.0)));
            }
        }
        Ok(())
    }

    /// The HTTP management API's address (port 15672 when none is given), `None` for `none`.
    pub fn management_addr(&self) -> Result<Option<SocketAddr>, SettingsError> {
        single_addr("management", &self.management, 15672)
    }

    /// The Prometheus metrics' address (port 15692 when none is given), `None` for `none`.
    pub fn prometheus_addr(&self) -> Result<Option<SocketAddr>, SettingsError> {
        single_addr("prometheus", &self.prometheus, 15692)
    }

    /// The stream protocol's address (port 5552 when none is given), `None` for `none`.
    pub fn stream_addr(&self) -> Result<Option<SocketAddr>, SettingsError> {
        single_addr("stream", &self.stream, 5552)
    }

    /// The stream protocol's TLS address (port 5551 when none is given), `None` for `none`.
    pub fn stream_tls_addr(&self) -> Result<Option<SocketAddr>, SettingsError> {
        single_addr("stream_tls", &self.stream_tls, 5551)
    }

    /// The certificate chain, key and CA bundle of one TLS listener (`amqps`, `mqtts` or
    /// `mqtt_wss`): its own keys where set, else the shared `tls_cert`, `tls_key`, `tls_ca`.
    pub fn tls_files_of(
        &self,
        listener: &str,
    ) -> (Option<&PathBuf>, Option<&PathBuf>, Option<&PathBuf>) {
        let (cert, key, ca) = match listener {
            "amqps" => (
                &self.amqps_tls_cert,
                &self.amqps_tls_key,
                &self.amqps_tls_ca,
            ),
            "mqtts" => (
                &self.mqtts_tls_cert,
                &self.mqtts_tls_key,
                &self.mqtts_tls_ca,
            ),
            "mqtt_wss" | "mqtt-wss" => (
                &self.mqtt_wss_tls_cert,
                &self.mqtt_wss_tls_key,
                &self.mqtt_wss_tls_ca,
            ),
            "stream_tls" | "stream-tls" => (
                &self.stream_tls_cert,
                &self.stream_tls_key,
                &self.stream_tls_ca,
            ),
            _ => (&None, &None, &None),
        };
        (
            cert.as_ref().or(self.tls_cert.as_ref()),
            key.as_ref().or(self.tls_key.as_ref()),
            ca.as_ref().or(self.tls_ca.as_ref()),
        )
    }

    fn listeners_raw(&self) -> [(&'static str, &Vec<String>); 6] {
        [
            ("amqp", &self.amqp),
            ("amqps", &self.amqps),
            ("mqtt", &self.mqtt),
            ("mqtts", &self.mqtts),
            ("mqtt_ws", &self.mqtt_ws),
            ("mqtt_wss", &self.mqtt_wss),
        ]
    }
}

/// Listen addresses of one listener key: `none` (alone) for none, else each `IP:PORT`,
/// `[IPv6]:PORT`, `HOST:PORT`, or an IP or host without port (then `default_port`).
pub fn parse_addrs(
    key: &str,
    values: &[String],
    default_port: u16,
) -> Result<Vec<SocketAddr>, SettingsError> {
    let flag = key.replace('_', "-");
    if values.iter().any(|v| v == "none") {
        if values.len() > 1 {
            return Err(SettingsError(format!(
                "--{flag}: `none` disables the listener and cannot go with addresses {values:?}"
            )));
        }
        return Ok(Vec::new());
    }
    let mut addrs = Vec::new();
    for value in values {
        let addr = parse_addr(value, default_port).ok_or_else(|| {
            SettingsError(format!(
                "--{flag} {value:?} is not an address like 127.0.0.1:{default_port}, \
                 [::1]:{default_port} or 0.0.0.0 (or `none`)"
            ))
        })?;
        if addrs.contains(&addr) {
            return Err(SettingsError(format!("--{flag} {addr} given twice")));
        }
        addrs.push(addr);
    }
    Ok(addrs)
}

/// One listen address (as [`parse_addrs`]) or `none`.
fn single_addr(
    key: &str,
    value: &str,
    default_port: u16,
) -> Result<Option<SocketAddr>, SettingsError> {
    Ok(parse_addrs(key, &[value.to_string()], default_port)?
        .into_iter()
        .next())
}

/// A TOML value that may be written as a number or a string (`0.4` or `"512MiB"`), kept as
/// its text. A float keeps its decimal point (`3.0` stays `"3.0"`), so it still reads as a
/// fraction and is not mistaken for a byte count.
fn number_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Value {
        Text(String),
        Integer(u64),
        Float(f64),
    }
    Ok(match Value::deserialize(d)? {
        Value::Text(s) => s,
        Value::Integer(n) => n.to_string(),
        Value::Float(f) => format!("{f:?}"),
    })
}

/// Total RAM in bytes, from /proc/meminfo.
fn total_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find(|l| l.starts_with("MemTotal:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// A size as RabbitMQ's configuration writes them: bytes, or a number with a unit (`kB`,
/// `MB`, `GB`: powers of 1000; `KiB`, `MiB`, `GiB`: powers of 1024).
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number.parse().ok()?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" | "k" | "K" => 1_000,
        "MB" | "M" => 1_000_000,
        "GB" | "G" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    number.checked_mul(scale)
}

/// A memory watermark as written: a fraction of RAM or an absolute size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Watermark {
    Fraction(f64),
    Bytes(u64),
}

/// Reads `--memory-high-watermark`: a fraction of RAM in (0, 1], or a size.
pub fn parse_watermark(text: &str) -> Result<Watermark, SettingsError> {
    match text.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(Watermark::Fraction(f)),
        // A plain number above 1 is an absolute size in bytes, as RabbitMQ's
        // `vm_memory_high_watermark.absolute`.
        _ => parse_size(text)
            .filter(|&n| n > 0)
            .map(Watermark::Bytes)
            .ok_or_else(|| {
                SettingsError(format!(
                    "--memory-high-watermark {text:?} must be a fraction of RAM in (0, 1] \
                     (e.g. 0.4) or a size (e.g. 512MiB)"
                ))
            }),
    }
}

/// The memory alarm threshold in bytes: `text` is a fraction of RAM or an absolute size.
pub fn watermark_bytes(text: &str) -> Result<u64, SettingsError> {
    Ok(match parse_watermark(text)? {
        Watermark::Bytes(n) => n,
        Watermark::Fraction(fraction) => {
            let total = total_memory().unwrap_or_else(|| {
                tracing::warn!(
                    "cannot read /proc/meminfo; assuming 1 GiB of RAM for the memory alarm"
                );
                1 << 30
            });
            (total as f64 * fraction) as u64
        }
    })
}

/// Reads `--disk-free-limit`: a size, `0` for no check.
pub fn disk_free_limit(text: &str) -> Result<u64, SettingsError> {
    parse_size(text).ok_or_else(|| {
        SettingsError(format!(
            "--disk-free-limit {text:?} must be a size, e.g. 50MB or 1GiB (0: no check)"
        ))
    })
}

fn parse_addr(value: &str, default_port: u16) -> Option<SocketAddr> {
    if let Ok(addr) = value.parse::<SocketAddr>() {
        return Some(addr);
    }
    let bare = value
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .unwrap_or(value);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, default_port));
    }
    // A host name, resolved once at start (the first address).
    let with_port = if value.contains(':') {
        value.to_string()
    } else {
        format!("{value}:{default_port}")
    };
    with_port.to_socket_addrs().ok()?.next()
}

/// A value the config file writes as a string its type parses (RabbitMQ's names).
fn parsed<'de, D: Deserializer<'de>, T: std::str::FromStr<Err = String>>(
    d: D,
) -> Result<T, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn listener_addresses() {
        let got = parse_addrs(
            "amqps",
            &strings(&["127.0.0.1", "[::1]:6000", "::1", "0.0.0.0:1"]),
            5671,
        )
        .expect("valid");
        let want: Vec<SocketAddr> = ["127.0.0.1:5671", "[::1]:6000", "[::1]:5671", "0.0.0.0:1"]
            .iter()
            .map(|s| s.parse().expect("addr"))
            .collect();
        assert_eq!(got, want);
        assert!(
            parse_addrs("amqp", &strings(&["none"]), 1)
                .expect("none")
                .is_empty()
        );
        assert!(parse_addrs("amqp", &strings(&["none", "127.0.0.1:1"]), 1).is_err());
        assert!(parse_addrs("amqp", &strings(&["127.0.0.1:70000"]), 1).is_err());
        assert!(parse_addrs("amqp", &strings(&["1.2.3.4:5", "1.2.3.4:5"]), 1).is_err());
    }

    #[test]
    fn env_overrides_and_bad_env_values() {
        let mut s = Settings::default();
        let vars = |k: &str| match k {
            "WARREN_AMQP" => Some("127.0.0.1:1, [::1]:2".to_string()),
            "WARREN_FSYNC" => Some("off".to_string()),
            "WARREN_SHARDS" => Some("3".to_string()),
            "WARREN_TLS_VERIFY_PEER" => Some("true".to_string()),
            _ => None,
        };
        s.apply_env(vars).expect("valid");
        assert_eq!(s.amqp, strings(&["127.0.0.1:1", "[::1]:2"]));
        assert_eq!(s.fsync, Fsync::Off);
        assert_eq!(s.shards, 3);
        assert!(s.tls_verify_peer);
        let e = s
            .apply_env(|k| (k == "WARREN_SHARDS").then(|| "many".to_string()))
            .expect_err("refused");
        assert!(e.0.contains("WARREN_SHARDS"), "{e}");
    }

    #[test]
    fn config_file_errors_name_file_and_line() {
        let dir = std::env::temp_dir().join(format!("warren-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("warren.toml");
        std::fs::write(&path, "data_dir = \"/tmp/x\"\n\nshardz = 2\n").expect("write");
        let e = Settings::from_file(&path).expect_err("unknown key");
        assert!(e.0.contains("warren.toml:3"), "{e}");
        assert!(e.0.contains("shardz"), "{e}");
        std::fs::write(&path, "fsync = \"sometimes\"\n").expect("write");
        let e = Settings::from_file(&path).expect_err("bad value");
        assert!(e.0.contains("warren.toml:1"), "{e}");
        std::fs::write(&path, "shards = 2\nmemory_high_watermark = 3.0\n").expect("write");
        let (s, text) = Settings::from_file(&path).expect("parses");
        assert_eq!(s.shards, 2);
        let e = s.validate(Some((&path, &text))).expect_err("out of range");
        assert!(e.0.contains("warren.toml:2"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sizes_read_as_rabbitmq_writes_them() {
        assert_eq!(parse_size("50MB"), Some(50_000_000));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("12 kB"), Some(12_000));
        assert_eq!(parse_size("MB"), None);
        assert_eq!(parse_size("5 parsecs"), None);
        assert_eq!(parse_size("99999999999GB"), None, "overflow is refused");
    }

    #[test]
    fn a_watermark_is_a_fraction_of_ram_or_an_absolute_size() {
        assert_eq!(watermark_bytes("64MiB").ok(), Some(64 << 20));
        assert_eq!(watermark_bytes("2000000").ok(), Some(2_000_000));
        let fraction = watermark_bytes("0.5").ok().unwrap_or(0);
        assert!(fraction > 0, "half of RAM is some bytes");
        assert!(watermark_bytes("0").is_err());
        assert!(watermark_bytes("-0.2").is_err());
        assert!(watermark_bytes("lots").is_err());
    }

    /// The limits and the HTTP listeners from the file: numbers or strings, checked with
    /// the file's line; flags' values from the environment.
    #[test]
    fn limits_and_http_listeners_from_file_and_env() {
        let dir = std::env::temp_dir().join(format!("warren-limits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("warren.toml");
        std::fs::write(
            &path,
            "memory_high_watermark = \"512MiB\"\ndisk_free_limit = 1000000\n\
             management = \"none\"\nprometheus = \"127.0.0.1\"\nstream = \"127.0.0.1\"\n\
             stream_read_ahead = 0\n",
        )
        .expect("write");
        let (s, text) = Settings::from_file(&path).expect("parses");
        s.validate(Some((&path, &text))).expect("valid");
        assert_eq!(
            parse_watermark(&s.memory_high_watermark).ok(),
            Some(Watermark::Bytes(512 << 20))
        );
        assert_eq!(disk_free_limit(&s.disk_free_limit).ok(), Some(1_000_000));
        assert_eq!(s.management_addr().ok(), Some(None));
        assert_eq!(
            s.stream_addr().ok().flatten(),
            Some("127.0.0.1:5552".parse().expect("addr"))
        );
        assert_eq!(s.stream_read_ahead, 0);
        assert_eq!(
            s.prometheus_addr().ok().flatten(),
            Some("127.0.0.1:15692".parse().expect("addr"))
        );
        std::fs::write(&path, "memory_high_watermark = 0.5\n").expect("write");
        let (mut s, _) = Settings::from_file(&path).expect("parses");
        assert_eq!(
            parse_watermark(&s.memory_high_watermark).ok(),
            Some(Watermark::Fraction(0.5))
        );
        for (text, line) in [
            ("shards = 1\ndisk_free_limit = \"lots\"\n", ":2"),
            ("management = \"not an address\"\n", ":1"),
            ("\nstream = \"127.0.0.1:99999\"\n", ":2"),
            ("\nmemory_high_watermark = \"0\"\n", ":2"),
        ] {
            std::fs::write(&path, text).expect("write");
            let (s, text) = Settings::from_file(&path).expect("parses");
            let e = s.validate(Some((&path, &text))).expect_err("refused");
            assert!(e.0.contains(&format!("warren.toml{line}")), "{e}");
        }
        s.apply_env(|k| match k {
            "WARREN_DISK_FREE_LIMIT" => Some("2GB".to_string()),
            "WARREN_MANAGEMENT" => Some("[::1]:0".to_string()),
            "WARREN_STREAM" => Some("none".to_string()),
            _ => None,
        })
        .expect("valid");
        assert_eq!(
            disk_free_limit(&s.disk_free_limit).ok(),
            Some(2_000_000_000)
        );
        assert_eq!(
            s.management_addr().ok(),
            Some(Some("[::1]:0".parse().expect("addr")))
        );
        assert_eq!(s.stream_addr().ok(), Some(None));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The cluster keys of the file reach the cluster's checks (`warren_member::options`
    /// has the tests of the checks themselves).
    #[test]
    fn cluster_keys_from_the_config_file() {
        let dir = std::env::temp_dir().join(format!("warren-cluster-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("warren.toml");
        let text = "node_id = 1\ncluster = \"10.0.0.1:1\"\npeers = [\"2=10.0.0.2:1\"]\njoin = true\n\
             cluster_secret_file = \"/s\"\ncluster_tls_cert = \"/c\"\ncluster_tls_key = \"/k\"\n\
             cluster_tls_ca = \"/a\"\n";
        std::fs::write(&path, text).expect("write");
        let a = Settings::from_file(&path).expect("parses").0.cluster_args();
        let files = [a.secret_file, a.tls_cert, a.tls_key, a.tls_ca].map(Option::unwrap_or_default);
        assert_eq!(
            files.map(|f| f.display().to_string()),
            ["/s", "/c", "/k", "/a"]
        );
        assert_eq!(
            (a.node_id, a.cluster.as_deref(), a.join),
            (Some(1), Some("10.0.0.1:1"), true)
        );
        assert_eq!(a.peers, ["2=10.0.0.2:1"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn example_config_parses_and_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../warren.toml");
        let (s, text) = Settings::from_file(&path).expect("the example parses");
        s.validate(Some((&path, &text)))
            .expect("the example is valid");
    }
}
