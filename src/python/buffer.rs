//! Bytes crossing the boundary: what keeps them alive ([`Keeper`], the one answer for every
//! view, part and tensor `mmcache._core` hands out), the two buffer exporters (`ShmView`,
//! `PartView`), buffer imports (`SimpleBuffer`, `raw_parts`), new `bytes` written in one pass
//! (`new_bytes`), and copies with the GIL released when they are large.
//!
//! Its `unsafe`: filling a `Py_buffer` for an export, taking and releasing buffer imports,
//! reference counting without PyO3's bookkeeping (for drops on threads torch calls us from),
//! raw copies out of callers' memory, writes into a `bytes` object nobody else has seen, and
//! the copy arena's allocation.
//! Each block says why it is sound.

use std::alloc::Layout;
use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::marker::Ungil;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::codec::FormatError;
use crate::layout::ALIGN;
use crate::segment::{RawBytes, written_whole};
use crate::store::{Lease, View};

/// Copies at least this large run with the GIL released.
const DETACH_THRESHOLD: usize = 64 * 1024;

/// Run `copy`, a copy of `len` bytes, with the GIL released when `len` is large enough for
/// other Python threads to gain more than the release costs.
pub(super) fn copying<T: Ungil>(py: Python<'_>, len: usize, copy: impl Ungil + FnOnce() -> T) -> T {
    if len >= DETACH_THRESHOLD {
        py.detach(copy)
    } else {
        copy()
    }
}

/// A new `bytes` object of `len` bytes, not yet written, and the [`BytesFill`] that writes it:
/// one pass instead of a zeroing pass and then the copies. Return the object only once the
/// fill is [`BytesFill::finish`]ed; dropped before, it was never anyone else's.
pub(super) fn new_bytes(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyBytes>, BytesFill)> {
    let size = isize::try_from(len).map_err(|_| PyValueError::new_err("too many bytes"))?;
    // SAFETY: a null source asks CPython for `len` bytes it leaves unwritten (and a trailing
    // NUL); the result is checked for null (MemoryError) before use.
    let bytes = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))
    }?
    .cast_into::<PyBytes>()?;
    // SAFETY: `bytes` is a bytes object; its buffer holds `len` bytes for as long as it lives.
    let ptr = unsafe { ffi::PyBytes_AsString(bytes.as_ptr()) }.cast::<u8>();
    Ok((bytes, BytesFill { ptr, len, at: 0 }))
}

/// A new `bytes` object of `len` bytes, all written by `copy` (with the GIL released when
/// there are many): one pass over fresh memory, where `PyBytes::new_with` first zeroes it
/// with the GIL held (a second pass, and the one that takes the page faults).
pub(super) fn copied_bytes<'py>(
    py: Python<'py>,
    len: usize,
    copy: impl Send + FnOnce(&mut [MaybeUninit<u8>]) -> PyResult<()>,
) -> PyResult<Bound<'py, PyBytes>> {
    let (bytes, fill) = new_bytes(py, len)?;
    copying(py, len, move || fill.copy_rest(copy))?;
    Ok(bytes)
}

/// Writes a new `bytes` object front to back (`new_bytes`).
pub(super) struct BytesFill {
    ptr: *mut u8,
    len: usize,
    at: usize,
}

// SAFETY: the bytes object is new and nothing but its creator refers to it until the fill is
// finished; every write goes through `&mut self`, on whichever thread holds the fill.
unsafe impl Send for BytesFill {}

