//! The packed words of a segment: each is one `u64` that changes with one atomic store or
//! CAS, so a process that dies between two of them never leaves one half-made.
//!
//! * [`Claim`]: a reader or writer slot's occupant (epoch, pid, state);
//! * [`SlotWord`]: one reader slot's references and views on one chunk;
//! * [`BlockState`]: what a block of the ring is (free, reserved by a writer, live, being
//!   evicted) and its CLOCK bits;
//! * [`PinWord`]: one writer slot's pins on one chunk;
//! * [`Bucket`]: the head word of one key-index bucket;
//! * [`LockWord`]: the ring lock's and the index lock's word, naming its holder.

/// A writer slot's current occupant: the slot and the epoch of its claim. Stamps made with
/// an earlier epoch are void (that occupant is gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WriterId {
    pub slot: u32,
    pub epoch: u32,
}

/// What a reader or writer slot is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nobody occupies it.
    Free,
    /// A reader or writer occupies it (a reader: the writers issue it a reference for every
    /// handle).
    Claimed,
    /// (Readers only.) Its reader closed while zero-copy views were alive: the views stay
    /// protected, no new references are issued, unread ones no longer count; freed with the
    /// last view.
    Draining,
}

/// A slot's claim word: `epoch (32) | pid (30) | state (2)`.
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
///   slot not yet acknowledged. A writer refuses to issue one more (`Error::Saturated`)
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

/// What a block of the ring is. Blocks tile the ring: each starts with a chunk header whose
/// `SIZE` word says how far the next one starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Nothing lives here; its id is 0. (A zeroed word is a free block.)
    Free,
    /// Allocated to `owner`, which fills it outside the ring lock; not readable (id 0 until
    /// published). Reclaimable once `owner` is gone.
    Reserved { owner: WriterId },
    /// A published chunk (readable by its handles).
    Live,
    /// A live chunk the ring lock's holder is deciding about, or evicting: a writer that
    /// finds it so after protecting the chunk backs off (see `store`'s protocol).
    Evicting,
}

/// A block's `STATE` word: kind, CLOCK's referenced bit, and whether the index files a key
/// under the chunk. Layout: `kind (2) | referenced (1) | keyed (1) | buffer (1) | 3 spare |
/// owner slot (8) | 16 spare | owner epoch (32)`. The buffer bit marks a reserved block as
/// what is left of its owner's allocation buffer ([`BlockState::buffer_word`]): unpacked, it
/// is a reservation like any other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockState {
    pub kind: BlockKind,
    /// Set by a hit, cleared when CLOCK's hand passes (second chance).
    pub referenced: bool,
    /// The index names this chunk (cleared when its key is evicted, invalidated, cleared).
    pub keyed: bool,
}

impl BlockState {
    pub const FREE: BlockState = BlockState {
        kind: BlockKind::Free,
        referenced: false,
        keyed: false,
    };
    pub const REFERENCED_BIT: u64 = 1 << 2;
    pub const KEYED_BIT: u64 = 1 << 3;
    pub const BUFFER_BIT: u64 = 1 << 4;

    /// The word of `owner`'s allocation buffer (the rest of it not yet carved): a
    /// reservation, but one a sweep may take back (free) while its owner lives, with a CAS on
    /// this exact word, as the owner carves from it with a CAS on it.
    pub fn buffer_word(owner: WriterId) -> u64 {
        BlockState {
            kind: BlockKind::Reserved { owner },
            referenced: false,
            keyed: false,
        }
        .pack()
            | Self::BUFFER_BIT
    }

    pub fn pack(self) -> u64 {
        let (kind, owner) = match self.kind {
            BlockKind::Free => (0, 0),
            BlockKind::Reserved { owner } => (
                1,
                ((owner.epoch as u64) << 32) | ((owner.slot as u64 & 0xff) << 8),
            ),
            BlockKind::Live => (2, 0),
            BlockKind::Evicting => (3, 0),
        };
        kind | owner | ((self.referenced as u64) << 2) | ((self.keyed as u64) << 3)
    }

