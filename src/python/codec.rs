//! The item codec's Python side: a cached item (a mapping of tensors, arrays and small values)
//! to a payload and back, in one native pass each way. The payload format is `crate::codec`.
//!
//! **Encode** walks the item once. Small values go into the header; every tensor, array and
//! long `bytes` value becomes a part, read in place (a tensor's bytes through its
//! `data_ptr()`, an array's through the buffer protocol) and copied straight into the ring's
//! chunk by the same `put` that writes the header — no intermediate buffer.
//!
//! **Decode** validates the whole header first (`Header::walk`), then builds the values:
//!
//! * zero-copy (`copy=False`): torch tensors come from DLPack capsules (torch accepts them
//!   without the warning it gives for read-only buffers) and numpy arrays from the buffer
//!   protocol, read-only where the memory is; every one keeps the payload alive;
//! * copying: one copy per value, with the GIL released when the copies are large. Tensors are
//!   copied into one torch allocation per item (pinned on request) and handed out as DLPack
//!   views of it, so a three-tensor item costs one allocator call; arrays get `np.empty`.
//!
//! Besides `segment.rs` this module holds the only `unsafe` code: the DLPack structures
//! handed to torch, buffer exports, and byte copies from Python buffers.

use std::collections::HashMap;
use std::ffi::{CStr, c_int, c_void};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple, PyType,
};
use pyo3::{ffi, intern};

use super::{
    DETACH_THRESHOLD, Role, SegmentCorruptError, ShmHandle, ShmObjectStore, ShmView, ViewBytes,
    export_read_only_bytes, put_parts,
};
use crate::codec::{
    Container, FormatError, Header, HeaderBuilder, MAX_DEPTH, Node, OUT_OF_BAND_BYTES, PREFIX_LEN,
    Shape, TreeReader, header_len,
};
use crate::layout::align_up;
use crate::segment::RawBytes;

impl From<FormatError> for PyErr {
    fn from(err: FormatError) -> PyErr {
        SegmentCorruptError::new_err(format!("payload is not a valid mmcache item: {err}"))
    }
}

// ---------------------------------------------------------------------------------------
// numpy and torch, looked up once per process
// ---------------------------------------------------------------------------------------

struct Numpy {
    ndarray: Py<PyType>,
    generic: Py<PyType>,
    dtype: Py<PyAny>,
    empty: Py<PyAny>,
    frombuffer: Py<PyAny>,
    ascontiguousarray: Py<PyAny>,
}

static NUMPY: PyOnceLock<Numpy> = PyOnceLock::new();

