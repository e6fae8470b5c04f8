//! The picklable handles: `ShmHandle` (one object in the ring, what P0 sends instead of data),
//! `ReaderHandle` (everything a reader process needs to attach) and `WriterHandle`
//! (everything another writer process needs to join).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyTuple};

use super::args::{self, Int, Name};
use super::errors::InvalidHandleError;
use crate::handle::{Handle, SIGNATURE_LEN};
use crate::store::{ReaderInfo, WriterInfo};

/// Where one object lives: ring address, monotonic id and a keyed signature.
#[pyclass(frozen, eq, hash, module = "mmcache._core")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct ShmHandle {
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

/// The signing secret a `ReaderHandle` or `WriterHandle` carries: exactly 32 bytes.
fn secret_field(secret: Vec<u8>) -> PyResult<[u8; 32]> {
    secret
        .try_into()
        .map_err(|_| PyValueError::new_err("secret must be 32 bytes"))
}

/// A handle's `__reduce__`: `mmcache._core.<unpickler>(*args)`. The unpicklers take the
/// constructors' fields in order, positionally, so pickles stay the same from one version to
/// the next (`test_core.py` holds pickles of an earlier one). Each caller keeps its
/// unpickler in its own `cell`, found once: importing it for every pickle took most of an
/// item handle's 0.5 µs `__reduce__`.
fn reduce<'py, A>(
    py: Python<'py>,
    cell: &'static PyOnceLock<Py<PyAny>>,
    unpickler: &str,
    args: A,
) -> PyResult<Bound<'py, PyTuple>>
where
    A: IntoPyObject<'py, Output = Bound<'py, PyTuple>>,
    A::Error: Into<PyErr>,
{
    let rebuild = cell.import(py, "mmcache._core", unpickler)?.clone();
    let args = args.into_pyobject(py).map_err(Into::into)?;
    (rebuild, args).into_pyobject(py)
}

/// The `__reduce__` of a `ReaderHandle` or `WriterHandle`: `fields`, the constructor's in
/// order (space-separated), read through their getters (a store handle is pickled once per
/// process that attaches, unlike the `ShmHandle` of every item).
fn reduce_fields<'py>(
    handle: &Bound<'py, PyAny>,
    cell: &'static PyOnceLock<Py<PyAny>>,
    unpickler: &str,
    fields: &str,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = handle.py();
    let values = fields
        .split(' ')
        .map(|field| handle.getattr(field))
        .collect::<PyResult<Vec<_>>>()?;
    reduce(py, cell, unpickler, PyTuple::new(py, values)?)
}

impl ShmHandle {
    /// The core's handle; a signature of the wrong length cannot verify.
    pub(super) fn to_handle(&self) -> PyResult<Handle> {
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

    pub(super) fn from_handle(h: Handle) -> Self {
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
        static UNPICKLER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let signature = PyBytes::new(py, &self.signature);
        reduce(
            py,
            &UNPICKLER,
            "_shm_handle",
            (self.address, self.monotonic_id, signature),
        )
    }
}

/// Unpickle a `ShmHandle` (positional, unlike its keyword-only constructor).
#[pyfunction]
pub(super) fn _shm_handle(
    address: Int<args::Address>,
    monotonic_id: Int<args::MonotonicId>,
    signature: Vec<u8>,
) -> ShmHandle {
    ShmHandle {
        address: address.get(),
        monotonic_id: monotonic_id.get(),
        signature,
    }
}

/// Everything a reader process needs to attach: segment name, layout and signing key.
#[pyclass(frozen, eq, module = "mmcache._core")]
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct ReaderHandle {
    info: ReaderInfo,
}

impl ReaderHandle {
    pub(super) fn from_info(info: ReaderInfo) -> Self {
        ReaderHandle { info }
    }

