//! Making a fault in a segment mapping explain itself.
//!
//! Two faults can hit mmcache's mappings, both on purpose or outside our control:
//!
//! * **SIGSEGV in a read-only view mapping**: a consumer wrote into a zero-copy view (torch
//!   cannot make a read-only tensor, so an in-place op on a `copy=False` tensor writes into
//!   memory mapped `PROT_READ`). The fault is the protection working — the alternative is
//!   silently changing every other reader's input — but a bare "Segmentation fault" tells
//!   nobody why.
//! * **SIGBUS in any segment mapping**: another process of the same user truncated the
//!   segment's file, which no POSIX shared-memory API can prevent.
//!
//! A handler, installed once when the first mapping is registered, prints one line naming the
//! cause when the faulting address lies in a registered mapping, then hands the signal on to
//! whatever handler was installed before it (faulthandler's, say) or to the default action.
//! The same signal sent by a process (`kill`, `raise`: no fault, no instruction to run again)
//! goes to what was there before at once: ignored, that handler, or the default action.
//! It only uses async-signal-safe operations: atomic loads from a fixed table and `write(2)`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// How many mappings the explainer keeps track of (beyond that, faults go unexplained).
const SLOTS: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// Read-only mapping exporting zero-copy views.
    Views,
    /// Read-write mapping (the writer's, or a reader's atomics).
    Shared,
}

struct Entry {
    start: AtomicUsize,
    /// `len << 1 | is_views`; 0 = free entry.
    len_kind: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Entry = Entry {
    start: AtomicUsize::new(0),
    len_kind: AtomicUsize::new(0),
};
static TABLE: [Entry; SLOTS] = [FREE; SLOTS];
static PREVIOUS: OnceLock<[libc::sigaction; 2]> = OnceLock::new();
const SIGNALS: [libc::c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

const VIEW_WRITE: &[u8] = b"mmcache: this process wrote into a read-only zero-copy view of \
shared memory (an in-place op on a tensor or array resolved with copy=False); the write is \
refused so that no other reader's data changes - resolve with copy=True for data you modify\n";
const TRUNCATED: &[u8] = b"mmcache: a shared-memory segment was truncated under this process \
(SIGBUS); another process of the same user changed its file in /dev/shm, which no cache can \
defend against - recreate the cache\n";

/// A registered mapping; unregistered on drop.
#[derive(Debug)]
pub struct Registered(Option<usize>);

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            TABLE[i].len_kind.store(0, Ordering::Release);
        }
    }
}

/// Explain faults in `[start, start + len)` from now until the returned guard is dropped.
pub fn register(start: *const u8, len: usize, kind: Mapping) -> Registered {
    install();
    let len_kind = (len << 1) | (kind == Mapping::Views) as usize;
    for (i, entry) in TABLE.iter().enumerate() {
        // Claim a free entry (len_kind 0 -> a sentinel), then publish its range.
        if entry
            .len_kind
            .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            entry.start.store(start as usize, Ordering::Relaxed);
            // Release pairs with the handler's Acquire load: it sees `start` with `len_kind`.
            entry.len_kind.store(len_kind, Ordering::Release);
            return Registered(Some(i));
        }
    }
    Registered(None)
}

fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut previous: [libc::sigaction; 2] = [empty_action(), empty_action()];
        for (sig, old) in SIGNALS.iter().zip(previous.iter_mut()) {
            // SAFETY: querying the current disposition into storage of the right type.
            if unsafe { libc::sigaction(*sig, std::ptr::null(), old) } != 0 {
                return;
            }
        }
        if PREVIOUS.set(previous).is_err() {
            return;
        }
        let mut action = empty_action();
        action.sa_sigaction = on_fault as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        for sig in SIGNALS {
            // SAFETY: installing a handler with the SA_SIGINFO signature for a synchronous
            // fault signal; the previous disposition was saved above for chaining.
            unsafe { libc::sigaction(sig, &action, std::ptr::null_mut()) };
        }
    });
}

fn empty_action() -> libc::sigaction {
    // SAFETY: `sigaction` is a plain C struct for which all-zeroes is a valid value
    // (SIG_DFL, no flags, empty mask).
    unsafe { std::mem::zeroed() }
}

