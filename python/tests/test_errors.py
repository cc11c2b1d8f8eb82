"""Bad inputs raise Python exceptions with the library's message; nothing crashes, and a refused
KV-cache call writes nothing."""

import pytest
import torch

import flash_attn_rs as fa


def _qkv(b=1, s=16, hq=4, hk=2, d=32, dtype=torch.float32, device="cpu"):
    return (torch.randn(b, s, h, d, dtype=dtype, device=device) for h in (hq, hk, hk))


def test_mixed_dtypes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dtype"):
        fa.flash_attn_func(q, k.bfloat16(), v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fa.flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype))


def test_not_a_tensor():
    _, k, v = _qkv()
    with pytest.raises(TypeError):
        fa.flash_attn_func([1.0], k, v)


def test_wrong_rank():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"\[b, sq, hq, d\]"):
        fa.flash_attn_func(q[0], k, v)


def test_head_ratio():
    q, k, v = _qkv(hq=3, hk=2)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fa.flash_attn_func(q, k, v)


def test_head_dim_mismatch():
    q, _, _ = _qkv(d=32)
    _, k, v = _qkv(d=16)
    with pytest.raises(ValueError, match="shape mismatch"):
        fa.flash_attn_func(q, k, v)


def test_batch_mismatch():
    q, _, _ = _qkv(b=2)
    _, k, v = _qkv(b=3)
    with pytest.raises(ValueError):
        fa.flash_attn_func(q, k, v)


def test_unsupported_head_dim():
    q, k, v = _qkv(d=1024)
    with pytest.raises(NotImplementedError, match="head dimension"):
        fa.flash_attn_func(q, k, v)


@pytest.mark.parametrize("kwargs,match", [
    ({"dropout_p": 1.0}, "dropout_p"),
    ({"dropout_p": -0.1}, "dropout_p"),
    ({"softcap": -1.0}, "softcap|Softcap|cap"),
    ({"window_size": (-3, 0)}, "window"),
    ({"softmax_scale": float("nan")}, "scale"),
])
def test_bad_options(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        fa.flash_attn_func(q, k, v, **kwargs)


def test_bad_alibi():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="float32"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="(?i)alibi"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(5))


def test_bad_cu_seqlens():
    q = torch.randn(20, 2, 32)
    with pytest.raises(ValueError, match="int32"):
        fa.flash_attn_varlen_func(q, q, q, torch.tensor([0, 20]), torch.tensor([0, 20]), 20, 20)
    bad = torch.tensor([0, 15, 10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fa.flash_attn_varlen_func(q, q, q, bad, bad, 20, 20)
    past = torch.tensor([0, 25], dtype=torch.int32)
    with pytest.raises(ValueError):
        fa.flash_attn_varlen_func(q, q, q, past, past, 25, 25)


def test_packed_shapes():
    with pytest.raises(ValueError, match="qkv"):
        fa.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 16))
    with pytest.raises(ValueError, match="kv"):
        fa.flash_attn_kvpacked_func(torch.randn(1, 8, 2, 16), torch.randn(1, 8, 3, 2, 16))


def test_kvcache_errors_write_nothing():
    q = torch.randn(2, 1, 4, 32)
    kc, vc = torch.randn(2, 40, 2, 32), torch.randn(2, 40, 2, 32)
    kn, vn = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError):  # past the cache's end
        fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([10, 40], dtype=torch.int32))
    with pytest.raises(ValueError):  # a page index out of range
        fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([3, 3], dtype=torch.int32),
                                   block_table=torch.tensor([[0], [7]], dtype=torch.int32))
    with pytest.raises(ValueError, match="come together"):
        fa.flash_attn_with_kvcache(q, kc, vc, kn, None, cache_seqlens=3)
    with pytest.raises(ValueError, match="int32"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 3]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_kvcache_refuses_caches_sharing_memory():
    q = torch.randn(1, 1, 2, 32)
    kv = torch.randn(1, 40, 2, 2, 32)
    with pytest.raises(ValueError, match="share memory"):
        fa.flash_attn_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], torch.randn(1, 1, 2, 32), torch.randn(1, 1, 2, 32),
                                   cache_seqlens=3)


def test_backward_with_a_wrong_lse():
    q, k, v = _qkv()
    out, lse, rng = fa.fwd(q, k, v)
    with pytest.raises(ValueError):
        fa.bwd(out, q, k, v, out, lse[:, :, :5], rng)
    with pytest.raises(ValueError, match="float32"):
        fa.bwd(out, q, k, v, out, lse.double(), rng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_specific_errors():
    q, k, v = _qkv(device="cuda")
    with pytest.raises(NotImplementedError, match="float16 and bfloat16"):
        fa.flash_attn_func(q, k, v)
    qh, kh, vh = _qkv(dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="is on"):
        fa.flash_attn_func(qh, kh.cpu(), vh)
    with pytest.raises(NotImplementedError, match="float16 and bfloat16"):
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=4)
    with pytest.raises(NotImplementedError, match="d == dv"):
        fa.flash_attn_with_kvcache(qh, kh, vh[..., :16].contiguous(), cache_seqlens=4)
