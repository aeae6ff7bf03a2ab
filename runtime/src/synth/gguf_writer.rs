//! A streaming GGUF (version 3) writer.
//!
//! The header, metadata and tensor table are written first; tensor data then follows in the
//! declared order, one tensor at a time, so a model of many GiB is never held in memory. The
//! writer checks that each tensor receives exactly the bytes its table entry promised.

use std::fs::File;
use std::io::{self, BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const GGUF_VERSION: u32 = 3;

/// A metadata value, in the GGUF value types the generator needs.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `GGUF_TYPE_UINT32`
    U32(u32),
    /// `GGUF_TYPE_UINT16`
    U16(u16),
    /// `GGUF_TYPE_INT32`
    I32(i32),
    /// `GGUF_TYPE_FLOAT32`
    F32(f32),
    /// `GGUF_TYPE_BOOL`
    Bool(bool),
    /// `GGUF_TYPE_STRING`
    Str(String),
    /// `GGUF_TYPE_ARRAY` of strings
    StrArray(Vec<String>),
    /// `GGUF_TYPE_ARRAY` of f32
    F32Array(Vec<f32>),
    /// `GGUF_TYPE_ARRAY` of i32
    I32Array(Vec<i32>),
}

const TYPE_UINT16: u32 = 2;
const TYPE_UINT32: u32 = 4;
const TYPE_INT32: u32 = 5;
const TYPE_FLOAT32: u32 = 6;
const TYPE_BOOL: u32 = 7;
const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;

/// The element type of a tensor written by the generator (ggml's type numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    /// `GGML_TYPE_F32`
    F32,
    /// `GGML_TYPE_F16`
    F16,
    /// `GGML_TYPE_Q4_K`: blocks of 256 in 144 bytes.
    Q4K,
    /// `GGML_TYPE_Q6_K`: blocks of 256 in 210 bytes.
    Q6K,
    /// `GGML_TYPE_Q5_0`: blocks of 32 in 22 bytes.
    Q5_0,
    /// `GGML_TYPE_Q8_0`: blocks of 32 in 34 bytes.
    Q8_0,
    /// `GGML_TYPE_MXFP4`: blocks of 32 in 17 bytes.
    Mxfp4,
}

impl TensorType {
    /// ggml's number for this type.
    fn ggml_id(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q4K => 12,
            TensorType::Q6K => 14,
            TensorType::Q5_0 => 6,
            TensorType::Q8_0 => 8,
            TensorType::Mxfp4 => 39,
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elements(self) -> u64 {
        match self {
            TensorType::F32 | TensorType::F16 => 1,
            TensorType::Q4K | TensorType::Q6K => 256,
            TensorType::Q5_0 | TensorType::Q8_0 | TensorType::Mxfp4 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            TensorType::F32 => 4,
            TensorType::F16 => 2,
            TensorType::Q4K => 144,
            TensorType::Q6K => 210,
            TensorType::Q5_0 => 22,
            TensorType::Q8_0 => 34,
            TensorType::Mxfp4 => 17,
        }
    }
}

/// One tensor's entry in the table: its name, shape (ggml order, `ne[0]` first) and type.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Tensor name, e.g. `blk.0.ffn_up_exps.weight`.
    pub name: String,
    /// Shape in ggml order.
    pub ne: Vec<u64>,
    /// Element type.
    pub ty: TensorType,
}

impl TensorSpec {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Size of the tensor's data in bytes.
    pub fn n_bytes(&self) -> u64 {
        self.n_elements() / self.ty.block_elements() * self.ty.block_bytes()
    }
}

/// Errors of the writer.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The file could not be created or written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file being written.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The data producer gave a tensor a different number of bytes than its table entry.
    #[error("tensor {name}: {got} bytes written, {want} declared")]
    SizeMismatch {
        /// The tensor.
        name: String,
        /// Bytes received.
        got: u64,
        /// Bytes declared.
        want: u64,
    },
    /// The alignment is not a power of two of at least 8 bytes.
    #[error("tensor alignment {0} is not a power of two >= 8")]
    BadAlignment(u64),
}

fn align_up(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment) * alignment
}

/// Writes one GGUF file: metadata, tensor table, then each tensor's bytes through a callback.
pub struct GgufWriter {
    path: PathBuf,
    out: BufWriter<File>,
    alignment: u64,
    written: u64,
}

