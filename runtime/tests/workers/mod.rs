//! A `sluice worker` on loopback for the scale-out tests: started with a budget (in a memory
//! cgroup of it where this machine lets the test make one), its log kept.
#![allow(dead_code)] // each test binary uses a part

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_hal::cgroup::MemoryCgroup;

use super::common::sluice_command;
use super::serving::{free_port, PATIENCE};

/// A running `sluice worker`, in its own memory cgroup when one can be made.
pub struct Worker {
    pub child: Child,
    pub endpoint: String,
    stderr: Arc<Mutex<String>>,
    cgroup: Option<MemoryCgroup>,
}

impl Worker {
    /// Starts a worker with a budget of `budget_mib` on `port` (a free one when `None`), its
    /// tensor cache in `dir`, and waits until it listens.
    pub fn start(dir: &Path, name: &str, budget_mib: u64, port: Option<u16>) -> Worker {
        Worker::start_with(dir, name, budget_mib, port, &[])
    }

    /// [`Worker::start`] with more `sluice worker` arguments.
    pub fn start_with(dir: &Path, name: &str, budget_mib: u64, port: Option<u16>, extra: &[&str]) -> Worker {
        let port = port.unwrap_or_else(|| free_port().port());
        let endpoint = format!("127.0.0.1:{port}");
        let profile = dir.join(format!("{name}.toml"));
        std::fs::write(&profile, format!("name = \"{name}\"\n[memory]\nbudget_mib = {budget_mib}\n")).unwrap();
        let cgroup_name = format!("sluice-test-{}-{name}-{port}", std::process::id());
        let cgroup = match MemoryCgroup::create(&cgroup_name, budget_mib << 20) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("note: worker {name} runs without a memory cgroup: {e}");
                None
            }
        };
        let mut cmd = sluice_command();
        cmd.args(["--board", profile.to_str().unwrap(), "-v", "worker", "--listen", &endpoint, "--threads", "1"]);
        if let Some(cg) = &cgroup {
            cmd.arg("--join-cgroup").arg(cg.dir());
        }
        let cache = dir.join(format!("cache-{name}"));
        let mut child = cmd
            .args(["--cache-dir", cache.to_str().unwrap()])
            .args(extra)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("CACHE_DIRECTORY")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        {
            let stderr = Arc::clone(&stderr);
            let pipe = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut s = stderr.lock().unwrap();
                    s.push_str(&line);
                    s.push('\n');
                }
            });
        }
        let mut w = Worker { child, endpoint, stderr, cgroup };
        let t0 = Instant::now();
        while !w.log().contains("sluice worker: serving RPC at") {
            if let Some(status) = w.child.try_wait().unwrap() {
                panic!("worker {name} exited ({status}):\n{}", w.log());
            }
            assert!(t0.elapsed() < PATIENCE, "worker {name} does not listen:\n{}", w.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        w
    }

    pub fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn port(&self) -> u16 {
        self.endpoint.rsplit_once(':').unwrap().1.parse().unwrap()
    }

    /// SIGKILL: a board that loses power.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGSTOP: a worker that stops answering while its connections stay open (and the kernel
    /// still accepts new ones).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`Worker::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, which: &str) {
        let pid = self.child.id().to_string();
        assert!(std::process::Command::new("kill").args([which, &pid]).status().unwrap().success());
    }

    /// Checks that the worker's cgroup never went over `budget_mib` nor hit its limit.
    pub fn assert_within_cgroup(&self, budget_mib: u64) {
        if let Some(cg) = &self.cgroup {
            let (peak, hits) = (cg.peak().unwrap_or(0), cg.limit_hits().unwrap_or(0));
            println!("worker {}: cgroup peak {:.1} MiB of {budget_mib} MiB", self.endpoint, peak as f64 / 1048576.0);
            assert!(peak <= budget_mib << 20 && hits == 0, "worker {}: peak {peak}, {hits} limit hits", self.endpoint);
        }
    }

    /// Whether the worker is still running (no signal ended it).
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy in front of a worker that forwards heads' connections until it falls silent:
/// after a head has sent `graphs` graph computations through it (or when told), it forwards
/// nothing more and holds every connection open, new ones included, as a worker that stopped
/// answering does while its kernel still accepts; [`SilentProxy::speak`] lets new connections
/// through again (the worker is back).
pub struct SilentProxy {
    pub endpoint: String,
    silent: Arc<std::sync::atomic::AtomicBool>,
}

impl SilentProxy {
    pub fn start(worker: &str, graphs: usize) -> SilentProxy {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        let silent = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicUsize::new(0));
        let (worker, flag) = (worker.to_string(), Arc::clone(&silent));
        let hold = || std::thread::sleep(Duration::from_secs(3600));
        std::thread::spawn(move || {
            for head in listener.incoming() {
                let Ok(head) = head else { return };
                let (worker, silent, seen) = (worker.clone(), Arc::clone(&flag), Arc::clone(&seen));
                std::thread::spawn(move || {
                    if silent.load(Ordering::SeqCst) {
                        let _keep = head;
                        return hold();
                    }
                    let Ok(w) = TcpStream::connect(&worker) else { return };
                    let (mut w_out, mut w_in, mut h_in, mut h_out) =
                        (w.try_clone().unwrap(), w, head.try_clone().unwrap(), head);
                    // Worker to head: bytes as they come, until the silence.
                    let down = Arc::clone(&silent);
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 1 << 16];
                        while let Ok(n) = w_in.read(&mut buf) {
                            if n == 0 || down.load(Ordering::SeqCst) || h_out.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        if down.load(Ordering::SeqCst) {
                            return hold();
                        }
                        let _ = h_out.shutdown(std::net::Shutdown::Both);
                    });
                    // Head to worker: whole commands (a byte, a length, the payload).
                    loop {
                        let mut head = [0u8; 9];
                        if h_in.read_exact(&mut head).is_err() {
                            // the head is gone: so is its connection to the worker
                            let _ = w_out.shutdown(std::net::Shutdown::Both);
                            return;
                        }
                        let mut payload = vec![0u8; u64::from_le_bytes(head[1..].try_into().unwrap()) as usize];
                        if h_in.read_exact(&mut payload).is_err() || silent.load(Ordering::SeqCst) {
                            break;
                        }
                        if w_out.write_all(&head).and_then(|()| w_out.write_all(&payload)).is_err() {
                            let _ = h_in.shutdown(std::net::Shutdown::Both);
                            return;
                        }
                        // GRAPH_COMPUTE, GRAPH_RECOMPUTE
                        if matches!(head[0], 10 | 16) && seen.fetch_add(1, Ordering::SeqCst) + 1 >= graphs {
                            silent.store(true, Ordering::SeqCst);
                        }
                    }
                    let _keep = (h_in, w_out);
                    hold();
                });
            }
        });
        SilentProxy { endpoint, silent }
    }

    /// Falls silent now.
    pub fn silence(&self) {
        self.silent.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// New connections are forwarded again.
    pub fn speak(&self) {
        self.silent.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}
