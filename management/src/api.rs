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

mod parameters;

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

// ---------------------------------------------------------------------------------------
// Node and overview

const EXCHANGE_TYPES: [(&str, &str); 4] = [
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

async fn overview(
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

async fn nodes(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    caller.require_monitor()?;
    Ok(Json(json!([m.node_json().await?])))
}

async fn node(
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

async fn whoami(Extension(caller): Extension<Caller>) -> Json<Value> {
    Json(json!({"name": caller.user, "tags": caller.tags}))
}

async fn alarms(
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
async fn health_port_listener(
    State(m): State<Shared>,
    Path(port): Path<String>,
) -> ApiResult<Response> {
    crate::health::port_listener(&m, &port).ok_or_else(|| ApiError::bad_request("Invalid port"))
}

async fn health_protocol_listener(
    State(m): State<Shared>,
    Path(protocol): Path<String>,
) -> Response {
    crate::health::protocol_listener(&m, &protocol)
}

async fn health_virtual_hosts() -> Response {
    crate::health::virtual_hosts()
}

async fn health_quorum_critical(State(m): State<Shared>) -> Response {
    crate::health::quorum_critical(&m)
}

/// Declares `aliveness-test` in the vhost, publishes to it and reads the message back,
/// as RabbitMQ's aliveness test.
async fn aliveness(
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

// ---------------------------------------------------------------------------------------
// Vhosts, users, permissions, policies

async fn vhosts(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let visible = m.visible(&caller).await?;
    let list = match m.ask(AdminRequest::ListVhosts).await? {
        AdminResponse::Vhosts(v) => v,
        other => return Err(unexpected(other)),
    };
    let queues = m.queue_list().await?;
    let stats = match m.ask(AdminRequest::VhostStats).await? {
        AdminResponse::VhostStats(s) => s,
        other => return Err(unexpected(other)),
    };
    let items = list
        .into_iter()
        .filter(|v| visible.sees(&v.name))
        .map(|v| {
            let in_vhost = queues.iter().filter(|q| q.vhost == v.name);
            let (ready, unacked) = in_vhost.fold((0, 0), |(r, u), q| {
                (r + q.messages_ready, u + q.messages_unacked)
            });
            let s = stats
                .iter()
                .find(|(n, _)| *n == v.name)
                .map(|(_, s)| *s)
                .unwrap_or_default();
            let r = m.rate(format!("v\0{}", v.name), s, (ready, unacked));
            json!({
                "name": v.name, "description": v.description, "tags": [],
                "default_queue_type": "classic",
                "messages_details": details(r.ready + r.unacked),
                "messages_ready_details": details(r.ready),
                "messages_unacknowledged_details": details(r.unacked),
                "metadata": {"description": v.description, "tags": []},
                "tracing": false, "cluster_state": {m.node.name.clone(): "running"},
                "messages": ready + unacked, "messages_ready": ready,
                "messages_unacknowledged": unacked,
                "message_stats": message_stats(&s, &r),
            })
        })
        .collect();
    listing(items, &q)
}

async fn vhost(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    let Json(all) = vhosts(State(m), Extension(caller), Query(HashMap::new())).await?;
    all.as_array()
        .and_then(|a| a.iter().find(|v| v["name"] == name.as_str()))
        .cloned()
        .map(Json)
        .ok_or_else(ApiError::not_found)
}

async fn put_vhost(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    let o = json_body(&headers, &body)?;
    if m.vhost_names().await?.contains(&name) {
        // RabbitMQ updates the metadata of an existing vhost; Warren keeps it as it is.
        return Ok(no_content());
    }
    let description = o
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    m.done(AdminRequest::AddVhost(warren_core::access::VhostDef {
        name: name.clone(),
        description,
    }))
    .await?;
    // As RabbitMQ's API (rabbit_mgmt_wm_vhost): the user who created the vhost may use it
    // at once, with full permissions (checked against 3.10.8: 201, then GET
    // /api/permissions/v/guest is configure/write/read ".*"). An existing vhost's
    // permissions are left as they are.
    m.done(AdminRequest::SetPermissions(PermissionDef {
        user: caller.user,
        vhost: name,
        configure: ".*".into(),
        write: ".*".into(),
        read: ".*".into(),
    }))
    .await?;
    Ok(StatusCode::CREATED)
}

async fn delete_vhost(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    m.vhost_exists(&name).await?;
    m.done(AdminRequest::DeleteVhost(name)).await?;
    Ok(no_content())
}

fn user_json(u: &warren_core::access::UserDef) -> Value {
    use base64::Engine;
    json!({
        "name": u.name,
        "password_hash": base64::engine::general_purpose::STANDARD.encode(&u.password_hash),
        "hashing_algorithm": warren_core::access::HASHING_ALGORITHM,
        "tags": u.tags, "limits": {},
    })
}

async fn user_list(m: &Management) -> ApiResult<Vec<warren_core::access::UserDef>> {
    match m.ask(AdminRequest::ListUsers).await? {
        AdminResponse::Users(u) => Ok(u),
        other => Err(unexpected(other)),
    }
}

async fn users(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    listing(user_list(&m).await?.iter().map(user_json).collect(), &q)
}

async fn user(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    user_list(&m)
        .await?
        .iter()
        .find(|u| u.name == name)
        .map(|u| Json(user_json(u)))
        .ok_or_else(ApiError::not_found)
}

async fn put_user(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    use base64::Engine;
    caller.require_admin()?;
    let o = json_body(&headers, &body)?;
    let password_hash = match (o.get("password"), o.get("password_hash")) {
        (Some(Value::String(p)), _) => crate::hash_password(p).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                e.to_string(),
            )
        })?,
        (_, Some(Value::String(h))) => {
            let algorithm = o
                .get("hashing_algorithm")
                .and_then(Value::as_str)
                .unwrap_or(warren_core::access::HASHING_ALGORITHM);
            if algorithm != warren_core::access::HASHING_ALGORITHM {
                return Err(ApiError::bad_request(format!(
                    "hashing_algorithm '{algorithm}' is not supported (use {})",
                    warren_core::access::HASHING_ALGORITHM
                )));
            }
            base64::engine::general_purpose::STANDARD
                .decode(h)
                .map_err(|_| ApiError::bad_request("password_hash is not base64"))?
        }
        _ => Vec::new(),
    };
    let exists = user_list(&m).await?.iter().any(|u| u.name == name);
    if o.get("tags").is_none() && !o.contains_key("password") && !o.contains_key("password_hash") {
        return Err(ApiError::bad_request(
            "tags, password or password_hash is required",
        ));
    }
    if exists {
        if !password_hash.is_empty() {
            m.done(AdminRequest::ChangePassword {
                user: name.clone(),
                password_hash,
            })
            .await?;
        }
        m.done(AdminRequest::SetUserTags {
            user: name,
            tags: defs::tags(&o),
        })
        .await?;
        return Ok(no_content());
    }
    m.done(AdminRequest::AddUser(warren_core::access::UserDef {
        name,
        password_hash,
        tags: defs::tags(&o),
    }))
    .await?;
    Ok(StatusCode::CREATED)
}

async fn delete_user(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    if !user_list(&m).await?.iter().any(|u| u.name == name) {
        return Err(ApiError::not_found());
    }
    m.done(AdminRequest::DeleteUser(name)).await?;
    Ok(no_content())
}

fn permission_json(p: &PermissionDef) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

async fn permission_list(m: &Management) -> ApiResult<Vec<PermissionDef>> {
    match m.ask(AdminRequest::ListPermissions).await? {
        AdminResponse::Permissions(p) => Ok(p),
        other => Err(unexpected(other)),
    }
}

async fn permissions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    listing(
        permission_list(&m)
            .await?
            .iter()
            .map(permission_json)
            .collect(),
        &q,
    )
}

async fn permission(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    permission_list(&m)
        .await?
        .iter()
        .find(|p| p.vhost == vhost && p.user == user)
        .map(|p| Json(permission_json(p)))
        .ok_or_else(ApiError::not_found)
}

/// Setting permissions for a vhost or user that does not exist: RabbitMQ answers 400 with
/// this reason (a delete of missing permissions is a 404).
fn vhost_or_user_not_found(e: ApiError) -> ApiError {
    if e.status == StatusCode::NOT_FOUND {
        ApiError::bad_request("vhost_or_user_not_found")
    } else {
        e
    }
}

async fn put_permission(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost)
        .await
        .map_err(vhost_or_user_not_found)?;
    let text = |k: &str| -> ApiResult<String> {
        o.get(k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| ApiError::bad_request(format!("'{k}' is required (a regex)")))
    };
    let existed = permission_list(&m)
        .await?
        .iter()
        .any(|p| p.vhost == vhost && p.user == user);
    m.done(AdminRequest::SetPermissions(PermissionDef {
        user,
        vhost,
        configure: text("configure")?,
        write: text("write")?,
        read: text("read")?,
    }))
    .await
    .map_err(vhost_or_user_not_found)?;
    Ok(put_status(existed))
}

