//! `mmcache._core`: the thin PyO3 layer. Argument conversion, the buffer protocol (in and
//! out), releasing the GIL around large copies, and mapping `Error` to Python exceptions —
//! nothing else. Besides `segment.rs`, this is the only module with `unsafe` code: the two
//! buffer-protocol crossings PyO3 cannot express safely, and (in `codec`) the item codec's
//! DLPack and buffer crossings.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{
    PyBufferError, PyException, PyFileExistsError, PyFileNotFoundError, PyKeyError, PyMemoryError,
    PyOSError, PyPermissionError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use pyo3::{create_exception, ffi};

use crate::error::Error;
use crate::handle::{Handle, SIGNATURE_LEN};
use crate::layout::LAYOUT_VERSION;
use crate::layout::{Liveness, SlotState};
use crate::segment::RawBytes;
use crate::store::{self, Reader, ReaderInfo, View, Writer};

mod codec;

create_exception!(
    mmcache._core,
    MmcacheError,
    PyException,
    "Base class of every mmcache error."
);
create_exception!(
    mmcache._core,
    SegmentCorruptError,
    MmcacheError,
    "A segment failed validation."
);
create_exception!(
    mmcache._core,
    ClosedError,
    MmcacheError,
    "The store was closed."
);
create_exception!(
    mmcache._core,
    InvalidHandleError,
    MmcacheError,
    "A forged, truncated, out-of-range or foreign handle."
);
create_exception!(
    mmcache._core,
    StaleHandleError,
    MmcacheError,
    "A genuine handle whose object is gone."
);
create_exception!(
    mmcache._core,
    WriterGoneError,
    MmcacheError,
    "The segment's writer closed it or exited."
);
create_exception!(
    mmcache._core,
    NoReaderSlotError,
    MmcacheError,
    "Every reader slot is taken."
);
create_exception!(
    mmcache._core,
    WrongProcessError,
    MmcacheError,
    "A writer or reader used in a process other than the one that created or attached it."
);

create_exception!(
    mmcache._core,
    ObjectTooLargeError,
    PyValueError,
    "An object larger than the store's max_object_size (a ValueError)."
);
create_exception!(
    mmcache._core,
    RingFullError,
    PyMemoryError,
    "No room in the ring: every chunk that could hold the object is still unread, pinned or \
     viewed (a MemoryError)."
);

/// Copies at least this large run with the GIL released.
const DETACH_THRESHOLD: usize = 64 * 1024;

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let msg = err.to_string();
        match err {
            Error::InvalidArgument(_) | Error::DuplicateKey(_) => PyValueError::new_err(msg),
            Error::TooLarge { .. } => ObjectTooLargeError::new_err(msg),
            Error::Full { .. } => RingFullError::new_err(msg),
            Error::ShmTooSmall { .. } | Error::Saturated { .. } => PyMemoryError::new_err(msg),
            Error::KeyNotFound(key) => PyKeyError::new_err(key),
            Error::Exists(_) => PyFileExistsError::new_err(msg),
            Error::NotFound(_) => PyFileNotFoundError::new_err(msg),
            Error::Permission(_) => PyPermissionError::new_err(msg),
            Error::Corrupt(_) | Error::NotASegment(_) => SegmentCorruptError::new_err(msg),
            Error::Closed => ClosedError::new_err(msg),
            Error::InvalidHandle(_) => InvalidHandleError::new_err(msg),
            Error::Stale => StaleHandleError::new_err(msg),
            Error::WriterGone(_) => WriterGoneError::new_err(msg),
            Error::NoReaderSlot(_) => NoReaderSlotError::new_err(msg),
            Error::WrongProcess(_) => WrongProcessError::new_err(msg),
            Error::Os { .. } => PyOSError::new_err(msg),
        }
    }
}

/// Where one object lives: ring address, monotonic id and a keyed signature.
#[pyclass(frozen, eq, hash, module = "mmcache._core")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ShmHandle {
    #[pyo3(get)]
    address: u64,
    #[pyo3(get)]
    monotonic_id: u64,
    signature: Vec<u8>,
}

fn u64_field(name: &str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    value
        .extract::<u64>()
        .map_err(|_| PyValueError::new_err(format!("{name} must be an integer in [0, 2**64)")))
}

