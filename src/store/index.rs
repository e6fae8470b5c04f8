//! The shared key index: an open-addressing table (linear probing) in the segment that maps
//! each stored key to its chunk and each claimed key to its claimant, read by every writer
//! without a lock.
//!
//! A bucket is a head word (`layout::Bucket`: kind, key length, a tag of the key's hash, the
//! chunk address or the claimant), a version word (the entry's unique id, 0 while it changes)
//! and a 64-byte key slot holding the key itself (keys of at most 64 bytes, content hashes as
//! hex among them) or, for a longer key, its BLAKE3 digest (the key itself is then stored in
//! the chunk, after the payload, for [`Shared::keys`]). So a lookup compares real keys and
//! touches no chunk: a hit is a hash, one or two buckets and a key compare.
//!
//! Lookups are a seqlock read on the version word (I1/I2 in the protocol of
//! [`store`](super)). Every change is made under the store lock: filing an entry or a claim,
//! turning a claim into an entry in place, and removing one, which leaves a tombstone (a
//! probe goes on past it) that becomes empty again as soon as the bucket after it is empty
//! (then no probe can need to pass it). The table has at least twice as many buckets as it
//! may hold entries and claims (`Layout::max_objects`); beyond that a put first evicts (the
//! allocator's CLOCK), so probes stay short and a free bucket always exists. A probe visits
//! each bucket at most once: even a corrupt table cannot make it loop.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::Shared;
use super::lock::LockGuard;
use crate::error::{Error, Result};
use crate::keyhash::KeyHasher;
use crate::layout::{Bucket, KeyRef, WriterId, chunk};
use crate::segment::RawBytes;

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
    fn slot_bytes(&self) -> &[u8] {
        match &self.digest {
            Some(digest) => digest,
            None => self.key.as_bytes(),
        }
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
    /// Its bucket is being changed right now (a claim becoming an entry, say).
    Changing,
    Absent,
}

/// Where a key is, or would go, as the store lock's holder finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Found {
    Stored(Entry),
    Claimed { bucket: u64, owner: WriterId },
    Vacant { bucket: u64 },
}

/// One bucket as a scan sees it (under the store lock, or racily for statistics).
#[derive(Clone, Copy, Debug)]
pub(super) struct Filed {
    pub(super) bucket: u64,
    pub(super) head: Bucket,
    pub(super) version: u64,
}

