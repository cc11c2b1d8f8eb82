//! Behaviours of the public entry points that are not numerics.

use flash_attn::{AttentionSpec, Error, Tensor};

#[test]
fn an_output_too_large_to_allocate_is_an_error_not_an_abort() {
    // Broadcast views (stride 0) make a huge problem out of tiny buffers.
    let x = [0.5f32; 4];
    let n = 1usize << 40;
    let q = Tensor::with_strides(&x, &[1, n, 1, 4], &[0, 0, 0, 1]);
    let k = Tensor::with_strides(&x, &[1, 3, 1, 4], &[0, 0, 0, 1]);
    let res = flash_attn::forward(&AttentionSpec::new(), &q, &k, &k);
    assert!(matches!(res, Err(Error::OutOfMemory { what: "out", .. })), "{res:?}");
}
