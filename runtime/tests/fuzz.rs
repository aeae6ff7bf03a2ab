//! Malformed models never crash sluice: deterministic mutations of fixtures' headers and
//! tensor-info region (flipped bits, extreme values, truncations, absurd counts, dims, types,
//! offsets, alignments, expert counts, duplicate token strings) go through `sluice plan`,
//! `sluice run` and `sluice run --resident`. Each must succeed or fail with an error message:
//! no signal, no panic, no hang.

use std::collections::BTreeMap;
use std::path::Path;

mod common;
mod fuzzing;
use common::sluice_command;
use fuzzing::{run, skip_value, u32_at, u64_at, Rng};

/// Where the fields of a GGUF header are: value offsets of the metadata, and the tensor infos.
struct Layout {
    /// Key name, value type, offset of the value.
    kvs: Vec<(String, u32, usize)>,
    /// Offsets of each tensor info's n_dims, its dims, its type and its data offset.
    tensors: Vec<(usize, Vec<usize>, usize, usize)>,
    /// End of the tensor infos.
    end: usize,
}

fn layout(b: &[u8]) -> Layout {
    let (n_tensors, n_kv) = (u64_at(b, 8), u64_at(b, 16));
    let mut p = 24;
    let mut kvs = Vec::new();
    for _ in 0..n_kv {
        let len = u64_at(b, p) as usize;
        let key = String::from_utf8_lossy(&b[p + 8..p + 8 + len]).into_owned();
        let ty = u32_at(b, p + 8 + len);
        let value = p + 12 + len;
        kvs.push((key, ty, value));
        p = skip_value(b, ty, value);
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        p += 8 + u64_at(b, p) as usize;
        let n_dims = u32_at(b, p);
        let dims = (0..n_dims as usize).map(|i| p + 4 + 8 * i).collect();
        let ty = p + 4 + 8 * n_dims as usize;
        tensors.push((p, dims, ty, ty + 4));
        p = ty + 12;
    }
    Layout { kvs, tensors, end: p }
}

const EXTREME_U32: [u32; 10] = [0, 1, 2, 3, 16, 31, 513, 1025, 0x8000_0000, u32::MAX];
const EXTREME_U64: [u64; 7] = [0, 1, 1 << 31, 1 << 40, 1 << 62, u64::MAX, 12_345_678_901];

/// One mutation of `base`; returns the bytes and what was done.
fn mutate(base: &[u8], l: &Layout, rng: &mut Rng) -> (Vec<u8>, &'static str) {
    let mut b = base.to_vec();
    let kind = match rng.below(9) {
        0 => {
            for _ in 0..1 + rng.below(4) {
                let p = rng.below(l.end);
                b[p] ^= 1 << rng.below(8);
            }
            "flipped bits"
        }
        1 => {
            let p = rng.below(l.end - 8) & !3;
            b[p..p + 4].copy_from_slice(&rng.pick(&EXTREME_U32).to_le_bytes());
            "extreme field"
        }
        2 => {
            b.truncate(rng.below(l.end + 8192));
            "truncated"
        }
        3 => {
            let wanted = [
                "block_count",
                "expert_count",
                "expert_used_count",
                "context_length",
                "embedding_length",
                "head_count",
                "head_count_kv",
                "feed_forward_length",
                "expert_feed_forward_length",
                "general.alignment",
            ];
            let candidates: Vec<_> =
                l.kvs.iter().filter(|(k, ty, _)| *ty == 4 && wanted.iter().any(|w| k.ends_with(w))).collect();
            let (_, _, p) = candidates[rng.below(candidates.len())];
            b[*p..*p + 4].copy_from_slice(&rng.pick(&EXTREME_U32).to_le_bytes());
            "metadata count"
        }
        4 => {
            let (_, _, p) = l.kvs.iter().find(|(k, _, _)| k == "tokenizer.ggml.tokens").expect("tokens");
            // Copy one token string over another of the same length.
            let (n, mut q) = (u64_at(&b, p + 4), p + 12);
            let mut strings = Vec::new();
            for _ in 0..n {
                let len = u64_at(&b, q) as usize;
                strings.push((q + 8, len));
                q += 8 + len;
            }
            let (a, len) = strings[rng.below(strings.len())];
            if let Some(&(c, _)) = strings.iter().filter(|(c, l2)| *l2 == len && *c != a).nth(rng.below(4)) {
                let src = b[a..a + len].to_vec();
                b[c..c + len].copy_from_slice(&src);
            }
            "duplicate token"
        }
        5 => {
            let (n_dims, dims, _, _) = &l.tensors[rng.below(l.tensors.len())];
            if dims.is_empty() || rng.below(3) == 0 {
                b[*n_dims..*n_dims + 4].copy_from_slice(&rng.pick(&[0u32, 5, 255, u32::MAX]).to_le_bytes());
            } else {
                let d = dims[rng.below(dims.len())];
                b[d..d + 8].copy_from_slice(&rng.pick(&EXTREME_U64).to_le_bytes());
            }
            "tensor dims"
        }
        6 => {
            let (_, _, ty, _) = l.tensors[rng.below(l.tensors.len())];
            let v = rng.pick(&[4u32, 5, 31, 39, 40, 1000, u32::MAX]);
            b[ty..ty + 4].copy_from_slice(&v.to_le_bytes());
            "tensor type"
        }
        7 => {
            let (_, _, _, off) = l.tensors[rng.below(l.tensors.len())];
            let v = rng.pick(&[1u64, 31, 4096 + 7, 1 << 40, u64::MAX, 0]);
            b[off..off + 8].copy_from_slice(&v.to_le_bytes());
            "tensor offset"
        }
        _ => {
            let at = rng.pick(&[8usize, 16]);
            b[at..at + 8].copy_from_slice(&rng.pick(&EXTREME_U64).to_le_bytes());
            "header counts"
        }
    };
    (b, kind)
}

