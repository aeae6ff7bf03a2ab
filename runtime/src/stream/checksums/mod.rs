//! Checksums of a model's bytes, for storage that rots (SD cards, worn eMMC).
//!
//! `sluice verify MODEL` reads the whole model once and writes a sidecar beside it,
//! `MODEL.sluice-sums` (a [`crate::framed`] file, magic `SLUICEVS`): for every file of the model
//! its size and an xxh3-64 of its header (the bytes before the tensor data), and for every tensor
//! an xxh3-64 of each routed expert's slice (expert tensors) or of the whole tensor (the others).
//!
//! With `storage.verify = true` (`--verify`) a streamed run loads the sidecar
//! ([`ReadSums::load`]), which checks the files' sizes and headers at start, and each I/O lane
//! checks every expert slice and dense tensor it reads before the read counts as landed: damaged
//! bytes fail the read naming the expert or tensor, never reach a token. Experts the cache holds
//! are not read again, so not checked again. `sluice verify --check MODEL` re-reads everything
//! and lists what no longer matches.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ggml_sys::Reservation;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::framed::{self, FramedError};
use crate::stream::index::{DenseTensor, ExpertTensor};
use crate::stream::ExpertIndex;

pub mod streaming;

const MAGIC: &[u8; 8] = b"SLUICEVS";
/// The sidecar format version written; others are refused.
pub const VERSION: u32 = 1;
/// What `sluice verify` appends to the model's (first) file name.
pub const SUFFIX: &str = ".sluice-sums";
/// The largest sidecar read: 8 bytes a slice for ~1,000 layers of 1,024 experts, with room.
const MAX_FILE_BYTES: u64 = 256 << 20;
/// Bytes hashed per read while writing or checking a sidecar, and per copy in a lane.
const CHUNK: usize = 1 << 20;

/// The sidecar of the model whose (first) file is `model`.
pub fn sidecar_of(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(SUFFIX);
    s.into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SumsFile {
    version: u32,
    shards: Vec<ShardSum>,
    tensors: Vec<TensorSum>,
}

impl SumsFile {
    /// Writes this as the sidecar of `model`; the report of `bytes` summed.
    fn save(&self, model: &Path, bytes: u64) -> Result<Report, SumsError> {
        let sums = self.tensors.iter().map(|t| t.sums.len() as u64).sum();
        let sidecar = sidecar_of(model);
        framed::save(&sidecar, MAGIC, self).map_err(|source| SumsError::Io { path: sidecar, source })?;
        Ok(Report { bytes, sums, mismatches: Vec::new() })
    }
}

/// One file of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ShardSum {
    size: u64,
    /// Bytes before the tensor data.
    header_len: u64,
    header: u64,
}

/// One tensor: its place and a checksum per `slice` bytes (one per expert, or one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TensorSum {
    name: String,
    shard: u32,
    offset: u64,
    size: u64,
    slice: u64,
    sums: Vec<u64>,
}

impl TensorSum {
    /// An expert tensor: a checksum per expert slice (the stride), not yet computed.
    fn of_experts(t: &ExpertTensor) -> TensorSum {
        let (name, shard, offset, size) = (t.name.clone(), t.shard as u32, t.offset, t.size);
        TensorSum { name, shard, offset, size, slice: t.stride, sums: vec![0; t.n_expert as usize] }
    }

    /// Any other tensor: one checksum of it whole, not yet computed.
    fn whole(d: &DenseTensor) -> TensorSum {
        let (name, shard, offset, size) = (d.name.clone(), d.shard as u32, d.offset, d.size);
        TensorSum { name, shard, offset, size, slice: size, sums: vec![0] }
    }

    /// The sums of `experts` (one per expert) and of `dense` and `not_run` (one each, whole),
    /// in file order (shard, then offset).
    fn in_file_order(experts: &[ExpertTensor], dense: &[DenseTensor], not_run: &[DenseTensor]) -> Vec<TensorSum> {
        let mut tensors: Vec<TensorSum> = experts
            .iter()
            .map(TensorSum::of_experts)
            .chain(dense.iter().chain(not_run).map(TensorSum::whole))
            .collect();
        tensors.sort_by_key(|t| (t.shard, t.offset));
        tensors
    }

