//! The small binary files sluice keeps (the expert heat map, a model's checksum sidecar): an
//! 8-byte magic, a postcard body and a little-endian CRC-32 of everything before it. A file is
//! written to a temporary file beside it, synced, and renamed over the old one, so a crash leaves
//! the old file or the new one, never half of one; a file that fails a check is refused.

use std::io::Write as _;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Why a framed file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FramedError {
    /// It cannot be read or written (`NotFound` when there is none).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// It is not a file of this kind, or it is damaged.
    #[error("{0}")]
    Corrupt(String),
}

/// Reads the file at `path` that starts with `magic`: a regular file of at most `max_bytes`.
pub fn load<T: DeserializeOwned>(path: &Path, magic: &[u8; 8], max_bytes: u64) -> Result<T, FramedError> {
    let bytes = sluice_hal::file::read_regular(path, max_bytes)?;
    if bytes.len() < magic.len() + 4 || &bytes[..magic.len()] != magic {
        return Err(FramedError::Corrupt(format!("no {} header", String::from_utf8_lossy(magic))));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(FramedError::Corrupt("checksum mismatch".into()));
    }
    postcard::from_bytes(&body[magic.len()..]).map_err(|e| FramedError::Corrupt(e.to_string()))
}

/// Writes `value` to `path` after `magic`: temporary file, fsync, rename, directory fsync.
pub fn save<T: Serialize>(path: &Path, magic: &[u8; 8], value: &T) -> std::io::Result<()> {
    let mut bytes = magic.to_vec();
    bytes.extend(postcard::to_allocvec(value).map_err(std::io::Error::other)?);
    bytes.extend(crc32fast::hash(&bytes).to_le_bytes());
    write_atomically(path, &bytes)
}

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one: a temporary file
/// beside it, synced, renamed over it, and the directory synced. The temporary file is made
/// anew (whatever was left at its name, a symlink planted there included, is removed, not
/// followed; then created exclusively).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let created = std::fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(&tmp);
    let written = created.and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()));
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir).and_then(|d| d.sync_all())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAGIC: &[u8; 8] = b"SLUICETT";

    #[test]
    fn a_saved_value_loads_back_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.bin");
        assert!(
            matches!(load::<Vec<u32>>(&path, MAGIC, 1 << 20), Err(FramedError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound)
        );
        save(&path, MAGIC, &vec![1u32, 2, 3]).unwrap();
        assert_eq!(load::<Vec<u32>>(&path, MAGIC, 1 << 20).unwrap(), [1, 2, 3]);
        assert!(!dir.path().join("v.bin.tmp").exists());
        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        flipped[9] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let e = load::<Vec<u32>>(&path, MAGIC, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("checksum mismatch"), "{e}");
        assert!(load::<Vec<u32>>(&path, b"SLUICEXX", 1 << 20).unwrap_err().to_string().contains("no SLUICEXX header"));
        std::fs::write(&path, &good).unwrap();
        assert!(matches!(load::<Vec<u32>>(&path, MAGIC, 4), Err(FramedError::Io(_))), "over the size bound");
    }

    #[test]
    fn a_link_planted_at_the_temporary_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, b"keep me").unwrap();
        let path = dir.path().join("slot.kv");
        std::os::unix::fs::symlink(&outside, dir.path().join("slot.kv.tmp")).unwrap();
        write_atomically(&path, b"state").unwrap();
        assert_eq!(std::fs::read(&outside).unwrap(), b"keep me", "the link's target was written");
        assert_eq!(std::fs::read(&path).unwrap(), b"state");
        assert!(std::fs::symlink_metadata(dir.path().join("slot.kv.tmp")).is_err(), "the link is gone");
    }
}
