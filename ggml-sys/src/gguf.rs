//! The GGUF index: tensor name → absolute data offset, size, type and shape, plus typed access
//! to the metadata, read from the file header without loading any tensor data.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use llama_cpp_sys_2 as sys;

use crate::{Error, GgmlType, Result};

/// One tensor of a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    /// Tensor name, e.g. `blk.3.ffn_down_exps.weight`.
    pub name: String,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub size: u64,
    /// Element type.
    pub ty: GgmlType,
    /// Shape in ggml order (`ne[0]` is the row length); unused dimensions are 1.
    pub ne: [i64; 4],
}

impl GgufTensor {
    /// Byte strides in ggml order (`nb[2]` is the per-expert stride of a 3-D expert tensor).
    pub fn nb(&self) -> [u64; 4] {
        let row = self.ty.row_size(self.ne[0]) as u64;
        let nb1 = row;
        let nb2 = nb1 * self.ne[1] as u64;
        let nb3 = nb2 * self.ne[2] as u64;
        [self.ty.row_size(1) as u64, nb1, nb2, nb3]
    }
}

/// A parsed GGUF header: metadata and tensor table. Holds no tensor data.
pub struct GgufFile {
    ctx: *mut sys::gguf_context,
    path: PathBuf,
    file_size: u64,
    tensors: Vec<GgufTensor>,
}

// SAFETY: the gguf_context is only read after gguf_init_from_file returns, and ggml's gguf getters
// do not mutate it, so sharing or moving it across threads is sound.
unsafe impl Send for GgufFile {}
// SAFETY: see Send: all access is read-only.
unsafe impl Sync for GgufFile {}

/// How much of a file whose header ggml rejected is read again to look for an I/O error.
const REREAD_BYTES: u64 = 64 << 20;

/// The I/O error that made ggml reject `path`'s header, if reading its first bytes again fails:
/// ggml's parser says only that it failed, which reads as a malformed file.
fn read_failure(path: &Path) -> Option<Error> {
    use std::os::unix::fs::FileExt as _;
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(source) => return Some(Error::GgufRead { path: path.into(), offset: 0, source }),
    };
    let end = file.metadata().map_or(0, |m| m.len()).min(REREAD_BYTES);
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < end {
        let want = buf.len().min((end - at) as usize);
        match file.read_at(&mut buf[..want], at) {
            Ok(0) => return None,
            Ok(n) => at += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => return Some(Error::GgufRead { path: path.into(), offset: at, source }),
        }
    }
    None
}

