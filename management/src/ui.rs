//! The web UI: three static files embedded at build time (no CDN: it must work on a machine
//! without internet), served beside the API on the same listener. The files need no
//! credentials, as RabbitMQ's UI does not: the page asks for them and every API call it
//! makes is authenticated as any other client's.

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX: &str = include_str!("../ui/index.html");
const SCRIPT: &str = include_str!("../ui/app.js");
const STYLE: &str = include_str!("../ui/app.css");

/// Scripts and styles from this origin only; the page's inline `style` attributes (chart
/// legends) are the one exception. Blob URLs carry the definitions download.
const CSP: &str = "default-src 'self'; style-src 'self' 'unsafe-inline'; \
    img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'";

pub(crate) fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        body,
    )
}

/// A 401 to the page's own requests (`X-Requested-With: XMLHttpRequest`, the common
/// convention) carries no `WWW-Authenticate`: with it, the browser holds the request behind
/// its own password dialog and the page never sees the refusal. Other clients (rabbitmqadmin,
/// curl, a browser opening `/api/...` directly) keep the challenge, as RabbitMQ sends it.
pub(crate) async fn no_browser_prompt(request: Request, next: Next) -> Response {
    let from_page = request
        .headers()
        .get("x-requested-with")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"XMLHttpRequest"));
    let mut response = next.run(request).await;
    if from_page {
        response.headers_mut().remove(header::WWW_AUTHENTICATE);
    }
    response
}
