//! `warren`: the broker binary. `warren serve` runs the broker; admin and bench subcommands
//! grow here.

mod admin;
mod alloc;
mod bench;
mod ctl;

/// Counts live heap bytes when `warren bench conns --socketless` turns it on.
#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

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
    Serve(ServeArgs),
    /// Inspect and manage a running broker (rabbitmqctl's verbs), through the admin socket
    /// in its data directory.
    Ctl(ctl::CtlArgs),
    /// Load generators and measurements: AMQP workloads against any broker address, idle
    /// MQTT connections.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// AMQP 0.9.1 listen address, or `none`.
    #[arg(long, default_value = "127.0.0.1:5672")]
    amqp: String,
    /// MQTT listen address, or `none`.
    #[arg(long, default_value = "127.0.0.1:1883")]
    mqtt: String,
    /// Where the broker keeps its data.
    #[arg(long, default_value = "./warren-data")]
    data_dir: PathBuf,
    /// Memory above which publishers are blocked until consumers catch up (RabbitMQ's
    /// vm_memory_high_watermark): a fraction of this machine's RAM (`0.4`) or an absolute
    /// size (`512MiB`, `2GB`). Compared with the larger of the queued message bodies and
    /// the process's resident memory; publishers are unblocked at 90% of it.
    #[arg(long, default_value = "0.4")]
    memory_high_watermark: String,
    /// Free space on the data directory's disk below which publishers are blocked
    /// (RabbitMQ's disk_free_limit): bytes or a size such as `50MB`, `1GiB`; `0` turns the
    /// check off. Unblocked once 10% above it. Not checked with `--in-memory`.
    #[arg(long, default_value = "50MB")]
    disk_free_limit: String,
    /// Whether publisher confirms of persistent messages wait for fsync (`on`, the default:
    /// confirmed means on disk) or only for the write to the OS (`off`: survives a broker
    /// crash, not a power cut; lower latency, as RabbitMQ's classic queues).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    fsync: String,
    /// Message bodies of at least this many bytes are stored once in the shared store;
    /// smaller ones inline in each queue's segment files.
    #[arg(long, default_value_t = 4096)]
    embed_msgs_below: usize,
    /// Keep everything in memory: no message log, no stored definitions (nothing survives
    /// a restart, and a confirm does not mean on disk). The data dir holds only the admin
    /// socket.
    #[arg(long)]
    in_memory: bool,
    /// Broker shards, each a task owning the queues its connections declare, with its own
    /// message log (ARCHITECTURE.md, "warren-runtime"): queue work spreads over up to this
    /// many cores. Fixed for a data directory once it holds queues. Experimental: on a
    /// small machine one shard is faster (docs/benchmarks.md, "Shards").
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    shards: u32,
    /// HTTP management API listen address (RabbitMQ's /api, basic auth), or `none`.
    #[arg(long, default_value = "127.0.0.1:15672")]
    management: String,
    /// Prometheus metrics listen address (`/metrics`), or `none`.
    #[arg(long, default_value = "127.0.0.1:15692")]
    prometheus: String,
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
fn parse_size(text: &str) -> Option<u64> {
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

/// The memory alarm threshold in bytes: `text` is a fraction of RAM or an absolute size.
fn watermark_bytes(text: &str) -> Result<u64, ConfigError> {
    let fraction = match text.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => f,
        // A plain number above 1 is an absolute size in bytes, as RabbitMQ's
        // `vm_memory_high_watermark.absolute`.
        _ => {
            return parse_size(text).filter(|&n| n > 0).ok_or_else(|| {
                ConfigError(format!(
                    "--memory-high-watermark {text:?} must be a fraction of RAM in (0, 1] \
                     (e.g. 0.4) or a size (e.g. 512MiB)"
                ))
            });
        }
    };
    let total = total_memory().unwrap_or_else(|| {
        tracing::warn!("cannot read /proc/meminfo; assuming 1 GiB of RAM for the memory alarm");
        1 << 30
    });
    Ok((total as f64 * fraction) as u64)
}

/// Exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration (address, data dir).
const EXIT_CONFIG: u8 = 2;

