//! Malformed models by family, derived from what llama.cpp asserts on: each mutant changes one
//! relation the loader, a verified architecture's graph, `build_moe_ffn`, the vocabulary or
//! ggml's CPU ops rely on (norm and float keys, rotary parameters, attention widths, per-layer
//! head and expert arrays, gating and groups, tensor types per role, split counts, NextN layouts,
//! sliding windows, tokenizers, array element types), on every base (qwen3moe f16 and Q8_0,
//! deepseek2 with a NextN block, deepseek2 with fused experts, gpt-oss). Every mutant goes
//! through `plan`, `run` and `run --resident`: no signal, no panic, no hang, and where both runs
//! succeed, the streamed text is the resident text.

use std::collections::BTreeMap;
use std::path::Path;

mod common;
mod fuzzing;
use common::sluice_command;
use fuzzing::{run, ty, Gguf, Rng, Value};

/// The mutation families.
const FAMILIES: [&str; 12] = [
    "norm and float keys",
    "rotary parameters",
    "attention widths",
    "per-layer heads",
    "experts per layer",
    "gating and groups",
    "tensor types per role",
    "split counts",
    "nextn layouts",
    "sliding window",
    "tokenizer",
    "array element types",
];

const FLOATS: [f32; 9] = [f32::NAN, -1.0, -1e-6, f32::INFINITY, f32::NEG_INFINITY, 0.0, 1e-30, 1e30, 1e-5];
const WIDTHS: [u32; 12] = [0, 1, 2, 16, 31, 32, 63, 64, 65, 128, 4096, u32::MAX];

/// The number of layers (block_count) of `g`.
fn layers(g: &Gguf) -> u32 {
    g.get(&g.arch_key("block_count")).and_then(Value::as_u64).unwrap() as u32
}

/// A per-layer array of `n` values picked from `from`, or now and then of the wrong length.
fn per_layer(rng: &mut Rng, n: u32, from: &[u32]) -> Value {
    let len = match rng.below(6) {
        0 => 0,
        1 => n.saturating_sub(1),
        2 => n + 1,
        _ => n,
    };
    Value::u32s(&(0..len).map(|_| rng.pick(from)).collect::<Vec<_>>())
}

