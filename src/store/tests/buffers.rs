//! Allocation buffers (`writer/lab.rs`): small objects carved from a block reserved for
//! several, large ones reserved on their own; a buffer given back, taken back by another
//! writer's sweep while its owner is idle, and reclaimed when its owner dies.

use super::*;
use crate::layout::BlockKind;

const KIB: u64 = 1 << 10;

/// Two writers of a 1 MiB ring (32 KiB buffers each) and its reader.
fn two_writers_and_a_reader() -> (Writer, Writer, Arc<Reader>) {
    let a = store(1024 * KIB, 1, 2);
    let b = join(&a);
    let r = Reader::attach(&a.reader_info()).unwrap();
    (a, b, r)
}

/// Put `bytes` under `key` with `w` and read them back through `r` (so nothing stays owed).
fn put_and_read(w: &Writer, r: &Arc<Reader>, key: &str, bytes: &[u8]) {
    let h = w.put(key, &[bytes]).unwrap();
    assert_eq!(read(r, &h, key).unwrap(), bytes);
}

#[test]
fn small_objects_are_carved_from_one_buffer_and_large_ones_are_not() {
    let (w, [r]) = writer_with_readers::<1>(4096 * KIB);
    let mut handles = Vec::new();
    for i in 0..10 {
        let key = format!("small{i}");
        handles.push((key.clone(), w.put(&key, &[&payload(i, 1000)]).unwrap()));
    }
    let stats = stats_of(&w);
    // A ring of 4 MiB and one writer slot: a 256 KiB buffer, reserved once.
    assert_eq!(stats["bytes_in_use"], 256 * KIB, "one buffer holds all ten");
    assert_eq!((stats["chunks"], stats["chunks_reserved"]), (10, 0));
    let large = w.put("large", &[&payload(99, 200 * 1024)]).unwrap();
    let grown = stats_of(&w)["bytes_in_use"] - 256 * KIB;
    assert!(
        (200 * KIB..210 * KIB).contains(&grown),
        "a large object is reserved on its own: {grown}"
    );
    for (i, (key, handle)) in handles.iter().enumerate() {
        assert_eq!(read(&r, handle, key).unwrap(), payload(i as u64, 1000));
    }
    assert_eq!(read(&r, &large, "large").unwrap(), payload(99, 200 * 1024));
    w.clear().unwrap();
    assert_eq!(
        stats_of(&w)["bytes_in_use"],
        0,
        "clear gives the buffer back"
    );
}

#[test]
fn an_idle_writers_buffer_is_taken_back_and_holds_nothing() {
    let (a, b, r) = two_writers_and_a_reader();
    put_and_read(&a, &r, "k", b"a small object of a's");
    // b's puts sweep the ring: a's buffer, just after k, must neither survive nor keep k.
    let mut n = 0u64;
    while a.is_cached("k").unwrap() {
        let key = format!("b{n}");
        put_and_read(&b, &r, &key, &payload(n, 4000));
        n += 1;
        assert!(n < 1000, "k was never evicted: a's idle buffer held it");
    }
    for i in 0..50 {
        let key = format!("a{i}");
        put_and_read(&a, &r, &key, &payload(1000 + i, 500));
    }
    let stats = stats_of(&a);
    assert!(stats["bytes_in_use"] <= stats["capacity"]);
    assert_eq!(stats["chunks_reserved"], 0);
    drop(b);
    drop(a); // closes: its buffer goes back, and nothing it holds is left to wait for
}

#[test]
fn a_dead_writers_buffer_is_reclaimed() {
    let (a, b, r) = two_writers_and_a_reader();
    put_and_read(&b, &r, "from b", b"carved from b's buffer");
    let dead = b.me;
    pretend_writer_dead(b);
    for n in 0..600 {
        let key = format!("a{n}");
        put_and_read(&a, &r, &key, &payload(n, 4000));
    }
    assert!(!a.is_cached("from b").unwrap(), "evicted with the rest");
    let lock = a.shared.lock(a.me).unwrap();
    let left: Vec<_> = a
        .shared
        .blocks(&lock)
        .unwrap()
        .into_iter()
        .filter(|block| block.state.kind == (BlockKind::Reserved { owner: dead }))
        .collect();
    assert!(left.is_empty(), "b's buffer was reclaimed: {left:?}");
}
