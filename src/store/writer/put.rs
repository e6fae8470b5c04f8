//! Storing an object, in three steps: reserve a block under the ring lock (or carve it from
//! the writer's allocation buffer, `lab.rs`), fill it outside the lock (the payload copy,
//! however large, holds no lock), and publish it under the index lock (P1: its id with Release,
//! then LIVE, then its index entry). A writer killed anywhere leaves at worst a reserved
//! block nobody lives to fill, which the next sweep reclaims, or a published chunk that no
//! key names, which it evicts: nothing half-written is ever readable.

use std::sync::MutexGuard;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::super::Shared;
use super::super::gate::Taken;
use super::super::index::{Found, Query};
use super::super::lock::{IndexGuard, LockGuard};
use super::super::ring::Census;
use super::super::stuck::Stuck;
use super::super::{crash, mac_words};
use super::Writer;
use super::state::ReaderSet;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::handle::tag;
use crate::layout::{
    BlockKind, BlockState, Bucket, Counter, MAX_KEY_LEN, MAX_META_LEN, SlotWord, align_up, chunk,
    part_offsets, slot,
};
use crate::segment::RawBytes;

/// A reserved block: its address, the id it will be published under, and the chunks
/// (`(address, id)`) evicted to make room for it.
pub(in crate::store) struct Reservation {
    pub(in crate::store) address: u64,
    pub(super) id: u64,
    pub(super) evicted: Vec<(u64, u64)>,
}

/// What this writer's last sweeps that found nothing saw ([`Stuck`]): the smallest
/// allocation that found no room in the ring, and an eviction to make room in the index that
/// found nothing to evict. While one still stands, the same request fails at once (`Full`,
/// `IndexFull`) instead of sweeping every chunk of the ring twice again.
#[derive(Debug, Default)]
pub(in crate::store) struct Full {
    ring: Option<Stuck>,
    /// The allocation `ring` found no room for (no larger one finds room either).
    ring_refused: u64,
    index: Option<Stuck>,
    /// Requests answered so (tests).
    #[cfg(test)]
    pub(in crate::store) spared: u64,
    /// Always sweep (tests: what a sweep would have answered).
    #[cfg(test)]
    pub(in crate::store) off: bool,
}

/// Where an object's parts go in its block.
struct Shape {
    /// Each part's offset in the payload (64-byte aligned).
    offsets: Vec<u64>,
    payload_len: u64,
    /// The whole block: header, payload, long key, metadata, rounded up to `ALIGN`.
    size: u64,
}

/// A filled chunk's words that publishing it writes, resolved first (so that a publication
/// without the lock cannot fail between taking its bucket and finishing its entry).
struct ChunkMarks<'s> {
    key_hash: &'s AtomicU64,
    id: &'s AtomicU64,
    state: &'s AtomicU64,
}

impl ChunkMarks<'_> {
    /// Make the chunk readable under `id` (P1) and live, before its index entry is.
    fn mark_live(&self, query: &Query<'_>, id: u64) {
        self.key_hash.store(query.hash(), Ordering::Relaxed);
        // P1: the chunk is readable from here on.
        self.id.store(id, Ordering::Release);
        crash::point("publish.id");
        let live = BlockState {
            kind: BlockKind::Live,
            referenced: false,
            keyed: true,
        };
        self.state.store(live.pack(), Ordering::Release);
        crash::point("publish.live");
    }
}

impl Writer {
    /// Store one object made of `parts`, each starting 64-byte aligned in the payload.
    pub fn put(&self, key: &str, parts: &[&[u8]]) -> Result<Handle> {
        let parts: Vec<RawBytes<'_>> = parts.iter().map(|&p| p.into()).collect();
        self.put_raw(key, &parts, RawBytes::from(&[][..]))
    }

    /// [`Writer::put`] with a metadata blob stored alongside (any writer reads it back with
    /// `read_meta`; readers never see it).
    pub fn put_with_meta(&self, key: &str, parts: &[&[u8]], meta: &[u8]) -> Result<Handle> {
        let parts: Vec<RawBytes<'_>> = parts.iter().map(|&p| p.into()).collect();
        self.put_raw(key, &parts, meta.into())
    }

