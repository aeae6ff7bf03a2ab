use super::*;
use crate::serve::job::Owner;

fn key(layout_crc: u32) -> SlotKey {
    SlotKey {
        model: ModelIdentity { n_layer: 2, n_expert: 4, layout_crc },
        files: vec![(10, 1)],
        slots: 2,
        positions: 256,
        batch: 64,
        reuse: Reuse::Exact,
        kv: KvTypes::default(),
    }
}

fn state(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn a_saved_slot_loads_back_and_one_it_extends_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    store.save(&[1, 2, 3], &state(100, 1), &Owner::default()).unwrap();
    store.save(&[9, 9], &state(50, 2), &Owner::default()).unwrap();
    store.save(&[1, 2, 3, 4, 5], &state(120, 3), &Owner::default()).unwrap();
    let store = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    assert_eq!(store.entries.len(), 2, "[1, 2, 3] was extended by [1, 2, 3, 4, 5]");
    let i = store.best(&[1, 2, 3, 4, 5, 6], 0, 1, &Owner::default()).unwrap();
    assert_eq!(store.load(i).unwrap(), (vec![1, 2, 3, 4, 5], state(120, 3)));
    assert_eq!(store.best(&[1, 2, 3, 4, 5, 6], 5, 1, &Owner::default()), None, "nothing better than what a slot keeps");
    assert_eq!(store.best(&[1, 2], 0, 1, &Owner::default()), Some(i), "a prefix of the prompt, less its last token");
    assert_eq!(store.best(&[7, 7, 7], 0, 1, &Owner::default()), None);
    assert_eq!(store.best(&[1, 2, 3, 4, 5, 6], 3, 4, &Owner::default()), Some(i), "whole batches of 4: 4 kept");
    assert_eq!(store.best(&[1, 2, 3, 4, 5, 6], 4, 4, &Owner::default()), None, "no more than a slot keeping 4");
    assert_eq!(store.newest().len(), 2);
    let names: Vec<_> = std::fs::read_dir(dir.path().join(DIR_NAME)).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 4, "a header and a state per slot, no temporary file: {names:?}");
}

#[test]
fn damaged_truncated_and_foreign_slots_are_not_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    store.save(&[1, 2, 3], &state(100, 1), &Owner::default()).unwrap();
    let kv = store.path(&store.entries[0].name, "kv");
    let good = std::fs::read(&kv).unwrap();
    let mut flipped = good.clone();
    flipped[40] ^= 0x10;
    std::fs::write(&kv, &flipped).unwrap();
    let e = store.load(0).unwrap_err().to_string();
    assert!(e.contains("damaged (checksum mismatch)"), "{e}");
    std::fs::write(&kv, &good[..60]).unwrap();
    let e = store.load(0).unwrap_err().to_string();
    assert!(e.contains("60 bytes where the header says 100"), "{e}");
    std::fs::write(&kv, &good).unwrap();
    assert!(store.load(0).is_ok());

    let other = SlotStore::open(dir.path(), key(2), 1 << 20).unwrap();
    assert_eq!(other.best(&[1, 2, 3, 4], 0, 1, &Owner::default()), None, "another model's slot is never used");
    assert_eq!(other.entries.len(), 1, "but it stays on disk, within the bound");
    let any = SlotStore::open(dir.path(), SlotKey { reuse: Reuse::Any, ..key(1) }, 1 << 20).unwrap();
    assert_eq!(
        any.best(&[1, 2, 3, 4], 0, 1, &Owner::default()),
        None,
        "a slot kept in whole batches is not one kept any way"
    );
    let q8 = crate::generate::KvCacheType::Q8_0;
    let quantized = SlotStore::open(dir.path(), SlotKey { kv: KvTypes { k: q8, v: q8 }, ..key(1) }, 1 << 20).unwrap();
    assert_eq!(
        quantized.best(&[1, 2, 3, 4], 0, 1, &Owner::default()),
        None,
        "an f16 cache's slot is not restored into a q8_0 one"
    );
    assert_eq!(quantized.entries.len(), 1, "and it stays on disk");
    let head = store.path(&store.entries[0].name, "slot");
    let mut h = std::fs::read(&head).unwrap();
    h[10] ^= 1;
    std::fs::write(&head, &h).unwrap();
    let reopened = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    assert!(reopened.entries.is_empty(), "a damaged header is removed");
    assert_eq!(std::fs::read_dir(dir.path().join(DIR_NAME)).unwrap().count(), 0, "with its state");
}

#[test]
fn the_oldest_go_when_over_the_bound_and_a_state_over_it_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SlotStore::open(dir.path(), key(1), 1000).unwrap();
    for i in 0..4u8 {
        store.save(&[i32::from(i) + 10, 1], &state(300, i), &Owner::default()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let kept: Vec<_> = store.entries.iter().map(|e| e.tokens().unwrap()[0]).collect();
    assert!(kept.len() < 4 && kept.contains(&13) && !kept.contains(&10), "{kept:?}");
    assert!(store.entries.iter().map(|e| e.bytes).sum::<u64>() <= 1000);
    let e = store.save(&[5], &state(2000, 0), &Owner::default()).unwrap_err();
    assert!(matches!(e, SlotFileError::TooLarge { .. }), "{e}");
}

#[test]
fn a_state_without_its_header_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let slots = dir.path().join(DIR_NAME);
    std::fs::create_dir_all(&slots).unwrap();
    std::fs::write(slots.join("abc-3.kv"), b"half a save").unwrap();
    std::fs::write(slots.join("abc-3.kv.tmp"), b"half a save").unwrap();
    let store = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    assert!(store.entries.is_empty());
    assert_eq!(std::fs::read_dir(&slots).unwrap().count(), 0);
}

#[test]
fn a_saved_slot_is_read_back_for_its_owner_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    let (alice, bob) = (Owner("key alice".into()), Owner("key bob".into()));
    store.save(&[1, 2, 3, 4], &state(100, 1), &alice).unwrap();
    assert_eq!(store.best(&[1, 2, 3, 4, 5], 0, 1, &bob), None, "bob never gets alice's prompt");
    // The same tokens saved for bob too: two files, each read back for its owner.
    store.save(&[1, 2, 3, 4, 5], &state(100, 2), &bob).unwrap();
    let store = SlotStore::open(dir.path(), key(1), 1 << 20).unwrap();
    assert_eq!(store.entries.len(), 2, "bob's longer slot does not replace alice's");
    let a = store.best(&[1, 2, 3, 4, 5, 6], 0, 1, &alice).unwrap();
    assert_eq!((store.owner(a), store.load(a).unwrap().0), (&alice, vec![1, 2, 3, 4]));
    let b = store.best(&[1, 2, 3, 4, 5, 6], 0, 1, &bob).unwrap();
    assert_eq!(store.owner(b), &bob);
}