#[test]
fn malformed_models_never_crash_sluice() {
    let dir = tempfile::tempdir().unwrap();
    // Two layouts take turns: the default qwen3moe, and deepseek2 (a NextN block, a leading dense
    // layer, expert groups), whose extra metadata the mutations reach too.
    let bases: Vec<(Vec<u8>, Layout)> = [&[][..], &["--arch", "deepseek2", "--layers", "3"][..]]
        .iter()
        .enumerate()
        .map(|(k, extra)| {
            let path = dir.path().join(format!("base{k}.gguf"));
            let o = sluice_command().args(["synth", "--out", path.to_str().unwrap()]).args(*extra).output().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let bytes = std::fs::read(&path).unwrap();
            let l = layout(&bytes);
            (bytes, l)
        })
        .collect();
    // Emulated (qemu) runs are slow: fewer mutations there.
    let emulated = common::emulated();
    let n = if emulated { 40 } else { 600 };
    let modes: [&[&str]; 3] = [
        &["plan", "--model", "M"],
        &["run", "-m", "M", "-p", "hi", "-n", "2"],
        &["run", "-m", "M", "-p", "hi", "-n", "2", "--resident"],
    ];
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut bad = Vec::new();
    let path = dir.path().join("mutated.gguf");
    for i in 0..n {
        let mut rng = Rng::of(i);
        let (base, l) = &bases[i % bases.len()];
        let (bytes, kind) = mutate(base, l, &mut rng);
        std::fs::write(&path, &bytes).unwrap();
        for mode in modes {
            let what = run(&path, mode).outcome;
            *counts.entry(what).or_default() += 1;
            if !matches!(what, "ok" | "clean error") {
                // SLUICE_FUZZ_KEEP=DIR keeps the failing inputs for a closer look.
                if let Some(keep) = std::env::var_os("SLUICE_FUZZ_KEEP") {
                    let _ = std::fs::copy(&path, Path::new(&keep).join(format!("mutation-{i}.gguf")));
                }
                bad.push(format!("mutation {i} ({kind}) through `sluice {}`: {what}", mode.join(" ")));
            }
        }
    }
    println!("{} runs of {n} mutations: {counts:?}", n * modes.len());
    assert!(
        bad.is_empty(),
        "{} bad outcomes of {}:\n{}",
        bad.len(),
        n * modes.len(),
        bad[..bad.len().min(30)].join("\n")
    );
    assert!(
        counts.get("clean error").copied().unwrap_or(0) > n,
        "the mutations must mostly break the file: {counts:?}"
    );
}
