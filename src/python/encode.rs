//! Encoding an item (a mapping of tensors, arrays and small values) in one native pass.
//!
//! Small values go into the header (`crate::codec::HeaderBuilder`); every tensor, array and
//! long `bytes` value becomes a part, read in place (a tensor's bytes through its
//! `data_ptr()`, an array's through the buffer protocol) and held by a [`Keeper`] until the
//! store has copied it into the ring's chunk (`ShmWriter.put_item`) or the caller has dropped
//! its views (`encode_item`, for `serde.encode`) — no intermediate buffer.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{
    PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PyString, PyTuple, PyType,
};

use super::buffer::{Keeper, PartView, SimpleBuffer};
use super::frameworks::{Numpy, Torch, array_descr, numpy, torch_if_loaded};
use crate::codec::{Container, FormatError, HeaderBuilder, MAX_DEPTH};
use crate::segment::RawBytes;

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
    parts: Vec<Keeper>,
}

/// An item encoded: part 0 and the parts that follow it.
pub(super) struct Encoded {
    header: Vec<u8>,
    parts: Vec<Keeper>,
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
    pub(super) fn parts(&self) -> Vec<RawBytes<'_>> {
        std::iter::once(RawBytes::from(self.header.as_slice()))
            .chain(self.parts.iter().map(Keeper::raw))
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
                let bytes = b.as_bytes();
                self.parts
                    .push(Keeper::object(b.as_any(), bytes.as_ptr(), bytes.len()));
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
        self.parts.push(Keeper::object(&t, ptr, nbytes as usize));
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
        self.parts.push(Keeper::Export(buffer));
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
        let view = Bound::new(py, PartView::new(part))?;
        views.append(PyMemoryView::from(view.as_any())?)?;
    }
    Ok((PyBytes::new(py, &encoded.header), views))
}

/// `serde.part_offsets` and `serde.payload_size`: where each part of a payload starts (every
/// part at the next multiple of `PART_ALIGNMENT`), and the payload's length — the store's
/// own rule (`crate::layout::part_offsets`).
#[pyfunction]
pub(super) fn part_offsets(lengths: Vec<u64>) -> PyResult<(Vec<u64>, u64)> {
    crate::layout::part_offsets(lengths)
        .ok_or_else(|| PyOverflowError::new_err("the parts' lengths overflow 64 bits"))
}

/// Add the encoder's functions and `PartView` to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PartView>()?;
    m.add_function(wrap_pyfunction!(encode_item, m)?)?;
    m.add_function(wrap_pyfunction!(part_offsets, m)?)?;
    Ok(())
}
