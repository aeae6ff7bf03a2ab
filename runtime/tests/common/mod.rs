//! What the binary's integration tests share.

#![allow(dead_code)] // each test binary uses a part

use std::path::Path;
use std::process::Command;

/// The built `sluice` binary as a command (see [`sluice_command_at`]).
pub fn sluice_command() -> Command {
    sluice_command_at(Path::new(env!("CARGO_BIN_EXE_sluice")))
}

/// The sluice binary at `bin` as a command; under a cross build, through the emulator named by
/// `SLUICE_TEST_RUNNER` (`make aarch64` sets it to qemu-aarch64). `RUST_LOG` is cleared so the
/// log level is the command line's.
pub fn sluice_command_at(bin: &Path) -> Command {
    let mut cmd = match std::env::var("SLUICE_TEST_RUNNER") {
        Ok(runner) if !runner.is_empty() => {
            let mut c = Command::new(runner);
            c.arg(bin);
            c
        }
        _ => Command::new(bin),
    };
    cmd.env_remove("RUST_LOG");
    cmd
}

/// Whether the tests run the binary under an emulator (`SLUICE_TEST_RUNNER`, set by `make
/// aarch64`): slow suites then take a sample.
pub fn emulated() -> bool {
    std::env::var_os("SLUICE_TEST_RUNNER").is_some_and(|r| !r.is_empty())
}

/// The small trained models `make test` names, by name: the KJV model (`SLUICE_TRAINED_MODEL`)
/// and the board-shaped one (`SLUICE_TRAINED_BOARD_MODEL`: 128 experts, 8 routed, padded). Each
/// that is not named is said and left out.
pub fn trained_models() -> Vec<(&'static str, std::path::PathBuf)> {
    let mut models = Vec::new();
    for (name, var) in [("trained", "SLUICE_TRAINED_MODEL"), ("board-shaped", "SLUICE_TRAINED_BOARD_MODEL")] {
        match std::env::var_os(var).filter(|p| !p.is_empty()) {
            Some(path) => models.push((name, std::path::PathBuf::from(path))),
            None => eprintln!("{var} is not set (make test sets it): the {name} model is left out"),
        }
    }
    models
}

/// Runs `cmd` with its standard output discarded, for at most `limit`: its exit status (`None`
/// when it ran past the limit and was killed), its standard error (read as it comes, so a full
/// pipe never stops it) and how long it ran.
pub fn run_within(
    cmd: &mut Command,
    limit: std::time::Duration,
) -> (Option<std::process::ExitStatus>, String, std::time::Duration) {
    use std::process::Stdio;
    let t0 = std::time::Instant::now();
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("spawn the command");
    let mut stderr = child.stderr.take().expect("piped standard error");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the command") {
            break Some(s);
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let took = t0.elapsed();
    (status, reader.join().unwrap_or_default(), took)
}
