//! Puts, reads and handles: round trips, errors, forged handles, reads by the writer.

use super::*;

#[test]
fn put_and_read_back_with_aligned_parts() {
    let (w, [r]) = writer_with_readers(1 << 16);
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
fn forged_and_foreign_handles_are_rejected_before_reading() {
    let (w, [r]) = writer_with_readers(1 << 16);
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
    // Room for exactly one chunk, so the new one reuses its bytes.
    let (w, [r]) = writer_with_readers(1024);
    let old = w.put("k", &[&[1u8; 896]]).unwrap();
    read(&r, &old, "k").unwrap();
    w.clear().unwrap();
    assert!(!w.is_cached("k").unwrap());
    let new = w.put("k", &[&[2u8; 896]]).unwrap();
    assert_eq!(new.address, old.address);
    assert!(new.monotonic_id > old.monotonic_id);
    assert!(matches!(read(&r, &old, "k"), Err(Error::Stale)));
    assert_eq!(read(&r, &new, "k").unwrap(), vec![2u8; 896]);
    // The writer's verify tells them apart too: same key, same address, another object.
    assert!(w.verify(&new, "k").unwrap());
    assert!(
        !w.verify(&old, "k").unwrap(),
        "a handle of the evicted object verified"
    );
}

#[test]
fn an_unprotected_copy_of_a_chunk_reused_meanwhile_is_stale() {
    // A replayed handle's lease protects nothing: if the chunk is reused between the lease
    // and the copy, the copy (of another object's bytes) must be reported stale.
    let (w, [r]) = writer_with_readers(1024);
    let old = w.put("k", &[&[1u8; 896]]).unwrap();
    assert_eq!(read(&r, &old, "k").unwrap(), vec![1u8; 896]); // its reference consumed
    let lease = r.acquire(&old, "k").unwrap();
    assert!(!lease.is_protected());
    w.clear().unwrap();
    let new = w.put("j", &[&[2u8; 896]]).unwrap();
    assert_eq!(
        new.address, old.address,
        "the new chunk reuses the old one's bytes"
    );
    let mut out = vec![0u8; lease.len()];
    assert!(matches!(lease.copy_to(&mut out), Err(Error::Stale)));
    assert_eq!(read(&r, &new, "j").unwrap(), vec![2u8; 896]);
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