fn numpy(py: Python<'_>) -> PyResult<&'static Numpy> {
    NUMPY.get_or_try_init(py, || {
        let np = py.import("numpy")?;
        Ok(Numpy {
            ndarray: np.getattr("ndarray")?.cast_into()?.unbind(),
            generic: np.getattr("generic")?.cast_into()?.unbind(),
            dtype: np.getattr("dtype")?.unbind(),
            empty: np.getattr("empty")?.unbind(),
            frombuffer: np.getattr("frombuffer")?.unbind(),
            ascontiguousarray: np.getattr("ascontiguousarray")?.unbind(),
        })
    })
}

/// Entries kept in each of the dtype caches below (descriptors come from payloads, so the
/// caches are bounded; a miss only costs a Python call).
const DTYPE_CACHE_ENTRIES: usize = 256;

/// numpy dtype objects (held, so their addresses stay theirs) to their `dtype.str`.
static ARRAY_DESCRS: Mutex<Vec<(Py<PyAny>, String)>> = Mutex::new(Vec::new());
/// `dtype.str` to the dtype object and its item size, for decoding.
static ARRAY_DTYPES: Mutex<Option<DtypesByDescr>> = Mutex::new(None);
type DtypesByDescr = HashMap<String, (Py<PyAny>, u64)>;

/// Why a numpy dtype cannot travel as raw bytes, if it cannot.
fn array_dtype_problem(dtype: &Bound<'_, PyAny>) -> PyResult<Option<&'static str>> {
    let py = dtype.py();
    Ok(if dtype.getattr(intern!(py, "hasobject"))?.is_truthy()? {
        Some("holds Python objects")
    } else if !dtype.getattr(intern!(py, "fields"))?.is_none() {
        Some("is a structured dtype")
    } else if !dtype.getattr(intern!(py, "subdtype"))?.is_none() {
        Some("is a sub-array dtype")
    } else {
        None
    })
}

/// An array dtype's descriptor (`dtype.str`), or why it is refused.
fn array_descr(dtype: &Bound<'_, PyAny>) -> PyResult<Result<String, String>> {
    // Never call Python while holding a cache lock (the callee may release the GIL).
    let cached = lock(&ARRAY_DESCRS)
        .iter()
        .find(|(d, _)| d.as_ptr() == dtype.as_ptr())
        .map(|(_, s)| s.clone());
    if let Some(descr) = cached {
        return Ok(Ok(descr));
    }
    if let Some(problem) = array_dtype_problem(dtype)? {
        return Ok(Err(format!("array dtype {dtype} {problem}")));
    }
    let descr: String = dtype.getattr(intern!(dtype.py(), "str"))?.extract()?;
    let mut cache = lock(&ARRAY_DESCRS);
    if cache.len() < DTYPE_CACHE_ENTRIES {
        cache.push((dtype.clone().unbind(), descr.clone()));
    }
    Ok(Ok(descr))
}

/// The numpy dtype of a stored descriptor and its item size.
fn array_dtype<'py>(py: Python<'py>, descr: &str) -> PyResult<(Bound<'py, PyAny>, u64)> {
    if let Some((dtype, itemsize)) = lock(&ARRAY_DTYPES).as_ref().and_then(|m| m.get(descr)) {
        return Ok((dtype.bind(py).clone(), *itemsize));
    }
    let corrupt = |why: String| FormatError(format!("array dtype {descr:?} {why}"));
    let dtype = numpy(py)?
        .dtype
        .bind(py)
        .call1((descr,))
        .map_err(|e| corrupt(format!("is not a numpy dtype ({e})")))?;
    if let Some(problem) = array_dtype_problem(&dtype)? {
        return Err(corrupt(problem.into()).into());
    }
    let itemsize: u64 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
    let mut cache = lock(&ARRAY_DTYPES);
    let map = cache.get_or_insert_with(HashMap::new);
    if map.len() < DTYPE_CACHE_ENTRIES {
        map.insert(descr.to_owned(), (dtype.clone().unbind(), itemsize));
    }
    Ok((dtype, itemsize))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// DLPack type codes (dlpack.h, `DLDataTypeCode`).
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_COMPLEX: u8 = 5;
const DL_BOOL: u8 = 6;
const DL_FLOAT8_E4M3FN: u8 = 10;
const DL_FLOAT8_E4M3FNUZ: u8 = 11;
const DL_FLOAT8_E5M2: u8 = 12;
const DL_FLOAT8_E5M2FNUZ: u8 = 13;
const DL_FLOAT8_E8M0FNU: u8 = 14;
const DL_FLOAT4_E2M1FN: u8 = 17;
/// `DLDeviceType::kDLCPU`.
const DL_CPU: i32 = 1;

/// Every torch dtype an item may hold, by torch's name, with the DLPack type torch exports
/// it as and imports back as the same dtype. Dtypes without one (sub-byte integers, bit
/// types) travel as bytes and are re-viewed on decode. Names the running torch lacks are
/// skipped; quantized dtypes are absent on purpose (their scale is not in the bytes).
const TORCH_DTYPES: &[(&str, Option<DlType>)] = &[
    ("float32", Some(DlType::new(DL_FLOAT, 32, 1))),
    ("float16", Some(DlType::new(DL_FLOAT, 16, 1))),
    ("bfloat16", Some(DlType::new(DL_BFLOAT, 16, 1))),
    ("float64", Some(DlType::new(DL_FLOAT, 64, 1))),
    ("int64", Some(DlType::new(DL_INT, 64, 1))),
    ("int32", Some(DlType::new(DL_INT, 32, 1))),
    ("int16", Some(DlType::new(DL_INT, 16, 1))),
    ("int8", Some(DlType::new(DL_INT, 8, 1))),
    ("uint8", Some(DlType::new(DL_UINT, 8, 1))),
    ("uint16", Some(DlType::new(DL_UINT, 16, 1))),
    ("uint32", Some(DlType::new(DL_UINT, 32, 1))),
    ("uint64", Some(DlType::new(DL_UINT, 64, 1))),
    ("bool", Some(DlType::new(DL_BOOL, 8, 1))),
    ("complex32", Some(DlType::new(DL_COMPLEX, 32, 1))),
    ("complex64", Some(DlType::new(DL_COMPLEX, 64, 1))),
    ("complex128", Some(DlType::new(DL_COMPLEX, 128, 1))),
    ("float8_e4m3fn", Some(DlType::new(DL_FLOAT8_E4M3FN, 8, 1))),
    (
        "float8_e4m3fnuz",
        Some(DlType::new(DL_FLOAT8_E4M3FNUZ, 8, 1)),
    ),
    ("float8_e5m2", Some(DlType::new(DL_FLOAT8_E5M2, 8, 1))),
    (
        "float8_e5m2fnuz",
        Some(DlType::new(DL_FLOAT8_E5M2FNUZ, 8, 1)),
    ),
    ("float8_e8m0fnu", Some(DlType::new(DL_FLOAT8_E8M0FNU, 8, 1))),
    (
        "float4_e2m1fn_x2",
        Some(DlType::new(DL_FLOAT4_E2M1FN, 4, 2)),
    ),
    ("int1", None),
    ("int2", None),
    ("int3", None),
    ("int4", None),
    ("int5", None),
    ("int6", None),
    ("int7", None),
    ("uint1", None),
    ("uint2", None),
    ("uint3", None),
    ("uint4", None),
    ("uint5", None),
    ("uint6", None),
    ("uint7", None),
    ("bits1x8", None),
    ("bits2x4", None),
    ("bits4x2", None),
    ("bits8", None),
    ("bits16", None),
];

struct TorchDtype {
    name: &'static str,
    obj: Py<PyAny>,
    itemsize: u64,
    complex: bool,
    dlpack: Option<DlType>,
}

struct Torch {
    tensor: Py<PyType>,
    strided: Py<PyAny>,
    from_dlpack: Py<PyAny>,
    /// `torch.UntypedStorage`: plain copy buffers (the cheapest torch allocation to call).
    storage: Py<PyAny>,
    empty: Py<PyAny>,
    /// `torch.empty` keyword arguments for a pinned byte buffer.
    pinned_kwargs: Py<PyDict>,
    dtypes: Vec<TorchDtype>,
    /// Address of each dtype object (held in `dtypes`) to its index.
    by_object: HashMap<usize, usize>,
    by_name: HashMap<&'static str, usize>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn load_torch(torch: &Bound<'_, PyModule>) -> PyResult<Torch> {
    let py = torch.py();
    let mut dtypes = Vec::new();
    for &(name, dlpack) in TORCH_DTYPES {
        let Ok(obj) = torch.getattr(name) else {
            continue; // an older torch
        };
        dtypes.push(TorchDtype {
            name,
            itemsize: obj.getattr("itemsize")?.extract()?,
            complex: obj.getattr("is_complex")?.is_truthy()?,
            obj: obj.unbind(),
            dlpack,
        });
    }
    let pinned_kwargs = PyDict::new(py);
    pinned_kwargs.set_item("dtype", torch.getattr("uint8")?)?;
    pinned_kwargs.set_item("pin_memory", true)?;
    Ok(Torch {
        tensor: torch.getattr("Tensor")?.cast_into()?.unbind(),
        strided: torch.getattr("strided")?.unbind(),
        // The C function behind `torch.from_dlpack`, which only adds a Python frame of
        // checks for objects with `__dlpack__` (a fifth of the cost of a small tensor).
        from_dlpack: match torch.getattr("_C")?.getattr("_from_dlpack") {
            Ok(f) => f,
            Err(_) => torch.getattr("from_dlpack")?,
        }
        .unbind(),
        storage: torch.getattr("UntypedStorage")?.unbind(),
        empty: torch.getattr("empty")?.unbind(),
        pinned_kwargs: pinned_kwargs.unbind(),
        by_object: dtypes
            .iter()
            .enumerate()
            .map(|(i, d)| (d.obj.as_ptr() as usize, i))
            .collect(),
        by_name: dtypes
            .iter()
            .enumerate()
            .map(|(i, d)| (d.name, i))
            .collect(),
        dtypes,
    })
}

/// torch, importing it (decoding a tensor needs it).
fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    TORCH.get_or_try_init(py, || load_torch(&py.import("torch")?))
}

/// torch if the process has imported it: a value can only be a tensor then, and encoding
/// never imports torch itself.
fn torch_if_loaded(py: Python<'_>) -> PyResult<Option<&'static Torch>> {
    if let Some(t) = TORCH.get(py) {
        return Ok(Some(t));
    }
    static MODULES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
    let modules = MODULES.import(py, "sys", "modules")?;
    match modules.get_item("torch")? {
        Some(_) => torch(py).map(Some),
        None => Ok(None),
    }
}

// ---------------------------------------------------------------------------------------
// Buffers and DLPack
// ---------------------------------------------------------------------------------------

/// A buffer export held open: contiguous bytes (`PyBUF_SIMPLE`, no format, so every numpy
/// dtype exports, datetimes included), released on drop.
pub(super) struct SimpleBuffer(Box<ffi::Py_buffer>);

// SAFETY: the export pins the exporter's memory until release, whatever the thread; we only
// read (or, for a writable export of memory we just allocated, write) through `buf`, and
// release under the GIL (`Drop`).
unsafe impl Send for SimpleBuffer {}
// SAFETY: as for `Send`: shared access only reads the fields.
unsafe impl Sync for SimpleBuffer {}

impl SimpleBuffer {
    fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        let mut view = Box::new(ffi::Py_buffer::new());
        let flags = if writable {
            ffi::PyBUF_WRITABLE
        } else {
            ffi::PyBUF_SIMPLE
        };
        // SAFETY: `obj` is a live object and `view` points to storage for one Py_buffer; on
        // success the exporter filled it, and we own the export until `PyBuffer_Release`.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(SimpleBuffer(view))
    }

    fn ptr(&self) -> *mut u8 {
        self.0.buf.cast()
    }

    fn len(&self) -> usize {
        self.0.len as usize
    }
}

impl Drop for SimpleBuffer {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
        // exactly once, here, holding the GIL.
        with_gil_held(|| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// Run `f` holding the GIL, whether or not this thread holds it already and whatever PyO3's
/// own bookkeeping says: torch frees a tensor (so calls its DLPack deleter) with the GIL
/// released, even in the middle of a PyO3 call, where `Python::attach` would assume it
/// held. Nothing runs once the interpreter is gone (what `f` would free goes with it).
fn with_gil_held(f: impl FnOnce()) {
    // SAFETY: Py_IsInitialized may be called at any time; PyGILState_Ensure/Release pair up
    // on this thread and work whether or not it holds the GIL.
    unsafe {
        if ffi::Py_IsInitialized() == 0 {
            return;
        }
        let state = ffi::PyGILState_Ensure();
        f();
        ffi::PyGILState_Release(state);
    }
}

/// dlpack.h's `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlType {
    code: u8,
    bits: u8,
    lanes: u16,
}

impl DlType {
    const fn new(code: u8, bits: u8, lanes: u16) -> Self {
        DlType { code, bits, lanes }
    }
}

/// dlpack.h's `DLTensor`.
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    dtype: DlType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// dlpack.h's `DLManagedTensor` (the unversioned struct of a `"dltensor"` capsule).
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What keeps a zero-copy value's bytes alive.
enum Owner {
    /// A payload read through the store (its lease protects the chunk).
    Store { _bytes: Arc<ViewBytes> },
    /// A Python object whose memory the bytes are (a caller's payload, a copy buffer).
    Object { obj: Py<PyAny> },
}

/// One tensor handed to torch: the DLPack struct first (torch sees its address), then what
/// its pointers point into and what keeps the data alive.
#[repr(C)]
struct Exported {
    managed: DLManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    owner: Owner,
}

/// The DLPack deleter: torch calls it once, when the tensor's storage goes.
unsafe extern "C" fn delete_exported(managed: *mut DLManagedTensor) {
    // SAFETY: `managed` is the first field of an `Exported` leaked with `Box::into_raw` in
    // `dlpack_tensor`, and DLPack calls the deleter exactly once.
    let exported = unsafe { Box::from_raw(managed.cast::<Exported>()) };
    if let Owner::Object { obj } = exported.owner {
        let obj = obj.into_ptr();
        // SAFETY: `obj` is the strong reference the owner held, given up exactly once, with
        // the GIL held.
        with_gil_held(|| unsafe { ffi::Py_DecRef(obj) });
    }
}

const DLTENSOR: &CStr = c"dltensor";

/// The capsule's destructor: frees the tensor only if no consumer took it (a consumer
/// renames the capsule to "used_dltensor" and calls the deleter itself).
unsafe extern "C" fn destroy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: CPython passes the capsule being destroyed; IsValid and GetPointer with the
    // name it was created with do not fail, and the pointer is the `DLManagedTensor` we put
    // there, whose deleter has not run (the capsule was never consumed).
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete_exported(managed.cast());
        }
    }
}

