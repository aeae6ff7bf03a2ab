//! The checks of a model's metadata that llama.cpp asserts on instead of reporting: run before
//! any llama.cpp call, in every mode, so a malformed file gets an error that names the key and
//! the value rather than an abort.

use std::collections::HashMap;
use std::path::Path;

use ggml_sys::GgufFile;

/// llama.cpp's most layers (`LLAMA_MAX_LAYERS`).
pub const MAX_LAYERS: u64 = 512;
/// llama.cpp's most experts (`LLAMA_MAX_EXPERTS`).
pub const MAX_EXPERTS: u64 = 1024;
/// The smallest tensor data alignment llama.cpp loads.
pub const MIN_ALIGNMENT: u64 = 32;

/// A metadata value llama.cpp would abort on.
#[derive(Debug, thiserror::Error)]
#[error("{key} {problem}; the file is malformed (re-download or re-convert it)")]
pub struct MetadataError {
    /// The metadata key at fault.
    pub key: String,
    /// What is wrong with it.
    pub problem: String,
}

impl MetadataError {
    fn new(key: impl Into<String>, problem: impl Into<String>) -> MetadataError {
        MetadataError { key: key.into(), problem: problem.into() }
    }
}

/// Checks `gguf`'s metadata: layer count, NextN layers, expert counts and groups (against the
/// expert tensors too), alignment, and the vocabulary's token strings.
pub fn check(gguf: &GgufFile) -> Result<(), MetadataError> {
    let Some(arch) = gguf.architecture() else {
        return Err(MetadataError::new("general.architecture", "is missing or not a string"));
    };
    let key = |name: &str| format!("{arch}.{name}");
    let align = gguf.alignment();
    if align < MIN_ALIGNMENT || !align.is_power_of_two() {
        return Err(MetadataError::new(
            "general.alignment",
            format!("is {align}; it must be a power of two of at least {MIN_ALIGNMENT}"),
        ));
    }
    let layers_key = key("block_count");
    let layers =
        gguf.get_u64(&layers_key).ok_or_else(|| MetadataError::new(&layers_key, "is missing or not an integer"))?;
    if !(1..=MAX_LAYERS).contains(&layers) {
        return Err(MetadataError::new(&layers_key, format!("is {layers}; llama.cpp runs 1 to {MAX_LAYERS} layers")));
    }
    let nextn_key = key("nextn_predict_layers");
    if let Some(n) = gguf.get_u64(&nextn_key).filter(|&n| n > layers) {
        return Err(MetadataError::new(&nextn_key, format!("is {n}, more than the {layers} layers")));
    }
    check_experts(gguf, &key, layers)?;
    if arch == "deepseek2" {
        check_latent_attention(gguf, &key, layers)?;
    }
    check_tokens(gguf)
}

/// deepseek2's attention dimensions, which its graph asserts on: the rotary part is narrower than
/// a head, and with latent attention (both `*_mla` head sizes set) there is one latent KV head
/// whose key is the latent plus the rotary part and whose value is the latent.
fn check_latent_attention(gguf: &GgufFile, key: &dyn Fn(&str) -> String, layers: u64) -> Result<(), MetadataError> {
    let get = |name: &str| gguf.get_u64(&key(name));
    let heads_key = key("attention.head_count");
    let heads = get("attention.head_count")
        .filter(|&h| h > 0)
        .ok_or_else(|| MetadataError::new(&heads_key, "is missing or 0; deepseek2 needs attention heads"))?;
    let embd = get("embedding_length").unwrap_or(0);
    let head_k = get("attention.key_length").unwrap_or(embd / heads);
    let head_v = get("attention.value_length").unwrap_or(embd / heads);
    let rot = get("rope.dimension_count").unwrap_or(head_k);
    let (k_mla, v_mla) = (get("attention.key_length_mla").unwrap_or(0), get("attention.value_length_mla").unwrap_or(0));
    if (k_mla == 0) != (v_mla == 0) {
        return Err(MetadataError::new(
            key("attention.key_length_mla"),
            format!(
                "is {k_mla} while {} is {v_mla}; latent attention needs both or neither",
                key("attention.value_length_mla")
            ),
        ));
    }
    let mla = k_mla > 0;
    let head_k_full = if mla { k_mla } else { head_k };
    if head_k_full <= rot {
        return Err(MetadataError::new(
            key("rope.dimension_count"),
            format!("is {rot}, not below the key head size {head_k_full}; deepseek2 needs a non-rotary part"),
        ));
    }
    if !mla {
        return Ok(());
    }
    let kv_key = key("attention.head_count_kv");
    let kv_heads =
        per_layer_values(gguf, &kv_key, layers)?.unwrap_or_else(|| vec![i64::try_from(heads).unwrap_or(i64::MAX)]);
    if kv_heads.iter().any(|&h| h != 1) {
        return Err(MetadataError::new(kv_key, format!("is {}; latent attention has one KV head", shown(&kv_heads))));
    }
    let lora = get("attention.kv_lora_rank").unwrap_or(0);
    if head_k != lora + rot || head_v != lora {
        return Err(MetadataError::new(
            key("attention.key_length"),
            format!(
                "is {head_k} (value length {head_v}); latent attention needs kv_lora_rank + rope.dimension_count = {} ({})",
                lora + rot,
                lora
            ),
        ));
    }
    Ok(())
}

