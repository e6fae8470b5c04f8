//! The bytes of a segment: where every field lives (the store's counters in one table, the
//! writers' and readers' slots, the key index, the parts of a payload at aligned offsets) and
//! how a segment is validated. The packed words themselves are in [`words`].
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

use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::segment::{LockRange, Segment};

mod words;

pub use words::{
    BlockKind, BlockState, Bucket, Claim, KeyRef, LockWord, PinWord, SlotState, SlotWord, WriterId,
};

/// "MMCACHE\x01" — first word of every segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"MMCACHE\x01");
/// Bumped on any change to the byte layout below; attach refuses other versions. Version 3:
/// several writers (writer table, shared key index, allocator and counters in the segment).
pub const LAYOUT_VERSION: u64 = 3;
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
    /// The key index's move count (a seqlock, on a cache line of its own): odd while the
    /// store lock's holder moves entries back to close the gap a removed one left; a lookup
    /// that misses checks it did not miss because of a move.
    pub const INDEX_MOVES: u64 = 320;
    /// The store lock (`words::LockWord`), on one cache line with the hand, the journal and
    /// the gauges it guards (the first counters).
    pub const LOCK: u64 = 384;
    /// CLOCK's hand: the ring address of the block the next allocation starts at (always a
    /// block start).
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
    /// Bytes of the ring that chunks (published or reserved) cover.
    BytesInUse => "bytes_in_use",
    /// Keys stored (live index entries).
    Objects => "objects",
    /// The id of the newest chunk or claim (ids keep counting across `clear`).
    LastId => "last_id",
    /// Keys claimed (single flight) and not yet put, unclaimed or dropped.
    Claims => "claims",
    /// Stored objects evicted to make room.
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

// Every counter's word lies in the header, before the reader table; the gauges changed under
// the store lock share the lock's cache line.
const _: () = assert!(header::COUNTERS + 8 * Counter::COUNT as u64 <= header::READER_TABLE);
const _: () = assert!(Counter::Claims.offset() < header::LOCK + 64);

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
    pub const ACKS: u64 = 32; // (readers) acknowledged by this slot, or released by a writer (Relaxed)
    pub const STALE: u64 = 40; // (readers) handles this slot found stale (Relaxed)
    // (writers) what the occupant counted (`Counter::writer_field`), folded into the header
    // word when it leaves or its slot is taken over. Only the occupant's threads write them,
    // under its private mutex (Relaxed load and store).
    pub const PUTS: u64 = 24;
    pub const HITS: u64 = 32;
    pub const REFS_ISSUED: u64 = 40;
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
    pub const BUCKET: u64 = 56;
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

/// What a store is created with (everything else is derived in [`Layout::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Bytes of the ring (rounded up to [`ALIGN`]).
    pub capacity: u64,
    pub n_readers: u32,
    /// Largest payload; `None`: what the ring can hold (a larger limit is clamped to it).
    pub max_object_size: Option<u64>,
    /// How many writer processes may be joined at once (the creator included).
    pub max_writers: u32,
    /// How many objects (and claims) the key index holds; `None`: sized from the capacity
    /// (see [`Layout::new`]). A larger number than the ring could ever hold is clamped.
    pub max_objects: Option<u64>,
}

impl Config {
    /// One writer, the index sized from the capacity.
    pub fn new(capacity: u64, n_readers: u32, max_object_size: Option<u64>) -> Config {
        Config {
            capacity,
            n_readers,
            max_object_size,
            max_writers: 1,
            max_objects: None,
        }
    }
}

/// The geometry of one segment, derived from its creation arguments and stored in its
/// header; every process computes every offset from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub header_size: u64,
    pub capacity: u64,
    pub n_readers: u32,
    pub max_object_size: u64,
    pub chunk_header_size: u64,
    pub max_writers: u32,
    /// Objects plus claims the index holds at most; beyond it a put evicts (CLOCK) first.
    pub max_objects: u64,
    /// Index buckets: a power of two, at least twice `max_objects` (probes stay short).
    pub index_buckets: u64,
}

