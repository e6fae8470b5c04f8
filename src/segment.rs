//! Named POSIX shared-memory segments, and every raw access to their bytes.
//!
//! This is the only module of the core with `unsafe` code touching shared memory (the other
//! is `python.rs`'s buffer-protocol boundary). Everything it hands out is safe to use:
//!
//! * atomics are handed out as `&AtomicU64` after a bounds and alignment check;
//! * plain bytes are only ever *copied* in or out through raw pointers — no `&[u8]` or
//!   `&mut [u8]` is ever formed over bytes that another process may write, because the
//!   compiler would be entitled to assume they do not change;
//! * the mapping lives as long as the `Segment`, which every view holds through an `Arc`.
//!
//! We use `libc` directly rather than the `shared_memory` crate named in DESIGN.md: that crate
//! hides the file descriptor (so no `posix_fallocate`, which is what turns "`/dev/shm` too
//! small" into an error at creation instead of a SIGBUS later), maps only read-write, is
//! `!Send`, and has not been released since 2022 (see ARCHITECTURE.md).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64};

use crate::error::{Error, Result};

/// Where the kernel exposes POSIX shared-memory names on Linux.
pub const SHM_DIR: &str = "/dev/shm";

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
    /// The pid that created (and alone may unlink) the segment; `None` for openers.
    creator_pid: Option<u32>,
    unlinked: AtomicBool,
    _fd: OwnedFd,
}

// SAFETY: `Segment` owns its mapping; the raw `base` pointer is only dereferenced through
// methods that perform atomic operations or raw copies, which are sound from any thread
// (the bytes are shared with other processes anyway, so no thread-local assumption exists).
unsafe impl Send for Segment {}
// SAFETY: see `Send`: all access through `&Segment` is atomic or a raw copy.
unsafe impl Sync for Segment {}

fn c_name(name: &str) -> Result<CString> {
    CString::new(format!("/{}", name.trim_start_matches('/')))
        .map_err(|_| Error::InvalidArgument(format!("segment name {name:?} contains a NUL byte")))
}

/// Map `open(2)`-family errors to the variants users expect.
fn open_error(name: &str, err: io::Error) -> Error {
    match err.raw_os_error() {
        Some(libc::EEXIST) => Error::Exists(name.to_owned()),
        Some(libc::ENOENT) => Error::NotFound(name.to_owned()),
        Some(libc::EACCES) | Some(libc::EPERM) => Error::Permission(name.to_owned()),
        Some(libc::ENAMETOOLONG) | Some(libc::EINVAL) => {
            Error::InvalidArgument(format!("invalid shared-memory segment name {name:?}"))
        }
        _ => Error::os(format!("opening shared-memory segment {name:?}"), err),
    }
}

/// Bytes free in `/dev/shm` for an unprivileged user, if it can be asked.
pub fn shm_free_bytes() -> Option<u64> {
    let path = CString::new(SHM_DIR).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a valid NUL-terminated string and `st` points to writable storage of
    // the right type; statvfs initialises it when it returns 0.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    // fsblkcnt_t and c_ulong are not u64 on every platform.
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The calling process's id.
pub fn current_pid() -> u32 {
    std::process::id()
}

/// A process's start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`), which
/// together with the pid names a process uniquely even after the pid is reused.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: skip past its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether a process with this pid exists (one syscall; a zombie or a reused pid counts).
pub fn pid_exists(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: kill with signal 0 sends nothing; it only checks that the pid exists.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether the process `pid` that started at `start_time` (0: unknown) is still running.
pub fn process_alive(pid: u32, start_time: u64) -> bool {
    if !pid_exists(pid) {
        return false;
    }
    // A zombie has exited: its memory is gone and it will never acknowledge anything.
    if let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) {
        if let Some(state) = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
        {
            if state == "Z" || state == "X" {
                return false;
            }
        }
    }
    start_time == 0 || process_start_time(pid).is_none_or(|t| t == start_time)
}

/// `n` bytes from the kernel's random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    use std::io::Read;
    let mut out = [0u8; N];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .map_err(|e| Error::os("reading /dev/urandom", e))?;
    Ok(out)
}

