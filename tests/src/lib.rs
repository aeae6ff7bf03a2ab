//! Test fixtures for sluice's end-to-end gates: small synthetic MoE models, generated
//! deterministically by `sluice synth`'s library into a test's own directory, and helpers to run
//! them.

use std::path::{Path, PathBuf};

use ggml_sys::Token;
use sluice::generate::{self, GenerateParams};
use sluice::synth::{self, OutputType, SynthArch, SynthSpec};

/// The fixture variants every gate runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fixture {
    /// f32 weights.
    F32,
    /// f16 matrices.
    F16,
    /// Q8_0 (through llama_model_quantize).
    Q8_0,
    /// Q4_K_M (through llama_model_quantize).
    Q4KM,
    /// Q6_K (through llama_model_quantize).
    Q6K,
    /// Q8_0 with widths of 96: expert slices of 9792 bytes, not a multiple of 4096.
    OddQ8_0,
    /// f16 with every tensor's data aligned to 4096 bytes.
    Aligned4096,
    /// f16 split into five files, the first holding only metadata.
    Split,
    /// deepseek2 (f16): latent attention, a shared expert, sigmoid routing with expert groups,
    /// a leading dense layer and a NextN block.
    Deepseek2,
    /// deepseek2 (f32) with each layer's gate and up experts fused in one tensor.
    Deepseek2Fused,
    /// gpt-oss with per-expert biases and MXFP4 experts (Q8_0 elsewhere).
    GptOss,
    /// bf16 matrices (through llama_model_quantize).
    Bf16,
    /// gpt-oss-120b's recipe (`make bench-board-120b`) at a gate's size: the Q4_K_M mix's types
    /// drawn directly (`q4_k_m-drawn`), MXFP4 experts, rows of 288 where Q5_0 and Q8_0 stand in
    /// for the k-quants as llama.cpp's fallback gives them.
    GptOssDrawn,
    /// The small KJV model trained by `trainer/make-model small` (Q8_0): a trained router, real
    /// language. Its path comes from `SLUICE_TRAINED_MODEL` (`make test` trains it, once per
    /// machine, and sets it); it has no synth parameters.
    Trained,
    /// The small board-shaped KJV model trained by `trainer/make-model board-small` (Q8_0): a
    /// trained router over 128 experts, 8 routed, each expert padded with zero units to 256 wide.
    /// Its path comes from `SLUICE_TRAINED_BOARD_MODEL` (`make test` sets it).
    TrainedBoard,
}

impl Fixture {
    /// Every synthesized variant.
    pub const ALL: [Fixture; 13] = [
        Fixture::F32,
        Fixture::F16,
        Fixture::Q8_0,
        Fixture::Q4KM,
        Fixture::Q6K,
        Fixture::OddQ8_0,
        Fixture::Aligned4096,
        Fixture::Split,
        Fixture::Deepseek2,
        Fixture::Deepseek2Fused,
        Fixture::GptOss,
        Fixture::Bf16,
        Fixture::GptOssDrawn,
    ];

    /// The synth parameters of this variant (the trained model has none: it panics).
    pub fn spec(self) -> SynthSpec {
        let base = SynthSpec { seed: 7, ..SynthSpec::default() };
        match self {
            Fixture::F32 => SynthSpec { out_type: OutputType::F32, ..base },
            Fixture::F16 => base,
            Fixture::Q8_0 => SynthSpec { out_type: OutputType::Q8_0, ..base },
            Fixture::Q4KM => SynthSpec { out_type: OutputType::Q4KM, ..base },
            Fixture::Q6K => SynthSpec { out_type: OutputType::Q6K, ..base },
            Fixture::Bf16 => SynthSpec { out_type: OutputType::Bf16, ..base },
            Fixture::OddQ8_0 => {
                SynthSpec { out_type: OutputType::Q8_0, embd: 96, heads: 3, kv_heads: 1, expert_ff: 96, ..base }
            }
            Fixture::Aligned4096 => SynthSpec { alignment: 4096, ..base },
            Fixture::Split => SynthSpec { split_max_tensors: Some(7), ..base },
            Fixture::Deepseek2 => SynthSpec { arch: SynthArch::Deepseek2, layers: 3, ..base },
            Fixture::Deepseek2Fused => SynthSpec {
                arch: SynthArch::Deepseek2,
                fused_gate_up: true,
                layers: 3,
                out_type: OutputType::F32,
                ..base
            },
            Fixture::GptOss => SynthSpec { arch: SynthArch::GptOss, out_type: OutputType::Mxfp4Moe, ..base },
            Fixture::GptOssDrawn => SynthSpec {
                arch: SynthArch::GptOss,
                out_type: OutputType::Q4KMDrawn,
                embd: 288,
                expert_ff: 288,
                ..base
            },
            Fixture::Trained | Fixture::TrainedBoard => {
                panic!("the trained fixtures are made by trainer/make-model, not synthesized")
            }
        }
    }

