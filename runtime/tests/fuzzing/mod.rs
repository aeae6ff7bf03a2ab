//! What the fuzz tests share: a deterministic generator, a GGUF file taken apart and put back
//! together (so a mutation can change a value's type or length, or a tensor's type with its data
//! resized), and one run of `sluice` judged by how it ended.

#![allow(dead_code)]

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::common::sluice_command;

/// How long one run may take before it counts as a hang.
pub const HANG: Duration = Duration::from_secs(60);

/// A small deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// The generator of mutation `i` of a test (seeded apart from its neighbours).
    pub fn of(i: usize) -> Rng {
        Rng(0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9))
    }
}

/// How one run ended, and its standard output.
pub struct Run {
    pub outcome: &'static str,
    pub stdout: Vec<u8>,
}

/// Runs `sluice` with `args` (`M` stands for `path`).
pub fn run(path: &Path, args: &[&str]) -> Run {
    let out_file = tempfile::tempfile().unwrap();
    let mut child = sluice_command()
        .args(args.iter().map(|a| if *a == "M" { path.to_str().unwrap() } else { a }))
        .stdout(out_file.try_clone().unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            return Run { outcome: "hang", stdout: Vec::new() };
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let err = err_reader.join().unwrap();
    let mut stdout = Vec::new();
    let mut f = out_file;
    std::io::Seek::rewind(&mut f).unwrap();
    std::io::Read::read_to_end(&mut f, &mut stdout).unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    let outcome = if status.signal().is_some() {
        "signal"
    } else if err.contains("panicked") {
        "panic"
    } else if status.success() {
        "ok"
    } else if err.contains("error:") {
        "clean error"
    } else {
        "error without a message"
    };
    Run { outcome, stdout }
}

/// GGUF value types.
pub mod ty {
    pub const U8: u32 = 0;
    pub const U16: u32 = 2;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
}

/// A metadata value: its type and its bytes as stored (for an array: element type, count and
/// elements).
#[derive(Clone)]
pub struct Value {
    pub ty: u32,
    pub bytes: Vec<u8>,
}

impl Value {
    pub fn u32(v: u32) -> Value {
        Value { ty: ty::U32, bytes: v.to_le_bytes().to_vec() }
    }
    pub fn u16(v: u16) -> Value {
        Value { ty: ty::U16, bytes: v.to_le_bytes().to_vec() }
    }
    pub fn i32(v: i32) -> Value {
        Value { ty: ty::I32, bytes: v.to_le_bytes().to_vec() }
    }
    pub fn f32(v: f32) -> Value {
        Value { ty: ty::F32, bytes: v.to_le_bytes().to_vec() }
    }
    pub fn string(s: &str) -> Value {
        let mut bytes = (s.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(s.as_bytes());
        Value { ty: ty::STRING, bytes }
    }
    /// An array of `elem`-typed items, each given as its bytes.
    pub fn array(elem: u32, items: &[Vec<u8>]) -> Value {
        let mut bytes = elem.to_le_bytes().to_vec();
        bytes.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for i in items {
            bytes.extend_from_slice(i);
        }
        Value { ty: ty::ARRAY, bytes }
    }
    pub fn u32s(values: &[u32]) -> Value {
        Value::array(ty::U32, &values.iter().map(|v| v.to_le_bytes().to_vec()).collect::<Vec<_>>())
    }
    /// The integer a scalar holds.
    pub fn as_u64(&self) -> Option<u64> {
        match self.ty {
            ty::U8 => Some(self.bytes[0].into()),
            ty::U16 => Some(u16::from_le_bytes(self.bytes[..2].try_into().ok()?).into()),
            ty::U32 | ty::I32 => Some(u32::from_le_bytes(self.bytes[..4].try_into().ok()?).into()),
            10 | 11 => Some(u64::from_le_bytes(self.bytes[..8].try_into().ok()?)),
            _ => None,
        }
    }
}

/// One tensor: name, dims, type and data (and where the data was in the parsed file).
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub at: u64,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

/// (block size, bytes per block) of the ggml types the fuzz tests write.
pub fn type_size(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        8 => (32, 34),    // Q8_0
        12 => (256, 144), // Q4_K
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        30 => (1, 2),     // BF16
        39 => (32, 17),   // MXFP4
        _ => return None,
    })
}

/// A GGUF file taken apart.
#[derive(Clone)]
pub struct Gguf {
    pub version: u32,
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<Tensor>,
}

/// The little-endian u32 at `p`.
pub fn u32_at(b: &[u8], p: usize) -> u32 {
    u32::from_le_bytes(b[p..p + 4].try_into().unwrap())
}

