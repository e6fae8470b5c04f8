//! The key index's hash: a fast keyed 64-bit hash of a cache key, for placing it in the
//! shared index (`store::index`) and telling keys apart at a glance.
//!
//! It is not a MAC and nothing depends on it being one: an index entry is confirmed against
//! the key bytes stored with the chunk, and a handle against its keyed BLAKE3 signature
//! (`handle`). The seed comes from the store's secret (every writer derives the same one), so
//! keys cannot be chosen to pile into one stretch of the table without it.
//!
//! Construction: 16 bytes at a time, each pair of little-endian words is folded into a
//! lane's state with a 64×64→128-bit multiply whose halves are XORed (every input bit
//! reaches every output bit of the product); two lanes take alternate 16-byte blocks (two
//! chains of multiplies, not one long one) and one last fold mixes them; the length enters
//! both lanes first and the tail is zero-padded, so keys of different lengths never collide
//! by padding.

/// A keyed hash of cache keys (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyHasher {
    seeds: [u64; 4],
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyHasher(<seeded>)")
    }
}

/// The two halves of a 128-bit product, XORed.
#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let product = (a as u128) * (b as u128);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Up to 8 bytes as a little-endian word, zero-padded. Loads of fixed widths (overlapping
/// for 4–7 bytes, first/middle/last for 1–3) rather than a copy of a variable length, which
/// would be a call into `memmove` on every short key's lookup.
#[inline(always)]
pub(crate) fn word(bytes: &[u8]) -> u64 {
    let n = bytes.len();
    debug_assert!(n <= 8, "a word holds at most 8 bytes");
    let load4 = |at: usize| {
        u64::from(u32::from_le_bytes([
            bytes[at],
            bytes[at + 1],
            bytes[at + 2],
            bytes[at + 3],
        ]))
    };
    match n {
        8.. => u64::from_le_bytes([
            bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7],
        ]),
        4..=7 => load4(0) | load4(n - 4) << (8 * (n - 4)),
        1..=3 => {
            let at = |i: usize| u64::from(bytes[i]) << (8 * i);
            at(0) | at(n / 2) | at(n - 1)
        }
        0 => 0,
    }
}

impl KeyHasher {
    /// The hasher of the store whose signing secret is `secret` (the same in every writer).
    pub fn for_secret(secret: &[u8; 32]) -> KeyHasher {
        let derived = blake3::derive_key("mmcache 2026 index key hash", secret);
        let mut seeds = [0u64; 4];
        for (seed, bytes) in seeds.iter_mut().zip(derived.chunks_exact(8)) {
            *seed = word(bytes) | 1; // never zero: a zero factor would erase its partner
        }
        KeyHasher { seeds }
    }

    /// The key's 64-bit hash: two lanes of keyed multiply-folds (alternate 16-byte blocks),
    /// then one fold of both. Two chains, not one: a 64-byte key (an mm_hash) waits on four
    /// multiplications in a row instead of six.
    #[inline(always)]
    pub fn hash(&self, key: &[u8]) -> u64 {
        let [s0, s1, s2, s3] = self.seeds;
        let len = key.len() as u64;
        let mut even = fold(s0 ^ len, s3);
        let mut odd = fold(s1 ^ len, s0);
        let mut pairs = key.chunks_exact(32);
        for pair in &mut pairs {
            even = fold(word(&pair[..8]) ^ s1, word(&pair[8..16]) ^ s2 ^ even);
            odd = fold(word(&pair[16..24]) ^ s2, word(&pair[24..]) ^ s1 ^ odd);
        }
        let rest = pairs.remainder();
        let (first, second) = rest.split_at(rest.len().min(16));
        if !first.is_empty() {
            let (a, b) = first.split_at(first.len().min(8));
            even = fold(word(a) ^ s1, word(b) ^ s2 ^ even);
        }
        if !second.is_empty() {
            let (a, b) = second.split_at(second.len().min(8));
            odd = fold(word(a) ^ s2, word(b) ^ s1 ^ odd);
        }
        fold(even ^ s3, odd ^ s0 ^ len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_word_is_its_bytes_zero_padded_at_every_length() {
        let bytes: Vec<u8> = (1..=8).map(|b| b * 17).collect();
        for n in 0..=8 {
            let mut padded = [0u8; 8];
            padded[..n].copy_from_slice(&bytes[..n]);
            assert_eq!(word(&bytes[..n]), u64::from_le_bytes(padded), "{n} bytes");
        }
    }

    #[test]
    fn equal_keys_agree_and_distinct_keys_differ() {
        let hasher = KeyHasher::for_secret(&[3; 32]);
        assert_eq!(hasher, KeyHasher::for_secret(&[3; 32]));
        assert_ne!(hasher, KeyHasher::for_secret(&[4; 32]));
        assert_eq!(hasher.hash(b"abc"), hasher.hash(b"abc"));
        // Padding cannot make keys of different lengths collide.
        assert_ne!(hasher.hash(b""), hasher.hash(b"\0"));
        assert_ne!(hasher.hash(b"a"), hasher.hash(b"a\0"));
        assert_ne!(hasher.hash(&[0; 16]), hasher.hash(&[0; 17]));
        // Many similar keys (content-hash-like and counters): no collisions in 64 bits, and
        // the low bits (the bucket) spread evenly.
        let mut seen = HashSet::new();
        let mut buckets = [0u32; 64];
        for i in 0..100_000u32 {
            let key = format!("{:064x}", i);
            let h = hasher.hash(key.as_bytes());
            assert!(seen.insert(h), "collision at {i}");
            buckets[(h & 63) as usize] += 1;
            assert!(seen.insert(hasher.hash(format!("k{i}").as_bytes())));
        }
        let expected = 100_000 / 64;
        for count in buckets {
            assert!(
                count.abs_diff(expected) < expected / 5,
                "uneven buckets: {buckets:?}"
            );
        }
    }

    #[test]
    fn one_flipped_bit_changes_about_half_the_output_at_every_length() {
        // Every length up to 100 bytes: each branch of `word` (1–3, 4–7, 8 bytes), both
        // lanes, and tails in either lane.
        let hasher = KeyHasher::for_secret(&[9; 32]);
        let text = b"0123456789abcdef".repeat(7);
        for len in 1..=100 {
            let key = &text[..len];
            let base = hasher.hash(key);
            let mut total = 0u32;
            let bits = len * 8;
            for bit in 0..bits {
                let mut flipped = key.to_vec();
                flipped[bit / 8] ^= 1 << (bit % 8);
                let changed = (hasher.hash(&flipped) ^ base).count_ones();
                assert!(
                    changed >= 8,
                    "{len} bytes, bit {bit}: {changed} output bits"
                );
                total += changed;
            }
            let mean = total as f64 / bits as f64;
            assert!(
                (26.0..38.0).contains(&mean),
                "{len} bytes: mean flipped output bits {mean}"
            );
        }
    }
}
