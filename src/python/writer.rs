//! `ShmWriter`: one writer of a store (`ShmObjectStore.create` makes the first, `.join` the
//! others). Lookups (`is_cached`, `issue`, `pin`, `unpin`) hold the GIL and take no lock
//! shared between processes; copies release the GIL when large (`put`) or always (reads,
//! whose length only the core knows); waits (`wait_for`, `claim`, `close`) always release it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::panic::PanicException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::{Borrowed, PyTraverseError, PyVisit, ffi, intern};

use super::args::{self, Int};
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
        // One str is iterable too: it would be read as a list of one-character keys.
        if keys.is_instance_of::<PyString>() || keys.is_instance_of::<PyBytes>() {
            return Err(PyTypeError::new_err(format!(
                "uncached takes a list of keys, not one {}: uncached([key])",
                type_name(keys)
            )));
        }
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
        pinned: Option<Int<args::Pinned>>,
    ) -> PyResult<Option<ShmHandle>> {
        let pinned = pinned.map(|id| id.get());
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
        monotonic_id: Option<Int<args::MonotonicId>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let monotonic_id = monotonic_id.map(|id| id.get());
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
    fn unpin_object(
        &self,
        py: Python<'_>,
        key: &str,
        monotonic_id: Int<args::MonotonicId>,
    ) -> PyResult<()> {
        let monotonic_id = monotonic_id.get();
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

/// The native base class of `ShmSenderCache`: its `is_cached_item` (P0 asks it of every item
/// of every request) as a C method of this class, so that a call of it is specialised as a
/// method's and runs no Python frame. Whether a key is stored, by the writer's lock-free
/// lookup, and the cache keeps the prompt updates of that very object (by monotonic id), in
/// `kept` (the cache's own dict of `key: (monotonic id, prompt updates)`, read with the GIL
/// held); a key stored but not kept for that object is answered by the cache's
/// `_learn_prompt_updates`. The writer and the dict are given once, by `_check_with`.
#[pyclass(subclass, frozen, module = "mmcache._core")]
pub(crate) struct CachedItemCheck {
    state: OnceLock<CheckState>,
}

/// What `is_cached_item` reads.
struct CheckState {
    writer: Py<ShmWriter>,
    kept: Py<PyDict>,
}

impl CachedItemCheck {
    /// Whether `mm_hash` is cached for `cache` (this object; every case, errors included).
    fn answer(
        &self,
        py: Python<'_>,
        cache: &Bound<'_, PyAny>,
        mm_hash: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let mm_hash = mm_hash.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                // The message Python's `mmcache.arguments.check_mm_hash_type` gives.
                "is_cached_item(mm_hash): mm_hash must be a str, not {}",
                type_name(mm_hash)
            ))
        })?;
        let Some(state) = self.state.get() else {
            return Err(PyRuntimeError::new_err(
                "is_cached_item of a cache that was never opened (made without __init__ or join)",
            ));
        };
        // The message Python's `mmcache.arguments.unstorable_hash` gives, for every mode alike.
        let key = mm_hash.to_str().map_err(|_| {
            PyValueError::new_err(format!(
                "mm_hash {} holds a lone surrogate (it is no valid UTF-8)",
                mm_hash
                    .repr()
                    .map_or_else(|_| "?".into(), |r| r.to_string())
            ))
        })?;
        let Some(id) = state.writer.get().writer.with(py, |w| w.stored_id(key))?? else {
            return Ok(false);
        };
        if let Some(kept) = state.kept.bind(py).get_item(mm_hash)? {
            if kept_for(kept.as_ptr(), id) {
                return Ok(true);
            }
        }
        cache
            .call_method1(intern!(py, "_learn_prompt_updates"), (mm_hash, id))?
            .is_truthy()
    }

    /// The answer for an exact `str` that is not stored, or stored and kept: the two
    /// answers of the hot path, reached without a Python object or error made; `None` for
    /// every other case (`answer` takes those).
    fn settled_answer(&self, py: Python<'_>, mm_hash: *mut ffi::PyObject) -> Option<bool> {
        let state = self.state.get()?;
        // SAFETY: `mm_hash` is a live object (a borrowed reference, valid for the call).
        if unsafe { ffi::PyUnicode_CheckExact(mm_hash) } == 0 {
            return None;
        }
        let mut len: ffi::Py_ssize_t = 0;
        // SAFETY: `mm_hash` is a `str`. The UTF-8 form CPython returns is valid UTF-8, cached
        // in the string (immutable, alive for the call), `len` bytes long; on failure (lone
        // surrogates) it returns null with an exception set, which is cleared: `answer`
        // raises it again.
        let key = unsafe {
            let data = ffi::PyUnicode_AsUTF8AndSize(mm_hash, &mut len);
            if data.is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            std::str::from_utf8_unchecked(std::slice::from_raw_parts(
                data.cast::<u8>(),
                usize::try_from(len).ok()?,
            ))
        };
        let stored = state
            .writer
            .get()
            .writer
            .with(py, |w| w.stored_id(key).ok());
        let Some(id) = stored.ok().flatten()? else {
            return Some(false);
        };
        // SAFETY: `kept` is a dict and `mm_hash` an exact str (its hash and equality cannot
        // raise); the result is borrowed, alive while the dict holds it (no Python code runs
        // before `kept_for` is done with it); null with an error set is left to `answer`.
        let kept = unsafe { ffi::PyDict_GetItemWithError(state.kept.as_ptr(), mm_hash) };
        if kept.is_null() {
            // SAFETY: attached to the interpreter; clears the error, if one is set.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        kept_for(kept, id).then_some(true)
    }
}