fn parse_listen(flag: &str, value: &str) -> anyhow::Result<Option<SocketAddr>> {
    if value == "none" {
        return Ok(None);
    }
    value.parse().map(Some).with_context(|| {
        format!("--{flag} {value:?} is not an address like 127.0.0.1:5672 (or `none`)")
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
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
        Command::Serve(args) => match runtime.block_on(serve(args)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(e.downcast_ref::<ConfigError>().map_or(1, |_| EXIT_CONFIG))
            }
        },
        Command::Bench { command } => match runtime.block_on(bench::run(command)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Ctl(args) => match ctl::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

/// A problem the operator fixes by changing flags or the environment (exit code 2).
#[derive(Debug)]
struct ConfigError(String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Watch the signals before anything else, so that a SIGTERM arriving during start-up
    // stops the broker cleanly once it is up instead of killing the process.
    let signals = Signals::watch()?;
    let amqp = parse_listen("amqp", &args.amqp).map_err(|e| ConfigError(format!("{e:#}")))?;
    let mqtt = parse_listen("mqtt", &args.mqtt).map_err(|e| ConfigError(format!("{e:#}")))?;
    let management =
        parse_listen("management", &args.management).map_err(|e| ConfigError(format!("{e:#}")))?;
    let prometheus =
        parse_listen("prometheus", &args.prometheus).map_err(|e| ConfigError(format!("{e:#}")))?;
    let memory_high_watermark = watermark_bytes(&args.memory_high_watermark)?;
    let disk_free_limit = parse_size(&args.disk_free_limit).ok_or_else(|| {
        ConfigError(format!(
            "--disk-free-limit {:?} must be a size, e.g. 50MB or 1GiB (0: no check)",
            args.disk_free_limit
        ))
    })?;
    let _lock = open_data_dir(&args.data_dir)?;
    if amqp.is_none() && mqtt.is_none() {
        return Err(ConfigError("nothing to serve: --amqp none and --mqtt none".into()).into());
    }
    let amqp_listener = match amqp {
        Some(addr) => Some(bind(addr, "amqp", "RabbitMQ").await?),
        None => None,
    };
    let mqtt_listener = match mqtt {
        Some(addr) => Some(bind(addr, "mqtt", "Mosquitto").await?),
        None => None,
    };
    let management_listener = match management {
        Some(addr) => Some(bind(addr, "management", "RabbitMQ's management plugin").await?),
        None => None,
    };
    let prometheus_listener = match prometheus {
        Some(addr) => Some(bind(addr, "prometheus", "RabbitMQ's prometheus plugin").await?),
        None => None,
    };
    let seed = warren_runtime::os_seed().context("cannot read OS randomness for names")?;
    let config = warren_core::BrokerConfig {
        seed,
        memory_high_watermark,
        disk_free_limit: if args.in_memory { 0 } else { disk_free_limit },
        ..warren_core::BrokerConfig::default()
    };
    let (broker, definitions_db) = if args.in_memory {
        tracing::warn!(
            shards = args.shards,
            "--in-memory: nothing survives a restart, and a confirm does not mean on disk"
        );
        (
            warren_runtime::BrokerHandle::start_sharded(config, args.shards),
            None,
        )
    } else {
        // Restore before listening: clients see the stored queues from their first
        // connection.
        let (broker, definitions_db) = warren_runtime::BrokerHandle::start_with_store_sharded(
            config,
            &args.data_dir,
            warren_store::DiskConfig {
                embed_msgs_below: args.embed_msgs_below,
                fsync: args.fsync == "on",
                ..warren_store::DiskConfig::default()
            },
            args.shards,
        )
        .map_err(|e| match e {
            warren_runtime::StartError::Open(e) => ConfigError(format!(
                "{e}; is another warren using --data-dir {}? pass another --data-dir",
                args.data_dir.display()
            )),
            other => ConfigError(other.to_string()),
        })?;
        (broker, Some(definitions_db))
    };
    tracing::info!(
        "memory alarm at {} MiB (queued message bodies or the process's RSS), free disk limit {} MB",
        memory_high_watermark >> 20,
        if args.in_memory {
            0
        } else {
            disk_free_limit / 1_000_000
        }
    );
    // Measured on a timer, decided by the core (the alarms' hysteresis is there).
    broker.watch_resources(warren_runtime::ResourceWatch {
        interval: std::time::Duration::from_secs(1),
        memory: true,
        disk: (!args.in_memory && disk_free_limit > 0).then(|| args.data_dir.clone()),
        // Freed heap goes back to the OS once RSS nears the point where the alarm clears.
        trim_above: memory_high_watermark / 10 * 8,
    });
    let (stop, stopped) = watch::channel(false);
    let admin = admin::bind(&args.data_dir).map_err(|e| ConfigError(format!("{e:#}")))?;
    let mut servers = Vec::new();
    let mut mqtt_writer = None;
    let mut gauges = Vec::new();
    let (mut amqp_bound, mut mqtt_bound) = (None, None);
    if let Some(listener) = amqp_listener {
        let bound = listener.local_addr()?;
        amqp_bound = Some(bound);
        let config = Arc::new(warren_amqp::AmqpConfig::default());
        servers.push((
            "AMQP",
            tokio::spawn(warren_amqp::serve(
                listener,
                broker.clone(),
                config,
                stopped.clone(),
            )),
        ));
        tracing::info!(data_dir = %args.data_dir.display(), "listening on {bound} (AMQP 0.9.1)");
    }
    if let Some(listener) = mqtt_listener {
        let bound = listener.local_addr()?;
        mqtt_bound = Some(bound);
        let config = Arc::new(warren_mqtt::MqttConfig::default());
        // Bounded offline queues for persistent sessions, as a policy operators can see.
        match broker
            .admin(warren_runtime::AdminRequest::SetPolicy(
                config.offline_policy(),
            ))
            .await
        {
            Ok(warren_runtime::AdminResponse::Done(Ok(()))) => {}
            other => tracing::warn!(?other, "cannot bound MQTT offline queues"),
        }
        let registry = Arc::new(match definitions_db {
            Some(db) => {
                let (registry, writer) = mqtt_registry(db, &config.vhost)?;
                mqtt_writer = Some(writer);
                registry
            }
            None => warren_mqtt::Registry::new(),
        });
        mqtt_gauges(&registry, &mut gauges);
        servers.push((
            "MQTT",
            tokio::spawn(warren_mqtt::serve_with(
                listener,
                broker.clone(),
                registry,
                config,
                stopped.clone(),
            )),
        ));
        tracing::info!("listening on {bound} (MQTT 3.1, 3.1.1, 5.0)");
    }
    let mut listeners = Vec::new();
    for (protocol, listener) in [
        ("amqp", amqp_bound),
        ("mqtt", mqtt_bound),
        (
            "http",
            management_listener
                .as_ref()
                .and_then(|l| l.local_addr().ok()),
        ),
        (
            "http/prometheus",
            prometheus_listener
                .as_ref()
                .and_then(|l| l.local_addr().ok()),
        ),
    ] {
        if let Some(addr) = listener {
            listeners.push(warren_management::Listener { protocol, addr });
        }
    }
    let data_dir = (!args.in_memory).then(|| args.data_dir.clone());
    let node = warren_management::NodeInfo::local(listeners, data_dir);
    let management = warren_management::Management::new(broker.clone(), node, gauges);
    tokio::spawn(admin::serve(
        admin,
        broker.clone(),
        management.clone(),
        stopped.clone(),
    ));
    if let Some(listener) = management_listener {
        let bound = listener.local_addr()?;
        servers.push((
            "HTTP API",
            tokio::spawn(warren_management::serve_api(
                listener,
                management.clone(),
                stopped.clone(),
            )),
        ));
        tracing::info!("listening on {bound} (HTTP management API)");
    }
    if let Some(listener) = prometheus_listener {
        let bound = listener.local_addr()?;
        servers.push((
            "Prometheus",
            tokio::spawn(warren_management::serve_metrics(
                listener,
                management,
                stopped.clone(),
            )),
        ));
        tracing::info!("listening on {bound} (Prometheus metrics)");
    }
    signals.wait().await;
    tracing::info!("shutting down: closing connections");
    let _ = stop.send(true);
    for (name, server) in servers {
        server
            .await
            .with_context(|| format!("{name} listener task failed"))??;
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

/// MQTT gauges for Prometheus: connected clients, stored sessions, retained messages.
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
    let r = registry.clone();
    gauges.push(warren_management::Gauge {
        name: "warren_mqtt_retained_messages",
        help: "MQTT retained messages held",
        value: Box::new(move || r.retained().len() as u64),
    });
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

/// The MQTT session registry, with the retained messages and sessions stored under the data
/// dir and a writer that stores every later change.
fn mqtt_registry(
    defs: warren_store::definitions::DefinitionStore,
    vhost: &str,
) -> anyhow::Result<(warren_mqtt::Registry, warren_store::retained::MqttWriter)> {
    let mut retained = warren_core::mqtt::RetainedStore::new();
    let stored = defs
        .load_retained()
        .context("cannot read the stored MQTT retained messages")?;
    let count = stored.len();
    for (vhost, m) in stored {
        retained.set(&vhost, m);
    }
    if count > 0 {
        tracing::info!(count, "restored MQTT retained messages");
    }
    let now = warren_mqtt::connection::now_ms();
    let sessions: Vec<_> = defs
        .load_mqtt_sessions()
        .context("cannot read the stored MQTT sessions")?
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
    let writer = warren_store::retained::MqttWriter::start(defs)
        .context("cannot start the MQTT state writer")?;
    let (retained_writer, session_writer) = (writer.clone(), writer.clone());
    let session_vhost = vhost.to_string();
    let registry = warren_mqtt::Registry::with_retained(
        retained,
        Box::new(move |vhost, m| retained_writer.set(vhost, m)),
    )
    .with_sessions(
        sessions,
        Box::new(move |client_id, s| session_writer.set_session(&session_vhost, client_id, s)),
    );
    Ok((registry, writer))
}

/// Binds a listener for `--{flag}`, with a hint when the address is taken.
async fn bind(addr: SocketAddr, flag: &str, usual: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            format!("is another broker ({usual}?) running? pass --{flag} ADDR or --{flag} none")
        } else {
            format!("pass --{flag} ADDR with an address this machine has")
        };
        ConfigError(format!("cannot listen on {addr}: {e}; {hint}")).into()
    })
}

/// SIGINT (Ctrl-C) and SIGTERM, registered up front.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn watch() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
            term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
        })
    }

    async fn wait(mut self) {
        let name = tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        };
        tracing::info!("{name} received");
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_size, watermark_bytes};

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
}
