//! Allocation buffers (`writer/lab.rs`): small objects carved from a block reserved for
//! several, large ones reserved on their own; a buffer given back, taken back by another
//! writer's sweep while its owner is idle, and reclaimed when its owner dies; an owner paused
//! in a carve while a sweep takes its buffer back and another object's bytes fill its place.

use std::sync::mpsc;
use std::time::Duration;

use super::*;
use crate::layout::{BlockKind, BlockState, WriterId, chunk, slot};
use crate::store::crash::hook;
use crate::store::ring::{Block, Census};

const KIB: u64 = 1 << 10;

/// Two writers of a 1 MiB ring (32 KiB buffers each) and its reader.
fn two_writers_and_a_reader() -> (Writer, Writer, Arc<Reader>) {
    let a = store(1024 * KIB, 1, 2);
    let b = join(&a);
    let r = Reader::attach(&a.reader_info()).unwrap();
    (a, b, r)
}

/// Put `bytes` under `key` with `w` and read them back through `r` (so nothing stays owed).
fn put_and_read(w: &Writer, r: &Arc<Reader>, key: &str, bytes: &[u8]) {
    let h = w.put(key, &[bytes]).unwrap();
    assert_eq!(read(r, &h, key).unwrap(), bytes);
}

#[test]
fn small_objects_are_carved_from_one_buffer_and_large_ones_are_not() {
    let (w, [r]) = writer_with_readers::<1>(4096 * KIB);
    let mut handles = Vec::new();
    for i in 0..10 {
        let key = format!("small{i}");
        handles.push((key.clone(), w.put(&key, &[&payload(i, 1000)]).unwrap()));
    }
    let stats = stats_of(&w);
    // A ring of 4 MiB and one writer slot: a 256 KiB buffer, reserved once.
    assert_eq!(stats["bytes_in_use"], 256 * KIB, "one buffer holds all ten");
    assert_eq!((stats["chunks"], stats["chunks_reserved"]), (10, 0));
    let large = w.put("large", &[&payload(99, 200 * 1024)]).unwrap();
    let grown = stats_of(&w)["bytes_in_use"] - 256 * KIB;
    assert!(
        (200 * KIB..210 * KIB).contains(&grown),
        "a large object is reserved on its own: {grown}"
    );
    for (i, (key, handle)) in handles.iter().enumerate() {
        assert_eq!(read(&r, handle, key).unwrap(), payload(i as u64, 1000));
    }
    assert_eq!(read(&r, &large, "large").unwrap(), payload(99, 200 * 1024));
    w.clear().unwrap();
    assert_eq!(
        stats_of(&w)["bytes_in_use"],
        0,
        "clear gives the buffer back"
    );
}

#[test]
fn an_idle_writers_buffer_is_taken_back_and_holds_nothing() {
    let (a, b, r) = two_writers_and_a_reader();
    put_and_read(&a, &r, "k", b"a small object of a's");
    // b's puts sweep the ring: a's buffer, just after k, must neither survive nor keep k.
    let mut n = 0u64;
    while a.is_cached("k").unwrap() {
        let key = format!("b{n}");
        put_and_read(&b, &r, &key, &payload(n, 4000));
        n += 1;
        assert!(n < 1000, "k was never evicted: a's idle buffer held it");
    }
    for i in 0..50 {
        let key = format!("a{i}");
        put_and_read(&a, &r, &key, &payload(1000 + i, 500));
    }
    let stats = stats_of(&a);
    assert!(stats["bytes_in_use"] <= stats["capacity"]);
    assert_eq!(stats["chunks_reserved"], 0);
    drop(b);
    drop(a); // closes: its buffer goes back, and nothing it holds is left to wait for
}

#[test]
fn a_dead_writers_buffer_is_reclaimed() {
    let (a, b, r) = two_writers_and_a_reader();
    put_and_read(&b, &r, "from b", b"carved from b's buffer");
    let dead = b.me;
    pretend_writer_dead(b);
    for n in 0..600 {
        let key = format!("a{n}");
        put_and_read(&a, &r, &key, &payload(n, 4000));
    }
    assert!(!a.is_cached("from b").unwrap(), "evicted with the rest");
    let lock = a.shared.lock(a.me).unwrap();
    let left: Vec<_> = a
        .shared
        .blocks(&lock)
        .unwrap()
        .into_iter()
        .filter(|block| block.state.kind == (BlockKind::Reserved { owner: dead }))
        .collect();
    assert!(left.is_empty(), "b's buffer was reclaimed: {left:?}");
}

