//! What a Hugging Face name means on the hub: the repository's files at `main` (the hub's API,
//! with each file's size and LFS sha256), the model's file(s) chosen by quantization, and where
//! each goes in the hub cache.

use serde::Deserialize;

use super::http::{Http, Token, TOKEN_HINT};
use super::{Planned, PlannedFile, PullError, Source};
use crate::dirs::env_path;
use crate::store::{hub::is_hex_id, quant, HubCache, ModelName};

#[derive(Debug, Deserialize)]
struct RepoInfo {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

/// The hub token: `$HF_TOKEN`, else the file `$HF_TOKEN_PATH`, `$HF_HOME/token` or
/// `~/.cache/huggingface/token` (where `huggingface-cli login` writes it).
pub fn token(endpoint: &str) -> Option<Token> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let file = || {
        let path = env_path("HF_TOKEN_PATH")
            .or_else(|| env_path("HF_HOME").map(|h| h.join("token")))
            .or_else(|| env_path("HOME").map(|h| h.join(".cache/huggingface/token")))?;
        std::fs::read_to_string(path).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
    };
    let value = env("HF_TOKEN").or_else(file)?;
    Some(Token { value, host: super::http::authority(endpoint)?, hint: TOKEN_HINT })
}

/// The files `repo:quant` means at `endpoint`, and where they go in `cache`.
pub fn plan(
    http: &Http,
    endpoint: &str,
    cache: &HubCache,
    repo: &str,
    quant: Option<&str>,
) -> Result<Planned, PullError> {
    let endpoint = endpoint.trim_end_matches('/');
    let token = token(endpoint);
    let what = format!("{repo} on {endpoint}");
    let info: RepoInfo =
        http.json(&format!("{endpoint}/api/models/{repo}/revision/main?blobs=true"), None, token.as_ref(), &what)?;
    if !is_hex_id(&info.sha) {
        return Err(PullError::Http {
            url: endpoint.into(),
            why: format!("the hub gave {:?} as {repo}'s commit", info.sha),
        });
    }
    let names: Vec<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
    let set = quant::choose(repo, &names, quant)?;
    let mut files = Vec::new();
    for f in &set.files {
        let lfs = info
            .siblings
            .iter()
            .find(|s| &s.rfilename == f)
            .and_then(|s| s.lfs.as_ref())
            .filter(|l| l.sha256.len() == 64 && is_hex_id(&l.sha256))
            .ok_or_else(|| PullError::Http {
                url: endpoint.into(),
                why: format!("the hub gave no sha256 for {repo}/{f}, so it cannot be checked"),
            })?;
        if f.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
            return Err(PullError::Http { url: endpoint.into(), why: format!("the hub named a file {f:?}") });
        }
        files.push(PlannedFile {
            label: f.clone(),
            url: format!("{endpoint}/{repo}/resolve/{}/{f}", info.sha),
            size: lfs.size,
            sha256: lfs.sha256.to_ascii_lowercase(),
            dest: cache.blob(repo, &lfs.sha256.to_ascii_lowercase()),
            gguf: true,
        });
    }
    let name = ModelName::Hub { repo: repo.into(), quant: set.quant.clone().or(quant.map(str::to_string)) };
    Ok(Planned { name, files, token, source: Source::Hub { repo: repo.into(), commit: info.sha } })
}
