//! The sidecar computed from a model's bytes as they arrive, file by file and in order
//! (`sluice pull` writes it in the pass that checks the download's digest, so `--verify` needs no
//! second read of the model): the same file `sluice verify` writes from the finished model.

use std::path::Path;

use ggml_sys::GgufFile;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use super::{Report, ShardSum, SumsError, SumsFile, TensorSum, VERSION};
use crate::stream::index::Classifier;

/// The sidecar of a model being received: each file's sums are added as its [`ShardHasher`]
/// finishes, first file first.
#[derive(Debug)]
pub struct SumsBuilder {
    classifier: Classifier,
    shards: Vec<ShardSum>,
    tensors: Vec<TensorSum>,
}

impl SumsBuilder {
    /// A builder for the model whose first file's header is `first` (at `path`); an error when
    /// the model has no routed experts or its counts are unreadable.
    pub fn new(path: &Path, first: &GgufFile) -> Result<SumsBuilder, SumsError> {
        let (classifier, _) = Classifier::of_first(path, first)?;
        Ok(SumsBuilder { classifier, shards: Vec::new(), tensors: Vec::new() })
    }

    /// A hasher for the model's next file, whose header is `g` and whose size is `size`.
    pub fn next_shard(&self, g: &GgufFile, size: u64) -> ShardHasher {
        let shard = self.shards.len();
        let tensors = self.classifier.shard(g, shard);
        let sums = TensorSum::in_file_order(&tensors.experts, &tensors.dense, &tensors.not_run);
        let ranges = sums
            .iter()
            .enumerate()
            .flat_map(|(t, s)| {
                s.ranges().enumerate().map(move |(i, (from, to))| Range { from, to, tensor: t, slice: i })
            })
            .collect();
        ShardHasher {
            size,
            header_len: g.data_offset(),
            header: None,
            header_hash: Xxh3::new(),
            tensors: sums,
            ranges,
            next: 0,
            open: None,
            pos: 0,
        }
    }

    /// Adds the sums of the file [`SumsBuilder::next_shard`] last made a hasher for.
    pub fn push(&mut self, done: FinishedShard) {
        self.shards.push(done.shard);
        self.tensors.extend(done.tensors);
    }

    /// Writes the sidecar of `model` (the model's first file, where it now is).
    pub fn save(self, model: &Path) -> Result<Report, SumsError> {
        let bytes = self.tensors.iter().map(|t| t.size).sum();
        SumsFile { version: VERSION, shards: self.shards, tensors: self.tensors }.save(model, bytes)
    }
}

/// One checksum's byte range in the file.
#[derive(Debug, Clone, Copy)]
struct Range {
    from: u64,
    to: u64,
    tensor: usize,
    slice: usize,
}

/// The sums of one file, fed its bytes in order.
pub struct ShardHasher {
    size: u64,
    header_len: u64,
    header: Option<u64>,
    header_hash: Xxh3,
    tensors: Vec<TensorSum>,
    ranges: Vec<Range>,
    /// The first range not yet summed.
    next: usize,
    /// The sum of `ranges[next]` while its bytes come.
    open: Option<Xxh3>,
    /// The bytes fed so far.
    pos: u64,
}

impl std::fmt::Debug for ShardHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardHasher")
            .field("size", &self.size)
            .field("pos", &self.pos)
            .field("next", &self.next)
            .finish()
    }
}

/// What a [`ShardHasher`] has done, saved where no range is half summed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardCheckpoint {
    pos: u64,
    header: Option<u64>,
    /// The sums of the ranges before `pos`, in file order.
    sums: Vec<u64>,
}

/// A file's sums, complete.
#[derive(Debug)]
pub struct FinishedShard {
    shard: ShardSum,
    tensors: Vec<TensorSum>,
}

impl ShardHasher {
    /// The bytes fed so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Where the next checkpoint is possible: the end of the sum being fed (the header's or a
    /// range's), or here when none is.
    pub fn next_cut(&self) -> u64 {
        if self.pos > 0 && self.pos < self.header_len {
            return self.header_len;
        }
        match (&self.open, self.ranges.get(self.next)) {
            (Some(_), Some(r)) => r.to,
            _ => self.pos,
        }
    }

    /// Feeds the file's next bytes.
    pub fn update(&mut self, data: &[u8]) {
        let end = self.pos + data.len() as u64;
        let mut at = self.pos;
        let bytes = |from: u64, to: u64| &data[(from - self.pos) as usize..(to - self.pos) as usize];
        while at < end {
            if at < self.header_len {
                let to = end.min(self.header_len);
                self.header_hash.update(bytes(at, to));
                at = to;
                if at == self.header_len {
                    self.header = Some(self.header_hash.digest());
                }
            } else if let Some(r) = self.ranges.get(self.next).copied() {
                if at < r.from {
                    at = end.min(r.from);
                    continue;
                }
                let to = end.min(r.to);
                self.open.get_or_insert_with(Xxh3::new).update(bytes(at, to));
                at = to;
                if at == r.to {
                    let sum = self.open.take().map(|h| h.digest()).unwrap_or_default();
                    self.tensors[r.tensor].sums[r.slice] = sum;
                    self.next += 1;
                }
            } else {
                at = end;
            }
        }
        self.pos = end;
    }

    /// The state to take up again after a restart, where no range is half summed (`None`
    /// while one is).
    pub fn checkpoint(&self) -> Option<ShardCheckpoint> {
        let in_header = self.pos > 0 && self.pos < self.header_len;
        (self.open.is_none() && !in_header).then(|| ShardCheckpoint {
            pos: self.pos,
            header: self.header,
            sums: self.ranges[..self.next].iter().map(|r| self.tensors[r.tensor].sums[r.slice]).collect(),
        })
    }

    /// Takes up `cp`, saved from a hasher of the same file; false (and nothing changed) when it
    /// cannot be this file's.
    pub fn resume(&mut self, cp: &ShardCheckpoint) -> bool {
        let next = cp.sums.len();
        let fits = next <= self.ranges.len()
            && cp.pos <= self.size
            && (cp.pos == 0 || cp.pos >= self.header_len)
            && cp.header.is_some() == (cp.pos >= self.header_len && self.header_len > 0)
            && self.ranges.get(next).is_none_or(|r| cp.pos <= r.from)
            && (next == 0 || self.ranges[next - 1].to <= cp.pos);
        if !fits {
            return false;
        }
        for (r, &sum) in self.ranges[..next].iter().zip(&cp.sums) {
            self.tensors[r.tensor].sums[r.slice] = sum;
        }
        (self.pos, self.header, self.next, self.open) = (cp.pos, cp.header, next, None);
        true
    }

    /// The file's sums, once all of its bytes were fed; `None` before.
    pub fn finish(self) -> Option<FinishedShard> {
        let whole = self.pos == self.size && self.next == self.ranges.len();
        let header = self.header.filter(|_| whole)?;
        Some(FinishedShard {
            shard: ShardSum { size: self.size, header_len: self.header_len, header },
            tensors: self.tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_inside_a_range_is_refused() {
        let cp = ShardCheckpoint { pos: 5, header: None, sums: vec![] };
        let mut h = ShardHasher {
            size: 100,
            header_len: 10,
            header: None,
            header_hash: Xxh3::new(),
            tensors: vec![],
            ranges: vec![],
            next: 0,
            open: None,
            pos: 0,
        };
        assert!(!h.resume(&cp), "inside the header");
        assert_eq!(h.position(), 0);
        assert!(h.resume(&ShardCheckpoint { pos: 0, header: None, sums: vec![] }));
    }
}
