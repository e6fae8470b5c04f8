//! The bytes of a segment: where every field lives (the store's counters in one table, the
//! parts of a payload at aligned offsets) and how a segment is validated.
//!
//! ```text
//! 0                      512            header_size                       total_len
//! | segment header ...   | reader table | data ring: chunks, 64-byte aligned ... |
//! ```
//!
//! Every field is a little-endian `u64` at a fixed offset, read and written only as an
//! `AtomicU64` (offsets, not pointers: each process maps the segment at its own address).
//! Fields marked *const* are written once by the creator before the segment's name is
//! handed to anyone and never change; readers still load them atomically.
//!
//! A chunk in the ring:
//!
//! ```text
//! +0  id          AtomicU64  monotonic id; 0 = dead. Published last (Release) by the
//!                            writer, after every other header field and the payload;
//!                            stored 0 before the bytes are reused (see `store`).
//! +8  sig_lo      AtomicU64  the handle signature, so a reader can tell its chunk from
//! +16 sig_hi      AtomicU64  payload bytes that later landed at the same address.
//! +24 len         AtomicU64  payload length in bytes.
//! +32 refs        AtomicU64  references issued over the chunk's life (for inspect).
//! +64 words[n]    AtomicU64  one `SlotWord` per reader slot (below).
//! +chunk_header_size         payload (64-byte aligned)
//! ```

use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::segment::{LockRange, Segment};

/// "MMCACHE\x01" — first word of every segment.
pub const MAGIC: u64 = u64::from_le_bytes(*b"MMCACHE\x01");
/// Bumped on any change to the byte layout below; attach refuses other versions.
pub const LAYOUT_VERSION: u64 = 2;
/// Alignment of chunks and of payload parts (a cache line; enough for any dtype).
pub const ALIGN: u64 = 64;
/// Most reader slots a segment may have (the reader table must fit its pages).
pub const MAX_READERS: u32 = 64;

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
    /// `WRITER_LIVE` until the writer closes (`WRITER_CLOSED`), Release/Acquire.
    pub const WRITER_STATE: u64 = 80;
    /// const: how liveness is told, `LIVENESS_LOCKS` or `LIVENESS_PIDS` (see `Liveness`).
    pub const LIVENESS: u64 = 88;
    /// The writer's published counters, one word each in [`Counter`](super::Counter) order
    /// (Relaxed: statistics only).
    pub const COUNTERS: u64 = 128;
    /// First reader slot; slot `i` is at `READER_TABLE + i * READER_SLOT_SIZE`.
    pub const READER_TABLE: u64 = 512;
    pub const READER_SLOT_SIZE: u64 = 64;
}

/// Declares [`Counter`] from one table: each counter's variant, the name `stats()` and
/// `inspect` report it under, and (by its position) its header word.
macro_rules! counters {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// The store's counters: what the writer tallies, publishes in the segment header
        /// (counter `c` at [`Counter::offset`]) and reports in `stats()`, and what `inspect`
        /// reads back — all from this one table.
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
    /// Objects stored by `put`.
    Puts => "puts",
    /// References issued by `get_cached`.
    Hits => "hits",
    /// Stored objects evicted to make room.
    Evictions => "evictions",
    /// Bytes of the ring that chunks cover (the ring's own count).
    BytesInUse => "bytes_in_use",
    /// Keys stored (the index's own count).
    Objects => "objects",
    /// References issued by `put` and `get_cached`.
    RefsIssued => "refs_issued",
    /// The id of the newest chunk (ids keep counting across `clear`).
    LastId => "last_id",
    /// Reader slots freed because their occupant died.
    ReadersReclaimed => "readers_reclaimed",
    /// Calls of `clear`.
    Clears => "clears",
}

impl Counter {
    /// How many counters there are.
    pub const COUNT: usize = Counter::ALL.len();

    /// The header word the writer publishes the counter in.
    pub const fn offset(self) -> u64 {
        header::COUNTERS + 8 * self as u64
    }
}

// Every counter's word lies in the header, before the reader table.
const _: () = assert!(header::COUNTERS + 8 * Counter::COUNT as u64 <= header::READER_TABLE);

pub const WRITER_LIVE: u64 = 1;
pub const WRITER_CLOSED: u64 = 2;

