//! Per-decode telemetry: time, I/O, routing, cache, faults and memory, with a run summary and
//! CSV output.

use std::io::Write;
use std::time::Duration;

use crate::stream::TokenRow;
use crate::units::mib;

/// A decode's live one-line status.
pub fn progress_line(row: &TokenRow) -> String {
    format!(
        "token {:>4}  {:>7.1} ms  io {:>6.1} ms  stall {:>6.1} ms  read {:>7.2} MiB  hit {:>5.1}%  rss {:>7.1} MiB",
        row.index,
        ms(row.wall),
        ms(row.io_wait),
        ms(row.stall),
        mib(row.bytes_read),
        100.0 * row.hit_rate,
        mib(row.rss())
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Totals over the generated tokens (prompt batches excluded).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    /// Tokens the decodes after the prompt generated (one per decode unless drafting).
    pub tokens: usize,
    /// Their wall time.
    pub wall: Duration,
    /// Their I/O wait.
    pub io_wait: Duration,
    /// Their stall: compute threads blocked in the kernel waiting for experts (overlap).
    pub stall: Duration,
    /// Their expert bytes read.
    pub bytes_read: u64,
    /// Their major faults.
    pub major_faults: u64,
    /// Chosen experts they replaced by cached ones (lossy `--substitute`).
    pub substituted: u64,
    /// Experts read ahead on the lookahead's guess.
    pub lookahead_reads: u64,
    /// Of which the router then chose.
    pub lookahead_used: u64,
    /// Their layers whose reads overlapped compute.
    pub overlapped_layers: u64,
    /// Cumulative hit rate at the end.
    pub hit_rate: f64,
    /// Highest RSS seen after a decode.
    pub peak_rss: u64,
}

impl Summary {
    /// Sums the rows of `generation`'s decodes.
    pub fn of_generation(rows: &[TokenRow], generation: &crate::generate::Generation) -> Summary {
        Summary { tokens: generation.decoded as usize, ..Summary::of(rows) }
    }

    /// Sums `rows`, one generated token per decode after the prompt.
    pub fn of(rows: &[TokenRow]) -> Summary {
        let mut s = Summary::default();
        for r in rows {
            s.peak_rss = s.peak_rss.max(r.rss());
            s.hit_rate = r.hit_rate;
            if r.prefill {
                continue;
            }
            s.tokens += 1;
            s.wall += r.wall;
            s.io_wait += r.io_wait;
            s.stall += r.stall;
            s.bytes_read += r.bytes_read;
            s.major_faults += r.major_faults;
            s.substituted += r.substituted;
            s.lookahead_reads += r.lookahead_reads;
            s.lookahead_used += r.lookahead_used;
            s.overlapped_layers += r.overlapped_layers;
        }
        s
    }

    /// Decode tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        if self.wall.is_zero() {
            0.0
        } else {
            self.tokens as f64 / self.wall.as_secs_f64()
        }
    }

    /// Expert bytes read per second spent waiting for them (I/O wait plus stall), MiB/s
    /// (`None` when nothing was read).
    pub fn read_mib_per_s(&self) -> Option<f64> {
        let waited = self.io_wait + self.stall;
        (self.bytes_read > 0 && !waited.is_zero()).then(|| mib(self.bytes_read) / waited.as_secs_f64())
    }

    /// Stall (compute threads waiting for experts) per generated token, ms.
    pub fn stall_ms_per_token(&self) -> f64 {
        self.ms_per_token(self.stall)
    }

    /// Time waiting for storage per generated token, ms: I/O wait (serial layers) plus stall
    /// (overlapped ones).
    pub fn waited_ms_per_token(&self) -> f64 {
        self.ms_per_token(self.io_wait + self.stall)
    }

    /// `d` per generated token, ms (0 when none was generated).
    fn ms_per_token(&self, d: Duration) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            ms(d) / self.tokens as f64
        }
    }

    /// MiB read per generated token.
    pub fn mib_per_token(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            mib(self.bytes_read) / self.tokens as f64
        }
    }

    /// A human-readable summary.
    pub fn describe(&self) -> String {
        format!(
            "streamed decode: {} tokens, {:.2} tok/s, {:.2} MiB read/token, I/O wait {:.0}% of wall, stall {:.1} ms/token, cache hit rate {:.1}%, {} major faults, peak RSS {:.1} MiB",
            self.tokens,
            self.tokens_per_s(),
            self.mib_per_token(),
            if self.wall.is_zero() { 0.0 } else { 100.0 * self.io_wait.as_secs_f64() / self.wall.as_secs_f64() },
            self.stall_ms_per_token(),
            100.0 * self.hit_rate,
            self.major_faults,
            mib(self.peak_rss)
        )
    }
}

