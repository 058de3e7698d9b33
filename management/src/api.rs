//! The HTTP API: RabbitMQ 3.10's routes, JSON shapes, status codes and error bodies, so
//! rabbitmqadmin, Terraform's provider and client libraries' test suites work unchanged.
//!
//! Access as RabbitMQ's tags grant it: `administrator` everything; `monitoring` reads
//! everything (all vhosts, all connections, the node); `policymaker` manages policies in its
//! vhosts; `management` reads and manages objects in the vhosts it has permissions in, within
//! those permissions. A user without one of these tags cannot log in here.

use crate::definitions as defs;
use crate::rates::Rate;
use crate::{Management, Stopped};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use warren_core::access::{Perm, PermissionDef, Permissions, TopicPermissionDef};
use warren_core::admin::AdminError;
use warren_core::broker::admin::{ChannelInfo, ConnectionInfo, QueueInfo};
use warren_core::command::{Bind, ExchangeDeclare, Op, QueueDeclare};
use warren_core::effect::Reply;
use warren_core::escape::Escaped;
use warren_core::stats::MessageStats;
use warren_runtime::{AdminRequest, AdminResponse, ConnMeta};

mod access;
mod bindings;
mod connections;
mod definitions_api;
mod exchanges;
mod overview;
mod parameters;
mod queues;

use access::*;
use bindings::*;
use connections::*;
use definitions_api::*;
use exchanges::*;
use overview::*;
pub(crate) use overview::{disk_free, rss};
use queues::*;

/// Largest request body (a definitions import is the largest; RabbitMQ's default
/// `management.http.max_body_size` is 20 MB).
pub(crate) const MAX_BODY: usize = 20 << 20;
/// `page_size` at most, as RabbitMQ.
const MAX_PAGE_SIZE: usize = 500;
/// Messages one `/get` returns at most.
const MAX_GET: u64 = 10_000;

type Shared = Arc<Management>;

pub(crate) fn router(m: Shared) -> Router {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{node}", get(node))
        .route("/api/whoami", get(whoami))
        .route("/api/vhosts", get(vhosts))
        .route(
            "/api/vhosts/{vhost}",
            get(vhost).put(put_vhost).delete(delete_vhost),
        )
        .route("/api/users", get(users))
        .route(
            "/api/users/{user}",
            get(user).put(put_user).delete(delete_user),
        )
        .route("/api/permissions", get(permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(permission)
                .put(put_permission)
                .delete(delete_permission),
        )
        .route("/api/topic-permissions", get(topic_permissions))
        .route(
            "/api/topic-permissions/{vhost}/{user}",
            get(topic_permission)
                .put(put_topic_permission)
                .delete(delete_topic_permission),
        )
        .route(
            "/api/users/{user}/topic-permissions",
            get(user_topic_permissions),
        )
        .route(
            "/api/vhosts/{vhost}/topic-permissions",
            get(vhost_topic_permissions),
        )
        .route("/api/policies", get(policies))
        .route("/api/policies/{vhost}", get(policies_in))
        .route(
            "/api/policies/{vhost}/{name}",
            get(policy).put(put_policy).delete(delete_policy),
        )
        .route("/api/parameters", get(parameters::all))
        .route("/api/parameters/{component}", get(parameters::of_component))
        .route(
            "/api/parameters/{component}/{vhost}",
            get(parameters::in_vhost),
        )
        .route(
            "/api/parameters/{component}/{vhost}/{name}",
            get(parameters::one)
                .put(parameters::put)
                .delete(parameters::delete),
        )
        .route("/api/shovels", get(parameters::shovels))
        .route("/api/shovels/{vhost}", get(parameters::shovels_in))
        .route("/api/bridges", get(parameters::bridges))
        .route("/api/exchanges", get(exchanges))
        .route("/api/exchanges/{vhost}", get(exchanges_in))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(exchange).put(put_exchange).delete(delete_exchange),
        )
        .route("/api/exchanges/{vhost}/{name}/publish", post(publish))
        .route(
            "/api/exchanges/{vhost}/{name}/scheduled",
            axum::routing::delete(purge_scheduled),
        )
        .route("/api/queues", get(queues))
        .route("/api/queues/{vhost}", get(queues_in))
        .route(
            "/api/queues/{vhost}/{name}",
            get(queue).put(put_queue).delete(delete_queue),
        )
        .route("/api/queues/{vhost}/{name}/get", post(get_messages))
        .route(
            "/api/queues/{vhost}/{name}/contents",
            axum::routing::delete(purge),
        )
        .route("/api/queues/{vhost}/{name}/bindings", get(queue_bindings))
        .route("/api/bindings", get(bindings))
        .route("/api/bindings/{vhost}", get(bindings_in))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(bindings_between).post(post_binding),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(binding).delete(delete_binding),
        )
        .route("/api/connections", get(connections))
        .route(
            "/api/connections/{name}",
            get(connection).delete(close_connection),
        )
        .route("/api/channels", get(channels))
        .route("/api/consumers", get(consumers))
        .route("/api/consumers/{vhost}", get(consumers_in))
        .route("/api/definitions", get(definitions).post(import))
        .route("/api/health/checks/alarms", get(alarms))
        .route("/api/health/checks/local-alarms", get(alarms))
        .route(
            "/api/health/checks/port-listener/{port}",
            get(health_port_listener),
        )
        .route(
            "/api/health/checks/protocol-listener/{protocol}",
            get(health_protocol_listener),
        )
        .route(
            "/api/health/checks/virtual-hosts",
            get(health_virtual_hosts),
        )
        .route(
            "/api/health/checks/node-is-quorum-critical",
            get(health_quorum_critical),
        )
        .route("/api/aliveness-test/{vhost}", get(aliveness))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(m.clone(), authenticate))
        .layer(middleware::from_fn(log_refusals))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(m)
}

