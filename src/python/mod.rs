//! `mmcache._core`: the PyO3 layer over the core. Argument conversion, the buffer protocol
//! (in and out), DLPack, the item codec's walk over Python objects, releasing the GIL around
//! large copies, and mapping errors to Python exceptions — one concern per file; the store's
//! rules stay in the core:
//!
//! * `args` — integer arguments whose range errors name the argument;
//! * `errors` — the exceptions, and the one mapping of the core's `Error` to them;
//! * `handles` — `ShmHandle`, `ReaderHandle`, `WriterHandle`;
//! * `store` — `ShmObjectStore` and its reader role, `ShmReader`;
//! * `writer` — its writer role, `ShmWriter`;
//! * `buffer` — what keeps exported bytes alive (`Keeper`), `ShmView`, `PartView`, imports;
//! * `dlpack` — the DLPack FFI that hands bytes to torch without a copy;
//! * `frameworks` — numpy and torch, their dtype tables;
//! * `encode`, `decode` — the item codec's Python side (the format is `crate::codec`);
//! * `inspect` — maintenance functions (inspect, status, list, unlink).
//!
//! Besides `segment`, only this module has `unsafe` code, in `buffer` and `dlpack`, the
//! copies and padding writes of `decode`, the direct calls of `frameworks` (a `METH_O`
//! builtin's C function) and `writer` (`CachedItemCheck`'s C method), and `Open::with` in
//! `store`: the crossings PyO3 cannot express safely.

use pyo3::prelude::*;

mod args;
mod buffer;
mod decode;
mod dlpack;
mod encode;
mod errors;
mod frameworks;
mod handles;
mod inspect;
mod store;
mod writer;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LAYOUT_VERSION", crate::layout::LAYOUT_VERSION)?;
    m.add("PART_ALIGNMENT", crate::layout::ALIGN)?;
    m.add("MAX_WRITERS", crate::layout::MAX_WRITERS)?;
    m.add("OUT_OF_BAND_BYTES", crate::codec::OUT_OF_BAND_BYTES)?;
    m.add("PAYLOAD_FORMAT_VERSION", crate::codec::FORMAT_VERSION)?;
    m.add(
        "CRASH_POINTS",
        pyo3::types::PyTuple::new(m.py(), crate::store::CRASH_POINTS)?,
    )?;
    errors::register(m)?;
    handles::register(m)?;
    store::register(m)?;
    encode::register(m)?;
    decode::register(m)?;
    inspect::register(m)?;
    Ok(())
}
