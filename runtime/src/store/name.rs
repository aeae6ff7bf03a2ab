//! The names people already type for a model, as llama.cpp and Ollama spell them:
//!
//! - `owner/repo[:QUANT]`, `hf.co/owner/repo[:QUANT]` (also `huggingface.co/...`): a GGUF
//!   repository on the Hugging Face hub; QUANT picks its file(s), case-insensitively.
//! - `model[:tag]` (`qwen3:30b-a3b`), `registry.ollama.ai/namespace/model[:tag]` (also
//!   `ollama.com/...`): a model of an Ollama registry; the tag defaults to `latest`.
//!
//! A name with one slash and no host is the hub's (as llama.cpp's `-hf` reads it); Ollama's own
//! namespaced models take their registry's host in front. Every part is checked to be a plain
//! word (letters, digits, `.`, `_`, `-`), because names become paths in the store.

use std::fmt;

/// Why a name cannot be a model's name.
#[derive(Debug, thiserror::Error)]
#[error("{name:?} is not a model name: {why}; write owner/repo[:QUANT] or hf.co/owner/repo[:QUANT] for a Hugging Face GGUF repository, model[:tag] for an Ollama model")]
pub struct NameError {
    /// The name given.
    pub name: String,
    /// What is wrong with it.
    pub why: String,
}

/// A model named by where it comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ModelName {
    /// A GGUF repository on the Hugging Face hub.
    Hub {
        /// `owner/repo`.
        repo: String,
        /// The quantization asked for (as typed); `None` takes the default.
        quant: Option<String>,
    },
    /// A model of an Ollama registry.
    Ollama {
        /// The namespace (`library` for Ollama's own models).
        namespace: String,
        /// The model.
        model: String,
        /// The tag (`latest` when none was given).
        tag: String,
    },
}

const HUB_HOSTS: [&str; 2] = ["hf.co/", "huggingface.co/"];
const OLLAMA_HOSTS: [&str; 2] = ["registry.ollama.ai/", "ollama.com/"];

/// Whether `part` is a word a store path may hold.
fn is_word(part: &str) -> bool {
    !part.is_empty()
        && part.len() <= 96
        && part != "."
        && part != ".."
        && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

impl ModelName {
    /// Parses a name; an error says what is wrong and how names are written.
    pub fn parse(name: &str) -> Result<ModelName, NameError> {
        let err = |why: &str| NameError { name: name.to_string(), why: why.to_string() };
        let s = name.trim();
        if s.contains("://") {
            return Err(err("a URL; sluice fetches from the hosts its settings name, by a model's name"));
        }
        let (path, tag) = match s.rsplit_once(':') {
            Some((p, t)) => (p, Some(t)),
            None => (s, None),
        };
        if let Some(t) = tag.filter(|t| !is_word(t)) {
            return Err(err(&format!("the tag {t:?} is not a word of letters, digits, '.', '_' and '-'")));
        }
        let hub = HUB_HOSTS.iter().find_map(|h| path.strip_prefix(h));
        let ollama = OLLAMA_HOSTS.iter().find_map(|h| path.strip_prefix(h));
        let parts: Vec<&str> = hub.or(ollama).unwrap_or(path).split('/').collect();
        if let Some(bad) = parts.iter().find(|p| !is_word(p)) {
            return Err(err(&format!("{bad:?} is not a word of letters, digits, '.', '_' and '-'")));
        }
        match (hub.is_some() || ollama.is_none() && parts.len() == 2, parts.as_slice()) {
            (true, [owner, repo]) => {
                Ok(ModelName::Hub { repo: format!("{owner}/{repo}"), quant: tag.map(str::to_string) })
            }
            (true, _) => Err(err("a Hugging Face repository is owner/repo")),
            (false, [model]) => Ok(ModelName::ollama("library", model, tag)),
            (false, [namespace, model]) => Ok(ModelName::ollama(namespace, model, tag)),
            (false, _) => Err(err("an Ollama model is model[:tag] or namespace/model[:tag]")),
        }
    }

    fn ollama(namespace: &str, model: &str, tag: Option<&str>) -> ModelName {
        ModelName::Ollama {
            namespace: namespace.to_string(),
            model: model.to_string(),
            tag: tag.unwrap_or("latest").to_string(),
        }
    }
}

impl fmt::Display for ModelName {
    /// The name as it is listed: `owner/repo:QUANT` (the quant as asked), `model:tag` for
    /// Ollama's library, `namespace/model:tag` with the registry's host for the others.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelName::Hub { repo, quant: Some(q) } => write!(f, "{repo}:{q}"),
            ModelName::Hub { repo, quant: None } => write!(f, "{repo}"),
            ModelName::Ollama { namespace, model, tag } if namespace == "library" => write!(f, "{model}:{tag}"),
            ModelName::Ollama { namespace, model, tag } => write!(f, "registry.ollama.ai/{namespace}/{model}:{tag}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(repo: &str, quant: Option<&str>) -> ModelName {
        ModelName::Hub { repo: repo.into(), quant: quant.map(Into::into) }
    }

    #[test]
    fn names_read_as_llama_cpp_and_ollama_read_them() {
        let cases = [
            ("unsloth/Qwen3-30B-A3B-GGUF", hub("unsloth/Qwen3-30B-A3B-GGUF", None)),
            ("unsloth/Qwen3-30B-A3B-GGUF:q4_k_m", hub("unsloth/Qwen3-30B-A3B-GGUF", Some("q4_k_m"))),
            ("hf.co/owner/repo:Q8_0", hub("owner/repo", Some("Q8_0"))),
            ("huggingface.co/owner/repo", hub("owner/repo", None)),
            ("qwen3:30b-a3b", ModelName::ollama("library", "qwen3", Some("30b-a3b"))),
            ("gpt-oss", ModelName::ollama("library", "gpt-oss", None)),
            ("registry.ollama.ai/someone/model:7b", ModelName::ollama("someone", "model", Some("7b"))),
        ];
        for (text, want) in cases {
            assert_eq!(ModelName::parse(text).unwrap(), want, "{text}");
        }
        assert_eq!(ModelName::parse("gpt-oss").unwrap().to_string(), "gpt-oss:latest");
        assert_eq!(ModelName::parse("hf.co/o/r:Q4_K_M").unwrap().to_string(), "o/r:Q4_K_M");
    }

    #[test]
    fn names_that_would_leave_the_store_or_are_urls_are_refused_with_the_spelling() {
        for bad in ["../etc/passwd", "o/..", "a/b/c", "https://example.com/x.gguf", "", "m:", "m:a/b", "o/r:..x/"] {
            let e = ModelName::parse(bad).expect_err(bad).to_string();
            assert!(e.contains("owner/repo[:QUANT]"), "{bad}: {e}");
        }
    }
}
