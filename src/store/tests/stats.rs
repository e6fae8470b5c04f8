//! `stats()` counts the ring in slices, the ring lock given back between two: a put that needs
//! the lock completes while a walk is paused, and a walk resumes on a block start however the
//! blocks were merged meanwhile (`ring::Walk`): checked at random too (every slice against a
//! walk of every block under the same hold of the lock, whatever other writers did between
//! two: puts of every size, hits, pins, invalidations, clears, deaths, a holder that died
//! mid-merge), with other writers' threads carving meanwhile, and with nothing changing (the
//! figures exact).

use std::sync::atomic::fence;
use std::sync::mpsc;
use std::time::Duration;

use super::*;
use crate::layout::{ALIGN, BlockKind, BlockState, chunk, header};
use crate::store::crash::hook;
use crate::store::lock::LockGuard;
use crate::store::ring::{Census, Walk};

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
    hook::set(hook::STATS_SLICE, move || {
        tell.send(lock_words(&watcher)).unwrap();
        // At the first pause, another writer puts an object too large for its allocation
        // buffer: it needs the ring lock, which the walk (on this thread) must not hold.
        if let Some(b) = b.take() {
            let (done, finished) = mpsc::channel();
            std::thread::spawn(move || {
                let put = b.put("large", &[&payload(7, 200 * 1024)]);
                // Closed before it says so: its close takes the ring lock too (to give its
                // allocation buffer back), which the next pause must not see held.
                drop(b);
                done.send(put.map(|_| ())).unwrap();
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
    hook::set(hook::STATS_SLICE, move || tell.send(()).unwrap());
    let chunks = stats_of(&w)["chunks"];
    hook::clear();
    assert_eq!(chunks, 400);
    let pauses = told.try_iter().count();
    assert!(pauses >= 400 / 48, "{pauses} pauses for 400 blocks");
}

/// The ring lock, repaired first if it was taken over from a holder that died (what
/// `Writer::lock` does for the writer's own operations).
fn ring_lock(w: &Writer) -> LockGuard<'_> {
    let guard = w.shared.lock(w.me).unwrap();
    if guard.taken_over() {
        w.shared.repair(&guard).unwrap();
    }
    guard
}

/// Writers that change the ring between two slices of a walk, at random (deterministic by
/// seed): puts of every size (carved from allocation buffers, reserved on their own, large
/// ones that evict and merge many small blocks, windows that would run past the ring's end,
/// one that ends exactly at it), hits (second chances) and pins (kept chunks: a window
/// then starts past the hand), invalidations, clears, a writer that dies (its buffer left
/// reserved) and one that dies holding the ring lock in the middle of a merge at the hand.
struct Meddlers {
    rng: Rng,
    writers: Vec<Writer>,
    keys: Vec<String>,
    pins: Vec<(usize, String, u64)>,
    puts: u64,
    deaths: u64,
}

impl Meddlers {
    fn new(seed: u64, of: &Writer, count: usize) -> Meddlers {
        Meddlers {
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            writers: (0..count).map(|_| join(of)).collect(),
            keys: Vec::new(),
            pins: Vec::new(),
            puts: 0,
            deaths: 0,
        }
    }

    fn key(&mut self) -> Option<String> {
        let n = self.keys.len() as u64;
        (n > 0).then(|| self.keys[self.rng.below(n) as usize].clone())
    }

    fn put(&mut self, w: usize, len: u64) {
        let key = format!("k{}", self.puts);
        self.puts += 1;
        match self.writers[w].put(&key, &[&payload(self.puts, len as usize)]) {
            Ok(_) => self.keys.push(key),
            Err(Error::Full { .. } | Error::IndexFull(_)) => {}
            Err(e) => panic!("put of {len} bytes: {e}"),
        }
    }

    /// One random change (or a few).
    fn meddle(&mut self) {
        let w = self.rng.below(self.writers.len() as u64) as usize;
        let l = self.writers[w].shared.layout;
        let largest = l.max_object_size.min(l.capacity - l.chunk_header_size);
        match self.rng.below(100) {
            0..=29 => {
                for _ in 0..=self.rng.below(20) {
                    let len = self.rng.below(1500);
                    self.put(w, len);
                }
            }
            30..=44 => {
                let len = 1500 + self.rng.below(16 * KIB);
                self.put(w, len);
            }
            45..=51 => {
                let len = 16 * KIB + self.rng.below(largest / 2);
                self.put(w, len);
            }
            52 => {
                let len = largest / 2 + self.rng.below(largest / 2 + 1);
                self.put(w, len);
            }
            53..=55 => {
                // An object whose block ends exactly at the ring's end, if reserved at the
                // hand: the hand then moves to the end, which is 0 of its next lap.
                let sh = &self.writers[w].shared;
                let hand = sh.header(header::HAND).unwrap().load(Ordering::Relaxed);
                let len = l.capacity - hand - l.chunk_header_size.min(l.capacity - hand);
                self.put(w, len.min(largest));
            }
            56..=65 => {
                if let Some(key) = self.key() {
                    let _ = self.writers[w].get_cached(&key);
                }
            }
            66..=72 => {
                if self.pins.len() < 4 {
                    if let Some(key) = self.key() {
                        if let Some(id) = self.writers[w].pin_object(&key).unwrap() {
                            self.pins.push((w, key, id));
                        }
                    }
                } else {
                    let (w, key, id) = self.pins.remove(0);
                    self.writers[w].unpin_object(&key, id).unwrap();
                }
            }
            73..=84 => {
                if let Some(key) = self.key() {
                    self.writers[w].invalidate(&key).unwrap();
                }
            }
            85..=87 => self.writers[w].clear().unwrap(),
            88..=92 => {
                // Dies with its buffer and its pins left as they are.
                self.die(w, None);
            }
            93..=95 => {
                let split = self.rng.below(2) == 0;
                self.die(w, Some(split));
            }
            _ => {}
        }
    }

    /// Writer `w` dies (holding the ring lock, mid-merge at the hand, split or not, if
    /// `in_merge`) and another joins in its place.
    fn die(&mut self, w: usize, in_merge: Option<bool>) {
        let successor = join(&self.writers[w]);
        let dead = std::mem::replace(&mut self.writers[w], successor);
        self.pins.retain(|&(p, ..)| p != w);
        if let Some(split) = in_merge {
            merge_at_the_hand_and_stop(&dead, split);
        }
        pretend_writer_dead(dead);
        self.deaths += 1;
    }
}

/// What a writer killed in `allocate` after it merged a window that starts at the hand, and
/// before it moved the hand past it, leaves: the ring lock held, the window's chunks evicted
/// and merged into one free block at the hand, or (`split`) that block split in two, the
/// first half reserved by the dead writer, the hand still at its start.
fn merge_at_the_hand_and_stop(w: &Writer, split: bool) {
    let sh = &w.shared;
    let guard = ring_lock(w);
    let hand = sh.header(header::HAND).unwrap().load(Ordering::Relaxed);
    let mut census = Census::new(w.me);
    let mut end = hand;
    {
        let index = sh.lock_index(w.me).unwrap();
        while end < sh.layout.capacity && end - hand < 64 * KIB {
            let block = sh.block(end).unwrap();
            let evicted = match block.state.kind {
                BlockKind::Free => true,
                BlockKind::Live => sh
                    .evict_if_unheld(&guard, &index, end, block.size, &mut census)
                    .unwrap(),
                _ => false,
            };
            if !evicted {
                break;
            }
            end += block.size;
        }
    }
    fence(Ordering::Release);
    let size = |address, size| {
        sh.chunk(address, chunk::SIZE)
            .unwrap()
            .store(size, Ordering::Release);
    };
    if end > hand {
        size(hand, end - hand);
    }
    let half = (end - hand) / 2 / ALIGN * ALIGN;
    if split && half > 0 {
        let rest = hand + half;
        sh.chunk(rest, chunk::ID)
            .unwrap()
            .store(0, Ordering::Relaxed);
        sh.state_word(rest)
            .unwrap()
            .store(BlockState::FREE.pack(), Ordering::Relaxed);
        size(rest, end - rest);
        size(hand, half);
        let reserved = BlockState {
            kind: BlockKind::Reserved { owner: w.me },
            referenced: false,
            keyed: false,
        };
        sh.state_word(hand)
            .unwrap()
            .store(reserved.pack(), Ordering::Release);
    }
    std::mem::forget(guard);
}

/// `w`'s ring full of small objects (some carved from buffers) and a few larger ones.
fn filled(meddlers: &mut Meddlers) {
    for i in 0..400 {
        let len = if i % 50 == 49 { 9000 } else { 100 + i % 700 };
        meddlers.put(i as usize % meddlers.writers.len(), len);
    }
}

/// One walk of `walker`'s ring in slices of 1 to 8 blocks, `meddlers` changing the ring
/// between two: each slice is the blocks of the ring then (compared with a walk of every
/// block under the same hold of the lock) from the first block start at or past where the
/// last one ended, and the walk ends at the ring's end.
fn walk_checked(walker: &Writer, meddlers: &mut Meddlers, seed: u64) -> usize {
    let sh = &walker.shared;
    let capacity = sh.layout.capacity;
    let mut walk = Walk::default();
    let mut walked = 0;
    let mut slices = 0;
    loop {
        let lock = ring_lock(walker);
        let max = 1 + meddlers.rng.below(8) as usize;
        let slice = sh.walk_slice(&lock, &mut walk, max).unwrap();
        let now = sh.blocks(&lock).unwrap();
        drop(lock);
        let first = now.iter().position(|b| b.address >= walked);
        if slice.is_empty() {
            // At the ring's end, or where the last block start walked was merged into the
            // ring's last block.
            assert_eq!(first, None, "seed {seed}: the walk ended at {walked}");
            return slices;
        }
        let first =
            first.unwrap_or_else(|| panic!("seed {seed}: a slice past the last block start"));
        let seen: Vec<(u64, u64)> = slice.iter().map(|b| (b.address, b.size)).collect();
        let real: Vec<(u64, u64)> = now[first..]
            .iter()
            .take(slice.len())
            .map(|b| (b.address, b.size))
            .collect();
        assert_eq!(
            seen, real,
            "seed {seed}, slice {slices}: the walk resumed from {walked}"
        );
        let last = slice[slice.len() - 1];
        walked = last.address + last.size;
        slices += 1;
        assert!(
            slices as u64 <= capacity / ALIGN,
            "seed {seed}: the walk does not end"
        );
        for _ in 0..=meddlers.rng.below(3) {
            meddlers.meddle();
        }
    }
}

#[test]
fn a_walk_yields_only_the_blocks_of_the_ring_as_it_is_whatever_changed_between_two_slices() {
    let (mut slices, mut deaths, mut evictions) = (0, 0, 0);
    for seed in 1..=24 {
        // A small index in every other store: puts then evict one chunk at a time to make
        // room in it (the hand moves without a merge).
        let max_objects = (seed % 2 == 0).then_some(96);
        let config = Config {
            // The walker, two meddlers, and the one that joins before another dies.
            max_writers: 4,
            max_objects,
            ..Config::new(256 * KIB, 1, None)
        };
        let walker = Writer::create_with(&config, None).unwrap();
        if seed % 3 == 0 {
            // The lap count wraps during the walks.
            let laps = walker.shared.header(header::HAND_LAPS).unwrap();
            laps.store(u64::MAX - 1, Ordering::Relaxed);
        }
        let mut meddlers = Meddlers::new(seed, &walker, 2);
        filled(&mut meddlers);
        for _ in 0..6 {
            slices += walk_checked(&walker, &mut meddlers, seed);
        }
        deaths += meddlers.deaths;
        evictions += stats_of(&walker)["evictions"];
        if seed % 3 == 0 {
            let laps = walker.shared.header(header::HAND_LAPS).unwrap();
            assert!(
                laps.load(Ordering::Relaxed) < 1000,
                "seed {seed}: the laps wrapped"
            );
        }
    }
    // What the seeds covered.
    assert!(
        slices > 1000 && deaths > 10 && evictions > 1000,
        "{slices} {deaths} {evictions}"
    );
}

/// `(chunks, chunks_reserved)` of `w`'s ring, counted in one walk under the ring lock.
fn census(w: &Writer) -> (u64, u64) {
    let lock = ring_lock(w);
    let (mut chunks, mut reserved) = (0, 0);
    for block in w.shared.blocks(&lock).unwrap() {
        match block.state.kind {
            BlockKind::Free => {}
            BlockKind::Reserved { .. } if block.buffer => {}
            BlockKind::Reserved { .. } => (chunks, reserved) = (chunks + 1, reserved + 1),
            BlockKind::Live | BlockKind::Evicting => chunks += 1,
        }
    }
    (chunks, reserved)
}

#[test]
fn stats_counts_a_ring_that_changes_between_its_slices_and_then_counts_it_exactly() {
    for seed in 1..=8 {
        let config = Config {
            max_writers: 4,
            ..Config::new(256 * KIB, 1, None)
        };
        let walker = Writer::create_with(&config, None).unwrap();
        let mut meddlers = Meddlers::new(seed, &walker, 2);
        filled(&mut meddlers);
        let most = walker.shared.layout.capacity / walker.shared.layout.chunk_header_size;
        let pauses = std::rc::Rc::new(std::cell::Cell::new(0));
        let counted = pauses.clone();
        hook::set(hook::STATS_SLICE, move || {
            counted.set(counted.get() + 1);
            meddlers.meddle();
        });
        for _ in 0..10 {
            let stats = stats_of(&walker);
            assert!(stats["chunks"] <= most, "seed {seed}: {stats:?}");
        }
        hook::clear(); // the meddlers (and their writers) go with it
        assert!(pauses.get() > 10, "seed {seed}: {} pauses", pauses.get());
        let stats = stats_of(&walker);
        assert_eq!(
            (stats["chunks"], stats["chunks_reserved"]),
            census(&walker),
            "seed {seed}: nothing changed during this one"
        );
    }
}

#[test]
fn stats_meanwhile_other_writers_threads_carve_put_and_evict() {
    let a = Arc::new(store(1024 * KIB, 1, 3));
    let most = a.shared.layout.capacity / a.shared.layout.chunk_header_size;
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let w = join(&a);
            std::thread::spawn(move || {
                let mut rng = Rng(t + 7);
                for i in 0..4000 {
                    let len = match rng.below(20) {
                        0 => 20 * KIB + rng.below(200 * KIB),
                        1..=3 => 2 * KIB + rng.below(16 * KIB),
                        _ => rng.below(1500),
                    };
                    let key = format!("t{t}-{i}");
                    match w.put(&key, &[&payload(i, len as usize)]) {
                        Ok(_) | Err(Error::Full { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                    if rng.below(8) == 0 {
                        w.invalidate(&format!("t{t}-{}", rng.below(i + 1))).unwrap();
                    }
                }
            })
        })
        .collect();
    let mut walks = 0;
    while !threads.iter().all(|t| t.is_finished()) || walks == 0 {
        let stats = stats_of(&a);
        assert!(stats["chunks"] <= most, "{stats:?}");
        walks += 1;
    }
    for t in threads {
        t.join().unwrap();
    }
    let stats = stats_of(&a);
    assert_eq!((stats["chunks"], stats["chunks_reserved"]), census(&a));
    assert!(walks > 1, "{walks} walks");
}

#[test]
fn with_nothing_changing_stats_counts_what_one_walk_under_the_lock_counts() {
    let a = store(8192 * KIB, 1, 3);
    let b = join(&a);
    let r = Reader::attach(&a.reader_info()).unwrap();
    let mut handles = Vec::new();
    for i in 0..600 {
        let w = if i % 3 == 0 { &b } else { &a };
        let key = format!("k{i}");
        handles.push((w.put(&key, &[&payload(i, 1000)]).unwrap(), key));
    }
    // 100 references read (10 leases still held: 10 views), 500 unread.
    let mut leases = Vec::new();
    for (handle, key) in &handles[..100] {
        let lease = r.acquire(handle, key).unwrap();
        if leases.len() < 10 {
            leases.push(lease);
        }
    }
    // 7 objects pinned by one writer, 3 by the other, one of them by both.
    for (_, key) in &handles[100..107] {
        a.pin(key).unwrap();
    }
    for (_, key) in &handles[106..109] {
        b.pin(key).unwrap();
    }
    // A block reserved and not (yet) published.
    let reserved = {
        let lock = ring_lock(&a);
        let mut census = Census::new(a.me);
        a.shared
            .allocate(&lock, 4 * KIB, &mut census, None)
            .unwrap()
            .expect("room")
    };
    let (tell, told) = mpsc::channel();
    hook::set(hook::STATS_SLICE, move || tell.send(()).unwrap());
    let stats = stats_of(&a);
    hook::clear();
    assert!(told.try_iter().count() >= 4, "counted in slices");
    assert_eq!(census(&a), (601, 1));
    let figures = [
        "chunks",
        "chunks_reserved",
        "outstanding_refs",
        "views",
        "pinned",
    ];
    assert_eq!(figures.map(|f| stats[f]), [601, 1, 500, 10, 9], "{stats:?}");
    drop(leases);
    let lock = ring_lock(&a);
    a.shared.unreserve(&lock, reserved).unwrap();
}
