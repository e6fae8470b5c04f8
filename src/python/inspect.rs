//! Maintenance without attaching: a live segment's counters (`mmcache inspect`), whether a
//! segment's writer is alive (what `mmcache prune` acts on), listing, naming and unlinking.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::args::Name;
use crate::layout::{Liveness, SlotState};
use crate::store;

/// Read a live segment's header, counters, reader and writer slots without attaching (never
/// writes to it).
#[pyfunction]
pub(super) fn inspect_segment<'py>(py: Python<'py>, name: Name) -> PyResult<Bound<'py, PyDict>> {
    let info = store::inspect(&name.0)?;
    let d = PyDict::new(py);
    d.set_item("name", &info.name)?;
    d.set_item("capacity", info.layout.capacity)?;
    d.set_item("total_len", info.total_len)?;
    d.set_item("n_readers", info.layout.n_readers)?;
    d.set_item("max_writers", info.layout.max_writers)?;
    d.set_item("max_objects", info.layout.max_objects)?;
    d.set_item("max_object_size", info.layout.max_object_size)?;
    d.set_item("creator_pid", info.creator_pid)?;
    d.set_item("creator_alive", info.creator_alive)?;
    d.set_item("writer_closed", info.writer_closed)?;
    d.set_item(
        "liveness",
        match info.liveness {
            Liveness::Locks => "locks",
            Liveness::Pids => "pids",
        },
    )?;
    for (k, v) in &info.counters {
        d.set_item(*k, *v)?;
    }
    let readers = PyList::empty(py);
    for s in &info.readers {
        let r = PyDict::new(py);
        r.set_item("slot", s.index)?;
        r.set_item("state", slot_state(s.state))?;
        r.set_item("claimed", s.state == SlotState::Claimed)?;
        r.set_item("pid", s.pid)?;
        r.set_item("alive", s.alive)?;
        r.set_item("refs", s.refs)?;
        r.set_item("acks", s.acks)?;
        r.set_item("outstanding", s.refs.saturating_sub(s.acks))?;
        r.set_item("stale", s.stale)?;
        readers.append(r)?;
    }
    d.set_item("readers", readers)?;
    let writers = PyList::empty(py);
    for s in &info.writers {
        let w = PyDict::new(py);
        w.set_item("slot", s.index)?;
        w.set_item("state", slot_state(s.state))?;
        w.set_item("claimed", s.state == SlotState::Claimed)?;
        w.set_item("pid", s.pid)?;
        w.set_item("epoch", s.epoch)?;
        w.set_item("alive", s.alive)?;
        writers.append(w)?;
    }
    d.set_item("writers", writers)?;
    d.set_item(
        "writers_alive",
        info.writers.iter().filter(|w| w.alive).count(),
    )?;
    Ok(d)
}

fn slot_state(state: SlotState) -> &'static str {
    match state {
        SlotState::Free => "free",
        SlotState::Claimed => "claimed",
        SlotState::Draining => "draining",
    }
}

/// Whether segment `name` is `"live"` (its writer runs, in any PID namespace), `"orphaned"`
/// (safe to remove) or `"undecided"` (leave it for now), and why.
#[pyfunction]
pub(super) fn segment_status(name: Name) -> PyResult<(&'static str, String)> {
    Ok(match store::status(&name.0)? {
        store::Status::Live => ("live", "a writer is alive".to_owned()),
        store::Status::Orphaned(why) => ("orphaned", why),
        store::Status::Undecided(why) => ("undecided", why),
    })
}

/// Names of the segments this package created on this host (live or orphaned).
#[pyfunction]
pub(super) fn list_segments() -> Vec<String> {
    store::list_segments()
}

/// Remove a segment's name (its memory is freed once every process unmaps it).
#[pyfunction]
pub(super) fn unlink_segment(name: Name) -> PyResult<()> {
    Ok(crate::segment::unlink(&name.0)?)
}

/// Remove segment `name` if it is orphaned, judged again while holding a lock that every
/// remover of a segment takes (so the name is not given to a new store in between); whether
/// it did.
#[pyfunction]
pub(super) fn remove_orphaned_segment(name: Name) -> PyResult<bool> {
    Ok(store::remove_if_orphaned(&name.0, false)?)
}

/// A fresh name of the kind `ShmObjectStore.create` generates (`mmc_<this process's
/// pid>_<random>`), for a store another process is to create with it: this one then knows
/// the name even if that process dies while creating it, and can remove what it left.
#[pyfunction]
pub(super) fn generate_segment_name() -> PyResult<String> {
    Ok(crate::segment::generate_name()?)
}

/// Add the maintenance functions to `mmcache._core`.
pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(generate_segment_name, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_segment, m)?)?;
    m.add_function(wrap_pyfunction!(list_segments, m)?)?;
    m.add_function(wrap_pyfunction!(remove_orphaned_segment, m)?)?;
    m.add_function(wrap_pyfunction!(segment_status, m)?)?;
    m.add_function(wrap_pyfunction!(unlink_segment, m)?)?;
    Ok(())
}
