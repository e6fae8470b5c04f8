//! The object store: one writer and up to `n_readers` readers over one segment.
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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::handle::{Handle, MAC_LEN, SIGNATURE_LEN, Signer, tag};
use crate::layout::{
    self, Claim, Counter, LAYOUT_VERSION, Layout, Liveness, SlotState, SlotWord, WRITER_CLOSED,
    WRITER_LIVE, WRITER_LOCK, align_up, chunk, header, part_offsets, slot,
};
use crate::ring::{Ring, Verdict};
use crate::segment::{self, Access, Process, RawBytes, Registration, Segment};

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

fn mac_words(mac: &[u8; MAC_LEN]) -> (u64, u64) {
    let lo = u64::from_le_bytes(mac[..8].try_into().expect("8 bytes"));
    let hi = u64::from_le_bytes(mac[8..].try_into().expect("8 bytes"));
    (lo, hi)
}

/// Apply `f` to a slot word with a CAS loop; `f` returns `None` to leave it unchanged.
fn update_word(word: &AtomicU64, mut f: impl FnMut(SlotWord) -> Option<SlotWord>) -> bool {
    word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
        f(SlotWord::unpack(w)).map(SlotWord::pack)
    })
    .is_ok()
}

// ----------------------------------------------------------------------------------------
// Writer
// ----------------------------------------------------------------------------------------

/// The claimed reader slots a handle's references went to, numbered so a handle can name it.
#[derive(Clone, Debug)]
struct ReaderSet {
    number: u32,
    /// `(slot, epoch)` of every claimed (not draining) slot.
    members: Arc<[(u32, u32)]>,
}

/// How many handles of one chunk were issued to one reader set and not given back with
/// `release` (reads are not tracked here: they are the readers' business).
#[derive(Debug)]
struct Issuance {
    reader_set: ReaderSet,
    /// The signature of this reader set's handle to the chunk (computed once).
    signature: [u8; SIGNATURE_LEN],
    unreleased: u32,
}

/// Writer-private bookkeeping for one chunk.
#[derive(Debug)]
struct ChunkMeta {
    /// `None` once invalidated or cleared: the chunk only waits to be reclaimed.
    key: Option<String>,
    id: u64,
    mac: [u8; MAC_LEN],
    pins: u32,
    /// CLOCK's referenced bit: set on a hit, cleared when the hand passes.
    referenced: bool,
    issued: Vec<Issuance>,
}

