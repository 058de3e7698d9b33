//! RabbitMQ's health checks (`/api/health/checks/...`, rabbit_mgmt_wm_health_check_*) with
//! its answers, checked against RabbitMQ 3.10.8: `{"status":"ok",...}` with 200, or
//! `{"status":"failed","reason":...}` with 503 and what is missing. `alarms` and
//! `local-alarms` are in `api.rs` with the other alarm code.

use crate::Management;
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// Where the node's quorum queues would lose their majority if it stopped: (vhost, name)
/// of each, as the host knows it (a cluster node's quorum queue groups). `None` (not set):
/// a single node, which RabbitMQ answers "single node cluster".
pub type QuorumCritical = Box<dyn Fn() -> Vec<(String, String)> + Send + Sync>;

fn ok(fields: Value) -> Response {
    let mut body = json!({"status": "ok"});
    if let (Some(b), Some(f)) = (body.as_object_mut(), fields.as_object()) {
        b.extend(f.clone());
    }
    Json(body).into_response()
}

fn failed(reason: &str, fields: Value) -> Response {
    let mut body = json!({"status": "failed", "reason": reason});
    if let (Some(b), Some(f)) = (body.as_object_mut(), fields.as_object()) {
        b.extend(f.clone());
    }
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// `port-listener/{port}`: whether one of the node's listeners is on `port`. `None`: the
/// port is no number (RabbitMQ: 400 "Invalid port", answered by the caller).
pub(crate) fn port_listener(m: &Management, port: &str) -> Option<Response> {
    let port: u16 = port.parse().ok()?;
    let ports: Vec<u16> = m.node.listeners.iter().map(|l| l.addr.port()).collect();
    Some(if ports.contains(&port) {
        ok(json!({"port": port}))
    } else {
        failed(
            "No active listener",
            json!({"missing": port, "ports": ports}),
        )
    })
}

/// `protocol-listener/{protocol}`: whether the node listens for `protocol`, named as
/// RabbitMQ names listeners or by one of the aliases it accepts (`normalize_protocol`).
pub(crate) fn protocol_listener(m: &Management, protocol: &str) -> Response {
    let wanted = normalize_protocol(protocol);
    let mut protocols: Vec<&str> = Vec::new();
    for l in &m.node.listeners {
        if !protocols.contains(&l.protocol) {
            protocols.push(l.protocol);
        }
    }
    if protocols.contains(&wanted.as_str()) {
        ok(json!({"protocol": wanted}))
    } else {
        failed(
            "No active listener",
            json!({"missing": wanted, "protocols": protocols}),
        )
    }
}

/// RabbitMQ's aliases for listener protocols (rabbit_mgmt_wm_health_check_protocol_listener,
/// each checked against 3.10.8); anything else as given, lowercased.
fn normalize_protocol(protocol: &str) -> String {
    let p = protocol.to_lowercase();
    let normal = match p.as_str() {
        "amqp091" | "amqp0.9.1" | "amqp0-9-1" | "amqp0_9_1" | "amqp10" | "amqp1.0" | "amqp1-0"
        | "amqp1_0" => "amqp",
        "amqps" => "amqp/ssl",
        "mqtt3.1" | "mqtt3.1.1" | "mqtt31" | "mqtt311" | "mqtt3_1" | "mqtt3_1_1" => "mqtt",
        "mqtts" | "mqtt+tls" | "mqtt+ssl" => "mqtt/ssl",
        "http1" | "http1.1" | "http_api" | "management" | "management_ui" | "ui" => "http",
        "cli" | "distribution" => "clustering",
        "webmqtt" | "web-mqtt" | "web_mqtt" => "http/web-mqtt",
        "webmqtt/tls" | "web-mqtt/tls" | "webmqtt/ssl" | "web-mqtt/ssl" | "webmqtt+tls"
        | "web-mqtt+tls" | "webmqtt+ssl" | "web-mqtt+ssl" => "https/web-mqtt",
        _ => return p,
    };
    normal.to_string()
}

/// `virtual-hosts`: every vhost is up. A Warren vhost has no process of its own that could
/// be down (RabbitMQ's vhost supervisor): a vhost that exists serves.
pub(crate) fn virtual_hosts() -> Response {
    ok(json!({}))
}

/// `node-is-quorum-critical`: whether stopping this node would leave a quorum queue
/// without a majority of its members online.
pub(crate) fn quorum_critical(m: &Management) -> Response {
    let Some(critical) = m.quorum_critical.get() else {
        return ok(json!({"reason": "single node cluster"}));
    };
    let queues = critical();
    if queues.is_empty() {
        return ok(json!({}));
    }
    let queues: Vec<Value> = queues
        .iter()
        .map(|(vhost, name)| {
            json!({
                "name": name, "virtual_host": vhost, "type": "quorum",
                "readable_name": format!("queue '{name}' in vhost '{vhost}'"),
            })
        })
        .collect();
    failed(
        "There are quorum queues that would lose their quorum if the target node is shut down",
        json!({"queues": queues}),
    )
}

#[cfg(test)]
mod tests {
    use super::normalize_protocol;

    #[test]
    fn protocol_aliases_are_rabbitmqs() {
        // Each as RabbitMQ 3.10.8 answered it.
        for (alias, normal) in [
            ("AMQP", "amqp"),
            ("amqp091", "amqp"),
            ("amqp0.9.1", "amqp"),
            ("amqp10", "amqp"),
            ("amqps", "amqp/ssl"),
            ("MQTT3.1.1", "mqtt"),
            ("mqtt+tls", "mqtt/ssl"),
            ("management", "http"),
            ("cli", "clustering"),
            ("web-mqtt", "http/web-mqtt"),
            ("webmqtt/tls", "https/web-mqtt"),
            ("prometheus", "prometheus"),
            ("amqpv0.9.1", "amqpv0.9.1"),
        ] {
            assert_eq!(normalize_protocol(alias), normal, "{alias}");
        }
    }
}
