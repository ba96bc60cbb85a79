//! `POST /console/pools/{pool}/imports` (admin): a partner's CSV from an
//! upload form, streamed into the pool by the importer of `codepool
//! import` (same header rule, validation, look-alikes, duplicates, audit
//! record), never held whole in memory; then the summary with the invalid
//! rows by line number. The role is checked before the body is read; the
//! form sends its CSRF token and options before the file, each at most
//! [`FIELD_LIMIT`] bytes (else 413), so the token is checked before a
//! byte of the file is read.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use codepool_issuance::imports::{self, Header, ImportError, ImportOptions, ImportSummary};
use futures::TryStreamExt;
use maud::html;

use crate::failure::Failure;
use crate::layout::{self, count, url_part};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

/// The fields before the file, as the form sends them.
#[derive(Debug, Default)]
struct Options {
    csrf: String,
    column: String,
    no_header: bool,
}

/// Largest field of the form other than the file (the CSRF token, the
/// column name, the header flag).
pub const FIELD_LIMIT: u64 = 4 * 1024;

fn unreadable(e: multer::Error) -> Failure {
    match e {
        multer::Error::FieldSizeExceeded { field_name, .. } => Failure::TooLarge(format!(
            "the form field {:?} is larger than {FIELD_LIMIT} bytes; send the console's own upload form",
            field_name.unwrap_or_default()
        )),
        e => Failure::Invalid(format!(
            "the upload could not be read ({e}); send the form again"
        )),
    }
}

/// The form's fields, each but the file bounded by [`FIELD_LIMIT`].
fn form_constraints() -> multer::Constraints {
    multer::Constraints::new().size_limit(
        multer::SizeLimit::new()
            .per_field(FIELD_LIMIT)
            .for_field("file", u64::MAX),
    )
}

/// Reads the text fields up to the file; returns them and the file field.
async fn fields_then_file(
    mut form: multer::Multipart<'static>,
) -> Result<(Options, multer::Field<'static>), Failure> {
    let mut o = Options::default();
    while let Some(field) = form.next_field().await.map_err(unreadable)? {
        match field.name().unwrap_or_default() {
            "file" => return Ok((o, field)),
            "csrf" => o.csrf = field.text().await.map_err(unreadable)?,
            "column" => o.column = field.text().await.map_err(unreadable)?,
            "no_header" => o.no_header = field.text().await.map_err(unreadable)? == "true",
            _ => {}
        }
    }
    Err(Failure::Invalid(
        "the form carried no file; pick a CSV file and send it again".into(),
    ))
}

fn import_failure(e: ImportError) -> Failure {
    match e {
        ImportError::Store(s) => s.into(),
        other => Failure::Invalid(other.to_string()),
    }
}

/// `POST /console/pools/{pool}/imports`.
pub async fn upload(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Failure> {
    let boundary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| multer::parse_boundary(ct).ok())
        .ok_or_else(|| Failure::Invalid("send the upload form (multipart/form-data)".into()))?;
    s.need(Role::Admin)?;
    let form =
        multer::Multipart::with_constraints(body.into_data_stream(), boundary, form_constraints());
    let (o, file) = fields_then_file(form).await?;
    s.check_csrf(&o.csrf)?;
    let name = file
        .file_name()
        .map(str::to_owned)
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| format!("(upload by operator {})", s.operator.name));
    let header = if o.no_header {
        Header::None
    } else {
        Header::Named(
            Some(o.column.trim().to_owned())
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| "code".into()),
        )
    };
    let stream = file.map_err(std::io::Error::other);
    let input = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    let options = ImportOptions {
        header,
        ..ImportOptions::default()
    };
    let core = &console.core;
    let actor = super::actor(&s, "POST /console/pools/{pool}/imports");
    let uploaded = core.upload(input, &name, &pool, &options, &actor);
    let uploaded = uploaded.await.map_err(import_failure)?;
    let summary = uploaded.summary;
    match uploaded.finished {
        Ok(()) => {}
        Err(e @ codepool_issuance::controls::ImportedError::Audit(_)) => {
            return Err(Failure::Unavailable(e.to_string()))
        }
        Err(e) => tracing::warn!(error = %e, "import done; {e}"),
    }
    let status = if imports::all_rows_invalid(&summary) {
        StatusCode::UNPROCESSABLE_ENTITY
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        layout::page(&s, "Import summary", summary_page(&summary)),
    )
        .into_response())
}

fn summary_page(r: &ImportSummary) -> maud::Markup {
    html! {
        h1 { "Import into " (r.pool) }
        @if r.invalid > 0 && r.inserted + r.duplicates == 0 {
            p.problem role="alert" { "Every row was invalid: nothing was imported. Fix the rows below and upload the file again." }
        }
        dl.summary #import-summary {
            dt { "File" } dd { (r.file) }
            dt { "Status" } dd { (r.status) }
            dt { "Rows" } dd.rows { (count(r.rows)) }
            dt { "Inserted" } dd.inserted { (count(r.inserted)) }
            dt { "Duplicates (already in the pool)" } dd.duplicates { (count(r.duplicates)) }
            dt { "Invalid" } dd.invalid { (count(r.invalid)) @if r.lookalikes > 0 { " (" (r.lookalikes) " look-alikes)" } }
            dt { "Import id" } dd { code { (r.import_id) } }
            dt { "SHA-256" } dd { code { (r.sha256) } }
            dt { "Time" } dd { (format!("{:.2} s", r.seconds)) }
        }
        @if !r.invalid_rows.is_empty() {
            h2 { "Invalid rows" }
            table.invalid-rows { thead { tr { th { "Line" } th { "Why" } } }
                tbody { @for row in &r.invalid_rows { tr { td.num { (row.line) } td { (row.reason) } } } } }
        }
        p { a href={"/console/pools/" (url_part(&r.pool))} { "Back to pool " (r.pool) } }
    }
}
