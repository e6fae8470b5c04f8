//! A writer of the store: creating a store or joining one, closing, and the operations on
//! stored objects. The orderings it keeps (P1–P3, I1/I2, S1/S2) are in the module docs of
//! [`store`](super); puts are in `writer/put.rs`, the writer's own copies out (`read`,
//! `read_key`, `read_meta`, `verify`) in `writer/read.rs`, claims in `writer/claims.rs`,
//! clearing, invalidating and statistics in `writer/maintain.rs`, the private bookkeeping in
//! `writer/state.rs`.
//!
//! A `Writer` may be used from many threads at once: everything shared lives in the segment
//! (lock-free, or under the ring or the index lock), and its private bookkeeping is behind a
//! mutex held for a few instructions. Lookups (`is_cached`) take no lock at all, not even that one.
//! Lock order: the ring lock, the allocation buffer's mutex, the index lock, the private
//! mutex; never the other way round.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::index::{Entry, Query};
use super::lock::{IndexGuard, LockGuard};
use super::{ReaderInfo, Shared, WriterInfo, crash, shared_over, update_word};
use crate::error::{Error, Result};
use crate::handle::{Handle, Signer};
use crate::keyhash::KeyHasher;
use crate::layout::{
    BlockKind, BlockState, Config, Counter, LAYOUT_VERSION, Layout, Liveness, PinWord, SlotState,
    SlotWord, WRITER_LOCK, WriterId, chunk, slot,
};
use crate::segment::{self, Process, Segment};
use state::{Private, Release};

mod claims;
mod lab;
mod maintain;
mod put;
mod read;
mod state;

/// Lookups retried when the chunk they found was being evicted or replaced meanwhile.
const ATTEMPTS: usize = 4;

/// One writer of a store (the one that created it, or one that joined).
#[derive(Debug)]
pub struct Writer {
    /// The store's tests reach the segment through it.
    pub(super) shared: Shared,
    signer: Signer,
    hasher: KeyHasher,
    pub(super) me: WriterId,
    process: Process,
    /// Set by `close`: no operation may take a hazard or a reservation after it (each
    /// checks after taking one; `close` waits for those taken before), nor start one that
    /// may take a lock (`enter`).
    pub(super) closing: AtomicBool,
    /// Operations in progress that may take a store lock (`enter`): `close` waits for them
    /// before it gives the slot back, so no thread ever takes a lock under the identity of a
    /// writer that left (a waiter would find it dead and take the lock over from it).
    busy: AtomicUsize,
    private: Mutex<Private>,
    /// The allocation buffer small puts carve from (`writer/lab.rs`). Its mutex may be
    /// taken while holding the ring lock, never the ring lock while holding it.
    lab: Mutex<Option<lab::Lab>>,
    /// Small puts still to reserve on their own after a refill found no room (`lab.rs`).
    lab_back_off: AtomicU32,
    /// What its last sweeps that found nothing saw (`put.rs`). Taken under the ring lock
    /// (and the index lock), and nothing is taken under it.
    full: Mutex<put::Full>,
}

/// One of this writer's hazard words, naming the chunk an operation holds (S1 in the
/// protocol): while it names it, the chunk is not evicted, so its words are that chunk's.
/// Given back with a Release store.
pub(super) struct Protected<'a> {
    hazard: &'a AtomicU64,
}

impl Drop for Protected<'_> {
    fn drop(&mut self) {
        self.hazard.store(0, Ordering::Release);
    }
}

impl Writer {
    /// Create a store of one writer (this one) with a ring of `capacity` bytes.
    pub fn create(
        capacity: u64,
        n_readers: u32,
        max_object_size: Option<u64>,
        name: Option<&str>,
    ) -> Result<Writer> {
        Writer::create_with(&Config::new(capacity, n_readers, max_object_size), name)
    }