/// A torch tensor over `nbytes` bytes at `data`, kept alive by `owner`, without a copy.
fn dlpack_tensor<'py>(
    py: Python<'py>,
    torch: &Torch,
    dtype: &TorchDtype,
    shape: Shape<'_>,
    data: *mut u8,
    nbytes: u64,
    owner: Owner,
) -> PyResult<Bound<'py, PyAny>> {
    let dims: Vec<i64> = shape
        .dims()
        .map(|d| i64::try_from(d).map_err(|_| FormatError(format!("dimension {d} too large"))))
        .collect::<Result<_, _>>()?;
    // Types torch has no DLPack code for travel as bytes, then take their dtype back.
    let (dl_type, dl_shape) = match dtype.dlpack {
        Some(t) => (t, dims.clone()),
        None => (DlType::new(DL_UINT, 8, 1), vec![nbytes as i64]),
    };
    let mut strides = vec![1i64; dl_shape.len()];
    for i in (0..dl_shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(dl_shape[i + 1].max(1));
    }
    let mut exported = Box::new(Exported {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data.cast(),
                device_type: DL_CPU,
                device_id: 0,
                ndim: dl_shape.len() as i32,
                dtype: dl_type,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape: dl_shape,
        strides,
        owner,
    });
    exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
    exported.managed.dl_tensor.strides = exported.strides.as_mut_ptr();
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is a live `Exported` whose first field is the `DLManagedTensor`; the
    // capsule owns it from here (its destructor or torch, through the deleter, frees it).
    let capsule = unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let capsule = ffi::PyCapsule_New(raw.cast(), DLTENSOR.as_ptr(), Some(destroy_capsule));
        if capsule.is_null() {
            delete_exported(raw.cast());
        }
        Bound::from_owned_ptr_or_err(py, capsule)?
    };
    let tensor = torch.from_dlpack.bind(py).call1((capsule,))?;
    if dtype.dlpack.is_some() {
        return Ok(tensor);
    }
    tensor
        .call_method1(intern!(py, "view"), (dtype.obj.bind(py),))?
        .call_method1(intern!(py, "reshape"), (PyTuple::new(py, &dims)?,))
}

