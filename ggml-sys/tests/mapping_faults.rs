//! A read through a file mapping that fails (here: a page past the end of a file truncated
//! while mapped, which the kernel answers as it does an I/O error, with SIGBUS `BUS_ADRERR`)
//! ends the process with status 1 and a message naming the model, not with the signal.

use std::process::Command;

const INNER: &str = "SLUICE_MAPPING_FAULT_FILE";

#[test]
fn a_failed_read_through_a_mapping_is_an_error_naming_the_model() {
    if let Some(path) = std::env::var_os(INNER) {
        // The child: map the file, truncate it, touch a page that is gone.
        let path = std::path::PathBuf::from(path);
        ggml_sys::name_mapped_model(&path);
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        // SAFETY: the test truncates the mapped file on purpose; the read below faults by design.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        file.set_len(0).unwrap();
        let byte = std::hint::black_box(map[4096]);
        panic!("the read of a truncated mapping returned {byte}");
    }
    if std::env::var_os("SLUICE_TEST_RUNNER").is_some_and(|r| !r.is_empty()) {
        println!("skipped: under qemu-user a fault in the emulated process is the emulator's");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, vec![7u8; 4 << 12]).unwrap();
    let o = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_failed_read_through_a_mapping_is_an_error_naming_the_model", "--nocapture"])
        .env(INNER, &path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{:?}: {err}", o.status);
    assert!(
        err.contains(&format!("reading the model {} through llama.cpp's file mapping failed", path.display())),
        "{err}"
    );
}
