//! `sluice unit`: the systemd drop-in that fits `systemd/sluice.service` to one board and model,
//! or `systemd/sluice-worker.service` to one RPC worker board.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use super::KEY_FILE;

use crate::board::profile::ServiceName;
use crate::board::SelectedBoard;

/// The Jetson GPU's device nodes (JetPack 5 names, then JetPack 6's `nvgpu/igpu0` ones); nodes a
/// board lacks are skipped by systemd with a warning.
const JETSON_GPU_DEVICES: &[&str] = &[
    "/dev/nvmap",
    "/dev/nvhost-ctrl",
    "/dev/nvhost-ctrl-gpu",
    "/dev/nvhost-prof-gpu",
    "/dev/nvhost-gpu",
    "/dev/nvhost-as-gpu",
    "/dev/nvhost-dbg-gpu",
    "/dev/nvhost-tsg-gpu",
    "/dev/nvhost-ctxsw-gpu",
    "/dev/nvhost-sched-gpu",
    "/dev/host1x-fence",
    "/dev/nvgpu/igpu0/as",
    "/dev/nvgpu/igpu0/channel",
    "/dev/nvgpu/igpu0/ctrl",
    "/dev/nvgpu/igpu0/ctxsw",
    "/dev/nvgpu/igpu0/dbg",
    "/dev/nvgpu/igpu0/power",
    "/dev/nvgpu/igpu0/prof",
    "/dev/nvgpu/igpu0/sched",
    "/dev/nvgpu/igpu0/tsg",
];

/// Which service the drop-in is for.
#[derive(Debug, Clone)]
pub enum UnitRole<'a> {
    /// `sluice serve` (`sluice.service`).
    Serve {
        /// The model's first file, absolute.
        model: &'a Path,
        /// A file on the board holding the API key, passed as the systemd credential `api-key`.
        api_key_file: Option<&'a Path>,
        /// RPC workers (`--rpc`): their `host:port` and IP address, which the service may reach.
        rpc: Vec<(String, IpAddr)>,
    },
    /// `sluice worker` (`sluice-worker.service`).
    Worker {
        /// The head, the one address allowed to connect.
        head: IpAddr,
    },
}

/// What the drop-in is made from.
#[derive(Debug, Clone)]
pub struct UnitRequest<'a> {
    /// The board profile, with its id.
    pub board: &'a SelectedBoard,
    /// The service.
    pub role: UnitRole<'a>,
    /// The address to serve on.
    pub listen: SocketAddr,
    /// The installed binary.
    pub exe: &'a Path,
    /// `MemTotal` of this machine, for a profile that names no RAM size.
    pub mem_total: Option<u64>,
}

/// Why no drop-in can be made.
#[derive(Debug, thiserror::Error)]
pub enum UnitError {
    /// A path is relative: the service runs from `/`.
    #[error("{what} {path} is relative; give an absolute path (the service runs from /)")]
    Relative {
        /// Which path.
        what: &'static str,
        /// The path.
        path: String,
    },
    /// The profile gives no budget and no RAM size, and this machine's is unknown.
    #[error(
        "board {0}: the profile sets neither memory.budget_mib nor identity.ram_gib; add one so MemoryMax can be set"
    )]
    NoMemory(String),
}

/// Quotes one argument for an `ExecStart=` line: `%` doubled (systemd specifiers), and quotes
/// around anything with spaces, quotes or backslashes.
fn exec_arg(s: &str) -> String {
    let s = s.replace('%', "%%");
    if s.chars().any(|c| c.is_whitespace() || c == '"' || c == '\'' || c == '\\' || c == ';') {
        format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        s
    }
}

