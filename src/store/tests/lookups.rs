//! Lock-free lookups that meet a change in progress: a miss they cannot confirm is no proof
//! that a key is absent, so a change that skips the index lock on a miss (`invalidate`,
//! `unclaim`) must not skip it on such a one.

use std::sync::mpsc;
use std::time::Duration;

use super::*;
use crate::layout::{Bucket, header};

/// Two keys whose probes start at the same bucket (`(first, second)`, neither stored).
fn colliding_keys(w: &Writer) -> (String, String) {
    let mask = w.shared.layout.index_buckets - 1;
    let home = |key: &str| w.query(key).hash() & mask;
    let first = "x0".to_owned();
    let second = (1..)
        .map(|i| format!("x{i}"))
        .find(|key| home(key) == home(&first))
        .unwrap();
    (first, second)
}

/// Run `change` (which takes the index lock unless its lookup proves it need not) while
/// another writer holding the index lock is stalled in the middle of a removal: `first`'s
/// entry removed from its bucket, `second`'s entry (filed in the next one) being moved back
/// into it — its head already there, its version still 0, the move count odd — as a holder
/// preempted inside `remove_bucket` leaves it. The stall then ends as if the removal had
/// been undone, and the lock is given back.
fn during_a_stalled_move(w: &Writer, first: &str, second: &str, change: impl FnOnce() + Send) {
    let (gap, next) = {
        let home = w.query(first).hash() & (w.shared.layout.index_buckets - 1);
        (home, (home + 1) & (w.shared.layout.index_buckets - 1))
    };
    let sh = &w.shared;
    let words = |bucket| {
        sh.seg
            .atomics::<2>(sh.layout.bucket_offset(bucket))
            .unwrap()
    };
    let [gap_head, gap_version] = words(gap);
    let [next_head, _] = words(next);
    assert!(
        matches!(
            Bucket::unpack(next_head.load(Ordering::Relaxed)),
            Bucket::Live { .. } | Bucket::Claim { .. }
        ),
        "{second} is filed right after {first}"
    );
    let holder = join(w);
    let busy = holder.enter().unwrap();
    let index = holder.shared.lock_index(holder.me).unwrap();
    let moves = sh.header(header::INDEX_MOVES).unwrap();
    let saved = (
        gap_head.load(Ordering::Relaxed),
        gap_version.load(Ordering::Relaxed),
    );
    moves.fetch_add(1, Ordering::Relaxed);
    gap_version.store(0, Ordering::Relaxed);
    gap_head.store(next_head.load(Ordering::Relaxed), Ordering::Relaxed);
    std::thread::scope(|scope| {
        let (done, finished) = mpsc::channel();
        scope.spawn(move || {
            change();
            let _ = done.send(()); // (nobody listens once the stall is over)
        });
        // Long enough for a change that skips the lock to be over; one that waits for it
        // goes on once the stall ends.
        let _ = finished.recv_timeout(Duration::from_millis(300));
        gap_head.store(saved.0, Ordering::Relaxed);
        gap_version.store(saved.1, Ordering::Release);
        moves.fetch_add(1, Ordering::Release);
        drop(index);
        drop(busy);
    });
}

#[test]
fn an_invalidation_during_a_move_of_its_key_forgets_the_key() {
    let w = store(1 << 20, 1, 2);
    let (first, second) = colliding_keys(&w);
    w.put(&first, &[&[1u8; 100]]).unwrap();
    w.put(&second, &[&[2u8; 100]]).unwrap();
    during_a_stalled_move(&w, &first, &second, || w.invalidate(&second).unwrap());
    assert!(
        !w.is_cached(&second).unwrap(),
        "{second} survived its invalidation"
    );
    assert!(w.is_cached(&first).unwrap());
}

#[test]
fn an_unclaim_during_a_move_of_its_claim_gives_the_claim_up() {
    let w = store(1 << 20, 1, 2);
    let (first, second) = colliding_keys(&w);
    w.put(&first, &[&[1u8; 100]]).unwrap();
    assert!(w.claim(&second).unwrap());
    during_a_stalled_move(&w, &first, &second, || w.unclaim(&second).unwrap());
    assert_eq!(
        w.shared.seek(&w.query(&second)).unwrap(),
        index::Seen::Absent,
        "{second}'s claim survived its unclaim"
    );
}
