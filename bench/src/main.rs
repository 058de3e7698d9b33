//! `warren-bench`: load generators that run against any broker address and report rates,
//! latency and (with `--broker-pid`) the broker's memory and CPU. A binary of its own so the
//! `warren` server carries neither the clients nor the counting allocator below.
//!
//! Code map: `client` (a lean AMQP 0.9.1 client for load generation), `workloads` (the AMQP
//! workloads as plans of queues, producers and consumers), `mqtt_client` and
//! `mqtt_workloads` (the same for MQTT 3.1.1), `runner` (what every workload shares:
//! timestamps, counters, timeline, progress and /proc sampling), `report` (latency
//! histogram, table/JSON/CSV output), `svg` (plots over time); `conns` (idle MQTT or AMQP
//! connections; the AMQP side in `idle_amqp`); `alloc` (warren-runtime's counting
//! allocator, which `conns --socketless` reads); `streams` (seed 003's stream table over the stream
//! protocol). Each kind of bench is one `BenchCommand` variant.

use warren_runtime::counting as alloc;
mod client;
mod conns;
mod delayed;
mod handshakes;
mod idle_amqp;
mod mqtt_client;
mod mqtt_workloads;
mod report;
mod runner;
mod stream_publish;
mod streams;
mod svg;
mod transport;
mod workloads;

use anyhow::bail;
use clap::Parser;
use report::Format;
use std::path::PathBuf;
use std::process::ExitCode;
use tracing_subscriber::EnvFilter;

/// Counts live heap bytes (this process's: the client's, and with `conns --socketless` the
/// in-process broker's) once `conns --socketless` turns it on.
#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

#[derive(Parser)]
#[command(
    name = "warren-bench",
    version,
    about = "Load generators and measurements: AMQP and MQTT workloads against any broker \
             address, idle connections"
)]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The in-process broker of `conns --socketless` logs through tracing; warnings only by
    // default, not a line per connection (RUST_LOG=info shows them).
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
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
    match runtime.block_on(run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[derive(clap::Subcommand)]
enum BenchCommand {
    /// 1 producer, 1 consumer, one queue (PerfTest -x 1 -y 1).
    #[command(alias = "one_fast")]
    OneFast(RunArgs),
    /// 2 producers, no consumers: builds a backlog in `warren-bench-backlog` (kept for drain).
    #[command(alias = "two_publishers_no_consumers")]
    TwoPublishers(RunArgs),
    /// 1 consumer empties `warren-bench-backlog` (filled first when empty), then deletes it.
    #[command(alias = "one_consumer_no_publishers")]
    Drain(RunArgs),
    /// 5 queues with a producer (10k msg/s unless --rate) and a consumer each.
    Fivers(RunArgs),
    /// 1 producer to amq.fanout, 10 queues with a consumer each.
    Fanout10(RunArgs),
    /// Confirm latency: 1 producer with 1 message in flight, 1 acking consumer.
    #[command(alias = "one_one_one")]
    OneOneOne(RunArgs),
    /// one-fast with acks at prefetch 1, 10, 100, 1000 and unlimited.
    PrefetchSweep(RunArgs),
    /// --queues queues (default 100), each with its own producer and consumer connection
    /// (confirm window 100 unless --confirm).
    ManyQueues(RunArgs),
    /// MQTT QoS 0, one publisher -> one subscriber on one topic.
    MqttQos0(RunArgs),
    /// MQTT QoS 1 one-to-one (publisher window --window, subscriber PUBACKs).
    MqttQos1(RunArgs),
    /// MQTT QoS 2 one-to-one (PUBREC/PUBREL/PUBCOMP both ways).
    MqttQos2(RunArgs),
    /// MQTT: --fan publishers (10) -> 1 subscriber at --qos.
    MqttFanIn(RunArgs),
    /// MQTT: 1 publisher -> --fan subscribers (10) at --qos.
    MqttFanOut(RunArgs),
    /// Every MQTT workload above.
    MqttAll(RunArgs),
    /// Every AMQP workload above, then every MQTT one when --mqtt is given.
    All(RunArgs),
    /// Many idle MQTT connections: broker memory per connection, connects per second,
    /// keep-alive CPU and publish -> deliver latency while they are held.
    Conns(conns::ConnsArgs),
    /// Connections opened and closed per second (TCP, TLS and WebSocket handshakes plus the
    /// protocol's), per --uri and --mqtt target: plain against TLS.
    Handshakes(handshakes::HandshakeArgs),
    /// Delayed delivery: scheduling rate with confirms, due-delivery rate, lateness, RSS.
    Delayed(delayed::DelayedArgs),
    /// Streams (seed 003): fill one stream per (message size, chunk size) with confirms,
    /// then consume each from `first` over the stream protocol; msg/s per cell.
    Stream(streams::StreamArgs),
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// The broker to load (AMQP workloads): `amqp://user:pass@host:port/vhost`, or
    /// `amqps://` over TLS (any server certificate trusted, as PerfTest).
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672")]
    uri: String,
    /// The broker's MQTT address, `host:port` or `mqtt://[user:pass@]host:port`, `mqtts://`
    /// (TLS), `ws://host:port/path` or `wss://` (WebSocket, path default /mqtt) (MQTT
    /// workloads; default 127.0.0.1:1883 for them; `all` runs them only when given).
    #[arg(long)]
    mqtt: Option<String>,
    /// QoS of mqtt-fan-in and mqtt-fan-out.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=2))]
    qos: u8,
    /// Publishers of mqtt-fan-in, subscribers of mqtt-fan-out.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    fan: u32,
    /// MQTT QoS 1/2 messages in flight per publisher (as a Receive Maximum would allow).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=32768))]
    window: u32,
    /// Messages per second per producer (PerfTest -r); 0: as fast as possible.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// MQTT: publishers stop while they are this many messages ahead of what the
    /// subscribers received (0: no limit). Measures the rate a broker sustains without a
    /// backlog, whatever it acknowledges (`bench/README.md`, "MQTT: a fair harness").
    #[arg(long, default_value_t = 0)]
    lead: u64,
    /// Messages per producer (PerfTest -C); 0: until --seconds. A run ends at whichever
    /// comes first.
    #[arg(long, default_value_t = 0)]
    count: u64,
    /// Queues of many-queues.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    queues: u64,
    /// Write one SVG per workload (received rate and latency over time) into this directory.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// How long each run publishes and consumes.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    seconds: u64,
    /// Message body size in bytes (the first 8 carry the send timestamp).
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(8..=131_064))]
    size: u64,
    /// Publisher confirms with at most N unconfirmed messages per producer (0: no confirms).
    #[arg(long, default_value_t = 0)]
    confirm: u32,
    /// Consumers use automatic acknowledgement (PerfTest -a); default: manual acks.
    #[arg(long)]
    autoack: bool,
    /// Manual acks: 0 acks each message (PerfTest's default); N sends one `multiple` ack
    /// per N messages and at the end of each socket read (PerfTest -A N, roughly).
    #[arg(long, default_value_t = 0)]
    multi_ack_every: u64,
    /// AMQP publishes per socket write; 0: as many as fit 64 KiB. PerfTest's Java client
    /// writes each publish on its own (1), which costs a broker more reads per message.
    #[arg(long, default_value_t = 0)]
    flush_every: u64,
    /// Consumer prefetch (basic.qos); 0 means unlimited.
    #[arg(long, default_value_t = 0)]
    prefetch: u16,
    /// Durable queues and persistent messages (PerfTest -f persistent).
    #[arg(long)]
    persistent: bool,
    /// Sample this process's RSS and CPU from /proc (the broker's pid).
    #[arg(long)]
    broker_pid: Option<u32>,
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
}

