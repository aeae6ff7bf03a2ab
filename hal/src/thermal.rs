//! Thermal state: zone temperatures, and a Raspberry Pi's firmware throttle flags.

use crate::root::SysRoot;

/// One thermal zone.
#[derive(Debug, Clone, PartialEq)]
pub struct ThermalZone {
    /// The zone's type (`cpu-thermal`, `gpu-thermal`, ...).
    pub kind: String,
    /// Temperature, °C.
    pub celsius: f64,
}

/// A Raspberry Pi's `get_throttled` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled(pub u32);

impl Throttled {
    const NAMES: [(u32, &'static str); 8] = [
        (0, "under-voltage now"),
        (1, "ARM frequency capped now"),
        (2, "throttled now"),
        (3, "soft temperature limit now"),
        (16, "under-voltage has occurred"),
        (17, "ARM frequency capping has occurred"),
        (18, "throttling has occurred"),
        (19, "soft temperature limit has occurred"),
    ];

    /// The conditions set, in words (empty when none).
    pub fn conditions(self) -> Vec<&'static str> {
        Self::NAMES.iter().filter(|(bit, _)| self.0 & (1 << bit) != 0).map(|(_, n)| *n).collect()
    }
}

/// The thermal picture of the board.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ThermalProbe {
    /// Every readable zone, in zone order.
    pub zones: Vec<ThermalZone>,
    /// The Pi firmware's throttle flags, where the board has them.
    pub throttled: Option<Throttled>,
}

impl ThermalProbe {
    /// Reads thermal state under `root`.
    pub fn probe(root: &SysRoot) -> ThermalProbe {
        let mut numbered: Vec<(u32, ThermalZone)> = std::fs::read_dir(root.path("/sys/class/thermal"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let n: u32 = name.strip_prefix("thermal_zone")?.parse().ok()?;
                let dir = format!("/sys/class/thermal/{name}");
                let milli: i64 = root.read(format!("{dir}/temp"))?.parse().ok()?;
                let kind = root.read(format!("{dir}/type")).unwrap_or_else(|| name.clone());
                Some((n, ThermalZone { kind, celsius: milli as f64 / 1000.0 }))
            })
            .collect();
        numbered.sort_by_key(|(n, _)| *n);
        ThermalProbe {
            zones: numbered.into_iter().map(|(_, z)| z).collect(),
            throttled: root
                .read_u64("/sys/devices/platform/soc/soc:firmware/get_throttled")
                .map(|v| Throttled(v as u32)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_bits_are_named() {
        assert_eq!(
            Throttled(0x50005).conditions(),
            ["under-voltage now", "throttled now", "under-voltage has occurred", "throttling has occurred"]
        );
        assert!(Throttled(0).conditions().is_empty());
    }
}
