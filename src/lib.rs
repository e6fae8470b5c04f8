//! # mmcache core
//!
//! An object store in one named POSIX shared-memory segment, for moving processed multimodal
//! items (tensors) from an LLM engine's frontends to its GPU workers without copying them
//! through pipes: one or more writer processes (each with any number of threads) share one
//! key index and one ring; readers resolve handles lock-free.
//!
//! Layers, bottom up (see ARCHITECTURE.md):
//!
//! * [`segment`] — creating, opening and unlinking segments, and every raw access to their
//!   bytes; names, processes and the other operating-system services around them.
//! * [`layout`] — where every field lives, the one table of the store's counters, where each
//!   part of a payload starts; header validation.
//! * [`handle`] — keyed signatures of `(key, address, monotonic id)`.
//! * [`keyhash`] — the key index's fast keyed hash.
//! * [`store`] — the protocol: the shared key index, the ring's allocator and its lock,
//!   references, acknowledgements, leases, eviction; one file per concern.
//! * [`codec`] — the payload format of one item (header + parts), encoded and parsed.
//! * `python` (feature `python`) — the PyO3 module `mmcache._core`, one concern per file.
//!
//! # Where `unsafe` lives
//!
//! In two modules, and the compiler holds every other one to that (`deny(unsafe_code)`):
//!
//! * [`segment`] (with its submodules): the operating system (`libc` calls, signal handlers,
//!   the fork handlers) and shared memory (atomics and raw copies over the mapping);
//! * `python`: the Python binding's buffer protocol (exports, and copies from callers'
//!   buffers), the copy arena, DLPack, C functions called and defined without PyO3's
//!   wrappers (`is_cached_item`, torch's DLPack import), and `Open::with` (a GIL-held
//!   borrow of a store's endpoint).
//!
//! Every `unsafe` block carries a `// SAFETY:` comment; bytes another process or thread may
//! write or free are never borrowed as Rust slices.

#![deny(unsafe_code)]

#[cfg(not(target_has_atomic = "64"))]
compile_error!("mmcache needs lock-free 64-bit atomics");
// A lock's futex word is the low half of a 64-bit field.
#[cfg(not(target_endian = "little"))]
compile_error!("mmcache's segment layout is little-endian");

pub mod codec;
pub mod error;
pub mod handle;
pub mod keyhash;
pub mod layout;
#[allow(unsafe_code)]
pub mod segment;
pub mod store;

#[cfg(feature = "python")]
#[allow(unsafe_code)]
mod python;

pub use error::{Error, Result};
pub use handle::Handle;
pub use store::{Lease, Reader, ReaderInfo, Writer, WriterInfo};