    pub fn unpack(word: u64) -> BlockState {
        let kind = match word & 3 {
            0 => BlockKind::Free,
            1 => BlockKind::Reserved {
                owner: WriterId {
                    slot: ((word >> 8) & 0xff) as u32,
                    epoch: (word >> 32) as u32,
                },
            },
            2 => BlockKind::Live,
            _ => BlockKind::Evicting,
        };
        BlockState {
            kind,
            referenced: word & Self::REFERENCED_BIT != 0,
            keyed: word & (1 << 3) != 0,
        }
    }
}

/// One writer slot's word on one chunk: `epoch (32) | pins (32)`: how often this writer pinned
/// the chunk's key (`pin`/`unpin`, saturating). They count only while the chunk is keyed
/// (invalidating or clearing a key drops its pins without touching the word) and while
/// `epoch` is the slot's current, live occupant's: a dead writer's pins are void without
/// anyone touching the word. Changed only by its writer, while it holds the chunk (a hazard),
/// so the word is always that chunk's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinWord {
    pub epoch: u32,
    pub pins: u32,
}

impl PinWord {
    pub fn pack(self) -> u64 {
        ((self.epoch as u64) << 32) | self.pins as u64
    }

    pub fn unpack(word: u64) -> PinWord {
        PinWord {
            epoch: (word >> 32) as u32,
            pins: word as u32,
        }
    }

    /// The word as `epoch` sees it: pins stamped with another epoch are void (zero).
    pub fn for_epoch(self, epoch: u32) -> PinWord {
        if self.epoch == epoch {
            self
        } else {
            PinWord { epoch, pins: 0 }
        }
    }
}

/// The head word of one bucket of the key index: `kind (2) | key length (7) | tag (17) |
/// payload (38)`. The bucket's version word is the entry's unique id (the chunk's id, or the
/// claim's ticket); its hash word the key's hash; its key slot the key (inline, up to
/// [`Bucket::INLINE_KEY`] bytes) or, for a longer key, the key's BLAKE3 digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bucket {
    /// Holds nothing: a probe stops here.
    Empty,
    /// The key is stored in the chunk at `address`.
    Live { key: KeyRef, address: u64 },
    /// The key is claimed by `owner` (single flight): it computes the item.
    Claim { key: KeyRef, owner: WriterId },
}

/// What a bucket head says of its key: enough to skip most other keys without reading the
/// key slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRef {
    /// Bits of the key's hash that the bucket index does not use.
    pub tag: u32,
    /// The key's length if at most [`Bucket::INLINE_KEY`] (the key slot holds the key), else
    /// [`Bucket::LONG_KEY`] (the slot holds its BLAKE3 digest; the chunk holds the key).
    pub len: u8,
}

impl KeyRef {
    /// The reference of a key of `len` bytes whose hash is `hash`.
    pub fn new(hash: u64, len: usize) -> KeyRef {
        KeyRef {
            tag: (hash >> 40) as u32 & ((1 << Bucket::TAG_BITS) - 1),
            len: if len <= Bucket::INLINE_KEY as usize {
                len as u8
            } else {
                Bucket::LONG_KEY
            },
        }
    }

    pub fn is_long(self) -> bool {
        self.len == Bucket::LONG_KEY
    }
}

impl Bucket {
    pub const TAG_BITS: u32 = 17;
    /// Keys up to this long live in their bucket's key slot (content hashes as hex fit).
    pub const INLINE_KEY: u8 = 64;
    pub const LONG_KEY: u8 = 127;
    /// Chunk addresses are stored in 64-byte units in 38 bits: a ring of at most 16 TiB.
    pub const MAX_ADDRESS: u64 = (1 << 44) - 1;

    pub fn pack(self) -> u64 {
        let (kind, key, payload) = match self {
            Bucket::Empty => (0, KeyRef { tag: 0, len: 0 }, 0),
            Bucket::Live { key, address } => (1, key, address >> 6),
            Bucket::Claim { key, owner } => (
                2,
                key,
                ((owner.epoch as u64) << 6) | (owner.slot as u64 & 63),
            ),
        };
        kind | ((key.len as u64 & 127) << 2)
            | ((key.tag as u64 & ((1 << Self::TAG_BITS) - 1)) << 9)
            | (payload << 26)
    }

