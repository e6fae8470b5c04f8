//! The store classes. `ShmObjectStore` holds what both roles share; its two subclasses hold
//! one role each: `ShmWriter` (made by `ShmObjectStore.create`) and `ShmReader` (made by
//! `ShmObjectStore.attach`). A method of the other role is simply absent (an
//! `AttributeError`, which type checkers see), and methods that change state are named for
//! the change: `issue` adds a reference, a reader's `resolve` consumes one.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pyclass_init::PyClassInitializer;
use pyo3::types::{PyBytes, PyDict};

use super::buffer::{Keeper, ShmView, collect_buffers, copying, raw_parts};
use super::decode::{check_pin_memory, decode};
use super::encode::Encoded;
use super::handles::{ReaderHandle, ShmHandle};
use crate::error::Error;
use crate::layout::Layout;
use crate::segment::RawBytes;
use crate::store::{Reader, ReaderInfo, Stats, Writer};

/// A writer or reader until `close()`, after which every use is a `ClosedError`.
struct Open<T>(Mutex<Option<Arc<T>>>);

impl<T> Open<T> {
    fn new(endpoint: Arc<T>) -> Self {
        Open(Mutex::new(Some(endpoint)))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arc<T>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self) -> PyResult<Arc<T>> {
        self.lock().clone().ok_or_else(|| Error::Closed.into())
    }

    fn take(&self) -> Option<Arc<T>> {
        self.lock().take()
    }

    fn is_closed(&self) -> bool {
        self.lock().is_none()
    }
}

