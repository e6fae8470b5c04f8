//! A writer's private bookkeeping: the reader set its handles go to, and the handles it
//! issued (for `release`, which gives back only references this writer issued, and so that a
//! repeated hit reuses the signature it computed). Nothing here is shared with other writers;
//! the shared state (index, ring, counters) is in the segment.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::error::Result;
use crate::handle::{Handle, SIGNATURE_LEN, Signer};
use crate::layout::{Claim, MAX_READERS, SlotState};
use crate::store::Shared;

/// Reader-set numbers carry the writer slot in their top 6 bits, so a handle names the
/// writer whose `release` may give it back.
const SET_SEQ_BITS: u32 = 26;

/// Hashes the `(address, id)` keys of the issuance records: chunk ids are unique and
/// this writer's own, so a multiply spreads them well (SipHash would be most of a hit's
/// bookkeeping).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(26) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The claimed reader slots a handle's references went to, numbered so a handle can name it.
#[derive(Clone, Debug)]
pub(super) struct ReaderSet {
    pub(super) number: u32,
    /// `(slot, epoch)` of every claimed (not draining) reader slot.
    pub(super) members: Arc<[(u32, u32)]>,
}

/// How many handles of one chunk this writer issued to one reader set and has not had given
/// back with `release` (reads are not tracked here: they are the readers' business).
#[derive(Debug)]
struct Issuance {
    reader_set: ReaderSet,
    /// The signature of this reader set's handle to the chunk (computed once).
    signature: [u8; SIGNATURE_LEN],
    unreleased: u32,
}

/// A chunk's issuance records: almost always one reader set (the set changes only when
/// readers come and go), so the first is kept inline.
#[derive(Debug)]
struct Issuances {
    first: Issuance,
    more: Vec<Issuance>,
}

impl Issuances {
    fn find_mut(&mut self, set_number: u32) -> Option<&mut Issuance> {
        std::iter::once(&mut self.first)
            .chain(self.more.iter_mut())
            .find(|i| i.reader_set.number == set_number)
    }
}

/// What `release` finds for a handle: the reader set to credit, once.
pub(super) enum Release {
    Credit(ReaderSet),
    /// Not this writer's, or every such handle was given back already.
    Nothing,
    /// Signed for this chunk and reader set by someone else's secret: refused.
    Mismatch,
}

#[derive(Debug)]
pub(super) struct Private {
    writer_slot: u32,
    reader_set: ReaderSet,
    /// The reader slots' claim words as last loaded (a cheap test that the set is unchanged).
    claim_words: [u64; MAX_READERS as usize],
    /// `(address, id)` of a chunk -> this writer's handles to it.
    issued: HashMap<(u64, u64), Issuances, BuildHasherDefault<IdHasher>>,
    /// Size of `issued` that triggers dropping the records of chunks that are gone.
    prune_at: usize,
}

impl Private {
    pub(super) fn new(writer_slot: u32, first_set: u32) -> Private {
        Private {
            writer_slot,
            reader_set: ReaderSet {
                number: (writer_slot << SET_SEQ_BITS) | (first_set & ((1 << SET_SEQ_BITS) - 1)),
                members: Arc::new([]),
            },
            claim_words: [u64::MAX; MAX_READERS as usize],
            issued: HashMap::default(),
            prune_at: 4096,
        }
    }

    /// The current reader set (claimed reader slots), numbered anew when it changed.
    pub(super) fn reader_set(&mut self, shared: &Shared) -> Result<&ReaderSet> {
        let n = shared.layout.n_readers as usize;
        let mut changed = false;
        for s in 0..n {
            let word = shared.claim(s as u32)?.0;
            changed |= word != self.claim_words[s];
            self.claim_words[s] = word;
        }
        if !changed {
            return Ok(&self.reader_set);
        }
        let members: Vec<(u32, u32)> = self.claim_words[..n]
            .iter()
            .enumerate()
            .filter_map(|(s, &w)| {
                let claim = Claim::unpack(w)?;
                (claim.state == SlotState::Claimed).then_some((s as u32, claim.epoch))
            })
            .collect();
        if *self.reader_set.members != *members {
            let seq = (self.reader_set.number.wrapping_add(1)) & ((1 << SET_SEQ_BITS) - 1);
            self.reader_set = ReaderSet {
                number: (self.writer_slot << SET_SEQ_BITS) | seq,
                members: members.into(),
            };
        }
        Ok(&self.reader_set)
    }

    /// One more handle to the chunk `(address, id)` of `key` for the current reader set (its
    /// signature made once per set).
    pub(super) fn issue(
        &mut self,
        signer: &Signer,
        key: &str,
        (address, id): (u64, u64),
    ) -> Handle {
        let number = self.reader_set.number;
        let known = self
            .issued
            .get_mut(&(address, id))
            .and_then(|issued| issued.find_mut(number));
        let signature = match known {
            Some(issuance) => {
                issuance.unreleased = issuance.unreleased.saturating_add(1);
                issuance.signature
            }
            None => {
                let handle = signer.handle(key, address, id, number);
                let reader_set = self.reader_set.clone();
                self.record(&handle, reader_set);
                handle.signature
            }
        };
        Handle {
            address,
            monotonic_id: id,
            signature,
        }
    }

    /// Record one handle issued to `reader_set` (`put`'s came with the chunk's MAC).
    pub(super) fn record(&mut self, handle: &Handle, reader_set: ReaderSet) {
        let issuance = Issuance {
            reader_set,
            signature: handle.signature,
            unreleased: 1,
        };
        match self.issued.get_mut(&(handle.address, handle.monotonic_id)) {
            Some(issued) => issued.more.push(issuance),
            None => {
                self.issued.insert(
                    (handle.address, handle.monotonic_id),
                    Issuances {
                        first: issuance,
                        more: Vec::new(),
                    },
                );
            }
        }
    }

    /// Take one unreleased handle of `handle`'s kind off the books.
    pub(super) fn release(&mut self, handle: &Handle) -> Release {
        let Some(issuance) = self
            .issued
            .get_mut(&(handle.address, handle.monotonic_id))
            .and_then(|issued| issued.find_mut(handle.reader_set()))
        else {
            return Release::Nothing;
        };
        if issuance.signature != handle.signature {
            return Release::Mismatch;
        }
        if issuance.unreleased == 0 {
            return Release::Nothing;
        }
        issuance.unreleased -= 1;
        Release::Credit(issuance.reader_set.clone())
    }

    /// Forget the chunk `(address, id)` (evicted, or its references were dropped by `clear`).
    pub(super) fn forget(&mut self, address: u64, id: u64) {
        self.issued.remove(&(address, id));
    }

    /// When the records have grown past a threshold, drop those of chunks that are gone
    /// (`alive` says whether a chunk still is): those other writers evicted (this writer
    /// forgets what it evicts itself). The threshold is then four times what is left.
    pub(super) fn prune(&mut self, mut alive: impl FnMut(u64, u64) -> bool) {
        if self.issued.len() < self.prune_at {
            return;
        }
        self.issued.retain(|&(address, id), _| alive(address, id));
        self.prune_at = (4 * self.issued.len()).max(4096);
    }
}