    pub fn unpack(word: u64) -> Bucket {
        let key = KeyRef {
            len: (word >> 2) as u8 & 127,
            tag: (word >> 9) as u32 & ((1 << Self::TAG_BITS) - 1),
        };
        let payload = word >> 26;
        match word & 3 {
            0 => Bucket::Empty,
            1 => Bucket::Live {
                key,
                address: payload << 6,
            },
            2 => Bucket::Claim {
                key,
                owner: WriterId {
                    slot: (payload & 63) as u32,
                    epoch: (payload >> 6) as u32,
                },
            },
            // Kind 3 is no bucket this build writes (a corrupt head): nothing is filed there.
            _ => Bucket::Empty,
        }
    }
}

/// A lock's word (the ring lock's or the index lock's). Its low 32 bits are the futex word:
/// 0 when free, else `(holder slot + 1) << 2 | waiters << 1 | 1`; the high 32 bits are the
/// holder's epoch. A holder is named in the same CAS that takes the lock, so a waiter can
/// always tell whether the holder still lives (and take the lock over if not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockWord {
    pub holder: WriterId,
    /// Someone may be sleeping on the futex: the releaser must wake one.
    pub waiters: bool,
}

impl LockWord {
    pub const WAITERS: u64 = 2;

    pub fn pack(self) -> u64 {
        ((self.holder.epoch as u64) << 32)
            | ((self.holder.slot as u64 + 1) << 2)
            | ((self.waiters as u64) << 1)
            | 1
    }

    /// `None` when the lock is free.
    pub fn unpack(word: u64) -> Option<LockWord> {
        if word as u32 == 0 {
            return None;
        }
        Some(LockWord {
            holder: WriterId {
                slot: ((word as u32) >> 2).wrapping_sub(1),
                epoch: (word >> 32) as u32,
            },
            waiters: word & Self::WAITERS != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn writer() -> impl Strategy<Value = WriterId> {
        (0u32..64, any::<u32>()).prop_map(|(slot, epoch)| WriterId { slot, epoch })
    }

    proptest! {
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

        #[test]
        fn block_states_round_trip(kind in 0u8..4, owner in writer(), referenced: bool, keyed: bool) {
            let kind = match kind {
                0 => BlockKind::Free,
                1 => BlockKind::Reserved { owner },
                2 => BlockKind::Live,
                _ => BlockKind::Evicting,
            };
            let state = BlockState { kind, referenced, keyed };
            prop_assert_eq!(BlockState::unpack(state.pack()), state);
        }

        #[test]
        fn pin_words_round_trip(epoch: u32, pins: u32) {
            let w = PinWord { epoch, pins };
            prop_assert_eq!(PinWord::unpack(w.pack()), w);
        }

        #[test]
        fn buckets_round_trip(
            tag in 0u32..(1 << Bucket::TAG_BITS),
            len in prop_oneof![0u8..=Bucket::INLINE_KEY, Just(Bucket::LONG_KEY)],
            address in (0..=Bucket::MAX_ADDRESS).prop_map(|a| a & !63),
            owner in writer(),
            kind in 0u8..3,
        ) {
            let key = KeyRef { tag, len };
            let bucket = match kind {
                0 => Bucket::Empty,
                1 => Bucket::Live { key, address },
                _ => Bucket::Claim { key, owner },
            };
            prop_assert_eq!(Bucket::unpack(bucket.pack()), bucket);
        }

        #[test]
        fn lock_words_round_trip(holder in writer(), waiters: bool) {
            let w = LockWord { holder, waiters };
            prop_assert_eq!(LockWord::unpack(w.pack()), Some(w));
            prop_assert!(w.pack() as u32 != 0, "a held lock's futex word is never 0");
        }
    }

    #[test]
    fn zeroed_words_are_free_and_empty() {
        assert_eq!(BlockState::unpack(0), BlockState::FREE);
        assert_eq!(Bucket::unpack(0), Bucket::Empty);
        assert_eq!(LockWord::unpack(0), None);
        assert_eq!(PinWord::unpack(0).for_epoch(3).pins, 0);
    }
}