async fn delete_permission(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    if !permission_list(&m)
        .await?
        .iter()
        .any(|p| p.vhost == vhost && p.user == user)
    {
        return Err(ApiError::not_found());
    }
    m.done(AdminRequest::ClearPermissions { vhost, user })
        .await?;
    Ok(no_content())
}

fn topic_permission_json(p: &TopicPermissionDef) -> Value {
    json!({
        "user": p.user, "vhost": p.vhost, "exchange": p.exchange, "write": p.write,
        "read": p.read,
    })
}

async fn topic_permission_list(m: &Management) -> ApiResult<Vec<TopicPermissionDef>> {
    match m.ask(AdminRequest::ListTopicPermissions).await? {
        AdminResponse::TopicPermissions(p) => Ok(p),
        other => Err(unexpected(other)),
    }
}

/// The topic permissions `keep` picks, as a listing.
async fn topic_permissions_where(
    m: &Management,
    caller: &Caller,
    q: &HashMap<String, String>,
    keep: impl Fn(&TopicPermissionDef) -> bool,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    listing(
        topic_permission_list(m)
            .await?
            .iter()
            .filter(|p| keep(p))
            .map(topic_permission_json)
            .collect(),
        q,
    )
}

async fn topic_permissions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    topic_permissions_where(&m, &caller, &q, |_| true).await
}

