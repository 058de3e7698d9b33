//! Storage measurements against a running broker (a benchmark, not a test: it reports, it does
//! not judge). `bench/storage.sh` drives it around broker restarts.
//!
//! ```text
//! storage-bench --amqp 127.0.0.1:5672 --pid PID fill --count 1000000 --size 1000
//! storage-bench --amqp 127.0.0.1:5672 --pid PID queues --count 10000
//! storage-bench --amqp 127.0.0.1:5672 count --queue bench-fill --timeout-secs 600
//! storage-bench --amqp 127.0.0.1:5672 count --prefix bench-q- --queues 10000
//! ```

use clap::{Parser, Subcommand};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tokio::time::timeout;

/// One broker round trip; a longer silence means the broker is stuck, not slow.
const OP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Parser)]
#[command(
    name = "storage-bench",
    about = "Fill, declare and count durable queues"
)]
struct Cli {
    /// Broker AMQP address.
    #[arg(long, default_value = "127.0.0.1:5672")]
    amqp: String,
    /// Broker process id: its resident memory (VmRSS) is reported.
    #[arg(long)]
    pid: Option<u32>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Publish persistent messages with confirms into one durable queue.
    Fill {
        #[arg(long, default_value = "bench-fill")]
        queue: String,
        #[arg(long, default_value_t = 1_000_000)]
        count: u64,
        /// Body size in bytes.
        #[arg(long, default_value_t = 1000)]
        size: usize,
        /// Publishes awaiting a confirm at any time.
        #[arg(long, default_value_t = 1000)]
        window: usize,
        /// Purge the queue first (it may hold messages from an earlier run).
        #[arg(long)]
        purge: bool,
    },
    /// Declare durable queues named PREFIX0 .. PREFIX(N-1).
    Queues {
        #[arg(long, default_value = "bench-q-")]
        prefix: String,
        #[arg(long, default_value_t = 10_000)]
        count: u32,
    },
    /// Wait until the broker answers a passive declare, then print the message count. Exits 3
    /// if the broker answers that a queue does not exist.
    Count {
        #[arg(long, default_value = "bench-fill")]
        queue: String,
        /// Instead of --queue: check that PREFIX0 .. PREFIX(N-1) all exist (with --queues).
        #[arg(long)]
        prefix: Option<String>,
        #[arg(long, default_value_t = 10_000)]
        queues: u32,
        #[arg(long, default_value_t = 600)]
        timeout_secs: u64,
    },
}

fn rss(pid: Option<u32>) -> String {
    let Some(pid) = pid else {
        return "n/a (no --pid)".into();
    };
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let kib: u64 = s
                .lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some(format!("{:.1} MiB", kib as f64 / 1024.0))
        })
        .unwrap_or_else(|| format!("n/a (cannot read /proc/{pid}/status)"))
}

async fn within<T>(what: &str, f: impl Future<Output = lapin::Result<T>>) -> Result<T, String> {
    match timeout(OP_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {OP_TIMEOUT:?}")),
    }
}

async fn open(amqp: &str) -> Result<(Connection, Channel), String> {
    let uri = format!("amqp://guest:guest@{amqp}/%2f");
    let conn = within(
        "connect",
        Connection::connect(&uri, ConnectionProperties::default()),
    )
    .await?;
    let ch = within("channel.open", conn.create_channel()).await?;
    Ok((conn, ch))
}

fn durable(passive: bool) -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        passive,
        ..QueueDeclareOptions::default()
    }
}

