//! Several writers over one real segment: sharing, joining and leaving, single flight,
//! metadata, a full index, writers that die (their stamps void, a lock they held taken over
//! and repaired), a proptest state machine of three writers against a model, and threads of
//! several writers racing on the same keys.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

use super::tests::{payload, read, stats_of, writer};
use super::*;
use crate::handle::Handle;
use crate::layout::{BlockKind, BlockState, Config, WRITER_LOCK, chunk};
use proptest::prelude::*;

fn store(capacity: u64, n_readers: u32, max_writers: u32) -> Writer {
    let config = Config {
        max_writers,
        ..Config::new(capacity, n_readers, None)
    };
    Writer::create_with(&config, None).expect("create segment")
}

fn join(w: &Writer) -> Writer {
    Writer::join(&w.writer_info()).expect("join")
}

/// What the kernel does when a writer's process dies: its OFD locks go, and nothing else
/// happens (its slot stays claimed, its stamps stay where they are). The writer is then
/// dropped without leaving the store.
fn pretend_dead(w: Writer) {
    let l = w.shared.layout;
    w.shared.seg.unlock(l.writer_slot_lock(w.me.slot)).unwrap();
    w.shared.seg.unlock(WRITER_LOCK).unwrap();
    w.closing.store(true, Ordering::Relaxed);
    drop(w);
}

#[test]
fn every_writer_sees_every_object_and_the_store_counts_once() {
    let a = store(1 << 16, 1, 3);
    let b = join(&a);
    let c = join(&a);
    assert_eq!((a.slot(), b.slot(), c.slot()), (0, 1, 2));
    let r = Reader::attach(&b.reader_info()).unwrap();
    let h = a.put("k", &[b"from a"]).unwrap();
    assert!(b.is_cached("k").unwrap() && c.is_cached("k").unwrap());
    let hb = b.get_cached("k").unwrap();
    assert_eq!((hb.address, hb.monotonic_id), (h.address, h.monotonic_id));
    assert_eq!(read(&r, &h, "k").unwrap(), b"from a");
    assert_eq!(read(&r, &hb, "k").unwrap(), b"from a");
    let hj = c.put("j", &[b"from c"]).unwrap();
    assert_eq!(
        a.read(&hj, "j").unwrap(),
        b"from c",
        "any writer reads any handle"
    );
    assert!(matches!(
        b.put("k", &[b"again"]),
        Err(Error::DuplicateKey(_))
    ));
    c.invalidate("k").unwrap();
    assert!(!a.is_cached("k").unwrap() && !b.is_cached("k").unwrap());
    assert_eq!(b.keys().unwrap(), vec!["j".to_owned()]);
    let stats = stats_of(&a);
    assert_eq!((stats["puts"], stats["hits"], stats["objects"]), (2, 1, 1));
    assert_eq!(stats["writers_attached"], 3);
    for w in [&b, &c] {
        let other = stats_of(w);
        for name in ["puts", "hits", "objects", "bytes_in_use", "last_id"] {
            assert_eq!(other[name], stats[name], "{name} is the store's");
        }
    }
    b.clear().unwrap();
    assert!(!a.is_cached("j").unwrap() && !c.is_cached("j").unwrap());
    assert!(
        matches!(read(&r, &hj, "j"), Err(Error::Stale)),
        "clear dropped the unread reference and reclaimed the chunk"
    );
}

#[test]
fn joining_checks_the_handle_and_the_free_slots() {
    let a = store(1 << 16, 1, 2);
    let mut wrong = a.writer_info();
    wrong.secret[0] ^= 1;
    assert!(matches!(Writer::join(&wrong), Err(Error::InvalidHandle(_))));
    let mut geometry = a.writer_info();
    geometry.max_writers = 3;
    assert!(matches!(Writer::join(&geometry), Err(Error::Corrupt(_))));
    let mut elsewhere = a.writer_info();
    elsewhere.name = format!("{}x", elsewhere.name);
    assert!(matches!(Writer::join(&elsewhere), Err(Error::NotFound(_))));
    let b = join(&a);
    assert!(matches!(
        Writer::join(&a.writer_info()),
        Err(Error::NoWriterSlot(2))
    ));
    drop(b);
    let b = join(&a);
    assert_eq!(b.slot(), 1, "a closed writer's slot is free");
    let epoch = b.me.epoch;
    pretend_dead(b);
    let b = join(&a);
    assert_eq!(
        (b.slot(), b.me.epoch),
        (1, epoch + 1),
        "a dead writer's slot is taken over"
    );
    assert_eq!(stats_of(&a)["writers_reclaimed"], 1);
    let solo = writer(1 << 16, 1);
    assert!(matches!(
        Writer::join(&solo.writer_info()),
        Err(Error::NoWriterSlot(1))
    ));
}

