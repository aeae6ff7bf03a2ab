//! The link between a head and its RPC workers: who may connect, how long anything may take,
//! and a pre-shared key both sides prove before ggml's protocol starts.
//!
//! ggml's RPC protocol has no authentication and runs commands from whoever connects. sluice
//! adds, on the worker: an `--allow` list of the head's addresses, a bound on how long a new
//! connection may take to identify itself, TCP keepalive so a head that vanished (a pulled cable)
//! frees the worker, and with a key, a mutual proof. On the head: a bound on connecting and on
//! every call, so a silent worker fails the request instead of hanging it, and the same proof.
//! Encryption stays the network's job (a private link, WireGuard): the key proves who speaks,
//! it does not hide what is said.
//!
//! The proof (HMAC-SHA-256 under the key, fresh 32-byte nonces from the OS on both sides):
//! the worker sends `MAGIC || Nw`; the head answers `Nh || HMAC(key, "head" || Nw || Nh)`; the
//! worker checks it and answers `HMAC(key, "worker" || Nh || Nw)`, which the head checks. Neither
//! side says anything that helps a party without the key, and a replayed answer fails against a
//! new nonce.

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// What the worker sends first when it wants the proof.
const MAGIC: &[u8; 16] = b"SLUICE-RPC-KEY01";
/// Bytes of each nonce.
const NONCE: usize = 32;
/// Bytes of a proof.
const PROOF: usize = 32;
/// The fewest bytes a key may have.
pub const MIN_KEY_BYTES: usize = 16;
/// The largest key file read.
const MAX_KEY_FILE_BYTES: u64 = 4096;

/// How long a new connection to a worker may take to identify itself (the proof and ggml's
/// HELLO); after that an identified head may idle as long as it likes.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the head waits for a worker to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the head waits for any one answer of a worker (a layer's computation of a prompt
/// batch on a slow board included) before the worker counts as lost, unless set otherwise
/// (`--rpc-call-timeout`).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// TCP keepalive: idle time before the first probe, and the interval between probes (a dead
/// peer is found after about idle + 3 intervals).
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(10));

/// Why the link cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The key file cannot be used.
    #[error("RPC key file {path}: {why}")]
    KeyFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong, and what to do.
        why: String,
    },
}

/// A pre-shared key.
#[derive(Clone)]
pub struct LinkKey(Arc<Vec<u8>>);

impl std::fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkKey(..)")
    }
}

impl LinkKey {
    /// The key in `path`: its bytes, surrounding white space removed; at least
    /// [`MIN_KEY_BYTES`]. Make one with `head -c 32 /dev/urandom | base64 > key`.
    pub fn from_file(path: &Path) -> Result<LinkKey, LinkError> {
        let bad = |why: String| LinkError::KeyFile { path: path.to_path_buf(), why };
        let bytes = sluice_hal::file::read_regular(path, MAX_KEY_FILE_BYTES).map_err(|e| bad(e.to_string()))?;
        let key = bytes.trim_ascii();
        if key.len() < MIN_KEY_BYTES {
            return Err(bad(format!(
                "{} bytes; a key needs at least {MIN_KEY_BYTES} (make one with `head -c 32 /dev/urandom | base64 > FILE`)",
                key.len()
            )));
        }
        Ok(LinkKey(Arc::new(key.to_vec())))
    }

    /// A key from its bytes (tests).
    pub fn new(bytes: &[u8]) -> LinkKey {
        LinkKey(Arc::new(bytes.to_vec()))
    }

    fn proof(&self, role: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(role);
        mac.update(first);
        mac.update(second);
        mac
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The peer closed, stalled or the socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer does not speak sluice's key handshake (no key on the worker, or not a sluice worker).
    #[error(
        "the worker did not ask for the key: it has none (start it with the same --key-file) or is not a sluice worker"
    )]
    NotAsked,
    /// The peer's proof is wrong: it has another key.
    #[error("the peer's proof does not match this key: the two sides have different keys")]
    WrongKey,
}

fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

/// The worker's side of the proof on a new connection.
pub fn worker_handshake(mut stream: &TcpStream, key: &LinkKey) -> Result<(), HandshakeError> {
    let nw = nonce()?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&nw);
    stream.write_all(&hello)?;
    let mut answer = [0u8; NONCE + PROOF];
    stream.read_exact(&mut answer)?;
    let (nh, proof) = answer.split_at(NONCE);
    key.proof(b"head", &nw, nh).verify_slice(proof).map_err(|_| HandshakeError::WrongKey)?;
    stream.write_all(&key.proof(b"worker", nh, &nw).finalize().into_bytes())?;
    Ok(())
}

/// The head's side of the proof on a new connection to a worker.
pub fn head_handshake(mut stream: &TcpStream, key: &LinkKey) -> Result<(), HandshakeError> {
    let mut hello = [0u8; 16 + NONCE];
    stream.read_exact(&mut hello)?;
    if &hello[..16] != MAGIC {
        return Err(HandshakeError::NotAsked);
    }
    let nw = &hello[16..];
    let nh = nonce()?;
    let mut answer = nh.to_vec();
    answer.extend_from_slice(&key.proof(b"head", nw, &nh).finalize().into_bytes());
    stream.write_all(&answer)?;
    let mut proof = [0u8; PROOF];
    stream.read_exact(&mut proof)?;
    key.proof(b"worker", &nh, nw).verify_slice(&proof).map_err(|_| HandshakeError::WrongKey)?;
    Ok(())
}

