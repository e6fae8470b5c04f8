//! The shared allocator against a byte-map model: after every step the blocks tile the ring
//! and the gauges add up; pinned objects are never evicted; a put is refused only when no
//! window of free or evictable bytes of its size exists.

use proptest::prelude::*;

use super::*;
use crate::layout::{BlockKind, Config, align_up};

#[derive(Debug, Clone)]
enum Op {
    Put { len: u64, pinned: bool },
    Invalidate { pick: usize },
    Unpin { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..1500, any::<bool>()).prop_map(|(len, pinned)| Op::Put { len, pinned }),
        1 => any::<usize>().prop_map(|pick| Op::Invalidate { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Unpin { pick }),
    ]
}

/// The blocks, walked from address 0 under the ring lock.
fn blocks(w: &Writer) -> Vec<ring::Block> {
    let guard = w.shared.lock(w.me).unwrap();
    w.shared.blocks(&guard).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn ring_matches_a_byte_map_model(ops in proptest::collection::vec(op(), 1..80)) {
        // No reader: a chunk is held only by its pin.
        let w = Writer::create_with(&Config::new(8 * 1024, 1, None), None).unwrap();
        let capacity = w.layout().capacity;
        let header = w.layout().chunk_header_size;
        let mut keys: Vec<(String, bool)> = Vec::new(); // (key, pinned) of what was put
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Put { len, pinned } => {
                    let key = format!("k{step}");
                    let size = align_up(header + len).unwrap();
                    // Granules (64 B) a window may take: free, or a chunk not pinned.
                    let pinned_at: Vec<u64> = keys
                        .iter()
                        .filter(|(_, p)| *p)
                        .filter_map(|(k, _)| w.shared.lookup(&w.query(k)).unwrap())
                        .map(|e| e.address)
                        .collect();
                    let mut takeable = vec![true; (capacity / 64) as usize];
                    for b in blocks(&w).iter().filter(|b| pinned_at.contains(&b.address)) {
                        for g in b.address / 64..(b.address + b.size) / 64 {
                            takeable[g as usize] = false;
                        }
                    }
                    let need = (size / 64) as usize;
                    let window = size <= capacity
                        && takeable.windows(need).any(|g| g.iter().all(|&t| t));
                    match w.put(&key, &[&vec![step as u8; len as usize]]) {
                        Ok(_) => {
                            prop_assert!(window, "a put succeeded without a window");
                            if pinned {
                                w.pin(&key).unwrap();
                            }
                            keys.push((key, pinned));
                        }
                        Err(Error::Full { .. }) => prop_assert!(!window, "refused with a free window"),
                        Err(Error::TooLarge { .. }) => prop_assert!(size > capacity),
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Invalidate { pick } => {
                    if !keys.is_empty() {
                        let (key, _) = keys.remove(pick % keys.len());
                        w.invalidate(&key).unwrap();
                    }
                }
                Op::Unpin { pick } => {
                    if !keys.is_empty() {
                        let i = pick % keys.len();
                        w.unpin(&keys[i].0).unwrap();
                        keys[i].1 = false;
                    }
                }
            }
            let after = blocks(&w);
            let mut end = 0;
            let mut in_use = 0;
            for b in &after {
                prop_assert_eq!(b.address, end, "blocks tile the ring");
                prop_assert!(b.size >= 64 && b.size % 64 == 0);
                end += b.size;
                if b.state.kind != BlockKind::Free {
                    in_use += b.size;
                }
            }
            prop_assert_eq!(end, capacity);
            let stats: std::collections::HashMap<_, _> = w.stats().unwrap().into_iter().collect();
            prop_assert_eq!(stats["bytes_in_use"], in_use);
            prop_assert_eq!(stats["objects"], w.keys().unwrap().len() as u64);
            for (key, pinned) in &keys {
                if *pinned {
                    prop_assert!(w.is_cached(key).unwrap(), "pinned {} was evicted", key);
                }
            }
        }
    }
}
