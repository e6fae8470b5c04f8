//! The two store locks together, and the filings that take neither: after writers' threads
//! race (puts through buffers and on their own, a small index that fills, invalidations,
//! claims, hits) and after writers die (holding a lock, or filing a key without one), the
//! index and the ring agree: every entry names a LIVE keyed chunk with its id and key hash,
//! every LIVE keyed chunk is named by one entry, and the gauges count what is there.

use std::time::Duration;

use super::*;
use crate::layout::{BlockKind, BlockState, Bucket, Counter, chunk, header};

fn check_consistent(w: &Writer) {
    check(w, false);
}

/// `orphans`: a live keyed chunk no entry names may be left (by a writer that died).
fn check(w: &Writer, orphans: bool) {
    let sh = &w.shared;
    let ring = sh.lock(w.me).unwrap();
    let index = sh.lock_index(w.me).unwrap();
    let mut entries = HashMap::new();
    let (mut objects, mut claims) = (0u64, 0u64);
    for filed in sh.filed().unwrap() {
        match filed.head {
            Bucket::Live { address, .. } => {
                objects += 1;
                assert!(
                    entries
                        .insert(address, (filed.bucket, filed.version))
                        .is_none(),
                    "two entries name chunk {address}"
                );
            }
            Bucket::Claim { .. } => claims += 1,
            Bucket::Empty => {}
        }
    }
    // Every entry is reachable: its key's probe, from its home bucket, finds it (no empty
    // bucket lies between), and no key has two entries.
    let mut keys = std::collections::HashSet::new();
    for filed in sh.filed().unwrap() {
        if let Some(key) = sh.key_of(&filed).unwrap() {
            assert!(keys.insert(key.clone()), "key {key} filed twice");
            match sh.find(&index, &w.query(&key)).unwrap() {
                index::Found::Stored(entry) => assert_eq!(entry.bucket, filed.bucket, "{key}"),
                other => panic!(
                    "key {key} in bucket {} unreachable: {other:?}",
                    filed.bucket
                ),
            }
        }
    }
    let mut in_use = 0;
    for block in sh.blocks(&ring).unwrap() {
        if block.state.kind != BlockKind::Free {
            in_use += block.size;
        }
        let id = sh
            .chunk(block.address, chunk::ID)
            .unwrap()
            .load(Ordering::Relaxed);
        match entries.remove(&block.address) {
            Some((bucket, version)) => {
                assert_eq!(
                    block.state.kind,
                    BlockKind::Live,
                    "entry names a non-live block"
                );
                assert!(block.state.keyed, "entry names an unkeyed chunk");
                assert_eq!(
                    id, version,
                    "entry names chunk {} of another id",
                    block.address
                );
                let hash = sh
                    .chunk(block.address, chunk::KEY_HASH)
                    .unwrap()
                    .load(Ordering::Relaxed);
                assert_eq!(
                    hash,
                    sh.seg
                        .atomic(sh.layout.bucket_hash_offset(bucket))
                        .unwrap()
                        .load(Ordering::Relaxed)
                );
            }
            None => assert!(
                orphans || !(block.state.kind == BlockKind::Live && block.state.keyed),
                "live keyed chunk {} (id {id}) that no entry names",
                block.address
            ),
        }
    }
    assert!(
        entries.is_empty(),
        "entries naming no block start: {entries:?}"
    );
    assert_eq!(
        sh.counter(Counter::Objects)
            .unwrap()
            .load(Ordering::Relaxed),
        objects
    );
    assert_eq!(
        sh.counter(Counter::Claims).unwrap().load(Ordering::Relaxed),
        claims
    );
    assert_eq!(
        sh.counter(Counter::BytesInUse)
            .unwrap()
            .load(Ordering::Relaxed),
        in_use
    );
    drop(index);
    drop(ring);
}

