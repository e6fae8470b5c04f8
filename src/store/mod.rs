//! The object store: one writer and up to `n_readers` readers over one segment.
//!
//! Each side of the protocol below has its file: `writer.rs` ([`Writer`]; what it may
//! reclaim in `writer/reclaim.rs`, its private bookkeeping in `writer/state.rs`), `reader.rs`
//! ([`Reader`], [`Lease`], [`View`]) and
//! `inspect.rs` (reading a segment without attaching: [`inspect`], [`list_segments`],
//! [`status`]). This file holds the protocol and what both sides share: [`ReaderInfo`] and
//! the accessors of the segment's words (`Shared`).
//!
//! # Protocol (each Acquire names the Release it pairs with)
//!
//! **Publication.** The writer fills a chunk's header fields, its per-slot words and its
//! payload with plain or Relaxed stores, then stores the chunk's `id` with **Release** (P1).
//! A reader loads `id` with **Acquire** (pairs with P1), so it sees the whole chunk.
//!
//! **References.** Every handle the writer issues adds one `outstanding` reference to the
//! word of every *claimed* reader slot (`layout::SlotWord`); the handle records which
//! reader set that was (`handle::Handle::reader_set`), so `release` gives back exactly those
//! references. A reader resolving a handle consumes one of *its own slot's* references with
//! a single CAS that also takes a view lease (`outstanding - 1, views + 1`, **AcqRel**, pairs
//! with the writer's Acquire loads in `holds`), reads, and drops the lease (`views - 1`,
//! Release) unless it hands out a zero-copy view. A reader can never consume another slot's
//! references, nor more than were issued to it, so a duplicated or replayed handle cannot
//! free an object that someone else still needs. A handle replayed to a reader that owes
//! nothing is read without any write to the segment and verified afterwards (seqlock,
//! below). Counts never overflow: the writer refuses a reference that would
//! (`Error::Saturated`), and a reader whose view count is full reads a verified copy.
//!
//! **Reclaim.** The writer evicts a chunk only when it is unpinned and, for every occupied
//! slot, the word is stamped for an earlier occupant or holds no view and (for a claimed,
//! not draining, slot) no reference (Acquire loads, pairing with the readers' AcqRel/Release
//! CASes). Only the writer issues references, so once that holds, no reader can start a new
//! lease on the chunk. Before reusing the bytes the writer stores `id = 0` and issues a
//! **Release fence** (P2).
//!
//! **Seqlock check for unprotected reads.** A reader without a lease copies the payload with
//! atomic loads (`Segment::read_into_racy`), issues an **Acquire fence** (pairs with P2) and
//! re-loads the id and signature words: if the writer reused any byte it copied, it sees the
//! change and reports the handle stale.
//!
//! **Slots.** A slot's claim word holds `(epoch, pid, state)` (`layout::Claim`). A reader
//! first takes the slot's OFD lock, then claims it with one CAS to `(epoch + 1, pid,
//! CLAIMED)` (AcqRel, pairs with the previous occupant's freeing CAS): a live occupant always
//! holds the lock, so liveness is never judged from an earlier occupant's pid, and a claim
//! whose holder died is reclaimable at once (the kernel dropped its lock). `close()` with
//! live views makes the slot `DRAINING` (no new references, unread ones stop counting); the
//! last view frees it. The writer frees the slot of an occupant whose lock is gone (or, in
//! the pid fallback, whose process is gone) with a CAS, which credits everything stamped
//! with its epoch.
//!
//! **Processes.** Every writer, reader and lease remembers the process it was made in
//! (`segment::Process`): in a forked child the writer refuses every operation, the reader
//! refuses to resolve, and inherited leases give nothing back (see `segment::fork`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::handle::MAC_LEN;
use crate::layout::{
    Claim, Layout, Liveness, SlotWord, WRITER_LIVE, WRITER_LOCK, chunk, header, slot,
};
use crate::segment::{self, Access, Segment};

mod inspect;
mod reader;
mod writer;

pub use inspect::{SegmentInfo, SlotInfo, Status, inspect, list_segments, remove_orphans, status};
pub use reader::{Lease, Reader, View};
pub use writer::Writer;

/// Everything a reader needs to attach (the Python `ReaderHandle`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReaderInfo {
    pub name: String,
    pub capacity: u64,
    pub n_readers: u32,
    pub max_object_size: u64,
    pub layout_version: u64,
    pub secret: [u8; 32],
}

/// Shared view of the segment used by both roles.
#[derive(Debug)]
struct Shared {
    seg: Arc<Segment>,
    layout: Layout,
    liveness: Liveness,
}

/// A reader slot that someone occupies, as loaded from its claim word.
#[derive(Clone, Copy, Debug)]
struct Occupant {
    slot: u32,
    claim: Claim,
    /// The claim word exactly as loaded, for CASes that must not act on a changed slot.
    word: u64,
}

