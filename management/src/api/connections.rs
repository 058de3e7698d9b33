//! Connections, channels and consumers.

use super::*;

pub(super) async fn connection_values(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let meta = m.meta();
    Ok(m.connection_list()
        .await?
        .iter()
        .filter(|c| caller.monitor() || c.user == caller.user)
        .map(|c| m.connection_json(c, meta.get(&c.conn.0).map(|m| &**m)))
        .collect())
}

pub(super) async fn connections(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(connection_values(&m, &caller).await?, &q)
}

/// A connection by RabbitMQ's name (`peer -> listener`) or by Warren's numeric id.
pub(super) async fn find_connection(
    m: &Management,
    caller: &Caller,
    name: &str,
) -> ApiResult<Value> {
    connection_values(m, caller)
        .await?
        .into_iter()
        .find(|c| c["name"] == name || c["id"].as_u64().is_some_and(|id| id.to_string() == name))
        .ok_or_else(ApiError::not_found)
}

pub(super) async fn connection(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    find_connection(&m, &caller, &name).await.map(Json)
}

/// Closes a connection (320 CONNECTION_FORCED); the reason is the `X-Reason` header, as
/// RabbitMQ's API takes it.
pub(super) async fn close_connection(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> ApiResult<StatusCode> {
    let c = find_connection(&m, &caller, &name).await?;
    if !caller.admin() && c["user"] != caller.user.as_str() {
        return Err(ApiError::not_authorised("Not administrator user"));
    }
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .to_string();
    let Some(id) = c["id"].as_u64() else {
        return Err(ApiError::not_found());
    };
    tracing::info!(
        connection = %Escaped(&name),
        user = %Escaped(&caller.user),
        reason = %Escaped(&reason),
        "closing connection (HTTP API)"
    );
    match m
        .ask(AdminRequest::CloseConnection {
            conn: warren_core::ids::ConnId(id),
            reason,
        })
        .await?
    {
        AdminResponse::Closed(true) => Ok(no_content()),
        AdminResponse::Closed(false) => Err(ApiError::not_found()),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn channels(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let meta = m.meta();
    let items = m
        .channel_list()
        .await?
        .iter()
        .filter(|c| caller.monitor() || c.user == caller.user)
        .map(|c| m.channel_json(c, meta.get(&c.conn.0).map(|m| &**m)))
        .collect();
    listing(items, &q)
}

pub(super) async fn consumer_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    let meta = m.meta();
    let users: HashMap<u64, String> = m
        .connection_list()
        .await?
        .into_iter()
        .map(|c| (c.conn.0, c.user))
        .collect();
    let list = match m.ask(AdminRequest::ListConsumers).await? {
        AdminResponse::Consumers(c) => c,
        other => return Err(unexpected(other)),
    };
    Ok(list
        .iter()
        .filter(|c| visible.sees(&c.vhost))
        .map(|c| {
            let meta = meta.get(&c.conn.0).map(|m| &**m);
            let conn_name = m.connection_name(c.conn.0, meta);
            let (peer_host, peer_port) = meta
                .and_then(|m| m.peer.parse::<SocketAddr>().ok())
                .map(|a| (a.ip().to_string(), a.port()))
                .unwrap_or_default();
            json!({
                "consumer_tag": c.tag, "exclusive": c.exclusive, "ack_required": c.ack_required,
                "prefetch_count": c.prefetch, "active": true, "activity_status": "up",
                "arguments": if c.priority != 0 { json!({"x-priority": c.priority}) } else { json!({}) },
                "consumer_timeout": 1_800_000,
                "queue": {"name": c.queue, "vhost": c.vhost},
                "channel_details": {
                    "name": format!("{conn_name} ({})", c.channel), "number": c.channel,
                    "connection_name": conn_name, "node": m.node.name,
                    "peer_host": peer_host, "peer_port": peer_port,
                    "user": users.get(&c.conn.0).cloned().unwrap_or_default(),
                },
            })
        })
        .collect())
}

pub(super) async fn consumers(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(consumer_list(&m, &caller).await?, &q)
}

pub(super) async fn consumers_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/queue/vhost", consumer_list(&m, &caller), &q).await
}
