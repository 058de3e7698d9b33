//! `warren bench`: load generators that run against any broker address and report rates,
//! latency and (with `--broker-pid`) the broker's memory and CPU.
//!
//! Code map: `client` (a lean AMQP 0.9.1 client for load generation), `workloads` (the AMQP
//! workloads as plans of queues, producers and consumers), `report` (latency histogram,
//! /proc sampling, table/JSON/CSV output); `conns` (idle MQTT or AMQP connections; the AMQP
//! side in `idle_amqp`). Each kind of
//! bench is one `BenchCommand` variant with its own args and module.

mod client;
pub mod conns;
mod idle_amqp;
mod report;
mod workloads;

use anyhow::bail;
use report::Format;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// 1 producer, 1 consumer, one queue (PerfTest -x 1 -y 1).
    OneFast(AmqpArgs),
    /// 2 producers, no consumers: builds a backlog in `warren-bench-backlog` (kept for drain).
    TwoPublishers(AmqpArgs),
    /// 1 consumer empties `warren-bench-backlog` (filled first when empty), then deletes it.
    Drain(AmqpArgs),
    /// 1 producer to amq.fanout, 10 queues with a consumer each.
    Fanout10(AmqpArgs),
    /// Confirm latency: 1 producer with 1 message in flight, 1 acking consumer.
    OneOneOne(AmqpArgs),
    /// one-fast with acks at prefetch 1, 10, 100, 1000 and unlimited.
    PrefetchSweep(AmqpArgs),
    /// Every AMQP workload above, one after the other.
    All(AmqpArgs),
    /// Many idle MQTT connections: broker memory per connection, connects per second,
    /// keep-alive CPU and publish -> deliver latency while they are held.
    Conns(conns::ConnsArgs),
}

#[derive(clap::Args, Clone)]
pub struct AmqpArgs {
    /// The broker to load.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672")]
    uri: String,
    /// How long each run publishes and consumes.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    seconds: u64,
    /// Message body size in bytes (the first 8 carry the send timestamp).
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u64).range(8..=131_064))]
    size: u64,
    /// Publisher confirms with at most N unconfirmed messages per producer (0: no confirms).
    #[arg(long, default_value_t = 0)]
    confirm: u32,
    /// Consumers use automatic acknowledgement (PerfTest -a); default: manual acks, one
    /// `multiple` ack per socket read.
    #[arg(long)]
    autoack: bool,
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

pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    let (workload, a) = match command {
        BenchCommand::Conns(args) => return conns::run(args).await,
        BenchCommand::OneFast(a) => ("one-fast", a),
        BenchCommand::TwoPublishers(a) => ("two-publishers", a),
        BenchCommand::Drain(a) => ("drain", a),
        BenchCommand::Fanout10(a) => ("fanout10", a),
        BenchCommand::OneOneOne(a) => ("one-one-one", a),
        BenchCommand::PrefetchSweep(a) => ("prefetch-sweep", a),
        BenchCommand::All(a) => ("all", a),
    };
    if let Some(pid) = a.broker_pid
        && report::sample_proc(pid).is_none()
    {
        bail!("--broker-pid {pid}: cannot read /proc/{pid}/stat and status");
    }
    let options = workloads::Options {
        uri: client::Uri::parse(&a.uri)?,
        seconds: a.seconds,
        size: a.size as usize,
        confirm: a.confirm,
        autoack: a.autoack,
        prefetch: a.prefetch,
        persistent: a.persistent,
        broker_pid: a.broker_pid,
    };
    let rows = workloads::run(workload, &options).await?;
    print!("{}", report::render(&rows, a.format));
    let failed: usize = rows.iter().map(|r| r.errors.len()).sum();
    if failed > 0 {
        bail!("{failed} client error(s); see the errors above");
    }
    Ok(())
}
