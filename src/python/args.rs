//! Integer arguments whose range errors name the argument, and segment names whose type
//! errors do.
//!
//! PyO3 turns a Python int that does not fit the Rust type (`-1` for a `u64`, `2**70`) into an
//! `OverflowError` that names neither the argument nor what it takes ("can't convert negative
//! int to unsigned", "out of range integral type conversion attempted"), and anything that is
//! not an int (`n_readers="2"`, read from an environment variable) into a `TypeError` whose
//! message names no argument either ("'str' object cannot be interpreted as an integer": PyO3
//! names it in a note, which a log of the message loses). `Int<A>` is a `u64` argument whose
//! out-of-range value is a `ValueError` saying which argument and what range, like the core's
//! own refusals of in-range values, and whose value of another type is a `TypeError` saying
//! the same. `Name` is a segment name argument, for the same reasons (see there).

use std::marker::PhantomData;

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

/// The name of an integer argument and the values it takes, for its error message.
pub(super) trait Named {
    const NAME: &'static str;
    const RANGE: &'static str;
}

/// A non-negative integer argument of at most 64 bits (see the module).
pub(super) struct Int<A>(u64, PhantomData<A>);

impl<A: Named> Int<A> {
    pub(super) const fn new(value: u64) -> Self {
        Int(value, PhantomData)
    }

    pub(super) fn get(&self) -> u64 {
        self.0
    }

    /// The value as a `u32` (the core's counts of readers and writers), a `ValueError` like
    /// an out-of-range int beyond it.
    pub(super) fn get_u32(&self) -> PyResult<u32> {
        u32::try_from(self.0).map_err(|_| out_of_range::<A>(&self.0))
    }
}

fn out_of_range<A: Named>(value: &dyn std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{} must be {}, got {value}", A::NAME, A::RANGE))
}

impl<'a, 'py, A: Named> FromPyObject<'a, 'py> for Int<A> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<u64>() {
            Ok(value) => Ok(Int::new(value)),
            Err(err) if err.is_instance_of::<PyOverflowError>(obj.py()) => {
                Err(out_of_range::<A>(&*obj))
            }
            Err(err) if err.is_instance_of::<PyTypeError>(obj.py()) => {
                Err(PyTypeError::new_err(format!(
                    "{} must be an int ({}), not {}",
                    A::NAME,
                    A::RANGE,
                    obj.get_type().qualname()?
                )))
            }
            Err(err) => Err(err),
        }
    }
}

/// A segment name argument (`name`): a `str` of UTF-8. Anything else is a `TypeError` saying
/// so and naming `name` (PyO3's own, "'int' object is not an instance of 'str'", names it only
/// in a note), and a `str` with a lone surrogate (how Python decodes a file name that is not
/// UTF-8: `os.listdir`, `sys.argv`) a `ValueError` naming it, not a `UnicodeEncodeError` about
/// a codec: no segment has such a name (every name this package makes is UTF-8, so a file
/// in `/dev/shm` whose name is not is never one of its segments).
pub(super) struct Name(pub(super) String);

impl<'a, 'py> FromPyObject<'a, 'py> for Name {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let Ok(name) = obj.cast::<PyString>() else {
            return Err(PyTypeError::new_err(format!(
                "name must be a str (a segment's file name in /dev/shm), not {}",
                obj.get_type().qualname()?
            )));
        };
        match name.to_str() {
            Ok(name) => Ok(Name(name.to_owned())),
            Err(_) => Err(PyValueError::new_err(format!(
                "name {} is not valid UTF-8 (it has a lone surrogate): a segment name is UTF-8, \
                 so a file in /dev/shm whose name is not is no mmcache segment",
                name.repr()?
            ))),
        }
    }
}

/// Declare marker types for `Int`: `name: "argument", "range"`.
macro_rules! named {
    ($($marker:ident: $name:literal, $range:literal;)*) => {
        $(
            pub(super) struct $marker;
            impl Named for $marker {
                const NAME: &'static str = $name;
                const RANGE: &'static str = $range;
            }
        )*
    };
}

named! {
    Capacity: "capacity", "a number of bytes from 1 to 2**44";
    NReaders: "n_readers", "between 1 and 64";
    MaxWriters: "max_writers", "between 1 and 64";
    MaxObjectSize: "max_object_size", "a positive number of bytes";
    MaxObjects: "max_objects", "between 1 and 67108864";
    Address: "address", "an integer in [0, 2**64)";
    MonotonicId: "monotonic_id", "an integer in [0, 2**64)";
    LayoutVersion: "layout_version", "an integer in [0, 2**64)";
    Pinned: "pinned", "a monotonic id from pin_object (an integer in [0, 2**64))";
}

// The ranges above are the core's.
const _: () = assert!(crate::layout::MAX_READERS == 64 && crate::layout::MAX_WRITERS == 64);
const _: () = assert!(crate::layout::MAX_OBJECTS == 67_108_864);