/// The role behind a `ShmObjectStore`, for the methods both roles have.
enum Role<'a> {
    Writer(&'a Open<Writer>),
    Reader(&'a Open<Reader>),
}

/// One named shared-memory ring: created by its single writer (`ShmWriter`), attached by
/// readers (`ShmReader`).
#[pyclass(frozen, subclass, module = "mmcache._core")]
pub(crate) struct ShmObjectStore {
    name: String,
    capacity: u64,
    n_readers: u32,
    max_object_size: u64,
    info: ReaderInfo,
}

impl ShmObjectStore {
    fn new(name: &str, layout: Layout, info: ReaderInfo) -> Self {
        ShmObjectStore {
            name: name.to_owned(),
            capacity: layout.capacity,
            n_readers: layout.n_readers,
            max_object_size: layout.max_object_size,
            info,
        }
    }

    fn role<'a>(slf: &'a Bound<'_, Self>) -> PyResult<Role<'a>> {
        if let Ok(writer) = slf.cast::<ShmWriter>() {
            return Ok(Role::Writer(&writer.get().writer));
        }
        if let Ok(reader) = slf.cast::<ShmReader>() {
            return Ok(Role::Reader(&reader.get().reader));
        }
        Err(PyTypeError::new_err(
            "a store is a writer (ShmObjectStore.create) or a reader (ShmObjectStore.attach)",
        ))
    }
}

#[pymethods]
impl ShmObjectStore {
    /// The single writer of a new segment.
    #[staticmethod]
    #[pyo3(signature = (capacity, *, n_readers = 1, max_object_size = None, name = None))]
    fn create<'py>(
        py: Python<'py>,
        capacity: u64,
        n_readers: u32,
        max_object_size: Option<u64>,
        name: Option<&str>,
    ) -> PyResult<Bound<'py, ShmWriter>> {
        let writer = Writer::create(capacity, n_readers, max_object_size, name)?;
        let base = ShmObjectStore::new(writer.name(), writer.layout(), writer.reader_info());
        let writer = ShmWriter {
            writer: Open::new(Arc::new(writer)),
        };
        Bound::new(py, PyClassInitializer::from(base).add_subclass(writer))
    }

    /// A reader of the segment `handle` names, in a reader slot of its own.
    #[staticmethod]
    fn attach<'py>(py: Python<'py>, handle: &ReaderHandle) -> PyResult<Bound<'py, ShmReader>> {
        let reader = Reader::attach(handle.info())?;
        let base = ShmObjectStore::new(reader.name(), reader.layout(), handle.info().clone());
        let reader = ShmReader {
            slot: reader.slot(),
            reader: Open::new(reader),
        };
        Bound::new(py, PyClassInitializer::from(base).add_subclass(reader))
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }
    #[getter]
    fn capacity(&self) -> u64 {
        self.capacity
    }
    #[getter]
    fn n_readers(&self) -> u32 {
        self.n_readers
    }
    #[getter]
    fn max_object_size(&self) -> u64 {
        self.max_object_size
    }
    #[getter]
    fn is_writer(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(matches!(Self::role(slf)?, Role::Writer(_)))
    }
    #[getter]
    fn closed(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(match Self::role(slf)? {
            Role::Writer(w) => w.is_closed(),
            Role::Reader(r) => r.is_closed(),
        })
    }

    fn handle(slf: &Bound<'_, Self>) -> PyResult<ReaderHandle> {
        if Self::closed(slf)? {
            return Err(Error::Closed.into());
        }
        Ok(ReaderHandle::from_info(slf.get().info.clone()))
    }

    /// The object's bytes: a reader's `resolve`, or the writer's own verified copy.
    #[pyo3(signature = (handle, key, copy = true))]
    fn get(
        slf: &Bound<'_, Self>,
        handle: &ShmHandle,
        key: &str,
        copy: bool,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        match Self::role(slf)? {
            Role::Reader(r) => resolve(py, &r.get()?, handle, key, copy),
            Role::Writer(w) => {
                let bytes = read_copy(py, &*w.get()?, handle, key)?;
                Ok(if copy {
                    PyBytes::new(py, &bytes).into_any().unbind()
                } else {
                    Py::new(py, ShmView::new(Arc::new(Keeper::Copy(bytes))))?.into_any()
                })
            }
        }
    }

    /// The object's item: a reader's `resolve_item`, or decoded from the writer's own copy.
    #[pyo3(signature = (handle, key, *, copy = true, pin_memory = false))]
    fn get_item<'py>(
        slf: &Bound<'py, Self>,
        handle: &ShmHandle,
        key: &str,
        copy: bool,
        pin_memory: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let py = slf.py();
        match Self::role(slf)? {
            Role::Reader(r) => resolve_item(py, &r.get()?, handle, key, copy, pin_memory),
            Role::Writer(w) => {
                check_pin_memory(copy, pin_memory)?;
                let keep = Arc::new(Keeper::Copy(read_copy(py, &*w.get()?, handle, key)?));
                decode(py, &keep, copy, pin_memory)
            }
        }
    }

    fn stats<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let stats: Stats = match Self::role(slf)? {
            Role::Writer(w) => w.get()?.stats()?,
            Role::Reader(r) => r.get()?.stats()?,
        };
        let dict = PyDict::new(slf.py());
        for (k, v) in stats {
            dict.set_item(k, v)?;
        }
        Ok(dict)
    }

    /// Close the writer (its segment is unlinked) or detach the reader (its slot drains:
    /// freed now, or when its last zero-copy view is gone). Idempotent.
    fn close(slf: &Bound<'_, Self>) -> PyResult<()> {
        match Self::role(slf)? {
            Role::Writer(w) => {
                if let Some(writer) = w.take() {
                    writer.close()?;
                }
            }
            Role::Reader(r) => {
                if let Some(reader) = r.take() {
                    reader.close();
                }
            }
        }
        Ok(())
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __exit__(
        slf: &Bound<'_, Self>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        Self::close(slf)
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let this = slf.get();
        Ok(format!(
            "{}(name={:?}, capacity={})",
            slf.get_type().qualname()?,
            this.name,
            this.capacity
        ))
    }
}

/// The writer's own read of a handle's object: a verified private copy. The GIL is released
/// whatever the size: the length is known only inside the core, under the writer's lock.
fn read_copy(py: Python<'_>, writer: &Writer, handle: &ShmHandle, key: &str) -> PyResult<Vec<u8>> {
    let handle = handle.to_handle()?;
    Ok(py.detach(|| writer.read(&handle, key))?)
}

