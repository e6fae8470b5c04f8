//! Store tests over real segments, one file per concern, and the helpers they share. One
//! writer: `basics` (puts, reads, handles), `protection` (what keeps an object: references,
//! views, pins, `release`), `readers` (reader slots and liveness), `segments` (headers,
//! `inspect`, orphans), `model` (a proptest state machine against a model). Several writers:
//! `members` (sharing, joining, leaving, metadata), `claims` (single flight, a full index),
//! `crash` (writers that die: their stamps void, a lock they held taken over and repaired),
//! `writers_model` (three writers against a model), `buffers` (allocation buffers), `full` (a
//! ring or index a sweep found nothing in, answered without sweeping again), `lookups`
//! (lock-free lookups meeting a change in progress), `two_locks` (the index and the ring
//! agree after races and deaths), `stats` (the ring counted in slices, the ring lock given
//! back between two). `race`: threads racing (readers against an evicting
//! writer; several writers' threads on the same keys, in a small ring and in one where every
//! object is carved from a buffer).

use std::collections::HashMap;

use super::*;
use crate::handle::Handle;
use crate::layout::Config;

mod basics;
mod buffers;
mod claims;
mod crash;
mod full;
mod lookups;
mod members;
mod model;
mod protection;
mod race;
mod readers;
mod segments;
mod stats;
mod two_locks;
mod writers_model;

fn writer(capacity: u64, n_readers: u32) -> Writer {
    Writer::create(capacity, n_readers, None, None).expect("create segment")
}

/// A store of `capacity` bytes for `N` readers, and those `N` readers attached.
fn writer_with_readers<const N: usize>(capacity: u64) -> (Writer, [Arc<Reader>; N]) {
    let w = writer(capacity, N as u32);
    let info = w.reader_info();
    let readers = std::array::from_fn(|_| Reader::attach(&info).expect("attach"));
    (w, readers)
}

fn read(reader: &Arc<Reader>, handle: &Handle, key: &str) -> Result<Vec<u8>> {
    let lease = reader.acquire(handle, key)?;
    let mut out = vec![0u8; lease.len()];
    lease.copy_to(&mut out)?;
    Ok(out)
}

fn payload(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (tag as usize * 31 + i * 7) as u8)
        .collect()
}

fn stats_of(w: &Writer) -> HashMap<&'static str, u64> {
    w.stats().unwrap().into_iter().collect()
}

/// How many writers the state machine (`writers_model`) and the race (`race`) run.
const WRITERS: usize = 3;

fn store(capacity: u64, n_readers: u32, max_writers: u32) -> Writer {
    let config = Config {
        max_writers,
        ..Config::new(capacity, n_readers, None)
    };
    Writer::create_with(&config, None).expect("create segment")
}

fn join(w: &Writer) -> Writer {
    Writer::join(&w.writer_info()).expect("join")
}

/// Leave a hazard of `w` on `handle`'s object, as a writer that dies while it reads it does
/// (never cleared by `w`).
fn leave_hazard(w: &Writer, handle: &Handle) {
    let entry = index::Entry {
        bucket: 0,
        address: handle.address,
        id: handle.monotonic_id,
    };
    std::mem::forget(w.protect(&entry).unwrap().expect("live"));
}

/// A tiny deterministic generator (xorshift) for the racing threads.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// A store of 8 KiB with a second writer joined and four objects of 500 bytes (`k0`..`k3`,
/// each filled with its number) put by the first: where a test stages the second's death.
fn two_writers_four_objects() -> (Writer, Writer, Vec<Handle>) {
    let a = store(8192, 1, 2);
    let b = join(&a);
    let hs = (0..4)
        .map(|i| a.put(&format!("k{i}"), &[&[i as u8; 500]]).unwrap())
        .collect();
    (a, b, hs)
}

/// What the kernel does when a writer's process dies: its OFD locks go, and nothing else
/// happens (its slot stays claimed, its stamps stay where they are). The writer is then
/// dropped without leaving the store.
fn pretend_writer_dead(w: Writer) {
    let l = w.shared.layout;
    w.shared.seg.unlock(l.writer_slot_lock(w.me.slot)).unwrap();
    w.shared.seg.unlock(WRITER_LOCK).unwrap();
    w.closing.store(true, Ordering::Relaxed);
    drop(w);
}