/// Applies one mutation of `family` to `g`; returns what it did and, for a split count, the
/// file name suffix the file must carry.
fn mutate(g: &mut Gguf, family: &str, rng: &mut Rng) -> (String, Option<String>) {
    let n = layers(g);
    let experts = g.get(&g.arch_key("expert_count")).and_then(Value::as_u64).unwrap_or(0) as u32;
    let set = |g: &mut Gguf, key: String, v: Value, shown: String| {
        g.set(&key, v);
        format!("{key} = {shown}")
    };
    let what = match family {
        "norm and float keys" => {
            let key = rng.pick(&[
                "attention.layer_norm_rms_epsilon",
                "attention.layer_norm_epsilon",
                "attention.temperature_scale",
                "rope.freq_base",
                "rope.freq_base_swa",
                "rope.scaling.factor",
                "rope.scaling.attn_factor",
            ]);
            let v = rng.pick(&FLOATS);
            set(g, g.arch_key(key), Value::f32(v), v.to_string())
        }
        "rotary parameters" => match rng.below(3) {
            0 => {
                let v = rng.pick(&[0, 1, 3, 6, 16, 32, 48, 64, 66, 128, 1 << 20, u32::MAX]);
                set(
                    g,
                    g.arch_key(rng.pick(&["rope.dimension_count", "rope.dimension_count_swa"])),
                    Value::u32(v),
                    v.to_string(),
                )
            }
            _ => {
                let s = rng.pick(&["none", "linear", "yarn", "longrope", "bogus", "", " yarn", "YARN"]);
                set(g, g.arch_key("rope.scaling.type"), Value::string(s), format!("{s:?}"))
            }
        },
        "attention widths" => {
            let key = rng.pick(&[
                "attention.key_length",
                "attention.value_length",
                "attention.key_length_swa",
                "attention.value_length_swa",
                "attention.key_length_mla",
                "attention.value_length_mla",
                "attention.kv_lora_rank",
                "embedding_length",
            ]);
            let v = rng.pick(&WIDTHS);
            set(g, g.arch_key(key), Value::u32(v), v.to_string())
        }
        "per-layer heads" => {
            let key = g.arch_key(rng.pick(&["attention.head_count", "attention.head_count_kv"]));
            if rng.below(3) == 0 {
                let v = rng.pick(&[0, 1, 2, 3, 4, 8, u32::MAX]);
                set(g, key, Value::u32(v), v.to_string())
            } else {
                let v = per_layer(rng, n, &[0, 1, 2, 4, 8]);
                set(g, key, v, "a per-layer array".into())
            }
        }
        "experts per layer" => {
            let key = g.arch_key("expert_used_count");
            if rng.below(4) == 0 {
                let v = rng.pick(&[0, 1, 2, experts.saturating_sub(1), experts, experts + 1]);
                set(g, key, Value::u32(v), v.to_string())
            } else {
                let v = per_layer(rng, n, &[0, 1, 2, 3, experts, experts + 1]);
                set(g, key, v, "a per-layer array".into())
            }
        }
        "gating and groups" => {
            let (key, v) = match rng.below(4) {
                0 => ("expert_gating_func", rng.below(8) as u32),
                1 => ("expert_group_count", rng.pick(&[0, 1, 2, 3, 4, 8, 16])),
                2 => ("expert_group_used_count", rng.pick(&[0, 1, 2, 3, 8])),
                _ => ("expert_count", rng.pick(&[0, 1, experts.saturating_sub(1), experts + 1, 2048])),
            };
            set(g, g.arch_key(key), Value::u32(v), v.to_string())
        }
        "tensor types per role" => {
            let i = rng.below(g.tensors.len());
            let t = rng.pick(&[0u32, 1, 8, 24, 25, 26, 27, 28, 30]);
            let name = g.tensors[i].name.clone();
            g.retype(i, t);
            format!("tensor {name} retyped {t}")
        }
        "split counts" => {
            let (v, shown) = match rng.below(3) {
                0 => (Value::u32(u32::MAX), "4294967295 (u32)".to_string()),
                _ => {
                    let c = rng.pick(&[0u16, 1, 2, 3, 100, u16::MAX]);
                    (Value::u16(c), c.to_string())
                }
            };
            let count = v.as_u64().unwrap();
            g.set("split.no", Value::u16(0));
            let what = set(g, "split.count".into(), v, shown);
            let suffix = (rng.below(2) == 0).then(|| format!("-00001-of-{count:05}.gguf"));
            return (what, suffix);
        }
        "nextn layouts" => {
            let v = rng.pick(&[0, 1, n.saturating_sub(1), n, n + 1]);
            set(g, g.arch_key("nextn_predict_layers"), Value::u32(v), v.to_string())
        }
        "sliding window" => match rng.below(3) {
            0 => {
                let v = rng.pick(&[0, 1, 128, u32::MAX]);
                set(g, g.arch_key("attention.sliding_window"), Value::u32(v), v.to_string())
            }
            1 => {
                let v = rng.pick(&[0, 1, 2, 3, n + 5]);
                set(g, g.arch_key("attention.sliding_window_pattern"), Value::u32(v), v.to_string())
            }
            _ => {
                let v = per_layer(rng, n, &[0, 1]);
                set(g, g.arch_key("attention.sliding_window_pattern"), v, "a per-layer array".into())
            }
        },
        "tokenizer" => match rng.below(3) {
            0 => {
                let m = rng.pick(&["bert", "t5", "rwkv", "plamo2", "none", "no_vocab", "llama", "gpt2", "bogus"]);
                set(g, "tokenizer.ggml.model".into(), Value::string(m), format!("{m:?}"))
            }
            1 => {
                let key = rng.pick(&[
                    "tokenizer.ggml.bos_token_id",
                    "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.seperator_token_id",
                ]);
                let v = rng.pick(&[u32::MAX, 0, 1 << 20]);
                set(g, key.into(), Value::u32(v), v.to_string())
            }
            _ => {
                let key = rng.pick(&[
                    "tokenizer.ggml.add_bos_token",
                    "tokenizer.ggml.add_eos_token",
                    "tokenizer.ggml.add_sep_token",
                ]);
                set(g, key.into(), Value { ty: ty::BOOL, bytes: vec![1] }, "true".into())
            }
        },
        _ => {
            let key = g.arch_key(rng.pick(&[
                "expert_used_count",
                "attention.head_count",
                "attention.head_count_kv",
                "feed_forward_length",
                "expert_feed_forward_length",
            ]));
            let v = match rng.below(3) {
                0 => Value::array(ty::F32, &vec![2.0f32.to_le_bytes().to_vec(); n as usize]),
                1 => Value::array(ty::U8, &vec![vec![2u8]; n as usize]),
                _ => Value::array(ty::I32, &vec![(-2i32).to_le_bytes().to_vec(); n as usize]),
            };
            set(g, key, v, "an array of another type".into())
        }
    };
    (what, None)
}

