//! Named POSIX shared-memory segments: the mapping, and every raw access to its bytes.
//!
//! This module and its submodules hold the core's `unsafe` code (see the crate docs for the
//! one other place). Everything it hands out is safe to use:
//!
//! * atomics are handed out as `&AtomicU64` after a bounds and alignment check;
//! * plain bytes are only ever *copied* in or out through raw pointers — no `&[u8]` or
//!   `&mut [u8]` is ever formed over bytes that another process may write, because the
//!   compiler would be entitled to assume they do not change;
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
//! Submodules: `locks` (the OFD liveness locks and futex calls on a segment), `naming` (which
//! names are allowed, and the ones we generate), `os` (the files in `/dev/shm` and their
//! locks, processes, randomness: everything that is not one mapping), [`fork`] (what a
//! `fork()` changes in the child) and [`fault`] (making a SIGSEGV/SIGBUS in a mapping explain
//! itself). What `naming` and `os` offer is re-exported
//! here, so callers name everything `segment::…`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use crate::error::{Error, Result};

pub mod fault;
pub mod fork;
mod locks;
mod naming;
mod os;
mod reserve;

pub use fork::{Process, Registration, register_view};
use naming::c_name;
pub use naming::{NAME_PREFIX, generate_name, pid_in_name, validate_name};
pub use os::{
    FileProbe, SHM_DIR, current_pid, kill_self, list_names, lower_thread_priority, pid_exists,
    probe_file, process_alive, process_start_time, random_bytes, read_prefix, shm_free_bytes,
    unlink,
};
use os::{flock, locks_unsupported, ofd_fcntl, open_error, open_regular};
use reserve::{Background, Reserved, Unpopulated};

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
    /// locks (read-write segments only). Registered so a forked child lets go of its share;
    /// the registration drops first, so the descriptor number is never reused while listed.
    lock_fd: Option<(Registration, OwnedFd)>,
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

/// Bytes owned by the caller but possibly written by another thread meanwhile (a Python
/// buffer with the GIL released): never formed into a Rust slice, only copied from.
#[derive(Clone, Copy, Debug)]
pub struct RawBytes<'a> {
    ptr: *const u8,
    len: usize,
    _borrow: std::marker::PhantomData<&'a [u8]>,
}

// SAFETY: `RawBytes` is a read-only borrow of memory valid for `'a` (its constructor's
// contract); it is only ever copied from, which is as sound from another thread as from the
// one that made it (a Python buffer stays pinned while the GIL is released).
unsafe impl Send for RawBytes<'_> {}
// SAFETY: as for `Send`: shared access only copies from the bytes.
unsafe impl Sync for RawBytes<'_> {}

