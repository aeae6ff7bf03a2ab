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

/// `eprint!` that never panics: a failed write to standard error (`2>/dev/full`, a closed
/// descriptor) loses the message, not the command's result.
macro_rules! note {
    ($($arg:tt)*) => { $crate::cli::write_stderr(format_args!($($arg)*)) };
}

/// `eprintln!` that never panics (see `note!`).
macro_rules! noteln {
    () => { $crate::cli::write_stderr(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::write_stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Writes to standard error, ignoring a failure: there is nowhere left to report it.
pub fn write_stderr(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = std::io::stderr().write_fmt(args);
}

/// Ends the process with status 141 (as SIGPIPE would) when `e` says the reader has gone.
fn exit_if_reader_gone(e: &std::io::Error) {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
}

/// Writes to standard output, exiting with status 141 when the reader has gone.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = std::io::stdout().write_fmt(args) {
        exit_if_reader_gone(&e);
        noteln!("error: writing to standard output: {e}");
        std::process::exit(1);
    }
}

/// Generated text written to standard output as it comes. The first failed write is kept
/// and later ones skipped, so that the command fails with it once generation ends.
pub struct TextOut {
    out: std::io::StdoutLock<'static>,
    failed: Option<std::io::Error>,
}

impl TextOut {
    /// Standard output, locked for the generation; an error when it was closed when the command
    /// started (the text would be lost and the command would succeed).
    pub fn new() -> anyhow::Result<TextOut> {
        let stdout = std::io::stdout();
        if ggml_sys::stdout_was_closed() {
            anyhow::bail!(
                "standard output is closed: the generated text would be lost; redirect it (`> FILE` or `> /dev/null`)"
            );
        }
        Ok(TextOut { out: stdout.lock(), failed: None })
    }

    /// Writes and flushes `text` (nothing after a failure).
    pub fn write(&mut self, text: &str) {
        use std::io::Write as _;
        if self.failed.is_none() {
            if let Err(e) = self.out.write_all(text.as_bytes()).and_then(|()| self.out.flush()) {
                self.failed = Some(e);
            }
        }
    }

    /// Writes the last `text` and a newline. A reader that went away ends the process with
    /// status 141 (as SIGPIPE would); any other failed write is an error.
    pub fn finish(mut self, text: &str) -> anyhow::Result<()> {
        self.write(text);
        self.write("\n");
        match self.failed {
            None => Ok(()),
            Some(e) => {
                exit_if_reader_gone(&e);
                Err(anyhow::anyhow!("writing the generated text to standard output: {e}"))
            }
        }
    }
}

pub mod args;
pub mod bench;
pub mod bench_child;
pub mod chat;
pub mod chat_link;
pub mod perplexity;
pub mod plan;
pub mod probe;
pub mod pull;
pub mod quantize;
pub mod replay;
pub mod run;
pub mod serve;
pub mod synth;
pub mod verify;
pub mod worker;