    /// [`Writer::put_with_meta`] from bytes that are only ever copied, never borrowed as a
    /// slice (a Python buffer that another thread may write while the copy runs without the
    /// GIL).
    pub fn put_raw(&self, key: &str, parts: &[RawBytes<'_>], meta: RawBytes<'_>) -> Result<Handle> {
        let _busy = self.enter()?;
        if key.len() > MAX_KEY_LEN {
            return Err(Error::InvalidArgument(format!(
                "keys are at most {MAX_KEY_LEN} bytes, got {}",
                key.len()
            )));
        }
        if meta.len() > MAX_META_LEN {
            return Err(Error::InvalidArgument(format!(
                "metadata is at most {MAX_META_LEN} bytes, got {}",
                meta.len()
            )));
        }
        let query = self.query(key);
        // Early, before any copy; `publish` checks again under the index lock.
        if self.shared.seen_stored(&query)? {
            return Err(Error::DuplicateKey(key.to_owned()));
        }
        let long_key = if query.is_long() { key.len() as u64 } else { 0 };
        let shape = self.shape(parts, long_key + meta.len() as u64)?;
        let reader_set = self.private().reader_set(&self.shared)?.clone();
        let Reservation {
            address,
            id,
            evicted,
        } = self.reserve(shape.size)?;
        crash::point("put.reserved");
        // P3: our writes to these bytes come after the evictor's P2 (through the lock), and
        // a reader whose unprotected copy sees them sees the old chunk's id gone.
        fence(Ordering::Release);
        let (mac, handle) = self.signer.sign(key, address, id, reader_set.number);
        let filled = self.fill(
            address,
            &mac,
            &reader_set,
            &shape,
            parts,
            key,
            long_key,
            meta,
        );
        // The readers are owed a reference each from publication on (counted first, so a
        // reader's acknowledgement never comes before it); a put that fails takes it back.
        let mut counted = false;
        let published = filled.and_then(|()| {
            self.count_refs(&reader_set, true)?;
            counted = true;
            crash::point("put.filled");
            self.publish(&query, address, id)
        });
        if let Err(e) = published {
            if counted {
                self.count_refs(&reader_set, false)?;
            }
            let lock = self.lock()?;
            self.shared.unreserve(&lock, address)?;
            return Err(e);
        }
        crash::point("put.published");
        let mut private = self.private();
        self.count(Counter::Puts, 1);
        self.count(Counter::RefsIssued, reader_set.members.len() as u64);
        for (address, id) in evicted {
            private.forget(address, id);
        }
        if !reader_set.members.is_empty() {
            // A handle with references to give back (`release`); one without has none.
            private.record(&handle, reader_set);
        }
        let shared = &self.shared;
        private.prune(|address, id| {
            shared
                .chunk(address, chunk::ID)
                .is_ok_and(|w| w.load(Ordering::Relaxed) == id)
        });
        Ok(handle)
    }

    /// Where `parts` go in a block, plus `extra` bytes (long key and metadata) after them.
    fn shape(&self, parts: &[RawBytes<'_>], extra: u64) -> Result<Shape> {
        let l = self.shared.layout;
        let too_large = |size| Error::TooLarge {
            size,
            max: l.max_object_size,
        };
        let (offsets, payload_len) =
            part_offsets(parts.iter().map(|p| p.len() as u64)).ok_or(too_large(u64::MAX))?;
        if payload_len > l.max_object_size {
            return Err(too_large(payload_len));
        }
        let size = l
            .chunk_header_size
            .checked_add(payload_len)
            .and_then(|n| n.checked_add(extra))
            .and_then(align_up)
            .filter(|&size| size <= l.capacity)
            .ok_or(too_large(payload_len.saturating_add(extra)))?;
        Ok(Shape {
            offsets,
            payload_len,
            size,
        })
    }

    /// Reserve a block of `size` bytes and draw its id: carved from this writer's allocation
    /// buffer without the ring lock when it has room (`writer/lab.rs`), else under the lock
    /// (held only for this), refilling the buffer for a small object.
    pub(in crate::store) fn reserve(&self, size: u64) -> Result<Reservation> {
        // Outside the lock: the first reservation starts a thread.
        self.shared.seg.start_background_reservation();
        let lab_size = self.plan_lab(size);
        if lab_size.is_some() {
            let mut lab = self.lab();
            // Under the buffer's mutex: `close` empties the buffer under it after setting
            // the flag, and waits for a block carved before.
            if self.closing.load(Ordering::Relaxed) {
                return Err(Error::Closed);
            }
            if let Some(carved) = self.carve(&mut lab, size)? {
                return Ok(carved);
            }
        }
        let mut census = Census::new(self.me);
        let lock = self.lock()?;
        crash::point("alloc.locked");
        // Under the lock: `close` looks for reservations under it after setting the flag.
        if self.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        if let Some(len) = lab_size {
            // The buffer's mutex after the ring lock (never the other way round).
            let mut lab = self.lab();
            if let Some(carved) = self.carve(&mut lab, size)? {
                return Ok(carved); // another thread refilled it meanwhile
            }
            self.return_lab(&lock, &mut lab)?;
            // A short look only: where no buffer's room is free near the hand, the object
            // is reserved on its own below, as if there were no buffer; so it is where
            // tmpfs cannot hold a whole buffer (`allocate` fails before it changes anything),
            // for the object alone may still fit in what is left.
            match self.shared.allocate(&lock, len, &mut census, Some(4 * len)) {
                Ok(Some(address)) => {
                    self.start_lab(&lock, &mut lab, address, len)?;
                    if let Some(carved) = self.carve(&mut lab, size)? {
                        return Ok(Reservation {
                            evicted: census.evicted,
                            ..carved
                        });
                    }
                }
                Ok(None) | Err(Error::ShmTooSmall { .. }) => self.back_off_lab(),
                Err(e) => return Err(e),
            }
        }
        let full = || Error::Full {
            needed: size,
            capacity: self.shared.layout.capacity,
        };
        if self.still_full(size)? {
            return Err(full());
        }
        let Some(address) = self.shared.allocate(&lock, size, &mut census, None)? else {
            if let Some(stuck) = census.last_lap.stuck() {
                let mut full = self.full();
                full.ring = Some(stuck);
                full.ring_refused = size;
            }
            return Err(full());
        };
        Ok(Reservation {
            address,
            id: self.shared.next_id()?,
            evicted: census.evicted,
        })
    }

    pub(in crate::store) fn full(&self) -> MutexGuard<'_, Full> {
        // Nothing in it is left half-changed by a panic: carry on with it.
        self.full.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether an allocation of `size` bytes would find no room, as a sweep that found none
    /// for one no larger found, and nothing it relied on changed since (ring lock held).
    fn still_full(&self, size: u64) -> Result<bool> {
        let mut full = self.full();
        if size < full.ring_refused {
            return Ok(false);
        }
        self.still_stands(&mut full, |f| &mut f.ring, false)
    }

    /// Whether an eviction to make index room would find nothing to evict (nor a dead
    /// writer's claim to drop), as the last one found, and nothing it relied on changed since
    /// (both locks held).
    fn index_still_full(&self) -> Result<bool> {
        self.still_stands(&mut self.full(), |f| &mut f.index, true)
    }

    /// Whether the record `of` picks out of `full` still stands (`Shared::still_stuck`),
    /// forgetting it if not.
    fn still_stands(
        &self,
        full: &mut Full,
        of: fn(&mut Full) -> &mut Option<Stuck>,
        index: bool,
    ) -> Result<bool> {
        #[cfg(test)]
        if full.off {
            return Ok(false);
        }
        let Some(stuck) = of(full).as_ref() else {
            return Ok(false);
        };
        if !self.shared.still_stuck(stuck, self.me, index)? {
            *of(full) = None;
            return Ok(false);
        }
        #[cfg(test)]
        {
            full.spared += 1;
        }
        Ok(true)
    }

    /// One reference more (or fewer, `add` false) in the `REFS` count of every reader of
    /// `reader_set` (what `inspect` subtracts the reader's acknowledgements from) that still
    /// occupies its slot: the set was loaded before the fill, and a slot whose reader left
    /// meanwhile may hold a newcomer, who can never consume a reference stamped for the old
    /// epoch (its `refs - acks` would stay one too high), and whose attach zeroed the count
    /// (a take-back would wrap it: it saturates at 0 instead).
    fn count_refs(&self, reader_set: &ReaderSet, add: bool) -> Result<()> {
        for &(s, epoch) in reader_set.members.iter() {
            let (_, claim) = self.shared.claim(s)?;
            if claim.epoch != epoch || !claim.is_occupied() {
                continue;
            }
            let refs = self.shared.slot(s, slot::REFS)?;
            if add {
                refs.fetch_add(1, Ordering::Relaxed);
            } else {
                let _ =
                    refs.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            }
        }
        Ok(())
    }

    /// Write everything but the id into the reserved block at `address` (no lock held).
    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        address: u64,
        mac: &[u8; crate::handle::MAC_LEN],
        reader_set: &ReaderSet,
        shape: &Shape,
        parts: &[RawBytes<'_>],
        key: &str,
        long_key: u64,
        meta: RawBytes<'_>,
    ) -> Result<()> {
        let sh = &self.shared;
        let (lo, hi) = mac_words(mac);
        sh.chunk(address, chunk::SIG_LO)?
            .store(lo, Ordering::Relaxed);
        sh.chunk(address, chunk::SIG_HI)?
            .store(hi, Ordering::Relaxed);
        sh.chunk(address, chunk::LEN)?
            .store(shape.payload_len, Ordering::Relaxed);
        sh.chunk(address, chunk::EXTRA)?
            .store(((meta.len() as u64) << 32) | long_key, Ordering::Relaxed);
        sh.chunk(address, chunk::KEY_HASH)?
            .store(0, Ordering::Relaxed);
        for s in 0..sh.layout.n_readers {
            sh.word(address, s)?.store(0, Ordering::Relaxed);
        }
        for w in 0..sh.layout.max_writers {
            sh.pin_word(address, w)?.store(0, Ordering::Relaxed);
        }
        for &(s, epoch) in reader_set.members.iter() {
            let word = SlotWord {
                stamp: SlotWord::stamp_for(tag(mac), epoch as u64),
                outstanding: 1,
                views: 0,
            };
            sh.word(address, s)?.store(word.pack(), Ordering::Relaxed);
        }
        let payload = sh.payload_offset(address);
        let mut cursor = 0u64;
        for (i, (part, &offset)) in parts.iter().zip(&shape.offsets).enumerate() {
            if offset > cursor {
                sh.seg.zero(payload + cursor, (offset - cursor) as usize)?;
            }
            sh.seg.write_from(payload + offset, *part)?;
            cursor = offset + part.len() as u64;
            if i == 0 {
                crash::point("put.mid_copy");
            }
        }
        if long_key > 0 {
            sh.seg
                .write_from(payload + shape.payload_len, key.as_bytes().into())?;
        }
        sh.seg
            .write_from(payload + shape.payload_len + long_key, meta)?;
        Ok(())
    }

    /// Publish the filled block at `address` as `query`'s key (P1): `DuplicateKey` if
    /// another writer stored the key meanwhile, `Full` if the index has no room and nothing
    /// can be evicted for it. A new key is filed without a lock (`gate.rs`); a claimed one,
    /// or one for which the index must make room, under the index lock.
    fn publish(&self, query: &Query<'_>, address: u64, id: u64) -> Result<()> {
        let marks = self.chunk_marks(address)?;
        if self.publish_unlocked(query, address, id, &marks)? {
            return Ok(());
        }
        let (_ring, index, found) = self.find_with_room(query)?;
        let (bucket, claimed) = match found {
            Found::Stored(_) => return Err(Error::DuplicateKey(query.key.to_owned())),
            Found::Claimed { bucket, .. } => (bucket, true),
            Found::Vacant { bucket } => (bucket, false),
        };
        marks.mark_live(query, id);
        self.shared.file_entry(&index, bucket, query, address, id)?;
        if claimed {
            self.shared.adjust(&index, Counter::Claims, -1)?;
        }
        self.shared.adjust(&index, Counter::Objects, 1)
    }

    /// Publish without the index lock, if the gate is closed, the index has room and the
    /// key is neither stored nor claimed: take its bucket, mark the chunk live, finish the
    /// entry. Whether it did (if not, the index lock's holder is to).
    fn publish_unlocked(
        &self,
        query: &Query<'_>,
        address: u64,
        id: u64,
        marks: &ChunkMarks<'_>,
    ) -> Result<bool> {
        let sh = &self.shared;
        let Some(filing) = sh.start_filing(self.me)? else {
            return Ok(false);
        };
        let Some(counted) = sh.count_filing(&filing)? else {
            return Ok(false);
        };
        let head = Bucket::Live {
            key: query.kref(),
            address,
        };
        // `take_bucket` resolves the words to write before it takes the bucket, and nothing
        // after it can fail: a bucket left taken by a writer that lives on is never repaired.
        let taken = match sh.take_bucket(query, head)? {
            Taken::Bucket(taken) => taken,
            Taken::Stored => return Err(Error::DuplicateKey(query.key.to_owned())),
            Taken::Locked => return Ok(false),
        };
        crash::point("publish.filing");
        marks.mark_live(query, id);
        Shared::finish_filing(taken, query, id);
        counted.keep();
        Ok(true)
    }

    /// The words of the filled chunk at `address` that publishing it writes.
    fn chunk_marks(&self, address: u64) -> Result<ChunkMarks<'_>> {
        let sh = &self.shared;
        Ok(ChunkMarks {
            key_hash: sh.chunk(address, chunk::KEY_HASH)?,
            id: sh.chunk(address, chunk::ID)?,
            state: sh.chunk(address, chunk::STATE)?,
        })
    }

    /// Where `query`'s key is (or would be filed), under the index lock, with room made for
    /// one more entry if it is not there: `IndexFull` if none can be made. Making room evicts,
    /// which takes the ring lock, and that is never taken inside the index lock: so when the
    /// index is full the index lock is given back, the ring lock taken, then the index lock
    /// again (both returned, held to the end of the caller's change).
    pub(super) fn find_with_room(
        &self,
        query: &Query<'_>,
    ) -> Result<(Option<LockGuard<'_>>, IndexGuard<'_>, Found)> {
        let index = self.lock_index()?;
        let found = self.shared.find(&index, query)?;
        if !matches!(found, Found::Vacant { .. }) || self.index_has_room(&index)? {
            return Ok((None, index, found));
        }
        drop(index);
        let ring = self.lock()?;
        let index = self.lock_index()?;
        if !self.make_index_room(&ring, &index)? {
            return Err(self.index_full());
        }
        let found = self.shared.find(&index, query)?;
        Ok((Some(ring), index, found))
    }

    /// Whether the index may file one more entry or claim without going past `max_objects`.
    fn index_has_room(&self, _index: &IndexGuard<'_>) -> Result<bool> {
        let sh = &self.shared;
        let used = sh.counter(Counter::Objects)?.load(Ordering::Relaxed)
            + sh.counter(Counter::Claims)?.load(Ordering::Relaxed);
        Ok(used < sh.layout.max_objects)
    }

    /// Make room in the index for one more entry or claim (holding both locks): by evicting
    /// with CLOCK, and only if nothing can be evicted, by dropping claims of writers that are
    /// gone. (That takes a scan of every bucket: run on each put into a full index, it made
    /// such a put cost 50 times an ordinary one.) Whether there is room. When there is none,
    /// the next call answers so at once while nothing the sweep relied on changes
    /// (`Full::index`): an index full of objects a reader stopped reading, or of claims, cost
    /// each put and claim two laps over the ring and a scan of the index.
    pub(super) fn make_index_room(
        &self,
        lock: &LockGuard<'_>,
        index: &IndexGuard<'_>,
    ) -> Result<bool> {
        let sh = &self.shared;
        if self.index_has_room(index)? {
            return Ok(true);
        }
        if self.index_still_full()? {
            return Ok(false);
        }
        let mut census = Census::new(self.me);
        let mut evicted = false;
        for _ in 0..4 {
            if self.index_has_room(index)? {
                return Ok(true);
            }
            evicted = sh.evict_one(lock, index, &mut census)?;
            if !evicted {
                break;
            }
        }
        if !self.index_has_room(index)? && sh.counter(Counter::Claims)?.load(Ordering::Relaxed) > 0
        {
            self.reap_claims(index, &mut census)?;
        }
        let room = self.index_has_room(index)?;
        if !room && !evicted {
            self.full().index = census.last_lap.stuck();
        }
        Ok(room)
    }

    fn index_full(&self) -> Error {
        Error::IndexFull(self.shared.layout.max_objects)
    }
}