async fn user_topic_permissions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(user): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    topic_permissions_where(&m, &caller, &q, |p| p.user == user).await
}

async fn vhost_topic_permissions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    m.vhost_exists(&vhost).await?;
    topic_permissions_where(&m, &caller, &q, |p| p.vhost == vhost).await
}

/// A user's topic permissions in a vhost, one per exchange (404 when it has none), as
/// RabbitMQ's `/api/topic-permissions/{vhost}/{user}`.
async fn topic_permission(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    let found: Vec<Value> = topic_permission_list(&m)
        .await?
        .iter()
        .filter(|p| p.vhost == vhost && p.user == user)
        .map(topic_permission_json)
        .collect();
    if found.is_empty() {
        return Err(ApiError::not_found());
    }
    Ok(Json(Value::Array(found)))
}

/// Sets the topic permissions of a user on the exchange the body names (`exchange`,
/// `write`, `read`), as RabbitMQ's PUT.
async fn put_topic_permission(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    let o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost)
        .await
        .map_err(vhost_or_user_not_found)?;
    let text = |k: &str, what: &str| -> ApiResult<String> {
        o.get(k)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| ApiError::bad_request(format!("'{k}' is required ({what})")))
    };
    let exchange = text("exchange", "a topic exchange's name")?;
    let existed = topic_permission_list(&m)
        .await?
        .iter()
        .any(|p| p.vhost == vhost && p.user == user && p.exchange == exchange);
    m.done(AdminRequest::SetTopicPermissions(TopicPermissionDef {
        user,
        vhost,
        exchange,
        write: text("write", "a regex")?,
        read: text("read", "a regex")?,
    }))
    .await
    .map_err(vhost_or_user_not_found)?;
    Ok(put_status(existed))
}

