//! What the binary's integration tests share.

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
