//! Encoding an item (a mapping of tensors, arrays and small values) in one native pass.
//!
//! Small values go into the header (`crate::codec::HeaderBuilder`); every tensor, array and
//! long `bytes` value becomes a part, read in place and held by a [`Keeper`] until the store
//! has copied it into the ring's chunk (`ShmWriter.put_item`), `pack_item` into its payload,
//! or the caller has dropped its views (`encode_item`, for `serde.encode`) — no intermediate
//! buffer. An array's bytes are read through a buffer export (numpy refuses to resize an
//! exported array); a `bytes` value is immutable.
//!
//! A tensor's bytes are read from its storage, never through `data_ptr()`, which a subclass
//! can make anything (the `_make_wrapper_subclass` tensors of DTensor, FakeTensor or torchao
//! say 0): the encoder takes the tensor's `untyped_storage()`, refuses one without memory of
//! its own (not a plain CPU storage, or `data_ptr()` refused or null), proves the tensor's
//! bytes lie inside it (`storage_offset() * itemsize + nbytes <= storage.nbytes()`, both read
//! once the walk is over, below), and holds the storage — not the tensor — until the copy is
//! done, so a tensor re-pointed with `set_()` or dropped meanwhile leaves the bytes alive.
//!
//! Holding a storage does not pin its memory: `UntypedStorage.resize_()` and
//! `share_memory_()` give the same storage new memory and free the old one at once, and a
//! storage's memory is uniquely owned (torch offers no reference to it from Python). Both run
//! holding the GIL (torch/csrc/StorageMethods.cpp, StorageSharing.cpp), so the encoder reads
//! each storage's address and size last, once the walk is over (no Python code runs between
//! those reads and the copy: the references the walk took, such as the keys on a tensor's
//! path, whose `__del__` is Python code, are released only with the encoding, after the copy;
//! a mapping or list is walked as a copy, since its values' code may change it), and copies
//! out of torch storages keep the GIL ([`Encoded::copying`]); a refusal found then still names
//! its field (each tensor's part keeps the path the walk took to it). A resize inside one of
//! torch's own kernels, which run with the GIL released (`Tensor.resize_`), races with every
//! reader of that tensor, torch's own included.

use std::collections::HashSet;

use pyo3::exceptions::{PyException, PyMemoryError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::marker::Ungil;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PySequence, PyString, PyTuple,
    PyType,
};

use super::buffer::{Keeper, PartView, SimpleBuffer, copying, new_bytes};
use super::frameworks::{Numpy, Torch, array_descr, numpy, torch_if_loaded};
use crate::codec::{Container, FormatError, HeaderBuilder, MAX_DEPTH};
use crate::segment::RawBytes;

const ITEM_NOT_ENCODABLE_DOC: &str = "An item the codec cannot hold: a value of a type it does \
not carry, or one past a limit of the format (containers nested deeper than 64, more than 64 \
dimensions, an int outside 64 bits, a str, bytes or key over 4 GiB), or a tensor without \
memory of its own. The message names the field. A TypeError and a ValueError.";

static ITEM_NOT_ENCODABLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `ItemNotEncodableError`: both a `TypeError` (what unsupported values always raised) and a
/// `ValueError` (what the format's limits raised), so one class catches every refusal and
/// callers that caught either before still do.
pub(super) fn item_not_encodable(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    ITEM_NOT_ENCODABLE
        .get_or_try_init(py, || {
            let bases = (py.get_type::<PyTypeError>(), py.get_type::<PyValueError>());
            let namespace = PyDict::new(py);
            namespace.set_item("__module__", "mmcache._core")?;
            namespace.set_item("__doc__", ITEM_NOT_ENCODABLE_DOC)?;
            let class =
                py.get_type::<PyType>()
                    .call1(("ItemNotEncodableError", bases, namespace))?;
            Ok(class.cast_into::<PyType>()?.unbind())
        })
        .map(|class| class.bind(py))
}

/// Why encoding failed.
enum EncodeError {
    /// The item holds what the format cannot (the message says what).
    Refused(String),
    /// A Python call raised while reading the item.
    Raised(PyErr),
}

/// One step of the path from the item to a field: a mapping's key or a sequence's index.
#[derive(Clone)]
enum Step<'py> {
    Key(Bound<'py, PyAny>),
    Index(usize),
}

impl EncodeError {
    fn refused(msg: String) -> Self {
        EncodeError::Refused(msg)
    }

