//! What segments need of the operating system besides their mappings: the files in
//! `/dev/shm` (opening, probing, listing, unlinking, free space) and their OFD locks, other
//! processes (existence, start time, liveness) and the kernel's random source.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::naming::{c_name, c_path};
use super::{Access, LockRange};
use crate::error::{Error, Result};

/// Where the kernel exposes POSIX shared-memory names on Linux.
pub const SHM_DIR: &str = "/dev/shm";

// ----------------------------------------------------------------------------------------
// Files in `/dev/shm`
// ----------------------------------------------------------------------------------------

/// Map `open(2)`-family errors to the variants users expect.
pub(super) fn open_error(name: &str, err: io::Error) -> Error {
    match err.raw_os_error() {
        Some(libc::EEXIST) => Error::Exists(name.to_owned()),
        // Only a creation meets it: tmpfs has no inode left (its bytes are checked apart).
        Some(libc::ENOSPC) => Error::ShmNoFiles(name.to_owned()),
        Some(libc::ENOENT) => Error::NotFound(name.to_owned()),
        Some(libc::EACCES) | Some(libc::EPERM) => Error::Permission(name.to_owned()),
        Some(libc::ENAMETOOLONG) | Some(libc::EINVAL) => {
            Error::InvalidArgument(format!("invalid shared-memory segment name {name:?}"))
        }
        _ => Error::os(format!("opening shared-memory segment {name:?}"), err),
    }
}

/// Open `/dev/shm/<name>` without following a symbolic link or blocking on a FIFO, and
/// check that it is a regular file; returns the descriptor and the file's size.
pub(super) fn open_regular(name: &str, access: Access) -> Result<(OwnedFd, usize)> {
    let path = c_path(name)?;
    let oflag = match access {
        Access::ReadWrite => libc::O_RDWR,
        Access::ReadOnly => libc::O_RDONLY,
    } | libc::O_CLOEXEC
        | libc::O_NOFOLLOW
        | libc::O_NONBLOCK;
    // SAFETY: `path` is a valid NUL-terminated string; the returned fd is checked.
    let raw = unsafe { libc::open(path.as_ptr(), oflag) };
    if raw < 0 {
        let err = io::Error::last_os_error();
        return Err(match err.raw_os_error() {
            Some(libc::ELOOP) => Error::NotASegment(format!("{SHM_DIR}/{name} is a symbolic link")),
            Some(libc::EISDIR) => Error::NotASegment(format!("{SHM_DIR}/{name} is a directory")),
            _ => open_error(name, err),
        });
    }
    // SAFETY: `raw` is a freshly opened fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let st = fstat(&fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => "a directory",
            libc::S_IFIFO => "a FIFO",
            libc::S_IFSOCK => "a socket",
            libc::S_IFCHR | libc::S_IFBLK => "a device",
            _ => "not a regular file",
        };
        return Err(Error::NotASegment(format!("{SHM_DIR}/{name} is {kind}")));
    }
    let len = usize::try_from(st.st_size)
        .map_err(|_| Error::Corrupt(format!("segment {name:?} has size {}", st.st_size)))?;
    Ok((fd, len))
}

pub(super) fn fstat(fd: &OwnedFd) -> Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat on an fd we own into storage of the right type.
    if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return Err(Error::os("fstat", io::Error::last_os_error()));
    }
    // SAFETY: fstat returned 0, so `st` is initialised.
    Ok(unsafe { st.assume_init() })
}

/// The size of `/dev/shm/<name>` and up to its first `N` bytes (zeros past its end), read
/// rather than mapped: whoever can write the file may shrink it at any moment, which would be
/// a SIGBUS at a mapped access, and is a short read here (regular files only; see
/// [`Segment::open`](super::Segment::open)).
pub fn read_start<const N: usize>(name: &str) -> Result<(usize, [u8; N])> {
    let (fd, len) = open_regular(name, Access::ReadOnly)?;
    let mut out = [0u8; N];
    read_from_start(&fd, name, &mut out)?;
    Ok((len, out))
}

/// Fill `buf` from the start of the file `fd` (`/dev/shm/<name>`) until it is full or the
/// file ends: the bytes read (fewer for a file shorter than `buf`, or shrunk meanwhile).
pub(super) fn read_from_start(fd: &OwnedFd, name: &str, buf: &mut [u8]) -> Result<usize> {
    use std::os::unix::fs::FileExt;
    let failed = |e| Error::os(format!("reading {SHM_DIR}/{name}"), e);
    let file = fs::File::from(fd.try_clone().map_err(failed)?);
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], filled as u64) {
            Ok(0) => break,
            Ok(got) => filled += got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(failed(e)),
        }
    }
    Ok(filled)
}

