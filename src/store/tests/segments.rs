//! The segment as a whole: corrupt or changing headers, `inspect`'s counters, and the
//! orphans every creation removes.

use std::sync::atomic::AtomicBool;

use super::*;
use crate::layout::WRITER_LOCK;

#[test]
fn inspect_reads_back_the_counters_stats_reports() {
    let (w, [r]) = writer_with_readers(2048);
    let a = w.put("a", &[&[1u8; 896]]).unwrap();
    w.get_cached("a").unwrap();
    w.put("b", &[&[2u8; 896]]).unwrap();
    read(&r, &a, "a").unwrap();
    read(&r, &a, "a").unwrap();
    w.put("c", &[&[3u8; 896]]).unwrap(); // evicts a
    w.clear().unwrap();
    let stats = stats_of(&w);
    let expected: Vec<(&str, u64)> = [
        ("bytes_in_use", 0),
        ("objects", 0),
        ("last_id", 3),
        ("claims", 0),
        ("evictions", 1),
        ("clears", 1),
        ("puts", 3),
        ("hits", 1),
        ("refs_issued", 4),
        ("readers_reclaimed", 0),
        ("writers_reclaimed", 0),
    ]
    .into();
    assert_eq!(inspect(w.name()).unwrap().counters, expected);
    for (name, value) in &expected {
        assert_eq!(stats[name], *value, "{name}");
    }
}

#[test]
fn corrupt_headers_are_refused() {
    let w = writer(1 << 16, 1);
    let info = w.reader_info();
    w.shared
        .header(header::CAPACITY)
        .unwrap()
        .store(1 << 40, Ordering::Relaxed);
    assert!(matches!(Reader::attach(&info), Err(Error::Corrupt(_))));
    w.shared
        .header(header::MAGIC)
        .unwrap()
        .store(7, Ordering::Relaxed);
    assert!(matches!(Reader::attach(&info), Err(Error::Corrupt(_))));
    assert!(matches!(inspect(w.name()), Err(Error::Corrupt(_))));
}

/// Sets its flag when dropped: stops a helper thread even if the test panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// `attach`, `inspect` and `status` (what `prune` decides) validate the header once and use
/// what they validated: a liveness word that another process changes meanwhile makes them
/// fail cleanly or succeed, never panic (they used to load it a second time and `expect` it
/// to be valid still).
#[test]
fn a_header_changing_under_validation_is_an_error_never_a_panic() {
    // The pid fallback: no writer lock, so `status` too opens the segment.
    let w = Writer::create_with_liveness(2048, 1, Liveness::Pids).unwrap();
    let info = w.reader_info();
    let liveness = w.shared.header(header::LIVENESS).unwrap();
    let stop = AtomicBool::new(false);
    let (mut accepted, mut refused) = (0, 0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                liveness.store(Liveness::Pids.code(), Ordering::Relaxed);
                liveness.store(0, Ordering::Relaxed); // no liveness mode at all
            }
        });
        let _stop = StopOnDrop(&stop);
        for i in 0..200_000 {
            let mut outcomes = vec![inspect(w.name()).map(drop)];
            if i % 16 == 0 {
                // Slower (they read /proc): less often.
                outcomes.push(Reader::attach(&info).map(drop));
                status(w.name()).unwrap();
            }
            for outcome in outcomes {
                match outcome {
                    Ok(()) => accepted += 1,
                    Err(Error::Corrupt(_)) => refused += 1,
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            if accepted >= 2000 && refused >= 2000 {
                break;
            }
        }
    });
    assert!(
        accepted >= 2000 && refused >= 2000,
        "the race was not exercised: {accepted} accepted, {refused} refused"
    );
}

/// Every store's creation first removes what dead creators left, and nothing a live one
/// makes or uses (other tests' creations run meanwhile: what must go may go earlier).
#[test]
fn creation_removes_only_segments_whose_writer_is_gone() {
    let path = |name: &str| format!("{}/{name}", segment::SHM_DIR);
    // Sized but headerless and unlocked: a creator killed half-way.
    let half_made_dead = segment::generate_name().unwrap();
    std::fs::write(path(&half_made_dead), vec![0u8; 4096]).unwrap();
    // A complete segment whose writer's lock is gone (as when it dies).
    let complete_dead = writer(1 << 16, 1);
    complete_dead.shared.seg.unlock(WRITER_LOCK).unwrap();
    // Sized and headerless, but locked: a live creator half-way.
    let half_made_live = segment::generate_name().unwrap();
    let making = Segment::create(&half_made_live, 4096, WRITER_LOCK, 4096).unwrap();
    // Empty and unlocked: the instant between a creator's shm_open and its lock.
    let just_opened = segment::generate_name().unwrap();
    std::fs::write(path(&just_opened), b"").unwrap();
    // The pid fallback with a damaged liveness word: its creator's pid is all there is.
    let damaged_live = Writer::create_with_liveness(1 << 16, 1, Liveness::Pids).unwrap();
    damaged_live
        .shared
        .header(header::LIVENESS)
        .unwrap()
        .store(0, Ordering::Relaxed);
    for (name, expected) in [
        (half_made_dead.as_str(), "orphaned"),
        (complete_dead.name(), "orphaned"),
        (half_made_live.as_str(), "live"),
        (just_opened.as_str(), "undecided"),
        (damaged_live.name(), "undecided"),
    ] {
        let found = match status(name) {
            Ok(Status::Live) => "live",
            Ok(Status::Orphaned(_)) => "orphaned",
            Ok(Status::Undecided(_)) => "undecided",
            Err(Error::NotFound(_)) if expected == "orphaned" => continue, // pruned already
            Err(e) => panic!("{name}: {e}"),
        };
        assert_eq!(found, expected, "{name}");
    }
    let _next = writer(1 << 16, 1);
    let listed = list_segments();
    for gone in [half_made_dead.as_str(), complete_dead.name()] {
        assert!(
            !listed.iter().any(|n| n == gone),
            "{gone} outlived its writer"
        );
    }
    for kept in [
        half_made_live.as_str(),
        just_opened.as_str(),
        damaged_live.name(),
    ] {
        assert!(listed.iter().any(|n| n == kept), "{kept} was removed");
    }
    drop(making); // its creator unlinks it
    segment::unlink(&just_opened).unwrap();
}
