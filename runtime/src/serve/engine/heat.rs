//! Warm restarts: the expert heat map (how often each layer's experts were routed), kept in the
//! state directory so the next start can fill the cache with the experts that will be wanted.
//!
//! File: a [`crate::framed`] file with the `SLUICEHM` magic and a [`HeatFile`] body (format
//! version, the model's identity, the counts). A file that fails any check is reported and not
//! used.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::framed::{self, FramedError};
use crate::stream::ExpertIndex;

const MAGIC: &[u8; 8] = b"SLUICEHM";
/// The format version written; files of another version are not used.
pub const VERSION: u32 = 1;
/// The state file's name inside the state directory.
pub const FILE_NAME: &str = "expert-heat.bin";
/// The largest heat map read: a count (at most 10 varint bytes) for each expert of the largest
/// models (~100 layers of ~512 experts), with room to spare.
const MAX_FILE_BYTES: u64 = 16 << 20;

/// Which model a heat map belongs to: its expert layout, so a map is never applied to another
/// model (or to the same name re-quantized).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// Layers with experts.
    pub n_layer: u32,
    /// Experts per layer.
    pub n_expert: u32,
    /// CRC-32 of every expert tensor's name, type, offset and size.
    pub layout_crc: u32,
}

impl ModelIdentity {
    /// The identity of the model `index` describes.
    pub fn of(index: &ExpertIndex) -> ModelIdentity {
        let mut h = crc32fast::Hasher::new();
        for t in &index.experts {
            h.update(t.name.as_bytes());
            h.update(format!(":{:?}:{}:{}:{};", t.ty, t.shard, t.offset, t.size).as_bytes());
        }
        ModelIdentity { n_layer: index.n_layer, n_expert: index.n_expert, layout_crc: h.finalize() }
    }
}

/// The saved state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeatFile {
    /// [`VERSION`] when written.
    pub version: u32,
    /// The model.
    pub model: ModelIdentity,
    /// Route counts, `layer * n_expert + expert`.
    pub counts: Vec<u64>,
}

/// Why a state file is not used.
#[derive(Debug, thiserror::Error)]
pub enum HeatError {
    /// It cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// It is not a sluice heat map, or it is damaged.
    #[error("{path}: not a valid sluice heat map ({why}); ignoring it, the cache starts cold")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What check failed.
        why: String,
    },
    /// It belongs to another model or format version.
    #[error("{path}: saved for {what}; ignoring it, the cache starts cold")]
    Foreign {
        /// The file.
        path: PathBuf,
        /// Whose it is.
        what: String,
    },
}

/// The state file in `dir`.
pub fn path_in(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

/// Reads the counts saved at `path` for `model`. `Ok(None)`: no file (a first start).
pub fn load(path: &Path, model: &ModelIdentity) -> Result<Option<Vec<u64>>, HeatError> {
    let file: HeatFile = match framed::load(path, MAGIC, MAX_FILE_BYTES) {
        Ok(f) => f,
        Err(FramedError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(FramedError::Io(source)) => return Err(HeatError::Io { path: path.into(), source }),
        Err(FramedError::Corrupt(why)) => return Err(HeatError::Corrupt { path: path.into(), why }),
    };
    if file.version != VERSION {
        return Err(HeatError::Foreign { path: path.into(), what: format!("format version {}", file.version) });
    }
    if &file.model != model {
        return Err(HeatError::Foreign {
            path: path.into(),
            what: format!(
                "another model ({} layers x {} experts, layout {:08x}; this one: {} x {}, {:08x})",
                file.model.n_layer,
                file.model.n_expert,
                file.model.layout_crc,
                model.n_layer,
                model.n_expert,
                model.layout_crc
            ),
        });
    }
    if file.counts.len() != (model.n_layer * model.n_expert) as usize {
        return Err(HeatError::Corrupt { path: path.into(), why: "count table of the wrong size".into() });
    }
    Ok(Some(file.counts))
}

/// Saves `counts` for `model` at `path` ([`framed::save`]: a crash leaves the old file or the new).
pub fn save(path: &Path, model: &ModelIdentity, counts: &[u64]) -> Result<(), HeatError> {
    let file = HeatFile { version: VERSION, model: model.clone(), counts: counts.to_vec() };
    framed::save(path, MAGIC, &file).map_err(|source| HeatError::Io { path: path.into(), source })
}

/// The experts worth reading at start, most routed first: `(layer, expert)` of every non-zero
/// count.
pub fn warm_order(counts: &[u64], n_expert: u32) -> Vec<(u32, u32)> {
    let mut order: Vec<(u64, u32)> =
        counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &c)| (c, i as u32)).collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    order.into_iter().map(|(_, i)| (i / n_expert, i % n_expert)).collect()
}

impl super::Engine<'_, '_> {
    /// Reads the saved heat map (if any) and fills the cache with its hottest experts.
    pub(super) fn warm_start(&mut self, index: &crate::stream::ExpertIndex) {
        let Some(path) = &self.heat_path else { return };
        let counts = match load(path, &self.identity) {
            Ok(Some(c)) => c,
            Ok(None) => {
                log::info!("no heat map at {}: the cache starts cold", path.display());
                return;
            }
            Err(e) => {
                log::warn!("{e}");
                return;
            }
        };
        self.shared.loading_step("pre-filling the expert cache from the saved heat map");
        let order = warm_order(&counts, index.n_expert);
        let mut streamer = self.session.streamer();
        streamer.add_heat(&counts);
        match streamer.prefill(&order) {
            Ok(p) => {
                log::info!(
                    "warm start: {} experts ({:.1} MiB) read from the heat map at {}",
                    p.experts,
                    crate::units::mib(p.bytes),
                    path.display()
                );
                self.shared.metrics.warm_start(p.bytes);
            }
            Err(e) => log::warn!("warm start stopped: {e}; serving with what was read"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> ModelIdentity {
        ModelIdentity { n_layer: 2, n_expert: 3, layout_crc: 0xabcd }
    }

    #[test]
    fn a_saved_map_loads_back_and_orders_the_hottest_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_in(dir.path());
        assert!(load(&path, &id()).unwrap().is_none());
        save(&path, &id(), &[0, 5, 1, 9, 0, 5]).unwrap();
        let counts = load(&path, &id()).unwrap().unwrap();
        assert_eq!(counts, [0, 5, 1, 9, 0, 5]);
        assert_eq!(warm_order(&counts, 3), [(1, 0), (0, 1), (1, 2), (0, 2)]);
        assert!(!dir.path().join("expert-heat.bin.tmp").exists());
    }

    #[test]
    fn damaged_and_foreign_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_in(dir.path());
        save(&path, &id(), &[1; 6]).unwrap();
        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        flipped[12] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        assert!(matches!(load(&path, &id()), Err(HeatError::Corrupt { .. })));
        std::fs::write(&path, b"garbage").unwrap();
        assert!(matches!(load(&path, &id()), Err(HeatError::Corrupt { .. })));
        std::fs::write(&path, &good).unwrap();
        let other = ModelIdentity { layout_crc: 1, ..id() };
        let e = load(&path, &other).unwrap_err();
        assert!(matches!(e, HeatError::Foreign { .. }), "{e}");
        assert!(e.to_string().contains("another model"), "{e}");
    }
}