impl Layout {
    /// Validate creation arguments and derive the geometry.
    ///
    /// The index is sized for `max_objects`, by default one per 16 KiB of ring but at least
    /// 4096, and never more than the ring could ever hold (`capacity / chunk_header_size`):
    /// items of tensors are far larger than 16 KiB, and a ring of small objects evicts the
    /// oldest (CLOCK) to stay within it. It costs 88 bytes a bucket (head and version, hash,
    /// a 64-byte key slot), two buckets an object: 11 MiB for a 1 GiB ring, 704 KiB for 4096.
    pub fn new(config: &Config) -> Result<Layout> {
        let Config {
            capacity,
            n_readers,
            max_object_size,
            max_writers,
            max_objects,
        } = *config;
        if capacity == 0 {
            return Err(Error::InvalidArgument("capacity must be positive".into()));
        }
        if n_readers == 0 || n_readers > MAX_READERS {
            return Err(Error::InvalidArgument(format!(
                "n_readers must be between 1 and {MAX_READERS}, got {n_readers}"
            )));
        }
        if max_writers == 0 || max_writers > MAX_WRITERS {
            return Err(Error::InvalidArgument(format!(
                "max_writers must be between 1 and {MAX_WRITERS}, got {max_writers}"
            )));
        }
        let too_big = || {
            Error::InvalidArgument(format!(
                "capacity {capacity} is too large (at most {} bytes)",
                Bucket::MAX_ADDRESS + 1
            ))
        };
        let capacity = align_up(capacity)
            .filter(|&c| c <= Bucket::MAX_ADDRESS + 1)
            .ok_or_else(too_big)?;
        let chunk_header_size =
            align_up(chunk::WORDS + 8 * (n_readers + max_writers) as u64).ok_or_else(too_big)?;
        let largest = capacity.checked_sub(chunk_header_size).filter(|&n| n > 0).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "capacity {capacity} cannot hold even one chunk header ({chunk_header_size} bytes)"
            ))
        })?;
        let max_object_size = match max_object_size {
            None => largest,
            Some(0) => {
                return Err(Error::InvalidArgument(
                    "max_object_size must be positive".into(),
                ));
            }
            // A limit above what the ring can hold is no error: the ring is the limit then.
            Some(m) => m.min(largest),
        };
        let most_possible = (capacity / chunk_header_size).max(1);
        let max_objects = match max_objects {
            None => (capacity / (16 << 10)).max(4096).min(most_possible),
            Some(n) if n == 0 || n > MAX_OBJECTS => {
                return Err(Error::InvalidArgument(format!(
                    "max_objects must be between 1 and {MAX_OBJECTS}, got {n}"
                )));
            }
            Some(n) => n.min(most_possible),
        };
        let index_buckets = (2 * max_objects).next_power_of_two().max(64);
        let layout = Layout {
            header_size: 0,
            capacity,
            n_readers,
            max_object_size,
            chunk_header_size,
            max_writers,
            max_objects,
            index_buckets,
        };
        let index_end = layout.key_slot_offset(index_buckets);
        let header_size = index_end.div_ceil(4096) * 4096;
        header_size.checked_add(capacity).ok_or_else(too_big)?;
        Ok(Layout {
            header_size,
            ..layout
        })
    }

    pub fn total_len(&self) -> u64 {
        self.header_size + self.capacity
    }

    pub fn slot_offset(&self, slot: u32) -> u64 {
        header::READER_TABLE + header::SLOT_SIZE * slot as u64
    }

    /// The byte range a reader keeps locked while it occupies `slot` (`Liveness::Locks`).
    pub fn slot_lock(&self, slot: u32) -> LockRange {
        LockRange {
            start: self.slot_offset(slot),
            len: header::SLOT_SIZE,
        }
    }

    pub fn writer_slot_offset(&self, slot: u32) -> u64 {
        self.slot_offset(self.n_readers) + header::WRITER_SLOT_SIZE * slot as u64
    }

    /// The byte range a writer keeps locked while it occupies writer slot `slot`.
    pub fn writer_slot_lock(&self, slot: u32) -> LockRange {
        LockRange {
            start: self.writer_slot_offset(slot),
            len: header::WRITER_SLOT_SIZE,
        }
    }

    /// The head word of index bucket `bucket` (its version word follows it).
    pub fn bucket_offset(&self, bucket: u64) -> u64 {
        self.writer_slot_offset(self.max_writers) + 16 * bucket
    }

    /// The hash word of index bucket `bucket` (the key's hash, for moving it).
    pub fn bucket_hash_offset(&self, bucket: u64) -> u64 {
        self.bucket_offset(self.index_buckets) + 8 * bucket
    }

    /// The key slot of index bucket `bucket`.
    pub fn key_slot_offset(&self, bucket: u64) -> u64 {
        self.bucket_hash_offset(self.index_buckets) + KEY_SLOT_SIZE * bucket
    }

    /// Segment offset of the chunk at ring address `address`.
    pub fn chunk_offset(&self, address: u64) -> u64 {
        self.header_size + address
    }

    /// Offset, inside a chunk header, of writer slot `slot`'s pin word.
    pub fn pin_word(&self, slot: u32) -> u64 {
        chunk::WORDS + 8 * (self.n_readers + slot) as u64
    }

    /// Whether `address` can start a chunk whose header lies inside the ring.
    pub fn valid_chunk_address(&self, address: u64) -> bool {
        address % ALIGN == 0
            && address
                .checked_add(self.chunk_header_size)
                .is_some_and(|end| end <= self.capacity)
    }

    /// Whether a payload of `len` bytes at `address` fits inside the ring.
    pub fn valid_payload(&self, address: u64, len: u64) -> bool {
        len <= self.max_object_size && self.fits(address, len)
    }

    /// Whether `len` bytes after the header of a chunk at `address` lie inside the ring.
    pub fn fits(&self, address: u64, len: u64) -> bool {
        address
            .checked_add(self.chunk_header_size)
            .and_then(|p| p.checked_add(len))
            .is_some_and(|end| end <= self.capacity)
    }

    /// Write the const fields of a fresh segment and its ring as one free block (creator
    /// only, before it is shared). `verifier` is the store secret's MAC of a constant.
    pub fn write(
        &self,
        seg: &Segment,
        creator_pid: u32,
        creator_start: u64,
        liveness: Liveness,
        verifier: [u64; 2],
    ) -> Result<()> {
        let fields = [
            (header::MAGIC, MAGIC),
            (header::VERSION, LAYOUT_VERSION),
            (header::HEADER_SIZE, self.header_size),
            (header::CAPACITY, self.capacity),
            (header::TOTAL_LEN, self.total_len()),
            (header::N_READERS, self.n_readers as u64),
            (header::MAX_OBJECT_SIZE, self.max_object_size),
            (header::CHUNK_HEADER_SIZE, self.chunk_header_size),
            (header::CREATOR_PID, creator_pid as u64),
            (header::CREATOR_START, creator_start),
            (header::LIVENESS, liveness.code()),
            (header::MAX_WRITERS, self.max_writers as u64),
            (header::MAX_OBJECTS, self.max_objects),
            (header::INDEX_BUCKETS, self.index_buckets),
            (header::VERIFIER, verifier[0]),
            (header::VERIFIER + 8, verifier[1]),
            // The whole ring is one free block (the pages are zero: state FREE, id 0).
            (self.chunk_offset(0) + chunk::SIZE, self.capacity),
        ];
        for (offset, value) in fields {
            seg.atomic(offset)?.store(value, Ordering::Relaxed);
        }
        // Release: a process that observes STORE_LIVE sees every field above.
        seg.atomic(header::STORE_STATE)?
            .store(STORE_LIVE, Ordering::Release);
        Ok(())
    }

    /// Read and validate a segment's header: its geometry and its liveness mode. Every field
    /// is loaded once and checked for consistency with checked arithmetic, so a corrupt or
    /// foreign segment is an error, never a wild offset; callers use the values returned
    /// here, never a second load of a word another process may change meanwhile.
    pub fn read(seg: &Segment) -> Result<(Layout, Liveness)> {
        if (seg.len() as u64) < header::READER_TABLE {
            return Err(Error::Corrupt(format!(
                "segment is {} bytes, smaller than a header",
                seg.len()
            )));
        }
        // Acquire pairs with the Release store of STORE_STATE in `write`.
        let state = seg.atomic(header::STORE_STATE)?.load(Ordering::Acquire);
        let load = |offset: u64| -> Result<u64> { Ok(seg.atomic(offset)?.load(Ordering::Relaxed)) };
        let magic = load(header::MAGIC)?;
        if magic != MAGIC {
            return Err(Error::Corrupt(format!("bad magic {magic:#018x}")));
        }
        let version = load(header::VERSION)?;
        if version != LAYOUT_VERSION {
            return Err(Error::Corrupt(format!(
                "layout version {version}, this build reads version {LAYOUT_VERSION}"
            )));
        }
        if state != STORE_LIVE && state != STORE_CLOSED {
            return Err(Error::Corrupt(format!("bad store state {state}")));
        }
        let code = load(header::LIVENESS)?;
        let liveness = Liveness::from_code(code)
            .ok_or_else(|| Error::Corrupt(format!("bad liveness mode {code}")))?;
        let small = |field: u64, what: &str| -> Result<u32> {
            u32::try_from(load(field)?).map_err(|_| Error::Corrupt(format!("{what} out of range")))
        };
        let max_object_size = load(header::MAX_OBJECT_SIZE)?;
        let max_objects = load(header::MAX_OBJECTS)?;
        let expected = Layout::new(&Config {
            capacity: load(header::CAPACITY)?,
            n_readers: small(header::N_READERS, "n_readers")?,
            max_object_size: Some(max_object_size),
            max_writers: small(header::MAX_WRITERS, "max_writers")?,
            max_objects: Some(max_objects),
        })
        .map_err(|e| Error::Corrupt(format!("inconsistent header ({e})")))?;
        if load(header::HEADER_SIZE)? != expected.header_size
            || max_object_size != expected.max_object_size
            || max_objects != expected.max_objects
            || load(header::CHUNK_HEADER_SIZE)? != expected.chunk_header_size
            || load(header::CAPACITY)? != expected.capacity
            || load(header::INDEX_BUCKETS)? != expected.index_buckets
            || load(header::TOTAL_LEN)? != expected.total_len()
        {
            return Err(Error::Corrupt("header sizes are inconsistent".into()));
        }
        if expected.total_len() != seg.len() as u64 {
            return Err(Error::Corrupt(format!(
                "header says {} bytes but the segment is {} bytes",
                expected.total_len(),
                seg.len()
            )));
        }
        Ok((expected, liveness))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(capacity: u64, n_readers: u32, max_object_size: Option<u64>) -> Result<Layout> {
        Layout::new(&Config::new(capacity, n_readers, max_object_size))
    }

    #[test]
    fn geometry_is_aligned_and_bounded() {
        let l = layout(1000, 3, None).unwrap();
        assert_eq!(l.capacity, 1024);
        assert_eq!(l.chunk_header_size, 128);
        assert_eq!(l.header_size, 8192, "tables and a 64-bucket index");
        assert_eq!(l.max_object_size, 1024 - 128);
        assert_eq!((l.max_objects, l.index_buckets), (8, 64));
        assert!(l.valid_chunk_address(0) && !l.valid_chunk_address(1));
        assert!(!l.valid_chunk_address(1024 - 64));
        assert!(l.valid_payload(0, 896) && !l.valid_payload(64, 896));
        assert!(layout(0, 1, None).is_err());
        assert!(layout(1 << 20, 0, None).is_err());
        assert!(layout(1 << 20, MAX_READERS + 1, None).is_err());
        assert!(layout(64, 1, None).is_err());
        let clamped = layout(1 << 20, 1, Some(1 << 21)).unwrap();
        assert_eq!(clamped.max_object_size, (1 << 20) - 128);
        assert!(layout(u64::MAX, 1, None).is_err());
        assert!(
            layout(Bucket::MAX_ADDRESS + 2, 1, None).is_err(),
            "past 16 TiB"
        );
    }

    #[test]
    fn writers_and_the_index_have_their_own_tables() {
        let config = Config {
            max_writers: 4,
            max_objects: Some(1000),
            ..Config::new(1 << 20, 2, None)
        };
        let l = Layout::new(&config).unwrap();
        assert_eq!(l.chunk_header_size, 128, "64 + 8 * (2 readers + 4 writers)");
        assert_eq!(l.writer_slot_offset(0), l.slot_offset(2));
        assert_eq!(l.writer_slot_offset(1), l.slot_offset(2) + 128);
        assert_eq!(l.bucket_offset(0), l.writer_slot_offset(4));
        assert_eq!((l.max_objects, l.index_buckets), (1000, 2048));
        assert_eq!(l.bucket_hash_offset(0), l.bucket_offset(2048));
        assert_eq!(l.key_slot_offset(0), l.bucket_hash_offset(2048));
        assert!(l.key_slot_offset(2048) <= l.header_size && l.header_size % 4096 == 0);
        assert_eq!(l.pin_word(3), chunk::WORDS + 8 * 5);
        let big = Layout::new(&Config::new(1 << 30, 1, None)).unwrap();
        assert_eq!(big.max_objects, 1 << 16, "one per 16 KiB");
        let small = Layout::new(&Config::new(1 << 22, 1, None)).unwrap();
        assert_eq!(small.max_objects, 4096, "at least 4096");
        let tiny = Layout::new(&Config {
            max_objects: Some(1 << 20),
            ..Config::new(4096, 1, None)
        })
        .unwrap();
        assert_eq!(
            tiny.max_objects, 32,
            "no more than the ring could ever hold"
        );
        for bad in [
            Config {
                max_writers: 0,
                ..config
            },
            Config {
                max_writers: MAX_WRITERS + 1,
                ..config
            },
            Config {
                max_objects: Some(0),
                ..config
            },
            Config {
                max_objects: Some(MAX_OBJECTS + 1),
                ..config
            },
        ] {
            assert!(
                matches!(Layout::new(&bad), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    fn scratch_segment(len: usize) -> Segment {
        let r = u32::from_le_bytes(crate::segment::random_bytes::<4>().unwrap());
        let name = format!("mmct_hdr_{}_{r:x}", crate::segment::current_pid());
        let seg = Segment::create(&name, len, WRITER_LOCK, len).unwrap();
        seg.unlink().unwrap(); // the mapping stays; nothing is left in /dev/shm
        seg
    }

    fn write_words(seg: &Segment, words: &[(u64, u64)]) {
        for &(offset, value) in words {
            seg.atomic(offset).unwrap().store(value, Ordering::Relaxed);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Fuzz target (stable-toolchain form; `fuzz/` has the libFuzzer one): random header
        /// words never panic `Layout::read`, and whatever it accepts is self-consistent and
        /// fits the segment.
        #[test]
        fn random_headers_are_refused_or_consistent(
            words in proptest::collection::vec((0u64..64, any::<u64>()), 0..24),
            keep_magic: bool,
        ) {
            let good = layout(8192, 2, None).unwrap();
            let seg = scratch_segment(good.total_len() as usize);
            good.write(&seg, 1, 1, Liveness::Locks, [0, 0]).unwrap();
            let words: Vec<(u64, u64)> = words.into_iter().map(|(i, v)| (i * 8, v)).collect();
            write_words(&seg, &words);
            if keep_magic {
                write_words(&seg, &[(header::MAGIC, MAGIC), (header::VERSION, LAYOUT_VERSION)]);
            }
            if let Ok((l, _)) = Layout::read(&seg) {
                prop_assert_eq!(l.total_len(), seg.len() as u64);
                prop_assert!(l.valid_payload(0, l.max_object_size));
                prop_assert!(l.n_readers >= 1 && l.n_readers <= MAX_READERS);
                prop_assert!(l.slot_offset(l.n_readers) <= l.header_size);
            }
        }

        /// A single changed size field is always caught.
        #[test]
        fn any_changed_size_field_is_refused(
            field in prop::sample::select(vec![
                header::HEADER_SIZE, header::CAPACITY, header::TOTAL_LEN, header::N_READERS,
                header::MAX_OBJECT_SIZE, header::CHUNK_HEADER_SIZE, header::MAX_WRITERS,
                header::MAX_OBJECTS, header::INDEX_BUCKETS,
            ]),
            delta in 1u64..u64::MAX,
        ) {
            let good = layout(8192, 2, Some(4000)).unwrap();
            let seg = scratch_segment(good.total_len() as usize);
            good.write(&seg, 1, 1, Liveness::Locks, [0, 0]).unwrap();
            let atomic = seg.atomic(field).unwrap();
            atomic.store(atomic.load(Ordering::Relaxed).wrapping_add(delta), Ordering::Relaxed);
            // MAX_OBJECT_SIZE and MAX_OBJECTS may legitimately change to other valid values
            // (of the same geometry).
            match Layout::read(&seg) {
                Ok((l, _)) => prop_assert!(
                    (field == header::MAX_OBJECT_SIZE && l.max_object_size != 4000)
                        || (field == header::MAX_OBJECTS && l.max_objects != good.max_objects)
                ),
                Err(e) => prop_assert!(matches!(e, Error::Corrupt(_))),
            }
        }
    }
}
