//! The benchmark's several-board rows: loopback `sluice worker`s, each in a memory cgroup of the
//! same budget as the head's, that the head's child splits the model over (`--rpc`).

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use sluice_hal::cgroup::MemoryCgroup;

use super::BenchError;

/// How long a worker may take to listen.
const START_PATIENCE: Duration = Duration::from_secs(120);

/// A worker the bench started, stopped (SIGKILL) on drop; its cgroup goes after it.
pub struct LoopbackWorker {
    child: Child,
    /// `127.0.0.1:port`.
    pub endpoint: String,
    /// Its memory cgroup.
    pub cgroup: MemoryCgroup,
}

impl LoopbackWorker {
    /// Starts `exe [global_args] worker` on a free loopback port in a new memory cgroup of
    /// `budget` bytes (named after `tag`), without a tensor cache, and waits until it listens.
    pub fn start(exe: &Path, global_args: &[OsString], budget: u64, tag: &str) -> Result<LoopbackWorker, BenchError> {
        let cgroup = MemoryCgroup::create(&format!("sluice-bench-{}-{tag}", std::process::id()), budget)?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| BenchError::Io("choosing a loopback port for a worker".into(), e))?
            .port();
        let endpoint = format!("127.0.0.1:{port}");
        let mut child = Command::new(exe)
            .args(global_args)
            .args(["-v", "worker", "--listen", &endpoint, "--no-cache", "--join-cgroup"])
            .arg(cgroup.dir())
            .env_remove("NOTIFY_SOCKET")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| BenchError::Io(format!("starting a worker ({})", exe.display()), e))?;
        let (tx, rx) = mpsc::channel();
        if let Some(pipe) = child.stderr.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    log::debug!("worker: {line}");
                    let _ = tx.send(line);
                }
            });
        }
        let mut said = String::new();
        loop {
            match rx.recv_timeout(START_PATIENCE) {
                Ok(line) if line.starts_with("sluice worker: serving RPC at") => break,
                Ok(line) => {
                    said.push_str(&line);
                    said.push('\n');
                }
                Err(_) => {
                    let _ = child.kill();
                    let status = child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
                    return Err(BenchError::Child { kind: format!("worker at {endpoint}"), status, stderr: said });
                }
            }
        }
        Ok(LoopbackWorker { child, endpoint, cgroup })
    }
}

impl Drop for LoopbackWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
