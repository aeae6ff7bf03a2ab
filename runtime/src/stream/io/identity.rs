//! What a shard file is when the lanes open it (a read finding it otherwise fails), and whether
//! `O_DIRECT` works on it.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

/// What a shard file was when the lanes opened it: a read finding it otherwise fails. The
/// change time counts: tools that rewrite a file in place can restore its size and
/// modification time (`cp --preserve=timestamps`, `rsync --inplace -t`, `touch -r`), but not
/// its ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    dev: u64,
    ino: u64,
    pub(super) size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileIdentity {
    /// What the file at `path` is now.
    pub(crate) fn of_path(path: &std::path::Path) -> io::Result<FileIdentity> {
        let m = std::fs::metadata(path)?;
        Ok(FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }

    /// How `now` differs from `self`, if it does.
    pub(crate) fn change(&self, now: &FileIdentity) -> Option<String> {
        if (now.dev, now.ino) != (self.dev, self.ino) {
            Some("it was replaced by another file".into())
        } else if now.size < self.size {
            Some(format!("it was truncated from {} to {} bytes", self.size, now.size))
        } else if now.size != self.size {
            Some(format!("it grew from {} to {} bytes", self.size, now.size))
        } else if now.mtime != self.mtime {
            Some("it was modified".into())
        } else if now.ctime != self.ctime {
            Some("it was rewritten or its attributes changed (its change time moved)".into())
        } else {
            None
        }
    }
}

pub(super) fn open_direct(path: &PathBuf) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

/// Whether `O_DIRECT` works on `path` and returns the same bytes as a buffered read.
pub(super) fn verify_direct(path: &PathBuf) -> Result<(), String> {
    let direct = open_direct(path).map_err(|e| format!("O_DIRECT open failed ({e})"))?;
    let buffered = File::open(path).map_err(|e| e.to_string())?;
    let block = 4096usize;
    let mut raw = vec![0u8; 2 * block];
    let at = raw.as_ptr().align_offset(block);
    let aligned = &mut raw[at..at + block];
    let n = direct.read_at(aligned, 0).map_err(|e| format!("O_DIRECT read failed ({e})"))?;
    let mut plain = vec![0u8; block];
    let m = buffered.read_at(&mut plain, 0).map_err(|e| e.to_string())?;
    if n != m || aligned[..n] != plain[..m] {
        return Err("O_DIRECT and buffered reads of the first block differ".into());
    }
    Ok(())
}