/// How the processes of a segment tell whether the others are alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// OFD locks (`segment::LockRange`): the writer holds [`WRITER_LOCK`] for the segment's
    /// life, each reader its slot's [`Layout::slot_lock`] while it occupies the slot. The
    /// kernel drops a lock when its holder dies, in whatever PID namespace.
    Locks,
    /// Fallback where the kernel has no OFD locks: pid + start time, which only work when
    /// every process shares one PID namespace.
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

/// The byte range the writer keeps locked while it lives (the magic word).
pub const WRITER_LOCK: LockRange = LockRange { start: 0, len: 8 };

/// Reader slot field offsets (relative to the slot). One cache line per reader.
pub mod slot {
    /// A `Claim` word: epoch, occupant pid and state, changed only by CAS. A reader claims a
    /// slot with one CAS to `(e + 1, pid, CLAIMED)`, so the pid is never an earlier
    /// occupant's; closing with live views makes it `DRAINING`; the last view (or the writer,
    /// for a dead occupant) makes it `FREE`. Epochs only grow, so a chunk word stamped for an
    /// earlier occupant can never be mistaken for the current one's.
    pub const CLAIM: u64 = 0;
    /// `epoch << 32 | start_time & 0xffff_ffff` of the occupant (pid reuse guard for the
    /// `Liveness::Pids` fallback); written after the claim, so it counts only when its epoch
    /// is the claim's.
    pub const START: u64 = 16;
    pub const REFS: u64 = 24; // references issued to this slot (writer, Relaxed)
    pub const ACKS: u64 = 32; // references acknowledged by this slot (reader; writer for released ones, Relaxed)
    pub const STALE: u64 = 40; // handles this slot found stale (reader, Relaxed)
}

/// Chunk header field offsets (relative to the chunk).
pub mod chunk {
    pub const ID: u64 = 0;
    pub const SIG_LO: u64 = 8;
    pub const SIG_HI: u64 = 16;
    pub const LEN: u64 = 24;
    pub const REFS: u64 = 32;
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

/// What a reader slot is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nobody occupies it.
    Free,
    /// A reader occupies it: the writer issues it a reference for every handle.
    Claimed,
    /// Its reader closed while zero-copy views were alive: the views stay protected, no new
    /// references are issued, unread ones no longer count; freed with the last view.
    Draining,
}

/// A reader slot's claim word: `epoch (32) | pid (30) | state (2)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    pub epoch: u32,
    pub pid: u32,
    pub state: SlotState,
}

impl Claim {
    const PID_MASK: u32 = (1 << 30) - 1;

    pub fn pack(self) -> u64 {
        let state = match self.state {
            SlotState::Free => 0,
            SlotState::Claimed => 1,
            SlotState::Draining => 2,
        };
        ((self.epoch as u64) << 32) | (((self.pid & Self::PID_MASK) as u64) << 2) | state
    }

    /// `None` for a state this build does not know (a corrupt word).
    pub fn unpack(word: u64) -> Option<Claim> {
        let state = match word & 3 {
            0 => SlotState::Free,
            1 => SlotState::Claimed,
            2 => SlotState::Draining,
            _ => return None,
        };
        Some(Claim {
            epoch: (word >> 32) as u32,
            pid: ((word >> 2) as u32) & Self::PID_MASK,
            state,
        })
    }

    pub fn is_occupied(self) -> bool {
        self.state != SlotState::Free
    }
}

/// One reader slot's state for one chunk, packed in a `u64` so it changes with one CAS:
///
/// * `stamp` (high 32 bits): the chunk's signature tag XOR the slot's epoch. A word whose
///   stamp is not the current occupant's owes that occupant nothing (the references were
///   issued to an earlier occupant, who is gone and so credited). Readers modify a word only
///   when its stamp matches: payload bytes that later land where a header was cannot be
///   mistaken for one (32 keyed bits).
/// * `outstanding` (20 bits, at most [`SlotWord::MAX_OUTSTANDING`]): references issued to this
///   slot not yet acknowledged. The writer refuses to issue one more (`Error::Saturated`)
///   rather than overflow; the cache then serves the item uncached.
/// * `views` (12 bits, at most [`SlotWord::MAX_VIEWS`]): zero-copy views this slot holds. A
///   reader past the limit reads a verified private copy instead of a view.
///
/// The chunk is reclaimable for this slot when the stamp is not the occupant's, or both
/// counts are zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotWord {
    pub stamp: u32,
    pub outstanding: u32,
    pub views: u32,
}

