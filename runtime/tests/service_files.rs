//! The systemd side of `sluice serve` and `sluice worker`: the shipped units pass
//! `systemd-analyze verify` and score at most 3.0 on `systemd-analyze security`, alone and with
//! the drop-ins `sluice unit` makes; the Debian package (`SLUICE_DEB`, which `make test` builds)
//! holds what it should, its units verify there and lintian finds no errors; and `serve` refuses
//! a memory plan over the board's budget before listening.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{sluice_command, sluice_command_at};

fn sluice(args: &[&str]) -> Output {
    sluice_command().args(args).output().expect("run sluice")
}

const SERVE: &str = "sluice.service";
const WORKER: &str = "sluice-worker.service";

fn unit_file(service: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../systemd").join(service)
}

/// Copies this machine's systemd units (for the targets a unit depends on) under `root`.
fn add_systemd_units(root: &Path) {
    std::fs::create_dir_all(root.join("usr/lib/systemd")).unwrap();
    let ok = Command::new("cp")
        .args(["-r", "/usr/lib/systemd/system"])
        .arg(root.join("usr/lib/systemd/"))
        .status()
        .unwrap()
        .success();
    assert!(ok, "copying /usr/lib/systemd/system");
}

/// A root directory holding systemd's own units (for the targets the unit depends on), the unit
/// `service`, an optional drop-in, and executables where ExecStart points.
fn unit_root(service: &str, drop_in: Option<&str>) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let system = r.join("etc/systemd/system");
    std::fs::create_dir_all(system.join(format!("{service}.d"))).unwrap();
    std::fs::create_dir_all(r.join("usr/local/bin")).unwrap();
    std::fs::create_dir_all(r.join("usr/bin")).unwrap();
    add_systemd_units(r);
    std::fs::copy(unit_file(service), system.join(service)).unwrap();
    if let Some(text) = drop_in {
        std::fs::write(system.join(format!("{service}.d/board.conf")), text).unwrap();
    }
    // The package's binary (the units' own ExecStart) and a hand-installed one (the drop-ins').
    for exe in ["usr/bin/sluice", "usr/local/bin/sluice"] {
        let exe = r.join(exe);
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        let mut perms = std::fs::metadata(&exe).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&exe, perms).unwrap();
    }
    root
}

/// Runs `systemd-analyze verify` and `security --offline=true` on `service` under `root`;
/// returns the score.
fn analyze(root: &Path, service: &str) -> f64 {
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .arg(service)
        .output()
        .expect("systemd-analyze (Debian package systemd; make deps installs it)");
    let err = String::from_utf8_lossy(&verify.stderr);
    assert!(verify.status.success() && err.trim().is_empty(), "systemd-analyze verify: {err}");
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(format!("--root={}", root.display()))
        .arg(service)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&security.stdout);
    let prefix = format!("→ Overall exposure level for {service}: ");
    let score = out
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no exposure score in:\n{out}\n{}", String::from_utf8_lossy(&security.stderr)));
    println!("exposure {score}");
    score
}

