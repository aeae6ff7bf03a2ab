//! Who may use the server: an API key checked as `Authorization: Bearer` (or `x-api-key`), the
//! browser origins allowed by CORS, and the names a request's `Host` may give ([`Hosts`]).
//!
//! A browser sends any page's requests to any server, and some without asking first (a
//! `text/plain` POST needs no preflight): so a request whose `Origin` is neither the server's own
//! (the chat and status pages) nor allowed by CORS is refused before it does anything, whether
//! or not the page could read the answer, and so is one whose `Host` the server does not answer
//! to (DNS rebinding makes a foreign page's requests same-origin under a name its site owns).
//!
//! The key comes from `--api-key` (or `SLUICE_API_KEY`), `--api-key-file`, or else a file named
//! `api-key` in systemd's credentials directory (`LoadCredential=api-key:...`) or the state
//! directory. `/health` and the pages' HTML, the chat at `/` and the status at `/status.html`
//! (which hold no data: they ask for the key and send it with their requests) are always open; `/metrics` is open unless
//! `--metrics-need-key`.

use std::path::{Path, PathBuf};

use hyper::header::HeaderValue;
use subtle::ConstantTimeEq as _;

use super::error::ApiError;
use super::hosts::{BadHost, Hosts};

use crate::systemd::KEY_FILE;

/// Why the access settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// The key file cannot be read.
    #[error("cannot read the API key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The key is empty or not printable ASCII.
    #[error("the API key from {from} is {what}; use a non-empty key of printable ASCII characters (no spaces)")]
    BadKey {
        /// Where it came from.
        from: String,
        /// What is wrong.
        what: &'static str,
    },
    /// A CORS origin is not a valid header value.
    #[error("--cors-origin {0:?} is not an origin; use `*` or a scheme and host such as https://example.org")]
    BadOrigin(String),
    /// An allowed host is not a host name.
    #[error(transparent)]
    BadHost(#[from] BadHost),
    /// A line of the named keys file cannot be used.
    #[error("{path}, line {line}: {why}; each line is NAME KEY (a name of letters, digits, '.', '_' or '-', then the key, printable ASCII), # starts a comment")]
    BadNamedKey {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong.
        why: String,
    },
}

/// The access settings.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// The keys that open the API, each with its name when it has one (the named keys file).
    keys: Vec<(Option<String>, String)>,
    metrics_keyed: bool,
    cors: Vec<HeaderValue>,
    cors_any: bool,
    hosts: Hosts,
}

/// Where the key may come from, first found wins.
#[derive(Debug, Clone, Default)]
pub struct KeySources {
    /// `--api-key` (or `SLUICE_API_KEY`).
    pub key: Option<String>,
    /// `--api-key-file`.
    pub file: Option<PathBuf>,
    /// `$CREDENTIALS_DIRECTORY`.
    pub credentials_dir: Option<PathBuf>,
    /// The state directory.
    pub state_dir: Option<PathBuf>,
    /// `--api-keys-file`: named keys, one client (a user, a service) each, beside the key above.
    pub named: Option<PathBuf>,
}

/// The largest API key file read.
const MAX_KEY_FILE_BYTES: u64 = 64 << 10;

impl KeySources {
    /// The key, and where it came from; `None` when no source has one.
    fn resolve(&self) -> Result<Option<(String, String)>, AccessError> {
        if let Some(k) = &self.key {
            return Ok(Some((k.clone(), "--api-key".into())));
        }
        let read = |path: &Path| -> Result<(String, String), AccessError> {
            let text = sluice_hal::file::read_regular_string(path, MAX_KEY_FILE_BYTES)
                .map_err(|source| AccessError::Read { path: path.to_path_buf(), source })?;
            Ok((text.trim().to_string(), path.display().to_string()))
        };
        if let Some(f) = &self.file {
            return read(f).map(Some);
        }
        for dir in [&self.credentials_dir, &self.state_dir].into_iter().flatten() {
            let path = dir.join(KEY_FILE);
            if path.is_file() {
                return read(&path).map(Some);
            }
        }
        Ok(None)
    }
}

/// A header's value as an error quotes it.
fn quoted(v: &HeaderValue) -> String {
    v.to_str().map_or_else(|_| "(not text)".to_string(), |s| format!("{:?}", crate::text::excerpt(s, 100)))
}

/// What is wrong with `key`, if anything.
fn key_flaw(key: &str) -> Option<&'static str> {
    if key.is_empty() {
        Some("empty")
    } else if !key.bytes().all(|b| b.is_ascii_graphic()) {
        Some("not printable ASCII")
    } else {
        None
    }
}

