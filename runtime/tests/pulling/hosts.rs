//! A Hugging Face-shaped hub and an Ollama-shaped registry on loopback, for `sluice pull`'s
//! tests: the hub's API (`/api/models/{repo}/revision/main?blobs=true`), its `resolve` URLs
//! answering with a redirect to a storage host on another port (as the real hub's CDN), the
//! registry's manifests and blob redirects, Range requests, and the faults a pull must survive.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// The hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A repository's files: (name, bytes).
pub type Files = Vec<(String, Vec<u8>)>;

/// What the hosts serve and how they misbehave.
#[derive(Default)]
pub struct World {
    /// Hub repositories: `owner/repo` → (commit, files by name).
    pub repos: HashMap<String, (String, Files)>,
    /// Registry models: `namespace/model:tag` → manifest JSON.
    pub manifests: HashMap<String, String>,
    /// Blobs by hex sha256 (the storage host serves these).
    pub blobs: HashMap<String, Vec<u8>>,
    /// A token the hub requires (401 without it).
    pub token: Option<String>,
    /// Body requests whose connection is closed after this many bytes (count, bytes).
    pub drop_after: Option<(u32, usize)>,
    /// Body requests that send this many bytes and then stall.
    pub stall_after: Option<(u32, usize)>,
    /// Serve blob bytes with one byte flipped.
    pub corrupt: bool,
    /// Body requests beyond this many wait until it is lifted.
    pub gate: Option<u32>,
    /// Every body request's range (from, to inclusive) in order.
    pub ranges: Vec<(u64, u64)>,
}

impl World {
    /// Adds a hub repository whose files are `files`; the blobs are served by digest.
    pub fn add_repo(&mut self, repo: &str, commit: &str, files: Files) {
        for (_, bytes) in &files {
            self.blobs.insert(sha256_hex(bytes), bytes.clone());
        }
        self.repos.insert(repo.into(), (commit.into(), files));
    }

    /// Adds an Ollama model whose layers are (media type, bytes).
    pub fn add_ollama(&mut self, name: &str, layers: Vec<(&str, Vec<u8>)>) {
        let config = b"{\"model_format\":\"gguf\"}".to_vec();
        let entry = |mt: &str, b: &[u8]| serde_json::json!({"mediaType": mt, "digest": format!("sha256:{}", sha256_hex(b)), "size": b.len()});
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": entry("application/vnd.docker.container.image.v1+json", &config),
            "layers": layers.iter().map(|(mt, b)| entry(mt, b)).collect::<Vec<_>>(),
        });
        self.blobs.insert(sha256_hex(&config), config);
        for (_, b) in layers {
            self.blobs.insert(sha256_hex(&b), b);
        }
        self.manifests.insert(name.into(), manifest.to_string());
    }
}

/// The two hosts: the hub/registry and the storage host it redirects to.
pub struct Hosts {
    /// `http://127.0.0.1:PORT` of the hub and registry.
    pub url: String,
    /// What they serve.
    pub world: Arc<(Mutex<World>, Condvar)>,
}

impl Hosts {
    /// Starts both on loopback; they run until the test process ends.
    pub fn start(world: World) -> Hosts {
        let world = Arc::new((Mutex::new(world), Condvar::new()));
        let storage = TcpListener::bind("127.0.0.1:0").unwrap();
        let storage_url = format!("http://{}", storage.local_addr().unwrap());
        let front = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", front.local_addr().unwrap());
        serve(storage, world.clone(), None);
        serve(front, world.clone(), Some(storage_url));
        Hosts { url, world }
    }

    /// Changes what is served.
    pub fn with<T>(&self, f: impl FnOnce(&mut World) -> T) -> T {
        let out = f(&mut self.world.0.lock().unwrap());
        self.world.1.notify_all();
        out
    }
}

fn serve(listener: TcpListener, world: Arc<(Mutex<World>, Condvar)>, storage: Option<String>) {
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (world, storage) = (world.clone(), storage.clone());
            std::thread::spawn(move || {
                let _ = handle(conn, &world, storage.as_deref());
            });
        }
    });
}

struct Request {
    path: String,
    headers: HashMap<String, String>,
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Some(Request { path, headers })
}

fn respond(out: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes())?;
    out.write_all(body)
}