fn race(capacity: u64, max_objects: Option<u64>, keys: u64, rounds: usize) {
    let config = Config {
        max_writers: 3,
        max_objects,
        ..Config::new(capacity, 1, None)
    };
    let first = Writer::create_with(&config, None).unwrap();
    let info = first.writer_info();
    let writers = [
        first,
        Writer::join(&info).unwrap(),
        Writer::join(&info).unwrap(),
    ];
    std::thread::scope(|scope| {
        for (wi, w) in writers.iter().enumerate() {
            for t in 0..3 {
                scope.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((wi * 8 + t + 1) as u64));
                    for _ in 0..rounds {
                        let k = rng.below(keys);
                        let key = format!("k{k}");
                        let len = 50 + (k as usize * 131) % 700;
                        match rng.below(12) {
                            0..=5 => match w.put(&key, &[&payload(k, len)]) {
                                Ok(h) => {
                                    if rng.below(2) == 0 {
                                        let _ = w.release(&h);
                                    }
                                }
                                Err(
                                    Error::DuplicateKey(_)
                                    | Error::Full { .. }
                                    | Error::IndexFull(_),
                                ) => {}
                                Err(e) => panic!("put: {e}"),
                            },
                            6..=7 => match w.get_cached(&key) {
                                Ok(h) => {
                                    w.release(&h).unwrap();
                                }
                                Err(Error::KeyNotFound(_)) => {}
                                Err(e) => panic!("issue: {e}"),
                            },
                            8..=9 => w.invalidate(&key).unwrap(),
                            10 => {
                                if w.claim(&key).unwrap() {
                                    w.unclaim(&key).unwrap();
                                }
                            }
                            _ => {
                                let _ = w.read_key(&key);
                            }
                        }
                    }
                });
            }
        }
    });
    assert!(stats_of(&writers[0])["evictions"] > 0, "the ring wrapped");
    for w in &writers {
        check_consistent(w);
    }
}

#[test]
fn index_and_ring_agree_after_buffered_puts_race() {
    race(1 << 20, None, 3000, 4000);
}

#[test]
fn index_and_ring_agree_after_a_full_index_races_refills() {
    race(1 << 20, Some(64), 400, 4000);
}

#[test]
fn index_and_ring_agree_in_a_small_ring() {
    race(64 * 1024, None, 200, 4000);
}

/// The index and the ring agree, with the dead writer's orphans allowed, and again after
/// puts that refill the ring over them (which reclaims them).
fn check_after_refills(a: &Writer) {
    check(a, true);
    for i in 0..40 {
        a.put(&format!("n{i}"), &[&[9u8; 500]]).unwrap();
    }
    check_consistent(a);
}

/// What a writer SIGKILLed at `alloc.unindexed` leaves: both locks held, a journaled window
/// of two chunks marked EVICTING and taken out of the index, the move count odd.
fn die_at_unindexed(b: Writer, hs: &[Handle]) {
    {
        let guard = b.shared.lock(b.me).unwrap();
        let index = b.shared.lock_index(b.me).unwrap();
        let sh = &b.shared;
        let start = hs[1].address;
        let len = sh.block_size(start).unwrap() + sh.block_size(hs[2].address).unwrap();
        sh.header(header::JOURNAL_LEN)
            .unwrap()
            .store(len, Ordering::Relaxed);
        sh.header(header::JOURNAL)
            .unwrap()
            .store(start + 1, Ordering::Relaxed);
        for h in &hs[1..3] {
            let state = sh.chunk(h.address, chunk::STATE).unwrap();
            let evicting = BlockState {
                kind: BlockKind::Evicting,
                ..BlockState::unpack(state.load(Ordering::Relaxed))
            };
            state.store(evicting.pack(), Ordering::Relaxed);
        }
        for h in &hs[1..3] {
            sh.unindex_chunk(&index, h.address).unwrap();
        }
        let moves = sh.header(header::INDEX_MOVES).unwrap();
        moves.store(moves.load(Ordering::Relaxed) | 1, Ordering::Relaxed);
        std::mem::forget(index);
        std::mem::forget(guard);
    }
    pretend_writer_dead(b);
}

#[test]
fn a_death_at_alloc_unindexed_is_repaired_index_lock_first() {
    let (a, b, hs) = two_writers_four_objects();
    die_at_unindexed(b, &hs);
    assert!(a.is_cached("k0").unwrap() && !a.is_cached("k1").unwrap());
    a.invalidate("k3").unwrap(); // the index lock, taken over
    assert_eq!(a.read_key("k0").unwrap(), vec![0u8; 500]);
    assert_eq!(
        a.read(&hs[1], "k1").unwrap(),
        vec![1u8; 500],
        "kept, live again"
    );
    check_after_refills(&a);
}