#[test]
fn the_last_writer_to_close_unlinks_once_and_readers_carry_on_until_then() {
    let a = store(1 << 16, 1, 2);
    let info = a.writer_info();
    let b = join(&a);
    let r = Reader::attach(&a.reader_info()).unwrap();
    let name = a.name().to_owned();
    let h = a.put("k", &[b"data"]).unwrap();
    a.close().unwrap();
    assert!(matches!(a.put("j", &[b"x"]), Err(Error::Closed)));
    assert!(list_segments().contains(&name), "b still uses it");
    assert!(inspect(&name).unwrap().creator_alive);
    assert_eq!(read(&r, &h, "k").unwrap(), b"data");
    assert!(
        b.is_cached("k").unwrap(),
        "items outlive the writer that put them"
    );
    let a2 = Writer::join(&info).expect("a store with a live writer can be joined");
    drop(a2);
    b.close().unwrap();
    assert!(!list_segments().contains(&name), "the last writer unlinks");
    assert!(matches!(r.acquire(&h, "k"), Err(Error::WriterGone(_))));
    assert!(matches!(Writer::join(&info), Err(Error::NotFound(_))));
}

#[test]
fn a_store_whose_writers_all_died_cannot_be_joined_and_is_prunable() {
    let a = store(1 << 16, 1, 2);
    let info = a.writer_info();
    let b = join(&a);
    let name = a.name().to_owned();
    pretend_dead(a);
    assert_eq!(status(&name).unwrap(), Status::Live, "b lives");
    pretend_dead(b);
    assert!(matches!(status(&name).unwrap(), Status::Orphaned(_)));
    assert!(matches!(Writer::join(&info), Err(Error::WriterGone(_))));
    crate::segment::unlink(&name).unwrap();
}

#[test]
fn a_claim_is_single_flight_and_ends_with_a_put_an_unclaim_or_its_writer() {
    let a = store(1 << 16, 1, 3);
    let b = join(&a);
    let c = join(&a);
    assert!(a.claim("k").unwrap());
    assert!(a.claim("k").unwrap(), "a holds it already");
    assert!(!b.claim("k").unwrap(), "a live writer holds it");
    assert_eq!(stats_of(&a)["claims"], 1);
    assert_eq!(
        b.wait_for(&["k"], Duration::from_millis(20)).unwrap(),
        [false],
        "not put in time"
    );
    assert_eq!(
        a.wait_for(&["k"], Duration::from_secs(600)).unwrap(),
        [false],
        "a writer never waits on its own claim"
    );
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| b.wait_for(&["k", "unclaimed"], Duration::from_secs(600)));
        std::thread::sleep(Duration::from_millis(5));
        a.put("k", &[b"v"]).unwrap();
        assert_eq!(waiting.join().unwrap().unwrap(), [true, false]);
    });
    assert_eq!(stats_of(&a)["claims"], 0, "the put ended the claim");
    assert!(!c.claim("k").unwrap(), "stored");
    assert!(a.claim("u").unwrap());
    a.unclaim("u").unwrap();
    assert!(b.claim("u").unwrap(), "unclaimed");
    assert!(b.claim("w").unwrap());
    pretend_dead(b);
    assert_eq!(
        c.wait_for(&["u", "w"], Duration::from_secs(600)).unwrap(),
        [false, false],
        "a dead writer's claims are void at once"
    );
    assert!(c.claim("u").unwrap(), "taken over from the dead writer");
    assert!(c.claim("v").unwrap());
    drop(c);
    assert!(a.claim("v").unwrap(), "closing gave c's claims back");
    a.put("u", &[b"u"]).unwrap();
    assert_eq!(stats_of(&a)["claims"], 1, "a's v (dead b's w was dropped)");
}

