//! Choosing a profile: `--board auto` (device tree and RAM), a built-in id, or a file.

use std::path::PathBuf;

use sluice_hal::board::BoardIdentity;

use super::profile::BoardProfile;
use super::{builtin, BoardError};

/// What `--board` asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BoardChoice {
    /// Detect from the device tree and RAM.
    Auto,
    /// A built-in profile by id.
    Id(String),
    /// A profile file.
    Path(PathBuf),
}

impl std::fmt::Display for BoardChoice {
    /// The choice as `--board` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BoardChoice::Auto => f.write_str("auto"),
            BoardChoice::Id(id) => f.write_str(id),
            BoardChoice::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

impl std::str::FromStr for BoardChoice {
    type Err = std::convert::Infallible;

    /// `auto`, a path (anything with a `/` or ending in `.toml`), or a built-in id.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(if s == "auto" {
            BoardChoice::Auto
        } else if s.contains('/') || s.ends_with(".toml") {
            BoardChoice::Path(s.into())
        } else {
            BoardChoice::Id(s.into())
        })
    }
}

/// A chosen profile, with where it came from and why.
#[derive(Debug, Clone)]
pub struct SelectedBoard {
    /// The profile's id (its file name without `.toml`).
    pub id: String,
    /// Where it was read from (`built-in` or the path).
    pub origin: String,
    /// Why it was chosen.
    pub reason: String,
    /// The profile.
    pub profile: BoardProfile,
}

/// Whether `MemTotal` fits a board sold with `ram_gib` GiB: above half of it and at most all
/// of it (the kernel and firmware keep some back).
fn ram_fits(ram_gib: u32, mem_total: u64) -> bool {
    let nominal = u64::from(ram_gib) << 30;
    mem_total > nominal / 2 && mem_total <= nominal
}

fn builtin_profile(id: &str) -> Result<BoardProfile, BoardError> {
    let text = builtin::text(id).ok_or_else(|| BoardError::UnknownId {
        id: id.into(),
        known: builtin::BUILTIN.iter().map(|(i, _)| *i).collect::<Vec<_>>().join(", "),
    })?;
    BoardProfile::parse(text, &format!("built-in profile {id}"))
}

/// Resolves `choice` against the probed identity.
pub fn select(choice: &BoardChoice, identity: &BoardIdentity) -> Result<SelectedBoard, BoardError> {
    match choice {
        BoardChoice::Id(id) => Ok(SelectedBoard {
            id: id.clone(),
            origin: "built-in".into(),
            reason: "named with --board".into(),
            profile: builtin_profile(id)?,
        }),
        BoardChoice::Path(path) => {
            let origin = path.display().to_string();
            let text = read_profile_file(path)?;
            Ok(SelectedBoard {
                id: path.file_stem().map_or_else(|| origin.clone(), |s| s.to_string_lossy().into_owned()),
                reason: "profile file given with --board".into(),
                profile: BoardProfile::parse(&text, &origin)?,
                origin,
            })
        }
        BoardChoice::Auto => detect(identity),
    }
}

/// `--board auto`: the first built-in profile one of whose `compatible` entries the device tree
/// lists and whose RAM size fits `MemTotal`; else `generic`.
fn detect(identity: &BoardIdentity) -> Result<SelectedBoard, BoardError> {
    let mut near_miss = None;
    for (id, _) in builtin::BUILTIN {
        let profile = builtin_profile(id)?;
        let Some(entry) = profile.identity.compatible.iter().find(|c| identity.is_compatible(c)) else { continue };
        let fits = match (profile.identity.ram_gib, identity.mem_total) {
            (Some(gib), Some(total)) => ram_fits(gib, total),
            (None, _) => true,
            (Some(_), None) => false,
        };
        if fits {
            let reason = format!(
                "device tree lists {entry:?}{}",
                match (profile.identity.ram_gib, identity.mem_total) {
                    (Some(gib), Some(total)) => format!(" and MemTotal {} MiB fits {gib} GiB", total >> 20),
                    _ => String::new(),
                }
            );
            return Ok(SelectedBoard { id: id.into(), origin: "built-in".into(), reason, profile });
        }
        near_miss.get_or_insert_with(|| entry.clone());
    }
    let reason = match (near_miss, &identity.model) {
        (Some(entry), _) => format!(
            "the device tree lists {entry:?} but MemTotal {} MiB fits none of its profiles",
            identity.mem_total.unwrap_or(0) >> 20
        ),
        (None, Some(model)) => format!("no profile matches the device tree ({model})"),
        (None, None) => "no device tree: not a known board".into(),
    };
    Ok(SelectedBoard { id: "generic".into(), origin: "built-in".into(), reason, profile: builtin_profile("generic")? })
}

/// The largest profile file read; profiles are a few hundred bytes.
const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// Reads a profile file: a regular file (a FIFO would block, a device read without end) of at
/// most [`MAX_PROFILE_BYTES`].
fn read_profile_file(path: &std::path::Path) -> Result<String, BoardError> {
    sluice_hal::file::read_regular_string(path, MAX_PROFILE_BYTES)
        .map_err(|e| BoardError::Read { path: path.to_path_buf(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_parses() {
        for (id, text) in builtin::BUILTIN {
            BoardProfile::parse(text, id).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
    }

    #[test]
    fn ram_sizes_tell_variants_apart() {
        let pi5 = |gib: u64| BoardIdentity {
            compatible: vec!["raspberrypi,5-model-b".into(), "brcm,bcm2712".into()],
            mem_total: Some(gib * (1 << 30) - (300 << 20)),
            ..Default::default()
        };
        assert_eq!(detect(&pi5(4)).unwrap().id, "rpi5-4gb");
        assert_eq!(detect(&pi5(8)).unwrap().id, "rpi5-8gb");
        assert_eq!(detect(&pi5(16)).unwrap().id, "rpi5-16gb");
        let odd = detect(&pi5(2)).unwrap();
        assert_eq!(odd.id, "generic");
        assert!(odd.reason.contains("fits none"), "{}", odd.reason);
        assert!("auto".parse::<BoardChoice>().unwrap() == BoardChoice::Auto);
        assert!(matches!("./x.toml".parse::<BoardChoice>().unwrap(), BoardChoice::Path(_)));
    }
}
