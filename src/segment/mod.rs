//! Named POSIX shared-memory segments: the mapping, and every raw access to its bytes.
//!
//! This module and its submodules hold the core's `unsafe` code (see the crate docs for the
//! one other place). Everything it hands out is safe to use:
//!
//! * atomics are handed out as `&AtomicU64` after a bounds and alignment check;
//! * plain bytes are only ever *copied* in or out through raw pointers — no `&[u8]` or
//!   `&mut [u8]` is ever formed over bytes that another process may write, because the
//!   compiler would be entitled to assume they do not change; a copy into memory not yet
//!   written (a new `bytes` object, a copy arena) takes it as `MaybeUninit` bytes
//!   (`read_into_uninit`), never as `&mut [u8]`;
//! * the mapping lives as long as the `Segment`, which every view holds through an `Arc`.
//!
//! We use `libc` directly rather than the `shared_memory` crate: that crate
//! hides the file descriptor and the mapping (so no reservation that turns "`/dev/shm` too
//! small" into an error instead of a SIGBUS, and no OFD locks), maps only read-write, is
//! `!Send`, and has not been released since 2022 (see ARCHITECTURE.md).
//!
//! **No SIGBUS.** A page of the file is allocated at its first touch, which is a SIGBUS when
//! tmpfs is full. Creation checks the free space, reserves the first bytes (header and slot
//! tables) and leaves the rest to `reserve`: a background thread of the creator reserves the
//! file front to back, and every access of a writer's mapping first makes sure its range is
//! reserved (one load once it is), so tmpfs running out is an `Error::ShmTooSmall` at the
//! access that needed the space. Readers and read-only mappings touch only reserved pages
//! (the header and tables, and published objects, which a writer reserved before writing).
//!
//! Liveness is told by **open-file-description locks** (`F_OFD_SETLK`) on byte ranges of
//! the segment's file: every live writer holds a shared one on the first word and an
//! exclusive one on its writer slot, each reader one on its slot. The kernel drops them when the holder's last descriptor goes, however it dies,
//! and any process that can open the file can test them, whatever its PID namespace. Locks
//! are taken through a second open file description that is never mapped: a mapping holds
//! its file description open, so a forked child that keeps its parent's mappings would
//! otherwise keep its parent's locks too.
//!
//! This file holds the `Segment` itself: creating, opening, mapping, owning and unlinking
//! one. Submodules: `access` (every access to its bytes: the checks, atomics, copies, view
//! addresses, and [`RawBytes`]), `reserve` (reserving its pages without a SIGBUS), `locks`
//! (the OFD liveness locks and futex calls on a segment), `naming` (which
//! names are allowed, and the ones we generate), `os` (the files in `/dev/shm` and their
//! locks, processes, randomness: everything that is not one mapping), [`fork`] (what a
//! `fork()` changes in the child) and [`fault`] (making a SIGSEGV/SIGBUS in a mapping explain
//! itself). What `naming` and `os` offer is re-exported
//! here, so callers name everything `segment::…`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

mod access;
pub mod fault;
pub mod fork;
mod locks;
mod naming;
mod os;
mod reserve;

pub use access::RawBytes;
pub(crate) use access::written_whole;
pub use fork::{LockFd, Process, Registration, register_view};
pub use locks::NameLock;
use naming::c_name;
pub use naming::{NAME_PREFIX, generate_name, pid_in_name, validate_name};
pub use os::{
    FileProbe, SHM_DIR, current_pid, kill_self, list_files, lower_thread_priority, pid_exists,
    probe_file, process_alive, process_start_time, random_bytes, read_start, shm_free_bytes,
    unlink,
};
use os::{flock, locks_unsupported, ofd_fcntl, open_error, open_regular};
use reserve::{Background, GRANULE, Reserved, Unpopulated};

/// How a segment is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    /// For `inspect`: loads only, never a store.
    ReadOnly,
}

