//! What a pull shows while it runs: a bar per file on a terminal (bytes, rate, time left), plain
//! lines for the journal and pipes, or events for the API's progress stream.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Receives a pull's events; called from several threads.
pub trait Progress: Sync {
    /// A file's fetch starts, `have` of its `size` bytes already there.
    fn file_start(&self, label: &str, size: u64, have: u64);
    /// `bytes` more of a file landed.
    fn advance(&self, label: &str, bytes: u64);
    /// A file is checked and in place.
    fn file_done(&self, label: &str);
    /// Something to tell (a retry, a verdict).
    fn note(&self, text: &str);
}

/// Bars on a terminal (indicatif).
pub struct Bars {
    multi: MultiProgress,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

impl Bars {
    /// Bars drawn on standard error.
    pub fn new() -> Bars {
        Bars { multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()), bars: Mutex::new(HashMap::new()) }
    }
}

impl Default for Bars {
    fn default() -> Self {
        Bars::new()
    }
}

impl Progress for Bars {
    fn file_start(&self, label: &str, size: u64, have: u64) {
        let bar = self.multi.add(ProgressBar::new(size));
        let style = ProgressStyle::with_template(
            "{msg:30!} {bar:30} {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} {eta:>4} left",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_message(label.to_string());
        bar.set_position(have);
        bar.reset_eta();
        self.bars.lock().unwrap_or_else(|p| p.into_inner()).insert(label.to_string(), bar);
    }

    fn advance(&self, label: &str, bytes: u64) {
        if let Some(b) = self.bars.lock().unwrap_or_else(|p| p.into_inner()).get(label) {
            b.inc(bytes);
        }
    }

    fn file_done(&self, label: &str) {
        if let Some(b) = self.bars.lock().unwrap_or_else(|p| p.into_inner()).remove(label) {
            b.finish_with_message(format!("{label}: checked"));
        }
    }

    fn note(&self, text: &str) {
        let _ = self.multi.println(text);
    }
}

/// Writes a line to standard error; a failed write loses the line, not the pull.
fn line(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{args}");
}

/// A file's figures for its lines: size, bytes here, start, last line, bytes at the start.
type FileLine = (u64, u64, Instant, Instant, u64);

/// Plain lines on standard error: a file's start, its progress every `every`, its end.
pub struct Lines {
    every: Duration,
    files: Mutex<HashMap<String, FileLine>>,
}

impl Lines {
    /// Lines at most every `every` a file.
    pub fn new(every: Duration) -> Lines {
        Lines { every, files: Mutex::new(HashMap::new()) }
    }
}

impl Progress for Lines {
    fn file_start(&self, label: &str, size: u64, have: u64) {
        let now = Instant::now();
        self.files.lock().unwrap_or_else(|p| p.into_inner()).insert(label.into(), (size, have, now, now, have));
        let size_h = bytesize::ByteSize(size);
        if have > 0 {
            line(format_args!("pulling {label}: {size_h}, {} already here", bytesize::ByteSize(have)));
        } else {
            line(format_args!("pulling {label}: {size_h}"));
        }
    }

    fn advance(&self, label: &str, bytes: u64) {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let Some((size, done, start, last, first)) = files.get_mut(label) else { return };
        *done += bytes;
        if last.elapsed() >= self.every {
            *last = Instant::now();
            let rate = (*done - *first) as f64 / start.elapsed().as_secs_f64().max(1e-3);
            let left = (*size - *done) as f64 / rate.max(1.0);
            line(format_args!(
                "pulling {label}: {} of {} ({:.0}%), {}/s, {} left",
                bytesize::ByteSize(*done),
                bytesize::ByteSize(*size),
                100.0 * *done as f64 / (*size).max(1) as f64,
                bytesize::ByteSize(rate as u64),
                humantime::format_duration(Duration::from_secs(left as u64))
            ));
        }
    }

    fn file_done(&self, label: &str) {
        line(format_args!("pulled {label}: digest checked"));
    }

    fn note(&self, text: &str) {
        line(format_args!("{text}"));
    }
}
