//! The page frame that needs no session: the document head, the bare page
//! of sign-in and errors, and URL escaping. Apart from `layout` (which
//! needs the signed-in session) so that the failure pages and the sessions
//! module depend on it without a circle of imports.

use maud::{html, Markup, DOCTYPE};

/// The document head every page shares.
pub(crate) fn head(title: &str) -> Markup {
    html! {
        (DOCTYPE)
        meta charset="utf-8";
        meta name="viewport" content="width=device-width, initial-scale=1";
        // htmx must not inject its own <style>: the CSP allows none.
        meta name="htmx-config" content=r#"{"includeIndicatorStyles":false,"allowEval":false}"#;
        title { (title) " · codepool console" }
        link rel="stylesheet" href="/console/static/console.css";
        script src="/console/static/htmx.min.js" defer {}
    }
}

/// A page without navigation (sign-in, errors).
pub fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (head(title))
        body.bare { main { (body) } }
    }
}

/// `s` for a URL path segment or query value: every byte but the
/// unreserved ones percent-encoded.
pub fn url_part(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, UNRESERVED_KEPT).to_string()
}

/// Everything but RFC 3986's unreserved characters is encoded.
const UNRESERVED_KEPT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');