/// Clears a user's topic permissions in a vhost (every exchange's, or only the one named
/// by an `exchange` in a JSON body).
async fn delete_topic_permission(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    let exchange = if body.is_empty() {
        None
    } else {
        json_body(&headers, &body)?
            .get("exchange")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    if !topic_permission_list(&m).await?.iter().any(|p| {
        p.vhost == vhost && p.user == user && exchange.as_ref().is_none_or(|x| *x == p.exchange)
    }) {
        return Err(ApiError::not_found());
    }
    m.done(AdminRequest::ClearTopicPermissions {
        vhost,
        user,
        exchange,
    })
    .await?;
    Ok(no_content())
}

fn policy_json(p: &warren_core::policy::PolicyDef) -> Value {
    json!({
        "vhost": p.vhost, "name": p.name, "pattern": p.pattern,
        "apply-to": p.apply_to.as_str(), "definition": defs::table(&p.definition),
        "priority": p.priority,
    })
}

async fn policy_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    match m.ask(AdminRequest::ListPolicies).await? {
        AdminResponse::Policies(p) => Ok(p
            .iter()
            .filter(|p| visible.sees(&p.vhost))
            .map(policy_json)
            .collect()),
        other => Err(unexpected(other)),
    }
}

async fn policies(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(policy_list(&m, &caller).await?, &q)
}

async fn policies_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", policy_list(&m, &caller), &q).await
}

async fn policy(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    one_named(policy_list(&m, &caller), &vhost, &name).await
}

async fn may_set_policies(m: &Management, caller: &Caller, vhost: &str) -> ApiResult<()> {
    if caller.admin() {
        return Ok(());
    }
    if !caller.policymaker() {
        return Err(ApiError::not_authorised("Not policymaker user"));
    }
    if !m.permissions_of(&caller.user).await?.contains_key(vhost) {
        return Err(ApiError::not_authorised(
            "User not authorised to access virtual host",
        ));
    }
    Ok(())
}

async fn put_policy(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let mut o = json_body(&headers, &body)?;
    m.vhost_exists(&vhost).await?;
    may_set_policies(&m, &caller, &vhost).await?;
    o.insert("vhost".into(), json!(vhost));
    o.insert("name".into(), json!(name));
    let def = defs::policy(&o).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let existed = policy_list(&m, &caller)
        .await?
        .iter()
        .any(|p| p["vhost"] == vhost.as_str() && p["name"] == name.as_str());
    m.done(AdminRequest::SetPolicy(def)).await?;
    Ok(put_status(existed))
}

async fn delete_policy(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    may_set_policies(&m, &caller, &vhost).await?;
    if !policy_list(&m, &caller)
        .await?
        .iter()
        .any(|p| p["vhost"] == vhost.as_str() && p["name"] == name.as_str())
    {
        return Err(ApiError::not_found());
    }
    m.done(AdminRequest::ClearPolicy { vhost, name }).await?;
    Ok(no_content())
}

// ---------------------------------------------------------------------------------------
// Exchanges

async fn exchange_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
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

async fn exchanges(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(exchange_list(&m, &caller).await?, &q)
}

async fn exchanges_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", exchange_list(&m, &caller), &q).await
}

/// `amq.default` is how the API names the default exchange (`""`).
fn exchange_name(name: &str) -> &str {
    if name == "amq.default" { "" } else { name }
}

async fn exchange(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let name = exchange_name(&name);
    one_named(exchange_list(&m, &caller), &vhost, name).await
}