// ---------------------------------------------------------------------------------------
// Errors

/// An error answer in RabbitMQ's shape: `{"error": ..., "reason": ...}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    error: &'static str,
    reason: String,
}

impl ApiError {
    fn new(status: StatusCode, error: &'static str, reason: impl Into<String>) -> ApiError {
        ApiError {
            status,
            error,
            reason: reason.into(),
        }
    }

    fn not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "Object Not Found", "Not Found")
    }

    /// A refused admin change, by its kind: 404 for what does not exist (RabbitMQ's error
    /// name), 503 for a change that cannot be made durable now, 400 otherwise.
    fn refused(e: AdminError) -> ApiError {
        match e {
            AdminError::NotFound(text) => {
                ApiError::new(StatusCode::NOT_FOUND, "Object Not Found", text)
            }
            AdminError::Unavailable(text) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", text)
            }
            AdminError::Invalid(text) => ApiError::bad_request(text),
        }
    }

    fn bad_request(reason: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }

    fn not_authorised(reason: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "not_authorised", reason)
    }
}

impl From<Stopped> for ApiError {
    fn from(e: Stopped) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            e.to_string(),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(json!({"error": self.error, "reason": self.reason})),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
            );
        }
        // For the refusal log line (`log_refusals`).
        response.extensions_mut().insert(Refusal(self.reason));
        response
    }
}

/// Why a request was refused, for the log.
#[derive(Clone)]
struct Refusal(String);

type ApiResult<T> = Result<T, ApiError>;

async fn not_found() -> ApiError {
    ApiError::not_found()
}

/// Every refused request (4xx, 5xx) gets a log line: method, path, status, reason.
async fn log_refusals(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string())
        .unwrap_or_default();
    let response = next.run(request).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        let reason = response
            .extensions()
            .get::<Refusal>()
            .map(|r| r.0.clone())
            .unwrap_or_else(|| status.canonical_reason().unwrap_or("").to_string());
        tracing::warn!(
            %peer,
            method = %Escaped(method.as_str()),
            path = %Escaped(&path),
            status = status.as_u16(),
            "HTTP API request refused: {}",
            Escaped(&reason)
        );
    }
    response
}

// ---------------------------------------------------------------------------------------
// Authentication and authorisation

/// Who is asking, once authenticated.
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    user: String,
    tags: Vec<String>,
}

impl Caller {
    fn has(&self, tag: &str) -> bool {
        self.tags.iter().any(|t| t == tag)
    }

    fn admin(&self) -> bool {
        self.has("administrator")
    }

    /// Sees every vhost and every connection.
    fn monitor(&self) -> bool {
        self.admin() || self.has("monitoring")
    }

    fn policymaker(&self) -> bool {
        self.admin() || self.has("policymaker")
    }

    fn require_admin(&self) -> ApiResult<()> {
        if self.admin() {
            Ok(())
        } else {
            Err(ApiError::not_authorised("Not administrator user"))
        }
    }

