//! A proptest state machine of one writer and two readers against a model.

use super::*;
use proptest::prelude::*;

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