impl ShmHandle {
    /// The core's handle; a signature of the wrong length cannot verify.
    fn to_handle(&self) -> PyResult<Handle> {
        let signature: [u8; SIGNATURE_LEN] = self.signature.as_slice().try_into().map_err(|_| {
            InvalidHandleError::new_err(format!(
                "invalid handle: signature has {} bytes, expected {SIGNATURE_LEN} (truncated or \
                 forged) — nothing was read",
                self.signature.len()
            ))
        })?;
        Ok(Handle {
            address: self.address,
            monotonic_id: self.monotonic_id,
            signature,
        })
    }

    fn from_handle(h: Handle) -> Self {
        ShmHandle {
            address: h.address,
            monotonic_id: h.monotonic_id,
            signature: h.signature.to_vec(),
        }
    }
}

#[pymethods]
impl ShmHandle {
    #[new]
    #[pyo3(signature = (*, address, monotonic_id, signature))]
    fn new(
        address: &Bound<'_, PyAny>,
        monotonic_id: &Bound<'_, PyAny>,
        signature: Vec<u8>,
    ) -> PyResult<Self> {
        Ok(ShmHandle {
            address: u64_field("address", address)?,
            monotonic_id: u64_field("monotonic_id", monotonic_id)?,
            signature,
        })
    }

    #[getter]
    fn signature<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.signature)
    }

    fn __repr__(&self) -> String {
        format!(
            "ShmHandle(address={}, monotonic_id={})",
            self.address, self.monotonic_id
        )
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let rebuild = py.import("mmcache._core")?.getattr("_shm_handle")?;
        (
            rebuild,
            (
                self.address,
                self.monotonic_id,
                PyBytes::new(py, &self.signature),
            ),
        )
            .into_pyobject(py)
    }
}

#[pyfunction]
fn _shm_handle(address: u64, monotonic_id: u64, signature: Vec<u8>) -> ShmHandle {
    ShmHandle {
        address,
        monotonic_id,
        signature,
    }
}

/// Everything a reader process needs to attach: segment name, layout and signing key.
#[pyclass(frozen, eq, module = "mmcache._core")]
#[derive(Clone, PartialEq, Eq)]
pub struct ReaderHandle {
    info: ReaderInfo,
}

#[pymethods]
impl ReaderHandle {
    #[new]
    #[pyo3(signature = (*, name, capacity, n_readers, max_object_size, layout_version, secret))]
    fn new(
        name: String,
        capacity: u64,
        n_readers: u32,
        max_object_size: u64,
        layout_version: u64,
        secret: Vec<u8>,
    ) -> PyResult<Self> {
        let secret: [u8; 32] = secret
            .try_into()
            .map_err(|_| PyValueError::new_err("secret must be 32 bytes"))?;
        Ok(ReaderHandle {
            info: ReaderInfo {
                name,
                capacity,
                n_readers,
                max_object_size,
                layout_version,
                secret,
            },
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.info.name
    }
    #[getter]
    fn capacity(&self) -> u64 {
        self.info.capacity
    }
    #[getter]
    fn n_readers(&self) -> u32 {
        self.info.n_readers
    }
    #[getter]
    fn max_object_size(&self) -> u64 {
        self.info.max_object_size
    }
    #[getter]
    fn layout_version(&self) -> u64 {
        self.info.layout_version
    }
    #[getter]
    fn secret<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.info.secret)
    }

    fn __repr__(&self) -> String {
        format!(
            "ReaderHandle(name={:?}, capacity={}, n_readers={})",
            self.info.name, self.info.capacity, self.info.n_readers
        )
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let rebuild = py.import("mmcache._core")?.getattr("_reader_handle")?;
        let i = &self.info;
        (
            rebuild,
            (
                i.name.clone(),
                i.capacity,
                i.n_readers,
                i.max_object_size,
                i.layout_version,
                PyBytes::new(py, &i.secret),
            ),
        )
            .into_pyobject(py)
    }
}

#[pyfunction]
fn _reader_handle(
    name: String,
    capacity: u64,
    n_readers: u32,
    max_object_size: u64,
    layout_version: u64,
    secret: Vec<u8>,
) -> PyResult<ReaderHandle> {
    ReaderHandle::new(
        name,
        capacity,
        n_readers,
        max_object_size,
        layout_version,
        secret,
    )
}

enum ViewBytes {
    /// Bytes in shared memory, protected (and registered for fork) while the view lives.
    Shared(View),
    /// A private copy (the writer's own reads, and replayed handles, which carry no lease).
    Owned(Vec<u8>),
}

