//! Several writers: single-flight claims and a full key index.

use std::time::Duration;

use super::*;

#[test]
fn a_claim_is_single_flight_and_ends_with_a_put_an_unclaim_or_its_writer() {
    let a = store(1 << 16, 1, 3);
    let b = join(&a);
    let c = join(&a);
    assert!(a.claim("k").unwrap());
    assert!(a.claim("k").unwrap(), "a holds it already");
    assert!(!b.claim("k").unwrap(), "a live writer holds it");
    assert_eq!(stats_of(&a)["claims"], 1);
    assert_eq!(
        b.wait_for(&["k"], Duration::from_millis(20)).unwrap(),
        [false],
        "not put in time"
    );
    assert_eq!(
        a.wait_for(&["k"], Duration::from_secs(600)).unwrap(),
        [false],
        "a writer never waits on its own claim"
    );
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| b.wait_for(&["k", "unclaimed"], Duration::from_secs(600)));
        std::thread::sleep(Duration::from_millis(5));
        a.put("k", &[b"v"]).unwrap();
        assert_eq!(waiting.join().unwrap().unwrap(), [true, false]);
    });
    assert_eq!(stats_of(&a)["claims"], 0, "the put ended the claim");
    assert!(!c.claim("k").unwrap(), "stored");
    assert!(a.claim("u").unwrap());
    a.unclaim("u").unwrap();
    assert!(b.claim("u").unwrap(), "unclaimed");
    assert!(b.claim("w").unwrap());
    pretend_writer_dead(b);
    assert_eq!(
        c.wait_for(&["u", "w"], Duration::from_secs(600)).unwrap(),
        [false, false],
        "a dead writer's claims are void at once"
    );
    assert!(c.claim("u").unwrap(), "taken over from the dead writer");
    assert!(c.claim("v").unwrap());
    drop(c);
    assert!(a.claim("v").unwrap(), "closing gave c's claims back");
    a.put("u", &[b"u"]).unwrap();
    assert_eq!(stats_of(&a)["claims"], 1, "a's v (dead b's w was dropped)");
}

#[test]
fn a_full_index_evicts_with_clock_or_refuses() {
    let config = Config {
        max_objects: Some(4),
        ..Config::new(1 << 16, 1, None)
    };
    let w = Writer::create_with(&config, None).unwrap();
    for i in 0..10 {
        w.put(&format!("k{i}"), &[b"tiny"]).unwrap();
    }
    let mut keys = w.keys().unwrap();
    keys.sort();
    assert_eq!(
        keys,
        ["k6", "k7", "k8", "k9"],
        "CLOCK evicted the oldest for room"
    );
    assert_eq!(stats_of(&w)["objects"], 4);
    let _r = Reader::attach(&w.reader_info()).unwrap();
    w.clear().unwrap();
    for i in 0..3 {
        w.put(&format!("held{i}"), &[b"unread"]).unwrap();
    }
    assert!(w.claim("c").unwrap());
    assert!(matches!(w.put("x", &[b"x"]), Err(Error::IndexFull(4))));
    assert!(
        w.claim("d").unwrap(),
        "not recorded: the caller computes it anyway"
    );
    assert_eq!(stats_of(&w)["claims"], 1);
    w.put("c", &[b"c"])
        .expect("the claim's bucket takes the entry");
}

#[test]
fn a_full_index_with_nothing_to_evict_drops_a_dead_writers_claims_for_room() {
    let config = Config {
        max_objects: Some(4),
        max_writers: 2,
        ..Config::new(1 << 16, 1, None)
    };
    let a = Writer::create_with(&config, None).unwrap();
    let b = join(&a);
    let _r = Reader::attach(&a.reader_info()).unwrap();
    for i in 0..3 {
        a.put(&format!("held{i}"), &[b"unread"]).unwrap();
    }
    assert!(b.claim("c").unwrap());
    assert!(matches!(a.put("x", &[b"x"]), Err(Error::IndexFull(4))));
    pretend_writer_dead(b);
    a.put("x", &[b"x"])
        .expect("the dead writer's claim gave its room up");
    assert_eq!(stats_of(&a)["claims"], 0);
    assert_eq!(stats_of(&a)["objects"], 4);
}