/// Whether `kept`, a value of the cache's `kept` dict (`(monotonic id, prompt updates)`), is
/// for the object of monotonic id `id` (the prompt updates of an object the key named before
/// are not this one's: another writer may have put it again with others).
fn kept_for(kept: *mut ffi::PyObject, id: u64) -> bool {
    // SAFETY: `kept` is a live object (borrowed for the call); the tuple is checked before
    // its first item is read, and an int's conversion error is cleared (it answers false).
    unsafe {
        if ffi::PyTuple_Check(kept) == 0 || ffi::PyTuple_Size(kept) < 1 {
            return false;
        }
        let kept_id = ffi::PyTuple_GetItem(kept, 0);
        if kept_id.is_null() || ffi::PyLong_Check(kept_id) == 0 {
            ffi::PyErr_Clear();
            return false;
        }
        let value = ffi::PyLong_AsUnsignedLongLong(kept_id);
        if value == u64::MAX && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            return false;
        }
        value == id
    }
}

/// The type name of `obj`, for an error message.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .qualname()
        .map_or_else(|_| "?".into(), |name| name.to_string())
}

/// `CachedItemCheck.is_cached_item`'s C function: `METH_FASTCALL | METH_KEYWORDS`, so
/// CPython calls it with its arguments as they are (no tuple, and a call site specialised
/// for a method), and the hot path's answers (one positional argument) are given without
/// PyO3's trampoline or argument parsing; the rest goes through it ([`full_answer`]).
unsafe extern "C" fn check_item(
    cache: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls a method of `CachedItemCheck` (a method descriptor of the type,
    // [`install_is_cached_item`]) attached to the interpreter, with `cache` an instance of
    // the type (checked by CPython before the call) and `nargs` positional arguments at
    // `args` followed by one per name in `kwnames` (a tuple, or null for none), borrowed for
    // the call. Nothing here detaches or lets `py` escape the call.
    let (py, this) = unsafe {
        let py = Python::assume_attached();
        let this = Borrowed::from_ptr(py, cache).cast_unchecked::<CachedItemCheck>();
        (py, this.get())
    };
    if nargs == 1 && kwnames.is_null() {
        // SAFETY: one positional argument (above).
        let mm_hash = unsafe { *args };
        // Unwind safety: a panic leaves nothing half changed (a lookup changes nothing).
        if let Ok(Some(answer)) =
            catch_unwind(AssertUnwindSafe(|| this.settled_answer(py, mm_hash)))
        {
            return new_bool(answer);
        }
    }
    // SAFETY: the call's own arguments (above).
    unsafe { full_answer(this, cache, args, nargs, kwnames) }
}

/// `true` or `false`, as a new reference.
fn new_bool(answer: bool) -> *mut ffi::PyObject {
    // SAFETY: `Py_True` and `Py_False` are singletons that live as long as the interpreter;
    // the reference returned is counted.
    unsafe {
        let result = if answer {
            ffi::Py_True()
        } else {
            ffi::Py_False()
        };
        ffi::Py_IncRef(result);
        result
    }
}

/// [`check_item`] for every call its hot path does not answer, through PyO3: the answer, or
/// null with the error set.
///
/// # Safety
/// The arguments are a vectorcall's of [`check_item`] (`cache` is `this`), on a thread
/// attached to the interpreter.
#[cold]
#[inline(never)]
unsafe fn full_answer(
    this: &CachedItemCheck,
    cache: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    Python::attach(|py| {
        let answer = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the caller's.
            let (cache, mm_hash) = unsafe {
                (
                    Borrowed::from_ptr(py, cache),
                    the_argument(py, args, nargs, kwnames)?,
                )
            };
            this.answer(py, &cache, &mm_hash)
        }))
        .unwrap_or_else(|payload| Err(PanicException::new_err(panic_message(payload.as_ref()))));
        match answer {
            Ok(answer) => new_bool(answer),
            Err(err) => {
                err.restore(py);
                std::ptr::null_mut()
            }
        }
    })
}

