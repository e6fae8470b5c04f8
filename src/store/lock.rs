//! The store's two locks, each one word in the segment's header: the **ring lock**
//! (`header::LOCK`) serializes changes to the ring's blocks, CLOCK's hand, the journal and the
//! bytes gauge; the **index lock** (`header::INDEX_LOCK`) serializes changes to the key
//! index's buckets, its move count and the objects and claims gauges, but for the filings of
//! new keys, which take no lock and which its holder keeps out with the index gate
//! (`gate.rs`; see the protocol in [`store`](super)). A publication takes the index lock only
//! for a claimed key or a full index, a refill of an allocation buffer the ring lock and, to
//! take its window's keys out of the index, the index lock inside it for that part alone: so
//! one writer's refill and another's publications run side by side. Order: the index lock is
//! taken inside the ring lock, never the other way round.
//!
//! Either is taken with one CAS and given back with one swap when nobody waits, so a single
//! writer pays two uncontended atomic operations for it. A writer that finds it taken spins
//! (at most [`SPIN_FOR`], yielding now and then), then sleeps on the word (a futex on the
//! shared mapping, woken by the holder), at most [`RECHECK`] at a time: after each sleep it
//! asks whether the holder the word names (slot and epoch, set in the same CAS that took it)
//! still lives. A holder that died however it died — SIGKILL in the middle of an update
//! included — is found dead as soon as its slot's OFD lock is gone (or its slot has a new
//! occupant), and the waiter takes the lock over with a CAS on the exact word it saw; the
//! guard then says so, and the new holder repairs what the dead one may have left half done
//! before anything else (`ring::repair` for the ring lock, `index::repair_index` for the
//! index lock). A writer takes either only inside an operation `close` waits for
//! (`Writer::enter`), so no live thread ever holds one under the name of a writer that left.
//!
//! The holder's identity is its writer slot and epoch, not its thread: two threads of one
//! writer exclude each other like two writers do (neither ever takes a lock twice).

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Shared;
use crate::error::{Error, Result};
use crate::layout::{LockWord, WriterId, header};

/// How long a waiter sleeps before it checks that the holder still lives.
const RECHECK: Duration = Duration::from_millis(2);
/// How long a waiter spins before it sleeps: longer than a critical section in normal use
/// (a publication is a few hundred nanoseconds; refilling an allocation buffer evicts up to
/// 256 KiB of chunks, tens of microseconds), because a sleep and its wake-up cost far more —
/// two writers putting on two cores slept once per refill with a short spin, and put 1.0×
/// as fast as one instead of 1.3–1.45×.
const SPIN_FOR: Duration = Duration::from_micros(100);
/// Spins between two looks at the clock, each also yielding the CPU (in case the holder
/// waits for it: more writers than cores).
const SPINS_PER_YIELD: u32 = 256;

/// How long a lock given back to let others in ([`LockGuard::give_way`]) is left free for a
/// writer spinning for it (which takes it within a fraction of this)...
const GIVE_WAY: Duration = Duration::from_micros(2);
/// ...and for one that slept on it (woken by the release, it needs to be scheduled first).
const GIVE_WAY_TO_SLEEPER: Duration = Duration::from_millis(1);

/// A lock word held; released when dropped.
struct Held<'a> {
    word: &'a AtomicU64,
    /// The word's header offset (the futex's address).
    offset: u64,
    shared: &'a Shared,
    /// The lock was taken over from a holder that died: the caller repairs first.
    taken_over: bool,
}

/// Proof that the ring lock is held; released when dropped.
pub(super) struct LockGuard<'a>(Held<'a>);

/// Proof that the index lock is held; released when dropped.
pub(super) struct IndexGuard<'a>(Held<'a>);

/// Either guard: proof for what either lock serializes (a gauge is changed under the lock
/// that guards what it counts: `Counter::under_index_lock`).
pub(super) trait Guard {
    /// Whether this is the index lock's guard.
    const INDEX: bool;
}
impl Guard for LockGuard<'_> {
    const INDEX: bool = false;
}
impl Guard for IndexGuard<'_> {
    const INDEX: bool = true;
}

