//! The bytes of a segment: where every field lives (the store's counters in one table, the
//! writers' and readers' slots, the key index, the parts of a payload at aligned offsets).
//! Where the tables and blocks lie for given creation arguments, and how a segment is
//! validated, is in `geometry` ([`Config`], [`Layout`]); the packed words themselves are in
//! `words`.
//!
//! ```text
//! 0        512            +64·n_readers  +128·max_writers                 header_size        total_len
//! | header | reader table | writer table | index heads, hashes, key slots | ring: blocks ... |
//! ```
//!
//! Every field is a little-endian `u64` at a fixed offset, read and written only as an
//! `AtomicU64` (offsets, not pointers: each process maps the segment at its own address).
//! Fields marked *const* are written once by the creator before the segment's name is
//! handed to anyone and never change; readers still load them atomically.
//!
//! The ring is tiled by *blocks*: each starts with a chunk header whose `SIZE` says where the
//! next one starts, so the blocks can be walked from address 0 to the capacity. A block is
//! free, reserved by a writer, or a chunk (`words::BlockState`):
//!
//! ```text
//! +0  id          AtomicU64  monotonic id; 0 = not readable. Published last (Release) by
//!                            the writer, after every other header field and the payload;
//!                            stored 0 before the bytes are reused (see `store`).
//! +8  sig_lo      AtomicU64  the chunk MAC, so a reader can tell its chunk from payload
//! +16 sig_hi      AtomicU64  bytes that later landed at the same address.
//! +24 len         AtomicU64  payload length in bytes.
//! +32 size        AtomicU64  the block's length (header, payload, long key and metadata,
//!                            rounded up to 64): where the next block starts. Writers only.
//! +40 state       AtomicU64  `words::BlockState`. Writers only.
//! +48 extra       AtomicU64  metadata length (high 32 bits) | long key length (low 32; 0
//!                            when the key fits its index key slot). Writers only.
//! +56 bucket      AtomicU64  the index bucket that names this chunk, plus one. Writers only.
//! +64 words[n]    AtomicU64  one `SlotWord` per reader slot.
//! +64+8n pins[w]  AtomicU64  one `PinWord` per writer slot (its pins). Writers only.
//! +chunk_header_size         payload (64-byte aligned), then the long key, then metadata
//! ```

use crate::segment::LockRange;

mod geometry;
mod words;

pub use geometry::{Config, Layout};
pub use words::{
    BlockKind, BlockState, Bucket, Claim, KeyRef, LockWord, PinWord, SlotState, SlotWord, WriterId,
};

/// "MMCACHE\x01" — first word of every segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"MMCACHE\x01");
/// Bumped on any change to the byte layout below; attach refuses other versions. Version 3:
/// several writers (writer table, shared key index, allocator and counters in the segment).
/// Version 4: the index key hash in two lanes (the same key files in another bucket).
/// Version 5: the store lock on a cache line of its own.
/// Version 6: the index lock beside it (the store lock became the ring lock), and a chunk's
/// key hash where its bucket number was.
/// Version 7: keys filed without the index lock (the index gate, each writer's filings).
/// Version 8: the hand's laps (a walk that gives the ring lock back between slices).
/// Version 9: each writer's carve word (a carve and a sweep taking its buffer back).
pub const LAYOUT_VERSION: u64 = 9;
/// Alignment of chunks and of payload parts (a cache line; enough for any dtype).
pub const ALIGN: u64 = 64;
/// Most reader slots a segment may have (the reader table must fit its pages).
pub const MAX_READERS: u32 = 64;
/// Most writer slots a segment may have (a slot number takes 6 bits in index words).
pub const MAX_WRITERS: u32 = 64;
/// Most objects the key index of one segment may be sized for.
pub const MAX_OBJECTS: u64 = 1 << 26;
/// Longest key (bytes).
pub const MAX_KEY_LEN: usize = 4096;
/// Largest metadata blob of one object (bytes).
pub const MAX_META_LEN: usize = 1 << 20;
/// Bytes of one index key slot.
pub const KEY_SLOT_SIZE: u64 = 64;

