//! The node, the overview, alarms and health checks (`/api/overview`, `/api/nodes`,
//! `/api/health/checks/*`, `/api/aliveness-test`).

use super::*;

pub(super) const EXCHANGE_TYPES: [(&str, &str); 4] = [
    (
        "direct",
        "AMQP direct exchange, as per the AMQP specification",
    ),
    (
        "fanout",
        "AMQP fanout exchange, as per the AMQP specification",
    ),
    (
        "headers",
        "AMQP headers exchange, as per the AMQP specification",
    ),
    (
        "topic",
        "AMQP topic exchange, as per the AMQP specification",
    ),
];

pub(super) async fn overview(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    let visible = m.visible(&caller).await?;
    let queues: Vec<QueueInfo> = m
        .queue_list()
        .await?
        .into_iter()
        .filter(|q| visible.sees(&q.vhost))
        .collect();
    let connections = m.connection_list().await?;
    let channels = m.channel_list().await?;
    let exchanges = match m.ask(AdminRequest::ListExchanges).await? {
        AdminResponse::Exchanges(x) => x.into_iter().filter(|x| visible.sees(&x.vhost)).count(),
        other => return Err(unexpected(other)),
    };
    let stats = match m.ask(AdminRequest::VhostStats).await? {
        AdminResponse::VhostStats(s) => s,
        other => return Err(unexpected(other)),
    };
    let mut total = MessageStats::default();
    for (vhost, s) in &stats {
        if visible.sees(vhost) {
            total.add(s);
        }
    }
    let ready: u64 = queues.iter().map(|q| q.messages_ready).sum();
    let unacked: u64 = queues.iter().map(|q| q.messages_unacked).sum();
    let r = m.rate("overview".into(), total, (ready, unacked));
    let own = |user: &str| caller.monitor() || user == caller.user;
    Ok(Json(json!({
        "management_version": env!("CARGO_PKG_VERSION"),
        "rates_mode": "basic",
        "product_name": "Warren", "product_version": env!("CARGO_PKG_VERSION"),
        // The RabbitMQ version whose API this follows (tools branch on it).
        "rabbitmq_version": "3.10.0",
        "erlang_version": "none", "erlang_full_version": "none (Rust)",
        "cluster_name": m.node.name, "node": m.node.name,
        "exchange_types": EXCHANGE_TYPES.iter().map(|(n, d)| json!({"name": n, "description": d, "enabled": true})).collect::<Vec<_>>(),
        "message_stats": message_stats(&total, &r),
        "churn_rates": {},
        "queue_totals": {
            "messages": ready + unacked, "messages_details": details(r.ready + r.unacked),
            "messages_ready": ready, "messages_ready_details": details(r.ready),
            "messages_unacknowledged": unacked, "messages_unacknowledged_details": details(r.unacked),
        },
        "object_totals": {
            "connections": connections.iter().filter(|c| own(&c.user)).count(),
            "channels": channels.iter().filter(|c| own(&c.user)).count(),
            "exchanges": exchanges, "queues": queues.len(),
            "consumers": queues.iter().map(|q| q.consumers).sum::<usize>(),
        },
        "statistics_db_event_queue": 0,
        "listeners": m.node.listeners.iter().map(|l| json!({
            "node": m.node.name, "protocol": l.protocol,
            "ip_address": l.addr.ip().to_string(), "port": l.addr.port(),
        })).collect::<Vec<_>>(),
        "contexts": [],
    })))
}

/// Resident memory of this process, from /proc (bytes).
pub(crate) fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Free space on the file system holding `dir`.
pub(crate) fn disk_free(dir: &std::path::Path) -> Option<u64> {
    let out = std::process::Command::new("df")
        .arg("-Pk")
        .arg(dir)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let line = text.lines().nth(1)?;
    let kib: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    Some(kib * 1024)
}