impl LockGuard<'_> {
    /// Taken over from a holder that died: the ring needs `repair` first.
    pub(super) fn taken_over(&self) -> bool {
        self.0.taken_over
    }

    /// Give the lock back and let a writer waiting for it take it before this thread may
    /// take it again (a walk holding it slice by slice: given back and taken again at once, it
    /// would stay with the walker, as a spinning waiter on another core rarely sees it free).
    /// Returns once another holder took it, or after a short while (longer when the word says
    /// a waiter slept), without giving up the CPU unless a sleeper waits: a walker's
    /// `yield` on a busy machine costs it a scheduler's time slice per slice.
    pub(super) fn give_way(self) {
        let word = self.0.word;
        let sleepers = LockWord::unpack(word.load(Ordering::Relaxed)).is_some_and(|h| h.waiters);
        drop(self);
        let wait = if sleepers {
            GIVE_WAY_TO_SLEEPER
        } else {
            GIVE_WAY
        };
        let since = Instant::now();
        let mut spins = 0u32;
        while LockWord::unpack(word.load(Ordering::Relaxed)).is_none() && since.elapsed() < wait {
            spins = spins.wrapping_add(1);
            if sleepers && spins % SPINS_PER_YIELD == 0 {
                std::thread::yield_now();
            } else {
                spin_loop();
            }
        }
    }
}

impl Shared {
    /// Take the ring lock as `me` (waiting while a live writer holds it).
    pub(super) fn lock(&self, me: WriterId) -> Result<LockGuard<'_>> {
        self.acquire(me, header::LOCK).map(LockGuard)
    }

    /// Take the index lock as `me` (waiting while a live writer holds it) and open the gate
    /// (waiting for filings in progress: `gate.rs`), repairing the index first if it was
    /// taken over from a holder that died or a writer died filing. A holder of the ring lock
    /// may take it; a holder of the index lock never takes the ring lock.
    pub(super) fn lock_index(&self, me: WriterId) -> Result<IndexGuard<'_>> {
        let guard = IndexGuard(self.acquire(me, header::INDEX_LOCK)?);
        let dead_filings = self.open_gate(&guard)?;
        if guard.0.taken_over || !dead_filings.is_empty() {
            self.repair_index(&guard)?;
        }
        self.void_filings(&guard, &dead_filings)?;
        Ok(guard)
    }

    fn acquire(&self, me: WriterId, offset: u64) -> Result<Held<'_>> {
        // Whatever changes under a lock never fails halfway for want of memory: the key
        // index is reserved first (one load once it is), the ring window by `allocate`.
        let index = self.layout.bucket_offset(0);
        let index_len = usize::try_from(self.layout.header_size - index)
            .map_err(|_| Error::Corrupt("key index larger than this host's memory".into()))?;
        self.seg.reserve(index, index_len)?;
        let word = self.header(offset)?;
        let held = |taken_over| Held {
            word,
            offset,
            shared: self,
            taken_over,
        };
        let mine = LockWord {
            holder: me,
            waiters: false,
        }
        .pack();
        // Acquire: pairs with the previous holder's Release swap in `drop`.
        if word
            .compare_exchange(0, mine, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return Ok(held(false));
        }
        // Contended. A waiter that has slept takes the lock saying it may have company (its
        // release then wakes one sleeper): a sleeper's wake-up may have been spent on it. One
        // that only spun takes it as it is, so releases that follow wake nobody in vain (a
        // wake is a system call); a sleeper always marks the word before it sleeps.
        let mut mine = mine;
        let mut spins = 0u32;
        let mut spinning = Some(Instant::now());
        loop {
            let seen = word.load(Ordering::Relaxed);
            let Some(holder) = LockWord::unpack(seen) else {
                if word
                    .compare_exchange(seen, mine, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(held(false));
                }
                continue;
            };
            if let Some(since) = spinning {
                spins = spins.wrapping_add(1);
                if spins % SPINS_PER_YIELD != 0 {
                    spin_loop();
                    continue;
                }
                if since.elapsed() < SPIN_FOR {
                    std::thread::yield_now();
                    continue;
                }
                spinning = None;
            }
            let sleeping_on = seen | LockWord::WAITERS;
            if !holder.waiters
                && word
                    .compare_exchange(seen, sleeping_on, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            self.seg.futex_wait(offset, sleeping_on as u32, RECHECK)?;
            mine |= LockWord::WAITERS;
            if word.load(Ordering::Relaxed) == sleeping_on && !self.writer_alive(holder.holder)? {
                // The holder died holding it. Take it over from exactly that holder.
                if word
                    .compare_exchange(sleeping_on, mine, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(held(true));
                }
            }
        }
    }
}

impl Drop for IndexGuard<'_> {
    fn drop(&mut self) {
        // Before the lock word is given back (the field's drop, after this). Nothing better
        // to do if it fails (it cannot: the header is mapped): the gate stays open, and
        // filers take the lock until its next holder closes it.
        let _ = self.0.shared.close_gate();
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // Release: everything changed under the lock happens before the next holder's
        // Acquire CAS.
        let before = self.word.swap(0, Ordering::Release);
        if before & LockWord::WAITERS != 0 {
            // Nothing better to do if waking fails: sleepers re-check within RECHECK anyway.
            let _ = self.shared.seg.futex_wake(self.offset, 1);
        }
    }
}