/// Segment header field offsets.
pub mod header {
    pub const MAGIC: u64 = 0; // const
    pub const VERSION: u64 = 8; // const
    pub const HEADER_SIZE: u64 = 16; // const: offset of the data ring
    pub const CAPACITY: u64 = 24; // const: bytes in the data ring
    pub const TOTAL_LEN: u64 = 32; // const: header_size + capacity
    pub const N_READERS: u64 = 40; // const
    pub const MAX_OBJECT_SIZE: u64 = 48; // const
    pub const CHUNK_HEADER_SIZE: u64 = 56; // const
    pub const CREATOR_PID: u64 = 64; // const
    pub const CREATOR_START: u64 = 72; // const: creator's start time (pid reuse guard)
    /// `STORE_LIVE` until the last writer closes the store (`STORE_CLOSED`),
    /// Release/Acquire.
    pub const STORE_STATE: u64 = 80;
    /// const: how liveness is told, `LIVENESS_LOCKS` or `LIVENESS_PIDS` (see `Liveness`).
    pub const LIVENESS: u64 = 88;
    pub const MAX_WRITERS: u64 = 96; // const
    pub const MAX_OBJECTS: u64 = 104; // const: what the key index is sized for
    pub const INDEX_BUCKETS: u64 = 112; // const: a power of two
    /// const: two words, a keyed MAC of a constant under the store's secret: a writer handle
    /// joins only if its secret gives the same (the secret itself is never stored).
    pub const VERIFIER: u64 = 128;
    /// The index lock (`words::LockWord`), alone on its cache line like the ring lock: it
    /// guards the key index's buckets and move count and the objects and claims gauges.
    pub const INDEX_LOCK: u64 = 192;
    /// The ring lock (`words::LockWord`), alone on its cache line: a writer waiting for it
    /// spins reading that line, and were the hand, the journal or the gauges on it, each of
    /// the holder's writes to them would first have to take the line back from the waiter.
    pub const LOCK: u64 = 256;
    /// The key index's move count (a seqlock, on a cache line of its own): odd while the
    /// index lock's holder moves entries back to close the gap a removed one left; a lookup
    /// that misses checks it did not miss because of a move.
    pub const INDEX_MOVES: u64 = 320;
    /// The index gate, on the move count's line (both change only under the index lock,
    /// and rarely): 1 while the index lock's holder may change the index, 0 otherwise. A
    /// writer files a new key without the lock only while it is 0 (`store/gate.rs`).
    pub const INDEX_GATE: u64 = 328;
    /// How many times CLOCK's hand passed the ring's end (under the ring lock; counted before
    /// the hand moves). With the hand, a position that only grows: allocations merge blocks
    /// only where the hand sweeps, so a walk that gave the ring lock back knows from it which
    /// of the block starts it saw may be gone (`ring::Walk`).
    pub const HAND_LAPS: u64 = 384;
    /// CLOCK's hand: the ring address of the block the next allocation starts at (always a
    /// block start). On one cache line with the journal and the gauges (the first counters),
    /// which the ring lock guards too (but for the index's gauges: see [`super::Counter`]).
    pub const HAND: u64 = 392;
    /// The window an allocation is evicting (start + 1, 0 when none) and its length, so
    /// that whoever takes the lock over from a holder that died can undo or finish it.
    pub const JOURNAL: u64 = 400;
    pub const JOURNAL_LEN: u64 = 408;
    /// The store's counters, one word each in [`Counter`](super::Counter) order (Relaxed:
    /// statistics and gauges).
    pub const COUNTERS: u64 = 416;
    /// First reader slot; slot `i` is at `READER_TABLE + i * SLOT_SIZE`. The writer table
    /// (slots of `WRITER_SLOT_SIZE`) follows the reader table (`Layout::writer_slot_offset`).
    pub const READER_TABLE: u64 = 512;
    pub const SLOT_SIZE: u64 = 64;
    /// A writer slot: its claim and counters, then its hazard words (a second cache line).
    pub const WRITER_SLOT_SIZE: u64 = 128;
}

/// Declares [`Counter`] from one table: each counter's variant, the name `stats()` and
/// `inspect` report it under, and (by its position) its header word.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// The store's counters: shared by every writer, kept in the segment header
        /// (counter `c` at [`Counter::offset`]), reported by `stats()` and `inspect` — all
        /// from this one table.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Counter {
            /// Every counter, in header order.
            pub const ALL: &[Counter] = &[$(Counter::$variant,)*];

            /// The name `stats()` and `inspect` report the counter under.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }
        }
    };
}

