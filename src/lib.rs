//! # mmcache core
//!
//! A lock-free, single-writer, multi-reader object store in one named POSIX shared-memory
//! segment, for moving processed multimodal items (tensors) from an LLM engine's frontend to
//! its GPU workers without copying them through pipes.
//!
//! Layers, bottom up (see ARCHITECTURE.md):
//!
//! * [`segment`] — creating, opening and unlinking segments; the only module with
//!   `unsafe` access to shared memory.
//! * [`layout`] — where every field lives; header validation.
//! * [`ring`] — the writer's allocator (pure, writer-private).
//! * [`handle`] — keyed signatures of `(key, address, monotonic id)`.
//! * [`store`] — the protocol: references, acknowledgements, leases, eviction.
//! * [`codec`] — the payload format of one item (header + parts), encoded and parsed.
//! * `python` (feature `python`) — the thin PyO3 module `mmcache._core`.

#[cfg(not(target_has_atomic = "64"))]
compile_error!("mmcache needs lock-free 64-bit atomics");

pub mod codec;
pub mod error;
pub mod handle;
pub mod layout;
pub mod ring;
pub mod segment;
pub mod store;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
pub use handle::Handle;
pub use store::{Lease, Reader, ReaderInfo, Writer};
