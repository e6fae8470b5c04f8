//! The writer: stores objects, issues and takes back references, evicts. The orderings it
//! keeps (P1, P2) are in the module docs of [`store`](super).

use std::collections::HashMap;
use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{ReaderInfo, Shared, Stats, mac_words, update_word};
use crate::error::{Error, Result};
use crate::handle::{Handle, MAC_LEN, Signer, tag};
use crate::layout::{
    Counter, LAYOUT_VERSION, Layout, Liveness, SlotState, SlotWord, WRITER_CLOSED, WRITER_LOCK,
    align_up, chunk, header, part_offsets, slot,
};
use crate::ring::Ring;
use crate::segment::{self, Process, RawBytes, Segment};
use reclaim::unindex_evicted;
use state::{ChunkMeta, Issuance, ReaderSet, Tally, WriterState};

mod reclaim;
mod state;

/// The single writer of a segment.
#[derive(Debug)]
pub struct Writer {
    /// The store's tests reach the segment through it.
    pub(super) shared: Shared,
    signer: Signer,
    process: Process,
    state: Mutex<WriterState>,
}

impl Writer {
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
        super::remove_orphans(); // what dead creators left goes first (SPEC §5, guarantee 10)
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

    /// Store one object made of `parts`, each starting 64-byte aligned in the payload.
    pub fn put(&self, key: &str, parts: &[&[u8]]) -> Result<Handle> {
        let parts: Vec<RawBytes<'_>> = parts.iter().map(|&p| p.into()).collect();
        self.put_raw(key, &parts)
    }

