"""FlashAttention-3's FP8 forward: float8_e4m3fn inputs with per-tensor descale factors, bf16
output, held to the FP8 contract (docs/semantics.md, "FP8 inputs") against the float64 oracle on
the dequantized inputs; the descale forms FlashAttention-3 takes; errors; no backward; custom op
and torch.compile.

CUDA tensors run the FP8 kernel on sm_90a (compute capability 9.0) and must meet the contract
there; other GPUs must refuse with NotImplementedError (the kernel uses Hopper's 8-bit warpgroup
MMAs), and every GPU refuses what the kernel does not take (varlen, dropout, softcap, ALiBi, head
dims that are not multiples of 16).
"""

import math

import pytest
import torch

import flash_attn_rs as fa
from flash_attn_rs._ops import fwd_fp8_op
from reference import EPS_FP8, assert_contract, attention

FP8 = torch.float8_e4m3fn

# (b, sq, sk, hq, hk, d, dv, options): the CUDA FP8 kernel takes these.
CASES = [
    (2, 64, 64, 4, 4, 64, 64, {}),
    (1, 97, 131, 4, 2, 64, 64, {"causal": True}),
    (2, 131, 97, 6, 2, 128, 128, {"causal": True}),  # the first 34 rows see no key
    (2, 80, 80, 4, 1, 32, 32, {"window_size": (16, 8)}),
    (1, 1, 300, 8, 2, 128, 128, {"causal": True}),
    (2, 200, 333, 4, 2, 96, 96, {}),
    (1, 40, 40, 2, 2, 256, 256, {"softmax_scale": 0.3}),
    (1, 70, 90, 4, 4, 16, 16, {"window_size": (20, 0), "causal": True}),
]
# ... and these it refuses (NotImplementedError on CUDA); the CPU takes every option.
CPU_ONLY_CASES = [
    (2, 48, 72, 4, 2, 64, 64, {"softcap": 5.0}),
    (2, 64, 64, 4, 2, 64, 64, {"alibi": "h", "causal": True}),
    (2, 17, 23, 3, 1, 20, 12, {"causal": True}),  # d not a multiple of 16, dv != d
]


def quantize(x):
    """Per-tensor e4m3: ``(x / scale)`` rounded to float8_e4m3fn, ``scale = max|x| / 448``
    (float32, 0-d), the descale factor that gives the real values back."""
    scale = (x.abs().amax().float() / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    return (x.float() / scale).to(FP8), scale


def dequantize(x8, scale):
    return x8.float() * scale


def _fp8_kernel(device):
    """Whether the CUDA FP8 kernel runs on this device: sm_90a, compute capability 9.0."""
    return device == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def _inputs(gen, device, b, sq, sk, hq, hk, d, dv, amplitude=1.0):
    """Random q, k, v quantized per tensor: ``(q8, k8, v8)`` on ``device`` and their descale
    factors (0-d float32 tensors on ``device``, as FlashAttention-3 takes them)."""
    shapes = ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv))
    quantized = [quantize(torch.randn(*s, generator=gen) * amplitude) for s in shapes]
    x8 = [x.to(device) for x, _ in quantized]
    scales = [s.to(device) for _, s in quantized]
    return x8, scales


def _references(x8, scales, **opts):
    """The float64 oracle and naive_fp8 on the dequantized inputs (on the CPU)."""
    deq = [dequantize(x.cpu(), s.cpu()) for x, s in zip(x8, scales)]
    oracle = attention(*(t.double() for t in deq), **opts)
    naive = attention(*deq, fp8=True, **opts)
    return oracle, naive


def _assert_fp8_contract(out, lse, oracle, naive):
    assert_contract("out", out.cpu(), naive[0], oracle[0], EPS_FP8)
    assert_contract("lse", lse.cpu(), naive[1], oracle[1], EPS_FP8)


def _alibi(gen, kind, b, hq):
    if kind is None:
        return None
    return torch.rand(*((hq,) if kind == "h" else (b, hq)), generator=gen) * 0.5