    /// A file name for this variant.
    pub fn file_name(self) -> String {
        let name = format!("{self:?}").to_lowercase();
        match self {
            Fixture::Split => format!("{name}-00001-of-00005.gguf"),
            _ => format!("{name}.gguf"),
        }
    }

    /// Writes the fixture into `dir` and returns every file, the model's entry file first.
    pub fn write(self, dir: &Path) -> Vec<PathBuf> {
        let trained = match self {
            Fixture::Trained => Some(trained_model().expect("SLUICE_TRAINED_MODEL names the trained model")),
            Fixture::TrainedBoard => {
                Some(trained_board_model().expect("SLUICE_TRAINED_BOARD_MODEL names the board-shaped model"))
            }
            _ => None,
        };
        if let Some(from) = trained {
            let to = dir.join(self.file_name());
            std::fs::copy(&from, &to).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
            return vec![to];
        }
        let out = synth::synthesize(&self.spec(), &dir.join(self.file_name()), 2)
            .unwrap_or_else(|e| panic!("synthesizing fixture {self:?}: {e}"));
        out.files
    }
}

/// Writes fixture `f` into `dir` and indexes its experts: its files, the entry file first.
pub fn indexed_fixture(f: Fixture, dir: &Path) -> (Vec<PathBuf>, std::sync::Arc<sluice::stream::ExpertIndex>) {
    let files = f.write(dir);
    let index = sluice::stream::ExpertIndex::open(&files[0]).unwrap_or_else(|e| panic!("{f:?}: {e}"));
    (files, std::sync::Arc::new(index))
}

/// The prompt the gates generate from.
pub const PROMPT: &str = "The quick brown fox jumps over the lazy dog.";

/// Loads the model at `path` resident (llama.cpp's own load), returns its greedy continuation of
/// [`PROMPT`], and frees it: the reference the streaming gates compare against.
pub fn resident_reference(path: &Path, n_predict: u32) -> Vec<Token> {
    let model = generate::load_model(path).expect("load the resident reference");
    greedy_tokens(&model, n_predict, 2)
}

/// Returns the greedy continuation of [`PROMPT`] from an already loaded `model`.
pub fn greedy_tokens(model: &ggml_sys::Model, n_predict: u32, n_threads: u32) -> Vec<Token> {
    let params = GenerateParams {
        n_predict,
        threads: ggml_sys::Threads::unpinned(n_threads),
        draft: None,
        batch: sluice::generate::DEFAULT_BATCH,
        kv: Default::default(),
    };
    generate::generate(model, PROMPT, &params, |_, _| {}).expect("generation").tokens
}

/// Whether the tests run under an emulator (`make aarch64` sets `SLUICE_TEST_RUNNER` to
/// qemu-aarch64), where madvise is a hint and everything is slower.
pub fn emulated() -> bool {
    std::env::var_os("SLUICE_TEST_RUNNER").is_some_and(|r| !r.is_empty())
}

/// The trained model `SLUICE_TRAINED_MODEL` names (`make test` sets it), if any.
pub fn trained_model() -> Option<PathBuf> {
    std::env::var_os("SLUICE_TRAINED_MODEL").filter(|p| !p.is_empty()).map(PathBuf::from)
}

/// The small board-shaped trained model `SLUICE_TRAINED_BOARD_MODEL` names (`make test` sets
/// it), if any.
pub fn trained_board_model() -> Option<PathBuf> {
    std::env::var_os("SLUICE_TRAINED_BOARD_MODEL").filter(|p| !p.is_empty()).map(PathBuf::from)
}

/// The fixtures the streaming gates run on: `SLUICE_GATE_FIXTURES` (comma-separated lowercase
/// names, e.g. `f32,q8_0`) narrows them, as `make aarch64` does under emulation. The trained
/// models are among them where `SLUICE_TRAINED_MODEL` and `SLUICE_TRAINED_BOARD_MODEL` name them
/// (`make test` does; a plain `cargo test` says it runs without).
pub fn gate_fixtures() -> Vec<Fixture> {
    let mut all = vec![
        Fixture::F32,
        Fixture::Q8_0,
        Fixture::Q4KM,
        Fixture::Q6K,
        Fixture::OddQ8_0,
        Fixture::Split,
        Fixture::Deepseek2,
        Fixture::Deepseek2Fused,
        Fixture::GptOss,
        Fixture::Bf16,
        Fixture::GptOssDrawn,
    ];
    if trained_model().is_some() {
        all.push(Fixture::Trained);
    } else {
        eprintln!(
            "gate fixtures: SLUICE_TRAINED_MODEL is not set, so the trained model is left out (make test sets it)"
        );
    }
    if trained_board_model().is_some() {
        all.push(Fixture::TrainedBoard);
    } else {
        eprintln!(
            "gate fixtures: SLUICE_TRAINED_BOARD_MODEL is not set, so the board-shaped trained model is left out \
             (make test sets it)"
        );
    }
    match std::env::var("SLUICE_GATE_FIXTURES") {
        Ok(list) if !list.trim().is_empty() => {
            let wanted: Vec<String> = list.split(',').map(|s| s.trim().to_lowercase()).collect();
            all.into_iter().filter(|f| wanted.contains(&format!("{f:?}").to_lowercase())).collect()
        }
        _ => all,
    }
}

