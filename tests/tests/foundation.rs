//! Foundation gates: fixtures are deterministic and have the layouts they promise, and every
//! variant loads and generates the same greedy text on repeated runs and thread counts.

use ggml_sys::{GgmlType, GgufFile};
use sluice::generate::load_model;
use sluice_tests::{greedy_tokens, Fixture};

#[test]
fn fixture_generation_is_deterministic() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    for f in Fixture::ALL {
        let fa = f.write(a.path());
        let fb = f.write(b.path());
        assert_eq!(fa.len(), fb.len(), "{f:?}");
        for (x, y) in fa.iter().zip(&fb) {
            let (bx, by) = (std::fs::read(x).unwrap(), std::fs::read(y).unwrap());
            assert!(bx == by, "{f:?}: {} and {} differ", x.display(), y.display());
        }
    }
}

#[test]
fn a_different_seed_gives_different_weights() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Fixture::F16.spec();
    let a = sluice::synth::synthesize(&spec, &dir.path().join("a.gguf"), 1).unwrap();
    let other = sluice::synth::SynthSpec { seed: spec.seed + 1, ..spec };
    let b = sluice::synth::synthesize(&other, &dir.path().join("b.gguf"), 1).unwrap();
    assert_ne!(std::fs::read(&a.files[0]).unwrap(), std::fs::read(&b.files[0]).unwrap());
}

fn expert_tensors(files: &[std::path::PathBuf]) -> Vec<ggml_sys::GgufTensor> {
    files
        .iter()
        .flat_map(|f| GgufFile::open(f).unwrap().tensors().to_vec())
        .filter(|t| t.name.ends_with("_exps.weight"))
        .collect()
}

/// Routed expert tensors in fixture `f`'s files: the kinds per MoE block (gate, up, down; or
/// fused gate/up, down) times the blocks. Every layer is a MoE block, except deepseek2's leading
/// dense layer, for which its NextN block makes up.
fn expected_experts(f: Fixture) -> usize {
    let spec = f.spec();
    let kinds = if spec.fused_gate_up { 2 } else { 3 };
    kinds * spec.layers as usize
}

#[test]
fn fixtures_have_the_promised_layouts() {
    let dir = tempfile::tempdir().unwrap();
    for f in Fixture::ALL {
        let files = f.write(dir.path());
        let experts = expert_tensors(&files);
        let spec = f.spec();
        assert_eq!(experts.len(), expected_experts(f), "{f:?}");
        for t in &experts {
            assert_eq!(t.ne[2], i64::from(spec.experts), "{f:?} {}", t.name);
            match f {
                Fixture::F32 | Fixture::Deepseek2Fused => assert_eq!(t.ty, GgmlType::F32),
                Fixture::F16 | Fixture::Aligned4096 | Fixture::Split | Fixture::Deepseek2 => {
                    assert_eq!(t.ty, GgmlType::F16)
                }
                Fixture::GptOss | Fixture::GptOssDrawn => assert_eq!(t.ty, GgmlType::MXFP4, "{}", t.name),
                Fixture::Q8_0 | Fixture::OddQ8_0 | Fixture::Trained | Fixture::TrainedBoard => {
                    assert_eq!(t.ty, GgmlType::Q8_0, "{}", t.name)
                }
                Fixture::Q4KM => assert!(t.ty == GgmlType::Q4_K || t.ty == GgmlType::Q6_K, "{} is {}", t.name, t.ty),
                Fixture::Q6K => assert_eq!(t.ty, GgmlType::Q6_K),
                Fixture::Bf16 => assert_eq!(t.ty, GgmlType::BF16),
            }
        }
        match f {
            Fixture::OddQ8_0 => {
                let stride = experts[0].nb()[2];
                assert_eq!(stride, 96 * 102);
                assert_ne!(stride % 4096, 0, "the odd fixture must have slices that are not page multiples");
            }
            Fixture::Aligned4096 => {
                let g = GgufFile::open(&files[0]).unwrap();
                assert_eq!(g.alignment(), 4096);
                assert!(g.tensors().iter().all(|t| t.offset % 4096 == 0));
            }
            Fixture::Split => {
                assert_eq!(files.len(), 5);
                let first = GgufFile::open(&files[0]).unwrap();
                assert!(first.tensors().is_empty(), "the first split file holds only metadata");
                assert_eq!(first.get_u64("split.count"), Some(5));
                assert_eq!(first.architecture().as_deref(), Some("qwen3moe"));
            }
            _ => {}
        }
    }
}

#[test]
fn every_variant_generates_the_same_greedy_text_on_repeat_and_across_thread_counts() {
    let dir = tempfile::tempdir().unwrap();
    for f in Fixture::ALL {
        let files = f.write(dir.path());
        let model = load_model(&files[0]).unwrap_or_else(|e| panic!("{f:?}: {e}"));
        let reference = greedy_tokens(&model, 24, 1);
        assert_eq!(reference.len(), 24, "{f:?} stopped early");
        let distinct: std::collections::BTreeSet<_> = reference.iter().collect();
        assert!(distinct.len() > 3, "{f:?} generates a degenerate sequence: {reference:?}");
        assert_eq!(greedy_tokens(&model, 24, 1), reference, "{f:?}: second run, 1 thread");
        assert_eq!(greedy_tokens(&model, 24, 2), reference, "{f:?}: 2 threads");
    }
}

#[test]
fn a_cancelled_tokenization_stops_and_the_next_one_is_whole() {
    let dir = tempfile::tempdir().unwrap();
    let files = Fixture::F16.write(dir.path());
    let model = load_model(&files[0]).unwrap();
    let text = "the quick brown fox jumps over the lazy dog ".repeat(2000);
    let whole = model.tokenize_with(&text, true, true).unwrap();
    let flag = std::sync::atomic::AtomicBool::new(false);
    assert_eq!(model.tokenize_cancellable(&text, true, true, &flag).unwrap(), whole);
    // Set: llama.cpp's tokenizer stops in its loops, with or without special-token parsing.
    flag.store(true, std::sync::atomic::Ordering::Relaxed);
    for parse_special in [true, false] {
        let r = model.tokenize_cancellable(&text, true, parse_special, &flag);
        assert!(matches!(r, Err(ggml_sys::Error::TokenizeCancelled)), "parse_special {parse_special}: {r:?}");
    }
    // The flag does not outlive its call: this thread's next tokenization is whole.
    assert_eq!(model.tokenize_with(&text, true, true).unwrap(), whole);
}