    /// Create a store, this writer its first.
    pub fn create_with(config: &Config, name: Option<&str>) -> Result<Writer> {
        let layout = Layout::new(config)?;
        let name_given = name.is_some();
        let name = match name {
            Some(n) => segment::validate_name(n)?.to_owned(),
            None => segment::generate_name()?,
        };
        let total = usize::try_from(layout.total_len())
            .map_err(|_| Error::InvalidArgument("capacity too large for this host".into()))?;
        // What dead creators left goes first (SPEC §5, guarantee 10): the new store may need
        // their space, and "the next store's creation frees it" is the promise.
        super::remove_orphans();
        if name_given {
            // An orphan of this name that a sweep elsewhere is removing: wait for it to go, or
            // remove it here, rather than find the name taken. An empty file a creator left
            // is judged only once it can no longer be one being created.
            super::wait_out_creation_grace(&name);
            let _ = super::remove_if_orphaned(&name, true);
        }
        // The header and the slot tables are read by every process from the start; the key
        // index and the ring are reserved in the background and by the puts that need them.
        let eager = usize::try_from(layout.bucket_offset(0)).unwrap_or(total);
        let seg = Segment::create(&name, total, WRITER_LOCK, eager)?;
        let liveness = if seg.holds_locks() {
            Liveness::Locks
        } else {
            Liveness::Pids
        };
        if liveness == Liveness::Pids && layout.max_writers > 1 {
            return Err(Error::InvalidArgument(
                "max_writers > 1 needs open-file-description locks, which this kernel or \
                 /dev/shm does not offer (Linux 3.15 or later, tmpfs)"
                    .into(),
            ));
        }
        let signer = Signer::new(segment::random_bytes::<32>()?);
        let pid = segment::current_pid();
        layout.write(
            &seg,
            pid,
            segment::process_start_time(pid).unwrap_or(0),
            liveness,
            signer.verifier(),
        )?;
        let shared = shared_over(seg)?;
        let me = shared
            .claim_writer_slot()?
            .ok_or_else(|| Error::Corrupt("a new store has no free writer slot".into()))?;
        // From here on the store's writers decide when the name goes (the last to close).
        shared.seg.keep_on_drop();
        Writer::new(shared, signer, me)
    }

    /// Join the store `info` names as one more writer (in this process or another).
    pub fn join(info: &WriterInfo) -> Result<Writer> {
        if info.layout_version != LAYOUT_VERSION {
            return Err(Error::Corrupt(format!(
                "writer handle is for layout version {}, this build reads version \
                 {LAYOUT_VERSION}",
                info.layout_version
            )));
        }
        let shared = shared_over(Segment::open_writer(&info.name)?)?;
        let l = shared.layout;
        if (l.capacity, l.n_readers, l.max_object_size, l.max_writers)
            != (
                info.capacity,
                info.n_readers,
                info.max_object_size,
                info.max_writers,
            )
        {
            return Err(Error::Corrupt(format!(
                "segment {:?} does not match its writer handle (capacity, n_readers, \
                 max_object_size or max_writers differ)",
                info.name
            )));
        }
        let signer = Signer::new(info.secret);
        shared.check_secret(&signer, "writer")?;
        if shared.liveness != Liveness::Locks {
            return Err(Error::InvalidArgument(
                "this store tells liveness by pids (no OFD locks): it has one writer".into(),
            ));
        }
        let me = shared.join_writers()?;
        let writer = Writer::new(shared, signer, me)?;
        // Claims of writers that died (the one whose slot this may be among) are void;
        // dropping them now keeps the claim count true.
        writer.reap_dead_claims()?;
        Ok(writer)
    }

    fn new(shared: Shared, signer: Signer, me: WriterId) -> Result<Writer> {
        crash::init();
        let first_set = u32::from_le_bytes(segment::random_bytes::<4>()?);
        Ok(Writer {
            hasher: KeyHasher::for_secret(signer.secret()),
            private: Mutex::new(Private::new(me.slot, first_set)),
            shared,
            signer,
            me,
            process: Process::current(),
            closing: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            lab: Mutex::new(None),
            lab_back_off: AtomicU32::new(0),
            full: Mutex::new(put::Full::default()),
        })
    }