fn handle(conn: TcpStream, world: &(Mutex<World>, Condvar), storage: Option<&str>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut out = conn;
    while let Some(req) = read_request(&mut reader) {
        match storage {
            Some(storage) => front(&mut out, &req, world, storage)?,
            None => {
                if !blob(&mut out, &req, world)? {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// The hub's API and resolve URLs, the registry's manifests and blob URLs.
fn front(out: &mut TcpStream, req: &Request, world: &(Mutex<World>, Condvar), storage: &str) -> std::io::Result<()> {
    let w = world.0.lock().unwrap();
    let authorized = w.token.as_ref().is_none_or(|t| req.headers.get("authorization") == Some(&format!("Bearer {t}")));
    if let Some(rest) = req.path.strip_prefix("/api/models/") {
        let repo = rest.split("/revision/").next().unwrap_or("");
        let Some((commit, files)) = w.repos.get(repo) else {
            return respond(out, "404 Not Found", &[], b"{\"error\":\"Repository not found\"}");
        };
        let siblings: Vec<_> = files
            .iter()
            .map(|(n, b)| serde_json::json!({"rfilename": n, "size": b.len(), "lfs": {"sha256": sha256_hex(b), "size": b.len(), "pointerSize": 134}}))
            .collect();
        let body = serde_json::json!({"id": repo, "sha": commit, "siblings": siblings}).to_string();
        return respond(out, "200 OK", &[("Content-Type", "application/json".into())], body.as_bytes());
    }
    if let Some(rest) = req.path.strip_prefix("/v2/") {
        if let Some((model, digest)) = rest.split_once("/blobs/") {
            let _ = model;
            let hex = digest.trim_start_matches("sha256:");
            return respond(out, "307 Temporary Redirect", &[("Location", format!("{storage}/blobs/{hex}"))], b"");
        }
        if let Some((model, tag)) = rest.split_once("/manifests/") {
            return match w.manifests.get(&format!("{model}:{tag}")) {
                Some(m) => respond(
                    out,
                    "200 OK",
                    &[("Content-Type", "application/vnd.docker.distribution.manifest.v2+json".into())],
                    m.as_bytes(),
                ),
                None => respond(out, "404 Not Found", &[], b"{\"errors\":[{\"code\":\"MANIFEST_UNKNOWN\"}]}"),
            };
        }
    }
    if let Some((repo, file)) = req.path.trim_start_matches('/').split_once("/resolve/") {
        if !authorized {
            return respond(out, "401 Unauthorized", &[("X-Error-Code", "GatedRepo".into())], b"Access restricted");
        }
        let file = file.split_once('/').map(|(_, f)| f).unwrap_or("");
        let found = w
            .repos
            .get(repo)
            .and_then(|(c, files)| files.iter().find(|(n, _)| n == file).map(|(_, b)| (c.clone(), sha256_hex(b))));
        return match found {
            Some((commit, sha)) => respond(
                out,
                "302 Found",
                &[
                    ("Location", format!("{storage}/blobs/{sha}")),
                    ("X-Linked-Etag", format!("\"{sha}\"")),
                    ("X-Repo-Commit", commit),
                ],
                b"",
            ),
            None => respond(out, "404 Not Found", &[("X-Error-Code", "EntryNotFound".into())], b""),
        };
    }
    respond(out, "404 Not Found", &[], b"")
}

/// The storage host: blobs by digest, with Range and the faults. False when the connection was
/// cut on purpose.
fn blob(out: &mut TcpStream, req: &Request, world: &(Mutex<World>, Condvar)) -> std::io::Result<bool> {
    let hex = req.path.trim_start_matches("/blobs/").to_string();
    let mut w = world.0.lock().unwrap();
    let Some(bytes) = w.blobs.get(&hex).cloned() else {
        respond(out, "404 Not Found", &[], b"")?;
        return Ok(true);
    };
    let (from, to) = req
        .headers
        .get("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(a, b)| (a.parse().unwrap_or(0), b.parse().unwrap_or(u64::MAX).min(bytes.len() as u64 - 1)))
        .unwrap_or((0, bytes.len() as u64 - 1));
    w.ranges.push((from, to));
    let n = w.ranges.len() as u32;
    while w.gate.is_some_and(|g| n > g) {
        w = world.1.wait(w).unwrap();
    }
    let mut body = bytes[from as usize..=to as usize].to_vec();
    if w.corrupt && !body.is_empty() {
        let mid = body.len() / 2;
        body[mid] ^= 0x40;
    }
    let cut = match (w.drop_after, w.stall_after) {
        (Some((count, at)), _) if n <= count => Some((at, false)),
        (_, Some((count, at))) if n <= count => Some((at, true)),
        _ => None,
    };
    drop(w);
    let head = format!(
        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {from}-{to}/{}\r\nETag: \"{hex}\"\r\n\r\n",
        body.len(),
        bytes.len()
    );
    out.write_all(head.as_bytes())?;
    match cut {
        Some((at, stall)) => {
            out.write_all(&body[..at.min(body.len())])?;
            out.flush()?;
            if stall {
                std::thread::sleep(Duration::from_secs(600));
            }
            let _ = out.shutdown(std::net::Shutdown::Both);
            Ok(false)
        }
        None => {
            out.write_all(&body)?;
            Ok(true)
        }
    }
}

/// Reads a whole file.
pub fn read(path: &std::path::Path) -> Vec<u8> {
    let mut v = Vec::new();
    std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).read_to_end(&mut v).unwrap();
    v
}
