//! What keeps an object: unread references, views, pins; `release`, `invalidate`, `clear`
//! and reference saturation.

use super::*;

/// How many references to `handle`'s object `reader` has yet to read.
fn outstanding(w: &Writer, handle: &Handle, reader: &Reader) -> u32 {
    let word = w.shared.word(handle.address, reader.slot()).unwrap();
    SlotWord::unpack(word.load(Ordering::Acquire)).outstanding
}

#[test]
fn unread_objects_are_protected_until_every_reader_reads() {
    // Ring of 4 chunks of 1 KiB (chunk header 128 + payload 896).
    let (w, [r1, r2]) = writer_with_readers(4096);
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
    let (w, [r]) = writer_with_readers(4096);
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
    let (w, [r]) = writer_with_readers(2048);
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
fn unread_object_survives_invalidate_but_clear_drops_its_references() {
    let (w, [r]) = writer_with_readers(4096);
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
    let (w, [_r]) = writer_with_readers(2048);
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

#[test]
fn reference_saturation_is_refused_whole_and_views_past_their_limit_read_copies() {
    let (w, [reading, stuck]) = writer_with_readers(4096);
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
    assert_eq!(
        outstanding(&w, &before_late, &late),
        1,
        "the late reader still owes after_late a read"
    );
    let lease = late.acquire(&after_late, "a").unwrap();
    assert!(
        lease.is_protected(),
        "after_late's reference was kept for the late reader"
    );
    w.release(&before_late).unwrap(); // a second release of the same handle gives nothing
    assert_eq!(
        outstanding(&w, &before_late, &early),
        1,
        "after_late's reference for the early reader stays"
    );
}

/// A reader that attaches while a put waits for the ring lock, is issued a reference on "a"
/// by another writer's hit (hits take no ring lock) and reads it through a protected lease:
/// the put's sweep, judging "a" afterwards, sees that reader (it loads the reader slots for
/// each chunk it judges, not once when the put began), keeps "a", and the lease reads "a".
#[test]
fn a_reader_attached_while_a_put_waits_for_the_ring_lock_keeps_its_lease() {
    let w = store(2048, 1, 2);
    let w2 = join(&w);
    let len = (1024 - w.layout().chunk_header_size) as usize;
    let a = payload(1, len);
    w.put("a", &[&a]).unwrap(); // no reader attached yet: no reference on it
    w.put("b", &[&payload(2, len)]).unwrap(); // the ring is full
    w.pin("b").unwrap(); // so the put's only candidate is "a"
    let guard = w2.shared.lock(w2.me).unwrap(); // another writer mid-sweep
    std::thread::scope(|s| {
        let putter = s.spawn(|| w.put("c", &[&payload(3, len)]));
        std::thread::sleep(std::time::Duration::from_millis(300)); // it waits for the lock
        let r = Reader::attach(&w.reader_info()).unwrap();
        let h = w2.get_cached("a").unwrap();
        let lease = r.acquire(&h, "a").unwrap();
        assert!(lease.is_protected());
        drop(guard);
        let put = putter.join().unwrap();
        let mut out = vec![0u8; lease.len()];
        let copied = lease.copy_to(&mut out);
        assert!(
            copied.is_err() || out == a,
            "a protected lease on \"a\" read other bytes (the put of \"c\": {put:?})"
        );
        assert!(
            put.is_err(),
            "\"c\" took the place of a leased object: {put:?}"
        );
    });
}

#[test]
fn a_hit_from_a_stale_reader_set_leaves_a_newer_readers_lease_alone() {
    // Writer `a` loaded its reader set while `old` held slot 0; before its hit's references
    // land, `old` leaves, `new` takes the slot, `b`'s hit stamps the word for `new`, and `new`
    // takes a protected lease. `a`'s stale member must not wipe that lease's view (with no
    // view the chunk would be evictable under it).
    let a = store(1 << 16, 1, 2);
    let b = join(&a);
    let info = a.reader_info();
    let old = Reader::attach(&info).unwrap();
    let old_epoch = a.shared.claim(old.slot()).unwrap().1.epoch;
    let put = a.put("k", &[&[7u8; 900]]).unwrap();
    read(&old, &put, "k").unwrap();
    drop(old);
    let new = Reader::attach(&info).unwrap();
    assert_ne!(a.shared.claim(new.slot()).unwrap().1.epoch, old_epoch);
    let h = b.get_cached("k").unwrap();
    let lease = new.acquire(&h, "k").unwrap();
    assert!(lease.is_protected());
    let sig_tag = a
        .shared
        .chunk(h.address, chunk::SIG_LO)
        .unwrap()
        .load(Ordering::Relaxed) as u32;
    let word = a.shared.word(h.address, new.slot()).unwrap();
    let before = word.load(Ordering::Acquire);
    a.add_references("k", h.address, sig_tag, &[(new.slot(), old_epoch)])
        .unwrap();
    assert_eq!(
        word.load(Ordering::Acquire),
        before,
        "the newer reader's references and view were overwritten"
    );
    assert_eq!(SlotWord::unpack(before).views, 1);
    drop(lease);
}
