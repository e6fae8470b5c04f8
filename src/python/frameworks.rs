//! numpy and torch, looked up once per process: the functions and types the codec calls,
//! the table of torch dtypes an item may hold (with the DLPack type each travels as), and
//! bounded caches of numpy dtypes by descriptor.

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use super::dlpack::{
    DL_BFLOAT, DL_BOOL, DL_COMPLEX, DL_FLOAT, DL_FLOAT4_E2M1FN, DL_FLOAT8_E4M3FN,
    DL_FLOAT8_E4M3FNUZ, DL_FLOAT8_E5M2, DL_FLOAT8_E5M2FNUZ, DL_FLOAT8_E8M0FNU, DL_INT, DL_UINT,
    DlType,
};
use crate::codec::FormatError;

/// The parts of numpy the codec calls.
pub(super) struct Numpy {
    pub(super) ndarray: Py<PyType>,
    pub(super) generic: Py<PyType>,
    dtype: Py<PyAny>,
    pub(super) empty: Py<PyAny>,
    pub(super) frombuffer: Py<PyAny>,
    pub(super) ascontiguousarray: Py<PyAny>,
    pub(super) str_: Py<PyAny>,
    pub(super) bytes_: Py<PyAny>,
}

static NUMPY: PyOnceLock<Numpy> = PyOnceLock::new();