/// A reader's read of a handle's object, consuming one of its references: the bytes, or
/// (`copy=False`) a read-only `ShmView` that keeps the object alive.
fn resolve(
    py: Python<'_>,
    reader: &Arc<Reader>,
    handle: &ShmHandle,
    key: &str,
    copy: bool,
) -> PyResult<Py<PyAny>> {
    let lease = reader.acquire(&handle.to_handle()?, key)?;
    if !copy {
        let keep = Keeper::from_lease(py, lease)?;
        return Ok(Py::new(py, ShmView::new(Arc::new(keep)))?.into_any());
    }
    let len = lease.len();
    let bytes = PyBytes::new_with(py, len, |buf| Ok(copying(py, len, || lease.copy_to(buf))?))?;
    Ok(bytes.into_any().unbind())
}

/// A reader's read of a handle's item, consuming one of its references (see `decode`).
fn resolve_item<'py>(
    py: Python<'py>,
    reader: &Arc<Reader>,
    handle: &ShmHandle,
    key: &str,
    copy: bool,
    pin_memory: bool,
) -> PyResult<Bound<'py, PyDict>> {
    check_pin_memory(copy, pin_memory)?;
    let lease = reader.acquire(&handle.to_handle()?, key)?;
    let keep = Arc::new(Keeper::from_lease(py, lease)?);
    decode(py, &keep, copy, pin_memory)
}