/// A streaming configuration for the gates.
pub fn stream_config(
    cache_bytes: u64,
    lanes: usize,
    direct: bool,
    dense: sluice::stream::DensePolicy,
) -> sluice::stream::StreamConfig {
    sluice::stream::StreamConfig {
        cache_bytes,
        force_cache: true,
        lanes: sluice::stream::LaneConfig {
            lanes,
            direct,
            max_request: 256 << 10,
            cpus: Vec::new(),
            bound: sluice::stream::READ_BOUND,
            fault: None,
            pace: None,
        },
        dense,
        trace_routes: true,
        cache_policy: sluice::stream::CachePolicy::Lru,
        // As much as the experts: a gate that checks the pool's sizing sets its own.
        expert_pool: Some(u64::MAX),
        gpu_layers: 0,
        overlap: None,
        overlap_decodes: sluice::stream::DecodeOverlap::Always,
        cores_load: sluice::stream::CoresLoad::Measured,
        lossy: sluice::lossy::Lossy::default(),
        rpc: None,
        verify: false,
        lookahead: false,
        force_routes: None,
        record_routes: false,
    }
}

/// What one streamed generation did.
#[derive(Debug)]
pub struct StreamRun {
    /// Generated tokens.
    pub tokens: Vec<Token>,
    /// Every layer's routed experts, per decode.
    pub trace: Vec<sluice::stream::RouteRecord>,
    /// Cache counters at the end.
    pub counters: sluice::stream::CacheCounters,
    /// Expert bytes read during the generation.
    pub bytes_read: u64,
    /// Whether shard 0 was read with O_DIRECT.
    pub direct: bool,
    /// Routed products the streamed-experts kernel computed, per single-token decode.
    pub kernel_nodes: Vec<u64>,
    /// Chosen experts replaced by cached ones (lossy substitution), per decode.
    pub substituted: Vec<u64>,
    /// The expert slot pools at the end.
    pub slots: sluice::stream::SlotUse,
    /// Experts read ahead on the lookahead's guess, and of those the ones then routed.
    pub lookahead: (u64, u64),
    /// Bytes of the lookahead's router copies at the end.
    pub router_copies: u64,
    /// The single-token decodes' layers whose reads overlapped compute.
    pub overlapped_layers: u64,
}

/// Generates greedily from [`PROMPT`] in an open streamed session.
pub fn stream_generate(
    session: &mut sluice::stream::StreamedSession<'_>,
    model: &ggml_sys::Model,
    n_predict: u32,
) -> StreamRun {
    let prompt = generate::Session::prepare(model, PROMPT, n_predict).expect("prompt");
    let (generation, rows) = session.generate(&prompt, n_predict, |_, _| {}, |_| {}).expect("streamed generation");
    let s = session.streamer();
    StreamRun {
        tokens: generation.tokens,
        trace: s.trace().to_vec(),
        counters: s.cache_counters(),
        bytes_read: rows.iter().map(|r| r.bytes_read).sum(),
        direct: s.lanes().is_direct(0),
        kernel_nodes: rows.iter().filter(|r| !r.prefill).map(|r| r.kernel_nodes).collect(),
        substituted: rows.iter().map(|r| r.substituted).collect(),
        lookahead: rows.iter().fold((0, 0), |(a, b), r| (a + r.lookahead_reads, b + r.lookahead_used)),
        router_copies: s.lookahead_bytes(),
        overlapped_layers: sluice::telemetry::Summary::of(&rows).overlapped_layers,
        slots: s.slots(),
    }
}

/// Opens a streamed session over `model` and generates once.
pub fn streamed(
    model: &ggml_sys::Model,
    index: std::sync::Arc<sluice::stream::ExpertIndex>,
    config: &sluice::stream::StreamConfig,
    n_predict: u32,
) -> StreamRun {
    let mut session = open_streamed(model, index, config, n_predict);
    stream_generate(&mut session, model, n_predict)
}

/// Opens a streamed session over `model` (two unpinned threads) that holds [`PROMPT`] and
/// `n_predict` tokens.
pub fn open_streamed<'m>(
    model: &'m ggml_sys::Model,
    index: std::sync::Arc<sluice::stream::ExpertIndex>,
    config: &sluice::stream::StreamConfig,
    n_predict: u32,
) -> sluice::stream::StreamedSession<'m> {
    let prompt_len = generate::Session::prepare(model, PROMPT, n_predict).expect("prompt").len();
    sluice::stream::StreamedSession::open(
        model,
        index,
        config,
        sluice::generate::ContextShape::one(prompt_len as u32 + n_predict),
        &ggml_sys::Threads::unpinned(2),
    )
    .expect("open streamed session")
}
