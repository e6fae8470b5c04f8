//! A proptest state machine of three writers and two readers against a model.

use super::*;
use proptest::prelude::*;

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
                    pretend_writer_dead(writers.remove(w));
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