impl SlotWord {
    pub const MAX_OUTSTANDING: u32 = (1 << 20) - 1;
    pub const MAX_VIEWS: u32 = (1 << 12) - 1;

    pub fn stamp_for(tag: u32, epoch: u64) -> u32 {
        tag ^ (epoch as u32)
    }

    pub fn unpack(word: u64) -> SlotWord {
        SlotWord {
            stamp: (word >> 32) as u32,
            outstanding: ((word >> 12) as u32) & Self::MAX_OUTSTANDING,
            views: (word as u32) & Self::MAX_VIEWS,
        }
    }

    /// Counts above their maxima are a caller bug; they are masked, never spilled into the
    /// stamp.
    pub fn pack(self) -> u64 {
        ((self.stamp as u64) << 32)
            | (((self.outstanding & Self::MAX_OUTSTANDING) as u64) << 12)
            | (self.views & Self::MAX_VIEWS) as u64
    }
}

/// The geometry of one segment, derived from its creation arguments and stored in its
/// header; both sides compute every offset from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub header_size: u64,
    pub capacity: u64,
    pub n_readers: u32,
    pub max_object_size: u64,
    pub chunk_header_size: u64,
}

impl Layout {
    /// Validate creation arguments and derive the geometry (`capacity` is rounded up to a
    /// multiple of `ALIGN`).
    pub fn new(capacity: u64, n_readers: u32, max_object_size: Option<u64>) -> Result<Layout> {
        if capacity == 0 {
            return Err(Error::InvalidArgument("capacity must be positive".into()));
        }
        if n_readers == 0 || n_readers > MAX_READERS {
            return Err(Error::InvalidArgument(format!(
                "n_readers must be between 1 and {MAX_READERS}, got {n_readers}"
            )));
        }
        let too_big = || Error::InvalidArgument(format!("capacity {capacity} is too large"));
        let capacity = align_up(capacity).ok_or_else(too_big)?;
        let chunk_header_size =
            align_up(chunk::WORDS + 8 * n_readers as u64).ok_or_else(too_big)?;
        let table_end = header::READER_TABLE + header::READER_SLOT_SIZE * n_readers as u64;
        let header_size = table_end.div_ceil(4096) * 4096;
        header_size.checked_add(capacity).ok_or_else(too_big)?;
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
        Ok(Layout {
            header_size,
            capacity,
            n_readers,
            max_object_size,
            chunk_header_size,
        })
    }

    pub fn total_len(&self) -> u64 {
        self.header_size + self.capacity
    }

    pub fn slot_offset(&self, slot: u32) -> u64 {
        header::READER_TABLE + header::READER_SLOT_SIZE * slot as u64
    }

    /// The byte range a reader keeps locked while it occupies `slot` (`Liveness::Locks`).
    pub fn slot_lock(&self, slot: u32) -> LockRange {
        LockRange {
            start: self.slot_offset(slot),
            len: header::READER_SLOT_SIZE,
        }
    }

    /// Segment offset of the chunk at ring address `address`.
    pub fn chunk_offset(&self, address: u64) -> u64 {
        self.header_size + address
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
        len <= self.max_object_size
            && address
                .checked_add(self.chunk_header_size)
                .and_then(|p| p.checked_add(len))
                .is_some_and(|end| end <= self.capacity)
    }

