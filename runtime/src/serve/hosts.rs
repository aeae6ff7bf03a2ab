//! The names a request's `Host` may give. A page on another site can make a browser send
//! requests to a server on the board's network or on loopback under a name the page's site
//! controls (DNS rebinding: the name first resolves to the site, then to the board), and then
//! read the answers as its own. Such a request names the site's domain in `Host`; a request
//! from anyone who reached the server by its address, by `localhost` or by the board's own name
//! does not. So a `Host` is answered when it is an IP address, `localhost` or a name under
//! `.localhost`, the machine's host name, a name under a suffix no public DNS delegates
//! (`.local`, `.internal`, `.home.arpa`: a site cannot own one), or a name the settings allow
//! (`allowed_hosts`, `*` for any, as behind a reverse proxy that passes on its own name).

use std::net::IpAddr;

/// Suffixes under which no public DNS name exists, so no other site can own a name.
const PRIVATE_SUFFIXES: [&str; 4] = [".localhost", ".local", ".internal", ".home.arpa"];

/// Why the allowed hosts cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("--allowed-host {0:?} is not a host name; give a name such as sluice.example.org (no scheme, no port), or `*` for any")]
pub struct BadHost(pub String);

/// The names a request's `Host` may give beside the addresses and private names every server
/// answers to.
#[derive(Debug, Clone, Default)]
pub struct Hosts {
    /// Names allowed by the settings, lowercase.
    listed: Vec<String>,
    /// `*`: any name.
    any: bool,
    /// This machine's host name, lowercase, when it has one.
    machine: Option<String>,
}

impl Hosts {
    /// The hosts answered: the private ones, this machine's name, and `allowed` (`*`: any).
    pub fn new(allowed: &[String]) -> Result<Hosts, BadHost> {
        let mut hosts = Hosts { machine: machine_name(), ..Hosts::default() };
        for name in allowed {
            if name == "*" {
                hosts.any = true;
            } else if is_host_name(name) {
                hosts.listed.push(name.trim_end_matches('.').to_ascii_lowercase());
            } else {
                return Err(BadHost(name.clone()));
            }
        }
        Ok(hosts)
    }

    /// Whether a request whose `Host` header is `header` (`name[:port]`, `[v6]:port`) is
    /// answered.
    pub fn allows(&self, header: &str) -> bool {
        if self.any {
            return true;
        }
        let Ok(authority) = header.parse::<hyper::http::uri::Authority>() else { return false };
        let host = authority.host();
        if host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok() {
            return true;
        }
        let name = host.trim_end_matches('.').to_ascii_lowercase();
        name == "localhost"
            || PRIVATE_SUFFIXES.iter().any(|s| name.ends_with(s))
            || self.machine.as_deref() == Some(name.as_str())
            || self.listed.contains(&name)
    }
}

/// Whether `name` is a DNS host name (letters, digits, `-` and `.`).
fn is_host_name(name: &str) -> bool {
    let name = name.trim_end_matches('.');
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
        })
}

/// This machine's host name, lowercase.
fn machine_name() -> Option<String> {
    let name = nix::unistd::gethostname().ok()?.into_string().ok()?.to_ascii_lowercase();
    is_host_name(&name).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_loopback_names_and_private_suffixes_are_answered_other_names_only_when_allowed() {
        let h = Hosts { machine: Some("pi5".into()), ..Hosts::new(&["sluice.example.org".into()]).unwrap() };
        for ok in [
            "127.0.0.1:8080",
            "192.168.1.20",
            "[::1]:11434",
            "[fe80::1]",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost",
            "pi5:8080",
            "pi5.local",
            "board.internal",
            "board.home.arpa:80",
            "sluice.example.org",
            "Sluice.Example.Org.:443",
        ] {
            assert!(h.allows(ok), "{ok} refused");
        }
        for refused in ["evil.example", "evil.example:8080", "localhost.evil.example", "pi5.evil.example", "local", ""]
        {
            assert!(!h.allows(refused), "{refused} answered");
        }
        assert!(Hosts::new(&["*".into()]).unwrap().allows("evil.example"));
        for bad in ["https://a.example", "a.example:80", "", "a..b", "-a.example"] {
            assert!(Hosts::new(&[bad.into()]).is_err(), "{bad} taken as a host name");
        }
    }
}
