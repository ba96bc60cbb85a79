//! `/console/static/{file}`: the console's own stylesheet and the vendored
//! htmx (2.0.11, from the npm package `htmx.org`), built into the binary.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

const CSS: &str = include_str!("../../static/console.css");
const HTMX: &str = include_str!("../../static/htmx.min.js");

pub async fn file(Path(file): Path<String>) -> Response {
    let (body, kind) = match file.as_str() {
        "console.css" => (CSS, "text/css; charset=utf-8"),
        "htmx.min.js" => (HTMX, "text/javascript; charset=utf-8"),
        _ => return (StatusCode::NOT_FOUND, "no such file").into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        body,
    )
        .into_response()
}
