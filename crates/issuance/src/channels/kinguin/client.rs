//! Kinguin's Sales Manager API as codepool calls it, apart from the
//! uploads: the bearer token and an offer's declared stock. The uploader
//! ([`super::Uploader`]) and the declarer
//! ([`crate::channels::stock::Declarer`]) of a process share one
//! [`Tokens`], so a token fetched by one serves the other.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use codepool_store::channels::ChannelDoc;
use codepool_store::Store;
use serde_json::{json, Value};

/// Where a channel's token comes from unless its credentials name a
/// `token_url`: this path under its `base_url`.
pub const TOKEN_PATH: &str = "/oauth/token";

/// The channel's API base URL, without a trailing `/`.
pub fn base(c: &ChannelDoc) -> Result<String, String> {
    c.base_url
        .as_deref()
        .map(|b| b.trim_end_matches('/').to_owned())
        .ok_or_else(|| "the channel has no base_url".into())
}

/// Where the channel's bearer token is fetched: its `token_url`, or
/// [`TOKEN_PATH`] under its `base_url`.
pub fn token_url(c: &ChannelDoc) -> Result<String, String> {
    match &c.auth_url {
        Some(u) => Ok(u.clone()),
        None => Ok(format!("{}{TOKEN_PATH}", base(c)?)),
    }
}

/// The bearer tokens of Kinguin's API, one per channel, each kept until a
/// minute before its end. One fetch at a time: callers that find no
/// token wait for the one being fetched.
#[derive(Default)]
pub struct Tokens {
    kept: std::sync::Mutex<HashMap<String, (String, Instant)>>,
    fetching: tokio::sync::Mutex<()>,
}

impl Tokens {
    /// The token in hand for `c` unless it is `refused` (Kinguin answered
    /// 401 to it) or past its end; else a new one from [`token_url`]
    /// (OAuth2 client credentials).
    pub async fn get(
        &self,
        http: &reqwest::Client,
        store: &Store,
        c: &ChannelDoc,
        refused: Option<&str>,
    ) -> Result<String, String> {
        if let Some(t) = self.kept(c, refused) {
            return Ok(t);
        }
        let _one = self.fetching.lock().await;
        // Fetched by another caller meanwhile.
        if let Some(t) = self.kept(c, refused) {
            return Ok(t);
        }
        let (token, life) = fetch(http, store, c).await?;
        let until = Instant::now() + life;
        self.kept
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(c.name.clone(), (token.clone(), until));
        Ok(token)
    }

    fn kept(&self, c: &ChannelDoc, refused: Option<&str>) -> Option<String> {
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let (t, until) = kept.get(&c.name)?;
        (Instant::now() < *until && refused != Some(t.as_str())).then(|| t.clone())
    }
}

/// A new token for `c` and how long to use it: until a minute before its
/// end (not at all, if it lives less than that).
async fn fetch(
    http: &reqwest::Client,
    store: &Store,
    c: &ChannelDoc,
) -> Result<(String, Duration), String> {
    let url = token_url(c)?;
    let id = c.client_id.clone().unwrap_or_default();
    let sealed = c
        .sealed
        .get("client_secret")
        .ok_or("the channel has no client_secret")?;
    let ring = (store.keys().ring_with(&sealed.key_id)).map_err(|e| e.to_string())?;
    let aad = format!("channel:{}:client_secret", c.name);
    let secret = ring
        .open(&sealed.key_id, aad.as_bytes(), &sealed.bytes.bytes)
        .map_err(|e| e.to_string())?;
    let form = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("grant_type", "client_credentials")
        .append_pair("client_id", &id)
        .append_pair("client_secret", &secret)
        .finish();
    let res = http
        .post(url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form)
        .send()
        .await
        .map_err(|e| format!("token: {e}"))?;
    let status = res.status();
    let body = res.bytes().await.map_err(|e| format!("token: {e}"))?;
    if !status.is_success() {
        return Err(format!("token: {status}"));
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let token = v["access_token"]
        .as_str()
        .ok_or("token: no access_token")?
        .to_owned();
    let life = v["expires_in"].as_u64().unwrap_or(300).saturating_sub(60);
    Ok((token, Duration::from_secs(life)))
}

/// Why a declaration did not reach Kinguin.
#[derive(Debug)]
pub enum NotDeclared {
    /// Kinguin refused this amount (400, e.g. "Max declared stock has
    /// been exceeded"): the same amount again is refused again.
    Refused(String),
    /// No answer, or one that may change (a token, 5xx, 429).
    Failed(String),
}

/// Declares `n` keys of `offer`: `PATCH {base}/api/v1/offers/{offer}`
/// `{declaredStock: n, declaredTextStock: n}` (text keys only); a 401
/// fetches a new token and sends once more.
pub async fn declare(
    http: &reqwest::Client,
    tokens: &Tokens,
    store: &Store,
    c: &ChannelDoc,
    offer: &str,
    n: u64,
) -> Result<(), NotDeclared> {
    let base = base(c).map_err(NotDeclared::Failed)?;
    // The offer id is a product id codepool took (letters, digits, `_`,
    // `-`): safe in a path.
    let url = format!("{base}/api/v1/offers/{offer}");
    let body = json!({"declaredStock": n, "declaredTextStock": n}).to_string();
    let mut refused = None;
    loop {
        let token =
            (tokens.get(http, store, c, refused.as_deref()).await).map_err(NotDeclared::Failed)?;
        let res = http
            .patch(&url)
            .bearer_auth(&token)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .map_err(|e| NotDeclared::Failed(e.to_string()))?;
        let status = res.status().as_u16();
        let text: String = (res.text().await.unwrap_or_default().chars())
            .take(300)
            .collect();
        return match status {
            200..=299 => Ok(()),
            401 if refused.is_none() => {
                refused = Some(token);
                continue;
            }
            400 => Err(NotDeclared::Refused(format!("{offer}: {text}"))),
            _ => Err(NotDeclared::Failed(format!("{offer}: {status} {text}"))),
        };
    }
}