async fn put_exchange(
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

async fn delete_exchange(
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
async fn purge_scheduled(
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

async fn publish(
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

fn properties_from_json(p: &Map<String, Value>) -> ApiResult<warren_core::message::Properties> {
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

fn properties_json(p: &warren_core::message::Properties) -> Value {
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

// ---------------------------------------------------------------------------------------
// Queues

async fn visible_queues(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    let queues: Vec<QueueInfo> = m
        .queue_list()
        .await?
        .into_iter()
        .filter(|q| visible.sees(&q.vhost))
        .collect();
    m.queues_json(&queues).await
}

async fn queues(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(visible_queues(&m, &caller).await?, &q)
}

async fn queues_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", visible_queues(&m, &caller), &q).await
}

async fn queue(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    one_named(visible_queues(&m, &caller), &vhost, &name).await
}

async fn put_queue(
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

async fn delete_queue(
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

async fn purge(
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
async fn get_messages(
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

// ---------------------------------------------------------------------------------------
// Bindings

/// RabbitMQ's `properties_key`: `~` for no key and no arguments, else the key (arguments
/// add a hash suffix there; Warren's bindings with arguments are named by key and `~args`).
fn properties_key(routing_key: &str, args: &warren_core::message::FieldTable) -> String {
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

async fn binding_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
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

async fn bindings(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(binding_list(&m, &caller).await?, &q)
}

async fn bindings_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", binding_list(&m, &caller), &q).await
}

async fn queue_bindings(
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

fn destination_kind(kind: &str) -> ApiResult<&'static str> {
    match kind {
        "q" => Ok("queue"),
        "e" => Ok("exchange"),
        _ => Err(ApiError::not_found()),
    }
}

async fn bindings_between(
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

async fn post_binding(
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

async fn binding(
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

async fn delete_binding(
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

// ---------------------------------------------------------------------------------------
// Connections, channels, consumers

async fn connection_values(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let meta = m.meta();
    Ok(m.connection_list()
        .await?
        .iter()
        .filter(|c| caller.monitor() || c.user == caller.user)
        .map(|c| m.connection_json(c, meta.get(&c.conn.0).map(|m| &**m)))
        .collect())
}

async fn connections(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(connection_values(&m, &caller).await?, &q)
}

/// A connection by RabbitMQ's name (`peer -> listener`) or by Warren's numeric id.
async fn find_connection(m: &Management, caller: &Caller, name: &str) -> ApiResult<Value> {
    connection_values(m, caller)
        .await?
        .into_iter()
        .find(|c| c["name"] == name || c["id"].as_u64().is_some_and(|id| id.to_string() == name))
        .ok_or_else(ApiError::not_found)
}

async fn connection(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<Json<Value>> {
    find_connection(&m, &caller, &name).await.map(Json)
}

/// Closes a connection (320 CONNECTION_FORCED); the reason is the `X-Reason` header, as
/// RabbitMQ's API takes it.
async fn close_connection(
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

async fn channels(
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

async fn consumer_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
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

async fn consumers(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(consumer_list(&m, &caller).await?, &q)
}

async fn consumers_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/queue/vhost", consumer_list(&m, &caller), &q).await
}

// ---------------------------------------------------------------------------------------
// Definitions

async fn definitions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    match m.ask(AdminRequest::Definitions).await? {
        AdminResponse::Definitions(d) => Ok(Json(defs::export(&d))),
        other => Err(unexpected(other)),
    }
}

async fn import(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    // RabbitMQ's UI posts the file as a form; tools post JSON.
    let doc = Value::Object(json_body(&headers, &body)?);
    let mut imported = defs::import(&doc).map_err(|e| ApiError::bad_request(e.to_string()))?;
    defs::check_parameters(&mut imported, |c, h, n, v| m.validate_parameter(c, h, n, v));
    for s in &imported.skipped {
        tracing::warn!("definitions import: skipped {}", Escaped(s));
    }
    let answer = m.ask(AdminRequest::Import(imported.definitions)).await?;
    m.parameters_changed();
    match answer {
        AdminResponse::Imported(report) if report.errors.is_empty() => Ok(no_content()),
        AdminResponse::Imported(report) => Err(ApiError::bad_request(report.errors.join("; "))),
        other => Err(unexpected(other)),
    }
}
