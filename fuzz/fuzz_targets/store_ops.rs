//! A byte string as a stream of store operations against a model: every handle a reader has
//! not read yet (since the last clear) reads back exactly its own bytes; replays read their
//! own bytes or are stale.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use mmcache::{Error, Handle, Reader, Writer};

fuzz_target!(|data: &[u8]| {
    let writer = Writer::create(8192, 1, None, None).expect("writer");
    let reader = Reader::attach(&writer.reader_info()).expect("reader");
    let mut truth: HashMap<u64, (String, Vec<u8>)> = HashMap::new();
    let mut owed: Vec<Handle> = Vec::new();
    let mut issued: Vec<Handle> = Vec::new();
    let read = |h: &Handle, key: &str| -> Result<Vec<u8>, Error> {
        let lease = reader.acquire(h, key)?;
        let mut out = vec![0u8; lease.len()];
        lease.copy_to(&mut out)?;
        Ok(out)
    };
    for (step, op) in data.chunks(3).enumerate() {
        let (kind, a, b) = (op[0] % 6, *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0));
        let key = format!("k{}", a % 8);
        match kind {
            0 => {
                let bytes = vec![step as u8; 1 + b as usize * 16];
                match writer.put(&key, &[&bytes]) {
                    Ok(h) => {
                        truth.insert(h.monotonic_id, (key, bytes));
                        owed.push(h);
                        issued.push(h);
                    }
                    Err(Error::DuplicateKey(_) | Error::Full { .. }) => {}
                    Err(e) => panic!("put: {e}"),
                }
            }
            1 => {
                if let Ok(h) = writer.get_cached(&key) {
                    owed.push(h);
                    issued.push(h);
                }
            }
            2 if !owed.is_empty() => {
                let h = owed.remove(b as usize % owed.len());
                let (key, bytes) = &truth[&h.monotonic_id];
                assert_eq!(&read(&h, key).expect("owed handles read"), bytes);
            }
            3 if !issued.is_empty() => {
                let h = issued[b as usize % issued.len()];
                let (key, bytes) = &truth[&h.monotonic_id];
                match read(&h, key) {
                    Ok(got) => {
                        assert_eq!(&got, bytes);
                        if let Some(i) = owed.iter().position(|o| *o == h) {
                            owed.remove(i);
                        }
                    }
                    Err(Error::Stale) => assert!(!owed.contains(&h)),
                    Err(e) => panic!("replay: {e}"),
                }
            }
            4 => writer.invalidate(&key).unwrap(),
            5 if b % 8 == 0 => {
                // clear() drops every unread reference: what was owed may now be stale.
                writer.clear().unwrap();
                owed.clear();
            }
            _ => {}
        }
    }
});
