//! `warren-bench stream`: seed 003's stream table against any stream-protocol broker
//! (RabbitMQ's `rabbitmq_stream` or `warren serve --stream`), with the Rust
//! `rabbitmq-stream-client`. `fill` creates one stream per (message size, chunk size) cell
//! and publishes `--messages` with confirms, the producer's batch size being the chunk size
//! (one Publish frame becomes one chunk); `consume` reads every cell from `first` and
//! reports messages per second. Run `consume` against a broker started with and without
//! read-ahead to compare (bench/stream-compare.sh does both).

use anyhow::{Context, bail};
use futures::StreamExt;
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::types::{Message, OffsetSpecification};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone)]
pub struct StreamArgs {
    /// `fill` (create and publish), `consume` (read all from first), or `both`.
    #[arg(value_parser = ["fill", "consume", "both"])]
    phase: String,
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
    /// Give up on a cell after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

pub async fn run(a: StreamArgs) -> anyhow::Result<()> {
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