/// A key that holds one value for every layer or an array of one per layer: its values (one for
/// a scalar), `None` when it is absent or of another type, and an error for an array that does
/// not hold one value per layer (of `layers`).
pub(crate) fn per_layer_values(gguf: &GgufFile, key: &str, layers: u64) -> Result<Option<Vec<i64>>, MetadataError> {
    if let Some(v) = gguf.get_u64(key) {
        return Ok(Some(vec![i64::try_from(v).unwrap_or(i64::MAX)]));
    }
    match gguf.array_u32(key) {
        Some(per_layer) if per_layer.len() as u64 != layers => {
            Err(MetadataError::new(key, format!("has {} values for {layers} layers", per_layer.len())))
        }
        values => Ok(values),
    }
}

/// Per-layer values as an error shows them: the value of a scalar, else the list.
fn shown(values: &[i64]) -> String {
    match values {
        [one] => one.to_string(),
        per_layer => format!("{per_layer:?}"),
    }
}

/// Expert counts: at most [`MAX_EXPERTS`], the experts used per token between 1 and the count
/// (0 without experts), groups that divide the experts, and expert tensors of that many
/// experts.
fn check_experts(gguf: &GgufFile, key: &dyn Fn(&str) -> String, layers: u64) -> Result<(), MetadataError> {
    let (count_key, used_key) = (key("expert_count"), key("expert_used_count"));
    let experts = gguf.get_u64(&count_key).unwrap_or(0);
    if experts > MAX_EXPERTS {
        return Err(MetadataError::new(
            count_key,
            format!("is {experts}; llama.cpp runs at most {MAX_EXPERTS} experts"),
        ));
    }
    let used = per_layer_values(gguf, &used_key, layers)?.unwrap_or_else(|| vec![0]);
    let used_max = used.iter().copied().max().unwrap_or(0);
    if used.iter().any(|&u| u < 0) || used_max > experts as i64 || (experts > 0 && used_max == 0) {
        let range = if experts > 0 { format!("1 to {experts} (the expert count)") } else { "0 (no experts)".into() };
        return Err(MetadataError::new(used_key, format!("is {}; it must be {range}", shown(&used))));
    }
    let (groups_key, group_used_key) = (key("expert_group_count"), key("expert_group_used_count"));
    let groups = gguf.get_u64(&groups_key).unwrap_or(0);
    let group_used = gguf.get_u64(&group_used_key).unwrap_or(0);
    if groups > 0 && (experts == 0 || groups >= experts) {
        return Err(MetadataError::new(
            groups_key,
            format!("is {groups}; it must be below the expert count {experts}"),
        ));
    }
    if groups > 1 && experts % groups != 0 {
        return Err(MetadataError::new(
            groups_key,
            format!("is {groups}, which does not divide the {experts} experts"),
        ));
    }
    if groups > 1 && !(1..groups).contains(&group_used) {
        return Err(MetadataError::new(group_used_key, format!("is {group_used}; it must be 1 to {}", groups - 1)));
    }
    if let Some(t) =
        gguf.tensors().iter().find(|t| crate::stream::index::is_expert_weight(&t.name) && t.ne[2] != experts as i64)
    {
        return Err(MetadataError::new(
            count_key,
            format!("is {experts}, but tensor {} holds {} experts", t.name, t.ne[2]),
        ));
    }
    Ok(())
}

/// Token strings: none may appear twice (llama.cpp maps text to tokens one to one).
fn check_tokens(gguf: &GgufFile) -> Result<(), MetadataError> {
    const TOKENS: &str = "tokenizer.ggml.tokens";
    let Some(tokens) = gguf.array_strings(TOKENS) else { return Ok(()) };
    let mut seen: HashMap<&[u8], usize> = HashMap::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        if let Some(first) = seen.insert(t, id) {
            return Err(MetadataError::new(
                TOKENS,
                format!("holds {:?} twice (tokens {first} and {id})", String::from_utf8_lossy(t)),
            ));
        }
    }
    Ok(())
}

/// Opens the header of `path` and checks it (see [`check`]).
pub fn check_file(path: &Path) -> Result<(), crate::generate::GenerateError> {
    let gguf = GgufFile::open(path)?;
    check(&gguf).map_err(|e| crate::generate::GenerateError::ModelFile { path: path.into(), reason: e.to_string() })
}