/// The mapping kind holding `address`, if any.
fn lookup(address: usize) -> Option<Mapping> {
    for entry in TABLE.iter() {
        let len_kind = entry.len_kind.load(Ordering::Acquire);
        if len_kind == 0 || len_kind == usize::MAX {
            continue;
        }
        let start = entry.start.load(Ordering::Relaxed);
        if address >= start && address - start < len_kind >> 1 {
            return Some(if len_kind & 1 == 1 {
                Mapping::Views
            } else {
                Mapping::Shared
            });
        }
    }
    None
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let code = if info.is_null() {
        0
    } else {
        // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler (non-null).
        unsafe { (*info).si_code }
    };
    if code <= 0 {
        // Sent by a process (`kill`, `raise`: SI_USER, SI_TKILL, ...), not a fault: nothing to
        // explain and no instruction to run again. What was there before us decides.
        on_sent(sig, info, context);
        return;
    }
    // SAFETY: as above; for a fault, si_addr is the faulting address.
    let address = (unsafe { (*info).si_addr() }) as usize;
    let message = match (sig, lookup(address)) {
        (libc::SIGSEGV, Some(Mapping::Views)) => Some(VIEW_WRITE),
        (libc::SIGBUS, Some(_)) => Some(TRUNCATED),
        _ => None,
    };
    if let Some(message) = message {
        // SAFETY: write(2) is async-signal-safe; the buffer is a static byte string.
        unsafe { libc::write(2, message.as_ptr().cast(), message.len()) };
    }
    let index = if sig == libc::SIGSEGV { 0 } else { 1 };
    let previous = PREVIOUS
        .get()
        .map(|p| p[index])
        .unwrap_or_else(empty_action);
    let is_handler =
        previous.sa_sigaction != libc::SIG_DFL && previous.sa_sigaction != libc::SIG_IGN;
    if message.is_some() || !is_handler {
        // Ours (or nobody else's): put the previous disposition back and return. The faulting
        // instruction runs again and the previous handler (faulthandler's traceback, say) or
        // the default action (death by the signal) takes it from there, exactly once.
        let restore = if is_handler { previous } else { empty_action() };
        // SAFETY: sigaction is async-signal-safe; `restore` is a saved or default disposition.
        unsafe { libc::sigaction(sig, &restore, std::ptr::null_mut()) };
    } else {
        // Someone else's fault and a handler to chain to.
        call_handler(&previous, sig, info, context);
    }
}

/// A fault signal a process sent: handled as the disposition before ours would have: ignored,
/// the previous handler called, or (the default) the process killed by it.
fn on_sent(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let index = if sig == libc::SIGSEGV { 0 } else { 1 };
    let previous = PREVIOUS
        .get()
        .map(|p| p[index])
        .unwrap_or_else(empty_action);
    if previous.sa_sigaction == libc::SIG_IGN {
        return;
    }
    if previous.sa_sigaction == libc::SIG_DFL {
        // SAFETY: sigaction and raise are async-signal-safe; the signal, blocked while this
        // handler runs, is delivered with the default action as it returns.
        unsafe {
            libc::sigaction(sig, &empty_action(), std::ptr::null_mut());
            libc::raise(sig);
        }
    } else {
        call_handler(&previous, sig, info, context);
    }
}

/// Call the handler `previous` installed (not SIG_DFL nor SIG_IGN) as the kernel would.
fn call_handler(
    previous: &libc::sigaction,
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    if previous.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: a handler installed with SA_SIGINFO has this signature.
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(previous.sa_sigaction) };
        handler(sig, info, context);
    } else {
        // SAFETY: a handler installed without SA_SIGINFO takes only the signal number.
        let handler: extern "C" fn(libc::c_int) =
            unsafe { std::mem::transmute(previous.sa_sigaction) };
        handler(sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_ranges_are_found_until_dropped() {
        let buf = [0u8; 256];
        let start = buf.as_ptr();
        let views = register(start, 128, Mapping::Views);
        let shared = register(start.wrapping_add(128), 128, Mapping::Shared);
        assert_eq!(lookup(start as usize), Some(Mapping::Views));
        assert_eq!(lookup(start as usize + 127), Some(Mapping::Views));
        assert_eq!(lookup(start as usize + 128), Some(Mapping::Shared));
        drop(views);
        assert_eq!(lookup(start as usize), None);
        drop(shared);
        assert_eq!(lookup(start as usize + 200), None);
    }
}
