//! The object store: up to `max_writers` writers and `n_readers` readers over one segment.
//!
//! Each concern has its file: `writer.rs` ([`Writer`]: creating, joining, closing and every
//! writer operation; its private bookkeeping in `writer/state.rs`), `index.rs` (the shared key
//! index), `ring.rs` (the shared allocator: blocks, CLOCK, eviction, repair), `lock.rs` (the
//! ring lock and the index lock), `gate.rs` (filing a new key without the index lock), `members.rs` (writer slots and liveness), `reader.rs`
//! ([`Reader`], [`Lease`], [`View`]), `inspect.rs` (reading a segment without attaching:
//! [`inspect`], [`list_segments`], [`status`]) and `crash.rs` (the crash points tests kill
//! writers at).
//! This file holds the protocol and what every side shares: [`ReaderInfo`], [`WriterInfo`]
//! and the accessors of the segment's words (`Shared`).
//!
//! # Protocol (each Acquire names the Release it pairs with)
//!
//! **Who changes what.** The *ring lock* (`lock.rs`) serializes every change to the ring's
//! blocks (their sizes and kinds), CLOCK's hand, the journal and `bytes_in_use` — but one: a
//! writer carves its own allocation buffer without it (B1 below). The *index lock* serializes
//! every change to the key index's buckets and move count and the gauges `objects`,
//! `claims` and `evictions` — but one: a writer files a new key without it, behind the
//! closed index gate that the lock's holder opens, and waits for filings to finish, before
//! it changes anything (G1 below); it is taken inside the ring lock (an eviction takes its chunks'
//! keys out of the index, then kills them), never around it. Without either: lookups (index
//! reads), ids (`last_id`, an atomic add), a hit's referenced bit, each writer's own pin word
//! in a chunk, the reader words (writers add references, readers consume them), each
//! writer's own counters in its slot, and filling a block a writer reserved. Payload copies
//! never happen under a lock: a put reserves its block under the ring lock (or carves it),
//! fills the block outside it, and takes the index lock to publish.
//!
//! **Buffers (B1).** A writer's allocation buffer is a block whose state word is
//! `BlockState::buffer_word(owner)`. Its owner carves a block from its front with a CAS of
//! that word to a plain reservation, writes the rest's header (Relaxed), then shrinks the
//! block onto it with a **Release** store of its size; a walker under the ring lock loads sizes
//! with **Acquire** (pairs with it), so one that sees the new size sees the rest's header.
//! A sweep takes a live writer's buffer back with a CAS of the same word to free: one of
//! the two CASes fails, and the block's size changes only after the owner's succeeds.
//! Before either CAS, each side changes the owner's carve word (`slot::CARVE`) with one
//! **SeqCst** RMW that reads the other's mark: the owner announces its carve and CASes only
//! if no sweep named its buffer taken; a sweep names it taken, and CASes, only if the owner
//! is not carving. The owner clears the word with **Release** after its CAS (a sweep's RMW
//! that reads the clear sees the CAS). So an owner never CASes a word in room a sweep freed
//! (where another object's payload may hold the same bytes).
//!
//! **Publication and the ring (B2).** A publication holds only the index lock, so a block a
//! ring-lock holder walks past may go from a writer's buffer to a carved reservation to
//! live while it looks: carved (its size shrunk with Release), filled, then published with
//! a **Release** store of its state. A walker loads the state with **Acquire** before the
//! size (pairs with it), so a block it sees live or evicting has its final size; the
//! allocator's sweep reads a block's size after its verdict. (A size read first could be
//! the whole buffer's, and judging the now-live chunk evictable with it would have the sweep
//! step over, and then free, the blocks carved after it: found by a test racing puts
//! against a full index, `store/tests/two_locks.rs`.)
//!
//! **Publication (P1).** A writer fills its reserved block (header fields, reader words,
//! payload, long key, metadata) with plain or Relaxed stores, then takes the key's bucket
//! (G1, or under the index lock), stores the chunk's `id` with **Release** (P1), marks it
//! LIVE and finishes the index entry (I1). A reader
//! loads `id` with **Acquire** (pairs with P1), so it sees the whole chunk.
//!
//! **Index (I1, I2).** A bucket's second word is its version: a unique id (a chunk's id, or
//! a claim's ticket from the same sequence) while it holds an entry, 0 while it is being
//! changed or empty. A writer changing a bucket stores 0 there, issues a **Release fence**
//! (I2), writes the head and the key slot, and stores the new id with **Release** (I1). A
//! lookup loads the second word with **Acquire** (pairs with I1), reads the head and compares
//! the key slot (atomic loads), issues an **Acquire fence** and loads the second word again:
//! the same nonzero id means it read one entry whole (had it read any byte of a later change,
//! the fence pairing with I2 would show it 0 or a newer id). So lookups take no lock.
//!
//! **The gate (G1).** A filer adds one to its writer slot's filing word (**SeqCst**), then
//! loads the index gate (**SeqCst**) and, if it is open, counts itself out and takes the
//! index lock instead. The lock's holder stores 1 in the gate (**SeqCst**), then loads every
//! writer's filing word (**SeqCst**) until none counts a filing. In the single order of
//! SeqCst operations one comes first: the filer sees the gate open, or the holder sees the
//! filing and waits. A filer takes an empty bucket with an **AcqRel** CAS of its head (its
//! version is already 0: the Acquire pairs with the remover's Release store of `Empty`),
//! issues the **Release fence** of I2, and finishes with I1; it counts itself out with a
//! **Release** subtraction, which the holder's load pairs with. The holder closes the gate
//! with a **Release** store before giving the lock back (a filer's SeqCst load of it pairs).
//!
//! **Protection (S1, S2).** A writer that adds anything to a chunk it found through the
//! index (references, a pin, a private copy) first names the chunk's id in one of its own
//! hazard words (`layout::slot::HAZARD`, a **SeqCst** CAS of a free word, S1), then checks that
//! the chunk is still LIVE with that id (**SeqCst** loads). The evictor first marks the chunk
//! EVICTING (**SeqCst** CAS, S2), then loads every live writer's hazard words (**SeqCst**). In
//! the single order of SeqCst operations one comes first: the writer sees EVICTING and backs
//! off, or the evictor sees the hazard and keeps the chunk. While protected, a chunk's words
//! are that chunk's (it cannot be reused), so writers may add references and pins to it; no
//! writer ever modifies a chunk word it has not checked under protection (a stale index entry
//! may name an address that now lies inside another block). A hazard is cleared with a
//! **Release** store after the references it covered were added, so an evictor that sees it
//! clear (SeqCst) also sees them.
//!
//! **References.** Every handle a writer issues adds one `outstanding` reference to the word
//! of every *claimed* reader slot (`layout::SlotWord`), under protection; the handle records
//! which reader set that was (`handle::Handle::reader_set`), so that writer's `release` gives
//! back exactly those references. A reader resolving a handle consumes one of *its own
//! slot's* references with a single CAS that also takes a view lease (`outstanding - 1,
//! views + 1`, **AcqRel**, pairs with the evictor's Acquire loads), reads, and drops the lease
//! (`views - 1`, Release) unless it hands out a zero-copy view. A reader can never consume
//! another slot's references, nor more than were issued to it, so a duplicated or replayed
//! handle cannot free an object that someone else still needs. Counts never overflow: a
//! writer refuses a reference that would (`Error::Saturated`), and a reader whose view count
//! is full reads a verified copy.
//!
//! **Reclaim (P2, P3).** Under the ring lock, the evictor evicts a chunk only when, after marking
//! it EVICTING (S2), no live writer's hazard names it nor (while it is keyed) pins it, and for every
//! occupied reader slot the word is stamped for an earlier occupant or holds no view and (for
//! a claimed, not draining, slot) no reference. The reader slots' claim words are loaded then,
//! after the hazards, never earlier in the sweep: a reader may attach meanwhile and be issued a
//! reference by a hit, whose writer loaded its claim word before clearing the hazard (Release;
//! the evictor's SeqCst load that saw the hazard clear sees the attach too). It takes the chunk out of the index, stores
//! `id = 0`, and issues a **Release fence** (P2) before any of its bytes change. A writer that
//! later fills those bytes took the ring lock after the evictor released it, and issues its own
//! **Release fence** (P3) before filling, so P2's guarantee carries over to its writes.
//!
//! **Seqlock check for unprotected reads.** A reader (or writer) without a lease or
//! protection copies with atomic loads (`Segment::read_into_racy`), issues an **Acquire
//! fence** (pairs with P2/P3) and re-loads the id and signature words: if any byte it copied
//! was reused, it sees the change and reports the handle stale.
//!
//! **Slots.** A reader or writer slot's claim word holds `(epoch, pid, state)`
//! (`layout::Claim`). An occupant first takes the slot's OFD lock, then claims it with one CAS
//! to `(epoch + 1, pid, CLAIMED)` (AcqRel, pairs with the previous occupant's freeing CAS): a
//! live occupant always holds the lock, so liveness is never judged from an earlier
//! occupant's pid, and a claim whose holder died is reclaimable at once (the kernel dropped
//! its lock). A writer's stamps (reservations, pins, hazards, claims, lock ownership)
//! carry its epoch, so they are void the moment its lock is gone or its slot's epoch moves
//! on. A reader's `close()` with live views makes its slot `DRAINING`; the last view frees it;
//! a writer frees the slot of a reader whose lock is gone (or, in the pid fallback, whose
//! process is gone) with a CAS, which credits everything stamped with its epoch.
//!
//! **Processes.** Every writer, reader and lease remembers the process it was made in
//! (`segment::Process`): in a forked child a writer refuses every operation, a reader refuses
//! to resolve, and inherited leases give nothing back (see `segment::fork`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::handle::{MAC_LEN, Signer};
use crate::layout::{
    Claim, Counter, Layout, Liveness, STORE_LIVE, SlotWord, WRITER_LOCK, WriterId, chunk, header,
    slot,
};
use crate::segment::{self, Access, Segment};