    /// The Python error: an `ItemNotEncodableError` naming the field `path` leads to
    /// (`item['pixels'][1]`), caused by what Python raised, if anything. Running out of
    /// memory and interrupts are not about the item: they propagate as they are.
    fn into_pyerr(self, py: Python<'_>, path: &[Step<'_>]) -> PyErr {
        let path: String = path
            .iter()
            .map(|step| match step {
                Step::Key(key) => key_segment(key),
                Step::Index(n) => format!("[{n}]"),
            })
            .collect();
        let (msg, cause) = match self {
            EncodeError::Refused(msg) => (msg, None),
            EncodeError::Raised(err)
                if err.is_instance_of::<PyMemoryError>(py)
                    || !err.is_instance_of::<PyException>(py) =>
            {
                return err;
            }
            EncodeError::Raised(err) => (err.value(py).to_string(), Some(err)),
        };
        let class = match item_not_encodable(py) {
            Ok(class) => class,
            Err(err) => return err,
        };
        let out = PyErr::from_type(class.clone(), format!("field item{path}: {msg}"));
        out.set_cause(py, cause);
        out
    }
}

impl From<PyErr> for EncodeError {
    fn from(err: PyErr) -> Self {
        EncodeError::Raised(err)
    }
}

impl From<FormatError> for EncodeError {
    fn from(err: FormatError) -> Self {
        EncodeError::refused(err.0)
    }
}

type EncodeResult<T> = Result<T, EncodeError>;

struct Encoder<'py> {
    py: Python<'py>,
    numpy: &'static Numpy,
    torch: Option<&'static Torch>,
    header: HeaderBuilder,
    parts: Vec<Part<'py>>,
    /// The path to the value being walked; left where it was when the walk fails.
    path: Vec<Step<'py>>,
}

/// One part as the walk finds it.
enum Part<'py> {
    /// Bytes their keeper holds already (an array's export, a `bytes` value).
    Held(Keeper),
    /// A tensor's bytes in its storage, whose memory is read once the walk is over.
    Tensor(TensorBytes<'py>),
}

impl Part<'_> {
    /// The part's keeper, a tensor's storage's memory read now (an `ItemNotEncodableError`
    /// naming the tensor's field if it cannot hold the tensor's bytes), and the references the
    /// walk took to find it, which must outlive the copy: dropping the last reference to a
    /// key may run its `__del__`, Python code that could free the memory just read.
    fn hold(self, py: Python<'_>, walked: &mut Vec<Py<PyAny>>) -> PyResult<Keeper> {
        match self {
            Part::Held(keeper) => Ok(keeper),
            Part::Tensor(t) => {
                let keeper = t.hold().map_err(|e| e.into_pyerr(py, &t.path));
                walked.push(t.tensor_type.into_any().unbind());
                walked.extend(t.path.into_iter().filter_map(|step| match step {
                    Step::Key(key) => Some(key.unbind()),
                    Step::Index(_) => None,
                }));
                keeper
            }
        }
    }
}

/// A tensor's `len` bytes from element `element` (of `itemsize` bytes) of `storage`, a plain
/// CPU storage, found at `path`.
struct TensorBytes<'py> {
    storage: Bound<'py, PyAny>,
    element: u64,
    itemsize: u64,
    len: u64,
    /// The tensor's type, for the refusal of a storage without memory.
    tensor_type: Bound<'py, PyType>,
    path: Vec<Step<'py>>,
}

impl TensorBytes<'_> {
    /// The bytes, held by their storage: memory of the storage's own, large enough for them.
    /// What the tensor said of itself only chooses which of the storage's bytes are read.
    fn hold(&self) -> EncodeResult<Keeper> {
        let py = self.storage.py();
        let (ptr, size) = storage_memory(&self.storage)
            .map_err(|e| self.no_memory(format!("torch says: {}", e.value(py))))?;
        // Nothing is read from an empty tensor: where it says it starts does not matter
        // (torch lets it start past the end of its storage).
        if self.len == 0 {
            return Ok(Keeper::object(&self.storage, ptr as *const u8, 0));
        }
        let start = self.element.checked_mul(self.itemsize).filter(|&start| {
            start
                .checked_add(self.len)
                .is_some_and(|end| end <= size as u64)
        });
        let Some(start) = start else {
            return Err(EncodeError::refused(format!(
                "a tensor of {} bytes at element {} does not fit its storage of {size} bytes",
                self.len, self.element
            )));
        };
        if ptr == 0 {
            return Err(self.no_memory("its storage's data_ptr() is null".into()));
        }
        Ok(Keeper::object(
            &self.storage,
            (ptr + start as usize) as *const u8,
            self.len as usize,
        ))
    }

    fn no_memory(&self, why: String) -> EncodeError {
        no_memory(&self.tensor_type, why)
    }
}