// ---------------------------------------------------------------------------------------
// Encode
// ---------------------------------------------------------------------------------------

/// The bytes of one part, read in place from the object that holds them.
enum Part<'py> {
    Bytes(Bound<'py, PyBytes>),
    Buffer(SimpleBuffer),
    Tensor {
        tensor: Bound<'py, PyAny>,
        ptr: *const u8,
        len: usize,
    },
}

impl Part<'_> {
    fn raw(&self) -> (*const u8, usize) {
        match self {
            Part::Bytes(b) => (b.as_bytes().as_ptr(), b.as_bytes().len()),
            Part::Buffer(b) => (b.ptr(), b.len()),
            Part::Tensor { ptr, len, .. } => (*ptr, *len),
        }
    }

    /// The part's bytes for `Writer::put_raw`, which only ever copies from them (another
    /// thread may write an item's tensors while the GIL is released).
    fn bytes(&self) -> RawBytes<'_> {
        match self.raw() {
            // An empty tensor's data pointer may be null.
            (_, 0) => RawBytes::from(&[][..]),
            // SAFETY: the memory belongs to a live Python object held by `self` (a tensor
            // whose storage it is, an open buffer export, or a bytes object), so it stays
            // valid for reads of `len` bytes for as long as `self` is borrowed.
            (ptr, len) => unsafe { RawBytes::new(ptr, len) },
        }
    }
}

/// Why encoding failed, and where (innermost segment last until unwound).
struct EncodeError {
    err: PyErr,
    path: Vec<String>,
}

impl EncodeError {
    fn unsupported(msg: String) -> Self {
        EncodeError {
            err: PyTypeError::new_err(msg),
            path: Vec::new(),
        }
    }

    fn at(mut self, segment: String) -> Self {
        self.path.push(segment);
        self
    }

    /// The Python error, naming the field (`item['pixels'][1]`).
    fn into_pyerr(self, py: Python<'_>) -> PyErr {
        let path: String = self.path.iter().rev().map(String::as_str).collect();
        let msg = format!("field item{path}: {}", self.err.value(py));
        let out = if self.err.is_instance_of::<PyTypeError>(py) {
            PyTypeError::new_err(msg)
        } else {
            PyValueError::new_err(msg)
        };
        out.set_cause(py, Some(self.err));
        out
    }
}

impl From<PyErr> for EncodeError {
    fn from(err: PyErr) -> Self {
        EncodeError {
            err,
            path: Vec::new(),
        }
    }
}

impl From<FormatError> for EncodeError {
    fn from(err: FormatError) -> Self {
        EncodeError::from(PyValueError::new_err(err.0))
    }
}

type EncodeResult<T> = Result<T, EncodeError>;

struct Encoder<'py> {
    py: Python<'py>,
    numpy: &'static Numpy,
    torch: Option<&'static Torch>,
    header: HeaderBuilder,
    parts: Vec<Part<'py>>,
}

/// An item encoded: part 0 and the parts that follow it.
struct Encoded<'py> {
    header: Vec<u8>,
    parts: Vec<Part<'py>>,
}

impl<'py> Encoded<'py> {
    fn new(item: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = item.py();
        let mut enc = Encoder {
            py,
            numpy: numpy(py)?,
            torch: torch_if_loaded(py)?,
            header: HeaderBuilder::new(),
            parts: Vec::new(),
        };
        let walked = if let Ok(dict) = item.cast_exact::<PyDict>() {
            enc.dict(dict, 1)
        } else if is_mapping(item)? {
            enc.mapping(item, 1)
        } else {
            return Err(PyTypeError::new_err(format!(
                "an item must be a mapping of field names, not {}",
                item.get_type().qualname()?
            )));
        };
        walked.map_err(|e| e.into_pyerr(py))?;
        Ok(Encoded {
            header: enc.header.finish()?,
            parts: enc.parts,
        })
    }

    /// Part 0 then every part, as the store writes them.
    fn parts(&self) -> Vec<RawBytes<'_>> {
        std::iter::once(RawBytes::from(self.header.as_slice()))
            .chain(self.parts.iter().map(Part::bytes))
            .collect()
    }
}

fn is_mapping(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    static MAPPING: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    value.is_instance(
        MAPPING
            .import(value.py(), "collections.abc", "Mapping")?
            .as_any(),
    )
}

/// A shape (`torch.Size` or an array's tuple) as `u64`s.
fn dims(shape: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    shape
        .cast::<PyTuple>()?
        .iter()
        .map(|d| d.extract::<u64>())
        .collect()
}

fn key_segment(key: &Bound<'_, PyAny>) -> String {
    match key.repr() {
        Ok(r) => format!("[{r}]"),
        Err(_) => "[?]".into(),
    }
}