counters! {
    /// Bytes of the ring that chunks (published or reserved) cover (under the ring lock).
    BytesInUse => "bytes_in_use",
    /// Keys stored (live index entries; under the index lock).
    Objects => "objects",
    /// The id of the newest chunk or claim (ids keep counting across `clear`; drawn with an
    /// atomic add, under no lock).
    LastId => "last_id",
    /// Keys claimed (single flight) and not yet put, unclaimed or dropped (under the index
    /// lock).
    Claims => "claims",
    /// Stored objects evicted to make room (under the index lock).
    Evictions => "evictions",
    /// Calls of `clear`.
    Clears => "clears",
    /// Objects stored by `put`.
    Puts => "puts",
    /// References issued by `issue` (hits).
    Hits => "hits",
    /// References issued by `put` and `issue`.
    RefsIssued => "refs_issued",
    /// Reader slots freed because their occupant died.
    ReadersReclaimed => "readers_reclaimed",
    /// Writer slots taken over from a writer that died (by a join).
    WritersReclaimed => "writers_reclaimed",
}

impl Counter {
    /// How many counters there are.
    pub const COUNT: usize = Counter::ALL.len();

    /// Whether the index lock guards this counter (the index's gauges); the others that
    /// change under a lock change under the ring lock.
    pub const fn under_index_lock(self) -> bool {
        matches!(
            self,
            Counter::Objects | Counter::Claims | Counter::Evictions
        )
    }

    /// The header word of the counter (for a per-writer counter: what writers that left
    /// counted).
    pub const fn offset(self) -> u64 {
        header::COUNTERS + 8 * self as u64
    }

    /// For the counters each writer counts in its own slot (the hot ones: no write shared
    /// between writers, no atomic read-modify-write), the slot field; the store's value is
    /// the header word plus every writer slot's.
    pub const fn writer_field(self) -> Option<u64> {
        match self {
            Counter::Puts => Some(slot::PUTS),
            Counter::Hits => Some(slot::HITS),
            Counter::RefsIssued => Some(slot::REFS_ISSUED),
            _ => None,
        }
    }
}

// Every counter's word lies in the header, before the reader table; the gauges share the
// hand's cache line; each lock has one to itself.
const _: () = assert!(header::COUNTERS + 8 * Counter::COUNT as u64 <= header::READER_TABLE);
const _: () = assert!(Counter::Claims.offset() < header::HAND / 64 * 64 + 64);
const _: () = assert!(header::VERIFIER + 16 <= header::INDEX_LOCK);
const _: () = assert!(header::INDEX_LOCK % 64 == 0 && header::INDEX_LOCK + 64 <= header::LOCK);
const _: () = assert!(header::LOCK % 64 == 0);
const _: () = assert!(header::LOCK + 64 <= header::INDEX_MOVES);
const _: () = assert!(header::INDEX_GATE / 64 == header::INDEX_MOVES / 64);
const _: () = assert!(header::INDEX_GATE + 8 <= header::HAND / 64 * 64);
const _: () = assert!(header::HAND_LAPS / 64 == header::HAND / 64);

pub const STORE_LIVE: u64 = 1;
pub const STORE_CLOSED: u64 = 2;

/// How the processes of a segment tell whether the others are alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// OFD locks (`segment::LockRange`): every live writer holds a shared lock on
    /// [`WRITER_LOCK`] and an exclusive one on its writer slot, each reader one on its reader
    /// slot. The kernel drops a lock when its holder dies, in whatever PID namespace.
    Locks,
    /// Fallback where the kernel has no OFD locks (one writer only): pid + start time, which
    /// only work when every process shares one PID namespace.
    Pids,
}

pub const LIVENESS_LOCKS: u64 = 1;
pub const LIVENESS_PIDS: u64 = 2;

impl Liveness {
    pub fn code(self) -> u64 {
        match self {
            Liveness::Locks => LIVENESS_LOCKS,
            Liveness::Pids => LIVENESS_PIDS,
        }
    }

    pub fn from_code(code: u64) -> Option<Liveness> {
        match code {
            LIVENESS_LOCKS => Some(Liveness::Locks),
            LIVENESS_PIDS => Some(Liveness::Pids),
            _ => None,
        }
    }
}

/// The byte range every live writer keeps a shared lock on (the magic word): "is any writer
/// alive" is one lock test.
pub const WRITER_LOCK: LockRange = LockRange { start: 0, len: 8 };
/// The byte range a writer locks exclusively, briefly, to join or to leave the store: the
/// last writer's "am I the last" and its unlink are one step for every joiner.
pub const MEMBERSHIP_LOCK: LockRange = LockRange { start: 8, len: 8 };