#[test]
fn metadata_is_every_writers_and_long_keys_are_exact() {
    let a = store(1 << 16, 1, 2);
    let b = join(&a);
    let r = Reader::attach(&a.reader_info()).unwrap();
    let h = a
        .put_with_meta("k", &[b"payload"], b"prompt updates")
        .unwrap();
    assert_eq!(
        b.read_meta("k", None).unwrap(),
        (h.monotonic_id, b"prompt updates".to_vec())
    );
    assert_eq!(
        b.read_meta("k", Some(h.monotonic_id)).unwrap().1,
        b"prompt updates"
    );
    assert!(matches!(
        b.read_meta("k", Some(h.monotonic_id + 1)),
        Err(Error::KeyNotFound(_))
    ));
    assert_eq!(
        read(&r, &h, "k").unwrap(),
        b"payload",
        "readers see the payload only"
    );
    b.put("plain", &[b"p"]).unwrap();
    assert_eq!(a.read_meta("plain", None).unwrap().1, b"");
    let long = "x".repeat(300);
    let near = format!("{}y", &long[..299]);
    let hl = a.put_with_meta(&long, &[b"long"], b"meta").unwrap();
    assert!(b.is_cached(&long).unwrap() && !b.is_cached(&near).unwrap());
    assert!(b.keys().unwrap().contains(&long));
    let again = b.get_cached(&long).unwrap();
    assert_eq!(read(&r, &again, &long).unwrap(), b"long");
    assert_eq!(
        b.read_meta(&long, None).unwrap(),
        (hl.monotonic_id, b"meta".to_vec())
    );
    assert!(b.claim(&near).unwrap() && !a.claim(&near).unwrap());
    let too_long = "k".repeat(crate::layout::MAX_KEY_LEN + 1);
    assert!(matches!(
        a.put(&too_long, &[b""]),
        Err(Error::InvalidArgument(_))
    ));
    let big_meta = vec![0u8; crate::layout::MAX_META_LEN + 1];
    assert!(matches!(
        a.put_with_meta("m", &[b""], &big_meta),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_full_index_evicts_with_clock_or_refuses() {
    let config = Config {
        max_objects: Some(4),
        ..Config::new(1 << 16, 1, None)
    };
    let w = Writer::create_with(&config, None).unwrap();
    for i in 0..10 {
        w.put(&format!("k{i}"), &[b"tiny"]).unwrap();
    }
    let mut keys = w.keys().unwrap();
    keys.sort();
    assert_eq!(
        keys,
        ["k6", "k7", "k8", "k9"],
        "CLOCK evicted the oldest for room"
    );
    assert_eq!(stats_of(&w)["objects"], 4);
    let _r = Reader::attach(&w.reader_info()).unwrap();
    w.clear().unwrap();
    for i in 0..3 {
        w.put(&format!("held{i}"), &[b"unread"]).unwrap();
    }
    assert!(w.claim("c").unwrap());
    assert!(matches!(w.put("x", &[b"x"]), Err(Error::IndexFull(4))));
    assert!(
        w.claim("d").unwrap(),
        "not recorded: the caller computes it anyway"
    );
    assert_eq!(stats_of(&w)["claims"], 1);
    w.put("c", &[b"c"])
        .expect("the claim's bucket takes the entry");
}

#[test]
fn a_dead_writers_reservation_pins_and_hazards_are_void() {
    // A ring of four 1 KiB chunks and no reader: only writers hold anything.
    let a = store(4096, 1, 2);
    let b = join(&a);
    b.put("pinned", &[&[1u8; 896]]).unwrap();
    b.pin("pinned").unwrap();
    let reserved = b.reserve(1024).unwrap().address;
    let held = b.put("held", &[&[2u8; 896]]).unwrap();
    let entry = index::Entry {
        bucket: 0,
        address: held.address,
        id: held.monotonic_id,
    };
    std::mem::forget(b.protect(&entry).unwrap().expect("live"));
    a.put("x", &[&[0u8; 896]]).expect("one free chunk was left");
    a.put("y", &[&[0u8; 896]]).expect("x is evicted");
    assert!(!a.is_cached("x").unwrap(), "only x could go");
    assert!(a.is_cached("pinned").unwrap() && a.is_cached("held").unwrap());
    assert!(matches!(
        a.put("z", &[&[0u8; 896]]),
        Ok(_) | Err(Error::Full { .. })
    ));
    assert_eq!(stats_of(&a)["chunks_reserved"], 1);
    pretend_dead(b);
    for i in 0..8 {
        a.put(&format!("n{i}"), &[&[3u8; 896]])
            .expect("the dead writer's blocks are reclaimed");
    }
    let stats = stats_of(&a);
    assert_eq!((stats["chunks_reserved"], stats["pinned"]), (0, 0));
    assert!(!a.is_cached("pinned").unwrap() && !a.is_cached("held").unwrap());
    let _ = reserved;
}

#[test]
fn a_dead_writers_hazards_do_not_pass_to_the_next_occupant_of_its_slot() {
    // A hazard word holds a chunk id and no epoch: once the slot has a live occupant again,
    // whatever the dead one left there would count as that occupant's (holding the chunk
    // forever, and making its `close` wait forever).
    let a = store(4096, 1, 2);
    let b = join(&a);
    let held = b.put("held", &[&[2u8; 896]]).unwrap();
    let entry = index::Entry {
        bucket: 0,
        address: held.address,
        id: held.monotonic_id,
    };
    std::mem::forget(b.protect(&entry).unwrap().expect("live"));
    pretend_dead(b);
    let c = join(&a);
    assert_eq!(c.slot(), 1, "the dead writer's slot is taken again");
    let stale = (0..slot::HAZARDS).any(|h| {
        let word = c
            .shared
            .writer_slot(c.me.slot, slot::HAZARD + 8 * h)
            .unwrap();
        word.load(Ordering::SeqCst) != 0
    });
    if stale {
        pretend_dead(c); // its `close` would wait for the stale hazard forever
        panic!("the dead writer's hazard passed to the next occupant of its slot");
    }
    for i in 0..8 {
        a.put(&format!("n{i}"), &[&[3u8; 896]])
            .expect("the dead writer's chunk is reclaimed");
    }
    assert!(!a.is_cached("held").unwrap());
    c.close().unwrap();
}

#[test]
fn a_live_lock_holder_is_waited_for() {
    let a = store(1 << 16, 1, 2);
    let b = join(&a);
    let released = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel();
        let (b, released) = (&b, &released);
        scope.spawn(move || {
            let guard = b.shared.lock(b.me).unwrap();
            tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            released.store(true, Ordering::SeqCst);
            drop(guard);
        });
        rx.recv().unwrap();
        a.put("k", &[b"v"]).unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "a put waited for the live holder"
        );
    });
}

