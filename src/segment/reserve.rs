//! Reserving a segment's pages after its creation, a granule at a time, without a SIGBUS.
//!
//! A page of a `/dev/shm` file that was never allocated is allocated by the first access
//! through a mapping, and when tmpfs is full that access is a SIGBUS. Reserving every page at
//! creation (`posix_fallocate` + `MAP_POPULATE`) costs about a second per GiB, so a segment
//! reserves at creation only the bytes every process reads at once (the header and the slot
//! tables) and the rest later, in two ways that each turn "tmpfs is full" into an error:
//!
//! * **in the background**: the creator's first put starts a thread (not the creation: see
//!   [`super::Segment::start_background_reservation`]) that walks the file front to back,
//!   `MADV_POPULATE_WRITE` over a mapping of its own (made before the thread starts, marked
//!   `MADV_DONTFORK`, so a forked child never inherits it), and stops at the end, at the first
//!   failure, or when the segment is dropped. It allocates (and zeroes) the pages ahead of the
//!   writers; it keeps no books another thread relies on.
//! * **on demand**: every access of a read-write mapping first checks [`Reserved`], this
//!   mapping's record of what is reserved (a prefix, the fast path: one load, and a bit per
//!   granule). A range not yet recorded is populated in the caller's own mapping, granule by
//!   granule (`MADV_POPULATE_WRITE`: allocated in the file where the background thread has not
//!   been yet, which returns an error, never a signal, when tmpfs cannot hold it), then
//!   recorded. A failure is [`Error::ShmTooSmall`], at that access.
//!
//! Every reservation populates whole granules, the creator's first bytes included, so a
//! granule that any mapping reserved is allocated whole: another mapping reserving it later
//! needs no room (a writer that joins once tmpfs is full still reads the header, and the
//! objects others put).
//!
//! Invariant: a byte this mapping records as reserved has its page allocated in the file,
//! and allocated pages of a tmpfs file stay allocated until it is truncated or deleted (which
//! nobody does while it is mapped: a truncation by another process is the one SIGBUS left,
//! see `fault`). So a recorded range is never a SIGBUS, in this process or in a forked child
//! (whose copy of the record holds only what the parent had reserved). Readers only read
//! published objects, which a writer reserved before writing them.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::error::{Error, Result};

use super::os::shm_free_bytes;

/// The unit a mapping records as reserved (small, so that touching the first word of the
/// ring at creation costs little; a range of several is reserved in one call).
pub(super) const GRANULE: usize = 64 << 10;
/// How much the background thread reserves per call (it checks for a stop between them).
const STEP: usize = 2 << 20;
const PAGE: usize = 4096;

/// Which parts of one mapping are reserved (see the module docs).
#[derive(Debug)]
pub(super) struct Reserved {
    /// Every byte below this is reserved: the fast path.
    prefix: AtomicUsize,
    /// One bit per granule reserved through this mapping beyond the prefix.
    granules: Vec<AtomicU64>,
    len: usize,
}

impl Reserved {
    /// Everything reserved already (the whole file was reserved at creation, or a read-only
    /// mapping, which never allocates: see [`super::Segment::open`]).
    pub(super) fn all(len: usize) -> Reserved {
        Reserved {
            prefix: AtomicUsize::new(len),
            granules: Vec::new(),
            len,
        }
    }

    /// Only the first `prefix` bytes reserved.
    pub(super) fn prefix(len: usize, prefix: usize) -> Reserved {
        let count = len.div_ceil(GRANULE).div_ceil(64);
        Reserved {
            prefix: AtomicUsize::new(prefix.min(len)),
            granules: (0..count).map(|_| AtomicU64::new(0)).collect(),
            len,
        }
    }

    /// Whether `[start, end)` is known to be reserved: one load.
    #[inline]
    pub(super) fn covers(&self, end: usize) -> bool {
        // Acquire: pairs with the Release `fetch_max` after the populating call returned.
        end <= self.prefix.load(Ordering::Acquire)
    }

    fn granule_done(&self, g: usize) -> bool {
        self.granules[g / 64].load(Ordering::Acquire) & (1 << (g % 64)) != 0
    }

    /// Reserve `[start, end)` of the mapping at `base` (of `self.len` bytes), granule by
    /// granule, and record it; [`Error::ShmTooSmall`] when tmpfs cannot hold a granule.
    ///
    /// # Safety
    /// `base` must be a read-write shared mapping of `self.len` bytes, mapped for the call.
    pub(super) unsafe fn reserve(&self, base: NonNull<u8>, start: usize, end: usize) -> Result<()> {
        let end = end.min(self.len);
        let last = end.div_ceil(GRANULE);
        let mut g = start / GRANULE;
        while g < last {
            if self.granule_done(g) {
                g += 1;
                continue;
            }
            // One call for the whole run of granules not yet recorded.
            let run = (g..last).find(|&h| self.granule_done(h)).unwrap_or(last);
            let from = g * GRANULE;
            let len = (run * GRANULE).min(self.len) - from;
            // SAFETY: `from..from + len` lies inside the mapping at `base` (granules of
            // `self.len`), which the caller keeps mapped (see `reserve`'s contract).
            unsafe { populate(base.as_ptr().wrapping_add(from), len, self.len) }?;
            for h in g..run {
                self.granules[h / 64].fetch_or(1 << (h % 64), Ordering::Release);
            }
            g = run;
        }
        // Grow the prefix over the granules now recorded (several threads may race here:
        // each only ever raises it to a boundary it saw recorded).
        let mut prefix = self.prefix.load(Ordering::Acquire);
        while prefix < self.len && self.granule_done(prefix / GRANULE) {
            let next = ((prefix / GRANULE + 1) * GRANULE).min(self.len);
            prefix = self.prefix.fetch_max(next, Ordering::Release).max(next);
        }
        Ok(())
    }
}