/// Reader and writer slot field offsets (relative to the slot). One cache line per slot.
pub mod slot {
    /// A `Claim` word: epoch, occupant pid and state, changed only by CAS. An occupant claims
    /// a slot with one CAS to `(e + 1, pid, CLAIMED)`, so the pid is never an earlier
    /// occupant's; a reader closing with live views makes it `DRAINING`; the last view (or a
    /// writer, for a dead reader) makes it `FREE`. Epochs only grow, so a word stamped for an
    /// earlier occupant can never be mistaken for the current one's.
    pub const CLAIM: u64 = 0;
    /// `epoch << 32 | start_time & 0xffff_ffff` of the occupant (pid reuse guard for the
    /// `Liveness::Pids` fallback); written after the claim, so it counts only when its epoch
    /// is the claim's.
    pub const START: u64 = 16;
    pub const REFS: u64 = 24; // (readers) references issued to this slot (writers, Relaxed)
    /// (readers) references acknowledged by this slot, or released by a writer (each
    /// counted with Release after the reference left the chunk's word: `ring::Stuck`).
    pub const ACKS: u64 = 32;
    pub const STALE: u64 = 40; // (readers) handles this slot found stale (Relaxed)
    // (writers) what the occupant counted (`Counter::writer_field`), folded into the header
    // word when it leaves or its slot is taken over. Only the occupant's threads write them,
    // under its private mutex (Relaxed load and store).
    pub const PUTS: u64 = 24;
    pub const HITS: u64 = 32;
    pub const REFS_ISSUED: u64 = 40;
    /// (writers) `epoch << 32 | n`: `n` of the occupant's threads are filing a key without
    /// the index lock (`store/gate.rs`); the epoch tells whose they are once it is gone.
    pub const FILING: u64 = 48;
    /// (writers) The occupant's carves from its allocation buffer against the sweeps that
    /// take the buffer back (`Shared::carve_buffer`): [`CARVING`] from just before its CAS on
    /// the buffer's word to just after; else `address | TAKEN` once a sweep took back the
    /// buffer at `address` (a block start: [`ALIGN`](super::ALIGN)ed), marked before the
    /// sweep's CAS. Each side changes the word with one SeqCst RMW that reads the other's
    /// mark, so whichever comes second sees the first. 0 when the occupant starts a buffer
    /// (under the ring lock, which every sweep holds; a new occupant starts one before it
    /// carves, so what a dead one left counts for nothing).
    pub const CARVE: u64 = 56;
    pub const CARVING: u64 = 1;
    pub const TAKEN: u64 = 2;
    /// (writers) `HAZARDS` hazard words: the id of a chunk one of the occupant's operations
    /// holds (a hit adding references, a pin, a copy), 0 when unused. Taken with a SeqCst
    /// CAS before the chunk is checked; the evictor reads them (SeqCst) after marking a chunk
    /// EVICTING (S1/S2 in `store`).
    pub const HAZARD: u64 = 64;
    pub const HAZARDS: u64 = 8;
}

/// Chunk (block) header field offsets (relative to the block).
pub mod chunk {
    pub const ID: u64 = 0;
    pub const SIG_LO: u64 = 8;
    pub const SIG_HI: u64 = 16;
    pub const LEN: u64 = 24;
    pub const SIZE: u64 = 32;
    pub const STATE: u64 = 40;
    pub const EXTRA: u64 = 48;
    /// The key's index hash (where its probe starts), written when the chunk is published:
    /// an evictor finds the chunk's entry by it, whatever moves the index made meanwhile.
    pub const KEY_HASH: u64 = 56;
    pub const WORDS: u64 = 64;
}

pub const fn align_up(n: u64) -> Option<u64> {
    match n.checked_add(ALIGN - 1) {
        Some(v) => Some(v & !(ALIGN - 1)),
        None => None,
    }
}

/// Where each part of a payload starts (every part starts [`ALIGN`]ed, after the previous
/// one) and where the last one ends; `None` if that overflows a `u64`. Writer and codec
/// both place parts by this one rule.
pub fn part_offsets(lengths: impl IntoIterator<Item = u64>) -> Option<(Vec<u64>, u64)> {
    let mut offsets = Vec::new();
    let mut end = 0u64;
    for len in lengths {
        let start = align_up(end)?;
        offsets.push(start);
        end = start.checked_add(len)?;
    }
    Some((offsets, end))
}