@pytest.mark.parametrize("case", range(len(CASES) + len(CPU_ONLY_CASES)))
def test_fp8_forward_meets_the_contract(device, case, gen):
    b, sq, sk, hq, hk, d, dv, opts = (CASES + CPU_ONLY_CASES)[case]
    opts = dict(opts)
    alibi = _alibi(gen, opts.pop("alibi", None), b, hq)
    scale = opts.pop("softmax_scale", 1.0 / math.sqrt(d))
    (q8, k8, v8), (dq, dk, dv_) = _inputs(gen, device, b, sq, sk, hq, hk, d, dv, amplitude=2.0)
    call = dict(softmax_scale=scale, alibi_slopes=None if alibi is None else alibi.to(device), descale_q=dq,
                descale_k=dk, descale_v=dv_, return_attn_probs=True, **opts)
    if device == "cuda" and (case >= len(CASES) or not _fp8_kernel(device)):
        with pytest.raises(NotImplementedError, match="FP8|fp8|sm_90a"):
            fa.flash_attn_func(q8, k8, v8, **call)
        return
    out, lse, _ = fa.flash_attn_func(q8, k8, v8, **call)
    assert out.shape == (b, sq, hq, dv) and out.dtype == torch.bfloat16 and out.device.type == device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    oracle, naive = _references(
        (q8, k8, v8), (dq, dk, dv_), scale=scale, causal=opts.get("causal", False),
        window=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0), alibi=alibi,
    )
    _assert_fp8_contract(out, lse, oracle, naive)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_meets_the_contract_on_the_cpu(causal, gen):
    lens_q, lens_k = [17, 64, 1, 40], [30, 64, 9, 40]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    shapes = ((sum(lens_q), 4, 64), (sum(lens_k), 2, 64), (sum(lens_k), 2, 64))
    quantized = [quantize(torch.randn(*s, generator=gen)) for s in shapes]
    (q8, dq), (k8, dk), (v8, dv) = quantized
    # FlashAttention-3's (batch, num_heads_k) form, all elements equal: batch = len(cu_seqlens_q) - 1.
    out, lse, _ = fa.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            window_size=(24, -1), descale_q=dq.expand(4, 2), descale_k=dk,
                                            descale_v=float(dv), return_attn_probs=True)
    assert out.shape == (sum(lens_q), 4, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (4, sum(lens_q))
    oracle, naive = _references((q8, k8, v8), (dq, dk, dv), scale=64**-0.5, causal=causal, window=(24, -1),
                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _assert_fp8_contract(out, lse, oracle, naive)


def test_fp8_dropout_on_the_cpu_meets_the_contract_with_the_kernels_mask(gen):
    b, s, hq, hk, d, p = 2, 72, 4, 2, 64, 0.2
    (q8, k8, v8), scales = _inputs(gen, "cpu", b, s, s, hq, hk, d, d)
    torch.manual_seed(1234)
    out, lse, s_dmask = fa.flash_attn_func(q8, k8, v8, dropout_p=p, causal=True, return_attn_probs=True,
                                           descale_q=scales[0], descale_k=scales[1], descale_v=scales[2])
    keep = s_dmask >= 0
    frac = 1 - keep[s_dmask != 0].float().mean().item()
    assert abs(frac - p) < 0.03, f"dropped fraction {frac} is not near p = {p}"
    oracle, naive = _references((q8, k8, v8), scales, scale=d**-0.5, causal=True, keep=keep, dropout_p=p)
    _assert_fp8_contract(out, lse, oracle, naive)


def test_fp8_attn_probs_are_the_softmax_of_the_dequantized_inputs(gen):
    (q8, k8, v8), scales = _inputs(gen, "cpu", 2, 30, 50, 4, 2, 32, 32)
    out, lse, probs = fa.flash_attn_func(q8, k8, v8, causal=True, return_attn_probs=True, descale_q=scales[0],
                                         descale_k=scales[1], descale_v=scales[2])
    assert probs.shape == (2, 4, 30, 50)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 30), atol=1e-4)
    oracle, _ = _references((q8, k8, v8), scales, scale=32**-0.5, causal=True)
    vh = dequantize(v8, scales[2]).double().transpose(1, 2).repeat_interleave(2, dim=1)
    pv = (probs.double() @ vh).transpose(1, 2)
    assert_contract("P·V", pv, out, oracle[0], EPS_FP8)


