//! Exchanges: listing, declare, delete, publish from the API, scheduled (delayed) messages.

use super::*;

pub(super) async fn exchange_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    // Delayed messages per exchange (docs/delayed.md): the plugin's `messages_delayed`, and
    // Warren's `next_due` (ms since the Unix epoch; null when all are paged out).
    let scheduled: HashMap<(String, String), (u64, Option<u64>)> =
        match m.ask(AdminRequest::ListScheduled).await? {
            AdminResponse::Scheduled(s) => s
                .into_iter()
                .map(|s| ((s.vhost, s.exchange), (s.messages, s.next_due)))
                .collect(),
            _ => HashMap::new(),
        };
    match m.ask(AdminRequest::ListExchanges).await? {
        AdminResponse::Exchanges(x) => Ok(x
            .iter()
            .filter(|x| visible.sees(&x.vhost))
            .map(|x| {
                let mut row = json!({
                    "name": x.name, "vhost": x.vhost, "type": x.kind, "durable": x.durable,
                    "auto_delete": x.auto_delete, "internal": x.internal,
                    "arguments": defs::table(&x.arguments),
                    "user_who_performed_action": "",
                    "policy": Value::Null,
                });
                let delayed = scheduled.get(&(x.vhost.clone(), x.name.clone()));
                if (x.kind == "x-delayed-message" || delayed.is_some())
                    && let Some(o) = row.as_object_mut()
                {
                    let (n, next) = delayed.copied().unwrap_or((0, None));
                    o.insert("messages_delayed".into(), json!(n));
                    o.insert("next_due".into(), json!(next));
                }
                row
            })
            .collect()),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn exchanges(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(exchange_list(&m, &caller).await?, &q)
}

pub(super) async fn exchanges_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", exchange_list(&m, &caller), &q).await
}

/// `amq.default` is how the API names the default exchange (`""`).
pub(super) fn exchange_name(name: &str) -> &str {
    if name == "amq.default" { "" } else { name }
}

pub(super) async fn exchange(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let name = exchange_name(&name);
    one_named(exchange_list(&m, &caller), &vhost, name).await
}

pub(super) async fn put_exchange(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Configure, &name).await?;
    let kind = o
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("'type' is required"))?
        .to_string();
    let existed = exchange_list(&m, &caller)
        .await?
        .iter()
        .any(|x| x["vhost"] == vhost.as_str() && x["name"] == name.as_str());
    m.op(
        &vhost,
        Op::ExchangeDeclare(ExchangeDeclare {
            exchange: name,
            kind,
            passive: false,
            durable: flag(&o, "durable", true),
            auto_delete: flag(&o, "auto_delete", false),
            internal: flag(&o, "internal", false),
            nowait: false,
            arguments: arguments(&o)?,
        }),
    )
    .await?;
    Ok(put_status(existed))
}

pub(super) async fn delete_exchange(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<StatusCode> {
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Configure, &name).await?;
    // exchange.delete of a missing exchange is a 404 in AMQP too.
    m.op(
        &vhost,
        Op::ExchangeDelete {
            exchange: name,
            if_unused: q.get("if-unused").is_some_and(|v| v == "true"),
            nowait: false,
        },
    )
    .await?;
    Ok(no_content())
}