/// Names (without the leading '/') of every entry in `/dev/shm`.
pub fn list_names() -> Vec<String> {
    fs::read_dir(SHM_DIR)
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Remove a segment's name; its memory is freed when the last mapping goes.
pub fn unlink(name: &str) -> Result<()> {
    let cname = c_name(name)?;
    // SAFETY: `cname` is a valid NUL-terminated string.
    if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
        return Err(open_error(name, io::Error::last_os_error()));
    }
    Ok(())
}

fn map(fd: &OwnedFd, len: usize, access: Access, populate: bool) -> io::Result<NonNull<u8>> {
    let prot = match access {
        Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        Access::ReadOnly => libc::PROT_READ,
    };
    let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
    // SAFETY: we ask the kernel for a fresh mapping (null hint) of an fd we own; the result is
    // checked against MAP_FAILED before use.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))
}

impl Segment {
    /// Create a new segment of `len` bytes, private to this user (mode 0600), with every page
    /// reserved and mapped now, so that a host without enough shared memory fails here with
    /// `ShmTooSmall` and never with a SIGBUS at first touch.
    pub fn create(name: &str, len: usize) -> Result<Segment> {
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
        // The umask may have narrowed the mode; make sure it is exactly owner read-write.
        // SAFETY: fchmod on an fd we own.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) } != 0 {
            return Err(fail(Error::os("fchmod", io::Error::last_os_error())));
        }
        // SAFETY: ftruncate on an fd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(fail(Error::os("ftruncate", io::Error::last_os_error())));
        }
        // SAFETY: posix_fallocate on an fd we own; it returns an error number, not -1.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
        if rc == libc::ENOSPC || rc == libc::ENOMEM {
            return Err(fail(Error::ShmTooSmall {
                needed: len as u64,
                available: shm_free_bytes().unwrap_or(0),
            }));
        } else if rc != 0 && rc != libc::EOPNOTSUPP {
            return Err(fail(Error::os(
                "reserving shared memory",
                io::Error::from_raw_os_error(rc),
            )));
        }
        let base = map(&fd, len, Access::ReadWrite, true)
            .map_err(|e| fail(Error::os("mapping shared memory", e)))?;
        Ok(Segment {
            name: name.trim_start_matches('/').to_owned(),
            base,
            view_base: None,
            len,
            access: Access::ReadWrite,
            creator_pid: Some(current_pid()),
            unlinked: AtomicBool::new(false),
            _fd: fd,
        })
    }

    /// Open an existing segment by name.
    pub fn open(name: &str, access: Access) -> Result<Segment> {
        let cname = c_name(name)?;
        let oflag = match access {
            Access::ReadWrite => libc::O_RDWR,
            Access::ReadOnly => libc::O_RDONLY,
        } | libc::O_CLOEXEC;
        // SAFETY: `cname` is a valid NUL-terminated string; the returned fd is checked.
        let raw = unsafe { libc::shm_open(cname.as_ptr(), oflag, 0) };
        if raw < 0 {
            return Err(open_error(name, io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a freshly opened fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat on an fd we own into storage of the right type.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(Error::os("fstat", io::Error::last_os_error()));
        }
        // SAFETY: fstat returned 0, so `st` is initialised.
        let size = unsafe { st.assume_init() }.st_size;
        let len = usize::try_from(size)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| Error::Corrupt(format!("segment {name:?} has size {size}")))?;
        let base =
            map(&fd, len, access, false).map_err(|e| Error::os("mapping shared memory", e))?;
        let view_base = match access {
            Access::ReadWrite => Some(map(&fd, len, Access::ReadOnly, true).map_err(|e| {
                // SAFETY: `base` is the mapping made just above; nothing refers to it yet.
                unsafe { libc::munmap(base.as_ptr().cast(), len) };
                Error::os("mapping shared memory read-only", e)
            })?),
            Access::ReadOnly => None,
        };
        Ok(Segment {
            name: name.trim_start_matches('/').to_owned(),
            base,
            view_base,
            len,
            access,
            creator_pid: None,
            unlinked: AtomicBool::new(false),
            _fd: fd,
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

    fn check(&self, offset: u64, len: usize) -> Result<usize> {
        let start = usize::try_from(offset).map_err(|_| out_of_range(offset, len))?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(out_of_range(offset, len)),
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

    /// Copy `dst.len()` bytes out of the segment, starting at `offset`.
    ///
    /// The source bytes may be written concurrently by another process; callers detect that
    /// with the chunk's id re-check (seqlock) and discard the copy. The copy itself never
    /// forms a reference to the shared bytes.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let start = self.check(offset, dst.len())?;
        // SAFETY: the source range is inside the mapping (checked), `dst` is a distinct
        // exclusive Rust buffer, so the ranges cannot overlap; a byte copy has no alignment
        // requirement.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(start),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copy `src` into the segment at `offset` (writer only).
    pub fn write_from(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_writable()?;
        let start = self.check(offset, src.len())?;
        // SAFETY: the destination range is inside a read-write mapping (checked); the writer
        // owns this range (the ring allocator handed it out and no reader acts on it until
        // the chunk's id is published with Release), and `src` is ordinary memory that is not
        // part of the destination range.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.as_ptr().add(start), src.len())
        };
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

    /// Whether this handle is the creator's, in the creating process.
    pub fn is_owner(&self) -> bool {
        self.creator_pid == Some(current_pid())
    }

    /// Remove the segment's name: only by its creator, only in the creating process (never
    /// by a forked child, whose copy of this struct has the parent's pid), at most once.
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
        let _ = self.unlink();
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

    fn unique(tag: &str) -> String {
        let r = random_bytes::<4>().unwrap();
        format!("mmct_{tag}_{}_{:x}", current_pid(), u32::from_le_bytes(r))
    }

    #[test]
    fn create_open_round_trip_and_unlink_once() {
        let name = unique("rt");
        let seg = Segment::create(&name, 8192).unwrap();
        seg.write_from(100, b"hello").unwrap();
        seg.atomic(64)
            .unwrap()
            .store(42, std::sync::atomic::Ordering::Release);
        let other = Segment::open(&name, Access::ReadOnly).unwrap();
        let mut out = [0u8; 5];
        other.read_into(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert_eq!(
            other
                .atomic(64)
                .unwrap()
                .load(std::sync::atomic::Ordering::Acquire),
            42
        );
        assert!(
            other.write_from(0, b"x").is_err(),
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
    fn bounds_and_alignment_are_checked() {
        let name = unique("b");
        let seg = Segment::create(&name, 4096).unwrap();
        assert!(seg.atomic(4096 - 8).is_ok());
        assert!(seg.atomic(4096).is_err());
        assert!(seg.atomic(12).is_err());
        assert!(seg.read_into(4090, &mut [0u8; 8]).is_err());
        assert!(seg.write_from(u64::MAX, b"a").is_err());
    }

    #[test]
    fn existing_name_and_oversize_requests_fail_cleanly() {
        let name = unique("e");
        let _seg = Segment::create(&name, 4096).unwrap();
        assert!(matches!(
            Segment::create(&name, 4096),
            Err(Error::Exists(_))
        ));
        let huge = shm_free_bytes().unwrap() as usize + (1 << 30);
        let name2 = unique("big");
        assert!(matches!(
            Segment::create(&name2, huge),
            Err(Error::ShmTooSmall { .. })
        ));
        assert!(matches!(
            Segment::open(&name2, Access::ReadOnly),
            Err(Error::NotFound(_))
        ));
    }

    #[test]
    fn liveness_of_this_and_a_dead_process() {
        let me = current_pid();
        assert!(process_alive(me, process_start_time(me).unwrap()));
        assert!(!process_alive(me, process_start_time(me).unwrap() + 1));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!process_alive(pid, 0));
    }
}
