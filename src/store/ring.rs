//! The ring's allocator, shared by every writer and changed under the ring lock (but for a
//! writer carving its own allocation buffer: B1 in [`store`](super)): blocks, CLOCK's sweep,
//! what may be reclaimed, eviction, and the repair after a lock holder died.
//!
//! The ring is tiled by blocks (`layout`): each starts with a chunk header whose `SIZE` says
//! where the next one starts and whose `STATE` says what it is (`layout::BlockState`). To
//! place `size` bytes, CLOCK's hand looks at the window `[hand, hand + size)`: every block in
//! it must be free or evictable; a chunk hit since the hand last passed is kept once (second
//! chance), one still held (a live writer's reservation, hazard or pin; a reader's
//! reference or view) is stepped over, so one live chunk never blocks the reclaimable space
//! around it. A window never wraps: one that would run past the end restarts at 0. The sweep
//! gives up after two full laps, so allocation always terminates.
//!
//! **Every step leaves a valid ring.** Each change is one store that keeps the blocks tiling
//! the ring: a window's chunks are first judged (each marked EVICTING while judged, S2 in the
//! protocol; the window recorded in the journal), then taken out of the index (under the
//! index lock, taken for that alone), then killed (`id = 0`) and marked free one by one,
//! then merged into one free block (its first block's
//! `SIZE` grows over the others), then split (the remainder's header is written before the
//! first block shrinks to `size`), then reserved for the writer. A writer killed between any
//! two of these leaves free blocks, a reserved block nobody lives to fill (reclaimed by the
//! next sweep that meets it), or chunks marked EVICTING that the journal names: whoever takes
//! the ring lock over repairs those first ([`Shared::repair`]) and recounts `bytes_in_use`.
//!
//! **A walk may give the lock back** ([`Walk`], for `stats()`): see [`walk`].

mod buffers;
mod walk;

pub(super) use walk::Walk;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::crash;
use super::lock::{IndexGuard, LockGuard};
use super::stuck::LastLap;
use super::{Occupant, Shared};
use crate::error::{Error, Result};
use crate::layout::{
    ALIGN, BlockKind, BlockState, Claim, Counter, MAX_READERS, MAX_WRITERS, PinWord, SlotState,
    SlotWord, WriterId, chunk, header, slot,
};

/// What the sweep decides for a block in the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Evict,
    Keep,
}

/// Who is alive, asked at most once per slot occupant for one sweep (each answer may cost a
/// system call). Not who occupies the slots: readers attach during a sweep, so `held` loads
/// the claim words afresh for every chunk.
pub(super) struct Census {
    pub(super) me: WriterId,
    /// `(address, id)` of every published chunk this sweep evicted (the writer forgets its
    /// records of them).
    pub(super) evicted: Vec<(u64, u64)>,
    /// What held the chunks the sweep kept in its last lap (a sweep that finds nothing:
    /// [`Stuck`]).
    pub(super) last_lap: LastLap,
    /// Per reader slot: the claim word of the occupant judged, and whether it was dead.
    readers_dead: [Option<(u64, bool)>; MAX_READERS as usize],
    writers: [Option<(u32, bool)>; MAX_WRITERS as usize],
}

impl Census {
    pub(super) fn new(me: WriterId) -> Census {
        Census {
            me,
            evicted: Vec::new(),
            last_lap: LastLap::default(),
            readers_dead: [None; MAX_READERS as usize],
            writers: [None; MAX_WRITERS as usize],
        }
    }

    /// Whether `writer` lives (this writer always does).
    pub(super) fn writer_alive(&mut self, shared: &Shared, writer: WriterId) -> Result<bool> {
        if writer == self.me {
            return Ok(true);
        }
        let Some(cached) = self.writers.get_mut(writer.slot as usize) else {
            return Ok(false);
        };
        if let Some((epoch, alive)) = *cached {
            if epoch == writer.epoch {
                return Ok(alive);
            }
        }
        let alive = shared.writer_alive(writer)?;
        *cached = Some((writer.epoch, alive));
        Ok(alive)
    }