/// The refusal of a tensor (of type `tensor_type`) whose storage has no memory to read.
fn no_memory(tensor_type: &Bound<'_, PyType>, why: String) -> EncodeError {
    EncodeError::refused(format!(
        "a {} has no memory of its own to read ({why}; a wrapper subclass such as DTensor or \
         FakeTensor? make it a plain tensor first)",
        tensor_type
            .qualname()
            .map_or_else(|_| "tensor".into(), |n| n.to_string())
    ))
}

/// The address and length of a torch storage's memory. torch refuses `data_ptr()` of a
/// storage whose memory is not its own (a wrapper subclass's).
fn storage_memory(storage: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let py = storage.py();
    let ptr = storage.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let len = storage.call_method0(intern!(py, "nbytes"))?.extract()?;
    Ok((ptr, len))
}

/// An item encoded: part 0 and the parts that follow it.
pub(super) struct Encoded {
    header: Vec<u8>,
    parts: Vec<Keeper>,
    /// Whether a part lies in a torch storage (copies of it keep the GIL: module doc).
    in_storage: bool,
    /// What the walk held on the way to the tensors (their keys, their types): released
    /// with the encoding, after the copy (see `Part::hold`).
    _walked: Vec<Py<PyAny>>,
}

impl Encoded {
    pub(super) fn new(item: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = item.py();
        let mut enc = Encoder {
            py,
            numpy: numpy(py)?,
            torch: torch_if_loaded(py)?,
            header: HeaderBuilder::new(),
            parts: Vec::new(),
            path: Vec::new(),
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
        walked.map_err(|e| e.into_pyerr(py, &enc.path))?;
        let header = enc
            .header
            .finish()
            .map_err(|e| EncodeError::from(e).into_pyerr(py, &[]))?;
        let in_storage = enc.parts.iter().any(|p| matches!(p, Part::Tensor(_)));
        let mut walked = Vec::new();
        let parts = std::mem::take(&mut enc.parts)
            .into_iter()
            .map(|p| p.hold(py, &mut walked))
            .collect::<PyResult<_>>()?;
        Ok(Encoded {
            header,
            parts,
            in_storage,
            _walked: walked,
        })
    }

    /// Part 0 then every part, as the store writes them.
    pub(super) fn parts(&self) -> Vec<RawBytes<'_>> {
        std::iter::once(RawBytes::from(self.header.as_slice()))
            .chain(self.parts.iter().map(Keeper::raw))
            .collect()
    }