def test_fp8_descale_forms_give_one_result(device, gen):
    """A float, a 0-d tensor, a one-element tensor, a (b, hk) tensor of equal elements (on the
    inputs' device or the CPU), and FlashAttention-3's later spelling ``q_descale``..."""
    if device == "cuda" and not _fp8_kernel(device):
        pytest.skip("the CUDA FP8 kernel needs sm_90a")
    b, hk = 2, 2
    (q8, k8, v8), (dq, dk, dv) = _inputs(gen, device, b, 40, 56, 4, hk, 64, 64)
    ref = fa.flash_attn_func(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    forms = [
        dict(descale_q=float(dq), descale_k=float(dk), descale_v=float(dv)),
        dict(descale_q=dq.reshape(1), descale_k=dk.reshape(1, 1), descale_v=dv.cpu()),
        dict(descale_q=dq.expand(b, hk).clone(), descale_k=dk.expand(b, hk), descale_v=dv.expand(b, hk).cpu()),
        dict(q_descale=dq.expand(b, hk), k_descale=dk, v_descale=float(dv)),
    ]
    for kwargs in forms:
        assert torch.equal(fa.flash_attn_func(q8, k8, v8, causal=True, **kwargs), ref), kwargs
    # Positional, after FlashAttention 2.x's arguments.
    args = (0.0, None, True, (-1, -1), 0.0, None, False, False, dq, dk, dv)
    assert torch.equal(fa.flash_attn_func(q8, k8, v8, *args), ref)


def test_fp8_without_descale_takes_the_e4m3_values_as_they_are(gen):
    (q8, k8, v8), _ = _inputs(gen, "cpu", 1, 20, 30, 2, 1, 32, 32)
    out = fa.flash_attn_func(q8, k8, v8)
    ones = torch.tensor(1.0)
    assert torch.equal(out, fa.flash_attn_func(q8, k8, v8, descale_q=ones, descale_k=1.0, descale_v=ones))


def test_descale_that_is_not_per_tensor_is_refused(gen):
    (q8, k8, v8), (dq, dk, dv) = _inputs(gen, "cpu", 2, 16, 16, 4, 2, 32, 32)
    per_head = dk * torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="per-tensor"):
        fa.flash_attn_func(q8, k8, v8, descale_q=dq, descale_k=per_head, descale_v=dv)
    with pytest.raises(ValueError, match="per-tensor"):  # (b, hq), not (b, hk)
        fa.flash_attn_func(q8, k8, v8, descale_q=dq.expand(2, 4), descale_k=dk, descale_v=dv)
    with pytest.raises(ValueError, match="per-tensor"):
        fa.flash_attn_func(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv.expand(3))


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_descale_must_be_positive_and_finite(value, gen):
    (q8, k8, v8), (dq, dk, dv) = _inputs(gen, "cpu", 1, 16, 16, 2, 2, 32, 32)
    with pytest.raises(ValueError, match="descale"):
        fa.flash_attn_func(q8, k8, v8, descale_q=dq, descale_k=value, descale_v=dv)
    with pytest.raises(ValueError, match="descale"):
        fa.flash_attn_func(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=torch.full((1, 2), value))


def test_bad_descale_arguments(gen):
    (q8, k8, v8), (dq, dk, dv) = _inputs(gen, "cpu", 1, 16, 16, 2, 2, 32, 32)
    with pytest.raises(TypeError, match="descale_q"):
        fa.flash_attn_func(q8, k8, v8, descale_q="0.5")
    with pytest.raises(TypeError, match="not both"):
        fa.flash_attn_func(q8, k8, v8, descale_q=dq, q_descale=dq)
    with pytest.raises(ValueError, match="floating-point"):
        fa.flash_attn_func(q8, k8, v8, descale_q=torch.tensor(1))


