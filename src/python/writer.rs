//! `ShmWriter`: one writer of a store (`ShmObjectStore.create` makes the first, `.join` the
//! others). Lookups (`is_cached`, `issue`, `pin`, `unpin`) hold the GIL and take no lock
//! shared between processes; copies release the GIL when large (`put`) or always (reads,
//! whose length only the core knows); waits (`wait_for`, `claim`, `close`) always release it.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use super::buffer::{collect_buffers, copying, raw_parts};
use super::encode::Encoded;
use super::handles::{ShmHandle, WriterHandle};
use super::store::{Open, ShmObjectStore};
use crate::error::Error;
use crate::segment::RawBytes;
use crate::store::Writer;

/// The writer's own read of a handle's object: a verified private copy. The GIL is released
/// whatever the size: the length is known only inside the core.
pub(super) fn read_copy(
    py: Python<'_>,
    writer: &Writer,
    handle: &ShmHandle,
    key: &str,
) -> PyResult<Vec<u8>> {
    let handle = handle.to_handle()?;
    Ok(py.detach(|| writer.read(&handle, key))?)
}

/// `Writer::put_raw`, with the GIL released when there is much to copy.
fn put_parts(
    py: Python<'_>,
    writer: &Writer,
    key: &str,
    parts: &[RawBytes<'_>],
    meta: &[u8],
) -> PyResult<ShmHandle> {
    let total = parts.iter().map(RawBytes::len).sum::<usize>() + meta.len();
    let meta = RawBytes::from(meta);
    let handle = copying(py, total, || writer.put_raw(key, parts, meta))?;
    Ok(ShmHandle::from_handle(handle))
}

/// One writer of a store (`ShmObjectStore.create`, `ShmObjectStore.join`).
#[pyclass(frozen, extends = ShmObjectStore, module = "mmcache._core")]
pub(crate) struct ShmWriter {
    writer: Open<Writer>,
    slot: u32,
}

impl ShmWriter {
    pub(super) fn new(writer: Writer) -> Self {
        ShmWriter {
            slot: writer.slot(),
            writer: Open::new(Arc::new(writer)),
        }
    }

    pub(super) fn open(&self) -> &Open<Writer> {
        &self.writer
    }
}

#[pymethods]
impl ShmWriter {
    /// This writer's slot among the store's `max_writers`.
    #[getter]
    fn writer_slot(&self) -> u32 {
        self.slot
    }

    /// Everything another process needs to join the store as a writer (with the signing
    /// secret: same trust as the reader handle).
    fn writer_handle(&self) -> PyResult<WriterHandle> {
        Ok(WriterHandle::from_info(self.writer.get()?.writer_info()))
    }

    /// Store `data` (one buffer, or a list/tuple of them, written part by part) under `key`,
    /// with `meta` beside it (any writer reads it back with `read_meta`; readers never see it).
    #[pyo3(signature = (key, data, *, meta = b"".as_slice()), text_signature = "($self, key, data, *, meta=b'')")]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        data: &Bound<'_, PyAny>,
        meta: &[u8],
    ) -> PyResult<ShmHandle> {
        let writer = self.writer.get()?;
        let buffers = collect_buffers(data)?;
        put_parts(py, &writer, key, &raw_parts(&buffers), meta)
    }

    /// Encode `item` (a mapping of tensors, arrays and small values) and store it under
    /// `key`, in one pass: the header and every tensor's bytes go straight into the chunk.
    #[pyo3(signature = (key, item, *, meta = b"".as_slice()), text_signature = "($self, key, item, *, meta=b'')")]
    fn put_item(
        &self,
        py: Python<'_>,
        key: &str,
        item: &Bound<'_, PyAny>,
        meta: &[u8],
    ) -> PyResult<ShmHandle> {
        let writer = self.writer.get()?;
        let encoded = Encoded::new(item)?;
        let parts = encoded.parts();
        // `Encoded::copying`, not `put_parts`: it keeps the GIL when a part lies in a torch
        // storage, which another thread may free while the GIL is released.
        let meta = RawBytes::from(meta);
        let handle = encoded.copying(py, || writer.put_raw(key, &parts, meta))?;
        Ok(ShmHandle::from_handle(handle))
    }

    fn is_cached(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        Ok(self.writer.with(py, |w| w.is_cached(key))??)
    }

    /// Those of `keys` (strs) that are not stored, by `is_cached`'s lookup each: what a cache
    /// keeps about objects since evicted, found at a cost that grows with what it keeps, not
    /// with the ring (`keys` walks the whole index).
    fn uncached<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        // An `Arc`, not `with`: iterating `keys` may run Python code (a generator).
        let writer = self.writer.get()?;
        let out = PyList::empty(py);
        for key in keys.try_iter()? {
            let key = key?;
            if !writer.is_cached(key.cast::<PyString>()?.to_str()?)? {
                out.append(key)?;
            }
        }
        Ok(out)
    }

    /// One more reference to `key`'s object, as a handle (`KeyError` if absent).
    fn issue(&self, py: Python<'_>, key: &str) -> PyResult<ShmHandle> {
        let handle = self.writer.with(py, |w| w.get_cached(key))??;
        Ok(ShmHandle::from_handle(handle))
    }

    /// `issue`, with `None` for an absent key instead of `KeyError` (P0's hot path).
    fn issue_if_present(&self, py: Python<'_>, key: &str) -> PyResult<Option<ShmHandle>> {
        match self.writer.with(py, |w| w.get_cached(key))? {
            Ok(h) => Ok(Some(ShmHandle::from_handle(h))),
            Err(Error::KeyNotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// `issue_if_present`, and if the object issued is the one `pinned` names (a monotonic
    /// id from `pin_object`), one of this writer's pins on it undone in the same lookup.
    fn issue_unpinning(
        &self,
        py: Python<'_>,
        key: &str,
        pinned: Option<u64>,
    ) -> PyResult<Option<ShmHandle>> {
        match self
            .writer
            .with(py, |w| w.get_cached_unpinning(key, pinned))?
        {
            Ok(h) => Ok(Some(ShmHandle::from_handle(h))),
            Err(Error::KeyNotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// A copy of what is stored under `key`, issuing no reference (`KeyError` if absent).
    fn read_stored<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let writer = self.writer.get()?;
        let bytes = py.detach(|| writer.read_key(key))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The metadata stored with `key`'s object (`KeyError` if absent; with `monotonic_id`,
    /// also if `key` now names another object than the one with that id).
    #[pyo3(signature = (key, *, monotonic_id = None))]
    fn read_meta<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        monotonic_id: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (_, meta) = self.writer.with(py, |w| w.read_meta(key, monotonic_id))??;
        Ok(PyBytes::new(py, &meta))
    }

    fn pin(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        Ok(self.writer.with(py, |w| w.pin(key))??)
    }

    /// `pin`, returning whether `key` was there to pin instead of raising `KeyError`.
    fn pin_if_present(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        match self.writer.with(py, |w| w.pin(key))? {
            Ok(()) => Ok(true),
            Err(Error::KeyNotFound(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// `pin_if_present`, returning the monotonic id of the object pinned (`None` if `key` is
    /// absent), for `unpin_object` or `issue_unpinning`.
    fn pin_object(&self, py: Python<'_>, key: &str) -> PyResult<Option<u64>> {
        Ok(self.writer.with(py, |w| w.pin_object(key))??)
    }

    /// Undo one of this writer's pins on `key`'s object if it is still the one with
    /// `monotonic_id` (a no-op otherwise).
    fn unpin_object(&self, py: Python<'_>, key: &str, monotonic_id: u64) -> PyResult<()> {
        Ok(self
            .writer
            .with(py, |w| w.unpin_object(key, monotonic_id))??)
    }

    fn unpin(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        Ok(self.writer.with(py, |w| w.unpin(key))??)
    }

    fn release(&self, py: Python<'_>, handle: &ShmHandle) -> PyResult<()> {
        let handle = handle.to_handle()?;
        Ok(self.writer.with(py, |w| w.release(&handle))??)
    }

    fn verify(&self, py: Python<'_>, handle: &ShmHandle, key: &str) -> PyResult<bool> {
        match handle.to_handle() {
            Ok(h) => Ok(self.writer.with(py, |w| w.verify(&h, key))??),
            Err(_) => Ok(false), // a signature of the wrong length names no entry
        }
    }

    fn invalidate(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        let writer = self.writer.get()?;
        Ok(py.detach(|| writer.invalidate(key))?)
    }

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let writer = self.writer.get()?;
        Ok(py.detach(|| writer.clear())?)
    }

    fn keys(&self) -> PyResult<Vec<String>> {
        Ok(self.writer.get()?.keys()?)
    }

    /// Claim `key` for this writer (single flight): `True` if this writer now holds the
    /// claim, `False` if the key is stored or another live writer claimed it.
    fn claim(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        let writer = self.writer.get()?;
        Ok(py.detach(|| writer.claim(key))?)
    }

    /// Give up this writer's claim of `key` (a no-op if it holds none).
    fn unclaim(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        let writer = self.writer.get()?;
        Ok(py.detach(|| writer.unclaim(key))?)
    }

    /// Wait up to `timeout_s` seconds for keys another live writer claimed: whether each key
    /// is stored when it returns (never waits on this writer's own claims).
    fn wait_for(&self, py: Python<'_>, keys: Vec<String>, timeout_s: f64) -> PyResult<Vec<bool>> {
        if !(timeout_s >= 0.0 && timeout_s.is_finite()) {
            return Err(PyValueError::new_err(format!(
                "timeout_s must be a finite number >= 0, not {timeout_s}"
            )));
        }
        let writer = self.writer.get()?;
        let timeout = Duration::from_secs_f64(timeout_s.min(1e9));
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        Ok(py.detach(|| writer.wait_for(&keys, timeout))?)
    }

    /// Alias of `issue` (the name SPEC.md gives it).
    fn get_cached(&self, py: Python<'_>, key: &str) -> PyResult<ShmHandle> {
        self.issue(py, key)
    }

    /// Alias of `issue_if_present`.
    fn try_get_cached(&self, py: Python<'_>, key: &str) -> PyResult<Option<ShmHandle>> {
        self.issue_if_present(py, key)
    }

    /// Alias of `read_stored`.
    fn get_stored<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.read_stored(py, key)
    }

    /// Alias of `pin_if_present`.
    fn try_pin(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.pin_if_present(py, key)
    }
}

/// `ShmSenderCache.is_cached_item` in one native call, with no Python frame (P0 asks it of
/// every item of every request): whether `key` is stored, by the writer's lock-free lookup,
/// and the cache keeps its prompt updates, in `kept` (the cache's own dict, read with the GIL
/// held). A key stored but not kept is answered by `learn`, a weak method of the cache
/// (`weakref.WeakMethod`, so this check, which the cache holds, does not keep it alive).
#[pyclass(frozen, module = "mmcache._core")]
pub(crate) struct CachedItemCheck {
    writer: Py<ShmWriter>,
    kept: Py<PyDict>,
    learn: Py<PyAny>,
}

#[pymethods]
impl CachedItemCheck {
    #[new]
    fn new(writer: Py<ShmWriter>, kept: Py<PyDict>, learn: Py<PyAny>) -> Self {
        CachedItemCheck {
            writer,
            kept,
            learn,
        }
    }

    /// Whether `mm_hash` is cached for the cache (`is_cached_item`, and its argument's name).
    fn check(&self, py: Python<'_>, mm_hash: &Bound<'_, PyString>) -> PyResult<bool> {
        let key = mm_hash.to_str()?;
        if !self.writer.get().writer.with(py, |w| w.is_cached(key))?? {
            return Ok(false);
        }
        if self.kept.bind(py).contains(mm_hash)? {
            return Ok(true);
        }
        let learn = self.learn.bind(py).call0()?;
        Ok(!learn.is_none() && learn.call1((mm_hash,))?.is_truthy()?)
    }
}
