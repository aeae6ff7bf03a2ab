//! The KV cache's element types (`--cache-type-k`, `--cache-type-v`, the profile's
//! `memory.cache_type_k` and `memory.cache_type_v`): llama.cpp's names and types. On an 8 GB
//! board every MiB the KV cache does not take is expert cache; a quantized type changes the
//! attention's arithmetic, so anything but f16 is lossy against the model's own output.

use ggml_sys::GgmlType;

/// One KV cache element type, as llama.cpp's `--cache-type-k` names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheType {
    /// 32-bit floats (twice f16's memory).
    F32,
    /// 16-bit floats: llama.cpp's default, exact.
    #[default]
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit blocks of 32 (about 53% of f16's memory).
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 (28%).
    #[value(name = "q4_0")]
    Q4_0,
    /// 4-bit blocks of 32 with a minimum (31%).
    #[value(name = "q4_1")]
    Q4_1,
    /// 4-bit non-linear blocks of 32 (28%).
    #[value(name = "iq4_nl")]
    Iq4Nl,
    /// 5-bit blocks of 32 (34%).
    #[value(name = "q5_0")]
    Q5_0,
    /// 5-bit blocks of 32 with a minimum (38%).
    #[value(name = "q5_1")]
    Q5_1,
}

impl KvCacheType {
    /// ggml's type.
    pub fn ggml(self) -> GgmlType {
        match self {
            KvCacheType::F32 => GgmlType::F32,
            KvCacheType::F16 => GgmlType::F16,
            KvCacheType::Bf16 => GgmlType::BF16,
            KvCacheType::Q8_0 => GgmlType::Q8_0,
            KvCacheType::Q4_0 => GgmlType::Q4_0,
            KvCacheType::Q4_1 => GgmlType::Q4_1,
            KvCacheType::Iq4Nl => GgmlType::IQ4_NL,
            KvCacheType::Q5_0 => GgmlType::Q5_0,
            KvCacheType::Q5_1 => GgmlType::Q5_1,
        }
    }

    /// llama.cpp's name for it (`q8_0`, ...).
    pub fn name(self) -> &'static str {
        self.ggml().name()
    }
}

/// The KV cache's types for keys and values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvTypes {
    /// Keys.
    pub k: KvCacheType,
    /// Values.
    pub v: KvCacheType,
}

impl KvTypes {
    /// `k f16, v q8_0`, for reports.
    pub fn describe(self) -> String {
        format!("k {}, v {}", self.k.name(), self.v.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn the_names_are_llama_cpps() {
        for t in KvCacheType::value_variants() {
            let name = t.to_possible_value().unwrap().get_name().to_string();
            assert_eq!(name, t.name(), "{t:?}");
            assert_eq!(serde_json::to_string(t).unwrap(), format!("\"{name}\""), "{t:?}");
        }
        assert_eq!(KvTypes { k: KvCacheType::Q8_0, v: KvCacheType::Q4_0 }.describe(), "k q8_0, v q4_0");
    }
}
