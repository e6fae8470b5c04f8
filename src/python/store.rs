//! The store classes. `ShmObjectStore` holds what both roles share; its two subclasses hold
//! one role each: `ShmWriter` (made by `ShmObjectStore.create` or `.join`; its methods are in
//! `writer.rs`) and `ShmReader` (made by `ShmObjectStore.attach`). A method of the other role
//! is simply absent (an `AttributeError`, which type checkers see), and methods that change
//! state are named for the change: `issue` adds a reference, a reader's `resolve` consumes
//! one.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pyclass_init::PyClassInitializer;
use pyo3::types::{PyBytes, PyDict};

use super::args::{self, Int, Name};
use super::buffer::{Keeper, ShmView, copied_bytes};
use super::decode::{check_pin_memory, decode};
use super::handles::{ReaderHandle, ShmHandle, WriterHandle};
use super::writer::{ShmWriter, read_copy};
use crate::error::Error;
use crate::layout::{Config, Layout};
use crate::segment::Process;
use crate::store::{Reader, ReaderInfo, Stats, Writer};

/// A writer or reader until `close()`, after which every use is a `ClosedError`.
pub(super) struct Open<T> {
    owner: Mutex<Option<Arc<T>>>,
    /// The endpoint `owner` holds (null once taken), for calls that hold the GIL from start
    /// to end ([`Open::with`]): they borrow it without touching a lock or a reference count,
    /// which is most of what a hit costs otherwise.
    current: AtomicPtr<T>,
    /// The process whose `close()` took the endpoint out and is closing it (`None` before
    /// and after): a `close()` that finds it taken waits for that one, so that every
    /// `close()` returns with the store closed (and its name gone, if it was the last
    /// writer), not while another thread closes it. A forked child does not wait: the thread
    /// closing is its parent's, and the child's copy never acts for the parent.
    closing: Mutex<Option<Process>>,
    closing_ended: Condvar,
}

/// A `close()` of the endpoint in progress (started with the GIL held, right after the
/// endpoint was taken); ended when dropped, whether it succeeded, failed or panicked, so a
/// waiting `close()` never hangs.
struct Closing<'a, T>(&'a Open<T>);

impl<'a, T> Closing<'a, T> {
    fn start(open: &'a Open<T>) -> Self {
        *open.closing.lock().unwrap_or_else(|p| p.into_inner()) = Some(Process::current());
        Closing(open)
    }
}

impl<T> Drop for Closing<'_, T> {
    fn drop(&mut self) {
        *self.0.closing.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.0.closing_ended.notify_all();
    }
}

impl<T> Open<T> {
    pub(super) fn new(endpoint: Arc<T>) -> Self {
        Open {
            current: AtomicPtr::new(Arc::as_ptr(&endpoint).cast_mut()),
            owner: Mutex::new(Some(endpoint)),
            closing: Mutex::new(None),
            closing_ended: Condvar::new(),
        }
    }

