//! Decoding an item: a payload (in the ring, or any buffer) back to the mapping it encodes.
//!
//! The whole header is validated first (`crate::codec::Header::walk`, on a private copy of
//! part 0); then the values are built:
//!
//! * zero-copy (`copy=False`): torch tensors come from DLPack capsules (`dlpack.rs`; torch
//!   accepts them without the warning it gives for read-only buffers) and numpy arrays from
//!   the buffer protocol of a `ShmView`, read-only where the memory is; every one holds the
//!   payload's [`Keeper`] — the one buffer export (or lease) the bytes were read through;
//! * copying: one copy per value, with the GIL released when the copies are large. Tensors
//!   are copied into one allocation per item (`CopyArena`, a plain `malloc`; torch's pinned
//!   memory on request) and handed out as DLPack views of it, so a three-tensor item costs
//!   one allocator call and no torch call but the three imports; arrays get `np.empty`.
//!
//! The header's walk proves every part is named by exactly one value (`crate::codec`), so
//! what a decode allocates is bounded by the payload's length before anything is allocated;
//! an allocation that still fails is a `MemoryError`, and whatever numpy or torch refuse to
//! build from a header is a `SegmentCorruptError`.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple};

use super::buffer::{CopyArena, Keeper, ShmView, SimpleBuffer, copied_bytes, copying};
use super::dlpack::{self, DlType};
use super::frameworks::{Torch, TorchDtype, array_dtype, lock, numpy, torch};
use crate::codec::{FormatError, Header, Node, PREFIX_LEN, Shape, TreeReader, header_len};
use crate::layout::{ALIGN, align_up};

/// `pin_memory=True` pins copies only: callers refuse it for views before they read (and
/// so consume a reference).
pub(super) fn check_pin_memory(copy: bool, pin_memory: bool) -> PyResult<()> {
    if pin_memory && !copy {
        return Err(PyValueError::new_err(
            "pin_memory=True pins copies (copy=True); zero-copy views are pinned by registering \
             the reader's mapping with CUDA (ShmReceiverCache(handle, copy=False, \
             pin_memory=True))",
        ));
    }
    Ok(())
}

/// Headers up to this long are copied to the stack, longer ones to the heap.
const SMALL_HEADER: usize = 1024;

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
    /// The payload's bytes, and what every zero-copy value holds.
    keep: &'a Arc<Keeper>,
    /// What zero-copy arrays view, made on first use (`array_base`).
    array_base: Option<Bound<'py, PyAny>>,
    parts: &'a [(u64, u64)],
    copy: bool,
    /// Copies of tensors land in this one allocation (a `CopyArena`, or torch's pinned
    /// memory), at `arena_cursor`.
    arena: Option<Arc<Keeper>>,
    arena_cursor: u64,
    jobs: Vec<CopyJob>,
    /// Array copies' buffers, written by the jobs, released at the end.
    buffers: Vec<SimpleBuffer>,
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

/// The item in the payload `keep` holds. Zero-copy values view `keep` itself, never another
/// export of the caller's object (which may be other memory: `__buffer__`).
pub(super) fn decode<'py>(
    py: Python<'py>,
    keep: &Arc<Keeper>,
    copy: bool,
    pin_memory: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let len = keep.len();
    let mut prefix = [0u8; PREFIX_LEN];
    if len < PREFIX_LEN {
        return Err(corrupt(format!("{len} bytes cannot hold a header")));
    }
    keep.read_at(0, &mut prefix)?;
    let hlen = header_len(&prefix)?;
    if hlen > len {
        return Err(corrupt(
            "the header runs past the end of the payload".into(),
        ));
    }
    // The private copy of part 0, on the stack when it is small (most items' headers).
    let mut small = [0u8; SMALL_HEADER];
    let mut large = Vec::new();
    let header_bytes = if hlen <= SMALL_HEADER {
        &mut small[..hlen]
    } else {
        large.resize(hlen, 0);
        &mut large[..]
    };
    keep.read_at(0, header_bytes)?;
    let header = Header::parse(header_bytes, len as u64)?;
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
        keep,
        array_base: None,
        parts: &header.parts,
        copy,
        arena: None,
        arena_cursor: 0,
        jobs: Vec::with_capacity(tensors),
        buffers: Vec::new(),
    };
    if copy && tensors > 0 {
        let arena = arena(py, tensor_bytes, pin_memory)?;
        // What no tensor covers (an arena of zero-byte tensors) is zeroed, not left unwritten.
        let covered = tensor_bytes as usize;
        // SAFETY: `covered..len()` lies inside the arena, memory of this decode's alone.
        unsafe {
            std::ptr::write_bytes(
                arena.ptr().add(covered).cast_mut(),
                0,
                arena.len() - covered,
            )
        };
        decoder.arena = Some(Arc::new(arena));
    }
    let mut tree = header.tree();
    let root = decoder.value(&mut tree)?;
    decoder.run_copies()?;
    Ok(root.cast_into()?)
}

