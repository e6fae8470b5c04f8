//! Reader slots: claiming, freeing, reclaiming from dead readers; liveness (locks, the pid
//! fallback); closing either side.

use super::*;
use crate::layout::SlotState;

/// Make `r` look dead to the others without dropping it: give up its slot's lock (what the
/// kernel does when its process dies). `r` must then be forgotten, not dropped.
fn pretend_dead(r: Arc<Reader>) {
    r.shared
        .seg
        .unlock(r.shared.layout.slot_lock(r.slot()))
        .unwrap();
    std::mem::forget(r);
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
fn a_reader_handle_of_another_secret_takes_no_slot() {
    let w = writer(2048, 1);
    let mut wrong = w.reader_info();
    wrong.secret[0] ^= 1;
    assert!(matches!(
        Reader::attach(&wrong),
        Err(Error::InvalidHandle(_))
    ));
    Reader::attach(&w.reader_info()).expect("the only slot is still free");
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
    let (w, [r]) = writer_with_readers(2048);
    let info = w.reader_info();
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
    let (w, [closing, other]) = writer_with_readers(4096);
    let info = w.reader_info();
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
fn close_racing_acquire_on_another_thread_leaves_each_lease_protected_and_frees_the_slot() {
    // `close(&self)` and `acquire(&Arc<Self>)` may run on two threads at once (`Reader` is
    // `Sync`): a lease taken past the closed check, as the slot turns to draining, holds its
    // view on the draining slot (which protects it) and the `Arc` the slot is freed with.
    for round in 0..100u8 {
        let (w, [closing, other]) = writer_with_readers(4096);
        let info = w.reader_info();
        let h = w.put("a", &[&[round; 896]]).unwrap();
        read(&other, &h, "a").unwrap(); // only `closing`'s lease may protect it now
        let views = std::thread::scope(|scope| {
            let acquiring = scope.spawn(|| {
                let mut views = Vec::new();
                loop {
                    match closing.acquire(&h, "a") {
                        Ok(lease) => views.extend(lease.into_view().ok()),
                        Err(Error::Closed) => return views,
                        Err(e) => panic!("{e}"),
                    }
                }
            });
            closing.close();
            acquiring.join().unwrap()
        });
        // The ring is churned: a chunk a view protects is never reused under it.
        for i in 0..20 {
            let key = format!("n{i}");
            let hk = w.put(&key, &[&[i as u8; 896]]).unwrap();
            read(&other, &hk, &key).unwrap();
        }
        for view in &views {
            let mut bytes = [0u8; 896];
            view.read_at(0, &mut bytes).unwrap();
            assert_eq!(bytes, [round; 896]);
        }
        drop(views);
        drop(closing);
        let stats = stats_of(&w);
        assert_eq!(
            (stats["readers_draining"], stats["views"]),
            (0, 0),
            "the slot is freed with its last lease, and no view is left counted"
        );
        Reader::attach(&info).expect("the freed slot is claimable");
    }
}

#[test]
fn closed_writer_is_reported_to_readers() {
    let (w, [r]) = writer_with_readers(1 << 16);
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

/// A put that fails after filling its block (here: the index is full of unread objects)
/// issues no handle, so no reader is owed a reference for it: `inspect`'s outstanding
/// (`refs - acks`) stays where it was, and the block and its bytes are given back.
#[test]
fn a_put_that_fails_after_its_fill_owes_the_readers_nothing() {
    let refs_of = |r: &Reader| {
        let stats = r.stats().unwrap();
        stats.into_iter().find(|(k, _)| *k == "refs").unwrap().1
    };
    let config = Config {
        max_objects: Some(4),
        ..Config::new(1 << 16, 1, None)
    };
    let w = Writer::create_with(&config, None).unwrap();
    let r = Reader::attach(&w.reader_info()).unwrap();
    for i in 0..4 {
        w.put(&format!("held{i}"), &[b"unread"]).unwrap();
    }
    assert_eq!(refs_of(&r), 4);
    assert!(matches!(w.put("x", &[b"x"]), Err(Error::IndexFull(4))));
    assert_eq!(stats_of(&w)["objects"], 4);
    assert_eq!(refs_of(&r), 4, "no handle was issued for the failed put");
}

/// A put counts its references for the reader set it loaded before its (unlocked, possibly
/// long) fill: a reader that left meanwhile, its slot taken by a new one, must not have the
/// reference counted for the newcomer, which can never consume it (the slot word is stamped
/// for the old epoch). After the newcomer tried every handle, its `refs` equals its `acks`.
#[test]
fn a_put_counts_no_reference_for_a_reader_that_attached_during_its_fill() {
    let counters = |r: &Reader| {
        let stats: HashMap<_, _> = r.stats().unwrap().into_iter().collect();
        (stats["refs"], stats["acks"])
    };
    let len = 64 << 20;
    let w = Writer::create_with(&Config::new(3 * len, 1, Some(len)), None).unwrap();
    let info = w.reader_info();
    let first = Reader::attach(&info).unwrap();
    let big = vec![7u8; len as usize];
    let (handle, second) = std::thread::scope(|s| {
        let put = s.spawn(|| w.put("big", &[&big]).unwrap());
        // The put loads its reader set at once, then fills 64 MiB of fresh pages.
        std::thread::sleep(std::time::Duration::from_millis(2));
        drop(first);
        let second = Reader::attach(&info).unwrap();
        (put.join().unwrap(), second)
    });
    let lease = second.acquire(&handle, "big").unwrap();
    let protected = lease.is_protected();
    drop(lease);
    let (refs, acks) = counters(&second);
    assert_eq!(
        refs,
        acks,
        "refs {refs}, acks {acks} (the put's reference was {}issued to the newcomer)",
        if protected { "" } else { "not " }
    );
}

#[test]
fn a_slots_new_occupant_is_not_charged_for_the_old_ones_unread_references() {
    // Room for exactly one chunk. The reference "k" owes the slot's first occupant, who left
    // without reading it, is stamped with that occupant's epoch: it keeps nothing for the
    // slot's next occupant, so "j" may evict "k".
    let w = writer(1024, 1);
    let info = w.reader_info();
    let first = Reader::attach(&info).unwrap();
    w.put("k", &[&[1u8; 896]]).unwrap();
    drop(first);
    let second = Reader::attach(&info).unwrap();
    assert_eq!(second.slot(), 0, "the slot the first reader left");
    let h = w.put("j", &[&[2u8; 896]]).unwrap();
    assert!(!w.is_cached("k").unwrap());
    assert_eq!(read(&second, &h, "j").unwrap(), vec![2u8; 896]);
}
