//! Writers' allocation buffers in the ring (`store/writer/lab.rs` is the owner's side): a
//! buffer made, carved by its owner, taken back by a sweep, freed. The owner's carve and a
//! sweep's take-back meet in the owner's carve word (`slot::CARVE`) before either CASes the
//! buffer's state word, so an owner never CASes room a sweep freed (`Shared::carve_buffer`).

use std::sync::atomic::Ordering;

use crate::error::Result;
use crate::layout::{BlockKind, BlockState, Counter, WriterId, chunk, slot};
use crate::store::Shared;
use crate::store::crash;
use crate::store::lock::LockGuard;

impl Shared {
    /// Make the block at `address`, just reserved by `owner`, its allocation buffer.
    pub(in crate::store) fn make_buffer(
        &self,
        _lock: &LockGuard<'_>,
        address: u64,
        owner: WriterId,
    ) -> Result<()> {
        // No sweep has taken this one back, and no carve of `owner` is under way (its
        // buffer's mutex is held): its carve word starts afresh. Sweeps see it under the lock.
        self.writer_slot(owner.slot, slot::CARVE)?
            .store(0, Ordering::Relaxed);
        self.state_word(address)?
            .store(BlockState::buffer_word(owner), Ordering::Release);
        Ok(())
    }

    /// Carve `owner`'s allocation buffer at `address` (`len` bytes) into a block of its
    /// first `size` bytes, reserved by `owner`, and the rest, the buffer still: whether it
    /// could (`false`: a sweep took the buffer back). No ring lock: the owner takes the block
    /// with a CAS on the buffer's word (the sweep frees it with one), and each store after it
    /// keeps the ring tiled: the rest's header first, then the block shrinks onto it with
    /// Release (a walker under the lock reads sizes with Acquire, so one that sees the new
    /// size sees the rest's header).
    ///
    /// The CAS alone cannot tell the buffer from bytes that merely look like it: once taken
    /// back, the buffer's room may be merged and filled with another object, whose payload
    /// may hold the buffer's word where the buffer's state was. So the owner first announces
    /// the carve in its carve word (`slot::CARVE`), in the same RMW that reads whether a
    /// sweep took the buffer back, and CASes only if none did; a sweep marks the word before
    /// its CAS, in the RMW that reads the announcement, and leaves the buffer alone if it
    /// sees one ([`Shared::take_back_buffer`]).
    pub(in crate::store) fn carve_buffer(
        &self,
        address: u64,
        len: u64,
        size: u64,
        owner: WriterId,
    ) -> Result<bool> {
        let reserved = BlockState {
            kind: BlockKind::Reserved { owner },
            referenced: false,
            keyed: false,
        };
        let carve = self.writer_slot(owner.slot, slot::CARVE)?;
        // SeqCst RMW (both sides): the one of the two that comes second in the word's order
        // sees the other's mark, so a sweep that took this buffer back said so before this.
        // (A mark naming another address is stale: a block carved since, a buffer before.)
        let taken = carve.fetch_or(slot::CARVING, Ordering::SeqCst) == address | slot::TAKEN;
        crash::point("lab.announced");
        #[cfg(test)]
        crash::hook::run(crash::hook::LAB_ANNOUNCED);
        // Only a sweep's take-back changes the buffer's word meanwhile, and none may now.
        let carved = !taken && self.take_buffer(address, owner, reserved.pack())?;
        // Release: a sweep whose RMW reads this sees the CAS's word. No sweep marked the word
        // since the announcement. A mark naming this buffer stays: if the sweep that made it
        // died before it freed the buffer, `repair` frees it by that mark. Any other is done
        // with (it names a block carved since, or a buffer before this one).
        carve.store(
            if taken { address | slot::TAKEN } else { 0 },
            Ordering::Release,
        );
        if !carved {
            return Ok(false);
        }
        if size < len {
            let rest = address + size;
            self.chunk(rest, chunk::ID)?.store(0, Ordering::Relaxed);
            self.state_word(rest)?
                .store(BlockState::buffer_word(owner), Ordering::Relaxed);
            self.chunk(rest, chunk::SIZE)?
                .store(len - size, Ordering::Relaxed);
            crash::point("lab.split");
            self.set_size(address, size)?;
        }
        Ok(true)
    }

