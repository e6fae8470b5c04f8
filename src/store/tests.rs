//! Store tests over real segments: protocol examples, a multi-threaded acknowledgement test,
//! and a proptest state machine against a model.

use super::*;
use proptest::prelude::*;

fn writer(capacity: u64, n_readers: u32) -> Writer {
    Writer::create(capacity, n_readers, None, None).expect("create segment")
}

fn read(reader: &Arc<Reader>, handle: &Handle, key: &str) -> Result<Vec<u8>> {
    let lease = reader.acquire(handle, key)?;
    let mut out = vec![0u8; lease.len()];
    lease.copy_to(&mut out)?;
    Ok(out)
}

fn payload(tag: u64, len: usize) -> Vec<u8> {
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

#[test]
fn slots_are_claimed_freed_and_reclaimed_from_dead_readers() {
    let w = writer(2048, 1);
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
    // Pretend the reader's process died: point its slot at an exited process.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id() as u64;
    child.wait().unwrap();
    w.shared
        .slot(r.slot(), slot::PID)
        .unwrap()
        .store(dead, Ordering::Release);
    w.put("c", &[&[1u8; 896]]).unwrap();
    let stats: HashMap<_, _> = w.stats().unwrap().into_iter().collect();
    assert_eq!(stats["readers_reclaimed"], 1);
    std::mem::forget(r); // its slot is no longer its own
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
    let view = lease.protected_ptr().unwrap() as usize;
    assert!(address <= view && view + lease.len() <= address + len);
}