/// The memory limit and why: the profile's budget, else its RAM less the reserve.
fn memory_max(req: &UnitRequest<'_>) -> Result<(u64, String), UnitError> {
    let p = &req.board.profile;
    if let Some(b) = p.memory.budget_mib {
        return Ok((b, "memory.budget_mib".into()));
    }
    let (ram_mib, from) = match (p.identity.ram_gib, req.mem_total) {
        (Some(g), _) => (u64::from(g) * 1024, format!("identity.ram_gib {g} GiB")),
        (None, Some(t)) => (t >> 20, format!("this machine's MemTotal {} MiB", t >> 20)),
        (None, None) => return Err(UnitError::NoMemory(req.board.id.clone())),
    };
    let reserve = p.memory.reserve_mib;
    Ok((ram_mib.saturating_sub(reserve), format!("{from} - memory.reserve_mib {reserve} MiB")))
}

/// The drop-in text (`/etc/systemd/system/sluice.service.d/board.conf`, or
/// `sluice-worker.service.d/board.conf` for a worker).
pub fn drop_in(req: &UnitRequest<'_>) -> Result<String, UnitError> {
    let mut paths = vec![("--exe", req.exe)];
    if let UnitRole::Serve { model, api_key_file, .. } = &req.role {
        paths.push(("--model", model));
        paths.extend(api_key_file.map(|f| ("--api-key-file", f)));
    }
    for (what, path) in paths {
        if !path.is_absolute() {
            return Err(UnitError::Relative { what, path: path.display().to_string() });
        }
    }
    let p = &req.board.profile;
    let board_arg = if req.board.origin == "built-in" { req.board.id.clone() } else { req.board.origin.clone() };
    let (service, command) = match req.role {
        UnitRole::Serve { .. } => ("sluice", "serve"),
        UnitRole::Worker { .. } => ("sluice-worker", "worker"),
    };
    let mut out = String::new();
    let _ =
        writeln!(out, "# {service}.service drop-in for board {} ({}), made by `sluice unit`.", req.board.id, p.name);
    let _ = writeln!(
        out,
        "# Install as /etc/systemd/system/{service}.service.d/board.conf, then `systemctl daemon-reload`."
    );
    let _ = writeln!(out, "[Service]");
    let _ = writeln!(out, "ExecStart=");
    let _ = writeln!(out, "ExecStart={}", exec_start(req, command, board_arg));
    write_affinity(&mut out, req);
    let (mib, why) = memory_max(req)?;
    let _ = writeln!(out, "# The memory budget: {why}. sluice plans its memory within this cgroup limit.");
    let _ = writeln!(out, "MemoryMax={mib}M");
    let _ = writeln!(out, "MemorySwapMax=0");
    match &req.role {
        UnitRole::Serve { model, api_key_file, rpc } => write_serve_access(&mut out, req, model, *api_key_file, rpc),
        UnitRole::Worker { head } => {
            let _ = writeln!(
                out,
                "# Only the head at {head} may connect: ggml's RPC has no authentication. Keep the link private."
            );
            let _ = writeln!(out, "IPAddressAllow={head}");
        }
    }
    Ok(out)
}

/// The service's command line, each argument quoted for `ExecStart=`.
fn exec_start(req: &UnitRequest<'_>, command: &str, board_arg: String) -> String {
    let mut args = vec![req.exe.display().to_string(), "-v".into(), command.into()];
    if let UnitRole::Serve { model, rpc, .. } = &req.role {
        args.extend(["--model".into(), model.display().to_string()]);
        if !rpc.is_empty() {
            let list: Vec<&str> = rpc.iter().map(|(e, _)| e.as_str()).collect();
            args.extend(["--rpc".into(), list.join(",")]);
        }
    }
    args.extend(["--board".into(), board_arg, "--listen".into(), req.listen.to_string()]);
    if let UnitRole::Worker { head } = &req.role {
        // The worker itself admits the head alone too (beside IPAddressAllow=).
        args.extend(["--allow".into(), head.to_string()]);
    }
    args.iter().map(|a| exec_arg(a)).collect::<Vec<_>>().join(" ")
}

