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
