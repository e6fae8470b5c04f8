//! Filing a new key without the index lock, and the gate that keeps such filings apart from
//! every change made under it.
//!
//! Two writers putting at once used to pass the index lock's cache line between their cores
//! at every publication, nearly half of what a second writer added to a put. So the common
//! publication — a key that is neither stored nor claimed, into an index with room — takes
//! no lock: the writer counts itself in its own slot's filing word, checks that the gate is
//! closed, takes the first empty bucket of the key's probe with a CAS of its head, and
//! finishes the entry as any filing does (I2, then I1: `index.rs`). Filings alone never make
//! a bucket empty nor move an entry, so each key has one place to go: the first empty bucket
//! of its probe, which a second filer of the same key finds taken (it waits for the entry to
//! be whole and compares keys, so no key is ever filed twice).
//!
//! Everything else that changes the index — removals and their backward shifts, claims,
//! `clear`, a repair — runs under the index lock with the gate open: the holder opens it,
//! then waits until every writer's filing word counts none, and closes it before giving the
//! lock back. A filer counts itself in (SeqCst), then loads the gate (SeqCst); the holder
//! stores the gate (SeqCst), then loads the filing words (SeqCst): in the single order of
//! SeqCst operations, either the filer sees the gate open and backs off to the lock, or the
//! holder sees it counted and waits for it (its count out is a Release store; the holder's
//! load pairs with it, so it sees the finished entry). So the index lock's holder still
//! changes the index alone, as the rest of the store assumes.
//!
//! A filer never waits for the lock while counted in, so the holder's wait always ends — but
//! for a filer that died: the holder finds its writer gone (the epoch in its filing word is
//! no longer its slot's occupant, or the occupant's OFD lock is gone), repairs the index
//! (`repair_index`), which drops a half-filed bucket and recounts the gauges it may have
//! counted, and only then voids its count: a holder that fails or dies before that leaves
//! the count, and so the repair, to the next one. A gate left open by a holder that died
//! sends filers to the lock, whose next holder takes it over, repairs and closes the gate.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::Shared;
use super::index::{Query, SLOT_WORDS};
use super::lock::IndexGuard;
use crate::error::{Error, Result};
use crate::keyhash::word;
use crate::layout::{Bucket, Counter, WriterId, header, slot};

/// What a writer filing a key without the index lock found on its probe.
pub(super) enum Taken<'s> {
    /// This bucket, taken for the key (its head set, its version still 0).
    Bucket(TakenBucket<'s>),
    /// The key is stored already.
    Stored,
    /// The key is claimed, or a bucket on the way stayed half filed: the index lock's
    /// holder sorts it out.
    Locked,
}

/// A bucket taken for a filing: its words, resolved before it was taken, so that finishing
/// the entry cannot fail halfway (and leave the bucket taken by a writer that lives on).
pub(super) struct TakenBucket<'s> {
    version: &'s AtomicU64,
    hash: &'s AtomicU64,
    slot: &'s [AtomicU64; SLOT_WORDS],
}

/// How long a filer waits for another's entry of the same key tag to be whole.
const FILING_SPINS: u32 = 1024;

/// A filing's count, given back when dropped.
pub(super) struct Filing<'a>(&'a AtomicU64);

impl Drop for Filing<'_> {
    fn drop(&mut self) {
        // Release: pairs with the SeqCst load of `open_gate` that sees the count out.
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// An object a filing counted in the `objects` gauge ahead of filing it: taken back when
/// dropped, unless the filing filed it ([`Counted::keep`]). Dropped before its [`Filing`]
/// (declared after it), so the holder never sees the gauge change behind the gate.
pub(super) struct Counted<'a>(&'a AtomicU64);

impl Counted<'_> {
    /// The object was filed: it stays counted.
    pub(super) fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The filing word of a writer that died counted in, as the gate's opener saw it.
pub(super) struct DeadFiling {
    slot: u32,
    seen: u64,
}

/// Spins between two checks that a filer the gate's opener waits for still lives.
const SPINS_PER_CHECK: u32 = 1024;

/// The filing count in a slot's filing word.
const COUNT: u64 = 0xffff_ffff;

impl Shared {
    fn gate(&self) -> Result<&AtomicU64> {
        self.header(header::INDEX_GATE)
    }

    /// Make `me`'s filing word name its epoch (on taking a writer slot: the word is then
    /// its own, and counts none).
    pub(super) fn own_filing_word(&self, me: WriterId) -> Result<()> {
        self.writer_slot(me.slot, slot::FILING)?
            .store(u64::from(me.epoch) << 32, Ordering::Release);
        Ok(())
    }

    /// Whether a writer that used to hold slot `s` died filing: its filing word still counts.
    pub(super) fn left_filing(&self, s: u32) -> Result<bool> {
        let word = self.writer_slot(s, slot::FILING)?.load(Ordering::Acquire);
        Ok(word & COUNT != 0)
    }