def test_descale_with_inputs_that_are_not_fp8_is_refused():
    q = torch.randn(1, 16, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs only"):
        fa.flash_attn_func(q, q, q, descale_q=0.5)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_mixed_dtypes_are_refused(which, gen):
    (q8, k8, v8), _ = _inputs(gen, "cpu", 1, 16, 16, 2, 2, 32, 32)
    args = {"q": q8, "k": k8, "v": v8}
    args[which] = args[which].to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        fa.flash_attn_func(args["q"], args["k"], args["v"])


def test_other_fp8_formats_are_refused(gen):
    q = torch.randn(1, 16, 2, 32, generator=gen).to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fa.flash_attn_func(q, q, q)


def test_fp8_is_not_in_the_other_calls(gen):
    (q8, k8, v8), _ = _inputs(gen, "cpu", 1, 1, 16, 2, 2, 32, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fa.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fa.fwd(q8, k8, v8)


def test_fp8_output_requires_grad_when_an_input_does_and_its_backward_raises(gen):
    """As FlashAttention-3: the forward runs, the backward is refused."""
    (q8, k8, v8), scales = _inputs(gen, "cpu", 1, 16, 16, 2, 2, 32, 32)
    q8.requires_grad_()
    out = fa.flash_attn_func(q8, k8, v8, descale_q=scales[0])
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not fa.flash_attn_func(q8, k8, v8, descale_q=scales[0]).requires_grad
    # Quantized inside an autograd graph: the same.
    x = torch.randn(1, 16, 2, 32, generator=gen, requires_grad=True)
    out = fa.flash_attn_func(x.to(FP8), k8, v8)
    with pytest.raises(NotImplementedError, match="no backward"):
        out.float().sum().backward()


def test_fp8_varlen_on_cuda_is_unsupported(device, gen):
    if device != "cuda":
        pytest.skip("a CUDA refusal")
    q8 = quantize(torch.randn(30, 2, 64, generator=gen))[0].to(device)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=device)
    with pytest.raises(NotImplementedError, match="varlen|sm_90a"):
        fa.flash_attn_varlen_func(q8, q8, q8, cu, cu, 20, 20, descale_q=0.5)


@pytest.mark.parametrize("option", ["dropout_p", "softcap", "alibi_slopes", "head_dim"])
def test_fp8_options_the_cuda_kernel_lacks_are_refused(device, option, gen):
    if device != "cuda":
        pytest.skip("a CUDA refusal")
    d = 40 if option == "head_dim" else 64
    (q8, k8, v8), scales = _inputs(gen, device, 1, 32, 32, 2, 2, d, d)
    kwargs = {"dropout_p": {"dropout_p": 0.1}, "softcap": {"softcap": 5.0},
              "alibi_slopes": {"alibi_slopes": torch.ones(2, device=device)}, "head_dim": {}}[option]
    with pytest.raises(NotImplementedError):
        fa.flash_attn_func(q8, k8, v8, descale_q=scales[0], **kwargs)


def test_cuda_fp8_strided_inputs_give_the_contiguous_result(device, gen):
    if not _fp8_kernel(device):
        pytest.skip("needs the CUDA FP8 kernel (sm_90a)")
    b, s, h, d = 2, 64, 4, 64
    # [b, h, s, d] storage seen as [b, s, h, d] (strides in 16-byte multiples: taken as they are).
    x8 = [quantize(torch.randn(b, h, s, d, generator=gen))[0].to(device) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in x8)
    assert not q.is_contiguous()
    out = fa.flash_attn_func(q, k, v, causal=True, descale_q=0.01, descale_k=0.02, descale_v=0.03)
    ref = fa.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, descale_q=0.01,
                             descale_k=0.02, descale_v=0.03)
    assert torch.equal(out, ref)
    # A last dimension with stride 2 is copied to a contiguous layout.
    wide = quantize(torch.randn(b, s, h, 2 * d, generator=gen))[0].to(device)
    out = fa.flash_attn_func(wide[..., ::2], k, v)
    assert torch.equal(out, fa.flash_attn_func(wide[..., ::2].contiguous(), k, v))


def test_opcheck_fwd_fp8(gen):
    (q8, k8, v8), (dq, dk, dv) = _inputs(gen, "cpu", 2, 24, 30, 4, 2, 32, 32)
    args = (q8, k8, v8, dq, dk.expand(2, 2), None, None, None, None, 0.2, True, -1, -1, 0.0, 0.0, None)
    # test_schema is left out: its checker multiplies the inputs, which torch cannot do in float8.
    torch.library.opcheck(
        fwd_fp8_op, args,
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_fp8(device, backend, gen):
    """torch.compile(fullgraph=True) through flash_attn_func on FP8 inputs: descale tensors,
    floats, and the quantization itself inside the graph; the result equals eager mode's. With an
    input that requires grad the compiled forward runs and its backward raises, as in eager mode."""
    if device == "cuda" and not _fp8_kernel(device):
        pytest.skip("the CUDA FP8 kernel needs sm_90a")
    (q8, k8, v8), (dq, dk, dv) = _inputs(gen, device, 2, 40, 48, 4, 2, 32, 32)

    def given(q8, k8, v8, dq, dk, dv):
        return fa.flash_attn_func(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)

    def floats(q8, k8, v8):
        return fa.flash_attn_func(q8, k8, v8, descale_q=0.01, descale_k=0.02, descale_v=0.5)

    def quantized_inside(q, k, v):
        (q8, dq), (k8, dk), (v8, dv) = quantize(q), quantize(k), quantize(v)
        out = fa.flash_attn_func(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
        return out.float() * 2

    def same(a, b, exact):
        # The compiled quantization may round an element differently from eager mode's (a
        # division fused into a multiply by the reciprocal), which moves the output a little.
        return a.dtype == b.dtype and (torch.equal(a, b) if exact else torch.allclose(a, b, atol=2e-2, rtol=2e-2))

    x = [dequantize(t, s) for t, s in zip((q8, k8, v8), (dq, dk, dv))]
    for f, args in ((given, (q8, k8, v8, dq, dk, dv)), (floats, (q8, k8, v8)), (quantized_inside, x)):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend=backend)
        assert same(compiled(*args), f(*args), exact=f is not quantized_inside), f.__name__
    torch._dynamo.reset()
    leaf = x[0].clone().requires_grad_()
    out = torch.compile(quantized_inside, fullgraph=True, backend=backend)(leaf, x[1], x[2])
    assert out.requires_grad and same(out.detach(), quantized_inside(*x), exact=False)
    with pytest.raises(NotImplementedError, match="no backward"):
        out.sum().backward()