    /// Swap `owner`'s buffer word at `address` for `state`, in one CAS (the owner's carve and
    /// a sweep's take-back race on it): whether this side won (the block was the buffer).
    fn take_buffer(&self, address: u64, owner: WriterId, state: u64) -> Result<bool> {
        Ok(self
            .state_word(address)?
            .compare_exchange(
                BlockState::buffer_word(owner),
                state,
                Ordering::SeqCst,
                Ordering::Relaxed,
            )
            .is_ok())
    }

    /// Take a live writer's allocation buffer at `address` back (free it), for a sweep:
    /// whether it did. Its owner's carve word names it taken first (`slot::CARVE`,
    /// [`Shared::carve_buffer`]): the owner never carves from it after, whatever bytes fill
    /// its room then. An owner between its announcement and its CAS keeps it this time (a
    /// sweep does not wait under the ring lock for an owner that may be preempted).
    pub(super) fn take_back_buffer(
        &self,
        lock: &LockGuard<'_>,
        address: u64,
        owner: WriterId,
    ) -> Result<bool> {
        let marked = self.writer_slot(owner.slot, slot::CARVE)?.fetch_update(
            Ordering::SeqCst,
            Ordering::SeqCst,
            |word| (word & slot::CARVING == 0).then_some(address | slot::TAKEN),
        );
        if marked.is_err() {
            return Ok(false);
        }
        // Dead here, the buffer is left whole and marked: `repair` frees it by the mark.
        crash::point("alloc.buffer_marked");
        // `false`: the owner carved from it before the mark, which names a block start that
        // is its reservation now, never its buffer again.
        self.free_buffer(lock, address, owner)
    }

    /// Whether a sweep took `owner`'s buffer at `address` back: its mark names it
    /// ([`Shared::take_back_buffer`]). Asked by `owner` with its buffer's mutex and the ring
    /// lock held, so no carve of its own nor any sweep changes the word meanwhile. (A sweep
    /// that died after its mark and before its CAS left the buffer whole: the next holder of
    /// the ring lock frees it, in `repair`.)
    pub(in crate::store) fn buffer_taken(
        &self,
        _lock: &LockGuard<'_>,
        address: u64,
        owner: WriterId,
    ) -> Result<bool> {
        // Acquire: pairs with the sweep's SeqCst mark (one that died holding the lock too).
        let word = self.writer_slot(owner.slot, slot::CARVE)?;
        Ok(word.load(Ordering::Acquire) == address | slot::TAKEN)
    }

    /// Free `owner`'s allocation buffer at `address` if a sweep marked it taken (the dead
    /// holder's, between its mark and its CAS, [`Shared::take_back_buffer`]), for `repair`:
    /// whether it did. Its owner never carves from it after the mark, so it is nobody's; freed
    /// here, before any other sweep can mark another buffer of the owner's, the owner's one
    /// carve word names at most one buffer of its, the one it may still carve from.
    pub(super) fn free_marked_buffer(
        &self,
        lock: &LockGuard<'_>,
        address: u64,
        owner: WriterId,
    ) -> Result<bool> {
        Ok(self.buffer_taken(lock, address, owner)?
            && self.take_buffer(address, owner, BlockState::FREE.pack())?)
    }

    /// Free `owner`'s allocation buffer at `address` (given back by its owner, once it knows
    /// no sweep took it back, or taken back by a sweep): whether it was still the buffer (not
    /// carved from, nor taken back, since).
    pub(in crate::store) fn free_buffer(
        &self,
        lock: &LockGuard<'_>,
        address: u64,
        owner: WriterId,
    ) -> Result<bool> {
        if !self.take_buffer(address, owner, BlockState::FREE.pack())? {
            return Ok(false);
        }
        // Its size only now: once taken back, the bytes there may be another block's.
        let size = self.block_size(address)?;
        self.adjust(lock, Counter::BytesInUse, -(size as i64))?;
        Ok(true)
    }
}