    fn require_monitor(&self) -> ApiResult<()> {
        if self.monitor() {
            Ok(())
        } else {
            Err(ApiError::not_authorised("Not monitor user"))
        }
    }
}

/// Basic auth against Warren's users; the user needs a management tag.
async fn authenticate(
    State(m): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut request: Request,
    next: Next,
) -> Response {
    let Some((user, password)) = basic_credentials(request.headers()) else {
        return ApiError::not_authorised("Login failed").into_response();
    };
    let loopback = peer.ip().to_canonical().is_loopback();
    let login = match m
        .broker
        .authenticate(&user, &password, loopback, None)
        .await
    {
        Ok(Ok(login)) => login,
        Ok(Err(e)) => {
            tracing::warn!(
                %peer,
                user = %Escaped(&user),
                "HTTP API login refused: {}",
                Escaped(&e.to_string())
            );
            return ApiError::not_authorised("Login failed").into_response();
        }
        Err(_) => return ApiError::from(Stopped).into_response(),
    };
    let caller = Caller {
        user: login.user,
        tags: login.tags,
    };
    if !["administrator", "monitoring", "policymaker", "management"]
        .iter()
        .any(|t| caller.has(t))
    {
        return ApiError::not_authorised("Not management user").into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

fn basic_credentials(headers: &HeaderMap) -> Option<(String, String)> {
    use base64::Engine;
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_string(), password.to_string()))
}

impl Management {
    /// The caller's permissions, by vhost.
    async fn permissions_of(&self, user: &str) -> ApiResult<BTreeMap<String, PermissionDef>> {
        match self.ask(AdminRequest::ListPermissions).await? {
            AdminResponse::Permissions(ps) => Ok(ps
                .into_iter()
                .filter(|p| p.user == user)
                .map(|p| (p.vhost.clone(), p))
                .collect()),
            other => Err(unexpected(other)),
        }
    }

    /// The vhosts whose objects the caller may see: all for monitoring users, else those
    /// it has permissions in.
    async fn visible(&self, caller: &Caller) -> ApiResult<Visible> {
        if caller.monitor() {
            return Ok(Visible::All);
        }
        Ok(Visible::Some(
            self.permissions_of(&caller.user)
                .await?
                .into_keys()
                .collect(),
        ))
    }

    /// Whether the caller may do `perm` on `name` in `vhost`: administrators may do
    /// anything; others as their permissions in the vhost say.
    async fn authorise(
        &self,
        caller: &Caller,
        vhost: &str,
        perm: Perm,
        name: &str,
    ) -> ApiResult<()> {
        if caller.admin() {
            return Ok(());
        }
        let perms = self.permissions_of(&caller.user).await?;
        let Some(def) = perms.get(vhost) else {
            return Err(ApiError::not_authorised(
                "User not authorised to access virtual host",
            ));
        };
        let compiled = Permissions::compile(def.clone()).map_err(ApiError::bad_request)?;
        if compiled.allows(perm, name) {
            Ok(())
        } else {
            Err(ApiError::not_authorised(format!(
                "access to '{name}' in vhost '{vhost}' refused for user '{}'",
                caller.user
            )))
        }
    }
}

enum Visible {
    All,
    Some(BTreeSet<String>),
}

impl Visible {
    fn sees(&self, vhost: &str) -> bool {
        match self {
            Visible::All => true,
            Visible::Some(v) => v.contains(vhost),
        }
    }
}

fn unexpected(other: AdminResponse) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_error",
        format!("unexpected answer from the broker: {other:?}"),
    )
}

// ---------------------------------------------------------------------------------------
// Request bodies

/// A JSON object body. RabbitMQ answers 415 to another content type and 400 to malformed
/// JSON.
fn json_body(headers: &HeaderMap, body: &Bytes) -> ApiResult<Map<String, Value>> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("");
        let mime = ct.split(';').next().unwrap_or("").trim();
        if !mime.eq_ignore_ascii_case("application/json") {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("content type '{ct}' is not application/json"),
            ));
        }
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_request("not a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("not json: {e}"))),
    }
}

fn flag(o: &Map<String, Value>, key: &str, default: bool) -> bool {
    match o.get(key) {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s == "true",
        _ => default,
    }
}