/// One mapped shared-memory segment.
#[derive(Debug)]
pub struct Segment {
    name: String,
    base: NonNull<u8>,
    /// A second, read-only mapping of the same pages (readers only): zero-copy views point
    /// here, so even a consumer that ignores the buffer's read-only flag (torch does) cannot
    /// change an object other readers see — an in-place write faults instead.
    view_base: Option<NonNull<u8>>,
    len: usize,
    access: Access,
    /// The pid that may unlink the segment (its creator, or a writer that opened it);
    /// `None` for readers and inspectors.
    owner_pid: Option<u32>,
    unlinked: AtomicBool,
    /// Whether dropping the segment unlinks it (a segment being created; its writer takes
    /// the decision over once the store is made).
    unlink_on_drop: AtomicBool,
    /// The descriptor the mappings were made from (a mapping keeps its open file
    /// description alive, in a forked child too, so it never holds a lock).
    fd: OwnedFd,
    /// A second open file description, never mapped, that holds this process's liveness
    /// locks (read-write segments only). Known to the fork handlers, so a forked child lets
    /// go of its share.
    lock_fd: Option<LockFd>,
    /// Whether the creator got its lock (false only where the kernel has no OFD locks).
    creator_locked: bool,
    /// Keeps faults in our mappings explained while they exist.
    fault_registrations: Vec<fault::Registered>,
    /// What of `base` is reserved: checked before every access of a writer's mapping.
    reserved: Reserved,
    /// Where the creator's background reservation starts (`None`: nothing left for it).
    background_from: Option<usize>,
    /// The creator's background reservation, started by the first put (see
    /// [`Segment::start_background_reservation`]; stopped when the segment goes).
    background: OnceLock<Option<Background>>,
}

/// A byte range of a segment's file used as a liveness lock (not as bytes: locks are
/// advisory and independent of the mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockRange {
    pub start: u64,
    pub len: u64,
}

// SAFETY: `Segment` owns its mapping; the raw `base` pointer is only dereferenced through
// methods that perform atomic operations or raw copies, which are sound from any thread
// (the bytes are shared with other processes anyway, so no thread-local assumption exists).
unsafe impl Send for Segment {}
// SAFETY: see `Send`: all access through `&Segment` is atomic or a raw copy.
unsafe impl Sync for Segment {}

fn map(fd: &OwnedFd, len: usize, access: Access) -> io::Result<NonNull<u8>> {
    let prot = match access {
        Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        Access::ReadOnly => libc::PROT_READ,
    };
    let flags = libc::MAP_SHARED;
    // SAFETY: we ask the kernel for a fresh mapping (null hint) of an fd we own; the result is
    // checked against MAP_FAILED before use.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
}