impl GgufFile {
    /// Parses the header of `path`. Checks that every tensor's data lies inside the file, so a
    /// truncated download is reported here, naming the first tensor that runs past the end.
    pub fn open(path: &Path) -> Result<GgufFile> {
        crate::init();
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::PathNul(path.into()))?;
        let params = sys::gguf_init_params { no_alloc: true, ctx: std::ptr::null_mut() };
        // SAFETY: c_path is a valid NUL-terminated string; with no_alloc and a NULL ctx out-pointer
        // ggml only parses the header and allocates nothing for tensor data.
        let ctx = unsafe { crate::shim::sluice_gguf_init_from_file(c_path.as_ptr(), params) };
        crate::shim::caught("gguf_init_from_file")?;
        if ctx.is_null() {
            return Err(read_failure(path).unwrap_or(Error::GgufParse { path: path.into() }));
        }
        let file_size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        let mut file = GgufFile { ctx, path: path.into(), file_size, tensors: Vec::new() };
        file.tensors = file.read_tensor_table();
        if let Some(t) = file.tensors.iter().find(|t| t.offset + t.size > file_size) {
            return Err(Error::Truncated {
                path: path.into(),
                tensor: t.name.clone(),
                end: t.offset + t.size,
                file_size,
            });
        }
        Ok(file)
    }

    fn read_tensor_table(&self) -> Vec<GgufTensor> {
        // SAFETY: self.ctx is a live gguf_context (see open).
        let data_offset = unsafe { sys::gguf_get_data_offset(self.ctx) } as u64;
        // SAFETY: as above.
        let n = unsafe { sys::gguf_get_n_tensors(self.ctx) };
        (0..n)
            .map(|i| {
                // SAFETY: i < n_tensors; the name is a NUL-terminated string owned by ctx.
                let name = unsafe { CStr::from_ptr(sys::gguf_get_tensor_name(self.ctx, i)) };
                // SAFETY: i < n_tensors; ggml returns a pointer to GGML_MAX_DIMS (4) elements.
                let ne = unsafe { std::slice::from_raw_parts(sys::gguf_get_tensor_ne(self.ctx, i), 4) };
                // SAFETY: i < n_tensors.
                let (offset, size, ty) = unsafe {
                    (
                        sys::gguf_get_tensor_offset(self.ctx, i) as u64,
                        sys::gguf_get_tensor_size(self.ctx, i) as u64,
                        sys::gguf_get_tensor_type(self.ctx, i),
                    )
                };
                GgufTensor {
                    name: name.to_string_lossy().into_owned(),
                    offset: data_offset + offset,
                    size,
                    ty: GgmlType(ty),
                    ne: [ne[0], ne[1], ne[2], ne[3]],
                }
            })
            .collect()
    }

    /// The file this header was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size in bytes.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// The tensors, in file order.
    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor data alignment (`general.alignment`, 32 by default).
    pub fn alignment(&self) -> u64 {
        // SAFETY: self.ctx is live.
        unsafe { sys::gguf_get_alignment(self.ctx) as u64 }
    }

    /// Absolute offset where tensor data starts.
    pub fn data_offset(&self) -> u64 {
        // SAFETY: self.ctx is live.
        unsafe { sys::gguf_get_data_offset(self.ctx) as u64 }
    }

    fn key_id(&self, key: &str) -> Option<i64> {
        let c_key = CString::new(key).ok()?;
        // SAFETY: self.ctx is live; c_key is NUL-terminated.
        let id = unsafe { sys::gguf_find_key(self.ctx, c_key.as_ptr()) };
        (id >= 0).then_some(id)
    }

    fn kv_type(&self, id: i64) -> sys::gguf_type {
        // SAFETY: id was returned by gguf_find_key for this ctx.
        unsafe { sys::gguf_get_kv_type(self.ctx, id) }
    }

    /// The metadata value of `key` as an unsigned integer, if it is stored as any non-negative
    /// integer type. (ggml aborts on a getter of the wrong type, so the stored type is checked.)
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        let id = self.key_id(key)?;
        let ctx = self.ctx;
        let ty = self.kv_type(id);
        // SAFETY: id belongs to ctx, and each getter is called only for its own stored type
        // (ggml aborts on a mismatch).
        let v: i128 = unsafe {
            match ty {
                sys::GGUF_TYPE_UINT8 => sys::gguf_get_val_u8(ctx, id).into(),
                sys::GGUF_TYPE_INT8 => sys::gguf_get_val_i8(ctx, id).into(),
                sys::GGUF_TYPE_UINT16 => sys::gguf_get_val_u16(ctx, id).into(),
                sys::GGUF_TYPE_INT16 => sys::gguf_get_val_i16(ctx, id).into(),
                sys::GGUF_TYPE_UINT32 => sys::gguf_get_val_u32(ctx, id).into(),
                sys::GGUF_TYPE_INT32 => sys::gguf_get_val_i32(ctx, id).into(),
                sys::GGUF_TYPE_UINT64 => sys::gguf_get_val_u64(ctx, id).into(),
                sys::GGUF_TYPE_INT64 => sys::gguf_get_val_i64(ctx, id).into(),
                _ => return None,
            }
        };
        u64::try_from(v).ok()
    }

    /// The metadata keys, in the file's order.
    pub fn keys(&self) -> Vec<String> {
        // SAFETY: self.ctx is live.
        let n = unsafe { sys::gguf_get_n_kv(self.ctx) };
        (0..n)
            .map(|id| {
                // SAFETY: 0 <= id < n for this ctx; ggml owns the key, NUL-terminated.
                unsafe { CStr::from_ptr(sys::gguf_get_key(self.ctx, id)) }.to_string_lossy().into_owned()
            })
            .collect()
    }

    /// The metadata value of `key`, if it is a boolean.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        let id = self.key_id(key)?;
        // SAFETY: id belongs to ctx and the getter matches the stored type.
        (self.kv_type(id) == sys::GGUF_TYPE_BOOL).then(|| unsafe { sys::gguf_get_val_bool(self.ctx, id) })
    }

    /// The metadata value of `key` as a float, if it is stored as f32 or f64.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        let id = self.key_id(key)?;
        match self.kv_type(id) {
            // SAFETY: id belongs to ctx and the getter matches the stored type.
            sys::GGUF_TYPE_FLOAT32 => Some(unsafe { sys::gguf_get_val_f32(self.ctx, id) }.into()),
            // SAFETY: as above.
            sys::GGUF_TYPE_FLOAT64 => Some(unsafe { sys::gguf_get_val_f64(self.ctx, id) }),
            _ => None,
        }
    }

    /// The metadata value of `key`, if it is a string.
    pub fn get_str(&self, key: &str) -> Option<String> {
        let id = self.key_id(key)?;
        if self.kv_type(id) != sys::GGUF_TYPE_STRING {
            return None;
        }
        // SAFETY: id belongs to ctx and holds a string; the pointer is owned by ctx.
        let p = unsafe { sys::gguf_get_val_str(self.ctx, id) };
        // SAFETY: ggml stores strings NUL-terminated.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// The number of elements of the array stored under `key`, if it is an array.
    pub fn array_len(&self, key: &str) -> Option<usize> {
        let id = self.key_id(key)?;
        if self.kv_type(id) != sys::GGUF_TYPE_ARRAY {
            return None;
        }
        // SAFETY: id belongs to ctx and holds an array.
        Some(unsafe { sys::gguf_get_arr_n(self.ctx, id) })
    }

    /// The element type and length of the array stored under `key`, if it is an array.
    fn array_of(&self, key: &str) -> Option<(i64, sys::gguf_type, usize)> {
        let id = self.key_id(key)?;
        if self.kv_type(id) != sys::GGUF_TYPE_ARRAY {
            return None;
        }
        // SAFETY: id belongs to ctx and holds an array.
        let (ty, n) = unsafe { (sys::gguf_get_arr_type(self.ctx, id), sys::gguf_get_arr_n(self.ctx, id)) };
        Some((id, ty, n))
    }

    /// The strings of the array stored under `key`, if it is an array of strings.
    pub fn array_strings(&self, key: &str) -> Option<Vec<Vec<u8>>> {
        let (id, _, n) = self.array_of(key).filter(|(_, ty, _)| *ty == sys::GGUF_TYPE_STRING)?;
        let string = |i: usize| {
            // SAFETY: i < n on an array of strings; ggml owns them, NUL-terminated.
            unsafe { CStr::from_ptr(sys::gguf_get_arr_str(self.ctx, id, i)) }.to_bytes().to_vec()
        };
        Some((0..n).map(string).collect())
    }

    /// The integers of the array stored under `key`, if it is an array of u32 or i32.
    pub fn array_u32(&self, key: &str) -> Option<Vec<i64>> {
        let (id, ty, n) = self.array_of(key)?;
        if ty != sys::GGUF_TYPE_UINT32 && ty != sys::GGUF_TYPE_INT32 {
            return None; // (ggml aborts when asked for the data of a string array)
        }
        if n == 0 {
            // ggml holds no data for an empty array (a null pointer, not a slice).
            return Some(Vec::new());
        }
        // SAFETY: id holds an array of n 4-byte integers, which ggml owns.
        let data = unsafe { sys::gguf_get_arr_data(self.ctx, id) };
        // SAFETY: as above: n elements of 4 bytes at data, alive as long as self.
        let raw = unsafe { std::slice::from_raw_parts(data.cast::<[u8; 4]>(), n) };
        Some(
            raw.iter()
                .map(|b| {
                    if ty == sys::GGUF_TYPE_UINT32 {
                        u32::from_ne_bytes(*b).into()
                    } else {
                        i32::from_ne_bytes(*b).into()
                    }
                })
                .collect(),
        )
    }

    /// The general architecture (`general.architecture`), e.g. `qwen3moe`.
    pub fn architecture(&self) -> Option<String> {
        self.get_str("general.architecture")
    }
}

impl Drop for GgufFile {
    fn drop(&mut self) {
        // SAFETY: ctx came from gguf_init_from_file and is freed exactly once, here.
        unsafe { sys::gguf_free(self.ctx) };
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile").field("path", &self.path).field("tensors", &self.tensors.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_file_that_is_not_gguf() {
        let dir = std::env::temp_dir().join(format!("ggml-sys-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("not.gguf");
        std::fs::write(&p, b"this is not a gguf file at all, just text").unwrap();
        let err = GgufFile::open(&p).unwrap_err();
        assert!(matches!(err, Error::GgufParse { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