fn arguments(o: &Map<String, Value>) -> ApiResult<warren_core::message::FieldTable> {
    match o.get("arguments") {
        None | Some(Value::Null) => Ok(Default::default()),
        Some(Value::Object(m)) => Ok(m.iter().map(|(k, v)| (k.clone(), defs::field(v))).collect()),
        Some(_) => Err(ApiError::bad_request("arguments must be an object")),
    }
}

// ---------------------------------------------------------------------------------------
// Listing helpers: pagination, sorting, columns, name filter

/// RabbitMQ's list query parameters.
#[derive(Default)]
struct ListQuery {
    page: Option<usize>,
    page_size: usize,
    name: Option<String>,
    use_regex: bool,
    sort: Option<String>,
    sort_reverse: bool,
    columns: Option<Vec<String>>,
}

impl ListQuery {
    fn parse(q: &HashMap<String, String>) -> ApiResult<ListQuery> {
        let number = |key: &str| -> ApiResult<Option<usize>> {
            match q.get(key) {
                None => Ok(None),
                Some(v) => v.parse::<usize>().map(Some).map_err(|_| {
                    ApiError::bad_request(format!("{key} must be a positive integer, not '{v}'"))
                }),
            }
        };
        let page = number("page")?;
        if page == Some(0) {
            return Err(ApiError::bad_request("page must be a positive integer"));
        }
        let page_size = number("page_size")?.unwrap_or(100);
        if page_size == 0 || page_size > MAX_PAGE_SIZE {
            return Err(ApiError::bad_request(format!(
                "page_size must be between 1 and {MAX_PAGE_SIZE}"
            )));
        }
        Ok(ListQuery {
            page,
            page_size,
            name: q.get("name").filter(|n| !n.is_empty()).cloned(),
            use_regex: q.get("use_regex").is_some_and(|v| v == "true"),
            sort: q.get("sort").filter(|s| !s.is_empty()).cloned(),
            sort_reverse: q.get("sort_reverse").is_some_and(|v| v == "true"),
            columns: q.get("columns").map(|c| {
                c.split(',')
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .map(str::to_string)
                    .collect()
            }),
        })
    }
}

/// A dotted path into a JSON object (`message_stats.publish`).
fn lookup<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, key| v.get(key))
}

/// Keeps only `columns` (dotted paths keep their nesting), as RabbitMQ's `columns=`.
fn select_columns(v: Value, columns: &[String]) -> Value {
    let mut out = Value::Object(Map::new());
    for c in columns {
        let Some(found) = lookup(&v, c) else { continue };
        let mut at = &mut out;
        let parts: Vec<&str> = c.split('.').collect();
        for (i, part) in parts.iter().enumerate() {
            let Value::Object(o) = at else { break };
            if i + 1 == parts.len() {
                o.insert(part.to_string(), found.clone());
                break;
            }
            at = o
                .entry(part.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
        }
    }
    out
}

fn compare(a: Option<&Value>, b: Option<&Value>) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Some(Value::Number(x)), Some(Value::Number(y))) => x
            .as_f64()
            .partial_cmp(&y.as_f64())
            .unwrap_or(Ordering::Equal),
        (Some(Value::String(x)), Some(Value::String(y))) => x.cmp(y),
        (Some(Value::Bool(x)), Some(Value::Bool(y))) => x.cmp(y),
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        _ => Ordering::Equal,
    }
}

/// Applies the list query: a plain array without `page`, RabbitMQ's page object with it.
/// The items of `vhost` (named at the JSON pointer `vhost_at` of each) as a listing; 404
/// when the vhost does not exist, checked before `items` runs.
async fn listing_in(
    m: &Management,
    vhost: &str,
    vhost_at: &str,
    items: impl Future<Output = ApiResult<Vec<Value>>>,
    q: &HashMap<String, String>,
) -> ApiResult<Json<Value>> {
    m.vhost_exists(vhost).await?;
    let items = items
        .await?
        .into_iter()
        .filter(|x| x.pointer(vhost_at).and_then(Value::as_str) == Some(vhost))
        .collect();
    listing(items, q)
}

/// The item named `name` in `vhost`, or 404.
async fn one_named(
    items: impl Future<Output = ApiResult<Vec<Value>>>,
    vhost: &str,
    name: &str,
) -> ApiResult<Json<Value>> {
    items
        .await?
        .into_iter()
        .find(|x| x["vhost"] == vhost && x["name"] == name)
        .map(Json)
        .ok_or_else(ApiError::not_found)
}