/// The one argument of a call of `is_cached_item`, `mm_hash`, given by position or by name.
///
/// # Safety
/// `args`, `nargs` and `kwnames` are a vectorcall's (see [`check_item`]), valid for `'a`.
unsafe fn the_argument<'a, 'py>(
    py: Python<'py>,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<Borrowed<'a, 'py, PyAny>> {
    // SAFETY: `kwnames` is null or a tuple of str, borrowed for the call.
    let names = unsafe { Borrowed::from_ptr_or_opt(py, kwnames) };
    let named = match &names {
        Some(names) => names.cast::<PyTuple>()?.len(),
        None => 0,
    };
    let by_name = || names.is_some_and(|names| names.eq(("mm_hash",)).unwrap_or(false));
    if (nargs, named) == (1, 0) || ((nargs, named) == (0, 1) && by_name()) {
        // SAFETY: exactly one argument is at `args`, borrowed for the call.
        return Ok(unsafe { Borrowed::from_ptr(py, *args) });
    }
    Err(PyTypeError::new_err(
        "is_cached_item takes one argument, mm_hash",
    ))
}

/// What a panic said, for the exception that reports it.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (
        payload.downcast_ref::<&str>(),
        payload.downcast_ref::<String>(),
    ) {
        (Some(message), _) => (*message).to_owned(),
        (_, Some(message)) => message.clone(),
        _ => "a panic in CachedItemCheck".to_owned(),
    }
}

/// The definition of [`check_item`] as a Python method.
struct CheckItemDef(ffi::PyMethodDef);

// SAFETY: the definition is never written after it is made, and what it points to (C
// string literals and a function) is `'static` and immutable; CPython only reads it.
unsafe impl Sync for CheckItemDef {}

static CHECK_ITEM: CheckItemDef = CheckItemDef(ffi::PyMethodDef {
    ml_name: c"is_cached_item".as_ptr(),
    ml_meth: ffi::PyMethodDefPointer {
        PyCFunctionFastWithKeywords: check_item,
    },
    ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
    ml_doc: c"is_cached_item($self, /, mm_hash)\n--\n\nWhether mm_hash is cached: stored in the \
ring and its prompt updates kept (or learnt) by this cache. No lock, no recency change."
        .as_ptr(),
});

/// `is_cached_item` as a method of `class` (`CachedItemCheck` or a subclass): a method
/// descriptor of [`CHECK_ITEM`]. CPython specialises a call of a C method only on instances
/// of exactly the descriptor's class, so `ShmSenderCache` gets one of its own.
fn is_cached_item_method<'py>(class: &Bound<'py, PyType>) -> PyResult<Bound<'py, PyAny>> {
    if !class.is_subclass_of::<CachedItemCheck>()? {
        return Err(PyTypeError::new_err(format!(
            "{} is not a subclass of CachedItemCheck",
            class.qualname()?
        )));
    }
    // SAFETY: `CHECK_ITEM` is a `'static` definition of a function that takes an instance of
    // `CachedItemCheck` as its `self`; the descriptor's calls check that `self` is an
    // instance of `class`, a subclass.
    unsafe {
        Bound::from_owned_ptr_or_err(
            class.py(),
            ffi::PyDescr_NewMethod(class.as_type_ptr(), (&raw const CHECK_ITEM.0).cast_mut()),
        )
    }
}

/// Give `CachedItemCheck` its `is_cached_item` (PyO3 would make its methods go through its
/// trampoline).
pub(super) fn install_is_cached_item(py: Python<'_>) -> PyResult<()> {
    let class = py.get_type::<CachedItemCheck>();
    class.setattr("is_cached_item", is_cached_item_method(&class)?)
}

#[pymethods]
impl CachedItemCheck {
    /// Ready for `_check_with` (whatever arguments the subclass's constructor takes).
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        CachedItemCheck {
            state: OnceLock::new(),
        }
    }

    /// Answer `is_cached_item` from `writer`'s lookups and the prompt updates kept in `kept`
    /// (once: `RuntimeError` after).
    fn _check_with(&self, writer: Py<ShmWriter>, kept: Py<PyDict>) -> PyResult<()> {
        self.state
            .set(CheckState { writer, kept })
            .map_err(|_| PyRuntimeError::new_err("is_cached_item is answered already"))
    }

    /// `is_cached_item` as a method of exactly `subclass` (to be set as its attribute:
    /// CPython specialises a call of it on that class's instances).
    #[staticmethod]
    fn _method_for<'py>(subclass: &Bound<'py, PyType>) -> PyResult<Bound<'py, PyAny>> {
        is_cached_item_method(subclass)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(state) = self.state.get() {
            visit.call(&state.writer)?;
            visit.call(&state.kept)?;
        }
        Ok(())
    }
}