#[test]
fn a_lock_holder_that_died_mid_eviction_is_taken_over_and_repaired() {
    let a = store(8192, 1, 2);
    let b = join(&a);
    let hs: Vec<Handle> = (0..4)
        .map(|i| a.put(&format!("k{i}"), &[&[i as u8; 500]]).unwrap())
        .collect();
    let victim = hs[1].address;
    {
        // b takes the lock, journals a window, marks a chunk EVICTING, kills another, and
        // dies: the state a SIGKILL between two steps of `allocate` leaves.
        let guard = b.shared.lock(b.me).unwrap();
        let sh = &b.shared;
        let size = sh.block_size(victim).unwrap();
        sh.header(header::JOURNAL_LEN)
            .unwrap()
            .store(2 * size, Ordering::Relaxed);
        sh.header(header::JOURNAL)
            .unwrap()
            .store(victim + 1, Ordering::Relaxed);
        let state = sh.chunk(victim, chunk::STATE).unwrap();
        let evicting = BlockState {
            kind: BlockKind::Evicting,
            ..BlockState::unpack(state.load(Ordering::Relaxed))
        };
        state.store(evicting.pack(), Ordering::Relaxed);
        let killed = hs[2].address;
        let bucket = sh
            .chunk(killed, chunk::BUCKET)
            .unwrap()
            .load(Ordering::Relaxed);
        assert!(
            sh.unindex(&guard, bucket - 1, killed, hs[2].monotonic_id)
                .unwrap()
        );
        sh.chunk(killed, chunk::ID)
            .unwrap()
            .store(0, Ordering::Relaxed);
        let marked = BlockState {
            kind: BlockKind::Evicting,
            ..BlockState::unpack(
                sh.chunk(killed, chunk::STATE)
                    .unwrap()
                    .load(Ordering::Relaxed),
            )
        };
        sh.chunk(killed, chunk::STATE)
            .unwrap()
            .store(marked.pack(), Ordering::Relaxed);
        sh.counter(crate::layout::Counter::BytesInUse)
            .unwrap()
            .store(12345, Ordering::Relaxed);
        std::mem::forget(guard);
    }
    pretend_dead(b);
    a.put("after", &[b"v"]).expect("the lock was taken over");
    let sh = &a.shared;
    let guard = sh.lock(a.me).unwrap();
    let blocks = sh.blocks(&guard).unwrap();
    drop(guard);
    let kind_at = |address| {
        blocks
            .iter()
            .find(|b| b.address == address)
            .map(|b| b.state.kind)
    };
    assert_eq!(kind_at(victim), Some(BlockKind::Live), "restored");
    assert_eq!(
        kind_at(hs[2].address),
        Some(BlockKind::Free),
        "its kill finished"
    );
    assert!(a.is_cached("k1").unwrap() && !a.is_cached("k2").unwrap());
    let in_use: u64 = blocks
        .iter()
        .filter(|b| b.state.kind != BlockKind::Free)
        .map(|b| b.size)
        .sum();
    let stats = stats_of(&a);
    assert_eq!(stats["bytes_in_use"], in_use, "the gauges were recounted");
    assert_eq!(stats["objects"], 4);
    assert_eq!(stats["puts"], 5);
}

