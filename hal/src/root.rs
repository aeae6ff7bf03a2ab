//! The file-system root every probe reads under: `/` on a real board, a directory of small text
//! files in tests (a fake Raspberry Pi, a fake Jetson).

use std::path::{Path, PathBuf};

/// A root directory standing in for `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysRoot(PathBuf);

impl Default for SysRoot {
    fn default() -> Self {
        SysRoot(PathBuf::from("/"))
    }
}

impl SysRoot {
    /// A root at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> SysRoot {
        SysRoot(dir.into())
    }

    /// The directory standing in for `/`.
    pub fn dir(&self) -> &Path {
        &self.0
    }

    /// Whether this is the machine's real root.
    pub fn is_real(&self) -> bool {
        self.0 == Path::new("/")
    }

    /// `abs` (an absolute path such as `/proc/meminfo`) under this root.
    pub fn path(&self, abs: impl AsRef<Path>) -> PathBuf {
        let abs = abs.as_ref();
        self.0.join(abs.strip_prefix("/").unwrap_or(abs))
    }

    /// The text of `abs` with surrounding whitespace and NULs removed, if it can be read.
    pub fn read(&self, abs: impl AsRef<Path>) -> Option<String> {
        let text = std::fs::read(self.path(abs)).ok()?;
        let text = String::from_utf8_lossy(&text);
        Some(text.trim_matches(|c: char| c.is_whitespace() || c == '\0').to_string())
    }

    /// `abs` parsed as an unsigned number (decimal, or hexadecimal with `0x`).
    pub fn read_u64(&self, abs: impl AsRef<Path>) -> Option<u64> {
        let text = self.read(abs)?;
        match text.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => text.parse().ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_values_are_read_under_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = SysRoot::new(dir.path());
        std::fs::create_dir_all(root.path("/proc")).unwrap();
        std::fs::write(root.path("/proc/a"), "42\n").unwrap();
        std::fs::write(root.path("/proc/b"), "0x50005\0").unwrap();
        assert_eq!(root.read_u64("/proc/a"), Some(42));
        assert_eq!(root.read_u64("/proc/b"), Some(0x50005));
        assert_eq!(root.read("/proc/missing"), None);
        assert!(SysRoot::default().is_real() && !root.is_real());
    }
}