/// What `MADV_POPULATE_WRITE` could not do.
#[derive(Debug)]
pub(super) enum Unpopulated {
    /// The kernel has no `MADV_POPULATE_WRITE` (before Linux 5.14).
    Unsupported,
    Failed(Error),
}

impl From<Unpopulated> for Error {
    fn from(u: Unpopulated) -> Error {
        match u {
            Unpopulated::Unsupported => Error::os(
                "reserving shared memory",
                std::io::Error::from_raw_os_error(libc::EINVAL),
            ),
            Unpopulated::Failed(e) => e,
        }
    }
}

/// Allocate (in the file) and map (in this mapping) the pages of `[addr, addr + len)` of a
/// `needed`-byte segment. Where tmpfs cannot hold them the kernel answers an error instead of
/// the SIGBUS a touch would raise.
///
/// # Safety
/// `addr..addr + len` must lie inside a read-write shared mapping that stays mapped for the
/// call.
pub(super) unsafe fn populate(
    addr: *mut u8,
    len: usize,
    needed: usize,
) -> std::result::Result<(), Unpopulated> {
    loop {
        // SAFETY: the caller guarantees `addr..addr + len` lies inside a live read-write
        // mapping; MADV_POPULATE_WRITE only faults its pages in (as a write would, without
        // writing), so no byte changes and no Rust reference is involved.
        let rc = unsafe { libc::madvise(addr.cast(), len, libc::MADV_POPULATE_WRITE) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
            Some(libc::EINVAL) => Unpopulated::Unsupported,
            // EFAULT: the fault would have been a SIGBUS (tmpfs full); ENOMEM: no memory.
            Some(libc::EFAULT) | Some(libc::ENOMEM) | Some(libc::ENOSPC) => {
                Unpopulated::Failed(Error::ShmTooSmall {
                    needed: needed as u64,
                    available: shm_free_bytes().unwrap_or(0),
                })
            }
            _ => Unpopulated::Failed(Error::os("reserving shared memory", err)),
        });
    }
}

/// The creator's background reservation: dropping it stops the thread (which never waits on
/// anything, so it is left to finish its current granule rather than joined: a forked child
/// has no such thread to join).
#[derive(Debug)]
pub(super) struct Background {
    stop: Arc<AtomicBool>,
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Test hook: with `MMCACHE_TEST_RESERVE_DELAY_S=<seconds>` in its environment, the
/// background reservation waits that long before it starts, so a test can put into pages
/// nobody reserved yet. Unset (always, outside tests) it costs one environment lookup.
fn delay_for_tests() -> Option<std::time::Duration> {
    std::env::var("MMCACHE_TEST_RESERVE_DELAY_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(|s| std::time::Duration::from_secs_f64(s.min(3600.0)))
}

/// Start reserving `[from, len)` of the file `fd` in the background.
pub(super) fn start_background(fd: &OwnedFd, len: usize, from: usize) -> Result<Background> {
    let stop = Arc::new(AtomicBool::new(false));
    let from = from / PAGE * PAGE;
    if from >= len {
        return Ok(Background { stop });
    }
    // SAFETY: a fresh shared mapping (null hint) of an fd we hold open, checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::os(
            "mapping shared memory",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `ptr..ptr + len` is the mapping just made; a forked child must not inherit it
    // (it would keep the file's memory alive in the child, with no thread to unmap it).
    if unsafe { libc::madvise(ptr, len, libc::MADV_DONTFORK) } != 0 {
        let err = std::io::Error::last_os_error();
        // SAFETY: the mapping made above, referred to by nothing else.
        unsafe { libc::munmap(ptr, len) };
        return Err(Error::os("mapping shared memory", err));
    }
    let address = ptr as usize;
    let flag = Arc::clone(&stop);
    let delay = delay_for_tests();
    let spawned = std::thread::Builder::new()
        .name("mmcache-reserve".into())
        .spawn(move || {
            super::os::lower_thread_priority();
            if let Some(d) = delay {
                std::thread::sleep(d);
            }
            let mut at = from;
            while at < len && !flag.load(Ordering::Relaxed) {
                let chunk = (STEP - at % STEP).min(len - at);
                // SAFETY: inside the thread's own read-write mapping, which only this thread
                // unmaps, below.
                if unsafe { populate((address + at) as *mut u8, chunk, len) }.is_err() {
                    break; // an access that needs these pages reports the error itself
                }
                at += chunk;
            }
            // SAFETY: this thread's own mapping (made for it above), unmapped once, here.
            unsafe { libc::munmap(address as *mut libc::c_void, len) };
        });
    if let Err(e) = spawned {
        // SAFETY: the thread did not start: the mapping is still ours alone.
        unsafe { libc::munmap(ptr, len) };
        return Err(Error::os("starting the reservation thread", e));
    }
    Ok(Background { stop })
}
