//! The readers: attaching (claiming a slot), resolving handles into leases, copying or
//! viewing payloads, and giving the slot back. The orderings are in the module docs of
//! [`store`](super).

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};

use super::{ReaderInfo, Shared, Stats, open_shared, update_word};
use crate::error::{Error, Result};
use crate::handle::{Handle, MAC_LEN, Signer, tag};
use crate::layout::{
    Claim, Counter, LAYOUT_VERSION, Layout, Liveness, SlotState, SlotWord, chunk, slot,
};
use crate::segment::{self, Access, Process, Registration, written_whole};

/// One attached reader: occupies one reader slot until dropped.
#[derive(Debug)]
pub struct Reader {
    /// The store's tests reach the segment through it.
    pub(super) shared: Shared,
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

    /// `Lease::read_at_uninit` of the view's payload.
    pub fn read_at_uninit(&self, offset: u64, dst: &mut [MaybeUninit<u8>]) -> Result<()> {
        self.lease.read_at_uninit(offset, dst)
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
        // Before a slot is taken: a reader of another store's secret could verify nothing.
        let signer = Signer::new(info.secret);
        shared.check_secret(&signer, "reader")?;
        if !shared.any_writer_alive()? {
            return Err(Error::WriterGone(format!(
                "every writer of {:?} closed it or exited",
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
                signer,
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
        if !self.shared.any_writer_alive()? {
            return Err(Error::WriterGone(format!(
                "every writer of {:?} closed it or exited",
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
        // Checked again after the length was read (Acquire fence, pairs with P2/P3): a length
        // read from a block reused meanwhile would bound the copy by another chunk's word,
        // reaching pages nobody reserved (a SIGBUS where /dev/shm is full).
        fence(Ordering::Acquire);
        if !sh.chunk_matches(address, handle.monotonic_id, &mac)?
            || !layout.valid_payload(address, len)
        {
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
            // Release: a writer that sees the count (Acquire) sees the reference gone from
            // the word (a ring it found full of unread objects may have room: `ring::Stuck`).
            sh.slot(self.slot, slot::ACKS)?
                .fetch_add(1, Ordering::Release);
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
        self.copy_to_uninit(written_whole(dst))
    }

    /// [`Lease::copy_to`] into memory not written yet (see `Segment::read_into_uninit`).
    pub fn copy_to_uninit(&self, dst: &mut [MaybeUninit<u8>]) -> Result<()> {
        if dst.len() != self.len() {
            return Err(Error::InvalidArgument(
                "destination has the wrong length".into(),
            ));
        }
        let sh = &self.reader.shared;
        if self.stamp.is_some() {
            sh.seg.read_into_uninit(self.payload_offset(), dst)?;
        } else {
            sh.seg.read_into_racy_uninit(self.payload_offset(), dst)?;
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
        self.read_at_uninit(offset, written_whole(dst))
    }

    /// [`Lease::read_at`] into memory not written yet (see `Segment::read_into_uninit`).
    pub fn read_at_uninit(&self, offset: u64, dst: &mut [MaybeUninit<u8>]) -> Result<()> {
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
            .read_into_uninit(self.payload_offset() + offset, dst)
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
