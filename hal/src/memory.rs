//! Memory facts from `/proc/meminfo`.

/// Bytes of `MemAvailable` (what can be allocated without swapping), if the kernel reports it.
pub fn mem_available() -> Option<u64> {
    meminfo_field(&std::fs::read_to_string("/proc/meminfo").ok()?, "MemAvailable:")
}

/// Parses one `Key:   N kB` line of a meminfo text into bytes.
pub fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo_lines() {
        let text = "MemTotal:        8000000 kB\nMemAvailable:    6000000 kB\n";
        assert_eq!(meminfo_field(text, "MemAvailable:"), Some(6_000_000 * 1024));
        assert_eq!(meminfo_field(text, "SwapTotal:"), None);
        assert!(mem_available().unwrap() > 0);
    }
}
