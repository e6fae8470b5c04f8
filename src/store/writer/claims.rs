//! Single flight: a writer about to compute an item claims its key, so the other writers
//! that want it wait for its put instead of computing it too.
//!
//! A claim is an index bucket in state "claimed by writer `(slot, epoch)`" (`layout::Bucket`),
//! filed under the index lock with a unique ticket as its version. It ends at anyone's put of
//! the key (the entry replaces it in place), at its writer's `unclaim` or `close`, or at its
//! writer's death: a claim whose writer's lock is gone, or whose slot's epoch moved on, is
//! void at once for everyone (`Shared::writer_alive`), and is taken over by the next claim of
//! the key, or dropped when the index needs room.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::crash;
use super::super::index::{Found, Seen};
use super::super::lock::IndexGuard;
use super::super::ring::Census;
use super::Writer;
use crate::error::{Error, Result};
use crate::layout::{Bucket, Counter, WriterId};

/// The first pause of `wait_for` between looks; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_micros(50);
const MAX_PAUSE: Duration = Duration::from_millis(2);

impl Writer {
    /// Claim `key` for this writer: `true` if this writer now holds the claim (it did
    /// already, it took over a dead writer's, or the key was neither stored nor claimed);
    /// `false` if the key is stored, or claimed by another live writer. When the index has
    /// no room even after evicting, the claim is not recorded and the answer is `true` (the
    /// caller computes the item, as it would without single flight), and so it is when tmpfs
    /// cannot hold the key index (nothing was ever stored: see `Shared::filed`).
    pub fn claim(&self, key: &str) -> Result<bool> {
        let _busy = self.enter()?;
        let query = self.query(key);
        // Without the lock first: most answers need none.
        match self.shared.seek(&query)? {
            Seen::Stored(_) => return Ok(false),
            Seen::Claimed(owner) if owner == self.me => return Ok(true),
            Seen::Claimed(owner) if self.shared.writer_alive(owner)? => return Ok(false),
            _ => {}
        }
        let mut census = Census::new(self.me);
        let (_ring, index, found) = match self.find_with_room(&query) {
            Ok(found) => found,
            Err(Error::IndexFull(_) | Error::ShmTooSmall { .. }) => return Ok(true),
            Err(e) => return Err(e),
        };
        let bucket = match found {
            Found::Stored(_) => return Ok(false),
            Found::Claimed { owner, .. } if owner == self.me => return Ok(true),
            Found::Claimed { bucket, owner } => {
                if census.writer_alive(&self.shared, owner)? {
                    return Ok(false);
                }
                bucket // a dead writer's: ours now (the claim count stays)
            }
            Found::Vacant { bucket } => {
                self.shared.adjust(&index, Counter::Claims, 1)?;
                bucket
            }
        };
        let ticket = self.shared.next_id()?;
        self.shared
            .file_claim(&index, bucket, &query, self.me, ticket)?;
        crash::point("claim.recorded");
        Ok(true)
    }

    /// Give up this writer's claim of `key` (a no-op if it holds none).
    pub fn unclaim(&self, key: &str) -> Result<()> {
        self.check_open()?;
        let query = self.query(key);
        // Without the lock only when the claim is surely not ours: a lookup that met a change
        // in progress (`Changing`) may have missed it.
        match self.shared.seek(&query)? {
            Seen::Claimed(owner) if owner == self.me => {}
            Seen::Changing => {}
            _ => return Ok(()),
        }
        let _busy = self.enter()?;
        let index = self.lock_index()?;
        if let Found::Claimed { bucket, owner } = self.shared.find(&index, &query)? {
            if owner == self.me {
                self.shared.remove_bucket(&index, bucket)?;
                self.shared.adjust(&index, Counter::Claims, -1)?;
            }
        }
        Ok(())
    }

    /// Wait up to `timeout` for keys another live writer claimed to be put: for each key,
    /// whether it is stored by the time this returns. Keys that are stored, or unclaimed, or
    /// claimed by this writer (never waited on) or by a writer that gave up or died, are
    /// answered at once; the wait polls with a pause that doubles from 50 µs to 2 ms, never
    /// past `timeout`.
    pub fn wait_for(&self, keys: &[&str], timeout: Duration) -> Result<Vec<bool>> {
        self.check_open()?;
        let deadline = Instant::now() + timeout;
        let queries: Vec<_> = keys.iter().map(|key| self.query(key)).collect();
        let mut stored = vec![false; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut pause = FIRST_PAUSE;
        loop {
            let mut census = Census::new(self.me);
            let mut still = Vec::with_capacity(pending.len());
            for i in pending {
                let waiting = match self.shared.seek(&queries[i])? {
                    Seen::Stored(_) => {
                        stored[i] = true;
                        false
                    }
                    Seen::Claimed(owner) => {
                        owner != self.me && census.writer_alive(&self.shared, owner)?
                    }
                    Seen::Changing => true,
                    Seen::Absent => false,
                };
                if waiting {
                    still.push(i);
                }
            }
            pending = still;
            let now = Instant::now();
            let closing = self.closing.load(Ordering::Relaxed);
            if pending.is_empty() || now >= deadline || closing {
                return Ok(stored);
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    /// Drop every claim whose writer is gone (the index lock's holder, when the index needs
    /// room).
    pub(super) fn reap_claims(&self, lock: &IndexGuard<'_>, census: &mut Census) -> Result<()> {
        self.drop_claims_where(lock, |owner| Ok(!census.writer_alive(&self.shared, owner)?))
    }

    /// Whether a claim of a writer that is gone is in the index, looked at without the index
    /// lock (a claim filed or dropped meanwhile may be missed, or seen after it went).
    pub(super) fn dead_claim_seen(&self, census: &mut Census) -> Result<bool> {
        for bucket in 0..self.shared.layout.index_buckets {
            if let Bucket::Claim { owner, .. } = self.shared.bucket(bucket)? {
                if !census.writer_alive(&self.shared, owner)? {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Drop every claim whose writer is gone (taking the index lock). None to drop when
    /// tmpfs cannot hold the key index: nothing was ever filed (see `Shared::filed`).
    pub(super) fn reap_dead_claims(&self) -> Result<()> {
        let _busy = self.enter()?;
        let lock = match self.lock_index() {
            Ok(lock) => lock,
            Err(Error::ShmTooSmall { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut census = Census::new(self.me);
        self.reap_claims(&lock, &mut census)
    }

    /// Drop this writer's own claims (it is leaving).
    pub(super) fn drop_claims(&self, lock: &IndexGuard<'_>) -> Result<()> {
        let me = self.me;
        self.drop_claims_where(lock, |owner| Ok(owner == me))
    }

    fn drop_claims_where(
        &self,
        lock: &IndexGuard<'_>,
        mut void: impl FnMut(WriterId) -> Result<bool>,
    ) -> Result<()> {
        // A removal moves later entries back into the gap, so the bucket just emptied is
        // looked at again, and the scan goes forward from there (nothing moves behind it).
        let mut bucket = 0;
        while bucket < self.shared.layout.index_buckets {
            if let Bucket::Claim { owner, .. } = self.shared.bucket(bucket)? {
                if void(owner)? {
                    self.shared.remove_bucket(lock, bucket)?;
                    self.shared.adjust(lock, Counter::Claims, -1)?;
                    continue;
                }
            }
            bucket += 1;
        }
        Ok(())
    }
}