/// Test hook: with `MMCACHE_TEST_PAUSE_IN_CREATION_S=<seconds>` in its environment, a process
/// waits that long in every creation at the stage `MMCACHE_TEST_PAUSE_IN_CREATION_AT` names
/// (default `sized`: locked and sized but no header yet; `locked`: locked, still empty), so a
/// test can kill a creator mid-creation or race another creation against it. Unset (always,
/// outside tests) it costs one environment lookup per stage.
fn pause_in_creation_for_tests(stage: &str) {
    let pause = std::env::var("MMCACHE_TEST_PAUSE_IN_CREATION_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0);
    let at = || std::env::var("MMCACHE_TEST_PAUSE_IN_CREATION_AT");
    if let Some(seconds) = pause.filter(|_| at().as_deref().unwrap_or("sized") == stage) {
        std::thread::sleep(std::time::Duration::from_secs_f64(seconds.min(3600.0)));
    }
}

/// A second open file description of `/dev/shm/<name>`, for liveness locks only, known to
/// the fork handlers.
fn open_lock_fd(name: &str) -> Result<LockFd> {
    LockFd::open(|| open_regular(name, Access::ReadWrite).map(|(fd, _)| fd))
}

impl Segment {
    /// Create a new segment of `len` bytes, private to this user (mode 0600). A host whose
    /// `/dev/shm` has less than `len` bytes free fails here with `ShmTooSmall`. The first
    /// `eager` bytes are reserved now, the rest by a background thread and by the accesses
    /// that need it first (see `reserve`), so creation costs no more for a large segment than
    /// for a small one, and tmpfs filling up later is an `ShmTooSmall` at an access, never a
    /// SIGBUS.
    ///
    /// The creator takes a shared OFD lock on `creator_lock` right after creating the name,
    /// before the file has a size, and holds it until it gives it back: whoever finds the
    /// name can tell a segment being made or used from one left behind (other writers take
    /// the same shared lock). [`Segment::holds_locks`] says whether it got it (false only
    /// where the kernel has no OFD locks). Until [`Segment::keep_on_drop`], dropping the
    /// segment unlinks it.
    pub fn create(
        name: &str,
        len: usize,
        creator_lock: LockRange,
        eager: usize,
    ) -> Result<Segment> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "segment length must be positive".into(),
            ));
        }
        if let Some(available) = shm_free_bytes() {
            if (len as u64) > available {
                return Err(Error::ShmTooSmall {
                    needed: len as u64,
                    available,
                });
            }
        }
        let cname = c_name(name)?;
        // SAFETY: `cname` is a valid NUL-terminated string; the returned fd is checked.
        let raw = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600 as libc::mode_t,
            )
        };
        if raw < 0 {
            return Err(open_error(name, io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a freshly opened fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let fail = |e: Error| {
            // The name was created by us a moment ago; take it away again on any failure.
            let _ = unlink(name);
            e
        };
        let lock_fd = open_lock_fd(name).map_err(fail)?;
        let creator_locked = match ofd_fcntl(
            lock_fd.fd(),
            libc::F_OFD_SETLK,
            &mut flock(libc::F_RDLCK as _, creator_lock),
        ) {
            Ok(()) => true,
            Err(e) if locks_unsupported(&e) => false,
            Err(e) => return Err(fail(Error::os("locking the new segment", e))),
        };
        pause_in_creation_for_tests("locked");
        // The umask may have narrowed the mode; make sure it is exactly owner read-write.
        // SAFETY: fchmod on an fd we own.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) } != 0 {
            return Err(fail(Error::os("fchmod", io::Error::last_os_error())));
        }
        // SAFETY: ftruncate on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(fail(Error::os("ftruncate", io::Error::last_os_error())));
        }
        pause_in_creation_for_tests("sized");
        let base = map(&fd, len, Access::ReadWrite)
            .map_err(|e| fail(Error::os("mapping shared memory", e)))?;
        let mut seg = Segment {
            name: validate_name(name)?.to_owned(),
            base,
            view_base: None,
            len,
            access: Access::ReadWrite,
            owner_pid: Some(current_pid()),
            unlinked: AtomicBool::new(false),
            unlink_on_drop: AtomicBool::new(true),
            fault_registrations: vec![fault::register(base.as_ptr(), len, fault::Mapping::Shared)],
            fd,
            lock_fd: Some(lock_fd),
            creator_locked,
            reserved: Reserved::prefix(len, 0),
            background_from: None,
            background: OnceLock::new(),
        };
        seg.reserve_at_creation(eager)?; // on failure, dropping `seg` unlinks the name
        Ok(seg)
    }

    /// Reserve the first `eager` bytes now and leave the rest to the accesses that need it
    /// and to the background reservation the first put starts; where the kernel cannot
    /// populate without a signal (before Linux 5.14), reserve the whole file now, as
    /// `posix_fallocate` does.
    fn reserve_at_creation(&mut self, eager: usize) -> Result<()> {
        // Whole granules: a process that opens the segment later reserves by the granule
        // (`Reserved`), and must find the first ones allocated already, whatever tmpfs has
        // left by then.
        let eager = eager
            .min(self.len)
            .div_ceil(GRANULE)
            .saturating_mul(GRANULE)
            .min(self.len);
        // SAFETY: `base..base + eager` lies inside our read-write mapping of `len` bytes.
        match unsafe { reserve::populate(self.base.as_ptr(), eager, self.len) } {
            Ok(()) => {
                self.reserved = Reserved::prefix(self.len, eager);
                self.background_from = Some(eager);
                Ok(())
            }
            Err(Unpopulated::Unsupported) => {
                let len = self.len as libc::off_t;
                // SAFETY: posix_fallocate on an fd we own; it returns an error number.
                let rc = unsafe { libc::posix_fallocate(self.fd.as_raw_fd(), 0, len) };
                if rc == libc::ENOSPC || rc == libc::ENOMEM {
                    return Err(Error::ShmTooSmall {
                        needed: self.len as u64,
                        available: shm_free_bytes().unwrap_or(0),
                    });
                } else if rc != 0 && rc != libc::EOPNOTSUPP {
                    return Err(Error::os(
                        "reserving shared memory",
                        io::Error::from_raw_os_error(rc),
                    ));
                }
                self.reserved = Reserved::all(self.len);
                Ok(())
            }
            Err(Unpopulated::Failed(e)) => Err(e),
        }
    }

    /// Open an existing segment by name. Only a regular file in `/dev/shm` is opened (never
    /// through a symbolic link, never blocking on a FIFO), and it is mapped only if it is one.
    pub fn open(name: &str, access: Access) -> Result<Segment> {
        Segment::open_as(name, access, None)
    }

    /// [`Segment::open`] read-write for a writer that joins the store: in this process (not
    /// a forked child) it may unlink the segment, should it be the last writer to leave.
    pub fn open_writer(name: &str) -> Result<Segment> {
        Segment::open_as(name, Access::ReadWrite, Some(current_pid()))
    }

    fn open_as(name: &str, access: Access, owner_pid: Option<u32>) -> Result<Segment> {
        let (fd, len) = open_regular(name, access)?;
        if len == 0 {
            return Err(Error::Corrupt(format!("segment {name:?} is empty")));
        }
        // Before anything is mapped: the name may be gone by now (the last writer closing),
        // and a failure after the mappings would leave them, and so the segment's pages,
        // allocated for as long as this process runs.
        let lock_fd = match access {
            Access::ReadWrite => Some(open_lock_fd(name)?),
            Access::ReadOnly => None,
        };
        let base = map(&fd, len, access).map_err(|e| Error::os("mapping shared memory", e))?;
        // Not populated: a reader's views fault their pages in as they are read (read faults
        // map several pages at a time), and attaching costs the same whatever the size.
        let view_base = match access {
            Access::ReadWrite => Some(map(&fd, len, Access::ReadOnly).map_err(|e| {
                // SAFETY: `base` is the mapping made just above; nothing refers to it yet.
                unsafe { libc::munmap(base.as_ptr().cast(), len) };
                Error::os("mapping shared memory read-only", e)
            })?),
            Access::ReadOnly => None,
        };
        let mut faults = vec![fault::register(base.as_ptr(), len, fault::Mapping::Shared)];
        if let Some(view) = view_base {
            faults.push(fault::register(view.as_ptr(), len, fault::Mapping::Views));
        }
        Ok(Segment {
            name: validate_name(name)?.to_owned(),
            base,
            view_base,
            len,
            access,
            owner_pid,
            unlinked: AtomicBool::new(false),
            unlink_on_drop: AtomicBool::new(false),
            fd,
            lock_fd,
            creator_locked: false,
            fault_registrations: faults,
            // A writer checks what it touches; readers and read-only mappings touch only
            // reserved pages (see the module docs).
            reserved: match owner_pid {
                Some(_) => Reserved::prefix(len, 0),
                None => Reserved::all(len),
            },
            background_from: None,
            background: OnceLock::new(),
        })
    }

    /// A private copy of the first `copy` bytes of the segment `name` (the rest reads as
    /// zeros), read-only, for `inspect`: whoever can write the file may shrink it at any
    /// moment, a SIGBUS at an access through a mapping of it but never through a copy. Its
    /// liveness locks are still tested on the file itself.
    pub fn snapshot(name: &str, copy: usize) -> Result<Segment> {
        let name = validate_name(name)?.to_owned();
        let (fd, len) = open_regular(&name, Access::ReadOnly)?;
        if len == 0 {
            return Err(Error::Corrupt(format!("segment {name:?} is empty")));
        }
        // SAFETY: a fresh private anonymous mapping (null hint), checked before use; only the
        // pages copied into are ever touched (NORESERVE: the rest costs nothing).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::os(
                "mapping a copy of shared memory",
                io::Error::last_os_error(),
            ));
        }
        let Some(base) = NonNull::new(ptr.cast::<u8>()) else {
            return Err(Error::os(
                "mapping a copy of shared memory",
                io::Error::other("mmap returned null"),
            ));
        };
        // SAFETY: the private anonymous mapping made above, of `len >= copy` bytes: no other
        // process or thread can see it yet, so it is ours to borrow mutably.
        let copied = unsafe { std::slice::from_raw_parts_mut(base.as_ptr(), copy.min(len)) };
        // A file shrunk meanwhile reads short: the rest reads as zeros (and fails validation).
        if let Err(e) = os::read_from_start(&fd, &name, copied) {
            // SAFETY: the mapping made above, referred to by nothing else (`copied` is dead).
            unsafe { libc::munmap(ptr, len) };
            return Err(e);
        }
        Ok(Segment {
            name,
            base,
            view_base: None,
            len,
            access: Access::ReadOnly,
            owner_pid: None,
            unlinked: AtomicBool::new(false),
            unlink_on_drop: AtomicBool::new(false),
            fd,
            lock_fd: None,
            creator_locked: false,
            fault_registrations: Vec::new(),
            reserved: Reserved::all(len),
            background_from: None,
            background: OnceLock::new(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start the creator's background reservation of the rest of the file, once, in the
    /// creator's process (a no-op anywhere else, and after the first call: one load). The
    /// store calls it at its first put rather than at creation: a new thread is the costliest
    /// step a creation would take (its start may take the creator's CPU on a busy host), and
    /// until something is put nothing needs the pages. Not starting it is never unsafe:
    /// every access reserves what it needs itself; the thread only does it ahead of them.
    pub fn start_background_reservation(&self) {
        let Some(from) = self.background_from else {
            return;
        };
        if self.background.get().is_none() && self.is_owner() {
            // A failure to start leaves the reservation to the accesses (see `reserve`).
            self.background
                .get_or_init(|| reserve::start_background(&self.fd, self.len, from).ok());
        }
    }

    /// Whether this handle may unlink the segment: its creator's or a joined writer's, in
    /// the process that made it.
    pub fn is_owner(&self) -> bool {
        self.owner_pid == Some(current_pid())
    }

    /// From now on dropping the segment leaves its name alone: the store decides when it
    /// goes (its last writer unlinks it).
    pub fn keep_on_drop(&self) {
        self.unlink_on_drop.store(false, Ordering::Relaxed);
    }

    /// Remove the segment's name: only by its creator or a joined writer, only in its own
    /// process (never by a forked child, whose copy of this struct has the parent's pid), at
    /// most once.
    pub fn unlink(&self) -> Result<()> {
        if !self.is_owner()
            || self
                .unlinked
                .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Ok(());
        }
        match unlink(&self.name) {
            Err(Error::NotFound(_)) => Ok(()), // someone (prune) removed it already
            other => other,
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.fault_registrations.clear(); // before the ranges are unmapped
        if self.unlink_on_drop.load(Ordering::Relaxed) {
            let _ = self.unlink();
        }
        // SAFETY: `base..base+len` is the mapping created in `create`/`open`; it is unmapped
        // exactly once, here, when the last owner (every view holds an `Arc<Segment>`) is gone.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
        if let Some(view) = self.view_base {
            // SAFETY: as above, for the read-only mapping; views hold the `Arc<Segment>`, so
            // none is alive any more.
            unsafe { libc::munmap(view.as_ptr().cast(), self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREATOR: LockRange = LockRange { start: 0, len: 8 };

    pub(super) fn unique(tag: &str) -> String {
        let r = random_bytes::<4>().unwrap();
        format!("mmct_{tag}_{}_{:x}", current_pid(), u32::from_le_bytes(r))
    }

    pub(super) fn create(name: &str, len: usize) -> Result<Segment> {
        Segment::create(name, len, CREATOR, 0)
    }

    #[test]
    fn create_open_round_trip_and_unlink_once() {
        let name = unique("rt");
        let seg = create(&name, 8192).unwrap();
        seg.write_from(100, b"hello".as_slice().into()).unwrap();
        seg.atomic(64).unwrap().store(42, Ordering::Release);
        let other = Segment::open(&name, Access::ReadOnly).unwrap();
        let mut out = [0u8; 5];
        other.read_into(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert_eq!(other.atomic(64).unwrap().load(Ordering::Acquire), 42);
        assert!(
            other.write_from(0, b"x".as_slice().into()).is_err(),
            "read-only mapping refuses writes"
        );
        assert!(!other.is_owner());
        seg.unlink().unwrap();
        seg.unlink().unwrap(); // second call is a no-op
        assert!(matches!(
            Segment::open(&name, Access::ReadOnly),
            Err(Error::NotFound(_))
        ));
    }

    #[test]
    fn existing_name_and_oversize_requests_fail_cleanly() {
        let name = unique("e");
        let _seg = create(&name, 4096).unwrap();
        assert!(matches!(create(&name, 4096), Err(Error::Exists(_))));
        let Some(free) = shm_free_bytes() else {
            return; // a /dev/shm without a size limit: no size is too large for it
        };
        let huge = free as usize + (1 << 30);
        let name2 = unique("big");
        assert!(matches!(
            create(&name2, huge),
            Err(Error::ShmTooSmall { .. })
        ));
        assert!(matches!(
            Segment::open(&name2, Access::ReadOnly),
            Err(Error::NotFound(_))
        ));
    }

    #[test]
    fn only_regular_files_are_opened_and_never_blocking() {
        let dir = unique("dir");
        std::fs::create_dir(format!("{SHM_DIR}/{dir}")).unwrap();
        let fifo = unique("fifo");
        let path = std::ffi::CString::new(format!("{SHM_DIR}/{fifo}")).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let target = unique("target");
        let _seg = create(&target, 4096).unwrap();
        let link = unique("link");
        std::os::unix::fs::symlink(format!("{SHM_DIR}/{target}"), format!("{SHM_DIR}/{link}"))
            .unwrap();
        for (name, what) in [
            (&dir, "a directory"),
            (&fifo, "a FIFO"),
            (&link, "a symbolic link"),
        ] {
            for access in [Access::ReadOnly, Access::ReadWrite] {
                match Segment::open(name, access) {
                    Err(Error::NotASegment(msg)) => assert!(msg.contains(what), "{msg}"),
                    other => panic!("{name}: {other:?}"),
                }
            }
            assert!(probe_file(name, CREATOR).is_err());
        }
        std::fs::remove_dir(format!("{SHM_DIR}/{dir}")).unwrap();
        std::fs::remove_file(format!("{SHM_DIR}/{fifo}")).unwrap();
        std::fs::remove_file(format!("{SHM_DIR}/{link}")).unwrap();
    }

    #[test]
    fn liveness_locks_are_seen_by_other_descriptors_and_released_on_close() {
        let name = unique("lock");
        let seg = create(&name, 4096).unwrap();
        assert!(seg.holds_locks());
        let slot = LockRange {
            start: 512,
            len: 64,
        };
        let a = Segment::open(&name, Access::ReadWrite).unwrap();
        let b = Segment::open(&name, Access::ReadWrite).unwrap();
        let watcher = Segment::open(&name, Access::ReadOnly).unwrap();
        assert!(watcher.lock_held(CREATOR).unwrap());
        assert!(
            seg.lock_held(CREATOR).unwrap(),
            "the creator's own lock counts too"
        );
        assert!(probe_file(&name, CREATOR).unwrap().creator_lock_held);
        assert!(!watcher.lock_held(slot).unwrap());
        assert!(a.try_lock(slot).unwrap());
        assert!(
            !b.try_lock(slot).unwrap(),
            "two descriptors cannot hold one slot"
        );
        assert!(watcher.lock_held(slot).unwrap());
        drop(a); // closing the descriptor releases its locks
        assert!(released(|| watcher.lock_held(slot).unwrap()));
        assert!(b.try_lock(slot).unwrap());
        assert!(b.lock_held(slot).unwrap());
        b.unlock(slot).unwrap();
        assert!(!watcher.lock_held(slot).unwrap());
        drop(seg);
        assert!(released(|| watcher.lock_held(CREATOR).unwrap()));
    }

    /// Whether `held()` turns false within a few seconds. Closing a descriptor releases its
    /// locks once no process shares its open file description, and a child another test is
    /// spawning right now (`Command::spawn`) shares every descriptor until it execs, which
    /// closes ours (`O_CLOEXEC`): so the release is waited for, briefly, not assumed at once.
    fn released(held: impl Fn() -> bool) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while held() {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }
}
