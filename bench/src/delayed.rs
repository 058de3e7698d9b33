//! `warren-bench delayed`: delayed delivery over the wire (docs/delayed.md). One publisher
//! schedules `--messages` persistent messages with confirms on an `x-delayed-message`
//! exchange (each with `x-deliver-at`, spread evenly over `--window-ms` starting `--lead-ms`
//! after the start), one no-ack consumer takes them from the bound queue. Reports the
//! scheduling rate (confirmed), the due-delivery rate, lateness (receive time minus due
//! time, from the due time the body carries) p50/p99/max, and the broker's peak RSS when
//! `--broker-pid` is given. Any broker with the plugin's interface can be measured.

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(clap::Args)]
pub struct DelayedArgs {
    /// The broker.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    uri: String,
    /// Messages to schedule.
    #[arg(long, default_value_t = 100_000)]
    messages: u64,
    /// Body size in bytes (at least 8: the due time).
    #[arg(long, default_value_t = 100)]
    size: usize,
    /// The due times are spread over this many ms...
    #[arg(long, default_value_t = 10_000)]
    window_ms: u64,
    /// ...starting this long after the start (scheduling should end before).
    #[arg(long, default_value_t = 5_000)]
    lead_ms: u64,
    /// Publishes awaiting their confirm at most.
    #[arg(long, default_value_t = 2_000)]
    in_flight: usize,
    /// The broker's pid: its peak RSS (VmHWM) is reported.
    #[arg(long)]
    broker_pid: Option<u32>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub async fn run(a: DelayedArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.size >= 8,
        "--size must be at least 8 (the body carries the due time)"
    );
    let props = ConnectionProperties::default();
    let publisher = Connection::connect(&a.uri, props.clone()).await?;
    let consumer_conn = Connection::connect(&a.uri, props).await?;
    let ch = publisher.create_channel().await?;
    let exchange = "warren-bench-delayed";
    let queue = "warren-bench-delayed";
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Custom("x-delayed-message".into()),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        table(&[(
            "x-delayed-type",
            AMQPValue::LongString(LongString::from("direct")),
        )]),
    )
    .await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_purge(queue.into(), QueuePurgeOptions::default())
        .await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let cch = consumer_conn.create_channel().await?;
    let mut deliveries = cch
        .basic_consume(
            queue.into(),
            "warren-bench-delayed".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    let n = a.messages;
    let consumer = tokio::spawn(async move {
        let mut lateness = Vec::with_capacity(n as usize);
        let mut first = None;
        let mut last = Instant::now();
        while (lateness.len() as u64) < n {
            let Ok(Some(Ok(d))) =
                tokio::time::timeout(Duration::from_secs(60), deliveries.next()).await
            else {
                break;
            };
            let now = unix_ms();
            let due = d
                .data
                .get(..8)
                .map_or(0, |b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])));
            lateness.push(now as i64 - due as i64);
            first.get_or_insert_with(Instant::now);
            last = Instant::now();
        }
        (lateness, first.map(|f| last.duration_since(f)))
    });
    let start_ms = unix_ms();
    let started = Instant::now();
    let mut pending = VecDeque::new();
    let mut nacked = 0u64;
    let mut body = vec![0u8; a.size];
    for i in 0..n {
        let due = start_ms + a.lead_ms + a.window_ms * i / n.max(1);
        body[..8].copy_from_slice(&due.to_be_bytes());
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(table(&[(
                "x-deliver-at",
                AMQPValue::LongLongInt(due as i64),
            )]));
        pending.push_back(
            ch.basic_publish(
                exchange.into(),
                "k".into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await?,
        );
        if pending.len() >= a.in_flight
            && let Some(c) = pending.pop_front()
            && !c.await?.is_ack()
        {
            nacked += 1;
        }
    }
    for c in pending {
        if !c.await?.is_ack() {
            nacked += 1;
        }
    }
    let scheduled_in = started.elapsed();
    let late_start = unix_ms() > start_ms + a.lead_ms;
    let (mut lateness, delivering) = consumer.await?;
    lateness.sort_unstable();
    let got = lateness.len() as u64;
    println!(
        "delayed: {n} messages of {} B, due over {} ms",
        a.size, a.window_ms
    );
    println!(
        "  scheduling (confirmed): {:.0} msg/s ({:.2} s, {nacked} nacked){}",
        n as f64 / scheduled_in.as_secs_f64(),
        scheduled_in.as_secs_f64(),
        if late_start {
            "; scheduling ran past the first due time: raise --lead-ms"
        } else {
            ""
        }
    );
    if let Some(d) = delivering {
        println!(
            "  due delivery: {got} received, {:.0} msg/s over {:.2} s (demand {:.0} msg/s)",
            got as f64 / d.as_secs_f64().max(1e-3),
            d.as_secs_f64(),
            n as f64 * 1000.0 / a.window_ms.max(1) as f64
        );
    }
    println!(
        "  lateness ms: p50 {} p99 {} max {} (min {})",
        percentile(&lateness, 0.5),
        percentile(&lateness, 0.99),
        lateness.last().copied().unwrap_or(0),
        lateness.first().copied().unwrap_or(0)
    );
    if let Some(kb) = a.broker_pid.and_then(vm_hwm_kb) {
        println!("  broker peak RSS: {} MB", kb / 1024);
    }
    anyhow::ensure!(got == n, "received {got} of {n}");
    Ok(())
}
