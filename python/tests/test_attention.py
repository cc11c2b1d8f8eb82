"""flash_attn_func and friends against the float64 oracle, under the numerics contract, on random
inputs seeded per case: forward, lse, backward, dropout, packed and varlen forms, strides."""

import math
import os
import time

import pytest
import torch

import flash_attn_rs as fa
from reference import EPS_GRAD, EPS_OUT, assert_contract, attention

# (b, sq, sk, hq, hk, d, dv, options)
CASES = [
    (2, 64, 64, 4, 4, 64, 64, {}),
    (1, 97, 131, 4, 2, 64, 64, {"causal": True}),
    (2, 131, 97, 6, 2, 128, 128, {"causal": True}),
    (2, 80, 80, 4, 1, 32, 32, {"window_size": (16, 8)}),
    (1, 70, 90, 4, 4, 64, 64, {"window_size": (20, 0), "causal": True}),
    (2, 48, 72, 4, 2, 64, 64, {"softcap": 5.0}),
    (2, 64, 64, 4, 2, 64, 64, {"alibi": "h", "causal": True}),
    (2, 33, 65, 4, 4, 40, 40, {"alibi": "bh"}),
    (1, 1, 300, 8, 2, 128, 128, {"causal": True}),
    (1, 40, 40, 2, 2, 256, 256, {"softmax_scale": 0.3}),
]
CPU_ONLY_CASES = [
    (2, 17, 23, 3, 1, 20, 12, {"causal": True}),  # dv != d, odd sizes
]


def _inputs(gen, device, dtype, b, sq, sk, hq, hk, d, dv, requires_grad=False):
    def mk(*shape):
        t = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return mk(b, sq, hq, d), mk(b, sk, hk, d), mk(b, sk, hk, dv)


def _alibi(gen, kind, b, hq, device):
    if kind is None:
        return None
    shape = (hq,) if kind == "h" else (b, hq)
    return (torch.rand(*shape, generator=gen) * 0.5).to(device)


def _cases(device):
    return CASES + (CPU_ONLY_CASES if device == "cpu" else [])


def _run_case(gen, device, dtype, case, backward):
    b, sq, sk, hq, hk, d, dv, opts = case
    opts = dict(opts)
    alibi = _alibi(gen, opts.pop("alibi", None), b, hq, device)
    scale = opts.pop("softmax_scale", 1.0 / math.sqrt(d))
    q, k, v = _inputs(gen, device, dtype, b, sq, sk, hq, hk, d, dv, requires_grad=backward)
    out, lse, _ = fa.flash_attn_func(q, k, v, softmax_scale=scale, alibi_slopes=alibi, return_attn_probs=True, **opts)
    ref_opts = dict(scale=scale, causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                    softcap=opts.get("softcap", 0.0), alibi=alibi)
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    o64, l64 = attention(q64, k64, v64, **ref_opts)
    qn, kn, vn = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    on, ln = attention(qn, kn, vn, **ref_opts)
    assert out.shape == (b, sq, hq, dv) and out.dtype == dtype and out.device.type == device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert_contract("out", out.detach(), on.detach(), o64.detach(), EPS_OUT[dtype])
    assert_contract("lse", lse, ln.detach(), l64.detach(), EPS_OUT[torch.float32])
    if backward:
        dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
        out.backward(dout)
        o64.backward(dout.double())
        on.backward(dout)
        for name, ours, naive, oracle in (("dq", q, qn, q64), ("dk", k, kn, k64), ("dv", v, vn, v64)):
            assert ours.grad.shape == ours.shape and ours.grad.dtype == dtype
            assert_contract(name, ours.grad, naive.grad, oracle.grad, EPS_GRAD[dtype])


@pytest.mark.parametrize("case", range(len(CASES) + len(CPU_ONLY_CASES)))
def test_forward_matches_oracle(device_dtype, case, gen):
    device, dtype = device_dtype
    cases = _cases(device)
    if case >= len(cases):
        pytest.skip("a CPU-only case (the CUDA kernels need d == dv, a multiple of 8)")
    _run_case(gen, device, dtype, cases[case], backward=False)


@pytest.mark.parametrize("case", range(len(CASES) + len(CPU_ONLY_CASES)))
def test_backward_matches_oracle(device_dtype, case, gen):
    device, dtype = device_dtype
    cases = _cases(device)
    if case >= len(cases):
        pytest.skip("a CPU-only case")
    _run_case(gen, device, dtype, cases[case], backward=True)


def test_dropout_matches_oracle_with_the_kernels_mask(device_dtype, gen):
    device, dtype = device_dtype
    b, s, hq, hk, d, p = 2, 72, 4, 2, 64, 0.2
    q, k, v = _inputs(gen, device, dtype, b, s, s, hq, hk, d, d, requires_grad=True)
    torch.manual_seed(1234)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    keep = s_dmask >= 0
    visible = s_dmask != 0
    frac = 1 - keep[visible].float().mean().item()
    assert abs(frac - p) < 0.03, f"dropped fraction {frac} is not near p = {p}"
    ref = dict(scale=d**-0.5, causal=True, keep=keep, dropout_p=p)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o64, _ = attention(q64, k64, v64, **ref)
    on, _ = attention(qn, kn, vn, **ref)
    assert_contract("out", out.detach(), on.detach(), o64.detach(), EPS_OUT[dtype])
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    out.backward(dout)
    o64.backward(dout.double())
    on.backward(dout)
    for name, ours, naive, oracle in (("dq", q, qn, q64), ("dk", k, kn, k64), ("dv", v, vn, v64)):
        assert_contract(name, ours.grad, naive.grad, oracle.grad, EPS_GRAD[dtype])


