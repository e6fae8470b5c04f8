//! A valid item payload with the input's bytes written over it: parsing and walking the
//! header must refuse the result or accept a tree whose every part lies inside the payload
//! and is named by exactly one node, so that the values hold at most the payload's bytes —
//! never panic, never read outside, never decode into more than the payload holds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mmcache::codec::{Container, Header, HeaderBuilder, Node, PREFIX_LEN, header_len, payload_len};

/// A payload with one of every kind of node (parts zero-filled).
fn template() -> Vec<u8> {
    let mut b = HeaderBuilder::new();
    let root = b.begin(Container::Dict);
    b.key("pixels").unwrap();
    b.tensor("bfloat16", &[2, 3], 12).unwrap();
    b.key("grid").unwrap();
    b.array("<i8", &[3], 24).unwrap();
    b.key("meta").unwrap();
    let list = b.begin(Container::List);
    b.int(-1);
    b.uint(u64::MAX);
    b.float(0.5);
    b.str("x").unwrap();
    b.none();
    b.bool(true);
    b.bytes(&[7; 300]).unwrap();
    b.scalar("<f4", &[0; 4]).unwrap();
    let tuple = b.begin(Container::Tuple);
    b.end(tuple, 0).unwrap();
    b.end(list, 9).unwrap();
    b.end(root, 3).unwrap();
    let lens = b.part_lens().to_vec();
    let mut out = b.finish().unwrap();
    out.resize(payload_len(out.len() as u64, &lens).unwrap() as usize, 0);
    out
}

fuzz_target!(|data: &[u8]| {
    let mut payload = template();
    // Input: pairs (position, byte) to overwrite, then bytes to cut off the end.
    for pair in data.chunks(3) {
        if let [hi, lo, byte] = *pair {
            let at = (usize::from(hi) << 8 | usize::from(lo)) % payload.len();
            payload[at] = byte;
        } else {
            payload.truncate(payload.len().saturating_sub(pair[0] as usize));
        }
    }
    let Some(prefix) = payload
        .get(..PREFIX_LEN)
        .and_then(|p| <&[u8; PREFIX_LEN]>::try_from(p).ok())
    else {
        return;
    };
    let Some(header) = header_len(prefix).ok().and_then(|n| payload.get(..n)) else {
        return;
    };
    let Ok(parsed) = Header::parse(header, payload.len() as u64) else {
        return;
    };
    for &(offset, len) in &parsed.parts {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= payload.len() as u64)
        );
    }
    let mut named = vec![0u32; parsed.parts.len()];
    // Bytes of the values: their parts, and what the header holds inline.
    let mut data = 0u64;
    let walked = parsed.walk(|node| {
        match *node {
            Node::Str(s) => data += s.len() as u64,
            Node::Bytes(b) | Node::Scalar { raw: b, .. } => data += b.len() as u64,
            _ => {}
        }
        if let Some(part) = node.part() {
            named[part] += 1;
            data += parsed.parts[part].1;
        }
        Ok(())
    });
    if walked.is_ok() {
        assert!(named.iter().all(|&n| n == 1));
        assert!(data <= payload.len() as u64);
    }
});