impl ChunkMeta {
    /// One more handle to this chunk for `reader_set` (its signature made once per set).
    fn issue(
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
struct Tally([u64; Counter::COUNT]);

impl Tally {
    fn bump(&mut self, counter: Counter) {
        self.0[counter as usize] += 1;
    }
}

#[derive(Debug)]
struct WriterState {
    ring: Ring<ChunkMeta>,
    keys: HashMap<String, u64>,
    last_id: u64,
    tally: Tally,
    closed: bool,
    reader_set: ReaderSet,
}

impl WriterState {
    /// The value of `counter` now.
    fn counter(&self, counter: Counter) -> u64 {
        match counter {
            Counter::BytesInUse => self.ring.used(),
            Counter::Objects => self.keys.len() as u64,
            Counter::LastId => self.last_id,
            event => self.tally.0[event as usize],
        }
    }

    /// The current reader set given the occupied slots, numbering a new one if it changed.
    fn reader_set(&mut self, occupants: &[Occupant]) -> ReaderSet {
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

/// The single writer of a segment.
#[derive(Debug)]
pub struct Writer {
    shared: Shared,
    signer: Signer,
    process: Process,
    state: Mutex<WriterState>,
}

/// Store counters, as `stats()` reports them.
pub type Stats = Vec<(&'static str, u64)>;

impl Writer {
    /// A writer that tells liveness by pids even though locks work (tests of the fallback).
    #[cfg(test)]
    fn create_with_liveness(capacity: u64, n_readers: u32, liveness: Liveness) -> Result<Writer> {
        let mut w = Writer::create(capacity, n_readers, None, None)?;
        if liveness == Liveness::Pids {
            w.shared.seg.unlock(WRITER_LOCK)?;
            w.shared
                .header(header::LIVENESS)?
                .store(liveness.code(), Ordering::Relaxed);
        }
        w.shared.liveness = liveness;
        Ok(w)
    }

    /// Create a segment with a ring of `capacity` bytes.
    pub fn create(
        capacity: u64,
        n_readers: u32,
        max_object_size: Option<u64>,
        name: Option<&str>,
    ) -> Result<Writer> {
        let layout = Layout::new(capacity, n_readers, max_object_size)?;
        let name = match name {
            Some(n) => segment::validate_name(n)?.to_owned(),
            None => segment::generate_name()?,
        };
        let total = usize::try_from(layout.total_len())
            .map_err(|_| Error::InvalidArgument("capacity too large for this host".into()))?;
        let seg = Segment::create(&name, total, WRITER_LOCK)?;
        let liveness = if seg.holds_locks() {
            Liveness::Locks
        } else {
            Liveness::Pids
        };
        let pid = segment::current_pid();
        layout.write(
            &seg,
            pid,
            segment::process_start_time(pid).unwrap_or(0),
            liveness,
        )?;
        Ok(Writer {
            shared: Shared {
                seg: Arc::new(seg),
                layout,
                liveness,
            },
            signer: Signer::new(segment::random_bytes::<32>()?),
            process: Process::current(),
            state: Mutex::new(WriterState {
                ring: Ring::new(layout.capacity),
                keys: HashMap::new(),
                last_id: 0,
                tally: Tally::default(),
                closed: false,
                reader_set: ReaderSet {
                    number: 0,
                    members: Arc::new([]),
                },
            }),
        })
    }

    pub fn name(&self) -> &str {
        self.shared.seg.name()
    }

    pub fn layout(&self) -> Layout {
        self.shared.layout
    }

    pub fn liveness(&self) -> Liveness {
        self.shared.liveness
    }

    pub fn reader_info(&self) -> ReaderInfo {
        ReaderInfo {
            name: self.name().to_owned(),
            capacity: self.shared.layout.capacity,
            n_readers: self.shared.layout.n_readers,
            max_object_size: self.shared.layout.max_object_size,
            layout_version: LAYOUT_VERSION,
            secret: *self.signer.secret(),
        }
    }

    /// The writer's state, after checking that this is the process that created it and that
    /// it is open.
    fn lock(&self) -> Result<MutexGuard<'_, WriterState>> {
        if !self.process.is_current() {
            return Err(Error::WrongProcess("this shared-memory writer".into()));
        }
        // A panic while holding the lock cannot leave shared memory inconsistent for readers
        // (they verify ids), so a poisoned lock is still usable.
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.closed {
            return Err(Error::Closed);
        }
        Ok(state)
    }

    /// Whether slot `o.slot` holds a view or (claimed, not draining) a reference on the chunk.
    fn holds(&self, address: u64, sig_tag: u32, o: &Occupant) -> Result<bool> {
        let w = SlotWord::unpack(self.shared.word(address, o.slot)?.load(Ordering::Acquire));
        Ok(
            w.stamp == SlotWord::stamp_for(sig_tag, o.claim.epoch as u64)
                && (w.views > 0 || (o.claim.state == SlotState::Claimed && w.outstanding > 0)),
        )
    }

    /// Whether the occupant of `o.slot` is gone; if so, free the slot (crediting everything
    /// it held). `checked` caches the answer for one sweep.
    fn reap_if_dead(
        &self,
        o: &Occupant,
        checked: &mut HashMap<u32, bool>,
        tally: &mut Tally,
    ) -> Result<bool> {
        if let Some(&dead) = checked.get(&o.slot) {
            return Ok(dead);
        }
        let dead = !self.shared.occupant_alive(o.slot, o.claim)?;
        if dead {
            let free = Claim {
                pid: 0,
                state: SlotState::Free,
                ..o.claim
            };
            // CAS: only free the slot if it still has the same occupant in the same state.
            let freed = self
                .shared
                .slot(o.slot, slot::CLAIM)?
                .compare_exchange(o.word, free.pack(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if freed {
                tally.bump(Counter::ReadersReclaimed);
            }
        }
        checked.insert(o.slot, dead);
        Ok(dead)
    }

    /// Whether the chunk can be reclaimed now (ignoring CLOCK's referenced bit).
    fn reclaimable(
        &self,
        address: u64,
        meta: &ChunkMeta,
        occupants: &[Occupant],
        checked: &mut HashMap<u32, bool>,
        tally: &mut Tally,
    ) -> bool {
        if meta.pins > 0 {
            return false;
        }
        let sig_tag = tag(&meta.mac);
        for o in occupants {
            match self.holds(address, sig_tag, o) {
                Ok(false) => {}
                Ok(true) => {
                    if !matches!(self.reap_if_dead(o, checked, tally), Ok(true)) {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// Mark a chunk dead before its bytes are reused (see P2 in the module docs).
    fn kill(&self, address: u64) -> Result<()> {
        self.shared
            .chunk(address, chunk::ID)?
            .store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Store one object made of `parts`, each starting 64-byte aligned in the payload.
    pub fn put(&self, key: &str, parts: &[&[u8]]) -> Result<Handle> {
        let parts: Vec<RawBytes<'_>> = parts.iter().map(|&p| p.into()).collect();
        self.put_raw(key, &parts)
    }

    /// [`Writer::put`] from bytes that are only ever copied, never borrowed as a slice (a
    /// Python buffer that another thread may write while the copy runs without the GIL).
    pub fn put_raw(&self, key: &str, parts: &[RawBytes<'_>]) -> Result<Handle> {
        let mut state = self.lock()?;
        if state.keys.contains_key(key) {
            return Err(Error::DuplicateKey(key.to_owned()));
        }
        let layout = self.shared.layout;
        let (offsets, payload_len) =
            part_offsets(parts.iter().map(|p| p.len() as u64)).ok_or(Error::TooLarge {
                size: u64::MAX,
                max: layout.max_object_size,
            })?;
        if payload_len > layout.max_object_size {
            return Err(Error::TooLarge {
                size: payload_len,
                max: layout.max_object_size,
            });
        }
        let size = align_up(layout.chunk_header_size + payload_len)
            .filter(|&s| s <= layout.capacity)
            .ok_or(Error::TooLarge {
                size: payload_len,
                max: layout.max_object_size,
            })?;

        let occupants = self.shared.occupants()?;
        let reader_set = state.reader_set(&occupants);
        let mut checked = HashMap::new();
        let mut tally = state.tally;
        let meta = ChunkMeta {
            key: Some(key.to_owned()),
            id: 0,
            mac: [0; MAC_LEN],
            pins: 0,
            referenced: false,
            issued: Vec::new(),
        };
        let placement = state.ring.allocate(size, meta, |address, meta| {
            if meta.key.is_some() && std::mem::take(&mut meta.referenced) {
                return Verdict::Keep; // second chance
            }
            if self.reclaimable(address, meta, &occupants, &mut checked, &mut tally) {
                Verdict::Evict
            } else {
                Verdict::Keep
            }
        });
        state.tally = tally;
        let Some(placement) = placement else {
            self.publish(&state)?;
            return Err(Error::Full {
                needed: size,
                capacity: layout.capacity,
            });
        };
        for (address, old) in &placement.evicted {
            self.kill(*address)?;
            if let Some(old_key) = &old.key {
                state.keys.remove(old_key);
                state.tally.bump(Counter::Evictions);
            }
        }
        // P2: every reader that copies reused bytes will see `id == 0` (or a newer id).
        fence(Ordering::Release);

        let address = placement.address;
        state.last_id += 1;
        let id = state.last_id;
        let (mac, handle) = self.signer.sign(key, address, id, reader_set.number);
        let (lo, hi) = mac_words(&mac);
        let sh = &self.shared;
        sh.chunk(address, chunk::SIG_LO)?
            .store(lo, Ordering::Relaxed);
        sh.chunk(address, chunk::SIG_HI)?
            .store(hi, Ordering::Relaxed);
        sh.chunk(address, chunk::LEN)?
            .store(payload_len, Ordering::Relaxed);
        sh.chunk(address, chunk::REFS)?.store(1, Ordering::Relaxed);
        for s in 0..layout.n_readers {
            sh.word(address, s)?.store(0, Ordering::Relaxed);
        }
        for &(s, epoch) in reader_set.members.iter() {
            sh.slot(s, slot::REFS)?.fetch_add(1, Ordering::Relaxed);
            let word = SlotWord {
                stamp: SlotWord::stamp_for(tag(&mac), epoch as u64),
                outstanding: 1,
                views: 0,
            };
            sh.word(address, s)?.store(word.pack(), Ordering::Relaxed);
        }
        let payload = sh.payload_offset(address);
        let mut cursor = 0u64;
        for (part, &offset) in parts.iter().zip(&offsets) {
            if offset > cursor {
                sh.seg.zero(payload + cursor, (offset - cursor) as usize)?;
            }
            sh.seg.write_from(payload + offset, *part)?;
            cursor = offset + part.len() as u64;
        }
        // P1: publish the chunk.
        sh.chunk(address, chunk::ID)?.store(id, Ordering::Release);

        let meta = state.ring.get_mut(address).expect("just placed");
        meta.id = id;
        meta.mac = mac;
        meta.issued.push(Issuance {
            reader_set,
            signature: handle.signature,
            unreleased: 1,
        });
        state.keys.insert(key.to_owned(), address);
        state.tally.bump(Counter::Puts);
        state.tally.bump(Counter::RefsIssued);
        self.publish(&state)?;
        Ok(handle)
    }

    pub fn is_cached(&self, key: &str) -> Result<bool> {
        Ok(self.lock()?.keys.contains_key(key))
    }

    pub fn keys(&self) -> Result<Vec<String>> {
        Ok(self.lock()?.keys.keys().cloned().collect())
    }

    /// Issue one more reference to a stored object. `Error::Saturated` (nothing changed)
    /// when a reader slot already holds as many unread references to it as it can count.
    pub fn get_cached(&self, key: &str) -> Result<Handle> {
        let mut state = self.lock()?;
        let address = *state
            .keys
            .get(key)
            .ok_or_else(|| Error::KeyNotFound(key.to_owned()))?;
        let occupants = self.shared.occupants()?;
        let reader_set = state.reader_set(&occupants);
        let meta = state.ring.get(address).expect("indexed keys have chunks");
        let sig_tag = tag(&meta.mac);
        // Check every slot before changing any: only this writer raises counts, so a count
        // below the limit now is still below it when we add one.
        for &(s, epoch) in reader_set.members.iter() {
            let w = SlotWord::unpack(self.shared.word(address, s)?.load(Ordering::Acquire));
            if w.stamp == SlotWord::stamp_for(sig_tag, epoch as u64)
                && w.outstanding >= SlotWord::MAX_OUTSTANDING
            {
                return Err(Error::Saturated {
                    key: key.to_owned(),
                    slot: s,
                    limit: SlotWord::MAX_OUTSTANDING,
                });
            }
        }
        for &(s, epoch) in reader_set.members.iter() {
            let stamp = SlotWord::stamp_for(sig_tag, epoch as u64);
            update_word(self.shared.word(address, s)?, |w| {
                Some(if w.stamp == stamp {
                    SlotWord {
                        outstanding: w.outstanding + 1,
                        ..w
                    }
                } else {
                    // Stamped for an earlier occupant, who is gone: start afresh.
                    SlotWord {
                        stamp,
                        outstanding: 1,
                        views: 0,
                    }
                })
            });
            self.shared
                .slot(s, slot::REFS)?
                .fetch_add(1, Ordering::Relaxed);
        }
        self.shared
            .chunk(address, chunk::REFS)?
            .fetch_add(1, Ordering::Relaxed);
        let meta = state
            .ring
            .get_mut(address)
            .expect("indexed keys have chunks");
        meta.referenced = true;
        let handle = meta.issue(&self.signer, key, address, &reader_set);
        state.tally.bump(Counter::Hits);
        state.tally.bump(Counter::RefsIssued);
        self.publish(&state)?;
        Ok(handle)
    }

    /// Protect a stored object from eviction until a matching `unpin` (pins are counted).
    pub fn pin(&self, key: &str) -> Result<()> {
        let mut state = self.lock()?;
        let address = *state
            .keys
            .get(key)
            .ok_or_else(|| Error::KeyNotFound(key.to_owned()))?;
        state.ring.get_mut(address).expect("indexed").pins += 1;
        Ok(())
    }

    /// Undo one `pin`; a no-op for an absent or unpinned key.
    pub fn unpin(&self, key: &str) -> Result<()> {
        let mut state = self.lock()?;
        if let Some(&address) = state.keys.get(key) {
            let meta = state.ring.get_mut(address).expect("indexed");
            meta.pins = meta.pins.saturating_sub(1);
        }
        Ok(())
    }

    /// Give back the references one undelivered handle holds (the request carrying it was
    /// dropped): one for each reader slot it was issued to, and no other (a reader that
    /// attached later keeps what later handles owe it). A no-op if the object is gone, or if
    /// every handle issued to that reader set was given back already.
    pub fn release(&self, handle: &Handle) -> Result<()> {
        let mut state = self.lock()?;
        let Some(meta) = state.ring.get_mut(handle.address) else {
            return Ok(());
        };
        if meta.id != handle.monotonic_id {
            return Ok(());
        }
        let sig_tag = tag(&meta.mac);
        let Some(issuance) = meta
            .issued
            .iter_mut()
            .find(|i| i.reader_set.number == handle.reader_set())
        else {
            return Ok(()); // never issued to that set here (or cleared since)
        };
        if issuance.signature != handle.signature {
            return Err(Error::InvalidHandle(
                "signature does not match the object".into(),
            ));
        }
        if issuance.unreleased == 0 {
            return Ok(()); // every such handle was given back already
        }
        issuance.unreleased -= 1;
        for &(s, epoch) in issuance.reader_set.members.iter() {
            let stamp = SlotWord::stamp_for(sig_tag, epoch as u64);
            update_word(self.shared.word(handle.address, s)?, |w| {
                (w.stamp == stamp && w.outstanding > 0).then(|| SlotWord {
                    outstanding: w.outstanding - 1,
                    ..w
                })
            });
        }
        Ok(())
    }

    /// Forget `key`; its chunk is reclaimed once nobody holds it. A no-op if absent.
    pub fn invalidate(&self, key: &str) -> Result<()> {
        let mut state = self.lock()?;
        if let Some(address) = state.keys.remove(key) {
            let meta = state.ring.get_mut(address).expect("indexed");
            meta.key = None;
            meta.pins = 0;
            meta.referenced = false;
        }
        self.publish(&state)
    }

    /// Forget every key, drop every undelivered or unread reference (so the references of
    /// requests abandoned without `release` stop pinning the ring), and reclaim at once every
    /// chunk that no live view holds. A handle issued before either still reads its own
    /// bytes (the reader verifies them) or is stale; ids keep counting, so it can never match
    /// anything stored after.
    pub fn clear(&self) -> Result<()> {
        let mut state = self.lock()?;
        state.keys.clear();
        let occupants = self.shared.occupants()?;
        let mut checked = HashMap::new();
        let mut tally = state.tally;
        let mut free = Vec::new();
        for (address, meta) in state.ring.iter_mut() {
            meta.key = None;
            meta.pins = 0;
            meta.referenced = false;
            meta.issued.clear();
            let sig_tag = tag(&meta.mac);
            for o in &occupants {
                let stamp = SlotWord::stamp_for(sig_tag, o.claim.epoch as u64);
                update_word(self.shared.word(address, o.slot)?, |w| {
                    (w.stamp == stamp && w.outstanding > 0).then_some(SlotWord {
                        outstanding: 0,
                        ..w
                    })
                });
            }
            if self.reclaimable(address, meta, &occupants, &mut checked, &mut tally) {
                free.push(address);
            }
        }
        for address in free {
            self.kill(address)?;
            state.ring.remove(address);
        }
        fence(Ordering::Release);
        tally.bump(Counter::Clears);
        state.tally = tally;
        self.publish(&state)
    }

    /// Whether `handle` is the current entry of `key`: signed for `key` by this store and
    /// naming the chunk `key` is stored in now. No side effect: no reference is issued, no
    /// hit counted, no recency changed (for validating handles a client sent back).
    pub fn verify(&self, handle: &Handle, key: &str) -> Result<bool> {
        let state = self.lock()?;
        if self.signer.verify(key, handle).is_none() {
            return Ok(false);
        }
        Ok(state.keys.get(key) == Some(&handle.address)
            && state
                .ring
                .get(handle.address)
                .is_some_and(|meta| meta.id == handle.monotonic_id))
    }

    /// Copy out the payload of the chunk at `address` (the writer's lock keeps it from
    /// changing). The length comes from shared memory, so it is checked before allocating.
    fn copy_payload(&self, address: u64) -> Result<Vec<u8>> {
        let len = self
            .shared
            .chunk(address, chunk::LEN)?
            .load(Ordering::Relaxed);
        if !self.shared.layout.valid_payload(address, len) {
            return Err(Error::Corrupt(format!(
                "chunk at {address} claims {len} bytes, more than fit"
            )));
        }
        let mut out = vec![0u8; len as usize];
        self.shared
            .seg
            .read_into(self.shared.payload_offset(address), &mut out)?;
        Ok(out)
    }

    /// Copy an object out through a handle: the writer's own read.
    pub fn read(&self, handle: &Handle, key: &str) -> Result<Vec<u8>> {
        let state = self.lock()?;
        if !self.shared.layout.valid_chunk_address(handle.address) {
            return Err(Error::InvalidHandle(format!(
                "address {} is out of range",
                handle.address
            )));
        }
        if self.signer.verify(key, handle).is_none() {
            return Err(Error::InvalidHandle("bad signature".into()));
        }
        match state.ring.get(handle.address) {
            Some(meta) if meta.id == handle.monotonic_id => {}
            _ => return Err(Error::Stale),
        }
        self.copy_payload(handle.address)
    }

    /// Copy out the object stored under `key`, issuing no reference (`KeyNotFound` if
    /// absent): how P0 serves a cached item it cannot hand out a handle for.
    pub fn read_key(&self, key: &str) -> Result<Vec<u8>> {
        let state = self.lock()?;
        let address = *state
            .keys
            .get(key)
            .ok_or_else(|| Error::KeyNotFound(key.to_owned()))?;
        self.copy_payload(address)
    }

    /// Publish every counter in the segment header, for `inspect`.
    fn publish(&self, state: &WriterState) -> Result<()> {
        for &counter in Counter::ALL {
            self.shared
                .header(counter.offset())?
                .store(state.counter(counter), Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn stats(&self) -> Result<Stats> {
        let state = self.lock()?;
        let occupants = self.shared.occupants()?;
        let mut outstanding = 0u64;
        let mut views = 0u64;
        let mut pinned = 0u64;
        for (address, _, meta) in state.ring.iter() {
            pinned += (meta.pins > 0) as u64;
            for o in &occupants {
                let w =
                    SlotWord::unpack(self.shared.word(address, o.slot)?.load(Ordering::Acquire));
                if w.stamp == SlotWord::stamp_for(tag(&meta.mac), o.claim.epoch as u64) {
                    if o.claim.state == SlotState::Claimed {
                        outstanding += w.outstanding as u64;
                    }
                    views += w.views as u64;
                }
            }
        }
        let draining = occupants
            .iter()
            .filter(|o| o.claim.state == SlotState::Draining)
            .count() as u64;
        let l = self.shared.layout;
        let mut stats = vec![
            ("capacity", l.capacity),
            ("n_readers", l.n_readers as u64),
            ("max_object_size", l.max_object_size),
        ];
        stats.extend(Counter::ALL.iter().map(|&c| (c.name(), state.counter(c))));
        stats.extend([
            ("chunks", state.ring.len() as u64),
            ("outstanding_refs", outstanding),
            ("views", views),
            ("pinned", pinned),
            ("readers_attached", occupants.len() as u64 - draining),
            ("readers_draining", draining),
        ]);
        Ok(stats)
    }

    /// Mark the segment closed for readers, remove its name and give up the writer's lock.
    /// Only the creating process does this: in a forked child it does nothing (the copy just
    /// stops working).
    pub fn close(&self) -> Result<()> {
        if !self.process.is_current() {
            return Ok(());
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.closed {
            return Ok(());
        }
        state.closed = true;
        // The writer created the segment, and this is its process (checked above).
        // Release pairs with the reader's Acquire load in `Shared::writer_alive`.
        self.shared
            .header(header::WRITER_STATE)?
            .store(WRITER_CLOSED, Ordering::Release);
        self.shared.seg.unlink()?;
        if self.shared.liveness == Liveness::Locks {
            self.shared.seg.unlock(WRITER_LOCK)?;
        }
        Ok(())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

// ----------------------------------------------------------------------------------------
// Reader
// ----------------------------------------------------------------------------------------

/// One attached reader: occupies one reader slot until dropped.
#[derive(Debug)]
pub struct Reader {
    shared: Shared,
    signer: Signer,
    slot: u32,
    epoch: u32,
    /// The process that claimed the slot: only it may use or free the slot.
    process: Process,
    /// Set by `close`: no new leases.
    closed: AtomicBool,
}

/// The outcome of checking a handle: a payload to copy, protected by a lease or not.
#[derive(Debug)]
pub struct Lease {
    reader: Arc<Reader>,
    address: u64,
    id: u64,
    mac: [u8; MAC_LEN],
    len: u64,
    /// The stamp of the slot word holding our view, or `None` when reading unprotected
    /// (a replayed handle): then the bytes are verified after the copy.
    stamp: Option<u32>,
}

/// A protected lease turned into a zero-copy view: the payload's address in this process's
/// read-only mapping, valid (and its bytes unchanging) while the view lives — in a forked
/// child too, where the pages become a private copy (`segment::fork`).
#[derive(Debug)]
pub struct View {
    lease: Lease,
    address: usize,
    _registration: Registration,
}

impl View {
    pub fn ptr(&self) -> *const u8 {
        self.address as *const u8
    }

    /// `Lease::read_at` of the view's payload (a copy that forms no reference to it).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.lease.read_at(offset, dst)
    }

    pub fn len(&self) -> usize {
        self.lease.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lease.is_empty()
    }
}

impl Reader {
    /// Attach to the segment named in `info`, claiming a free reader slot (or the slot of
    /// a reader whose process is gone).
    pub fn attach(info: &ReaderInfo) -> Result<Arc<Reader>> {
        if info.layout_version != LAYOUT_VERSION {
            return Err(Error::Corrupt(format!(
                "reader handle is for layout version {}, this build reads version \
                 {LAYOUT_VERSION}",
                info.layout_version
            )));
        }
        let shared = open_shared(&info.name, Access::ReadWrite)?;
        let (layout, liveness) = (shared.layout, shared.liveness);
        if layout.capacity != info.capacity
            || layout.n_readers != info.n_readers
            || layout.max_object_size != info.max_object_size
        {
            return Err(Error::Corrupt(format!(
                "segment {:?} does not match its reader handle (capacity, n_readers or \
                 max_object_size differ)",
                info.name
            )));
        }
        if !shared.writer_alive()? {
            return Err(Error::WriterGone(format!(
                "the writer of {:?} closed it or exited",
                info.name
            )));
        }
        let pid = segment::current_pid();
        for s in 0..layout.n_readers {
            let claimed = match liveness {
                Liveness::Locks => Self::claim_locked(&shared, s, pid)?,
                Liveness::Pids => Self::claim_by_pid(&shared, s, pid)?,
            };
            let Some(epoch) = claimed else { continue };
            for field in [slot::REFS, slot::ACKS, slot::STALE] {
                shared.slot(s, field)?.store(0, Ordering::Relaxed);
            }
            let start = segment::process_start_time(pid).unwrap_or(0) & 0xffff_ffff;
            shared
                .slot(s, slot::START)?
                .store(((epoch as u64) << 32) | start, Ordering::Release);
            return Ok(Arc::new(Reader {
                shared,
                signer: Signer::new(info.secret),
                slot: s,
                epoch,
                process: Process::current(),
                closed: AtomicBool::new(false),
            }));
        }
        Err(Error::NoReaderSlot(layout.n_readers))
    }

    /// Claim slot `s` as `pid` (`Liveness::Locks`): take its lock first; whoever holds it
    /// is alive, and a slot whose lock we get has no live occupant, so we may take it over.
    /// Returns the new epoch, or `None` if a live reader has the slot.
    fn claim_locked(shared: &Shared, s: u32, pid: u32) -> Result<Option<u32>> {
        let range = shared.layout.slot_lock(s);
        if !shared.seg.try_lock(range)? {
            return Ok(None);
        }
        // Only the writer (freeing a dead occupant) can change the word meanwhile: retry.
        loop {
            let (word, claim) = match shared.claim(s) {
                Ok(c) => c,
                Err(e) => {
                    let _ = shared.seg.unlock(range);
                    return Err(e);
                }
            };
            if let Some(epoch) = Self::try_claim(shared, s, word, claim, pid)? {
                return Ok(Some(epoch));
            }
        }
    }

    /// Claim slot `s` as `pid` (`Liveness::Pids`): free, or occupied by a dead process. A
    /// lost race re-reads the slot rather than giving up on it.
    fn claim_by_pid(shared: &Shared, s: u32, pid: u32) -> Result<Option<u32>> {
        loop {
            let (word, claim) = shared.claim(s)?;
            if claim.is_occupied() && shared.occupant_alive(s, claim)? {
                return Ok(None);
            }
            if let Some(epoch) = Self::try_claim(shared, s, word, claim, pid)? {
                return Ok(Some(epoch));
            }
        }
    }

    /// One CAS of slot `s`'s claim word from `word` (= `claim`) to `(epoch + 1, pid,
    /// CLAIMED)`: the new epoch, or `None` if the word changed meanwhile.
    fn try_claim(
        shared: &Shared,
        s: u32,
        word: u64,
        claim: Claim,
        pid: u32,
    ) -> Result<Option<u32>> {
        let epoch = claim.epoch.wrapping_add(1);
        let mine = Claim {
            epoch,
            pid,
            state: SlotState::Claimed,
        };
        // AcqRel: pairs with the previous occupant's (or the writer's) freeing CAS.
        Ok(shared
            .slot(s, slot::CLAIM)?
            .compare_exchange(word, mine.pack(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then_some(epoch))
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }

    pub fn layout(&self) -> Layout {
        self.shared.layout
    }

    pub fn name(&self) -> &str {
        self.shared.seg.name()
    }

    /// Address and length of this reader's read-only mapping of the whole segment, where
    /// zero-copy views point (for registering it with a device, e.g. `cudaHostRegister`).
    pub fn view_mapping(&self) -> Option<(usize, usize)> {
        self.shared.seg.view_mapping()
    }

    /// Stop taking leases; the slot drains (its live views stay protected, it gets no new
    /// references and what it had not read stops counting) and is freed when the last
    /// lease goes. Idempotent; a no-op in a forked child.
    pub fn close(&self) {
        if !self.process.is_current() || self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.set_state(SlotState::Claimed, SlotState::Draining);
    }

    /// Move our own claim from `from` to `to` with a CAS loop; a no-op if the slot is no
    /// longer ours in state `from` (the writer freed it).
    fn set_state(&self, from: SlotState, to: SlotState) -> bool {
        let Ok(word) = self.shared.slot(self.slot, slot::CLAIM) else {
            return false;
        };
        // Release: our acknowledgements and view releases happen before the change is seen
        // (pairs with the writer's Acquire loads of claim words).
        word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            let claim = Claim::unpack(w)?;
            (claim.epoch == self.epoch && claim.state == from).then(|| {
                Claim {
                    state: to,
                    pid: if to == SlotState::Free { 0 } else { claim.pid },
                    ..claim
                }
                .pack()
            })
        })
        .is_ok()
    }

    fn check_writer(&self) -> Result<()> {
        if !self.shared.writer_alive()? {
            return Err(Error::WriterGone(format!(
                "the writer of {:?} closed it or its process exited",
                self.name()
            )));
        }
        Ok(())
    }

    fn stale(&self) -> Error {
        if let Ok(counter) = self.shared.slot(self.slot, slot::STALE) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        Error::Stale
    }

    /// Verify `handle` for `key` and take a lease on its payload. Every check that needs no
    /// shared byte (process, signature, bounds) comes first.
    pub fn acquire(self: &Arc<Self>, handle: &Handle, key: &str) -> Result<Lease> {
        if !self.process.is_current() {
            return Err(Error::WrongProcess("this shared-memory reader".into()));
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let layout = self.shared.layout;
        if handle.monotonic_id == 0 || !layout.valid_chunk_address(handle.address) {
            return Err(Error::InvalidHandle(format!(
                "address {} / id {} is out of range",
                handle.address, handle.monotonic_id
            )));
        }
        let Some(mac) = self.signer.verify(key, handle) else {
            return Err(Error::InvalidHandle(
                "signature does not match (wrong key, store, or forged)".into(),
            ));
        };
        self.check_writer()?;
        let sh = &self.shared;
        let address = handle.address;
        if !sh.chunk_matches(address, handle.monotonic_id, &mac)? {
            return Err(self.stale());
        }
        let len = sh.chunk(address, chunk::LEN)?.load(Ordering::Relaxed);
        if !layout.valid_payload(address, len) {
            return Err(self.stale());
        }
        let stamp = SlotWord::stamp_for(tag(&mac), self.epoch as u64);
        let mut viewed = false;
        let consumed = update_word(sh.word(address, self.slot)?, |w| {
            (w.stamp == stamp && w.outstanding > 0).then(|| {
                // A slot holding as many views as it can count reads a verified copy.
                viewed = w.views < SlotWord::MAX_VIEWS;
                SlotWord {
                    outstanding: w.outstanding - 1,
                    views: w.views + viewed as u32,
                    ..w
                }
            })
        });
        let leased = consumed && viewed;
        let lease = Lease {
            reader: Arc::clone(self),
            address,
            id: handle.monotonic_id,
            mac,
            len,
            stamp: leased.then_some(stamp),
        };
        if consumed {
            sh.slot(self.slot, slot::ACKS)?
                .fetch_add(1, Ordering::Relaxed);
        }
        if leased {
            // Our lease was taken on whatever chunk is at this address now: make sure it is
            // still ours. (Dropping the lease gives the view back.)
            fence(Ordering::Acquire);
            if !sh.chunk_matches(address, handle.monotonic_id, &mac)? {
                return Err(self.stale());
            }
        }
        Ok(lease)
    }

    fn release_view(&self, address: u64, stamp: u32) {
        if let Ok(word) = self.shared.word(address, self.slot) {
            // Release: our reads of the payload happen before the writer may reuse it.
            update_word(word, |w| {
                (w.stamp == stamp && w.views > 0).then(|| SlotWord {
                    views: w.views - 1,
                    ..w
                })
            });
        }
    }

    pub fn stats(&self) -> Result<Stats> {
        let sh = &self.shared;
        Ok(vec![
            ("slot", self.slot as u64),
            ("capacity", sh.layout.capacity),
            ("n_readers", sh.layout.n_readers as u64),
            (
                "refs",
                sh.slot(self.slot, slot::REFS)?.load(Ordering::Relaxed),
            ),
            (
                "acks",
                sh.slot(self.slot, slot::ACKS)?.load(Ordering::Relaxed),
            ),
            (
                "stale",
                sh.slot(self.slot, slot::STALE)?.load(Ordering::Relaxed),
            ),
            (
                "bytes_in_use",
                sh.header(Counter::BytesInUse.offset())?
                    .load(Ordering::Relaxed),
            ),
            (
                "objects",
                sh.header(Counter::Objects.offset())?
                    .load(Ordering::Relaxed),
            ),
        ])
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if !self.process.is_current() {
            return; // a forked child's copy: the slot is the parent's
        }
        let freed = self.set_state(SlotState::Claimed, SlotState::Free)
            || self.set_state(SlotState::Draining, SlotState::Free);
        if freed && self.shared.liveness == Liveness::Locks {
            let _ = self
                .shared
                .seg
                .unlock(self.shared.layout.slot_lock(self.slot));
        }
    }
}

impl Lease {
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the payload is protected for the lease's lifetime (so it can be viewed).
    pub fn is_protected(&self) -> bool {
        self.stamp.is_some()
    }

    fn payload_offset(&self) -> u64 {
        self.reader.shared.payload_offset(self.address)
    }

    /// Copy the payload into `dst` (exactly `len()` bytes). An unprotected copy is verified
    /// afterwards and reported stale if the writer reused the bytes meanwhile.
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() != self.len() {
            return Err(Error::InvalidArgument(
                "destination has the wrong length".into(),
            ));
        }
        let sh = &self.reader.shared;
        if self.stamp.is_some() {
            sh.seg.read_into(self.payload_offset(), dst)?;
        } else {
            sh.seg.read_into_racy(self.payload_offset(), dst)?;
            // Pairs with P2: if we copied any reused byte, we see the id change.
            fence(Ordering::Acquire);
            if !sh.chunk_matches(self.address, self.id, &self.mac)? {
                return Err(self.reader.stale());
            }
        }
        Ok(())
    }

    /// Copy `dst.len()` payload bytes starting `offset` bytes in (a protected lease only:
    /// the writer cannot reuse those bytes while it lives, so no check is needed after).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        if self.stamp.is_none() {
            return Err(Error::InvalidArgument(
                "read_at needs a protected lease; copy an unprotected payload with copy_to".into(),
            ));
        }
        if offset
            .checked_add(dst.len() as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}+{} lie outside the {}-byte payload",
                dst.len(),
                self.len
            )));
        }
        self.reader
            .shared
            .seg
            .read_into(self.payload_offset() + offset, dst)
    }

    /// A zero-copy view of the payload, for a protected lease (`Err(self)` otherwise).
    pub fn into_view(self) -> std::result::Result<View, Lease> {
        if self.stamp.is_none() {
            return Err(self);
        }
        match self
            .reader
            .shared
            .seg
            .view_address(self.payload_offset(), self.len())
        {
            Ok(ptr) => Ok(View {
                _registration: segment::register_view(ptr, self.len()),
                address: ptr as usize,
                lease: self,
            }),
            Err(_) => Err(self),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // In a forked child the lease is a copy of the parent's: the view it counts is the
        // parent's to give back.
        if let Some(stamp) = self.stamp {
            if self.reader.process.is_current() {
                self.reader.release_view(self.address, stamp);
            }
        }
    }
}

// ----------------------------------------------------------------------------------------
// Maintenance: read a segment without attaching
// ----------------------------------------------------------------------------------------

/// One reader slot as `inspect` sees it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub index: u32,
    pub state: SlotState,
    pub epoch: u32,
    /// The occupant's pid in its own PID namespace (0 when free).
    pub pid: u32,
    pub alive: bool,
    pub refs: u64,
    pub acks: u64,
    pub stale: u64,
}

/// A segment's header, read through a read-only mapping (no slot claimed, nothing written).
#[derive(Debug, Clone)]
pub struct SegmentInfo {
    pub name: String,
    pub layout: Layout,
    pub liveness: Liveness,
    pub total_len: u64,
    pub creator_pid: u64,
    pub creator_alive: bool,
    pub writer_closed: bool,
    pub counters: Vec<(&'static str, u64)>,
    pub readers: Vec<SlotInfo>,
}

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

pub fn inspect(name: &str) -> Result<SegmentInfo> {
    let sh = open_shared(name, Access::ReadOnly)?;
    let load = |field: u64| -> Result<u64> { Ok(sh.header(field)?.load(Ordering::Acquire)) };
    let writer_closed = load(header::WRITER_STATE)? == WRITER_CLOSED;
    let mut readers = Vec::new();
    for s in 0..sh.layout.n_readers {
        let (_, claim) = sh.claim(s)?;
        readers.push(SlotInfo {
            index: s,
            state: claim.state,
            epoch: claim.epoch,
            pid: claim.pid,
            alive: claim.is_occupied() && sh.occupant_alive(s, claim)?,
            refs: sh.slot(s, slot::REFS)?.load(Ordering::Relaxed),
            acks: sh.slot(s, slot::ACKS)?.load(Ordering::Relaxed),
            stale: sh.slot(s, slot::STALE)?.load(Ordering::Relaxed),
        });
    }
    let counters = Counter::ALL
        .iter()
        .map(|&c| Ok((c.name(), load(c.offset())?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(SegmentInfo {
        name: sh.seg.name().to_owned(),
        total_len: sh.layout.total_len(),
        layout: sh.layout,
        liveness: sh.liveness,
        creator_pid: load(header::CREATOR_PID)?,
        creator_alive: sh.writer_alive()?,
        writer_closed,
        counters,
        readers,
    })
}

/// Names in `/dev/shm` that this package made: generated names (`mmc_…`, whatever their
/// content: a truncated or half-made segment has lost or not yet got its magic) and any
/// regular file that starts with this package's magic (segments created with a chosen name).
pub fn list_segments() -> Vec<String> {
    segment::list_names()
        .into_iter()
        .filter(|name| {
            name.starts_with(segment::NAME_PREFIX)
                || segment::read_prefix::<8>(name)
                    .is_ok_and(|m| u64::from_le_bytes(m) == layout::MAGIC)
        })
        .collect()
}

/// Seconds an empty, unlocked file is given to become a segment: the creator takes its lock
/// right after creating the name, so only a creator that died in that instant leaves one.
const CREATION_GRACE_SECS: u64 = 10;

/// Whether a segment's writer lives, as `prune` must decide it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Its writer is alive (in any PID namespace): never remove it.
    Live,
    /// Nobody will use it again: safe to remove. Says why.
    Orphaned(String),
    /// Cannot be decided now (being created, or made by another version whose creator may
    /// run): leave it. Says why.
    Undecided(String),
}

/// Decide whether the segment `name` is left behind. A writer's lock, held in any PID
/// namespace, always means `Live`; a valid segment without it is orphaned; a truncated or
/// garbage one is orphaned unless it may still be being created.
pub fn status(name: &str) -> Result<Status> {
    let probe = segment::probe_file(name, WRITER_LOCK)?;
    if probe.creator_lock_held {
        return Ok(Status::Live);
    }
    match open_shared(name, Access::ReadOnly) {
        Ok(sh) => Ok(match sh.liveness {
            Liveness::Locks => Status::Orphaned("its writer is gone".into()),
            Liveness::Pids if sh.writer_alive()? => Status::Live,
            Liveness::Pids => Status::Orphaned("its writer's process is gone".into()),
        }),
        Err(Error::NotFound(n)) => Err(Error::NotFound(n)),
        Err(err) => {
            let prefix = segment::read_prefix::<16>(name).ok();
            let ours_other_version = prefix.is_some_and(|p| {
                u64::from_le_bytes(p[..8].try_into().expect("8 bytes")) == layout::MAGIC
                    && u64::from_le_bytes(p[8..].try_into().expect("8 bytes")) != LAYOUT_VERSION
            });
            if ours_other_version {
                // Made by another version, which may not take locks: trust its name's pid.
                return Ok(match segment::pid_in_name(name) {
                    Some(pid) if segment::pid_exists(pid) => Status::Undecided(format!(
                        "made by another mmcache version; its creator (pid {pid}) may still run"
                    )),
                    _ => Status::Orphaned("made by another mmcache version, creator gone".into()),
                });
            }
            if probe.size == 0 && probe.age_secs < CREATION_GRACE_SECS {
                return Ok(Status::Undecided(
                    "empty and new: it may be being created".into(),
                ));
            }
            Ok(Status::Orphaned(format!("{err}; no writer holds it")))
        }
    }
}

#[cfg(test)]
mod tests;
