//! The object store: one writer and up to `n_readers` readers over one segment.
//!
//! # Protocol (each Acquire names the Release it pairs with)
//!
//! **Publication.** The writer fills a chunk's header fields, its per-slot words and its
//! payload with plain or Relaxed stores, then stores the chunk's `id` with **Release** (P1).
//! A reader loads `id` with **Acquire** (pairs with P1), so it sees the whole chunk.
//!
//! **References.** Every handle the writer issues adds one `outstanding` reference to the
//! word of every claimed reader slot (`layout::SlotWord`). A reader resolving a handle
//! consumes one of *its own slot's* references with a single CAS that also takes a view
//! lease (`outstanding - 1, views + 1`, **AcqRel**, pairs with the writer's Acquire loads in
//! `holds`), reads, and drops the lease (`views - 1`, Release) unless it hands out a
//! zero-copy view. A reader can never consume another slot's references, nor more than were
//! issued to it, so a duplicated or replayed handle cannot free an object that someone else
//! still needs. A handle replayed to a reader that owes nothing is read without any write to
//! the segment and verified afterwards (seqlock, below).
//!
//! **Reclaim.** The writer evicts a chunk only when it is unpinned and, for every claimed
//! slot, the word is stamped for an earlier occupant or holds no reference and no view
//! (Acquire loads, pairing with the readers' AcqRel/Release CASes). Only the writer issues
//! references, so once that holds, no reader can start a new lease on the chunk. Before
//! reusing the bytes the writer stores `id = 0` and issues a **Release fence** (P2).
//!
//! **Seqlock check for unprotected reads.** A reader without a lease copies the payload,
//! issues an **Acquire fence** (pairs with P2) and re-loads the id and signature words: if
//! the writer reused any byte it copied, it sees the change and reports the handle stale.
//!
//! **Slots.** A reader claims a slot by CAS on its claim word (`epoch << 1 | 1`, AcqRel) and
//! frees it with a Release store. The writer frees the slot of a reader whose process is
//! gone (pid + start time), which credits every reference and view it held: words stamped
//! with its epoch no longer count.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::handle::{Handle, SIGNATURE_LEN, Signer, tag};
use crate::layout::{
    self, LAYOUT_VERSION, Layout, SlotWord, WRITER_CLOSED, WRITER_LIVE, align_up, chunk,
    claim_epoch, claim_is_claimed, claim_word, header, slot,
};
use crate::ring::{Ring, Verdict};
use crate::segment::{self, Access, Segment};

/// Prefix of every segment name this package generates.
pub const NAME_PREFIX: &str = "mmc_";

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

/// Byte offsets of each part inside a payload: every part starts 64-byte aligned.
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

fn to_base36(mut n: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).expect("ASCII digits")
}

/// A fresh segment name: `mmc_<pid>_<random>`, at most 22 characters (macOS allows 30).
pub fn generate_name() -> Result<String> {
    let random = u64::from_le_bytes(segment::random_bytes::<8>()?) % 36u64.pow(8);
    Ok(format!(
        "{NAME_PREFIX}{}_{:0>8}",
        to_base36(segment::current_pid() as u64),
        to_base36(random)
    ))
}

/// Shared view of the segment used by both roles.
#[derive(Debug)]
struct Shared {
    seg: Arc<Segment>,
    layout: Layout,
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

    /// The id and signature words of the chunk at `address` equal the handle's.
    fn chunk_matches(&self, address: u64, id: u64, sig: &[u8; SIGNATURE_LEN]) -> Result<bool> {
        let (lo, hi) = sig_words(sig);
        Ok(
            self.chunk(address, chunk::ID)?.load(Ordering::Relaxed) == id
                && self.chunk(address, chunk::SIG_LO)?.load(Ordering::Relaxed) == lo
                && self.chunk(address, chunk::SIG_HI)?.load(Ordering::Relaxed) == hi,
        )
    }
}

