//! A walk over the ring's blocks that gives the ring lock back between slices ([`Walk`], for
//! `stats()`). Blocks merge only in a window the hand sweeps (a window starts where the hand
//! stands or past it, and the hand ends where the last one ends), and the hand counts its laps
//! (`header::HAND_LAPS`), so a walk that resumes knows whether the block start it stopped at
//! can have been merged away, and if so finds its way from a block start no merge can have
//! crossed.

use std::sync::atomic::Ordering;

use super::Block;
use crate::error::Result;
use crate::layout::header;
use crate::store::Shared;
use crate::store::lock::LockGuard;

/// Where CLOCK's hand stands: its laps of the ring and its address, a position that only
/// grows (read under the ring lock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HandAt {
    laps: u64,
    address: u64,
}

/// A walk over the ring's blocks from address 0 in slices, each under the ring lock, the lock
/// given back between two ([`Shared::walk_slice`]): every block it yields was a block when its
/// slice was walked, and a block start no merge has crossed since is never passed over.
#[derive(Debug, Default)]
pub(in crate::store) struct Walk {
    /// The block start the next slice begins at (as of the last slice).
    next: u64,
    /// Where the hand stood while the last slice was walked.
    hand: Option<HandAt>,
}

impl Shared {
    fn hand_at(&self, _lock: &LockGuard<'_>) -> Result<HandAt> {
        Ok(HandAt {
            laps: self.header(header::HAND_LAPS)?.load(Ordering::Relaxed),
            address: self.header(header::HAND)?.load(Ordering::Relaxed),
        })
    }

    /// The next slice of `walk`, at most `max` blocks (none once it reached the ring's end).
    pub(in crate::store) fn walk_slice(
        &self,
        lock: &LockGuard<'_>,
        walk: &mut Walk,
        max: usize,
    ) -> Result<Vec<Block>> {
        let hand = self.hand_at(lock)?;
        if let Some(then) = walk.hand {
            walk.next = self.resume_at(then, hand, walk.next)?;
        }
        walk.hand = Some(hand);
        let mut out = Vec::new();
        while walk.next < self.layout.capacity && out.len() < max {
            let block = self.block(walk.next)?;
            walk.next += block.size;
            out.push(block);
        }
        Ok(out)
    }

    /// Where a walk that stopped at the block start `next` while the hand stood at `then`
    /// resumes, the hand now at `now` (under the ring lock): `next` itself when no merge can
    /// have crossed it, else the first block start past it, found from a block start no merge
    /// can have crossed (0; the hand now; the hand then, if it has not lapped).
    fn resume_at(&self, then: HandAt, now: HandAt, next: u64) -> Result<u64> {
        let capacity = self.layout.capacity;
        if next >= capacity {
            return Ok(next);
        }
        // Every window merged since lies between the hand then and the end of the block it
        // stands on now (the last window's rest): `reach` bytes on from the hand then, or
        // `None` once that is a lap or more (any block start may be gone).
        let swept = match now.laps.wrapping_sub(then.laps) {
            0 if now.address >= then.address => Some(now.address - then.address),
            1 if now.address < then.address => Some(capacity - then.address + now.address),
            _ => None,
        };
        let reach = match swept {
            Some(swept) => Some(swept + self.block_size(now.address)?).filter(|&r| r <= capacity),
            None => None,
        };
        let ahead = if next >= then.address {
            next - then.address
        } else {
            capacity - then.address + next
        };
        let mut from = 0;
        if let Some(reach) = reach {
            // A window starts at the hand or past it: it never swallows where the hand stood.
            if ahead == 0 || ahead >= reach {
                return Ok(next);
            }
            if then.address <= next {
                from = then.address;
            }
        }
        if now.address <= next {
            from = from.max(now.address);
        }
        while from < next {
            from += self.block_size(from)?;
        }
        Ok(from)
    }
}