/// A read-only, zero-copy view of one object's bytes (buffer protocol).
#[pyclass(frozen, module = "mmcache._core")]
pub struct ShmView {
    /// Shared with the tensors a decoded item hands out over the same bytes.
    bytes: Arc<ViewBytes>,
}

impl ShmView {
    fn ptr_len(&self) -> (*const u8, usize) {
        match &*self.bytes {
            ViewBytes::Shared(view) => (view.ptr(), view.len()),
            ViewBytes::Owned(v) => (v.as_ptr(), v.len()),
        }
    }
}

#[pymethods]
impl ShmView {
    fn __len__(&self) -> usize {
        self.ptr_len().1
    }

    fn __repr__(&self) -> String {
        let kind = match *self.bytes {
            ViewBytes::Shared(_) => "shared",
            ViewBytes::Owned(_) => "copy",
        };
        format!("ShmView({} bytes, {kind})", self.ptr_len().1)
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = slf.get().ptr_len();
        // SAFETY: forwarded from this method's contract; the bytes live as long as `slf` (the
        // lease and the mapping, or the private copy), which the view references.
        unsafe { export_read_only_bytes(slf.into_any(), view, flags, ptr, len) }
    }
}

/// Fill `view` with `len` read-only bytes at `ptr`, owned by `owner` (what `__getbuffer__`
/// of a read-only, one-dimensional byte exporter does).
///
/// # Safety
/// `view` is the Py_buffer the interpreter passed to `__getbuffer__`; `ptr..ptr+len` stays
/// valid and unchanged for as long as `owner` lives.
unsafe fn export_read_only_bytes(
    owner: Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    ptr: *const u8,
    len: usize,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("view is null"));
    }
    if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
        return Err(PyBufferError::new_err(format!(
            "{} is read-only",
            owner.get_type().qualname()?
        )));
    }
    // SAFETY: `view` is a non-null Py_buffer the interpreter asked us to fill. We store a
    // strong reference to `owner` in `obj`, so the bytes outlive every consumer of the
    // buffer (the caller's contract). The memory is exposed read-only; the shape/strides
    // pointers point into the Py_buffer itself, as CPython's own 1-D exporters do, and the
    // format is a static string, so nothing needs freeing.
    unsafe {
        (*view).obj = owner.into_ptr();
        (*view).buf = ptr.cast_mut().cast();
        (*view).len = len as isize;
        (*view).readonly = 1;
        (*view).itemsize = 1;
        (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
            c"B".as_ptr().cast_mut()
        } else {
            std::ptr::null_mut()
        };
        (*view).ndim = 1;
        (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
            &mut (*view).len
        } else {
            std::ptr::null_mut()
        };
        (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
            &mut (*view).itemsize
        } else {
            std::ptr::null_mut()
        };
        (*view).suboffsets = std::ptr::null_mut();
        (*view).internal = std::ptr::null_mut();
    }
    Ok(())
}

#[derive(Clone)]
enum Role {
    Writer(Arc<Writer>),
    Reader(Arc<Reader>),
}

/// One named shared-memory ring: created by its single writer, attached by readers.
#[pyclass(frozen, module = "mmcache._core")]
pub struct ShmObjectStore {
    role: Mutex<Option<Role>>,
    name: String,
    capacity: u64,
    n_readers: u32,
    max_object_size: u64,
    is_writer: bool,
    reader_slot: Option<u32>,
    info: Option<ReaderInfo>,
}

/// Borrow every part of `data` (one buffer, or a list/tuple of them) as C-contiguous bytes.
fn collect_buffers(data: &Bound<'_, PyAny>) -> PyResult<Vec<PyUntypedBuffer>> {
    let items: Vec<Bound<'_, PyAny>> =
        if data.is_instance_of::<PyList>() || data.is_instance_of::<PyTuple>() {
            data.try_iter()?.collect::<PyResult<_>>()?
        } else {
            vec![data.clone()]
        };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let buf = PyUntypedBuffer::get(item).map_err(|_| {
                PyTypeError::new_err(format!(
                    "part {i} ({}) does not support the buffer protocol",
                    item.get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })?;
            if !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "part {i} is not C-contiguous"
                )));
            }
            Ok(buf)
        })
        .collect()
}

/// `Writer::put_raw`, with the GIL released when there is much to copy.
fn put_parts(
    py: Python<'_>,
    writer: &Writer,
    key: &str,
    parts: &[RawBytes<'_>],
) -> PyResult<ShmHandle> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let handle = if total >= DETACH_THRESHOLD {
        py.detach(|| writer.put_raw(key, parts))
    } else {
        writer.put_raw(key, parts)
    }?;
    Ok(ShmHandle::from_handle(handle))
}

