//! Reading small settings and state files safely: only regular files, and only up to a size.
//!
//! A path a user gives can name a FIFO (opening it for reading blocks until a writer comes), a
//! device such as `/dev/zero` (reads without end) or a huge file. The file is opened without
//! blocking, checked to be a regular file on the open descriptor (no race with a rename), and
//! read to at most the limit.

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use nix::fcntl::OFlag;

/// Reads the regular file at `path` whole, refusing anything else and anything over
/// `max_bytes`; the error says which (its kind is `InvalidInput` for those two).
pub fn read_regular(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(OFlag::O_NONBLOCK.bits()).open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO, socket or device); give a regular file",
        ));
    }
    if meta.len() > max_bytes {
        return Err(too_large(meta.len(), max_bytes));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_bytes + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        // It grew while being read.
        return Err(too_large(bytes.len() as u64, max_bytes));
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_string(path: &Path, max_bytes: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?).map_err(|e| {
        io::Error::new(io::ErrorKind::InvalidData, format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()))
    })
}

fn too_large(len: u64, max: u64) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{len} bytes or more, over the {max} bytes this file may have"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_small_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("ok");
        std::fs::write(&ok, "hello").unwrap();
        assert_eq!(read_regular_string(&ok, 5).unwrap(), "hello");
        let e = read_regular(&ok, 4).unwrap_err();
        assert!(e.to_string().contains("over the 4 bytes"), "{e}");
        let e = read_regular(dir.path(), 100).unwrap_err();
        assert!(e.to_string().contains("not a regular file") || e.raw_os_error() == Some(nix::libc::EISDIR), "{e}");
        let e = read_regular(Path::new("/dev/zero"), 100).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // Would block forever if opened for reading the ordinary way.
        let e = read_regular(&fifo, 100).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::write(&ok, [0xff, 0xfe]).unwrap();
        assert!(read_regular_string(&ok, 5).unwrap_err().to_string().contains("not UTF-8"));
    }
}
