//! What a synthetic model is: its output type and its parameters, checked against each other.

use super::gguf_writer::TensorType;
use super::routing::{self, Routing};
use super::{arch, invalid, reuse, SynthArch, SynthError};

/// The element type of the weights in the output file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputType {
    /// 32-bit floats everywhere.
    F32,
    /// 16-bit floats for matrices, f32 for norms.
    F16,
    /// 8-bit blocks of 32 (`llama_model_quantize`).
    #[value(name = "q8_0")]
    Q8_0,
    /// The 4-bit k-quant mix (`llama_model_quantize`).
    #[value(name = "q4_k_m")]
    Q4KM,
    /// 6-bit k-quants (`llama_model_quantize`).
    #[value(name = "q6_k")]
    Q6K,
    /// MXFP4 routed experts, Q8_0 for the other matrices, as gpt-oss ships
    /// (`llama_model_quantize`).
    #[value(name = "mxfp4_moe")]
    Mxfp4Moe,
    /// bfloat16 matrices, f32 for norms (`llama_model_quantize` from f16).
    #[value(name = "bf16")]
    Bf16,
    /// The Q4_K_M mix's types with their blocks drawn directly, no f16 file quantized, as
    /// llama.cpp's quantization chooses them: Q6_K for the output and for `attn_v` and
    /// `ffn_down*` in the layers the mix gives more bits, Q4_K for the other matrices, Q5_0 and
    /// Q8_0 in place of Q4_K and Q6_K where a row is not a multiple of 256 wide, the router f32;
    /// gpt-oss's experts MXFP4, as the published Q4_K_M files keep them. A model of tens of GB
    /// then needs only its own size on disk (`make bench-board`'s Qwen3-30B-A3B shape would need
    /// 61 GB of f16 first, gpt-oss-120b's 235 GB).
    #[value(name = "q4_k_m-drawn")]
    Q4KMDrawn,
}

impl OutputType {
    /// The quantization that produces this type, if it is a quantized one.
    pub fn quant(self) -> Option<ggml_sys::QuantType> {
        match self {
            OutputType::F32 | OutputType::F16 | OutputType::Q4KMDrawn => None,
            OutputType::Q8_0 => Some(ggml_sys::QuantType::Q8_0),
            OutputType::Q4KM => Some(ggml_sys::QuantType::Q4KM),
            OutputType::Q6K => Some(ggml_sys::QuantType::Q6K),
            OutputType::Mxfp4Moe => Some(ggml_sys::QuantType::Mxfp4Moe),
            OutputType::Bf16 => Some(ggml_sys::QuantType::Bf16),
        }
    }

    /// Rows must be a multiple of this many elements for the type's blocks.
    pub fn block_width(self) -> u32 {
        match self {
            OutputType::F32 | OutputType::F16 | OutputType::Bf16 => 1,
            OutputType::Q8_0 | OutputType::Mxfp4Moe | OutputType::Q4KMDrawn => 32,
            OutputType::Q4KM | OutputType::Q6K => 256,
        }
    }

    /// Approximate bytes per weight of a matrix (for `--size`).
    pub fn bytes_per_weight(self) -> f64 {
        match self {
            OutputType::F32 => 4.0,
            OutputType::F16 | OutputType::Bf16 => 2.0,
            OutputType::Q8_0 => 34.0 / 32.0,
            // Q4_K (144 B / 256) for most matrices, Q6_K (210 B / 256) for some down projections.
            OutputType::Q4KM | OutputType::Q4KMDrawn => 0.62,
            OutputType::Q6K => 210.0 / 256.0,
            // MXFP4 (17 B / 32) for the experts, which are most of a MoE model.
            OutputType::Mxfp4Moe => 17.0 / 32.0,
        }
    }

    /// The type matrices are written in before any quantization.
    pub(super) fn matrix_type(self) -> TensorType {
        match self {
            OutputType::F32 => TensorType::F32,
            OutputType::Q4KMDrawn => TensorType::Q4K,
            _ => TensorType::F16,
        }
    }