fn sig_words(sig: &[u8; SIGNATURE_LEN]) -> (u64, u64) {
    let lo = u64::from_le_bytes(sig[..8].try_into().expect("8 bytes"));
    let hi = u64::from_le_bytes(sig[8..].try_into().expect("8 bytes"));
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

/// Writer-private bookkeeping for one chunk.
#[derive(Debug)]
struct ChunkMeta {
    /// `None` once invalidated or cleared: the chunk only waits to be reclaimed.
    key: Option<String>,
    id: u64,
    signature: [u8; SIGNATURE_LEN],
    pins: u32,
    /// CLOCK's referenced bit: set on a hit, cleared when the hand passes.
    referenced: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    puts: u64,
    hits: u64,
    evictions: u64,
    refs_issued: u64,
    readers_reclaimed: u64,
    clears: u64,
}

#[derive(Debug)]
struct WriterState {
    ring: Ring<ChunkMeta>,
    keys: HashMap<String, u64>,
    last_id: u64,
    counters: Counters,
    closed: bool,
}

/// The single writer of a segment.
#[derive(Debug)]
pub struct Writer {
    shared: Shared,
    signer: Signer,
    state: Mutex<WriterState>,
}

/// Store counters, as `stats()` reports them.
pub type Stats = Vec<(&'static str, u64)>;

impl Writer {
    /// Create a segment with a ring of `capacity` bytes.
    pub fn create(
        capacity: u64,
        n_readers: u32,
        max_object_size: Option<u64>,
        name: Option<&str>,
    ) -> Result<Writer> {
        let layout = Layout::new(capacity, n_readers, max_object_size)?;
        let name = match name {
            Some(n) if !n.trim_start_matches('/').is_empty() => {
                n.trim_start_matches('/').to_owned()
            }
            Some(_) => return Err(Error::InvalidArgument("segment name is empty".into())),
            None => generate_name()?,
        };
        let total = usize::try_from(layout.total_len())
            .map_err(|_| Error::InvalidArgument("capacity too large for this host".into()))?;
        let seg = Segment::create(&name, total)?;
        let pid = segment::current_pid();
        layout.write(&seg, pid, segment::process_start_time(pid).unwrap_or(0))?;
        Ok(Writer {
            shared: Shared {
                seg: Arc::new(seg),
                layout,
            },
            signer: Signer::new(segment::random_bytes::<32>()?),
            state: Mutex::new(WriterState {
                ring: Ring::new(layout.capacity),
                keys: HashMap::new(),
                last_id: 0,
                counters: Counters::default(),
                closed: false,
            }),
        })
    }

    pub fn name(&self) -> &str {
        self.shared.seg.name()
    }

    pub fn layout(&self) -> Layout {
        self.shared.layout
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

    fn lock(&self) -> Result<MutexGuard<'_, WriterState>> {
        // A panic while holding the lock cannot leave shared memory inconsistent for readers
        // (they verify ids), so a poisoned lock is still usable.
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.closed {
            return Err(Error::Closed);
        }
        Ok(state)
    }

    /// Claimed slots as `(index, epoch)`.
    fn claimed_slots(&self) -> Result<Vec<(u32, u64)>> {
        let mut out = Vec::new();
        for s in 0..self.shared.layout.n_readers {
            // Acquire pairs with the reader's claim CAS / release store.
            let w = self.shared.slot(s, slot::CLAIM)?.load(Ordering::Acquire);
            if claim_is_claimed(w) {
                out.push((s, claim_epoch(w)));
            }
        }
        Ok(out)
    }

    /// Whether slot `s` (claimed in `epoch`) holds a reference or a view on the chunk.
    fn holds(&self, address: u64, sig_tag: u32, s: u32, epoch: u64) -> Result<bool> {
        let w = SlotWord::unpack(self.shared.word(address, s)?.load(Ordering::Acquire));
        Ok(w.stamp == SlotWord::stamp_for(sig_tag, epoch) && (w.outstanding > 0 || w.views > 0))
    }

    /// Whether the occupant of slot `s` is gone; if so, free the slot (crediting everything
    /// it held). `checked` caches the answer for one sweep.
    fn reap_if_dead(
        &self,
        s: u32,
        epoch: u64,
        checked: &mut HashMap<u32, bool>,
        counters: &mut Counters,
    ) -> Result<bool> {
        if let Some(&dead) = checked.get(&s) {
            return Ok(dead);
        }
        let pid = self.shared.slot(s, slot::PID)?.load(Ordering::Acquire);
        let start = self.shared.slot(s, slot::START)?.load(Ordering::Acquire);
        let dead = pid != 0 && !segment::process_alive(pid as u32, start);
        if dead {
            // CAS: only free the slot if it still has the same occupant.
            let freed = self
                .shared
                .slot(s, slot::CLAIM)?
                .compare_exchange(
                    claim_word(epoch, true),
                    claim_word(epoch, false),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok();
            if freed {
                counters.readers_reclaimed += 1;
            }
        }
        checked.insert(s, dead);
        Ok(dead)
    }

    /// Whether the chunk can be reclaimed now (ignoring CLOCK's referenced bit).
    fn reclaimable(
        &self,
        address: u64,
        meta: &ChunkMeta,
        slots: &[(u32, u64)],
        checked: &mut HashMap<u32, bool>,
        counters: &mut Counters,
    ) -> bool {
        if meta.pins > 0 {
            return false;
        }
        let sig_tag = tag(&meta.signature);
        for &(s, epoch) in slots {
            match self.holds(address, sig_tag, s, epoch) {
                Ok(false) => {}
                Ok(true) => {
                    if !matches!(self.reap_if_dead(s, epoch, checked, counters), Ok(true)) {
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

        let slots = self.claimed_slots()?;
        let mut checked = HashMap::new();
        let mut counters = state.counters;
        let meta = ChunkMeta {
            key: Some(key.to_owned()),
            id: 0,
            signature: [0; SIGNATURE_LEN],
            pins: 0,
            referenced: false,
        };
        let placement = state.ring.allocate(size, meta, |address, meta| {
            if meta.key.is_some() && std::mem::take(&mut meta.referenced) {
                return Verdict::Keep; // second chance
            }
            if self.reclaimable(address, meta, &slots, &mut checked, &mut counters) {
                Verdict::Evict
            } else {
                Verdict::Keep
            }
        });
        state.counters = counters;
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
                state.counters.evictions += 1;
            }
        }
        // P2: every reader that copies reused bytes will see `id == 0` (or a newer id).
        fence(Ordering::Release);

        let address = placement.address;
        state.last_id += 1;
        let id = state.last_id;
        let signature = self.signer.sign(key, address, id);
        let (lo, hi) = sig_words(&signature);
        let sh = &self.shared;
        sh.chunk(address, chunk::SIG_LO)?
            .store(lo, Ordering::Relaxed);
        sh.chunk(address, chunk::SIG_HI)?
            .store(hi, Ordering::Relaxed);
        sh.chunk(address, chunk::LEN)?
            .store(payload_len, Ordering::Relaxed);
        sh.chunk(address, chunk::REFS)?.store(1, Ordering::Relaxed);
        let claimed: HashMap<u32, u64> = slots.iter().copied().collect();
        for s in 0..layout.n_readers {
            let word = match claimed.get(&s) {
                Some(&epoch) => {
                    sh.slot(s, slot::REFS)?.fetch_add(1, Ordering::Relaxed);
                    SlotWord {
                        stamp: SlotWord::stamp_for(tag(&signature), epoch),
                        outstanding: 1,
                        views: 0,
                    }
                    .pack()
                }
                None => 0,
            };
            sh.word(address, s)?.store(word, Ordering::Relaxed);
        }
        let payload = sh.payload_offset(address);
        let mut cursor = 0u64;
        for (part, &offset) in parts.iter().zip(&offsets) {
            if offset > cursor {
                sh.seg.zero(payload + cursor, (offset - cursor) as usize)?;
            }
            sh.seg.write_from(payload + offset, part)?;
            cursor = offset + part.len() as u64;
        }
        // P1: publish the chunk.
        sh.chunk(address, chunk::ID)?.store(id, Ordering::Release);

        let meta = state.ring.get_mut(address).expect("just placed");
        meta.id = id;
        meta.signature = signature;
        state.keys.insert(key.to_owned(), address);
        state.counters.puts += 1;
        state.counters.refs_issued += 1;
        self.publish(&state)?;
        Ok(Handle {
            address,
            monotonic_id: id,
            signature,
        })
    }

    pub fn is_cached(&self, key: &str) -> Result<bool> {
        Ok(self.lock()?.keys.contains_key(key))
    }

    pub fn keys(&self) -> Result<Vec<String>> {
        Ok(self.lock()?.keys.keys().cloned().collect())
    }

    /// Issue one more reference to a stored object.
    pub fn get_cached(&self, key: &str) -> Result<Handle> {
        let mut state = self.lock()?;
        let address = *state
            .keys
            .get(key)
            .ok_or_else(|| Error::KeyNotFound(key.to_owned()))?;
        let slots = self.claimed_slots()?;
        let meta = state.ring.get(address).expect("indexed keys have chunks");
        let (id, signature) = (meta.id, meta.signature);
        let sig_tag = tag(&signature);
        for &(s, epoch) in &slots {
            let stamp = SlotWord::stamp_for(sig_tag, epoch);
            let mut overflow = false;
            update_word(self.shared.word(address, s)?, |w| {
                if w.stamp != stamp {
                    // Stamped for an earlier occupant, who is gone: start afresh.
                    return Some(SlotWord {
                        stamp,
                        outstanding: 1,
                        views: 0,
                    });
                }
                match w.outstanding.checked_add(1) {
                    Some(outstanding) => Some(SlotWord { outstanding, ..w }),
                    None => {
                        overflow = true;
                        None
                    }
                }
            });
            if overflow {
                return Err(Error::Full {
                    needed: 0,
                    capacity: self.shared.layout.capacity,
                });
            }
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
        state.counters.hits += 1;
        state.counters.refs_issued += 1;
        self.publish(&state)?;
        Ok(Handle {
            address,
            monotonic_id: id,
            signature,
        })
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

    /// Give back one undelivered reference of every reader slot (the request carrying the
    /// handle was dropped). A no-op if the object is gone already.
    pub fn release(&self, handle: &Handle) -> Result<()> {
        let state = self.lock()?;
        let Some(meta) = state.ring.get(handle.address) else {
            return Ok(());
        };
        if meta.id != handle.monotonic_id {
            return Ok(());
        }
        if meta.signature != handle.signature {
            return Err(Error::InvalidHandle(
                "signature does not match the object".into(),
            ));
        }
        let sig_tag = tag(&meta.signature);
        for (s, epoch) in self.claimed_slots()? {
            let stamp = SlotWord::stamp_for(sig_tag, epoch);
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
        let slots = self.claimed_slots()?;
        let mut checked = HashMap::new();
        let mut counters = state.counters;
        let mut free = Vec::new();
        for (address, meta) in state.ring.iter_mut() {
            meta.key = None;
            meta.pins = 0;
            meta.referenced = false;
            let sig_tag = tag(&meta.signature);
            for &(s, epoch) in &slots {
                let stamp = SlotWord::stamp_for(sig_tag, epoch);
                update_word(self.shared.word(address, s)?, |w| {
                    (w.stamp == stamp && w.outstanding > 0).then_some(SlotWord {
                        outstanding: 0,
                        ..w
                    })
                });
            }
            if self.reclaimable(address, meta, &slots, &mut checked, &mut counters) {
                free.push(address);
            }
        }
        for address in free {
            self.kill(address)?;
            state.ring.remove(address);
        }
        fence(Ordering::Release);
        counters.clears += 1;
        state.counters = counters;
        self.publish(&state)
    }

    /// Whether `handle` is the current entry of `key`: signed for `key` by this store and
    /// naming the chunk `key` is stored in now. No side effect: no reference is issued, no
    /// hit counted, no recency changed (for validating handles a client sent back).
    pub fn verify(&self, handle: &Handle, key: &str) -> Result<bool> {
        let state = self.lock()?;
        if !self.signer.verify(key, handle) {
            return Ok(false);
        }
        Ok(state.keys.get(key) == Some(&handle.address)
            && state
                .ring
                .get(handle.address)
                .is_some_and(|meta| meta.id == handle.monotonic_id))
    }

    /// Copy an object out: the writer's own read. Its lock keeps the bytes from changing.
    pub fn read(&self, handle: &Handle, key: &str) -> Result<Vec<u8>> {
        let state = self.lock()?;
        if !self.shared.layout.valid_chunk_address(handle.address) {
            return Err(Error::InvalidHandle(format!(
                "address {} is out of range",
                handle.address
            )));
        }
        if !self.signer.verify(key, handle) {
            return Err(Error::InvalidHandle("bad signature".into()));
        }
        match state.ring.get(handle.address) {
            Some(meta) if meta.id == handle.monotonic_id => {}
            _ => return Err(Error::Stale),
        }
        let len = self
            .shared
            .chunk(handle.address, chunk::LEN)?
            .load(Ordering::Relaxed);
        let mut out = vec![0u8; len as usize];
        self.shared
            .seg
            .read_into(self.shared.payload_offset(handle.address), &mut out)?;
        Ok(out)
    }

    fn publish(&self, state: &WriterState) -> Result<()> {
        let c = state.counters;
        let objects = state.keys.len() as u64;
        let values = [
            (header::PUTS, c.puts),
            (header::HITS, c.hits),
            (header::EVICTIONS, c.evictions),
            (header::BYTES_IN_USE, state.ring.used()),
            (header::OBJECTS, objects),
            (header::REFS_ISSUED, c.refs_issued),
            (header::LAST_ID, state.last_id),
            (header::READERS_RECLAIMED, c.readers_reclaimed),
            (header::CLEARS, c.clears),
        ];
        for (field, value) in values {
            self.shared.header(field)?.store(value, Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn stats(&self) -> Result<Stats> {
        let state = self.lock()?;
        let slots = self.claimed_slots()?;
        let mut outstanding = 0u64;
        let mut views = 0u64;
        let mut pinned = 0u64;
        for (address, _, meta) in state.ring.iter() {
            pinned += (meta.pins > 0) as u64;
            for &(s, epoch) in &slots {
                let w = SlotWord::unpack(self.shared.word(address, s)?.load(Ordering::Acquire));
                if w.stamp == SlotWord::stamp_for(tag(&meta.signature), epoch) {
                    outstanding += w.outstanding as u64;
                    views += w.views as u64;
                }
            }
        }
        let c = state.counters;
        let l = self.shared.layout;
        Ok(vec![
            ("capacity", l.capacity),
            ("n_readers", l.n_readers as u64),
            ("max_object_size", l.max_object_size),
            ("bytes_in_use", state.ring.used()),
            ("objects", state.keys.len() as u64),
            ("chunks", state.ring.len() as u64),
            ("puts", c.puts),
            ("hits", c.hits),
            ("evictions", c.evictions),
            ("refs_issued", c.refs_issued),
            ("outstanding_refs", outstanding),
            ("views", views),
            ("pinned", pinned),
            ("readers_attached", slots.len() as u64),
            ("readers_reclaimed", c.readers_reclaimed),
            ("clears", c.clears),
            ("last_id", state.last_id),
        ])
    }

    /// Mark the segment closed for readers and remove its name. Only the creating process
    /// does this: a forked child's copy just stops working.
    pub fn close(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.closed {
            return Ok(());
        }
        state.closed = true;
        if self.shared.seg.is_owner() {
            // Release pairs with the reader's Acquire load in `check_writer`.
            self.shared
                .header(header::WRITER_STATE)?
                .store(WRITER_CLOSED, Ordering::Release);
            self.shared.seg.unlink()?;
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

/// One attached reader: owns one reader slot until dropped.
#[derive(Debug)]
pub struct Reader {
    shared: Shared,
    signer: Signer,
    slot: u32,
    epoch: u64,
    /// The process that claimed the slot: only it may free the slot (not a forked child).
    claimant_pid: u32,
    writer_pid: u32,
}

/// The outcome of checking a handle: a payload to copy, protected by a lease or not.
#[derive(Debug)]
pub struct Lease {
    reader: Arc<Reader>,
    address: u64,
    id: u64,
    signature: [u8; SIGNATURE_LEN],
    len: u64,
    /// The stamp of the slot word holding our view, or `None` when reading unprotected
    /// (a replayed handle): then the bytes are verified after the copy.
    stamp: Option<u32>,
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
        let seg = Segment::open(&info.name, Access::ReadWrite)?;
        let layout = Layout::read(&seg)?;
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
        let shared = Shared {
            seg: Arc::new(seg),
            layout,
        };
        let writer_pid = shared.header(header::CREATOR_PID)?.load(Ordering::Relaxed) as u32;
        if shared.header(header::WRITER_STATE)?.load(Ordering::Acquire) != WRITER_LIVE {
            return Err(Error::WriterGone(format!(
                "the writer of {:?} closed it",
                info.name
            )));
        }
        let pid = segment::current_pid();
        let start = segment::process_start_time(pid).unwrap_or(0);
        for s in 0..layout.n_readers {
            let claim = shared.slot(s, slot::CLAIM)?;
            let current = claim.load(Ordering::Acquire);
            if claim_is_claimed(current) {
                let other = shared.slot(s, slot::PID)?.load(Ordering::Acquire);
                let other_start = shared.slot(s, slot::START)?.load(Ordering::Acquire);
                if other == 0 || segment::process_alive(other as u32, other_start) {
                    continue;
                }
            }
            let epoch = claim_epoch(current) + 1;
            // AcqRel: pairs with the previous occupant's Release store when it freed the slot.
            if claim
                .compare_exchange(
                    current,
                    claim_word(epoch, true),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
            {
                continue;
            }
            for field in [slot::REFS, slot::ACKS, slot::STALE] {
                shared.slot(s, field)?.store(0, Ordering::Relaxed);
            }
            shared.slot(s, slot::START)?.store(start, Ordering::Release);
            shared
                .slot(s, slot::PID)?
                .store(pid as u64, Ordering::Release);
            return Ok(Arc::new(Reader {
                shared,
                signer: Signer::new(info.secret),
                slot: s,
                epoch,
                claimant_pid: pid,
                writer_pid,
            }));
        }
        Err(Error::NoReaderSlot(layout.n_readers))
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

    fn check_writer(&self) -> Result<()> {
        // Acquire pairs with the writer's Release store in `Writer::close`.
        if self
            .shared
            .header(header::WRITER_STATE)?
            .load(Ordering::Acquire)
            != WRITER_LIVE
        {
            return Err(Error::WriterGone(format!(
                "the writer of {:?} closed it",
                self.name()
            )));
        }
        // One syscall on the hot path; a reused pid is caught by the writer-state check
        // only if the writer closed cleanly, which is the common case.
        if !segment::pid_exists(self.writer_pid) {
            return Err(Error::WriterGone(format!(
                "the writer process (pid {}) of {:?} exited",
                self.writer_pid,
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
    /// shared byte (signature, bounds) comes first.
    pub fn acquire(self: &Arc<Self>, handle: &Handle, key: &str) -> Result<Lease> {
        let layout = self.shared.layout;
        if handle.monotonic_id == 0 || !layout.valid_chunk_address(handle.address) {
            return Err(Error::InvalidHandle(format!(
                "address {} / id {} is out of range",
                handle.address, handle.monotonic_id
            )));
        }
        if !self.signer.verify(key, handle) {
            return Err(Error::InvalidHandle(
                "signature does not match (wrong key, store, or forged)".into(),
            ));
        }
        self.check_writer()?;
        let sh = &self.shared;
        let address = handle.address;
        // Acquire pairs with P1 (the writer's Release store of the id).
        if sh.chunk(address, chunk::ID)?.load(Ordering::Acquire) != handle.monotonic_id
            || !sh.chunk_matches(address, handle.monotonic_id, &handle.signature)?
        {
            return Err(self.stale());
        }
        let len = sh.chunk(address, chunk::LEN)?.load(Ordering::Relaxed);
        if !layout.valid_payload(address, len) {
            return Err(self.stale());
        }
        let stamp = SlotWord::stamp_for(tag(&handle.signature), self.epoch);
        let leased = update_word(sh.word(address, self.slot)?, |w| {
            (w.stamp == stamp && w.outstanding > 0 && w.views < u16::MAX).then(|| SlotWord {
                outstanding: w.outstanding - 1,
                views: w.views + 1,
                ..w
            })
        });
        let lease = Lease {
            reader: Arc::clone(self),
            address,
            id: handle.monotonic_id,
            signature: handle.signature,
            len,
            stamp: leased.then_some(stamp),
        };
        if leased {
            sh.slot(self.slot, slot::ACKS)?
                .fetch_add(1, Ordering::Relaxed);
            // Our lease was taken on whatever chunk is at this address now: make sure it is
            // still ours. (Dropping the lease gives the view back.)
            fence(Ordering::Acquire);
            if !sh.chunk_matches(address, handle.monotonic_id, &handle.signature)? {
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
                sh.header(header::BYTES_IN_USE)?.load(Ordering::Relaxed),
            ),
            (
                "objects",
                sh.header(header::OBJECTS)?.load(Ordering::Relaxed),
            ),
        ])
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if segment::current_pid() != self.claimant_pid {
            return; // a forked child's copy: the slot is the parent's
        }
        if let Ok(claim) = self.shared.slot(self.slot, slot::CLAIM) {
            // Release pairs with the next claimant's AcqRel CAS and the writer's Acquire load:
            // every acknowledgement we made happens before the slot is seen free.
            let _ = claim.compare_exchange(
                claim_word(self.epoch, true),
                claim_word(self.epoch, false),
                Ordering::Release,
                Ordering::Relaxed,
            );
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
        sh.seg.read_into(self.payload_offset(), dst)?;
        if self.stamp.is_none() {
            // Pairs with P2: if we copied any reused byte, we see the id change.
            fence(Ordering::Acquire);
            if !sh.chunk_matches(self.address, self.id, &self.signature)? {
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

    /// The payload's address in this process, only for a protected lease; valid while the
    /// lease lives.
    pub fn protected_ptr(&self) -> Option<*const u8> {
        self.stamp?;
        self.reader
            .shared
            .seg
            .view_address(self.payload_offset(), self.len())
            .ok()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(stamp) = self.stamp {
            self.reader.release_view(self.address, stamp);
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
    pub claimed: bool,
    pub epoch: u64,
    pub pid: u64,
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
    pub total_len: u64,
    pub creator_pid: u64,
    pub creator_alive: bool,
    pub writer_closed: bool,
    pub counters: Vec<(&'static str, u64)>,
    pub readers: Vec<SlotInfo>,
}

pub fn inspect(name: &str) -> Result<SegmentInfo> {
    let seg = Segment::open(name, Access::ReadOnly)?;
    let layout = Layout::read(&seg)?;
    let sh = Shared {
        seg: Arc::new(seg),
        layout,
    };
    let load = |field: u64| -> Result<u64> { Ok(sh.header(field)?.load(Ordering::Acquire)) };
    let creator_pid = load(header::CREATOR_PID)?;
    let creator_start = load(header::CREATOR_START)?;
    let writer_closed = load(header::WRITER_STATE)? == WRITER_CLOSED;
    let mut readers = Vec::new();
    for s in 0..layout.n_readers {
        let claim = sh.slot(s, slot::CLAIM)?.load(Ordering::Acquire);
        let pid = sh.slot(s, slot::PID)?.load(Ordering::Acquire);
        let start = sh.slot(s, slot::START)?.load(Ordering::Acquire);
        let claimed = claim_is_claimed(claim);
        readers.push(SlotInfo {
            index: s,
            claimed,
            epoch: claim_epoch(claim),
            pid: if claimed { pid } else { 0 },
            alive: claimed && (pid == 0 || segment::process_alive(pid as u32, start)),
            refs: sh.slot(s, slot::REFS)?.load(Ordering::Relaxed),
            acks: sh.slot(s, slot::ACKS)?.load(Ordering::Relaxed),
            stale: sh.slot(s, slot::STALE)?.load(Ordering::Relaxed),
        });
    }
    let counters = [
        ("puts", header::PUTS),
        ("hits", header::HITS),
        ("evictions", header::EVICTIONS),
        ("bytes_in_use", header::BYTES_IN_USE),
        ("objects", header::OBJECTS),
        ("refs_issued", header::REFS_ISSUED),
        ("last_id", header::LAST_ID),
        ("readers_reclaimed", header::READERS_RECLAIMED),
        ("clears", header::CLEARS),
    ]
    .into_iter()
    .map(|(k, f)| Ok((k, load(f)?)))
    .collect::<Result<Vec<_>>>()?;
    Ok(SegmentInfo {
        name: sh.seg.name().to_owned(),
        total_len: layout.total_len(),
        layout,
        creator_pid,
        creator_alive: !writer_closed && segment::process_alive(creator_pid as u32, creator_start),
        writer_closed,
        counters,
        readers,
    })
}

/// Names of the segments on this host that carry this package's magic.
pub fn list_segments() -> Vec<String> {
    use std::io::Read;
    segment::list_names()
        .into_iter()
        .filter(|name| {
            let mut magic = [0u8; 8];
            std::fs::File::open(format!("{}/{name}", segment::SHM_DIR))
                .and_then(|mut f| f.read_exact(&mut magic))
                .is_ok()
                && u64::from_le_bytes(magic) == layout::MAGIC
        })
        .collect()
}

#[cfg(test)]
mod tests;
