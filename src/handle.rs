//! Keyed signatures that make handles unforgeable.
//!
//! Two MACs (keyed BLAKE3, 128 bits each) hash `(key, address, id)` and a suffix each:
//!
//! * the **chunk MAC** (`… ‖ 0x00`): the chunk's identity, stored in its header, so a reader
//!   can tell its chunk from bytes that later landed at the same address;
//! * the **handle MAC** (`… ‖ 0x01 ‖ reader set`): what a handle carries. A handle's
//!   signature is its handle MAC followed by the 4-byte number of the *reader set* its
//!   references were issued to (little-endian), which the writer's `release` uses to credit
//!   exactly those readers. The MAC covers that number, so it cannot be changed either.
//!
//! The store's first writer draws a 32-byte secret at creation. It travels only inside the
//! picklable reader and writer handles (the engine's own IPC), never in the segment (which
//! holds only a MAC of a constant under it, [`Signer::verifier`], so a joining writer's
//! secret can be checked), so a process that can read `/dev/shm` but did not get a handle
//! cannot mint handles. A signature covers the
//! cache key, the address, the monotonic id and the reader set: a handle replayed for
//! another key, moved to another address, re-numbered or re-targeted fails verification
//! before any shared byte is read.

/// Bytes of a MAC (a truncated keyed BLAKE3 hash: 128 bits).
pub const MAC_LEN: usize = 16;
/// Bytes of a handle signature: the handle MAC and the issuing reader set's number.
pub const SIGNATURE_LEN: usize = MAC_LEN + 4;

/// Where one object lives and the proof that this store's writer said so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle {
    /// Offset of the chunk in the data ring (64-byte aligned).
    pub address: u64,
    /// The chunk's 64-bit id; never reused, never 0.
    pub monotonic_id: u64,
    pub signature: [u8; SIGNATURE_LEN],
}

impl Handle {
    /// The number of the reader set this handle's references were issued to.
    pub fn reader_set(&self) -> u32 {
        let [.., a, b, c, d] = self.signature;
        u32::from_le_bytes([a, b, c, d])
    }
}

/// Signs and verifies handles with one secret.
#[derive(Clone)]
pub struct Signer {
    secret: [u8; 32],
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer(<secret>)")
    }
}

impl Signer {
    pub fn new(secret: [u8; 32]) -> Self {
        Signer { secret }
    }

    pub fn secret(&self) -> &[u8; 32] {
        &self.secret
    }

    /// A keyed MAC of a constant under this secret, stored in the segment so a writer handle
    /// can prove it carries the store's secret without the secret ever being stored.
    pub fn verifier(&self) -> [u64; 2] {
        let mut hasher = blake3::Hasher::new_keyed(&self.secret);
        hasher.update(b"mmcache writer handle verifier");
        let mac = u128::from_le_bytes(Self::finish(&hasher));
        [mac as u64, (mac >> 64) as u64]
    }

    /// The message both MACs hash, up to their suffixes: `(key, address, id)`, with room for
    /// the longer suffix. Each MAC is one keyed hash of the whole message: continuing a
    /// hasher of the common part instead copies BLAKE3's streaming state (~1.9 KB) for each
    /// MAC, which cost more than hashing the short common part twice.
    fn message(key: &str, address: u64, monotonic_id: u64) -> Vec<u8> {
        let mut message = Vec::with_capacity(8 + key.len() + 8 + 8 + 1 + 4);
        // Length-prefix the key so (key, address) pairs cannot be re-split.
        message.extend_from_slice(&(key.len() as u64).to_le_bytes());
        message.extend_from_slice(key.as_bytes());
        message.extend_from_slice(&address.to_le_bytes());
        message.extend_from_slice(&monotonic_id.to_le_bytes());
        message
    }

