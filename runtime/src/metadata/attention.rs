//! Attention widths, rotary and norm parameters: the relations `load_hparams`, the verified
//! architectures' graph builders and ggml's CPU ops (`rope`: rotated width <= head and even;
//! the norms: epsilon >= 0) assert on.

use super::{shown, Meta, MetadataError};

/// llama.cpp's rotary scaling types (`LLAMA_ROPE_SCALING_TYPES`); any other name is asserted on.
const ROPE_SCALING_TYPES: [&str; 4] = ["none", "linear", "yarn", "longrope"];

/// Float keys a graph computes with: a NaN or infinity there is asserted on (the norms'
/// epsilon must be >= 0, which NaN is not) or turns every logit into NaN.
const FINITE_KEYS: [&str; 7] = [
    "attention.layer_norm_rms_epsilon",
    "attention.layer_norm_epsilon",
    "attention.temperature_scale",
    "rope.freq_base",
    "rope.freq_base_swa",
    "rope.scaling.factor",
    "rope.scaling.attn_factor",
];

/// The checks of this module, in order.
pub(super) fn check(m: &Meta) -> Result<(), MetadataError> {
    check_floats(m)?;
    check_temperature(m)?;
    check_rope_scaling(m)?;
    let Some(heads) = Heads::read(m)? else {
        if m.is_verified() {
            return Err(m.error("attention.head_count", format!("is missing or 0; {} needs attention heads", m.arch)));
        }
        return Ok(());
    };
    heads.check_rope(m)?;
    if m.is_verified() {
        heads.check_uniform(m)?;
    }
    if m.is("qwen3moe") {
        heads.check_equal(m, &[("attention.value_length", heads.v), ("rope.dimension_count", heads.rot)])?;
    }
    if m.is("gpt-oss") {
        // Its tensors and KV cache are sized by the rotated width in every layer.
        heads.check_equal(
            m,
            &[
                ("attention.value_length", heads.v),
                ("attention.key_length_swa", heads.k_swa),
                ("attention.value_length_swa", heads.v_swa),
                ("rope.dimension_count", heads.rot),
                ("rope.dimension_count_swa", heads.rot_swa),
            ],
        )?;
        check_sliding_window(m)?;
    }
    if m.is("deepseek2") {
        check_latent_attention(m, &heads)?;
    }
    Ok(())
}

/// Norm epsilons, temperature and rotary frequencies: finite, and the epsilons >= 0.
fn check_floats(m: &Meta) -> Result<(), MetadataError> {
    for name in FINITE_KEYS {
        let epsilon = name.contains("epsilon");
        if let Some(v) = m.float(name) {
            if !v.is_finite() || (epsilon && v < 0.0) {
                let want = if epsilon { "a finite number >= 0" } else { "a finite number" };
                return Err(m.error(name, format!("is {v}; it must be {want}")));
            }
        }
    }
    Ok(())
}

/// Attention temperature scaling (llama.cpp's attn-temp input) divides positions by
/// `attention.temperature_length`: a scale needs a length.
fn check_temperature(m: &Meta) -> Result<(), MetadataError> {
    let scale = m.float("attention.temperature_scale").unwrap_or(0.0);
    if scale != 0.0 && m.int("attention.temperature_length").unwrap_or(0) == 0 {
        return Err(m.error(
            "attention.temperature_length",
            format!("is missing or 0, but attention.temperature_scale is {scale}; scaled attention needs a length"),
        ));
    }
    Ok(())
}

/// `rope.scaling.type`: one llama.cpp knows.
fn check_rope_scaling(m: &Meta) -> Result<(), MetadataError> {
    match m.gguf.get_str(&m.key("rope.scaling.type")) {
        Some(t) if !ROPE_SCALING_TYPES.contains(&t.as_str()) => Err(m.error(
            "rope.scaling.type",
            format!("is {:?}; llama.cpp knows {}", crate::text::excerpt(&t, 64), ROPE_SCALING_TYPES.join(", ")),
        )),
        _ => Ok(()),
    }
}

/// The attention heads and head widths as llama.cpp derives them (`load_hparams`).
struct Heads {
    /// Query heads per layer.
    q: Vec<i64>,
    /// Key/value heads per layer (the query heads when absent).
    kv: Vec<i64>,
    /// Key and value widths of a head, full and sliding-window layers.
    k: u64,
    v: u64,
    k_swa: u64,
    v_swa: u64,
    /// The rotated part of a key, full and sliding-window layers.
    rot: u64,
    rot_swa: u64,
}

