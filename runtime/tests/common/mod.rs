//! What the binary's integration tests share.

use std::process::Command;

/// The built `sluice` binary as a command; under a cross build, through the emulator named by
/// `SLUICE_TEST_RUNNER` (`make aarch64` sets it to qemu-aarch64). `RUST_LOG` is cleared so the
/// log level is the command line's.
pub fn sluice_command() -> Command {
    let bin = env!("CARGO_BIN_EXE_sluice");
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
