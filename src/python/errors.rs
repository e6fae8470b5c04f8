//! The exceptions of `mmcache._core` and the one mapping from the core's errors to them.
//!
//! Each `Error` variant becomes exactly one Python exception: a builtin where users expect
//! one (`ValueError`, `KeyError`, `MemoryError`, ...), or a subclass of it where callers must
//! tell cases apart without parsing messages, else a subclass of `MmcacheError`. The codec's
//! `FormatError` (a payload that is not a valid item) is a `SegmentCorruptError` when
//! decoding; encoding reports it as an `ItemNotEncodableError` naming the field, a class of
//! its own (`encode.rs`).

use pyo3::create_exception;
use pyo3::exceptions::{
    PyException, PyFileExistsError, PyFileNotFoundError, PyKeyError, PyMemoryError, PyOSError,
    PyPermissionError, PyValueError,
};
use pyo3::prelude::*;

use crate::codec::FormatError;
use crate::error::Error;

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
    NoWriterSlotError,
    MmcacheError,
    "Every writer slot of the store is taken (max_writers)."
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
    KeyExistsError,
    PyValueError,
    "A put of a key that is already stored, by this writer or another (a ValueError): with \
     several writers, another writer's put won the race."
);
create_exception!(
    mmcache._core,
    RingFullError,
    PyMemoryError,
    "No room in the ring: every chunk that could hold the object is still unread, pinned or \
     viewed (a MemoryError)."
);
create_exception!(
    mmcache._core,
    ReferencesSaturatedError,
    PyMemoryError,
    "One more reference would overflow a reader's count: that reader already holds the most \
     unread references to the object it can count (a MemoryError; nothing changed)."
);
create_exception!(
    mmcache._core,
    ShmTooSmallError,
    PyMemoryError,
    "The host's /dev/shm cannot hold the segment, for want of bytes or of files (a \
     MemoryError; the message says how to make room)."
);

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let msg = err.to_string();
        match err {
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::DuplicateKey(_) => KeyExistsError::new_err(msg),
            Error::TooLarge { .. } => ObjectTooLargeError::new_err(msg),
            Error::Full { .. } | Error::IndexFull(_) => RingFullError::new_err(msg),
            Error::Saturated { .. } => ReferencesSaturatedError::new_err(msg),
            Error::ShmTooSmall { .. } | Error::ShmNoFiles(_) => ShmTooSmallError::new_err(msg),
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
            Error::NoWriterSlot(_) => NoWriterSlotError::new_err(msg),
            Error::WrongProcess(_) => WrongProcessError::new_err(msg),
            Error::Os { .. } => PyOSError::new_err(msg),
        }
    }
}

/// A payload that does not decode (`encode.rs` maps encoding failures itself).
impl From<FormatError> for PyErr {
    fn from(err: FormatError) -> PyErr {
        SegmentCorruptError::new_err(format!("payload is not a valid mmcache item: {err}"))
    }
}

/// Add every exception class to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("MmcacheError", py.get_type::<MmcacheError>())?;
    m.add("SegmentCorruptError", py.get_type::<SegmentCorruptError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("InvalidHandleError", py.get_type::<InvalidHandleError>())?;
    m.add("StaleHandleError", py.get_type::<StaleHandleError>())?;
    m.add("WriterGoneError", py.get_type::<WriterGoneError>())?;
    m.add("NoReaderSlotError", py.get_type::<NoReaderSlotError>())?;
    m.add("NoWriterSlotError", py.get_type::<NoWriterSlotError>())?;
    m.add("WrongProcessError", py.get_type::<WrongProcessError>())?;
    m.add("ObjectTooLargeError", py.get_type::<ObjectTooLargeError>())?;
    m.add("KeyExistsError", py.get_type::<KeyExistsError>())?;
    m.add("RingFullError", py.get_type::<RingFullError>())?;
    m.add(
        "ReferencesSaturatedError",
        py.get_type::<ReferencesSaturatedError>(),
    )?;
    m.add("ShmTooSmallError", py.get_type::<ShmTooSmallError>())?;
    Ok(())
}