fn listing(items: Vec<Value>, q: &HashMap<String, String>) -> ApiResult<Json<Value>> {
    let lq = ListQuery::parse(q)?;
    let total = items.len();
    let mut items: Vec<Value> = match &lq.name {
        Some(name) if lq.use_regex => {
            let re = regex_lite_match(name)?;
            items
                .into_iter()
                .filter(|v| v.get("name").and_then(Value::as_str).is_some_and(&re))
                .collect()
        }
        Some(name) => items
            .into_iter()
            .filter(|v| {
                v.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| n.contains(name.as_str()))
            })
            .collect(),
        None => items,
    };
    if let Some(sort) = &lq.sort {
        items.sort_by(|a, b| compare(lookup(a, sort), lookup(b, sort)));
    }
    if lq.sort_reverse {
        items.reverse();
    }
    let filtered = items.len();
    let project = |items: Vec<Value>| -> Vec<Value> {
        match &lq.columns {
            Some(cols) => items.into_iter().map(|v| select_columns(v, cols)).collect(),
            None => items,
        }
    };
    let Some(page) = lq.page else {
        return Ok(Json(Value::Array(project(items))));
    };
    let page_count = filtered.div_ceil(lq.page_size).max(1);
    if page > page_count {
        return Err(ApiError::bad_request(format!(
            "page {page} is past the last page, {page_count}"
        )));
    }
    let start = (page - 1) * lq.page_size;
    let page_items: Vec<Value> = items.into_iter().skip(start).take(lq.page_size).collect();
    Ok(Json(json!({
        "filtered_count": filtered,
        "item_count": page_items.len(),
        "items": project(page_items),
        "page": page,
        "page_count": page_count,
        "page_size": lq.page_size,
        "total_count": total,
    })))
}

/// `name` with `use_regex=true`: a regular expression (the core's `regex-lite`, through
/// the permission compiler, which anchors nothing).
fn regex_lite_match(pattern: &str) -> ApiResult<impl Fn(&str) -> bool> {
    let perms = Permissions::compile(PermissionDef {
        user: String::new(),
        vhost: String::new(),
        configure: pattern.to_string(),
        write: String::new(),
        read: String::new(),
    })
    .map_err(|e| ApiError::bad_request(format!("name is not a regular expression: {e}")))?;
    Ok(move |name: &str| perms.allows(Perm::Configure, name))
}

fn details(rate: f64) -> Value {
    json!({"rate": (rate * 10.0).round() / 10.0})
}

fn message_stats(s: &MessageStats, r: &Rate) -> Value {
    json!({
        "publish": s.publish, "publish_details": details(r.publish),
        "deliver_get": s.deliver_get, "deliver_get_details": details(r.deliver_get),
        "redeliver": s.redeliver, "redeliver_details": details(r.redeliver),
        "ack": s.ack, "ack_details": details(r.ack),
    })
}

// ---------------------------------------------------------------------------------------
// Shapes

impl Management {
    fn rate(&self, key: String, stats: MessageStats, depth: (u64, u64)) -> Rate {
        let now = warren_runtime::unix_ms();
        self.rates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .observe(key, now, stats, depth)
    }

    fn queue_json(&self, q: &QueueInfo) -> Value {
        let ready = q.messages_ready;
        let unacked = q.messages_unacked;
        let r = self.rate(
            format!("q\0{}\0{}", q.vhost, q.name),
            q.stats,
            (ready, unacked),
        );
        let mut v = json!({
            "name": q.name, "vhost": q.vhost, "type": q.queue_type.name(), "node": self.node.name,
            "state": "running", "durable": q.durable, "auto_delete": q.auto_delete,
            "exclusive": q.exclusive, "arguments": defs::table(&q.arguments),
            "consumers": q.consumers, "memory": q.memory,
            "messages": ready + unacked, "messages_details": details(r.ready + r.unacked),
            "messages_ready": ready, "messages_ready_details": details(r.ready),
            "messages_unacknowledged": unacked,
            "messages_unacknowledged_details": details(r.unacked),
            "messages_paged_out": q.paged_out, "messages_ram": ready - q.paged_out.min(ready),
            // Dead letters held until their targets confirm them (at-least-once).
            "messages_dlx": q.messages_dlx,
            "message_bytes_ram": q.memory,
            "exclusive_consumer_tag": Value::Null, "policy": q.policy,
            "effective_policy_definition": Value::Null, "operator_policy": Value::Null,
            // No consumer_utilisation: Warren does not measure it, and tools read a missing
            // field as unknown where a null breaks them (rabbitmqadmin 2.x wants a number).
            "single_active_consumer_tag": Value::Null, "head_message_timestamp": Value::Null,
            "messages_ready_ram": ready - q.paged_out.min(ready),
            "messages_unacknowledged_ram": unacked,
            "message_stats": message_stats(&q.stats, &r),
        });
        if let Some(extra) = self.placement.get().and_then(|p| p(&q.vhost, &q.name))
            && let Some(obj) = v.as_object_mut()
        {
            obj.extend(extra);
        }
        v
    }

