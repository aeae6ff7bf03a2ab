//! ggml tensor element types.

use std::ffi::CStr;

use llama_cpp_sys_2 as sys;

/// A ggml tensor element type (`enum ggml_type`), as stored in GGUF files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub(crate) sys::ggml_type);

impl GgmlType {
    /// `GGML_TYPE_F32`.
    pub const F32: GgmlType = GgmlType(sys::GGML_TYPE_F32);
    /// `GGML_TYPE_F16`.
    pub const F16: GgmlType = GgmlType(sys::GGML_TYPE_F16);
    /// `GGML_TYPE_BF16`.
    pub const BF16: GgmlType = GgmlType(sys::GGML_TYPE_BF16);
    /// `GGML_TYPE_Q8_0`.
    pub const Q8_0: GgmlType = GgmlType(sys::GGML_TYPE_Q8_0);
    /// `GGML_TYPE_Q5_1`.
    pub const Q5_1: GgmlType = GgmlType(sys::GGML_TYPE_Q5_1);
    /// `GGML_TYPE_Q5_0`.
    pub const Q5_0: GgmlType = GgmlType(sys::GGML_TYPE_Q5_0);
    /// `GGML_TYPE_Q4_1`.
    pub const Q4_1: GgmlType = GgmlType(sys::GGML_TYPE_Q4_1);
    /// `GGML_TYPE_Q4_0`.
    pub const Q4_0: GgmlType = GgmlType(sys::GGML_TYPE_Q4_0);
    /// `GGML_TYPE_IQ4_NL`.
    pub const IQ4_NL: GgmlType = GgmlType(sys::GGML_TYPE_IQ4_NL);
    /// `GGML_TYPE_Q4_K`.
    pub const Q4_K: GgmlType = GgmlType(sys::GGML_TYPE_Q4_K);
    /// `GGML_TYPE_Q6_K`.
    pub const Q6_K: GgmlType = GgmlType(sys::GGML_TYPE_Q6_K);
    /// `GGML_TYPE_MXFP4`.
    pub const MXFP4: GgmlType = GgmlType(sys::GGML_TYPE_MXFP4);

    /// Wraps ggml's type number, if it names a type this ggml knows.
    pub fn from_raw(raw: u32) -> Option<GgmlType> {
        (raw < sys::GGML_TYPE_COUNT && Self::name_of(raw).is_some()).then_some(GgmlType(raw))
    }

    /// ggml's type number.
    pub fn raw(self) -> u32 {
        self.0
    }

    fn name_of(raw: u32) -> Option<&'static str> {
        // SAFETY: ggml_type_name indexes a static table of GGML_TYPE_COUNT entries; `raw` is
        // checked against that bound by every caller. Removed types have a NULL or empty name.
        let p = unsafe { sys::ggml_type_name(raw) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null names in ggml's type table are static NUL-terminated strings.
        let name = unsafe { CStr::from_ptr(p) }.to_str().ok()?;
        (!name.is_empty() && name != "NONE").then_some(name)
    }

    /// The type's name as ggml prints it (`f32`, `q8_0`, `q4_K`, ...).
    pub fn name(self) -> &'static str {
        Self::name_of(self.0).unwrap_or("unknown")
    }

    /// Whether the type is a block-quantized one.
    pub fn is_quantized(self) -> bool {
        // SAFETY: ggml_is_quantized reads the static type traits table; self.0 < GGML_TYPE_COUNT.
        unsafe { sys::ggml_is_quantized(self.0) }
    }

    /// Bytes of one row of `ne0` elements (`ggml_row_size`). `ne0` must be a multiple of the
    /// block size.
    pub fn row_size(self, ne0: i64) -> usize {
        // SAFETY: pure arithmetic over the static type traits table; self.0 is a valid type.
        unsafe { sys::ggml_row_size(self.0, ne0) }
    }

    /// Elements per block (1 for plain float types, 32 for Q8_0, 256 for k-quants).
    pub fn block_size(self) -> i64 {
        // SAFETY: reads the static type traits table; self.0 is a valid type.
        unsafe { sys::ggml_blck_size(self.0) }
    }

    /// Whether ggml's CPU backend multiplies a matrix of this type: it has a dot product, and the
    /// activations can be converted to that dot product's operand type. A weight matrix of any
    /// other type (I8, I32, F64, ...) reaches a kernel that does not exist.
    pub fn has_cpu_matmul(self) -> bool {
        // SAFETY: ggml's CPU trait table is static and covers every type below GGML_TYPE_COUNT.
        let Some(traits) = (unsafe { sys::ggml_get_type_traits_cpu(self.0).as_ref() }) else { return false };
        if traits.vec_dot.is_none() {
            return false;
        }
        let operand = traits.vec_dot_type;
        // SAFETY: as above, for the dot product's operand type (a valid type of the table).
        operand == sys::GGML_TYPE_F32
            || unsafe { sys::ggml_get_type_traits_cpu(operand).as_ref() }.is_some_and(|t| t.from_float.is_some())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_row_sizes() {
        assert_eq!(GgmlType::F32.name(), "f32");
        assert_eq!(GgmlType::Q8_0.name(), "q8_0");
        assert_eq!(GgmlType::Q8_0.row_size(96), 102);
        assert_eq!(GgmlType::Q4_K.block_size(), 256);
        assert!(GgmlType::Q6_K.is_quantized());
        assert!(!GgmlType::F16.is_quantized());
        assert_eq!(GgmlType::from_raw(10_000), None);
        assert_eq!(GgmlType::from_raw(0), Some(GgmlType::F32));
    }

    #[test]
    fn matmul_types() {
        for t in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::MXFP4] {
            assert!(t.has_cpu_matmul(), "{t}");
        }
        for raw in [sys::GGML_TYPE_I8, sys::GGML_TYPE_I16, sys::GGML_TYPE_I32, sys::GGML_TYPE_I64, sys::GGML_TYPE_F64] {
            assert!(!GgmlType(raw).has_cpu_matmul(), "{}", GgmlType(raw));
        }
    }
}
