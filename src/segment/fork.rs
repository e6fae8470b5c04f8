//! What a `fork()` must change in the child, and how objects tell they were inherited.
//!
//! A forked child inherits every writer, reader and zero-copy view of its parent as copies of
//! their memory — and, through the inherited file descriptors, the parent's liveness locks.
//! None of them may act for the parent (a stale allocator overwriting live chunks, a child
//! giving back the parent's references or view leases), and the child's inherited views must
//! never change their bytes, even after the parent drops its own copies of them. So, in the
//! child, right after `fork()` (a `pthread_atfork` child handler, which runs for `os.fork`,
//! `multiprocessing`'s fork start method and any C-level `fork`):
//!
//! * the **process generation** is bumped: every writer, reader, lease and view records the
//!   generation it was made in and does nothing to shared state in another one;
//! * every **liveness-lock descriptor** is pointed at `/dev/null` (`dup3`): OFD locks belong
//!   to the open file description, which the child shares, so without this a child would keep
//!   a dead parent looking alive. The descriptor number stays valid for its owner's `Drop`;
//! * every **live zero-copy view** is replaced by a private, read-only copy of its pages
//!   (`mremap` of an anonymous copy over the view), so the child's views keep their bytes
//!   whatever the parent and the writer do next.
//!
//! The registry behind this is guarded by a spin lock that the `prepare` handler takes before
//! `fork()` and the parent/child handlers release, so the child never inherits it mid-update
//! (a `std` or `parking_lot` mutex could be held by a thread that does not exist in the child).

use std::cell::UnsafeCell;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static GENERATION: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
static REGISTRY: SpinLock<Registry> = SpinLock::new(Registry {
    lock_fds: BTreeMap::new(),
    views: BTreeMap::new(),
});

/// What the child handler acts on.
struct Registry {
    /// Descriptors holding liveness locks -> how many owners registered them.
    lock_fds: BTreeMap<RawFd, usize>,
    /// Live zero-copy views: start address -> (length, how many views start there).
    views: BTreeMap<usize, (usize, usize)>,
}

/// The process an object was made in, as seen by the fork handlers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process(u64);

impl Process {
    /// This process (installs the fork handlers on first use).
    pub fn current() -> Process {
        install();
        Process(GENERATION.load(Ordering::Acquire))
    }

    /// Whether we are still in the process this was made in (not a forked child of it).
    pub fn is_current(&self) -> bool {
        GENERATION.load(Ordering::Acquire) == self.0
    }
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: the three handlers are `extern "C"` functions with the signature
        // pthread_atfork expects, defined in this module and never unloaded (a Python
        // extension module is never unloaded). If registration fails (ENOMEM) forks simply
        // go unhandled; there is nothing better to do, so the result is ignored.
        let _ = unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_in_parent),
                Some(after_fork_in_child),
            )
        };
    });
}

/// A descriptor that holds liveness locks, known to the fork handlers for as long as it is
/// open: it is opened and closed with the registry's lock held, which `fork()` waits for, so
/// no child inherits it unregistered (and so keeps its locks, a dead writer looking alive).
#[derive(Debug)]
pub struct LockFd {
    /// `Some` until dropped.
    fd: Option<OwnedFd>,
    process: Process,
}

impl LockFd {
    /// Open the descriptor with `open` and register it, as one step for the fork handlers.
    pub fn open<E>(open: impl FnOnce() -> Result<OwnedFd, E>) -> Result<LockFd, E> {
        let process = Process::current();
        REGISTRY.with(|r| {
            let fd = open()?;
            *r.lock_fds.entry(fd.as_raw_fd()).or_insert(0) += 1;
            Ok(LockFd {
                fd: Some(fd),
                process,
            })
        })
    }

    pub fn fd(&self) -> &OwnedFd {
        self.fd.as_ref().expect("open until dropped")
    }
}

impl Drop for LockFd {
    fn drop(&mut self) {
        let fd = self.fd.take();
        if !self.process.is_current() {
            return; // a forked child's copy: it points at /dev/null and the registry is empty
        }
        REGISTRY.with(|r| {
            if let Some(fd) = fd {
                let raw = fd.as_raw_fd();
                if let Some(n) = r.lock_fds.get_mut(&raw) {
                    *n -= 1;
                    if *n == 0 {
                        r.lock_fds.remove(&raw);
                    }
                }
                drop(fd); // closed while listed: the number is never reused unlisted
            }
        });
    }
}

