//! `POST /console/pools/{pool}/generations` (admin): the pool page's form
//! that makes codes in the pool, through the core's generation run that
//! `codepool generate` and the API start. The run goes on in the
//! background; the pool page lists it with its imports.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use codepool_domain::CodePattern;
use codepool_issuance::generations::{GenerateError, Generation};
use codepool_issuance::operators::Role;
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::url_part;
use crate::sessions::Session;
use crate::state::Console;

#[derive(Debug, Deserialize)]
pub struct GenerateForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    count: String,
    #[serde(default)]
    pattern: String,
    #[serde(default)]
    check_char: String,
}

/// Starts the run and goes back to the pool's page.
pub async fn start(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
    Form(f): Form<GenerateForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let count: u64 = f.count.trim().parse().map_err(|_| {
        Failure::Invalid(format!(
            "the number of codes must be a whole number, not {:?}",
            f.count
        ))
    })?;
    let text = match f.pattern.trim() {
        "" => codepool_domain::pattern::DEFAULT_PATTERN,
        p => p,
    };
    let pattern = CodePattern::parse(text, f.check_char == "true")
        .map_err(|e| Failure::Invalid(format!("pattern {text:?} refused: {e}")))?;
    let g = Generation {
        pool: pool.clone(),
        count,
        pattern,
        expires_at: None,
        run_id: None,
    };
    let actor = super::actor(&s, "POST /console/pools/{pool}/generations");
    match console.core.start_generation(g, actor).await {
        Ok(_) => {}
        Err(
            e @ (GenerateError::Pool(_)
            | GenerateError::Count(_)
            | GenerateError::ExpiredAtBirth(_)
            | GenerateError::Recalled { .. }),
        ) => return Err(Failure::Invalid(e.to_string())),
        Err(GenerateError::Store(e)) => return Err(e.into()),
        Err(e) => return Err(Failure::Unavailable(e.to_string())),
    }
    Ok(Redirect::to(&format!("/console/pools/{}", url_part(&pool))).into_response())
}
