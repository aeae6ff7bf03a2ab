//! The benchmark's results as a table and as CSV: each row's speed against the mmap-resident
//! reference, its reads against the storage ceiling and the I/O bound, and whether its text
//! equals the reference's.

use std::fmt::Write as _;

use super::BenchRow;
use crate::units::mib;

/// The I/O bound of a row that read experts: the tokens per second the storage `ceiling`
/// (MiB/s) allows at the row's MiB read per token.
fn io_bound(r: &BenchRow, ceiling: f64) -> Option<f64> {
    (r.read_mib_s.is_some() && r.mib_per_token > 0.0).then(|| ceiling / r.mib_per_token)
}

/// The smaller of the row's I/O bound (`ceiling` MiB/s over its MiB per token, where it read
/// experts) and the `compute` bound (the all-in-RAM decode, tok/s).
fn bound(r: &BenchRow, ceiling: Option<f64>, compute: Option<f64>) -> Option<f64> {
    match (ceiling.and_then(|c| io_bound(r, c)), compute.filter(|&c| c > 0.0)) {
        (Some(io), Some(c)) => Some(io.min(c)),
        (io, c) => io.or(c),
    }
}

/// One column of a results table: header and the cell of each row.
pub(crate) struct Column {
    header: String,
    cells: Vec<String>,
}

/// The column `header` of `rows`, each cell `cell` of its row.
pub(crate) fn column<T>(header: impl Into<String>, rows: &[T], cell: impl Fn(&T) -> String) -> Column {
    Column { header: header.into(), cells: rows.iter().map(cell).collect() }
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

/// The results as a table: each row's speed relative to the first (the mmap-resident
/// reference), whether its tokens equal the first's, and, when `ceiling` (the storage ceiling in
/// MiB/s) is given, expert reads as a share of it; with `compute` (the all-in-RAM decode,
/// tok/s), each row's speed as a share of the smaller of its I/O bound and the compute.
/// Cgroup columns appear for isolated runs.
pub fn table(rows: &[BenchRow], ceiling: Option<f64>, compute: Option<f64>) -> String {
    let base = rows.first().map_or(0.0, |r| r.tokens_per_s);
    let first = rows.first().map(|r| r.tokens.clone()).unwrap_or_default();
    let isolated = rows.iter().any(|r| r.cgroup_peak.is_some());
    let mut cols = vec![
        column("config", rows, |r| r.label.clone()),
        column("cache MiB", rows, |r| opt(r.cache_bytes, |b| format!("{:.1}", mib(b)))),
        column("tok/s", rows, |r| format!("{:.2}", r.tokens_per_s)),
        column("x mmap", rows, |r| format!("{:.2}", if base > 0.0 { r.tokens_per_s / base } else { 0.0 })),
        column("MiB/token", rows, |r| format!("{:.2}", r.mib_per_token)),
        column("hit %", rows, |r| opt(r.hit_rate, |h| format!("{:.1}", 100.0 * h))),
        column("major faults", rows, |r| r.major_faults.to_string()),
        column("peak RSS MiB", rows, |r| format!("{:.1}", mib(r.peak_rss))),
    ];
    if isolated {
        cols.push(column("cgroup peak MiB", rows, |r| opt(r.cgroup_peak, |b| format!("{:.1}", mib(b)))));
        cols.push(column("limit hits", rows, |r| opt(r.limit_hits, |h| h.to_string())));
    }
    if rows.iter().any(|r| r.stall_ms.is_some()) {
        cols.push(column("stall ms/tok", rows, |r| opt(r.stall_ms, |v| format!("{v:.1}"))));
    }
    if rows.iter().any(|r| r.draft_accept.is_some()) {
        cols.push(column("draft acc %", rows, |r| opt(r.draft_accept, |v| format!("{:.0}", 100.0 * v))));
    }
    if rows.iter().any(|r| r.lossy_quality.is_some()) {
        cols.push(column("top-1 %", rows, |r| opt(r.lossy_quality, |q| format!("{:.1}", 100.0 * q.top1))));
        cols.push(column("mean KL", rows, |r| opt(r.lossy_quality, |q| format!("{:.4}", q.mean_kl))));
    }
    cols.push(column("read MiB/s", rows, |r| opt(r.read_mib_s, |v| format!("{v:.1}"))));
    if let Some(c) = ceiling {
        cols.push(column("% ceiling", rows, |r| opt(r.read_mib_s, |v| format!("{:.0}", 100.0 * v / c))));
        cols.push(column("I/O bound tok/s", rows, |r| opt(io_bound(r, c), |b| format!("{b:.2}"))));
        cols.push(column("% I/O bound", rows, |r| {
            opt(io_bound(r, c), |b| format!("{:.0}", 100.0 * r.tokens_per_s / b))
        }));
    }
    if let Some(c) = compute {
        cols.push(column("compute tok/s", rows, |_| format!("{c:.2}")));
        cols.push(column("% min(I/O, compute)", rows, |r| {
            opt(bound(r, ceiling, compute), |b| format!("{:.0}", 100.0 * r.tokens_per_s / b))
        }));
    }
    cols.push(column("open s", rows, |r| format!("{:.2}", r.open_s)));
    cols.push(column("TTFT s", rows, |r| format!("{:.2}", r.ttft_s)));
    cols.push(column("prefill MiB", rows, |r| format!("{:.1}", mib(r.prefill_read))));
    cols.push(column("same text", rows, |r| if r.tokens == first { "yes".into() } else { "NO".into() }));
    render(&cols, rows.len())
}

/// Columns as an aligned text table (the first left-aligned, the rest right-aligned).
pub(crate) fn render(cols: &[Column], n_rows: usize) -> String {
    let widths: Vec<usize> =
        cols.iter().map(|c| c.cells.iter().map(String::len).chain([c.header.len()]).max().unwrap_or(0)).collect();
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| if i == 0 { format!("{c:<w$}") } else { format!("{c:>w$}") })
            .collect();
        let _ = writeln!(out, "{}", parts.join("  "));
    };
    line(cols.iter().map(|c| c.header.as_str()).collect(), &mut out);
    for i in 0..n_rows {
        line(cols.iter().map(|c| c.cells[i].as_str()).collect(), &mut out);
    }
    out
}

