//! The commands of the `sluice` binary, one module each, the argument groups they share, and
//! standard output that ends the process quietly when its reader goes away (`sluice boards |
//! head`) instead of panicking.

/// `print!` to standard output; a closed pipe ends the process with status 141 (as SIGPIPE
/// would).
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!($($arg)*)) };
}

/// `println!` to standard output; a closed pipe ends the process with status 141.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Writes to standard output, exiting with status 141 when the reader has gone.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = std::io::stdout().write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("error: writing to standard output: {e}");
        std::process::exit(1);
    }
}

pub mod args;
pub mod bench;
pub mod plan;
pub mod probe;
pub mod run;
pub mod serve;
pub mod synth;
