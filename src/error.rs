//! The one error type of the core (the payload codec has its own, `codec::FormatError`).
//! `python/errors.rs` maps each variant to one Python exception.

use std::fmt;
use std::io;

/// Everything that can go wrong in the core, each with a message that says what to do.
#[derive(Debug)]
pub enum Error {
    /// A caller passed an argument outside its documented range.
    InvalidArgument(String),
    /// `put` with a key that is already stored.
    DuplicateKey(String),
    /// An object larger than the store's `max_object_size`.
    TooLarge { size: u64, max: u64 },
    /// No space could be reclaimed: every candidate chunk is unread, pinned or viewed.
    Full { needed: u64, capacity: u64 },
    /// The host's shared-memory filesystem cannot hold the segment.
    ShmTooSmall { needed: u64, available: u64 },
    /// The host's shared-memory filesystem has no file left to give (its inodes are used up),
    /// whatever its free bytes: segment `name` could not be created.
    ShmNoFiles(String),
    /// `issue` / `pin` of an absent key.
    KeyNotFound(String),
    /// A segment with this name exists already.
    Exists(String),
    /// No segment with this name.
    NotFound(String),
    /// The segment belongs to someone else.
    Permission(String),
    /// The segment failed validation: corrupt, foreign or of another layout version.
    Corrupt(String),
    /// The store was closed.
    Closed,
    /// A handle that cannot have come from this store's writer for this key.
    InvalidHandle(String),
    /// A genuine handle whose object is gone.
    Stale,
    /// The writer of the segment closed it or exited.
    WriterGone(String),
    /// Every reader slot is claimed.
    NoReaderSlot(u32),
    /// Every writer slot has a live writer (`max_writers` of them).
    NoWriterSlot(u32),
    /// The key index holds as many objects and claims as it was sized for (`max_objects`)
    /// and none can be evicted.
    IndexFull(u64),
    /// A name in `/dev/shm` that is not a regular file (a directory, FIFO, symbolic link...).
    NotASegment(String),
    /// A writer or reader used in a process other than the one that created or attached it
    /// (a forked child).
    WrongProcess(String),
    /// One more reference to `key` would overflow a reader slot's counter: that reader has
    /// `limit` unread references to it.
    Saturated { key: String, slot: u32, limit: u32 },
    /// Any other operating-system failure, with what was being done.
    Os { context: String, source: io::Error },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn os(context: impl Into<String>, source: io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument(msg) => write!(f, "{msg}"),
            Error::DuplicateKey(key) => write!(
                f,
                "key {key:?} is already stored; invalidate it first or use get_cached()"
            ),
            Error::TooLarge { size, max } => write!(
                f,
                "object of {size} bytes exceeds max_object_size ({max} bytes); serve it uncached \
                 or create the store with a larger max_object_size"
            ),
            Error::Full { needed, capacity } => write!(
                f,
                "no space for {needed} bytes in a ring of {capacity} bytes: every candidate chunk \
                 is unread, pinned or viewed; serve this object uncached, read or release \
                 outstanding handles, or use a larger capacity"
            ),
            Error::ShmTooSmall { needed, available } => write!(
                f,
                "shared memory too small: the segment needs {needed} bytes but /dev/shm has \
                 {available} bytes free; lower the cache capacity or enlarge /dev/shm (Docker: \
                 --shm-size=<size> or --ipc=host; Kubernetes: an emptyDir volume with \
                 medium: Memory mounted at /dev/shm)"
            ),
            Error::ShmNoFiles(name) => write!(
                f,
                "shared memory has no room for one more file: /dev/shm's inodes are used up \
                 (by other processes' files), so segment {name:?} could not be created; \
                 remove what is left there (`mmcache prune` removes this package's orphans) or \
                 give /dev/shm more inodes (mount option nr_inodes)"
            ),
            Error::KeyNotFound(key) => write!(f, "{key:?}"),
            Error::Exists(name) => write!(
                f,
                "shared-memory segment {name:?} already exists; pick another name, or run \
                 `mmcache prune` if it was left behind by a dead process"
            ),
            Error::NotFound(name) => write!(
                f,
                "shared-memory segment {name:?} does not exist (its writer closed it or never \
                 created it)"
            ),
            Error::Permission(name) => write!(
                f,
                "permission denied for shared-memory segment {name:?}: segments are private \
                 (mode 0600) to the user that created them"
            ),
            Error::Corrupt(msg) => write!(
                f,
                "shared-memory segment failed validation: {msg}; it is corrupt, was not made by \
                 this version of mmcache, or was overwritten — recreate the cache"
            ),
            Error::Closed => write!(f, "the store is closed; create or attach a new one"),
            Error::InvalidHandle(msg) => write!(
                f,
                "invalid handle: {msg}; it was forged, truncated, or signed for another key or \
                 store — nothing was read"
            ),
            Error::Stale => write!(
                f,
                "the object behind this handle is gone (evicted, invalidated or cleared); \
                 retry the request with its data attached"
            ),
            Error::WriterGone(msg) => write!(
                f,
                "{msg}; the cache is unusable — re-create it (and run `mmcache prune` to remove \
                 segments of dead writers)"
            ),
            Error::NoReaderSlot(n) => write!(
                f,
                "all {n} reader slots of this segment are taken; create the writer with a larger \
                 n_readers or close an attached reader first"
            ),
            Error::NoWriterSlot(n) => write!(
                f,
                "all {n} writer slots of this store are taken (max_writers={n}); create the \
                 store with a larger max_writers or close a writer first"
            ),
            Error::IndexFull(n) => write!(
                f,
                "the store's key index holds max_objects={n} objects and claims, and every \
                 object is unread, pinned or viewed; serve this object uncached, or create the \
                 store with a larger max_objects"
            ),
            Error::NotASegment(what) => write!(
                f,
                "{what}, not a shared-memory segment of mmcache; nothing was opened"
            ),
            Error::WrongProcess(what) => write!(
                f,
                "{what} was made in another process: after fork() a child cannot use its \
                 parent's shared-memory writer or reader (create a new writer, or attach a new \
                 reader in the child)"
            ),
            Error::Saturated { key, slot, limit } => write!(
                f,
                "reader slot {slot} already has {limit} unread references to {key:?}, the most \
                 it can count: that reader is not reading (a stuck worker, or aborted requests \
                 whose handles were never given back with release_handles); serve this item \
                 uncached"
            ),
            Error::Os { context, source } => write!(f, "{context}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Os { source, .. } => Some(source),
            _ => None,
        }
    }
}