    /// Queues as JSON, with each policy's definition (`effective_policy_definition`).
    async fn queues_json(&self, queues: &[QueueInfo]) -> ApiResult<Vec<Value>> {
        let policies = match self.ask(AdminRequest::ListPolicies).await? {
            AdminResponse::Policies(p) => p,
            other => return Err(unexpected(other)),
        };
        Ok(queues
            .iter()
            .map(|q| {
                let mut v = self.queue_json(q);
                if let Some(p) = policies
                    .iter()
                    .find(|p| p.vhost == q.vhost && Some(&p.name) == q.policy.as_ref())
                {
                    v["effective_policy_definition"] = defs::table(&p.definition);
                }
                v
            })
            .collect())
    }

    fn meta(&self) -> HashMap<u64, Arc<ConnMeta>> {
        self.broker
            .connection_meta()
            .into_iter()
            .map(|(id, m)| (id.0, m))
            .collect()
    }

    /// The connection's name as RabbitMQ makes it (`peer -> listener`); the id alone for a
    /// connection no gateway described.
    fn connection_name(&self, id: u64, meta: Option<&ConnMeta>) -> String {
        let Some(m) = meta else {
            return id.to_string();
        };
        let kind = listener_kind(m.protocol);
        match self.node.listeners.iter().find(|l| l.protocol == kind) {
            Some(l) => format!("{} -> {}", m.peer, l.addr),
            None => m.peer.to_string(),
        }
    }

    fn connection_json(&self, c: &ConnectionInfo, meta: Option<&ConnMeta>) -> Value {
        let r = self.rate(format!("c\0{}", c.conn.0), c.stats, (0, 0));
        let (peer_host, peer_port) = meta
            .and_then(|m| m.peer.parse::<SocketAddr>().ok())
            .map(|a| (a.ip().to_string(), a.port()))
            .unwrap_or_default();
        let protocol = meta.map_or("AMQP 0-9-1", |m| m.protocol);
        let kind = listener_kind(protocol);
        let listener = self.node.listeners.iter().find(|l| l.protocol == kind);
        let mut client_properties = meta
            .and_then(|m| m.client_properties.as_deref())
            .map(defs::table)
            .unwrap_or_else(|| json!({}));
        if let (Some(id), Value::Object(o)) = (
            meta.and_then(|m| m.client_id.as_deref()),
            &mut client_properties,
        ) {
            o.insert("client_id".into(), json!(id));
        }
        json!({
            "name": self.connection_name(c.conn.0, meta), "id": c.conn.0,
            "node": self.node.name, "type": "network", "state": if c.paused_by > 0 { "flow" } else { "running" },
            "protocol": protocol, "user": c.user, "user_who_performed_action": c.user,
            "vhost": c.vhost, "auth_mechanism": "PLAIN", "ssl": meta.is_some_and(|m| m.tls),
            "peer_host": peer_host, "peer_port": peer_port,
            "host": listener.map(|l| l.addr.ip().to_string()),
            "port": listener.map(|l| l.addr.port()),
            "channels": c.channels, "channel_max": 2047,
            "frame_max": meta.map_or(0, |m| m.frame_max), "timeout": meta.map_or(0, |m| m.heartbeat),
            "connected_at": meta.map_or(0, |m| m.connected_at),
            "user_provided_name": meta
                .and_then(|m| m.client_properties.as_deref())
                .and_then(|p| p.get("connection_name"))
                .map(defs::value),
            "client_properties": client_properties,
            "client_id": meta.and_then(|m| m.client_id.as_deref()),
            "consumers": c.consumers,
            "message_stats": message_stats(&c.stats, &r),
        })
    }