/// Registers a zero-copy view of `len` bytes at `start` until the returned guard is dropped.
pub fn register_view(start: *const u8, len: usize) -> Registration {
    let process = Process::current();
    let start = start as usize;
    REGISTRY.with(|r| {
        let entry = r.views.entry(start).or_insert((len, 0));
        entry.0 = entry.0.max(len);
        entry.1 += 1;
    });
    Registration { start, process }
}

/// Keeps one view in the registry; removing it is a no-op in a forked child (the child
/// handler already emptied the registry the child inherited).
#[derive(Debug)]
pub struct Registration {
    /// The view's start address.
    start: usize,
    process: Process,
}

impl Drop for Registration {
    fn drop(&mut self) {
        if !self.process.is_current() {
            return;
        }
        REGISTRY.with(|r| {
            if let Some((_, n)) = r.views.get_mut(&self.start) {
                *n -= 1;
                if *n == 0 {
                    r.views.remove(&self.start);
                }
            }
        });
    }
}

extern "C" fn before_fork() {
    REGISTRY.acquire();
}

extern "C" fn after_fork_in_parent() {
    REGISTRY.release();
}

extern "C" fn after_fork_in_child() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
    // SAFETY: `before_fork` acquired the lock in the parent and the child is single-threaded
    // here, so we have exclusive access until `release` below.
    let registry = unsafe { REGISTRY.get_unchecked() };
    for &fd in registry.lock_fds.keys() {
        point_at_dev_null(fd);
    }
    registry.lock_fds.clear();
    let page = page_size();
    // Views are keyed by start address: merge overlapping page ranges as we go, so each
    // page is copied once and the child's mapping count stays small.
    let mut pending: Option<(usize, usize)> = None;
    for (&start, &(len, _)) in registry.views.iter() {
        let lo = start & !(page - 1);
        let hi = (start + len.max(1)).next_multiple_of(page);
        pending = match pending {
            Some((a, b)) if lo <= b => Some((a, b.max(hi))),
            Some((a, b)) => {
                make_private(a, b - a);
                Some((lo, hi))
            }
            None => Some((lo, hi)),
        };
    }
    if let Some((a, b)) = pending {
        make_private(a, b - a);
    }
    registry.views.clear();
    REGISTRY.release();
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as usize } else { 4096 }
}

/// Replace `fd` with a descriptor of `/dev/null` (same number, close-on-exec).
fn point_at_dev_null(fd: RawFd) {
    // SAFETY: open/dup3/close on descriptors this process owns; `fd` stays a valid descriptor
    // number (now of /dev/null), so its owner's later `close` closes the right thing.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null >= 0 {
            libc::dup3(null, fd, libc::O_CLOEXEC);
            libc::close(null);
        }
    }
}

/// Replace the read-only shared pages `[start, start + len)` by a private read-only copy.
/// Should that fail (no memory), make them inaccessible instead: a fault beats bytes that
/// change under a live view.
fn make_private(start: usize, len: usize) {
    let target = start as *mut libc::c_void;
    // SAFETY: `[start, start + len)` is page-aligned and lies in this process's read-only view
    // mapping of a segment (it covers live views, which keep the mapping alive). We map fresh
    // anonymous memory, copy the pages into it, and move it over the range with
    // MREMAP_FIXED, which atomically replaces what was mapped there; every pointer into the
    // range stays valid and reads the same bytes. On failure we map inaccessible memory over
    // the range, which is also a valid (if faulting) mapping.
    unsafe {
        let copy = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if copy != libc::MAP_FAILED {
            std::ptr::copy_nonoverlapping(start as *const u8, copy.cast::<u8>(), len);
            if libc::mprotect(copy, len, libc::PROT_READ) == 0
                && libc::mremap(
                    copy,
                    len,
                    len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    target,
                ) != libc::MAP_FAILED
            {
                return;
            }
            libc::munmap(copy, len);
        }
        libc::mmap(
            target,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        );
    }
}

/// A minimal spin lock whose state is one flag, so a fork handler can hold it across
/// `fork()` and the child can release it.
struct SpinLock<T> {
    locked: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: access to `data` is serialised by `locked` (Acquire on taking it, Release on giving
// it back), so sharing the lock between threads is sound for any `T: Send`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    const fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            data: UnsafeCell::new(value),
        }
    }

    fn acquire(&self) {
        // Acquire pairs with the Release in `release`: the previous holder's updates are seen.
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    fn release(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// # Safety
    /// The caller holds the lock (and no other reference to the data exists).
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_unchecked(&self) -> &mut T {
        // SAFETY: per this function's contract the caller has exclusive access.
        unsafe { &mut *self.data.get() }
    }

    fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        struct Held<'a, T>(&'a SpinLock<T>);
        impl<T> Drop for Held<'_, T> {
            fn drop(&mut self) {
                self.0.release();
            }
        }
        self.acquire();
        let held = Held(self);
        // SAFETY: we hold the lock until `held` is dropped, after `f` returns or unwinds.
        f(unsafe { held.0.get_unchecked() })
    }
}