/// The conversation rows as a table: each turn's (or client group's) time to first token from
/// its request, the expert bytes its prompt read, and its decode speed.
pub fn conversation_table(rows: &[BenchRow]) -> String {
    let cols = conversation_columns(rows);
    render(&cols, rows.len())
}

/// The conversation rows as CSV.
pub fn conversation_csv(rows: &[BenchRow]) -> String {
    columns_csv(&conversation_columns(rows), rows.len())
}

/// Columns as CSV: their headers, then a record per row.
pub(crate) fn columns_csv(cols: &[Column], n_rows: usize) -> String {
    let mut w = csv::Writer::from_writer(Vec::new());
    let _ = w.write_record(cols.iter().map(|c| c.header.as_str()));
    for i in 0..n_rows {
        // Writing into memory cannot fail.
        let _ = w.write_record(cols.iter().map(|c| c.cells[i].as_str()));
    }
    w.into_inner().map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default()
}

fn conversation_columns(rows: &[BenchRow]) -> Vec<Column> {
    vec![
        column("config", rows, |r| r.label.clone()),
        column("TTFT s", rows, |r| format!("{:.2}", r.ttft_s)),
        column("prefill MiB", rows, |r| format!("{:.1}", mib(r.prefill_read))),
        column("tok/s", rows, |r| format!("{:.2}", r.tokens_per_s)),
        column("MiB/token", rows, |r| format!("{:.2}", r.mib_per_token)),
        column("hit %", rows, |r| opt(r.hit_rate, |h| format!("{:.1}", 100.0 * h))),
        column("cgroup peak MiB", rows, |r| opt(r.cgroup_peak, |b| format!("{:.1}", mib(b)))),
        column("limit hits", rows, |r| opt(r.limit_hits, |h| h.to_string())),
    ]
}