#[test]
fn a_writer_dead_in_the_middle_of_a_carve_wedges_nobody_and_its_slot_carves_again() {
    let (a, b, r) = two_writers_and_a_reader();
    put_and_read(&b, &r, "from b", b"carved from b's buffer");
    // b dies between its announcement and its CAS: its carve word says so from then on.
    let carve = b.shared.writer_slot(b.me.slot, slot::CARVE).unwrap();
    carve.fetch_or(slot::CARVING, Ordering::SeqCst);
    let dead = b.me;
    pretend_writer_dead(b);
    let buffers_of = |w: &Writer, owner| {
        let lock = w.shared.lock(w.me).unwrap();
        let blocks = w.shared.blocks(&lock).unwrap();
        let of_owner = |block: &Block| block.state.kind == (BlockKind::Reserved { owner });
        blocks.into_iter().filter(of_owner).collect::<Vec<_>>()
    };
    for n in 0..600 {
        put_and_read(&a, &r, &format!("a{n}"), &payload(n, 4000));
    }
    let left = buffers_of(&a, dead);
    assert!(left.is_empty(), "b's buffer was reclaimed: {left:?}");
    // The next occupant of b's slot carves, and its idle buffer is taken back as any other.
    let c = join(&a);
    assert_eq!(c.me.slot, dead.slot);
    put_and_read(&c, &r, "from c", b"carved from c's buffer");
    assert_eq!(buffers_of(&a, c.me).len(), 1, "c's buffer");
    for n in 600..1200 {
        put_and_read(&a, &r, &format!("a{n}"), &payload(n, 4000));
    }
    let left = buffers_of(&a, c.me);
    assert!(left.is_empty(), "c's idle buffer was taken back: {left:?}");
    c.close().unwrap();
}

#[test]
fn a_take_back_marked_before_a_buffer_started_never_stops_its_carves() {
    // A sweep took a's buffer at `address` back while a was idle, and a carved nothing since
    // (its puts too large, or it cleared): the mark still names `address` when a's next
    // buffer starts there. Had a given that buffer up, it would hold its room until a sweep
    // met it, and a's `close` (which waits for its reservations) until then.
    let a = store(1024 * KIB, 1, 2);
    let (len, size) = (32 * KIB, 4 * KIB);
    let lock = a.shared.lock(a.me).unwrap();
    let mut census = Census::new(a.me);
    let address = a.shared.allocate(&lock, len, &mut census, None).unwrap();
    let address = address.expect("room");
    let carve = a.shared.writer_slot(a.me.slot, slot::CARVE).unwrap();
    carve.store(address | slot::TAKEN, Ordering::SeqCst);
    a.shared.make_buffer(&lock, address, a.me).unwrap();
    drop(lock);
    let carved = a.shared.carve_buffer(address, len, size, a.me).unwrap();
    let lock = a.shared.lock(a.me).unwrap();
    let rest = if carved {
        a.shared.unreserve(&lock, address).unwrap();
        address + size
    } else {
        address
    };
    assert!(a.shared.free_buffer(&lock, rest, a.me).unwrap());
    drop(lock);
    assert!(carved, "a carved from its new buffer");
}

/// Two writers of a 1 MiB ring (32 KiB buffers each), no reader attached (nothing a put
/// issues is owed, so objects are evicted freely), the first with a buffer it carved one
/// object from: the writers, and where what is left of that buffer starts.
fn a_buffer_carved_once() -> (Writer, Writer, u64) {
    let a = store(1024 * KIB, 1, 2);
    let b = join(&a);
    let first = a.put("a0", &[&payload(0, 1000)]).unwrap();
    let rest = first.address + a.shared.block_size(first.address).unwrap();
    let word = a.shared.state_word(rest).unwrap().load(Ordering::Relaxed);
    assert_eq!(word, BlockState::buffer_word(a.me), "a's buffer follows a0");
    (a, b, rest)
}

/// Where the first difference between `got` and `want` is, if any.
fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    let differs = got.iter().zip(want).position(|(g, w)| g != w);
    differs.or((got.len() != want.len()).then_some(got.len().min(want.len())))
}

