//! Saved slots: a slot's memory (llama.cpp's sequence state) and its tokens, kept in the state
//! directory so that a restarted server answers a known conversation, or a fixed system prompt,
//! without computing it again.
//!
//! Each saved slot is two files in `STATE_DIR/slots/`: `NAME.kv`, the state as llama.cpp
//! serializes it, and `NAME.slot`, a [`crate::framed`] file (magic `SLUICESL`) with the format
//! version, the [`SlotKey`] it was saved under, the tokens, and the state's length and CRC-32.
//! The state goes to llama.cpp only when its header matches this model and context shape and the
//! state's bytes match their CRC; any other file is ignored with a warning. The files together
//! stay within a bound on disk (`--slot-save-mib`): the oldest go first.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use ggml_sys::Token;
use serde::{Deserialize, Serialize};

use super::heat::ModelIdentity;
use crate::framed::{self, FramedError};
use crate::generate::{kept_prefix, ContextShape, KvTypes, Reuse};
use crate::serve::job::Owner;

const MAGIC: &[u8; 8] = b"SLUICESL";
/// The format version written; files of another version are not used (4: the owner).
const VERSION: u32 = 4;
/// The largest header read: the tokens of a slot of a million positions, with room to spare.
const MAX_HEADER_BYTES: u64 = 8 << 20;
/// The folder of the state directory the slots are saved in.
pub const DIR_NAME: &str = "slots";

/// What a saved slot belongs to: the model (its expert layout, and each file's size and
/// modification time, so that another file of the same layout is not taken for it) and the
/// context's shape (llama.cpp's state holds one KV stream per slot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotKey {
    /// The model's expert layout.
    pub model: ModelIdentity,
    /// Each model file's size and modification time (nanoseconds since the epoch).
    pub files: Vec<(u64, i128)>,
    /// The context's slots.
    pub slots: u32,
    /// Positions per slot.
    pub positions: u32,
    /// The prompt batch, which decides what a slot keeps of a prompt.
    pub batch: u32,
    /// What a slot keeps ([`Reuse::Exact`] slots hold whole batches only).
    pub reuse: Reuse,
    /// The KV cache's element types (llama.cpp's state holds the cache as they are).
    pub kv: KvTypes,
}

impl SlotKey {
    /// The key of `model`'s files (`shards`) in a context of `shape`.
    pub fn new(
        model: ModelIdentity,
        shards: &[PathBuf],
        shape: ContextShape,
        reuse: Reuse,
    ) -> std::io::Result<SlotKey> {
        let mut files = Vec::new();
        for path in shards {
            let meta = std::fs::metadata(path)?;
            let mtime = meta.modified()?.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128);
            files.push((meta.len(), mtime));
        }
        Ok(SlotKey {
            model,
            files,
            slots: shape.slots,
            positions: shape.positions,
            batch: shape.batch,
            reuse,
            kv: shape.kv,
        })
    }
}

/// A saved slot's header.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SlotHeader {
    version: u32,
    key: SlotKey,
    /// The client whose prompts the slot holds: read back for it alone.
    owner: Owner,
    tokens: Vec<Token>,
    state_len: u64,
    state_crc: u32,
}

/// Why a saved slot could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SlotFileError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The state file does not match its header (truncated, damaged, or replaced).
    #[error("{path}: the saved slot's state is damaged ({why})")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// What check failed.
        why: String,
    },
    /// One slot's state is larger than the bound on saved slots.
    #[error("its state ({state_mib} MiB) is over --slot-save-mib ({max_mib} MiB)")]
    TooLarge {
        /// The state, MiB.
        state_mib: u64,
        /// The bound, MiB.
        max_mib: u64,
    },
}

/// One saved slot on disk.
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    /// Its tokens and its state's length and CRC-32; `None` for a file of another model, shape
    /// or version (never used, but on disk and counted against the bound).
    usable: Option<(Vec<Token>, u64, u32)>,
    /// The client whose prompts it holds.
    owner: Owner,
    bytes: u64,
    written: SystemTime,
}

impl Entry {
    fn tokens(&self) -> Option<&[Token]> {
        self.usable.as_ref().map(|(t, _, _)| t.as_slice())
    }
}