#[cfg(test)]
mod tests {
    use super::super::LockRange;
    use super::super::os::{SHM_DIR, flock, ofd_fcntl};
    use super::*;
    use std::time::{Duration, Instant};

    /// In a forked child: whether one of its descriptors' open file descriptions holds an OFD
    /// lock (the fork handler pointed every lock descriptor it knew at /dev/null).
    fn inherits_a_lock() -> bool {
        std::fs::read_dir("/proc/self/fdinfo").is_ok_and(|dir| {
            dir.filter_map(|e| e.ok())
                .any(|e| std::fs::read_to_string(e.path()).is_ok_and(|i| i.contains("OFDLCK")))
        })
    }

    /// Forks while another thread opens lock descriptors, locks through them and closes them
    /// again: each is known to the fork handlers whenever it is open, so no child shares a
    /// lock (which would keep a dead writer looking alive for as long as the child lives).
    #[test]
    fn a_child_forked_while_lock_descriptors_open_and_close_holds_none_of_their_locks() {
        // Not an `mmc_` name: other tests' store creations would sweep it as a broken segment.
        let path = format!("{SHM_DIR}/forktest_{}", std::process::id());
        std::fs::write(&path, [0u8; 64]).unwrap();
        let open = || {
            std::fs::File::options()
                .read(true)
                .write(true)
                .open(&path)
                .map(OwnedFd::from)
        };
        let stop = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(5);
        let (forks, leaks) = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let fds: Vec<LockFd> = (0..32).map(|_| LockFd::open(open).unwrap()).collect();
                    for fd in &fds {
                        let range = LockRange { start: 0, len: 8 };
                        let mut lock = flock(libc::F_RDLCK as _, range);
                        ofd_fcntl(fd.fd(), libc::F_OFD_SETLK, &mut lock).unwrap();
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    drop(fds);
                }
            });
            let (mut forks, mut leaks) = (0u32, 0u32);
            // This test's children only (other tests wait for theirs).
            let mut alive: Vec<libc::pid_t> = Vec::new();
            let mut reap = |alive: &mut Vec<libc::pid_t>, options: libc::c_int| {
                alive.retain(|&pid| {
                    let mut status = 0;
                    // SAFETY: waiting for a child of this test; `status` is a valid out-pointer.
                    if unsafe { libc::waitpid(pid, &mut status, options) } != pid {
                        return true;
                    }
                    leaks += u32::from(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 1);
                    false
                });
            };
            while Instant::now() < deadline {
                if alive.len() < 16 {
                    // SAFETY: the child only reads /proc, sleeps and leaves with `_exit`.
                    match unsafe { libc::fork() } {
                        0 => {
                            let inherited = (0..10).any(|_| {
                                std::thread::sleep(Duration::from_millis(2));
                                inherits_a_lock()
                            });
                            // SAFETY: leaving the child at once, running nothing of the parent's.
                            unsafe { libc::_exit(i32::from(inherited)) };
                        }
                        pid if pid > 0 => {
                            forks += 1;
                            alive.push(pid);
                        }
                        _ => {}
                    }
                }
                reap(&mut alive, libc::WNOHANG);
                std::thread::sleep(Duration::from_micros(200));
            }
            stop.store(true, Ordering::Relaxed);
            reap(&mut alive, 0);
            (forks, leaks)
        });
        std::fs::remove_file(&path).unwrap();
        assert!(forks > 100, "only {forks} forks");
        assert_eq!(
            leaks, 0,
            "{leaks} of {forks} children shared a lock descriptor's locks"
        );
    }

    #[test]
    fn registrations_are_counted_and_removed() {
        let buf = [0u8; 64];
        let a = register_view(buf.as_ptr(), 64);
        let b = register_view(buf.as_ptr(), 64);
        let count = || REGISTRY.with(|r| r.views.get(&(buf.as_ptr() as usize)).map(|v| v.1));
        assert_eq!(count(), Some(2));
        drop(a);
        assert_eq!(count(), Some(1));
        drop(b);
        assert_eq!(count(), None);
        assert!(Process::current().is_current());
    }
}
