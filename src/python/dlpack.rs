//! The DLPack crossing: a `"dltensor"` capsule over bytes we keep alive, which torch imports
//! as a tensor without copying (and, unlike a read-only buffer, without a warning).
//!
//! All of it is `unsafe` FFI: the C structs of dlpack.h, a leaked box that torch owns once it
//! consumes the capsule, and the two destructors that free it exactly once (torch's call of
//! the deleter, or the capsule's destructor if nobody consumed it). Nothing here knows about
//! torch's dtypes (`frameworks.rs`) or about payloads (`decode.rs`).

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use super::buffer::Keeper;

/// DLPack type codes (dlpack.h, `DLDataTypeCode`).
pub(super) const DL_INT: u8 = 0;
pub(super) const DL_UINT: u8 = 1;
pub(super) const DL_FLOAT: u8 = 2;
pub(super) const DL_BFLOAT: u8 = 4;
pub(super) const DL_COMPLEX: u8 = 5;
pub(super) const DL_BOOL: u8 = 6;
pub(super) const DL_FLOAT8_E4M3FN: u8 = 10;
pub(super) const DL_FLOAT8_E4M3FNUZ: u8 = 11;
pub(super) const DL_FLOAT8_E5M2: u8 = 12;
pub(super) const DL_FLOAT8_E5M2FNUZ: u8 = 13;
pub(super) const DL_FLOAT8_E8M0FNU: u8 = 14;
pub(super) const DL_FLOAT4_E2M1FN: u8 = 17;
/// `DLDeviceType::kDLCPU`.
const DL_CPU: i32 = 1;

/// dlpack.h's `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct DlType {
    code: u8,
    bits: u8,
    lanes: u16,
}

impl DlType {
    pub(super) const fn new(code: u8, bits: u8, lanes: u16) -> Self {
        DlType { code, bits, lanes }
    }

    /// Plain bytes: what types without a DLPack code travel as.
    pub(super) const BYTES: DlType = DlType::new(DL_UINT, 8, 1);
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

/// Tensors of up to this many dimensions keep their shape and strides in their `Exported`.
const INLINE_NDIM: usize = 4;

/// A tensor's shape, then its strides: inside the `Exported` box when they are few.
enum Sizes {
    Inline([i64; 2 * INLINE_NDIM]),
    Heap(Vec<i64>),
}

impl Sizes {
    /// The `2 * ndim` sizes of `shape`, strides of a C-contiguous tensor.
    fn new(shape: impl ExactSizeIterator<Item = i64>) -> Self {
        let ndim = shape.len();
        let mut sizes = if ndim <= INLINE_NDIM {
            Sizes::Inline([1; 2 * INLINE_NDIM])
        } else {
            Sizes::Heap(vec![1; 2 * ndim])
        };
        let all = sizes.as_mut(ndim);
        for (slot, d) in all.iter_mut().zip(shape) {
            *slot = d;
        }
        for i in (0..ndim.saturating_sub(1)).rev() {
            all[ndim + i] = all[ndim + i + 1].saturating_mul(all[i + 1].max(1));
        }
        sizes
    }

    fn as_mut(&mut self, ndim: usize) -> &mut [i64] {
        match self {
            Sizes::Inline(sizes) => &mut sizes[..2 * ndim],
            Sizes::Heap(sizes) => sizes,
        }
    }
}

/// One tensor handed over: the DLPack struct first (the consumer sees its address), then
/// what its pointers point into and what keeps the data alive.
#[repr(C)]
struct Exported {
    managed: DLManagedTensor,
    sizes: Sizes,
    /// Dropped by the deleter, on whatever thread torch frees the tensor (`Keeper` is
    /// safe to drop there).
    _keep: Arc<Keeper>,
}

/// The DLPack deleter: the consumer calls it once, when the tensor's storage goes.
unsafe extern "C" fn delete_exported(managed: *mut DLManagedTensor) {
    // SAFETY: `managed` is the first field of an `Exported` leaked with `Box::into_raw` in
    // `capsule`, and DLPack calls the deleter exactly once.
    drop(unsafe { Box::from_raw(managed.cast::<Exported>()) });
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

/// A `"dltensor"` capsule of a C-contiguous CPU tensor of `dtype` and `shape` over the bytes
/// at `data`, which `keep` keeps alive (and must hold at least as many bytes as the shape
/// covers) until the consumer frees the tensor.
pub(super) fn capsule<'py>(
    py: Python<'py>,
    data: *mut u8,
    dtype: DlType,
    shape: impl ExactSizeIterator<Item = i64>,
    keep: Arc<Keeper>,
) -> PyResult<Bound<'py, PyAny>> {
    let ndim = shape.len();
    let sizes = Sizes::new(shape);
    let exported = Box::new(Exported {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data.cast(),
                device_type: DL_CPU,
                device_id: 0,
                ndim: ndim as i32,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        sizes,
        _keep: keep,
    });
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is a live `Exported` whose first field is the `DLManagedTensor`; the
    // capsule owns it from here (its destructor or the consumer, through the deleter, frees
    // it), and if no capsule could be made we free it ourselves, once. The shape and
    // strides pointers are taken through `raw`, after the box gave up its contents, which
    // never move again (an inline `Sizes` included): they stay valid for its life.
    unsafe {
        let (shape, strides) = (*raw).sizes.as_mut(ndim).split_at_mut(ndim);
        (*raw).managed.dl_tensor.shape = shape.as_mut_ptr();
        (*raw).managed.dl_tensor.strides = strides.as_mut_ptr();
        (*raw).managed.manager_ctx = raw.cast();
        let capsule = ffi::PyCapsule_New(raw.cast(), DLTENSOR.as_ptr(), Some(destroy_capsule));
        if capsule.is_null() {
            delete_exported(raw.cast());
        }
        Bound::from_owned_ptr_or_err(py, capsule)
    }
}
