//! Store tests over real segments: protocol examples, a multi-threaded acknowledgement test,
//! and a proptest state machine against a model (one writer; `writers_tests.rs` has several).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;

use super::*;
use crate::handle::Handle;
use crate::layout::SlotState;
use proptest::prelude::*;

pub(super) fn writer(capacity: u64, n_readers: u32) -> Writer {
    Writer::create(capacity, n_readers, None, None).expect("create segment")
}

pub(super) fn read(reader: &Arc<Reader>, handle: &Handle, key: &str) -> Result<Vec<u8>> {
    let lease = reader.acquire(handle, key)?;
    let mut out = vec![0u8; lease.len()];
    lease.copy_to(&mut out)?;
    Ok(out)
}

pub(super) fn payload(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (tag as usize * 31 + i * 7) as u8)
        .collect()
}

#[test]
fn put_and_read_back_with_aligned_parts() {
    let w = writer(1 << 16, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let h = w.put("a", &[b"xyz", &[1u8; 100], b""]).unwrap();
    let got = read(&r, &h, "a").unwrap();
    // The empty last part starts (and ends) at the next aligned offset, 192.
    assert_eq!(got.len(), 192);
    assert_eq!(&got[..3], b"xyz");
    assert!(got[3..64].iter().all(|&b| b == 0), "padding is zeroed");
    assert!(got[64..164].iter().all(|&b| b == 1));
    assert!(got[164..].iter().all(|&b| b == 0));
    assert_eq!(w.read(&h, "a").unwrap(), got);
    assert_eq!(h.address % 64, 0);
}

#[test]
fn duplicate_oversize_and_absent_keys_are_errors() {
    let w = Writer::create(1 << 16, 1, Some(1000), None).unwrap();
    w.put("k", &[b"1"]).unwrap();
    assert!(matches!(w.put("k", &[b"2"]), Err(Error::DuplicateKey(_))));
    assert!(matches!(
        w.put("big", &[&[0u8; 1001]]),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(w.get_cached("nope"), Err(Error::KeyNotFound(_))));
    assert!(matches!(w.pin("nope"), Err(Error::KeyNotFound(_))));
    w.unpin("nope").unwrap();
    w.invalidate("nope").unwrap();
}

#[test]
fn unread_objects_are_protected_until_every_reader_reads() {
    // Ring of 4 chunks of 1 KiB (chunk header 128 + payload 896).
    let w = writer(4096, 2);
    let r1 = Reader::attach(&w.reader_info()).unwrap();
    let r2 = Reader::attach(&w.reader_info()).unwrap();
    let handles: Vec<_> = (0..4)
        .map(|i| w.put(&format!("k{i}"), &[&[i as u8; 896]]).unwrap())
        .collect();
    assert!(matches!(
        w.put("k4", &[&[9u8; 896]]),
        Err(Error::Full { .. })
    ));
    read(&r1, &handles[0], "k0").unwrap();
    // A replay by r1 must not stand in for r2's acknowledgement.
    read(&r1, &handles[0], "k0").unwrap();
    assert!(matches!(
        w.put("k4", &[&[9u8; 896]]),
        Err(Error::Full { .. })
    ));
    read(&r2, &handles[0], "k0").unwrap();
    let h4 = w.put("k4", &[&[9u8; 896]]).unwrap();
    assert_eq!(h4.address, handles[0].address);
    assert!(!w.is_cached("k0").unwrap());
    assert!(matches!(read(&r1, &handles[0], "k0"), Err(Error::Stale)));
    assert_eq!(read(&r2, &h4, "k4").unwrap(), vec![9u8; 896]);
}

#[test]
fn a_live_chunk_is_stepped_over_not_waited_on() {
    let w = writer(4096, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let hs: Vec<_> = (0..4)
        .map(|i| w.put(&format!("k{i}"), &[&[0u8; 896]]).unwrap())
        .collect();
    // Read all but the oldest: the sweep must skip it and reuse the second.
    for (i, h) in hs.iter().enumerate().skip(1) {
        read(&r, h, &format!("k{i}")).unwrap();
    }
    let h = w.put("new", &[&[1u8; 896]]).unwrap();
    assert_eq!(h.address, hs[1].address);
    assert!(w.is_cached("k0").unwrap());
}

#[test]
fn views_and_pins_protect_their_chunk() {
    let w = writer(2048, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let h0 = w.put("a", &[&[1u8; 896]]).unwrap();
    let h1 = w.put("b", &[&[2u8; 896]]).unwrap();
    let view = r.acquire(&h0, "a").unwrap();
    assert!(view.is_protected());
    read(&r, &h1, "b").unwrap();
    w.pin("b").unwrap();
    assert!(matches!(
        w.put("c", &[&[3u8; 896]]),
        Err(Error::Full { .. })
    ));
    w.unpin("b").unwrap();
    let hc = w.put("c", &[&[3u8; 896]]).unwrap();
    assert_eq!(hc.address, h1.address);
    drop(view);
    read(&r, &hc, "c").unwrap();
    w.put("d", &[&[4u8; 896]]).unwrap();
    assert!(!w.is_cached("a").unwrap());
}

#[test]
fn forged_and_foreign_handles_are_rejected_before_reading() {
    let w = writer(1 << 16, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let h = w.put("k", &[b"data"]).unwrap();
    let mut forged = h;
    forged.signature[0] ^= 1;
    assert!(matches!(
        r.acquire(&forged, "k"),
        Err(Error::InvalidHandle(_))
    ));
    assert!(matches!(
        r.acquire(&h, "other"),
        Err(Error::InvalidHandle(_))
    ));
    for address in [h.address + 1, 1 << 40, u64::MAX] {
        let bad = Handle { address, ..h };
        assert!(matches!(r.acquire(&bad, "k"), Err(Error::InvalidHandle(_))));
    }
    assert!(matches!(
        r.acquire(
            &Handle {
                monotonic_id: 0,
                ..h
            },
            "k"
        ),
        Err(Error::InvalidHandle(_))
    ));
    let other = writer(1 << 16, 1);
    let h_other = other.put("k", &[b"data"]).unwrap();
    assert!(matches!(
        r.acquire(&h_other, "k"),
        Err(Error::InvalidHandle(_))
    ));
    assert_eq!(read(&r, &h, "k").unwrap(), b"data");
}

#[test]
fn handles_from_before_clear_never_alias_new_data() {
    let w = writer(1024, 1); // room for exactly one chunk, so the new one reuses its bytes
    let r = Reader::attach(&w.reader_info()).unwrap();
    let old = w.put("k", &[&[1u8; 896]]).unwrap();
    read(&r, &old, "k").unwrap();
    w.clear().unwrap();
    assert!(!w.is_cached("k").unwrap());
    let new = w.put("k", &[&[2u8; 896]]).unwrap();
    assert_eq!(new.address, old.address);
    assert!(new.monotonic_id > old.monotonic_id);
    assert!(matches!(read(&r, &old, "k"), Err(Error::Stale)));
    assert_eq!(read(&r, &new, "k").unwrap(), vec![2u8; 896]);
}

#[test]
fn unread_object_survives_invalidate_but_clear_drops_its_references() {
    let w = writer(4096, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let h = w.put("k", &[&[5u8; 896]]).unwrap();
    w.invalidate("k").unwrap();
    for i in 0..3 {
        w.put(&format!("x{i}"), &[&[0u8; 896]]).unwrap();
    }
    assert!(matches!(
        w.put("y", &[&[0u8; 896]]),
        Err(Error::Full { .. })
    ));
    assert_eq!(
        read(&r, &h, "k").unwrap(),
        vec![5u8; 896],
        "invalidate keeps unread data"
    );
    // An abandoned request's handle (never delivered) stops pinning the ring after clear.
    let abandoned = w.put("y", &[&[6u8; 896]]).unwrap();
    let view = r.acquire(&w.get_cached("x0").unwrap(), "x0").unwrap();
    w.clear().unwrap();
    let stats: HashMap<_, _> = w.stats().unwrap().into_iter().collect();
    assert_eq!(stats["outstanding_refs"], 0);
    assert_eq!(
        stats["chunks"], 1,
        "only the chunk under a live view survives clear"
    );
    assert!(matches!(read(&r, &abandoned, "y"), Err(Error::Stale)));
    drop(view);
}

#[test]
fn release_gives_back_an_undelivered_reference() {
    let w = writer(2048, 1);
    let _r = Reader::attach(&w.reader_info()).unwrap();
    let h = w.put("a", &[&[1u8; 896]]).unwrap();
    w.put("b", &[&[1u8; 896]]).unwrap();
    let h2 = w.get_cached("a").unwrap();
    assert_eq!(h2, h);
    w.release(&h).unwrap();
    assert!(matches!(
        w.put("c", &[&[1u8; 896]]),
        Err(Error::Full { .. })
    ));
    w.release(&h2).unwrap();
    w.put("c", &[&[1u8; 896]]).unwrap();
    assert!(!w.is_cached("a").unwrap());
}

/// Make `r` look dead to the others without dropping it: give up its slot's lock (what the
/// kernel does when its process dies). `r` must then be forgotten, not dropped.
fn pretend_dead(r: Arc<Reader>) {
    r.shared
        .seg
        .unlock(r.shared.layout.slot_lock(r.slot()))
        .unwrap();
    std::mem::forget(r);
}

pub(super) fn stats_of(w: &Writer) -> HashMap<&'static str, u64> {
    w.stats().unwrap().into_iter().collect()
}

#[test]
fn inspect_reads_back_the_counters_stats_reports() {
    let w = writer(2048, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let a = w.put("a", &[&[1u8; 896]]).unwrap();
    w.get_cached("a").unwrap();
    w.put("b", &[&[2u8; 896]]).unwrap();
    read(&r, &a, "a").unwrap();
    read(&r, &a, "a").unwrap();
    w.put("c", &[&[3u8; 896]]).unwrap(); // evicts a
    w.clear().unwrap();
    let stats = stats_of(&w);
    let expected: Vec<(&str, u64)> = [
        ("bytes_in_use", 0),
        ("objects", 0),
        ("last_id", 3),
        ("claims", 0),
        ("evictions", 1),
        ("clears", 1),
        ("puts", 3),
        ("hits", 1),
        ("refs_issued", 4),
        ("readers_reclaimed", 0),
        ("writers_reclaimed", 0),
    ]
    .into();
    assert_eq!(inspect(w.name()).unwrap().counters, expected);
    for (name, value) in &expected {
        assert_eq!(stats[name], *value, "{name}");
    }
}

/// The pid of a process that has exited.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Overwrite the pid in the claim word of `r`'s slot.
fn set_claim_pid(w: &Writer, r: &Reader, pid: u32) {
    let claim = w.shared.slot(r.slot(), slot::CLAIM).unwrap();
    let current = Claim::unpack(claim.load(Ordering::Acquire)).unwrap();
    claim.store(Claim { pid, ..current }.pack(), Ordering::Release);
}

#[test]
fn slots_are_claimed_freed_and_reclaimed_from_dead_readers() {
    let w = writer(2048, 1);
    assert_eq!(w.liveness(), Liveness::Locks);
    let info = w.reader_info();
    let r = Reader::attach(&info).unwrap();
    assert!(matches!(Reader::attach(&info), Err(Error::NoReaderSlot(1))));
    drop(r);
    let r = Reader::attach(&info).unwrap();
    let _h = w.put("a", &[&[1u8; 896]]).unwrap();
    w.put("b", &[&[1u8; 896]]).unwrap();
    assert!(matches!(
        w.put("c", &[&[1u8; 896]]),
        Err(Error::Full { .. })
    ));
    pretend_dead(r);
    w.put("c", &[&[1u8; 896]]).unwrap();
    assert_eq!(stats_of(&w)["readers_reclaimed"], 1);
    Reader::attach(&info).expect("the reclaimed slot is free again");
}

#[test]
fn liveness_is_never_judged_from_a_pid() {
    // A live reader whose claim word shows some other, long-dead pid (an earlier occupant's,
    // say) keeps its slot: its lock says it lives.
    let w = writer(2048, 1);
    let info = w.reader_info();
    let r = Reader::attach(&info).unwrap();
    set_claim_pid(&w, &r, dead_pid());
    let h = w.put("a", &[&[1u8; 896]]).unwrap();
    w.put("b", &[&[1u8; 896]]).unwrap();
    assert!(
        matches!(w.put("c", &[&[1u8; 896]]), Err(Error::Full { .. })),
        "r's slot was freed"
    );
    assert!(
        matches!(Reader::attach(&info), Err(Error::NoReaderSlot(1))),
        "r's slot was taken"
    );
    assert_eq!(read(&r, &h, "a").unwrap(), vec![1u8; 896]);
    assert_eq!(stats_of(&w)["readers_reclaimed"], 0);
}

#[test]
fn a_claim_whose_holder_died_before_finishing_is_taken_over() {
    // A reader killed right after its claim CAS (before anything else): the slot shows
    // CLAIMED by a pid nobody can check, but its lock is gone with the process.
    let w = writer(2048, 1);
    let info = w.reader_info();
    let claim = w.shared.slot(0, slot::CLAIM).unwrap();
    claim.store(
        Claim {
            epoch: 7,
            pid: 0,
            state: SlotState::Claimed,
        }
        .pack(),
        Ordering::Release,
    );
    let r = Reader::attach(&info).expect("the half-made claim is reclaimable at once");
    assert_eq!(r.slot(), 0);
    assert_eq!(
        Claim::unpack(claim.load(Ordering::Acquire)).unwrap().epoch,
        8
    );
}

#[test]
fn pid_fallback_tells_live_from_dead_readers() {
    let w = Writer::create_with_liveness(2048, 1, Liveness::Pids).unwrap();
    let info = w.reader_info();
    let r = Reader::attach(&info).unwrap();
    assert!(matches!(Reader::attach(&info), Err(Error::NoReaderSlot(1))));
    let h = w.put("a", &[&[1u8; 896]]).unwrap();
    w.put("b", &[&[1u8; 896]]).unwrap();
    assert!(matches!(
        w.put("c", &[&[1u8; 896]]),
        Err(Error::Full { .. })
    ));
    assert_eq!(read(&r, &h, "a").unwrap(), vec![1u8; 896]);
    // Now make the occupant a process that has exited: the writer frees the slot.
    set_claim_pid(&w, &r, dead_pid());
    w.put("c", &[&[1u8; 896]]).unwrap();
    w.put("d", &[&[1u8; 896]]).unwrap();
    assert_eq!(stats_of(&w)["readers_reclaimed"], 1);
    std::mem::forget(r);
    Reader::attach(&info).expect("the freed slot is claimable");
}

#[test]
fn a_closed_reader_with_a_live_view_drains() {
    let w = writer(4096, 2);
    let info = w.reader_info();
    let closing = Reader::attach(&info).unwrap();
    let other = Reader::attach(&info).unwrap();
    let h = w.put("a", &[&[5u8; 896]]).unwrap();
    let view = closing.acquire(&h, "a").unwrap().into_view().unwrap();
    read(&other, &h, "a").unwrap();
    closing.close();
    assert!(matches!(closing.acquire(&h, "a"), Err(Error::Closed)));
    let stats = stats_of(&w);
    assert_eq!(
        (stats["readers_attached"], stats["readers_draining"]),
        (1, 1)
    );
    // New handles owe the draining slot nothing: the ring never fills on its account.
    for i in 0..20 {
        let key = format!("n{i}");
        let hk = w.put(&key, &[&[i as u8; 896]]).unwrap();
        read(&other, &hk, &key).unwrap();
    }
    assert!(
        w.is_cached("a").unwrap(),
        "the draining slot's view still protects its chunk"
    );
    assert_eq!(stats_of(&w)["outstanding_refs"], 0);
    drop(view);
    drop(closing);
    let stats = stats_of(&w);
    assert_eq!(
        (stats["readers_attached"], stats["readers_draining"]),
        (1, 0)
    );
    Reader::attach(&info).expect("freed with its last view");
}

#[test]
fn reference_saturation_is_refused_whole_and_views_past_their_limit_read_copies() {
    let w = writer(4096, 2);
    let info = w.reader_info();
    let reading = Reader::attach(&info).unwrap();
    let stuck = Reader::attach(&info).unwrap();
    let h = w.put("hot", &[&[9u8; 100]]).unwrap();
    // Bring the stuck reader's count to the limit directly (a million hits would do it).
    let word = w.shared.word(h.address, stuck.slot()).unwrap();
    let mut sw = SlotWord::unpack(word.load(Ordering::Acquire));
    sw.outstanding = SlotWord::MAX_OUTSTANDING;
    word.store(sw.pack(), Ordering::Release);
    let reading_word = w.shared.word(h.address, reading.slot()).unwrap();
    let before = reading_word.load(Ordering::Acquire);
    match w.get_cached("hot") {
        Err(Error::Saturated { key, slot, limit }) => {
            assert_eq!(
                (key.as_str(), slot, limit),
                ("hot", stuck.slot(), SlotWord::MAX_OUTSTANDING)
            );
        }
        other => panic!("expected Saturated, got {other:?}"),
    }
    assert_eq!(
        reading_word.load(Ordering::Acquire),
        before,
        "no slot was half-updated"
    );
    assert_eq!(w.read_key("hot").unwrap()[..100], [9u8; 100]);
    // Views: a slot at its view limit consumes the reference and reads a verified copy.
    let mut rw = SlotWord::unpack(reading_word.load(Ordering::Acquire));
    rw.views = SlotWord::MAX_VIEWS;
    reading_word.store(rw.pack(), Ordering::Release);
    let lease = reading.acquire(&h, "hot").unwrap();
    assert!(!lease.is_protected());
    let mut out = vec![0u8; lease.len()];
    lease.copy_to(&mut out).unwrap();
    assert_eq!(out[..100], [9u8; 100]);
    let after = SlotWord::unpack(reading_word.load(Ordering::Acquire));
    assert_eq!((after.outstanding, after.views), (0, SlotWord::MAX_VIEWS));
}

#[test]
fn release_credits_only_the_readers_its_handle_was_issued_to() {
    let w = writer(4096, 2);
    let info = w.reader_info();
    let early = Reader::attach(&info).unwrap();
    let before_late = w.put("a", &[&[1u8; 100]]).unwrap();
    let late = Reader::attach(&info).unwrap();
    let after_late = w.get_cached("a").unwrap();
    assert_ne!(before_late.reader_set(), after_late.reader_set());
    w.release(&before_late).unwrap(); // its request was aborted
    let late_word = SlotWord::unpack(
        w.shared
            .word(before_late.address, late.slot())
            .unwrap()
            .load(Ordering::Acquire),
    );
    assert_eq!(
        late_word.outstanding, 1,
        "the late reader still owes after_late a read"
    );
    let lease = late.acquire(&after_late, "a").unwrap();
    assert!(
        lease.is_protected(),
        "after_late's reference was kept for the late reader"
    );
    w.release(&before_late).unwrap(); // a second release of the same handle gives nothing
    let early_word = SlotWord::unpack(
        w.shared
            .word(before_late.address, early.slot())
            .unwrap()
            .load(Ordering::Acquire),
    );
    assert_eq!(
        early_word.outstanding, 1,
        "after_late's reference for the early reader stays"
    );
}

#[test]
fn writer_reads_check_lengths_before_allocating() {
    let w = writer(4096, 1);
    let h = w.put("a", &[&[1u8; 100]]).unwrap();
    w.shared
        .chunk(h.address, chunk::LEN)
        .unwrap()
        .store(u64::MAX / 2, Ordering::Relaxed);
    assert!(matches!(w.read(&h, "a"), Err(Error::Corrupt(_))));
    assert!(matches!(w.read_key("a"), Err(Error::Corrupt(_))));
}

#[test]
fn corrupt_headers_are_refused() {
    let w = writer(1 << 16, 1);
    let info = w.reader_info();
    w.shared
        .header(header::CAPACITY)
        .unwrap()
        .store(1 << 40, Ordering::Relaxed);
    assert!(matches!(Reader::attach(&info), Err(Error::Corrupt(_))));
    w.shared
        .header(header::MAGIC)
        .unwrap()
        .store(7, Ordering::Relaxed);
    assert!(matches!(Reader::attach(&info), Err(Error::Corrupt(_))));
    assert!(matches!(inspect(w.name()), Err(Error::Corrupt(_))));
}

/// Sets its flag when dropped: stops a helper thread even if the test panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `attach`, `inspect` and `status` (what `prune` decides) validate the header once and use
/// what they validated: a liveness word that another process changes meanwhile makes them
/// fail cleanly or succeed, never panic (they used to load it a second time and `expect` it
/// to be valid still).
#[test]
fn a_header_changing_under_validation_is_an_error_never_a_panic() {
    // The pid fallback: no writer lock, so `status` too opens the segment.
    let w = Writer::create_with_liveness(2048, 1, Liveness::Pids).unwrap();
    let info = w.reader_info();
    let liveness = w.shared.header(header::LIVENESS).unwrap();
    let stop = AtomicBool::new(false);
    let (mut accepted, mut refused) = (0, 0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                liveness.store(Liveness::Pids.code(), Ordering::Relaxed);
                liveness.store(0, Ordering::Relaxed); // no liveness mode at all
            }
        });
        let _stop = StopOnDrop(&stop);
        for i in 0..200_000 {
            let mut outcomes = vec![inspect(w.name()).map(drop)];
            if i % 16 == 0 {
                // Slower (they read /proc): less often.
                outcomes.push(Reader::attach(&info).map(drop));
                status(w.name()).unwrap();
            }
            for outcome in outcomes {
                match outcome {
                    Ok(()) => accepted += 1,
                    Err(Error::Corrupt(_)) => refused += 1,
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            if accepted >= 2000 && refused >= 2000 {
                break;
            }
        }
    });
    assert!(
        accepted >= 2000 && refused >= 2000,
        "the race was not exercised: {accepted} accepted, {refused} refused"
    );
}

#[test]
fn closed_writer_is_reported_to_readers() {
    let w = writer(1 << 16, 1);
    let r = Reader::attach(&w.reader_info()).unwrap();
    let h = w.put("k", &[b"x"]).unwrap();
    let name = w.name().to_owned();
    assert!(list_segments().contains(&name));
    assert!(inspect(&name).unwrap().creator_alive);
    w.close().unwrap();
    assert!(matches!(w.put("j", &[b"x"]), Err(Error::Closed)));
    assert!(matches!(r.acquire(&h, "k"), Err(Error::WriterGone(_))));
    assert!(
        !list_segments().contains(&name),
        "the creator unlinks on close"
    );
}

/// Every store's creation first removes what dead creators left, and nothing a live one
/// makes or uses (other tests' creations run meanwhile: what must go may go earlier).
#[test]
fn creation_removes_only_segments_whose_writer_is_gone() {
    let path = |name: &str| format!("{}/{name}", segment::SHM_DIR);
    // Sized but headerless and unlocked: a creator killed half-way.
    let half_made_dead = segment::generate_name().unwrap();
    std::fs::write(path(&half_made_dead), vec![0u8; 4096]).unwrap();
    // A complete segment whose writer's lock is gone (as when it dies).
    let complete_dead = writer(1 << 16, 1);
    complete_dead.shared.seg.unlock(WRITER_LOCK).unwrap();
    // Sized and headerless, but locked: a live creator half-way.
    let half_made_live = segment::generate_name().unwrap();
    let making = Segment::create(&half_made_live, 4096, WRITER_LOCK, 4096).unwrap();
    // Empty and unlocked: the instant between a creator's shm_open and its lock.
    let just_opened = segment::generate_name().unwrap();
    std::fs::write(path(&just_opened), b"").unwrap();
    // The pid fallback with a damaged liveness word: its creator's pid is all there is.
    let damaged_live = Writer::create_with_liveness(1 << 16, 1, Liveness::Pids).unwrap();
    damaged_live
        .shared
        .header(header::LIVENESS)
        .unwrap()
        .store(0, Ordering::Relaxed);
    for (name, expected) in [
        (half_made_dead.as_str(), "orphaned"),
        (complete_dead.name(), "orphaned"),
        (half_made_live.as_str(), "live"),
        (just_opened.as_str(), "undecided"),
        (damaged_live.name(), "undecided"),
    ] {
        let found = match status(name) {
            Ok(Status::Live) => "live",
            Ok(Status::Orphaned(_)) => "orphaned",
            Ok(Status::Undecided(_)) => "undecided",
            Err(Error::NotFound(_)) if expected == "orphaned" => continue, // pruned already
            Err(e) => panic!("{name}: {e}"),
        };
        assert_eq!(found, expected, "{name}");
    }
    let _next = writer(1 << 16, 1);
    let listed = list_segments();
    for gone in [half_made_dead.as_str(), complete_dead.name()] {
        assert!(
            !listed.iter().any(|n| n == gone),
            "{gone} outlived its writer"
        );
    }
    for kept in [
        half_made_live.as_str(),
        just_opened.as_str(),
        damaged_live.name(),
    ] {
        assert!(listed.iter().any(|n| n == kept), "{kept} was removed");
    }
    drop(making); // its creator unlinks it
    segment::unlink(&just_opened).unwrap();
}

/// Readers on threads resolve handles while the writer keeps evicting; every byte read is
/// the object's own, every handle is either read whole or reported stale.
#[test]
fn concurrent_readers_never_see_foreign_bytes() {
    const READERS: usize = 3;
    const OBJECTS: u64 = 400;
    let w = Arc::new(writer(64 * 1024, READERS as u32));
    let info = w.reader_info();
    let mut senders = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..READERS {
        let (tx, rx) = std::sync::mpsc::channel::<Option<(Handle, u64)>>();
        senders.push(tx);
        let r = Reader::attach(&info).unwrap();
        threads.push(std::thread::spawn(move || {
            let mut ok = 0;
            while let Some((h, n)) = rx.recv().unwrap() {
                // Hold some leases briefly to exercise views.
                let lease = r
                    .acquire(&h, &format!("k{n}"))
                    .expect("unread handles are protected");
                let mut buf = vec![0u8; lease.len()];
                lease.copy_to(&mut buf).unwrap();
                assert_eq!(buf, payload(n, buf.len()), "object {n} read foreign bytes");
                ok += 1;
            }
            ok
        }));
    }
    let mut sent = 0;
    let mut n = 0;
    while n < OBJECTS {
        let len = 100 + (n as usize * 997) % 6000;
        match w.put(&format!("k{n}"), &[&payload(n, len)]) {
            Ok(h) => {
                for tx in &senders {
                    tx.send(Some((h, n))).unwrap();
                }
                sent += 1;
                n += 1;
            }
            Err(Error::Full { .. }) => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    for tx in &senders {
        tx.send(None).unwrap();
    }
    for t in threads {
        assert_eq!(t.join().unwrap(), sent);
    }
    let stats: HashMap<_, _> = w.stats().unwrap().into_iter().collect();
    assert!(stats["evictions"] > 0, "the ring wrapped");
    assert_eq!(stats["outstanding_refs"], 0);
}

// ---------------------------------------------------------------------------------------
// State machine against a model
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Put { key: u8, len: usize },
    GetCached { key: u8 },
    Read { reader: usize, pick: usize },
    Replay { reader: usize, pick: usize },
    Pin { key: u8 },
    Unpin { key: u8 },
    Invalidate { key: u8 },
    Release { pick: usize },
    Clear,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..12, prop_oneof![1usize..64, 64usize..2000, Just(3968usize), Just(4000usize)])
            .prop_map(|(key, len)| Op::Put { key, len }),
        3 => (0u8..12).prop_map(|key| Op::GetCached { key }),
        6 => (0usize..2, any::<usize>()).prop_map(|(reader, pick)| Op::Read { reader, pick }),
        1 => (0usize..2, any::<usize>()).prop_map(|(reader, pick)| Op::Replay { reader, pick }),
        1 => (0u8..12).prop_map(|key| Op::Pin { key }),
        1 => (0u8..12).prop_map(|key| Op::Unpin { key }),
        1 => (0u8..12).prop_map(|key| Op::Invalidate { key }),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The model: what each handle must read as, which handles each reader still owes an
    /// acknowledgement for, and which keys are pinned. Oracle after every step: a handle a
    /// reader has not yet read always reads back its own bytes (never stale, never foreign);
    /// a replayed handle reads its own bytes or is stale; pinned keys stay cached; sizes add up.
    #[test]
    fn store_matches_model(ops in proptest::collection::vec(op_strategy(), 1..120)) {
        let w = Writer::create(16 * 1024, 2, None, None).unwrap();
        let readers = [Reader::attach(&w.reader_info()).unwrap(), Reader::attach(&w.reader_info()).unwrap()];
        let mut truth: HashMap<u64, (String, Vec<u8>)> = HashMap::new(); // id -> (key, bytes)
        let mut owed: [Vec<Handle>; 2] = [Vec::new(), Vec::new()];
        let mut issued: Vec<Handle> = Vec::new();
        let mut pins: HashMap<String, u32> = HashMap::new();
        let mut seq = 0u64;
        for op in ops {
            match op {
                Op::Put { key, len } => {
                    let key = format!("k{key}");
                    seq += 1;
                    let bytes = payload(seq, len);
                    match w.put(&key, &[&bytes]) {
                        Ok(h) => {
                            prop_assert!(!truth.contains_key(&h.monotonic_id));
                            truth.insert(h.monotonic_id, (key, bytes));
                            for o in owed.iter_mut() { o.push(h); }
                            issued.push(h);
                        }
                        Err(Error::DuplicateKey(_)) => prop_assert!(w.is_cached(&key).unwrap()),
                        Err(Error::Full { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::GetCached { key } => {
                    let key = format!("k{key}");
                    match w.get_cached(&key) {
                        Ok(h) => {
                            prop_assert_eq!(&truth[&h.monotonic_id].0, &key);
                            for o in owed.iter_mut() { o.push(h); }
                            issued.push(h);
                        }
                        Err(Error::KeyNotFound(_)) => prop_assert!(!w.is_cached(&key).unwrap()),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Read { reader, pick } => {
                    if !owed[reader].is_empty() {
                        let h = owed[reader].remove(pick % owed[reader].len());
                        let (key, bytes) = &truth[&h.monotonic_id];
                        let got = read(&readers[reader], &h, key);
                        prop_assert!(got.is_ok(), "owed handle unreadable: {:?}", got.err());
                        prop_assert_eq!(&got.unwrap(), bytes);
                    }
                }
                Op::Replay { reader, pick } => {
                    if !issued.is_empty() {
                        let h = issued[pick % issued.len()];
                        let (key, bytes) = &truth[&h.monotonic_id];
                        let owes = owed[reader].iter().position(|o| *o == h);
                        match read(&readers[reader], &h, key) {
                            Ok(got) => {
                                prop_assert_eq!(&got, bytes);
                                if let Some(i) = owes { owed[reader].remove(i); }
                            }
                            Err(Error::Stale) => prop_assert!(owes.is_none(), "owed handle went stale"),
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                }
                Op::Pin { key } => {
                    let key = format!("k{key}");
                    if w.pin(&key).is_ok() { *pins.entry(key).or_default() += 1; }
                }
                Op::Unpin { key } => {
                    let key = format!("k{key}");
                    w.unpin(&key).unwrap();
                    if let Some(n) = pins.get_mut(&key) { *n = n.saturating_sub(1); }
                }
                Op::Invalidate { key } => {
                    let key = format!("k{key}");
                    w.invalidate(&key).unwrap();
                    pins.remove(&key);
                    prop_assert!(!w.is_cached(&key).unwrap());
                }
                Op::Release { pick } => {
                    if !issued.is_empty() {
                        let h = issued[pick % issued.len()];
                        // Only release a reference neither reader has consumed.
                        let owing: Vec<usize> =
                            owed.iter().filter_map(|o| o.iter().position(|x| *x == h)).collect();
                        if owing.len() == 2 {
                            w.release(&h).unwrap();
                            for (o, i) in owed.iter_mut().zip(owing) {
                                o.remove(i);
                            }
                        }
                    }
                }
                Op::Clear => {
                    w.clear().unwrap();
                    pins.clear();
                    // Every reference is dropped: later reads are replays (own bytes or stale).
                    owed.iter_mut().for_each(Vec::clear);
                    prop_assert!(w.keys().unwrap().is_empty());
                }
            }
            for (key, n) in &pins {
                if *n > 0 { prop_assert!(w.is_cached(key).unwrap(), "pinned {} was evicted", key); }
            }
            let stats: HashMap<_, _> = w.stats().unwrap().into_iter().collect();
            prop_assert!(stats["bytes_in_use"] <= stats["capacity"]);
            prop_assert_eq!(stats["objects"], w.keys().unwrap().len() as u64);
            let owed_total: usize = owed.iter().map(Vec::len).sum();
            prop_assert_eq!(stats["outstanding_refs"], owed_total as u64);
        }
    }
}

#[test]
fn read_at_copies_slices_of_protected_payloads_only() {
    let w = writer(1 << 16, 1);
    // Issued before the reader attached: that reader reads it unprotected.
    let early = w.put("early", &[&payload(1, 300)]).unwrap();
    let r = Reader::attach(&w.reader_info()).unwrap();
    let h = w.put("a", &[&payload(2, 300)]).unwrap();
    let lease = r.acquire(&h, "a").unwrap();
    let mut middle = [0u8; 100];
    lease.read_at(50, &mut middle).unwrap();
    assert_eq!(&middle[..], &payload(2, 300)[50..150]);
    assert!(
        lease.read_at(250, &mut middle).is_err(),
        "runs past the payload"
    );
    assert!(lease.read_at(u64::MAX, &mut [0u8; 1]).is_err());
    let unprotected = r.acquire(&early, "early").unwrap();
    assert!(!unprotected.is_protected());
    assert!(unprotected.read_at(0, &mut middle).is_err());
    let (address, len) = r.view_mapping().expect("readers map a view");
    assert_eq!(len as u64, w.layout().total_len());
    let view = lease.into_view().expect("a protected lease views");
    let mut again = [0u8; 100];
    view.read_at(50, &mut again).unwrap();
    assert_eq!(again, middle);
    let at = view.ptr() as usize;
    assert!(address <= at && at + view.len() <= address + len);
}