    /// Whether reader `o` is gone; if so, free its slot (crediting everything it held).
    pub(super) fn reader_gone(&mut self, shared: &Shared, o: &Occupant) -> Result<bool> {
        if let Some((word, dead)) = self.readers_dead[o.slot as usize] {
            if word == o.word {
                return Ok(dead);
            }
        }
        let dead = !shared.occupant_alive(o.slot, o.claim)?;
        if dead {
            let free = Claim {
                pid: 0,
                state: SlotState::Free,
                ..o.claim
            };
            // CAS: only free the slot if it still has the same occupant in the same state.
            let freed = shared
                .slot(o.slot, slot::CLAIM)?
                .compare_exchange(o.word, free.pack(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            if freed {
                shared.bump(Counter::ReadersReclaimed, 1);
            }
        }
        self.readers_dead[o.slot as usize] = Some((o.word, dead));
        Ok(dead)
    }
}

/// One block as a walk sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Block {
    pub(super) address: u64,
    pub(super) size: u64,
    pub(super) state: BlockState,
    /// A writer's allocation buffer (a reservation a sweep may take back).
    pub(super) buffer: bool,
}

impl Shared {
    pub(super) fn state_word(&self, address: u64) -> Result<&AtomicU64> {
        self.chunk(address, chunk::STATE)
    }

    /// The length of the block at `address`, checked: a corrupt size is an error, never a
    /// wild walk.
    pub(super) fn block_size(&self, address: u64) -> Result<u64> {
        let size = self.chunk(address, chunk::SIZE)?.load(Ordering::Acquire);
        let fits = address
            .checked_add(size)
            .is_some_and(|end| end <= self.layout.capacity);
        if size < ALIGN || size % ALIGN != 0 || !fits {
            return Err(Error::Corrupt(format!(
                "ring block at {address} claims {size} bytes"
            )));
        }
        Ok(size)
    }

    /// The block at `address` as it is now. Its state is read before its size (B2): a block
    /// seen live or evicting has its final size.
    pub(super) fn block(&self, address: u64) -> Result<Block> {
        let raw = self.state_word(address)?.load(Ordering::Acquire);
        let size = self.block_size(address)?;
        Ok(Block {
            address,
            size,
            state: BlockState::unpack(raw),
            buffer: raw & BlockState::BUFFER_BIT != 0,
        })
    }

    /// Every block from address 0 (under the ring lock: only a carve splits a writer's buffer
    /// meanwhile, and a walk sees the buffer whole or split, B1; a publication may turn a
    /// reserved block live meanwhile, B2).
    pub(super) fn blocks(&self, _lock: &LockGuard<'_>) -> Result<Vec<Block>> {
        let mut out = Vec::new();
        let mut address = 0;
        while address < self.layout.capacity {
            let block = self.block(address)?;
            address += block.size;
            out.push(block);
        }
        Ok(out)
    }

    /// Move the hand to `to` (a block start, or the ring's end: then 0) after it passed the
    /// ring's end `wraps` times. The laps are counted first: a holder that dies between the
    /// two leaves a count a walk takes for a lap at least ([`Shared::repair`] adds two).
    fn move_hand(&self, _lock: &LockGuard<'_>, mut wraps: u64, mut to: u64) -> Result<()> {
        if to == self.layout.capacity {
            (wraps, to) = (wraps + 1, 0);
        }
        if wraps > 0 {
            let laps = self.header(header::HAND_LAPS)?;
            laps.store(
                laps.load(Ordering::Relaxed).wrapping_add(wraps),
                Ordering::Relaxed,
            );
        }
        self.header(header::HAND)?.store(to, Ordering::Relaxed);
        Ok(())
    }

    /// Change the kind of the block at `address`, keeping its bits (a hit may set the
    /// referenced bit meanwhile).
    fn set_kind(&self, address: u64, kind: BlockKind) -> Result<()> {
        let _ = self
            .state_word(address)?
            .fetch_update(Ordering::SeqCst, Ordering::Relaxed, |w| {
                Some(
                    BlockState {
                        kind,
                        ..BlockState::unpack(w)
                    }
                    .pack(),
                )
            });
        Ok(())
    }

    fn set_size(&self, address: u64, size: u64) -> Result<()> {
        self.chunk(address, chunk::SIZE)?
            .store(size, Ordering::Release);
        Ok(())
    }

    fn journal(&self, start: u64, len: u64) -> Result<()> {
        self.header(header::JOURNAL_LEN)?
            .store(len, Ordering::Relaxed);
        self.header(header::JOURNAL)?
            .store(start + 1, Ordering::Release);
        Ok(())
    }

