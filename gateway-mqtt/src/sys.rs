//! `$SYS/broker/...` topics as Mosquitto publishes them ("BROKER STATUS" in `man mosquitto`),
//! so dashboards and health checks written for it work. A task of the gateway's shell
//! publishes them every `sys_interval` as retained QoS 0 messages into `amq.topic`; the
//! counters are read from what the broker already counts (the registry's clients, the
//! core's per-vhost message counters, the retained store): nothing is added to the message
//! path. Wildcards at the first level never match `$` topics (MQTT-4.7.2-1), so only a
//! subscription naming `$SYS` gets them.

use crate::config::MqttConfig;
use crate::connection::now_ms;
use crate::convert;
use crate::registry::Registry;
use bytes::Bytes;
use mqtt_proto::QoS;
use mqtt_proto::v5::PublishProperties;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use warren_core::command::Op;
use warren_core::mqtt::RetainedMessage;
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};

/// Exponentially decaying per-minute rates over 1, 5 and 15 minutes, as Mosquitto's
/// `load/.../1min|5min|15min`.
#[derive(Default)]
struct Load {
    last: Option<u64>,
    rates: [f64; 3],
}

impl Load {
    const WINDOWS_S: [f64; 3] = [60.0, 300.0, 900.0];

    fn update(&mut self, total: u64, elapsed_s: f64) {
        if let Some(last) = self.last
            && elapsed_s > 0.0
        {
            let per_min = total.saturating_sub(last) as f64 * 60.0 / elapsed_s;
            for (rate, window) in self.rates.iter_mut().zip(Self::WINDOWS_S) {
                let k = (-elapsed_s / window).exp();
                *rate = per_min + k * (*rate - per_min);
            }
        }
        self.last = Some(total);
    }
}

/// Publishes the `$SYS` topics every `interval` until shutdown.
pub async fn publish_sys_topics(
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let started = Instant::now();
    let mut maximum = 0usize;
    let mut received = Load::default();
    let mut sent = Load::default();
    let mut last_tick = Instant::now();
    let mut dropped_before = 0u64;
    loop {
        let connected = registry.clients();
        maximum = maximum.max(connected);
        let disconnected = registry.stored_sessions();
        let stats = match broker.admin(AdminRequest::VhostStats).await {
            Ok(AdminResponse::VhostStats(s)) => s
                .into_iter()
                .find(|(v, _)| *v == config.vhost)
                .map(|(_, s)| s)
                .unwrap_or_default(),
            _ => Default::default(),
        };
        let elapsed = last_tick.elapsed().as_secs_f64();
        last_tick = Instant::now();
        // This task's own publishes are not in it (`AdminRequest::StatusPublish`).
        let published = stats.publish;
        received.update(published, elapsed);
        sent.update(stats.deliver_get, elapsed);
        let retained = match broker.admin(AdminRequest::RetainedStats).await {
            Ok(AdminResponse::Retained(r)) => r
                .into_iter()
                .find(|(v, _, _)| *v == config.vhost)
                .map_or(0, |(_, n, _)| n),
            _ => 0,
        };
        let dropped = match broker.admin(AdminRequest::Qos0Dropped).await {
            Ok(AdminResponse::Dropped(n)) => n,
            _ => dropped_before,
        };
        if dropped > dropped_before {
            // Once per interval, as Mosquitto counts them: what a QoS 0 subscriber slower
            // than its publishers lost (MQTT allows it; the broker holds nothing for it).
            tracing::warn!(
                "{} QoS 0 messages dropped in the last {:.0} s: subscribers slower than their \
                 publishers (their write window was full)",
                dropped - dropped_before,
                elapsed
            );
        }
        dropped_before = dropped;
        let mut topics: Vec<(String, String)> = vec![
            (
                "version".into(),
                format!("warren version {}", env!("CARGO_PKG_VERSION")),
            ),
            (
                "uptime".into(),
                format!("{} seconds", started.elapsed().as_secs()),
            ),
            ("clients/connected".into(), connected.to_string()),
            ("clients/active".into(), connected.to_string()),
            ("clients/disconnected".into(), disconnected.to_string()),
            ("clients/inactive".into(), disconnected.to_string()),
            (
                "clients/total".into(),
                (connected + disconnected).to_string(),
            ),
            ("clients/maximum".into(), maximum.to_string()),
            ("messages/received".into(), published.to_string()),
            ("messages/sent".into(), stats.deliver_get.to_string()),
            ("publish/messages/received".into(), published.to_string()),
            (
                "publish/messages/sent".into(),
                stats.deliver_get.to_string(),
            ),
            ("retained messages/count".into(), retained.to_string()),
            // Mosquitto's name; all vhosts' (the drops are counted per broker).
            ("publish/messages/dropped".into(), dropped.to_string()),
        ];
        for (i, w) in ["1min", "5min", "15min"].iter().enumerate() {
            for (dir, load) in [("received", &received), ("sent", &sent)] {
                topics.push((
                    format!("load/messages/{dir}/{w}"),
                    format!("{:.2}", load.rates[i]),
                ));
                topics.push((
                    format!("load/publish/{dir}/{w}"),
                    format!("{:.2}", load.rates[i]),
                ));
            }
        }
        for (topic, value) in topics {
            publish(&broker, &config, &format!("$SYS/broker/{topic}"), value).await;
        }
        tokio::select! {
            biased;
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    return;
                }
            }
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// Retains `value` on `topic` (not durably: the task publishes it again after a restart, as
/// Mosquitto does) and routes it to the current subscribers, through the broker's internal
/// admin connection (no user's permissions apply to the broker's own status): the retain on
/// its admin channel, the publish on its status channel, whose publishes the message stats do
/// not count (an idle broker shows no publish rate in the HTTP API, Prometheus or
/// `messages/received`).
async fn publish(broker: &BrokerHandle, config: &MqttConfig, topic: &str, value: String) {
    let now = now_ms();
    let payload = Bytes::from(value);
    // The `$SYS/...` names here are constants, all valid topic names.
    let Ok(name) = mqtt_proto::TopicName::try_from(topic) else {
        return;
    };
    let publish = convert::to_core(
        &name,
        QoS::Level0,
        true,
        payload.clone(),
        &PublishProperties::default(),
        now,
        None,
    );
    let retain = AdminRequest::Op {
        vhost: config.vhost.clone(),
        op: Op::Retain {
            message: Box::new(RetainedMessage {
                topic: Arc::from(topic),
                qos: 0,
                payload,
                properties: publish.properties.clone(),
                stored_at: now,
                expiry_ms: None,
            }),
            durable: false,
        },
    };
    let publish = AdminRequest::StatusPublish {
        vhost: config.vhost.clone(),
        publish: Box::new(publish),
    };
    for request in [retain, publish] {
        match broker.admin(request).await {
            Ok(AdminResponse::Op(Ok(_))) => {}
            other => tracing::debug!(topic, ?other, "cannot publish a $SYS topic"),
        }
    }
}
