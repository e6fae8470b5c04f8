//! # mmcache core
//!
//! A lock-free, single-writer, multi-reader object store in one named POSIX shared-memory
//! segment, for moving processed multimodal items (tensors) from an LLM engine's frontend to
//! its GPU workers without copying them through pipes.
//!
//! Layers, bottom up (see ARCHITECTURE.md):
//!
//! * [`segment`] — creating, opening and unlinking segments, and every raw access to their
//!   bytes; names, processes and the other operating-system services around them.
//! * [`layout`] — where every field lives, the one table of the store's counters, where each
//!   part of a payload starts; header validation.
//! * [`ring`] — the writer's allocator (pure, writer-private).
//! * [`handle`] — keyed signatures of `(key, address, monotonic id)`.
//! * [`store`] — the protocol: references, acknowledgements, leases, eviction; one file per
//!   side (writer, reader, inspect).
//! * [`codec`] — the payload format of one item (header + parts), encoded and parsed.
//! * `python` (feature `python`) — the thin PyO3 module `mmcache._core`.
//!
//! # Where `unsafe` lives
//!
//! In two modules, and the compiler holds every other one to that (`deny(unsafe_code)`):
//!
//! * [`segment`] (with its submodules): the operating system (`libc` calls, signal handlers,
//!   the fork handlers) and shared memory (atomics and raw copies over the mapping);
//! * `python`: the Python binding's buffer protocol (exports, and copies from callers'
//!   buffers) and DLPack.
//!
//! Every `unsafe` block carries a `// SAFETY:` comment; bytes another process or thread may
//! write or free are never borrowed as Rust slices.

#![deny(unsafe_code)]

#[cfg(not(target_has_atomic = "64"))]
compile_error!("mmcache needs lock-free 64-bit atomics");

pub mod codec;
pub mod error;
pub mod handle;
pub mod layout;
pub mod ring;
#[allow(unsafe_code)]
pub mod segment;
pub mod store;

#[cfg(feature = "python")]
#[allow(unsafe_code)]
mod python;

pub use error::{Error, Result};
pub use handle::Handle;
pub use store::{Lease, Reader, ReaderInfo, Writer};