async fn run(command: BenchCommand) -> anyhow::Result<()> {
    let (workload, a) = match command {
        BenchCommand::Conns(args) => return conns::run(args).await,
        BenchCommand::Stream(args) => return streams::run(args).await,
        BenchCommand::Handshakes(args) => return handshakes::run(args).await,
        BenchCommand::Delayed(args) => return delayed::run(args).await,
        BenchCommand::OneFast(a) => ("one-fast", a),
        BenchCommand::TwoPublishers(a) => ("two-publishers", a),
        BenchCommand::Drain(a) => ("drain", a),
        BenchCommand::Fivers(a) => ("fivers", a),
        BenchCommand::Fanout10(a) => ("fanout10", a),
        BenchCommand::OneOneOne(a) => ("one-one-one", a),
        BenchCommand::PrefetchSweep(a) => ("prefetch-sweep", a),
        BenchCommand::ManyQueues(a) => ("many-queues", a),
        BenchCommand::MqttQos0(a) => ("mqtt-qos0", a),
        BenchCommand::MqttQos1(a) => ("mqtt-qos1", a),
        BenchCommand::MqttQos2(a) => ("mqtt-qos2", a),
        BenchCommand::MqttFanIn(a) => ("mqtt-fan-in", a),
        BenchCommand::MqttFanOut(a) => ("mqtt-fan-out", a),
        BenchCommand::MqttAll(a) => ("mqtt-all", a),
        BenchCommand::All(a) => ("all", a),
    };
    if let Some(pid) = a.broker_pid
        && report::sample_proc(pid).is_none()
    {
        bail!("--broker-pid {pid}: cannot read /proc/{pid}/stat and status");
    }
    let mqtt_only = workload.starts_with("mqtt-");
    let mut rows = Vec::new();
    if !mqtt_only {
        let options = workloads::Options {
            uri: client::Uri::parse(&a.uri)?,
            seconds: a.seconds,
            size: a.size as usize,
            confirm: a.confirm,
            autoack: a.autoack,
            prefetch: a.prefetch,
            persistent: a.persistent,
            broker_pid: a.broker_pid,
            rate: a.rate,
            count: a.count,
            queues: a.queues as usize,
            multi_ack_every: a.multi_ack_every,
            flush_every: a.flush_every,
        };
        rows = workloads::run(workload, &options).await?;
    }
    let mqtt = match (&a.mqtt, mqtt_only) {
        (Some(m), _) => Some(m.as_str()),
        (None, true) => Some("127.0.0.1:1883"),
        (None, false) => None,
    };
    if let Some(m) = mqtt {
        let options = mqtt_workloads::MqttOptions {
            target: mqtt_client::Target::parse(m)?,
            seconds: a.seconds,
            size: a.size as usize,
            qos: a.qos,
            fan: a.fan as usize,
            window: a.window,
            rate: a.rate,
            lead: a.lead,
            count: a.count,
            broker_pid: a.broker_pid,
        };
        let which = match workload {
            "all" | "mqtt-all" => "all",
            w => w,
        };
        rows.extend(mqtt_workloads::run(which, &options).await?);
    }
    print!("{}", report::render(&rows, a.format));
    if let Some(dir) = &a.svg {
        for p in svg::write_all(dir, &rows)? {
            eprintln!("wrote {}", p.display());
        }
    }
    let failed: usize = rows.iter().map(|r| r.errors.len()).sum();
    if failed > 0 {
        bail!("{failed} client error(s); see the errors above");
    }
    Ok(())
}
