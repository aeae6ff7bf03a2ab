//! Units for reports.

/// Bytes as MiB.
pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// `part` as a share of `part + rest` (0 when both are 0).
pub fn share(part: u64, rest: u64) -> f64 {
    let total = part + rest;
    if total == 0 {
        0.0
    } else {
        part as f64 / total as f64
    }
}