/// `CPUAffinity=` of the profile's cores: a worker computes only; the head's I/O lanes need
/// their cores too.
fn write_affinity(out: &mut String, req: &UnitRequest<'_>) {
    let p = &req.board.profile;
    let io_cores = match req.role {
        UnitRole::Serve { .. } => p.cpu.io_cores.iter().flatten().copied().collect(),
        UnitRole::Worker { .. } => Vec::new(),
    };
    let mut cores: Vec<usize> = p.cpu.compute_cores.iter().flatten().copied().chain(io_cores).collect();
    cores.sort_unstable();
    cores.dedup();
    if cores.is_empty() {
        return;
    }
    let list = sluice_hal::cpulist::format(&cores);
    let which = match req.role {
        UnitRole::Serve { .. } => "compute and I/O cores (cpu.compute_cores, cpu.io_cores)",
        UnitRole::Worker { .. } => "compute cores (cpu.compute_cores)",
    };
    let _ = writeln!(out, "# The profile's {which}.");
    let _ = writeln!(out, "CPUAffinity={}", list.replace(',', " "));
}

/// What the serving head reads and who reaches it: the model's directory read-only, the API
/// key credential, other hosts when it listens beyond loopback, the RPC workers, and the GPU's
/// devices for the cuda service.
fn write_serve_access(
    out: &mut String,
    req: &UnitRequest<'_>,
    model: &Path,
    api_key_file: Option<&Path>,
    rpc: &[(String, IpAddr)],
) {
    let model_dir = model.parent().unwrap_or(Path::new("/"));
    let _ = writeln!(out, "# The model (and the other files of a split model) is only read.");
    let _ = writeln!(out, "ReadOnlyPaths={}", exec_arg(&model_dir.display().to_string()));
    if home_or_tmp(model_dir) {
        let _ = writeln!(out, "# The model lies under a directory the base unit hides; let the service see it.");
        let _ = writeln!(out, "ProtectHome=read-only");
        let _ = writeln!(out, "PrivateTmp=no");
    }
    if let Some(key) = api_key_file {
        let _ = writeln!(
            out,
            "# The API key, read by root and handed to the service as $CREDENTIALS_DIRECTORY/{}.",
            KEY_FILE
        );
        let _ = writeln!(out, "LoadCredential={KEY_FILE}:{}", exec_arg(&key.display().to_string()));
    }
    if !req.listen.ip().is_loopback() {
        let _ =
            writeln!(out, "# --listen {} is not a loopback address: accept connections from other hosts.", req.listen);
        let _ = writeln!(out, "IPAddressDeny=");
    }
    if !rpc.is_empty() {
        let mut ips: Vec<String> = rpc.iter().map(|(_, ip)| ip.to_string()).collect();
        ips.dedup();
        let _ = writeln!(out, "# The RPC workers (--rpc) this board connects to.");
        let _ = writeln!(out, "IPAddressAllow={}", ips.join(" "));
    }
    if req.board.profile.compute.service == ServiceName::Cuda {
        let _ = writeln!(
            out,
            "# compute.service = \"cuda\": the Jetson GPU's device nodes, through the video and render groups"
        );
        let _ = writeln!(
            out,
            "# (a user namespace would hide those groups), and executable memory for CUDA's loaded kernels."
        );
        let _ = writeln!(out, "PrivateDevices=no");
        let _ = writeln!(out, "PrivateUsers=no");
        let _ = writeln!(out, "MemoryDenyWriteExecute=no");
        let _ = writeln!(out, "SupplementaryGroups=video render");
        for dev in JETSON_GPU_DEVICES {
            let _ = writeln!(out, "DeviceAllow={dev} rw");
        }
    }
}

