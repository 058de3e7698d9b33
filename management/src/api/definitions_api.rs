//! Definitions export and import (`/api/definitions`).

use super::*;

pub(super) async fn definitions(
    State(m): State<Shared>,
    Extension(caller): Extension<Caller>,
) -> ApiResult<Json<Value>> {
    caller.require_admin()?;
    match m.ask(AdminRequest::Definitions).await? {
        AdminResponse::Definitions(d) => Ok(Json(defs::export(&d))),
        other => Err(unexpected(other)),
    }
}

pub(super) async fn import(
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
