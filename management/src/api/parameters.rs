//! Runtime parameters (`/api/parameters`, RabbitMQ's shapes and status codes) and the
//! shovels' status (`/api/shovels`, rabbitmq_shovel_management's). A value is checked by
//! the host's links before the core keeps it (`Management::validate_parameter`); refusals
//! carry RabbitMQ's texts, with `<`, `>` and `&` escaped as its API escapes them.

use super::*;

fn parameter_json(p: &warren_core::parameter::ParameterDef) -> Value {
    let value = serde_json::from_str::<Value>(&p.value).unwrap_or(Value::Null);
    json!({"value": value, "vhost": p.vhost, "component": p.component, "name": p.name})
}

/// RabbitMQ's API escapes its error reasons as HTML text.
fn html_escaped(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Parameters may be read by those who may set policies, and by monitors.
fn may_read(caller: &Caller) -> ApiResult<()> {
    if caller.policymaker() || caller.monitor() {
        Ok(())
    } else {
        Err(ApiError::not_authorised("Not policymaker user"))
    }
}

async fn parameter_list(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    may_read(caller)?;
    let visible = m.visible(caller).await?;
    match m.ask(AdminRequest::ListParameters).await? {
        AdminResponse::Parameters(ps) => Ok(ps
            .iter()
            .filter(|p| visible.sees(&p.vhost))
            .map(parameter_json)
            .collect()),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn all(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(parameter_list(&m, &caller).await?, &q)
}

pub(super) async fn of_component(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(component): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let items = parameter_list(&m, &caller)
        .await?
        .into_iter()
        .filter(|p| p["component"] == component.as_str())
        .collect();
    listing(items, &q)
}

pub(super) async fn in_vhost(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((component, vhost)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    let items = async {
        Ok(parameter_list(&m, &caller)
            .await?
            .into_iter()
            .filter(|p| p["component"] == component.as_str())
            .collect())
    };
    listing_in(&m, &vhost, "/vhost", items, &q).await
}

async fn find(
    m: &Management,
    caller: &Caller,
    component: &str,
    vhost: &str,
    name: &str,
) -> ApiResult<Option<Value>> {
    Ok(parameter_list(m, caller)
        .await?
        .into_iter()
        .find(|p| p["component"] == component && p["vhost"] == vhost && p["name"] == name))
}

pub(super) async fn one(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((component, vhost, name)): Path<(String, String, String)>,
) -> ApiResult<Json<Value>> {
    find(&m, &caller, &component, &vhost, &name)
        .await?
        .map(Json)
        .ok_or_else(ApiError::not_found)
}

pub(super) async fn put(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((component, vhost, name)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let o = json_body(&headers, &body)?;
    if m.vhost_exists(&vhost).await.is_err() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "vhost_not_found",
        ));
    }
    may_set_policies(&m, &caller, &vhost).await?;
    let Some(value) = o.get("value") else {
        return Err(ApiError::bad_request("[{key_missing,value}]"));
    };
    m.validate_parameter(&component, &vhost, &name, value)
        .map_err(|e| ApiError::bad_request(html_escaped(&e)))?;
    let existed = find(&m, &caller, &component, &vhost, &name)
        .await?
        .is_some();
    let def = warren_core::parameter::ParameterDef {
        component,
        vhost,
        name,
        value: value.to_string(),
    };
    m.done(AdminRequest::SetParameter(def)).await?;
    m.parameters_changed();
    Ok(put_status(existed))
}

pub(super) async fn delete(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path((component, vhost, name)): Path<(String, String, String)>,
) -> ApiResult<StatusCode> {
    may_set_policies(&m, &caller, &vhost).await?;
    if find(&m, &caller, &component, &vhost, &name)
        .await?
        .is_none()
    {
        return Err(ApiError::not_found());
    }
    m.done(AdminRequest::ClearParameter {
        vhost,
        component,
        name,
    })
    .await?;
    m.parameters_changed();
    Ok(no_content())
}

async fn shovel_rows(m: &Management, caller: &Caller) -> ApiResult<Vec<Value>> {
    let visible = m.visible(caller).await?;
    let rows = m.links.get().map(|l| l.shovels()).unwrap_or_default();
    Ok(rows
        .into_iter()
        .filter(|r| r["vhost"].as_str().is_some_and(|v| visible.sees(v)))
        .collect())
}

pub(super) async fn shovels(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing(shovel_rows(&m, &caller).await?, &q)
}

/// The MQTT bridges' status (node-wide: monitoring users and administrators).
pub(super) async fn bridges(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    caller.require_monitor()?;
    listing(m.links.get().map(|l| l.bridges()).unwrap_or_default(), &q)
}

pub(super) async fn shovels_in(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    listing_in(&m, &vhost, "/vhost", shovel_rows(&m, &caller), &q).await
}