#[test]
fn malformed_metadata_by_family_never_crashes_and_streams_as_resident() {
    let dir = tempfile::tempdir().unwrap();
    let bases: Vec<(&str, Gguf)> = [
        ("qwen3moe f16", &[][..]),
        ("qwen3moe q8_0", &["--type", "q8_0"][..]),
        ("deepseek2 nextn", &["--arch", "deepseek2", "--layers", "3"][..]),
        ("deepseek2 fused", &["--arch", "deepseek2", "--layers", "3", "--fused-gate-up"][..]),
        ("gpt-oss", &["--arch", "gpt-oss"][..]),
    ]
    .iter()
    .map(|(name, extra)| {
        let path = dir.path().join("base.gguf");
        let o = sluice_command().args(["synth", "--out", path.to_str().unwrap()]).args(*extra).output().unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        (*name, Gguf::parse(&std::fs::read(&path).unwrap()))
    })
    .collect();
    let emulated = common::emulated();
    // 600 mutants: each family on each base ten times (12 x 5 x 10), three runs each.
    let n = if emulated { 2 * FAMILIES.len() } else { 600 };
    let modes: [&[&str]; 3] = [
        &["plan", "--model", "M"],
        &["run", "-m", "M", "-p", "hi", "-n", "3"],
        &["run", "-m", "M", "-p", "hi", "-n", "3", "--resident"],
    ];
    let mut by_family: BTreeMap<&str, BTreeMap<&str, usize>> = BTreeMap::new();
    let (mut bad, mut compared) = (Vec::new(), 0);
    for i in 0..n {
        let mut rng = Rng::of(i);
        // Every family in turn, each on every base in turn.
        let family = FAMILIES[i % FAMILIES.len()];
        let (base_name, base) = &bases[(i / FAMILIES.len() + i) % bases.len()];
        let mut g = base.clone();
        let (what, suffix) = mutate(&mut g, family, &mut rng);
        let name = format!("m{i}{}", suffix.as_deref().unwrap_or(".gguf"));
        let path = dir.path().join(name);
        std::fs::write(&path, g.write()).unwrap();
        let runs: Vec<_> = modes.iter().map(|m| run(&path, m)).collect();
        for (mode, r) in modes.iter().zip(&runs) {
            *by_family.entry(family).or_default().entry(r.outcome).or_default() += 1;
            if !matches!(r.outcome, "ok" | "clean error") {
                // SLUICE_FUZZ_KEEP=DIR keeps the failing inputs for a closer look.
                if let Some(keep) = std::env::var_os("SLUICE_FUZZ_KEEP") {
                    let _ = std::fs::copy(&path, Path::new(&keep).join(path.file_name().unwrap()));
                }
                bad.push(format!("{base_name}, {what}: `sluice {}`: {}", mode.join(" "), r.outcome));
            }
        }
        if runs[1].outcome == "ok" && runs[2].outcome == "ok" {
            compared += 1;
            if runs[1].stdout != runs[2].stdout {
                bad.push(format!(
                    "{base_name}, {what}: streamed {:?} != resident {:?}",
                    String::from_utf8_lossy(&runs[1].stdout),
                    String::from_utf8_lossy(&runs[2].stdout)
                ));
            }
        }
        std::fs::remove_file(&path).unwrap();
    }
    println!("{} runs of {n} mutants, streamed == resident on {compared}:", n * modes.len());
    for (family, counts) in &by_family {
        println!("  {family}: {counts:?}");
    }
    assert!(bad.is_empty(), "{} bad outcomes:\n{}", bad.len(), bad[..bad.len().min(40)].join("\n"));
    assert!(compared > n / 10, "too few mutants ran in both modes to compare: {compared}");
}