/// The named keys of the file at `path`: `NAME KEY` a line, names and keys each once.
fn named_keys(path: &Path) -> Result<Vec<(Option<String>, String)>, AccessError> {
    let text = sluice_hal::file::read_regular_string(path, MAX_KEY_FILE_BYTES)
        .map_err(|source| AccessError::Read { path: path.to_path_buf(), source })?;
    let mut keys: Vec<(Option<String>, String)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |why: String| AccessError::BadNamedKey { path: path.to_path_buf(), line: i + 1, why };
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, key] = fields[..] else {
            return Err(bad(format!("{} fields where NAME KEY are two", fields.len())));
        };
        let name_ok = name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b".-_".contains(&b));
        if !name_ok {
            return Err(bad(format!(
                "the name {:?} has other characters or is over 64",
                crate::text::excerpt(name, 80)
            )));
        }
        if let Some(what) = key_flaw(key) {
            return Err(bad(format!("the key of {name} is {what}")));
        }
        if keys.iter().any(|(n, _)| n.as_deref() == Some(name)) {
            return Err(bad(format!("the name {name} is given twice")));
        }
        if keys.iter().any(|(_, k)| k == key) {
            return Err(bad(format!("the key of {name} is another name's too")));
        }
        keys.push((Some(name.to_string()), key.to_string()));
    }
    Ok(keys)
}

impl Access {
    /// Access with the key from `keys` (none: open to all), `/metrics` keyed when
    /// `metrics_keyed`, CORS for `origins` (`*`: any), and `hosts` answered beside the
    /// addresses and private names ([`Hosts`]).
    pub fn new(
        keys: &KeySources,
        metrics_keyed: bool,
        origins: &[String],
        hosts: &[String],
    ) -> Result<Access, AccessError> {
        let mut named_keys = match &keys.named {
            Some(path) => named_keys(path)?,
            None => Vec::new(),
        };
        let mut all = Vec::new();
        if let Some((key, from)) = keys.resolve()? {
            if let Some(what) = key_flaw(&key) {
                return Err(AccessError::BadKey { from, what });
            }
            log::info!("API key from {from}: requests need Authorization: Bearer");
            all.push((None, key));
        }
        if !named_keys.is_empty() {
            log::info!("{} named API keys: each client's prompts are reused for it alone", named_keys.len());
        }
        all.append(&mut named_keys);
        let mut cors = Vec::new();
        let mut cors_any = false;
        for o in origins {
            if o == "*" {
                cors_any = true;
            } else {
                let v = HeaderValue::from_str(o.trim_end_matches('/'))
                    .ok()
                    .filter(|_| o.contains("://"))
                    .ok_or_else(|| AccessError::BadOrigin(o.clone()))?;
                cors.push(v);
            }
        }
        Ok(Access { keys: all, metrics_keyed, cors, cors_any, hosts: Hosts::new(hosts)? })
    }

    /// Whether `/metrics` needs the key (`--metrics-need-key`).
    pub fn metrics_keyed(&self) -> bool {
        self.metrics_keyed
    }

    /// Checks a request for a route that needs the key (`needed`) with its `Authorization`
    /// header (or, as Anthropic's clients send the key, its `x-api-key` header): 401 when the
    /// server has keys and none of them is given. The name of the named key given, if one was.
    pub fn authorize(
        &self,
        needed: bool,
        authorization: Option<&HeaderValue>,
        x_api_key: Option<&HeaderValue>,
    ) -> Result<Option<String>, ApiError> {
        if self.keys.is_empty() || !needed {
            return Ok(None);
        }
        let bearer = authorization.and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
        let given = bearer.or_else(|| x_api_key.and_then(|v| v.to_str().ok()).map(str::trim));
        let message = match given {
            None => {
                "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY` (or `x-api-key: YOUR_KEY`)."
            }
            Some(t) => {
                // Every key compared, in constant time each: the time tells nothing of which.
                let matched = self.keys.iter().fold(None, |found, (name, key)| {
                    if bool::from(t.as_bytes().ct_eq(key.as_bytes())) {
                        Some(name)
                    } else {
                        found
                    }
                });
                match matched {
                    Some(name) => return Ok(name.clone()),
                    None => "Incorrect API key provided.",
                }
            }
        };
        Err(ApiError::new(401, "invalid_request_error", message).with_code("invalid_api_key"))
    }

    /// Checks where a request comes from before anything else: 403 when its `host` header names
    /// a host this server does not answer to, or its `origin` is neither this server's own
    /// (the same host and port as `host`) nor allowed by CORS. A request without them (not from
    /// a browser) passes.
    pub fn admit(&self, host: Option<&HeaderValue>, origin: Option<&HeaderValue>) -> Result<(), ApiError> {
        let host = match host {
            None => None,
            Some(v) => match v.to_str() {
                Ok(h) if self.hosts.allows(h) => Some(h),
                _ => {
                    return Err(ApiError::new(
                        403,
                        "permission_error",
                        format!(
                            "this server does not answer to the Host {}: reach it by its address, localhost or this machine's name, or allow the name with --allowed-host (allowed_hosts in the settings file)",
                            quoted(v)
                        ),
                    ))
                }
            },
        };
        let Some(origin) = origin else { return Ok(()) };
        let own = origin.to_str().ok().and_then(|o| o.split_once("://")).is_some_and(|(scheme, authority)| {
            matches!(scheme, "http" | "https") && host.is_some_and(|h| h.eq_ignore_ascii_case(authority))
        });
        if own || self.cors_allows(Some(origin)).is_some() {
            return Ok(());
        }
        Err(ApiError::new(
            403,
            "permission_error",
            format!(
                "requests from the page at {} are refused: allow its origin with --cors-origin (cors_origins in the settings file) to let it use this server",
                quoted(origin)
            ),
        ))
    }