impl ShmObjectStore {
    fn role(&self) -> PyResult<Role> {
        self.role
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Closed.into())
    }

    fn writer(&self, what: &str) -> PyResult<Arc<Writer>> {
        match self.role()? {
            Role::Writer(w) => Ok(w),
            Role::Reader(_) => Err(MmcacheError::new_err(format!(
                "{what}() is for the writer; this store is attached as a reader"
            ))),
        }
    }

    fn from_writer(w: Writer) -> Self {
        let layout = w.layout();
        ShmObjectStore {
            name: w.name().to_owned(),
            capacity: layout.capacity,
            n_readers: layout.n_readers,
            max_object_size: layout.max_object_size,
            is_writer: true,
            reader_slot: None,
            info: Some(w.reader_info()),
            role: Mutex::new(Some(Role::Writer(Arc::new(w)))),
        }
    }
}

#[pymethods]
impl ShmObjectStore {
    #[staticmethod]
    #[pyo3(signature = (capacity, *, n_readers = 1, max_object_size = None, name = None))]
    fn create(
        capacity: u64,
        n_readers: u32,
        max_object_size: Option<u64>,
        name: Option<&str>,
    ) -> PyResult<Self> {
        Ok(Self::from_writer(Writer::create(
            capacity,
            n_readers,
            max_object_size,
            name,
        )?))
    }