    /// Where it is and how it is cut: what must agree between the sidecar and the model.
    fn place(&self) -> (&str, u32, u64, u64, u64, usize) {
        (&self.name, self.shard, self.offset, self.size, self.slice, self.sums.len())
    }

    /// The byte ranges (absolute in its file) that `sums` cover.
    fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.sums.len() as u64).map(|i| {
            let from = self.offset + i * self.slice;
            (from, (from + self.slice).min(self.offset + self.size))
        })
    }
}

/// Why checksums could not be written, loaded or checked.
#[derive(Debug, thiserror::Error)]
pub enum SumsError {
    /// The model cannot be indexed.
    #[error(transparent)]
    Index(#[from] crate::stream::IndexError),
    /// A file cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// No sidecar.
    #[error("{sidecar} not found: --verify (storage.verify) checks reads against the checksums `sluice verify --model {model}` writes there; write them first, from a copy of the model you trust")]
    Missing {
        /// Where it was looked for.
        sidecar: PathBuf,
        /// The model.
        model: PathBuf,
    },
    /// The sidecar is damaged or not a sidecar.
    #[error("{path}: not a valid sluice checksum file ({why}); write it again with `sluice verify`")]
    Corrupt {
        /// The sidecar.
        path: PathBuf,
        /// What check failed.
        why: String,
    },
    /// The sidecar describes another model, or another version of this one.
    #[error("{path}: written for {what}; write it again with `sluice verify` if the model was replaced on purpose")]
    Foreign {
        /// The sidecar.
        path: PathBuf,
        /// How it differs.
        what: String,
    },
    /// A file's header no longer matches.
    #[error("{path}: its header (the first {len} bytes) does not match the checksum `sluice verify` recorded: the file changed since, or the storage returned damaged data")]
    Header {
        /// The model file.
        path: PathBuf,
        /// Header bytes.
        len: u64,
    },
}

/// What `sluice verify` wrote or checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Bytes read.
    pub bytes: u64,
    /// Checksums written or compared.
    pub sums: u64,
    /// What no longer matches (`--check`): `tensor NAME`, `expert E of tensor NAME`.
    pub mismatches: Vec<String>,
}

/// An xxh3-64 of `len` bytes of `file` from `offset`, read `CHUNK` bytes at a time into `buf`.
fn hash_file_range(file: &File, offset: u64, len: u64, buf: &mut [u8]) -> io::Result<u64> {
    let mut h = Xxh3::new();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], offset + done).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(e.kind(), format!("the file ends before byte {}", offset + len))
            } else {
                e
            }
        })?;
        h.update(&buf[..n]);
        done += n as u64;
    }
    Ok(h.digest())
}