    pub(super) fn info(&self) -> &ReaderInfo {
        &self.info
    }
}

#[pymethods]
impl ReaderHandle {
    #[new]
    #[pyo3(signature = (*, name, capacity, n_readers, max_object_size, layout_version, secret))]
    fn new(
        name: Name,
        capacity: Int<args::Capacity>,
        n_readers: Int<args::NReaders>,
        max_object_size: Int<args::MaxObjectSize>,
        layout_version: Int<args::LayoutVersion>,
        secret: Vec<u8>,
    ) -> PyResult<Self> {
        Ok(ReaderHandle {
            info: ReaderInfo {
                name: name.0,
                capacity: capacity.get(),
                n_readers: n_readers.get_u32()?,
                max_object_size: max_object_size.get(),
                layout_version: layout_version.get(),
                secret: secret_field(secret)?,
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

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let fields = "name capacity n_readers max_object_size layout_version secret";
        static UNPICKLER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        reduce_fields(slf.as_any(), &UNPICKLER, "_reader_handle", fields)
    }
}

/// Unpickle a `ReaderHandle` (positional, unlike its keyword-only constructor).
#[pyfunction]
pub(super) fn _reader_handle(
    name: Name,
    capacity: Int<args::Capacity>,
    n_readers: Int<args::NReaders>,
    max_object_size: Int<args::MaxObjectSize>,
    layout_version: Int<args::LayoutVersion>,
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

/// Everything another writer process needs to join a store: segment name, layout and the
/// signing secret (so it carries the same trust as a `ReaderHandle`).
#[pyclass(frozen, eq, module = "mmcache._core")]
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct WriterHandle {
    info: WriterInfo,
}

impl WriterHandle {
    pub(super) fn from_info(info: WriterInfo) -> Self {
        WriterHandle { info }
    }

    pub(super) fn info(&self) -> &WriterInfo {
        &self.info
    }
}

#[pymethods]
impl WriterHandle {
    #[new]
    #[pyo3(signature = (
        *, name, capacity, n_readers, max_object_size, max_writers, layout_version, secret
    ))]
    fn new(
        name: Name,
        capacity: Int<args::Capacity>,
        n_readers: Int<args::NReaders>,
        max_object_size: Int<args::MaxObjectSize>,
        max_writers: Int<args::MaxWriters>,
        layout_version: Int<args::LayoutVersion>,
        secret: Vec<u8>,
    ) -> PyResult<Self> {
        Ok(WriterHandle {
            info: WriterInfo {
                name: name.0,
                capacity: capacity.get(),
                n_readers: n_readers.get_u32()?,
                max_object_size: max_object_size.get(),
                max_writers: max_writers.get_u32()?,
                layout_version: layout_version.get(),
                secret: secret_field(secret)?,
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
    fn max_writers(&self) -> u32 {
        self.info.max_writers
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
            "WriterHandle(name={:?}, capacity={}, max_writers={})",
            self.info.name, self.info.capacity, self.info.max_writers
        )
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let fields = "name capacity n_readers max_object_size max_writers layout_version secret";
        static UNPICKLER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        reduce_fields(slf.as_any(), &UNPICKLER, "_writer_handle", fields)
    }
}

/// Unpickle a `WriterHandle` (positional, unlike its keyword-only constructor).
#[pyfunction]
pub(super) fn _writer_handle(
    name: Name,
    capacity: Int<args::Capacity>,
    n_readers: Int<args::NReaders>,
    max_object_size: Int<args::MaxObjectSize>,
    max_writers: Int<args::MaxWriters>,
    layout_version: Int<args::LayoutVersion>,
    secret: Vec<u8>,
) -> PyResult<WriterHandle> {
    WriterHandle::new(
        name,
        capacity,
        n_readers,
        max_object_size,
        max_writers,
        layout_version,
        secret,
    )
}

/// Add the handle classes (and their unpicklers) to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ShmHandle>()?;
    m.add_class::<ReaderHandle>()?;
    m.add_class::<WriterHandle>()?;
    m.add_function(wrap_pyfunction!(_shm_handle, m)?)?;
    m.add_function(wrap_pyfunction!(_reader_handle, m)?)?;
    m.add_function(wrap_pyfunction!(_writer_handle, m)?)?;
    Ok(())
}
