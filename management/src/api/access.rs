//! Vhosts, users, permissions, topic permissions and policies.

use super::*;

pub(super) async fn vhosts(
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

pub(super) async fn vhost(
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

pub(super) async fn put_vhost(
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

pub(super) async fn delete_vhost(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    caller.require_admin()?;
    m.vhost_exists(&name).await?;
    m.done(AdminRequest::DeleteVhost(name)).await?;
    Ok(no_content())
}

pub(super) fn user_json(u: &warren_core::access::UserDef) -> Value {
    use base64::Engine;
    json!({
        "name": u.name,
        "password_hash": base64::engine::general_purpose::STANDARD.encode(&u.password_hash),
        "hashing_algorithm": warren_core::access::HASHING_ALGORITHM,
        "tags": u.tags, "limits": {},
    })
}

pub(super) async fn user_list(m: &Management) -> ApiResult<Vec<warren_core::access::UserDef>> {
    match m.ask(AdminRequest::ListUsers).await? {
        AdminResponse::Users(u) => Ok(u),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn users(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    listing(user_list(&m).await?.iter().map(user_json).collect(), &q)
}

pub(super) async fn user(
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

pub(super) async fn put_user(
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

pub(super) async fn delete_user(
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

pub(super) fn permission_json(p: &PermissionDef) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

pub(super) async fn permission_list(m: &Management) -> ApiResult<Vec<PermissionDef>> {
    match m.ask(AdminRequest::ListPermissions).await? {
        AdminResponse::Permissions(p) => Ok(p),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn permissions(
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

pub(super) async fn permission(
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
pub(super) fn vhost_or_user_not_found(e: ApiError) -> ApiError {
    if e.status == StatusCode::NOT_FOUND {
        ApiError::bad_request("vhost_or_user_not_found")
    } else {
        e
    }
}

pub(super) async fn put_permission(
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

pub(super) async fn delete_permission(
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

pub(super) fn topic_permission_json(p: &TopicPermissionDef) -> Value {
    json!({
        "user": p.user, "vhost": p.vhost, "exchange": p.exchange, "write": p.write,
        "read": p.read,
    })
}

pub(super) async fn topic_permission_list(m: &Management) -> ApiResult<Vec<TopicPermissionDef>> {
    match m.ask(AdminRequest::ListTopicPermissions).await? {
        AdminResponse::TopicPermissions(p) => Ok(p),
        other => Err(unexpected(other)),
    }
}

/// The topic permissions `keep` picks, as a listing.
pub(super) async fn topic_permissions_where(
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

pub(super) async fn topic_permissions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    topic_permissions_where(&m, &caller, &q, |_| true).await
}

pub(super) async fn user_topic_permissions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(user): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    topic_permissions_where(&m, &caller, &q, |p| p.user == user).await
}

pub(super) async fn vhost_topic_permissions(
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
pub(super) async fn topic_permission(
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
pub(super) async fn put_topic_permission(
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
pub(super) async fn delete_topic_permission(
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

pub(super) fn policy_json(p: &warren_core::policy::PolicyDef) -> Value {
    json!({
        "vhost": p.vhost, "name": p.name, "pattern": p.pattern,
        "apply-to": p.apply_to.as_str(), "definition": defs::table(&p.definition),
        "priority": p.priority,
    })
}

pub(super) async fn policy_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
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

pub(super) async fn policies(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(policy_list(&m, &caller).await?, &q)
}

pub(super) async fn policies_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", policy_list(&m, &caller), &q).await
}

pub(super) async fn policy(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    one_named(policy_list(&m, &caller), &vhost, &name).await
}

pub(super) async fn may_set_policies(
    m: &Management,
    caller: &Caller,
    vhost: &str,
) -> ApiResult<()> {
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

pub(super) async fn put_policy(
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

pub(super) async fn delete_policy(
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
