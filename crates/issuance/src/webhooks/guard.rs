//! Where a webhook may go: https, to a public address. http, loopback,
//! private, link-local (the cloud metadata address among them), shared,
//! multicast and unspecified addresses are refused when an endpoint is
//! added, and again at every delivery against the address the name
//! resolves to then ([`GuardedResolver`]), so a name that re-resolves to
//! an inside address (DNS rebinding) reaches nothing. Hosts named in
//! `CODEPOOL_WEBHOOK_ALLOW_HOSTS` pass, over http too (development, tests).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use url::{Host, Url};

/// Why an endpoint address is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("{0:?} is not a URL: give one like https://shop.example/hooks")]
    NotUrl(String),
    #[error("webhooks go over https only: use https://{0}, or list the host in CODEPOOL_WEBHOOK_ALLOW_HOSTS for development")]
    NotHttps(String),
    #[error("the URL must not carry a user name or password; put credentials in the path or rely on the signature")]
    Credentials,
    #[error("{host} is {what} ({ip}): webhooks go to public addresses only; list the host in CODEPOOL_WEBHOOK_ALLOW_HOSTS to allow it")]
    Inside {
        host: String,
        ip: IpAddr,
        what: &'static str,
    },
    #[error("{0} does not resolve: check the host name")]
    Unresolved(String),
}

/// The hosts let through whatever their address or scheme.
#[derive(Debug, Clone, Default)]
pub struct AllowHosts(Arc<HashSet<String>>);

impl AllowHosts {
    /// From a comma-separated list (`CODEPOOL_WEBHOOK_ALLOW_HOSTS`).
    pub fn parse(list: &str) -> Self {
        Self(Arc::new(
            list.split(',')
                .map(|h| {
                    h.trim()
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_ascii_lowercase()
                })
                .filter(|h| !h.is_empty())
                .collect(),
        ))
    }

    pub fn allows(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.0.contains(&host.to_ascii_lowercase())
    }
}

/// What kind of inside address `ip` is; `None` for a public one.
pub fn inside(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => inside_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return inside_v4(v4);
            }
            let first = v6.segments()[0];
            if v6.is_loopback() {
                Some("a loopback address")
            } else if v6.is_unspecified() {
                Some("the unspecified address")
            } else if v6.is_multicast() {
                Some("a multicast address")
            } else if first & 0xfe00 == 0xfc00 {
                Some("a private (unique local) address")
            } else if first & 0xffc0 == 0xfe80 {
                Some("a link-local address")
            } else if v6.segments()[..6] == [0, 0, 0, 0, 0, 0] {
                // IPv4-compatible (deprecated) addresses: the v4 rules.
                inside_v4(Ipv4Addr::from(u128::from(v6) as u32))
            } else if first == 0x2001 && v6.segments()[1] == 0x0db8 {
                Some("a documentation address")
            } else if first == 0x0064 && v6.segments()[1] == 0xff9b {
                // NAT64: the embedded v4 address decides.
                inside_v4(Ipv4Addr::from(u128::from(v6) as u32))
            } else {
                None
            }
        }
    }
}

fn inside_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip.is_loopback() {
        Some("a loopback address")
    } else if ip.is_private() {
        Some("a private address")
    } else if ip.is_link_local() {
        Some("a link-local address (cloud metadata lives there)")
    } else if ip.is_unspecified() || a == 0 {
        Some("the unspecified address")
    } else if a == 100 && (64..128).contains(&b) {
        Some("a shared (carrier-grade NAT) address")
    } else if ip.is_multicast() || ip.is_broadcast() || a >= 240 {
        Some("a multicast or reserved address")
    } else if ip.is_documentation() || (a == 198 && (b == 18 || b == 19)) {
        Some("a documentation or benchmarking address")
    } else if a == 192 && b == 0 && ip.octets()[2] == 0 {
        Some("an IETF protocol address")
    } else {
        None
    }
}

