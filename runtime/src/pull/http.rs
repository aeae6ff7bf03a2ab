//! The HTTP side of a pull: `ureq` with a stall bound on every read, redirects followed here (a
//! hub answers a file with a redirect to its storage host, a registry a blob likewise) so that a
//! token goes only to the host it is for, and statuses turned into errors that say what to do.

use std::time::Duration;

use ureq::http::{Response, Uri};
use ureq::Body;

use super::PullError;

/// The most redirects one request follows.
const MAX_REDIRECTS: usize = 8;
/// The most bytes of a JSON answer (a repository's file list, a manifest).
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// What a 401 or 403 asks for (the hub's tokens; a registry's models are public).
pub const TOKEN_HINT: &str = "set HF_TOKEN (or run `huggingface-cli login`) to a token of an account that may read it; a gated repository also needs its access request accepted on the hub's page";

/// A bearer token and the host it may be sent to.
#[derive(Debug, Clone)]
pub struct Token {
    /// The token.
    pub value: String,
    /// The host (and port) it is for: the configured endpoint's.
    pub host: String,
    /// How to get a token that works, for a 401's message.
    pub hint: &'static str,
}

/// An HTTP client for pulls.
#[derive(Debug, Clone)]
pub struct Http {
    agent: ureq::Agent,
}

/// The host and port of `url`, for comparing hosts.
pub fn authority(url: &str) -> Option<String> {
    url.parse::<Uri>().ok()?.authority().map(|a| a.as_str().to_ascii_lowercase())
}

/// `location` (absolute, or relative to `base`) as an absolute URL.
fn join(base: &str, location: &str) -> Option<String> {
    if location.starts_with("http://") || location.starts_with("https://") {
        return Some(location.to_string());
    }
    let uri: Uri = base.parse().ok()?;
    let origin = format!("{}://{}", uri.scheme_str()?, uri.authority()?.as_str());
    if location.starts_with('/') {
        return Some(format!("{origin}{location}"));
    }
    let dir = uri.path().rsplit_once('/').map(|(d, _)| d).unwrap_or("");
    Some(format!("{origin}{dir}/{location}"))
}

impl Http {
    /// A client whose reads give up after `stall` without a byte.
    pub fn new(stall: Duration) -> Http {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(20)))
            .timeout_recv_response(Some(stall))
            .timeout_per_read(Some(stall))
            .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Http { agent }
    }

    /// GETs (or HEADs) `url`, following redirects, with `range` (`bytes=from-to`, inclusive)
    /// and `accept` when given; `token` is sent only to its own host. Returns the final
    /// response (any status) and the URL it came from; `first_headers` gets the first hop's.
    pub fn get(
        &self,
        url: &str,
        range: Option<(u64, u64)>,
        accept: Option<&str>,
        token: Option<&Token>,
        mut first_headers: Option<&mut ureq::http::HeaderMap>,
    ) -> Result<(Response<Body>, String), PullError> {
        let mut at = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&at);
            if let Some((from, to)) = range {
                req = req.header("Range", format!("bytes={from}-{to}"));
            }
            if let Some(a) = accept {
                req = req.header("Accept", a);
            }
            if let Some(t) = token.filter(|t| authority(&at).as_deref() == Some(t.host.as_str())) {
                req = req.header("Authorization", format!("Bearer {}", t.value));
            }
            let resp = req.call().map_err(|e| PullError::Http { url: at.clone(), why: e.to_string() })?;
            if let Some(h) = first_headers.take() {
                *h = resp.headers().clone();
            }
            if !resp.status().is_redirection() {
                return Ok((resp, at));
            }
            let location = resp.headers().get("location").and_then(|l| l.to_str().ok()).unwrap_or("");
            at = join(&at, location).ok_or_else(|| PullError::Http {
                url: at.clone(),
                why: format!("a redirect to {location:?}, which is not a URL"),
            })?;
        }
        Err(PullError::Http { url: url.into(), why: format!("more than {MAX_REDIRECTS} redirects") })
    }

    /// GETs at most `limit` bytes (of `range`, when given), mapping 401/403/404 to errors naming
    /// `what`; returns them and the URL that answered.
    pub fn bytes(
        &self,
        url: &str,
        range: Option<(u64, u64)>,
        accept: Option<&str>,
        token: Option<&Token>,
        what: &str,
        limit: u64,
    ) -> Result<(Vec<u8>, String), PullError> {
        let (mut resp, at) = self.get(url, range, accept, token, None)?;
        check_status(resp.status().as_u16(), &at, what, token)?;
        let body = resp
            .body_mut()
            .with_config()
            .limit(limit)
            .read_to_vec()
            .map_err(|e| PullError::Http { url: at.clone(), why: e.to_string() })?;
        Ok((body, at))
    }

    /// GETs a JSON document (bounded), mapping 401/403/404 to errors naming `what`.
    pub fn json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        accept: Option<&str>,
        token: Option<&Token>,
        what: &str,
    ) -> Result<T, PullError> {
        let (body, at) = self.bytes(url, None, accept, token, what, MAX_JSON_BYTES)?;
        serde_json::from_slice(&body)
            .map_err(|e| PullError::Http { url: at, why: format!("not the JSON answer expected: {e}") })
    }
}

/// The error for an unsuccessful status of a request for `what`.
pub fn check_status(status: u16, url: &str, what: &str, token: Option<&Token>) -> Result<(), PullError> {
    match status {
        200..=299 => Ok(()),
        401 | 403 => Err(PullError::Denied {
            what: what.into(),
            status,
            hint: token.map(|t| t.hint).unwrap_or(TOKEN_HINT).into(),
        }),
        404 => Err(PullError::NotFound { what: what.into(), url: url.into() }),
        _ => Err(PullError::Http { url: url.into(), why: format!("HTTP {status}") }),
    }
}

/// Whether an error is worth trying again (a dropped connection, a stall, a server's 5xx or
/// 429) rather than final (denied, not found, a broken host).
pub fn is_transient(status: u16) -> bool {
    status == 408 || status == 429 || status >= 500
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_join_as_browsers_join_them() {
        assert_eq!(join("http://a:1/x/y?z", "/b/c").unwrap(), "http://a:1/b/c");
        assert_eq!(join("http://a:1/x/y", "https://cdn/q").unwrap(), "https://cdn/q");
        assert_eq!(join("http://a:1/x/y", "w").unwrap(), "http://a:1/x/w");
        assert_eq!(authority("http://Host:8/p").unwrap(), "host:8");
    }
}