/// The results as CSV (one header line, one record per configuration, quoted where a field needs
/// it; sizes in MiB); bounds as [`table`] has them.
pub fn csv(rows: &[BenchRow], ceiling: Option<f64>, compute: Option<f64>) -> String {
    const HEADER: [&str; 25] = [
        "config",
        "cache_mib",
        "tok_s",
        "x_mmap",
        "mib_per_token",
        "hit_rate",
        "major_faults",
        "peak_rss_mib",
        "cgroup_peak_mib",
        "limit_hits",
        "stall_ms_per_token",
        "read_mib_s",
        "share_of_ceiling",
        "io_bound_tok_s",
        "share_of_io_bound",
        "open_s",
        "ttft_s",
        "prefill_mib",
        "draft_accept",
        "top1_agreement",
        "mean_kl",
        "same_text",
        "compute_tok_s",
        "bound_tok_s",
        "share_of_bound",
    ];
    let base = rows.first().map_or(0.0, |r| r.tokens_per_s);
    let num = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
    let mut w = csv::Writer::from_writer(Vec::new());
    let records = std::iter::once(HEADER.map(String::from).to_vec()).chain(rows.iter().map(|r| {
        vec![
            r.label.clone(),
            num(r.cache_bytes.map(mib)),
            format!("{:.4}", r.tokens_per_s),
            format!("{:.4}", if base > 0.0 { r.tokens_per_s / base } else { 0.0 }),
            format!("{:.4}", r.mib_per_token),
            num(r.hit_rate),
            r.major_faults.to_string(),
            format!("{:.1}", mib(r.peak_rss)),
            num(r.cgroup_peak.map(mib)),
            r.limit_hits.map_or(String::new(), |h| h.to_string()),
            num(r.stall_ms),
            num(r.read_mib_s),
            num(r.read_mib_s.zip(ceiling).map(|(v, c)| v / c)),
            num(ceiling.and_then(|c| io_bound(r, c))),
            num(ceiling.and_then(|c| io_bound(r, c)).map(|b| r.tokens_per_s / b)),
            format!("{:.3}", r.open_s),
            format!("{:.3}", r.ttft_s),
            format!("{:.1}", mib(r.prefill_read)),
            num(r.draft_accept),
            num(r.lossy_quality.map(|q| q.top1)),
            num(r.lossy_quality.map(|q| q.mean_kl)),
            (r.tokens == rows[0].tokens).to_string(),
            num(compute),
            num(bound(r, ceiling, compute)),
            num(bound(r, ceiling, compute).map(|b| r.tokens_per_s / b)),
        ]
    }));
    for record in records {
        // Writing into memory cannot fail.
        let _ = w.write_record(&record);
    }
    w.into_inner().map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: &str, tokens_per_s: f64) -> BenchRow {
        BenchRow {
            label: label.into(),
            cache_bytes: Some(64 << 20),
            tokens_per_s,
            mib_per_token: 2.5,
            hit_rate: Some(0.5),
            major_faults: 3,
            peak_rss: 100 << 20,
            read_mib_s: Some(800.0),
            stall_ms: None,
            cgroup_peak: None,
            limit_hits: Some(0),
            open_s: 0.5,
            open_read: 0,
            ttft_s: 0.7,
            prefill_read: 96 << 20,
            draft_accept: Some(0.25),
            lossy_quality: None,
            tokens: vec![1, 2, 3],
        }
    }

    #[test]
    fn a_standard_reader_reads_the_bench_csv_back_field_for_field() {
        let rows = [row("resident-mmap", 2.0), row("streamed, no cache, serial", 5.0)];
        let text = csv(&rows, Some(1000.0), Some(4.0));
        let mut reader = ::csv::Reader::from_reader(text.as_bytes());
        let width = reader.headers().unwrap().len();
        assert_eq!(width, 25);
        let records: Vec<::csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        assert_eq!(records.len(), 2);
        assert!(records.iter().all(|r| r.len() == width), "{text}");
        assert_eq!(&records[1][0], "streamed, no cache, serial", "the comma-holding label is one field");
        assert_eq!(&records[1][3], "2.5000", "x_mmap against the first row");
        assert_eq!(&records[1][12], "0.8000", "share of the ceiling");
        assert_eq!(&records[1][13], "400.0000", "I/O bound: 1000 MiB/s over 2.5 MiB per token");
        assert_eq!(&records[1][14], "0.0125", "5 tok/s of the bound");
        assert_eq!(&records[1][17], "96.0", "prefill MiB");
        assert_eq!(&records[1][18], "0.2500", "draft acceptance");
        assert_eq!(&records[1][23], "4.0000", "the compute bound is below the I/O bound");
        assert_eq!(&records[0][23], "4.0000", "a row that read no experts is bound by compute");
        assert_eq!(&records[1][24], "1.2500");
        let text = table(&rows, Some(1000.0), Some(4.0));
        assert!(text.lines().next().is_some_and(|h| h.contains("% min(I/O, compute)")), "{text}");
    }
}
