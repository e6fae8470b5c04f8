//! The single writer's ring allocator (writer-private memory; no shared state).
//!
//! Chunks are placed contiguously at a cursor that sweeps the ring like a clock hand. To
//! place `size` bytes, the window `[cursor, cursor + size)` must be free or covered only by
//! chunks the caller agrees to evict; a chunk the caller wants to keep (unread, pinned,
//! viewed, or recently hit and given a second chance) moves the window past it, so one live
//! chunk never blocks the reclaimable space around it. A chunk never wraps: a window that
//! would run past the end restarts at 0. The sweep gives up after two full laps (the first
//! lap may only have cleared second-chance bits), so allocation always terminates.

use std::collections::BTreeMap;

/// What the caller decides for a chunk that lies in the window being considered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Evict,
    Keep,
}

#[derive(Debug)]
struct Entry<T> {
    len: u64,
    value: T,
}

/// Placement of `T`-tagged chunks in `[0, capacity)`.
#[derive(Debug)]
pub struct Ring<T> {
    capacity: u64,
    cursor: u64,
    used: u64,
    chunks: BTreeMap<u64, Entry<T>>,
}

/// A successful allocation: where the new chunk starts, what had to go, and the new chunk's
/// value (for filling in what depends on where it landed).
#[derive(Debug)]
pub struct Placement<'a, T> {
    pub address: u64,
    pub evicted: Vec<(u64, T)>,
    pub value: &'a mut T,
}

