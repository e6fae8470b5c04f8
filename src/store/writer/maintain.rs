//! What any writer does to the whole store: invalidating a key, clearing everything (under
//! the ring lock and the index lock; `invalidate` under the index lock), and the statistics
//! (the ring counted in slices, the ring lock given back between two).

use std::sync::atomic::{Ordering, fence};

use super::super::index::{Found, Seen};
use super::super::ring::{Census, Walk};
use super::super::{Stats, crash, update_word};
use super::Writer;
use crate::error::{Error, Result};
use crate::layout::{
    BlockKind, BlockState, Counter, PinWord, SlotState, SlotWord, WriterId, chunk,
};

/// What `stats` does under one hold of the ring lock, in the time it takes to read one more
/// word of a block (~3 ns): ~15 µs, less than a buffer's refill holds the lock. Measured on a
/// ring of small objects, a block costs ~100 ns (its header's cache line), ~32 words, plus one
/// per writer slot and per reader: 128 blocks a slice with three writer slots and one reader,
/// 44 with 64 writer slots and 8 readers.
const STATS_SLICE_WORDS: usize = 4608;
/// A block's own cost, in words (above).
const BLOCK_WORDS: usize = 32;

impl Writer {
    /// Forget `key` for every writer; its chunk is reclaimed once nobody holds it (pins on it
    /// stop counting). A no-op if absent.
    pub fn invalidate(&self, key: &str) -> Result<()> {
        self.check_open()?;
        let query = self.query(key);
        // Without the lock only when the key is surely not stored: a lookup that met a change
        // in progress (`Changing`) may have missed it.
        if matches!(self.shared.seek(&query)?, Seen::Absent | Seen::Claimed(_)) {
            return Ok(());
        }
        let _busy = self.enter()?;
        let index = self.lock_index()?;
        if let Found::Stored(entry) = self.shared.find(&index, &query)? {
            self.shared.remove_bucket(&index, entry.bucket)?;
            self.shared.adjust(&index, Counter::Objects, -1)?;
            let unkeyed = !(BlockState::REFERENCED_BIT | BlockState::KEYED_BIT);
            self.shared
                .chunk(entry.address, chunk::STATE)?
                .fetch_and(unkeyed, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Forget every key, drop every undelivered or unread reference (so the references of
    /// requests abandoned without `release` stop pinning the ring), and reclaim at once every
    /// chunk that no live view (and no writer's operation in progress) holds. A handle issued
    /// before still reads its own bytes (the reader verifies them) or is stale; ids keep
    /// counting, so it can never match anything stored after. Claims stay. A no-op when tmpfs
    /// cannot hold the key index (nothing was ever stored: see `Shared::filed`).
    pub fn clear(&self) -> Result<()> {
        let _busy = self.enter()?;
        let lock = match self.lock() {
            Ok(lock) => lock,
            Err(Error::ShmTooSmall { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        self.return_lab(&lock, &mut self.lab())?;
        let index = self.lock_index()?;
        let sh = &self.shared;
        let mut census = Census::new(self.me);
        // Who held references when the clear began; a reader attached since keeps its own
        // (its chunks are then kept: `held` sees it).
        let occupants = sh.occupants()?;
        let mut cleared = 0;
        let mut forgotten = Vec::new();
        for block in sh.blocks(&lock)? {
            if !matches!(block.state.kind, BlockKind::Live | BlockKind::Evicting) {
                continue;
            }
            let address = block.address;
            let id = sh.chunk(address, chunk::ID)?.load(Ordering::Relaxed);
            if block.state.keyed {
                let hash = sh.chunk(address, chunk::KEY_HASH)?.load(Ordering::Relaxed);
                if sh.unindex(&index, hash, address, id)? {
                    sh.adjust(&index, Counter::Objects, -1)?;
                }
            }
            let unkeyed = BlockState {
                kind: BlockKind::Live,
                referenced: false,
                keyed: false,
            };
            sh.chunk(address, chunk::STATE)?
                .store(unkeyed.pack(), Ordering::SeqCst);
            let sig_tag = sh.chunk(address, chunk::SIG_LO)?.load(Ordering::Relaxed) as u32;
            for o in &occupants {
                let stamp = SlotWord::stamp_for(sig_tag, o.claim.epoch as u64);
                update_word(sh.word(address, o.slot)?, |w| {
                    (w.stamp == stamp && w.outstanding > 0).then_some(SlotWord {
                        outstanding: 0,
                        ..w
                    })
                });
            }
            forgotten.push((address, id));
            if sh.evict_if_unheld(&lock, &index, address, block.size, &mut census)? {
                cleared += 1;
                if cleared == 1 {
                    crash::point("clear.partway");
                }
            }
        }
        // P2 for every chunk freed above.
        fence(Ordering::Release);
        sh.adjust(&lock, Counter::Clears, 1)?;
        drop(index);
        drop(lock);
        // After the store's locks: the private mutex is never taken while holding them.
        let mut private = self.private();
        for (address, id) in forgotten {
            private.forget(address, id);
        }
        Ok(())
    }

    /// The store's counters and what the ring holds (claims of writers that died are dropped
    /// first, so `claims` counts live ones).
    ///
    /// The ring is counted in slices (about 15 µs of work each), each under the ring lock, given
    /// back between two, and the index lock is taken only to drop dead writers' claims (when a
    /// look without it saw one): a walk over a large ring of small objects holds up no other
    /// writer's allocation for longer than a refill does. So while other writers put, each
    /// block is counted as it stood when its slice was walked, not all at one instant.
    pub fn stats(&self) -> Result<Stats> {
        let _busy = self.enter()?;
        let sh = &self.shared;
        let mut census = Census::new(self.me);
        if sh.counter_value(Counter::Claims)? > 0 && self.dead_claim_seen(&mut census)? {
            let index = self.lock_index()?;
            self.reap_claims(&index, &mut census)?;
        }
        let occupants = sh.occupants()?;
        let (mut chunks, mut reserved, mut pinned, mut outstanding, mut views) = (0, 0, 0, 0, 0);
        let mut walk = Walk::default();
        let words = BLOCK_WORDS + sh.layout.max_writers as usize + occupants.len();
        let slice_blocks = (STATS_SLICE_WORDS / words).max(1);
        loop {
            let lock = match self.lock() {
                Ok(lock) => lock,
                // tmpfs cannot hold the key index, so no lock was ever taken and no block
                // ever placed (see `Shared::filed`). Only ever at the first slice: a lock
                // taken once has reserved the index in this mapping for good.
                Err(Error::ShmTooSmall { .. }) => break,
                Err(e) => return Err(e),
            };
            // Under the ring lock: no block of the slice is evicted meanwhile, so its words are
            // its own.
            let slice = sh.walk_slice(&lock, &mut walk, slice_blocks)?;
            if slice.is_empty() {
                break;
            }
            for block in slice {
                let address = block.address;
                match block.state.kind {
                    BlockKind::Free => continue,
                    BlockKind::Reserved { .. } if block.buffer => continue,
                    BlockKind::Reserved { .. } => {
                        reserved += 1;
                        chunks += 1;
                        continue;
                    }
                    BlockKind::Live | BlockKind::Evicting => chunks += 1,
                }
                if block.state.keyed {
                    for w in 0..sh.layout.max_writers {
                        let pin = PinWord::unpack(sh.pin_word(address, w)?.load(Ordering::Acquire));
                        let writer = WriterId {
                            slot: w,
                            epoch: pin.epoch,
                        };
                        if pin.pins > 0 && census.writer_alive(sh, writer)? {
                            pinned += 1;
                            break;
                        }
                    }
                }
                let sig_tag = sh.chunk(address, chunk::SIG_LO)?.load(Ordering::Relaxed) as u32;
                for o in &occupants {
                    let w = SlotWord::unpack(sh.word(address, o.slot)?.load(Ordering::Acquire));
                    if w.stamp == SlotWord::stamp_for(sig_tag, o.claim.epoch as u64) {
                        if o.claim.state == SlotState::Claimed {
                            outstanding += w.outstanding as u64;
                        }
                        views += w.views as u64;
                    }
                }
            }
            lock.give_way();
            #[cfg(test)]
            crash::hook::run(crash::hook::STATS_SLICE);
        }
        let draining = occupants
            .iter()
            .filter(|o| o.claim.state == SlotState::Draining)
            .count() as u64;
        let mut writers = 0;
        for s in 0..sh.layout.max_writers {
            let (_, claim) = sh.writer_claim(s)?;
            let me = WriterId {
                slot: s,
                epoch: claim.epoch,
            };
            writers += (claim.state == SlotState::Claimed && census.writer_alive(sh, me)?) as u64;
        }
        let l = sh.layout;
        let mut stats = vec![
            ("capacity", l.capacity),
            ("n_readers", l.n_readers as u64),
            ("max_object_size", l.max_object_size),
            ("max_writers", l.max_writers as u64),
            ("max_objects", l.max_objects),
            ("writer_slot", self.me.slot as u64),
        ];
        for &c in Counter::ALL {
            stats.push((c.name(), sh.counter_value(c)?));
        }
        stats.extend([
            ("chunks", chunks),
            ("chunks_reserved", reserved),
            ("outstanding_refs", outstanding),
            ("views", views),
            ("pinned", pinned),
            ("readers_attached", occupants.len() as u64 - draining),
            ("readers_draining", draining),
            ("writers_attached", writers),
        ]);
        Ok(stats)
    }
}
