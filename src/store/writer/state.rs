//! The writer's private bookkeeping — what it knows of each chunk (key, id, MAC, pins,
//! CLOCK's referenced bit, the handles it issued), the current reader set, the key index and
//! its counters. Nothing here touches shared memory.

use std::collections::HashMap;
use std::sync::Arc;

use crate::handle::{Handle, MAC_LEN, SIGNATURE_LEN, Signer};
use crate::layout::{Counter, SlotState};
use crate::ring::Ring;
use crate::store::Occupant;

/// The claimed reader slots a handle's references went to, numbered so a handle can name it.
#[derive(Clone, Debug)]
pub(super) struct ReaderSet {
    pub(super) number: u32,
    /// `(slot, epoch)` of every claimed (not draining) slot.
    pub(super) members: Arc<[(u32, u32)]>,
}

/// How many handles of one chunk were issued to one reader set and not given back with
/// `release` (reads are not tracked here: they are the readers' business).
#[derive(Debug)]
pub(super) struct Issuance {
    pub(super) reader_set: ReaderSet,
    /// The signature of this reader set's handle to the chunk (computed once).
    pub(super) signature: [u8; SIGNATURE_LEN],
    pub(super) unreleased: u32,
}

/// Writer-private bookkeeping for one chunk. `Default` is a chunk placed but not published
/// yet (no key, id 0).
#[derive(Debug, Default)]
pub(super) struct ChunkMeta {
    /// The key the index files this chunk under: `Some` exactly while `keys` maps it here
    /// (`None` before publication and once invalidated or cleared: the chunk only waits to
    /// be reclaimed).
    pub(super) key: Option<String>,
    pub(super) id: u64,
    pub(super) mac: [u8; MAC_LEN],
    pub(super) pins: u32,
    /// CLOCK's referenced bit: set on a hit, cleared when the hand passes.
    pub(super) referenced: bool,
    pub(super) issued: Vec<Issuance>,
}

impl ChunkMeta {
    /// One more handle to this chunk for `reader_set` (its signature made once per set).
    pub(super) fn issue(
        &mut self,
        signer: &Signer,
        key: &str,
        address: u64,
        reader_set: &ReaderSet,
    ) -> Handle {
        let signature = match self
            .issued
            .iter_mut()
            .find(|i| i.reader_set.number == reader_set.number)
        {
            Some(issuance) => {
                issuance.unreleased = issuance.unreleased.saturating_add(1);
                issuance.signature
            }
            None => {
                let handle = signer.handle(key, address, self.id, reader_set.number);
                self.issued.push(Issuance {
                    reader_set: reader_set.clone(),
                    signature: handle.signature,
                    unreleased: 1,
                });
                handle.signature
            }
        };
        Handle {
            address,
            monotonic_id: self.id,
            signature,
        }
    }
}

/// The counters the writer counts as events happen; the ring, the index and the id counter
/// hold the others (see [`WriterState::counter`]).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally([u64; Counter::COUNT]);

impl Tally {
    pub(super) fn bump(&mut self, counter: Counter) {
        self.0[counter as usize] += 1;
    }
}

#[derive(Debug)]
pub(super) struct WriterState {
    pub(super) ring: Ring<ChunkMeta>,
    pub(super) keys: HashMap<String, u64>,
    pub(super) last_id: u64,
    pub(super) tally: Tally,
    pub(super) closed: bool,
    pub(super) reader_set: ReaderSet,
}

impl WriterState {
    /// The bookkeeping of the chunk `key` is stored in.
    pub(super) fn stored(&mut self, key: &str) -> Option<&mut ChunkMeta> {
        let address = *self.keys.get(key)?;
        self.ring.get_mut(address)
    }

    /// The value of `counter` now.
    pub(super) fn counter(&self, counter: Counter) -> u64 {
        match counter {
            Counter::BytesInUse => self.ring.used(),
            Counter::Objects => self.keys.len() as u64,
            Counter::LastId => self.last_id,
            event => self.tally.0[event as usize],
        }
    }

    /// The current reader set given the occupied slots, numbering a new one if it changed.
    pub(super) fn reader_set(&mut self, occupants: &[Occupant]) -> ReaderSet {
        let members = || {
            occupants
                .iter()
                .filter(|o| o.claim.state == SlotState::Claimed)
                .map(|o| (o.slot, o.claim.epoch))
        };
        // Compared without allocating: the set changes only when readers come and go.
        if !self.reader_set.members.iter().copied().eq(members()) {
            self.reader_set = ReaderSet {
                number: self.reader_set.number.wrapping_add(1),
                members: members().collect(),
            };
        }
        self.reader_set.clone()
    }
}
