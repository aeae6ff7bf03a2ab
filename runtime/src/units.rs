//! Units for reports.

/// Bytes as MiB.
pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}