/// The checksum of the tensor bytes `[from, to)` that a read landed in `r`; `None` when the
/// range is not inside the tensor.
pub fn sum_of_landed(r: &Reservation, from: u64, to: u64) -> Option<u64> {
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; (to.saturating_sub(from) as usize).min(CHUNK)];
    let mut at = from;
    while at < to {
        let n = (to - at).min(buf.len() as u64) as usize;
        if !r.copy_to(at, &mut buf[..n]) {
            return None;
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Some(h.digest())
}

/// Every tensor of `index` (streamed, dense and never run) with the bytes per checksum: the
/// expert stride for expert tensors, the whole tensor for the others; in file order.
fn layout(index: &ExpertIndex) -> Vec<TensorSum> {
    TensorSum::in_file_order(&index.experts, &index.dense, &index.not_run)
}

/// The size of the file at `path` and the checksum of its first `header_len` bytes.
fn shard_sum(path: &Path, header_len: u64, buf: &mut [u8]) -> Result<ShardSum, SumsError> {
    let io = |source| SumsError::Io { path: path.into(), source };
    let file = File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    Ok(ShardSum { size, header_len, header: hash_file_range(&file, 0, header_len, buf).map_err(io)? })
}

/// Each file's size and header checksum, its header being the bytes before its tensor data.
fn shard_sums(index: &ExpertIndex) -> Result<Vec<ShardSum>, SumsError> {
    let mut buf = vec![0u8; CHUNK];
    index
        .shards
        .iter()
        .map(|path| {
            let header_len = ggml_sys::GgufFile::open(path)
                .map_err(|e| SumsError::Io {
                    path: path.clone(),
                    source: io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
                })?
                .data_offset();
            shard_sum(path, header_len, &mut buf)
        })
        .collect()
}

/// Computes every tensor's checksums from the files. Returns the bytes read.
fn compute(index: &ExpertIndex, tensors: &mut [TensorSum]) -> Result<u64, SumsError> {
    let files = index
        .shards
        .iter()
        .map(|p| File::open(p).map_err(|source| SumsError::Io { path: p.clone(), source }))
        .collect::<Result<Vec<_>, _>>()?;
    let mut buf = vec![0u8; CHUNK];
    let mut bytes = 0;
    for t in tensors.iter_mut() {
        let path = &index.shards[t.shard as usize];
        let file = &files[t.shard as usize];
        let ranges: Vec<(u64, u64)> = t.ranges().collect();
        for (i, (from, to)) in ranges.into_iter().enumerate() {
            t.sums[i] = hash_file_range(file, from, to - from, &mut buf).map_err(|e| SumsError::Io {
                path: path.clone(),
                source: io::Error::new(e.kind(), format!("reading tensor {} at offset {from}: {e}", t.name)),
            })?;
            bytes += to - from;
        }
        // A scan of a model bigger than the board's memory should not push out what it runs.
        let _ = sluice_hal::storage::drop_cached_range(file, t.offset, t.size);
    }
    Ok(bytes)
}

/// `sluice verify MODEL`: reads every byte of the model's tensors and headers and writes the
/// sidecar ([`sidecar_of`]).
pub fn write(model: &Path) -> Result<Report, SumsError> {
    let index = ExpertIndex::open(model)?;
    let shards = shard_sums(&index)?;
    let mut tensors = layout(&index);
    let bytes = compute(&index, &mut tensors)?;
    SumsFile { version: VERSION, shards, tensors }.save(model, bytes)
}

/// `sluice verify --check MODEL`: re-reads the model and compares it with its sidecar.
pub fn check(model: &Path) -> Result<Report, SumsError> {
    let index = ExpertIndex::open(model)?;
    let (file, sidecar) = load_sidecar(model)?;
    let mut report = Report::default();
    match check_shards(&index, &file, &sidecar) {
        Err(SumsError::Header { path, .. }) => report.mismatches.push(format!("the header of {}", path.display())),
        other => other?,
    }
    let mut now = layout(&index);
    if now.len() != file.tensors.len() || now.iter().zip(&file.tensors).any(|(t, r)| t.place() != r.place()) {
        return Err(foreign(&sidecar, "a model with other tensors"));
    }
    report.bytes = compute(&index, &mut now)?;
    for (t, r) in now.iter().zip(&file.tensors) {
        report.sums += t.sums.len() as u64;
        for (i, _) in t.sums.iter().zip(&r.sums).enumerate().filter(|(_, (a, b))| a != b) {
            report.mismatches.push(if t.sums.len() > 1 {
                format!("expert {i} of tensor {}", t.name)
            } else {
                format!("tensor {}", t.name)
            });
        }
    }
    Ok(report)
}

fn foreign(sidecar: &Path, what: &str) -> SumsError {
    SumsError::Foreign { path: sidecar.into(), what: what.into() }
}

/// The sidecar of `model`, read and version-checked.
fn load_sidecar(model: &Path) -> Result<(SumsFile, PathBuf), SumsError> {
    let sidecar = sidecar_of(model);
    let file: SumsFile = match framed::load(&sidecar, MAGIC, MAX_FILE_BYTES) {
        Ok(f) => f,
        Err(FramedError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
            return Err(SumsError::Missing { sidecar, model: model.into() })
        }
        Err(FramedError::Io(source)) => return Err(SumsError::Io { path: sidecar, source }),
        Err(FramedError::Corrupt(why)) => return Err(SumsError::Corrupt { path: sidecar, why }),
    };
    if file.version != VERSION {
        return Err(foreign(&sidecar, &format!("sidecar format version {}", file.version)));
    }
    Ok((file, sidecar))
}

/// Checks that the model's files have the sizes and headers the sidecar recorded.
fn check_shards(index: &ExpertIndex, file: &SumsFile, sidecar: &Path) -> Result<(), SumsError> {
    if file.shards.len() != index.shards.len() {
        return Err(foreign(
            sidecar,
            &format!("a model of {} files (this one has {})", file.shards.len(), index.shards.len()),
        ));
    }
    let mut buf = vec![0u8; CHUNK];
    for (path, recorded) in index.shards.iter().zip(&file.shards) {
        let now = shard_sum(path, recorded.header_len, &mut buf)?;
        if now.size != recorded.size {
            return Err(foreign(
                sidecar,
                &format!("a {} of {} bytes (it has {})", path.display(), recorded.size, now.size),
            ));
        }
        if now.header != recorded.header {
            return Err(SumsError::Header { path: path.clone(), len: recorded.header_len });
        }
    }
    Ok(())
}

/// The checksums a streamed run checks its reads against.
#[derive(Debug)]
pub struct ReadSums {
    /// Per expert tensor of the index, one per expert.
    experts: Vec<Vec<u64>>,
    /// Per dense tensor of the index.
    dense: Vec<u64>,
}

impl ReadSums {
    /// Loads the sidecar of `index`'s model, checks the files' sizes and headers against it, and
    /// takes the checksums of `index`'s expert and dense tensors.
    pub fn load(index: &ExpertIndex) -> Result<ReadSums, SumsError> {
        let model = &index.shards[0];
        let (file, sidecar) = load_sidecar(model)?;
        check_shards(index, &file, &sidecar)?;
        let by_name: HashMap<&str, &TensorSum> = file.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let find = |want: TensorSum| {
            by_name.get(want.name.as_str()).filter(|r| r.place() == want.place()).map(|r| r.sums.clone()).ok_or_else(
                || foreign(&sidecar, &format!("a model whose tensor {} is elsewhere or another size", want.name)),
            )
        };
        let experts = index.experts.iter().map(|t| find(TensorSum::of_experts(t))).collect::<Result<_, _>>()?;
        let dense = index.dense.iter().map(|d| find(TensorSum::whole(d)).map(|s| s[0])).collect::<Result<_, _>>()?;
        Ok(ReadSums { experts, dense })
    }

    /// The checksum of expert `e`'s slice of expert tensor `k`.
    pub fn expert(&self, k: usize, e: u32) -> u64 {
        self.experts[k][e as usize]
    }

    /// The checksum of dense tensor `k`.
    pub fn dense(&self, k: usize) -> u64 {
        self.dense[k]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd as _;

    #[test]
    fn a_landed_range_hashes_as_the_file_bytes_do() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..3 * CHUNK + 4321).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = File::open(&path).unwrap();
        // A tensor at an odd offset, larger than one chunk.
        let (off, size) = (1000u64, (2 * CHUNK + 5000) as u64);
        let r = Reservation::new(off, size).unwrap();
        let (start, end) = r.window(0, size);
        r.read_window(file.as_fd(), start, (end - start) as usize).unwrap();
        let want = |from: u64, to: u64| xxhash_rust::xxh3::xxh3_64(&data[(off + from) as usize..(off + to) as usize]);
        assert_eq!(sum_of_landed(&r, 0, size), Some(want(0, size)));
        assert_eq!(sum_of_landed(&r, 3, CHUNK as u64 + 9), Some(want(3, CHUNK as u64 + 9)));
        assert_eq!(
            hash_file_range(&file, off + 3, CHUNK as u64 + 6, &mut [0; 4096]).unwrap(),
            want(3, CHUNK as u64 + 9)
        );
        assert_eq!(sum_of_landed(&r, 0, size + 1), None, "past the tensor");
        let e = hash_file_range(&file, data.len() as u64 - 10, 20, &mut [0; 64]).unwrap_err();
        assert!(e.to_string().contains("ends before byte"), "{e}");
    }
}
