//! `handshakes`: connections opened and closed per second, each a new TCP connection, the
//! TLS handshake when the target says so (a full one: no resumption) and the protocol's own
//! (AMQP up to connection.open-ok, MQTT CONNECT/CONNACK), then a clean close. Plain against
//! TLS targets of the same broker shows what TLS costs a connecting client.

use crate::report::{self, TICKS_PER_SEC};
use crate::{client, mqtt_client};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone)]
pub struct HandshakeArgs {
    /// AMQP targets (`amqp://...` or `amqps://...`), repeatable.
    #[arg(long)]
    uri: Vec<String>,
    /// MQTT targets (`mqtt://`, `mqtts://`, `ws://`, `wss://`), repeatable.
    #[arg(long)]
    mqtt: Vec<String>,
    /// Seconds per target.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
    seconds: u64,
    /// Clients connecting at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1000))]
    concurrency: u64,
    /// The broker's pid: its CPU time per connection.
    #[arg(long)]
    broker_pid: Option<u32>,
}

enum Target {
    Amqp(client::Uri),
    Mqtt(mqtt_client::Target),
}

impl Target {
    /// One connection: open, handshake, close.
    async fn once(&self, n: u64) -> anyhow::Result<()> {
        match self {
            Target::Amqp(uri) => {
                client::Conn::open(uri, &format!("warren-bench-handshake-{n}"))
                    .await?
                    .close()
                    .await
            }
            Target::Mqtt(target) => {
                mqtt_client::MqttConn::connect(target, &format!("wb-hs-{n}"), None)
                    .await?
                    .disconnect()
                    .await
            }
        }
    }
}

pub async fn run(a: HandshakeArgs) -> anyhow::Result<()> {
    let mut targets = Vec::new();
    for u in &a.uri {
        let uri = client::Uri::parse(u)?;
        targets.push((format!("amqp {}", uri.transport.name()), Target::Amqp(uri)));
    }
    for m in &a.mqtt {
        let t = mqtt_client::Target::parse(m)?;
        targets.push((format!("mqtt {}", t.transport.name()), Target::Mqtt(t)));
    }
    anyhow::ensure!(!targets.is_empty(), "give --uri and/or --mqtt targets");
    println!(
        "{:<10} {:>12} {:>10} {:>8} {:>14} {:>15}",
        "target", "connections", "per sec", "errors", "broker CPU %", "broker us/conn"
    );
    let mut failed = 0;
    for (label, target) in targets {
        let target = Arc::new(target);
        let done = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(AtomicU64::new(0));
        let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
        let before = a.broker_pid.and_then(report::sample_proc);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(a.seconds);
        let mut tasks = tokio::task::JoinSet::new();
        for worker in 0..a.concurrency {
            let (target, done, errors, first_error) = (
                target.clone(),
                done.clone(),
                errors.clone(),
                first_error.clone(),
            );
            tasks.spawn(async move {
                let mut n = worker << 32;
                while Instant::now() < deadline {
                    n += 1;
                    match target.once(n).await {
                        Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            first_error
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert_with(|| format!("{e:#}"));
                            errors.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            });
        }
        while tasks.join_next().await.is_some() {}
        let secs = start.elapsed().as_secs_f64();
        let after = a.broker_pid.and_then(report::sample_proc);
        let (n, e) = (done.load(Ordering::Relaxed), errors.load(Ordering::Relaxed));
        let cpu = match (before, after) {
            (Some(b), Some(a)) => {
                Some(a.cpu_ticks.saturating_sub(b.cpu_ticks) as f64 / TICKS_PER_SEC)
            }
            _ => None,
        };
        println!(
            "{:<10} {:>12} {:>10.0} {:>8} {:>14} {:>15}",
            label,
            n,
            n as f64 / secs,
            e,
            cpu.map_or("-".into(), |c| format!("{:.0}", c / secs * 100.0)),
            cpu.filter(|_| n > 0)
                .map_or("-".into(), |c| format!("{:.0}", c * 1e6 / n as f64)),
        );
        if let Some(err) = first_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            eprintln!("{label}: first error: {err}");
        }
        failed += e;
    }
    anyhow::ensure!(failed == 0, "{failed} connection(s) failed");
    Ok(())
}