impl<'py> Encoder<'py> {
    fn value(&mut self, v: &Bound<'py, PyAny>, depth: usize) -> EncodeResult<()> {
        let py = self.py;
        if let Ok(d) = v.cast_exact::<PyDict>() {
            return self.dict(d, depth + 1);
        }
        if let Some(torch) = self.torch {
            if v.is_instance(torch.tensor.bind(py).as_any())? {
                return self.tensor(torch, v);
            }
        }
        if v.is_none() {
            self.header.none();
        } else if let Ok(b) = v.cast::<PyBool>() {
            self.header.bool(b.is_true());
        } else if v.is_instance_of::<PyInt>() {
            if let Ok(i) = v.extract::<i64>() {
                self.header.int(i);
            } else if let Ok(u) = v.extract::<u64>() {
                self.header.uint(u);
            } else {
                return Err(EncodeError::unsupported(format!(
                    "int {v} does not fit in 64 bits"
                )));
            }
        } else if let Ok(f) = v.cast::<PyFloat>() {
            self.header.float(f.value());
        } else if let Ok(s) = v.cast::<PyString>() {
            let s = s.to_str().map_err(|_| {
                EncodeError::unsupported("str is not valid UTF-8 (a lone surrogate?)".into())
            })?;
            self.header.str(s)?;
        } else if let Ok(b) = v.cast::<PyBytes>() {
            if self.header.bytes(b.as_bytes())?.is_some() {
                self.parts.push(Part::Bytes(b.clone()));
            }
        } else if v.is_instance(self.numpy.ndarray.bind(py).as_any())? {
            self.array(v)?;
        } else if v.is_instance(self.numpy.generic.bind(py).as_any())? {
            self.scalar(v)?;
        } else if let Ok(l) = v.cast::<PyList>() {
            self.sequence(Container::List, l.as_any(), depth + 1)?;
        } else if let Ok(t) = v.cast::<PyTuple>() {
            self.sequence(Container::Tuple, t.as_any(), depth + 1)?;
        } else if is_mapping(v)? {
            self.mapping(v, depth + 1)?;
        } else {
            return Err(EncodeError::unsupported(format!(
                "unsupported type {}",
                v.get_type().qualname()?
            )));
        }
        Ok(())
    }

    fn check_depth(&self, depth: usize) -> EncodeResult<()> {
        if depth > MAX_DEPTH {
            return Err(EncodeError::unsupported(format!(
                "nested deeper than {MAX_DEPTH} levels (a container that holds itself?)"
            )));
        }
        Ok(())
    }

    fn entry(
        &mut self,
        key: &Bound<'py, PyAny>,
        value: &Bound<'py, PyAny>,
        depth: usize,
    ) -> EncodeResult<()> {
        let name = key
            .cast::<PyString>()
            .map_err(|_| {
                EncodeError::unsupported(format!("key {} is not a str", key_segment(key)))
            })?
            .to_str()
            .map_err(|_| EncodeError::unsupported("a key is not valid UTF-8".into()))?;
        self.header.key(name)?;
        self.value(value, depth).map_err(|e| e.at(key_segment(key)))
    }

    fn dict(&mut self, d: &Bound<'py, PyDict>, depth: usize) -> EncodeResult<()> {
        self.check_depth(depth)?;
        let open = self.header.begin(Container::Dict);
        let mut n = 0;
        for (k, v) in d.iter() {
            self.entry(&k, &v, depth)?;
            n += 1;
        }
        Ok(self.header.end(open, n)?)
    }

    fn mapping(&mut self, m: &Bound<'py, PyAny>, depth: usize) -> EncodeResult<()> {
        self.check_depth(depth)?;
        let open = self.header.begin(Container::Dict);
        let mut n = 0;
        for pair in m.call_method0(intern!(self.py, "items"))?.try_iter()? {
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = pair?.extract()?;
            self.entry(&k, &v, depth)?;
            n += 1;
        }
        Ok(self.header.end(open, n)?)
    }

    fn sequence(
        &mut self,
        kind: Container,
        seq: &Bound<'py, PyAny>,
        depth: usize,
    ) -> EncodeResult<()> {
        self.check_depth(depth)?;
        let open = self.header.begin(kind);
        let mut n = 0;
        for v in seq.try_iter()? {
            self.value(&v?, depth).map_err(|e| e.at(format!("[{n}]")))?;
            n += 1;
        }
        Ok(self.header.end(open, n)?)
    }

    fn tensor(&mut self, torch: &Torch, t: &Bound<'py, PyAny>) -> EncodeResult<()> {
        let py = self.py;
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let Some(&index) = torch.by_object.get(&(dtype.as_ptr() as usize)) else {
            return Err(EncodeError::unsupported(format!(
                "unsupported tensor dtype {dtype}"
            )));
        };
        let dt = &torch.dtypes[index];
        let layout = t.getattr(intern!(py, "layout"))?;
        if layout.as_ptr() != torch.strided.as_ptr() {
            return Err(EncodeError::unsupported(format!(
                "unsupported tensor layout {layout} (only strided tensors have plain bytes)"
            )));
        }
        // A tensor whose bytes are not its values as they stand (another device, a lazy
        // conjugate or negation, a strided view) is materialised first.
        let in_place = t.getattr(intern!(py, "is_cpu"))?.is_truthy()?
            && t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()?
            && !t.call_method0(intern!(py, "is_neg"))?.is_truthy()?
            && !(dt.complex && t.call_method0(intern!(py, "is_conj"))?.is_truthy()?);
        let t = if in_place {
            t.clone()
        } else {
            t.call_method0(intern!(py, "detach"))?
                .call_method0(intern!(py, "cpu"))?
                .call_method0(intern!(py, "resolve_conj"))?
                .call_method0(intern!(py, "resolve_neg"))?
                .call_method0(intern!(py, "contiguous"))?
        };
        let shape = dims(&t.getattr(intern!(py, "shape"))?)?;
        let nbytes = shape
            .iter()
            .try_fold(dt.itemsize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| EncodeError::unsupported("tensor too large".into()))?;
        let ptr = t
            .call_method0(intern!(py, "data_ptr"))?
            .extract::<usize>()? as *const u8;
        self.header.tensor(dt.name, &shape, nbytes)?;
        self.parts.push(Part::Tensor {
            tensor: t,
            ptr,
            len: nbytes as usize,
        });
        Ok(())
    }