/// What `prune` needs to know of a name in `/dev/shm`, read without mapping it.
#[derive(Clone, Copy, Debug)]
pub struct FileProbe {
    pub size: u64,
    /// Seconds since the file last changed.
    pub age_secs: u64,
    /// Whether any lock (a writer's shared one included) is held on `creator_lock` (OFD
    /// locks: any PID namespace).
    pub creator_lock_held: bool,
    /// Whether the file takes OFD locks at all (false: its creator, if alive, holds none).
    pub locks_supported: bool,
}

/// Probe `/dev/shm/<name>` (regular files only; see [`Segment::open`](super::Segment::open)).
/// The size is read before the lock is tested: a creator locks before it sizes the file, so
/// a size seen before a free lock means that creator is gone.
pub fn probe_file(name: &str, creator_lock: LockRange) -> Result<FileProbe> {
    let (fd, size) = open_regular(name, Access::ReadOnly)?;
    let st = fstat(&fd)?;
    let changed = std::time::UNIX_EPOCH + std::time::Duration::from_secs(st.st_ctime.max(0) as u64);
    let age_secs = std::time::SystemTime::now()
        .duration_since(changed)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (creator_lock_held, locks_supported) = match lock_held(&fd, creator_lock) {
        Ok(held) => (held, true),
        Err(Error::Os { source, .. }) if locks_unsupported(&source) => (false, false),
        Err(e) => return Err(e),
    };
    Ok(FileProbe {
        size: size as u64,
        age_secs,
        creator_lock_held,
        locks_supported,
    })
}

/// Names (without the leading '/') of the regular files in `/dev/shm` that `by_name` accepts
/// or whose first `N` bytes `by_prefix` accepts (a file shorter than that is not accepted).
///
/// Every store's creation lists `/dev/shm` this way (to remove orphans), so a file that is not
/// accepted by name costs three system calls, not the four of [`read_start`]: it is opened
/// through the directory's descriptor and read once, without an `fstat`, because its directory
/// entry said it is a regular file (`O_NOFOLLOW | O_NONBLOCK`: something put under that name
/// since is not followed and never blocks the open or the read).
pub fn list_files<const N: usize>(
    by_name: impl Fn(&str) -> bool,
    by_prefix: impl Fn(&[u8; N]) -> bool,
) -> Vec<String> {
    let Ok(entries) = fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let dir = open_dir();
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        // A name that is not UTF-8 is no segment's: every name this package makes is UTF-8.
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| {
            by_name(name)
                || dir
                    .as_ref()
                    .and_then(|dir| prefix_at::<N>(dir, name))
                    .is_some_and(|prefix| by_prefix(&prefix))
        })
        .collect()
}

/// A descriptor of `/dev/shm` itself, for `openat`.
fn open_dir() -> Option<OwnedFd> {
    let path = CString::new(SHM_DIR).ok()?;
    // SAFETY: `path` is a valid NUL-terminated string; the returned fd is checked.
    let raw = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    // SAFETY: a non-negative `raw` is a freshly opened fd that nothing else owns.
    (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw) })
}