/// The saved slots of one model and context shape.
#[derive(Debug)]
pub struct SlotStore {
    dir: PathBuf,
    key: SlotKey,
    max_bytes: u64,
    entries: Vec<Entry>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SlotFileError + '_ {
    move |source| SlotFileError::Io { path: path.to_path_buf(), source }
}

impl SlotStore {
    /// The saved slots in `state_dir` for `key`, within `max_bytes` on disk. A file that cannot
    /// be used is ignored with a warning; one without its other half (a save cut short) is
    /// removed.
    pub fn open(state_dir: &Path, key: SlotKey, max_bytes: u64) -> Result<SlotStore, SlotFileError> {
        let dir = state_dir.join(DIR_NAME);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let mut store = SlotStore { dir, key, max_bytes, entries: Vec::new() };
        let listing = std::fs::read_dir(&store.dir).map_err(io(&store.dir))?;
        let mut names: Vec<String> = listing
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix(".slot")).map(str::to_string))
            .collect();
        names.sort();
        for name in names {
            if let Some(entry) = store.read_entry(&name) {
                store.entries.push(entry);
            }
        }
        store.remove_orphans();
        store.evict();
        Ok(store)
    }

    fn path(&self, name: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{name}.{ext}"))
    }

    /// The entry of `name`, or `None` (with a warning, its files removed) when its header is
    /// damaged or its state is missing.
    fn read_entry(&self, name: &str) -> Option<Entry> {
        let (head, kv) = (self.path(name, "slot"), self.path(name, "kv"));
        let sizes = std::fs::metadata(&head).and_then(|h| Ok((h, std::fs::metadata(&kv)?)));
        let header = framed::load::<SlotHeader>(&head, MAGIC, MAX_HEADER_BYTES);
        let (h, k, header) = match (sizes, header) {
            (Ok((h, k)), Ok(header)) => (h, k, header),
            (_, Err(FramedError::Corrupt(why))) => {
                log::warn!("{}: not a valid saved slot ({why}); removing it", head.display());
                self.remove_files(name);
                return None;
            }
            (Err(e), _) | (_, Err(FramedError::Io(e))) => {
                log::warn!("{}: cannot read the saved slot ({e}); removing it", head.display());
                self.remove_files(name);
                return None;
            }
        };
        let written = h.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let usable = header.version == VERSION && header.key == self.key;
        if header.version == VERSION && header.key == (SlotKey { kv: header.key.kv, ..self.key.clone() }) && !usable {
            log::warn!(
                "{}: saved with a KV cache of {}, and this server's is {}; ignoring it (--cache-type-k {} --cache-type-v {} would use it)",
                head.display(),
                header.key.kv.describe(),
                self.key.kv.describe(),
                header.key.kv.k.name(),
                header.key.kv.v.name()
            );
        } else if !usable {
            log::warn!("{}: saved for another model, context shape or format version; ignoring it", head.display());
        }
        let usable = usable.then_some((header.tokens, header.state_len, header.state_crc));
        Some(Entry { name: name.to_string(), usable, owner: header.owner, bytes: h.len() + k.len(), written })
    }

    /// Removes state files whose header is gone (a save cut short).
    fn remove_orphans(&self) {
        let Ok(listing) = std::fs::read_dir(&self.dir) else { return };
        for e in listing.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(".kv").or_else(|| name.strip_suffix(".tmp")) else { continue };
            if !self.entries.iter().any(|x| x.name == stem) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    fn remove_files(&self, name: &str) {
        for ext in ["slot", "kv"] {
            let _ = std::fs::remove_file(self.path(name, ext));
        }
    }

    /// The usable entry of `owner`'s that keeps the most of `prompt` in units of `unit` tokens
    /// ([`kept_prefix`]; [`Reuse::unit`]), if that is more than `better_than` tokens.
    pub fn best(&self, prompt: &[Token], better_than: usize, unit: usize, owner: &Owner) -> Option<usize> {
        let (i, n) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.owner == *owner)
            .filter_map(|(i, e)| e.tokens().map(|t| (i, kept_prefix(t, prompt, unit))))
            .max_by_key(|&(i, n)| (n, self.entries[i].written))?;
        (n > better_than).then_some(i)
    }

    /// The usable entries, newest first.
    pub fn newest(&self) -> Vec<usize> {
        let mut usable: Vec<usize> = (0..self.entries.len()).filter(|&i| self.entries[i].usable.is_some()).collect();
        usable.sort_by_key(|&i| std::cmp::Reverse(self.entries[i].written));
        usable
    }

    /// Names entry `i` for a message.
    pub fn describe(&self, i: usize) -> String {
        self.path(&self.entries[i].name, "slot").display().to_string()
    }

    /// Usable entry `i`'s tokens and state, the state checked against its header (as read when
    /// the store opened or the slot was saved).
    pub fn load(&self, i: usize) -> Result<(Vec<Token>, Vec<u8>), SlotFileError> {
        let e = &self.entries[i];
        let kv = self.path(&e.name, "kv");
        let Some((tokens, state_len, state_crc)) = &e.usable else {
            return Err(SlotFileError::Damaged { path: kv, why: "saved for another model or shape".into() });
        };
        let state = sluice_hal::file::read_regular(&kv, *state_len).map_err(io(&kv))?;
        if state.len() as u64 != *state_len {
            let why = format!("{} bytes where the header says {state_len}", state.len());
            return Err(SlotFileError::Damaged { path: kv, why });
        }
        if crc32fast::hash(&state) != *state_crc {
            return Err(SlotFileError::Damaged { path: kv, why: "checksum mismatch".into() });
        }
        Ok((tokens.clone(), state))
    }

    /// The client whose prompts entry `i` holds.
    pub fn owner(&self, i: usize) -> &Owner {
        &self.entries[i].owner
    }

    /// Removes entry `i` and its files.
    pub fn forget(&mut self, i: usize) {
        let e = self.entries.remove(i);
        self.remove_files(&e.name);
    }

    /// The usable entry whose file is named `name` (with or without its `.slot`).
    pub fn find(&self, name: &str) -> Option<usize> {
        let stem = name.strip_suffix(".slot").unwrap_or(name);
        self.entries.iter().position(|e| e.name == stem && e.usable.is_some())
    }

    /// Saves a slot of `owner`'s holding `tokens` with `state`; saved slots of `owner`'s it
    /// extends (their tokens a prefix of these) are removed, and the oldest go while the files
    /// are over the bound. Returns the name of its file.
    pub fn save(&mut self, tokens: &[Token], state: &[u8], owner: &Owner) -> Result<String, SlotFileError> {
        if state.len() as u64 > self.max_bytes {
            return Err(SlotFileError::TooLarge {
                state_mib: (state.len() as u64).div_ceil(1 << 20),
                max_mib: self.max_bytes >> 20,
            });
        }
        let mut bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        bytes.extend_from_slice(owner.0.as_bytes());
        let name = format!("{:08x}-{}", crc32fast::hash(&bytes), tokens.len());
        let kv = self.path(&name, "kv");
        framed::write_atomically(&kv, state).map_err(io(&kv))?;
        let (state_len, state_crc) = (state.len() as u64, crc32fast::hash(state));
        let header = SlotHeader {
            version: VERSION,
            key: self.key.clone(),
            owner: owner.clone(),
            tokens: tokens.to_vec(),
            state_len,
            state_crc,
        };
        let head = self.path(&name, "slot");
        framed::save(&head, MAGIC, &header).map_err(io(&head))?;
        let subsumed =
            |e: &Entry| e.name == name || (e.owner == *owner && e.tokens().is_some_and(|t| tokens.starts_with(t)));
        for e in self.entries.iter().filter(|e| subsumed(e)) {
            if e.name != name {
                self.remove_files(&e.name);
            }
        }
        self.entries.retain(|e| !subsumed(e));
        let size = std::fs::metadata(&head).map_or(0, |m| m.len()) + state.len() as u64;
        let usable = Some((tokens.to_vec(), state_len, state_crc));
        let entry = Entry { name: name.clone(), usable, owner: owner.clone(), bytes: size, written: SystemTime::now() };
        self.entries.push(entry);
        self.evict();
        Ok(format!("{name}.slot"))
    }

    /// Removes the oldest entries while the files are over the bound.
    fn evict(&mut self) {
        while self.entries.iter().map(|e| e.bytes).sum::<u64>() > self.max_bytes {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].written) else { return };
            log::info!("{}: removed, the saved slots are over --slot-save-mib", self.describe(oldest));
            self.forget(oldest);
        }
    }
}

#[cfg(test)]
mod tests;
