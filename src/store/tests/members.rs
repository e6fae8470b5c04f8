//! Several writers over one real segment: sharing objects, counters and metadata, joining
//! and leaving.

use super::*;

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
    pretend_writer_dead(b);
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
    pretend_writer_dead(a);
    assert_eq!(status(&name).unwrap(), Status::Live, "b lives");
    pretend_writer_dead(b);
    // From here on, a store another test creates meanwhile may prune the segment (its
    // creation sweeps orphans, and only orphans): gone is that same verdict.
    fn pruned<T>(r: &Result<T>) -> bool {
        matches!(r, Err(Error::NotFound(_)))
    }
    let verdict = status(&name);
    assert!(pruned(&verdict) || matches!(verdict, Ok(Status::Orphaned(_))));
    let joined = Writer::join(&info);
    assert!(pruned(&joined) || matches!(joined, Err(Error::WriterGone(_))));
    let unlinked = crate::segment::unlink(&name);
    assert!(pruned(&unlinked) || unlinked.is_ok());
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