fn unit_text(args: &[&str]) -> String {
    let o = sluice(args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn drop_in(board: &str, listen: &str, extra: &[&str]) -> String {
    let mut args = vec!["--board", board, "unit", "--model", "/srv/models/m.gguf", "--listen", listen];
    args.extend_from_slice(extra);
    unit_text(&args)
}

#[test]
fn the_units_verify_and_are_hardened() {
    for service in [SERVE, WORKER] {
        let score = analyze(unit_root(service, None).path(), service);
        assert!(score <= 1.5, "{service}: exposure {score} > 1.5");
    }
}

#[test]
fn rpc_drop_ins_admit_only_the_head_and_reach_only_the_workers() {
    let worker =
        unit_text(&["--board", "rpi5-8gb", "unit", "--worker", "--listen", "10.0.0.2:50052", "--head", "10.0.0.1"]);
    assert!(worker.contains("worker --board rpi5-8gb --listen 10.0.0.2:50052 --allow 10.0.0.1\n"), "{worker}");
    assert!(worker.contains("\nIPAddressAllow=10.0.0.1\n") && worker.contains("MemoryMax=7168M\n"), "{worker}");
    let score = analyze(unit_root(WORKER, Some(&worker)).path(), WORKER);
    assert!(score <= 1.5, "worker drop-in: exposure {score} > 1.5");
    let head = drop_in("rpi5-8gb", "127.0.0.1:8080", &["--rpc", "10.0.0.2:50052,10.0.0.3:50052"]);
    assert!(
        head.contains("--rpc 10.0.0.2:50052,10.0.0.3:50052 ") && head.contains("\nIPAddressAllow=10.0.0.2 10.0.0.3\n"),
        "{head}"
    );
    let score = analyze(unit_root(SERVE, Some(&head)).path(), SERVE);
    assert!(score <= 1.5, "head drop-in with workers: exposure {score} > 1.5");
    // A worker's unit needs the head and an IPv4 address; a head's unit needs workers' IPs.
    let o = sluice(&["unit", "--worker", "--head", "10.0.0.1"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--worker needs --listen IPV4:PORT"));
    let o = sluice(&["unit", "--model", "/srv/m.gguf", "--rpc", "pi2.lan:50052"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("give the worker's IP instead of pi2.lan"), "{err}");
}

#[test]
fn board_drop_ins_verify_and_keep_the_unit_hardened() {
    let pi = drop_in("rpi5-8gb", "127.0.0.1:8080", &["--api-key-file", "/etc/sluice/api-key"]);
    assert!(pi.contains("CPUAffinity=0-3\n") && pi.contains("MemoryMax=7168M\n"), "{pi}");
    assert!(pi.contains("LoadCredential=api-key:/etc/sluice/api-key\n"), "{pi}");
    let score = analyze(unit_root(SERVE, Some(&pi)).path(), SERVE);
    assert!(score <= 1.5, "rpi5-8gb: exposure {score} > 1.5");
    // The GPU's device nodes and accepting other hosts cost some exposure.
    let jetson = drop_in("orin-nano-8gb", "0.0.0.0:8080", &[]);
    assert!(jetson.contains("DeviceAllow=/dev/nvmap rw\n"), "{jetson}");
    let score = analyze(unit_root(SERVE, Some(&jetson)).path(), SERVE);
    assert!(score <= 3.0, "orin-nano-8gb (GPU devices, other hosts): exposure {score} > 3.0");
}

#[test]
fn unit_refuses_a_relative_model_path() {
    let o = sluice(&["--board", "rpi5-8gb", "unit", "--model", "models/m.gguf"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--model models/m.gguf is relative; give an absolute path"), "{err}");
}

#[test]
fn serve_refuses_a_plan_over_the_budget_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let o = sluice(&["synth", "--out", model.to_str().unwrap()]);
    assert!(o.status.success());
    let profile = dir.path().join("tiny.toml");
    std::fs::write(&profile, "name = \"tiny\"\n[memory]\nbudget_mib = 30\n").unwrap();
    let o = sluice(&[
        "--board",
        profile.to_str().unwrap(),
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("more than the budget of 30.0 MiB") && err.contains("raise the budget"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Runs `program` with `args`; its standard output, or a failure with its standard error.
fn output_of(program: &str, args: &[&str]) -> String {
    let o = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(o.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn the_debian_package_holds_the_binary_units_profiles_docs_and_settings() {
    let Some(deb) = std::env::var_os("SLUICE_DEB") else {
        eprintln!("SKIPPED: SLUICE_DEB names no package (make test builds one with cargo-deb and sets it)");
        return;
    };
    let deb = deb.to_str().unwrap().to_string();
    let listing = output_of("dpkg-deb", &["--contents", &deb]);
    let mut files: Vec<&str> = listing
        .lines()
        .filter(|l| !l.starts_with('d'))
        .filter_map(|l| l.split_whitespace().last()?.strip_prefix("./"))
        .collect();
    files.sort_unstable();
    let boards = Path::new(env!("CARGO_MANIFEST_DIR")).join("../boards");
    let mut expected: Vec<String> = std::fs::read_dir(&boards)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".toml"))
        .map(|n| format!("usr/share/sluice/boards/{n}"))
        .collect();
    expected.extend(
        [
            "etc/sluice/sluice.toml",
            "usr/bin/sluice",
            "usr/lib/systemd/system/sluice-worker.service",
            "usr/lib/systemd/system/sluice.service",
            "usr/share/doc/sluice/README.md",
            "usr/share/doc/sluice/benchmarks.md",
            "usr/share/doc/sluice/boards.md",
            "usr/share/doc/sluice/changelog.Debian.gz",
            "usr/share/doc/sluice/models.md",
            "usr/share/doc/sluice/copyright",
            "usr/share/doc/sluice/setup.md",
        ]
        .map(String::from),
    );
    expected.sort_unstable();
    assert_eq!(files, expected, "the package's files");
    assert!(listing.lines().any(|l| l.starts_with("-rwxr-xr-x 0/0") && l.ends_with("./usr/bin/sluice")), "{listing}");

    // The settings file is a conffile; no maintainer script enables or starts anything.
    let control = tempfile::tempdir().unwrap();
    output_of("dpkg-deb", &["--control", &deb, control.path().to_str().unwrap()]);
    let conffiles = std::fs::read_to_string(control.path().join("conffiles")).unwrap();
    assert_eq!(conffiles.trim(), "/etc/sluice/sluice.toml");
    for script in ["preinst", "postinst", "prerm", "postrm"] {
        let text = std::fs::read_to_string(control.path().join(script)).unwrap_or_default();
        assert!(!text.contains("enable") && !text.contains("start"), "{script} enables or starts: {text}");
    }

    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    output_of("dpkg-deb", &["--extract", &deb, r.to_str().unwrap()]);
    assert_eq!(
        std::fs::read(r.join("usr/lib/systemd/system/sluice.service")).unwrap(),
        std::fs::read(unit_file(SERVE)).unwrap()
    );
    add_systemd_units(r);
    for service in [SERVE, WORKER] {
        let score = analyze(r, service);
        assert!(score <= 1.5, "{service} as packaged: exposure {score} > 1.5");
    }
    // The unit's command on the shipped settings: nothing runs until a model is set.
    let o = sluice_command_at(&r.join("usr/bin/sluice"))
        .args(["serve", "--config"])
        .arg(r.join("etc/sluice/sluice.toml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("sluice.toml: no `model` key; set model = "), "{err}");

    match Command::new("lintian").args(["--fail-on", "error", &deb]).output() {
        Err(e) => {
            eprintln!("SKIPPED lintian: {e} (apt-get install lintian; make test installs it where apt is reachable)")
        }
        Ok(o) => {
            let out = String::from_utf8_lossy(&o.stdout);
            println!("lintian:\n{out}");
            assert!(o.status.success() && !out.lines().any(|l| l.starts_with("E:")), "lintian errors:\n{out}");
        }
    }
}