/// The first `N` bytes of the file `name` in the directory `dir` (see [`list_files`]).
fn prefix_at<const N: usize>(dir: &OwnedFd, name: &str) -> Option<[u8; N]> {
    let name = CString::new(name).ok()?;
    let flags =
        libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
    // SAFETY: `dir` is an open directory descriptor and `name` a valid NUL-terminated string;
    // the returned fd is checked.
    let raw = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` is a freshly opened fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut out = [0u8; N];
    // SAFETY: `out` is writable storage of `N` bytes that we own.
    let got = unsafe { libc::read(fd.as_raw_fd(), out.as_mut_ptr().cast(), N) };
    (usize::try_from(got) == Ok(N)).then_some(out)
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

/// Bytes free in `/dev/shm` for an unprivileged user, if it can be asked; `None` also for a
/// tmpfs without a size limit (`size=0`), which reports no blocks at all (0 total, 0 free):
/// it is not full, and only memory bounds what it holds.
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
    if st.f_blocks == 0 {
        return None;
    }
    // fsblkcnt_t and c_ulong are not u64 on every platform.
    #[allow(clippy::unnecessary_cast)]
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

// ----------------------------------------------------------------------------------------
// OFD locks: liveness that the kernel keeps
// ----------------------------------------------------------------------------------------

pub(super) fn flock(kind: libc::c_int, range: LockRange) -> libc::flock {
    // SAFETY: `flock` is a plain C struct; all-zeroes is valid (and l_pid must be 0 for OFD
    // locks).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = range.start as libc::off_t;
    lock.l_len = range.len as libc::off_t;
    lock
}

/// One OFD-lock `fcntl` on `fd`.
pub(super) fn ofd_fcntl(fd: &OwnedFd, cmd: libc::c_int, lock: &mut libc::flock) -> io::Result<()> {
    // SAFETY: fcntl with an OFD lock command takes a pointer to a valid `flock`, which `lock`
    // is for the duration of the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), cmd, lock as *mut libc::flock) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether an OFD-lock error means "this kernel or filesystem has no OFD locks".
pub(super) fn locks_unsupported(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::ENOLCK)
    )
}

pub(super) fn lock_held(fd: &OwnedFd, range: LockRange) -> Result<bool> {
    let mut probe = flock(libc::F_WRLCK as _, range);
    ofd_fcntl(fd, libc::F_OFD_GETLK, &mut probe)
        .map_err(|e| Error::os("testing a liveness lock", e))?;
    Ok(probe.l_type != libc::F_UNLCK as libc::c_short)
}

// ----------------------------------------------------------------------------------------
// Processes
// ----------------------------------------------------------------------------------------

/// Let the calling thread yield the CPU to everything else (nice 19): for work that may lag,
/// such as the background reservation, so that it never slows the
/// thread that started it on a busy host. Best effort.
pub fn lower_thread_priority() {
    // SAFETY: gettid has no preconditions; setpriority on our own thread id (Linux applies a
    // thread id to that thread alone) changes only its scheduling weight.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

/// The calling process's id.
pub fn current_pid() -> u32 {
    std::process::id()
}

/// `/proc/<pid>/stat` after the command name (which may contain spaces and parentheses:
/// everything up to its last ')' is skipped); its first field is field 3, the state.
fn proc_stat_after_name(pid: u32) -> Option<String> {
    use std::io::Read;
    // Room for the whole line, so it comes in one read: `fs::read_to_string` takes the size
    // a /proc file reports (0) as its hint and reads in six growing pieces.
    let mut stat = String::with_capacity(1024);
    fs::File::open(format!("/proc/{pid}/stat"))
        .ok()?
        .read_to_string(&mut stat)
        .ok()?;
    let end = stat.rfind(')')? + 1;
    stat.drain(..end);
    Some(stat)
}

/// A process's start time in clock ticks since boot (field 22 of `/proc/<pid>/stat`), which
/// together with the pid names a process uniquely even after the pid is reused. Never cached:
/// a cache of this process's own would be inherited by forked children, and a descendant
/// that reuses an ancestor's pid would be given the ancestor's start time.
pub fn process_start_time(pid: u32) -> Option<u64> {
    proc_stat_after_name(pid)?
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
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

/// Whether the process `pid` that started at `start_time` (0: unknown; only its low 32 bits
/// count) is still running.
pub fn process_alive(pid: u32, start_time: u64) -> bool {
    if !pid_exists(pid) {
        return false;
    }
    // One read of /proc/<pid>/stat gives both the state and the start time.
    let Some(stat) = proc_stat_after_name(pid) else {
        return true; // it exists, but /proc does not show it (e.g. another namespace's /proc)
    };
    let mut fields = stat.split_whitespace();
    // A zombie has exited: its memory is gone and it will never acknowledge anything.
    if matches!(fields.next(), Some("Z" | "X")) {
        return false;
    }
    // Compare the low 32 bits only: reader slots keep no more (clock ticks since boot: over
    // a year of uptime at 100 Hz before two start times could share them).
    let started = fields.nth(18).and_then(|t| t.parse::<u64>().ok());
    start_time == 0 || started.is_none_or(|t| t as u32 == start_time as u32)
}

/// End this process at once with SIGKILL, as a crash would (the store's crash-point tests).
pub fn kill_self() -> ! {
    // SAFETY: raising a signal has no memory-safety preconditions; SIGKILL cannot be caught,
    // so the call does not return.
    unsafe { libc::raise(libc::SIGKILL) };
    // Unreachable unless SIGKILL was somehow not delivered; abort is the next best crash.
    std::process::abort()
}

// ----------------------------------------------------------------------------------------
// Randomness
// ----------------------------------------------------------------------------------------

/// `n` bytes from the kernel's random source.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    // One system call (not open, read and close of /dev/urandom): a creation asks three times.
    while filled < N {
        // SAFETY: `out[filled..]` is writable storage of `N - filled` bytes that we own.
        let got = unsafe { libc::getrandom(out[filled..].as_mut_ptr().cast(), N - filled, 0) };
        if got < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::os("getrandom", err));
        }
        filled += got as usize;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
