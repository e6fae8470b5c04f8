//! The shared key index: an open-addressing table (linear probing) in the segment that maps
//! each stored key to its chunk and each claimed key to its claimant, read by every writer
//! without a lock.
//!
//! A bucket is a head word (`layout::Bucket`: kind, key length, a tag of the key's hash, the
//! chunk address or the claimant), a version word (the entry's unique id, 0 while it
//! changes), a hash word (the key's hash: where its probe starts) and a 64-byte key slot
//! holding the key itself (keys of at most 64 bytes, content hashes as hex among them) or,
//! for a longer key, its BLAKE3 digest (the key itself is then stored in the chunk, after the
//! payload, for [`Shared::keys`]). So a lookup compares real keys and touches no chunk: a hit
//! is a hash, one or two buckets and a key compare.
//!
//! Lookups read each bucket under a seqlock on its version word (I1/I2 in the protocol of
//! [`store`](super)). A new key is filed without a lock, behind the index gate (`gate.rs`);
//! every other change is made under the index lock: filing a claim, turning a claim into an
//! entry in place, and removing either. A removal leaves no tombstone:
//! the entries after it in its cluster whose probe would pass the gap are moved back into it
//! (backward shift), so the table never silts up with deleted entries and probes stay as
//! short as the load allows. A move copies the entry before its old place is reused, so an
//! entry is always somewhere; a lookup that probed past a moving entry could still miss it,
//! so a miss is confirmed by a second probe under the index's move count (a seqlock: odd
//! while entries move). The table has at least twice as many buckets as it may hold entries
//! and claims (`Layout::max_objects`); beyond that a put first evicts (the allocator's CLOCK),
//! so an empty bucket always exists. A probe visits each bucket at most once: even a corrupt
//! table cannot make it loop.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::Shared;
use super::lock::IndexGuard;
use crate::error::{Error, Result};
use crate::keyhash::{KeyHasher, word};
use crate::layout::{Bucket, Counter, KEY_SLOT_SIZE, KeyRef, WriterId, chunk, header};
use crate::segment::RawBytes;

/// The words of a key slot.
pub(super) const SLOT_WORDS: usize = (KEY_SLOT_SIZE / 8) as usize;

/// A key as the index looks for it: hashed once per operation.
#[derive(Debug)]
pub(super) struct Query<'k> {
    pub(super) key: &'k str,
    hash: u64,
    kref: KeyRef,
    /// The BLAKE3 digest of a key too long for its key slot.
    digest: Option<[u8; 32]>,
}

impl<'k> Query<'k> {
    /// The key's index hash (where its probe starts).
    pub(super) fn hash(&self) -> u64 {
        self.hash
    }

    #[inline(always)]
    pub(super) fn new(hasher: &KeyHasher, key: &'k str) -> Query<'k> {
        let hash = hasher.hash(key.as_bytes());
        let kref = KeyRef::new(hash, key.len());
        Query {
            key,
            hash,
            kref,
            digest: kref
                .is_long()
                .then(|| *blake3::hash(key.as_bytes()).as_bytes()),
        }
    }

    /// What the key slot holds for this key.
    pub(super) fn slot_bytes(&self) -> &[u8] {
        match &self.digest {
            Some(digest) => digest,
            None => self.key.as_bytes(),
        }
    }

    /// The key's length and tag, as its bucket's head holds them.
    pub(super) fn kref(&self) -> KeyRef {
        self.kref
    }

    /// Whether the chunk stores the key itself (after its payload).
    pub(super) fn is_long(&self) -> bool {
        self.kref.is_long()
    }
}

/// A stored key's entry: its bucket, its chunk's address and id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) bucket: u64,
    pub(super) address: u64,
    pub(super) id: u64,
}

/// What a lock-free probe found for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Seen {
    Stored(Entry),
    Claimed(WriterId),
    /// Its bucket is being changed right now (a claim becoming an entry, say), or entries
    /// kept moving while [`Shared::seek`] tried to confirm a miss: it may be stored.
    Changing,
    Absent,
}

