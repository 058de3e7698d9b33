//! Prometheus metrics (`GET /metrics`, text format 0.0.4) under rabbitmq_prometheus's names
//! and labels where RabbitMQ has the metric (queues per object with `vhost` and `queue`
//! labels, as with `return_per_object_metrics`), `warren_*` for the rest (MQTT, storage).

use crate::Management;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::fmt::Write;
use std::sync::Arc;
use warren_runtime::storage_metrics::HistogramSnapshot;
use warren_runtime::{AdminRequest, AdminResponse};

pub(crate) fn router(m: Arc<Management>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/metrics/per-object", get(metrics))
        .with_state(m)
}

/// Escapes a label value (text format: backslash, double quote, line feed).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One metric family: HELP, TYPE, then its samples.
struct Family<'a> {
    out: &'a mut String,
    name: &'static str,
}

impl<'a> Family<'a> {
    fn new(out: &'a mut String, name: &'static str, kind: &str, help: &str) -> Family<'a> {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        Family { out, name }
    }

    fn sample(&mut self, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let _ = write!(self.out, "{}", self.name);
        if !labels.is_empty() {
            let text: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
                .collect();
            let _ = write!(self.out, "{{{}}}", text.join(","));
        }
        let _ = writeln!(self.out, " {value}");
    }
}

fn gauge(out: &mut String, name: &'static str, help: &str, value: impl std::fmt::Display) {
    Family::new(out, name, "gauge", help).sample(&[], value);
}

fn counter(out: &mut String, name: &'static str, help: &str, value: u64) {
    Family::new(out, name, "counter", help).sample(&[], value);
}

/// A histogram in Prometheus' text format: cumulative `_bucket{le=...}` samples, `+Inf`,
/// `_sum` and `_count`.
fn histogram(out: &mut String, name: &'static str, help: &str, h: &HistogramSnapshot) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (le, n) in &h.buckets {
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum_seconds);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

