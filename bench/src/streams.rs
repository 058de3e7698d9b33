//! `warren-bench stream`: seed 003's stream table against any stream-protocol broker
//! (RabbitMQ's `rabbitmq_stream` or `warren serve --stream`), with the Rust
//! `rabbitmq-stream-client`. `fill` creates one stream per (message size, chunk size) cell
//! and publishes `--messages` with confirms, the producer's batch size being the chunk size
//! (one Publish frame becomes one chunk); `consume` reads every cell from `first` and
//! reports messages per second. Run `consume` against a broker started with and without
//! read-ahead to compare (bench/stream-compare.sh does both). `amqp-consume` reads every cell
//! over AMQP 0.9.1 instead (`--uri`), as PerfTest does in seed 003 (`--qos 200`, offset
//! `first`, one ack per message) but with warren-bench's lean client, so that the broker, not
//! the client, bounds the rate; with `--broker-pid` it also prints the broker's CPU time per
//! message.

use anyhow::{Context, bail};
use futures::StreamExt;
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::types::{Message, OffsetSpecification};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone)]
pub struct StreamArgs {
    /// `fill` (create and publish), `consume` (read all from first), or `both`;
    /// `amqp-consume`: read all from first over AMQP 0.9.1 (`--uri`); `publish`: the lean
    /// raw-frame producer (`stream_publish.rs`; RabbitMQ 3.10 too), rate and broker CPU;
    /// `raw-consume`: the lean raw-frame consumer of the streams `publish --keep` filled
    /// (RabbitMQ 3.10 too), rate and broker CPU.
    #[arg(value_parser = ["fill", "consume", "both", "amqp-consume", "publish", "raw-consume"])]
    phase: String,
    /// The AMQP broker for `amqp-consume`.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672")]
    uri: String,
    /// basic.qos prefetch for `amqp-consume` (seed 003's PerfTest: 200).
    #[arg(long, default_value_t = 200)]
    qos: u16,
    /// The broker's process id: `amqp-consume` prints its CPU time per message.
    #[arg(long)]
    broker_pid: Option<u32>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 5552)]
    port: u16,
    #[arg(long, default_value = "guest")]
    user: String,
    #[arg(long, default_value = "guest")]
    password: String,
    /// Messages per cell.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Message sizes in bytes, comma-separated.
    #[arg(long, default_value = "12,1024", value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Chunk sizes (messages per Publish frame), comma-separated.
    #[arg(long, default_value = "1,8,64", value_delimiter = ',')]
    chunks: Vec<usize>,
    /// Stream names are `<prefix>-<size>-<chunk>`.
    #[arg(long, default_value = "bench")]
    prefix: String,
    /// A label for the consume lines (e.g. `read-ahead 4096`).
    #[arg(long, default_value = "")]
    label: String,
    /// `publish`: connections publishing to the stream at once.
    #[arg(long, default_value_t = 1)]
    publishers: usize,
    /// `publish`: unconfirmed messages each connection may have.
    #[arg(long, default_value_t = 20_000)]
    in_flight: u64,
    /// `publish`: leave each stream filled (for `raw-consume`). With `--in-flight` equal to
    /// the chunk size every Publish frame is a chunk of its own (none waits to be merged).
    #[arg(long)]
    keep: bool,
    /// Give up on a cell after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

pub async fn run(a: StreamArgs) -> anyhow::Result<()> {
    if a.phase == "amqp-consume" {
        return amqp_consume_all(&a).await;
    }
    if a.phase == "publish" || a.phase == "raw-consume" {
        return publish_all(&a).await;
    }
    let env = Environment::builder()
        .host(&a.host)
        .port(a.port)
        .username(&a.user)
        .password(&a.password)
        .build()
        .await
        .with_context(|| format!("connect to {}:{}", a.host, a.port))?;
    let deadline = Duration::from_secs(a.timeout);
    for &size in &a.sizes {
        for &chunk in &a.chunks {
            let name = format!("{}-{size}-{chunk}", a.prefix);
            if a.phase != "consume" {
                let rate =
                    tokio::time::timeout(deadline, fill(&env, &name, size, chunk, a.messages))
                        .await
                        .with_context(|| format!("fill {name}: over {} s", a.timeout))??;
                println!(
                    "fill    {name:<20} size {size:>5} chunk {chunk:>4}: {rate:>10.0} msg/s published with confirms"
                );
            }
            if a.phase != "fill" {
                let rate = tokio::time::timeout(deadline, consume(&env, &name, a.messages))
                    .await
                    .with_context(|| format!("consume {name}: over {} s", a.timeout))??;
                println!(
                    "consume {name:<20} size {size:>5} chunk {chunk:>4}: {rate:>10.0} msg/s {}",
                    a.label
                );
            }
        }
    }
    Ok(())
}