/// The little-endian u64 at `p`.
pub fn u64_at(b: &[u8], p: usize) -> u64 {
    u64::from_le_bytes(b[p..p + 8].try_into().unwrap())
}

/// The offset after a value of type `ty` at `p`.
pub fn skip_value(b: &[u8], ty: u32, p: usize) -> usize {
    match ty {
        0 | 1 | 7 => p + 1,
        2 | 3 => p + 2,
        4..=6 => p + 4,
        10..=12 => p + 8,
        8 => p + 8 + u64_at(b, p) as usize,
        9 => {
            let (elem, n) = (u32_at(b, p), u64_at(b, p + 4));
            (0..n).fold(p + 12, |q, _| skip_value(b, elem, q))
        }
        _ => panic!("fixture has value type {ty}"),
    }
}

impl Gguf {
    pub fn parse(b: &[u8]) -> Gguf {
        let version = u32_at(b, 4);
        let (n_tensors, n_kv) = (u64_at(b, 8), u64_at(b, 16));
        let mut p = 24;
        let mut kvs = Vec::new();
        for _ in 0..n_kv {
            let len = u64_at(b, p) as usize;
            let key = String::from_utf8(b[p + 8..p + 8 + len].to_vec()).unwrap();
            let ty = u32_at(b, p + 8 + len);
            let start = p + 12 + len;
            p = skip_value(b, ty, start);
            kvs.push((key, Value { ty, bytes: b[start..p].to_vec() }));
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let len = u64_at(b, p) as usize;
            let name = String::from_utf8(b[p + 8..p + 8 + len].to_vec()).unwrap();
            p += 8 + len;
            let n_dims = u32_at(b, p) as usize;
            let dims: Vec<u64> = (0..n_dims).map(|i| u64_at(b, p + 4 + 8 * i)).collect();
            p += 4 + 8 * n_dims;
            let (ty, offset) = (u32_at(b, p), u64_at(b, p + 4));
            p += 12;
            infos.push((name, dims, ty, offset));
        }
        let mut g = Gguf { version, kvs, tensors: Vec::new() };
        let align = g.alignment();
        let data = p.div_ceil(align) * align;
        for (name, dims, ty, offset) in infos {
            let size = Gguf::nbytes(&dims, ty).unwrap() as usize;
            let at = data + offset as usize;
            g.tensors.push(Tensor { name, at: at as u64, dims, ty, data: b[at..at + size].to_vec() });
        }
        g
    }

    fn alignment(&self) -> usize {
        self.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize
    }

    /// Bytes of a tensor of `dims` and type `ty` (None for a row that is not whole blocks).
    pub fn nbytes(dims: &[u64], ty: u32) -> Option<u64> {
        let (block, size) = type_size(ty)?;
        if dims.first().is_some_and(|d| d % block != 0) {
            return None;
        }
        Some(dims.iter().product::<u64>() / block * size)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kvs.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Sets `key` (replaced where it is, else added).
    pub fn set(&mut self, key: &str, v: Value) {
        match self.kvs.iter_mut().find(|(k, _)| k == key) {
            Some((_, old)) => *old = v,
            None => self.kvs.push((key.to_string(), v)),
        }
    }

    /// The architecture's key `name`.
    pub fn arch_key(&self, name: &str) -> String {
        let arch = self.get("general.architecture").unwrap();
        format!("{}.{name}", String::from_utf8_lossy(&arch.bytes[8..]))
    }

    /// Sets tensor `i`'s type, its data cut or zero-padded to the new size.
    pub fn retype(&mut self, i: usize, ty: u32) {
        let t = &mut self.tensors[i];
        t.ty = ty;
        let size = Gguf::nbytes(&t.dims, ty).unwrap_or(0) as usize;
        t.data.resize(size, 0);
    }

    pub fn write(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            b.extend_from_slice(&(k.len() as u64).to_le_bytes());
            b.extend_from_slice(k.as_bytes());
            b.extend_from_slice(&v.ty.to_le_bytes());
            b.extend_from_slice(&v.bytes);
        }
        let align = self.alignment();
        let mut offset = 0u64;
        for t in &self.tensors {
            b.extend_from_slice(&(t.name.len() as u64).to_le_bytes());
            b.extend_from_slice(t.name.as_bytes());
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).div_ceil(align as u64) * align as u64;
        }
        b.resize(b.len().div_ceil(align) * align, 0);
        for t in &self.tensors {
            b.extend_from_slice(&t.data);
            b.resize(b.len().div_ceil(align) * align, 0);
        }
        b
    }
}
