//! The lanes' API: waves, waits for one expert, bounds.

use super::*;
use ggml_sys::Reservation;

/// Lanes over one file of `len` bytes of 7s, and a job reading all of it as expert 3 of
/// layer 5 (tensor 0).
fn setup(dir: &std::path::Path, len: usize) -> (IoLanes, Vec<ReadJob>) {
    setup_with_fault(dir, len, None)
}

/// [`setup`], with `fault` injected.
fn setup_with_fault(dir: &std::path::Path, len: usize, fault: Option<ReadFault>) -> (IoLanes, Vec<ReadJob>) {
    let path = dir.join("f");
    std::fs::write(&path, vec![7u8; len]).unwrap();
    let config = LaneConfig {
        lanes: 1,
        direct: false,
        max_request: 1 << 20,
        cpus: Vec::new(),
        bound: READ_BOUND,
        fault,
        pace: None,
    };
    let lanes = IoLanes::new(&[path], &config).unwrap();
    let target = Arc::new(Reservation::new(0, len as u64).unwrap());
    let job = ReadJob {
        target,
        shard: 0,
        start: 0,
        len,
        tag: (5, 3),
        tensor: 0,
        slice: None,
        pass: false,
        speculative: false,
        check: None,
    };
    (lanes, vec![job])
}

#[test]
fn waves_begin_a_passing_read_only_when_the_window_has_room() {
    let dir = tempfile::tempdir().unwrap();
    let page = ggml_sys::page_size() as usize;
    let (lanes, mut jobs) = setup(dir.path(), 4 * page);
    let one = jobs.pop().unwrap();
    // Four passing reads of one page each (experts 0..4 of tensor 0), a window of two pages.
    for e in 0..4u32 {
        let from = u64::from(e) * page as u64;
        jobs.push(ReadJob {
            start: from,
            len: page,
            tag: (5, e),
            slice: Some((from, from + page as u64)),
            pass: true,
            ..one.clone()
        });
    }
    lanes.submit_waves(&mut jobs, 2 * page as u64);
    assert!(lanes.wait_any(0, &[0], READ_BOUND) && lanes.wait_any(0, &[1], READ_BOUND));
    // Nothing is given back: the third read may not begin, however long we look.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(lanes.reads_begun(), 2);
    assert!(!lanes.is_landed(0, 2));
    assert_eq!(lanes.release_after_use(0, 1), page as u64);
    assert!(lanes.wait_any(0, &[2], READ_BOUND));
    assert_eq!(lanes.release_after_use(0, 1), 0, "given back once");
    lanes.release_after_use(0, 0);
    lanes.release_after_use(0, 2);
    let stats = lanes.wait(&mut jobs, None).unwrap();
    assert_eq!(stats.bytes, 4 * page as u64);
}

#[test]
fn wait_any_returns_once_one_of_the_experts_has_landed() {
    let dir = tempfile::tempdir().unwrap();
    let (lanes, mut jobs) = setup(dir.path(), 1 << 20);
    lanes.submit(&mut jobs);
    assert!(lanes.is_landed(0, 9), "an expert never asked for is not waited for");
    assert!(lanes.wait_any(1, &[3], Duration::from_secs(30)), "another tensor's expert is not waited for");
    assert!(lanes.wait_any(0, &[3], Duration::from_secs(30)));
    assert!(lanes.is_landed(0, 3));
    let stats = lanes.wait(&mut jobs, None).unwrap();
    assert_eq!(stats.bytes, 1 << 20);
}

#[test]
fn a_wait_past_its_bound_fails_the_batch_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    // 64 MiB in 1 MiB requests on one lane: still in flight when the zero bound has passed.
    let (lanes, mut jobs) = setup(dir.path(), 64 << 20);
    lanes.submit(&mut jobs);
    assert!(!lanes.is_landed(0, 3));
    assert!(!lanes.wait_any(0, &[3], Duration::ZERO));
    let failure = lanes.wait(&mut jobs, Some(Duration::from_secs(30))).unwrap_err();
    assert_eq!(failure.what, "expert 3 of layer 5");
    assert_eq!(failure.cause.kind(), io::ErrorKind::TimedOut);
    assert!(failure.to_string().contains("expert 3 of layer 5"), "{failure}");
}