// ---------------------------------------------------------------------------------------
// State machine: three writers, two readers, against a model
// ---------------------------------------------------------------------------------------

const WRITERS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    Put {
        w: usize,
        key: u8,
        len: usize,
        meta: bool,
    },
    Issue {
        w: usize,
        key: u8,
    },
    Read {
        reader: usize,
        pick: usize,
    },
    Replay {
        reader: usize,
        pick: usize,
    },
    Pin {
        w: usize,
        key: u8,
    },
    Unpin {
        w: usize,
        key: u8,
    },
    Invalidate {
        w: usize,
        key: u8,
    },
    Release {
        w: usize,
        pick: usize,
    },
    Clear {
        w: usize,
    },
    Claim {
        w: usize,
        key: u8,
    },
    Unclaim {
        w: usize,
        key: u8,
    },
    /// The writer dies and another process joins in its place.
    Kill {
        w: usize,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let w = || 0..WRITERS;
    let key = || 0u8..12;
    prop_oneof![
        6 => (w(), key(), prop_oneof![1usize..64, 64usize..2000, Just(3968usize)], any::<bool>())
            .prop_map(|(w, key, len, meta)| Op::Put { w, key, len, meta }),
        3 => (w(), key()).prop_map(|(w, key)| Op::Issue { w, key }),
        6 => (0usize..2, any::<usize>()).prop_map(|(reader, pick)| Op::Read { reader, pick }),
        1 => (0usize..2, any::<usize>()).prop_map(|(reader, pick)| Op::Replay { reader, pick }),
        1 => (w(), key()).prop_map(|(w, key)| Op::Pin { w, key }),
        1 => (w(), key()).prop_map(|(w, key)| Op::Unpin { w, key }),
        1 => (w(), key()).prop_map(|(w, key)| Op::Invalidate { w, key }),
        2 => (w(), any::<usize>()).prop_map(|(w, pick)| Op::Release { w, pick }),
        1 => w().prop_map(|w| Op::Clear { w }),
        2 => (w(), key()).prop_map(|(w, key)| Op::Claim { w, key }),
        1 => (w(), key()).prop_map(|(w, key)| Op::Unclaim { w, key }),
        1 => w().prop_map(|w| Op::Kill { w }),
    ]
}