    /// [`Writer::put`] from bytes that are only ever copied, never borrowed as a slice (a
    /// Python buffer that another thread may write while the copy runs without the GIL).
    pub fn put_raw(&self, key: &str, parts: &[RawBytes<'_>]) -> Result<Handle> {
        let mut guard = self.lock()?;
        let state = &mut *guard;
        if state.keys.contains_key(key) {
            return Err(Error::DuplicateKey(key.to_owned()));
        }
        let shape = self.chunk_shape(parts)?;
        let occupants = self.shared.occupants()?;
        let reader_set = state.reader_set(&occupants);
        let placement = self.make_room(&mut state.ring, &mut state.tally, shape.size, &occupants);
        let Some(placement) = placement else {
            self.publish(state);
            return Err(Error::Full {
                needed: shape.size,
                capacity: self.shared.layout.capacity,
            });
        };
        // Before any step that can fail: the index never names a reclaimed chunk.
        unindex_evicted(&mut state.keys, &mut state.tally, &placement.evicted);
        let address = placement.address;
        state.last_id += 1;
        let id = state.last_id;
        let (mac, handle) = self.signer.sign(key, address, id, reader_set.number);
        let written = self
            .kill_evicted(&placement.evicted)
            .and_then(|()| self.write_chunk(address, id, &mac, &reader_set, &shape, parts));
        if let Err(err) = written {
            // Never published, so nobody can hold it: its space is free again at once.
            state.ring.remove(address);
            self.publish(state);
            return Err(err);
        }
        *placement.value = ChunkMeta {
            key: Some(key.to_owned()),
            id,
            mac,
            issued: vec![Issuance {
                reader_set,
                signature: handle.signature,
                unreleased: 1,
            }],
            ..ChunkMeta::default()
        };
        state.keys.insert(key.to_owned(), address);
        state.tally.bump(Counter::Puts);
        state.tally.bump(Counter::RefsIssued);
        self.publish(state);
        Ok(handle)
    }

    /// Where `parts` go in a chunk, or `TooLarge` if they exceed `max_object_size` or the ring.
    fn chunk_shape(&self, parts: &[RawBytes<'_>]) -> Result<ChunkShape> {
        let layout = self.shared.layout;
        let too_large = |size| Error::TooLarge {
            size,
            max: layout.max_object_size,
        };
        let (offsets, payload_len) =
            part_offsets(parts.iter().map(|p| p.len() as u64)).ok_or(too_large(u64::MAX))?;
        if payload_len > layout.max_object_size {
            return Err(too_large(payload_len));
        }
        let size = align_up(layout.chunk_header_size + payload_len)
            .filter(|&s| s <= layout.capacity)
            .ok_or(too_large(payload_len))?;
        Ok(ChunkShape {
            offsets,
            payload_len,
            size,
        })
    }

    /// Fill the chunk at `address` — its signature and length, one reference for each
    /// member of `reader_set`, the payload — and publish it (P1).
    fn write_chunk(
        &self,
        address: u64,
        id: u64,
        mac: &[u8; MAC_LEN],
        reader_set: &ReaderSet,
        shape: &ChunkShape,
        parts: &[RawBytes<'_>],
    ) -> Result<()> {
        let sh = &self.shared;
        let (lo, hi) = mac_words(mac);
        sh.chunk(address, chunk::SIG_LO)?
            .store(lo, Ordering::Relaxed);
        sh.chunk(address, chunk::SIG_HI)?
            .store(hi, Ordering::Relaxed);
        sh.chunk(address, chunk::LEN)?
            .store(shape.payload_len, Ordering::Relaxed);
        sh.chunk(address, chunk::REFS)?.store(1, Ordering::Relaxed);
        for s in 0..sh.layout.n_readers {
            sh.word(address, s)?.store(0, Ordering::Relaxed);
        }
        for &(s, epoch) in reader_set.members.iter() {
            sh.slot(s, slot::REFS)?.fetch_add(1, Ordering::Relaxed);
            let word = SlotWord {
                stamp: SlotWord::stamp_for(tag(mac), epoch as u64),
                outstanding: 1,
                views: 0,
            };
            sh.word(address, s)?.store(word.pack(), Ordering::Relaxed);
        }
        self.write_payload(address, shape, parts)?;
        // P1: publish the chunk.
        sh.chunk(address, chunk::ID)?.store(id, Ordering::Release);
        Ok(())
    }

    /// Copy `parts` into the payload at `address`, each at its offset, zeroing the padding.
    fn write_payload(
        &self,
        address: u64,
        shape: &ChunkShape,
        parts: &[RawBytes<'_>],
    ) -> Result<()> {
        let seg = &self.shared.seg;
        let payload = self.shared.payload_offset(address);
        let mut cursor = 0u64;
        for (part, &offset) in parts.iter().zip(&shape.offsets) {
            if offset > cursor {
                seg.zero(payload + cursor, (offset - cursor) as usize)?;
            }
            seg.write_from(payload + offset, *part)?;
            cursor = offset + part.len() as u64;
        }
        Ok(())
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
        let mut guard = self.lock()?;
        let state = &mut *guard;
        let not_found = || Error::KeyNotFound(key.to_owned());
        let address = *state.keys.get(key).ok_or_else(not_found)?;
        let occupants = self.shared.occupants()?;
        let reader_set = state.reader_set(&occupants);
        let meta = state.ring.get_mut(address).ok_or_else(not_found)?;
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
        meta.referenced = true;
        let handle = meta.issue(&self.signer, key, address, &reader_set);
        state.tally.bump(Counter::Hits);
        state.tally.bump(Counter::RefsIssued);
        self.publish(state);
        Ok(handle)
    }

    /// Protect a stored object from eviction until a matching `unpin` (pins are counted).
    pub fn pin(&self, key: &str) -> Result<()> {
        let mut state = self.lock()?;
        let meta = state
            .stored(key)
            .ok_or_else(|| Error::KeyNotFound(key.to_owned()))?;
        meta.pins = meta.pins.saturating_add(1);
        Ok(())
    }

    /// Undo one `pin`; a no-op for an absent or unpinned key.
    pub fn unpin(&self, key: &str) -> Result<()> {
        if let Some(meta) = self.lock()?.stored(key) {
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
            let given_back = update_word(self.shared.word(handle.address, s)?, |w| {
                (w.stamp == stamp && w.outstanding > 0).then(|| SlotWord {
                    outstanding: w.outstanding - 1,
                    ..w
                })
            });
            if given_back {
                // Acknowledged on the reader's behalf (it will never see the handle), so its
                // outstanding count (refs - acks, `inspect`) returns to where it was. Only for
                // the occupant the reference was issued to: the word's stamp matched.
                self.shared
                    .slot(s, slot::ACKS)?
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Forget `key`; its chunk is reclaimed once nobody holds it. A no-op if absent.
    pub fn invalidate(&self, key: &str) -> Result<()> {
        let mut state = self.lock()?;
        if let Some(meta) = state.stored(key) {
            meta.key = None;
            meta.pins = 0;
            meta.referenced = false;
        }
        state.keys.remove(key);
        self.publish(&state);
        Ok(())
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
        self.publish(&state);
        Ok(())
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

    /// Publish every counter in the segment header, for `inspect`. Statistics only, so it
    /// cannot fail the operation it counts: a word out of reach (impossible, `Layout` puts
    /// every counter in the header) is skipped.
    fn publish(&self, state: &WriterState) {
        for &counter in Counter::ALL {
            if let Ok(word) = self.shared.header(counter.offset()) {
                word.store(state.counter(counter), Ordering::Relaxed);
            }
        }
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

/// Where an object's parts go in its chunk.
struct ChunkShape {
    /// Each part's offset in the payload (64-byte aligned).
    offsets: Vec<u64>,
    payload_len: u64,
    /// The whole chunk, header included, rounded up to `ALIGN`.
    size: u64,
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
