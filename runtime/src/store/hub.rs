//! The Hugging Face hub's cache layout, as `huggingface_hub` (and so `huggingface-cli`, and
//! llama.cpp's `-hf`) keeps it, so that a model one of them downloaded is found here and one
//! sluice pulled is found by them:
//!
//! ```text
//! <cache>/models--<owner>--<repo>/blobs/<sha256>            the files' bytes, named by digest
//! <cache>/models--<owner>--<repo>/snapshots/<commit>/<file> relative links to the blobs
//! <cache>/models--<owner>--<repo>/refs/main                 the commit `main` was at
//! ```
//!
//! A blob appears only once its digest was checked; a snapshot's link only once its blob is
//! there, so a half-pulled model is never found.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::quant;

/// A hub cache directory (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCache {
    /// The directory.
    pub root: PathBuf,
}

/// Whether `s` can name a commit or a blob (hex, as the hub gives them).
pub fn is_hex_id(s: &str) -> bool {
    (7..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl HubCache {
    /// The directory of `repo` (`owner/repo`).
    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.root.join(format!("models--{}", repo.replace('/', "--")))
    }

    /// Where the file whose digest is `sha256` is kept.
    pub fn blob(&self, repo: &str, sha256: &str) -> PathBuf {
        self.repo_dir(repo).join("blobs").join(sha256)
    }

    /// Where `file` of `repo` at `commit` is linked.
    pub fn snapshot_file(&self, repo: &str, commit: &str, file: &str) -> PathBuf {
        self.repo_dir(repo).join("snapshots").join(commit).join(file)
    }

    /// The commit `main` was at when `repo` was last pulled.
    pub fn commit(&self, repo: &str) -> Option<String> {
        let text = fs::read_to_string(self.repo_dir(repo).join("refs").join("main")).ok()?;
        Some(text.trim().to_string()).filter(|c| is_hex_id(c))
    }

    /// Records that `main` is at `commit`.
    pub fn set_main(&self, repo: &str, commit: &str) -> io::Result<()> {
        let refs = self.repo_dir(repo).join("refs");
        fs::create_dir_all(&refs)?;
        crate::framed::write_atomically(&refs.join("main"), commit.as_bytes())
    }

    /// Links `file` of `repo` at `commit` to its blob (a relative link, as the hub's library
    /// makes them), replacing an older link.
    pub fn link(&self, repo: &str, commit: &str, file: &str, sha256: &str) -> io::Result<PathBuf> {
        let at = self.snapshot_file(repo, commit, file);
        let depth = file.matches('/').count() + 2;
        let target: PathBuf = std::iter::repeat_n("..", depth).collect::<PathBuf>().join("blobs").join(sha256);
        if let Some(parent) = at.parent() {
            fs::create_dir_all(parent)?;
        }
        let tmp = at.with_extension("sluice-link");
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp)?;
        fs::rename(&tmp, &at)?;
        Ok(at)
    }

    /// The files of `repo`'s snapshot at `main` whose blobs are there, relative to it.
    pub fn files(&self, repo: &str) -> Option<(String, Vec<String>)> {
        let commit = self.commit(repo)?;
        let dir = self.repo_dir(repo).join("snapshots").join(&commit);
        let mut files = Vec::new();
        walk(&dir, &dir, &mut files);
        files.sort();
        Some((commit, files))
    }

    /// The file to load of `repo`'s model of `quant` (or the default), when all its files are
    /// there, with all of its files.
    pub fn find(&self, repo: &str, quant: Option<&str>) -> Option<(PathBuf, Vec<PathBuf>)> {
        let (commit, files) = self.files(repo)?;
        let set = quant::choose(repo, &files, quant).ok()?;
        let paths: Vec<PathBuf> = set.files.iter().map(|f| self.snapshot_file(repo, &commit, f)).collect();
        Some((paths[0].clone(), paths))
    }

    /// The repositories in the cache (`owner/repo`).
    pub fn repos(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.root) else { return Vec::new() };
        let mut repos: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter_map(|n| n.strip_prefix("models--").map(|r| r.replacen("--", "/", 1)))
            .collect();
        repos.sort();
        repos
    }

    /// Removes `files` (snapshot links) and the blobs no other link of the repository uses.
    pub fn remove(&self, repo: &str, files: &[PathBuf]) -> io::Result<u64> {
        let mut blobs = Vec::new();
        for f in files {
            if let Ok(target) = fs::canonicalize(f) {
                blobs.push(target);
            }
            fs::remove_file(f).or_else(ignore_missing)?;
        }
        let mut still = Vec::new();
        let snapshots = self.repo_dir(repo).join("snapshots");
        walk(&snapshots, &snapshots, &mut still);
        let used: Vec<PathBuf> = still.iter().filter_map(|f| fs::canonicalize(snapshots.join(f)).ok()).collect();
        let mut freed = 0;
        for b in blobs.into_iter().filter(|b| !used.contains(b)) {
            freed += fs::metadata(&b).map(|m| m.len()).unwrap_or(0);
            fs::remove_file(&b).or_else(ignore_missing)?;
        }
        Ok(freed)
    }
}

fn ignore_missing(e: io::Error) -> io::Result<()> {
    if e.kind() == io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

/// The files under `dir` (links whose targets exist, and regular files), relative to `base`;
/// the checksum sidecars sluice writes beside a model are not the repository's files. Linked
/// folders are not followed, so a link loop in a cache is not walked for ever.
fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
    for e in walkdir::WalkDir::new(dir).min_depth(1).into_iter().flatten() {
        let path = e.path();
        if path.is_file() && !path.to_string_lossy().ends_with(crate::stream::checksums::SUFFIX) {
            if let Ok(rel) = path.strip_prefix(base) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_with_a_link_loop_lists_its_files_once() {
        let dir = tempfile::tempdir().unwrap();
        let cache = HubCache { root: dir.path().into() };
        let commit = "0123456789abcdef0123456789abcdef01234567";
        cache.set_main("o/r", commit).unwrap();
        let blob = cache.blob("o/r", "ab");
        fs::create_dir_all(blob.parent().unwrap()).unwrap();
        fs::write(&blob, b"x").unwrap();
        let linked = cache.link("o/r", commit, "sub/m-Q4_K_M.gguf", "ab").unwrap();
        std::os::unix::fs::symlink("..", linked.parent().unwrap().join("loop")).unwrap();
        assert_eq!(cache.files("o/r"), Some((commit.to_string(), vec!["sub/m-Q4_K_M.gguf".to_string()])));
    }
}
