//! Writer slots: how a writer takes one (creating the store, or joining it), gives it back,
//! and how the last writer to leave removes the segment.
//!
//! A writer slot is claimed like a reader slot (its OFD lock first, then one CAS of its claim
//! word to a new epoch), so a writer that died is recognised exactly as a dead reader is.
//! Every live writer also holds a *shared* lock on [`WRITER_LOCK`], so "is any writer alive"
//! (what readers, `inspect` and `prune` ask) is one lock test in any PID namespace.
//!
//! Joining and leaving happen under the exclusive [`MEMBERSHIP_LOCK`] (held for a few system
//! calls; the kernel drops it if its holder dies): a leaving writer gives up its slot's lock,
//! tests through its own lock descriptor whether any other writer holds the shared lock, and
//! if none does marks the store closed and unlinks it, giving up its own shared lock only
//! then — all before a joiner can look, and while a sweep still sees the store live. A joiner
//! takes the shared lock first, then refuses a store that is closed or has no other writer
//! (readers have been told it is gone; a sweep may be removing it: see `remove_if_orphaned`,
//! which holds the membership lock too). So the segment is unlinked exactly once, by the last
//! writer to leave (or by a sweep once every writer is dead).

use std::sync::atomic::Ordering;

use super::Shared;
use crate::error::{Error, Result};
use crate::layout::{
    Claim, Counter, Liveness, MEMBERSHIP_LOCK, STORE_CLOSED, STORE_LIVE, SlotState, WRITER_LOCK,
    WriterId, header, slot,
};
use crate::segment;

/// The membership lock, released when dropped.
struct Membership<'a>(&'a Shared);

impl<'a> Membership<'a> {
    fn take(shared: &'a Shared) -> Result<Membership<'a>> {
        shared.seg.lock_wait(MEMBERSHIP_LOCK)?;
        Ok(Membership(shared))
    }
}

impl Drop for Membership<'_> {
    fn drop(&mut self) {
        let _ = self.0.seg.unlock(MEMBERSHIP_LOCK);
    }
}

impl Shared {
    /// Slot `s`'s claim word (a writer slot), loaded with Acquire (pairs with the CASes that
    /// claim and free it).
    pub(super) fn writer_claim(&self, s: u32) -> Result<(u64, Claim)> {
        let word = self.writer_slot(s, slot::CLAIM)?.load(Ordering::Acquire);
        let claim = Claim::unpack(word)
            .ok_or_else(|| Error::Corrupt(format!("writer slot {s} has claim word {word:#x}")))?;
        Ok((word, claim))
    }

    /// Take a writer slot for this process: a free one, or one whose writer is gone (its lock
    /// is free, or in the pid fallback its process is gone). `None` if every slot has a live
    /// writer.
    pub(super) fn claim_writer_slot(&self) -> Result<Option<WriterId>> {
        let pid = segment::current_pid();
        for s in 0..self.layout.max_writers {
            let range = self.layout.writer_slot_lock(s);
            if self.liveness == Liveness::Locks && !self.seg.try_lock(range)? {
                continue;
            }
            // With the slot's lock held (or no locks at all) only we change the word.
            let (word, claim) = self.writer_claim(s)?;
            if self.liveness == Liveness::Pids
                && claim.is_occupied()
                && self.writer_alive(WriterId {
                    slot: s,
                    epoch: claim.epoch,
                })?
            {
                continue;
            }
            // Epoch 0 is never an occupant's: a zeroed pin word stamps nobody.
            let epoch = claim.epoch.wrapping_add(1).max(1);
            let mine = Claim {
                epoch,
                pid,
                state: SlotState::Claimed,
            };
            // AcqRel: pairs with the previous occupant's freeing CAS.
            if self
                .writer_slot(s, slot::CLAIM)?
                .compare_exchange(word, mine.pack(), Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                if self.liveness == Liveness::Locks {
                    self.seg.unlock(range)?;
                }
                continue;
            }
            if claim.is_occupied() {
                // Its writer died: what it counted is the store's now.
                self.fold_writer_counters(s)?;
                self.bump(Counter::WritersReclaimed, 1);
            }
            // A hazard word names a chunk, not an epoch: what a writer that died left in one
            // would count as ours from now on (holding its chunk, and our `close`, forever).
            // The slot is ours and we have begun nothing; a sweep that still sees a stale
            // word merely keeps that chunk one round longer.
            for h in 0..slot::HAZARDS {
                self.writer_slot(s, slot::HAZARD + 8 * h)?
                    .store(0, Ordering::SeqCst);
            }
            // A writer that died filing a key left its count in the slot's filing word: the
            // next holder of the index lock voids it and repairs what it half filed (here
            // us, unless another holder did already), before the word becomes ours.
            let me = WriterId { slot: s, epoch };
            if self.left_filing(s)? {
                drop(self.lock_index(me)?);
            }
            self.own_filing_word(me)?;
            let start = segment::process_start_time(pid).unwrap_or(0) & 0xffff_ffff;
            self.writer_slot(s, slot::START)?
                .store(((epoch as u64) << 32) | start, Ordering::Release);
            return Ok(Some(me));
        }
        Ok(None)
    }