def test_dropout_follows_torch_manual_seed(device_dtype, gen):
    device, dtype = device_dtype
    q, k, v = _inputs(gen, device, dtype, 1, 40, 40, 2, 2, 32, 32)
    torch.manual_seed(7)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    b = fa.flash_attn_func(q, k, v, dropout_p=0.3)
    c = fa.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_attn_probs_are_the_softmax(device_dtype, gen):
    device, dtype = device_dtype
    q, k, v = _inputs(gen, device, dtype, 2, 30, 50, 4, 2, 32, 32)
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, softcap=4.0, return_attn_probs=True)
    s = attention(q.double(), k.double(), v.double(), scale=32**-0.5, causal=True, softcap=4.0)
    assert probs.shape == (2, 4, 30, 50)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 30, device=device, dtype=torch.float32), atol=1e-4)
    # P · V from the probabilities reproduces the output.
    vh = v.double().transpose(1, 2).repeat_interleave(2, dim=1)
    o = (probs.double() @ vh).transpose(1, 2)
    assert_contract("P·V", o, out, s[0], EPS_OUT[dtype])


def test_packed_forms_equal_the_unpacked(device_dtype, gen):
    device, dtype = device_dtype
    b, s, h, d = 2, 50, 4, 64
    qkv = torch.randn(b, s, 3, h, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    ref = fa.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    q = torch.randn(b, s, h, d, generator=gen).to(device=device, dtype=dtype)
    kv = torch.randn(b, s + 7, 2, 2, d, generator=gen).to(device=device, dtype=dtype)
    assert torch.equal(fa.flash_attn_kvpacked_func(q, kv), fa.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1]))


def _varlen(gen, device, dtype, lens_q, lens_k, hq, hk, d, requires_grad):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(device=device, dtype=dtype).requires_grad_(requires_grad)
    k = torch.randn(sum(lens_k), hk, d, generator=gen).to(device=device, dtype=dtype).requires_grad_(requires_grad)
    v = torch.randn(sum(lens_k), hk, d, generator=gen).to(device=device, dtype=dtype).requires_grad_(requires_grad)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_oracle(device_dtype, causal, gen):
    device, dtype = device_dtype
    lens_q, lens_k = [17, 64, 1, 40], [30, 64, 9, 40]
    q, k, v, cu_q, cu_k = _varlen(gen, device, dtype, lens_q, lens_k, 4, 2, 64, True)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            window_size=(24, -1), return_attn_probs=True)
    ref = dict(scale=64**-0.5, causal=causal, window=(24, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o64, l64 = attention(q64, k64, v64, **ref)
    on, ln = attention(qn, kn, vn, **ref)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    assert_contract("out", out.detach(), on.detach(), o64.detach(), EPS_OUT[dtype])
    assert_contract("lse", lse, ln.detach(), l64.detach(), EPS_OUT[torch.float32])
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    out.backward(dout)
    o64.backward(dout.double())
    on.backward(dout)
    for name, ours, naive, oracle in (("dq", q, qn, q64), ("dk", k, kn, k64), ("dv", v, vn, v64)):
        assert_contract(name, ours.grad, naive.grad, oracle.grad, EPS_GRAD[dtype])


def test_varlen_packed_forms(device_dtype, gen):
    device, dtype = device_dtype
    lens = [5, 33, 12]
    q, k, v, cu, _ = _varlen(gen, device, dtype, lens, lens, 2, 2, 32, False)
    qkv = torch.stack([q, k, v], dim=1)
    ref = fa.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 33, causal=True), ref)
    kv = torch.stack([k, v], dim=1)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 33, 33, causal=True), ref)