/// Where a key is, or would go, as the index lock's holder finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Found {
    Stored(Entry),
    Claimed { bucket: u64, owner: WriterId },
    Vacant { bucket: u64 },
}

/// One bucket as a scan sees it (under the index lock, or racily for statistics).
#[derive(Clone, Copy, Debug)]
pub(super) struct Filed {
    pub(super) bucket: u64,
    pub(super) head: Bucket,
    pub(super) version: u64,
}

/// Lookups that found a move in progress try again this often before answering `Changing`
/// (a holder that died moving leaves the count odd until the lock is taken over).
const SEEK_ATTEMPTS: usize = 64;

impl Shared {
    fn bucket_head(&self, bucket: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.bucket_offset(bucket))
    }

    fn bucket_version(&self, bucket: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.bucket_offset(bucket) + 8)
    }

    pub(super) fn bucket_hash(&self, bucket: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.bucket_hash_offset(bucket))
    }

    fn moves(&self) -> Result<&AtomicU64> {
        self.header(header::INDEX_MOVES)
    }

    /// What bucket `bucket` holds now (for the index lock's holder: it does not change
    /// meanwhile; for anyone else, what it held at some instant).
    pub(super) fn bucket(&self, bucket: u64) -> Result<Bucket> {
        Ok(Bucket::unpack(
            self.bucket_head(bucket)?.load(Ordering::Relaxed),
        ))
    }

    /// Whether bucket `bucket`'s key slot holds `query`'s key (read racily: the caller
    /// confirms the bucket's version after).
    #[inline(always)]
    pub(super) fn key_slot_matches(&self, bucket: u64, query: &Query<'_>) -> Result<bool> {
        let slot = self
            .seg
            .atomics::<SLOT_WORDS>(self.layout.key_slot_offset(bucket))?;
        // Word against word (little-endian), no early exit: one cache line, no branch to
        // mispredict, no call into memcmp. Past the key's end the slot may hold an earlier,
        // longer key's bytes: the last word is masked to the key's.
        let whole = query.slot_bytes().chunks_exact(8);
        let tail = whole.remainder();
        let mut differ = 0;
        for (loaded, want) in slot.iter().zip(whole) {
            differ |= loaded.load(Ordering::Relaxed) ^ word(want);
        }
        let last = query.slot_bytes().len() / 8;
        if let Some(loaded) = slot.get(last).filter(|_| !tail.is_empty()) {
            let mask = u64::MAX >> (64 - 8 * tail.len());
            differ |= (loaded.load(Ordering::Relaxed) & mask) ^ word(tail);
        }
        Ok(differ == 0)
    }

    /// The buckets a probe for `hash` visits, in order (each once).
    pub(super) fn probe(&self, hash: u64) -> impl Iterator<Item = u64> {
        let n = self.layout.index_buckets;
        let start = hash & (n - 1);
        (0..n).map(move |i| (start + i) & (n - 1))
    }

    /// Where `query`'s key is stored or claimed, without a lock. A hit is always true (each
    /// bucket is read whole under its seqlock); a miss is confirmed by a second probe that no
    /// move overlapped (the move count, read with Acquire before and, after an Acquire fence,
    /// again: pairs with `remove_bucket`'s Release stores of it).
    ///
    /// Inlined, with the first probe: a hit's result stays in registers (returned through
    /// memory it was stored in parts and reloaded whole, a store-forwarding stall each time).
    #[inline(always)]
    pub(super) fn seek(&self, query: &Query<'_>) -> Result<Seen> {
        let seen = self.probe_for(query)?;
        if matches!(seen, Seen::Stored(_) | Seen::Claimed(_)) {
            return Ok(seen);
        }
        self.confirm_miss(query)
    }

    /// [`Shared::seek`] after a first probe that found nothing: probe again until no move
    /// overlapped the probe; `Changing` if none could be confirmed so.
    #[inline(never)]
    fn confirm_miss(&self, query: &Query<'_>) -> Result<Seen> {
        let moves = self.moves()?;
        for _ in 0..SEEK_ATTEMPTS {
            let before = moves.load(Ordering::Acquire);
            if before % 2 == 1 {
                spin_loop();
                continue;
            }
            let seen = self.probe_for(query)?;
            if matches!(seen, Seen::Stored(_) | Seen::Claimed(_)) {
                return Ok(seen);
            }
            fence(Ordering::Acquire);
            if moves.load(Ordering::Relaxed) == before {
                return Ok(seen);
            }
        }
        // Unconfirmed: a change that skips the index lock on a miss must not skip it here.
        Ok(Seen::Changing)
    }

    /// One probe for `query` (a seqlock read per bucket, I1/I2 in the protocol).
    #[inline(always)]
    fn probe_for(&self, query: &Query<'_>) -> Result<Seen> {
        for bucket in self.probe(query.hash) {
            let [head_word, version_word] =
                match self.seg.atomics::<2>(self.layout.bucket_offset(bucket)) {
                    Ok(words) => words,
                    Err(Error::ShmTooSmall { .. }) => return Ok(Seen::Absent), // see `filed`
                    Err(e) => return Err(e),
                };
            let mut spins = 0;
            loop {
                // Acquire pairs with I1: the head and key slot of that version are visible.
                let version = version_word.load(Ordering::Acquire);
                let head = Bucket::unpack(head_word.load(Ordering::Relaxed));
                let (kref, found) = match head {
                    Bucket::Empty => return Ok(Seen::Absent),
                    Bucket::Live { key, address } => (
                        key,
                        Seen::Stored(Entry {
                            bucket,
                            address,
                            id: version,
                        }),
                    ),
                    Bucket::Claim { key, owner } => (key, Seen::Claimed(owner)),
                };
                if kref != query.kref {
                    break;
                }
                let same = version != 0 && self.key_slot_matches(bucket, query)?;
                // Pairs with I2: had we read a byte of a later change, we see its version.
                fence(Ordering::Acquire);
                let unchanged = version_word.load(Ordering::Relaxed) == version;
                if version != 0 && unchanged {
                    if same {
                        return Ok(found);
                    }
                    break;
                }
                // Changing under us: the lock's holder finishes within nanoseconds.
                spins += 1;
                if spins > 64 {
                    return Ok(Seen::Changing);
                }
                spin_loop();
            }
        }
        Ok(Seen::Absent)
    }

    /// Whether one lock-free probe sees `query`'s key stored. A miss is not confirmed (a
    /// move may have hidden the key): for an early check that a later one under the index
    /// lock repeats.
    #[inline(always)]
    pub(super) fn seen_stored(&self, query: &Query<'_>) -> Result<bool> {
        Ok(matches!(self.probe_for(query)?, Seen::Stored(_)))
    }

    /// The entry of a stored key, without a lock.
    #[inline(always)]
    pub(super) fn lookup(&self, query: &Query<'_>) -> Result<Option<Entry>> {
        Ok(match self.seek(query)? {
            Seen::Stored(entry) => Some(entry),
            _ => None,
        })
    }

    /// Where `query`'s key is stored, claimed, or would be filed (the index lock's holder:
    /// nothing changes meanwhile, so plain reads suffice).
    pub(super) fn find(&self, _lock: &IndexGuard<'_>, query: &Query<'_>) -> Result<Found> {
        for bucket in self.probe(query.hash) {
            let version = self.bucket_version(bucket)?.load(Ordering::Acquire);
            match Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed)) {
                Bucket::Empty => return Ok(Found::Vacant { bucket }),
                Bucket::Live { key, address }
                    if key == query.kref && self.key_slot_matches(bucket, query)? =>
                {
                    return Ok(Found::Stored(Entry {
                        bucket,
                        address,
                        id: version,
                    }));
                }
                Bucket::Claim { key, owner }
                    if key == query.kref && self.key_slot_matches(bucket, query)? =>
                {
                    return Ok(Found::Claimed { bucket, owner });
                }
                _ => {}
            }
        }
        Err(Error::Corrupt(
            "the key index has no empty bucket (it is never filled past half)".into(),
        ))
    }

    /// Make `bucket` hold `head` for a key of hash `hash` whose key slot is `slot`, with
    /// version `version` (the index lock's holder; `bucket` is empty, holds that key's claim,
    /// or is the gap of a move). I2 then I1.
    fn file(&self, bucket: u64, head: Bucket, hash: u64, slot: &[u8], version: u64) -> Result<()> {
        let version_word = self.bucket_version(bucket)?;
        version_word.store(0, Ordering::Relaxed);
        // I2: a lookup that reads any byte written below sees version 0 or the new one.
        fence(Ordering::Release);
        self.seg
            .write_from(self.layout.key_slot_offset(bucket), RawBytes::from(slot))?;
        self.bucket_hash(bucket)?.store(hash, Ordering::Relaxed);
        self.bucket_head(bucket)?
            .store(head.pack(), Ordering::Relaxed);
        // I1: the head and key slot are visible to whoever loads this version with Acquire.
        self.bucket_version(bucket)?
            .store(version, Ordering::Release);
        Ok(())
    }

    /// File `query`'s key as stored in the chunk `(address, id)`, in `bucket` (empty, or
    /// holding the key's claim, which the entry replaces).
    pub(super) fn file_entry(
        &self,
        _lock: &IndexGuard<'_>,
        bucket: u64,
        query: &Query<'_>,
        address: u64,
        id: u64,
    ) -> Result<()> {
        let head = Bucket::Live {
            key: query.kref,
            address,
        };
        self.file(bucket, head, query.hash, query.slot_bytes(), id)
    }

    /// File `owner`'s claim of `query`'s key in `bucket` (empty, or holding a claim of the
    /// same key, which `owner` takes over), with the unique `ticket` as its version.
    pub(super) fn file_claim(
        &self,
        _lock: &IndexGuard<'_>,
        bucket: u64,
        query: &Query<'_>,
        owner: WriterId,
        ticket: u64,
    ) -> Result<()> {
        let head = Bucket::Claim {
            key: query.kref,
            owner,
        };
        self.file(bucket, head, query.hash, query.slot_bytes(), ticket)
    }

    /// Copy the entry in bucket `from` into bucket `to` (the gap of a removal). Its chunk is
    /// not told: an evictor finds the entry by probing from the key hash the chunk keeps.
    fn move_entry(&self, from: u64, to: u64) -> Result<()> {
        let head = Bucket::unpack(self.bucket_head(from)?.load(Ordering::Relaxed));
        let version = self.bucket_version(from)?.load(Ordering::Relaxed);
        let hash = self.bucket_hash(from)?.load(Ordering::Relaxed);
        let mut slot = [0u8; KEY_SLOT_SIZE as usize];
        self.seg
            .read_into(self.layout.key_slot_offset(from), &mut slot)?;
        self.file(to, head, hash, &slot, version)
    }

    /// Empty `bucket`, moving back into the gap every later entry of its cluster whose probe
    /// would otherwise have to pass it (backward shift): no tombstone is left. While entries
    /// move the move count is odd, so lock-free misses retry.
    pub(super) fn remove_bucket(&self, _lock: &IndexGuard<'_>, bucket: u64) -> Result<()> {
        let n = self.layout.index_buckets;
        let mask = n - 1;
        let moves = self.moves()?;
        let mut moving = false;
        let mut gap = bucket;
        let mut next = (gap + 1) & mask;
        for _ in 0..n {
            if Bucket::unpack(self.bucket_head(next)?.load(Ordering::Relaxed)) == Bucket::Empty {
                break;
            }
            let home = self.bucket_hash(next)?.load(Ordering::Relaxed) & mask;
            // `next` may move into the gap unless its home lies cyclically in (gap, next].
            let stays = if gap <= next {
                gap < home && home <= next
            } else {
                gap < home || home <= next
            };
            if !stays {
                if !moving {
                    moves.store(moves.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                    // A lookup that reads any bucket changed below sees the count odd.
                    fence(Ordering::Release);
                    moving = true;
                }
                self.move_entry(next, gap)?;
                gap = next;
            }
            next = (next + 1) & mask;
        }
        self.bucket_version(gap)?.store(0, Ordering::Relaxed);
        self.bucket_head(gap)?
            .store(Bucket::Empty.pack(), Ordering::Release);
        if moving {
            // Pairs with `seek`'s Acquire load: every move above is visible to a lookup that
            // sees the count even again.
            moves.store(moves.load(Ordering::Relaxed) + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Take the chunk `(address, id)` out of the index, if it is filed there: its key's
    /// entry lies on the probe from `hash` (moves only ever shift an entry back towards its
    /// home bucket, never past an empty one). Whether it was.
    pub(super) fn unindex(
        &self,
        lock: &IndexGuard<'_>,
        hash: u64,
        address: u64,
        id: u64,
    ) -> Result<bool> {
        for bucket in self.probe(hash) {
            let head = Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed));
            if head == Bucket::Empty {
                return Ok(false);
            }
            if matches!(head, Bucket::Live { address: a, .. } if a == address)
                && self.bucket_version(bucket)?.load(Ordering::Relaxed) == id
            {
                self.remove_bucket(lock, bucket)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Load the first words of the bucket a key of hash `hash` is probed from (before the
    /// index lock is taken, so that the miss is not taken while holding it).
    pub(super) fn warm_bucket(&self, hash: u64) -> Result<u64> {
        let bucket = hash & (self.layout.index_buckets - 1);
        Ok(self.bucket_head(bucket)?.load(Ordering::Relaxed)
            ^ self.bucket_hash(bucket)?.load(Ordering::Relaxed))
    }

    /// Every bucket that holds an entry or a claim (a snapshot per bucket; without the lock
    /// it may be out of date by the time it returns).
    ///
    /// A bucket tmpfs cannot hold (`ShmTooSmall` reserving it) means nothing was ever filed:
    /// every lock's taker reserves the whole index before it takes the lock, and a reserved
    /// page stays allocated, so no writer ever held a lock, and every lock-free read of the
    /// index answers that nothing is filed (a put refused for want of space is the caller's
    /// to serve uncached).
    pub(super) fn filed(&self) -> Result<Vec<Filed>> {
        let mut out = Vec::new();
        for bucket in 0..self.layout.index_buckets {
            let version = match self.bucket_version(bucket) {
                Ok(word) => word.load(Ordering::Acquire),
                Err(Error::ShmTooSmall { .. }) => return Ok(Vec::new()),
                Err(e) => return Err(e),
            };
            let head = Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed));
            if matches!(head, Bucket::Live { .. } | Bucket::Claim { .. }) {
                out.push(Filed {
                    bucket,
                    head,
                    version,
                });
            }
        }
        Ok(out)
    }

    /// The key filed in `bucket` at `version` (a live entry), read without a lock: `None` if
    /// the bucket changed meanwhile. A long key is read from its chunk.
    pub(super) fn key_of(&self, filed: &Filed) -> Result<Option<String>> {
        let Bucket::Live { key, address } = filed.head else {
            return Ok(None);
        };
        if filed.version == 0 {
            return Ok(None); // being filed (or left half filed by a writer that died)
        }
        let bytes = if key.is_long() {
            if !self.layout.valid_chunk_address(address) {
                return Ok(None);
            }
            let extra = self.chunk(address, chunk::EXTRA)?.load(Ordering::Relaxed);
            let len = self.chunk(address, chunk::LEN)?.load(Ordering::Relaxed);
            let key_len = extra & 0xffff_ffff;
            if key_len as usize > crate::layout::MAX_KEY_LEN
                || !self.layout.fits(address, len.saturating_add(key_len))
            {
                return Ok(None);
            }
            let mut bytes = vec![0u8; key_len as usize];
            self.seg
                .read_into_racy(self.payload_offset(address) + len, &mut bytes)?;
            // Pairs with P2/P3: a reused chunk shows another id.
            fence(Ordering::Acquire);
            if self.chunk(address, chunk::ID)?.load(Ordering::Relaxed) != filed.version {
                return Ok(None);
            }
            bytes
        } else {
            let mut bytes = vec![0u8; key.len as usize];
            self.seg
                .read_into_racy(self.layout.key_slot_offset(filed.bucket), &mut bytes)?;
            bytes
        };
        fence(Ordering::Acquire);
        if self.bucket_version(filed.bucket)?.load(Ordering::Relaxed) != filed.version {
            return Ok(None);
        }
        Ok(String::from_utf8(bytes).ok())
    }

    /// Every stored key (a snapshot: keys put or removed meanwhile may be missing or present).
    pub(super) fn keys(&self) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        for filed in self.filed()? {
            if let Some(key) = self.key_of(&filed)? {
                keys.push(key);
            }
        }
        Ok(keys)
    }

    /// After taking the index lock over from a holder that died: rebuild the index from what
    /// it holds (it may have died filing, removing or moving entries: a bucket half written,
    /// an entry twice, a gap a lookup would stop at), and recount the objects and claims
    /// gauges. Lookups meanwhile see an odd move count and confirm their misses after.
    pub(super) fn repair_index(&self, _lock: &IndexGuard<'_>) -> Result<()> {
        let moves = self.moves()?;
        moves.store(moves.load(Ordering::Relaxed) | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        let mut entries = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for bucket in 0..self.layout.index_buckets {
            let version = self.bucket_version(bucket)?.load(Ordering::Relaxed);
            let head = Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed));
            if head != Bucket::Empty && version != 0 && seen.insert(version) {
                let hash = self.bucket_hash(bucket)?.load(Ordering::Relaxed);
                let mut slot = [0u8; KEY_SLOT_SIZE as usize];
                self.seg
                    .read_into(self.layout.key_slot_offset(bucket), &mut slot)?;
                entries.push((head, version, hash, slot));
            }
            self.bucket_version(bucket)?.store(0, Ordering::Relaxed);
            self.bucket_head(bucket)?
                .store(Bucket::Empty.pack(), Ordering::Relaxed);
        }
        let (mut objects, mut claims) = (0, 0);
        for (head, version, hash, slot) in entries {
            let mut empty = None;
            for bucket in self.probe(hash) {
                if Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed))
                    == Bucket::Empty
                {
                    empty = Some(bucket);
                    break;
                }
            }
            let bucket = empty.ok_or_else(|| Error::Corrupt("the key index is full".into()))?;
            self.file(bucket, head, hash, &slot, version)?;
            match head {
                Bucket::Live { .. } => objects += 1,
                Bucket::Claim { .. } => claims += 1,
                Bucket::Empty => {}
            }
        }
        moves.store(moves.load(Ordering::Relaxed) + 1, Ordering::Release);
        for (counter, value) in [(Counter::Objects, objects), (Counter::Claims, claims)] {
            self.counter(counter)?.store(value, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Writer;

    #[test]
    fn a_key_slot_matches_its_key_whatever_lies_past_its_end() {
        // The compare goes word by word, the last word masked to the key: keys of every
        // length a slot holds (and a long key's digest), over an earlier key's bytes, match
        // themselves and nothing that differs from them in one byte.
        let w = Writer::create(1 << 20, 1, None, None).unwrap();
        let sh = &w.shared;
        let bucket = 5;
        let slot = sh.layout.key_slot_offset(bucket);
        let write = |bytes: &[u8]| sh.seg.write_from(slot, RawBytes::from(bytes)).unwrap();
        for len in (0..=64).chain([65, 200]) {
            let key: String = (0..len)
                .map(|i| (b'a' + (i * 7 + len) as u8 % 26) as char)
                .collect();
            let query = w.query(&key);
            let bytes = query.slot_bytes().to_vec();
            write(&[0xa5; KEY_SLOT_SIZE as usize]);
            write(&bytes);
            assert!(sh.key_slot_matches(bucket, &query).unwrap(), "length {len}");
            for i in 0..bytes.len() {
                let mut changed = bytes.clone();
                changed[i] ^= 0x20;
                write(&changed);
                assert!(
                    !sh.key_slot_matches(bucket, &query).unwrap(),
                    "length {len}, byte {i}"
                );
            }
        }
    }
}