    fn array(&mut self, a: &Bound<'py, PyAny>) -> EncodeResult<()> {
        let py = self.py;
        if !a.is_exact_instance(self.numpy.ndarray.bind(py).as_any()) {
            static MASKED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
            if a.is_instance(MASKED.import(py, "numpy.ma", "MaskedArray")?.as_any())? {
                return Err(EncodeError::unsupported(
                    "unsupported array (MaskedArray: its mask would be lost)".into(),
                ));
            }
        }
        let dtype = a.getattr(intern!(py, "dtype"))?;
        let descr = array_descr(&dtype)?.map_err(EncodeError::unsupported)?;
        // PyBUF_SIMPLE asks for C-contiguous bytes: anything else is made contiguous first.
        let buffer = match SimpleBuffer::get(a, false) {
            Ok(b) => b,
            Err(_) => {
                let c = self.numpy.ascontiguousarray.bind(py).call1((a,))?;
                SimpleBuffer::get(&c, false)?
            }
        };
        let shape = dims(&a.getattr(intern!(py, "shape"))?)?;
        self.header.array(&descr, &shape, buffer.len() as u64)?;
        self.parts.push(Part::Buffer(buffer));
        Ok(())
    }

    fn scalar(&mut self, v: &Bound<'py, PyAny>) -> EncodeResult<()> {
        let py = self.py;
        let dtype = v.getattr(intern!(py, "dtype"))?;
        let descr = array_descr(&dtype)?.map_err(EncodeError::unsupported)?;
        let raw = v.call_method0(intern!(py, "tobytes"))?;
        self.header.scalar(
            &descr,
            raw.cast::<PyBytes>().map_err(PyErr::from)?.as_bytes(),
        )?;
        Ok(())
    }
}

/// A read-only view of one part of an encoded item (a tensor's, array's or `bytes` value's
/// bytes, in place), keeping the object that holds them alive.
#[pyclass(frozen, module = "mmcache._core")]
pub struct PartView {
    _source: PartSource,
    ptr: usize,
    len: usize,
}

/// What holds a part's bytes: the tensor, or the array's open buffer export.
enum PartSource {
    Object { _obj: Py<PyAny> },
    Buffer { _buffer: SimpleBuffer },
}

#[pymethods]
impl PartView {
    fn __len__(&self) -> usize {
        self.len
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().ptr as *const u8, slf.get().len);
        // SAFETY: forwarded from this method's contract (a Py_buffer to fill); the bytes
        // belong to `source`, which lives as long as `slf`, which the view references.
        unsafe { export_read_only_bytes(slf.into_any(), view, flags, ptr, len) }
    }
}

/// `serde.encode`: an item as `(part 0, [part 1, ...])`, each part a read-only memoryview
/// of the item's own memory.
#[pyfunction]
pub(super) fn encode_item<'py>(
    py: Python<'py>,
    item: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>)> {
    let encoded = Encoded::new(item)?;
    let views = PyList::empty(py);
    for part in encoded.parts {
        let (ptr, len) = part.raw();
        let source = match part {
            Part::Bytes(b) => {
                views.append(PyMemoryView::from(b.as_any())?)?;
                continue;
            }
            Part::Buffer(b) => PartSource::Buffer { _buffer: b },
            Part::Tensor { tensor, .. } => PartSource::Object {
                _obj: tensor.unbind(),
            },
        };
        let view = Bound::new(
            py,
            PartView {
                _source: source,
                ptr: ptr as usize,
                len,
            },
        )?;
        views.append(PyMemoryView::from(view.as_any())?)?;
    }
    Ok((PyBytes::new(py, &encoded.header), views))
}

/// `ShmObjectStore.put_item`: encode `item` and write it under `key` in one pass.
pub(super) fn put_item(
    store: &ShmObjectStore,
    py: Python<'_>,
    key: &str,
    item: &Bound<'_, PyAny>,
) -> PyResult<ShmHandle> {
    let writer = store.writer("put_item")?;
    let encoded = Encoded::new(item)?;
    put_parts(py, &writer, key, &encoded.parts())
}

// ---------------------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------------------

/// Where a payload's bytes are.
enum Source {
    /// Read through the store: a leased chunk, or a private verified copy.
    Store(Arc<ViewBytes>),
    /// A caller's buffer, held open by the caller for the whole decode.
    Buffer { ptr: *const u8, len: usize },
}

// SAFETY: `Buffer`'s memory stays exported (and so valid) while the decode that owns the
// source runs, on whatever thread it copies from; it is only read, through raw copies.
unsafe impl Send for Source {}
// SAFETY: as for `Send`.
unsafe impl Sync for Source {}

impl Source {
    fn len(&self) -> usize {
        match self {
            Source::Store(bytes) => match &**bytes {
                ViewBytes::Shared(view) => view.len(),
                ViewBytes::Owned(v) => v.len(),
            },
            Source::Buffer { len, .. } => *len,
        }
    }

    /// The address of byte `offset` (inside the payload), for zero-copy values.
    fn address(&self, offset: u64) -> *mut u8 {
        let base = match self {
            Source::Store(bytes) => match &**bytes {
                ViewBytes::Shared(view) => view.ptr(),
                ViewBytes::Owned(v) => v.as_ptr(),
            },
            Source::Buffer { ptr, .. } => *ptr,
        };
        base.wrapping_add(offset as usize).cast_mut()
    }

    /// Copy `dst.len()` bytes starting `offset` bytes into the payload.
    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> PyResult<()> {
        let start = offset as usize;
        if start
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len())
        {
            return Err(FormatError("a part lies outside the payload".into()).into());
        }
        match self {
            Source::Store(bytes) => match &**bytes {
                ViewBytes::Shared(view) => view.read_at(offset, dst)?,
                ViewBytes::Owned(v) => dst.copy_from_slice(&v[start..start + dst.len()]),
            },
            // SAFETY: the range is inside the caller's exported buffer (checked above), which
            // stays exported during the decode; `dst` is our own, distinct memory. A raw copy
            // forms no reference to bytes another process may be writing.
            Source::Buffer { ptr, .. } => unsafe {
                std::ptr::copy_nonoverlapping(ptr.add(start), dst.as_mut_ptr(), dst.len())
            },
        }
        Ok(())
    }
}

/// Destination memory of one copy: freshly allocated by us, not yet visible to anyone.
struct CopyJob {
    offset: u64,
    dst: *mut u8,
    len: usize,
}

// SAFETY: `dst` is memory we allocated for this decode and nothing else writes or reads
// before the decode returns.
unsafe impl Send for CopyJob {}