impl<T> Ring<T> {
    pub fn new(capacity: u64) -> Self {
        Ring {
            capacity,
            cursor: 0,
            used: 0,
            chunks: BTreeMap::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes covered by live chunks.
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    pub fn get(&self, address: u64) -> Option<&T> {
        self.chunks.get(&address).map(|e| &e.value)
    }

    pub fn get_mut(&mut self, address: u64) -> Option<&mut T> {
        self.chunks.get_mut(&address).map(|e| &mut e.value)
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, &T)> {
        self.chunks.iter().map(|(&a, e)| (a, e.len, &e.value))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut T)> {
        self.chunks.iter_mut().map(|(&a, e)| (a, &mut e.value))
    }

    /// Forget the chunk at `address` (its bytes become free space).
    pub fn remove(&mut self, address: u64) -> Option<T> {
        let entry = self.chunks.remove(&address)?;
        self.used -= entry.len;
        Some(entry.value)
    }

    /// Starts of the chunks that overlap `[start, end)`, in address order.
    fn overlapping(&self, start: u64, end: u64) -> Vec<u64> {
        let mut found: Vec<u64> = self
            .chunks
            .range(..end)
            .rev()
            .take_while(|(a, e)| *a + e.len > start)
            .map(|(a, _)| *a)
            .collect();
        found.reverse();
        found
    }

    /// Place a chunk of `size` bytes holding `value`. `decide` is asked about each chunk in
    /// the way (and may update it, e.g. clear a second-chance bit before answering `Keep`).
    /// Returns `None`, changing nothing but what `decide` changed, when no window can be
    /// cleared within two laps.
    pub fn allocate(
        &mut self,
        size: u64,
        value: T,
        mut decide: impl FnMut(u64, &mut T) -> Verdict,
    ) -> Option<Placement<'_, T>> {
        if size == 0 || size > self.capacity {
            return None;
        }
        let budget = 2 * self.capacity + size;
        let mut swept = 0u64;
        while swept <= budget {
            if self.cursor + size > self.capacity {
                swept += self.capacity - self.cursor;
                self.cursor = 0;
                continue;
            }
            let (start, end) = (self.cursor, self.cursor + size);
            let in_way = self.overlapping(start, end);
            // Chunks never overlap: those in the way are exactly the ones starting from the
            // first of them up to `end`.
            let first = in_way.first().copied().unwrap_or(end);
            let mut blocked_at = None;
            for (&address, entry) in self.chunks.range_mut(first..end) {
                if decide(address, &mut entry.value) == Verdict::Keep {
                    blocked_at = Some(address + entry.len);
                    break;
                }
            }
            match blocked_at {
                Some(end) => {
                    swept += end - start;
                    self.cursor = end;
                }
                None => {
                    let evicted = in_way
                        .into_iter()
                        .filter_map(|a| Some((a, self.remove(a)?)))
                        .collect();
                    self.used += size;
                    self.cursor = end;
                    // No chunk starts at `start` any more: the one that did was in the way.
                    let placed = self
                        .chunks
                        .entry(start)
                        .or_insert(Entry { len: size, value });
                    return Some(Placement {
                        address: start,
                        evicted,
                        value: &mut placed.value,
                    });
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `Keep` for chunks tagged true.
    fn keep_true(_: u64, live: &mut bool) -> Verdict {
        if *live { Verdict::Keep } else { Verdict::Evict }
    }

    #[test]
    fn fills_then_wraps_and_evicts_oldest_first() {
        let mut ring = Ring::new(256);
        for i in 0..4 {
            let p = ring.allocate(64, false, keep_true).unwrap();
            assert_eq!(p.address, i * 64);
            assert!(p.evicted.is_empty());
        }
        let p = ring.allocate(128, false, keep_true).unwrap();
        assert_eq!(p.address, 0);
        assert_eq!(
            p.evicted.iter().map(|e| e.0).collect::<Vec<_>>(),
            vec![0, 64]
        );
        assert_eq!(ring.used(), 256);
    }

    #[test]
    fn steps_over_a_live_chunk_instead_of_blocking() {
        let mut ring = Ring::new(256);
        ring.allocate(64, true, keep_true).unwrap(); // 0: live forever
        for _ in 0..3 {
            ring.allocate(64, false, keep_true).unwrap();
        }
        // The live chunk at 0 is stepped over; 64..192 is reused.
        let p = ring.allocate(128, false, keep_true).unwrap();
        assert_eq!(p.address, 64);
        assert!(ring.get(0).is_some());
    }

    #[test]
    fn full_of_live_chunks_fails_without_change() {
        let mut ring = Ring::new(256);
        for _ in 0..4 {
            ring.allocate(64, true, keep_true).unwrap();
        }
        assert!(ring.allocate(64, false, keep_true).is_none());
        assert_eq!(ring.len(), 4);
        assert!(ring.allocate(512, false, keep_true).is_none());
    }

    #[test]
    fn second_chance_is_given_once() {
        // Values: (referenced bit). Keep and clear when set.
        let mut ring = Ring::new(128);
        ring.allocate(64, true, |_, _| Verdict::Evict).unwrap();
        ring.allocate(64, false, |_, _| Verdict::Evict).unwrap();
        let mut second_chance = |_: u64, referenced: &mut bool| {
            if std::mem::take(referenced) {
                Verdict::Keep
            } else {
                Verdict::Evict
            }
        };
        let p = ring.allocate(64, false, &mut second_chance).unwrap();
        assert_eq!(p.address, 64, "the referenced chunk at 0 survives one pass");
        let p = ring.allocate(64, false, &mut second_chance).unwrap();
        assert_eq!(p.address, 0, "and is evicted on the next");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64, bool),
        Remove(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u64..=16, any::<bool>()).prop_map(|(n, live)| Op::Alloc(n * 64, live)),
            1 => any::<usize>().prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Against a byte-map model: chunks never overlap or leave the ring, `used` is their
        /// sum, live chunks are never evicted, and allocation fails only if no window of
        /// free-or-evictable bytes exists.
        #[test]
        fn ring_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
            let capacity = 1024u64;
            let mut ring = Ring::new(capacity);
            for op in ops {
                match op {
                    Op::Alloc(size, live) => {
                        let before: Vec<(u64, u64, bool)> =
                            ring.iter().map(|(a, l, v)| (a, l, *v)).collect();
                        match ring.allocate(size, live, keep_true) {
                            Some(p) => {
                                prop_assert!(p.address + size <= capacity);
                                prop_assert!(p.evicted.iter().all(|(_, live)| !live));
                            }
                            None => {
                                // No window of non-live bytes of this size may exist.
                                let mut blocked = vec![false; (capacity / 64) as usize];
                                for (a, l, live) in &before {
                                    if *live {
                                        for b in a / 64..(a + l) / 64 { blocked[b as usize] = true; }
                                    }
                                }
                                let need = (size / 64) as usize;
                                let has_window = blocked.windows(need).any(|w| w.iter().all(|b| !b));
                                prop_assert!(!has_window, "allocation failed with a free window");
                            }
                        }
                    }
                    Op::Remove(i) => {
                        let addrs: Vec<u64> = ring.iter().map(|(a, _, _)| a).collect();
                        if !addrs.is_empty() {
                            ring.remove(addrs[i % addrs.len()]);
                        }
                    }
                }
                let mut end = 0;
                let mut total = 0;
                for (a, l, _) in ring.iter() {
                    prop_assert!(a >= end, "chunks overlap");
                    prop_assert!(a + l <= capacity);
                    end = a + l;
                    total += l;
                }
                prop_assert_eq!(total, ring.used());
            }
        }
    }
}