impl Shared {
    fn header(&self, field: u64) -> Result<&AtomicU64> {
        self.seg.atomic(field)
    }

    fn slot(&self, index: u32, field: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.slot_offset(index) + field)
    }

    fn chunk(&self, address: u64, field: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.chunk_offset(address) + field)
    }

    fn word(&self, address: u64, slot_index: u32) -> Result<&AtomicU64> {
        self.chunk(address, chunk::WORDS + 8 * slot_index as u64)
    }

    fn payload_offset(&self, address: u64) -> u64 {
        self.layout.chunk_offset(address) + self.layout.chunk_header_size
    }

    /// The id and MAC words of the chunk at `address` equal the handle's. The id is loaded
    /// first, with Acquire: it pairs with P1 (the writer's Release store of the id), so the
    /// MAC words and everything the writer wrote before publishing the id are visible.
    fn chunk_matches(&self, address: u64, id: u64, mac: &[u8; MAC_LEN]) -> Result<bool> {
        let (lo, hi) = mac_words(mac);
        Ok(
            self.chunk(address, chunk::ID)?.load(Ordering::Acquire) == id
                && self.chunk(address, chunk::SIG_LO)?.load(Ordering::Relaxed) == lo
                && self.chunk(address, chunk::SIG_HI)?.load(Ordering::Relaxed) == hi,
        )
    }

    /// Slot `s`'s claim word, loaded with Acquire (pairs with the AcqRel/Release CASes that
    /// claim, drain and free slots).
    fn claim(&self, s: u32) -> Result<(u64, Claim)> {
        let word = self.slot(s, slot::CLAIM)?.load(Ordering::Acquire);
        let claim = Claim::unpack(word)
            .ok_or_else(|| Error::Corrupt(format!("reader slot {s} has claim word {word:#x}")))?;
        Ok((word, claim))
    }

    /// Every occupied (claimed or draining) slot.
    fn occupants(&self) -> Result<Vec<Occupant>> {
        let mut out = Vec::new();
        for s in 0..self.layout.n_readers {
            let (word, claim) = self.claim(s)?;
            if claim.is_occupied() {
                out.push(Occupant {
                    slot: s,
                    claim,
                    word,
                });
            }
        }
        Ok(out)
    }

    /// Whether the process occupying slot `s` (as `claim` says) is alive.
    fn occupant_alive(&self, s: u32, claim: Claim) -> Result<bool> {
        match self.liveness {
            Liveness::Locks => self.seg.lock_held(self.layout.slot_lock(s)),
            Liveness::Pids => {
                let start = self.slot(s, slot::START)?.load(Ordering::Acquire);
                // The start time counts only if it was written for this occupant.
                let start = if (start >> 32) as u32 == claim.epoch {
                    start & 0xffff_ffff
                } else {
                    0
                };
                Ok(claim.pid != 0 && segment::process_alive(claim.pid, start))
            }
        }
    }

    /// Whether the writer still runs (its lock is held, or its pid exists) and has not
    /// closed the segment.
    fn writer_alive(&self) -> Result<bool> {
        // Acquire pairs with the writer's Release store in `Writer::close`.
        if self.header(header::WRITER_STATE)?.load(Ordering::Acquire) != WRITER_LIVE {
            return Ok(false);
        }
        match self.liveness {
            Liveness::Locks => self.seg.lock_held(WRITER_LOCK),
            Liveness::Pids => {
                let pid = self.header(header::CREATOR_PID)?.load(Ordering::Relaxed);
                let start = self.header(header::CREATOR_START)?.load(Ordering::Relaxed);
                Ok(segment::process_alive(pid as u32, start))
            }
        }
    }
}

/// A chunk MAC as the two words the chunk header stores it in (`SIG_LO`, `SIG_HI`).
fn mac_words(mac: &[u8; MAC_LEN]) -> (u64, u64) {
    let mac = u128::from_le_bytes(*mac);
    (mac as u64, (mac >> 64) as u64)
}

/// Apply `f` to a slot word with a CAS loop; `f` returns `None` to leave it unchanged.
fn update_word(word: &AtomicU64, mut f: impl FnMut(SlotWord) -> Option<SlotWord>) -> bool {
    word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
        f(SlotWord::unpack(w)).map(SlotWord::pack)
    })
    .is_ok()
}

/// Store counters, as `stats()` reports them.
pub type Stats = Vec<(&'static str, u64)>;

/// An existing segment, its layout and liveness mode read and validated.
fn open_shared(name: &str, access: Access) -> Result<Shared> {
    let seg = Segment::open(name, access)?;
    let (layout, liveness) = Layout::read(&seg)?;
    Ok(Shared {
        seg: Arc::new(seg),
        layout,
        liveness,
    })
}

#[cfg(test)]
mod tests;