impl BytesFill {
    /// Room for `n` more bytes, or an error; where they go.
    fn next(&mut self, n: usize) -> PyResult<*mut u8> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.len)
            .ok_or_else(|| PyValueError::new_err("writing past the end of new bytes"))?;
        // SAFETY: `at <= len`, so the result is inside (or one past) the object's buffer.
        let dst = unsafe { self.ptr.add(self.at) };
        self.at = end;
        Ok(dst)
    }

    /// Hand every byte not yet written to `copy`, which writes them all (they are not
    /// initialised: `MaybeUninit` bytes until it has).
    fn copy_rest(
        mut self,
        copy: impl FnOnce(&mut [MaybeUninit<u8>]) -> PyResult<()>,
    ) -> PyResult<()> {
        let n = self.len - self.at;
        let dst = self.next(n)?;
        // SAFETY: `next` checked that the `n` bytes at `dst` lie inside the new object's
        // buffer, which nothing else refers to until the fill is done (`new_bytes`); viewed
        // as `MaybeUninit` bytes, unwritten memory is valid. Should `copy` fail, the object
        // is dropped unseen.
        copy(unsafe { std::slice::from_raw_parts_mut(dst.cast::<MaybeUninit<u8>>(), n) })
    }

    /// Zeros up to offset `to`.
    pub(super) fn pad_to(&mut self, to: usize) -> PyResult<()> {
        let n = to
            .checked_sub(self.at)
            .ok_or_else(|| PyValueError::new_err("padding backwards in new bytes"))?;
        let dst = self.next(n)?;
        // SAFETY: `next` checked that `n` bytes at `dst` lie inside the new object's buffer.
        unsafe { std::ptr::write_bytes(dst, 0, n) };
        Ok(())
    }

    /// `src` next.
    pub(super) fn write(&mut self, src: &[u8]) -> PyResult<()> {
        let dst = self.next(src.len())?;
        // SAFETY: `next` checked the room; `src` is a slice of other memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// The bytes `keep` holds next.
    pub(super) fn write_kept(&mut self, keep: &Keeper) -> PyResult<()> {
        let dst = self.next(keep.len())?;
        if keep.len() > 0 {
            // SAFETY: `next` checked the room; `keep` keeps its `len()` bytes readable while
            // borrowed (a lease, an export, a live object). A raw copy forms no reference to
            // bytes another thread may be writing.
            unsafe { std::ptr::copy_nonoverlapping(keep.ptr(), dst, keep.len()) };
        }
        Ok(())
    }

    /// Zero whatever is left: every byte of the object is written.
    pub(super) fn finish(mut self) -> PyResult<()> {
        self.pad_to(self.len)
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

/// A strong reference to a Python object that may be dropped on any thread, GIL or not.
pub(super) struct Held(Option<Py<PyAny>>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            let obj = obj.into_ptr();
            // SAFETY: `obj` is the strong reference we held, given up exactly once, with the
            // GIL held.
            with_gil_held(|| unsafe { ffi::Py_DecRef(obj) });
        }
    }
}

/// A buffer export held open: contiguous bytes (`PyBUF_SIMPLE`, no format, so every numpy
/// dtype exports, datetimes included), released on drop.
pub(super) struct SimpleBuffer(Box<ffi::Py_buffer>);

// SAFETY: the export pins the exporter's memory until release, whatever the thread; we only
// read (or, for a writable export of memory we just allocated, write) through `buf`, and
// release with the GIL held (`Drop`).
unsafe impl Send for SimpleBuffer {}
// SAFETY: as for `Send`: shared access only reads the fields.
unsafe impl Sync for SimpleBuffer {}

impl SimpleBuffer {
    pub(super) fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
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

    pub(super) fn ptr(&self) -> *mut u8 {
        self.0.buf.cast()
    }

    pub(super) fn len(&self) -> usize {
        self.0.len as usize
    }

    /// Whether the exporter let this export write its bytes.
    fn writable(&self) -> bool {
        self.0.readonly == 0
    }
}