/// Drops every delayed message of an exchange (a Warren extension, docs/delayed.md);
/// configure permission on the exchange, as deleting it. 200 with the count dropped.
pub(super) async fn purge_scheduled(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Configure, &name).await?;
    match m
        .ask(AdminRequest::PurgeScheduled {
            vhost,
            exchange: name,
        })
        .await?
    {
        AdminResponse::Dropped(n) => Ok(Json(json!({ "purged": n }))),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn publish(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    use base64::Engine;
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost).await?;
    let exchange = exchange_name(&name).to_string();
    m.authorise(&caller, &vhost, Perm::Write, &exchange).await?;
    let routing_key = o
        .get("routing_key")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("'routing_key' is required"))?
        .to_string();
    let payload = o
        .get("payload")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("'payload' is required"))?;
    let body = match o
        .get("payload_encoding")
        .and_then(Value::as_str)
        .unwrap_or("string")
    {
        "string" => Bytes::copy_from_slice(payload.as_bytes()),
        "base64" => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(payload)
                .map_err(|_| ApiError::bad_request("payload is not base64"))?,
        ),
        other => {
            return Err(ApiError::bad_request(format!(
                "payload_encoding '{other}' is not string or base64"
            )));
        }
    };
    let properties = match o.get("properties") {
        Some(Value::Object(p)) => properties_from_json(p)?,
        None | Some(Value::Null) => Default::default(),
        Some(_) => return Err(ApiError::bad_request("properties must be an object")),
    };
    // Routed here on the latest table, as a client connection routes, so the answer can
    // say whether it reached a queue (RabbitMQ's `routed`); the broker uses this routing.
    let routed = m
        .broker
        .route(&vhost, &exchange, &routing_key, properties.headers.as_ref());
    let reached = routed.as_ref().is_some_and(|r| !r.queues.is_empty());
    m.op(
        &vhost,
        Op::Publish(Box::new(warren_core::command::Publish {
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            mandatory: false,
            immediate: false,
            properties,
            body,
            routed,
        })),
    )
    .await?;
    Ok(Json(json!({"routed": reached})))
}

pub(super) fn properties_from_json(
    p: &Map<String, Value>,
) -> ApiResult<warren_core::message::Properties> {
    let text = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_string);
    let mut props = warren_core::message::Properties {
        content_type: text("content_type"),
        content_encoding: text("content_encoding"),
        correlation_id: text("correlation_id"),
        reply_to: text("reply_to"),
        expiration: text("expiration"),
        message_id: text("message_id"),
        kind: text("type"),
        user_id: text("user_id"),
        app_id: text("app_id"),
        ..Default::default()
    };
    if let Some(d) = p.get("delivery_mode").and_then(Value::as_u64) {
        props.delivery_mode = Some(
            u8::try_from(d).map_err(|_| ApiError::bad_request("delivery_mode must be 1 or 2"))?,
        );
    }
    if let Some(d) = p.get("priority").and_then(Value::as_u64) {
        props.priority =
            Some(u8::try_from(d).map_err(|_| ApiError::bad_request("priority must be 0-255"))?);
    }
    if let Some(t) = p.get("timestamp").and_then(Value::as_u64) {
        props.timestamp = Some(t);
    }
    if let Some(Value::Object(h)) = p.get("headers") {
        props.headers = Some(h.iter().map(|(k, v)| (k.clone(), defs::field(v))).collect());
    }
    Ok(props)
}

pub(super) fn properties_json(p: &warren_core::message::Properties) -> Value {
    let mut o = Map::new();
    let mut put = |k: &str, v: Value| {
        o.insert(k.to_string(), v);
    };
    if let Some(v) = &p.content_type {
        put("content_type", json!(v));
    }
    if let Some(v) = &p.content_encoding {
        put("content_encoding", json!(v));
    }
    if let Some(v) = &p.headers {
        put("headers", defs::table(v));
    }
    if let Some(v) = p.delivery_mode {
        put("delivery_mode", json!(v));
    }
    if let Some(v) = p.priority {
        put("priority", json!(v));
    }
    if let Some(v) = &p.correlation_id {
        put("correlation_id", json!(v));
    }
    if let Some(v) = &p.reply_to {
        put("reply_to", json!(v));
    }
    if let Some(v) = &p.expiration {
        put("expiration", json!(v));
    }
    if let Some(v) = &p.message_id {
        put("message_id", json!(v));
    }
    if let Some(v) = p.timestamp {
        put("timestamp", json!(v));
    }
    if let Some(v) = &p.kind {
        put("type", json!(v));
    }
    if let Some(v) = &p.user_id {
        put("user_id", json!(v));
    }
    if let Some(v) = &p.app_id {
        put("app_id", json!(v));
    }
    Value::Object(o)
}
