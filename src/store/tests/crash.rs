//! Writers that die: their stamps void, a lock they held waited for or taken over and
//! repaired.

use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::Duration;

use super::*;
use crate::layout::{BlockKind, BlockState, Counter};

#[test]
fn a_dead_writers_reservation_pins_and_hazards_are_void() {
    // A ring of four 1 KiB chunks and no reader: only writers hold anything.
    let a = store(4096, 1, 2);
    let b = join(&a);
    b.put("pinned", &[&[1u8; 896]]).unwrap();
    b.pin("pinned").unwrap();
    let reserved = {
        let _busy = b.enter().unwrap();
        b.reserve(1024).unwrap().address
    };
    let held = b.put("held", &[&[2u8; 896]]).unwrap();
    leave_hazard(&b, &held);
    a.put("x", &[&[0u8; 896]]).expect("one free chunk was left");
    a.put("y", &[&[0u8; 896]]).expect("x is evicted");
    assert!(!a.is_cached("x").unwrap(), "only x could go");
    assert!(a.is_cached("pinned").unwrap() && a.is_cached("held").unwrap());
    assert!(matches!(
        a.put("z", &[&[0u8; 896]]),
        Ok(_) | Err(Error::Full { .. })
    ));
    assert_eq!(stats_of(&a)["chunks_reserved"], 1);
    pretend_writer_dead(b);
    for i in 0..8 {
        a.put(&format!("n{i}"), &[&[3u8; 896]])
            .expect("the dead writer's blocks are reclaimed");
    }
    let stats = stats_of(&a);
    assert_eq!((stats["chunks_reserved"], stats["pinned"]), (0, 0));
    assert!(!a.is_cached("pinned").unwrap() && !a.is_cached("held").unwrap());
    let _ = reserved;
}

#[test]
fn a_dead_writers_hazards_do_not_pass_to_the_next_occupant_of_its_slot() {
    // A hazard word holds a chunk id and no epoch: once the slot has a live occupant again,
    // whatever the dead one left there would count as that occupant's (holding the chunk
    // forever, and making its `close` wait forever).
    let a = store(4096, 1, 2);
    let b = join(&a);
    let held = b.put("held", &[&[2u8; 896]]).unwrap();
    leave_hazard(&b, &held);
    pretend_writer_dead(b);
    let c = join(&a);
    assert_eq!(c.slot(), 1, "the dead writer's slot is taken again");
    let stale = (0..slot::HAZARDS).any(|h| {
        let word = c
            .shared
            .writer_slot(c.me.slot, slot::HAZARD + 8 * h)
            .unwrap();
        word.load(Ordering::SeqCst) != 0
    });
    if stale {
        pretend_writer_dead(c); // its `close` would wait for the stale hazard forever
        panic!("the dead writer's hazard passed to the next occupant of its slot");
    }
    for i in 0..8 {
        a.put(&format!("n{i}"), &[&[3u8; 896]])
            .expect("the dead writer's chunk is reclaimed");
    }
    assert!(!a.is_cached("held").unwrap());
    c.close().unwrap();
}

#[test]
fn a_live_lock_holder_is_waited_for() {
    let a = store(1 << 16, 1, 2);
    let b = join(&a);
    let released = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel();
        let (b, released) = (&b, &released);
        scope.spawn(move || {
            let guard = b.shared.lock(b.me).unwrap();
            tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            released.store(true, Ordering::SeqCst);
            drop(guard);
        });
        rx.recv().unwrap();
        a.put("k", &[b"v"]).unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "a put waited for the live holder"
        );
    });
}

#[test]
fn a_lock_holder_that_died_mid_eviction_is_taken_over_and_repaired() {
    let (a, b, hs) = two_writers_four_objects();
    let victim = hs[1].address;
    {
        // b takes both locks, journals a window, marks a chunk EVICTING, takes another out
        // of the index and kills it, and dies: the state a SIGKILL between two steps of
        // `allocate` leaves.
        let guard = b.shared.lock(b.me).unwrap();
        let index = b.shared.lock_index(b.me).unwrap();
        let sh = &b.shared;
        let size = sh.block_size(victim).unwrap();
        sh.header(header::JOURNAL_LEN)
            .unwrap()
            .store(2 * size, Ordering::Relaxed);
        sh.header(header::JOURNAL)
            .unwrap()
            .store(victim + 1, Ordering::Relaxed);
        let state = sh.chunk(victim, chunk::STATE).unwrap();
        let evicting = BlockState {
            kind: BlockKind::Evicting,
            ..BlockState::unpack(state.load(Ordering::Relaxed))
        };
        state.store(evicting.pack(), Ordering::Relaxed);
        let killed = hs[2].address;
        let hash = sh
            .chunk(killed, chunk::KEY_HASH)
            .unwrap()
            .load(Ordering::Relaxed);
        assert!(
            sh.unindex(&index, hash, killed, hs[2].monotonic_id)
                .unwrap()
        );
        sh.chunk(killed, chunk::ID)
            .unwrap()
            .store(0, Ordering::Relaxed);
        let marked = BlockState {
            kind: BlockKind::Evicting,
            ..BlockState::unpack(
                sh.chunk(killed, chunk::STATE)
                    .unwrap()
                    .load(Ordering::Relaxed),
            )
        };
        sh.chunk(killed, chunk::STATE)
            .unwrap()
            .store(marked.pack(), Ordering::Relaxed);
        for counter in [Counter::BytesInUse, Counter::Objects] {
            sh.counter(counter).unwrap().store(12345, Ordering::Relaxed);
        }
        std::mem::forget(index);
        std::mem::forget(guard);
    }
    pretend_writer_dead(b);
    a.put("after", &[b"v"]).expect("both locks were taken over");
    let sh = &a.shared;
    let guard = sh.lock(a.me).unwrap();
    let blocks = sh.blocks(&guard).unwrap();
    drop(guard);
    let kind_at = |address| {
        blocks
            .iter()
            .find(|b| b.address == address)
            .map(|b| b.state.kind)
    };
    assert_eq!(kind_at(victim), Some(BlockKind::Live), "restored");
    assert_eq!(
        kind_at(hs[2].address),
        Some(BlockKind::Free),
        "its kill finished"
    );
    assert!(a.is_cached("k1").unwrap() && !a.is_cached("k2").unwrap());
    let in_use: u64 = blocks
        .iter()
        .filter(|b| b.state.kind != BlockKind::Free)
        .map(|b| b.size)
        .sum();
    let stats = stats_of(&a);
    assert_eq!(stats["bytes_in_use"], in_use, "the gauges were recounted");
    assert_eq!(stats["objects"], 4);
    assert_eq!(stats["puts"], 5);
}
