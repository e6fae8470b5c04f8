//! What the writer may reclaim, and when: CLOCK's sweep over the ring (second chance for a
//! chunk hit since the hand last passed, stepping over one still held), the per-slot check
//! that nobody holds a chunk (freeing the slots of dead readers on the way), and the
//! eviction itself — out of the index first, then killed (P2 in the module docs of
//! [`store`](crate::store)).

use std::collections::HashMap;
use std::sync::atomic::{Ordering, fence};

use super::Writer;
use super::state::{ChunkMeta, Tally};
use crate::error::Result;
use crate::handle::tag;
use crate::layout::{Claim, Counter, SlotState, SlotWord, chunk, slot};
use crate::ring::{Placement, Ring, Verdict};
use crate::store::Occupant;

impl Writer {
    /// Whether slot `o.slot` holds a view or (claimed, not draining) a reference on the chunk.
    fn holds(&self, address: u64, sig_tag: u32, o: &Occupant) -> Result<bool> {
        let w = SlotWord::unpack(self.shared.word(address, o.slot)?.load(Ordering::Acquire));
        Ok(
            w.stamp == SlotWord::stamp_for(sig_tag, o.claim.epoch as u64)
                && (w.views > 0 || (o.claim.state == SlotState::Claimed && w.outstanding > 0)),
        )
    }

    /// Whether the occupant of `o.slot` is gone; if so, free the slot (crediting everything
    /// it held). `checked` caches the answer for one sweep.
    fn reap_if_dead(
        &self,
        o: &Occupant,
        checked: &mut HashMap<u32, bool>,
        tally: &mut Tally,
    ) -> Result<bool> {
        if let Some(&dead) = checked.get(&o.slot) {
            return Ok(dead);
        }
        let dead = !self.shared.occupant_alive(o.slot, o.claim)?;
        if dead {
            let free = Claim {
                pid: 0,
                state: SlotState::Free,
                ..o.claim
            };
            // CAS: only free the slot if it still has the same occupant in the same state.
            let freed = self
                .shared
                .slot(o.slot, slot::CLAIM)?
                .compare_exchange(o.word, free.pack(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if freed {
                tally.bump(Counter::ReadersReclaimed);
            }
        }
        checked.insert(o.slot, dead);
        Ok(dead)
    }

    /// Whether the chunk can be reclaimed now (ignoring CLOCK's referenced bit).
    pub(super) fn reclaimable(
        &self,
        address: u64,
        meta: &ChunkMeta,
        occupants: &[Occupant],
        checked: &mut HashMap<u32, bool>,
        tally: &mut Tally,
    ) -> bool {
        if meta.pins > 0 {
            return false;
        }
        let sig_tag = tag(&meta.mac);
        for o in occupants {
            match self.holds(address, sig_tag, o) {
                Ok(false) => {}
                Ok(true) => {
                    if !matches!(self.reap_if_dead(o, checked, tally), Ok(true)) {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// Mark a chunk dead before its bytes are reused (see P2 in the module docs).
    pub(super) fn kill(&self, address: u64) -> Result<()> {
        self.shared
            .chunk(address, chunk::ID)?
            .store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Place an unpublished chunk of `size` bytes with CLOCK: a chunk hit since the hand last
    /// passed is kept once (second chance), one still held is stepped over, the others in
    /// the way are evicted (from the ring only: the caller unindexes and kills them). `None`
    /// when no room can be made.
    pub(super) fn make_room<'r>(
        &self,
        ring: &'r mut Ring<ChunkMeta>,
        tally: &mut Tally,
        size: u64,
        occupants: &[Occupant],
    ) -> Option<Placement<'r, ChunkMeta>> {
        let mut checked = HashMap::new();
        ring.allocate(size, ChunkMeta::default(), |address, meta| {
            if meta.key.is_some() && std::mem::take(&mut meta.referenced) {
                return Verdict::Keep; // second chance
            }
            if self.reclaimable(address, meta, occupants, &mut checked, tally) {
                Verdict::Evict
            } else {
                Verdict::Keep
            }
        })
    }

    /// Mark every evicted chunk dead, then issue the Release fence (P2): every reader that
    /// copies reused bytes will see `id == 0` (or a newer id).
    pub(super) fn kill_evicted(&self, evicted: &[(u64, ChunkMeta)]) -> Result<()> {
        for &(address, _) in evicted {
            self.kill(address)?;
        }
        fence(Ordering::Release);
        Ok(())
    }
}

/// Take the keys of evicted chunks out of the index (each only if it still names that
/// chunk), counting the evictions.
pub(super) fn unindex_evicted(
    keys: &mut HashMap<String, u64>,
    tally: &mut Tally,
    evicted: &[(u64, ChunkMeta)],
) {
    for (address, old) in evicted {
        if let Some(key) = &old.key {
            if keys.get(key) == Some(address) {
                keys.remove(key);
                tally.bump(Counter::Evictions);
            }
        }
    }
}