    fn journal_done(&self) -> Result<()> {
        self.header(header::JOURNAL)?.store(0, Ordering::Release);
        Ok(())
    }

    /// Whether a live writer holds the chunk (a hazard word names it) or, while it is keyed,
    /// pins it, or a reader holds a view or (a claimed slot) a reference on it. Readers whose
    /// lock is gone are reaped on the way. Hazards are loaded with SeqCst (S2's other half).
    fn held(&self, address: u64, state: BlockState, census: &mut Census) -> Result<bool> {
        let id = self.chunk(address, chunk::ID)?.load(Ordering::Relaxed);
        for w in 0..self.layout.max_writers {
            let (_, claim) = self.writer_claim(w)?;
            if !claim.is_occupied() {
                continue;
            }
            let writer = WriterId {
                slot: w,
                epoch: claim.epoch,
            };
            let pin = PinWord::unpack(self.pin_word(address, w)?.load(Ordering::Acquire));
            let mut holds = state.keyed && pin.epoch == claim.epoch && pin.pins > 0;
            for h in 0..slot::HAZARDS {
                let hazard = self.writer_slot(w, slot::HAZARD + 8 * h)?;
                holds |= id != 0 && hazard.load(Ordering::SeqCst) == id;
            }
            if holds && census.writer_alive(self, writer)? {
                return Ok(true);
            }
        }
        // The tag readers stamp their words with: the low 32 bits of the chunk MAC.
        let sig_tag = self.chunk(address, chunk::SIG_LO)?.load(Ordering::Relaxed) as u32;
        for slot in 0..self.layout.n_readers {
            // Loaded now, after S2 and the hazards, not when the sweep began: a reader may
            // have attached since and been issued a reference by a hit. That hit's writer
            // loaded this claim word before it cleared its hazard (Release), and the SeqCst
            // load above that saw the hazard cleared makes the attach visible here too.
            let (word, claim) = self.claim(slot)?;
            if !claim.is_occupied() {
                continue;
            }
            let o = Occupant { slot, claim, word };
            // Acquire: pairs with the readers' AcqRel/Release CASes on their words.
            let w = SlotWord::unpack(self.word(address, o.slot)?.load(Ordering::Acquire));
            let holds = w.stamp == SlotWord::stamp_for(sig_tag, o.claim.epoch as u64)
                && (w.views > 0 || (o.claim.state == SlotState::Claimed && w.outstanding > 0));
            if holds && !census.reader_gone(self, &o)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Judge the block at `address` for eviction. A live chunk is marked EVICTING first (S2)
    /// and stays so when the verdict is `Evict`; a kept one is LIVE again.
    pub(super) fn decide(
        &self,
        lock: &LockGuard<'_>,
        address: u64,
        census: &mut Census,
    ) -> Result<Verdict> {
        let state_word = self.state_word(address)?;
        loop {
            let raw = state_word.load(Ordering::SeqCst);
            let state = BlockState::unpack(raw);
            match state.kind {
                BlockKind::Free => return Ok(Verdict::Evict),
                BlockKind::Reserved { owner } => {
                    // A dead writer's reservation is garbage: nothing in it is readable.
                    if !census.writer_alive(self, owner)? {
                        return Ok(Verdict::Evict);
                    }
                    if raw & BlockState::BUFFER_BIT == 0 {
                        return Ok(Verdict::Keep);
                    }
                    // A live writer's allocation buffer is taken back (freed here), so an
                    // idle writer's buffer never holds the ring, nor the chunks before it;
                    // unless its owner is carving from it, or carved from it meanwhile (the
                    // block is then a reservation of its own).
                    if !self.take_back_buffer(lock, address, owner)? {
                        return Ok(Verdict::Keep);
                    }
                    return Ok(Verdict::Evict);
                }
                BlockKind::Evicting => {
                    // Left by a holder that died outside any journal: judge it afresh.
                    self.set_kind(address, BlockKind::Live)?;
                }
                BlockKind::Live => {
                    if state.keyed && state.referenced {
                        state_word.fetch_and(!BlockState::REFERENCED_BIT, Ordering::Relaxed);
                        return Ok(Verdict::Keep); // second chance
                    }
                    let evicting = BlockState {
                        kind: BlockKind::Evicting,
                        ..state
                    };
                    // S2: marked before the pin words are read.
                    if state_word
                        .compare_exchange(raw, evicting.pack(), Ordering::SeqCst, Ordering::SeqCst)
                        .is_err()
                    {
                        continue; // a hit set the referenced bit meanwhile
                    }
                    if self.held(address, state, census)? {
                        self.set_kind(address, BlockKind::Live)?;
                        return Ok(Verdict::Keep);
                    }
                    return Ok(Verdict::Evict);
                }
            }
        }
    }

    /// Take the chunk at `address` (judged `Evict`) out of the index, if it is keyed there.
    pub(super) fn unindex_chunk(&self, index: &IndexGuard<'_>, address: u64) -> Result<()> {
        let state = BlockState::unpack(self.state_word(address)?.load(Ordering::Relaxed));
        if state.kind == BlockKind::Free || !state.keyed {
            return Ok(());
        }
        let hash = self
            .chunk(address, chunk::KEY_HASH)?
            .load(Ordering::Relaxed);
        let id = self.chunk(address, chunk::ID)?.load(Ordering::Relaxed);
        if self.unindex(index, hash, address, id)? {
            self.adjust(index, Counter::Objects, -1)?;
            self.adjust(index, Counter::Evictions, 1)?;
        }
        Ok(())
    }

    /// Free the block at `address` (judged `Evict`, out of the index): killed (`id = 0`),
    /// then free. The caller issues the Release fence (P2) before any byte of it changes.
    fn kill(&self, lock: &LockGuard<'_>, address: u64, size: u64) -> Result<()> {
        let state = BlockState::unpack(self.state_word(address)?.load(Ordering::Relaxed));
        if state.kind == BlockKind::Free {
            return Ok(());
        }
        self.chunk(address, chunk::ID)?.store(0, Ordering::Relaxed);
        self.state_word(address)?
            .store(BlockState::FREE.pack(), Ordering::Release);
        self.adjust(lock, Counter::BytesInUse, -(size as i64))
    }

    /// Judge the chunk at `address` and, if nothing holds it, free it (journaled; out of the
    /// index under `index`): whether it was freed. The caller issues the Release fence (P2).
    pub(super) fn evict_if_unheld(
        &self,
        lock: &LockGuard<'_>,
        index: &IndexGuard<'_>,
        address: u64,
        size: u64,
        census: &mut Census,
    ) -> Result<bool> {
        self.journal(address, size)?;
        let evict = self.decide(lock, address, census)? == Verdict::Evict;
        if evict {
            self.unindex_chunk(index, address)?;
            self.kill(lock, address, size)?;
        }
        self.journal_done()?;
        Ok(evict)
    }

    /// Take the keyed chunks of the judged window `[start, end)` out of the index, under the
    /// index lock taken for this alone (publications wait for this part of a refill only).
    /// Their index buckets are loaded before the lock is taken, so the misses overlap each
    /// other instead of lengthening the time it is held.
    fn unindex_window(&self, me: WriterId, start: u64, end: u64) -> Result<()> {
        let mut keyed = Vec::new();
        let mut address = start;
        while address < end {
            let block = self.block(address)?;
            if block.state.keyed && block.state.kind != BlockKind::Free {
                let hash = self
                    .chunk(address, chunk::KEY_HASH)?
                    .load(Ordering::Relaxed);
                std::hint::black_box(self.warm_bucket(hash)?);
                keyed.push(address);
            }
            address += block.size;
        }
        if keyed.is_empty() {
            return Ok(());
        }
        let index = self.lock_index(me)?;
        for address in keyed {
            self.unindex_chunk(&index, address)?;
        }
        crash::point("alloc.unindexed");
        Ok(())
    }

    /// Mark every block of `[start, end)` that is EVICTING live again (a window that could
    /// not be cleared).
    fn restore(&self, start: u64, end: u64) -> Result<()> {
        let mut address = start;
        while address < end {
            let block = self.block(address)?;
            if block.state.kind == BlockKind::Evicting {
                self.set_kind(address, BlockKind::Live)?;
            }
            address += block.size;
        }
        Ok(())
    }

    /// Place a block of `size` bytes (a multiple of [`ALIGN`]) with CLOCK and reserve it for
    /// `census.me`; `None` when no room can be made within two laps.
    ///
    /// `sweep` bounds how far the hand may look (`None`: the two laps); a bounded sweep that
    /// finds no window leaves the hand where it was.
    pub(super) fn allocate(
        &self,
        lock: &LockGuard<'_>,
        size: u64,
        census: &mut Census,
        sweep: Option<u64>,
    ) -> Result<Option<u64>> {
        let capacity = self.layout.capacity;
        if size == 0 || size > capacity || size % ALIGN != 0 {
            return Ok(None);
        }
        let mut cursor = self.header(header::HAND)?.load(Ordering::Relaxed);
        let budget = sweep.unwrap_or(2 * capacity + size);
        let mut swept = 0u64;
        let mut wraps = 0;
        census.last_lap = LastLap::default();
        while swept <= budget {
            if swept >= capacity && !census.last_lap.started() {
                self.start_last_lap(census)?;
            }
            if cursor + size > capacity {
                swept += capacity.saturating_sub(cursor);
                cursor = 0;
                wraps += 1;
                continue;
            }
            let end = cursor + size;
            // Reserve the block and the remainder's header before anything changes, so that
            // tmpfs running out is a clean error here (nothing marked, nothing journaled).
            let header_end = (end + self.layout.chunk_header_size).min(capacity);
            let reach_len = usize::try_from(header_end - cursor).map_err(|_| {
                Error::Corrupt(format!(
                    "block of {size} bytes larger than this host's memory"
                ))
            })?;
            self.seg
                .reserve(self.layout.chunk_offset(cursor), reach_len)?;
            self.journal(cursor, size)?;
            // Judge the blocks in the window; `reach` ends the last one.
            let mut reach = cursor;
            let mut kept_until = None;
            while reach < end {
                // The size after the verdict (B2): a block carved from a buffer and published
                // since the walk got here is judged live, with the size it has now.
                let verdict = self.decide(lock, reach, census)?;
                let len = self.block_size(reach)?;
                if verdict == Verdict::Keep {
                    self.note_kept(reach, census)?;
                    kept_until = Some(reach + len);
                    break;
                }
                reach += len;
            }
            if let Some(next) = kept_until {
                self.restore(cursor, reach)?;
                self.journal_done()?;
                swept += next - cursor;
                cursor = next;
                continue;
            }
            crash::point("alloc.marked");
            // From here the window's blocks change: the hand stays on a block start.
            self.move_hand(lock, wraps, cursor)?;
            self.unindex_window(census.me, cursor, reach)?;
            let mut address = cursor;
            while address < reach {
                let len = self.block_size(address)?;
                let id = self.chunk(address, chunk::ID)?.load(Ordering::Relaxed);
                self.kill(lock, address, len)?;
                if id != 0 {
                    census.evicted.push((address, id));
                }
                address += len;
            }
            // P2: every reader that copies a byte changed below sees id 0 (or a newer id).
            fence(Ordering::Release);
            crash::point("alloc.evicted");
            self.set_size(cursor, reach - cursor)?;
            crash::point("alloc.coalesced");
            if reach > end {
                // The remainder's header first, then the first block shrinks onto it.
                self.chunk(end, chunk::ID)?.store(0, Ordering::Relaxed);
                self.state_word(end)?
                    .store(BlockState::FREE.pack(), Ordering::Relaxed);
                self.set_size(end, reach - end)?;
                self.set_size(cursor, size)?;
            }
            let reserved = BlockState {
                kind: BlockKind::Reserved { owner: census.me },
                referenced: false,
                keyed: false,
            };
            self.state_word(cursor)?
                .store(reserved.pack(), Ordering::Release);
            self.adjust(lock, Counter::BytesInUse, size as i64)?;
            crash::point("alloc.reserved");
            self.journal_done()?;
            self.move_hand(lock, 0, end)?;
            return Ok(Some(cursor));
        }
        Ok(None)
    }

    /// Give back a reserved block that was never published (a put that failed after it
    /// reserved): it becomes free.
    pub(super) fn unreserve(&self, lock: &LockGuard<'_>, address: u64) -> Result<()> {
        let size = self.block_size(address)?;
        self.chunk(address, chunk::ID)?.store(0, Ordering::Relaxed);
        self.state_word(address)?
            .store(BlockState::FREE.pack(), Ordering::Release);
        self.adjust(lock, Counter::BytesInUse, -(size as i64))
    }

    /// The next id (of a chunk, or of a claim's ticket): ids only grow, across `clear` too.
    pub(super) fn next_id(&self) -> Result<u64> {
        Ok(self.next_ids(1)?.start)
    }

    /// The next `count` ids, drawn at once (a writer's allocation buffer carves with them);
    /// under no lock (an atomic add: each is drawn once, whichever lock its drawer holds).
    pub(super) fn next_ids(&self, count: u64) -> Result<Range<u64>> {
        let last = self
            .counter(Counter::LastId)?
            .fetch_add(count, Ordering::Relaxed)
            + count;
        Ok(last + 1 - count..last + 1)
    }

    /// Evict one keyed chunk with CLOCK's sweep (second chance included), to free an index
    /// bucket: whether one could be.
    pub(super) fn evict_one(
        &self,
        lock: &LockGuard<'_>,
        index: &IndexGuard<'_>,
        census: &mut Census,
    ) -> Result<bool> {
        let capacity = self.layout.capacity;
        let mut address = self.header(header::HAND)?.load(Ordering::Relaxed);
        let mut swept = 0;
        let mut wraps = 0;
        census.last_lap = LastLap::default();
        while swept < 2 * capacity {
            if swept >= capacity && !census.last_lap.started() {
                self.start_last_lap(census)?;
            }
            if address >= capacity {
                address = 0;
                wraps += 1;
            }
            let block = self.block(address)?;
            let next = address + block.size;
            if block.state.keyed && block.state.kind == BlockKind::Live {
                if self.evict_if_unheld(lock, index, address, block.size, census)? {
                    fence(Ordering::Release); // P2
                    self.move_hand(lock, wraps, next)?;
                    return Ok(true);
                }
                self.note_kept(address, census)?;
            } else if block.state.keyed && block.state.kind != BlockKind::Free {
                self.note_kept(address, census)?; // left EVICTING: it may be judged again
            }
            swept += block.size;
            address = next;
        }
        Ok(false)
    }

    /// After taking the ring lock over from a holder that died: finish or undo what its
    /// journal names, check that the blocks still tile the ring and the hand stands on one,
    /// mark any chunk left EVICTING live again, and recount the bytes in use. (The index is
    /// repaired by whoever takes the index lock over, if the holder died holding that too.)
    pub(super) fn repair(&self, lock: &LockGuard<'_>) -> Result<()> {
        let journal = self.header(header::JOURNAL)?.load(Ordering::Acquire);
        if journal != 0 {
            let start = journal - 1;
            let end =
                start.saturating_add(self.header(header::JOURNAL_LEN)?.load(Ordering::Relaxed));
            let mut address = start;
            while address < end.min(self.layout.capacity) {
                let block = self.block(address)?;
                if block.state.kind == BlockKind::Evicting
                    && self.chunk(address, chunk::ID)?.load(Ordering::Relaxed) == 0
                {
                    // Killed but not yet marked free.
                    self.state_word(address)?
                        .store(BlockState::FREE.pack(), Ordering::Release);
                }
                address += block.size;
            }
            self.journal_done()?;
        }
        let hand = self.header(header::HAND)?;
        let hand_at = hand.load(Ordering::Relaxed);
        let mut hand_ok = false;
        let mut in_use = 0;
        for block in self.blocks(lock)? {
            hand_ok |= block.address == hand_at;
            match block.state.kind {
                BlockKind::Free => {}
                BlockKind::Evicting => {
                    self.set_kind(block.address, BlockKind::Live)?;
                    in_use += block.size;
                }
                BlockKind::Reserved { owner }
                    if block.buffer && self.free_marked_buffer(lock, block.address, owner)? => {}
                _ => in_use += block.size,
            }
        }
        if !hand_ok {
            hand.store(0, Ordering::Relaxed);
        }
        // The dead holder may have merged a window at the hand (and split it) without moving
        // the hand past it, and the hand may have been put back to 0 above: a walk in
        // progress cannot tell from the hand how far merges reached. Two more laps tell it
        // that any block start may be gone.
        let laps = self.header(header::HAND_LAPS)?;
        laps.store(
            laps.load(Ordering::Relaxed).wrapping_add(2),
            Ordering::Relaxed,
        );
        self.counter(Counter::BytesInUse)?
            .store(in_use, Ordering::Relaxed);
        Ok(())
    }
}