    /// Count a filing of `me` in, if the gate is closed: `None` (counted out again) if the
    /// index lock's holder has it open, and the filing is to take the lock.
    pub(super) fn start_filing(&self, me: WriterId) -> Result<Option<Filing<'_>>> {
        let word = self.writer_slot(me.slot, slot::FILING)?;
        word.fetch_add(1, Ordering::SeqCst);
        let filing = Filing(word);
        if self.gate()?.load(Ordering::SeqCst) != 0 {
            return Ok(None);
        }
        Ok(Some(filing))
    }

    /// Count one more object in the `objects` gauge for a filing (counted in), if the index
    /// has room for it without evicting: the gauge is added to atomically, as other filers
    /// add theirs meanwhile (claims change only behind the gate). `None`, counting nothing,
    /// if it has not.
    pub(super) fn count_filing(&self, _filing: &Filing<'_>) -> Result<Option<Counted<'_>>> {
        let objects = self.counter(Counter::Objects)?;
        let claims = self.counter(Counter::Claims)?.load(Ordering::Relaxed);
        let before = objects.fetch_add(1, Ordering::Relaxed);
        let counted = Counted(objects);
        Ok((before + claims < self.layout.max_objects).then_some(counted))
    }

    /// Open the gate (index lock held) and wait until no writer is filing: the filing words
    /// of the writers that died counted in, as seen (empty unless one did). Their counts
    /// stand until [`Shared::void_filings`], after the [`Shared::repair_index`] they call
    /// for: a holder that fails or dies before then leaves them for the next one.
    pub(super) fn open_gate(&self, _index: &IndexGuard<'_>) -> Result<Vec<DeadFiling>> {
        self.gate()?.store(1, Ordering::SeqCst);
        let mut dead = Vec::new();
        for s in 0..self.layout.max_writers {
            let word = self.writer_slot(s, slot::FILING)?;
            let mut spins = 0u32;
            loop {
                let seen = word.load(Ordering::SeqCst);
                if seen & COUNT == 0 {
                    break;
                }
                spins = spins.wrapping_add(1);
                if spins % SPINS_PER_CHECK != 0 {
                    spin_loop();
                    continue;
                }
                let filer = WriterId {
                    slot: s,
                    epoch: (seen >> 32) as u32,
                };
                if !self.writer_alive(filer)? {
                    dead.push(DeadFiling { slot: s, seen });
                    break;
                }
                std::thread::yield_now();
            }
        }
        Ok(dead)
    }

    /// Void the counts of writers that died filing (index lock held, the index repaired
    /// since [`Shared::open_gate`] found them). A word that changed meanwhile is left as it
    /// is: only a joiner of the slot changes it, and only once no count is left in it.
    pub(super) fn void_filings(&self, _index: &IndexGuard<'_>, dead: &[DeadFiling]) -> Result<()> {
        for filing in dead {
            let word = self.writer_slot(filing.slot, slot::FILING)?;
            // The count goes, the epoch stays (so the word still names no live writer).
            let _ = word.compare_exchange(
                filing.seen,
                filing.seen & !COUNT,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        Ok(())
    }

    /// Close the gate (the index lock's holder, before giving it back): filings may start.
    pub(super) fn close_gate(&self) -> Result<()> {
        // Release: a filer that sees it closed (its SeqCst load) sees every change made
        // behind it.
        self.gate()?.store(0, Ordering::Release);
        Ok(())
    }

    /// Take the bucket `query`'s key is to be filed in as `head`, without the index lock (a
    /// filing counted in behind the closed gate): the first empty bucket of its
    /// probe, taken with a CAS of its head. Its version stays 0 (lookups take it for a
    /// change in progress) until [`Shared::finish_filing`]. Behind the gate buckets are only
    /// ever taken and filed, never emptied nor moved, so another filer of the same key meets
    /// this bucket on its probe and waits for the entry to compare keys.
    pub(super) fn take_bucket(&self, query: &Query<'_>, head: Bucket) -> Result<Taken<'_>> {
        'probe: for bucket in self.probe(query.hash()) {
            let [head_word, version_word] =
                self.seg.atomics::<2>(self.layout.bucket_offset(bucket))?;
            let mut spins = 0;
            loop {
                // Acquire: pairs with a remover's Release store of `Empty` (its version 0 is
                // visible) and with another filer's CAS.
                let seen = head_word.load(Ordering::Acquire);
                let (key, claimed) = match Bucket::unpack(seen) {
                    Bucket::Empty => {
                        let taken = TakenBucket {
                            version: version_word,
                            hash: self.bucket_hash(bucket)?,
                            slot: self
                                .seg
                                .atomics::<SLOT_WORDS>(self.layout.key_slot_offset(bucket))?,
                        };
                        if head_word
                            .compare_exchange(
                                seen,
                                head.pack(),
                                Ordering::AcqRel,
                                Ordering::Acquire,
                            )
                            .is_ok()
                        {
                            return Ok(Taken::Bucket(taken));
                        }
                        continue; // another filer took it: what for?
                    }
                    Bucket::Live { key, .. } => (key, false),
                    Bucket::Claim { key, .. } => (key, true),
                };
                if key != query.kref() {
                    continue 'probe;
                }
                // Acquire: pairs with I1 (the whole entry is visible).
                if version_word.load(Ordering::Acquire) != 0 {
                    if !self.key_slot_matches(bucket, query)? {
                        continue 'probe;
                    }
                    return Ok(if claimed {
                        Taken::Locked
                    } else {
                        Taken::Stored
                    });
                }
                spins += 1;
                if spins > FILING_SPINS {
                    return Ok(Taken::Locked);
                }
                spin_loop();
            }
        }
        Err(Error::Corrupt(
            "the key index has no empty bucket (it is never filled past half)".into(),
        ))
    }

    /// Finish filing `query`'s key at `version` in the bucket [`Shared::take_bucket`] took:
    /// I2, then the key slot (word by word; past the key's end a slot is never compared)
    /// and the hash, then I1.
    pub(super) fn finish_filing(taken: TakenBucket<'_>, query: &Query<'_>, version: u64) {
        // I2: a lookup that reads any byte written below sees version 0 or the new one.
        fence(Ordering::Release);
        for (slot_word, bytes) in taken.slot.iter().zip(query.slot_bytes().chunks(8)) {
            slot_word.store(word(bytes), Ordering::Relaxed);
        }
        taken.hash.store(query.hash(), Ordering::Relaxed);
        // I1: the head and key slot are visible to whoever loads this version with Acquire.
        taken.version.store(version, Ordering::Release);
    }
}