/// One of `b`'s objects, put over the ring until one covers the state word of the block
/// start `rest` (where `a`'s buffer was), its payload crafted (stored verbatim): `a`'s buffer
/// word at every 8 bytes, so that word reads as `a`'s buffer word. Its key, handle and bytes.
fn cover_with_forged_words(a: WriterId, b: &Writer, rest: u64) -> (String, Handle, Vec<u8>) {
    let forged = forged_copy(BlockState::buffer_word(a), 96 * KIB as usize);
    let state_at = rest + chunk::STATE;
    let header = b.shared.layout.chunk_header_size;
    for n in 0..200u64 {
        // Sizes vary, so block starts do not repeat from one lap to the next.
        let len = (48 + 8 * (n % 7) as usize) * 1024;
        let key = format!("b{n}");
        let h = b.put(&key, &[&forged[..len]]).unwrap();
        let payload = h.address + header..h.address + header + len as u64;
        if payload.contains(&state_at) && payload.contains(&(state_at + 7)) {
            return (key, h, forged[..len].to_vec());
        }
    }
    panic!("no object of b covered a's old buffer");
}

/// `b`'s object (`cover_with_forged_words`) reads back whole, and no block starts inside it.
fn check_intact(b: &Writer, (key, covering, bytes): &(String, Handle, Vec<u8>)) {
    let got = b.read(covering, key).unwrap();
    assert_eq!(
        first_difference(&got, bytes),
        None,
        "b's object kept its bytes (a changed nothing inside it)"
    );
    assert!(b.verify(covering, key).unwrap());
    let lock = b.shared.lock(b.me).unwrap();
    let blocks = b.shared.blocks(&lock).unwrap();
    let header = b.shared.layout.chunk_header_size;
    let inside = covering.address + 1..covering.address + header + bytes.len() as u64;
    assert!(
        !blocks.iter().any(|block| inside.contains(&block.address)),
        "no block starts inside b's object: {blocks:?}"
    );
}

#[test]
fn an_owner_paused_in_a_carve_never_carves_a_buffer_taken_back_and_filled_since() {
    let (a, b, rest) = a_buffer_carved_once();
    let (tell, told) = mpsc::channel();
    let owner = a.me;
    let mut meddler = Some(b);
    // Paused in its next carve, after it read its buffer and before it carves, a sees b's
    // sweeps take the buffer back, until one of b's objects covers `rest`.
    hook::set(hook::LAB_CARVE, move || {
        let Some(b) = meddler.take() else {
            return;
        };
        let covering = std::thread::spawn(move || {
            let covering = cover_with_forged_words(owner, &b, rest);
            (b, covering)
        });
        tell.send(covering.join().unwrap()).unwrap();
    });
    let carved = a.put("a1", &[&payload(1, 1000)]);
    hook::clear();
    let (b, covering) = told.try_recv().expect("a paused in its carve");
    let carved = carved.unwrap();
    assert_eq!(a.read(&carved, "a1").unwrap(), payload(1, 1000));
    // On main a's CAS took the forged word for its buffer: a1's header and bytes landed
    // inside b's object (where a's buffer was).
    check_intact(&b, &covering);
}

#[test]
fn an_owner_never_gives_back_a_buffer_taken_back_and_filled_since() {
    // a idle: b's sweeps take its buffer back and fill its room; then a gives back what it
    // thinks is left of its buffer (on `close`, as on a refill or `clear`).
    let (a, b, rest) = a_buffer_carved_once();
    let covering = cover_with_forged_words(a.me, &b, rest);
    let closed = a.close();
    check_intact(&b, &covering);
    assert!(closed.is_ok(), "a's close: {closed:?}");
}

