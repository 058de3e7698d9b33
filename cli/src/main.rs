//! `warren`: the broker binary. `warren serve` runs the broker, `warren ctl` manages a running
//! one. The load generator is a binary of its own (`warren-bench`, in bench/).

mod admin;
mod ctl;
#[cfg(test)]
mod footprint;
mod links;
mod settings;

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing_subscriber::EnvFilter;
use warren_core::escape::Escaped;
use warren_runtime::{tls, ws_upgrade as ws};

#[derive(Parser)]
#[command(
    name = "warren",
    version,
    about = "Warren: an AMQP 0.9.1 and MQTT message broker",
    after_help = "Exit codes: 0 stopped cleanly (SIGINT/SIGTERM), 1 runtime failure, \
                  2 bad usage or configuration (flags, address in use, data dir)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the broker.
    Serve(Box<ServeArgs>),
    /// Inspect and manage a running broker (rabbitmqctl's verbs), through the admin socket
    /// in its data directory.
    Ctl(ctl::CtlArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A TOML file with any of these settings (keys: the flags' names with `_` for `-`; see
    /// warren.toml in the repository). Flags override it; WARREN_<KEY> variables override both.
    #[arg(long)]
    config: Option<PathBuf>,
    /// AMQP 0.9.1 listen address, repeatable (`--amqp 0.0.0.0:5672 --amqp [::]:5672`), or
    /// `none`. Default 127.0.0.1:5672.
    #[arg(long)]
    amqp: Vec<String>,
    /// AMQP over TLS listen address (port 5671 when none is given), repeatable. Needs
    /// --tls-cert and --tls-key.
    #[arg(long)]
    amqps: Vec<String>,
    /// MQTT listen address, repeatable, or `none`. Default 127.0.0.1:1883.
    #[arg(long)]
    mqtt: Vec<String>,
    /// MQTT over TLS listen address (port 8883 when none is given), repeatable.
    #[arg(long)]
    mqtts: Vec<String>,
    /// MQTT over WebSocket listen address (port 8083 when none is given), repeatable.
    #[arg(long)]
    mqtt_ws: Vec<String>,
    /// MQTT over secure WebSocket listen address (port 8084 when none is given), repeatable.
    #[arg(long)]
    mqtt_wss: Vec<String>,
    /// The HTTP path of the WebSocket listeners (default /mqtt, as EMQX and MQTT.js's
    /// examples; RabbitMQ's Web MQTT uses /ws).
    #[arg(long)]
    mqtt_ws_path: Option<String>,
    /// PEM certificate chain (server certificate first) of the TLS listeners; re-read on
    /// SIGHUP.
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of --tls-cert.
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// PEM CA bundle client certificates are verified against (with --tls-verify-peer).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// The --amqps listeners' own certificate chain (default: --tls-cert).
    #[arg(long)]
    amqps_tls_cert: Option<PathBuf>,
    /// The --amqps listeners' own key (default: --tls-key).
    #[arg(long)]
    amqps_tls_key: Option<PathBuf>,
    /// The --amqps listeners' own client CA bundle (default: --tls-ca).
    #[arg(long)]
    amqps_tls_ca: Option<PathBuf>,
    /// The --mqtts listeners' own certificate chain (default: --tls-cert).
    #[arg(long)]
    mqtts_tls_cert: Option<PathBuf>,
    /// The --mqtts listeners' own key (default: --tls-key).
    #[arg(long)]
    mqtts_tls_key: Option<PathBuf>,
    /// The --mqtts listeners' own client CA bundle (default: --tls-ca).
    #[arg(long)]
    mqtts_tls_ca: Option<PathBuf>,
    /// The --mqtt-wss listeners' own certificate chain (default: --tls-cert).
    #[arg(long)]
    mqtt_wss_tls_cert: Option<PathBuf>,
    /// The --mqtt-wss listeners' own key (default: --tls-key).
    #[arg(long)]
    mqtt_wss_tls_key: Option<PathBuf>,
    /// The --mqtt-wss listeners' own client CA bundle (default: --tls-ca).
    #[arg(long)]
    mqtt_wss_tls_ca: Option<PathBuf>,
    /// Ask TLS clients for a certificate and verify it against --tls-ca (RabbitMQ's
    /// verify_peer); a verified certificate's subject CN can log in (AMQP EXTERNAL, MQTT
    /// --mqtt-use-identity-as-username).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    tls_verify_peer: Option<bool>,
    /// With --tls-verify-peer: refuse TLS clients without a certificate (RabbitMQ's
    /// fail_if_no_peer_cert).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    tls_fail_if_no_peer_cert: Option<bool>,
    /// Which name of a verified client certificate is the user (RabbitMQ's
    /// ssl_cert_login_from): its subject's common name (default) or its first subject
    /// alternative name (DNS name, email or URI).
    #[arg(long)]
    tls_login_from: Option<tls::LoginFrom>,
    /// MQTT over TLS: the client certificate's subject CN is the user name, no password
    /// checked (Mosquitto's use_identity_as_username).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    mqtt_use_identity_as_username: Option<bool>,
    /// Largest MQTT packet accepted, bytes (default 16 MiB; v5 CONNACK announces it).
    #[arg(long)]
    mqtt_max_packet_size: Option<u32>,
    /// QoS 1/2 messages in flight per MQTT session and direction (v5 Receive Maximum;
    /// default 1024).
    #[arg(long)]
    mqtt_max_inflight: Option<u16>,
    /// Longest MQTT keep-alive allowed, seconds (v5 Server Keep Alive); default: the
    /// client's.
    #[arg(long)]
    mqtt_server_keep_alive: Option<u16>,
    /// Messages a persistent MQTT session keeps while its client is away (default 100000).
    #[arg(long)]
    mqtt_max_offline_messages: Option<u64>,
    /// MQTT retained messages a vhost holds at most; a retained publish to a new topic
    /// beyond it is routed but not retained (default 100000).
    #[arg(long)]
    mqtt_max_retained: Option<usize>,
    /// MQTT retained payload bytes a vhost holds at most (default 268435456, 256 MiB).
    #[arg(long)]
    mqtt_max_retained_bytes: Option<u64>,
    /// Seconds between publications of the MQTT `$SYS/broker/...` topics (Mosquitto's
    /// sys_interval; default 10, 0 disables them).
    #[arg(long)]
    sys_interval: Option<u64>,
    /// Where the broker keeps its data (default ./warren-data).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The administrator a new broker starts with, with full permissions on vhost `/`
    /// (RabbitMQ's default_user; default guest, which logs in from loopback only). Used on
    /// the first start of a data directory only: later the stored users count.
    #[arg(long)]
    default_user: Option<String>,
    /// Its password (RabbitMQ's default_pass; default guest). Prefer WARREN_DEFAULT_PASS or
    /// the config file: a flag shows in the process list.
    #[arg(long)]
    default_pass: Option<String>,
    /// Memory above which publishers are blocked until consumers catch up (RabbitMQ's
    /// vm_memory_high_watermark): a fraction of this machine's RAM (`0.4`, the default) or an
    /// absolute size (`512MiB`, `2GB`). Compared with the larger of the queued message bodies
    /// and the process's resident memory; publishers are unblocked at 90% of it.
    #[arg(long)]
    memory_high_watermark: Option<String>,
    /// Free space on the data directory's disk below which publishers are blocked
    /// (RabbitMQ's disk_free_limit): bytes or a size such as `50MB` (the default), `1GiB`;
    /// `0` turns the check off. Unblocked once 10% above it. Not checked with `--in-memory`.
    #[arg(long)]
    disk_free_limit: Option<String>,
    /// Whether publisher confirms of persistent messages wait for fsync (`on`, the default:
    /// confirmed means on disk) or only for the write to the OS (`off`: survives a broker
    /// crash, not a power cut; lower latency, as RabbitMQ's classic queues).
    #[arg(long, value_enum)]
    fsync: Option<settings::Fsync>,
    /// Message bodies of at least this many bytes are stored once in the shared store;
    /// smaller ones inline in each queue's segment files (default 4096).
    #[arg(long)]
    embed_msgs_below: Option<usize>,
    /// Keep everything in memory: no message log, no stored definitions (nothing survives
    /// a restart, and a confirm does not mean on disk). The data dir holds only the admin
    /// socket.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    in_memory: Option<bool>,
    /// Broker shards, each a task owning the queues its connections declare, with its own
    /// message log (ARCHITECTURE.md, "warren-runtime"): queue work spreads over up to this
    /// many cores. Fixed for a data directory once it holds queues. Experimental: on a
    /// small machine one shard is faster (docs/benchmarks.md, "Shards"). Default 1.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=256))]
    shards: Option<u32>,
    /// HTTP management API listen address (RabbitMQ's /api, basic auth), or `none`. Default
    /// 127.0.0.1:15672.
    #[arg(long)]
    management: Option<String>,
    /// Prometheus metrics listen address (`/metrics`), or `none`. Default 127.0.0.1:15692.
    #[arg(long)]
    prometheus: Option<String>,
    /// RabbitMQ's stream protocol listen address, or `none`. Default 127.0.0.1:5552. Streams
    /// live under <data-dir>/streams (with --in-memory: in memory, one log per stream for
    /// AMQP stream queues and this protocol as with a data directory).
    #[arg(long)]
    stream: Option<String>,
    /// The stream protocol over TLS (RabbitMQ's port 5551), or `none` (the default): the
    /// same streams as --stream, with --tls-cert/--tls-key (or --stream-tls-cert/-key/-ca).
    #[arg(long)]
    stream_tls: Option<String>,
    /// The host stream clients are told to connect to (Open's `advertised_host`, Metadata's
    /// brokers; RabbitMQ's stream.advertised_host), for a broker behind NAT, in a container
    /// or behind a load balancer. Default: the listener's address.
    #[arg(long)]
    stream_advertised_host: Option<String>,
    /// The port stream clients of --stream are told to connect to (RabbitMQ's
    /// stream.advertised_port). Default: the listener's port (--stream-tls tells its own).
    #[arg(long)]
    stream_advertised_port: Option<u16>,
    /// The --stream-tls listener's own certificate chain (default: --tls-cert).
    #[arg(long)]
    stream_tls_cert: Option<PathBuf>,
    /// The --stream-tls listener's own key (default: --tls-key).
    #[arg(long)]
    stream_tls_key: Option<PathBuf>,
    /// The --stream-tls listener's own client CA bundle (default: --tls-ca).
    #[arg(long)]
    stream_tls_ca: Option<PathBuf>,
    /// Bytes a stream reader reads ahead past a small chunk, to serve several chunks per
    /// system call (RabbitMQ 4.2's read-ahead); 0 turns it off. Default 4096.
    #[arg(long)]
    stream_read_ahead: Option<usize>,
    /// Stream chunks of 16 KiB and more go from the segment file to the socket with
    /// sendfile(2), not copied through the broker (`false`: read and written). Default true.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    stream_sendfile: Option<bool>,
    /// Log filter: a level, or per module (`info,warren_mqtt=debug`). Default info, or
    /// RUST_LOG when set and no level is configured.
    #[arg(long)]
    log_level: Option<String>,
    /// Log lines as text (default) or JSON objects.
    #[arg(long, value_enum)]
    log_format: Option<settings::LogFormat>,
    /// Append logs to this file instead of standard output.
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// This node's id in a cluster (a number, unique and fixed for its data dir); with
    /// --cluster, --peers and --cluster-secret-file (docs/cluster.md). Default: no cluster
    #[arg(long)]
    node_id: Option<u64>,
    /// The cluster listener: this node's own IP:PORT, which the peers dial (e.g. 10.0.0.1:25672)
    #[arg(long)]
    cluster: Option<String>,
    /// The other members as ID=IP:PORT, repeatable or comma-separated
    /// (`--peers 2=10.0.0.2:25672,3=10.0.0.3:25672`)
    #[arg(long)]
    peers: Vec<String>,
    /// A file with the shared cluster secret (at least 16 bytes, the same on every node, as
    /// RabbitMQ's Erlang cookie); peers prove they know it, it never crosses the network
    #[arg(long)]
    cluster_secret_file: Option<PathBuf>,
    /// TLS on the cluster port, mutual (as RabbitMQ's inter-node TLS): this node's
    /// certificate chain (PEM; its subject alternative names must include its --cluster IP);
    /// with --cluster-tls-key and --cluster-tls-ca, on every node
    #[arg(long)]
    cluster_tls_cert: Option<PathBuf>,
    /// The private key of --cluster-tls-cert (PEM)
    #[arg(long)]
    cluster_tls_key: Option<PathBuf>,
    /// The CA bundle (PEM) every peer's certificate must chain to, both ways
    #[arg(long)]
    cluster_tls_ca: Option<PathBuf>,
    /// Start as a new member of an existing cluster (its --peers may be empty): propose no
    /// membership of its own; then run `warren ctl join ID IP:PORT` on a member
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    join: Option<bool>,
}

impl ServeArgs {
    /// The settings: the file's, then these flags, then WARREN_* variables.
    fn settings(self) -> Result<settings::Settings, settings::SettingsError> {
        let (mut s, source) = match &self.config {
            Some(path) => {
                let (s, text) = settings::Settings::from_file(path)?;
                (s, Some((path.clone(), text)))
            }
            None => (settings::Settings::default(), None),
        };
        macro_rules! flag {
            ($($key:ident),*) => {$(
                if let Some(v) = self.$key {
                    s.$key = v;
                }
            )*};
        }
        macro_rules! list {
            ($($key:ident),*) => {$(
                if !self.$key.is_empty() {
                    s.$key = self.$key;
                }
            )*};
        }
        macro_rules! optional {
            ($($key:ident),*) => {$(
                if self.$key.is_some() {
                    s.$key = self.$key;
                }
            )*};
        }
        list!(amqp, amqps, mqtt, mqtts, mqtt_ws, mqtt_wss, peers);
        flag!(
            join,
            mqtt_ws_path,
            tls_verify_peer,
            tls_fail_if_no_peer_cert,
            tls_login_from,
            mqtt_use_identity_as_username,
            mqtt_max_packet_size,
            mqtt_max_inflight,
            mqtt_max_offline_messages,
            mqtt_max_retained,
            mqtt_max_retained_bytes,
            sys_interval,
            data_dir,
            default_user,
            default_pass,
            memory_high_watermark,
            disk_free_limit,
            fsync,
            embed_msgs_below,
            in_memory,
            shards,
            management,
            prometheus,
            stream,
            stream_tls,
            stream_read_ahead,
            stream_sendfile,
            log_format
        );
        optional!(
            tls_cert,
            tls_key,
            tls_ca,
            amqps_tls_cert,
            amqps_tls_key,
            amqps_tls_ca,
            mqtts_tls_cert,
            mqtts_tls_key,
            mqtts_tls_ca,
            mqtt_wss_tls_cert,
            mqtt_wss_tls_key,
            mqtt_wss_tls_ca,
            stream_tls_cert,
            stream_tls_key,
            stream_tls_ca,
            stream_advertised_host,
            stream_advertised_port,
            mqtt_server_keep_alive,
            log_level,
            log_file,
            node_id,
            cluster,
            cluster_secret_file,
            cluster_tls_cert,
            cluster_tls_key,
            cluster_tls_ca
        );
        s.apply_env(|k| std::env::var(k).ok())?;
        s.validate(source.as_ref().map(|(p, t)| (p.as_path(), t.as_str())))?;
        Ok(s)
    }
}

/// Exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration (address, data dir),
/// 3 a damaged data file the start cannot read past (the error line names it and says how to
/// recover; restarting in a loop does not help).
const EXIT_CONFIG: u8 = 2;
const EXIT_DAMAGED: u8 = 3;

/// The default logger of the subcommands other than `serve`.
fn init_default_logs() {
    tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
}

/// `serve`'s logger, as its settings say.
fn init_serve_logs(s: &settings::Settings) -> Result<(), ConfigError> {
    let filter = match &s.log_level {
        Some(level) => EnvFilter::try_new(level).map_err(|e| ConfigError(e.to_string()))?,
        // openraft logs every failed RPC to an unreachable member (~20 lines a second while
        // one is down, errors among them); Warren logs the cluster's changes itself, once
        // per change (warren-member, warren_cluster::transport).
        // rustls logs every warning alert a peer sends at WARN (the Java client sends
        // user_canceled before each close); failed handshakes are Warren's own line.
        None => EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new("info,openraft=off,rustls=error")),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let file = match &s.log_file {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| {
                    ConfigError(format!(
                        "cannot open log file {}: {e}; pass --log-file with a writable path",
                        path.display()
                    ))
                })?,
        ),
        None => None,
    };
    let ansi = file.is_none() && std::io::stdout().is_terminal();
    match (s.log_format, file) {
        (settings::LogFormat::Text, None) => builder.with_ansi(ansi).init(),
        (settings::LogFormat::Json, None) => builder.json().init(),
        (settings::LogFormat::Text, Some(f)) => builder
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(f))
            .init(),
        (settings::LogFormat::Json, Some(f)) => {
            builder.json().with_writer(std::sync::Mutex::new(f)).init()
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` sets its logger up from its settings.
    if !matches!(cli.command, Command::Serve(_)) {
        init_default_logs();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Serve(args) => {
            let settings = match args.settings() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            if let Err(e) = init_serve_logs(&settings) {
                eprintln!("error: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
            match runtime.block_on(serve(settings)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("error: {e:#}");
                    ExitCode::from(if e.downcast_ref::<DamagedData>().is_some() {
                        EXIT_DAMAGED
                    } else {
                        e.downcast_ref::<ConfigError>().map_or(1, |_| EXIT_CONFIG)
                    })
                }
            }
        }
        Command::Ctl(args) => match ctl::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                if e.downcast_ref::<ctl::Refused>().is_some() {
                    ExitCode::from(EXIT_CONFIG)
                } else {
                    ExitCode::FAILURE
                }
            }
        },
    }
}

/// A data file the start cannot read (exit code 3): damaged, or of another format.
#[derive(Debug)]
struct DamagedData(String);

impl std::fmt::Display for DamagedData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DamagedData {}

/// A problem the operator fixes by changing flags or the environment (exit code 2).
#[derive(Debug)]
struct ConfigError(String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl From<settings::SettingsError> for ConfigError {
    fn from(e: settings::SettingsError) -> ConfigError {
        ConfigError(e.0)
    }
}

/// What a listener serves, over what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listener {
    Amqp,
    Amqps,
    Mqtt,
    Mqtts,
    MqttWs,
    MqttWss,
}

impl Listener {
    const ALL: [Listener; 6] = [
        Listener::Amqp,
        Listener::Mqtt,
        Listener::Amqps,
        Listener::Mqtts,
        Listener::MqttWs,
        Listener::MqttWss,
    ];

    /// The flag (and, with `_`, the config key).
    fn flag(self) -> &'static str {
        match self {
            Listener::Amqp => "amqp",
            Listener::Amqps => "amqps",
            Listener::Mqtt => "mqtt",
            Listener::Mqtts => "mqtts",
            Listener::MqttWs => "mqtt-ws",
            Listener::MqttWss => "mqtt-wss",
        }
    }

    fn default_port(self) -> u16 {
        match self {
            Listener::Amqp => 5672,
            Listener::Amqps => 5671,
            Listener::Mqtt => 1883,
            Listener::Mqtts => 8883,
            Listener::MqttWs => 8083,
            Listener::MqttWss => 8084,
        }
    }

    fn addresses(self, s: &settings::Settings) -> &Vec<String> {
        match self {
            Listener::Amqp => &s.amqp,
            Listener::Amqps => &s.amqps,
            Listener::Mqtt => &s.mqtt,
            Listener::Mqtts => &s.mqtts,
            Listener::MqttWs => &s.mqtt_ws,
            Listener::MqttWss => &s.mqtt_wss,
        }
    }

    /// RabbitMQ's name of the listener's protocol (the HTTP API's `listeners`).
    fn protocol(self) -> &'static str {
        match self {
            Listener::Amqp => "amqp",
            Listener::Amqps => "amqp/ssl",
            Listener::Mqtt => "mqtt",
            Listener::Mqtts => "mqtt/ssl",
            Listener::MqttWs => "http/web-mqtt",
            Listener::MqttWss => "https/web-mqtt",
        }
    }

    fn tls(self) -> bool {
        matches!(self, Listener::Amqps | Listener::Mqtts | Listener::MqttWss)
    }

    fn is_amqp(self) -> bool {
        matches!(self, Listener::Amqp | Listener::Amqps)
    }

    /// How the start-up log names it (the plain ones as before: scripts parse them).
    fn describe(self, path: &str) -> String {
        match self {
            Listener::Amqp => "(AMQP 0.9.1)".into(),
            Listener::Mqtt => "(MQTT 3.1, 3.1.1, 5.0)".into(),
            Listener::Amqps => "for amqps: AMQP 0.9.1 over TLS".into(),
            Listener::Mqtts => "for mqtts: MQTT over TLS".into(),
            Listener::MqttWs => format!("for mqtt-ws: MQTT over WebSocket at {path}"),
            Listener::MqttWss => format!("for mqtt-wss: MQTT over secure WebSocket at {path}"),
        }
    }
}

/// What every connection task of the listeners shares.
#[derive(Clone)]
struct Shared {
    broker: warren_runtime::BrokerHandle,
    amqp: Arc<warren_amqp::AmqpConfig>,
    mqtt: Arc<warren_mqtt::MqttConfig>,
    registry: Arc<warren_mqtt::Registry>,
    tls: Option<Arc<tls::Reloadable>>,
    ws_path: Arc<str>,
    stopped: watch::Receiver<bool>,
}

/// Runs one listener's accept loop; each connection's task does its own TLS and WebSocket
/// handshakes (bounded in time, off the broker's task).
///
/// Each kind of listener spawns its own future type. A task's memory is the size of its
/// future, which is that of its largest state: when one `async` block served every kind, a
/// plain MQTT connection was sized for a TLS handshake under a WebSocket upgrade and for an
/// AMQP connection (14.1 KB of RSS per idle MQTT connection instead of 5.4 KB).
/// `tests::idle_connections_stay_small` bounds the heap per connection over real sockets.
async fn run_listener(
    kind: Listener,
    listener: TcpListener,
    shared: Shared,
) -> std::io::Result<()> {
    use warren_runtime::listener::accept_loop;
    let stopped = shared.stopped.clone();
    match kind {
        Listener::Amqp => {
            accept_loop(listener, stopped, move |socket, addr| {
                serve_amqp(&shared, kind, socket, addr, None)
            })
            .await
        }
        Listener::Mqtt => {
            accept_loop(listener, stopped, move |socket, addr| {
                serve_mqtt(&shared, kind, socket, addr, None)
            })
            .await
        }
        Listener::MqttWs => {
            accept_loop(listener, stopped, move |socket, addr| {
                let shared = shared.clone();
                async move {
                    let Some(ws) = ws_accept(&shared, socket, addr, kind).await else {
                        return;
                    };
                    // Boxed: the serving future is not laid out over the upgrade's.
                    Box::pin(serve_mqtt(&shared, kind, ws, addr, None)).await
                }
            })
            .await
        }
        Listener::Amqps | Listener::Mqtts | Listener::MqttWss => {
            let Some(tls) = shared.tls.clone() else {
                tracing::error!("{} listener without TLS configuration", kind.flag());
                return Ok(());
            };
            accept_loop(listener, stopped, move |socket, addr| {
                let shared = shared.clone();
                let tls = tls.clone();
                async move {
                    let Some((stream, identity)) =
                        tls::accept(&tls, socket, addr, kind.flag()).await
                    else {
                        return;
                    };
                    // Boxed: the serving future is not laid out over the handshake's.
                    match kind {
                        Listener::Amqps => {
                            Box::pin(serve_amqp(&shared, kind, stream, addr, identity)).await
                        }
                        Listener::Mqtts => {
                            Box::pin(serve_mqtt(&shared, kind, stream, addr, identity)).await
                        }
                        _ => {
                            let Some(ws) = ws_accept(&shared, stream, addr, kind).await else {
                                return;
                            };
                            Box::pin(serve_mqtt(&shared, kind, ws, addr, identity)).await
                        }
                    }
                }
            })
            .await
        }
    }
}

/// The stream TLS listener's flag (and, with `_`, its config key and TLS files' prefix).
const STREAM_TLS: &str = "stream-tls";

type Servers = Vec<(&'static str, tokio::task::JoinHandle<std::io::Result<()>>)>;

/// The stream protocol's listeners over `backend`: plain, and TLS (the handshake in each
/// connection's task, as amqps).
fn spawn_streams<B: warren_stream::StreamBackend>(
    backend: Arc<B>,
    plain: Option<tokio::net::TcpListener>,
    tls: Option<(tokio::net::TcpListener, Arc<tls::Reloadable>)>,
    advertised: (Option<String>, Option<u16>),
    stopped: &watch::Receiver<bool>,
    servers: &mut Servers,
) -> std::io::Result<()> {
    // What clients are told to connect to: the settings', else each listener's own. The
    // advertised port is the plain listener's (RabbitMQ has a TLS one of its own): the TLS
    // listener tells its own port.
    let config = |bound: std::net::SocketAddr, port: Option<u16>| {
        Arc::new(warren_stream::StreamConfig {
            advertised_host: advertised
                .0
                .clone()
                .unwrap_or_else(|| bound.ip().to_string()),
            advertised_port: port.unwrap_or(bound.port()),
            ..warren_stream::StreamConfig::default()
        })
    };
    if let Some(listener) = plain {
        let bound = listener.local_addr()?;
        let task = tokio::spawn(warren_stream::serve_with(
            listener,
            backend.clone(),
            config(bound, advertised.1),
            stopped.clone(),
        ));
        servers.push(("stream", task));
        tracing::info!("listening on {bound} (stream)");
    }
    if let Some((listener, tls)) = tls {
        let bound = listener.local_addr()?;
        let handshake = move |socket, addr| {
            let tls = tls.clone();
            async move {
                tls::accept(&tls, socket, addr, STREAM_TLS)
                    .await
                    .map(|(stream, _identity)| stream)
            }
        };
        let task = tokio::spawn(warren_stream::serve_layered(
            listener,
            backend,
            config(bound, None),
            stopped.clone(),
            handshake,
        ));
        servers.push((STREAM_TLS, task));
        tracing::info!("listening on {bound} for stream-tls: the stream protocol over TLS");
    }
    Ok(())
}

/// The WebSocket upgrade of an MQTT-over-WebSocket connection.
async fn ws_accept<S>(
    shared: &Shared,
    stream: S,
    addr: SocketAddr,
    kind: Listener,
) -> Option<ws::WsStream<S>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let max = shared.mqtt.max_packet_size as usize + ws::SLACK;
    ws::accept(stream, &shared.ws_path, max, addr, kind.flag()).await
}

/// One AMQP connection's task, over TCP or TLS.
fn serve_amqp<S>(
    shared: &Shared,
    kind: Listener,
    stream: S,
    addr: SocketAddr,
    identity: Option<String>,
) -> impl Future<Output = ()> + Send + use<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let peer = warren_amqp::PeerInfo {
        addr: addr.to_string(),
        is_loopback: warren_runtime::listener::is_loopback(&addr),
        identity: identity.clone(),
        tls: kind.tls(),
    };
    // The header decides: AMQP 1.0 (RabbitMQ 4's) or 0.9.1, on the same listener.
    let peer10 = warren_amqp10::PeerInfo::new(addr, identity, kind.tls());
    let (b, c, stop) = (
        shared.broker.clone(),
        shared.amqp.clone(),
        shared.stopped.clone(),
    );
    warren_amqp10::dispatch(stream, peer10, b.clone(), stop.clone(), move |s| {
        warren_amqp::serve_connection(s, peer, b, c, stop)
    })
}

/// One MQTT connection's task, over TCP, TLS, WebSocket or both: the gateway's own future,
/// not wrapped in a larger one.
fn serve_mqtt<S>(
    shared: &Shared,
    kind: Listener,
    stream: S,
    addr: SocketAddr,
    identity: Option<String>,
) -> impl Future<Output = ()> + Send + use<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let peer = warren_mqtt::PeerInfo {
        addr: addr.to_string(),
        is_loopback: warren_runtime::listener::is_loopback(&addr),
        identity,
        tls: kind.tls(),
    };
    warren_mqtt::serve_connection(
        stream,
        peer,
        shared.broker.clone(),
        shared.registry.clone(),
        shared.mqtt.clone(),
        shared.stopped.clone(),
    )
}

async fn serve(s: settings::Settings) -> anyhow::Result<()> {
    // Watch the signals before anything else, so that a SIGTERM arriving during start-up
    // stops the broker cleanly once it is up instead of killing the process.
    let mut signals = Signals::watch()?;
    let mut wanted = Vec::new();
    for kind in Listener::ALL {
        for addr in settings::parse_addrs(kind.flag(), kind.addresses(&s), kind.default_port())
            .map_err(ConfigError::from)?
        {
            wanted.push((kind, addr));
        }
    }
    let stream = s.stream_addr().map_err(ConfigError::from)?;
    let stream_tls = s.stream_tls_addr().map_err(ConfigError::from)?;
    if wanted.is_empty() && stream.is_none() && stream_tls.is_none() {
        return Err(ConfigError(
            "nothing to serve: every listener is `none` (--amqp none --mqtt none --stream none)"
                .into(),
        )
        .into());
    }
    let management = s.management_addr().map_err(ConfigError::from)?;
    let prometheus = s.prometheus_addr().map_err(ConfigError::from)?;
    let memory_high_watermark =
        settings::watermark_bytes(&s.memory_high_watermark).map_err(ConfigError::from)?;
    let disk_free_limit =
        settings::disk_free_limit(&s.disk_free_limit).map_err(ConfigError::from)?;
    // One TLS configuration per TLS listener kind in use, each from its own files or the
    // shared --tls-cert/--tls-key/--tls-ca.
    let mut tls_listeners = Vec::new();
    let tls_kinds = Listener::ALL
        .into_iter()
        .filter(|k| k.tls() && wanted.iter().any(|(w, _)| w == k))
        .map(Listener::flag)
        .chain(stream_tls.map(|_| STREAM_TLS));
    for flag in tls_kinds {
        let (cert, key, ca) = s.tls_files_of(flag);
        let (Some(cert), Some(key)) = (cert, key) else {
            return Err(ConfigError(format!(
                "the TLS listener --{flag} needs a certificate and key: --tls-cert PEM and \
                 --tls-key PEM (or --{own}-tls-cert and --{own}-tls-key)",
                own = flag.strip_suffix("-tls").unwrap_or(flag)
            ))
            .into());
        };
        let files = tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.cloned(),
            verify_peer: s.tls_verify_peer,
            fail_if_no_peer_cert: s.tls_fail_if_no_peer_cert,
            login_from: s.tls_login_from,
        };
        tls_listeners.push((flag, files));
    }
    let tls = if tls_listeners.is_empty() {
        None
    } else {
        Some(Arc::new(
            tls::Reloadable::new(tls_listeners).map_err(|e| ConfigError(e.to_string()))?,
        ))
    };
    let cluster_options =
        warren_member::options(&s.cluster_args()).map_err(|e| ConfigError(e.to_string()))?;
    let _lock = open_data_dir(&s.data_dir)?;
    let mut listeners = Vec::new();
    for (kind, addr) in wanted {
        listeners.push((kind, bind(addr, kind.flag()).await?));
    }
    let management_listener = match management {
        Some(addr) => Some(bind(addr, "management").await?),
        None => None,
    };
    let prometheus_listener = match prometheus {
        Some(addr) => Some(bind(addr, "prometheus").await?),
        None => None,
    };
    let stream_listener = match stream {
        Some(addr) => Some(bind(addr, "stream").await?),
        None => None,
    };
    let stream_tls_listener = match stream_tls {
        Some(addr) => Some(bind(addr, STREAM_TLS).await?),
        None => None,
    };
    let seed = warren_runtime::os_seed().context("cannot read OS randomness for names")?;
    // guest/guest keeps the fixed hash a fresh RabbitMQ exports; another password gets a
    // salt of its own.
    let default_pass_hash = if s.default_pass == "guest" && s.default_user == "guest" {
        warren_core::access::DEFAULT_GUEST_HASH.to_vec()
    } else {
        let salt = warren_runtime::os_seed().context("cannot read OS randomness for a salt")?;
        let salt = (salt as u32).to_be_bytes();
        warren_core::access::hash_password(salt, &s.default_pass)
    };
    let config = warren_core::BrokerConfig {
        seed,
        default_user: s.default_user.clone(),
        default_pass_hash,
        memory_high_watermark,
        disk_free_limit: if s.in_memory { 0 } else { disk_free_limit },
        max_retained_messages: s.mqtt_max_retained,
        max_retained_bytes: s.mqtt_max_retained_bytes,
        ..warren_core::BrokerConfig::default()
    };
    // The stream logs, before the broker: its restore reopens the stream queues on them, and
    // the stream protocol serves the same logs.
    let disk_streams = if s.in_memory {
        None
    } else {
        Some(
            warren_stream_backends::DiskStreams::open(
                &s.data_dir,
                s.stream_read_ahead,
                s.stream_sendfile,
                s.fsync == settings::Fsync::On,
            )
            .map_err(|e| ConfigError(format!("cannot open the streams: {e:#}")))?,
        )
    };
    // In memory, one log per stream for AMQP stream queues and the stream protocol too.
    let mem_streams = s.in_memory.then(warren_stream_backends::MemStreams::new);
    // A cluster node's quorum-queue replication: the store layer, then the cluster's.
    let mut replication = None;
    let (broker, definitions_db) = if s.in_memory {
        tracing::warn!(
            shards = s.shards,
            "--in-memory: nothing survives a restart, and a confirm does not mean on disk"
        );
        (
            warren_runtime::BrokerHandle::start_sharded_with_streams(
                config,
                s.shards,
                mem_streams
                    .clone()
                    .map(|m| m as Arc<dyn warren_core::store::SharedStreams>),
            ),
            None,
        )
    } else {
        // Restore before listening: clients see the stored queues from their first
        // connection.
        // A cluster node replicates its quorum queues' writes through their groups.
        replication = cluster_options
            .as_ref()
            .map(|_| warren_member::Replication::new(&s.data_dir));
        let layer = replication
            .clone()
            .map(|repl| Arc::new(repl) as Arc<dyn warren_runtime::StoreLayer>);
        let (broker, definitions_db) = warren_runtime::BrokerHandle::start_with_store_layered(
            config,
            &s.data_dir,
            warren_store::DiskConfig {
                embed_msgs_below: s.embed_msgs_below,
                fsync: s.fsync == settings::Fsync::On,
                streams: disk_streams
                    .clone()
                    .map(|d| d as Arc<dyn warren_store::StreamHost>),
                ..warren_store::DiskConfig::default()
            },
            s.shards,
            layer,
        )
        .map_err(|e| match e {
            // Only a lock says another process has the files.
            warren_runtime::StartError::Open(e) if e.is_locked() => {
                anyhow::Error::new(ConfigError(format!(
                    "{e}; is another warren using --data-dir {}? pass another --data-dir",
                    s.data_dir.display()
                )))
            }
            warren_runtime::StartError::Open(e) if e.is_damaged() => {
                anyhow::Error::new(DamagedData(e.to_string()))
            }
            other => anyhow::Error::new(ConfigError(other.to_string())),
        })?;
        (broker, Some(definitions_db))
    };
    if let Some(d) = &disk_streams {
        d.set_broker(broker.clone());
    }
    if let Some(m) = &mem_streams {
        m.set_broker(broker.clone());
    }
    tracing::info!(
        "memory alarm at {} MiB (queued message bodies or the process's RSS), free disk limit {} MB",
        memory_high_watermark >> 20,
        if s.in_memory {
            0
        } else {
            disk_free_limit / 1_000_000
        }
    );
    // Measured on a timer, decided by the core (the alarms' hysteresis is there).
    broker.watch_resources(warren_runtime::ResourceWatch {
        interval: std::time::Duration::from_secs(1),
        memory: true,
        disk: (!s.in_memory && disk_free_limit > 0).then(|| s.data_dir.clone()),
        // Freed heap goes back to the OS once RSS nears the point where the alarm clears.
        trim_above: memory_high_watermark / 10 * 8,
    });
    // Before any client or operator can reach the broker: from here on its metadata
    // changes go through the cluster.
    let cluster = match cluster_options.zip(replication) {
        Some((opts, repl)) => Some(
            warren_member::Cluster::start(opts, &broker, repl)
                .await
                .map_err(|e| ConfigError(format!("cluster: {:#}", anyhow::Error::new(e))))?,
        ),
        None => None,
    };
    let (stop, stopped) = watch::channel(false);
    let admin = admin::bind(&s.data_dir).map_err(|e| ConfigError(format!("{e:#}")))?;
    let mqtt_config = warren_mqtt::MqttConfig {
        max_packet_size: s.mqtt_max_packet_size,
        max_inflight: s.mqtt_max_inflight,
        server_keep_alive: s.mqtt_server_keep_alive,
        max_offline_messages: s.mqtt_max_offline_messages,
        use_identity_as_username: s.mqtt_use_identity_as_username,
        sys_interval: (s.sys_interval > 0).then(|| std::time::Duration::from_secs(s.sys_interval)),
        ..warren_mqtt::MqttConfig::default()
    };
    let mut mqtt_writer = None;
    let serves_mqtt = listeners.iter().any(|(kind, _)| !kind.is_amqp());
    let registry = if serves_mqtt {
        // Bounded offline queues for persistent sessions, as a policy operators can see.
        // Every node sets its own at start (a cluster member does not wait for a quorum).
        match broker
            .admin_local(warren_runtime::AdminRequest::SetPolicy(
                mqtt_config.offline_policy(),
            ))
            .await
        {
            Ok(warren_runtime::AdminResponse::Done(Ok(()))) => {}
            other => {
                tracing::warn!(answer = %Escaped(&format!("{other:?}")), "cannot bound MQTT offline queues")
            }
        }
        match definitions_db {
            Some(db) => {
                let (registry, writer) = mqtt_registry(db, &mqtt_config.vhost)?;
                mqtt_writer = Some(writer);
                registry
            }
            None => warren_mqtt::Registry::new(),
        }
    } else {
        warren_mqtt::Registry::new()
    };
    let shared = Shared {
        broker: broker.clone(),
        amqp: Arc::new(warren_amqp::AmqpConfig::default()),
        mqtt: Arc::new(mqtt_config),
        registry: Arc::new(registry),
        tls: tls.clone(),
        ws_path: s.mqtt_ws_path.as_str().into(),
        stopped: stopped.clone(),
    };
    // On a cluster node, one MQTT session per client id across the nodes (docs/cluster.md,
    // "MQTT sessions across nodes").
    let mqtt_cluster = cluster
        .as_ref()
        .filter(|_| serves_mqtt)
        .map(|c| c.serve_mqtt(&shared.registry, &shared.mqtt.vhost));
    let mut gauges = Vec::new();
    // Restored delayed wills and the expiry of offline sessions: once for all MQTT listeners.
    let mqtt_sessions = serves_mqtt.then(|| {
        mqtt_gauges(&shared.registry, &mut gauges);
        warren_mqtt::start_session_tasks(&broker, &shared.registry, &shared.mqtt, &stopped)
    });
    let mut servers = Vec::new();
    let mut node_listeners = Vec::new();
    for (kind, listener) in listeners {
        let bound = listener.local_addr()?;
        node_listeners.push(warren_management::Listener {
            protocol: kind.protocol(),
            addr: bound,
        });
        servers.push((
            kind.flag(),
            tokio::spawn(run_listener(kind, listener, shared.clone())),
        ));
        if kind == Listener::Amqp {
            tracing::info!(data_dir = %s.data_dir.display(), "listening on {bound} {}", kind.describe(&s.mqtt_ws_path));
        } else {
            tracing::info!("listening on {bound} {}", kind.describe(&s.mqtt_ws_path));
        }
    }
    drop(shared);
    for (protocol, listener) in [
        ("http", &management_listener),
        ("http/prometheus", &prometheus_listener),
        ("stream", &stream_listener),
        ("stream/ssl", &stream_tls_listener),
    ] {
        if let Some(addr) = listener.as_ref().and_then(|l| l.local_addr().ok()) {
            node_listeners.push(warren_management::Listener { protocol, addr });
        }
    }
    let data_dir = (!s.in_memory).then(|| s.data_dir.clone());
    let local_ends = links::local(&node_listeners);
    let node = warren_management::NodeInfo::local(node_listeners, data_dir);
    let node_name = node.name.clone();
    let management = warren_management::Management::new(broker.clone(), node, gauges);
    links::start(
        broker.clone(),
        &management,
        local_ends,
        (node_name, cluster.as_ref().map(|c| c.leads_metadata())),
        (s.bridge.clone(), s.shovel.clone()),
        stopped.clone(),
    );
    if let Some(repl) = cluster.as_ref().map(|c| c.replication()) {
        let repl = repl.clone();
        let critical = repl.clone();
        management.set_placement(Box::new(move |vhost, name| repl.placement(vhost, name)));
        management.set_quorum_critical(Box::new(move || critical.quorum_critical()));
    }
    tokio::spawn(admin::serve(
        admin,
        cluster.clone(),
        broker.clone(),
        management.clone(),
        tls.clone(),
        stopped.clone(),
    ));
    if let Some(listener) = management_listener {
        let bound = listener.local_addr()?;
        servers.push((
            "management",
            tokio::spawn(warren_management::serve_api(
                listener,
                management.clone(),
                stopped.clone(),
            )),
        ));
        tracing::info!("listening on {bound} (HTTP management API)");
    }
    let stream_tls_listener = stream_tls_listener.zip(tls.clone());
    let advertised = (s.stream_advertised_host.clone(), s.stream_advertised_port);
    if let Some(m) = mem_streams.clone() {
        spawn_streams(
            m,
            stream_listener,
            stream_tls_listener,
            advertised.clone(),
            &stopped,
            &mut servers,
        )?;
    } else if let Some(d) = disk_streams.clone() {
        spawn_streams(
            d,
            stream_listener,
            stream_tls_listener,
            advertised.clone(),
            &stopped,
            &mut servers,
        )?;
    }
    if let Some(listener) = prometheus_listener {
        let bound = listener.local_addr()?;
        servers.push((
            "prometheus",
            tokio::spawn(warren_management::serve_metrics(
                listener,
                management,
                stopped.clone(),
            )),
        ));
        tracing::info!("listening on {bound} (Prometheus metrics)");
    }
    loop {
        match signals.wait().await {
            Signal::Stop(name) => {
                tracing::info!("{name} received");
                break;
            }
            Signal::Reload => {
                match &tls {
                    Some(tls) => match tls.reload() {
                        Ok(()) => tracing::info!("SIGHUP: TLS certificate files reloaded"),
                        Err(e) => {
                            tracing::warn!("SIGHUP: TLS files not reloaded, keeping the old: {e}")
                        }
                    },
                    None => tracing::info!("SIGHUP: no TLS configured, nothing to reload"),
                }
                match cluster.as_ref().map_or(Ok(false), |c| c.reload_tls()) {
                    Ok(true) => tracing::info!("SIGHUP: cluster TLS files reloaded"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(
                        "SIGHUP: cluster TLS files not reloaded, keeping the old: {e}"
                    ),
                }
            }
        }
    }
    tracing::info!("shutting down: closing connections");
    let _ = stop.send(true);
    for (flag, server) in servers {
        server
            .await
            .with_context(|| format!("{flag} listener task failed"))??;
    }
    // The cluster stops once the connections closed: their last MQTT session states (the
    // offline sessions the shutdown made) reach the cluster's records first, so a client
    // resuming on another node while this one is down waits for no handover.
    if let Some(sessions) = &mqtt_cluster {
        sessions.flush(std::time::Duration::from_secs(5)).await;
    }
    if let Some(cluster) = &cluster {
        cluster.stop().await;
    }
    if let Some(sessions) = mqtt_sessions {
        sessions.abort();
    }
    if let Some(writer) = mqtt_writer {
        // The sessions the shutdown closed are stored before the process exits, so they
        // resume (and their expiry counts from now) after the restart.
        let flushed =
            tokio::task::spawn_blocking(move || writer.flush(std::time::Duration::from_secs(10)))
                .await
                .unwrap_or(false);
        if !flushed {
            tracing::warn!("MQTT sessions not all stored at shutdown");
        }
    }
    // Everything acked, purged or deleted is made durable before the process ends, so a
    // restart after a clean stop redelivers nothing that was acked.
    tracing::info!("syncing the store");
    if !broker.stop().await {
        anyhow::bail!("stopped without syncing the store (see the error above)");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Prepares the data directory before anything reads or writes it: the process creates
/// everything owner-only from here on (umask 077: directories 0700, files and the admin
/// socket 0600 from their creation, as RabbitMQ keeps its mnesia directory closed), and
/// only one broker may use the directory (`warren_store::lock`), so a second one exits
/// with code 2 before it touches anything.
fn open_data_dir(dir: &std::path::Path) -> anyhow::Result<warren_store::lock::DirLock> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    // SAFETY: umask only swaps the process's file-creation mask; it cannot fail.
    unsafe {
        libc::umask(0o077);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| {
            ConfigError(format!(
                "cannot create data dir {}: {e}; pass --data-dir DIR with a writable path",
                dir.display()
            ))
        })?;
    let lock = warren_store::lock::DirLock::acquire(dir).map_err(|e| {
        ConfigError(format!(
            "{e}; stop it first or pass another --data-dir (nothing in {} was touched)",
            dir.display()
        ))
    })?;
    // A directory made by an older version (or by hand) readable by others: its files hold
    // message bodies and password hashes.
    if let Ok(meta) = std::fs::metadata(dir)
        && meta.permissions().mode() & 0o077 != 0
    {
        match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
            Ok(()) => {
                tracing::info!(data_dir = %dir.display(), "data dir restricted to its owner (0700)")
            }
            Err(e) => {
                tracing::warn!(data_dir = %dir.display(), error = %e, "cannot restrict the data dir to its owner")
            }
        }
    }
    Ok(lock)
}

/// MQTT gauges for Prometheus: connected clients, stored sessions (retained messages are the
/// core's: `warren_mqtt_retained_messages` in metrics.rs).
fn mqtt_gauges(registry: &Arc<warren_mqtt::Registry>, gauges: &mut Vec<warren_management::Gauge>) {
    let r = registry.clone();
    gauges.push(warren_management::Gauge {
        name: "warren_mqtt_clients",
        help: "MQTT clients connected (with a claimed client id)",
        value: Box::new(move || r.clients() as u64),
    });
    let r = registry.clone();
    gauges.push(warren_management::Gauge {
        name: "warren_mqtt_stored_sessions",
        help: "Persistent MQTT sessions kept for clients not connected",
        value: Box::new(move || r.stored_sessions() as u64),
    });
}

/// The MQTT session registry, with the sessions stored under the data dir and a writer that
/// stores every later change.
fn mqtt_registry(
    defs: warren_store::definitions::DefinitionStore,
    vhost: &str,
) -> anyhow::Result<(warren_mqtt::Registry, warren_store::mqtt_writer::MqttWriter)> {
    let now = warren_mqtt::connection::now_ms();
    let sessions: Vec<_> = defs
        .load_mqtt_sessions()
        .map_err(|e| {
            DamagedData(format!(
                "cannot read the stored MQTT sessions in definitions.redb of the data dir: {e}; \
                 to recover, stop warren, move that file away (or restore it from a backup) and \
                 start again"
            ))
        })?
        .into_iter()
        .filter(|(v, _, _)| v == vhost)
        .map(|(_, id, s)| {
            (
                std::sync::Arc::from(id),
                warren_mqtt::session::SessionRecord::from_stored(s, now),
            )
        })
        .collect();
    if !sessions.is_empty() {
        tracing::info!(count = sessions.len(), "restored MQTT sessions");
    }
    let writer = warren_store::mqtt_writer::MqttWriter::start(defs)
        .context("cannot start the MQTT state writer")?;
    let session_writer = writer.clone();
    let session_vhost = vhost.to_string();
    let registry = warren_mqtt::Registry::new().with_sessions(
        sessions,
        Box::new(move |client_id, s| session_writer.set_session(&session_vhost, client_id, s)),
    );
    Ok((registry, writer))
}

/// Binds a listener for `--{flag}`, with a hint when the address is taken.
async fn bind(addr: SocketAddr, flag: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            format!("is another broker running? pass --{flag} ADDR or --{flag} none")
        } else {
            format!("pass --{flag} ADDR with an address this machine has")
        };
        ConfigError(format!("cannot listen on {addr} (--{flag}): {e}; {hint}")).into()
    })
}

enum Signal {
    Stop(&'static str),
    Reload,
}

/// SIGINT (Ctrl-C), SIGTERM and SIGHUP, registered up front.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn watch() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
            term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
            hup: signal(SignalKind::hangup()).context("cannot watch SIGHUP")?,
        })
    }

    async fn wait(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::Stop("SIGINT"),
            _ = self.term.recv() => Signal::Stop("SIGTERM"),
            _ = self.hup.recv() => Signal::Reload,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every `serve` flag (but --config) is a config-file key, and the example warren.toml
    /// names it: the "every flag has a key", kept true as flags are added.
    #[test]
    fn every_serve_flag_is_a_config_key_documented_in_the_example() {
        let cli = Cli::command();
        let serve = cli.find_subcommand("serve").expect("serve");
        let example = include_str!("../../warren.toml");
        let mut checked = 0;
        for arg in serve.get_arguments() {
            let Some(flag) = arg.get_long() else {
                continue;
            };
            if flag == "config" || flag == "help" {
                continue;
            }
            let key = flag.replace('-', "_");
            // A value of the wrong type is refused as such; an unknown key as unknown.
            let error = toml::from_str::<settings::Settings>(&format!("{key} = {{}}"))
                .expect_err("a table is no setting's value");
            assert!(
                !error.message().contains("unknown field"),
                "--{flag} has no config key {key}: {error}"
            );
            assert!(
                example.contains(&format!("{key} =")),
                "warren.toml does not document {key}"
            );
            checked += 1;
        }
        assert!(checked > 30, "only {checked} flags seen");
    }
}