/// `Writer::put_raw`, with the GIL released when there is much to copy.
fn put_parts(
    py: Python<'_>,
    writer: &Writer,
    key: &str,
    parts: &[RawBytes<'_>],
) -> PyResult<ShmHandle> {
    let total = parts.iter().map(RawBytes::len).sum();
    let handle = copying(py, total, || writer.put_raw(key, parts))?;
    Ok(ShmHandle::from_handle(handle))
}

/// The single writer of a ring (`ShmObjectStore.create`).
#[pyclass(frozen, extends = ShmObjectStore, module = "mmcache._core")]
pub(crate) struct ShmWriter {
    writer: Open<Writer>,
}

#[pymethods]
impl ShmWriter {
    /// Store `data` (one buffer, or a list/tuple of them, written part by part) under `key`.
    fn put(&self, py: Python<'_>, key: &str, data: &Bound<'_, PyAny>) -> PyResult<ShmHandle> {
        let writer = self.writer.get()?;
        let buffers = collect_buffers(data)?;
        put_parts(py, &writer, key, &raw_parts(&buffers))
    }

    /// Encode `item` (a mapping of tensors, arrays and small values) and store it under
    /// `key`, in one pass: the header and every tensor's bytes go straight into the chunk.
    fn put_item(&self, py: Python<'_>, key: &str, item: &Bound<'_, PyAny>) -> PyResult<ShmHandle> {
        let writer = self.writer.get()?;
        let encoded = Encoded::new(item)?;
        let parts = encoded.parts();
        // `Encoded::copying`, not `put_parts`: it keeps the GIL when a part lies in a torch
        // storage, which another thread may free while the GIL is released.
        let handle = encoded.copying(py, || writer.put_raw(key, &parts))?;
        Ok(ShmHandle::from_handle(handle))
    }

    fn is_cached(&self, key: &str) -> PyResult<bool> {
        Ok(self.writer.get()?.is_cached(key)?)
    }

    /// One more reference to `key`'s object, as a handle (`KeyError` if absent).
    fn issue(&self, key: &str) -> PyResult<ShmHandle> {
        Ok(ShmHandle::from_handle(self.writer.get()?.get_cached(key)?))
    }

    /// `issue`, with `None` for an absent key instead of `KeyError` (P0's hot path).
    fn issue_if_present(&self, key: &str) -> PyResult<Option<ShmHandle>> {
        match self.writer.get()?.get_cached(key) {
            Ok(h) => Ok(Some(ShmHandle::from_handle(h))),
            Err(Error::KeyNotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// A copy of what is stored under `key`, issuing no reference (`KeyError` if absent).
    fn read_stored<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let writer = self.writer.get()?;
        // The GIL is released whatever the size: only the core knows it, under its lock.
        let bytes = py.detach(|| writer.read_key(key))?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn pin(&self, key: &str) -> PyResult<()> {
        Ok(self.writer.get()?.pin(key)?)
    }

    /// `pin`, returning whether `key` was there to pin instead of raising `KeyError`.
    fn pin_if_present(&self, key: &str) -> PyResult<bool> {
        match self.writer.get()?.pin(key) {
            Ok(()) => Ok(true),
            Err(Error::KeyNotFound(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn unpin(&self, key: &str) -> PyResult<()> {
        Ok(self.writer.get()?.unpin(key)?)
    }

    fn release(&self, handle: &ShmHandle) -> PyResult<()> {
        Ok(self.writer.get()?.release(&handle.to_handle()?)?)
    }

    fn verify(&self, handle: &ShmHandle, key: &str) -> PyResult<bool> {
        let writer = self.writer.get()?;
        match handle.to_handle() {
            Ok(h) => Ok(writer.verify(&h, key)?),
            Err(_) => Ok(false), // a signature of the wrong length names no entry
        }
    }

    fn invalidate(&self, key: &str) -> PyResult<()> {
        Ok(self.writer.get()?.invalidate(key)?)
    }

    fn clear(&self) -> PyResult<()> {
        Ok(self.writer.get()?.clear()?)
    }

    fn keys(&self) -> PyResult<Vec<String>> {
        Ok(self.writer.get()?.keys()?)
    }

    /// Alias of `issue` (the name SPEC.md gives it).
    fn get_cached(&self, key: &str) -> PyResult<ShmHandle> {
        self.issue(key)
    }

    /// Alias of `issue_if_present`.
    fn try_get_cached(&self, key: &str) -> PyResult<Option<ShmHandle>> {
        self.issue_if_present(key)
    }

    /// Alias of `read_stored`.
    fn get_stored<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        self.read_stored(py, key)
    }

    /// Alias of `pin_if_present`.
    fn try_pin(&self, key: &str) -> PyResult<bool> {
        self.pin_if_present(key)
    }
}

/// One reader of a ring, in a reader slot of its own (`ShmObjectStore.attach`).
#[pyclass(frozen, extends = ShmObjectStore, module = "mmcache._core")]
pub(crate) struct ShmReader {
    reader: Open<Reader>,
    slot: u32,
}

#[pymethods]
impl ShmReader {
    #[getter]
    fn reader_slot(&self) -> u32 {
        self.slot
    }

    /// Verify `handle` for `key` and read its object, consuming one of this reader's
    /// references: the bytes, or (`copy=False`) a read-only zero-copy view.
    #[pyo3(signature = (handle, key, *, copy = true))]
    fn resolve(
        &self,
        py: Python<'_>,
        handle: &ShmHandle,
        key: &str,
        copy: bool,
    ) -> PyResult<Py<PyAny>> {
        resolve(py, &self.reader.get()?, handle, key, copy)
    }

    /// `resolve` and decode the item: zero-copy views (`copy=False`) or one copy per value,
    /// tensors into torch memory (pinned with `pin_memory=True`).
    #[pyo3(signature = (handle, key, *, copy = true, pin_memory = false))]
    fn resolve_item<'py>(
        &self,
        py: Python<'py>,
        handle: &ShmHandle,
        key: &str,
        copy: bool,
        pin_memory: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        resolve_item(py, &self.reader.get()?, handle, key, copy, pin_memory)
    }

    /// `(address, length)` of this reader's read-only mapping of the segment, which zero-copy
    /// views point into (to register it with CUDA, say).
    fn view_mapping(&self) -> PyResult<(usize, usize)> {
        self.reader.get()?.view_mapping().ok_or_else(|| {
            super::errors::MmcacheError::new_err("this reader has no read-only mapping")
        })
    }
}

/// Add the store classes to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ShmView>()?;
    m.add_class::<ShmObjectStore>()?;
    m.add_class::<ShmWriter>()?;
    m.add_class::<ShmReader>()?;
    Ok(())
}