impl Shared {
    fn bucket_head(&self, bucket: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.bucket_offset(bucket))
    }

    fn bucket_version(&self, bucket: u64) -> Result<&AtomicU64> {
        self.seg.atomic(self.layout.bucket_offset(bucket) + 8)
    }

    fn key_slot_matches(&self, bucket: u64, query: &Query<'_>) -> Result<bool> {
        self.racy_eq(self.layout.key_slot_offset(bucket), query.slot_bytes())
    }

    /// The buckets a probe for `hash` visits, in order (each once).
    fn probe(&self, hash: u64) -> impl Iterator<Item = u64> {
        let n = self.layout.index_buckets;
        let start = hash & (n - 1);
        (0..n).map(move |i| (start + i) & (n - 1))
    }

    /// Where `query`'s key is stored or claimed, without a lock (a seqlock read per bucket,
    /// I1/I2 in the protocol).
    pub(super) fn seek(&self, query: &Query<'_>) -> Result<Seen> {
        for bucket in self.probe(query.hash) {
            let mut spins = 0;
            loop {
                // Acquire pairs with I1: the head and key slot of that version are visible.
                let version = self.bucket_version(bucket)?.load(Ordering::Acquire);
                let head = Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed));
                let (kref, found) = match head {
                    Bucket::Empty => return Ok(Seen::Absent),
                    Bucket::Tomb => break,
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
                let unchanged = self.bucket_version(bucket)?.load(Ordering::Relaxed) == version;
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

    /// The entry of a stored key, without a lock.
    pub(super) fn lookup(&self, query: &Query<'_>) -> Result<Option<Entry>> {
        Ok(match self.seek(query)? {
            Seen::Stored(entry) => Some(entry),
            _ => None,
        })
    }

    /// Where `query`'s key is stored, claimed, or would be filed (the store lock's holder:
    /// nothing changes meanwhile, so plain reads suffice).
    pub(super) fn find(&self, _lock: &LockGuard<'_>, query: &Query<'_>) -> Result<Found> {
        let mut free = None;
        for bucket in self.probe(query.hash) {
            let version = self.bucket_version(bucket)?.load(Ordering::Acquire);
            match Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed)) {
                Bucket::Empty => {
                    return Ok(Found::Vacant {
                        bucket: free.unwrap_or(bucket),
                    });
                }
                Bucket::Tomb => {
                    free.get_or_insert(bucket);
                }
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
        free.map(|bucket| Found::Vacant { bucket }).ok_or_else(|| {
            Error::Corrupt("the key index has no free bucket (it is never filled past half)".into())
        })
    }

    /// Make `bucket` hold `head` for `query`'s key, with version `version` (the store lock's
    /// holder; `bucket` is vacant, or holds `query`'s claim). I2 then I1.
    fn file(&self, bucket: u64, query: &Query<'_>, head: Bucket, version: u64) -> Result<()> {
        let version_word = self.bucket_version(bucket)?;
        version_word.store(0, Ordering::Relaxed);
        // I2: a lookup that reads any byte written below sees version 0 or the new one.
        fence(Ordering::Release);
        self.seg.write_from(
            self.layout.key_slot_offset(bucket),
            RawBytes::from(query.slot_bytes()),
        )?;
        self.bucket_head(bucket)?
            .store(head.pack(), Ordering::Relaxed);
        // I1: the head and key slot are visible to whoever loads this version with Acquire.
        version_word.store(version, Ordering::Release);
        Ok(())
    }

    /// File `query`'s key as stored in the chunk `(address, id)`, in `bucket` (vacant, or
    /// holding the key's claim, which the entry replaces).
    pub(super) fn file_entry(
        &self,
        _lock: &LockGuard<'_>,
        bucket: u64,
        query: &Query<'_>,
        address: u64,
        id: u64,
    ) -> Result<()> {
        let head = Bucket::Live {
            key: query.kref,
            address,
        };
        self.file(bucket, query, head, id)
    }

    /// File `owner`'s claim of `query`'s key in `bucket` (vacant, or holding a claim of the
    /// same key, which `owner` takes over), with the unique `ticket` as its version.
    pub(super) fn file_claim(
        &self,
        _lock: &LockGuard<'_>,
        bucket: u64,
        query: &Query<'_>,
        owner: WriterId,
        ticket: u64,
    ) -> Result<()> {
        let head = Bucket::Claim {
            key: query.kref,
            owner,
        };
        self.file(bucket, query, head, ticket)
    }

    /// Empty `bucket` (it leaves a tombstone, which becomes empty again once nothing can need
    /// to probe past it).
    pub(super) fn remove_bucket(&self, _lock: &LockGuard<'_>, bucket: u64) -> Result<()> {
        self.bucket_version(bucket)?.store(0, Ordering::Relaxed);
        self.bucket_head(bucket)?
            .store(Bucket::Tomb.pack(), Ordering::Release);
        let n = self.layout.index_buckets;
        let next = (bucket + 1) & (n - 1);
        if Bucket::unpack(self.bucket_head(next)?.load(Ordering::Relaxed)) != Bucket::Empty {
            return Ok(());
        }
        // A tombstone followed by an empty bucket ends every probe that reaches it: empty.
        let mut b = bucket;
        for _ in 0..n {
            let head = self.bucket_head(b)?;
            if Bucket::unpack(head.load(Ordering::Relaxed)) != Bucket::Tomb {
                break;
            }
            head.store(Bucket::Empty.pack(), Ordering::Release);
            b = (b + n - 1) & (n - 1);
        }
        Ok(())
    }

    /// Take the chunk `(address, id)` out of the index, if `bucket` still files it there.
    /// Whether it did.
    pub(super) fn unindex(
        &self,
        lock: &LockGuard<'_>,
        bucket: u64,
        address: u64,
        id: u64,
    ) -> Result<bool> {
        if bucket >= self.layout.index_buckets {
            return Ok(false);
        }
        let head = Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed));
        let version = self.bucket_version(bucket)?.load(Ordering::Relaxed);
        if !matches!(head, Bucket::Live { address: a, .. } if a == address) || version != id {
            return Ok(false);
        }
        self.remove_bucket(lock, bucket)?;
        Ok(true)
    }

    /// Every bucket that holds an entry or a claim (a snapshot per bucket; without the lock
    /// it may be out of date by the time it returns).
    pub(super) fn filed(&self) -> Result<Vec<Filed>> {
        let mut out = Vec::new();
        for bucket in 0..self.layout.index_buckets {
            let version = self.bucket_version(bucket)?.load(Ordering::Acquire);
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

    /// After taking the lock over from a holder that died: remove any bucket it left half
    /// changed (version 0 under a live or claim head), and count entries and claims.
    pub(super) fn repair_index(&self, lock: &LockGuard<'_>) -> Result<(u64, u64)> {
        let (mut objects, mut claims) = (0, 0);
        for bucket in 0..self.layout.index_buckets {
            let version = self.bucket_version(bucket)?.load(Ordering::Relaxed);
            match Bucket::unpack(self.bucket_head(bucket)?.load(Ordering::Relaxed)) {
                Bucket::Live { .. } | Bucket::Claim { .. } if version == 0 => {
                    self.remove_bucket(lock, bucket)?;
                }
                Bucket::Live { .. } => objects += 1,
                Bucket::Claim { .. } => claims += 1,
                Bucket::Empty | Bucket::Tomb => {}
            }
        }
        Ok((objects, claims))
    }
}
