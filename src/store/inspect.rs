//! Reading a segment without attaching: `inspect` (its header, counters, reader and writer
//! slots), `list_segments` (what this package left in `/dev/shm`) and `status` (whether any
//! of a segment's writers lives: what `prune` decides).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::shared_over;
use crate::error::{Error, Result};
use crate::layout::{
    self, Counter, LAYOUT_VERSION, Layout, Liveness, MEMBERSHIP_LOCK, STORE_CLOSED, STORE_LIVE,
    SlotState, WRITER_LOCK, WriterId, header, slot,
};
use crate::segment::{self, Segment};

/// One reader slot as `inspect` sees it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub index: u32,
    pub state: SlotState,
    pub epoch: u32,
    /// The occupant's pid in its own PID namespace (0 when free).
    pub pid: u32,
    pub alive: bool,
    pub refs: u64,
    pub acks: u64,
    pub stale: u64,
}

/// One writer slot as `inspect` sees it.
#[derive(Debug, Clone)]
pub struct WriterSlotInfo {
    pub index: u32,
    pub state: SlotState,
    pub epoch: u32,
    /// The occupant's pid in its own PID namespace (0 when free).
    pub pid: u32,
    pub alive: bool,
}

/// A segment's header, read from a private copy of its header and slot tables (no slot
/// claimed, nothing written).
#[derive(Debug, Clone)]
pub struct SegmentInfo {
    pub name: String,
    pub layout: Layout,
    pub liveness: Liveness,
    pub total_len: u64,
    pub creator_pid: u64,
    /// Whether any writer of the store lives.
    pub creator_alive: bool,
    /// Whether the last writer closed the store.
    pub writer_closed: bool,
    /// Every [`Counter`], by name, in the table's order.
    pub counters: Vec<(&'static str, u64)>,
    pub readers: Vec<SlotInfo>,
    pub writers: Vec<WriterSlotInfo>,
}

/// Read the header, counters, reader and writer slots of the segment `name` (see
/// [`SegmentInfo`]).
pub fn inspect(name: &str) -> Result<SegmentInfo> {
    // Read from a copy of the header and the slot tables, not through a mapping of the file:
    // whoever can write it may shrink it meanwhile, a SIGBUS under a mapping.
    let (len, bytes) = segment::read_start::<{ header::READER_TABLE as usize }>(name)?;
    if len == 0 {
        return Err(empty_file(name));
    }
    if let Some(word) = foreign_first_word(name, len, &bytes) {
        // Not a damaged segment to recreate (what validation would say): someone else's file.
        return Err(Error::NotASegment(format!(
            "{}/{name} is another program's file (it starts with {word:#018x}, not as a \
             segment does)",
            segment::SHM_DIR
        )));
    }
    let (layout, _) = Layout::read_bytes(len, &bytes)?;
    let tables = usize::try_from(layout.bucket_offset(0))
        .map_err(|_| Error::Corrupt("slot tables larger than this host's memory".into()))?;
    let sh = shared_over(Segment::snapshot(name, tables)?)?;
    let load = |field: u64| -> Result<u64> { Ok(sh.header(field)?.load(Ordering::Acquire)) };
    let writer_closed = load(header::STORE_STATE)? == STORE_CLOSED;
    let mut readers = Vec::new();
    for s in 0..sh.layout.n_readers {
        let (_, claim) = sh.claim(s)?;
        readers.push(SlotInfo {
            index: s,
            state: claim.state,
            epoch: claim.epoch,
            pid: claim.pid,
            alive: claim.is_occupied() && sh.occupant_alive(s, claim)?,
            refs: sh.slot(s, slot::REFS)?.load(Ordering::Relaxed),
            acks: sh.slot(s, slot::ACKS)?.load(Ordering::Relaxed),
            stale: sh.slot(s, slot::STALE)?.load(Ordering::Relaxed),
        });
    }
    let mut writers = Vec::new();
    for s in 0..sh.layout.max_writers {
        let (_, claim) = sh.writer_claim(s)?;
        let writer = WriterId {
            slot: s,
            epoch: claim.epoch,
        };
        writers.push(WriterSlotInfo {
            index: s,
            state: claim.state,
            epoch: claim.epoch,
            pid: claim.pid,
            alive: claim.is_occupied() && sh.writer_alive(writer)?,
        });
    }
    let counters = Counter::ALL
        .iter()
        .map(|&c| Ok((c.name(), sh.counter_value(c)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(SegmentInfo {
        name: sh.seg.name().to_owned(),
        total_len: sh.layout.total_len(),
        layout: sh.layout,
        liveness: sh.liveness,
        creator_pid: load(header::CREATOR_PID)?,
        creator_alive: sh.any_writer_alive()?,
        writer_closed,
        counters,
        readers,
        writers,
    })
}

/// What `inspect` says of an empty file: not a segment yet, and what becomes of it (rather
/// than "corrupt ... recreate the cache", which a creation under its name refused while its
/// creator might still be making it).
fn empty_file(name: &str) -> Error {
    let holder = match segment::probe_file(name, WRITER_LOCK) {
        Ok(probe) if probe.creator_lock_held => {
            "its creator holds it, about to give it a size".to_owned()
        }
        _ => format!(
            "no process holds it: its creator was killed before giving it a size (or is \
             between creating and locking it); a store created under this name takes it over \
             once it is {CREATION_GRACE_SECS} s old, and `mmcache prune` removes it under a \
             generated (mmc_) name only (under a chosen one it may be another program's file)"
        ),
    };
    Error::NotASegment(format!(
        "{}/{name} is empty (0 bytes), no store yet; {holder}",
        segment::SHM_DIR
    ))
}

/// Names in `/dev/shm` that this package made: generated names (`mmc_…`, whatever their
/// content: a truncated or half-made segment has lost or not yet got its magic) and any
/// regular file that starts with this package's magic (segments created with a chosen name).
/// A file whose name is not UTF-8 is never listed: every name this package makes is UTF-8
/// (names are `str`s), so such a file is another program's, whatever it holds.
pub fn list_segments() -> Vec<String> {
    segment::list_files(
        |name| name.starts_with(segment::NAME_PREFIX),
        |first: &[u8; 8]| u64::from_le_bytes(*first) == layout::MAGIC,
    )
}

/// Seconds a file that holds no writer lock and is not (yet) a valid segment is given to
/// become one where its creator cannot be seen: the instant between `shm_open` and the
/// creator's lock (the file is still empty then: the creator locks before it sizes the file),
/// or, where the kernel has no OFD locks, the whole creation.
const CREATION_GRACE_SECS: u64 = 10;

/// Whether a segment's writer lives, as `prune` must decide it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// One of its writers is alive (in any PID namespace): never remove it.
    Live,
    /// Nobody will use it again: safe to remove. Says why.
    Orphaned(String),
    /// Cannot be decided now (being created, or made by another version whose creator may
    /// run): leave it. Says why.
    Undecided(String),
}

/// Decide whether the segment `name` is left behind. A writer's (shared) lock, held in any
/// PID namespace by any of its writers, always means `Live`. The creator takes it before it
/// gives the file a size, so a file that had a size while the lock was free is orphaned at
/// once, valid or half-made; only an empty one is given ten seconds (`CREATION_GRACE_SECS`). A segment
/// of the pid fallback (one writer), or of another layout version, is judged by its
/// creator's pid (one of another version by the pid in its generated name; under a chosen
/// name it is left).
pub fn status(name: &str) -> Result<Status> {
    // The size is read before the lock is tested (see `probe_file`).
    let probe = segment::probe_file(name, WRITER_LOCK)?;
    if probe.creator_lock_held {
        return Ok(Status::Live);
    }
    // The header is read, not mapped: this runs in every store's creation, on any file in
    // /dev/shm that looks like a segment, and whoever can write one may shrink it under a
    // mapping (a SIGBUS, which would kill the process creating a store).
    let header = segment::read_start::<{ header::READER_TABLE as usize }>(name);
    // What was read, for the rules below if it is no valid segment of this build.
    let read = header.as_ref().ok().copied();
    let err = match header.and_then(|(len, bytes)| Ok((Layout::read_bytes(len, &bytes)?, bytes))) {
        // A creator that finished creating after the probe holds its lock now.
        Ok(((_, Liveness::Locks), _))
            if segment::probe_file(name, WRITER_LOCK)?.creator_lock_held =>
        {
            return Ok(Status::Live);
        }
        Ok(((_, Liveness::Locks), _)) => {
            return Ok(Status::Orphaned("every writer is gone".into()));
        }
        // The pid fallback (no OFD locks: one writer), judged by its header words as
        // `Shared::any_writer_alive` judges it.
        Ok(((_, Liveness::Pids), bytes)) => {
            let word = |offset: u64| word_at(&bytes, offset);
            let alive = word(header::STORE_STATE) == STORE_LIVE
                && segment::process_alive(
                    word(header::CREATOR_PID) as u32,
                    word(header::CREATOR_START),
                );
            return Ok(if alive {
                Status::Live
            } else {
                Status::Orphaned("its writer's process is gone".into())
            });
        }
        Err(Error::NotFound(n)) => return Err(Error::NotFound(n)),
        Err(err) => err,
    };
    // Not a valid segment of this build: another version's, damaged, or half-made.
    let ours = read.filter(|(len, bytes)| {
        *len as u64 >= header::CREATOR_START + 8 && word_at(bytes, header::MAGIC) == layout::MAGIC
    });
    if let Some((_, bytes)) = ours {
        let word = |offset: u64| word_at(&bytes, offset);
        if word(header::VERSION) != LAYOUT_VERSION {
            // Made by another version, which may not take locks: trust its name's pid. A
            // name its creator chose carries none, and nothing else tells whether that
            // creator runs (that version's header is not ours to read): leave it.
            return Ok(match segment::pid_in_name(name) {
                Some(pid) if segment::pid_exists(pid) => Status::Undecided(format!(
                    "made by another mmcache version; its creator (pid {pid}) may still run"
                )),
                Some(_) => Status::Orphaned("made by another mmcache version, creator gone".into()),
                None => Status::Undecided(
                    "made by another mmcache version under a chosen name, which does not \
                     tell whether its creator still runs"
                        .into(),
                ),
            });
        }
        // Its liveness word may be what is damaged: the pid fallback's rule still holds.
        let pid = word(header::CREATOR_PID);
        let start = word(header::CREATOR_START);
        if u32::try_from(pid).is_ok_and(|pid| segment::process_alive(pid, start)) {
            return Ok(Status::Undecided(format!(
                "{err}; its creator (pid {pid}) still runs"
            )));
        }
    }
    // Another program's file is never ours to remove (a creation under that name finds it
    // taken).
    if read.is_some_and(|(len, bytes)| foreign_first_word(name, len, &bytes).is_some()) {
        return Ok(Status::Undecided(format!(
            "{err}; not an mmcache segment (another program's file?), never removed"
        )));
    }
    // Empty or garbage: a creator that died half-way, unless it may still be creating it.
    if in_creation_grace(&probe) {
        return Ok(Status::Undecided("new: it may be being created".into()));
    }
    Ok(Status::Orphaned(format!("{err}; no writer holds it")))
}

/// The first word of the file `name` (`len` bytes, starting with `bytes`) if it shows that
/// the file is no segment at all but another program's: under a name its creator chose (no
/// prefix of ours), a first word that is neither the magic nor the zeros a creator killed
/// before writing it leaves. Under our prefix, garbage is a damaged segment of ours.
fn foreign_first_word(name: &str, len: usize, bytes: &[u8]) -> Option<u64> {
    let word = word_at(bytes, header::MAGIC);
    (!name.starts_with(segment::NAME_PREFIX) && len > 0 && word != 0 && word != layout::MAGIC)
        .then_some(word)
}

/// Whether a file no writer lock holds may still be being created (see
/// [`CREATION_GRACE_SECS`]): young, and empty or on a kernel without OFD locks.
fn in_creation_grace(probe: &segment::FileProbe) -> bool {
    probe.age_secs < CREATION_GRACE_SECS && (probe.size == 0 || !probe.locks_supported)
}

/// Wait, for at most [`CREATION_GRACE_SECS`], while `name` is an empty file that no writer
/// holds and that may still be being created: what a creation under a chosen name does
/// before it judges the file there, so that a store restarted under its name right after its
/// creator was killed before sizing the file takes that file over (it was a
/// `FileExistsError` until the file was ten seconds old). Returns as soon as the file is
/// gone, sized, locked (a creator is making it: the name is taken) or old enough to judge.
pub(super) fn wait_out_creation_grace(name: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(CREATION_GRACE_SECS);
    while std::time::Instant::now() < deadline {
        match segment::probe_file(name, WRITER_LOCK) {
            Ok(probe)
                if probe.size == 0 && !probe.creator_lock_held && in_creation_grace(&probe) =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            _ => return,
        }
    }
}

/// The little-endian word at `offset` of `bytes` (0 past their end).
fn word_at(bytes: &[u8], offset: u64) -> u64 {
    usize::try_from(offset)
        .ok()
        .and_then(|at| bytes.get(at..at.checked_add(8)?))
        .and_then(|word| <[u8; 8]>::try_from(word).ok())
        .map_or(0, u64::from_le_bytes)
}

/// Unlink every segment [`status`] finds orphaned, and return their names: what every new
/// store's creation does first, so that no segment outlives the processes that used it for
/// longer than it takes the host to make its next store. Cheap enough for that: one
/// directory listing, then a lock probe (a few system calls) per segment; only segments
/// without a writer lock are mapped. Never fails: a segment it cannot judge or unlink is
/// left for `prune` to report.
pub fn remove_orphans() -> Vec<String> {
    list_segments()
        .into_iter()
        .filter(|name| matches!(status(name), Ok(Status::Orphaned(_))))
        .filter(|name| remove_if_orphaned(name, false).unwrap_or(false))
        .collect()
}

/// How long [`remove_if_orphaned`] waits, if asked to, for whoever else holds the lock it
/// takes: a joiner, a leaving writer or another remover holds it for a few system calls; a
/// file of that name that another program keeps locked must not hold it up for ever.
const REMOVER_WAIT: Duration = Duration::from_secs(5);

/// Remove segment `name` if [`status`] finds it orphaned, judged while holding the exclusive
/// [`MEMBERSHIP_LOCK`] of the file the name refers to: no writer can join it meanwhile, and
/// nobody else can remove the name (every remover holds that lock, a last writer leaving
/// included), so the name cannot be given to a new store between the verdict and the removal.
/// Returns whether it removed it; `false` when the name is gone, is another file than when
/// locked, is not orphaned, or is being joined, left or removed by someone (with `wait`: for
/// longer than five seconds, `REMOVER_WAIT`).
pub fn remove_if_orphaned(name: &str, wait: bool) -> Result<bool> {
    let wait = if wait { REMOVER_WAIT } else { Duration::ZERO };
    let Some(lock) = segment::NameLock::take(name, MEMBERSHIP_LOCK, wait)? else {
        return Ok(false);
    };
    if !lock.still_named()? || !matches!(status(name)?, Status::Orphaned(_)) {
        return Ok(false);
    }
    match lock.unlink() {
        Ok(()) => Ok(true),
        Err(Error::NotFound(_)) => Ok(false),
        Err(e) => Err(e),
    }
}