/// The one allocation of `size` bytes for an item's tensor copies: memory of our own, or
/// torch's pinned memory on request. A refusal is a `MemoryError` (torch reports its own as
/// a `RuntimeError`).
fn arena(py: Python<'_>, size: u64, pin_memory: bool) -> PyResult<Keeper> {
    // Never empty, so a zero-byte tensor's pointer is into (or just past) a live allocation,
    // never null or dangling.
    let size = size.max(ALIGN);
    let cannot_allocate = |why: String| {
        let pinned = if pin_memory { " of pinned memory" } else { "" };
        PyMemoryError::new_err(format!(
            "cannot allocate {size} bytes{pinned} for the item's tensor copies{why}"
        ))
    };
    if !pin_memory {
        return usize::try_from(size)
            .ok()
            .and_then(CopyArena::new)
            .map(Keeper::Arena)
            .ok_or_else(|| cannot_allocate(String::new()));
    }
    let torch = torch(py)?;
    let arena = torch
        .empty
        .bind(py)
        .call((size,), Some(torch.pinned_kwargs.bind(py)))
        .map_err(|e| {
            let out = cannot_allocate(format!(": {}", e.value(py)));
            out.set_cause(py, Some(e));
            out
        })?;
    let ptr = arena
        .call_method0(intern!(py, "data_ptr"))?
        .extract::<usize>()? as *const u8;
    Ok(Keeper::object(&arena, ptr, size as usize))
}

/// Keys up to this many bytes are cached (`dict_key`).
const CACHED_KEY_LEN: usize = 64;
/// Slots of the key cache (direct-mapped: a key takes the place of its slot's last one).
const KEY_SLOTS: usize = 64;

/// The `str` objects made for recent dict keys. Items come with the same few keys (an
/// engine's field names): a key found here costs no new object, and its `str` carries its
/// hash already, so the dict does not compute it either.
static KEYS: Mutex<[Option<CachedKey>; KEY_SLOTS]> = Mutex::new([const { None }; KEY_SLOTS]);
/// A key and the `str` made for it.
type CachedKey = (Box<str>, Py<PyString>);

/// A dict key's `str`, from the cache when it holds it.
fn dict_key<'py>(py: Python<'py>, key: &str) -> Bound<'py, PyString> {
    if key.len() > CACHED_KEY_LEN {
        return PyString::new(py, key);
    }
    // FNV-1a: keys are short, and only the slot comes from the hash (a match is compared).
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let slot = (hash % KEY_SLOTS as u64) as usize;
    if let Some((cached, string)) = &lock(&KEYS)[slot] {
        if **cached == *key {
            return string.bind(py).clone();
        }
    }
    let string = PyString::new(py, key);
    let evicted = lock(&KEYS)[slot].replace((key.into(), string.clone().unbind()));
    // Released after the lock (a cache's lock is never held while calling into Python).
    drop(evicted);
    string
}