struct Decoder<'a, 'py> {
    py: Python<'py>,
    source: &'a Source,
    /// What the payload's zero-copy values keep alive, and numpy's buffer for them.
    exporter: Exporter<'py>,
    parts: &'a [(u64, u64)],
    copy: bool,
    /// Copies of tensors land in this one torch allocation, at `arena_cursor`.
    arena: Option<(Bound<'py, PyAny>, *mut u8)>,
    arena_cursor: u64,
    jobs: Vec<CopyJob>,
    /// Array copies' buffers, written by the jobs, released at the end.
    buffers: Vec<SimpleBuffer>,
}

/// The object numpy views a zero-copy payload through (and tensors keep alive).
enum Exporter<'py> {
    Store(Option<Bound<'py, ShmView>>, Arc<ViewBytes>),
    Object(Bound<'py, PyAny>),
}

impl<'py> Exporter<'py> {
    fn owner(&self) -> Owner {
        match self {
            Exporter::Store(_, bytes) => Owner::Store {
                _bytes: Arc::clone(bytes),
            },
            Exporter::Object(obj) => Owner::Object {
                obj: obj.clone().unbind(),
            },
        }
    }

    fn buffer(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Exporter::Store(view, bytes) => match view {
                Some(v) => v.clone().into_any(),
                None => {
                    let v = Bound::new(
                        py,
                        ShmView {
                            bytes: Arc::clone(bytes),
                        },
                    )?;
                    *view = Some(v.clone());
                    v.into_any()
                }
            },
            Exporter::Object(obj) => obj.clone(),
        })
    }
}

fn corrupt(msg: String) -> PyErr {
    FormatError(msg).into()
}

/// numpy or torch refused to build a value from what the header says: the header is bad
/// (a genuine allocation failure stays a `MemoryError`).
fn refused(py: Python<'_>, what: &str, err: PyErr) -> PyErr {
    if err.is_instance_of::<PyMemoryError>(py) {
        return err;
    }
    let out = corrupt(format!("{what}: {}", err.value(py)));
    out.set_cause(py, Some(err));
    out
}

/// The item in a payload.
fn decode<'py>(
    py: Python<'py>,
    source: &Source,
    exporter: Exporter<'py>,
    copy: bool,
    pin_memory: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let len = source.len();
    let mut prefix = [0u8; PREFIX_LEN];
    if len < PREFIX_LEN {
        return Err(corrupt(format!("{len} bytes cannot hold a header")));
    }
    source.copy_out(0, &mut prefix)?;
    let hlen = header_len(&prefix)?;
    if hlen > len {
        return Err(corrupt(
            "the header runs past the end of the payload".into(),
        ));
    }
    let mut header_bytes = vec![0u8; hlen];
    source.copy_out(0, &mut header_bytes)?;
    let header = Header::parse(&header_bytes, len as u64)?;
    // Copies of tensors share one allocation: its size (each at an aligned offset).
    let mut tensors = 0usize;
    let mut tensor_bytes = 0u64;
    header.walk(|node| {
        if let Node::Tensor { part, .. } = node {
            tensors += 1;
            tensor_bytes = align_up(header.parts[*part].1)
                .and_then(|n| n.checked_add(tensor_bytes))
                .ok_or_else(|| FormatError("the tensors' sizes overflow".into()))?;
        }
        Ok(())
    })?;
    let mut decoder = Decoder {
        py,
        source,
        exporter,
        parts: &header.parts,
        copy,
        arena: None,
        arena_cursor: 0,
        jobs: Vec::new(),
        buffers: Vec::new(),
    };
    if copy && tensors > 0 {
        let torch = torch(py)?;
        // Never empty, so even zero-byte tensors point into memory that is theirs.
        let size = (tensor_bytes.max(crate::layout::ALIGN),);
        let arena = if pin_memory {
            torch
                .empty
                .bind(py)
                .call(size, Some(torch.pinned_kwargs.bind(py)))?
        } else {
            torch.storage.bind(py).call1(size)?
        };
        let ptr = arena
            .call_method0(intern!(py, "data_ptr"))?
            .extract::<usize>()? as *mut u8;
        decoder.arena = Some((arena, ptr));
    }
    let mut tree = header.tree();
    let root = decoder.value(&mut tree)?;
    decoder.run_copies()?;
    Ok(root.cast_into()?)
}