    fn channel_json(&self, c: &ChannelInfo, meta: Option<&ConnMeta>) -> Value {
        let r = self.rate(format!("ch\0{}\0{}", c.conn.0, c.channel), c.stats, (0, 0));
        let conn_name = self.connection_name(c.conn.0, meta);
        let (peer_host, peer_port) = meta
            .and_then(|m| m.peer.parse::<SocketAddr>().ok())
            .map(|a| (a.ip().to_string(), a.port()))
            .unwrap_or_default();
        json!({
            "name": format!("{conn_name} ({})", c.channel), "number": c.channel,
            "node": self.node.name, "vhost": c.vhost, "user": c.user, "state": "running",
            "connection_details": {"name": conn_name, "peer_host": peer_host, "peer_port": peer_port},
            "consumer_count": c.consumers, "messages_unacknowledged": c.unacked,
            "messages_unconfirmed": 0, "messages_uncommitted": 0, "acks_uncommitted": 0,
            "prefetch_count": c.prefetch, "global_prefetch_count": c.global_prefetch,
            "confirm": c.confirm, "transactional": c.transactional,
            "message_stats": message_stats(&c.stats, &r),
        })
    }

    async fn queue_list(&self) -> ApiResult<Vec<QueueInfo>> {
        match self.ask(AdminRequest::ListQueues).await? {
            AdminResponse::Queues(q) => Ok(q),
            other => Err(unexpected(other)),
        }
    }

    async fn connection_list(&self) -> ApiResult<Vec<ConnectionInfo>> {
        match self.ask(AdminRequest::ListConnections).await? {
            AdminResponse::Connections(c) => Ok(c),
            other => Err(unexpected(other)),
        }
    }

    async fn channel_list(&self) -> ApiResult<Vec<ChannelInfo>> {
        match self.ask(AdminRequest::ListChannels).await? {
            AdminResponse::Channels(c) => Ok(c),
            other => Err(unexpected(other)),
        }
    }

    async fn vhost_names(&self) -> ApiResult<Vec<String>> {
        match self.ask(AdminRequest::ListVhosts).await? {
            AdminResponse::Vhosts(v) => Ok(v.into_iter().map(|v| v.name).collect()),
            other => Err(unexpected(other)),
        }
    }

    /// 404 unless `vhost` exists.
    async fn vhost_exists(&self, vhost: &str) -> ApiResult<()> {
        if self.vhost_names().await?.iter().any(|v| v == vhost) {
            Ok(())
        } else {
            Err(ApiError::not_found())
        }
    }

    /// A change answered `Done`.
    async fn done(&self, request: AdminRequest) -> ApiResult<()> {
        match self.ask(request).await? {
            AdminResponse::Done(Ok(())) => Ok(()),
            AdminResponse::Done(Err(e)) => Err(ApiError::refused(e)),
            other => Err(unexpected(other)),
        }
    }

    /// One operation on the broker's admin channel in `vhost`.
    async fn op(&self, vhost: &str, op: Op) -> ApiResult<Option<Reply>> {
        match self
            .ask(AdminRequest::Op {
                vhost: vhost.to_string(),
                op,
            })
            .await?
        {
            AdminResponse::Op(Ok(reply)) => Ok(reply),
            AdminResponse::Op(Err(e)) => Err(protocol_error(&e)),
            other => Err(unexpected(other)),
        }
    }
}

/// The listener (`node.listeners`' protocol) a connection of `protocol` came through.
fn listener_kind(protocol: &str) -> &'static str {
    if protocol.starts_with("MQTT") {
        "mqtt"
    } else if protocol == "stream" {
        "stream"
    } else {
        "amqp"
    }
}

/// An AMQP error as RabbitMQ's API reports it: 404 for NOT_FOUND, 401 for ACCESS_REFUSED,
/// 400 for the rest (PRECONDITION_FAILED, RESOURCE_LOCKED, ...).
fn protocol_error(e: &warren_core::error::ProtocolError) -> ApiError {
    use warren_core::error::ErrorCode;
    match e.code {
        ErrorCode::NotFound => ApiError::new(StatusCode::NOT_FOUND, "not_found", e.text.clone()),
        ErrorCode::AccessRefused => ApiError::not_authorised(e.text.clone()),
        _ => ApiError::bad_request(e.text.clone()),
    }
}

fn no_content() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// A PUT's answer, as RabbitMQ's HTTP API gives it: 201 Created for a new object, 204 No
/// Content for one that existed (and was replaced).
fn put_status(existed: bool) -> StatusCode {
    if existed {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::CREATED
    }
}
