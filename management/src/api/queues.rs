//! Queues: listing, declare, delete, purge and `/get`.

use super::*;

pub(super) async fn visible_queues(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    let queues: Vec<QueueInfo> = m
        .queue_list()
        .await?
        .into_iter()
        .filter(|q| visible.sees(&q.vhost))
        .collect();
    m.queues_json(&queues).await
}

pub(super) async fn queues(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(visible_queues(&m, &caller).await?, &q)
}

pub(super) async fn queues_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", visible_queues(&m, &caller), &q).await
}

pub(super) async fn queue(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    one_named(visible_queues(&m, &caller), &vhost, &name).await
}

pub(super) async fn put_queue(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Configure, &name).await?;
    let existed = m
        .queue_list()
        .await?
        .iter()
        .any(|q| q.vhost == vhost && q.name == name);
    m.op(
        &vhost,
        Op::QueueDeclare(QueueDeclare {
            queue: name,
            passive: false,
            durable: flag(&o, "durable", true),
            exclusive: false,
            auto_delete: flag(&o, "auto_delete", false),
            nowait: false,
            arguments: arguments(&o)?,
        }),
    )
    .await?;
    Ok(put_status(existed))
}

pub(super) async fn delete_queue(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<StatusCode> {
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Configure, &name).await?;
    // queue.delete of a missing queue succeeds in AMQP; the API answers 404.
    if !m
        .queue_list()
        .await?
        .iter()
        .any(|x| x.vhost == vhost && x.name == name)
    {
        return Err(ApiError::not_found());
    }
    m.op(
        &vhost,
        Op::QueueDelete {
            queue: name,
            if_unused: q.get("if-unused").is_some_and(|v| v == "true"),
            if_empty: q.get("if-empty").is_some_and(|v| v == "true"),
            nowait: false,
        },
    )
    .await?;
    Ok(no_content())
}

pub(super) async fn purge(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Read, &name).await?;
    m.op(
        &vhost,
        Op::QueuePurge {
            queue: name,
            nowait: false,
        },
    )
    .await?;
    Ok(no_content())
}

/// RabbitMQ's "get messages": `count`, `ackmode` (`ack_requeue_true`,
/// `ack_requeue_false`, `reject_requeue_true`, `reject_requeue_false`), `encoding`
/// (`auto` or `base64`), `truncate`.
pub(super) async fn get_messages(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    use base64::Engine;
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Read, &name).await?;
    let count = o
        .get("count")
        .and_then(Value::as_u64)
        .unwrap_or(1)
        .min(MAX_GET);
    let ackmode = o
        .get("ackmode")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request("'ackmode' is required"))?;
    let requeue = match ackmode {
        "ack_requeue_true" | "reject_requeue_true" => true,
        "ack_requeue_false" | "reject_requeue_false" => false,
        other => {
            return Err(ApiError::bad_request(format!(
                "ackmode '{other}' is not one of ack_requeue_true, ack_requeue_false, \
                 reject_requeue_true, reject_requeue_false"
            )));
        }
    };
    let base64_always = match o.get("encoding").and_then(Value::as_str).unwrap_or("auto") {
        "auto" => false,
        "base64" => true,
        other => {
            return Err(ApiError::bad_request(format!(
                "encoding '{other}' is not auto or base64"
            )));
        }
    };
    let truncate = o
        .get("truncate")
        .and_then(Value::as_u64)
        .map(|t| t as usize);
    let mut out = Vec::new();
    let mut tags = Vec::new();
    for _ in 0..count {
        // Taken with an ack pending, so a requeue puts it back where it was, redelivered.
        let reply = m
            .op(
                &vhost,
                Op::Get {
                    queue: name.clone(),
                    no_ack: false,
                },
            )
            .await?;
        let Some(Reply::GetOk {
            delivery,
            message_count,
        }) = reply
        else {
            break;
        };
        tags.push(delivery.delivery_tag);
        let msg = &delivery.message;
        let bytes = &msg.body[..truncate.unwrap_or(msg.body.len()).min(msg.body.len())];
        let (payload, encoding) = match std::str::from_utf8(bytes) {
            Ok(s) if !base64_always => (s.to_string(), "string"),
            _ => (
                base64::engine::general_purpose::STANDARD.encode(bytes),
                "base64",
            ),
        };
        out.push(json!({
            "payload_bytes": msg.body.len(), "redelivered": delivery.redelivered,
            "exchange": &*msg.exchange, "routing_key": &*msg.routing_key,
            "message_count": message_count, "properties": properties_json(&msg.properties),
            "payload": payload, "payload_encoding": encoding,
        }));
    }
    // Settled together after reading, so a requeued message is not read twice.
    if let Some(&last) = tags.last() {
        let op = if requeue {
            Op::Nack {
                delivery_tag: last,
                multiple: true,
                requeue: true,
            }
        } else {
            Op::Ack {
                delivery_tag: last,
                multiple: true,
            }
        };
        m.op(&vhost, op).await?;
    }
    Ok(Json(Value::Array(out)))
}