/// Writes `rows` as CSV after a `#`-commented preamble of `config` lines.
pub fn write_csv(out: &mut dyn Write, config: &[(String, String)], rows: &[TokenRow]) -> std::io::Result<()> {
    for (k, v) in config {
        // One comment line each, whatever the value holds.
        writeln!(out, "# {k} = {}", v.replace(['\n', '\r'], " "))?;
    }
    let mut w = csv::Writer::from_writer(out);
    w.write_record(CSV_HEADER)?;
    for r in rows {
        w.write_record([
            r.index.to_string(),
            u8::from(r.prefill).to_string(),
            r.n_tokens.to_string(),
            format!("{:.3}", ms(r.wall)),
            format!("{:.3}", ms(r.io_wait)),
            format!("{:.3}", ms(r.stall)),
            format!("{:.3}", ms(r.compute())),
            r.kernel_nodes.to_string(),
            r.bytes_read.to_string(),
            r.experts_routed.to_string(),
            r.hits.to_string(),
            r.misses.to_string(),
            r.substituted.to_string(),
            r.passed.to_string(),
            r.lookahead_reads.to_string(),
            r.lookahead_used.to_string(),
            r.overlapped_layers.to_string(),
            format!("{:.4}", r.hit_rate),
            r.major_faults.to_string(),
            r.rss_anon.to_string(),
            r.rss_file.to_string(),
            r.rss_shmem.to_string(),
        ])?;
    }
    w.flush()
}

/// The columns of the per-token CSV.
const CSV_HEADER: [&str; 22] = [
    "index",
    "prefill",
    "n_tokens",
    "wall_ms",
    "io_wait_ms",
    "stall_ms",
    "compute_ms",
    "kernel_nodes",
    "bytes_read",
    "experts_routed",
    "hits",
    "misses",
    "substituted",
    "passed",
    "lookahead_reads",
    "lookahead_used",
    "overlapped_layers",
    "hit_rate",
    "major_faults",
    "rss_anon",
    "rss_file",
    "rss_shmem",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn row(prefill: bool, ms_wall: u64, bytes: u64) -> TokenRow {
        TokenRow {
            index: 0,
            prefill,
            n_tokens: 1,
            runs: 1,
            wall: Duration::from_millis(ms_wall),
            io_wait: Duration::from_millis(ms_wall / 2),
            stall: Duration::ZERO,
            kernel_nodes: 3,
            bytes_read: bytes,
            experts_routed: 4,
            hits: 1,
            misses: 3,
            substituted: 0,
            passed: 0,
            lookahead_reads: 2,
            lookahead_used: 1,
            overlapped_layers: 3,
            hit_rate: 0.25,
            major_faults: 0,
            rss_anon: 1 << 20,
            rss_file: 0,
            rss_shmem: 0,
        }
    }

    #[test]
    fn summary_excludes_prompt_batches() {
        let rows = vec![row(true, 1000, 100 << 20), row(false, 100, 2 << 20), row(false, 100, 2 << 20)];
        let s = Summary::of(&rows);
        assert_eq!(s.tokens, 2);
        assert!((s.tokens_per_s() - 10.0).abs() < 1e-9);
        assert!((s.mib_per_token() - 2.0).abs() < 1e-9);
        assert_eq!((s.lookahead_reads, s.lookahead_used), (4, 2), "reads ahead of the generated tokens only");
        assert_eq!(s.overlapped_layers, 6, "the generated tokens' layers only");
    }

    #[test]
    fn csv_has_preamble_header_and_rows_a_standard_reader_reads_back() {
        let mut out = Vec::new();
        let config = [("cache_mb".into(), "0".into()), ("model".into(), "/m/a, b\nc.gguf".into())];
        write_csv(&mut out, &config, &[row(false, 10, 5), row(true, 20, 6)]).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines[0], "# cache_mb = 0");
        assert_eq!(lines[1], "# model = /m/a, b c.gguf", "a value's newline stays in its comment line");
        let mut reader = csv::ReaderBuilder::new().comment(Some(b'#')).from_reader(text.as_bytes());
        assert_eq!(reader.headers().unwrap().len(), CSV_HEADER.len());
        let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        assert_eq!(records.len(), 2);
        assert!(records.iter().all(|r| r.len() == CSV_HEADER.len()));
        assert_eq!(&records[1][1], "1", "the prompt batch row");
    }
}