/// A torch tensor of `dtype` and `shape` over the `nbytes` bytes at `data`, which `keep`
/// keeps alive, without a copy.
fn tensor_over<'py>(
    py: Python<'py>,
    torch: &Torch,
    dtype: &TorchDtype,
    shape: Shape<'_>,
    data: *mut u8,
    nbytes: u64,
    keep: Arc<Keeper>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(d) = shape.dims().find(|&d| i64::try_from(d).is_err()) {
        return Err(corrupt(format!("dimension {d} too large")));
    }
    // torch refuses a tensor whose C-contiguous strides overflow an i64, even one of no
    // elements (`torch.empty((0, 2**62, 4))`): an encoder never wrote one.
    let outer_stride = shape
        .dims()
        .skip(1)
        .try_fold(1i64, |stride, d| stride.checked_mul((d as i64).max(1)));
    if outer_stride.is_none() {
        return Err(corrupt(format!(
            "a tensor of shape {:?} has strides past 64 bits",
            shape.dims().collect::<Vec<_>>()
        )));
    }
    let dims = shape.dims().map(|d| d as i64);
    match dtype.dlpack {
        Some(dl_type) => torch.import_dlpack(dlpack::capsule(py, data, dl_type, dims, keep)?),
        // Types torch has no DLPack code for travel as bytes, then take their dtype back.
        None => {
            let bytes = [nbytes as i64].into_iter();
            let bytes = dlpack::capsule(py, data, DlType::BYTES, bytes, keep)?;
            torch
                .import_dlpack(bytes)?
                .call_method1(intern!(py, "view"), (dtype.obj.bind(py),))?
                .call_method1(intern!(py, "reshape"), (PyTuple::new(py, dims)?,))
        }
    }
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
                    let key = dict_key(py, r.key()?);
                    dict.set_item(key, self.value(r)?)?;
                }
                // The encoder writes distinct keys: a repeated one would silently drop a value.
                if dict.len() != n {
                    return Err(corrupt("a dict names one key twice".into()));
                }
                dict.into_any()
            }
            Node::Tensor { dtype, shape, part } => self.tensor(dtype, shape, part)?,
            Node::Array { descr, shape, part } => self.array(descr, shape, part)?,
            Node::Scalar { descr, raw } => self.scalar(descr, raw)?,
        })
    }

    /// A numpy scalar of dtype `descr` whose bytes are `raw`.
    fn scalar(&self, descr: &str, raw: &[u8]) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let numpy = numpy(py)?;
        let wrong_size = || corrupt(format!("a {descr} scalar of {} bytes", raw.len()));
        // A str_ or bytes_ is its whole dtype, trailing NULs included (and an empty one has
        // no bytes): built from its bytes, as an array's item would take NULs for padding.
        match descr.as_bytes() {
            [order @ (b'<' | b'>'), b'U', ..] => {
                if raw.len() % 4 != 0 || descr[2..] != (raw.len() / 4).to_string() {
                    return Err(wrong_size());
                }
                let codec = if *order == b'<' {
                    "utf-32-le"
                } else {
                    "utf-32-be"
                };
                PyBytes::new(py, raw)
                    .call_method1(intern!(py, "decode"), (codec, "surrogatepass"))
                    .and_then(|text| numpy.str_.bind(py).call1((text,)))
                    .map_err(|e| refused(py, "a scalar", e))
            }
            [b'|', b'S', ..] => {
                if descr[2..] != raw.len().to_string() {
                    return Err(wrong_size());
                }
                numpy.bytes_.bind(py).call1((PyBytes::new(py, raw),))
            }
            _ => {
                let (dtype, itemsize) = array_dtype(py, descr)?;
                if raw.len() as u64 != itemsize {
                    return Err(wrong_size());
                }
                numpy
                    .frombuffer
                    .bind(py)
                    .call1((PyBytes::new(py, raw), dtype))
                    .and_then(|a| a.get_item(0))
                    .map_err(|e| refused(py, "a scalar", e))
            }
        }
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
        let (py, keep) = (self.py, self.keep);
        copied_bytes(py, len as usize, |dst| keep.read_at_uninit(offset, dst))
    }

    fn tensor(&mut self, name: &str, shape: Shape<'_>, p: usize) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let torch = torch(py)?;
        let dtype = torch
            .dtype_named(name)
            .ok_or_else(|| corrupt(format!("unknown torch dtype {name:?}")))?;
        let (offset, len) = self.sized_part(p, shape, dtype.itemsize, "tensor")?;
        let (data, keep) = match &self.arena {
            Some(arena) => {
                let data = arena
                    .ptr()
                    .wrapping_add(self.arena_cursor as usize)
                    .cast_mut();
                self.jobs.push(CopyJob {
                    offset,
                    dst: data,
                    len: len as usize,
                });
                let slot = align_up(len).expect("sized by walk");
                // The padding up to the next tensor's slot is zeroed, not left unwritten.
                // SAFETY: the walk sized the arena to hold every tensor's aligned slot, so
                // `data + len .. data + slot` lies inside it, memory of this decode's alone.
                unsafe { std::ptr::write_bytes(data.add(len as usize), 0, (slot - len) as usize) };
                self.arena_cursor += slot;
                (data, Arc::clone(arena))
            }
            None => (
                self.keep.ptr().wrapping_add(offset as usize).cast_mut(),
                Arc::clone(self.keep),
            ),
        };
        tensor_over(py, torch, dtype, shape, data, len, keep)
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
        let base = self.array_base()?;
        numpy
            .ndarray
            .bind(py)
            .call1((dims, dtype, base, offset))
            .map_err(|e| refused(py, "an array", e))
    }

    /// What zero-copy arrays view (numpy builds them over an object with the buffer protocol,
    /// which it keeps): a `ShmView` sharing the payload's keeper, so the arrays hold the very
    /// lease or export their bytes were read through (writable where that export is). Not a
    /// memoryview of a caller's payload: numpy keeps a memoryview's object, not its export,
    /// and a new export may be other memory. One per item, made on first use.
    fn array_base(&mut self) -> PyResult<Bound<'py, PyAny>> {
        if let Some(base) = &self.array_base {
            return Ok(base.clone());
        }
        let base = Bound::new(self.py, ShmView::new(Arc::clone(self.keep)))?.into_any();
        self.array_base = Some(base.clone());
        Ok(base)
    }

    /// Fill every copy destination, with the GIL released when there is much to copy.
    fn run_copies(&mut self) -> PyResult<()> {
        let jobs = std::mem::take(&mut self.jobs);
        let total: usize = jobs.iter().map(|j| j.len).sum();
        let keep = self.keep;
        copying(self.py, total, move || {
            jobs.iter().try_for_each(|job| {
                // SAFETY: `dst` is `len` bytes of memory allocated for this decode (the
                // tensors' arena or a fresh array), exclusively ours until we return; not yet
                // written, so viewed as `MaybeUninit` bytes.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(job.dst.cast::<MaybeUninit<u8>>(), job.len)
                };
                keep.read_at_uninit(job.offset, dst)
            })
        })?;
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
    // The one export of `payload`: every zero-copy value reads through it and holds it.
    let keep = Arc::new(Keeper::Export(SimpleBuffer::get(payload, false)?));
    decode(py, &keep, copy, false)
}

/// Add the decoder's function to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_item, m)?)?;
    Ok(())
}