    /// The `Access-Control-Allow-Origin` value for a request from `origin`, if CORS allows it.
    pub fn cors_allows(&self, origin: Option<&HeaderValue>) -> Option<HeaderValue> {
        let origin = origin?;
        if self.cors_any {
            return Some(HeaderValue::from_static("*"));
        }
        self.cors.iter().find(|o| *o == origin).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(key: &str, metrics: bool) -> Access {
        Access::new(&KeySources { key: Some(key.into()), ..Default::default() }, metrics, &[], &[]).unwrap()
    }

    fn h(v: &str) -> HeaderValue {
        HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn a_key_is_checked_as_a_bearer_token_or_x_api_key_where_needed() {
        let a = keyed("s3cret", false);
        assert!(a.authorize(true, Some(&h("Bearer s3cret")), None).is_ok());
        assert!(a.authorize(true, Some(&h("bearer  s3cret ")), None).is_ok());
        let e = a.authorize(true, Some(&h("Bearer s3cre")), None).unwrap_err();
        assert_eq!(
            (e.status, e.code, e.message.as_str()),
            (401, Some("invalid_api_key"), "Incorrect API key provided.")
        );
        assert!(a.authorize(true, None, None).unwrap_err().message.contains("didn't provide"));
        assert!(a.authorize(true, Some(&h("Basic czNjcmV0")), None).is_err());
        assert!(a.authorize(true, None, Some(&h("s3cret"))).is_ok());
        assert!(a.authorize(true, None, Some(&h("s3cre"))).is_err());
        assert!(a.authorize(false, None, None).is_ok(), "a route that needs no key");
        assert!(!a.metrics_keyed() && keyed("s3cret", true).metrics_keyed());
        assert!(Access::default().authorize(true, None, None).is_ok());
    }

    #[test]
    fn the_key_comes_from_the_first_source_that_has_one() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("creds");
        let state = dir.path().join("state");
        std::fs::create_dir_all(&creds).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join(KEY_FILE), "from-state\n").unwrap();
        let mut s = KeySources { credentials_dir: Some(creds.clone()), state_dir: Some(state), ..Default::default() };
        assert_eq!(s.resolve().unwrap().unwrap().0, "from-state");
        std::fs::write(creds.join(KEY_FILE), "from-creds").unwrap();
        assert_eq!(s.resolve().unwrap().unwrap().0, "from-creds");
        s.file = Some(dir.path().join("missing"));
        let e = Access::new(&s, false, &[], &[]).unwrap_err().to_string();
        assert!(e.contains("cannot read the API key file") && e.contains("missing"), "{e}");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, " \n").unwrap();
        s.file = Some(empty);
        assert!(Access::new(&s, false, &[], &[]).unwrap_err().to_string().contains("is empty"));
        assert!(Access::new(&KeySources::default(), false, &[], &[]).unwrap().keys.is_empty());
    }

    #[test]
    fn named_keys_open_the_api_under_their_names_and_bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("keys");
        std::fs::write(&file, "# clients\nalice  key-of-alice\n\nha.service key-of-ha\n").unwrap();
        let sources = KeySources { key: Some("shared".into()), named: Some(file.clone()), ..Default::default() };
        let a = Access::new(&sources, false, &[], &[]).unwrap();
        assert_eq!(a.authorize(true, Some(&h("Bearer key-of-alice")), None).unwrap().as_deref(), Some("alice"));
        assert_eq!(a.authorize(true, None, Some(&h("key-of-ha"))).unwrap().as_deref(), Some("ha.service"));
        assert_eq!(a.authorize(true, Some(&h("Bearer shared")), None).unwrap(), None);
        assert!(a.authorize(true, Some(&h("Bearer key-of-bob")), None).is_err());
        for (text, why) in [
            ("alice\n", "1 fields"),
            ("al/ice key\n", "other characters"),
            ("a k1\na k2\n", "given twice"),
            ("a k\nb k\n", "another name's too"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = Access::new(&sources, false, &[], &[]).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("line"), "{text:?}: {e}");
        }
    }

    #[test]
    fn cors_allows_listed_origins_or_any() {
        let a = Access::new(&KeySources::default(), false, &["https://a.example/".into()], &[]).unwrap();
        assert_eq!(a.cors_allows(Some(&h("https://a.example"))), Some(h("https://a.example")));
        assert_eq!(a.cors_allows(Some(&h("https://b.example"))), None);
        assert_eq!(a.cors_allows(None), None);
        let any = Access::new(&KeySources::default(), false, &["*".into()], &[]).unwrap();
        assert_eq!(any.cors_allows(Some(&h("https://b.example"))), Some(h("*")));
        assert!(Access::new(&KeySources::default(), false, &["not an origin".into()], &[]).is_err());
    }
}
