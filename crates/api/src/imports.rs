//! `/v1/pools/{pool}/imports`, `/v1/imports/{id}` and its recall (scope
//! `admin`): a partner's CSV uploaded as the request body, streamed into
//! the pool by the same importer as `codepool import` (same rules, same
//! summary, same audit record), never held whole in memory.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::controls::Recall;
use codepool_issuance::imports::{self, Header, ImportError, ImportOptions};
use codepool_issuance::model::ImportRecord;
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use crate::problem::Problem;
use crate::request::RequestId;
use crate::request::{Admin, Caller};
use crate::state::Api;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Upload {
    /// The name the import is recorded under (the partner's file name);
    /// the same name and pool resumes an interrupted upload.
    file: Option<String>,
    /// The body has no header row: every row is a code.
    #[serde(default)]
    no_header: bool,
    /// The header of the code column (default `code`).
    column: Option<String>,
}

/// A row an upload refused.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct InvalidRow {
    /// The row's line number in the file (the header is line 1).
    line: u64,
    reason: String,
}

/// What an upload did: the summary `codepool import` prints.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ImportSummary {
    import_id: String,
    pool: String,
    file: String,
    status: String,
    sha256: String,
    rows: u64,
    inserted: u64,
    duplicates: u64,
    /// Rows refused (malformed, or look-alikes of a code the pool holds).
    invalid: u64,
    lookalikes: u64,
    /// Of `invalid`, codes refused because another pool holds them.
    cross_pool: u64,
    /// The pools that hold the codes refused as cross-pool duplicates.
    cross_pool_pools: Vec<String>,
    /// The first invalid rows, by line number.
    invalid_rows: Vec<InvalidRow>,
    seconds: f64,
    codes_per_second: f64,
    /// The unfinished run of the same file this upload completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    resumed_from: Option<String>,
}

// Field for field the importer's summary, taken apart whole: a field
// added there does not compile here until it is shown or left out on
// purpose.
impl From<imports::ImportSummary> for ImportSummary {
    fn from(s: imports::ImportSummary) -> Self {
        let imports::ImportSummary {
            import_id,
            pool,
            file,
            status,
            sha256,
            rows,
            inserted,
            duplicates,
            invalid,
            lookalikes,
            cross_pool,
            cross_pool_pools,
            invalid_rows,
            seconds,
            codes_per_second,
            resumed_from,
        } = s;
        let invalid_rows = (invalid_rows.into_iter())
            .map(|imports::InvalidRow { line, reason }| InvalidRow { line, reason })
            .collect();
        ImportSummary {
            import_id,
            pool,
            file,
            status: status.to_string(),
            sha256,
            rows,
            inserted,
            duplicates,
            invalid,
            lookalikes,
            cross_pool,
            cross_pool_pools,
            invalid_rows,
            seconds,
            codes_per_second,
            resumed_from,
        }
    }
}

/// `POST /v1/pools/{pool}/imports?file=NAME`: the CSV is the body.
#[utoipa::path(
    post, path = "/v1/pools/{pool}/imports", tag = "imports",
    operation_id = "upload_import",
    params(("pool" = String, Path, description = "the pool the codes go to"),
           ("file" = Option<String>, Query, description = "the name the import is recorded under; the same name resumes an interrupted upload"),
           ("no_header" = Option<bool>, Query, description = "the body has no header row"),
           ("column" = Option<String>, Query, description = "the header of the code column (default `code`)")),
    request_body(content = String, content_type = "text/csv", description = "the partner's CSV, streamed"),
    responses(
        (status = 201, description = "imported: the summary, invalid rows by line number", body = ImportSummary),
        (status = 200, description = "nothing new (every code already in the pool): the summary", body = ImportSummary),
        (status = 415, description = "a Content-Encoding other than gzip", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "the file cannot be imported (a bad header, an unknown column)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn upload(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Path(pool): Path<String>,
    Query(q): Query<Upload>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    let name = q
        .file
        .clone()
        .unwrap_or_else(|| format!("(upload by api-key {})", key.name));
    let header = if q.no_header {
        Header::None
    } else {
        Header::Named(q.column.clone().unwrap_or_else(|| "code".into()))
    };
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let input = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    let input = match decoded(&headers, input) {
        Ok(input) => input,
        Err(other) => return unsupported_encoding(&other, &rid),
    };
    let options = ImportOptions {
        header,
        ..ImportOptions::default()
    };
    let actor =
        codepool_issuance::audit::Actor::api_key(&key.name, "POST /v1/pools/{name}/imports");
    let uploaded = api.upload(input, &name, &pool, &options, &actor);
    let summary = match uploaded.await {
        Ok(u) => {
            if let Err(e) = u.finished {
                tracing::warn!(error = %e, "import done; {e}");
            }
            u.summary
        }
        Err(e) => return import_failed(e, &rid),
    };
    if imports::all_rows_invalid(&summary) {
        return Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "all-rows-invalid",
            "every row was invalid, nothing was imported",
            "fix the rows listed in invalid_rows and upload the file again",
        )
        .with("summary", json!(ImportSummary::from(summary)))
        .at(&rid.0)
        .into_response();
    }
    let status = if summary.inserted > 0 {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(ImportSummary::from(summary))).into_response()
}

