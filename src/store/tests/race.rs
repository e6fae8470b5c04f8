//! Threads racing: readers against an evicting writer, and threads of several writers on
//! the same keys.

use std::sync::mpsc;

use super::*;

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
    race_on_keys(64 * 1024, 24);
}

/// The same race in a ring large enough for allocation buffers (43 KiB each: every object
/// is carved without the ring lock) and keys enough to wrap it: carves race other writers'
/// sweeps, which take idle buffers back.
#[test]
fn writers_carving_their_buffers_race_each_others_sweeps() {
    let stats = race_on_keys(2 << 20, 2000);
    assert!(
        stats["last_id"] > 2 * stats["puts"],
        "ids were drawn for buffers: {stats:?}"
    );
}

/// The race above over a ring of `capacity` bytes and `keys` keys; the store's statistics
/// after it.
fn race_on_keys(capacity: u64, keys: u64) -> HashMap<&'static str, u64> {
    const THREADS_PER_WRITER: usize = 2;
    const ROUNDS: usize = 3000;
    let first = store(capacity, 2, WRITERS as u32);
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
                        let k = rng.below(keys);
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
    let mut stored_keys = writers[1].keys().unwrap();
    let n = stored_keys.len();
    stored_keys.sort();
    stored_keys.dedup();
    assert_eq!(stored_keys.len(), n, "a key is stored at most once");
    stats
}