def test_strided_inputs_need_no_copy_and_give_the_same_result(device_dtype, gen):
    device, dtype = device_dtype
    b, s, h, d = 2, 64, 4, 64
    # [b, h, s, d] storage seen as [b, s, h, d]: the layout transformers' attention modules hand over.
    qh, kh, vh = (torch.randn(b, h, s, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    q, k, v = (t.transpose(1, 2) for t in (qh, kh, vh))
    assert not q.is_contiguous()
    out = fa.flash_attn_func(q, k, v, causal=True)
    ref = fa.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, ref)
    # A last dimension with stride 2 is copied to a contiguous layout, not refused.
    wide = torch.randn(b, s, h, 2 * d, generator=gen).to(device=device, dtype=dtype)
    out = fa.flash_attn_func(wide[..., ::2], k, v)
    assert torch.equal(out, fa.flash_attn_func(wide[..., ::2].contiguous(), k, v))


def test_gradients_agree_with_finite_differences(gen):
    """gradcheck-style: the directional derivative of our forward (central differences, float32)
    against the analytic gradient from our backward, along random directions."""
    b, s, h, d = 1, 24, 2, 16
    q, k, v = (torch.randn(b, s, h, d, generator=gen, dtype=torch.float32) for _ in range(3))
    dout = torch.randn(b, s, h, d, generator=gen)
    args = dict(causal=True, softcap=3.0, alibi_slopes=torch.tensor([0.1, 0.3]))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (fa.flash_attn_func(*leaves, **args) * dout).sum().backward()
    for _ in range(3):
        dirs = [torch.randn(t.shape, generator=gen) for t in (q, k, v)]
        eps = 1e-2

        def f(sign):
            moved = [(t + sign * eps * u).double().float() for t, u in zip((q, k, v), dirs)]
            return (fa.flash_attn_func(*moved, **args).double() * dout.double()).sum().item()

        numeric = (f(1) - f(-1)) / (2 * eps)
        analytic = sum((leaf.grad.double() * u.double()).sum().item() for leaf, u in zip(leaves, dirs))
        assert abs(numeric - analytic) <= 2e-3 * max(1.0, abs(analytic)), (numeric, analytic)


def test_low_level_fwd_bwd_pair(device_dtype, gen):
    device, dtype = device_dtype
    q, k, v = _inputs(gen, device, dtype, 2, 40, 56, 4, 2, 64, 64)
    out, lse, rng = fa.fwd(q, k, v, causal=True, dropout_p=0.1, rng_state=torch.tensor([11, 3]))
    assert rng.tolist() == [11, 3]
    again, _, _ = fa.fwd(q, k, v, causal=True, dropout_p=0.1, rng_state=torch.tensor([11, 3]))
    assert torch.equal(out, again)
    dout = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    dq, dk, dv = fa.bwd(dout, q, k, v, out, lse, rng, causal=True, dropout_p=0.1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o2, _, _ = fa.fwd(*leaves, causal=True, dropout_p=0.1, rng_state=rng)
    o2.backward(dout)
    for ours, leaf in zip((dq, dk, dv), leaves):
        if device == "cpu":
            assert torch.equal(ours, leaf.grad)  # the CPU backward is bitwise reproducible
        else:
            assert torch.allclose(ours.float(), leaf.grad.float(), atol=1e-2, rtol=1e-2)


def test_deterministic_backward_is_bitwise_reproducible(device_dtype, gen):
    device, dtype = device_dtype
    q, k, v = _inputs(gen, device, dtype, 2, 200, 200, 8, 2, 64, 64)
    dout = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    grads = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fa.flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout)
        grads.append([t.grad for t in leaves])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
                    reason="torch keeps no memory statistics without its caching allocator")
def test_cuda_backward_scratch_comes_from_torch():
    """The f32 dQ accumulator (4 bytes per query row, head and column) is a torch allocation:
    torch's peak-memory counter sees it."""
    b, s, h, d = 1, 4096, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = fa.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(dout)
    torch.cuda.synchronize()
    grads = 3 * b * s * h * d * 2
    accum = 4 * b * s * h * d
    assert torch.cuda.max_memory_allocated() - before >= grads + accum


def test_varlen_tokens_past_the_last_sequence_give_zero_and_minus_inf(device_dtype, gen):
    """DESIGN §2: packed rows past cu_seqlens[-1] are no sequence's; their output is 0 and their
    lse -inf, whatever the output buffer held before."""
    device, dtype = device_dtype
    q = torch.randn(40, 2, 32, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(40, 2, 32, generator=gen).to(device=device, dtype=dtype)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=device)
    for _ in range(2):  # the second call reuses freed (non-zero) memory from the caching allocator
        junk = torch.full((4096,), 7.0, device=device)
        del junk
        out, lse, _ = fa.flash_attn_varlen_func(q, k, k, cu, cu, 20, 20, causal=True, return_attn_probs=True)
        assert torch.equal(out[30:].float(), torch.zeros(10, 2, 32, device=device))
        assert torch.isneginf(lse[:, 30:]).all()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_computes_what_its_parent_did():
    # The parent's call starts the CPU backend's workers; a child forked after it has none of
    # them, and must still finish (on its calling thread) with the same bits. The child drops
    # torch to one thread first, as DataLoader's workers do: torch's own OpenMP pool hangs a
    # forked child whose parent used it (a float64 matmul alone hangs there).
    gen = torch.Generator().manual_seed(47)
    q, k, v = _inputs(gen, "cpu", torch.float32, 1, 256, 256, 8, 8, 64, 64)
    parent = fa.flash_attn_func(q, k, v, causal=True)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            torch.set_num_threads(1)
            child = fa.flash_attn_func(q, k, v, causal=True)
            os.write(w, b"1" if torch.equal(child, parent) else b"0")
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 120
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's forward did not finish")
        time.sleep(0.02)
    assert os.read(r, 1) == b"1"
    os.close(r)
