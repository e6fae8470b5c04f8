//! Keyed signatures that make handles unforgeable.
//!
//! The writer draws a 32-byte secret at creation. It travels only inside the picklable
//! reader handle (the engine's own IPC), never in the segment, so a process that can read
//! `/dev/shm` but did not get a reader handle cannot mint handles. A signature covers the
//! cache key, the address and the monotonic id: a handle replayed for another key, moved to
//! another address or re-numbered fails verification before any shared byte is read.

/// Bytes of a handle signature (a truncated keyed BLAKE3 hash: 128 bits).
pub const SIGNATURE_LEN: usize = 16;

/// Where one object lives and the proof that this store's writer said so.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle {
    /// Offset of the chunk in the data ring (64-byte aligned).
    pub address: u64,
    /// The chunk's 64-bit id; never reused, never 0.
    pub monotonic_id: u64,
    pub signature: [u8; SIGNATURE_LEN],
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

    pub fn sign(&self, key: &str, address: u64, monotonic_id: u64) -> [u8; SIGNATURE_LEN] {
        let mut hasher = blake3::Hasher::new_keyed(&self.secret);
        // Length-prefix the key so (key, address) pairs cannot be re-split.
        hasher.update(&(key.len() as u64).to_le_bytes());
        hasher.update(key.as_bytes());
        hasher.update(&address.to_le_bytes());
        hasher.update(&monotonic_id.to_le_bytes());
        let mut out = [0u8; SIGNATURE_LEN];
        out.copy_from_slice(&hasher.finalize().as_bytes()[..SIGNATURE_LEN]);
        out
    }

    /// Constant-time check that `handle` was signed by this secret for `key`.
    pub fn verify(&self, key: &str, handle: &Handle) -> bool {
        let expected = self.sign(key, handle.address, handle.monotonic_id);
        expected
            .iter()
            .zip(handle.signature.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The 32-bit tag of a signature that chunk headers carry in each reader word (see
/// `layout::SlotWord`): readers only ever modify a word whose tag matches their handle.
pub fn tag(signature: &[u8; SIGNATURE_LEN]) -> u32 {
    u32::from_le_bytes([signature[0], signature[1], signature[2], signature[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_bind_key_address_and_id() {
        let signer = Signer::new([7; 32]);
        let sig = signer.sign("img", 128, 5);
        let good = Handle {
            address: 128,
            monotonic_id: 5,
            signature: sig,
        };
        assert!(signer.verify("img", &good));
        assert!(!signer.verify("img2", &good));
        assert!(!signer.verify(
            "img",
            &Handle {
                address: 192,
                ..good
            }
        ));
        assert!(!signer.verify(
            "img",
            &Handle {
                monotonic_id: 6,
                ..good
            }
        ));
        assert!(!Signer::new([8; 32]).verify("img", &good));
        // Length prefix: ("ab", x) and ("a", "b"+x) cannot collide by construction.
        assert_ne!(signer.sign("ab", 0, 0), signer.sign("a", 0, 0));
    }
}