    /// Wait until a `close()` of this process that took the endpoint out has finished
    /// (call without the GIL: that close may need it).
    fn wait_closed(&self) {
        let mut closing = self.closing.lock().unwrap_or_else(|p| p.into_inner());
        while closing.is_some_and(|process| process.is_current()) {
            closing = self
                .closing_ended
                .wait(closing)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arc<T>>> {
        self.owner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The endpoint, kept alive by the returned reference (for calls that release the GIL).
    pub(super) fn get(&self) -> PyResult<Arc<T>> {
        self.lock().clone().ok_or_else(|| Error::Closed.into())
    }

    /// Call `f` with the endpoint while holding the GIL (`_py`) throughout; `f` must not
    /// release it (it gets no `Python` token to do so). Always inlined, like the lookup it
    /// usually wraps: a result passed back through memory costs a store-forwarding stall.
    #[inline(always)]
    pub(super) fn with<R>(&self, _py: Python<'_>, f: impl FnOnce(&T) -> R) -> PyResult<R> {
        let endpoint = self.current.load(Ordering::Acquire);
        if endpoint.is_null() {
            return Err(Error::Closed.into());
        }
        // SAFETY: `endpoint` came from `Arc::as_ptr` of the `Arc` in `owner`, which keeps it
        // alive until `take` removes it. `take` nulls `current` first and runs, like this
        // call, with the GIL held, and the `Arc` it returns is dropped by `close` with the GIL
        // held as well; we hold the GIL from the load above until `f` returns and do not
        // release it, so `take` and that drop cannot happen in between. Only shared
        // references to the endpoint ever exist (it is used through `&T`, being `Sync`).
        Ok(f(unsafe { &*endpoint }))
    }

    /// Take the endpoint out (call with the GIL held, and drop what it returns with the GIL
    /// held: see [`Open::with`]).
    fn take(&self) -> Option<Arc<T>> {
        self.current.store(std::ptr::null_mut(), Ordering::Release);
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

/// One named shared-memory ring: created by its first writer (`ShmWriter`), joined by up to
/// `max_writers - 1` more, attached by readers (`ShmReader`).
#[pyclass(frozen, subclass, module = "mmcache._core")]
pub(crate) struct ShmObjectStore {
    name: String,
    capacity: u64,
    n_readers: u32,
    max_object_size: u64,
    max_writers: u32,
    info: ReaderInfo,
}

impl ShmObjectStore {
    fn new(name: &str, layout: Layout, info: ReaderInfo) -> Self {
        ShmObjectStore {
            name: name.to_owned(),
            capacity: layout.capacity,
            n_readers: layout.n_readers,
            max_object_size: layout.max_object_size,
            max_writers: layout.max_writers,
            info,
        }
    }

    /// A `ShmWriter` over `writer` (just created or joined).
    fn writer<'py>(py: Python<'py>, writer: Writer) -> PyResult<Bound<'py, ShmWriter>> {
        let base = ShmObjectStore::new(writer.name(), writer.layout(), writer.reader_info());
        Bound::new(
            py,
            PyClassInitializer::from(base).add_subclass(ShmWriter::new(writer)),
        )
    }

    fn role<'a>(slf: &'a Bound<'_, Self>) -> PyResult<Role<'a>> {
        if let Ok(writer) = slf.cast::<ShmWriter>() {
            return Ok(Role::Writer(writer.get().open()));
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
    /// The first writer of a new segment (`max_writers` writers may be joined at once).
    #[staticmethod]
    #[pyo3(
        signature = (
            capacity, *, n_readers = Int::new(1), max_object_size = None, name = None,
            max_writers = Int::new(1), max_objects = None,
        ),
        text_signature = "(capacity, *, n_readers=1, max_object_size=None, name=None, \
                          max_writers=1, max_objects=None)"
    )]
    fn create<'py>(
        py: Python<'py>,
        capacity: Int<args::Capacity>,
        n_readers: Int<args::NReaders>,
        max_object_size: Option<Int<args::MaxObjectSize>>,
        name: Option<Name>,
        max_writers: Int<args::MaxWriters>,
        max_objects: Option<Int<args::MaxObjects>>,
    ) -> PyResult<Bound<'py, ShmWriter>> {
        let config = Config {
            capacity: capacity.get(),
            n_readers: n_readers.get_u32()?,
            max_object_size: max_object_size.map(|m| m.get()),
            max_writers: max_writers.get_u32()?,
            max_objects: max_objects.map(|m| m.get()),
        };
        let name = name.map(|n| n.0);
        // Without the GIL: a creation under a chosen name may wait, for an empty file there
        // to be judged (up to 10 s) or for whoever removes an orphan of that name (up to 5 s).
        let writer = py.detach(|| Writer::create_with(&config, name.as_deref()))?;
        Self::writer(py, writer)
    }

    /// One more writer of the store `writer_handle` names (this process or another).
    #[staticmethod]
    fn join<'py>(py: Python<'py>, writer_handle: &WriterHandle) -> PyResult<Bound<'py, ShmWriter>> {
        let info = writer_handle.info().clone();
        Self::writer(py, py.detach(|| Writer::join(&info))?)
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
    fn max_writers(&self) -> u32 {
        self.max_writers
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
            // A walk over the whole ring (milliseconds in a large one): the GIL released, so
            // the process's other threads go on meanwhile.
            Role::Writer(w) => {
                let writer = w.get()?;
                slf.py().detach(|| writer.stats())?
            }
            Role::Reader(r) => r.get()?.stats()?,
        };
        let dict = PyDict::new(slf.py());
        for (k, v) in stats {
            dict.set_item(k, v)?;
        }
        Ok(dict)
    }

    /// Close the writer (the last writer to close unlinks the segment) or detach the reader
    /// (its slot drains: freed now, or when its last zero-copy view is gone). Idempotent.
    fn close(slf: &Bound<'_, Self>) -> PyResult<()> {
        match Self::role(slf)? {
            Role::Writer(w) => match w.take() {
                Some(writer) => {
                    let _closing = Closing::start(w);
                    // Waits for other threads' operations in progress: without the GIL. The
                    // `Arc` is dropped after, with the GIL (`Open::with`).
                    slf.py().detach(|| writer.close())?;
                }
                // Another thread's `close()` is closing it: return once that one has.
                None => slf.py().detach(|| w.wait_closed()),
            },
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
    let bytes = copied_bytes(py, len, |buf| Ok(lease.copy_to_uninit(buf)?))?;
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

impl Drop for ShmReader {
    /// Dropped without `close()` (garbage-collected with zero-copy views still alive, which
    /// keep the core reader itself alive): detach as `close()` does, so the slot drains
    /// instead of being handed one reference per new object that nobody will ever read.
    /// (A writer closes itself when dropped: `Writer`'s `Drop`.) Python drops objects with
    /// the GIL held, as `Open::take` needs.
    fn drop(&mut self) {
        if let Some(reader) = self.reader.take() {
            reader.close();
        }
    }
}

/// Add the store classes to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ShmView>()?;
    m.add_class::<ShmObjectStore>()?;
    m.add_class::<ShmWriter>()?;
    m.add_class::<super::writer::CachedItemCheck>()?;
    super::writer::install_is_cached_item(m.py())?;
    m.add_class::<ShmReader>()?;
    Ok(())
}
