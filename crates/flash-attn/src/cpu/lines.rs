//! Growable buffers of 4-byte elements that start on a 64-byte cache line.
//!
//! The tiles the products read and write (`Q`, the packed `Kᵀ` and `V`, the score and output
//! tiles) live in [`LineVec`]s: with row strides of whole lines, every row of a tile then starts
//! a line. From the system allocator a `Vec<f32>` starts 16 bytes into a line, and every 64-byte
//! row an AMX `tileloadd` or `tilestored` moves, or an AVX-512 register loads, spans two lines.
//! Measured on the Xeon (one thread, session 45, `examples/cpu_gemm_bf16`): `gemm_bf16` on AMX at
//! three of the forward's tile shapes ran 2.1-2.2× faster (best bursts) with its operands on line
//! boundaries than 16 bytes off; the bf16 forward on 16 threads, 1.20-1.44× at d 128.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Element types a [`LineVec`] holds: 4 bytes, alignment at most 4, every bit pattern valid.
pub(super) trait Word: Copy + Default + sealed::Sealed {}

impl Word for f32 {}
impl Word for u32 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u32 {}
}

/// Elements of a [`LineVec`] per 64-byte line.
pub(super) const LINE_WORDS: usize = 16;

/// One cache line of storage.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([u32; LINE_WORDS]);

/// A `Vec`-like buffer of [`Word`]s whose first element starts a 64-byte line.
pub(super) struct LineVec<E> {
    lines: Vec<Line>,
    len: usize,
    _element: PhantomData<E>,
}

impl<E: Word> Default for LineVec<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Word> LineVec<E> {
    /// An empty buffer (allocates nothing).
    pub const fn new() -> Self {
        LineVec { lines: Vec::new(), len: 0, _element: PhantomData }
    }

    /// `n` zeros.
    pub fn zeroed(n: usize) -> Self {
        let mut v = Self::new();
        v.resize(n, E::default());
        v
    }

    /// This buffer's memory as `n` zeros (its contents those of [`Self::zeroed`]).
    pub fn into_zeros(mut self, n: usize) -> Self {
        self.clear();
        self.resize(n, E::default());
        self
    }

    /// Elements the buffer holds without growing.
    pub fn capacity(&self) -> usize {
        self.lines.capacity() * LINE_WORDS
    }

    /// Resizes to `n` elements as `Vec::resize` does: the first `min(len, n)` kept, the rest
    /// `value`.
    pub fn resize(&mut self, n: usize, value: E) {
        let lines = n.div_ceil(LINE_WORDS);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line::default());
        }
        let old = self.len;
        self.len = n;
        if n > old {
            self[old..].fill(value);
        }
    }

    /// Empties the buffer, keeping its memory.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Reserves room for `n` elements in all, or says the allocator has none.
    pub fn try_reserve_total(&mut self, n: usize) -> Result<(), std::collections::TryReserveError> {
        let lines = n.div_ceil(LINE_WORDS);
        self.lines.try_reserve_exact(lines.saturating_sub(self.lines.len()))
    }
}

impl<E: Word> Deref for LineVec<E> {
    type Target = [E];

    fn deref(&self) -> &[E] {
        // SAFETY: `lines` holds `16 · lines.len()` initialised 4-byte words, at least `len`
        // (`resize` keeps `len ≤ 16 · lines.len()`), and `E` is 4 bytes, aligned to at most 4, with
        // every bit pattern valid (`Word`), so they are `len` valid `E`s; the borrow of `self`
        // covers them.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<E>(), self.len) }
    }
}

impl<E: Word> DerefMut for LineVec<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        // SAFETY: as in `deref`, with the unique borrow of `self`; any `E` written is a valid word.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<E>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_resizes_as_a_vec_does() {
        let mut v = LineVec::<f32>::zeroed(5);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(&v[..], &[0.0; 5]);
        v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 + 0.5);
        v.resize(40, -1.0);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(v.len(), 40);
        assert_eq!(&v[..5], &[0.5, 1.5, 2.5, 3.5, 4.5]);
        assert!(v[5..].iter().all(|&x| x == -1.0));
        // Shrinking then growing refills the regrown part, as `Vec` does.
        v.resize(3, 9.0);
        v.resize(6, 7.0);
        assert_eq!(&v[..], &[0.5, 1.5, 2.5, 7.0, 7.0, 7.0]);
        let v = v.into_zeros(4);
        assert_eq!(&v[..], &[0.0; 4]);
        let mut v = v;
        v.clear();
        assert!(v.is_empty());
        assert!(v.capacity() >= 48);
        let mut w = LineVec::<u32>::new();
        assert!(w.try_reserve_total(100).is_ok());
        assert!(w.capacity() >= 100 && w.is_empty());
    }
}