    /// The type of matrix `name` of a model of `layers` layers of `arch`, its rows `row` elements
    /// wide: the spec's matrix type, or for [`OutputType::Q4KMDrawn`] the one llama.cpp's
    /// Q4_K_M mix gives it.
    pub(super) fn type_of(self, name: &str, row: u64, layers: u32, arch: SynthArch) -> TensorType {
        if self != OutputType::Q4KMDrawn {
            return self.matrix_type();
        }
        let layer = name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<u32>().ok());
        // llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
        // one between.
        let more_bits = |il: u32| il < layers / 8 || il >= 7 * layers / 8 || (il - layers / 8) % 3 == 2;
        if name.contains("ffn_gate_inp") {
            return TensorType::F32;
        }
        if arch == SynthArch::GptOss && name.contains("_exps") {
            return TensorType::Mxfp4;
        }
        let more = name == "output.weight"
            || ((name.contains(".attn_v.") || name.contains(".ffn_down")) && layer.is_some_and(more_bits));
        // llama.cpp's fallback for rows its k-quants' blocks of 256 do not divide.
        match (more, row % 256 == 0) {
            (true, true) => TensorType::Q6K,
            (true, false) => TensorType::Q8_0,
            (false, true) => TensorType::Q4K,
            (false, false) => TensorType::Q5_0,
        }
    }

    /// llama.cpp's `general.file_type` for the directly written types.
    pub(super) fn file_type(self) -> u32 {
        match self {
            OutputType::F32 => 0,
            // LLAMA_FTYPE_MOSTLY_Q4_K_M
            OutputType::Q4KMDrawn => 15,
            _ => 1,
        }
    }
}

/// Everything that determines a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// The architecture (tensor layout and metadata).
    pub arch: SynthArch,
    /// Routed experts' gate and up projections in one tensor (`ffn_gate_up_exps`; deepseek2).
    pub fused_gate_up: bool,
    /// Transformer layers (deepseek2 adds a NextN block after them).
    pub layers: u32,
    /// Embedding width.
    pub embd: u32,
    /// Attention heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u32,
    /// Routed experts per layer.
    pub experts: u32,
    /// Experts each token is routed to.
    pub experts_used: u32,
    /// Hidden width of each expert's feed-forward network.
    pub expert_ff: u32,
    /// Training context length recorded in the file.
    pub ctx_len: u32,
    /// Random seed.
    pub seed: u64,
    /// Output weight type.
    pub out_type: OutputType,
    /// Tensor data alignment in bytes (`general.alignment`).
    pub alignment: u64,
    /// Split into files of at most this many tensors (the first file holds only metadata).
    pub split_max_tensors: Option<u32>,
    /// A chat template stored as `tokenizer.chat_template` (llama.cpp recognises templates by
    /// their text, or by a name such as `chatml`).
    pub chat_template: Option<String>,
    /// How the router spreads tokens over experts.
    pub routing: Routing,
    /// Token-to-token reuse (skewed gpt-oss routing only): how many times more often consecutive
    /// tokens share their first-choice expert than independent tokens ([`reuse`]); `None`
    /// leaves the attention random.
    pub reuse: Option<f64>,
    /// A thousand common English words in the vocabulary besides the byte tokens (the demo
    /// model: random weights then print words).
    pub words: bool,
    /// Width of each attention head (`attention.key_length`); `None`: `embd / heads`. A real
    /// model's (Qwen3-30B-A3B: 128 with 32 heads of a 2048 embedding) gives its KV cache's and
    /// attention weights' real size.
    pub key_length: Option<u32>,
    /// Pad the vocabulary with unused tokens to this many (a real model's, for the size of its
    /// embedding and output matrices and the output product's work); `None`: none.
    pub vocab_size: Option<u32>,
    /// A token the weights favour at every position (a model that keeps writing it, for testing
    /// what a grammar bounds): one printable ASCII character (its byte token) or a token of the
    /// vocabulary such as a chat marker; `None`: random weights alone.
    pub favour: Option<String>,
    /// gpt-oss's sliding window, tokens (`attention.sliding_window`); `None`: 16, short so the
    /// gates' prompts cross it (gpt-oss's own is 128).
    pub sliding_window: Option<u32>,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            arch: SynthArch::Qwen3moe,
            fused_gate_up: false,
            layers: 2,
            embd: 256,
            heads: 4,
            kv_heads: 2,
            experts: 8,
            experts_used: 2,
            expert_ff: 256,
            ctx_len: 4096,
            seed: 42,
            out_type: OutputType::F16,
            alignment: 32,
            split_max_tensors: None,
            chat_template: None,
            routing: Routing::Uniform,
            reuse: None,
            words: false,
            key_length: None,
            vocab_size: None,
            favour: None,
            sliding_window: None,
        }
    }
}

