//! Which file(s) of a GGUF repository a name means: the repository's models grouped (a split
//! model's shards together, projector files left out), told apart by the quantization in their
//! names, and chosen by the QUANT of `owner/repo:QUANT` or by the default.
//!
//! The default is Q4_K_M, as llama.cpp's `-hf`, Ollama and the hub's own snippets choose: a
//! streamed model reads its routed experts from storage every token, so its speed is about
//! inversely proportional to the bits per weight; Q4_K_M is where quality loss stays small
//! (the quantization most board figures, ours included, are measured at), and a Q8_0 of the
//! same model reads 1.8 times the bytes a token. Without a Q4_K_M, the nearest 4-bit kinds come
//! next, then 5-, 3-, 6- and 8-bit ones; a repository with a single model needs no choice.

use std::collections::BTreeMap;

/// The default's order of preference.
const PREFERRED: [&str; 16] = [
    "Q4_K_M",
    "Q4_K_XL",
    "Q4_K_S",
    "IQ4_XS",
    "IQ4_NL",
    "Q4_0",
    "Q4_1",
    "MXFP4_MOE",
    "MXFP4",
    "Q5_K_M",
    "Q5_K_S",
    "Q3_K_L",
    "Q3_K_M",
    "Q3_K_XL",
    "Q6_K",
    "Q8_0",
];

/// One model of a repository: its files (one, or a split model's shards in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufSet {
    /// Its files, relative to the repository, the first (the one to load) first.
    pub files: Vec<String>,
    /// The quantization its name says, upper case.
    pub quant: Option<String>,
}

impl GgufSet {
    /// The file to load.
    pub fn first(&self) -> &str {
        &self.files[0]
    }
}

/// Why no file of a repository answers a name.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    /// No GGUF model at all.
    #[error("{repo} has no GGUF model file (files: {files})")]
    NoGguf {
        /// The repository.
        repo: String,
        /// What it has, shortened.
        files: String,
    },
    /// None of the asked quantization.
    #[error("{repo} has no {quant} file; it has {have}: name one as {repo}:QUANT")]
    NoSuchQuant {
        /// The repository.
        repo: String,
        /// What was asked.
        quant: String,
        /// What it has.
        have: String,
    },
    /// Several models and none preferred.
    #[error(
        "{repo} has several models and none of the default quantizations; it has {have}: name one as {repo}:QUANT"
    )]
    Ambiguous {
        /// The repository.
        repo: String,
        /// What it has.
        have: String,
    },
}

/// The split suffix of a shard's name: (the name before it, shard number, shard count).
fn split_parts(file: &str) -> Option<(&str, u32, u32)> {
    let stem = file.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, number) = rest.rsplit_once('-')?;
    let ok = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    (ok(number) && ok(count)).then(|| (prefix, number.parse().unwrap_or(0), count.parse().unwrap_or(0)))
}

/// Whether a word of a file name is a quantization's name (`Q4_K_M`, `IQ4_XS`, `BF16`, ...).
fn is_quant_word(w: &str) -> bool {
    let b = w.as_bytes();
    let numbered = |skip: usize| b.len() > skip && b[skip].is_ascii_digit();
    (w.starts_with('Q') && numbered(1))
        || ((w.starts_with("IQ") || w.starts_with("TQ")) && numbered(2))
        || matches!(w, "F16" | "F32" | "BF16" | "MXFP4" | "MXFP4_MOE")
}

/// The quantization a file's path names, upper case: its last word that is one.
pub fn quant_of(file: &str) -> Option<String> {
    let upper = file.to_ascii_uppercase();
    let upper = upper.strip_suffix(".GGUF").unwrap_or(&upper);
    upper.split(['-', '.', '/']).rfind(|w| is_quant_word(w)).map(str::to_string)
}

/// The repository's models: files ending in `.gguf`, projectors (`mmproj`) left out, a split
/// model's shards together and only when every shard is there.
pub fn gguf_sets(files: &[String]) -> Vec<GgufSet> {
    let mut splits: BTreeMap<(&str, u32), Vec<(u32, &String)>> = BTreeMap::new();
    let mut sets = Vec::new();
    for f in files.iter().filter(|f| f.ends_with(".gguf") && !f.to_ascii_lowercase().contains("mmproj")) {
        match split_parts(f) {
            Some((prefix, n, count)) if count > 1 => splits.entry((prefix, count)).or_default().push((n, f)),
            _ => sets.push(GgufSet { files: vec![f.clone()], quant: quant_of(f) }),
        }
    }
    for ((_, count), mut shards) in splits {
        shards.sort();
        shards.dedup_by_key(|s| s.0);
        if shards.len() == count as usize && shards.iter().enumerate().all(|(i, s)| s.0 == i as u32 + 1) {
            let files: Vec<String> = shards.into_iter().map(|(_, f)| f.clone()).collect();
            sets.push(GgufSet { quant: quant_of(&files[0]), files });
        }
    }
    sets.sort_by(|a, b| a.files.cmp(&b.files));
    sets
}