async fn fill(
    env: &Environment,
    name: &str,
    size: usize,
    chunk: usize,
    n: u64,
) -> anyhow::Result<f64> {
    let _ = env.delete_stream(name).await;
    env.stream_creator()
        .create(name)
        .await
        .with_context(|| format!("create {name}"))?;
    let producer = env.producer().batch_size(chunk).build(name).await?;
    let confirmed = Arc::new(AtomicU64::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let body = vec![b'x'; size];
    let start = Instant::now();
    // At most this many unconfirmed (the client's own bound is higher; this keeps chunks full
    // without queueing everything in the client).
    const WINDOW: u64 = 20_000;
    let mut sent = 0u64;
    while sent < n {
        while sent - confirmed.load(Ordering::Acquire) >= WINDOW {
            tokio::time::timeout(Duration::from_millis(10), done.notified())
                .await
                .ok();
        }
        let (c, d) = (confirmed.clone(), done.clone());
        producer
            .send(Message::builder().body(body.clone()).build(), move |r| {
                let (c, d) = (c.clone(), d.clone());
                async move {
                    if r.is_ok_and(|s| s.confirmed()) {
                        c.fetch_add(1, Ordering::AcqRel);
                    }
                    d.notify_one();
                }
            })
            .await?;
        sent += 1;
    }
    while confirmed.load(Ordering::Acquire) < n {
        tokio::time::timeout(Duration::from_millis(10), done.notified())
            .await
            .ok();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    producer.close().await?;
    Ok(rate)
}

async fn consume(env: &Environment, name: &str, n: u64) -> anyhow::Result<f64> {
    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build(name)
        .await
        .with_context(|| format!("subscribe to {name}"))?;
    let start = Instant::now();
    let mut got = 0u64;
    while got < n {
        match consumer.next().await {
            Some(Ok(d)) => {
                if d.offset() != got {
                    bail!("{name}: offset {} where {got} was due", d.offset());
                }
                got += 1;
            }
            Some(Err(e)) => bail!("{name}: {e}"),
            None => bail!("{name}: consumer closed after {got}"),
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    consumer.handle().close().await?;
    Ok(rate)
}

/// A reading of the broker's CPU time, as bench/java/BrokerCpu.java takes it: per thread
/// from /proc/PID/task/T/schedstat (ns; /proc/PID/stat counts 10 ms ticks, too coarse for
/// 50k messages of 1 us each), and those ticks for when a thread ended between two readings
/// (its time left with it: tokio ends idle blocking threads after 10 s).
pub(crate) struct BrokerCpu {
    threads: std::collections::HashMap<String, u64>,
    ticks: u64,
}

impl BrokerCpu {
    pub(crate) fn read(pid: u32) -> Option<BrokerCpu> {
        let mut threads = std::collections::HashMap::new();
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
            let Ok(t) = t else { continue };
            // A thread that ended meanwhile has no file any more.
            let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) else {
                continue;
            };
            if let Some(ns) = s.split_whitespace().next().and_then(|v| v.parse().ok()) {
                threads.insert(t.file_name().to_string_lossy().into_owned(), ns);
            }
        }
        let ticks = crate::report::sample_proc(pid)?.cpu_ticks;
        Some(BrokerCpu { threads, ticks })
    }

    /// CPU ns from `self` to `later`.
    pub(crate) fn until(&self, later: &BrokerCpu) -> u64 {
        if self.threads.keys().any(|t| !later.threads.contains_key(t)) {
            return later.ticks.saturating_sub(self.ticks) * 10_000_000;
        }
        later
            .threads
            .iter()
            .map(|(t, ns)| ns.saturating_sub(self.threads.get(t).copied().unwrap_or(0)))
            .sum()
    }
}

/// `publish`: every (size, chunk) cell with the lean producer.
async fn publish_all(a: &StreamArgs) -> anyhow::Result<()> {
    if a.publishers == 0 {
        bail!("--publishers must be at least 1");
    }
    let p = crate::stream_publish::Publish {
        host: &a.host,
        port: a.port,
        user: &a.user,
        password: &a.password,
        publishers: a.publishers,
        in_flight: a.in_flight,
        broker_pid: a.broker_pid,
        keep: a.keep,
    };
    let deadline = Duration::from_secs(a.timeout);
    if a.phase == "raw-consume" {
        for &size in &a.sizes {
            for &chunk in &a.chunks {
                let name = format!("{}-{size}-{chunk}", a.prefix);
                let (rate, cpu) = tokio::time::timeout(
                    deadline,
                    crate::stream_publish::consume(&p, &name, a.messages),
                )
                .await
                .with_context(|| format!("raw-consume {name}: over {} s", a.timeout))??;
                // The lines bench/stream-table.py reads (as the Java tools print them).
                println!("raw     {name:<20} {rate:>10.0} msg/s {}", a.label);
                if let Some(ns) = cpu {
                    println!(
                        "cpu     raw      {name:<20} {:>8.3} us/msg broker {}",
                        ns / 1000.0,
                        a.label
                    );
                }
            }
        }
        return Ok(());
    }
    for &size in &a.sizes {
        for &chunk in &a.chunks {
            let name = format!("{}-{size}-{chunk}", a.prefix);
            let (rate, cpu) = tokio::time::timeout(
                deadline,
                crate::stream_publish::run(&p, &name, size, chunk, a.messages),
            )
            .await
            .with_context(|| format!("publish {name}: over {} s", a.timeout))??;
            let cpu = cpu.map_or(String::new(), |ns| {
                format!(", broker {:.2} us/msg", ns / 1000.0)
            });
            println!(
                "publish {name:<20} size {size:>5} batch {chunk:>4} publishers {}: {rate:>10.0} msg/s with confirms{cpu} {}",
                a.publishers, a.label
            );
        }
    }
    Ok(())
}

async fn amqp_consume_all(a: &StreamArgs) -> anyhow::Result<()> {
    let uri = crate::client::Uri::parse(&a.uri)?;
    let deadline = Duration::from_secs(a.timeout);
    for &size in &a.sizes {
        for &chunk in &a.chunks {
            let name = format!("{}-{size}-{chunk}", a.prefix);
            let before = a.broker_pid.and_then(BrokerCpu::read);
            let rate = tokio::time::timeout(deadline, amqp_consume(&uri, &name, a.qos, a.messages))
                .await
                .with_context(|| format!("amqp-consume {name}: over {} s", a.timeout))??;
            let after = a.broker_pid.and_then(BrokerCpu::read);
            println!("amqp    {name:<20} {rate:>10.0} msg/s {}", a.label);
            if let (Some(b), Some(e)) = (before, after) {
                let us = b.until(&e) as f64 / 1000.0 / a.messages as f64;
                println!(
                    "cpu     amqp     {name:<20} {us:>8.3} us/msg broker {}",
                    a.label
                );
            }
        }
    }
    Ok(())
}

/// Reads `n` messages of stream queue `name` from `first`: prefetch `qos`, one ack per
/// delivery (PerfTest's default), the acks of one socket read sent in one write.
async fn amqp_consume(
    uri: &crate::client::Uri,
    name: &str,
    qos: u16,
    n: u64,
) -> anyhow::Result<f64> {
    use crate::client::{CH, Conn};
    use amq_protocol::protocol::{AMQPClass, basic};
    use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
    use warren_amqp::codec::Frame;
    let mut c = Conn::open(uri, "warren-bench stream amqp-consume").await?;
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-stream-offset"),
        AMQPValue::LongString(LongString::from("first")),
    );
    let start = Instant::now();
    c.consume_with(name, qos, false, args)
        .await
        .with_context(|| format!("consume {name}"))?;
    let (mut got, mut remaining) = (0u64, 0u64);
    while got < n {
        while let Some(f) = c.rd.try_frame()? {
            match f {
                Frame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                    c.wr.ack(CH, d.delivery_tag, false);
                }
                Frame::Method(_, m) => crate::client::check_close(&m)?,
                Frame::Header(_, h) => {
                    remaining = h.body_size;
                    got += u64::from(remaining == 0);
                }
                Frame::Body(_, b) => {
                    remaining = remaining.saturating_sub(b.len() as u64);
                    got += u64::from(remaining == 0);
                }
                Frame::Heartbeat(_) => {}
            }
        }
        c.wr.flush().await?;
        if got < n {
            c.rd.fill().await?;
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    c.close().await.ok();
    Ok(rate)
}
