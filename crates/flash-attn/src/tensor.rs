//! Strided views over caller-owned buffers.
//!
//! A view is a buffer plus a shape and strides in elements (row-major by default). Building a
//! view never fails; it is checked when it meets an [`AttentionSpec`](crate::AttentionSpec), where
//! the error can name the tensor (`q`, `k`, ...) and the layout it should have.

use crate::error::{Error, Result};

/// Row-major strides of a shape.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// A read-only strided view: `data[Σ index_i · strides_i]` is element `index`.
#[derive(Debug, Clone)]
pub struct Tensor<'a, T> {
    data: &'a [T],
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a, T> Tensor<'a, T> {
    /// A row-major contiguous view of `data` with the given shape.
    pub fn new(data: &'a [T], shape: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: contiguous_strides(shape) }
    }

    /// A view with explicit strides (in elements). The last stride must be 1 for `q`, `k`, `v`.
    pub fn with_strides(data: &'a [T], shape: &[usize], strides: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: strides.to_vec() }
    }

    /// The underlying buffer.
    pub fn data(&self) -> &'a [T] {
        self.data
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Checks rank, strides and bounds; `name` and `layout` go into the error message.
    pub(crate) fn check(&self, name: &'static str, layout: &'static str, rank: usize) -> Result<()> {
        check_view(name, layout, rank, &self.shape, &self.strides, self.data.len())
    }
}

/// A writable strided view. Outputs must not overlap themselves (checked before writing).
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    data: &'a mut [T],
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a, T> TensorMut<'a, T> {
    /// A row-major contiguous view of `data` with the given shape.
    pub fn new(data: &'a mut [T], shape: &[usize]) -> Self {
        let strides = contiguous_strides(shape);
        Self { data, shape: shape.to_vec(), strides }
    }

    /// A view with explicit strides (in elements); the last stride must be 1.
    pub fn with_strides(data: &'a mut [T], shape: &[usize], strides: &[usize]) -> Self {
        Self { data, shape: shape.to_vec(), strides: strides.to_vec() }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The underlying buffer, read-only.
    pub fn data(&self) -> &[T] {
        self.data
    }

    /// The underlying buffer.
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }

    /// The underlying buffer, for the whole lifetime of the view's borrow.
    pub fn into_data(self) -> &'a mut [T] {
        self.data
    }

    /// Checks rank, strides, bounds and that no two elements share memory.
    pub(crate) fn check(&self, name: &'static str, layout: &'static str, rank: usize) -> Result<()> {
        check_view(name, layout, rank, &self.shape, &self.strides, self.data.len())?;
        check_no_overlap(name, &self.shape, &self.strides)
    }
}

fn check_view(
    name: &'static str,
    layout: &'static str,
    rank: usize,
    shape: &[usize],
    strides: &[usize],
    len: usize,
) -> Result<()> {
    if shape.len() != rank {
        return Err(Error::Rank { tensor: name, expected: rank, got: shape.len(), layout, shape: shape.to_vec() });
    }
    if strides.len() != shape.len() {
        return Err(Error::StrideCount { tensor: name, dims: shape.len(), strides: strides.len() });
    }
    if let (Some(&n), Some(&s)) = (shape.last(), strides.last()) {
        if n > 1 && s != 1 {
            return Err(Error::InnerStride { tensor: name, stride: s });
        }
    }
    let needed = extent(shape, strides);
    if needed.is_none_or(|n| n > len) {
        return Err(Error::OutOfBounds {
            tensor: name,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            needed: needed.unwrap_or(usize::MAX),
            len,
        });
    }
    Ok(())
}

/// One past the largest offset a view reaches (0 for an empty view), `None` on overflow.
fn extent(shape: &[usize], strides: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().zip(strides).try_fold(1usize, |acc, (&n, &s)| acc.checked_add((n - 1).checked_mul(s)?))
}

/// Sufficient condition for distinct offsets: ordered by stride, each stride exceeds the largest
/// offset reachable with the smaller ones.
fn check_no_overlap(name: &'static str, shape: &[usize], strides: &[usize]) -> Result<()> {
    if shape.contains(&0) {
        return Ok(());
    }
    let mut dims: Vec<(usize, usize)> =
        shape.iter().zip(strides).filter(|(&n, _)| n > 1).map(|(&n, &s)| (s, n)).collect();
    dims.sort_unstable();
    let mut reach = 0usize;
    for (s, n) in dims {
        if s <= reach {
            return Err(Error::Overlap { tensor: name, shape: shape.to_vec(), strides: strides.to_vec() });
        }
        reach = reach.saturating_add((n - 1).saturating_mul(s));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_are_row_major() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<usize>::new());
    }

    #[test]
    fn view_reaching_past_buffer_is_an_error() {
        let data = [0.0f32; 10];
        let t = Tensor::with_strides(&data, &[2, 5], &[6, 1]);
        assert!(matches!(t.check("q", "[a, b]", 2), Err(Error::OutOfBounds { needed: 11, len: 10, .. })));
    }

    #[test]
    fn padded_rows_are_accepted() {
        let data = [0.0f32; 11];
        let t = Tensor::with_strides(&data, &[2, 5], &[6, 1]);
        assert!(t.check("q", "[a, b]", 2).is_ok());
    }

    #[test]
    fn overlapping_output_is_an_error() {
        let mut data = [0.0f32; 10];
        let t = TensorMut::with_strides(&mut data, &[3, 4], &[2, 1]);
        assert!(matches!(t.check("out", "[a, b]", 2), Err(Error::Overlap { .. })));
        let t = TensorMut::with_strides(&mut data, &[2, 4], &[0, 1]);
        assert!(matches!(t.check("out", "[a, b]", 2), Err(Error::Overlap { .. })));
    }
}