impl<'a> RawBytes<'a> {
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes for the lifetime `'a`.
    pub unsafe fn new(ptr: *const u8, len: usize) -> RawBytes<'a> {
        RawBytes {
            ptr,
            len,
            _borrow: std::marker::PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'a> From<&'a [u8]> for RawBytes<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        // SAFETY: a shared slice is valid for reads of its length for its lifetime.
        unsafe { RawBytes::new(bytes.as_ptr(), bytes.len()) }
    }
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
/// waits that long in every creation once the segment is locked and sized but has no header
/// yet, so a test can kill a creator mid-creation or race another creation against it. Unset
/// (always, outside tests) it costs one environment lookup per creation.
fn pause_in_creation_for_tests() {
    let pause = std::env::var("MMCACHE_TEST_PAUSE_IN_CREATION_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0);
    if let Some(seconds) = pause {
        std::thread::sleep(std::time::Duration::from_secs_f64(seconds.min(3600.0)));
    }
}

/// A second open file description of `/dev/shm/<name>`, for liveness locks only, registered
/// with the fork handlers.
fn open_lock_fd(name: &str) -> Result<(Registration, OwnedFd)> {
    let (fd, _) = open_regular(name, Access::ReadWrite)?;
    Ok((fork::register_lock_fd(fd.as_raw_fd()), fd))
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
        let (registration, lock_fd) = open_lock_fd(name).map_err(fail)?;
        let creator_locked = match ofd_fcntl(
            &lock_fd,
            libc::F_OFD_SETLK,
            &mut flock(libc::F_RDLCK as _, creator_lock),
        ) {
            Ok(()) => true,
            Err(e) if locks_unsupported(&e) => false,
            Err(e) => return Err(fail(Error::os("locking the new segment", e))),
        };
        // The umask may have narrowed the mode; make sure it is exactly owner read-write.
        // SAFETY: fchmod on an fd we own.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) } != 0 {
            return Err(fail(Error::os("fchmod", io::Error::last_os_error())));
        }
        // SAFETY: ftruncate on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(fail(Error::os("ftruncate", io::Error::last_os_error())));
        }
        pause_in_creation_for_tests();
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
            lock_fd: Some((registration, lock_fd)),
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
        let eager = eager
            .min(self.len)
            .div_ceil(4096)
            .saturating_mul(4096)
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
        let lock_fd = match access {
            Access::ReadWrite => Some(open_lock_fd(name)?),
            Access::ReadOnly => None,
        };
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

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of `len` bytes at `offset` after checking they lie inside the segment and
    /// are reserved (reserving them first if needed: `ShmTooSmall` if tmpfs cannot).
    fn check(&self, offset: u64, len: usize) -> Result<usize> {
        let start = usize::try_from(offset).map_err(|_| out_of_range(offset, len))?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => {
                if !self.reserved.covers(end) {
                    // SAFETY: `base` is our read-write mapping of `len` bytes (a read-only
                    // one records everything reserved), mapped while `self` lives.
                    unsafe { self.reserved.reserve(self.base, start, end) }?;
                }
                Ok(start)
            }
            _ => Err(out_of_range(offset, len)),
        }
    }

    /// Make sure `len` bytes at `offset` are reserved, before a step that must not fail
    /// halfway (`ShmTooSmall` if tmpfs cannot hold them).
    pub fn reserve(&self, offset: u64, len: usize) -> Result<()> {
        self.check(offset, len).map(|_| ())
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

    fn check_writable(&self) -> Result<()> {
        match self.access {
            Access::ReadWrite => Ok(()),
            Access::ReadOnly => Err(Error::InvalidArgument("segment is mapped read-only".into())),
        }
    }

    /// The 8-byte-aligned word at `offset`, as an atomic.
    pub fn atomic(&self, offset: u64) -> Result<&AtomicU64> {
        let start = self.check(offset, 8)?;
        if start % 8 != 0 {
            return Err(Error::Corrupt(format!("misaligned atomic offset {offset}")));
        }
        // SAFETY: `start..start+8` lies inside the mapping (checked above) and is 8-byte
        // aligned (the base is page-aligned). The mapping outlives the returned reference
        // (it is tied to `&self`). All processes access this word only atomically, so viewing
        // it as `AtomicU64` introduces no data race.
        Ok(unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(start).cast::<u64>()) })
    }

    /// Copy `dst.len()` bytes out of the segment, starting at `offset`, from bytes that no
    /// other process writes meanwhile: a chunk the caller protects (a lease, or the writer's
    /// own lock), published with Release and observed with Acquire.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let start = self.check(offset, dst.len())?;
        // SAFETY: the source range is inside the mapping (checked), `dst` is a distinct
        // exclusive Rust buffer, so the ranges cannot overlap; a byte copy has no alignment
        // requirement. Per this function's contract nobody writes the source meanwhile, so
        // the plain copy races with nothing.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(start),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copy `dst.len()` bytes out of the segment from bytes the writer may be reusing at this
    /// very moment (an unprotected read, verified afterwards by the caller's seqlock check).
    ///
    /// Every byte is read with an atomic (Relaxed) load — whole aligned words in the middle,
    /// single bytes at the ends — so a concurrent write is a benign race in Rust's memory
    /// model rather than undefined behaviour; the caller discards the copy if the chunk's id
    /// changed.
    pub fn read_into_racy(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let start = self.check(offset, dst.len())?;
        let src = self.base.as_ptr().wrapping_add(start);
        let head = src.align_offset(8).min(dst.len());
        let words = (dst.len() - head) / 8;
        let load_byte = |i: usize| {
            // SAFETY: `src + i` lies inside the mapping (the whole range was checked) and a
            // byte is always aligned; shared bytes are only ever accessed atomically here or
            // written by the writer, which is the race the seqlock check resolves.
            unsafe { AtomicU8::from_ptr(src.add(i)) }.load(Ordering::Relaxed)
        };
        for (i, byte) in dst[..head].iter_mut().enumerate() {
            *byte = load_byte(i);
        }
        for (w, out) in dst[head..head + words * 8].chunks_exact_mut(8).enumerate() {
            // SAFETY: as above, and `src + head` is 8-byte aligned, so every word is.
            let word = unsafe { AtomicU64::from_ptr(src.add(head + w * 8).cast::<u64>()) }
                .load(Ordering::Relaxed);
            out.copy_from_slice(&word.to_ne_bytes());
        }
        let tail = head + words * 8;
        for (i, byte) in dst[tail..].iter_mut().enumerate() {
            *byte = load_byte(tail + i);
        }
        Ok(())
    }

    /// Copy `src` into the segment at `offset` (writer only).
    pub fn write_from(&self, offset: u64, src: RawBytes<'_>) -> Result<()> {
        self.check_writable()?;
        let start = self.check(offset, src.len)?;
        // SAFETY: the destination range is inside a read-write mapping (checked); the writer
        // owns this range (the ring allocator handed it out and no reader acts on it until
        // the chunk's id is published with Release). `src` is valid for reads of `len` bytes
        // (`RawBytes`'s contract) and is caller memory, not part of the destination range.
        // It is read through a raw pointer, never as a slice, because another thread may
        // write it meanwhile (a Python buffer with the GIL released): such a write can only
        // change what is stored, which is that caller's own race.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr, self.base.as_ptr().add(start), src.len) };
        Ok(())
    }

    /// Fill `len` bytes at `offset` with zeros (writer only).
    pub fn zero(&self, offset: u64, len: usize) -> Result<()> {
        self.check_writable()?;
        let start = self.check(offset, len)?;
        // SAFETY: as in `write_from`: an in-bounds range owned by the writer.
        unsafe { std::ptr::write_bytes(self.base.as_ptr().add(start), 0, len) };
        Ok(())
    }

    /// The address of `len` bytes at `offset` in the read-only mapping, for exporting a
    /// view. Dereferencing it is the caller's responsibility (and needs the chunk to be
    /// protected). Only openers have a read-only mapping; the writer exports no views.
    pub fn view_address(&self, offset: u64, len: usize) -> Result<*const u8> {
        let start = self.check(offset, len)?;
        let base = match (self.view_base, self.access) {
            (Some(view), _) => view,
            (None, Access::ReadOnly) => self.base,
            (None, Access::ReadWrite) => {
                return Err(Error::InvalidArgument("the writer exports no views".into()));
            }
        };
        Ok(base.as_ptr().wrapping_add(start).cast_const())
    }

    /// Address and length of the read-only mapping views point into (openers only).
    pub fn view_mapping(&self) -> Option<(usize, usize)> {
        self.view_base
            .map(|base| (base.as_ptr() as usize, self.len))
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

fn out_of_range(offset: u64, len: usize) -> Error {
    Error::Corrupt(format!("range {offset}+{len} lies outside the segment"))
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

    fn unique(tag: &str) -> String {
        let r = random_bytes::<4>().unwrap();
        format!("mmct_{tag}_{}_{:x}", current_pid(), u32::from_le_bytes(r))
    }

    fn create(name: &str, len: usize) -> Result<Segment> {
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
    fn racy_copies_equal_plain_copies_at_every_alignment() {
        let name = unique("racy");
        let seg = create(&name, 4096).unwrap();
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        seg.write_from(0, bytes.as_slice().into()).unwrap();
        for offset in 0..17u64 {
            for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 200] {
                let mut plain = vec![0u8; len];
                let mut racy = vec![0u8; len];
                seg.read_into(offset, &mut plain).unwrap();
                seg.read_into_racy(offset, &mut racy).unwrap();
                assert_eq!(plain, racy, "offset {offset} len {len}");
            }
        }
        assert!(seg.read_into_racy(4090, &mut [0u8; 8]).is_err());
    }

    #[test]
    fn bounds_and_alignment_are_checked() {
        let name = unique("b");
        let seg = create(&name, 4096).unwrap();
        assert!(seg.atomic(4096 - 8).is_ok());
        assert!(seg.atomic(4096).is_err());
        assert!(seg.atomic(12).is_err());
        assert!(seg.read_into(4090, &mut [0u8; 8]).is_err());
        assert!(seg.write_from(u64::MAX, b"a".as_slice().into()).is_err());
    }

    #[test]
    fn existing_name_and_oversize_requests_fail_cleanly() {
        let name = unique("e");
        let _seg = create(&name, 4096).unwrap();
        assert!(matches!(create(&name, 4096), Err(Error::Exists(_))));
        let huge = shm_free_bytes().unwrap() as usize + (1 << 30);
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
        assert!(!watcher.lock_held(slot).unwrap());
        assert!(b.try_lock(slot).unwrap());
        assert!(b.lock_held(slot).unwrap());
        b.unlock(slot).unwrap();
        assert!(!watcher.lock_held(slot).unwrap());
        drop(seg);
        assert!(!watcher.lock_held(CREATOR).unwrap());
    }
}