    /// The MAC of `message` followed by `suffix`.
    fn mac(&self, message: &mut Vec<u8>, suffix: &[u8]) -> [u8; MAC_LEN] {
        let len = message.len();
        message.extend_from_slice(suffix);
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&blake3::keyed_hash(&self.secret, message).as_bytes()[..MAC_LEN]);
        message.truncate(len);
        out
    }

    fn finish(hasher: &blake3::Hasher) -> [u8; MAC_LEN] {
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&hasher.finalize().as_bytes()[..MAC_LEN]);
        out
    }

    /// The chunk MAC of the object `(key, address, id)` and a handle to it for `reader_set`.
    pub fn sign(
        &self,
        key: &str,
        address: u64,
        monotonic_id: u64,
        reader_set: u32,
    ) -> ([u8; MAC_LEN], Handle) {
        let mut message = Self::message(key, address, monotonic_id);
        (
            self.mac(&mut message, &[0]),
            self.handle_from(&mut message, address, monotonic_id, reader_set),
        )
    }

    /// Another handle to the object `(key, address, id)`, for another reader set.
    pub fn handle(&self, key: &str, address: u64, monotonic_id: u64, reader_set: u32) -> Handle {
        self.handle_from(
            &mut Self::message(key, address, monotonic_id),
            address,
            monotonic_id,
            reader_set,
        )
    }

    fn handle_from(
        &self,
        message: &mut Vec<u8>,
        address: u64,
        monotonic_id: u64,
        reader_set: u32,
    ) -> Handle {
        let [a, b, c, d] = reader_set.to_le_bytes();
        let mut signature = [0u8; SIGNATURE_LEN];
        signature[..MAC_LEN].copy_from_slice(&self.mac(message, &[1, a, b, c, d]));
        signature[MAC_LEN..].copy_from_slice(&reader_set.to_le_bytes());
        Handle {
            address,
            monotonic_id,
            signature,
        }
    }

    /// Check (in constant time) that `handle` was signed by this secret for `key`; if so,
    /// the chunk MAC of the object it names.
    pub fn verify(&self, key: &str, handle: &Handle) -> Option<[u8; MAC_LEN]> {
        let (chunk_mac, expected) = self.sign(
            key,
            handle.address,
            handle.monotonic_id,
            handle.reader_set(),
        );
        let diff = expected
            .signature
            .iter()
            .zip(handle.signature.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        (diff == 0).then_some(chunk_mac)
    }
}

/// The 32-bit tag of a chunk's MAC that chunk headers carry in each reader word (see
/// `layout::SlotWord`): readers only ever modify a word whose tag matches their handle.
pub fn tag(mac: &[u8; MAC_LEN]) -> u32 {
    u32::from_le_bytes([mac[0], mac[1], mac[2], mac[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_bind_key_address_id_and_reader_set() {
        let signer = Signer::new([7; 32]);
        let (chunk_mac, good) = signer.sign("img", 128, 5, 3);
        assert_eq!(good.reader_set(), 3);
        assert_eq!(signer.verify("img", &good), Some(chunk_mac));
        assert_eq!(signer.verify("img2", &good), None);
        for forged in [
            Handle {
                address: 192,
                ..good
            },
            Handle {
                monotonic_id: 6,
                ..good
            },
        ] {
            assert_eq!(signer.verify("img", &forged), None);
        }
        let mut retargeted = good;
        retargeted.signature[MAC_LEN] ^= 1; // another reader set, same MAC
        assert_eq!(signer.verify("img", &retargeted), None);
        assert_eq!(Signer::new([8; 32]).verify("img", &good), None);
        // Another reader set: another handle to the same chunk.
        let other = signer.handle("img", 128, 5, 4);
        assert_ne!(other, good);
        assert_eq!(signer.verify("img", &other), Some(chunk_mac));
        // Length prefix: ("ab", x) and ("a", "b"+x) cannot collide by construction.
        assert_ne!(signer.sign("ab", 0, 0, 0).0, signer.sign("a", 0, 0, 0).0);
    }

    #[test]
    fn a_change_to_any_byte_of_the_signature_fails_verification() {
        // Every byte counts: a comparison of only a prefix of the MAC (or of the MAC
        // without the reader set) would accept these.
        let signer = Signer::new([7; 32]);
        let good = signer.handle("img", 128, 5, 3);
        assert!(signer.verify("img", &good).is_some());
        for i in 0..SIGNATURE_LEN {
            for bit in [0x01, 0x80] {
                let mut forged = good;
                forged.signature[i] ^= bit;
                assert_eq!(signer.verify("img", &forged), None, "byte {i} bit {bit:#x}");
            }
        }
    }

    #[test]
    fn macs_are_keyed_blake3_of_the_documented_message() {
        // The module doc's definition, hashed in pieces: what every build signs and verifies.
        let secret = [9; 32];
        let expected = |suffix: &[u8]| {
            let mut hasher = blake3::Hasher::new_keyed(&secret);
            hasher.update(&3u64.to_le_bytes());
            hasher.update(b"img");
            hasher.update(&128u64.to_le_bytes());
            hasher.update(&5u64.to_le_bytes());
            hasher.update(suffix);
            hasher.finalize().as_bytes()[..MAC_LEN].to_vec()
        };
        let signer = Signer::new(secret);
        let (chunk_mac, handle) = signer.sign("img", 128, 5, 0x0403_0201);
        assert_eq!(chunk_mac.to_vec(), expected(&[0]));
        assert_eq!(
            handle.signature[..MAC_LEN].to_vec(),
            expected(&[1, 1, 2, 3, 4])
        );
        let other = signer.handle("img", 128, 5, 7);
        assert_eq!(
            other.signature[..MAC_LEN].to_vec(),
            expected(&[1, 7, 0, 0, 0])
        );
    }
}