impl Heads {
    /// The heads of `m`; `None` for a model without attention (layer 0 has no heads).
    fn read(m: &Meta) -> Result<Option<Heads>, MetadataError> {
        let Some(q) = m.per_layer("attention.head_count")? else { return Ok(None) };
        if q[0] <= 0 {
            return Ok(None);
        }
        let kv = m.per_layer("attention.head_count_kv")?.unwrap_or_else(|| q.clone());
        for (layer, (&h, &g)) in q.iter().zip(&kv).enumerate() {
            // The graph groups h query heads over g key/value heads (ggml_mul_mat broadcasts
            // only whole multiples).
            if g > 0 && (h % g != 0 || g > h) {
                return Err(m.error(
                    "attention.head_count_kv",
                    format!("is {g} for layer {layer}, which does not divide its {h} query heads"),
                ));
            }
        }
        let embd = m.int("embedding_length").unwrap_or(0);
        if embd == 0 {
            return Err(m.error("embedding_length", "is missing or 0; a model with attention heads needs a width"));
        }
        let default = embd / q[0] as u64;
        let k = m.int("attention.key_length").unwrap_or(default);
        let v = m.int("attention.value_length").unwrap_or(default);
        for (name, width) in [("attention.key_length", k), ("attention.value_length", v)] {
            if width == 0 {
                return Err(m.error(name, format!("is 0 (embedding_length {embd} over {} heads)", q[0])));
            }
        }
        let rot = m.int("rope.dimension_count").unwrap_or(k);
        let (k_swa, v_swa) =
            (m.int("attention.key_length_swa").unwrap_or(k), m.int("attention.value_length_swa").unwrap_or(v));
        let rot_swa = m.int("rope.dimension_count_swa").unwrap_or(rot);
        Ok(Some(Heads { q, kv, k, v, k_swa, v_swa, rot, rot_swa }))
    }

    /// ggml's rope: the rotated width is even and within the head.
    fn check_rope(&self, m: &Meta) -> Result<(), MetadataError> {
        for (name, rot, head) in
            [("rope.dimension_count", self.rot, self.k), ("rope.dimension_count_swa", self.rot_swa, self.k_swa)]
        {
            if rot > head || rot % 2 != 0 {
                return Err(m.error(name, format!("is {rot}; it must be even and at most the key head width {head}")));
            }
        }
        Ok(())
    }

    /// The verified architectures' graphs read layer 0's head counts for every layer.
    fn check_uniform(&self, m: &Meta) -> Result<(), MetadataError> {
        for (name, values) in [("attention.head_count", &self.q), ("attention.head_count_kv", &self.kv)] {
            if values.iter().any(|v| *v != values[0]) {
                return Err(m.error(name, format!("is {}; {} needs one value for all layers", shown(values), m.arch)));
            }
        }
        Ok(())
    }

    /// Widths that the architecture's graph takes to be the key head width.
    fn check_equal(&self, m: &Meta, widths: &[(&str, u64)]) -> Result<(), MetadataError> {
        match widths.iter().find(|(_, w)| *w != self.k) {
            Some((name, w)) => Err(m.error(
                name,
                format!("is {w}, but {} builds every head {} wide (attention.key_length)", m.arch, self.k),
            )),
            None => Ok(()),
        }
    }
}

/// gpt-oss: a sliding window, and at least one layer that uses it (its KV cache keeps the
/// sliding-window layers apart).
fn check_sliding_window(m: &Meta) -> Result<(), MetadataError> {
    if m.int("attention.sliding_window").unwrap_or(0) == 0 {
        return Err(m.error("attention.sliding_window", "is missing or 0; gpt-oss attends through a sliding window"));
    }
    let name = "attention.sliding_window_pattern";
    let any_swa = match (m.int(name), m.gguf.array_len(&m.key(name))) {
        // llama.cpp's set_swa_pattern: layer il slides when il % n < n - 1 (n = 0: all).
        (Some(n), _) => n != 1,
        (None, Some(_)) => m.per_layer(name)?.is_some_and(|v| v.iter().any(|&s| s != 0)),
        (None, None) => true,
    };
    if !any_swa {
        return Err(m.error(name, "leaves no sliding-window layer; gpt-oss needs one (the default pattern is 2)"));
    }
    Ok(())
}

/// deepseek2's attention dimensions, which its graph asserts on: the rotary part is narrower than
/// a head, and with latent attention (both `*_mla` head sizes set) there is one latent KV head
/// whose key is the latent plus the rotary part and whose value is the latent.
fn check_latent_attention(m: &Meta, heads: &Heads) -> Result<(), MetadataError> {
    let (k_mla, v_mla) =
        (m.int("attention.key_length_mla").unwrap_or(0), m.int("attention.value_length_mla").unwrap_or(0));
    if (k_mla == 0) != (v_mla == 0) {
        return Err(m.error(
            "attention.key_length_mla",
            format!(
                "is {k_mla} while {} is {v_mla}; latent attention needs both or neither",
                m.key("attention.value_length_mla")
            ),
        ));
    }
    let mla = k_mla > 0;
    let (rot, head_k_full) = (heads.rot, if mla { k_mla } else { heads.k });
    if head_k_full <= rot {
        return Err(m.error(
            "rope.dimension_count",
            format!("is {rot}, not below the key head size {head_k_full}; deepseek2 needs a non-rotary part"),
        ));
    }
    if !mla {
        return Ok(());
    }
    if heads.kv.iter().any(|&h| h != 1) {
        return Err(
            m.error("attention.head_count_kv", format!("is {}; latent attention has one KV head", shown(&heads.kv)))
        );
    }
    let lora = m.int("attention.kv_lora_rank").unwrap_or(0);
    if heads.k != lora + rot || heads.v != lora {
        return Err(m.error(
            "attention.key_length",
            format!(
                "is {} (value length {}); latent attention needs kv_lora_rank + rope.dimension_count = {} ({})",
                heads.k,
                heads.v,
                lora + rot,
                lora
            ),
        ));
    }
    Ok(())
}
