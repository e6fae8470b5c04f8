//! Every access to a segment's bytes: the bounds and reservation check in front of each, the
//! atomic words, plain and racy copies in and out, and the addresses views export. What
//! `RawBytes` and these methods promise is the module docs' first rule: no Rust slice over
//! bytes another process or thread may write.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use super::{Access, Segment};
use crate::error::{Error, Result};

/// Bytes owned by the caller but possibly written by another thread meanwhile (a Python
/// buffer with the GIL released): never formed into a Rust slice, only copied from.
#[derive(Clone, Copy, Debug)]
pub struct RawBytes<'a> {
    ptr: *const u8,
    len: usize,
    _borrow: std::marker::PhantomData<&'a [u8]>,
}

// SAFETY: `RawBytes` is a read-only borrow of memory valid for `'a` (its constructor's
// contract); it is only ever copied from, which is as sound from another thread as from the
// one that made it (a Python buffer stays pinned while the GIL is released).
unsafe impl Send for RawBytes<'_> {}
// SAFETY: as for `Send`: shared access only copies from the bytes.
unsafe impl Sync for RawBytes<'_> {}

impl<'a> RawBytes<'a> {
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes for the lifetime `'a`.
    pub unsafe fn new(ptr: *const u8, len: usize) -> RawBytes<'a> {
        RawBytes {
            ptr,
            len,
            _borrow: std::marker::PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'a> From<&'a [u8]> for RawBytes<'a> {
    fn from(bytes: &'a [u8]) -> Self {
        // SAFETY: a shared slice is valid for reads of its length for its lifetime.
        unsafe { RawBytes::new(bytes.as_ptr(), bytes.len()) }
    }
}

/// `dst` as bytes to be written, for the copies of this module, which write every one of
/// them and never a `MaybeUninit::uninit()`: it stays initialised.
pub(crate) fn written_whole(dst: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` has `u8`'s size and alignment, so the slice is the same
    // memory; every caller only ever stores initialised bytes through the result (the
    // copies in this crate), so `dst` is still all initialised once it is used again.
    unsafe { &mut *(std::ptr::from_mut::<[u8]>(dst) as *mut [MaybeUninit<u8>]) }
}

impl Segment {
    /// The start of `len` bytes at `offset` after checking they lie inside the segment and
    /// are reserved (reserving them first if needed: `ShmTooSmall` if tmpfs cannot).
    ///
    /// Inlined (a lookup makes a dozen of these checks): the common case is two compares and
    /// a load; reserving and the error are out of line.
    #[inline]
    fn check(&self, offset: u64, len: usize) -> Result<usize> {
        let Ok(start) = usize::try_from(offset) else {
            return Err(out_of_range(offset, len));
        };
        match start.checked_add(len) {
            Some(end) if end <= self.len => {
                if !self.reserved.covers(end) {
                    self.reserve_range(start, end)?;
                }
                Ok(start)
            }
            _ => Err(out_of_range(offset, len)),
        }
    }

    /// [`Segment::check`]'s slow path: reserve `[start, end)`, inside the mapping.
    #[cold]
    #[inline(never)]
    fn reserve_range(&self, start: usize, end: usize) -> Result<()> {
        // SAFETY: `base` is our read-write mapping of `len` bytes (a read-only one records
        // everything reserved), mapped while `self` lives.
        unsafe { self.reserved.reserve(self.base, start, end) }
    }

    /// Make sure `len` bytes at `offset` are reserved, before a step that must not fail
    /// halfway (`ShmTooSmall` if tmpfs cannot hold them).
    pub fn reserve(&self, offset: u64, len: usize) -> Result<()> {
        self.check(offset, len).map(|_| ())
    }

    fn check_writable(&self) -> Result<()> {
        match self.access {
            Access::ReadWrite => Ok(()),
            Access::ReadOnly => Err(Error::InvalidArgument("segment is mapped read-only".into())),
        }
    }

    /// The 8-byte-aligned word at `offset`, as an atomic.
    #[inline]
    pub fn atomic(&self, offset: u64) -> Result<&AtomicU64> {
        let [word] = self.atomics::<1>(offset)?;
        Ok(word)
    }

    /// The `N` consecutive 8-byte-aligned words at `offset`, as atomics, for one check (a
    /// bucket's head and version, a key slot).
    #[inline]
    pub fn atomics<const N: usize>(&self, offset: u64) -> Result<&[AtomicU64; N]> {
        let start = self.check(offset, 8 * N)?;
        if start % 8 != 0 {
            return Err(misaligned(offset));
        }
        // SAFETY: `start..start+8N` lies inside the mapping (checked above) and is 8-byte
        // aligned (the base is page-aligned), as `[AtomicU64; N]` must be. The mapping
        // outlives the returned reference (it is tied to `&self`). All processes access these
        // words only atomically, so viewing them as `AtomicU64`s introduces no data race.
        Ok(unsafe { &*self.base.as_ptr().add(start).cast::<[AtomicU64; N]>() })
    }

    /// Copy `dst.len()` bytes out of the segment, starting at `offset`, from bytes that no
    /// other process writes meanwhile: a chunk the caller protects (a lease, or the writer's
    /// own lock), published with Release and observed with Acquire.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.read_into_uninit(offset, written_whole(dst))
    }

    /// [`Segment::read_into`] into memory not written yet (a new `bytes` object, a copy
    /// arena): viewed as `MaybeUninit` bytes, never as `[u8]`, until this has written them.
    pub fn read_into_uninit(&self, offset: u64, dst: &mut [MaybeUninit<u8>]) -> Result<()> {
        let start = self.check(offset, dst.len())?;
        // SAFETY: the source range is inside the mapping (checked), `dst` is a distinct
        // exclusive Rust buffer, so the ranges cannot overlap; a byte copy has no alignment
        // requirement. Per this function's contract nobody writes the source meanwhile, so
        // the plain copy races with nothing.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(start),
                dst.as_mut_ptr().cast::<u8>(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copy `dst.len()` bytes out of the segment from bytes the writer may be reusing at this
    /// very moment (an unprotected read, verified afterwards by the caller's seqlock check).
    ///
    /// Every byte is read with an atomic (Relaxed) load — whole aligned words in the middle,
    /// single bytes at the ends — so a concurrent write is a benign race in Rust's memory
    /// model rather than undefined behaviour; the caller discards the copy if the chunk's id
    /// changed.
    pub fn read_into_racy(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.read_into_racy_uninit(offset, written_whole(dst))
    }

    /// [`Segment::read_into_racy`] into memory not written yet (see
    /// [`Segment::read_into_uninit`]).
    pub fn read_into_racy_uninit(&self, offset: u64, dst: &mut [MaybeUninit<u8>]) -> Result<()> {
        let start = self.check(offset, dst.len())?;
        let src = self.base.as_ptr().wrapping_add(start);
        let head = src.align_offset(8).min(dst.len());
        let words = (dst.len() - head) / 8;
        let load_byte = |i: usize| {
            // SAFETY: `src + i` lies inside the mapping (the whole range was checked) and a
            // byte is always aligned; shared bytes are only ever accessed atomically here or
            // written by the writer, which is the race the seqlock check resolves.
            unsafe { AtomicU8::from_ptr(src.add(i)) }.load(Ordering::Relaxed)
        };
        for (i, byte) in dst[..head].iter_mut().enumerate() {
            byte.write(load_byte(i));
        }
        for (w, out) in dst[head..head + words * 8].chunks_exact_mut(8).enumerate() {
            // SAFETY: as above, and `src + head` is 8-byte aligned, so every word is.
            let word = unsafe { AtomicU64::from_ptr(src.add(head + w * 8).cast::<u64>()) }
                .load(Ordering::Relaxed);
            for (byte, value) in out.iter_mut().zip(word.to_ne_bytes()) {
                byte.write(value);
            }
        }
        let tail = head + words * 8;
        for (i, byte) in dst[tail..].iter_mut().enumerate() {
            byte.write(load_byte(tail + i));
        }
        Ok(())
    }

    /// Copy `src` into the segment at `offset` (writer only).
    pub fn write_from(&self, offset: u64, src: RawBytes<'_>) -> Result<()> {
        self.check_writable()?;
        let start = self.check(offset, src.len)?;
        // SAFETY: the destination range is inside a read-write mapping (checked); the writer
        // owns this range (the ring allocator handed it out and no reader acts on it until
        // the chunk's id is published with Release). `src` is valid for reads of `len` bytes
        // (`RawBytes`'s contract) and is caller memory, not part of the destination range.
        // It is read through a raw pointer, never as a slice, because another thread may
        // write it meanwhile (a Python buffer with the GIL released): such a write can only
        // change what is stored, which is that caller's own race.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr, self.base.as_ptr().add(start), src.len) };
        Ok(())
    }

    /// Fill `len` bytes at `offset` with zeros (writer only).
    pub fn zero(&self, offset: u64, len: usize) -> Result<()> {
        self.check_writable()?;
        let start = self.check(offset, len)?;
        // SAFETY: as in `write_from`: an in-bounds range owned by the writer.
        unsafe { std::ptr::write_bytes(self.base.as_ptr().add(start), 0, len) };
        Ok(())
    }

    /// The address of `len` bytes at `offset` in the read-only mapping, for exporting a
    /// view. Dereferencing it is the caller's responsibility (and needs the chunk to be
    /// protected). Only openers have a read-only mapping; the writer exports no views.
    pub fn view_address(&self, offset: u64, len: usize) -> Result<*const u8> {
        let start = self.check(offset, len)?;
        let base = match (self.view_base, self.access) {
            (Some(view), _) => view,
            (None, Access::ReadOnly) => self.base,
            (None, Access::ReadWrite) => {
                return Err(Error::InvalidArgument("the writer exports no views".into()));
            }
        };
        Ok(base.as_ptr().wrapping_add(start).cast_const())
    }

    /// Address and length of the read-only mapping views point into (openers only).
    pub fn view_mapping(&self) -> Option<(usize, usize)> {
        self.view_base
            .map(|base| (base.as_ptr() as usize, self.len))
    }
}

#[cold]
#[inline(never)]
fn misaligned(offset: u64) -> Error {
    Error::Corrupt(format!("misaligned atomic offset {offset}"))
}

#[cold]
#[inline(never)]
fn out_of_range(offset: u64, len: usize) -> Error {
    Error::Corrupt(format!("range {offset}+{len} lies outside the segment"))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{create, unique};

    #[test]
    fn racy_copies_equal_plain_copies_at_every_alignment() {
        let name = unique("racy");
        let seg = create(&name, 4096).unwrap();
        let bytes: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        seg.write_from(0, bytes.as_slice().into()).unwrap();
        for offset in 0..17u64 {
            for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 200] {
                let mut plain = vec![0u8; len];
                let mut racy = vec![0u8; len];
                seg.read_into(offset, &mut plain).unwrap();
                seg.read_into_racy(offset, &mut racy).unwrap();
                assert_eq!(plain, racy, "offset {offset} len {len}");
            }
        }
        assert!(seg.read_into_racy(4090, &mut [0u8; 8]).is_err());
    }

    #[test]
    fn bounds_and_alignment_are_checked() {
        let name = unique("b");
        let seg = create(&name, 4096).unwrap();
        assert!(seg.atomic(4096 - 8).is_ok());
        assert!(seg.atomic(4096).is_err());
        assert!(seg.atomic(12).is_err());
        assert!(seg.read_into(4090, &mut [0u8; 8]).is_err());
        assert!(seg.write_from(u64::MAX, b"a".as_slice().into()).is_err());
    }
}