    /// A writer that tells liveness by pids even though locks work (tests of the fallback).
    #[cfg(test)]
    pub(super) fn create_with_liveness(
        capacity: u64,
        n_readers: u32,
        liveness: Liveness,
    ) -> Result<Writer> {
        let mut w = Writer::create(capacity, n_readers, None, None)?;
        if liveness == Liveness::Pids {
            w.shared.seg.unlock(WRITER_LOCK)?;
            w.shared
                .seg
                .unlock(w.shared.layout.writer_slot_lock(w.me.slot))?;
            w.shared
                .header(crate::layout::header::LIVENESS)?
                .store(liveness.code(), Ordering::Relaxed);
        }
        w.shared.liveness = liveness;
        Ok(w)
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

    /// This writer's slot in the store's writer table.
    pub fn slot(&self) -> u32 {
        self.me.slot
    }

    pub fn reader_info(&self) -> ReaderInfo {
        let l = self.shared.layout;
        ReaderInfo {
            name: self.name().to_owned(),
            capacity: l.capacity,
            n_readers: l.n_readers,
            max_object_size: l.max_object_size,
            layout_version: LAYOUT_VERSION,
            secret: *self.signer.secret(),
        }
    }

    pub fn writer_info(&self) -> WriterInfo {
        let l = self.shared.layout;
        WriterInfo {
            name: self.name().to_owned(),
            capacity: l.capacity,
            n_readers: l.n_readers,
            max_object_size: l.max_object_size,
            max_writers: l.max_writers,
            layout_version: LAYOUT_VERSION,
            secret: *self.signer.secret(),
        }
    }

    /// Refuse use from a forked child or after `close`.
    fn check_open(&self) -> Result<()> {
        if !self.process.is_current() {
            return Err(Error::WrongProcess("this shared-memory writer".into()));
        }
        if self.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Start an operation that may take a store lock: refused from a forked child or once
    /// `close` began; `close` waits until the returned token is dropped. (Dekker's pairing
    /// with `close`: the count goes up before `closing` is read, `closing` is set before the
    /// count is read, both SeqCst, so either the operation sees `closing` or `close` sees it.)
    pub(super) fn enter(&self) -> Result<Busy<'_>> {
        self.check_open()?;
        self.busy.fetch_add(1, Ordering::SeqCst);
        let busy = Busy(&self.busy);
        if self.closing.load(Ordering::SeqCst) {
            return Err(Error::Closed); // `busy` drops, and counts down
        }
        Ok(busy)
    }

    /// Count `by` in this writer's own counter `c` (one of `Counter::writer_field`'s). The
    /// caller holds the private mutex, so this writer's threads take turns: a load and a
    /// store suffice.
    fn count(&self, c: Counter, by: u64) {
        if let Some(word) = c
            .writer_field()
            .and_then(|field| self.shared.writer_slot(self.me.slot, field).ok())
        {
            word.store(
                word.load(Ordering::Relaxed).wrapping_add(by),
                Ordering::Relaxed,
            );
        }
    }

    fn private(&self) -> MutexGuard<'_, Private> {
        // Nothing in the private state is left inconsistent by a panic: still usable.
        self.private.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ring lock; repairs what a holder that died left half done, if it was taken over.
    /// Taken inside an operation (`enter`), or by `close`.
    fn lock(&self) -> Result<LockGuard<'_>> {
        self.debug_assert_entered();
        let guard = self.shared.lock(self.me)?;
        if guard.taken_over() {
            self.shared.repair(&guard)?;
        }
        Ok(guard)
    }