impl Management {
    pub(crate) async fn node_json(&self) -> ApiResult<Value> {
        let memory = match self.ask(AdminRequest::MemoryStatus).await? {
            AdminResponse::Memory(m) => m,
            other => return Err(unexpected(other)),
        };
        Ok(json!({
            "name": self.node.name, "type": "disc", "running": true,
            // RabbitMQ's maintenance mode (rabbitmqadmin 2.x's `list nodes` needs the
            // field): Warren has no drain, so a node is never being drained.
            "being_drained": false,
            "uptime": self.uptime_ms(),
            "mem_used": rss(), "mem_limit": memory.watermark, "mem_alarm": memory.alarm,
            "message_bytes_held": memory.held,
            "disk_free": self.node.data_dir.as_deref().and_then(disk_free),
            "disk_free_limit": 50_000_000, "disk_free_alarm": false,
            "proc_used": 0, "fd_used": 0,
            "processors": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "run_queue": 0, "os_pid": std::process::id().to_string(),
            "rates_mode": "basic",
            "exchange_types": EXCHANGE_TYPES.iter().map(|(n, d)| json!({"name": n, "description": d, "enabled": true})).collect::<Vec<_>>(),
            "listeners": self.node.listeners.iter().map(|l| json!({
                "node": self.node.name, "protocol": l.protocol,
                "ip_address": l.addr.ip().to_string(), "port": l.addr.port(),
            })).collect::<Vec<_>>(),
            "applications": [{"name": "warren", "description": "Warren message broker", "version": env!("CARGO_PKG_VERSION")}],
            "started_at": self.started_at_ms,
        }))
    }
}

pub(super) async fn nodes(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    caller.require_monitor()?;
    Ok(Json(json!([m.node_json().await?])))
}

pub(super) async fn node(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    caller.require_monitor()?;
    if name != m.node.name {
        return Err(ApiError::not_found());
    }
    Ok(Json(m.node_json().await?))
}

pub(super) async fn whoami(Extension(caller): Extension<Caller>) -> Json<Value> {
    Json(json!({"name": caller.user, "tags": caller.tags}))
}

pub(super) async fn alarms(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Response> {
    caller.require_monitor()?;
    let memory = match m.ask(AdminRequest::MemoryStatus).await? {
        AdminResponse::Memory(mem) => mem,
        other => return Err(unexpected(other)),
    };
    Ok(if memory.alarm {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "failed", "reason": "resource alarm(s) in effect in the cluster",
                "alarms": [{"node": m.node.name, "resource": "memory"}],
            })),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    })
}

// RabbitMQ's health checks (`crate::health`): any management user may ask, as there.
pub(super) async fn health_port_listener(
    State(m): State<Shared>,
    Path(port): Path<String>,
) -> ApiResult<Response> {
    crate::health::port_listener(&m, &port).ok_or_else(|| ApiError::bad_request("Invalid port"))
}

pub(super) async fn health_protocol_listener(
    State(m): State<Shared>,
    Path(protocol): Path<String>,
) -> Response {
    crate::health::protocol_listener(&m, &protocol)
}

pub(super) async fn health_virtual_hosts() -> Response {
    crate::health::virtual_hosts()
}

pub(super) async fn health_quorum_critical(State(m): State<Shared>) -> Response {
    crate::health::quorum_critical(&m)
}

/// Declares `aliveness-test` in the vhost, publishes to it and reads the message back,
/// as RabbitMQ's aliveness test.
pub(super) async fn aliveness(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> ApiResult<Json<Value>> {
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Configure, "aliveness-test")
        .await?;
    let queue = "aliveness-test".to_string();
    m.op(
        &vhost,
        Op::QueueDeclare(QueueDeclare {
            queue: queue.clone(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: Default::default(),
        }),
    )
    .await?;
    m.op(
        &vhost,
        Op::Publish(Box::new(warren_core::command::Publish {
            exchange: "".into(),
            routing_key: queue.as_str().into(),
            mandatory: false,
            immediate: false,
            properties: Default::default(),
            body: Bytes::from_static(b"test_message"),
            routed: None,
        })),
    )
    .await?;
    match m
        .op(
            &vhost,
            Op::Get {
                queue,
                no_ack: true,
            },
        )
        .await?
    {
        Some(Reply::GetOk { .. }) => Ok(Json(json!({"status": "ok"}))),
        _ => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "failed",
            "the test message did not come back",
        )),
    }
}
