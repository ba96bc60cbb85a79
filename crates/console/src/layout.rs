//! The frame every page shares (head, navigation by role, sign-out) and
//! small rendering helpers. maud escapes every string it is given; nothing
//! here writes unescaped text except the fixed markup of this file.

use axum::response::Html;
use maud::{html, Markup};

use crate::frame::head;
pub use crate::frame::{bare, url_part};
use crate::sessions::Session;
use codepool_issuance::operators::Role;

/// The navigation: label, path, role needed.
const NAV: &[(&str, &str, Role)] = &[
    ("Pools", "/console/pools", Role::Viewer),
    ("Orders", "/console/orders", Role::Support),
    ("Channels", "/console/channels", Role::Viewer),
    ("Dead letters", "/console/dead-letters", Role::Admin),
    ("Shops", "/console/shops", Role::Admin),
    ("API keys", "/console/api-keys", Role::Admin),
    ("Operators", "/console/operators", Role::Admin),
    ("Audit", "/console/audit", Role::Admin),
];

/// A page for a signed-in operator.
pub fn page(s: &Session, title: &str, body: Markup) -> Html<String> {
    let markup = html! {
        (head(title))
        body {
            header.top {
                a.brand href="/console/pools" { "codepool" }
                nav {
                    @for (label, path, role) in NAV {
                        @if s.operator.may(*role) {
                            a href=(path) { (label) }
                        }
                    }
                }
                form.signout method="post" action="/console/signout" {
                    (csrf(s))
                    span.who { (s.operator.name) " · " (s.operator.role.as_str()) }
                    button type="submit" { "Sign out" }
                }
            }
            main { (body) }
        }
    };
    Html(markup.into_string())
}

/// The hidden CSRF field of a state-changing form.
pub fn csrf(s: &Session) -> Markup {
    html! { input type="hidden" name="csrf" value=(s.csrf()); }
}

/// A time as operators read it (UTC, to the second).
pub fn when(t: bson::DateTime) -> String {
    when_chrono(t.to_chrono())
}

pub fn when_chrono(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// 1234567 as "1,234,567".
pub fn count(n: u64) -> String {
    let digits: Vec<char> = n.to_string().chars().rev().collect();
    let groups: Vec<String> = digits
        .chunks(3)
        .map(|g| g.iter().rev().collect())
        .rev()
        .collect();
    groups.join(",")
}

/// A notice at the top of a page (the outcome of an action).
pub fn notice(text: &str) -> Markup {
    html! { p.notice role="status" { (text) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parts_keep_only_unreserved_bytes() {
        assert_eq!(url_part("O-1001_a.b~"), "O-1001_a.b~");
        assert_eq!(url_part("a/b c<"), "a%2Fb%20c%3C");
        assert_eq!(url_part("é"), "%C3%A9");
    }

    #[test]
    fn counts_group_thousands() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(10_000_000), "10,000,000");
    }
}
