//! A writer's own copies out of the ring: an object through a handle (`read`) or by key
//! (`read_key`), the metadata stored beside it (`read_meta`), and `verify`, which checks a
//! handle without copying. Each copies from a chunk it has protected (S1), so the bytes are
//! that chunk's; no reference is issued and nothing changes.

use std::sync::atomic::Ordering;

use super::super::index::Entry;
use super::Writer;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::layout::chunk;

impl Writer {
    /// Whether `handle` is the current entry of `key`: signed for `key` by this store and
    /// naming the chunk `key` is stored in now. No side effect: no reference is issued, no
    /// hit counted, no recency changed (for validating handles a client sent back).
    pub fn verify(&self, handle: &Handle, key: &str) -> Result<bool> {
        self.check_open()?;
        if self.signer.verify(key, handle).is_none() {
            return Ok(false);
        }
        Ok(self
            .shared
            .lookup(&self.query(key))?
            .is_some_and(|e| e.address == handle.address && e.id == handle.monotonic_id))
    }

    /// Copy `len` bytes at `offset` into the payload of a protected chunk (its length comes
    /// from shared memory, so it is checked before anything is allocated).
    fn copy_out(&self, address: u64, offset: u64, len: u64) -> Result<Vec<u8>> {
        let fits = offset
            .checked_add(len)
            .is_some_and(|n| self.shared.layout.fits(address, n));
        if !fits {
            return Err(Error::Corrupt(format!(
                "chunk at {address} claims {len} bytes at {offset}, more than fit"
            )));
        }
        let mut out = vec![0u8; len as usize];
        self.shared
            .seg
            .read_into(self.shared.payload_offset(address) + offset, &mut out)?;
        Ok(out)
    }

    fn payload_len(&self, address: u64) -> Result<u64> {
        let len = self
            .shared
            .chunk(address, chunk::LEN)?
            .load(Ordering::Relaxed);
        if !self.shared.layout.valid_payload(address, len) {
            return Err(Error::Corrupt(format!(
                "chunk at {address} claims {len} bytes, more than fit"
            )));
        }
        Ok(len)
    }

    /// Copy an object out through a handle: the writer's own read (any writer's handle).
    pub fn read(&self, handle: &Handle, key: &str) -> Result<Vec<u8>> {
        self.check_open()?;
        if !self.shared.layout.valid_chunk_address(handle.address) {
            return Err(Error::InvalidHandle(format!(
                "address {} is out of range",
                handle.address
            )));
        }
        if self.signer.verify(key, handle).is_none() {
            return Err(Error::InvalidHandle("bad signature".into()));
        }
        let entry = Entry {
            bucket: 0,
            address: handle.address,
            id: handle.monotonic_id,
        };
        let Some(_protected) = self.protect_settled(&entry)? else {
            return Err(Error::Stale);
        };
        self.copy_out(handle.address, 0, self.payload_len(handle.address)?)
    }

    /// Copy out the object stored under `key`, issuing no reference (`KeyNotFound` if
    /// absent): how a writer serves a cached item it cannot hand out a handle for.
    pub fn read_key(&self, key: &str) -> Result<Vec<u8>> {
        self.check_open()?;
        let Some((entry, _protected)) = self.find_protected(&self.query(key))? else {
            return Err(Error::KeyNotFound(key.to_owned()));
        };
        self.copy_out(entry.address, 0, self.payload_len(entry.address)?)
    }

    /// The metadata stored with `key`'s object and that object's id (its handles'
    /// `monotonic_id`). With `id`, only that object's: `KeyNotFound` if `key` now names
    /// another object (or none).
    pub fn read_meta(&self, key: &str, id: Option<u64>) -> Result<(u64, Vec<u8>)> {
        self.check_open()?;
        let not_found = || Error::KeyNotFound(key.to_owned());
        let Some((entry, _protected)) = self.find_protected(&self.query(key))? else {
            return Err(not_found());
        };
        if id.is_some_and(|id| id != entry.id) {
            return Err(not_found());
        }
        let len = self.payload_len(entry.address)?;
        let extra = self
            .shared
            .chunk(entry.address, chunk::EXTRA)?
            .load(Ordering::Relaxed);
        let (meta_len, key_len) = (extra >> 32, extra & 0xffff_ffff);
        let meta = self.copy_out(entry.address, len + key_len, meta_len)?;
        Ok((entry.id, meta))
    }
}