/// Whether `set` is of quantization `quant` (any case; `UD-Q4_K_XL` matches the words of a
/// name, so a prefix such as Unsloth's `UD-` can be asked for too).
fn matches(set: &GgufSet, quant: &str) -> bool {
    let q = quant.to_ascii_uppercase();
    let name = set.first().to_ascii_uppercase();
    set.quant.as_deref() == Some(q.as_str())
        || name.match_indices(&q).any(|(i, _)| {
            let before = name[..i].chars().next_back().is_none_or(|c| matches!(c, '-' | '.' | '/' | '_'));
            let after = name[i + q.len()..].chars().next().is_none_or(|c| matches!(c, '-' | '.' | '/'));
            before && after
        })
}

/// What the repository has, for an error: its quantizations, or its first files.
fn have(sets: &[GgufSet]) -> String {
    let mut quants: Vec<&str> = sets.iter().map(|s| s.quant.as_deref().unwrap_or(s.first())).collect();
    quants.dedup();
    quants.join(", ")
}

/// The model of `repo` (whose files are `files`) that `quant` names, or the default's.
pub fn choose(repo: &str, files: &[String], quant: Option<&str>) -> Result<GgufSet, QuantError> {
    let sets = gguf_sets(files);
    if sets.is_empty() {
        let mut shown: Vec<&str> = files.iter().take(8).map(String::as_str).collect();
        if files.len() > 8 {
            shown.push("...");
        }
        return Err(QuantError::NoGguf { repo: repo.into(), files: shown.join(", ") });
    }
    let found = match quant {
        Some(q) => sets.iter().find(|s| matches(s, q)),
        None if sets.len() == 1 => sets.first(),
        None => PREFERRED.iter().find_map(|q| sets.iter().find(|s| s.quant.as_deref() == Some(q))),
    };
    found.cloned().ok_or_else(|| match quant {
        Some(q) => QuantError::NoSuchQuant { repo: repo.into(), quant: q.into(), have: have(&sets) },
        None => QuantError::Ambiguous { repo: repo.into(), have: have(&sets) },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_default_is_q4_k_m_and_a_quant_matches_in_any_case() {
        let files = names(&[
            "README.md",
            "Qwen3-30B-A3B-Q8_0.gguf",
            "Qwen3-30B-A3B-Q4_K_M.gguf",
            "Qwen3-30B-A3B-Q4_K_S.gguf",
            "Qwen3-30B-A3B-UD-Q4_K_XL.gguf",
            "mmproj-F16.gguf",
        ]);
        assert_eq!(choose("o/r", &files, None).unwrap().first(), "Qwen3-30B-A3B-Q4_K_M.gguf");
        assert_eq!(choose("o/r", &files, Some("q8_0")).unwrap().first(), "Qwen3-30B-A3B-Q8_0.gguf");
        assert_eq!(choose("o/r", &files, Some("Q4_K_S")).unwrap().first(), "Qwen3-30B-A3B-Q4_K_S.gguf");
        assert_eq!(choose("o/r", &files, Some("ud-q4_k_xl")).unwrap().first(), "Qwen3-30B-A3B-UD-Q4_K_XL.gguf");
        let e = choose("o/r", &files, Some("Q2_K")).unwrap_err().to_string();
        assert!(e.contains("has no Q2_K file; it has Q4_K_M, Q4_K_S, Q8_0, Q4_K_XL"), "{e}");
    }

    #[test]
    fn a_split_model_is_all_of_its_shards_or_nothing() {
        let files = names(&[
            "Q4_K_M/m-Q4_K_M-00002-of-00003.gguf",
            "Q4_K_M/m-Q4_K_M-00001-of-00003.gguf",
            "Q4_K_M/m-Q4_K_M-00003-of-00003.gguf",
            "Q8_0/m-Q8_0-00001-of-00002.gguf",
        ]);
        let set = choose("o/r", &files, None).unwrap();
        assert_eq!(set.files.len(), 3);
        assert_eq!(set.first(), "Q4_K_M/m-Q4_K_M-00001-of-00003.gguf");
        assert_eq!(set.quant.as_deref(), Some("Q4_K_M"));
        assert!(choose("o/r", &files, Some("Q8_0")).is_err(), "a shard is missing");
    }

    #[test]
    fn no_gguf_and_no_default_are_errors_that_name_what_is_there() {
        assert!(matches!(choose("o/r", &names(&["a.bin"]), None), Err(QuantError::NoGguf { .. })));
        let two = names(&["m-F16.gguf", "m-Q2_K.gguf"]);
        let e = choose("o/r", &two, None).unwrap_err().to_string();
        assert!(e.contains("F16, Q2_K"), "{e}");
        assert_eq!(choose("o/r", &names(&["only.gguf"]), None).unwrap().first(), "only.gguf");
    }
}