/// The model: what each chunk holds, the references each reader is owed per chunk (a
/// reader's references to one chunk are interchangeable, whichever writer's handle carried
/// them), the handles each writer may still give back, pins, claims.
#[derive(Default)]
struct Model {
    truth: HashMap<u64, (String, Vec<u8>, Vec<u8>)>,
    owed: [HashMap<u64, u32>; 2],
    issued: Vec<Handle>,
    /// (writer, incarnation, handle) -> handles not given back yet.
    unreleased: HashMap<(usize, u32, Handle), u32>,
    incarnation: [u32; WRITERS],
    pins: HashMap<(usize, String), u32>,
    claims: HashMap<String, usize>,
}

impl Model {
    fn issue(&mut self, handle: Handle, writer: usize) {
        for owed in self.owed.iter_mut() {
            *owed.entry(handle.monotonic_id).or_default() += 1;
        }
        let incarnation = self.incarnation[writer];
        self.issued.push(handle);
        *self
            .unreleased
            .entry((writer, incarnation, handle))
            .or_default() += 1;
    }

    fn owes(&self, reader: usize, id: u64) -> bool {
        self.owed[reader].get(&id).is_some_and(|&n| n > 0)
    }

    fn consume(&mut self, reader: usize, id: u64) {
        if let Some(n) = self.owed[reader].get_mut(&id) {
            *n = n.saturating_sub(1);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The single-writer model's oracle, with three writers interleaving: every writer sees
    /// one key set; a handle a reader has not yet read always reads back its own bytes, from
    /// whichever writer issued it; replays read their own bytes or are stale; a key pinned by
    /// any live writer stays cached; metadata comes back from any writer; claims are single
    /// flight (void with their writer); a writer releases only the handles it issued; a
    /// writer that dies leaves nothing that blocks the others, and its slot is joinable.
    #[test]
    fn writers_match_the_model(ops in proptest::collection::vec(op_strategy(), 1..120)) {
        let first = store(16 * 1024, 2, WRITERS as u32);
        let info = first.writer_info();
        let mut writers = vec![first];
        for _ in 1..WRITERS { writers.push(Writer::join(&info).unwrap()); }
        let readers = [
            Reader::attach(&writers[0].reader_info()).unwrap(),
            Reader::attach(&writers[0].reader_info()).unwrap(),
        ];
        let mut m = Model::default();
        let mut seq = 0u64;
        for op in ops {
            match op {
                Op::Put { w, key, len, meta } => {
                    let key = format!("k{key}");
                    seq += 1;
                    let bytes = payload(seq, len);
                    let meta = if meta { payload(seq + 7, 40) } else { Vec::new() };
                    match writers[w].put_with_meta(&key, &[&bytes], &meta) {
                        Ok(h) => {
                            prop_assert!(!m.truth.contains_key(&h.monotonic_id));
                            m.truth.insert(h.monotonic_id, (key.clone(), bytes, meta));
                            m.issue(h, w);
                            m.claims.remove(&key);
                        }
                        Err(Error::DuplicateKey(_)) => {
                            prop_assert!(writers.iter().all(|x| x.is_cached(&key).unwrap()));
                        }
                        Err(Error::Full { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Issue { w, key } => {
                    let key = format!("k{key}");
                    match writers[w].get_cached(&key) {
                        Ok(h) => {
                            prop_assert_eq!(&m.truth[&h.monotonic_id].0, &key);
                            m.issue(h, w);
                        }
                        Err(Error::KeyNotFound(_)) => {
                            prop_assert!(writers.iter().all(|x| !x.is_cached(&key).unwrap()));
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Read { reader, pick } => {
                    let owed: Vec<&Handle> =
                        m.issued.iter().filter(|h| m.owes(reader, h.monotonic_id)).collect();
                    if !owed.is_empty() {
                        let h = *owed[pick % owed.len()];
                        let (key, bytes, _) = &m.truth[&h.monotonic_id];
                        let got = read(&readers[reader], &h, key);
                        prop_assert!(got.is_ok(), "owed handle unreadable: {:?}", got.err());
                        prop_assert_eq!(&got.unwrap(), bytes);
                        m.consume(reader, h.monotonic_id);
                    }
                }
                Op::Replay { reader, pick } => {
                    if !m.issued.is_empty() {
                        let h = m.issued[pick % m.issued.len()];
                        let (key, bytes, _) = &m.truth[&h.monotonic_id];
                        let owes = m.owes(reader, h.monotonic_id);
                        match read(&readers[reader], &h, key) {
                            Ok(got) => {
                                prop_assert_eq!(&got, bytes);
                                m.consume(reader, h.monotonic_id);
                            }
                            Err(Error::Stale) => prop_assert!(!owes, "owed handle went stale"),
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                }
                Op::Pin { w, key } => {
                    let key = format!("k{key}");
                    if writers[w].pin(&key).is_ok() { *m.pins.entry((w, key)).or_default() += 1; }
                }
                Op::Unpin { w, key } => {
                    let key = format!("k{key}");
                    writers[w].unpin(&key).unwrap();
                    if let Some(n) = m.pins.get_mut(&(w, key)) { *n = n.saturating_sub(1); }
                }
                Op::Invalidate { w, key } => {
                    let key = format!("k{key}");
                    writers[w].invalidate(&key).unwrap();
                    m.pins.retain(|(_, k), _| *k != key);
                    for x in &writers {
                        prop_assert!(!x.is_cached(&key).unwrap());
                        prop_assert!(matches!(x.read_meta(&key, None), Err(Error::KeyNotFound(_))));
                    }
                }
                Op::Release { w, pick } => {
                    if !m.issued.is_empty() {
                        let h = m.issued[pick % m.issued.len()];
                        let id = h.monotonic_id;
                        // Only while both readers are owed a reference to the chunk (else the
                        // reference given back could be one a reader still needs).
                        if m.owes(0, id) && m.owes(1, id) {
                            writers[w].release(&h).unwrap();
                            // Only the writer that issued it gives its references back.
                            let mine = (w, m.incarnation[w], h);
                            if let Some(n) = m.unreleased.get_mut(&mine).filter(|n| **n > 0) {
                                *n -= 1;
                                m.consume(0, id);
                                m.consume(1, id);
                            }
                        }
                    }
                }
                Op::Clear { w } => {
                    writers[w].clear().unwrap();
                    m.pins.clear();
                    m.owed.iter_mut().for_each(HashMap::clear);
                    m.unreleased.clear();
                    for x in &writers { prop_assert!(x.keys().unwrap().is_empty()); }
                }
                Op::Claim { w, key } => {
                    let key = format!("k{key}");
                    let stored = writers[w].is_cached(&key).unwrap();
                    let expected = !stored && m.claims.get(&key).is_none_or(|&o| o == w);
                    prop_assert_eq!(writers[w].claim(&key).unwrap(), expected, "claim of {}", key);
                    if expected { m.claims.insert(key, w); }
                }
                Op::Unclaim { w, key } => {
                    let key = format!("k{key}");
                    writers[w].unclaim(&key).unwrap();
                    if m.claims.get(&key) == Some(&w) { m.claims.remove(&key); }
                }
                Op::Kill { w } => {
                    pretend_dead(writers.remove(w));
                    writers.insert(w, Writer::join(&info).expect("the dead writer's slot"));
                    m.incarnation[w] += 1;
                    m.pins.retain(|(x, _), _| *x != w);
                    m.claims.retain(|_, o| *o != w);
                }
            }
            for ((_, key), n) in &m.pins {
                if *n > 0 {
                    prop_assert!(writers.iter().all(|x| x.is_cached(key).unwrap()), "pinned {} was evicted", key);
                }
            }
            let keys = writers[0].keys().unwrap();
            for key in &keys {
                let (id, meta) = writers[1].read_meta(key, None).unwrap();
                prop_assert_eq!(&m.truth[&id].2, &meta);
            }
            let stats = stats_of(&writers[2]);
            prop_assert!(stats["bytes_in_use"] <= stats["capacity"]);
            prop_assert_eq!(stats["objects"], keys.len() as u64);
            prop_assert_eq!(stats["claims"], m.claims.len() as u64);
            let owed_total: u32 = m.owed.iter().flat_map(|o| o.values()).sum();
            prop_assert_eq!(stats["outstanding_refs"], owed_total as u64);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Threads of several writers racing
// ---------------------------------------------------------------------------------------

/// A tiny deterministic generator (xorshift) for the racing threads.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The bytes every writer stores under key `k`: so whichever writer wins a race to put it,
/// a reader can check it got exactly key `k`'s bytes.
fn content(k: u64) -> Vec<u8> {
    payload(k, 100 + (k as usize * 997) % 6000)
}

/// Three writers with two threads each put, issue, pin, invalidate and claim overlapping keys
/// in a small ring (constant eviction) while two readers resolve every handle: every handle
/// reads back exactly its key's bytes (never a half-written or another key's chunk), every
/// race on one key stores it once, and nothing is left owed.
#[test]
fn writers_and_threads_race_on_the_same_keys_and_readers_only_see_their_bytes() {
    const THREADS_PER_WRITER: usize = 2;
    const KEYS: u64 = 24;
    const ROUNDS: usize = 3000;
    let first = store(64 * 1024, 2, WRITERS as u32);
    let info = first.writer_info();
    let reader_info = first.reader_info();
    let mut writers = vec![Arc::new(first)];
    for _ in 1..WRITERS {
        writers.push(Arc::new(Writer::join(&info).unwrap()));
    }
    let mut to_readers = Vec::new();
    let mut reader_threads = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = mpsc::channel::<(Handle, u64)>();
        to_readers.push(tx);
        let r = Reader::attach(&reader_info).unwrap();
        reader_threads.push(std::thread::spawn(move || {
            let mut read_ok = 0u64;
            for (h, k) in rx {
                let got = read(&r, &h, &format!("k{k}")).expect("an owed handle reads");
                assert_eq!(got, content(k), "key {k} read other bytes");
                read_ok += 1;
            }
            read_ok
        }));
    }
    let stored = std::sync::atomic::AtomicU64::new(0);
    let duplicates = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for (wi, w) in writers.iter().enumerate() {
            for t in 0..THREADS_PER_WRITER {
                let to_readers = to_readers.clone();
                let (stored, duplicates) = (&stored, &duplicates);
                scope.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((wi * 8 + t + 1) as u64));
                    let send = |h: Handle, k: u64| {
                        for tx in &to_readers {
                            tx.send((h, k)).unwrap();
                        }
                    };
                    for _ in 0..ROUNDS {
                        let k = rng.below(KEYS);
                        let key = format!("k{k}");
                        match rng.below(10) {
                            0..=4 => match w.put(&key, &[&content(k)]) {
                                Ok(h) => {
                                    stored.fetch_add(1, Ordering::Relaxed);
                                    send(h, k);
                                }
                                Err(Error::DuplicateKey(_)) => {
                                    duplicates.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(Error::Full { .. }) => std::thread::yield_now(),
                                Err(e) => panic!("put: {e}"),
                            },
                            5..=7 => match w.get_cached(&key) {
                                Ok(h) => send(h, k),
                                Err(Error::KeyNotFound(_)) => {}
                                Err(e) => panic!("issue: {e}"),
                            },
                            8 => {
                                if w.pin(&key).is_ok() {
                                    std::thread::yield_now();
                                    w.unpin(&key).unwrap();
                                }
                            }
                            _ => {
                                if rng.below(2) == 0 {
                                    w.invalidate(&key).unwrap();
                                } else if w.claim(&key).unwrap() {
                                    if let Ok(h) = w.put(&key, &[&content(k)]) {
                                        stored.fetch_add(1, Ordering::Relaxed);
                                        send(h, k);
                                    }
                                    w.unclaim(&key).unwrap();
                                }
                            }
                        }
                    }
                });
            }
        }
    });
    drop(to_readers);
    for t in reader_threads {
        t.join().expect("reader thread");
    }
    let stats = stats_of(&writers[0]);
    assert!(stats["evictions"] > 0, "the ring wrapped");
    assert!(
        duplicates.load(Ordering::Relaxed) > 0,
        "writers raced on keys"
    );
    assert_eq!(stats["puts"], stored.load(Ordering::Relaxed));
    assert_eq!(stats["outstanding_refs"], 0);
    assert_eq!(stats["claims"], 0);
    let mut keys = writers[1].keys().unwrap();
    let n = keys.len();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), n, "a key is stored at most once");
}
