//! Crash points: named places in the writer's code where a test can have the process killed
//! with SIGKILL, to prove that a writer dying at that instant wedges nobody (ARCHITECTURE.md
//! lists every point and the test that kills a writer there).
//!
//! `MMCACHE_CRASH_POINT=<name>` arms one point, read once, when the process makes its first
//! writer; `MMCACHE_CRASH_AFTER=<n>` (default 1) kills at the point's n-th pass, so a test
//! can let earlier operations through. Unarmed, a point costs one Relaxed load of a static.
//!
//! Unit tests also have a [`hook`]: code of theirs run at a place (between two slices of a
//! `stats` walk, the ring lock given back; in a carve, before its announcement and before
//! its CAS) on the thread that set it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::segment;

/// Every crash point, in the order a put meets them (and then the others).
pub const POINTS: &[&str] = &[
    "alloc.locked",
    "alloc.buffer_marked",
    "alloc.marked",
    "alloc.unindexed",
    "alloc.evicted",
    "alloc.coalesced",
    "alloc.reserved",
    "lab.announced",
    "lab.split",
    "put.reserved",
    "put.mid_copy",
    "put.filled",
    "publish.filing",
    "publish.id",
    "publish.live",
    "put.published",
    "issue.protected",
    "claim.recorded",
    "clear.partway",
];

static ARMED: AtomicBool = AtomicBool::new(false);
static PASSES: AtomicU64 = AtomicU64::new(0);
static ARMING: OnceLock<Option<(String, u64)>> = OnceLock::new();

/// Read the environment once (on the process's first writer).
pub(super) fn init() {
    ARMING.get_or_init(|| {
        let point = std::env::var("MMCACHE_CRASH_POINT").ok()?;
        let after = std::env::var("MMCACHE_CRASH_AFTER")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        ARMED.store(true, Ordering::Relaxed);
        Some((point, after))
    });
}

/// Whether any point is armed (to do extra work only a crash test needs).
#[inline]
pub(super) fn armed() -> bool {
    ARMED.load(Ordering::Relaxed)
}

/// Die here if `name` is the armed point and this is its n-th pass.
#[inline]
pub(super) fn point(name: &'static str) {
    if armed() {
        passed(name);
    }
}

#[cold]
fn passed(name: &'static str) {
    debug_assert!(POINTS.contains(&name), "unlisted crash point {name}");
    if let Some(Some((armed, after))) = ARMING.get() {
        if armed == name && PASSES.fetch_add(1, Ordering::Relaxed) + 1 >= *after {
            segment::kill_self();
        }
    }
}

/// A unit test's code, run on the thread that set it where the writer calls [`hook::run`]
/// with the place it was set for.
#[cfg(test)]
pub(super) mod hook {
    use std::cell::RefCell;

    /// A place: between two slices of a `stats` walk, the ring lock given back.
    pub(in crate::store) const STATS_SLICE: &str = "stats.slice";
    /// A carve from the writer's allocation buffer, after it read the buffer and before it
    /// announced the carve.
    pub(in crate::store) const LAB_CARVE: &str = "lab.carve";
    /// A carve, announced, before its CAS on the buffer's word.
    pub(in crate::store) const LAB_ANNOUNCED: &str = "lab.announced";

    type Hook = (&'static str, Box<dyn FnMut()>);

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Run `hook` at every pass of this thread at `place`, until [`clear`].
    pub(in crate::store) fn set(place: &'static str, hook: impl FnMut() + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some((place, Box::new(hook))));
    }

    pub(in crate::store) fn clear() {
        HOOK.with(|h| *h.borrow_mut() = None);
    }

    /// Run this thread's hook if it was set for `place` (not from inside a hook: a hook
    /// that puts passes places too).
    pub(in crate::store) fn run(place: &'static str) {
        HOOK.with(|h| {
            let Ok(mut running) = h.try_borrow_mut() else {
                return;
            };
            if let Some((at, hook)) = running.as_mut() {
                if *at == place {
                    hook();
                }
            }
        });
    }
}