/// Whether the worker at `endpoint` asks for the key handshake: a new connection on which it
/// speaks first with the key's greeting (within [`CONNECT_TIMEOUT`]). For telling a head without
/// `--rpc-key-file` why it could not connect.
pub fn asks_for_key(endpoint: &str) -> bool {
    use std::net::ToSocketAddrs as _;
    let Some(addr) = endpoint.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return false };
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) else { return false };
    let mut greeting = [0u8; 16];
    stream.set_read_timeout(Some(CONNECT_TIMEOUT)).is_ok()
        && stream.read_exact(&mut greeting).is_ok()
        && &greeting == MAGIC
}

/// Keepalive probes on `stream`, so a peer that vanished is noticed.
fn keepalive(stream: &TcpStream) {
    let ka = socket2::TcpKeepalive::new().with_time(KEEPALIVE.0).with_interval(KEEPALIVE.1).with_retries(3);
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&ka) {
        log::debug!("cannot set TCP keepalive: {e}");
    }
}

/// What a worker admits.
#[derive(Debug, Clone, Default)]
pub struct Admission {
    /// The heads' addresses (empty: any).
    pub allow: Vec<IpAddr>,
    /// The key heads must prove (none: no proof).
    pub key: Option<LinkKey>,
}

impl Admission {
    /// Whether to serve a new connection: from an allowed address, identified within
    /// [`HANDSHAKE_TIMEOUT`] (the bound stays set for ggml's HELLO, which the patched server
    /// lifts once it is read), with keepalive on.
    pub fn admit(&self, stream: &TcpStream) -> bool {
        let peer = match stream.peer_addr() {
            Ok(p) => p,
            Err(e) => {
                log::debug!("a connection that is already gone: {e}");
                return false;
            }
        };
        if !self.allow.is_empty() && !self.allow.contains(&peer.ip()) {
            log::warn!("refused a connection from {peer}: not in --allow");
            return false;
        }
        if stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)))
            .is_err()
        {
            return false;
        }
        keepalive(stream);
        if let Some(key) = &self.key {
            if let Err(e) = worker_handshake(stream, key) {
                log::warn!("refused a connection from {peer}: {e}");
                return false;
            }
        }
        let _ = stream.set_write_timeout(None);
        log::info!("admitted the head at {peer}");
        true
    }
}

/// Sets how this process connects to workers: [`CONNECT_TIMEOUT`], `call_timeout` for each
/// answer, keepalive, and the proof when `key` is given. Call once before connecting to any
/// worker.
pub fn configure_head(key: Option<LinkKey>, call_timeout: Duration) {
    let hook: Arc<ggml_sys::ConnectHook> = Arc::new(move |stream: &TcpStream, endpoint: &str| {
        keepalive(stream);
        match &key {
            None => Ok(()),
            Some(key) => head_handshake(stream, key).map_err(|e| {
                log::error!("RPC worker {endpoint}: {e}");
                match e {
                    HandshakeError::Io(_) => format!(
                        "the key handshake failed ({e}): the worker closed the connection, which it does for a head whose proof is wrong (another --key-file) or not in its --allow"
                    ),
                    e => e.to_string(),
                }
            }),
        }
    });
    ggml_sys::rpc_client_options(CONNECT_TIMEOUT, call_timeout, Some(hook));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        (a, b)
    }

    fn run(worker_key: &[u8], head_key: &[u8]) -> (Result<(), HandshakeError>, Result<(), HandshakeError>) {
        let (head, worker) = pair();
        let wk = LinkKey::new(worker_key);
        let w = std::thread::spawn(move || {
            let r = worker_handshake(&worker, &wk);
            drop(worker);
            r
        });
        let h = head_handshake(&head, &LinkKey::new(head_key));
        drop(head);
        (w.join().unwrap(), h)
    }

    #[test]
    fn both_sides_prove_the_same_key() {
        let (w, h) = run(b"0123456789abcdef", b"0123456789abcdef");
        assert!(w.is_ok() && h.is_ok(), "{w:?} {h:?}");
    }

    #[test]
    fn a_different_key_fails_on_both_sides() {
        let (w, h) = run(b"0123456789abcdef", b"0123456789abcdeX");
        assert!(matches!(w, Err(HandshakeError::WrongKey)), "{w:?}");
        assert!(h.is_err(), "{h:?}");
    }

    #[test]
    fn a_worker_without_a_key_is_named() {
        let (head, worker) = pair();
        (&worker).write_all(&[0u8; 48]).unwrap();
        let e = head_handshake(&head, &LinkKey::new(b"0123456789abcdef")).unwrap_err();
        assert!(matches!(e, HandshakeError::NotAsked), "{e}");
    }

    #[test]
    fn short_key_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("k");
        std::fs::write(&f, "short\n").unwrap();
        assert!(LinkKey::from_file(&f).unwrap_err().to_string().contains("at least 16"));
        std::fs::write(&f, "  0123456789abcdef0123\n").unwrap();
        assert_eq!(LinkKey::from_file(&f).unwrap().0.as_slice(), b"0123456789abcdef0123");
    }
}