/// The URL, checked as far as it can be without resolving its host.
pub fn check_url(raw: &str, allow: &AllowHosts) -> Result<Url, AddressError> {
    let url = Url::parse(raw.trim()).map_err(|_| AddressError::NotUrl(raw.to_owned()))?;
    let host = url
        .host_str()
        .ok_or_else(|| AddressError::NotUrl(raw.to_owned()))?
        .to_owned();
    if !url.username().is_empty() || url.password().is_some() {
        return Err(AddressError::Credentials);
    }
    let allowed = allow.allows(&host);
    match url.scheme() {
        "https" => {}
        "http" if allowed => {}
        "http" => return Err(AddressError::NotHttps(strip_scheme(&url))),
        _ => return Err(AddressError::NotUrl(raw.to_owned())),
    }
    if !allowed {
        let ip = match url.host() {
            Some(Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
            Some(Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
            _ => None,
        };
        if let Some(ip) = ip {
            refuse_inside(&host, ip)?;
        }
        if host.eq_ignore_ascii_case("localhost")
            || host.to_ascii_lowercase().ends_with(".localhost")
        {
            return Err(AddressError::Inside {
                host,
                ip: IpAddr::V6(Ipv6Addr::LOCALHOST),
                what: "a loopback name",
            });
        }
    }
    Ok(url)
}

fn strip_scheme(url: &Url) -> String {
    url.as_str()
        .split_once("://")
        .map_or(url.as_str(), |(_, rest)| rest)
        .to_owned()
}

fn refuse_inside(host: &str, ip: IpAddr) -> Result<(), AddressError> {
    match inside(ip) {
        Some(what) => Err(AddressError::Inside {
            host: host.to_owned(),
            ip,
            what,
        }),
        None => Ok(()),
    }
}

/// Checks the URL and every address its host resolves to now.
pub async fn check_endpoint(raw: &str, allow: &AllowHosts) -> Result<Url, AddressError> {
    let url = check_url(raw, allow)?;
    let host = url.host_str().unwrap_or_default().to_owned();
    if allow.allows(&host) || !matches!(url.host(), Some(Host::Domain(_))) {
        return Ok(url);
    }
    resolve_public(&host, url.port_or_known_default().unwrap_or(443)).await?;
    Ok(url)
}

/// The addresses `host` resolves to, all public, or why not.
async fn resolve_public(host: &str, port: u16) -> Result<Vec<SocketAddr>, AddressError> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|_| AddressError::Unresolved(host.to_owned()))?
        .collect();
    if addrs.is_empty() {
        return Err(AddressError::Unresolved(host.to_owned()));
    }
    for a in &addrs {
        refuse_inside(host, a.ip())?;
    }
    Ok(addrs)
}

/// The resolver of the delivering HTTP client: a name resolving to any
/// inside address fails the delivery (unless the host is allowed). IP
/// literals never reach a resolver; [`check_url`] judges them before
/// every delivery.
#[derive(Debug, Clone)]
pub struct GuardedResolver {
    pub allow: AllowHosts,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow = self.allow.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs = if allow.allows(&host) {
                tokio::net::lookup_host((host.as_str(), 0))
                    .await?
                    .collect::<Vec<_>>()
            } else {
                resolve_public(&host, 0).await?
            };
            let addrs: reqwest::dns::Addrs = Box::new(addrs.into_iter());
            Ok(addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(url: &str) -> AddressError {
        check_url(url, &AllowHosts::default()).unwrap_err()
    }

    #[test]
    fn inside_addresses_and_plain_http_are_refused() {
        for url in [
            "https://127.0.0.1/h",
            "https://10.1.2.3/h",
            "https://172.16.0.1/h",
            "https://192.168.1.1/h",
            "https://169.254.169.254/latest/meta-data",
            "https://100.64.0.1/h",
            "https://0.0.0.0/h",
            "https://[::1]/h",
            "https://[fd00::1]/h",
            "https://[fe80::1]/h",
            "https://[::ffff:127.0.0.1]/h",
            "https://localhost/h",
            "https://api.localhost/h",
        ] {
            assert!(
                matches!(refused(url), AddressError::Inside { .. }),
                "{url} must be refused as an inside address"
            );
        }
        assert!(matches!(
            refused("http://shop.example/h"),
            AddressError::NotHttps(_)
        ));
        assert!(matches!(
            refused("ftp://shop.example/h"),
            AddressError::NotUrl(_)
        ));
        assert!(matches!(
            refused("https://u:p@shop.example/h"),
            AddressError::Credentials
        ));
        assert!(check_url("https://93.184.216.34/h", &AllowHosts::default()).is_ok());
        assert!(check_url("https://[2606:4700::1111]/h", &AllowHosts::default()).is_ok());
    }

    #[test]
    fn allowed_hosts_pass_over_http_too() {
        let allow = AllowHosts::parse(" 127.0.0.1 , Receiver.Test,[::1]");
        assert!(check_url("http://127.0.0.1:8080/h", &allow).is_ok());
        assert!(check_url("http://receiver.test/h", &allow).is_ok());
        assert!(check_url("http://[::1]:9/h", &allow).is_ok());
        assert!(check_url("http://10.0.0.1/h", &allow).is_err());
    }
}