fn home_or_tmp(dir: &Path) -> bool {
    ["/home", "/root", "/run/user", "/tmp", "/var/tmp"].iter().any(|p| dir.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::board::{select, BoardChoice};

    fn board(id: &str) -> SelectedBoard {
        select(&BoardChoice::Id(id.into()), &Default::default()).unwrap()
    }

    fn unit(id: &str, model: &str, listen: &str) -> String {
        let b = board(id);
        drop_in(&UnitRequest {
            board: &b,
            role: UnitRole::Serve { model: Path::new(model), api_key_file: None, rpc: Vec::new() },
            listen: listen.parse().unwrap(),
            exe: Path::new("/usr/local/bin/sluice"),
            mem_total: None,
        })
        .unwrap()
    }

    #[test]
    fn a_pi_gets_its_cores_and_memory() {
        let u = unit("rpi5-8gb", "/srv/models/m.gguf", "127.0.0.1:8080");
        assert!(u.contains("ExecStart=\nExecStart=/usr/local/bin/sluice -v serve --model /srv/models/m.gguf --board rpi5-8gb --listen 127.0.0.1:8080\n"), "{u}");
        assert!(u.contains("\nCPUAffinity=0-3\n"), "{u}");
        assert!(u.contains("\nMemoryMax=7168M\n"), "{u}");
        assert!(u.contains("\nReadOnlyPaths=/srv/models\n"), "{u}");
        assert!(!u.contains("DeviceAllow") && !u.contains("IPAddressDeny"), "{u}");
    }

    #[test]
    fn a_jetson_gets_its_gpu_and_other_hosts_when_asked() {
        let u = unit("orin-nano-8gb", "/home/me/my models/m%1.gguf", "0.0.0.0:8080");
        assert!(u.contains("DeviceAllow=/dev/nvmap rw\n") && u.contains("PrivateDevices=no\n"), "{u}");
        assert!(u.contains("\nIPAddressDeny=\n"), "{u}");
        assert!(u.contains("--model \"/home/me/my models/m%%1.gguf\""), "{u}");
        assert!(u.contains("ProtectHome=read-only"), "{u}");
        assert!(u.contains("\nMemoryMax=6656M\n"), "{u}");
    }

    #[test]
    fn relative_paths_are_refused() {
        let b = board("generic");
        let e = drop_in(&UnitRequest {
            board: &b,
            role: UnitRole::Serve { model: Path::new("m.gguf"), api_key_file: None, rpc: Vec::new() },
            listen: "127.0.0.1:1".parse().unwrap(),
            exe: Path::new("/usr/local/bin/sluice"),
            mem_total: Some(8 << 30),
        })
        .unwrap_err();
        assert!(e.to_string().contains("--model m.gguf is relative"), "{e}");
    }

    #[test]
    fn a_worker_admits_only_its_head_and_a_head_reaches_its_workers() {
        let b = board("rpi5-8gb");
        let head: IpAddr = "10.0.0.1".parse().unwrap();
        let w = drop_in(&UnitRequest {
            board: &b,
            role: UnitRole::Worker { head },
            listen: "10.0.0.2:50052".parse().unwrap(),
            exe: Path::new("/usr/local/bin/sluice"),
            mem_total: None,
        })
        .unwrap();
        assert!(
            w.contains(
                "ExecStart=\nExecStart=/usr/local/bin/sluice -v worker --board rpi5-8gb --listen 10.0.0.2:50052 --allow 10.0.0.1\n"
            ),
            "{w}"
        );
        assert!(w.contains("sluice-worker.service.d/board.conf") && w.contains("\nIPAddressAllow=10.0.0.1\n"), "{w}");
        assert!(w.contains("\nMemoryMax=7168M\n") && w.contains("\nCPUAffinity=0-3\n"), "{w}");
        assert!(!w.contains("IPAddressDeny=") && !w.contains("ReadOnlyPaths"), "{w}");
        let h = drop_in(&UnitRequest {
            board: &b,
            role: UnitRole::Serve {
                model: Path::new("/srv/m.gguf"),
                api_key_file: None,
                rpc: vec![
                    ("10.0.0.2:50052".into(), "10.0.0.2".parse().unwrap()),
                    ("10.0.0.3:50052".into(), "10.0.0.3".parse().unwrap()),
                ],
            },
            listen: "127.0.0.1:8080".parse().unwrap(),
            exe: Path::new("/usr/local/bin/sluice"),
            mem_total: None,
        })
        .unwrap();
        assert!(h.contains(" --rpc 10.0.0.2:50052,10.0.0.3:50052 "), "{h}");
        assert!(h.contains("\nIPAddressAllow=10.0.0.2 10.0.0.3\n"), "{h}");
    }
}