/// 415 for a Content-Encoding other than gzip.
fn unsupported_encoding(other: &str, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported-encoding",
        "the upload's encoding is not supported",
        format!("Content-Encoding {other:?} is not read; send the CSV as it is, or gzip-compressed with Content-Encoding: gzip"),
    )
    .at(&rid.0)
    .into_response()
}

fn import_failed(e: ImportError, rid: &RequestId) -> Response {
    let (status, slug) = match &e {
        ImportError::Store(s) if s.is_unavailable() => {
            return Problem::unavailable(&e).at(&rid.0).into_response()
        }
        ImportError::Store(_) => {
            return Problem::internal(&e, "the import stopped; run it again to finish it")
                .at(&rid.0)
                .into_response()
        }
        ImportError::Pool(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid-pool"),
        ImportError::Header { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "invalid-header"),
        ImportError::Rows(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid-csv"),
        ImportError::FileName(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid-file-name"),
        ImportError::Recalled(_) | ImportError::FileRecalled { .. } => {
            (StatusCode::CONFLICT, "recalled")
        }
        _ => (StatusCode::BAD_REQUEST, "unreadable-body"),
    };
    let detail = e.to_string();
    Problem::new(status, slug, "the import did not run", detail)
        .at(&rid.0)
        .into_response()
}

fn bad_id(id: &str, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-import",
        "no such import",
        format!(
            "no import {:?}; use the import_id an upload answered (24 hexadecimal digits)",
            id.chars().take(40).collect::<String>()
        ),
    )
    .at(&rid.0)
    .into_response()
}

/// An import's record: the same as `codepool import` writes.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ImportOut {
    import_id: String,
    pool: String,
    file: String,
    /// `running`, `done`, `interrupted` or `failed`.
    status: String,
    sha256: Option<String>,
    rows: u64,
    inserted: u64,
    duplicates: u64,
    invalid: u64,
    seconds: f64,
    error: Option<String>,
    started_at: String,
    finished_at: Option<String>,
}

impl From<&ImportRecord> for ImportOut {
    fn from(r: &ImportRecord) -> Self {
        ImportOut {
            import_id: r.id.to_hex(),
            pool: r.pool.clone(),
            file: r.file.clone(),
            status: r.status.to_string(),
            sha256: r.sha256.clone(),
            rows: r.rows,
            inserted: r.inserted,
            duplicates: r.duplicates,
            invalid: r.invalid,
            seconds: r.seconds,
            error: r.error.clone(),
            started_at: r.started_at.to_chrono().to_rfc3339(),
            finished_at: r.finished_at.map(|t| t.to_chrono().to_rfc3339()),
        }
    }
}

/// `GET /v1/imports/{id}`: the audit record of an import run.
#[utoipa::path(
    get, path = "/v1/imports/{import_id}", tag = "imports",
    operation_id = "show_import",
    params(("import_id" = String, Path, description = "the id an upload answered")),
    responses(
        (status = 200, description = "the import's record", body = ImportOut),
        (status = 404, description = "no such import", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn show(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    Path(id): Path<String>,
) -> Response {
    let Ok(oid) = bson::oid::ObjectId::parse_str(&id) else {
        return bad_id(&id, &rid);
    };
    match api.import_record(oid).await {
        Ok(Some(r)) => Json(ImportOut::from(&r)).into_response(),
        Ok(None) => bad_id(&id, &rid),
        Err(e) => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}

/// The body of a recall.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ReasonIn)]
pub(crate) struct RecallBody {
    /// Why (a partner leak): 1 to 200 characters.
    reason: String,
}

/// A code of the recalled import that a buyer already holds, masked.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeldCode {
    code: String,
    status: &'static str,
    order_id: Option<String>,
}

/// One run of the recalled file, and what the recall did to it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecalledRun {
    import_id: String,
    status: String,
    codes: u64,
    voided: u64,
}

/// What a recall did.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Recalled {
    import_id: String,
    pool: String,
    voided: u64,
    issued: u64,
    /// Every run of the same file into the pool that the recall covered.
    runs: Vec<RecalledRun>,
    held: Vec<HeldCode>,
}

impl From<&Recall> for Recalled {
    fn from(r: &Recall) -> Self {
        let runs = r.runs.iter().map(|run| RecalledRun {
            import_id: run.id.to_hex(),
            status: run.status.to_string(),
            codes: run.codes,
            voided: run.voided,
        });
        let held = r.held.iter().map(|c| HeldCode {
            code: c.masked(),
            status: c.status.name(),
            order_id: c.holder.as_ref().map(|h| h.order_id.clone()),
        });
        Recalled {
            import_id: r.import.id.to_hex(),
            pool: r.import.pool.clone(),
            voided: r.voided,
            issued: r.held.len() as u64,
            runs: runs.collect(),
            held: held.collect(),
        }
    }
}

/// `POST /v1/imports/{id}/recall` with `{"reason": …}`: voids every
/// still-unissued code of the import; lists the issued ones, masked.
#[utoipa::path(
    post, path = "/v1/imports/{import_id}/recall", tag = "imports",
    operation_id = "recall_import",
    params(("import_id" = String, Path, description = "the id an upload answered")),
    request_body(content = RecallBody, content_type = "application/json"),
    responses(
        (status = 200, description = "the import's unissued codes are void; the issued ones are listed, masked", body = Recalled),
        (status = 404, description = "no such import", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "the import and its linked runs hold no code (the problem names other runs of the file that do), or a run (an import or a generation) is still inserting codes (`run-in-progress`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "no reason, or one too long", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn recall(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    use codepool_issuance::controls::RecallError;
    let reason = serde_json::from_slice::<RecallBody>(&body)
        .map(|b| b.reason)
        .unwrap_or_default();
    let actor = codepool_issuance::audit::Actor::api_key(&key.name, "POST /v1/imports/{id}/recall");
    match api.recall_import(&id, &reason, &actor).await {
        Ok(r) => Json(Recalled::from(&r)).into_response(),
        Err(RecallError::Reason) => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-reason",
            "a recall needs a reason",
            "send {\"reason\": \"partner leak\"}: 1 to 200 characters saying why",
        )
        .field("reason")
        .at(&rid.0)
        .into_response(),
        Err(RecallError::BadId(_) | RecallError::UnknownImport(_)) => bad_id(&id, &rid),
        Err(e @ RecallError::Running(_)) => Problem::new(
            StatusCode::CONFLICT,
            "run-in-progress",
            "the run is still inserting codes",
            e.to_string(),
        )
        .at(&rid.0)
        .into_response(),
        Err(e @ (RecallError::NothingRecalled { .. } | RecallError::Empty { .. })) => Problem::new(
            StatusCode::CONFLICT,
            "nothing-to-recall",
            "the import holds no code",
            e.to_string(),
        )
        .at(&rid.0)
        .into_response(),
        Err(RecallError::Store(e)) => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}

/// The upload's bytes as the importer reads them: `Content-Encoding: gzip`
/// (curl --data-binary @codes.csv.gz -H 'Content-Encoding: gzip') through
/// a decoder, streamed; any other encoding is refused (the `Err` names it).
fn decoded<R: std::io::Read + Send + 'static>(
    headers: &axum::http::HeaderMap,
    input: R,
) -> Result<Box<dyn std::io::Read + Send>, String> {
    let encoding = headers
        .get(axum::http::header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase());
    match encoding.as_deref() {
        None | Some("identity") => Ok(Box::new(input)),
        Some("gzip" | "x-gzip") => Ok(Box::new(Gunzip::Pending(Some(input)))),
        Some(other) => Err(other.to_owned()),
    }
}

/// A gzip-compressed upload, decoded as it is read. The decoder is made on
/// the first read, in the importer's blocking task: making it reads the
/// gzip header, which must not block the runtime.
enum Gunzip<R: std::io::Read> {
    Pending(Option<R>),
    Reading(flate2::read::MultiGzDecoder<R>),
}

impl<R: std::io::Read> std::io::Read for Gunzip<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Gunzip::Pending(input) = self {
            let Some(input) = input.take() else {
                return Ok(0);
            };
            *self = Gunzip::Reading(flate2::read::MultiGzDecoder::new(input));
        }
        match self {
            Gunzip::Reading(d) => d.read(buf),
            Gunzip::Pending(_) => Ok(0),
        }
    }
}
