//! `sluice serve --config FILE`: the settings file gives the model, the address, the name and
//! the context; flags override it; a bad key, a wrong type and a missing model are errors that
//! name the file and the key, before anything loads.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

mod common;
mod serving;
use common::sluice_command;
use serving::{free_port, request, synth, PATIENCE};

/// `sluice serve` with `args`, its log in `dir`.
fn serve(dir: &Path, args: &[&str]) -> Child {
    sluice_command()
        .args(["serve", "--threads", "1"])
        .args(args)
        .env_remove("SLUICE_API_KEY")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("CREDENTIALS_DIRECTORY")
        .env_remove("STATE_DIRECTORY")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("serve.log")).unwrap())
        .spawn()
        .unwrap()
}

/// Waits until the server at `addr` is ready.
fn wait_ready(child: &mut Child, addr: std::net::SocketAddr, dir: &Path) {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("serve exited ({s}): {}", std::fs::read_to_string(dir.join("serve.log")).unwrap());
        }
        if std::net::TcpStream::connect(addr).is_ok() && request(addr, "GET", "/health", None).status == 200 {
            return;
        }
        assert!(t0.elapsed() < PATIENCE, "not ready: {}", std::fs::read_to_string(dir.join("serve.log")).unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_settings_file_configures_serve_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth(dir.path());
    let addr = free_port();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        format!(
            "model = \"{}\"\nlisten = \"{addr}\"\nmodel_id = \"from-the-file\"\nctx = 64\nboard = \"generic\"\ncache_mb = 0\nqueue = 2\n",
            model.display()
        ),
    )
    .unwrap();
    let mut child = serve(dir.path(), &["--config", config.to_str().unwrap()]);
    wait_ready(&mut child, addr, dir.path());
    let models = request(addr, "GET", "/v1/models", None).json();
    assert_eq!(models["data"][0]["id"], "from-the-file");
    // ctx = 64 holds: a longer prompt is refused.
    let long = format!(r#"{{"prompt":"{}","max_tokens":4}}"#, "word ".repeat(80));
    let r = request(addr, "POST", "/v1/completions", Some(&long));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("context_length_exceeded"), "{}", r.body);
    child.kill().unwrap();
    child.wait().unwrap();

    let mut child = serve(dir.path(), &["--config", config.to_str().unwrap(), "--model-id", "from-the-flag"]);
    wait_ready(&mut child, addr, dir.path());
    assert_eq!(request(addr, "GET", "/v1/models", None).json()["data"][0]["id"], "from-the-flag");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn bad_keys_wrong_types_and_a_missing_model_name_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    let fails = |text: &str, needle: &str| {
        std::fs::write(&config, text).unwrap();
        let o = sluice_command().args(["serve", "--config", config.to_str().unwrap()]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(&format!("{}: {needle}", config.display())), "{needle} not in: {err}");
    };
    fails("model = \"/m.gguf\"\ncache_size = 3\n", "key `cache_size`: unknown key; the keys are model,");
    fails("model = \"/m.gguf\"\nqueue = \"many\"\n", "key `queue`: invalid type: string \"many\", expected");
    fails("listen = \"0.0.0.0:8080\"\n", "no `model` key; set model = ");
    std::fs::remove_file(&config).unwrap();
    let o = sluice_command().args(["serve", "--config", config.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("cannot read the settings file {}", config.display())), "{err}");
}

#[test]
fn devices_fifos_and_huge_files_are_refused_as_settings_or_key_files_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let huge = dir.path().join("huge.toml");
    std::fs::write(&huge, "#".repeat(2 << 20)).unwrap();
    let model = synth(dir.path());
    // Each would read forever, block forever, or take megabytes.
    for (args, needle) in [
        (vec!["serve", "--config", "/dev/zero"], "/dev/zero: not a regular file"),
        (vec!["serve", "--config", fifo.to_str().unwrap()], "not a regular file"),
        (vec!["serve", "--config", huge.to_str().unwrap()], "over the 1048576 bytes"),
        (
            vec!["serve", "--no-config", "--model", model.to_str().unwrap(), "--api-key-file", "/dev/zero"],
            "cannot read the API key file /dev/zero: not a regular file",
        ),
        (
            vec!["serve", "--no-config", "--model", model.to_str().unwrap(), "--api-key-file", fifo.to_str().unwrap()],
            "not a regular file",
        ),
    ] {
        let o = sluice_command().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {needle:?} not in: {err}");
    }
}