#[test]
fn speculative_reads_are_dropped_or_lost_never_failing_their_batch() {
    let dir = tempfile::tempdir().unwrap();
    let page = ggml_sys::page_size() as usize;
    // One lane; the second read fails with EIO.
    let (lanes, mut jobs) = setup_with_fault(dir.path(), 64 << 20, Some(ReadFault { at: 2, kind: FaultKind::Eio }));
    let first = jobs.pop().unwrap();
    // The layer's own 64 MiB, then three one-page reads ahead for layer 6.
    let ahead = |e: u32| ReadJob { len: page, tag: (6, e), tensor: 1, speculative: true, ..first.clone() };
    let mut jobs = vec![first.clone(), ahead(1), ahead(2), ahead(4)];
    lanes.submit(&mut jobs);
    // While the lane reads the first 64 MiB, layer 6's router chooses 1 and 2: 4 is dropped.
    lanes.drop_speculative(|(l, e)| l == 6 && e != 4);
    let stats = lanes.wait(&mut jobs, None).expect("a read ahead that fails does not fail its batch");
    assert_eq!(stats.bytes, (64 << 20) + page as u64, "the first read and the guess of 2 landed");
    assert_eq!(lanes.reads_begun(), 3, "the dropped read never began");
    assert_eq!(lanes.take_lost(), vec![(6, 1), (6, 4)], "the failed and the dropped guesses");
    assert!(lanes.take_lost().is_empty());
}

#[test]
fn adjacent_slices_of_a_tensor_are_read_in_one_request_each_landing_whole() {
    let dir = tempfile::tempdir().unwrap();
    let page = ggml_sys::page_size() as usize;
    let path = dir.path().join("f");
    // Page p of the file holds the byte p + 1.
    let data: Vec<u8> = (0..10 * page).map(|i| (i / page) as u8 + 1).collect();
    std::fs::write(&path, &data).unwrap();
    let config = |max_request| LaneConfig {
        lanes: 1,
        direct: false,
        max_request,
        cpus: Vec::new(),
        bound: READ_BOUND,
        fault: None,
        pace: None,
    };
    let tensor = Arc::new(Reservation::new(0, 8 * page as u64).unwrap());
    let other = Arc::new(Reservation::new(8 * page as u64, 2 * page as u64).unwrap());
    // Expert e of layer 5 is page e of the tensor (of the other tensor from 8 on).
    let slice = |e: u32, target: &Arc<Reservation>| {
        let from = u64::from(e) * page as u64;
        let start = if Arc::ptr_eq(target, &tensor) { from } else { from - 8 * page as u64 };
        ReadJob {
            target: Arc::clone(target),
            shard: 0,
            start: from,
            len: page,
            tag: (5, e),
            tensor: usize::from(!Arc::ptr_eq(target, &tensor)),
            slice: Some((start, start + page as u64)),
            pass: false,
            speculative: false,
            check: None,
        }
    };
    let batch = || {
        vec![
            slice(0, &tensor),
            slice(1, &tensor),
            slice(2, &tensor),
            ReadJob { speculative: true, ..slice(3, &tensor) },
            slice(4, &tensor),
            slice(5, &tensor),
            ReadJob { pass: true, ..slice(6, &tensor) },
            slice(8, &other),
            slice(9, &other),
        ]
    };
    // Requests: 0-2, the read ahead 3 alone, 4-5, the passing 6 alone, 8-9 (another tensor).
    let lanes = IoLanes::new(std::slice::from_ref(&path), &config(1 << 20)).unwrap();
    let mut jobs = batch();
    let stats = lanes.read_all(&mut jobs).unwrap();
    assert_eq!(stats.bytes, 9 * page as u64, "each page read once");
    assert_eq!(lanes.reads_begun(), 5);
    for e in [0u32, 1, 2, 3, 4, 5, 6] {
        assert!(lanes.is_landed(0, e), "expert {e}");
        let mut got = vec![0u8; page];
        assert!(tensor.copy_to(u64::from(e) * page as u64, &mut got));
        assert!(got.iter().all(|&b| b == e as u8 + 1), "expert {e} landed whole, in its place");
    }
    let mut got = vec![0u8; 2 * page];
    assert!(other.copy_to(0, &mut got));
    assert_eq!(got, &data[8 * page..]);
    // A request holds at most max_request: two pages, so 0-2 go as 0-1 and 2, 4-5 and 8-9 whole.
    let lanes = IoLanes::new(&[path], &config(2 * page)).unwrap();
    let mut jobs = batch();
    lanes.read_all(&mut jobs).unwrap();
    assert_eq!(lanes.reads_begun(), 6);
}
