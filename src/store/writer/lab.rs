//! This writer's allocation buffer: a block reserved under the ring lock for several small
//! objects at once, which later puts carve their blocks from without taking the lock. A put
//! then takes one lock (the index lock, to publish) instead of two, and reserving for many
//! objects evicts their room in one go — what lets several writers put at once.
//!
//! The buffer is a reservation of this writer marked as a buffer
//! (`BlockState::buffer_word`): a sweep that meets it reclaims it if this writer died, and
//! takes it back (frees it) if not, so an idle writer's buffer never holds the ring or the
//! chunks just before it. The owner carves with a CAS on the buffer's word, the sweep frees
//! it with one: one of the two fails, and an owner that finds its buffer gone reserves
//! anew. Before either CAS the two meet in this writer's carve word
//! (`Shared::carve_buffer`), so the owner never CASes a word where its buffer was once a
//! sweep took it back: another object's bytes may be there. Each carve keeps the ring tiled
//! at every store (`Shared::carve_buffer`), so a writer killed in the middle leaves only
//! reservations of a dead writer. What is left goes back to the ring when a refill replaces
//! it, on this writer's `clear` and on its `close`; until then `bytes_in_use` counts it
//! (not `chunks_reserved`). It holds at most 1/16 of the ring per writer slot (and 256
//! KiB), and only objects up to a quarter of it are carved, so a small ring, or a large
//! object, is reserved exactly as before. A refill looks only near the hand; when it finds
//! no room there, or `/dev/shm` cannot hold a whole buffer, the object and the next
//! [`BACK_OFF`] small puts are reserved on their own.

use std::ops::Range;
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

#[cfg(test)]
use super::super::crash;
use super::super::lock::LockGuard;
use super::Writer;
use super::put::Reservation;
use crate::error::Result;
use crate::layout::ALIGN;

/// The most a buffer holds.
const MOST: u64 = 256 << 10;
/// Small puts reserved on their own after a refill found no room near the hand.
const BACK_OFF: u32 = 64;

/// What is left of the buffer: the block `[rest, end)`, reserved by this writer, and the ids
/// drawn for the objects still to be carved from it.
#[derive(Debug)]
pub(super) struct Lab {
    rest: u64,
    end: u64,
    ids: Range<u64>,
}

impl Writer {
    /// The size of the buffer an object of `size` bytes (a block) is to be carved from, or
    /// `None` when it is to be reserved on its own (a large object, a small ring, or one of
    /// the puts after a refill failed, which this counts down).
    pub(super) fn plan_lab(&self, size: u64) -> Option<u64> {
        let l = &self.shared.layout;
        let share = l.capacity / (16 * u64::from(l.max_writers));
        let buffer = MOST.min(share) / ALIGN * ALIGN;
        if size.saturating_mul(4) > buffer {
            return None;
        }
        let backing_off = self
            .lab_back_off
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        (!backing_off).then_some(buffer)
    }

    /// A refill found no room near the hand: reserve the next small puts on their own (a
    /// bounded sweep that fails costs a sweep, and the second chances of what it passed).
    pub(super) fn back_off_lab(&self) {
        self.lab_back_off.store(BACK_OFF, Ordering::Relaxed);
    }

    pub(super) fn lab(&self) -> MutexGuard<'_, Option<Lab>> {
        // Nothing in it is left half-changed by a panic: carry on with it.
        self.lab
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Carve a block of `size` bytes out of the buffer (its reservation evicted nothing), or
    /// `None` if the buffer lacks the room (or an id) for it. Takes no lock.
    pub(super) fn carve(&self, lab: &mut Option<Lab>, size: u64) -> Result<Option<Reservation>> {
        let Some(buffer) = lab.as_mut() else {
            return Ok(None);
        };
        let left = buffer.end - buffer.rest;
        if size > left || buffer.ids.is_empty() {
            return Ok(None);
        }
        let address = buffer.rest;
        #[cfg(test)]
        crash::hook::run(crash::hook::LAB_CARVE);
        if !self.shared.carve_buffer(address, left, size, self.me)? {
            *lab = None; // a sweep took it back
            return Ok(None);
        }
        let id = buffer.ids.start;
        buffer.ids.start += 1;
        buffer.rest += size;
        if buffer.rest == buffer.end {
            *lab = None;
        }
        Ok(Some(Reservation {
            address,
            id,
            evicted: Vec::new(),
        }))
    }

    /// Start a buffer at `address`, `len` bytes this writer just reserved (under the ring
    /// lock). Ids are drawn, with one atomic add, for as many blocks as it holds of the
    /// smallest with a payload; a buffer that runs out of ids first is refilled early.
    pub(super) fn start_lab(
        &self,
        lock: &LockGuard<'_>,
        lab: &mut Option<Lab>,
        address: u64,
        len: u64,
    ) -> Result<()> {
        let most_blocks = len / (self.shared.layout.chunk_header_size + ALIGN);
        self.shared.make_buffer(lock, address, self.me)?;
        *lab = Some(Lab {
            rest: address,
            end: address + len,
            ids: self.shared.next_ids(most_blocks)?,
        });
        Ok(())
    }

    /// Give what is left of the buffer back to the ring (under the ring lock).
    pub(super) fn return_lab(&self, lock: &LockGuard<'_>, lab: &mut Option<Lab>) -> Result<()> {
        if let Some(buffer) = lab.take() {
            // Unless a sweep took it back already: its room may be another object's since,
            // and the bytes at `rest` that object's payload, which a CAS must not touch.
            if !self.shared.buffer_taken(lock, buffer.rest, self.me)? {
                self.shared.free_buffer(lock, buffer.rest, self.me)?;
            }
        }
        Ok(())
    }
}
