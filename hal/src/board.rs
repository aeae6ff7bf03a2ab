//! Board identity: the device tree's model and `compatible` strings, RAM, and the Jetson
//! release file.

use crate::root::SysRoot;

/// What the board says it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BoardIdentity {
    /// `/proc/device-tree/model` (absent on most x86 machines).
    pub model: Option<String>,
    /// `/proc/device-tree/compatible`, most specific first.
    pub compatible: Vec<String>,
    /// `MemTotal` in bytes.
    pub mem_total: Option<u64>,
    /// The first line of `/etc/nv_tegra_release` (Jetson Linux release), if present.
    pub tegra_release: Option<String>,
}

impl BoardIdentity {
    /// Reads the identity under `root`.
    pub fn probe(root: &SysRoot) -> BoardIdentity {
        let compatible = std::fs::read(root.path("/proc/device-tree/compatible"))
            .map(|raw| {
                raw.split(|&b| b == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).trim().to_string())
                    .collect()
            })
            .unwrap_or_default();
        BoardIdentity {
            model: root.read("/proc/device-tree/model").filter(|m| !m.is_empty()),
            compatible,
            mem_total: crate::memory::meminfo(root, "MemTotal:"),
            tegra_release: root
                .read("/etc/nv_tegra_release")
                .and_then(|t| t.lines().next().map(|l| l.trim_start_matches('#').trim().to_string())),
        }
    }

    /// Whether the device tree lists `entry` among the compatible strings.
    pub fn is_compatible(&self, entry: &str) -> bool {
        self.compatible.iter().any(|c| c == entry)
    }
}