    /// Join the store as one more writer (`Liveness::Locks` only): under the membership lock,
    /// refuse a store that is closed or has no live writer, take the shared writer lock and a
    /// writer slot.
    pub(super) fn join_writers(&self) -> Result<WriterId> {
        let _membership = Membership::take(self)?;
        let gone = |why: &str| Error::WriterGone(format!("{why} {:?}", self.seg.name()));
        if self.header(header::STORE_STATE)?.load(Ordering::Acquire) != STORE_LIVE {
            return Err(gone("the last writer closed the store"));
        }
        // Our shared lock first, then another writer's looked for: a last writer that dies
        // in between leaves the store to us, not to a sweep that finds no lock held.
        if !self.seg.try_lock_shared(WRITER_LOCK)? {
            return Err(Error::Corrupt(
                "someone holds the writers' shared lock exclusively".into(),
            ));
        }
        if !self.seg.lock_held_by_others(WRITER_LOCK)? {
            self.seg.unlock(WRITER_LOCK)?;
            return Err(gone("every writer has exited the store"));
        }
        match self.claim_writer_slot()? {
            Some(me) => Ok(me),
            None => {
                self.seg.unlock(WRITER_LOCK)?;
                Err(Error::NoWriterSlot(self.layout.max_writers))
            }
        }
    }

    /// Give writer slot `me` back and, if no other writer is left, close the store and
    /// unlink its segment (under the membership lock, so no joiner can slip in between).
    /// Returns whether this was the last writer.
    pub(super) fn leave_writers(&self, me: WriterId) -> Result<bool> {
        let locks = self.liveness == Liveness::Locks;
        let _membership = if locks {
            Some(Membership::take(self)?)
        } else {
            None
        };
        self.fold_writer_counters(me.slot)?;
        let claim_word = self.writer_slot(me.slot, slot::CLAIM)?;
        let _ = claim_word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            let claim = Claim::unpack(w)?;
            (claim.epoch == me.epoch).then(|| {
                Claim {
                    pid: 0,
                    state: SlotState::Free,
                    ..claim
                }
                .pack()
            })
        });
        let last = if locks {
            self.seg.unlock(self.layout.writer_slot_lock(me.slot))?;
            !self.seg.lock_held_by_others(WRITER_LOCK)?
        } else {
            true // the pid fallback has one writer
        };
        if last {
            // Release pairs with the readers' Acquire load in `Shared::any_writer_alive`.
            self.header(header::STORE_STATE)?
                .store(STORE_CLOSED, Ordering::Release);
            // Unlinked while our shared lock still shows the store live: a sweep cannot take
            // it for an orphan and remove it, and then we a successor made under its name.
            self.seg.unlink()?;
        }
        if locks {
            self.seg.unlock(WRITER_LOCK)?;
        }
        Ok(last)
    }
}
