//! `stats()` counts the ring in slices, the ring lock given back between two: a put that needs
//! the lock completes while a walk is paused, and a walk resumes on a block start however the
//! blocks were merged meanwhile (`ring::Walk`).

use std::sync::mpsc;
use std::time::Duration;

use super::*;
use crate::layout::header;
use crate::store::crash::hook;
use crate::store::ring::Walk;

const KIB: u64 = 1 << 10;

/// The ring lock's and the index lock's words (0: free).
fn lock_words(w: &Writer) -> (u64, u64) {
    let word = |offset| w.shared.header(offset).unwrap().load(Ordering::Relaxed);
    (word(header::LOCK), word(header::INDEX_LOCK))
}

#[test]
fn a_put_that_needs_the_ring_lock_completes_while_stats_is_between_two_slices() {
    let a = store(8192 * KIB, 1, 3);
    for i in 0..400 {
        a.put(&format!("small{i}"), &[&payload(i, 1000)]).unwrap();
    }
    let mut b = Some(join(&a));
    let watcher = join(&a);
    let (tell, told) = mpsc::channel();
    hook::set(move || {
        tell.send(lock_words(&watcher)).unwrap();
        // At the first pause, another writer puts an object too large for its allocation
        // buffer: it needs the ring lock, which the walk (on this thread) must not hold.
        if let Some(b) = b.take() {
            let (done, finished) = mpsc::channel();
            std::thread::spawn(move || {
                let put = b.put("large", &[&payload(7, 200 * 1024)]);
                done.send(put.map(|_| ())).unwrap();
                drop(b);
            });
            let put = finished.recv_timeout(Duration::from_secs(20));
            assert!(
                matches!(put, Ok(Ok(()))),
                "the put waited for the walk: {put:?}"
            );
        }
    });
    let stats: HashMap<_, _> = a.stats().unwrap().into_iter().collect();
    hook::clear();
    let pauses: Vec<(u64, u64)> = told.try_iter().collect();
    assert!(
        pauses.len() >= 3,
        "400 blocks in slices: {} pauses",
        pauses.len()
    );
    assert!(
        pauses.iter().all(|&words| words == (0, 0)),
        "neither lock held between two slices: {pauses:?}"
    );
    // The large object lies past the first slice (after the buffers of the small ones): the
    // walk resumed and counted it.
    assert_eq!((stats["chunks"], stats["objects"]), (401, 401));
    assert_eq!(stats_of(&a)["chunks"], 401);
}

/// The block starts of `w`'s ring now.
fn block_starts(w: &Writer) -> Vec<u64> {
    let lock = w.shared.lock(w.me).unwrap();
    let blocks = w.shared.blocks(&lock).unwrap();
    blocks.iter().map(|b| b.address).collect()
}

/// The hand as a position that only grows.
fn hand_position(w: &Writer) -> u64 {
    let word = |offset| w.shared.header(offset).unwrap().load(Ordering::Relaxed);
    word(header::HAND_LAPS) * w.shared.layout.capacity + word(header::HAND)
}

/// A 1 MiB ring that wrapped, full of small objects nobody holds, with its hand somewhere in
/// the middle.
fn full_ring() -> Writer {
    let w = writer(1024 * KIB, 1);
    for i in 0..3000 {
        w.put(&format!("small{i}"), &[&payload(i, 400)]).unwrap();
    }
    w
}

/// Walk `w`'s ring up to the block start `stop`, run `meanwhile` with the ring lock given
/// back, then walk the rest: the block starts of the rest.
fn walk_around(w: &Writer, stop: u64, meanwhile: impl FnOnce()) -> Vec<u64> {
    let sh = &w.shared;
    let mut walk = Walk::default();
    let mut walked = 0;
    while walked < stop {
        let lock = sh.lock(w.me).unwrap();
        let block = sh.walk_slice(&lock, &mut walk, 1).unwrap()[0];
        walked = block.address + block.size;
    }
    assert_eq!(walked, stop);
    meanwhile();
    let lock = sh.lock(w.me).unwrap();
    let rest = sh.walk_slice(&lock, &mut walk, usize::MAX).unwrap();
    assert!(
        sh.walk_slice(&lock, &mut walk, 1).unwrap().is_empty(),
        "done"
    );
    rest.iter().map(|b| b.address).collect()
}

/// Put objects of 20 KiB (each reserved on its own, evicting and merging the small ones at
/// the hand) until the hand went `distance` bytes further.
fn sweep(w: &Writer, distance: u64) {
    let from = hand_position(w);
    let mut i = 0;
    while hand_position(w) - from < distance {
        w.put(&format!("large{i}"), &[&payload(i, 20 * 1024)])
            .unwrap();
        i += 1;
    }
}

#[test]
fn a_walk_resumes_where_it_stopped_when_nothing_merged_meanwhile() {
    let w = full_ring();
    let starts = block_starts(&w);
    let stop = starts[starts.len() / 2];
    let rest = walk_around(&w, stop, || {
        for i in 0..100 {
            w.put(&format!("more{i}"), &[&payload(i, 400)]).unwrap(); // carved: no merge
        }
    });
    assert_eq!(rest[0], stop);
    let now = block_starts(&w);
    assert_eq!(rest, now[now.iter().position(|&a| a == stop).unwrap()..]);
}

#[test]
fn a_walk_resumes_on_a_block_start_after_merges_swallowed_the_one_it_stopped_at() {
    for lapped in [false, true] {
        let w = full_ring();
        let starts = block_starts(&w);
        let hand = w
            .shared
            .header(header::HAND)
            .unwrap()
            .load(Ordering::Relaxed);
        let at = starts.iter().position(|&a| a == hand).unwrap();
        // A few blocks past the hand: the next large put's window swallows it.
        let stop = starts[at + 5];
        let capacity = w.shared.layout.capacity;
        let distance = if lapped {
            capacity + 64 * KIB
        } else {
            40 * KIB
        };
        let rest = walk_around(&w, stop, || sweep(&w, distance));
        let now = block_starts(&w);
        assert!(
            !now.contains(&stop),
            "the block start the walk stopped at was merged away"
        );
        let first = now.iter().position(|&a| a > stop).unwrap();
        assert_eq!(rest, now[first..], "lapped: {lapped}");
    }
}

#[test]
fn a_slice_holds_fewer_blocks_where_each_block_has_more_words() {
    // 64 writer slots: a block's pin words alone are 64, so a slice holds 48 blocks, not 128.
    let w = store(8192 * KIB, 1, 64);
    for i in 0..400 {
        w.put(&format!("small{i}"), &[&payload(i, 1000)]).unwrap();
    }
    let (tell, told) = mpsc::channel();
    hook::set(move || tell.send(()).unwrap());
    let chunks = stats_of(&w)["chunks"];
    hook::clear();
    assert_eq!(chunks, 400);
    let pauses = told.try_iter().count();
    assert!(pauses >= 400 / 48, "{pauses} pauses for 400 blocks");
}