impl<'py> Decoder<'_, 'py> {
    fn value(&mut self, r: &mut TreeReader<'_>) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        Ok(match r.node()? {
            Node::None => py.None().into_bound(py),
            Node::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
            Node::Int(i) => i.into_pyobject(py)?.into_any(),
            Node::UInt(u) => u.into_pyobject(py)?.into_any(),
            Node::Float(f) => PyFloat::new(py, f).into_any(),
            Node::Str(s) => PyString::new(py, s).into_any(),
            Node::Bytes(b) => PyBytes::new(py, b).into_any(),
            Node::BytesPart(p) => self.bytes(p)?.into_any(),
            Node::List(n) => {
                let list = PyList::empty(py);
                for _ in 0..n {
                    list.append(self.value(r)?)?;
                }
                list.into_any()
            }
            Node::Tuple(n) => {
                let items = (0..n)
                    .map(|_| self.value(r))
                    .collect::<PyResult<Vec<_>>>()?;
                PyTuple::new(py, items)?.into_any()
            }
            Node::Dict(n) => {
                let dict = PyDict::new(py);
                for _ in 0..n {
                    let key = PyString::new(py, r.key()?);
                    dict.set_item(key, self.value(r)?)?;
                }
                dict.into_any()
            }
            Node::Tensor { dtype, shape, part } => self.tensor(dtype, shape, part)?,
            Node::Array { descr, shape, part } => self.array(descr, shape, part)?,
            Node::Scalar { descr, raw } => {
                let (dtype, itemsize) = array_dtype(py, descr)?;
                if raw.len() as u64 != itemsize {
                    return Err(corrupt(format!("a {descr} scalar of {} bytes", raw.len())));
                }
                numpy(py)?
                    .frombuffer
                    .bind(py)
                    .call1((PyBytes::new(py, raw), dtype))
                    .and_then(|a| a.get_item(0))
                    .map_err(|e| refused(py, "a scalar", e))?
            }
        })
    }

    /// Part `p`'s offset and length, checked to be `numel * itemsize` bytes.
    fn sized_part(
        &self,
        p: usize,
        shape: Shape<'_>,
        itemsize: u64,
        what: &str,
    ) -> PyResult<(u64, u64)> {
        let (offset, len) = self.parts[p];
        if shape.numel().and_then(|n| n.checked_mul(itemsize)) != Some(len) {
            return Err(corrupt(format!(
                "a {what} of shape {:?} does not fill its {len}-byte part",
                shape.dims().collect::<Vec<_>>()
            )));
        }
        Ok((offset, len))
    }

    fn bytes(&mut self, p: usize) -> PyResult<Bound<'py, PyBytes>> {
        let (offset, len) = self.parts[p];
        let source = self.source;
        PyBytes::new_with(self.py, len as usize, |dst| {
            if dst.len() >= DETACH_THRESHOLD {
                self.py.detach(|| source.copy_out(offset, dst))
            } else {
                source.copy_out(offset, dst)
            }
        })
    }

    fn tensor(&mut self, name: &str, shape: Shape<'_>, p: usize) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let torch = torch(py)?;
        let dtype = torch
            .by_name
            .get(name)
            .map(|&i| &torch.dtypes[i])
            .ok_or_else(|| corrupt(format!("unknown torch dtype {name:?}")))?;
        let (offset, len) = self.sized_part(p, shape, dtype.itemsize, "tensor")?;
        let (data, owner) = match &self.arena {
            Some((arena, base)) if self.copy => {
                let data = base.wrapping_add(self.arena_cursor as usize);
                self.jobs.push(CopyJob {
                    offset,
                    dst: data,
                    len: len as usize,
                });
                self.arena_cursor += align_up(len).expect("sized by walk");
                let obj = arena.clone().unbind();
                (data, Owner::Object { obj })
            }
            _ => (self.source.address(offset), self.exporter.owner()),
        };
        dlpack_tensor(py, torch, dtype, shape, data, len, owner)
            .map_err(|e| refused(py, "a tensor", e))
    }

    fn array(&mut self, descr: &str, shape: Shape<'_>, p: usize) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let (dtype, itemsize) = array_dtype(py, descr)?;
        let (offset, len) = self.sized_part(p, shape, itemsize, "array")?;
        let dims = PyTuple::new(py, shape.dims())?;
        let numpy = numpy(py)?;
        if self.copy {
            let array = numpy
                .empty
                .bind(py)
                .call1((dims, dtype))
                .map_err(|e| refused(py, "an array", e))?;
            if len > 0 {
                let buffer = SimpleBuffer::get(&array, true)?;
                if buffer.len() as u64 != len {
                    return Err(corrupt(format!(
                        "an array of {} bytes, not {len}",
                        buffer.len()
                    )));
                }
                self.jobs.push(CopyJob {
                    offset,
                    dst: buffer.ptr(),
                    len: buffer.len(),
                });
                self.buffers.push(buffer);
            }
            return Ok(array);
        }
        let buffer = self.exporter.buffer(py)?;
        numpy
            .ndarray
            .bind(py)
            .call1((dims, dtype, buffer, offset))
            .map_err(|e| refused(py, "an array", e))
    }

    /// Fill every copy destination, with the GIL released when there is much to copy.
    fn run_copies(&mut self) -> PyResult<()> {
        let jobs = std::mem::take(&mut self.jobs);
        let total: usize = jobs.iter().map(|j| j.len).sum();
        let source = self.source;
        let run = move || {
            jobs.iter().try_for_each(|job| {
                // SAFETY: `dst` is `len` bytes of memory allocated for this decode (the
                // tensors' arena or a fresh array), exclusively ours until we return.
                let dst = unsafe { std::slice::from_raw_parts_mut(job.dst, job.len) };
                source.copy_out(job.offset, dst)
            })
        };
        if total >= DETACH_THRESHOLD {
            self.py.detach(run)?;
        } else {
            run()?;
        }
        self.buffers.clear();
        Ok(())
    }
}

/// `serde.decode`: the item in a payload (any object with the buffer protocol).
#[pyfunction]
#[pyo3(signature = (payload, *, copy = true))]
pub(super) fn decode_item<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
    copy: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let buffer = SimpleBuffer::get(payload, false)?;
    let source = Source::Buffer {
        ptr: buffer.ptr(),
        len: buffer.len(),
    };
    // Views hold a memoryview: its export keeps the payload from being resized or freed.
    let exporter = if copy {
        payload.clone()
    } else {
        PyMemoryView::from(payload)?.into_any()
    };
    let item = decode(py, &source, Exporter::Object(exporter), copy, false);
    drop(buffer);
    item
}

/// `ShmObjectStore.get_item`: resolve a handle straight into the item.
pub(super) fn get_item<'py>(
    store: &ShmObjectStore,
    py: Python<'py>,
    handle: &ShmHandle,
    key: &str,
    copy: bool,
    pin_memory: bool,
) -> PyResult<Bound<'py, PyDict>> {
    if pin_memory && !copy {
        return Err(PyValueError::new_err(
            "pin_memory=True pins copies (copy=True); zero-copy views are pinned by registering \
             the reader's mapping with CUDA (ShmReceiverCache(handle, copy=False, \
             pin_memory=True))",
        ));
    }
    let h = handle.to_handle()?;
    let bytes = match store.role()? {
        Role::Writer(w) => ViewBytes::Owned(w.read(&h, key)?),
        Role::Reader(r) => match r.acquire(&h, key)?.into_view() {
            Ok(view) => ViewBytes::Shared(view),
            // A replayed handle holds no lease: read a verified private copy.
            Err(lease) => {
                let mut owned = vec![0u8; lease.len()];
                lease.copy_to(&mut owned)?;
                ViewBytes::Owned(owned)
            }
        },
    };
    let bytes = Arc::new(bytes);
    let source = Source::Store(Arc::clone(&bytes));
    decode(py, &source, Exporter::Store(None, bytes), copy, pin_memory)
}

/// Add the codec's functions, class and constants to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("OUT_OF_BAND_BYTES", OUT_OF_BAND_BYTES)?;
    m.add("PAYLOAD_FORMAT_VERSION", crate::codec::FORMAT_VERSION)?;
    m.add_class::<PartView>()?;
    m.add_function(wrap_pyfunction!(encode_item, m)?)?;
    m.add_function(wrap_pyfunction!(decode_item, m)?)?;
    Ok(())
}
