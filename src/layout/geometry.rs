//! The geometry of one segment: what a store is created with ([`Config`]), what every
//! process derives from it ([`Layout`]: each table's and each block's offsets, checked
//! arithmetic), and how the header records it (`Layout::write`) and is validated
//! (`Layout::read`, which refuses any disagreement).

use std::sync::atomic::Ordering;

use super::{
    ALIGN, Bucket, KEY_SLOT_SIZE, LAYOUT_VERSION, Liveness, MAGIC, MAX_OBJECTS, MAX_READERS,
    MAX_WRITERS, STORE_CLOSED, STORE_LIVE, align_up, chunk, header,
};
use crate::error::{Error, Result};
use crate::segment::{LockRange, Segment};

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
            return Err(Layout::too_small(seg.len()));
        }
        // Acquire pairs with the Release store of STORE_STATE in `write`.
        let state = seg.atomic(header::STORE_STATE)?.load(Ordering::Acquire);
        Layout::parse(seg.len(), state, |offset| {
            Ok(seg.atomic(offset)?.load(Ordering::Relaxed))
        })
    }

    /// [`Layout::read`] of a header read as bytes (its first [`header::READER_TABLE`]) from a
    /// file of `len` bytes, not mapped.
    pub fn read_bytes(len: usize, bytes: &[u8]) -> Result<(Layout, Liveness)> {
        if (len as u64) < header::READER_TABLE || (bytes.len() as u64) < header::READER_TABLE {
            return Err(Layout::too_small(len));
        }
        let load = |offset: u64| -> Result<u64> {
            let at = offset as usize;
            let word = bytes
                .get(at..at + 8)
                .and_then(|w| <[u8; 8]>::try_from(w).ok())
                .ok_or_else(|| Error::Corrupt(format!("header word {offset} out of range")))?;
            Ok(u64::from_le_bytes(word))
        };
        Layout::parse(len, load(header::STORE_STATE)?, load)
    }

    fn too_small(len: usize) -> Error {
        Error::Corrupt(format!("segment is {len} bytes, smaller than a header"))
    }

    /// Validate the header of a segment of `len` bytes whose store state is `state`, its
    /// other words loaded by `load` (see [`Layout::read`]).
    fn parse(
        len: usize,
        state: u64,
        load: impl Fn(u64) -> Result<u64>,
    ) -> Result<(Layout, Liveness)> {
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
        if expected.total_len() != len as u64 {
            return Err(Error::Corrupt(format!(
                "header says {} bytes but the segment is {} bytes",
                expected.total_len(),
                len
            )));
        }
        Ok((expected, liveness))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::WRITER_LOCK;
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