    /// The index lock (repaired likewise); taken inside the ring lock, never around it.
    fn lock_index(&self) -> Result<IndexGuard<'_>> {
        self.debug_assert_entered();
        self.shared.lock_index(self.me)
    }

    fn debug_assert_entered(&self) {
        debug_assert!(
            self.busy.load(Ordering::Relaxed) > 0 || self.closing.load(Ordering::Relaxed),
            "a store lock taken outside `enter`"
        );
    }

    #[inline(always)] // (see `is_cached`)
    pub(super) fn query<'k>(&self, key: &'k str) -> Query<'k> {
        Query::new(&self.hasher, key)
    }

    /// Protect the chunk `entry` names (S1), if it is still LIVE with that id: name it in a
    /// free hazard word of this writer (SeqCst CAS), then check it. With every hazard word in
    /// use (that many of this writer's threads in the middle of an operation), wait for one.
    pub(super) fn protect(&self, entry: &Entry) -> Result<Option<Protected<'_>>> {
        let hazard = loop {
            let mut taken = None;
            for h in 0..slot::HAZARDS {
                let word = self
                    .shared
                    .writer_slot(self.me.slot, slot::HAZARD + 8 * h)?;
                if word
                    .compare_exchange(0, entry.id, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok()
                {
                    taken = Some(word);
                    break;
                }
            }
            match taken {
                Some(word) => break word,
                None => std::thread::yield_now(),
            }
        };
        let protected = Protected { hazard };
        // SeqCst, after the SeqCst CAS: `close` sets the flag, then looks for hazards.
        if self.closing.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        let state = self
            .shared
            .chunk(entry.address, chunk::STATE)?
            .load(Ordering::SeqCst);
        let id = self
            .shared
            .chunk(entry.address, chunk::ID)?
            .load(Ordering::SeqCst);
        Ok(
            (BlockState::unpack(state).kind == BlockKind::Live && id == entry.id)
                .then_some(protected),
        )
    }

    /// [`Writer::protect`], and if that fails because the chunk is mid-eviction, settle it
    /// and try once more: the ring lock is taken (and given back), which waits for the
    /// writer deciding about it, or takes over from one that died and repairs what it left,
    /// so a chunk that was only being judged is live again. `None`: gone.
    fn protect_settled(&self, entry: &Entry) -> Result<Option<Protected<'_>>> {
        if let Some(protected) = self.protect(entry)? {
            return Ok(Some(protected));
        }
        let busy = self.enter()?;
        drop(self.lock()?);
        drop(busy);
        self.protect(entry)
    }

    /// Find `key`'s chunk and protect it: `None` if the key is not stored.
    fn find_protected(&self, query: &Query<'_>) -> Result<Option<(Entry, Protected<'_>)>> {
        for _ in 0..ATTEMPTS {
            let Some(entry) = self.shared.lookup(query)? else {
                return Ok(None);
            };
            if let Some(protected) = self.protect_settled(&entry)? {
                return Ok(Some((entry, protected)));
            }
        }
        Ok(None)
    }

    /// Whether `key` is stored (no reference, hit or recency change; no lock).
    ///
    /// Always inlined: returned through memory, the result was stored in parts and reloaded
    /// whole (a store-forwarding stall, a fifth of a lookup's time).
    #[inline(always)]
    pub fn is_cached(&self, key: &str) -> Result<bool> {
        self.check_open()?;
        Ok(self.shared.lookup(&self.query(key))?.is_some())
    }

    /// The monotonic id of the object stored under `key` now, if one is.
    pub fn stored_id(&self, key: &str) -> Result<Option<u64>> {
        self.check_open()?;
        Ok(self.shared.lookup(&self.query(key))?.map(|entry| entry.id))
    }

    /// Every stored key (a snapshot).
    pub fn keys(&self) -> Result<Vec<String>> {
        self.check_open()?;
        self.shared.keys()
    }

    /// Issue one more reference to a stored object. `Error::Saturated` (nothing changed)
    /// when a reader slot already holds as many unread references to it as it can count.
    pub fn get_cached(&self, key: &str) -> Result<Handle> {
        self.get_cached_unpinning(key, None)
    }

    /// [`Writer::get_cached`], and if the object issued is the one `pinned` names (by
    /// monotonic id, from [`Writer::pin_object`]), one of this writer's pins on it undone, in
    /// the same lookup: the handle's reference protects it from then on. The pin stays when
    /// the reference is refused (`Error::Saturated`) or `key` names another object now.
    pub fn get_cached_unpinning(&self, key: &str, pinned: Option<u64>) -> Result<Handle> {
        self.check_open()?;
        let query = self.query(key);
        let Some((entry, _protected)) = self.find_protected(&query)? else {
            return Err(Error::KeyNotFound(key.to_owned()));
        };
        let sh = &self.shared;
        let sig_tag = sh
            .chunk(entry.address, chunk::SIG_LO)?
            .load(Ordering::Relaxed) as u32;
        let mut private = self.private();
        let members = &private.reader_set(sh)?.members;
        let referenced = self.add_references(key, entry.address, sig_tag, members)?;
        crash::point("issue.protected");
        let state = sh.chunk(entry.address, chunk::STATE)?;
        if state.load(Ordering::Relaxed) & BlockState::REFERENCED_BIT == 0 {
            state.fetch_or(BlockState::REFERENCED_BIT, Ordering::Relaxed);
        }
        let handle = private.issue(&self.signer, key, (entry.address, entry.id));
        self.count(Counter::Hits, 1);
        self.count(Counter::RefsIssued, referenced);
        if pinned == Some(entry.id) {
            self.change_pin_word(entry.address, |pins| pins.saturating_sub(1))?;
        }
        Ok(handle)
    }

    /// One more reference per member of a reader set on the (protected) chunk at `address`;
    /// how many were added (none for a member that left its slot since the set was loaded).
    /// Other writers may be adding theirs, so each word's limit is checked in its own CAS,
    /// and a refusal undoes the ones before (`Error::Saturated`, nothing changed).
    pub(super) fn add_references(
        &self,
        key: &str,
        address: u64,
        sig_tag: u32,
        members: &[(u32, u32)],
    ) -> Result<u64> {
        let sh = &self.shared;
        let mut added = 0;
        for (i, &(s, epoch)) in members.iter().enumerate() {
            let stamp = SlotWord::stamp_for(sig_tag, epoch as u64);
            let (mut saturated, mut left) = (false, false);
            update_word(sh.word(address, s)?, |w| {
                (saturated, left) = (false, false);
                if w.stamp != stamp {
                    // Stamped for another occupant. If the member still holds the slot, that
                    // one is gone: start afresh (the chunk is protected, so this word is its
                    // own). If the member left since the set was loaded, the word may be its
                    // successor's, with views that protect leases: left alone. The claim is
                    // loaded after the word, so a successor stamped before that load is seen
                    // (its stamping writer loaded the claim before its Release CAS, which the
                    // word's Acquire load read); one stamped after it changes the word, which
                    // fails this CAS and judges again.
                    left = !sh.claim(s).is_ok_and(|(_, claim)| {
                        claim.state == SlotState::Claimed && claim.epoch == epoch
                    });
                    return (!left).then_some(SlotWord {
                        stamp,
                        outstanding: 1,
                        views: 0,
                    });
                }
                saturated = w.outstanding >= SlotWord::MAX_OUTSTANDING;
                (!saturated).then_some(SlotWord {
                    outstanding: w.outstanding + 1,
                    ..w
                })
            });
            if left {
                continue;
            }
            if saturated {
                for &(s, epoch) in &members[..i] {
                    self.credit(address, sig_tag, s, epoch)?;
                }
                return Err(Error::Saturated {
                    key: key.to_owned(),
                    slot: s,
                    limit: SlotWord::MAX_OUTSTANDING,
                });
            }
            sh.slot(s, slot::REFS)?.fetch_add(1, Ordering::Relaxed);
            added += 1;
        }
        Ok(added)
    }

    /// Take back one reference of reader slot `(s, epoch)` on the chunk tagged `sig_tag`.
    fn credit(&self, address: u64, sig_tag: u32, s: u32, epoch: u32) -> Result<()> {
        let stamp = SlotWord::stamp_for(sig_tag, epoch as u64);
        let given_back = update_word(self.shared.word(address, s)?, |w| {
            (w.stamp == stamp && w.outstanding > 0).then(|| SlotWord {
                outstanding: w.outstanding - 1,
                ..w
            })
        });
        if given_back {
            // Acknowledged on the reader's behalf (it will never see the handle), so its
            // outstanding count (refs - acks, `inspect`) returns to where it was. Only for the
            // occupant the reference was issued to: the word's stamp matched.
            // Release: as a reader's acknowledgement (`Reader::acquire`).
            self.shared
                .slot(s, slot::ACKS)?
                .fetch_add(1, Ordering::Release);
        }
        Ok(())
    }

    /// Change this writer's pin count on `key`'s chunk by `f` (under protection: the word is
    /// that chunk's). Whether the key was stored.
    fn change_pins(&self, key: &str, f: impl Fn(u32) -> u32) -> Result<bool> {
        Ok(self.change_pins_of(key, None, f)?.is_some())
    }

    /// [`Writer::change_pins`] of `key`'s object if it is the one with monotonic id `id`
    /// (any object with `None`): the id of the object whose pins changed, if any.
    fn change_pins_of(
        &self,
        key: &str,
        id: Option<u64>,
        f: impl Fn(u32) -> u32,
    ) -> Result<Option<u64>> {
        self.check_open()?;
        let Some((entry, _protected)) = self.find_protected(&self.query(key))? else {
            return Ok(None);
        };
        if id.is_some_and(|id| id != entry.id) {
            return Ok(None);
        }
        self.change_pin_word(entry.address, f)?;
        Ok(Some(entry.id))
    }

    /// Change this writer's pin count on the (protected) chunk at `address` by `f`.
    fn change_pin_word(&self, address: u64, f: impl Fn(u32) -> u32) -> Result<()> {
        let epoch = self.me.epoch;
        let word = self.shared.pin_word(address, self.me.slot)?;
        // Only this writer changes its word (its threads one CAS at a time).
        let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
            let pin = PinWord::unpack(w).for_epoch(epoch);
            Some(
                PinWord {
                    pins: f(pin.pins),
                    ..pin
                }
                .pack(),
            )
        });
        Ok(())
    }

    /// Protect a stored object from eviction until a matching `unpin` (pins are counted per
    /// writer; a writer's pins end with it, and with the key's invalidation).
    pub fn pin(&self, key: &str) -> Result<()> {
        if self.change_pins(key, |pins| pins.saturating_add(1))? {
            Ok(())
        } else {
            Err(Error::KeyNotFound(key.to_owned()))
        }
    }

    /// [`Writer::pin`], returning the monotonic id of the object pinned (`None`: `key` is not
    /// stored), for an undo that cannot reach a later object under the same key
    /// ([`Writer::unpin_object`], [`Writer::get_cached_unpinning`]).
    pub fn pin_object(&self, key: &str) -> Result<Option<u64>> {
        self.change_pins_of(key, None, |pins| pins.saturating_add(1))
    }

    /// Undo one of this writer's pins on `key`'s object if it is still the one with
    /// monotonic id `id` (a no-op otherwise: that object was invalidated or replaced, which
    /// ended its pins).
    pub fn unpin_object(&self, key: &str, id: u64) -> Result<()> {
        self.change_pins_of(key, Some(id), |pins| pins.saturating_sub(1))?;
        Ok(())
    }

    /// Undo one of this writer's `pin`s; a no-op for an absent or unpinned key.
    pub fn unpin(&self, key: &str) -> Result<()> {
        self.change_pins(key, |pins| pins.saturating_sub(1))?;
        Ok(())
    }

    /// Give back the references one undelivered handle holds (the request carrying it was
    /// dropped): one for each reader slot it was issued to, and no other (a reader that
    /// attached later keeps what later handles owe it). Only handles this writer issued are
    /// given back; a no-op for another writer's handle, if the object is gone, or if every
    /// handle issued to that reader set was given back already.
    pub fn release(&self, handle: &Handle) -> Result<()> {
        self.check_open()?;
        let entry = Entry {
            bucket: 0,
            address: handle.address,
            id: handle.monotonic_id,
        };
        if !self.shared.layout.valid_chunk_address(handle.address) {
            return Ok(());
        }
        // The private mutex is never held while waiting for a lock (`clear` takes
        // them the other way round).
        let reader_set = match self.private().release(handle) {
            Release::Credit(set) if !set.members.is_empty() => set,
            Release::Credit(_) | Release::Nothing => return Ok(()), // nothing to give back
            Release::Mismatch => {
                return Err(Error::InvalidHandle(
                    "signature does not match the object".into(),
                ));
            }
        };
        let Some(_protected) = self.protect_settled(&entry)? else {
            self.private().forget(handle.address, handle.monotonic_id);
            return Ok(()); // gone: its references no longer matter
        };
        let sig_tag = self
            .shared
            .chunk(handle.address, chunk::SIG_LO)?
            .load(Ordering::Relaxed) as u32;
        for &(s, epoch) in reader_set.members.iter() {
            self.credit(handle.address, sig_tag, s, epoch)?;
        }
        Ok(())
    }

    /// Leave the store: give back this writer's claims and slot; the last writer to leave
    /// marks the store closed for readers and removes its name. Operations other threads have
    /// in progress finish first (those that may take a lock, and those that hold a hazard or
    /// a reservation: no new one starts). Only the process that made the writer does this:
    /// in a forked child it does nothing (the copy just stops working).
    pub fn close(&self) -> Result<()> {
        if !self.process.is_current() || self.closing.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        while self.busy.load(Ordering::SeqCst) != 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
        loop {
            let lock = match self.lock() {
                Ok(lock) => lock,
                // The key index could not be reserved (tmpfs is full), so no writer ever
                // took the lock (which reserves it first): this one holds no claim, no block.
                Err(Error::ShmTooSmall { .. }) => break,
                Err(e) => return Err(e),
            };
            self.return_lab(&lock, &mut self.lab())?;
            if !self.holds_anything(&lock)? {
                self.drop_claims(&self.lock_index()?)?;
                break;
            }
            drop(lock);
            std::thread::sleep(Duration::from_micros(50));
        }
        self.shared.leave_writers(self.me)?;
        Ok(())
    }

    /// Whether one of this writer's operations holds a chunk (a hazard) or a block (a
    /// reservation) right now.
    fn holds_anything(&self, lock: &LockGuard<'_>) -> Result<bool> {
        for h in 0..slot::HAZARDS {
            let hazard = self
                .shared
                .writer_slot(self.me.slot, slot::HAZARD + 8 * h)?;
            // SeqCst: the other half of the test in `protect`.
            if hazard.load(Ordering::SeqCst) != 0 {
                return Ok(true);
            }
        }
        for block in self.shared.blocks(lock)? {
            if block.state.kind == (BlockKind::Reserved { owner: self.me }) {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// An operation in progress (`Writer::enter`); counts down when dropped.
pub(super) struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
