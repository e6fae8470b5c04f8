//! Random bytes as a segment header: validation must refuse them or accept a geometry that
//! is self-consistent and fits the segment — never panic, never a wild offset.
#![no_main]

use std::sync::atomic::Ordering;

use libfuzzer_sys::fuzz_target;
use mmcache::layout::{Config, Layout, Liveness, WRITER_LOCK, header};
use mmcache::segment::{Segment, current_pid};

fuzz_target!(|data: &[u8]| {
    let good = Layout::new(&Config::new(8192, 2, None)).expect("valid geometry");
    let name = format!("mmcf_hdr_{}", current_pid());
    let _ = mmcache::segment::unlink(&name);
    let total = good.total_len() as usize;
    let seg = Segment::create(&name, total, WRITER_LOCK, total).expect("segment");
    seg.unlink().expect("unlink");
    good.write(&seg, 1, 1, Liveness::Locks, [0, 0]).expect("header");
    // Overwrite the first words of the header with the input.
    for (i, word) in data.chunks(8).take((header::READER_TABLE / 8) as usize).enumerate() {
        let mut bytes = [0u8; 8];
        bytes[..word.len()].copy_from_slice(word);
        seg.atomic(i as u64 * 8).unwrap().store(u64::from_le_bytes(bytes), Ordering::Relaxed);
    }
    if let Ok((layout, _)) = Layout::read(&seg) {
        assert_eq!(layout.total_len(), seg.len() as u64);
        assert!(layout.valid_payload(0, layout.max_object_size));
    }
});