impl SynthSpec {
    /// Dimension of each attention head.
    pub fn head_dim(&self) -> u32 {
        self.key_length.unwrap_or(self.embd / self.heads.max(1))
    }

    /// Checks the parameters against each other and against the output type's block width.
    pub fn validate(&self) -> Result<(), SynthError> {
        let nonzero = [
            ("layers", self.layers),
            ("embd", self.embd),
            ("heads", self.heads),
            ("kv-heads", self.kv_heads),
            ("experts", self.experts),
            ("experts-used", self.experts_used),
            ("expert-ff", self.expert_ff),
            ("ctx", self.ctx_len),
        ];
        for (field, v) in nonzero {
            if v == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if self.key_length == Some(0) {
            return Err(invalid("head-dim", "must be at least 2"));
        }
        if (self.key_length.is_none() && self.embd % self.heads != 0) || self.head_dim() % 2 != 0 {
            return Err(invalid(
                "heads",
                format!("--embd {} must split into {} heads of an even width", self.embd, self.heads),
            ));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(invalid("kv-heads", format!("{} does not divide --heads {}", self.kv_heads, self.heads)));
        }
        if self.experts_used > self.experts {
            return Err(invalid(
                "experts-used",
                format!("{} is more than --experts {}", self.experts_used, self.experts),
            ));
        }
        let w = self.out_type.block_width();
        for (field, v) in [("embd", self.embd), ("expert-ff", self.expert_ff)] {
            if v % w != 0 {
                return Err(invalid(
                    field,
                    format!("{v} is not a multiple of {w}, the block width of {:?}", self.out_type),
                ));
            }
        }
        let base = super::vocab::n_vocab(self.words, self.chat_template.as_deref(), None);
        if self.vocab_size.is_some_and(|v| u64::from(v) < base) {
            return Err(invalid("vocab", format!("is below the {base} tokens the vocabulary has without padding")));
        }
        if self.favour.is_some() && !matches!(self.out_type, OutputType::F16 | OutputType::F32) {
            return Err(invalid("favour", "needs --type f16 or f32 (the marked weights are written as values)"));
        }
        if let Some(text) = &self.favour {
            if super::vocab::token_id(text, self.words, self.chat_template.as_deref()).is_none() {
                return Err(invalid(
                    "favour",
                    format!("{text:?} is neither one printable ASCII character nor a token of the vocabulary (such as a marker of --chat-template)"),
                ));
            }
        }
        if self.alignment < 8 || !self.alignment.is_power_of_two() {
            return Err(invalid("alignment", format!("{} is not a power of two of at least 8", self.alignment)));
        }
        arch::validate(self).map_err(|(field, reason)| invalid(field, reason))?;
        self.validate_routing()?;
        if self.split_max_tensors == Some(0) {
            return Err(invalid("split-max-tensors", "must be at least 1"));
        }
        if self.split_max_tensors.is_some() && self.out_type.quant().is_some() {
            return Err(invalid(
                "split-max-tensors",
                "split output is written directly and supports --type f32 or f16 only; quantize first, or drop the split",
            ));
        }
        Ok(())
    }

    /// Checks skewed routing (its architecture, spread and calibration) and token-to-token
    /// reuse (which needs skewed routing).
    fn validate_routing(&self) -> Result<(), SynthError> {
        if let Routing::Skewed(sigma) = self.routing {
            if self.arch != SynthArch::GptOss {
                return Err(invalid(
                    "routing",
                    format!(
                        "skewed routing is written as a router bias, which {} has not; use --arch gpt-oss",
                        self.arch.name()
                    ),
                ));
            }
            if !(sigma.is_finite() && sigma >= 0.0) {
                return Err(invalid("skew", format!("{sigma} is not a spread of at least 0")));
            }
            routing::routed_chances(self.experts, self.experts_used, sigma)
                .map_err(|e| invalid("skew", e.to_string()))?;
        }
        if let Some(r) = self.reuse {
            if !matches!(self.routing, Routing::Skewed(_)) {
                return Err(invalid(
                    "reuse",
                    "token-to-token reuse is calibrated with skewed routing: add --routing skewed",
                ));
            }
            if !(r.is_finite() && (1.0..=reuse::MAX_REUSE).contains(&r)) {
                return Err(invalid(
                    "reuse",
                    format!(
                        "{r} is not between 1 (no reuse) and {} times the repeats of independent tokens",
                        reuse::MAX_REUSE
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