pub(super) fn numpy(py: Python<'_>) -> PyResult<&'static Numpy> {
    NUMPY.get_or_try_init(py, || {
        let np = py.import("numpy")?;
        Ok(Numpy {
            ndarray: np.getattr("ndarray")?.cast_into()?.unbind(),
            generic: np.getattr("generic")?.cast_into()?.unbind(),
            dtype: np.getattr("dtype")?.unbind(),
            empty: np.getattr("empty")?.unbind(),
            frombuffer: np.getattr("frombuffer")?.unbind(),
            ascontiguousarray: np.getattr("ascontiguousarray")?.unbind(),
            str_: np.getattr("str_")?.unbind(),
            bytes_: np.getattr("bytes_")?.unbind(),
        })
    })
}

/// Entries kept in each of the dtype caches below (descriptors come from payloads, so the
/// caches are bounded; a miss only costs a Python call).
const DTYPE_CACHE_ENTRIES: usize = 256;

/// numpy dtype objects (held, so their addresses stay theirs) to their descriptor.
static ARRAY_DESCRS: Mutex<Vec<(Py<PyAny>, String)>> = Mutex::new(Vec::new());
/// A descriptor to the dtype object and its item size, for decoding.
static ARRAY_DTYPES: Mutex<Option<DtypesByDescr>> = Mutex::new(None);
type DtypesByDescr = HashMap<String, (Py<PyAny>, u64)>;

/// Why a numpy dtype cannot travel as raw bytes, if it cannot: what it is, and what to pass
/// instead (for the encoder's refusal; the decoder names only what a descriptor is).
struct DtypeProblem {
    what: String,
    instead: String,
}

fn array_dtype_problem(dtype: &Bound<'_, PyAny>) -> PyResult<Option<DtypeProblem>> {
    let py = dtype.py();
    let problem = |what: &str, instead: String| {
        Some(DtypeProblem {
            what: what.into(),
            instead,
        })
    };
    // StringDType says it holds objects (its strings need the Python API), but holds none:
    // its strings lie in an arena outside the array's buffer.
    Ok(if dtype.getattr(intern!(py, "kind"))?.eq("T")? {
        problem(
            "keeps its strings outside the array (numpy's variable-width strings: no other \
             process can read them)",
            "convert it to a fixed-width str dtype (.astype('U'))".into(),
        )
    } else if dtype.getattr(intern!(py, "hasobject"))?.is_truthy()? {
        problem(
            "holds references to Python objects (no other process can read them)",
            "pass the values themselves (a list), or an array of a numeric or fixed-width \
             str dtype"
                .into(),
        )
    } else if !dtype.getattr(intern!(py, "fields"))?.is_none() {
        let names = dtype.getattr(intern!(py, "names"))?;
        let names = names
            .try_iter()?
            .map(|name| Ok(name?.repr()?.to_string()))
            .collect::<PyResult<Vec<String>>>()?;
        Some(DtypeProblem {
            what: format!(
                "is a structured dtype (records of the field{} {}), a layout items do not carry",
                if names.len() == 1 { "" } else { "s" },
                names.join(", ")
            ),
            instead: format!(
                "pass each field as an array of its own (x[{}])",
                names.first().map_or("name", String::as_str)
            ),
        })
    } else if let Ok((_, shape)) = dtype
        .getattr(intern!(py, "subdtype"))?
        .extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()
    {
        Some(DtypeProblem {
            what: format!("is a sub-array dtype (each element an array of shape {shape})"),
            instead: "pass one array with the sub-array's shape as its last dimensions".into(),
        })
    } else {
        None
    })
}

/// The descriptor of `dtype` that reads back as its own scalar type: `descr` (its
/// `dtype.str`, which reads back as `named`), or where numpy gives two scalar types one
/// `dtype.str` (on LP64, longlong and int64 are both "<i8", which reads back as int64) its
/// byte order and character code ("<q").
fn same_type_descr(
    np_dtype: &Bound<'_, PyAny>,
    dtype: &Bound<'_, PyAny>,
    named: &Bound<'_, PyAny>,
    descr: String,
) -> PyResult<String> {
    let py = dtype.py();
    let scalar_type = dtype.getattr(intern!(py, "type"))?;
    if named.getattr(intern!(py, "type"))?.is(&scalar_type) {
        return Ok(descr);
    }
    let code: String = dtype.getattr(intern!(py, "char"))?.extract()?;
    let by_code = format!("{}{code}", descr.get(..1).unwrap_or_default());
    Ok(match np_dtype.call1((&by_code,)) {
        Ok(d) if d.getattr(intern!(py, "type"))?.is(&scalar_type) && d.eq(dtype)? => by_code,
        _ => descr,
    })
}

/// An array dtype's descriptor (`dtype.str`, or what [`same_type_descr`] makes of it), or
/// why it is refused (`what`: the value of
/// that dtype, "an array" or "a numpy scalar").
pub(super) fn array_descr(
    dtype: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<Result<String, String>> {
    // Never call Python while holding a cache lock (the callee may release the GIL).
    let cached = lock(&ARRAY_DESCRS)
        .iter()
        .find(|(d, _)| d.as_ptr() == dtype.as_ptr())
        .map(|(_, s)| s.clone());
    if let Some(descr) = cached {
        return Ok(Ok(descr));
    }
    if let Some(problem) = array_dtype_problem(dtype)? {
        return Ok(Err(format!(
            "{what} of dtype {dtype}, which {}: {}",
            problem.what, problem.instead
        )));
    }
    let py = dtype.py();
    let mut descr: String = dtype.getattr(intern!(py, "str"))?.extract()?;
    let np_dtype = numpy(py)?.dtype.bind(py);
    // A user-defined dtype (ml_dtypes' bfloat16, numpy's test dtype `rational`) has a void
    // descriptor ("<V8"): it would decode as raw void records, another dtype; or one numpy
    // cannot read at all (ml_dtypes' float8_e5m2 says "<f1").
    let named = match np_dtype.call1((&descr,)) {
        Ok(named) if named.eq(dtype).unwrap_or(false) => {
            descr = same_type_descr(np_dtype, dtype, &named, descr)?;
            None
        }
        Ok(named) => Some(format!(
            "names another dtype ({named}), so it would come back as that"
        )),
        Err(_) => Some("names no dtype numpy reads, so it could not be read back".into()),
    };
    if let Some(named) = named {
        return Ok(Err(format!(
            "{what} of dtype {dtype}, which is not one of numpy's own (a user-defined dtype): \
             its descriptor '{descr}' {named}; convert it to one of numpy's dtypes, or pass a \
             torch tensor"
        )));
    }
    let mut cache = lock(&ARRAY_DESCRS);
    if cache.len() < DTYPE_CACHE_ENTRIES {
        cache.push((dtype.clone().unbind(), descr.clone()));
    }
    Ok(Ok(descr))
}

/// The numpy dtype of a stored descriptor and its item size.
pub(super) fn array_dtype<'py>(py: Python<'py>, descr: &str) -> PyResult<(Bound<'py, PyAny>, u64)> {
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
        return Err(corrupt(problem.what).into());
    }
    let itemsize: u64 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
    // numpy makes an `S0` or `U0` array one byte or character wide: a hostile header could
    // have it allocate its shape's worth of uninitialised memory for a part of no bytes.
    // (`V0` arrays exist, and hold nothing.)
    if itemsize == 0 && dtype.getattr(intern!(py, "kind"))?.ne("V")? {
        return Err(corrupt("has items of no size".into()).into());
    }
    let mut cache = lock(&ARRAY_DTYPES);
    let map = cache.get_or_insert_with(HashMap::new);
    if map.len() < DTYPE_CACHE_ENTRIES {
        map.insert(descr.to_owned(), (dtype.clone().unbind(), itemsize));
    }
    Ok((dtype, itemsize))
}

/// A cache's lock (a panic while holding one leaves the cache usable).
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every torch dtype an item may hold, by torch's name, with the DLPack type torch exports
/// it as and imports back as the same dtype. Dtypes without one (sub-byte integers, bit
/// types, bcomplex32) travel as bytes and are re-viewed on decode. Names the running torch lacks are
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
    ("bcomplex32", None),
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

/// One torch dtype of the table, as the running torch has it.
pub(super) struct TorchDtype {
    pub(super) name: &'static str,
    pub(super) obj: Py<PyAny>,
    pub(super) itemsize: u64,
    pub(super) complex: bool,
    /// The DLPack type torch exports it as and imports back as this dtype, if any.
    pub(super) dlpack: Option<DlType>,
}