/// Bytes of the files under `dir` (at most `MAX_FILES` entries: a bound on the walk).
fn bytes_on_disk(dir: &std::path::Path) -> u64 {
    const MAX_FILES: usize = 1_000_000;
    let mut total = 0;
    let mut seen = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            seen += 1;
            if seen > MAX_FILES {
                return total;
            }
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

async fn metrics(State(m): State<Arc<Management>>) -> Response {
    match render(&m).await {
        Some(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the broker is shutting down\n",
        )
            .into_response(),
    }
}

async fn render(m: &Management) -> Option<String> {
    let Ok(AdminResponse::Queues(queues)) = m.ask(AdminRequest::ListQueues).await else {
        return None;
    };
    let Ok(AdminResponse::Connections(conns)) = m.ask(AdminRequest::ListConnections).await else {
        return None;
    };
    let Ok(AdminResponse::Channels(channels)) = m.ask(AdminRequest::ListChannels).await else {
        return None;
    };
    let Ok(AdminResponse::Exchanges(exchanges)) = m.ask(AdminRequest::ListExchanges).await else {
        return None;
    };
    let Ok(AdminResponse::VhostStats(stats)) = m.ask(AdminRequest::VhostStats).await else {
        return None;
    };
    let Ok(AdminResponse::Memory(memory)) = m.ask(AdminRequest::MemoryStatus).await else {
        return None;
    };
    let meta = m.broker.connection_meta();
    let mut out = String::new();
    let o = &mut out;

    let mut f = Family::new(
        o,
        "rabbitmq_identity_info",
        "gauge",
        "RabbitMQ node & cluster identity info",
    );
    f.sample(
        &[
            ("rabbitmq_node", &m.node.name),
            ("rabbitmq_cluster", &m.node.name),
        ],
        1,
    );
    let mut f = Family::new(
        o,
        "rabbitmq_build_info",
        "gauge",
        "RabbitMQ & Erlang/OTP version info",
    );
    f.sample(
        &[
            ("rabbitmq_version", "3.10.0"),
            ("product_name", "Warren"),
            ("product_version", env!("CARGO_PKG_VERSION")),
        ],
        1,
    );
    gauge(
        o,
        "rabbitmq_connections",
        "Connections currently open",
        conns.len(),
    );
    gauge(
        o,
        "rabbitmq_channels",
        "Channels currently open",
        channels.len(),
    );
    gauge(
        o,
        "rabbitmq_consumers",
        "Consumers currently connected",
        queues.iter().map(|q| q.consumers).sum::<usize>(),
    );
    gauge(o, "rabbitmq_queues", "Queues available", queues.len());
    gauge(
        o,
        "rabbitmq_exchanges",
        "Exchanges available",
        exchanges.len(),
    );

    let mut total = warren_core::stats::MessageStats::default();
    for (_, s) in &stats {
        total.add(s);
    }
    counter(
        o,
        "rabbitmq_global_messages_received_total",
        "Total number of messages received from publishers",
        total.publish,
    );
    counter(
        o,
        "rabbitmq_global_messages_delivered_total",
        "Total number of messages delivered to consumers",
        total.deliver_get,
    );
    counter(
        o,
        "rabbitmq_global_messages_redelivered_total",
        "Total number of messages redelivered to consumers",
        total.redeliver,
    );
    counter(
        o,
        "rabbitmq_global_messages_acknowledged_total",
        "Total number of messages acknowledged by consumers",
        total.ack,
    );
    let mut f = Family::new(
        o,
        "warren_vhost_messages_received_total",
        "counter",
        "Messages received from publishers, per vhost",
    );
    for (vhost, s) in &stats {
        f.sample(&[("vhost", vhost)], s.publish);
    }

    macro_rules! per_queue {
        ($name:literal, $kind:literal, $help:literal, $value:expr) => {{
            let mut f = Family::new(o, $name, $kind, $help);
            for q in &queues {
                f.sample(&[("vhost", &q.vhost), ("queue", &q.name)], $value(q));
            }
        }};
    }
    use warren_core::broker::admin::QueueInfo;
    per_queue!(
        "rabbitmq_queue_messages_ready",
        "gauge",
        "Messages ready to be delivered to consumers",
        |q: &QueueInfo| q.messages_ready
    );
    per_queue!(
        "rabbitmq_queue_messages_unacked",
        "gauge",
        "Messages delivered to consumers but not yet acknowledged",
        |q: &QueueInfo| q.messages_unacked
    );
    per_queue!(
        "rabbitmq_queue_messages",
        "gauge",
        "Sum of ready and unacknowledged messages - total queue depth",
        |q: &QueueInfo| q.messages_ready + q.messages_unacked
    );
    per_queue!(
        "rabbitmq_queue_messages_paged_out",
        "gauge",
        "Messages paged out to disk",
        |q: &QueueInfo| q.paged_out
    );
    per_queue!(
        "rabbitmq_queue_messages_ram_bytes",
        "gauge",
        "Size of ready messages kept in memory",
        |q: &QueueInfo| q.memory
    );
    per_queue!(
        "rabbitmq_queue_consumers",
        "gauge",
        "Consumers on a queue",
        |q: &QueueInfo| q.consumers
    );
    per_queue!(
        "rabbitmq_queue_messages_published_total",
        "counter",
        "Total number of messages published to queues",
        |q: &QueueInfo| q.stats.publish
    );
    per_queue!(
        "warren_queue_messages_delivered_total",
        "counter",
        "Messages delivered from a queue (consumers and basic.get)",
        |q: &QueueInfo| q.stats.deliver_get
    );
    per_queue!(
        "warren_queue_messages_acked_total",
        "counter",
        "Messages acknowledged on a queue",
        |q: &QueueInfo| q.stats.ack
    );

    gauge(
        o,
        "rabbitmq_process_resident_memory_bytes",
        "Memory used in bytes",
        crate::api::rss(),
    );
    gauge(
        o,
        "rabbitmq_resident_memory_limit_bytes",
        "Memory high watermark in bytes",
        memory.watermark,
    );
    gauge(
        o,
        "warren_message_bytes",
        "Message body bytes held in memory by queues and unacked deliveries",
        memory.held,
    );
    gauge(
        o,
        "rabbitmq_alarms_memory_used_watermark",
        "is 1 if VM memory watermark alarm is in effect",
        u8::from(memory.alarm),
    );
    if let Some(dir) = &m.node.data_dir {
        if let Some(free) = crate::api::disk_free(dir) {
            gauge(
                o,
                "rabbitmq_disk_space_available_bytes",
                "Disk space available in bytes",
                free,
            );
        }
        gauge(
            o,
            "warren_storage_bytes",
            "Bytes of the files in the data directory (message logs, definitions)",
            bytes_on_disk(dir),
        );
        histogram(
            o,
            "warren_storage_sync_seconds",
            "Duration of each group commit: everything it covers durable (journal, definitions, bodies, segments)",
            &warren_runtime::storage_metrics::SYNC.snapshot(),
        );
        histogram(
            o,
            "warren_storage_journal_fsync_seconds",
            "Duration of the journal's fdatasync in each group commit",
            &warren_runtime::storage_metrics::JOURNAL_FSYNC.snapshot(),
        );
    }
    let mut by_protocol: std::collections::BTreeMap<&str, usize> = Default::default();
    for (_, c) in &meta {
        *by_protocol.entry(c.protocol).or_default() += 1;
    }
    let mut f = Family::new(
        o,
        "warren_connections_by_protocol",
        "gauge",
        "Connections currently open, by protocol",
    );
    for (protocol, n) in &by_protocol {
        f.sample(&[("protocol", protocol)], n);
    }
    gauge(
        o,
        "warren_mqtt_connections",
        "MQTT connections currently open",
        meta.iter()
            .filter(|(_, c)| c.protocol.starts_with("MQTT"))
            .count(),
    );
    for g in &m.gauges {
        gauge(o, g.name, g.help, (g.value)());
    }
    if let Some(links) = m.links.get() {
        links.metrics(o);
    }
    if let Ok(AdminResponse::Retained(retained)) = m.ask(AdminRequest::RetainedStats).await {
        gauge(
            o,
            "warren_mqtt_retained_messages",
            "MQTT retained messages held (every vhost)",
            retained.iter().map(|(_, n, _)| n).sum::<u64>(),
        );
    }
    if let Ok(AdminResponse::Scheduled(scheduled)) = m.ask(AdminRequest::ListScheduled).await {
        // Delayed messages (docs/delayed.md): the total, and per exchange with the earliest
        // due time known in memory.
        let mut f = Family::new(
            o,
            "warren_scheduled_messages",
            "gauge",
            "Delayed messages waiting to be routed, per exchange",
        );
        for s in &scheduled {
            f.sample(
                &[("vhost", &s.vhost), ("exchange", &s.exchange)],
                s.messages,
            );
        }
        let mut f = Family::new(
            o,
            "warren_scheduled_next_due_seconds",
            "gauge",
            "The earliest due time of an exchange's delayed messages (Unix seconds)",
        );
        for s in &scheduled {
            if let Some(at) = s.next_due {
                f.sample(
                    &[("vhost", &s.vhost), ("exchange", &s.exchange)],
                    format!("{:.3}", at as f64 / 1000.0),
                );
            }
        }
    }
    gauge(
        o,
        "warren_uptime_seconds",
        "Seconds since the broker started",
        m.uptime_ms() / 1000,
    );
    Some(out)
}
