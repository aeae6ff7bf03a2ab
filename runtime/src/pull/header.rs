//! A model's GGUF headers fetched over HTTP alone (Range requests), so that a model is planned
//! against the board before its gigabytes are: each file's header is read until its tensor data
//! begins, and written into a file of the model file's size whose data part is a hole. Such a
//! copy is for metadata only (`sluice plan`): its tensor data reads as zeros and it is never run.

use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use super::http::Http;
use super::{Planned, PullError};

/// The first bytes asked for; doubled until the header is whole.
const FIRST_READ: u64 = 1 << 20;
/// The largest header read (a vocabulary of a few hundred thousand tokens takes a few MiB).
const MAX_HEADER: u64 = 256 << 20;

/// Why bytes are not a GGUF header.
#[derive(Debug, PartialEq, Eq)]
pub struct NotGguf(pub String);

/// Reads GGUF's little-endian fields from a prefix of a file.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: u64) -> Option<&[u8]> {
        let end = self.at.checked_add(usize::try_from(n).ok()?)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn string(&mut self) -> Option<&[u8]> {
        let n = self.u64()?;
        self.take(n)
    }

    /// Skips a value of GGUF type `ty`; its value when it is a u32 (for `general.alignment`).
    fn value(&mut self, ty: u32, depth: u32) -> Result<Option<Option<u32>>, NotGguf> {
        let fixed = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4 => return Ok(self.u32().map(Some)),
            5 | 6 => 4,
            10..=12 => 8,
            8 => return Ok(self.string().map(|_| None)),
            9 if depth == 0 => {
                let (Some(elem), Some(n)) = (self.u32(), self.u64()) else { return Ok(None) };
                for _ in 0..n {
                    if self.value(elem, depth + 1)?.is_none() {
                        return Ok(None);
                    }
                }
                return Ok(Some(None));
            }
            _ => return Err(NotGguf(format!("a metadata value of type {ty}"))),
        };
        Ok(self.take(fixed).map(|_| None))
    }
}

/// Where the tensor data of the GGUF file starting with `bytes` begins: `Ok(None)` when more of
/// the file is needed to tell.
pub fn data_offset(bytes: &[u8]) -> Result<Option<u64>, NotGguf> {
    let mut c = Cursor { bytes, at: 0 };
    let Some(magic) = c.take(4) else { return Ok(None) };
    if magic != b"GGUF" {
        return Err(NotGguf("no GGUF magic".into()));
    }
    let (Some(version), Some(n_tensors), Some(n_kv)) = (c.u32(), c.u64(), c.u64()) else { return Ok(None) };
    if !(2..=3).contains(&version) {
        return Err(NotGguf(format!("GGUF version {version}")));
    }
    let mut alignment = 32u64;
    for _ in 0..n_kv {
        let Some(key) = c.string().map(|k| k == b"general.alignment") else { return Ok(None) };
        let Some(ty) = c.u32() else { return Ok(None) };
        match c.value(ty, 0)? {
            None => return Ok(None),
            Some(Some(v)) if key => alignment = u64::from(v.max(1)),
            Some(_) => {}
        }
    }
    for _ in 0..n_tensors {
        let Some(_) = c.string() else { return Ok(None) };
        let Some(dims) = c.u32() else { return Ok(None) };
        if c.take(u64::from(dims) * 8 + 4 + 8).is_none() {
            return Ok(None);
        }
    }
    Ok(Some((c.at as u64).div_ceil(alignment) * alignment))
}

/// Copies of a model's GGUF headers in a folder of their own (removed when dropped).
pub struct HeaderCopy {
    /// The folder.
    pub dir: tempfile::TempDir,
    /// The copy of the model's first file.
    pub first: PathBuf,
    /// Bytes fetched.
    pub fetched: u64,
}

/// Fetches the headers of the GGUF files of `planned` into copies named as the files are.
pub fn fetch_headers(planned: &Planned, settings: &super::PullSettings) -> Result<HeaderCopy, PullError> {
    let http = Http::new(settings.stall);
    let dir = tempfile::Builder::new()
        .prefix("sluice-header-")
        .tempdir()
        .map_err(|source| PullError::Io { path: std::env::temp_dir(), source })?;
    let mut fetched = 0;
    let mut first = None;
    for f in planned.files.iter().filter(|f| f.gguf) {
        let name = Path::new(&f.label).file_name().map_or_else(|| "model.gguf".into(), |n| n.to_owned());
        let mut path = dir.path().join(name);
        if path.extension().is_none() {
            path.set_extension("gguf");
        }
        let bytes = header(&http, planned, f)?;
        fetched += bytes.len() as u64;
        let io = |source| PullError::Io { path: path.clone(), source };
        let file = File::create(&path).map_err(io)?;
        file.set_len(f.size).map_err(io)?;
        file.write_all_at(&bytes, 0).map_err(io)?;
        first.get_or_insert(path);
    }
    let first =
        first.ok_or_else(|| PullError::Broken { url: planned.name.to_string(), why: "no GGUF file to plan".into() })?;
    Ok(HeaderCopy { dir, first, fetched })
}

/// The header of one file: its first bytes, more each time until the tensor data begins.
fn header(http: &Http, planned: &Planned, f: &super::PlannedFile) -> Result<Vec<u8>, PullError> {
    let mut want = FIRST_READ.min(f.size);
    loop {
        let (bytes, at) =
            http.bytes(&f.url, Some((0, want.max(1) - 1)), None, planned.token.as_ref(), &f.label, want)?;
        let broken = |why: String| PullError::Broken { url: at.clone(), why: format!("{}: {why}", f.label) };
        match data_offset(&bytes).map_err(|e| broken(e.0))? {
            Some(end) => return Ok(bytes[..(end as usize).min(bytes.len())].to_vec()),
            None if want >= f.size.min(MAX_HEADER) => {
                return Err(broken(format!("its header does not end within {} bytes", bytes.len())))
            }
            None => want = (want * 4).min(f.size).min(MAX_HEADER),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gguf(kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, u32)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (k, ty, v) in kv {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        for (name, dims) in tensors {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(dims.to_le_bytes());
            for _ in 0..*dims {
                b.extend(4u64.to_le_bytes());
            }
            b.extend(0u32.to_le_bytes());
            b.extend(0u64.to_le_bytes());
        }
        b
    }

    #[test]
    fn the_data_offset_is_the_aligned_end_of_the_header_and_a_prefix_asks_for_more() {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend(2u64.to_le_bytes());
        for s in ["a", "bc"] {
            arr.extend((s.len() as u64).to_le_bytes());
            arr.extend(s.as_bytes());
        }
        let kv = [("general.alignment", 4u32, 64u32.to_le_bytes().to_vec()), ("tokens", 9, arr)];
        let b = gguf(&kv, &[("t", 2)]);
        assert_eq!(data_offset(&b), Ok(Some((b.len() as u64).div_ceil(64) * 64)));
        for cut in [0, 3, 10, 30, b.len() - 1] {
            assert_eq!(data_offset(&b[..cut]), Ok(None), "cut at {cut}");
        }
        assert!(data_offset(b"GGML....").is_err());
        let plain = gguf(&[], &[]);
        assert_eq!(data_offset(&plain), Ok(Some(32)));
    }
}
