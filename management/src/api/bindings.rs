//! Bindings between exchanges and queues or exchanges.

use super::*;

/// RabbitMQ's `properties_key`: `~` for no key and no arguments, else the key (arguments
/// add a hash suffix there; Warren's bindings with arguments are named by key and `~args`).
pub(super) fn properties_key(routing_key: &str, args: &warren_core::message::FieldTable) -> String {
    let key = if routing_key.is_empty() {
        "~".to_string()
    } else {
        routing_key.replace('%', "%25").replace('~', "%7E")
    };
    if args.is_empty() {
        key
    } else {
        let mut h: u32 = 0x811c9dc5;
        for b in format!("{args:?}").bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x01000193);
        }
        format!("{key}~{h:08x}")
    }
}

pub(super) async fn binding_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    let list = match m.ask(AdminRequest::ListBindings).await? {
        AdminResponse::Bindings(b) => b,
        other => return Err(unexpected(other)),
    };
    let mut out = Vec::new();
    // The default exchange's implicit bindings, as RabbitMQ lists them.
    for q in m.queue_list().await? {
        if visible.sees(&q.vhost) {
            out.push(json!({
                "source": "", "vhost": q.vhost, "destination": q.name,
                "destination_type": "queue", "routing_key": q.name, "arguments": {},
                "properties_key": properties_key(&q.name, &Default::default()),
            }));
        }
    }
    for b in list.iter().filter(|b| visible.sees(&b.vhost)) {
        out.push(json!({
            "source": b.source, "vhost": b.vhost, "destination": b.destination,
            "destination_type": if b.destination_is_exchange { "exchange" } else { "queue" },
            "routing_key": b.routing_key, "arguments": defs::table(&b.arguments),
            "properties_key": properties_key(&b.routing_key, &b.arguments),
        }));
    }
    Ok(out)
}

pub(super) async fn bindings(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(binding_list(&m, &caller).await?, &q)
}

pub(super) async fn bindings_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", binding_list(&m, &caller), &q).await
}

pub(super) async fn queue_bindings(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    m.vhost_exists(&vhost).await?;
    let items: Vec<Value> = binding_list(&m, &caller)
        .await?
        .into_iter()
        .filter(|b| {
            b["vhost"] == vhost.as_str()
                && b["destination"] == name.as_str()
                && b["destination_type"] == "queue"
        })
        .collect();
    Ok(Json(Value::Array(items)))
}

pub(super) fn destination_kind(kind: &str) -> ApiResult<&'static str> {
    match kind {
        "q" => Ok("queue"),
        "e" => Ok("exchange"),
        _ => Err(ApiError::not_found()),
    }
}

pub(super) async fn bindings_between(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
) -> ApiResult<Json<Value>> {
    let kind = destination_kind(&kind)?;
    m.vhost_exists(&vhost).await?;
    let source = exchange_name(&source).to_string();
    let items: Vec<Value> = binding_list(&m, &caller)
        .await?
        .into_iter()
        .filter(|b| {
            b["vhost"] == vhost.as_str()
                && b["source"] == source.as_str()
                && b["destination"] == destination.as_str()
                && b["destination_type"] == kind
        })
        .collect();
    Ok(Json(Value::Array(items)))
}

pub(super) async fn post_binding(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, source, kind, destination)): Path<(String, String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let kind = destination_kind(&kind)?;
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Write, &destination)
        .await?;
    m.authorise(&caller, &vhost, Perm::Read, &source).await?;
    let routing_key = o
        .get("routing_key")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let args = arguments(&o)?;
    let location = properties_key(&routing_key, &args);
    let bind = Bind {
        destination,
        source,
        routing_key,
        nowait: false,
        arguments: args,
    };
    let op = if kind == "queue" {
        Op::QueueBind(bind)
    } else {
        Op::ExchangeBind(bind)
    };
    m.op(&vhost, op).await?;
    let mut response = StatusCode::CREATED.into_response();
    if let Ok(v) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, v);
    }
    Ok(response)
}

pub(super) async fn binding(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult<Json<Value>> {
    let Json(list) = bindings_between(
        State(m),
        Extension(caller),
        Path((vhost, source, kind, destination)),
    )
    .await?;
    list.as_array()
        .and_then(|a| a.iter().find(|b| b["properties_key"] == props.as_str()))
        .cloned()
        .map(Json)
        .ok_or_else(ApiError::not_found)
}

pub(super) async fn delete_binding(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, source, kind, destination, props)): Path<(String, String, String, String, String)>,
) -> ApiResult<StatusCode> {
    let kind_name = destination_kind(&kind)?;
    m.vhost_exists(&vhost).await?;
    m.authorise(&caller, &vhost, Perm::Write, &destination)
        .await?;
    m.authorise(&caller, &vhost, Perm::Read, &source).await?;
    let list = match m.ask(AdminRequest::ListBindings).await? {
        AdminResponse::Bindings(b) => b,
        other => return Err(unexpected(other)),
    };
    let Some(b) = list.into_iter().find(|b| {
        b.vhost == vhost
            && b.source == exchange_name(&source)
            && b.destination == destination
            && b.destination_is_exchange == (kind_name == "exchange")
            && properties_key(&b.routing_key, &b.arguments) == props
    }) else {
        return Err(ApiError::not_found());
    };
    let bind = Bind {
        destination: b.destination,
        source: b.source,
        routing_key: b.routing_key,
        nowait: false,
        arguments: b.arguments,
    };
    let op = if b.destination_is_exchange {
        Op::ExchangeUnbind(bind)
    } else {
        Op::QueueUnbind(bind)
    };
    m.op(&vhost, op).await?;
    Ok(no_content())
}