#[test]
fn a_death_at_alloc_unindexed_is_repaired_ring_lock_first() {
    let (a, b, hs) = two_writers_four_objects();
    die_at_unindexed(b, &hs);
    // A read of the EVICTING chunk settles it through the ring lock (taken over).
    assert_eq!(a.read(&hs[2], "k2").unwrap(), vec![2u8; 500]);
    a.invalidate("k3").unwrap();
    check_after_refills(&a);
}

#[test]
fn close_waits_for_an_operation_in_progress_and_refuses_new_ones() {
    // Were a thread's operation to take a lock after `close` gave the slot back, it would
    // hold it under a dead writer's name, and a waiter would take the lock over from it.
    let a = store(1 << 20, 1, 2);
    let b = join(&a);
    b.put("k", &[&[1u8; 100]]).unwrap();
    std::thread::scope(|scope| {
        let busy = b.enter().unwrap();
        let (closed, was_closed) = std::sync::mpsc::channel();
        let b = &b;
        scope.spawn(move || {
            b.close().unwrap();
            closed.send(()).unwrap();
        });
        while !b.closing.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        for refused in [b.invalidate("k"), b.unclaim("k"), b.clear()] {
            assert!(matches!(refused, Err(Error::Closed)), "{refused:?}");
        }
        assert!(matches!(b.claim("k"), Err(Error::Closed)));
        assert!(matches!(b.put("j", &[&[2u8; 100]]), Err(Error::Closed)));
        // Blocked, not slow: it cannot return while the operation is in progress.
        assert!(was_closed.recv_timeout(Duration::from_millis(50)).is_err());
        drop(busy);
        was_closed
            .recv_timeout(Duration::from_secs(60))
            .expect("close returns once the operation ends");
    });
    assert!(a.is_cached("k").unwrap());
    let c = join(&a); // the slot is free again
    c.put("j", &[&[2u8; 100]]).unwrap();
    check_consistent(&a);
}

#[test]
fn a_writer_closed_while_its_threads_put_claim_and_invalidate_leaves_the_store_whole() {
    let config = Config {
        max_writers: 2,
        max_objects: Some(64),
        ..Config::new(256 * 1024, 1, None)
    };
    let a = Writer::create_with(&config, None).unwrap();
    for round in 0..12u64 {
        // Each round's writer takes the slot the last one gave back.
        let b = Writer::join(&a.writer_info()).unwrap();
        std::thread::scope(|scope| {
            for t in 0..3u64 {
                let b = &b;
                scope.spawn(move || {
                    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (round * 8 + t + 1));
                    loop {
                        let k = rng.below(150);
                        let key = format!("k{k}");
                        let done = match rng.below(4) {
                            0 | 1 => match b.put(&key, &[&payload(k, 300)]) {
                                Ok(h) => b.release(&h).is_err(),
                                Err(Error::Closed) => true,
                                Err(Error::DuplicateKey(_) | Error::IndexFull(_)) => false,
                                Err(e) => panic!("put: {e}"),
                            },
                            2 => matches!(b.invalidate(&key), Err(Error::Closed)),
                            _ => match b.claim(&key) {
                                Ok(true) => matches!(b.unclaim(&key), Err(Error::Closed)),
                                Ok(false) => false,
                                Err(Error::Closed) => true,
                                Err(e) => panic!("claim: {e}"),
                            },
                        };
                        if done {
                            break;
                        }
                    }
                });
            }
            for i in 0..200 {
                let key = format!("a{i}");
                if let Ok(h) = a.put(&key, &[&payload(i, 200)]) {
                    a.release(&h).unwrap();
                }
            }
            b.close().unwrap();
        });
        // `a` claims nothing, and `close` dropped every claim `b` made before it: a claim
        // left now was filed after (an operation that did not wait for `close`).
        let claims = a.shared.filed().unwrap().into_iter();
        let left = claims.filter(|f| matches!(f.head, Bucket::Claim { .. }));
        assert_eq!(
            left.count(),
            0,
            "round {round}: a claim outlived its writer"
        );
        check_consistent(&a);
    }
}

#[test]
fn writers_filing_the_same_keys_at_once_file_each_once() {
    // Three writers' threads put the same keys at once (most filed without the index lock,
    // the rest behind the gate a fourth thread keeps opening with claims and invalidations of
    // other keys): each key is stored by exactly one put, and reads back as put.
    for _ in 0..8 {
        filing_race();
    }
}