impl Drop for SimpleBuffer {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
        // exactly once, here, holding the GIL.
        with_gil_held(|| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// Memory of our own for an item's tensor copies: `len` bytes at an `ALIGN`-aligned address,
/// not initialised (the decode writes every byte before anyone sees them), freed on drop on
/// any thread. One `malloc` (~50 ns) where a torch storage cost ten times that through its
/// Python constructor and `data_ptr()`; the tensors are DLPack views either way.
pub(super) struct CopyArena {
    /// What `alloc` returned, with room to start `ALIGN`-aligned inside it.
    base: NonNull<u8>,
    layout: Layout,
    /// `base` rounded up to `ALIGN`.
    start: *mut u8,
    len: usize,
}

// SAFETY: the memory is ours alone: written by the decode that made it, then only read (or
// written by the tensors' owners, through torch) wherever the arena is; freed once, on drop.
unsafe impl Send for CopyArena {}
// SAFETY: as for `Send`: `&CopyArena` only reads the pointer and the length.
unsafe impl Sync for CopyArena {}

impl CopyArena {
    /// `len` bytes, or `None` if the allocator refuses them.
    pub(super) fn new(len: usize) -> Option<Self> {
        // A plain allocation, aligned by hand: an aligned one (`posix_memalign`) splits its
        // chunk and frees the rest, which costs more than the slack.
        const MALLOC_ALIGN: usize = 16;
        let slack = ALIGN as usize - MALLOC_ALIGN;
        let layout = Layout::from_size_align(len.checked_add(slack)?.max(1), MALLOC_ALIGN).ok()?;
        // SAFETY: the layout's size is not zero; a null result is a refusal, checked here.
        let base = NonNull::new(unsafe { std::alloc::alloc(layout) })?;
        let pad = base.as_ptr().align_offset(ALIGN as usize);
        if pad > slack {
            // SAFETY: `base` came from `alloc` with this layout and is freed once, here.
            unsafe { std::alloc::dealloc(base.as_ptr(), layout) };
            return None;
        }
        // SAFETY: `pad <= slack`, so `start .. start + len` lies inside the allocation.
        let start = unsafe { base.as_ptr().add(pad) };
        Some(CopyArena {
            base,
            layout,
            start,
            len,
        })
    }
}

impl Drop for CopyArena {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc` with this very layout and is freed once, here.
        unsafe { std::alloc::dealloc(self.base.as_ptr(), self.layout) };
    }
}

/// What keeps a run of bytes alive, and where they are. Every zero-copy value `_core`
/// hands out (a `ShmView`, a `PartView`, a DLPack tensor) holds one, so its bytes cannot be
/// freed, reused or resized before it goes; dropping one is safe on any thread.
pub(super) enum Keeper {
    /// An object in the ring: the view's lease protects the chunk (and its fork
    /// registration the pages) while it lives.
    Ring(View),
    /// A private copy: the writer's own reads, and replayed handles (which carry no lease).
    Copy(Vec<u8>),
    /// A caller's memory, held by an open buffer export (an array, a payload).
    Export(SimpleBuffer),
    /// Memory a Python object owns at `ptr..ptr + len` for as long as it lives (a tensor's
    /// storage, a pinned copy arena).
    Object { _obj: Held, ptr: usize, len: usize },
    /// An item's tensor copies, in memory of our own.
    Arena(CopyArena),
}

impl Keeper {
    /// The object's bytes at `ptr..ptr + len`, kept alive by holding it.
    pub(super) fn object(obj: &Bound<'_, PyAny>, ptr: *const u8, len: usize) -> Self {
        Keeper::Object {
            _obj: Held(Some(obj.clone().unbind())),
            ptr: ptr as usize,
            len,
        }
    }

    /// A lease's payload: a zero-copy view when the lease protects it, else (a replayed
    /// handle) a verified private copy.
    pub(super) fn from_lease(py: Python<'_>, lease: Lease) -> PyResult<Self> {
        match lease.into_view() {
            Ok(view) => Ok(Keeper::Ring(view)),
            Err(lease) => {
                let mut copy = vec![0u8; lease.len()];
                copying(py, copy.len(), || lease.copy_to(&mut copy))?;
                Ok(Keeper::Copy(copy))
            }
        }
    }

    pub(super) fn ptr(&self) -> *const u8 {
        match self {
            Keeper::Ring(view) => view.ptr(),
            Keeper::Copy(v) => v.as_ptr(),
            Keeper::Export(buffer) => buffer.ptr(),
            Keeper::Object { ptr, .. } => *ptr as *const u8,
            Keeper::Arena(arena) => arena.start,
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Keeper::Ring(view) => view.len(),
            Keeper::Copy(v) => v.len(),
            Keeper::Export(buffer) => buffer.len(),
            Keeper::Object { len, .. } => *len,
            Keeper::Arena(arena) => arena.len,
        }
    }

    /// The bytes for `Writer::put_raw`, which only ever copies from them (another thread may
    /// write a caller's memory while the GIL is released).
    pub(super) fn raw(&self) -> RawBytes<'_> {
        match (self.ptr(), self.len()) {
            // An empty tensor's data pointer may be null.
            (_, 0) => RawBytes::from(&[][..]),
            // SAFETY: `self` keeps the memory alive and readable for `len` bytes (a lease, our
            // own copy, an open export, or a live object owning it) while it is borrowed.
            (ptr, len) => unsafe { RawBytes::new(ptr, len) },
        }
    }

    /// Copy `dst.len()` bytes starting `offset` bytes in.
    pub(super) fn read_at(&self, offset: u64, dst: &mut [u8]) -> PyResult<()> {
        self.read_at_uninit(offset, written_whole(dst))
    }

    /// [`Keeper::read_at`] into memory not written yet (a new `bytes` object, the copy
    /// arena, a new array).
    pub(super) fn read_at_uninit(&self, offset: u64, dst: &mut [MaybeUninit<u8>]) -> PyResult<()> {
        let start = offset as usize;
        if start
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len())
        {
            return Err(FormatError("a part lies outside the payload".into()).into());
        }
        match self {
            // Shared memory: the core's raw copy, never a slice over it.
            Keeper::Ring(view) => view.read_at_uninit(offset, dst)?,
            // SAFETY: the range is inside memory `self` keeps alive (checked above); `dst` is
            // distinct memory of our own. A raw copy forms no reference to bytes another
            // thread may be writing (nor to `dst`, not yet written).
            Keeper::Copy(_) | Keeper::Export(_) | Keeper::Object { .. } | Keeper::Arena(_) => unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr().add(start),
                    dst.as_mut_ptr().cast::<u8>(),
                    dst.len(),
                )
            },
        }
        Ok(())
    }

    /// Whether views of these bytes may write them: only a caller's buffer whose export is
    /// writable (a `bytearray` payload), never the ring or a private copy.
    fn writable(&self) -> bool {
        matches!(self, Keeper::Export(buffer) if buffer.writable())
    }

    fn kind(&self) -> &'static str {
        match self {
            Keeper::Ring(_) => "shared",
            Keeper::Copy(_) | Keeper::Arena(_) => "copy",
            Keeper::Export(_) | Keeper::Object { .. } => "borrowed",
        }
    }
}

/// A zero-copy view of one object's bytes (buffer protocol): read-only, except over a
/// caller's writable buffer (the base of `decode_item`'s zero-copy arrays).
#[pyclass(frozen, module = "mmcache._core")]
pub(crate) struct ShmView {
    /// Shared with the tensors a decoded item hands out over the same bytes.
    keep: Arc<Keeper>,
}

impl ShmView {
    pub(super) fn new(keep: Arc<Keeper>) -> Self {
        ShmView { keep }
    }
}

#[pymethods]
impl ShmView {
    fn __len__(&self) -> usize {
        self.keep.len()
    }

    fn __repr__(&self) -> String {
        format!("ShmView({} bytes, {})", self.keep.len(), self.keep.kind())
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let keep = &slf.get().keep;
        let (ptr, len, writable) = (keep.ptr(), keep.len(), keep.writable());
        // SAFETY: forwarded from this method's contract; the bytes live as long as `slf`,
        // whose keeper holds them and which the export references; they are writable only
        // where the keeper's own export is.
        unsafe { export_bytes(slf.into_any(), view, flags, ptr, len, writable) }
    }
}

/// A read-only view of one part of an encoded item (a tensor's, array's or `bytes` value's
/// bytes, in place), keeping the object that holds them alive.
#[pyclass(frozen, module = "mmcache._core")]
pub(crate) struct PartView {
    keep: Keeper,
}

impl PartView {
    pub(super) fn new(keep: Keeper) -> Self {
        PartView { keep }
    }
}

#[pymethods]
impl PartView {
    fn __len__(&self) -> usize {
        self.keep.len()
    }

    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let keep = &slf.get().keep;
        let (ptr, len) = (keep.ptr(), keep.len());
        // SAFETY: forwarded from this method's contract; the bytes live as long as `slf`,
        // whose keeper holds them and which the export references.
        unsafe { export_bytes(slf.into_any(), view, flags, ptr, len, false) }
    }
}

/// Fill `view` with `len` bytes at `ptr`, owned by `owner`, writable if `writable` (what
/// `__getbuffer__` of a one-dimensional byte exporter does).
///
/// # Safety
/// `view` is the Py_buffer the interpreter passed to `__getbuffer__`; `ptr..ptr+len` stays
/// valid for as long as `owner` lives, and unchanged by anyone else unless `writable` (its
/// memory is then a caller's writable buffer, theirs to write).
unsafe fn export_bytes(
    owner: Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    ptr: *const u8,
    len: usize,
    writable: bool,
) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("view is null"));
    }
    if !writable && flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
        return Err(PyBufferError::new_err(format!(
            "{} is read-only",
            owner.get_type().qualname()?
        )));
    }
    // SAFETY: `view` is a non-null Py_buffer the interpreter asked us to fill. We store a
    // strong reference to `owner` in `obj`, so the bytes outlive every consumer of the
    // buffer (the caller's contract). The memory is exposed read-only unless the caller's own
    // export of it is writable; the shape/strides pointers point into the Py_buffer itself,
    // as CPython's own 1-D exporters do, and the format is a static string, so nothing needs
    // freeing.
    unsafe {
        (*view).obj = owner.into_ptr();
        (*view).buf = ptr.cast_mut().cast();
        (*view).len = len as isize;
        (*view).readonly = c_int::from(!writable);
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

/// Borrow every part of `data` (one buffer, or a list/tuple of them) as C-contiguous bytes.
pub(super) fn collect_buffers(data: &Bound<'_, PyAny>) -> PyResult<Vec<PyUntypedBuffer>> {
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

/// The bytes of `collect_buffers`' exports, for `Writer::put_raw`.
pub(super) fn raw_parts(buffers: &[PyUntypedBuffer]) -> Vec<RawBytes<'_>> {
    buffers
        .iter()
        // SAFETY: each buffer is C-contiguous (checked by `collect_buffers`) and pinned by its
        // PyUntypedBuffer, borrowed for as long as the `RawBytes`, so `len_bytes` bytes at
        // `buf_ptr` stay readable meanwhile (the buffer protocol forbids resizing an exported
        // buffer). Another thread may write them while the GIL is released: `RawBytes` only
        // ever copies from them, never forms a slice.
        .map(|b| unsafe { RawBytes::new(b.buf_ptr().cast::<u8>(), b.len_bytes()) })
        .collect()
}
