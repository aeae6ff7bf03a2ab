//! The benchmark's storage throttle: reads from the model's disk through it run at the rate it
//! sets, and it is gone afterwards. Needs root and an I/O cgroup controller; skipped with a
//! message elsewhere (and under qemu-user, whose reads are the emulator's).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use sluice_hal::cgroup::{MemoryCgroup, ReadThrottle};
use sluice_hal::root::SysRoot;
use sluice_hal::storage::StorageProbe;

const FILE_BYTES: usize = 48 << 20;
const RATE: u64 = 24_000_000;
/// Reads through the throttle, each after a read of the disk alone.
const TRIES: usize = 3;

/// Reads `file` with O_DIRECT in a child process that first joins `dirs`; returns bytes/s.
fn read_rate_in(dirs: &[PathBuf], file: &Path) -> f64 {
    let joins: String = dirs.iter().map(|d| format!("echo $$ > '{}/cgroup.procs' && ", d.display())).collect();
    let script = format!("{joins}exec dd if='{}' of=/dev/null bs=1M iflag=direct status=none", file.display());
    let t0 = Instant::now();
    let status = Command::new("sh").arg("-c").arg(&script).status().expect("run sh");
    assert!(status.success(), "{script}: {status}");
    FILE_BYTES as f64 / t0.elapsed().as_secs_f64()
}

#[test]
fn reads_through_the_throttle_run_at_its_rate_and_it_is_lifted_afterwards() {
    if sluice_tests::emulated() {
        eprintln!("skipped: under qemu-user");
        return;
    }
    // On the disk the build lives on (the system temporary directory may be tmpfs).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = dir.path().join("throttled.bin");
    std::fs::write(&file, vec![0x5a_u8; FILE_BYTES]).unwrap();
    let Some(disk) = StorageProbe::disk_of_file(&SysRoot::default(), &file) else {
        eprintln!("skipped: {} is on no block device", file.display());
        return;
    };
    let cg = match MemoryCgroup::create(&format!("sluice-test-throttle-{}", std::process::id()), 1 << 30) {
        Ok(cg) => cg,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let throttle = match ReadThrottle::create(&cg, disk, RATE) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let mut dirs = vec![cg.dir().to_path_buf()];
    if throttle.dir() != cg.dir() {
        dirs.push(throttle.dir().to_path_buf());
    }
    // A throttle never lets reads run faster than its rate; that they run at it is only seen
    // while the disk itself (as busy as other work keeps it) reads well faster than the rate,
    // measured just before each try.
    let mut slow = Vec::new();
    let mut shown = false;
    for _ in 0..TRIES {
        let free = read_rate_in(&[], &file);
        let rate = read_rate_in(&dirs, &file);
        let ratio = rate / RATE as f64;
        assert!(ratio <= 1.2, "read at {:.1} MB/s through a {} MB/s throttle", rate / 1e6, RATE / 1_000_000);
        if free < 2.0 * RATE as f64 {
            continue;
        }
        if ratio >= 0.8 {
            shown = true;
            break;
        }
        slow.push(format!("{:.1} MB/s (the disk alone: {:.1} MB/s)", rate / 1e6, free / 1e6));
    }
    assert!(shown || slow.is_empty(), "reads through a {} MB/s throttle ran at {slow:?}", RATE / 1_000_000);
    if !shown {
        eprintln!("not shown: the disk never read faster than twice the throttle's rate; only its cap was checked");
    }
    drop(throttle);
    drop(cg);
    for d in &dirs {
        assert!(!d.exists(), "{} is still there: the throttle was not lifted", d.display());
    }
}
