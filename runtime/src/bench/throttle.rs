//! Board-class storage for the benchmark: the speed `sluice bench --storage-mbps` throttles the
//! model's disk to, by number or by the class of storage a board reads from.

use std::fmt;
use std::str::FromStr;

use sluice_hal::storage::Medium;

/// Classes of board storage and the sequential read speed each is benched at, MB/s (10^6 bytes
/// per second).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageClass {
    /// A Raspberry Pi's SD card (UHS-I, as a Pi 5 reads it): 85 MB/s.
    Sd,
    /// Soldered eMMC 5.1 (HS400 boards measure 250-300 MB/s sequential): 250 MB/s.
    Emmc,
    /// An NVMe SSD on a PCIe Gen2 x1 link (a Pi 5 HAT at its default speed): 400 MB/s.
    NvmeGen2,
    /// An NVMe SSD on a PCIe Gen3 x1 link (a Pi 5 HAT forced to Gen3, a Jetson's slot is faster
    /// still): 800 MB/s.
    NvmeGen3,
}

impl StorageClass {
    /// The names on the command line.
    pub const NAMES: [&'static str; 4] = ["sd", "emmc", "nvme-gen2", "nvme-gen3"];

    /// Read speed, MB/s.
    pub fn mbps(self) -> u64 {
        match self {
            StorageClass::Sd => 85,
            StorageClass::Emmc => 250,
            StorageClass::NvmeGen2 => 400,
            StorageClass::NvmeGen3 => 800,
        }
    }

    /// The class a profile's `storage.medium` stands for (NVMe: Gen2, the slower link a board is
    /// sold with), if it names one.
    pub fn of_medium(medium: Medium) -> Option<StorageClass> {
        match medium {
            Medium::Sd => Some(StorageClass::Sd),
            Medium::Emmc => Some(StorageClass::Emmc),
            Medium::Nvme => Some(StorageClass::NvmeGen2),
            Medium::Virtio | Medium::Other => None,
        }
    }

    fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// What `--storage-mbps` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageSpeed {
    /// A speed in MB/s.
    Mbps(u64),
    /// A storage class.
    Class(StorageClass),
    /// The class of the board profile's `storage.medium`.
    Board,
}

impl FromStr for StorageSpeed {
    type Err = String;

    fn from_str(s: &str) -> Result<StorageSpeed, String> {
        if s == "board" {
            return Ok(StorageSpeed::Board);
        }
        if let Some(i) = StorageClass::NAMES.iter().position(|n| *n == s) {
            let class = [StorageClass::Sd, StorageClass::Emmc, StorageClass::NvmeGen2, StorageClass::NvmeGen3][i];
            return Ok(StorageSpeed::Class(class));
        }
        match s.parse::<u64>() {
            Ok(n) if n > 0 => Ok(StorageSpeed::Mbps(n)),
            _ => Err(format!(
                "'{s}' is not a speed: give MB/s (a whole number above 0), one of {}, or board (the profile's storage.medium)",
                StorageClass::NAMES.join(", ")
            )),
        }
    }
}

impl fmt::Display for StorageSpeed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StorageSpeed::Mbps(n) => write!(f, "{n} MB/s"),
            StorageSpeed::Class(c) => write!(f, "{} MB/s ({})", c.mbps(), c.name()),
            StorageSpeed::Board => f.write_str("the board's storage"),
        }
    }
}

impl StorageSpeed {
    /// The speed as a class or number, the board's medium resolved (`None` when the profile
    /// names no medium a class stands for).
    pub fn resolve(self, medium: Option<Medium>) -> Option<StorageSpeed> {
        match self {
            StorageSpeed::Board => medium.and_then(StorageClass::of_medium).map(StorageSpeed::Class),
            other => Some(other),
        }
    }

    /// Bytes per second (a resolved speed; [`StorageSpeed::Board`] gives 0).
    pub fn bytes_per_s(self) -> u64 {
        match self {
            StorageSpeed::Mbps(n) => n.saturating_mul(1_000_000),
            StorageSpeed::Class(c) => c.mbps() * 1_000_000,
            StorageSpeed::Board => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeds_parse_by_number_class_and_board() {
        assert_eq!("85".parse(), Ok(StorageSpeed::Mbps(85)));
        assert_eq!("nvme-gen2".parse::<StorageSpeed>().unwrap().bytes_per_s(), 400_000_000);
        assert_eq!("sd".parse::<StorageSpeed>().unwrap().to_string(), "85 MB/s (sd)");
        let board: StorageSpeed = "board".parse().unwrap();
        assert_eq!(board.resolve(Some(Medium::Emmc)), Some(StorageSpeed::Class(StorageClass::Emmc)));
        assert_eq!(board.resolve(Some(Medium::Virtio)), None, "a VM's disk is no board class");
        assert_eq!(board.resolve(None), None);
        for bad in ["0", "-3", "fast", "8.5"] {
            let e = bad.parse::<StorageSpeed>().unwrap_err();
            assert!(e.contains(bad) && e.contains("nvme-gen3"), "{e}");
        }
    }
}