mod crash;
mod gate;
mod index;
mod inspect;
mod lock;
mod members;
mod reader;
mod ring;
mod stuck;
mod writer;

pub use crash::POINTS as CRASH_POINTS;
use inspect::wait_out_creation_grace;
pub use inspect::{
    SegmentInfo, SlotInfo, Status, WriterSlotInfo, inspect, list_segments, remove_if_orphaned,
    remove_orphans, status,
};
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

/// Everything a writer needs to join a store (the Python `WriterHandle`): the store's
/// geometry and its signing secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterInfo {
    pub name: String,
    pub capacity: u64,
    pub n_readers: u32,
    pub max_object_size: u64,
    pub max_writers: u32,
    pub layout_version: u64,
    pub secret: [u8; 32],
}

/// Shared view of the segment used by every role.
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

// The word accessors are inlined: each is a bounds check and an address (a call returned
// its result through memory, reloaded at once: a store-forwarding stall on the hit path).
impl Shared {
    #[inline]
    fn header(&self, field: u64) -> Result<&AtomicU64> {
        self.seg.atomic(field)
    }

    #[inline]
    fn slot(&self, index: u32, field: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.slot_offset(index) + field)
    }

    #[inline]
    fn writer_slot(&self, index: u32, field: u64) -> Result<&AtomicU64> {
        self.seg
            .atomic(self.layout.writer_slot_offset(index) + field)
    }

    #[inline]
    fn chunk(&self, address: u64, field: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.chunk_offset(address) + field)
    }

    /// Reader slot `slot_index`'s word on the chunk at `address`.
    #[inline]
    fn word(&self, address: u64, slot_index: u32) -> Result<&AtomicU64> {
        self.chunk(address, chunk::WORDS + 8 * slot_index as u64)
    }

    /// Writer slot `writer_slot`'s pin word on the chunk at `address`.
    #[inline]
    fn pin_word(&self, address: u64, writer_slot: u32) -> Result<&AtomicU64> {
        self.chunk(address, self.layout.pin_word(writer_slot))
    }

    /// `InvalidHandle` unless `signer`'s secret is the store's (a `role` handle of another
    /// store, e.g. a stale one whose name a new store took).
    fn check_secret(&self, signer: &Signer, role: &str) -> Result<()> {
        let stored = [
            self.header(header::VERIFIER)?.load(Ordering::Relaxed),
            self.header(header::VERIFIER + 8)?.load(Ordering::Relaxed),
        ];
        if stored != signer.verifier() {
            return Err(Error::InvalidHandle(format!(
                "the {role} handle's secret does not match store {:?}",
                self.seg.name()
            )));
        }
        Ok(())
    }

    fn payload_offset(&self, address: u64) -> u64 {
        self.layout.chunk_offset(address) + self.layout.chunk_header_size
    }

    /// Counter `c`'s header word (Relaxed: statistics and gauges).
    fn counter(&self, c: Counter) -> Result<&AtomicU64> {
        self.header(c.offset())
    }

    /// Count an event that happens outside the locks and rarely (statistics: never
    /// fails the operation it counts).
    fn bump(&self, c: Counter, by: u64) {
        if let Ok(word) = self.counter(c) {
            word.fetch_add(by, Ordering::Relaxed);
        }
    }

    /// Add `delta` to counter `c`, which changes only under the lock that guards it
    /// ([`Counter`]'s docs; so a load and a store suffice; wrapping, as a gauge may dip below
    /// zero only if a dead holder's update was lost, and the repairs recount those).
    fn adjust<G: lock::Guard>(&self, _lock: &G, c: Counter, delta: i64) -> Result<()> {
        debug_assert_eq!(G::INDEX, c.under_index_lock(), "{c:?} under the wrong lock");
        let word = self.counter(c)?;
        let value = word.load(Ordering::Relaxed).wrapping_add(delta as u64);
        word.store(value, Ordering::Relaxed);
        Ok(())
    }

    /// Counter `c`'s value: its header word, plus every writer slot's for a per-writer one.
    fn counter_value(&self, c: Counter) -> Result<u64> {
        let mut value = self.counter(c)?.load(Ordering::Relaxed);
        if let Some(field) = c.writer_field() {
            for s in 0..self.layout.max_writers {
                value = value.wrapping_add(self.writer_slot(s, field)?.load(Ordering::Relaxed));
            }
        }
        Ok(value)
    }

    /// Fold what writer slot `s` counted into the header words and zero it (its writer left,
    /// or died and its slot is being taken over).
    fn fold_writer_counters(&self, s: u32) -> Result<()> {
        for &c in Counter::ALL {
            if let Some(field) = c.writer_field() {
                let counted = self.writer_slot(s, field)?.swap(0, Ordering::Relaxed);
                self.counter(c)?.fetch_add(counted, Ordering::Relaxed);
            }
        }
        Ok(())
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

    /// Every occupied (claimed or draining) reader slot.
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

    /// Whether the process occupying reader slot `s` (as `claim` says) is alive.
    fn occupant_alive(&self, s: u32, claim: Claim) -> Result<bool> {
        match self.liveness {
            Liveness::Locks => self.seg.lock_held(self.layout.slot_lock(s)),
            Liveness::Pids => {
                let start = self.slot(s, slot::START)?.load(Ordering::Acquire);
                Ok(pid_alive(claim, start))
            }
        }
    }

    /// Whether any writer still runs (one holds the shared writer lock, or the creator's pid
    /// exists) and the last one has not closed the store.
    fn any_writer_alive(&self) -> Result<bool> {
        // Acquire pairs with the last writer's Release store in `Writer::close`.
        if self.header(header::STORE_STATE)?.load(Ordering::Acquire) != STORE_LIVE {
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

    /// Whether `writer` still occupies its slot and lives (its epoch is the slot's, the slot
    /// is claimed, and its lock is held — or, in the pid fallback, its process runs).
    fn writer_alive(&self, writer: WriterId) -> Result<bool> {
        if writer.slot >= self.layout.max_writers {
            return Ok(false);
        }
        let word = self
            .writer_slot(writer.slot, slot::CLAIM)?
            .load(Ordering::Acquire);
        let Some(claim) = Claim::unpack(word) else {
            return Ok(false);
        };
        if claim.epoch != writer.epoch || !claim.is_occupied() {
            return Ok(false);
        }
        match self.liveness {
            Liveness::Locks => self
                .seg
                .lock_held(self.layout.writer_slot_lock(writer.slot)),
            Liveness::Pids => {
                let start = self
                    .writer_slot(writer.slot, slot::START)?
                    .load(Ordering::Acquire);
                Ok(pid_alive(claim, start))
            }
        }
    }
}

/// Whether the pid in `claim` runs, judged with the start time word of its slot (it counts
/// only if it was written for this occupant's epoch).
fn pid_alive(claim: Claim, start_word: u64) -> bool {
    let start = if (start_word >> 32) as u32 == claim.epoch {
        start_word & 0xffff_ffff
    } else {
        0
    };
    claim.pid != 0 && segment::process_alive(claim.pid, start)
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
    shared_over(seg)
}

/// `seg` with its layout and liveness mode read and validated.
fn shared_over(seg: Segment) -> Result<Shared> {
    let (layout, liveness) = Layout::read(&seg)?;
    Ok(Shared {
        seg: Arc::new(seg),
        layout,
        liveness,
    })
}

#[cfg(test)]
mod ring_tests;
#[cfg(test)]
mod tests;