async fn fill(
    amqp: &str,
    pid: Option<u32>,
    queue: &str,
    count: u64,
    size: usize,
    window: usize,
    purge: bool,
) -> Result<(), String> {
    let (conn, ch) = open(amqp).await?;
    within(
        "queue.declare",
        ch.queue_declare(queue.into(), durable(false), FieldTable::default()),
    )
    .await?;
    if purge {
        within(
            "queue.purge",
            ch.queue_purge(queue.into(), QueuePurgeOptions::default()),
        )
        .await?;
    }
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    let props = BasicProperties::default().with_delivery_mode(2);
    let mut body = vec![b'x'; size];
    let mut inflight = VecDeque::with_capacity(window);
    let (mut acked, mut failed) = (0u64, 0u64);
    let started = Instant::now();
    let mut report = started;
    for i in 0..count {
        // A distinct prefix per message, so no layer can deduplicate identical bodies.
        let id = i.to_be_bytes();
        let n = id.len().min(size);
        body[..n].copy_from_slice(&id[..n]);
        let confirm = within(
            "basic.publish",
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &body,
                props.clone(),
            ),
        )
        .await?;
        inflight.push_back(confirm);
        while inflight.len() >= window {
            match within("confirm", inflight.pop_front().expect("full window")).await? {
                Confirmation::Ack(_) => acked += 1,
                _ => failed += 1,
            }
        }
        if report.elapsed() >= Duration::from_secs(5) {
            report = Instant::now();
            eprintln!(
                "  {i} published, {:.0} msg/s so far, broker RSS {}",
                i as f64 / started.elapsed().as_secs_f64(),
                rss(pid)
            );
        }
    }
    for confirm in inflight {
        match within("confirm", confirm).await? {
            Confirmation::Ack(_) => acked += 1,
            _ => failed += 1,
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let depth = within(
        "queue.declare",
        ch.queue_declare(queue.into(), durable(true), FieldTable::default()),
    )
    .await?
    .message_count();
    println!(
        "fill: {count} x {size} B into {queue} in {secs:.1} s: {:.0} msg/s, {:.1} MB/s; \
         confirmed {acked}, nacked {failed}; queue depth {depth}; broker RSS {}",
        count as f64 / secs,
        (count as f64 * size as f64) / secs / 1e6,
        rss(pid)
    );
    let _ = conn.close(200, "done".into()).await;
    if failed > 0 || acked != count {
        return Err(format!("{failed} of {count} publishes were not confirmed"));
    }
    Ok(())
}

async fn queues(amqp: &str, pid: Option<u32>, prefix: &str, count: u32) -> Result<(), String> {
    let (conn, ch) = open(amqp).await?;
    let started = Instant::now();
    for i in 0..count {
        within(
            "queue.declare",
            ch.queue_declare(
                format!("{prefix}{i}").into(),
                durable(false),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "queues: declared {count} durable queues in {secs:.1} s ({:.0}/s); broker RSS {}",
        f64::from(count) / secs,
        rss(pid)
    );
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// The outcome of one passive declare: the queue's message count, or `None` for a 404.
async fn passive(ch: &Channel, name: &str) -> Result<Option<u32>, String> {
    match timeout(
        OP_TIMEOUT,
        ch.queue_declare(name.into(), durable(true), FieldTable::default()),
    )
    .await
    {
        Ok(Ok(q)) => Ok(Some(q.message_count())),
        Ok(Err(e)) if matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if p.get_id() == 404) => {
            Ok(None)
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {OP_TIMEOUT:?}")),
    }
}

/// Polls until the broker answers; `Ok(false)` if it answered that a queue is missing.
async fn count(
    amqp: &str,
    queue: &str,
    prefix: Option<&str>,
    queues: u32,
    limit: Duration,
) -> Result<bool, String> {
    let started = Instant::now();
    let mut last_error = String::new();
    while started.elapsed() < limit {
        let (conn, ch) = match open(amqp).await {
            Ok(c) => c,
            Err(e) => {
                last_error = e;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let found = match prefix {
            None => match passive(&ch, queue).await {
                Ok(Some(n)) => {
                    println!(
                        "count: {queue} holds {n} messages (answered {} ms after the first try)",
                        started.elapsed().as_millis()
                    );
                    true
                }
                Ok(None) => {
                    println!("count: {queue} does not exist");
                    false
                }
                Err(e) => {
                    last_error = e;
                    continue;
                }
            },
            Some(prefix) => {
                let mut total = 0u64;
                let mut missing = None;
                for i in 0..queues {
                    let name = format!("{prefix}{i}");
                    match passive(&ch, &name).await? {
                        Some(n) => total += u64::from(n),
                        None => {
                            missing = Some(name);
                            break;
                        }
                    }
                }
                match missing {
                    None => {
                        println!(
                            "count: all {queues} queues {prefix}* exist, {total} messages \
                             (answered {} ms after the first try)",
                            started.elapsed().as_millis()
                        );
                        true
                    }
                    Some(name) => {
                        println!("count: {name} does not exist");
                        false
                    }
                }
            }
        };
        let _ = conn.close(200, "done".into()).await;
        return Ok(found);
    }
    Err(format!("no answer within {limit:?}: {last_error}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async {
        match cli.command {
            Cmd::Fill {
                queue,
                count,
                size,
                window,
                purge,
            } => fill(
                &cli.amqp,
                cli.pid,
                &queue,
                count,
                size,
                window.max(1),
                purge,
            )
            .await
            .map(|()| true),
            Cmd::Queues { prefix, count } => queues(&cli.amqp, cli.pid, &prefix, count)
                .await
                .map(|()| true),
            Cmd::Count {
                queue,
                prefix,
                queues,
                timeout_secs,
            } => {
                count(
                    &cli.amqp,
                    &queue,
                    prefix.as_deref(),
                    queues,
                    Duration::from_secs(timeout_secs),
                )
                .await
            }
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(3),
        Err(e) => {
            eprintln!("storage-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
