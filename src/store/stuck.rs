//! A sweep that found nothing, kept (`Stuck`): which readers' unread references held every
//! chunk of its last lap, and the counters that must move before the same sweep could find
//! anything. A writer keeps one and refuses the same request at once while it stands, instead
//! of sweeping the whole ring again (`writer/put.rs`): a ring a reader stopped reading made
//! every put cost two laps over every chunk.

use std::sync::atomic::Ordering;

use super::ring::Census;
use super::{Occupant, Shared};
use crate::error::Result;
use crate::layout::{BlockKind, BlockState, Counter, SlotState, SlotWord, WriterId, chunk, slot};

/// What a sweep saw in its last lap (allocation's, or `evict_one`'s): from the moment it
/// began (the counters then, [`Snapshot`]), which reader slots held each chunk it kept for
/// good, as far as it can tell (unread references: see [`Stuck`]), and whether some chunk
/// was kept by something passing instead (a writer's reservation, hazard or pin, a view, or
/// only a hit since the first lap cleared its referenced bit).
#[derive(Debug)]
pub(super) struct LastLap {
    before: Option<Snapshot>,
    passing: bool,
    /// The reader slots that held every chunk kept for good, and those that held any.
    every: u64,
    any: u64,
}

impl Default for LastLap {
    fn default() -> LastLap {
        LastLap {
            before: None,
            passing: false,
            every: u64::MAX,
            any: 0,
        }
    }
}

/// The counters whose change may let a sweep that found nothing find something: per reader
/// slot its claim word and `ACKS` (a read, or a writer's `release`, of one of its
/// references), per writer slot its claim word, and the store's `clears` and `puts`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Snapshot {
    /// `(slot, claim word, acks)`.
    readers: Vec<(u32, u64, u64)>,
    writers: Vec<u64>,
    clears: u64,
    puts: u64,
}

/// A sweep found nothing to make room with, and every chunk it kept in its last lap was held
/// by unread references of the reader slots in `before.readers` — which only that reader's
/// read, a writer's `release` (each counted in the slot's `ACKS`, with Release), `clear`,
/// the reader leaving its slot (its claim word) or dying (its lock) undo. Nor did anything
/// else end between its kept chunks: what it met was free or evictable, or lay beyond the
/// last window. So while none of those counters moves, and those readers live, the same
/// sweep would find nothing again: an allocation no smaller than the one that failed (a new
/// block only ever fills a gap between kept chunks, never widens one), or an eviction for the
/// index (a new keyed chunk comes from a publication, counted in `puts`; a claim of a
/// writer that died, which the index may drop for room, shows in the writer claim words
/// and locks). A writer keeps one after a failed sweep and answers the next request that it
/// would fail at once, instead of sweeping the whole ring again (a ring that a reader
/// stopped reading made every put cost two laps over every chunk: milliseconds in a GiB).
#[derive(Debug)]
pub(super) struct Stuck {
    before: Snapshot,
}

impl LastLap {
    /// Whether the sweep is in its last lap and records what it keeps.
    pub(super) fn started(&self) -> bool {
        self.before.is_some()
    }

    /// A chunk kept in the last lap, held for good by the reader slots in `holders` (a bit
    /// each; none: something passing holds it).
    fn kept(&mut self, holders: u64) {
        if holders == 0 {
            self.passing = true;
        } else {
            self.every &= holders;
            self.any |= holders;
        }
    }

    /// The sweep that just found nothing, as a [`Stuck`], if its last lap kept nothing for
    /// a passing reason. One reader slot holding every kept chunk is enough to watch (the
    /// other readers' reads then change nothing: they keep reading the hits of a ring one
    /// reader stopped reading); else every slot that held one.
    pub(super) fn stuck(&mut self) -> Option<Stuck> {
        let mut before = self.before.take()?;
        if self.passing {
            return None;
        }
        let watched = if self.every != u64::MAX && self.every != 0 {
            self.every & self.every.wrapping_neg()
        } else {
            self.any
        };
        before.readers.retain(|&(s, _, _)| watched & (1 << s) != 0);
        Some(Stuck { before })
    }
}