    /// Run `copy`, a copy of the parts: with the GIL released when they are large, unless one
    /// lies in a torch storage, whose memory another thread holding the GIL may free (module
    /// doc). Nothing may run Python code between `Encoded::new` and this call.
    pub(super) fn copying<T: Ungil>(&self, py: Python<'_>, copy: impl Ungil + FnOnce() -> T) -> T {
        if self.in_storage {
            copy()
        } else {
            let len = self.header.len() + self.parts.iter().map(Keeper::len).sum::<usize>();
            copying(py, len, copy)
        }
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

/// A mapping key's text: keys must be `str`.
fn key_text<'a>(key: &'a Bound<'_, PyAny>) -> EncodeResult<&'a str> {
    key.cast::<PyString>()
        .map_err(|_| EncodeError::refused(format!("key {} is not a str", key_segment(key))))?
        .to_str()
        .map_err(|_| EncodeError::refused("a key is not valid UTF-8".into()))
}

/// Refuse a key text `seen` holds already: the decoded dict would keep one of the two
/// values (keys of a str subclass, or a mapping whose `items()` repeats a key).
fn distinct(seen: &mut HashSet<String>, name: &str) -> EncodeResult<()> {
    if !seen.insert(name.to_owned()) {
        return Err(EncodeError::refused(format!(
            "two keys are the str {name:?}: one value would be lost"
        )));
    }
    Ok(())
}

fn key_segment(key: &Bound<'_, PyAny>) -> String {
    match key.repr() {
        Ok(r) => format!("[{r}]"),
        Err(_) => "[?]".into(),
    }
}

/// The storage of a tensor of `nbytes` bytes and the element its bytes start at: a plain
/// storage on the CPU (not a wrapper subclass's, FakeTensor's or the meta device's). Its memory
/// is read, and the bytes' bounds checked, once the walk is over ([`TensorBytes::hold`]).
fn tensor_storage<'py>(
    torch: &Torch,
    t: &Bound<'py, PyAny>,
    nbytes: u64,
) -> EncodeResult<(Bound<'py, PyAny>, u64)> {
    let py = t.py();
    let no_memory = |why: String| no_memory(&t.get_type(), why);
    let storage = t
        .call_method0(intern!(py, "untyped_storage"))
        .map_err(|e| no_memory(format!("untyped_storage() raised {}", e.value(py))))?;
    if !storage.is_exact_instance(torch.storage.bind(py)) {
        return Err(no_memory(format!(
            "its untyped_storage() is a {}",
            storage.get_type().qualname()?
        )));
    }
    // The tensor is on the CPU (read in place only when `is_cpu`, else made by `cpu()`), and
    // torch keeps a plain tensor's storage on its device: only a subclass's storage, whatever
    // its `untyped_storage()` returns, needs the check (a device read and compared per tensor).
    // `device == cpu` compares type and index: equal is on the CPU; a CPU device with an
    // index (`cpu:0`) takes the slower check of its type.
    if !t.is_exact_instance(torch.tensor.bind(py).as_any()) {
        let device = storage.getattr(intern!(py, "device"))?;
        if !device.eq(torch.cpu.bind(py))? && device.getattr(intern!(py, "type"))?.ne("cpu")? {
            return Err(no_memory(format!("its storage is on {device}")));
        }
    }
    if nbytes == 0 {
        return Ok((storage, 0)); // where an empty tensor starts is never read
    }
    let element = t.call_method0(intern!(py, "storage_offset"))?.extract()?;
    Ok((storage, element))
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
                return Err(EncodeError::refused(format!(
                    "int {v} does not fit in 64 bits"
                )));
            }
        } else if v.is_instance(self.numpy.generic.bind(py).as_any())? {
            // Before float, str and bytes, which np.float64, np.str_ and np.bytes_ subclass.
            self.scalar(v)?;
        } else if let Ok(f) = v.cast::<PyFloat>() {
            self.header.float(f.value());
        } else if let Ok(s) = v.cast::<PyString>() {
            let s = s.to_str().map_err(|_| {
                EncodeError::refused("str is not valid UTF-8 (a lone surrogate?)".into())
            })?;
            self.header.str(s)?;
        } else if let Ok(b) = v.cast::<PyBytes>() {
            if self.header.bytes(b.as_bytes())?.is_some() {
                let bytes = b.as_bytes();
                self.parts.push(Part::Held(Keeper::object(
                    b.as_any(),
                    bytes.as_ptr(),
                    bytes.len(),
                )));
            }
        } else if v.is_instance(self.numpy.ndarray.bind(py).as_any())? {
            self.array(v)?;
        } else if let Ok(l) = v.cast::<PyList>() {
            self.sequence(Container::List, l.as_any(), depth + 1)?;
        } else if let Ok(t) = v.cast::<PyTuple>() {
            self.sequence(Container::Tuple, t.as_any(), depth + 1)?;
        } else if is_mapping(v)? {
            self.mapping(v, depth + 1)?;
        } else {
            return Err(EncodeError::refused(format!(
                "unsupported type {}",
                v.get_type().qualname()?
            )));
        }
        Ok(())
    }

    fn check_depth(&self, depth: usize) -> EncodeResult<()> {
        if depth > MAX_DEPTH {
            return Err(EncodeError::refused(format!(
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
        self.header.key(key_text(key)?)?;
        self.path.push(Step::Key(key.clone()));
        self.value(value, depth)?;
        self.path.pop();
        Ok(())
    }

    fn dict(&mut self, d: &Bound<'py, PyDict>, depth: usize) -> EncodeResult<()> {
        self.check_depth(depth)?;
        let open = self.header.begin(Container::Dict);
        let mut n = 0;
        // Only keys of a str subclass can be distinct keys of a dict and one text.
        let mut plain_keys = true;
        // A copy of it: walking its values may run Python code that changes the dict.
        let copy = d.copy()?;
        for (k, v) in copy.iter() {
            self.entry(&k, &v, depth)?;
            plain_keys &= k.is_exact_instance_of::<PyString>();
            n += 1;
        }
        if !plain_keys {
            let mut seen = HashSet::new();
            for k in copy.keys() {
                distinct(&mut seen, key_text(&k)?)?;
            }
        }
        Ok(self.header.end(open, n)?)
    }

    fn mapping(&mut self, m: &Bound<'py, PyAny>, depth: usize) -> EncodeResult<()> {
        self.check_depth(depth)?;
        let open = self.header.begin(Container::Dict);
        let mut n = 0;
        let mut seen = HashSet::new();
        // Its pairs first, as `dict` walks a copy: walking the values may run Python code
        // that changes the mapping, and its items() iterator would raise mid-walk.
        let pairs = m
            .call_method0(intern!(self.py, "items"))?
            .try_iter()?
            .collect::<PyResult<Vec<_>>>()?;
        for pair in pairs {
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = pair.extract()?;
            self.entry(&k, &v, depth)?;
            distinct(&mut seen, key_text(&k)?)?;
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
        // A snapshot of it (a tuple is its own): walking its values may run Python code, or
        // release the GIL, and a list shifted meanwhile would be walked into fields twice or
        // none. A subclass's elements are what its iterator gives (`PySequence_Tuple`).
        let values = seq.cast::<PySequence>().map_err(PyErr::from)?.to_tuple()?;
        for (n, v) in values.iter().enumerate() {
            self.path.push(Step::Index(n));
            self.value(&v, depth)?;
            self.path.pop();
        }
        Ok(self.header.end(open, values.len())?)
    }

    fn tensor(&mut self, torch: &Torch, t: &Bound<'py, PyAny>) -> EncodeResult<()> {
        let py = self.py;
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let Some(dt) = torch.dtype_of(&dtype) else {
            return Err(EncodeError::refused(format!(
                "unsupported tensor dtype {dtype}"
            )));
        };
        let layout = t.getattr(intern!(py, "layout"))?;
        if layout.as_ptr() != torch.strided.as_ptr() {
            return Err(EncodeError::refused(format!(
                "unsupported tensor layout {layout} (only strided tensors have plain bytes)"
            )));
        }
        // A tensor whose bytes are not its values as they stand (another device, a lazy
        // conjugate or negation, a strided view) is materialised first, by torch (a subclass's
        // own operations decide what that gives; its storage is checked like any other).
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
        let shape = match t.getattr(intern!(py, "shape")) {
            Ok(shape) => dims(&shape)?,
            // A nested tensor of the strided layout passes every check above but has no one
            // shape (torch raises an "Internal error"): asked only once reading it failed.
            Err(_) if t.getattr(intern!(py, "is_nested"))?.is_truthy()? => {
                return Err(EncodeError::refused(
                    "a nested tensor (torch.nested) has no one shape: pass its tensors as a \
                     list (.unbind())"
                        .into(),
                ));
            }
            Err(err) => return Err(err.into()),
        };
        // A tensor with a dimension of 0 holds no bytes, however large the others (torch
        // builds `torch.empty((2**63 - 1, 0))`): a product in order overflowed before the 0.
        let nbytes = if shape.contains(&0) {
            Some(0)
        } else {
            shape.iter().try_fold(dt.itemsize, |n, &d| n.checked_mul(d))
        }
        .ok_or_else(|| EncodeError::refused("tensor too large".into()))?;
        let (storage, element) = tensor_storage(torch, &t, nbytes)?;
        self.header.tensor(dt.name, &shape, nbytes)?;
        self.parts.push(Part::Tensor(TensorBytes {
            storage,
            element,
            itemsize: dt.itemsize,
            len: nbytes,
            tensor_type: t.get_type(),
            path: self.path.clone(),
        }));
        Ok(())
    }

    fn array(&mut self, a: &Bound<'py, PyAny>) -> EncodeResult<()> {
        let py = self.py;
        if !a.is_exact_instance(self.numpy.ndarray.bind(py).as_any()) {
            static MASKED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
            if a.is_instance(MASKED.import(py, "numpy.ma", "MaskedArray")?.as_any())? {
                return Err(EncodeError::refused(
                    "unsupported array (MaskedArray: its mask would be lost)".into(),
                ));
            }
        }
        let dtype = a.getattr(intern!(py, "dtype"))?;
        let descr = array_descr(&dtype, "an array")?.map_err(EncodeError::refused)?;
        // PyBUF_SIMPLE asks for C-contiguous bytes: anything else is made contiguous first.
        let buffer = match SimpleBuffer::get(a, false) {
            Ok(b) => b,
            Err(_) => {
                let c = self.numpy.ascontiguousarray.bind(py).call1((a,))?;
                SimpleBuffer::get(&c, false)?
            }
        };
        let shape = dims(&a.getattr(intern!(py, "shape"))?)?;
        let itemsize: u64 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        let nbytes = shape.iter().try_fold(itemsize, |n, &d| n.checked_mul(d));
        if nbytes != Some(buffer.len() as u64) {
            return Err(EncodeError::refused(format!(
                "an array of shape {shape:?} whose buffer is {} bytes (a subclass's shape?)",
                buffer.len()
            )));
        }
        self.header.array(&descr, &shape, buffer.len() as u64)?;
        self.parts.push(Part::Held(Keeper::Export(buffer)));
        Ok(())
    }

    fn scalar(&mut self, v: &Bound<'py, PyAny>) -> EncodeResult<()> {
        let py = self.py;
        let dtype = v.getattr(intern!(py, "dtype"))?;
        let descr = array_descr(&dtype, "a numpy scalar")?.map_err(EncodeError::refused)?;
        let raw = v.call_method0(intern!(py, "tobytes"))?;
        let mut raw = raw.cast::<PyBytes>().map_err(PyErr::from)?.as_bytes();
        let itemsize: usize = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        if raw.len() != itemsize || itemsize == 0 {
            // An empty str_ or bytes_ (`<U0`, `|S0`) gives one NUL item: stored as no bytes
            // (a NUL is a character of a str_ or bytes_ scalar). An empty void has no bytes
            // to decode from.
            raw = match (descr.as_bytes().get(1), raw.len(), itemsize) {
                (Some(b'U'), 4, 0) | (Some(b'S'), 1, 0) => &[],
                _ => {
                    return Err(EncodeError::refused(format!(
                        "a numpy scalar of dtype {descr} whose bytes are {} long",
                        raw.len()
                    )));
                }
            };
        }
        self.header.scalar(&descr, raw)?;
        Ok(())
    }
}

/// `serde.encode`: an item as `(part 0, [part 1, ...])`, each part a read-only memoryview
/// of the item's own memory (a tensor's: of its storage, which the view holds).
#[pyfunction]
pub(super) fn encode_item<'py>(
    py: Python<'py>,
    item: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyList>)> {
    let encoded = Encoded::new(item)?;
    let views = PyList::empty(py);
    for part in encoded.parts {
        let view = Bound::new(py, PartView::new(part))?;
        views.append(PyMemoryView::from(view.as_any())?)?;
    }
    Ok((PyBytes::new(py, &encoded.header), views))
}

/// `serde.pack`: an item's whole payload as one `bytes` — part 0, then each part at its
/// aligned offset, zero padding between — encoded and copied in this one call, so that no
/// Python code runs between reading a tensor's address and copying its bytes.
#[pyfunction]
pub(super) fn pack_item<'py>(
    py: Python<'py>,
    item: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let encoded = Encoded::new(item)?;
    let lens = std::iter::once(encoded.header.len())
        .chain(encoded.parts.iter().map(Keeper::len))
        .map(|n| n as u64);
    let (offsets, len) = crate::layout::part_offsets(lens)
        .ok_or_else(|| PyOverflowError::new_err("the parts' lengths overflow 64 bits"))?;
    let (bytes, mut fill) = new_bytes(py, len as usize)?;
    encoded.copying(py, || {
        fill.write(&encoded.header)?;
        for (part, &offset) in encoded.parts.iter().zip(&offsets[1..]) {
            fill.pad_to(offset as usize)?;
            fill.write_kept(part)?;
        }
        fill.finish()
    })?;
    Ok(bytes)
}

/// `serde.part_offsets` and `serde.payload_size`: where each part of a payload starts (every
/// part at the next multiple of `PART_ALIGNMENT`), and the payload's length — the store's
/// own rule (`crate::layout::part_offsets`).
#[pyfunction]
pub(super) fn part_offsets(lengths: Vec<u64>) -> PyResult<(Vec<u64>, u64)> {
    crate::layout::part_offsets(lengths)
        .ok_or_else(|| PyOverflowError::new_err("the parts' lengths overflow 64 bits"))
}

/// Add the encoder's functions, `PartView` and `ItemNotEncodableError` to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ItemNotEncodableError", item_not_encodable(m.py())?)?;
    m.add_class::<PartView>()?;
    m.add_function(wrap_pyfunction!(encode_item, m)?)?;
    m.add_function(wrap_pyfunction!(pack_item, m)?)?;
    m.add_function(wrap_pyfunction!(part_offsets, m)?)?;
    Ok(())
}