    /// Write the const fields of a fresh segment (creator only, before it is shared).
    pub fn write(
        &self,
        seg: &Segment,
        creator_pid: u32,
        creator_start: u64,
        liveness: Liveness,
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
        ];
        for (offset, value) in fields {
            seg.atomic(offset)?.store(value, Ordering::Relaxed);
        }
        // Release: a process that observes WRITER_LIVE sees every field above.
        seg.atomic(header::WRITER_STATE)?
            .store(WRITER_LIVE, Ordering::Release);
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
        // Acquire pairs with the Release store of WRITER_STATE in `write`.
        let state = seg.atomic(header::WRITER_STATE)?.load(Ordering::Acquire);
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
        if state != WRITER_LIVE && state != WRITER_CLOSED {
            return Err(Error::Corrupt(format!("bad writer state {state}")));
        }
        let code = load(header::LIVENESS)?;
        let liveness = Liveness::from_code(code)
            .ok_or_else(|| Error::Corrupt(format!("bad liveness mode {code}")))?;
        let n_readers = u32::try_from(load(header::N_READERS)?)
            .map_err(|_| Error::Corrupt("n_readers out of range".into()))?;
        let max_object_size = load(header::MAX_OBJECT_SIZE)?;
        let expected = Layout::new(load(header::CAPACITY)?, n_readers, Some(max_object_size))
            .map_err(|e| Error::Corrupt(format!("inconsistent header ({e})")))?;
        if load(header::HEADER_SIZE)? != expected.header_size
            || max_object_size != expected.max_object_size
            || load(header::CHUNK_HEADER_SIZE)? != expected.chunk_header_size
            || load(header::CAPACITY)? != expected.capacity
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

    #[test]
    fn geometry_is_aligned_and_bounded() {
        let l = Layout::new(1000, 3, None).unwrap();
        assert_eq!(l.capacity, 1024);
        assert_eq!(l.chunk_header_size, 128);
        assert_eq!(l.header_size, 4096);
        assert_eq!(l.max_object_size, 1024 - 128);
        assert!(l.valid_chunk_address(0) && !l.valid_chunk_address(1));
        assert!(!l.valid_chunk_address(1024 - 64));
        assert!(l.valid_payload(0, 896) && !l.valid_payload(64, 896));
        assert!(Layout::new(0, 1, None).is_err());
        assert!(Layout::new(1 << 20, 0, None).is_err());
        assert!(Layout::new(1 << 20, MAX_READERS + 1, None).is_err());
        assert!(Layout::new(64, 1, None).is_err());
        let clamped = Layout::new(1 << 20, 1, Some(1 << 21)).unwrap();
        assert_eq!(clamped.max_object_size, (1 << 20) - 128);
        assert!(Layout::new(u64::MAX, 1, None).is_err());
    }

    fn scratch_segment(len: usize) -> Segment {
        let r = u32::from_le_bytes(crate::segment::random_bytes::<4>().unwrap());
        let name = format!("mmct_hdr_{}_{r:x}", crate::segment::current_pid());
        let seg = Segment::create(&name, len, WRITER_LOCK).unwrap();
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
            let good = Layout::new(8192, 2, None).unwrap();
            let seg = scratch_segment(good.total_len() as usize);
            good.write(&seg, 1, 1, Liveness::Locks).unwrap();
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
                header::MAX_OBJECT_SIZE, header::CHUNK_HEADER_SIZE,
            ]),
            delta in 1u64..u64::MAX,
        ) {
            let good = Layout::new(8192, 2, Some(4000)).unwrap();
            let seg = scratch_segment(good.total_len() as usize);
            good.write(&seg, 1, 1, Liveness::Locks).unwrap();
            let atomic = seg.atomic(field).unwrap();
            atomic.store(atomic.load(Ordering::Relaxed).wrapping_add(delta), Ordering::Relaxed);
            // MAX_OBJECT_SIZE may legitimately change to another valid value.
            match Layout::read(&seg) {
                Ok((l, _)) => prop_assert!(field == header::MAX_OBJECT_SIZE && l.max_object_size != 4000),
                Err(e) => prop_assert!(matches!(e, Error::Corrupt(_))),
            }
        }

        #[test]
        fn slot_words_round_trip(
            stamp: u32,
            outstanding in 0..=SlotWord::MAX_OUTSTANDING,
            views in 0..=SlotWord::MAX_VIEWS,
        ) {
            let w = SlotWord { stamp, outstanding, views };
            prop_assert_eq!(SlotWord::unpack(w.pack()), w);
        }

        #[test]
        fn claim_words_round_trip(epoch: u32, pid in 0u32..(1 << 30), state in 0u8..3) {
            let state = [SlotState::Free, SlotState::Claimed, SlotState::Draining][state as usize];
            let claim = Claim { epoch, pid, state };
            prop_assert_eq!(Claim::unpack(claim.pack()), Some(claim));
        }
    }
}
