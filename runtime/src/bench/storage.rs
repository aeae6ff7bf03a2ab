//! The storage under the benchmark: its ceiling (O_DIRECT reads of the model file from a cold
//! page cache, one reader and the profile's lanes) and the read sweep over lane counts and
//! request sizes.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sluice_hal::root::SysRoot;
use sluice_hal::storage::{measure_direct_read, ReadThroughput, StorageProbe};

use super::{drop_cached, BenchError};
use crate::board::ResolvedBoard;
use crate::stream::ExpertIndex;

/// The lane counts of the read sweep.
pub const SWEEP_LANES: [u32; 3] = [1, 2, 4];
/// The request sizes of the read sweep, bytes.
pub const SWEEP_REQUESTS: [u64; 4] = [128 << 10, 512 << 10, 1 << 20, 4 << 20];
/// How much of the file each point of the sweep reads (the whole file when smaller).
const SWEEP_LIMIT: u64 = 192 << 20;

/// One point of the read sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Parallel readers.
    pub lanes: u32,
    /// Request size, bytes.
    pub request: u64,
    /// Throughput, MiB/s.
    pub mib_s: f64,
}

/// The storage ceiling measured on the model file.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ceiling {
    /// One reader, requests of one expert slice: the reference for the streamer's reads.
    pub single_mib_s: f64,
    /// Its request size, bytes.
    pub single_request: u64,
    /// The profile's lanes and read size.
    pub lanes_mib_s: f64,
    /// Lanes.
    pub lanes: u32,
    /// Their request size, bytes.
    pub lanes_request: u64,
    /// Whether the reads bypassed the page cache.
    pub direct: bool,
}

/// The most of the file the ceiling reads (the whole file when smaller).
const CEILING_LIMIT: u64 = 4 << 30;

/// Reads the model's first file with one reader at the largest expert slice's size, then with
/// the profile's lanes and read size.
pub(super) fn ceiling(model: &Path, index: &ExpertIndex, board: &ResolvedBoard) -> Result<Ceiling, BenchError> {
    let page = ggml_sys::page_size();
    let slice = index.experts.iter().map(|t| t.stride.div_ceil(page) * page).max().unwrap_or(page);
    let single = cold_read(model, index, slice, 1, CEILING_LIMIT)?;
    let lanes = cold_read(model, index, board.read_bytes.value, board.lanes.value, CEILING_LIMIT)?;
    Ok(Ceiling {
        single_mib_s: single.mib_per_s(),
        single_request: slice,
        lanes_mib_s: lanes.mib_per_s(),
        lanes: board.lanes.value,
        lanes_request: board.read_bytes.value,
        direct: single.direct && lanes.direct,
    })
}

/// Reads the model's first file at every point of [`SWEEP_LANES`] × [`SWEEP_REQUESTS`], each
/// from a cold page cache.
pub(super) fn read_sweep(model: &Path, index: &ExpertIndex) -> Result<Vec<SweepPoint>, BenchError> {
    let mut points = Vec::new();
    for lanes in SWEEP_LANES {
        for request in SWEEP_REQUESTS {
            let t = cold_read(model, index, request, lanes, SWEEP_LIMIT)?;
            points.push(SweepPoint { lanes, request, mib_s: t.mib_per_s() });
        }
    }
    Ok(points)
}

/// Drops the model from the page cache, then reads up to `limit` bytes of its first file with
/// O_DIRECT in `request`-byte requests from `lanes` readers.
fn cold_read(
    model: &Path,
    index: &ExpertIndex,
    request: u64,
    lanes: u32,
    limit: u64,
) -> Result<ReadThroughput, BenchError> {
    let align = StorageProbe::for_file(&SysRoot::default(), model).map_or(4096, |s| s.direct_alignment()) as usize;
    drop_cached(&index.shards);
    measure_direct_read(model, request as usize, lanes as usize, align, limit)
        .map_err(|e| BenchError::Io(format!("reading {}", model.display()), e))
}

/// The read sweep as a table: a row per lane count, a column per request size, MiB/s.
pub fn sweep_table(points: &[SweepPoint]) -> String {
    let mut out = String::from("lanes");
    for r in SWEEP_REQUESTS {
        out.push_str(&format!("  {:>9}", format!("{} KiB", r >> 10)));
    }
    out.push('\n');
    for lanes in SWEEP_LANES {
        out.push_str(&format!("{lanes:>5}"));
        for r in SWEEP_REQUESTS {
            let cell = points
                .iter()
                .find(|p| p.lanes == lanes && p.request == r)
                .map_or("-".into(), |p| format!("{:.1}", p.mib_s));
            out.push_str(&format!("  {cell:>9}"));
        }
        out.push('\n');
    }
    out
}

/// The read sweep as CSV (`lanes,request_kib,mib_s`).
pub fn sweep_csv(points: &[SweepPoint]) -> String {
    let mut w = csv::Writer::from_writer(Vec::new());
    let _ = w.write_record(["lanes", "request_kib", "mib_s"]);
    for p in points {
        // Writing into memory cannot fail.
        let _ = w.write_record([p.lanes.to_string(), (p.request >> 10).to_string(), format!("{:.2}", p.mib_s)]);
    }
    w.into_inner().map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default()
}
