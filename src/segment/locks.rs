//! The OFD liveness locks on a segment's byte ranges (exclusive, shared, and the one waited
//! for) and the futex calls on its words. Locks go through the segment's second, never-mapped
//! descriptor (see the module docs of [`segment`](super)); probes through the mapping's.

use std::io;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use super::fork::LockFd;
use super::os::{SHM_DIR, flock, fstat, lock_held, ofd_fcntl, open_regular, unlink};
use super::{Access, LockRange, Segment};
use crate::error::{Error, Result};

/// An exclusive lock on a byte range of the file `/dev/shm/<name>` referred to when it was
/// taken, for whoever removes a segment it does not belong to (an orphan's sweep): if every
/// process that removes a segment's name first locks the file that name refers to, nobody can
/// give the name to another file between a sweep's verdict on it and its removal.
#[derive(Debug)]
pub struct NameLock {
    name: String,
    fd: LockFd,
}

impl NameLock {
    /// Open `/dev/shm/<name>` and take the exclusive lock on `range` through a new open file
    /// description, waiting up to `wait` for it: `None` if the name is gone, or if another
    /// description holds a lock there for longer. The wait is bounded, not `F_OFD_SETLKW`:
    /// any process that can open a file of that name may lock it for as long as it likes.
    pub fn take(name: &str, range: LockRange, wait: Duration) -> Result<Option<NameLock>> {
        let fd = match LockFd::open(|| open_regular(name, Access::ReadWrite).map(|(fd, _)| fd)) {
            Ok(fd) => fd,
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_micros(50);
        loop {
            match ofd_fcntl(
                fd.fd(),
                libc::F_OFD_SETLK,
                &mut flock(libc::F_WRLCK as _, range),
            ) {
                Ok(()) => {
                    return Ok(Some(NameLock {
                        name: name.to_owned(),
                        fd,
                    }));
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(pause.min(deadline - now));
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
                Err(e) => return Err(Error::os("locking a segment to remove it", e)),
            }
        }
    }

    /// Whether the name still refers to the file locked (not removed, nor given to another).
    pub fn still_named(&self) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let locked = fstat(self.fd.fd())?;
        Ok(
            std::fs::symlink_metadata(format!("{SHM_DIR}/{}", self.name)).is_ok_and(|named| {
                named.dev() == locked.st_dev as u64 && named.ino() == locked.st_ino as u64
            }),
        )
    }

    /// Remove the name (the lock goes when this is dropped).
    pub fn unlink(&self) -> Result<()> {
        unlink(&self.name)
    }
}

impl Segment {
    /// Whether the creator took its liveness lock (false only where the kernel has no OFD
    /// locks, and for segments opened rather than created).
    pub fn holds_locks(&self) -> bool {
        self.creator_locked
    }

    fn lock_fd(&self) -> Result<&OwnedFd> {
        match &self.lock_fd {
            Some(fd) => Ok(fd.fd()),
            None => Err(Error::InvalidArgument(
                "a segment opened read-only takes no locks".into(),
            )),
        }
    }

    /// Take the OFD lock on `range` if no other open file description holds it: `Ok(true)`
    /// when taken, `Ok(false)` when someone else holds it.
    pub fn try_lock(&self, range: LockRange) -> Result<bool> {
        match ofd_fcntl(
            self.lock_fd()?,
            libc::F_OFD_SETLK,
            &mut flock(libc::F_WRLCK as _, range),
        ) {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Ok(false)
            }
            Err(e) => Err(Error::os("taking a liveness lock", e)),
        }
    }

    /// Take a shared OFD lock on `range` unless another open file description holds an
    /// exclusive one there: `Ok(true)` when taken.
    pub fn try_lock_shared(&self, range: LockRange) -> Result<bool> {
        match ofd_fcntl(
            self.lock_fd()?,
            libc::F_OFD_SETLK,
            &mut flock(libc::F_RDLCK as _, range),
        ) {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Ok(false)
            }
            Err(e) => Err(Error::os("taking a shared liveness lock", e)),
        }
    }

    /// Take the exclusive OFD lock on `range`, waiting while another open file description
    /// holds one there (the kernel gives it up when its holder dies). For short critical
    /// sections only: joining and leaving a store.
    pub fn lock_wait(&self, range: LockRange) -> Result<()> {
        loop {
            match ofd_fcntl(
                self.lock_fd()?,
                libc::F_OFD_SETLKW,
                &mut flock(libc::F_WRLCK as _, range),
            ) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(Error::os("waiting for the membership lock", e)),
            }
        }
    }

    /// Give back a lock taken with [`Segment::try_lock`], [`Segment::try_lock_shared`] or
    /// [`Segment::lock_wait`] (closing the segment does too).
    pub fn unlock(&self, range: LockRange) -> Result<()> {
        ofd_fcntl(
            self.lock_fd()?,
            libc::F_OFD_SETLK,
            &mut flock(libc::F_UNLCK as _, range),
        )
        .map_err(|e| Error::os("releasing a liveness lock", e))
    }

    /// Whether anyone (any process, any PID namespace, this segment's own lock descriptor
    /// included) holds a lock on `range`. The probe goes through the mapping's descriptor,
    /// which never holds one.
    pub fn lock_held(&self, range: LockRange) -> Result<bool> {
        lock_held(&self.fd, range)
    }

    /// Whether an open file description other than this segment's lock descriptor (in any
    /// process) holds a lock on `range`: the probe goes through the lock descriptor, whose own
    /// locks never conflict with it.
    pub fn lock_held_by_others(&self, range: LockRange) -> Result<bool> {
        lock_held(self.lock_fd()?, range)
    }

    /// Sleep while the 32-bit word at `offset` (the low half of an aligned `u64` field, on a
    /// little-endian host) holds `expected`, at most `timeout` (`FUTEX_WAIT` on a shared
    /// mapping: a wake from any process mapping the file ends it). Returns on a wake, a
    /// timeout, a signal, or at once if the word differs: callers re-check the word.
    pub fn futex_wait(&self, offset: u64, expected: u32, timeout: Duration) -> Result<()> {
        let word = self.atomic(offset)?;
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `word` is an aligned, in-bounds word of our shared mapping (checked by
        // `atomic`), valid for the duration of the call; its low 32 bits are the futex word
        // (little-endian, asserted in lib.rs). FUTEX_WAIT only reads it and sleeps; `ts` is a
        // valid relative timeout living on our stack for the call. The unused arguments are
        // null/0 as FUTEX_WAIT requires.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr().cast::<u32>(),
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::ETIMEDOUT) | Some(libc::EINTR) => Ok(()),
            _ => Err(Error::os("waiting on a store lock", err)),
        }
    }

    /// Wake up to `count` processes sleeping in [`Segment::futex_wait`] on the word at
    /// `offset`.
    pub fn futex_wake(&self, offset: u64, count: i32) -> Result<()> {
        let word = self.atomic(offset)?;
        // SAFETY: as in `futex_wait`; FUTEX_WAKE does not touch the word, only the kernel's
        // wait queue keyed by it.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr().cast::<u32>(),
                libc::FUTEX_WAKE,
                count,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            )
        };
        if rc < 0 {
            return Err(Error::os("waking a store lock", io::Error::last_os_error()));
        }
        Ok(())
    }
}