impl GgufWriter {
    /// Creates `path` and writes the header, the metadata and the table of `tensors`, with each
    /// tensor's data offset aligned to `alignment` bytes.
    pub fn create(
        path: &Path,
        metadata: &[(String, Value)],
        tensors: &[TensorSpec],
        alignment: u64,
    ) -> Result<Self, WriteError> {
        if alignment < 8 || !alignment.is_power_of_two() {
            return Err(WriteError::BadAlignment(alignment));
        }
        let io_err = |source| WriteError::Io { path: path.to_path_buf(), source };
        let file = File::create(path).map_err(io_err)?;
        let mut w = GgufWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, file),
            alignment,
            written: 0,
        };
        w.write_header(metadata, tensors).map_err(io_err)?;
        Ok(w)
    }

    fn write_header(&mut self, metadata: &[(String, Value)], tensors: &[TensorSpec]) -> io::Result<()> {
        self.put(GGUF_MAGIC)?;
        self.put(&GGUF_VERSION.to_le_bytes())?;
        self.put(&(tensors.len() as u64).to_le_bytes())?;
        self.put(&(metadata.len() as u64).to_le_bytes())?;
        for (key, value) in metadata {
            self.put_str(key)?;
            self.put_value(value)?;
        }
        let mut offset = 0u64;
        for t in tensors {
            self.put_str(&t.name)?;
            self.put(&(t.ne.len() as u32).to_le_bytes())?;
            for d in &t.ne {
                self.put(&d.to_le_bytes())?;
            }
            self.put(&t.ty.ggml_id().to_le_bytes())?;
            self.put(&offset.to_le_bytes())?;
            offset = align_up(offset + t.n_bytes(), self.alignment);
        }
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn put_str(&mut self, s: &str) -> io::Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn put_value(&mut self, value: &Value) -> io::Result<()> {
        match value {
            Value::U32(v) => {
                self.put(&TYPE_UINT32.to_le_bytes())?;
                self.put(&v.to_le_bytes())
            }
            Value::U16(v) => {
                self.put(&TYPE_UINT16.to_le_bytes())?;
                self.put(&v.to_le_bytes())
            }
            Value::I32(v) => {
                self.put(&TYPE_INT32.to_le_bytes())?;
                self.put(&v.to_le_bytes())
            }
            Value::F32(v) => {
                self.put(&TYPE_FLOAT32.to_le_bytes())?;
                self.put(&v.to_le_bytes())
            }
            Value::Bool(v) => {
                self.put(&TYPE_BOOL.to_le_bytes())?;
                self.put(&[u8::from(*v)])
            }
            Value::Str(s) => {
                self.put(&TYPE_STRING.to_le_bytes())?;
                self.put_str(s)
            }
            Value::StrArray(items) => {
                self.put_array_header(TYPE_STRING, items.len())?;
                items.iter().try_for_each(|s| self.put_str(s))
            }
            Value::F32Array(items) => {
                self.put_array_header(TYPE_FLOAT32, items.len())?;
                items.iter().try_for_each(|v| self.put(&v.to_le_bytes()))
            }
            Value::I32Array(items) => {
                self.put_array_header(TYPE_INT32, items.len())?;
                items.iter().try_for_each(|v| self.put(&v.to_le_bytes()))
            }
        }
    }

    fn put_array_header(&mut self, elem_type: u32, len: usize) -> io::Result<()> {
        self.put(&TYPE_ARRAY.to_le_bytes())?;
        self.put(&elem_type.to_le_bytes())?;
        self.put(&(len as u64).to_le_bytes())
    }

    fn pad(&mut self) -> io::Result<()> {
        let target = align_up(self.written, self.alignment);
        let zeros = vec![0u8; (target - self.written) as usize];
        self.put(&zeros)
    }

    /// Writes the data of the next tensor in table order. `fill` is called with a sink and must
    /// write exactly `spec.n_bytes()` bytes into it.
    pub fn write_tensor(
        &mut self,
        spec: &TensorSpec,
        fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
    ) -> Result<(), WriteError> {
        let start = self.written;
        let io_err = |source| WriteError::Io { path: self.path.clone(), source };
        {
            let mut counting = CountingWriter { inner: &mut self.out, count: 0 };
            fill(&mut counting).map_err(io_err)?;
            self.written += counting.count;
        }
        let got = self.written - start;
        if got != spec.n_bytes() {
            return Err(WriteError::SizeMismatch { name: spec.name.clone(), got, want: spec.n_bytes() });
        }
        self.pad().map_err(|source| WriteError::Io { path: self.path.clone(), source })
    }

    /// Flushes and closes the file, returning its size in bytes.
    pub fn finish(mut self) -> Result<u64, WriteError> {
        let io_err = |source| WriteError::Io { path: self.path.clone(), source };
        self.out.flush().map_err(io_err)?;
        let mut file = self.out.into_inner().map_err(|e| io_err(e.into_error()))?;
        let len = file.stream_position().map_err(io_err)?;
        file.sync_all().map_err(io_err)?;
        Ok(len)
    }
}

struct CountingWriter<'a, W: Write> {
    inner: &'a mut W,
    count: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_sizes_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let tensors = vec![
            TensorSpec { name: "a".into(), ne: vec![3], ty: TensorType::F32 },
            TensorSpec { name: "b".into(), ne: vec![2, 2], ty: TensorType::F16 },
        ];
        let meta = vec![("general.architecture".to_string(), Value::Str("x".into()))];
        let mut w = GgufWriter::create(&path, &meta, &tensors, 64).unwrap();
        w.write_tensor(&tensors[0], |o| o.write_all(&[0u8; 12])).unwrap();
        let err = w.write_tensor(&tensors[1], |o| o.write_all(&[0u8; 7])).unwrap_err();
        assert!(matches!(err, WriteError::SizeMismatch { got: 7, want: 8, .. }), "{err}");
    }

    #[test]
    fn rejects_bad_alignment() {
        let dir = tempfile::tempdir().unwrap();
        let err = GgufWriter::create(&dir.path().join("t.gguf"), &[], &[], 48).err().unwrap();
        assert!(matches!(err, WriteError::BadAlignment(48)));
    }

    #[test]
    fn header_starts_with_magic_version_and_counts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let tensors = vec![TensorSpec { name: "a".into(), ne: vec![4], ty: TensorType::F32 }];
        let mut w = GgufWriter::create(&path, &[], &tensors, 32).unwrap();
        w.write_tensor(&tensors[0], |o| o.write_all(&[1u8; 16])).unwrap();
        let len = w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, len);
        assert_eq!(&bytes[0..4], b"GGUF");
        assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 3);
        assert_eq!(u64::from_le_bytes(bytes[8..16].try_into().unwrap()), 1);
        assert_eq!(len % 32, 0);
        // The data sits at an aligned offset and is padded to the alignment, as llama.cpp writes.
        let n = bytes.len();
        assert_eq!(&bytes[n - 32..n - 16], &[1u8; 16]);
        assert_eq!(&bytes[n - 16..], &[0u8; 16]);
    }
}