    #[staticmethod]
    fn attach(handle: &ReaderHandle) -> PyResult<Self> {
        let reader = Reader::attach(&handle.info)?;
        let layout = reader.layout();
        Ok(ShmObjectStore {
            name: reader.name().to_owned(),
            capacity: layout.capacity,
            n_readers: layout.n_readers,
            max_object_size: layout.max_object_size,
            is_writer: false,
            reader_slot: Some(reader.slot()),
            info: Some(handle.info.clone()),
            role: Mutex::new(Some(Role::Reader(reader))),
        })
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
    fn is_writer(&self) -> bool {
        self.is_writer
    }
    #[getter]
    fn reader_slot(&self) -> Option<u32> {
        self.reader_slot
    }
    #[getter]
    fn closed(&self) -> bool {
        self.role
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    fn handle(&self) -> PyResult<ReaderHandle> {
        self.role()?;
        let info = self
            .info
            .clone()
            .ok_or_else(|| PyErr::from(Error::Closed))?;
        Ok(ReaderHandle { info })
    }

    fn put(&self, py: Python<'_>, key: &str, data: &Bound<'_, PyAny>) -> PyResult<ShmHandle> {
        let writer = self.writer("put")?;
        let buffers = collect_buffers(data)?;
        let parts: Vec<RawBytes<'_>> = buffers
            .iter()
            // SAFETY: each buffer is C-contiguous (checked) and pinned by its PyUntypedBuffer,
            // which lives until the end of this function, so `len_bytes` bytes at `buf_ptr`
            // stay readable meanwhile (the buffer protocol forbids resizing an exported
            // buffer). Another thread may write them while the GIL is released: `RawBytes`
            // only ever copies from them, never forms a slice.
            .map(|b| unsafe { RawBytes::new(b.buf_ptr().cast::<u8>(), b.len_bytes()) })
            .collect();
        put_parts(py, &writer, key, &parts)
    }

    fn is_cached(&self, key: &str) -> PyResult<bool> {
        Ok(self.writer("is_cached")?.is_cached(key)?)
    }

    fn get_cached(&self, key: &str) -> PyResult<ShmHandle> {
        Ok(ShmHandle::from_handle(
            self.writer("get_cached")?.get_cached(key)?,
        ))
    }

    fn get_stored<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.writer("get_stored")?.read_key(key)?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn pin(&self, key: &str) -> PyResult<()> {
        Ok(self.writer("pin")?.pin(key)?)
    }

    fn unpin(&self, key: &str) -> PyResult<()> {
        Ok(self.writer("unpin")?.unpin(key)?)
    }

    fn release(&self, handle: &ShmHandle) -> PyResult<()> {
        let writer = self.writer("release")?;
        Ok(writer.release(&handle.to_handle()?)?)
    }

    fn verify(&self, handle: &ShmHandle, key: &str) -> PyResult<bool> {
        let writer = self.writer("verify")?;
        match handle.to_handle() {
            Ok(h) => Ok(writer.verify(&h, key)?),
            Err(_) => Ok(false), // a signature of the wrong length names no entry
        }
    }

    fn invalidate(&self, key: &str) -> PyResult<()> {
        Ok(self.writer("invalidate")?.invalidate(key)?)
    }

    fn clear(&self) -> PyResult<()> {
        Ok(self.writer("clear")?.clear()?)
    }

    fn keys(&self) -> PyResult<Vec<String>> {
        Ok(self.writer("keys")?.keys()?)
    }

    #[pyo3(signature = (handle, key, copy = true))]
    fn get(
        &self,
        py: Python<'_>,
        handle: &ShmHandle,
        key: &str,
        copy: bool,
    ) -> PyResult<Py<PyAny>> {
        let h = handle.to_handle()?;
        let reader = match self.role()? {
            Role::Writer(w) => {
                let bytes = w.read(&h, key)?;
                return Ok(if copy {
                    PyBytes::new(py, &bytes).into_any().unbind()
                } else {
                    Py::new(
                        py,
                        ShmView {
                            bytes: Arc::new(ViewBytes::Owned(bytes)),
                        },
                    )?
                    .into_any()
                });
            }
            Role::Reader(r) => r,
        };
        let lease = reader.acquire(&h, key)?;
        let len = lease.len();
        if copy {
            let bytes = PyBytes::new_with(py, len, |buf| {
                if len >= DETACH_THRESHOLD {
                    py.detach(|| lease.copy_to(buf))?;
                } else {
                    lease.copy_to(buf)?;
                }
                Ok(())
            })?;
            return Ok(bytes.into_any().unbind());
        }
        let bytes = match lease.into_view() {
            Ok(view) => ViewBytes::Shared(view),
            Err(lease) => {
                let mut owned = vec![0u8; len];
                lease.copy_to(&mut owned)?;
                ViewBytes::Owned(owned)
            }
        };
        Ok(Py::new(
            py,
            ShmView {
                bytes: Arc::new(bytes),
            },
        )?
        .into_any())
    }

    /// Encode `item` (a mapping of tensors, arrays and small values) and store it under
    /// `key`, in one pass: the header and every tensor's bytes go straight into the chunk.
    fn put_item(&self, py: Python<'_>, key: &str, item: &Bound<'_, PyAny>) -> PyResult<ShmHandle> {
        codec::put_item(self, py, key, item)
    }

    /// Verify `handle` for `key` and decode its item: zero-copy views (`copy=False`) or one
    /// copy per value, tensors into torch memory (pinned with `pin_memory=True`).
    #[pyo3(signature = (handle, key, *, copy = true, pin_memory = false))]
    fn get_item<'py>(
        &self,
        py: Python<'py>,
        handle: &ShmHandle,
        key: &str,
        copy: bool,
        pin_memory: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        codec::get_item(self, py, handle, key, copy, pin_memory)
    }

    /// `get_cached`, with `None` for an absent key instead of `KeyError` (P0's hot path).
    fn try_get_cached(&self, key: &str) -> PyResult<Option<ShmHandle>> {
        match self.writer("try_get_cached")?.get_cached(key) {
            Ok(h) => Ok(Some(ShmHandle::from_handle(h))),
            Err(Error::KeyNotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// `pin`, returning whether `key` was there to pin instead of raising `KeyError`.
    fn try_pin(&self, key: &str) -> PyResult<bool> {
        match self.writer("try_pin")?.pin(key) {
            Ok(()) => Ok(true),
            Err(Error::KeyNotFound(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// `(address, length)` of a reader's read-only mapping of the segment, which zero-copy
    /// views point into (to register it with CUDA, say).
    fn view_mapping(&self) -> PyResult<(usize, usize)> {
        match self.role()? {
            Role::Reader(r) => r
                .view_mapping()
                .ok_or_else(|| MmcacheError::new_err("this reader has no read-only mapping")),
            Role::Writer(_) => Err(MmcacheError::new_err(
                "view_mapping() is for readers; the writer exports no views",
            )),
        }
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = match self.role()? {
            Role::Writer(w) => w.stats()?,
            Role::Reader(r) => r.stats()?,
        };
        let dict = PyDict::new(py);
        for (k, v) in stats {
            dict.set_item(k, v)?;
        }
        Ok(dict)
    }

    fn close(&self) -> PyResult<()> {
        let role = self.role.lock().unwrap_or_else(|p| p.into_inner()).take();
        match role {
            Some(Role::Writer(w)) => w.close()?,
            // The slot drains: freed now, or when its last zero-copy view is gone.
            Some(Role::Reader(r)) => r.close(),
            None => {}
        }
        Ok(())
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.close()
    }

    fn __repr__(&self) -> String {
        let role = if self.is_writer { "writer" } else { "reader" };
        format!(
            "ShmObjectStore(name={:?}, capacity={}, {role})",
            self.name, self.capacity
        )
    }
}

/// Read a live segment's header without attaching as a reader (never writes to it).
#[pyfunction]
fn inspect_segment<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
    let info = store::inspect(name)?;
    let d = PyDict::new(py);
    d.set_item("name", &info.name)?;
    d.set_item("capacity", info.layout.capacity)?;
    d.set_item("total_len", info.total_len)?;
    d.set_item("n_readers", info.layout.n_readers)?;
    d.set_item("max_object_size", info.layout.max_object_size)?;
    d.set_item("creator_pid", info.creator_pid)?;
    d.set_item("creator_alive", info.creator_alive)?;
    d.set_item("writer_closed", info.writer_closed)?;
    d.set_item(
        "liveness",
        match info.liveness {
            Liveness::Locks => "locks",
            Liveness::Pids => "pids",
        },
    )?;
    for (k, v) in &info.counters {
        d.set_item(*k, *v)?;
    }
    let readers = PyList::empty(py);
    for s in &info.readers {
        let r = PyDict::new(py);
        r.set_item("slot", s.index)?;
        r.set_item(
            "state",
            match s.state {
                SlotState::Free => "free",
                SlotState::Claimed => "claimed",
                SlotState::Draining => "draining",
            },
        )?;
        r.set_item("claimed", s.state == SlotState::Claimed)?;
        r.set_item("pid", s.pid)?;
        r.set_item("alive", s.alive)?;
        r.set_item("refs", s.refs)?;
        r.set_item("acks", s.acks)?;
        r.set_item("outstanding", s.refs.saturating_sub(s.acks))?;
        r.set_item("stale", s.stale)?;
        readers.append(r)?;
    }
    d.set_item("readers", readers)?;
    Ok(d)
}

/// Whether segment `name` is `"live"` (its writer runs, in any PID namespace), `"orphaned"`
/// (safe to remove) or `"undecided"` (leave it for now), and why.
#[pyfunction]
fn segment_status(name: &str) -> PyResult<(&'static str, String)> {
    Ok(match store::status(name)? {
        store::Status::Live => ("live", "its writer is alive".to_owned()),
        store::Status::Orphaned(why) => ("orphaned", why),
        store::Status::Undecided(why) => ("undecided", why),
    })
}

/// Names of the segments this package created on this host (live or orphaned).
#[pyfunction]
fn list_segments() -> Vec<String> {
    store::list_segments()
}

/// Remove a segment's name (its memory is freed once every process unmaps it).
#[pyfunction]
fn unlink_segment(name: &str) -> PyResult<()> {
    Ok(crate::segment::unlink(name)?)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LAYOUT_VERSION", LAYOUT_VERSION)?;
    m.add("PART_ALIGNMENT", crate::layout::ALIGN)?;
    m.add("MmcacheError", py.get_type::<MmcacheError>())?;
    m.add("SegmentCorruptError", py.get_type::<SegmentCorruptError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("InvalidHandleError", py.get_type::<InvalidHandleError>())?;
    m.add("StaleHandleError", py.get_type::<StaleHandleError>())?;
    m.add("WriterGoneError", py.get_type::<WriterGoneError>())?;
    m.add("NoReaderSlotError", py.get_type::<NoReaderSlotError>())?;
    m.add("WrongProcessError", py.get_type::<WrongProcessError>())?;
    m.add("ObjectTooLargeError", py.get_type::<ObjectTooLargeError>())?;
    m.add("RingFullError", py.get_type::<RingFullError>())?;
    m.add_class::<ShmHandle>()?;
    m.add_class::<ReaderHandle>()?;
    m.add_class::<ShmView>()?;
    m.add_class::<ShmObjectStore>()?;
    m.add_function(wrap_pyfunction!(_shm_handle, m)?)?;
    m.add_function(wrap_pyfunction!(_reader_handle, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_segment, m)?)?;
    m.add_function(wrap_pyfunction!(list_segments, m)?)?;
    m.add_function(wrap_pyfunction!(segment_status, m)?)?;
    m.add_function(wrap_pyfunction!(unlink_segment, m)?)?;
    codec::register(m)?;
    Ok(())
}