fn filing_race() {
    let config = Config {
        max_writers: 3,
        ..Config::new(4 << 20, 1, None)
    };
    let first = Writer::create_with(&config, None).unwrap();
    let writers = [join(&first), join(&first), first];
    const KEYS: u64 = 1500;
    let stored = std::sync::Mutex::new(vec![0u32; KEYS as usize]);
    let done = std::sync::atomic::AtomicBool::new(false);
    let start = std::sync::Barrier::new(6);
    std::thread::scope(|scope| {
        let gate_keeper = &writers[2];
        let done = &done;
        scope.spawn(move || {
            let mut i = 0u64;
            while !done.load(Ordering::Relaxed) {
                let other = format!("other{}", i % 7);
                if gate_keeper.claim(&other).unwrap() {
                    gate_keeper.unclaim(&other).unwrap();
                }
                gate_keeper.invalidate(&other).unwrap();
                i += 1;
            }
        });
        let mut putters = Vec::new();
        for (wi, w) in writers.iter().enumerate() {
            for t in 0..2u64 {
                let (stored, start) = (&stored, &start);
                putters.push(scope.spawn(move || {
                    start.wait();
                    // Each thread walks the keys from its own starting point.
                    let first_key = (wi as u64 * 2 + t) * KEYS / 6;
                    for n in 0..KEYS {
                        let k = (first_key + n) % KEYS;
                        match w.put(&format!("k{k}"), &[&payload(k, 100)]) {
                            Ok(h) => {
                                w.release(&h).unwrap();
                                stored.lock().unwrap()[k as usize] += 1;
                            }
                            Err(Error::DuplicateKey(_)) => {}
                            Err(e) => panic!("put: {e}"),
                        }
                    }
                }));
            }
        }
        for putter in putters {
            putter.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let stored = stored.into_inner().unwrap();
    assert!(
        stored.iter().all(|&n| n == 1),
        "a key stored by {:?} puts",
        stored.iter().max()
    );
    for k in 0..KEYS {
        let w = &writers[k as usize % 3];
        assert_eq!(w.read_key(&format!("k{k}")).unwrap(), payload(k, 100));
    }
    assert_eq!(stats_of(&writers[0])["objects"], KEYS);
    for w in &writers {
        check_consistent(w);
    }
}

/// What a writer SIGKILLed at `publish.filing` leaves: counted in its slot's filing word, the
/// `objects` gauge counted for its key, and that key's bucket taken (its version 0).
fn die_filing(b: Writer, key: &str) {
    {
        let _busy = b.enter().unwrap();
        let sh = &b.shared;
        let filing = sh.start_filing(b.me).unwrap().expect("the gate is closed");
        std::mem::forget(sh.count_filing(&filing).unwrap().expect("room"));
        let query = b.query(key);
        let head = Bucket::Live {
            key: query.kref(),
            address: 0,
        };
        assert!(matches!(
            sh.take_bucket(&query, head).unwrap(),
            gate::Taken::Bucket(_)
        ));
        std::mem::forget(filing);
    }
    pretend_writer_dead(b);
}

#[test]
fn a_writer_that_dies_filing_is_repaired_by_the_next_holder_of_the_index_lock() {
    let (a, b, _) = two_writers_four_objects();
    die_filing(b, "half");
    // Its bucket is no entry: a lookup misses (after waiting out the "change").
    assert!(!a.is_cached("half").unwrap());
    assert!(a.keys().unwrap().iter().all(|k| k != "half"));
    // A put of that key meets the half-filed bucket, takes the lock, whose opening of the
    // gate finds the filer dead and repairs the index.
    a.put("half", &[&[7u8; 500]]).unwrap();
    assert_eq!(a.read_key("half").unwrap(), vec![7u8; 500]);
    assert!(!a.shared.left_filing(1).unwrap(), "its count is void");
    assert_eq!(stats_of(&a)["objects"], 5);
    check_consistent(&a);
    let c = join(&a); // its slot is free again
    c.put("more", &[&[8u8; 500]]).unwrap();
    check_consistent(&a);
}

#[test]
fn a_holder_that_stops_before_repairing_leaves_a_dead_filers_count_to_the_next() {
    let (a, b, _) = two_writers_four_objects();
    {
        let _busy = a.enter().unwrap();
        let index = a.shared.lock_index(a.me).unwrap();
        // Let b file behind a's back (as if a had taken the lock after b counted in), die
        // there, and have a find it, then stop (an error, a death) before repairing.
        a.shared.close_gate().unwrap();
        die_filing(b, "half");
        assert_eq!(a.shared.open_gate(&index).unwrap().len(), 1);
    }
    assert!(
        a.shared.left_filing(1).unwrap(),
        "the count stands until the repair it calls for is done"
    );
    a.put("half", &[&[7u8; 500]]).unwrap();
    assert!(
        !a.shared.left_filing(1).unwrap(),
        "the next holder repaired, then voided"
    );
    assert_eq!(a.read_key("half").unwrap(), vec![7u8; 500]);
    assert_eq!(stats_of(&a)["objects"], 5);
    check_consistent(&a);
}

#[test]
fn a_writer_that_joins_the_slot_of_one_that_died_filing_repairs_the_index_first() {
    let (a, b, _) = two_writers_four_objects();
    die_filing(b, "half");
    let c = join(&a);
    assert_eq!(c.slot(), 1, "the dead filer's slot");
    assert!(
        !a.shared.left_filing(1).unwrap(),
        "the count is void, the word c's"
    );
    assert_eq!(
        stats_of(&a)["objects"],
        4,
        "the dead filer's count is taken back"
    );
    c.put("half", &[&[7u8; 500]]).unwrap();
    assert_eq!(a.read_key("half").unwrap(), vec![7u8; 500]);
    check_consistent(&a);
}

/// Whether `key` is stored, as the index lock's holder finds it (no lookup race).
fn stored_under_lock(w: &Writer, key: &str) -> bool {
    let _busy = w.enter().unwrap();
    let index = w.shared.lock_index(w.me).unwrap();
    matches!(
        w.shared.find(&index, &w.query(key)).unwrap(),
        index::Found::Stored(_)
    )
}

#[test]
fn filings_racing_removals_in_a_dense_index_lose_no_entry() {
    // A 64-bucket index kept nearly half full, so clusters are long: each thread puts and
    // invalidates keys only it touches (so it knows whether each is stored) among shared
    // keys every thread puts and invalidates, whose removals shift entries back while
    // filings take buckets. No ring wrap, no index full: nothing is ever evicted.
    let config = Config {
        max_writers: 3,
        max_objects: Some(32),
        ..Config::new(64 << 20, 1, None)
    };
    let first = Writer::create_with(&config, None).unwrap();
    let writers = [join(&first), join(&first), first];
    std::thread::scope(|scope| {
        for (wi, w) in writers.iter().enumerate() {
            for t in 0..2u64 {
                scope.spawn(move || {
                    let me = wi as u64 * 2 + t;
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (me + 1));
                    let mut stored = [false; 3];
                    for _ in 0..20_000 {
                        if rng.below(2) == 0 {
                            let k = rng.below(12);
                            let key = format!("shared{k}");
                            match rng.below(2) {
                                0 => match w.put(&key, &[&payload(k, 100)]) {
                                    Ok(h) => w.release(&h).unwrap(),
                                    Err(Error::DuplicateKey(_)) => {}
                                    Err(e) => panic!("put: {e}"),
                                },
                                _ => w.invalidate(&key).unwrap(),
                            }
                            continue;
                        }
                        let i = rng.below(3) as usize;
                        let key = format!("own{me}.{i}");
                        let tag = 1000 + me * 3 + i as u64;
                        if stored[i] {
                            match w.read_key(&key) {
                                Ok(got) => assert_eq!(got, payload(tag, 100), "{key}"),
                                // A lookup may miss it while a move is stalled: not lost.
                                Err(Error::KeyNotFound(_)) => {
                                    assert!(stored_under_lock(w, &key), "{key} lost");
                                }
                                Err(e) => panic!("read {key}: {e}"),
                            }
                            w.invalidate(&key).unwrap();
                            assert!(!stored_under_lock(w, &key), "{key} invalidated");
                        } else {
                            assert!(!stored_under_lock(w, &key), "{key} not put");
                            match w.put(&key, &[&payload(tag, 100)]) {
                                Ok(h) => w.release(&h).unwrap(),
                                Err(e) => panic!("put {key}: {e}"),
                            }
                            assert!(stored_under_lock(w, &key), "{key} put");
                        }
                        stored[i] = !stored[i];
                        if rng.below(8) == 0 {
                            std::thread::yield_now();
                        }
                    }
                });
            }
        }
    });
    assert_eq!(stats_of(&writers[0])["evictions"], 0);
    for w in &writers {
        check_consistent(w);
    }
}