impl Shared {
    /// The counters of a [`Snapshot`], as they are now. Each `ACKS` is loaded with Acquire
    /// (pairs with the Release of its increment), so every consumed or given-back reference
    /// it counts is seen by the loads of reader words that follow.
    fn snapshot(&self) -> Result<Snapshot> {
        let mut readers = Vec::with_capacity(self.layout.n_readers as usize);
        for s in 0..self.layout.n_readers {
            let (word, _) = self.claim(s)?;
            let acks = self.slot(s, slot::ACKS)?.load(Ordering::Acquire);
            readers.push((s, word, acks));
        }
        let mut writers = Vec::with_capacity(self.layout.max_writers as usize);
        for w in 0..self.layout.max_writers {
            writers.push(self.writer_claim(w)?.0);
        }
        Ok(Snapshot {
            readers,
            writers,
            clears: self.counter(Counter::Clears)?.load(Ordering::Relaxed),
            puts: self.counter_value(Counter::Puts)?,
        })
    }

    /// Begin a sweep's last lap (what it keeps from here on is recorded).
    pub(super) fn start_last_lap(&self, census: &mut Census) -> Result<()> {
        census.last_lap = LastLap {
            before: Some(self.snapshot()?),
            ..LastLap::default()
        };
        Ok(())
    }

    /// Record why the block at `address`, just kept, was kept (in a sweep's last lap).
    pub(super) fn note_kept(&self, address: u64, census: &mut Census) -> Result<()> {
        if !census.last_lap.started() {
            return Ok(());
        }
        let state = BlockState::unpack(self.state_word(address)?.load(Ordering::Acquire));
        let holders = if state.kind == BlockKind::Live {
            self.referencing_readers(address, census)?
        } else {
            0 // a reservation, or a chunk left EVICTING
        };
        census.last_lap.kept(holders);
        Ok(())
    }

    /// The claimed reader slots (a bit each) whose living occupant holds unread references
    /// to the chunk at `address` (a look, changing nothing but freeing the slots of readers
    /// found dead, as `held` does).
    fn referencing_readers(&self, address: u64, census: &mut Census) -> Result<u64> {
        let sig_tag = self.chunk(address, chunk::SIG_LO)?.load(Ordering::Relaxed) as u32;
        let mut holders = 0u64;
        for slot in 0..self.layout.n_readers {
            let (word, claim) = self.claim(slot)?;
            if claim.state != SlotState::Claimed {
                continue;
            }
            let w = SlotWord::unpack(self.word(address, slot)?.load(Ordering::Acquire));
            let o = Occupant { slot, claim, word };
            if w.stamp == SlotWord::stamp_for(sig_tag, claim.epoch as u64)
                && w.outstanding > 0
                && !census.reader_gone(self, &o)?
            {
                holders |= 1 << slot;
            }
        }
        Ok(holders)
    }

    /// Whether what `stuck` recorded still stands: every counter it watches unchanged and
    /// every reader it relied on alive (with `index`, for an eviction to make index room:
    /// no publication since, and every writer alive whose claims the index could drop).
    pub(super) fn still_stuck(&self, stuck: &Stuck, me: WriterId, index: bool) -> Result<bool> {
        let before = &stuck.before;
        if self.counter(Counter::Clears)?.load(Ordering::Relaxed) != before.clears {
            return Ok(false);
        }
        for &(s, word, acks) in &before.readers {
            let (now, claim) = self.claim(s)?;
            if now != word
                || self.slot(s, slot::ACKS)?.load(Ordering::Acquire) != acks
                || !self.occupant_alive(s, claim)?
            {
                return Ok(false);
            }
        }
        if !index {
            return Ok(true);
        }
        if self.counter_value(Counter::Puts)? != before.puts {
            return Ok(false);
        }
        for (w, &word) in (0..).zip(&before.writers) {
            let (now, claim) = self.writer_claim(w)?;
            if now != word {
                return Ok(false);
            }
            let writer = WriterId {
                slot: w,
                epoch: claim.epoch,
            };
            if claim.is_occupied() && writer != me && !self.writer_alive(writer)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