/// The parts of torch the codec calls.
pub(super) struct Torch {
    pub(super) tensor: Py<PyType>,
    pub(super) strided: Py<PyAny>,
    from_dlpack: Py<PyAny>,
    /// `from_dlpack`'s C function and the object it is bound to, when it is a one-argument
    /// builtin (`torch._C._from_dlpack` is): called directly, without the one-tuple every
    /// call through the object builds (the stable ABI of 3.11 has no vectorcall).
    from_dlpack_c: Option<(ffi::PyCFunction, Py<PyAny>)>,
    /// `torch.UntypedStorage`: the type of every tensor's storage whose bytes the encoder
    /// reads.
    pub(super) storage: Py<PyAny>,
    /// `torch.device("cpu")`: a storage's device equal to it is on the CPU without reading
    /// the device's `type`, which builds a new `str` each time.
    pub(super) cpu: Py<PyAny>,
    pub(super) empty: Py<PyAny>,
    /// `torch.empty` keyword arguments for a pinned byte buffer.
    pub(super) pinned_kwargs: Py<PyDict>,
    pub(super) dtypes: Vec<TorchDtype>,
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
    // The C function behind `torch.from_dlpack`, which only adds a Python frame of checks
    // for objects with `__dlpack__` (a fifth of the cost of a small tensor).
    let from_dlpack = match torch.getattr("_C")?.getattr("_from_dlpack") {
        Ok(f) => f,
        Err(_) => torch.getattr("from_dlpack")?,
    };
    let pinned_kwargs = PyDict::new(py);
    pinned_kwargs.set_item("dtype", torch.getattr("uint8")?)?;
    pinned_kwargs.set_item("pin_memory", true)?;
    Ok(Torch {
        tensor: torch.getattr("Tensor")?.cast_into()?.unbind(),
        strided: torch.getattr("strided")?.unbind(),
        from_dlpack_c: one_argument_builtin(&from_dlpack),
        from_dlpack: from_dlpack.unbind(),
        storage: torch.getattr("UntypedStorage")?.unbind(),
        cpu: torch.getattr("device")?.call1(("cpu",))?.unbind(),
        empty: torch.getattr("empty")?.unbind(),
        pinned_kwargs: pinned_kwargs.unbind(),
        dtypes,
    })
}

/// A builtin function of one argument (`METH_O`): its C function and its bound object.
fn one_argument_builtin(f: &Bound<'_, PyAny>) -> Option<(ffi::PyCFunction, Py<PyAny>)> {
    // SAFETY: `f` is a live object, checked to be a builtin function before the accessors
    // read its method definition and bound object (a borrowed reference, taken as our own).
    unsafe {
        if ffi::PyCFunction_Check(f.as_ptr()) == 0
            || ffi::PyCFunction_GetFlags(f.as_ptr()) != ffi::METH_O
        {
            return None;
        }
        let function = ffi::PyCFunction_GetFunction(f.as_ptr())?;
        let bound = Bound::from_borrowed_ptr_or_opt(f.py(), ffi::PyCFunction_GetSelf(f.as_ptr()))?;
        Some((function, bound.unbind()))
    }
}

impl Torch {
    /// The tensor a DLPack capsule holds, without a copy (torch consumes the capsule).
    pub(super) fn import_dlpack<'py>(
        &self,
        capsule: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = capsule.py();
        match &self.from_dlpack_c {
            // SAFETY: a `METH_O` builtin's C function, called as CPython calls it: the GIL
            // held, its bound object (alive: we hold it) and one borrowed argument (alive:
            // `capsule`); it returns a new reference, or null with an exception set.
            Some((function, bound)) => unsafe {
                Bound::from_owned_ptr_or_err(py, function(bound.as_ptr(), capsule.as_ptr()))
            },
            None => self.from_dlpack.bind(py).call1((capsule,)),
        }
    }

    /// The table's entry of a torch dtype object, if it has one: the common dtypes come
    /// first, so a scan of the addresses finds them sooner than a hash would.
    pub(super) fn dtype_of(&self, dtype: &Bound<'_, PyAny>) -> Option<&TorchDtype> {
        self.dtypes
            .iter()
            .find(|d| d.obj.as_ptr() == dtype.as_ptr())
    }

    /// The table's entry of a dtype by its name in a payload: a scan too, for the same reason.
    pub(super) fn dtype_named(&self, name: &str) -> Option<&TorchDtype> {
        self.dtypes.iter().find(|d| d.name == name)
    }
}

/// torch, importing it (decoding a tensor needs it).
pub(super) fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    TORCH.get_or_try_init(py, || load_torch(&py.import("torch")?))
}

/// torch if the process has imported it: a value can only be a tensor then, and encoding
/// never imports torch itself.
pub(super) fn torch_if_loaded(py: Python<'_>) -> PyResult<Option<&'static Torch>> {
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
