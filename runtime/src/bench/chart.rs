//! The benchmark's chart: decode tokens per second by configuration, as a self-contained SVG
//! bar chart (plain markup, viewable in any browser).

use std::fmt::Write as _;

use super::BenchRow;

/// Escapes text for SVG character data.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A horizontal bar per row (tok/s, with the ratio to the first row), titled `title`.
pub fn svg_bar_chart(rows: &[BenchRow], title: &str) -> String {
    let (label_w, bar_w, row_h, top) = (220.0, 460.0, 34.0, 56.0);
    let width = label_w + bar_w + 140.0;
    let height = top + row_h * rows.len() as f64 + 30.0;
    let max = rows.iter().map(|r| r.tokens_per_s).fold(0.0f64, f64::max).max(f64::MIN_POSITIVE);
    let base = rows.first().map_or(0.0, |r| r.tokens_per_s);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"13\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"12\" y=\"24\" font-size=\"16\" font-weight=\"bold\">{}</text>\n\
         <text x=\"12\" y=\"42\" fill=\"#555\">decode tokens/s (higher is better); ratio to {}</text>\n",
        escape(title),
        escape(rows.first().map_or("-", |r| r.label.as_str()))
    );
    for (i, r) in rows.iter().enumerate() {
        let y = top + row_h * i as f64;
        let w = (bar_w * r.tokens_per_s / max).max(1.0);
        let fill = if i == 0 { "#9e9e9e" } else { "#2e7d32" };
        let ratio = if base > 0.0 { r.tokens_per_s / base } else { 0.0 };
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n\
             <rect x=\"{label_w}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"{:.1}\" fill=\"{fill}\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\">{:.2} tok/s ({ratio:.1}x)</text>",
            label_w - 8.0,
            y + row_h * 0.6,
            escape(&r.label),
            y + 6.0,
            row_h - 12.0,
            label_w + w + 6.0,
            y + row_h * 0.6,
            r.tokens_per_s
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: &str, tps: f64) -> BenchRow {
        BenchRow {
            label: label.into(),
            cache_bytes: None,
            tokens_per_s: tps,
            mib_per_token: 0.0,
            hit_rate: None,
            major_faults: 0,
            peak_rss: 0,
            read_mib_s: None,
            stall_ms: None,
            cgroup_peak: None,
            limit_hits: None,
            open_s: 0.0,
            open_read: 0,
            ttft_s: 0.0,
            prefill_read: 0,
            draft_accept: None,
            lossy_quality: None,
            tokens: Vec::new(),
        }
    }

    #[test]
    fn one_bar_per_row_scaled_to_the_fastest() {
        let svg = svg_bar_chart(&[row("resident-mmap", 1.0), row("streamed <auto>", 10.0)], "t & t");
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<rect x=").count(), 2);
        assert!(svg.contains("width=\"460.0\"") && svg.contains("width=\"46.0\""), "{svg}");
        assert!(svg.contains("streamed &lt;auto&gt;") && svg.contains("t &amp; t") && svg.contains("(10.0x)"));
    }
}