#[test]
fn a_sweep_leaves_the_buffer_of_an_owner_in_the_middle_of_a_carve_to_it() {
    let (a, b, rest) = a_buffer_carved_once();
    let capacity = a.shared.layout.capacity;
    let len_of = |n: u64| (48 + 8 * (n % 7) as usize) * 1024;
    let (tell, told) = mpsc::channel();
    let mut meddler = Some(b);
    // Paused between its announcement and its CAS, a sees b's puts sweep the ring twice over:
    // each steps over a's buffer (a preempted owner never wedges a sweep), none takes it.
    hook::set(hook::LAB_ANNOUNCED, move || {
        let Some(b) = meddler.take() else {
            return;
        };
        let seen = std::thread::spawn(move || {
            let mut put = 0;
            let mut n = 0u64;
            while put < 2 * capacity {
                let len = len_of(n);
                b.put(&format!("b{n}"), &[&payload(n, len)]).unwrap();
                put += len as u64;
                n += 1;
            }
            let word = b.shared.state_word(rest).unwrap().load(Ordering::Relaxed);
            (b, n, word)
        })
        .join()
        .unwrap();
        tell.send(seen).unwrap();
    });
    let carved = a.put("a1", &[&payload(1, 1000)]);
    hook::clear();
    let (b, n, word) = told.try_recv().expect("a paused in its carve");
    assert_eq!(word, BlockState::buffer_word(a.me), "a's buffer was kept");
    let carved = carved.unwrap();
    assert_eq!(carved.address, rest, "a1 was carved from it");
    assert_eq!(a.read(&carved, "a1").unwrap(), payload(1, 1000));
    let last = format!("b{}", n - 1);
    assert_eq!(
        b.read_key(&last).unwrap(),
        payload(n - 1, b.read_key(&last).unwrap().len())
    );
    // The buffer is an idle writer's again: the next sweep over it takes it back.
    for m in n..n + 40 {
        b.put(&format!("b{m}"), &[&payload(m, 64 * 1024)]).unwrap();
    }
    let lock = a.shared.lock(a.me).unwrap();
    let buffers: Vec<_> = a
        .shared
        .blocks(&lock)
        .unwrap()
        .into_iter()
        .filter(|block| block.buffer)
        .collect();
    assert!(buffers.is_empty(), "a's buffer was taken back: {buffers:?}");
}

#[test]
fn a_buffer_a_dead_sweep_marked_taken_is_freed_by_the_next_holder_of_the_ring_lock() {
    // b's sweep marked a's buffer taken and died, holding the ring lock, before it freed it:
    // a's next carve gives the buffer up, whole, and the ring lock's next holder (a, to
    // refill) frees it in its repair. Left in place, it would be a second buffer of a's that
    // a later sweep marks, overwriting the mark of a's new one; and a's `close` (which waits
    // for its reservations) would wait for it.
    let (a, b, rest) = a_buffer_carved_once();
    {
        let guard = b.shared.lock(b.me).unwrap();
        let carve = b.shared.writer_slot(a.me.slot, slot::CARVE).unwrap();
        carve.store(rest | slot::TAKEN, Ordering::SeqCst);
        std::mem::forget(guard);
    }
    pretend_writer_dead(b);
    let carved = a.put("a1", &[&payload(1, 1000)]).unwrap();
    assert_ne!(carved.address, rest, "a gave its buffer up");
    let me = a.me;
    let lock = a.shared.lock(me).unwrap();
    let blocks = a.shared.blocks(&lock).unwrap();
    drop(lock);
    let at_rest = blocks.iter().find(|block| block.address == rest);
    assert!(
        at_rest.is_none_or(|block| !block.buffer),
        "the marked buffer was freed: {at_rest:?}"
    );
    let buffers = blocks
        .iter()
        .filter(|block| block.buffer && block.state.kind == (BlockKind::Reserved { owner: me }));
    assert_eq!(buffers.count(), 1, "a holds its new buffer only");
    let c = join(&a); // to look at the ring once a closed
    let (done, closed) = mpsc::channel();
    std::thread::spawn(move || done.send(a.close()).unwrap());
    let closed = closed.recv_timeout(Duration::from_secs(20));
    assert!(matches!(closed, Ok(Ok(()))), "a's close: {closed:?}");
    let lock = c.shared.lock(c.me).unwrap();
    let blocks = c.shared.blocks(&lock).unwrap();
    let reserved = |block: &&Block| block.state.kind == (BlockKind::Reserved { owner: me });
    let left: Vec<_> = blocks.iter().filter(reserved).collect();
    assert!(left.is_empty(), "a's blocks all went back: {left:?}");
}

/// `len` bytes of `word` repeated (little endian).
fn forged_copy(word: u64, len: usize) -> Vec<u8> {
    std::iter::repeat_n(word.to_le_bytes(), len.div_ceil(8))
        .flatten()
        .take(len)
        .collect()
}
