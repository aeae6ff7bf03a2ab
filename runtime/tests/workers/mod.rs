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
