"""The torch custom ops: ``flash_attn_rs::fwd``, ``flash_attn_rs::fwd_fp8``, ``flash_attn_rs::bwd``,
``flash_attn_rs::kvcache``.

Each op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces through
it, and ``fwd`` has an autograd formula that calls ``bwd``; ``fwd_fp8`` has none (its backward
raises, as FlashAttention-3 has no FP8 backward). The real implementations allocate
every output with torch (on the inputs' device, through torch's caching allocator), hand the
native module data pointers and strides (no copies), and launch on
``torch.cuda.current_stream()`` for CUDA tensors.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _native

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# FlashAttention-3's FP8 format (the forward only).
FP8 = torch.float8_e4m3fn


def _dtype_name(t: Tensor) -> str:
    name = _DTYPES.get(t.dtype)
    if name is None:
        raise ValueError(
            f"flash_attn_rs takes float32, float16 or bfloat16 tensors (and float8_e4m3fn for the forward of "
            f"flash_attn_func / flash_attn_varlen_func), got {t.dtype}"
        )
    return name


def _device_index(t: Tensor) -> int:
    if t.device.type == "cpu":
        return -1
    if t.device.type == "cuda":
        return t.device.index if t.device.index is not None else torch.cuda.current_device()
    raise ValueError(f"flash_attn_rs runs on CPU and CUDA tensors, got a tensor on {t.device}")


def _stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device >= 0 else 0


def _view(t: Tensor):
    return (t.data_ptr(), list(t.shape), list(t.stride()))


def _kernel_layout(t: Tensor, cuda: bool) -> Tensor:
    """``t`` itself where the kernels take its strides, else a contiguous copy: the last stride
    must be 1, and on CUDA every other stride a multiple of 16 bytes (16-byte loads: 8 elements
    of float16, 16 of float8)."""
    if t.dim() == 0:
        return t
    ok = t.stride(-1) == 1 or t.shape[-1] <= 1
    if ok and cuda:
        align = 16 // t.element_size()
        ok = all(s % align == 0 or n <= 1 for s, n in zip(t.stride()[:-1], t.shape[:-1])) and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def _check_same(name: str, t: Tensor, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"`{name}` has dtype {t.dtype} but `q` has {ref.dtype}: all inputs must share one dtype")
    if t.device != ref.device:
        raise ValueError(f"`{name}` is on {t.device} but `q` is on {ref.device}")


def _host_i32(name: str, t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None:
        return None
    if t.dtype != torch.int32:
        raise ValueError(f"`{name}` must be an int32 tensor, got {t.dtype}")
    return t.detach().to("cpu").contiguous()


def _host_alibi(t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None:
        return None
    if t.dtype != torch.float32:
        raise ValueError(f"`alibi_slopes` must be a float32 tensor, got {t.dtype}")
    return t.detach().to("cpu").contiguous()


def _opts(softmax_scale, causal, window_left, window_right, softcap, alibi, cu_q, cu_k, dropout, deterministic):
    return {
        "scale": float(softmax_scale),
        "causal": bool(causal),
        "window": (int(window_left), int(window_right)),
        "softcap": float(softcap),
        "alibi": None if alibi is None else _view(alibi),
        "cu_seqlens": None if cu_q is None else (_view(cu_q), _view(cu_k)),
        "dropout": dropout,
        "deterministic": bool(deterministic),
    }


def _out_shapes(q: Tensor, v: Tensor, varlen: bool) -> Tuple[List[int], List[int]]:
    if varlen:
        if q.dim() != 3:
            raise ValueError(f"varlen `q` must be [total_q, hq, d], got shape {list(q.shape)}")
        return [q.shape[0], q.shape[1], v.shape[-1]], [q.shape[1], q.shape[0]]
    if q.dim() != 4:
        raise ValueError(f"`q` must be [b, sq, hq, d], got shape {list(q.shape)}")
    return [q.shape[0], q.shape[1], q.shape[2], v.shape[-1]], [q.shape[0], q.shape[2], q.shape[1]]


def draw_rng_state() -> Tensor:
    """A fresh dropout ``(seed, offset)`` from torch's default CPU generator, so that
    ``torch.manual_seed`` makes dropout reproducible. The offset is 32 bits (the kernels' Philox
    counter word)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64) % torch.tensor([2**62, 2**32])


def _forward_buffers(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left,
                     window_right, softcap, dropout_p, deterministic, rng_state, out_dtype):
    """What a forward call hands the native module: ``(device, [q, k, v, out, lse], rng_state,
    opts, keep)`` with the inputs in the kernels' layout and ``out`` (``out_dtype``) and ``lse``
    fresh. ``opts`` holds raw views of host copies (ALiBi slopes, ``cu_seqlens``) that ``keep``
    owns: the caller holds ``keep`` until the native call returns (a copy made here would
    otherwise be freed at return, leaving ``opts`` pointing at freed memory)."""
    for name, t in (("k", k), ("v", v)):
        _check_same(name, t, q)
    device = _device_index(q)
    cuda = device >= 0
    q, k, v = (_kernel_layout(t, cuda) for t in (q, k, v))
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("`cu_seqlens_q` and `cu_seqlens_k` come together")
    cu_q, cu_k = _host_i32("cu_seqlens_q", cu_seqlens_q), _host_i32("cu_seqlens_k", cu_seqlens_k)
    alibi = _host_alibi(alibi_slopes)
    out_shape, lse_shape = _out_shapes(q, v, varlen)
    out = torch.empty(out_shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if rng_state is None:
        rng_state = draw_rng_state() if dropout_p > 0 else torch.zeros(2, dtype=torch.int64)
    rng_state = rng_state.detach().to("cpu", torch.int64).clone()
    seed, offset = (int(x) for x in rng_state.tolist())
    dropout = (float(dropout_p), seed, offset) if dropout_p > 0 else None
    opts = _opts(softmax_scale, causal, window_left, window_right, softcap, alibi, cu_q, cu_k, dropout, deterministic)
    return device, [q, k, v, out, lse], rng_state, opts, (alibi, cu_q, cu_k)


@torch.library.custom_op("flash_attn_rs::fwd", mutates_args=(), device_types=("cpu", "cuda"))
def fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    rng_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(out, softmax_lse, rng_state)``; ``rng_state`` (int64 ``[2]``, CPU) is the
    dropout ``(seed, offset)`` used, drawn from torch's generator when not given."""
    dtype = _dtype_name(q)
    device, tensors, rng_state, opts, keep = _forward_buffers(
        q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
        dropout_p, deterministic, rng_state, q.dtype,
    )
    _native.fwd(dtype, device, _stream(device), *(_view(t) for t in tensors), opts)
    del keep  # the host copies `opts` pointed at lived until here
    out, lse = tensors[3], tensors[4]
    return out, lse, rng_state


@fwd_op.register_fake
def _(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
      softcap, dropout_p, deterministic, rng_state):
    out_shape, lse_shape = _out_shapes(q, v, cu_seqlens_q is not None)
    return (
        q.new_empty(out_shape),
        q.new_empty(lse_shape, dtype=torch.float32),
        torch.empty(2, dtype=torch.int64, device="cpu"),
    )


def _descale_shape_ok(t: Tensor, batch: int, hk: int) -> bool:
    return t.numel() == 1 or list(t.shape) == [batch, hk]


def _check_descale(name: str, t: Optional[Tensor], batch: int, hk: int) -> None:
    """Refuses a descale tensor that cannot be per-tensor by its shape or dtype alone (what is
    known while tracing): it must be floating point, one element or ``(batch, hk)``."""
    if t is None:
        return
    if not t.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got {t.dtype}")
    if not _descale_shape_ok(t, batch, hk):
        raise ValueError(
            f"`{name}` must be per-tensor: a float, a one-element tensor or a ({batch}, {hk}) (batch, num_heads_k) "
            f"tensor whose elements are all equal; got shape {list(t.shape)} (flash_attn_rs supports per-tensor "
            f"descale factors only)"
        )


def _descale_value(name: str, t: Optional[Tensor], batch: int, hk: int) -> float:
    """The one factor of a per-tensor descale tensor (1 for ``None``); a ``(batch, hk)`` tensor
    must hold one value. Reading a CUDA tensor waits for the value (a host synchronisation)."""
    _check_descale(name, t, batch, hk)
    if t is None:
        return 1.0
    flat = t.detach().to("cpu", torch.float32).reshape(-1)
    first = flat[0]
    same = (flat == first) | (flat.isnan() & first.isnan())
    if not bool(same.all()):
        raise ValueError(
            f"`{name}` has {flat.numel()} different descale factors; flash_attn_rs supports per-tensor descale "
            f"factors only (one value for every batch element and key/value head)"
        )
    return float(first)


def _batch(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1


def _kv_heads(k: Tensor) -> int:
    return k.shape[-2] if k.dim() > 1 else 0


@torch.library.custom_op("flash_attn_rs::fwd_fp8", mutates_args=(), device_types=("cpu", "cuda"))
def fwd_fp8_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    descale_q: Optional[Tensor],
    descale_k: Optional[Tensor],
    descale_v: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    rng_state: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """FP8 forward: ``q``, ``k``, ``v`` in ``float8_e4m3fn``, each with a per-tensor descale
    factor (``None``: 1; the real value of an element is its e4m3 value times the factor).
    Returns ``(out, softmax_lse, rng_state)`` with ``out`` in ``bfloat16``. Forward only."""
    if q.dtype != FP8:
        raise ValueError(f"the FP8 forward takes float8_e4m3fn inputs, got `q` of {q.dtype}")
    batch, hk = _batch(q, cu_seqlens_q), _kv_heads(k)
    scales = tuple(
        _descale_value(name, t, batch, hk)
        for name, t in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v))
    )
    device, tensors, rng_state, opts, keep = _forward_buffers(
        q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right, softcap,
        dropout_p, False, rng_state, torch.bfloat16,
    )
    _native.fwd_fp8(device, _stream(device), *(_view(t) for t in tensors), scales, opts)
    del keep  # the host copies `opts` pointed at lived until here
    out, lse = tensors[3], tensors[4]
    return out, lse, rng_state


@fwd_fp8_op.register_fake
def _(q, k, v, descale_q, descale_k, descale_v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
      window_left, window_right, softcap, dropout_p, rng_state):
    batch, hk = _batch(q, cu_seqlens_q), _kv_heads(k)
    for name, t in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v)):
        _check_descale(name, t, batch, hk)
    out_shape, lse_shape = _out_shapes(q, v, cu_seqlens_q is not None)
    return (
        q.new_empty(out_shape, dtype=torch.bfloat16),
        q.new_empty(lse_shape, dtype=torch.float32),
        torch.empty(2, dtype=torch.int64, device="cpu"),
    )


FP8_NO_BACKWARD = (
    "flash_attn_rs's FP8 forward has no backward (nor has FlashAttention-3's): run it under torch.no_grad() or "
    "torch.inference_mode(), or on inputs that do not require grad; train with float16/bfloat16 inputs"
)


@torch.library.custom_op("flash_attn_rs::fp8_no_backward", mutates_args=(), device_types=("cpu", "cuda"))
def fp8_no_backward_op(
    dout: Tensor, q_shape: List[int], k_shape: List[int], v_shape: List[int]
) -> Tuple[Tensor, Tensor, Tensor]:
    """``fwd_fp8``'s backward: raises ``NotImplementedError``. An op of its own, taking the
    output's gradient, so that the error comes when the backward runs, in eager mode and in a
    compiled graph alike (a Python ``raise`` in the autograd formula would fire while
    ``torch.compile`` traces the backward, failing the forward's compilation)."""
    raise NotImplementedError(FP8_NO_BACKWARD)


@fp8_no_backward_op.register_fake
def _(dout, q_shape, k_shape, v_shape):
    return tuple(dout.new_empty(shape, dtype=FP8) for shape in (q_shape, k_shape, v_shape))


_FP8_FWD_ARGS = 16


def _fp8_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.shapes = (list(q.shape), list(k.shape), list(v.shape))


def _fp8_backward(ctx, dout, dlse, drng):
    return fp8_no_backward_op(dout, *ctx.shapes) + (None,) * (_FP8_FWD_ARGS - 3)


fwd_fp8_op.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


@torch.library.custom_op("flash_attn_rs::bwd", mutates_args=(), device_types=("cpu", "cuda"))
def bwd_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    rng_state: Tensor,
    alibi_slopes: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv)`` by recomputation from ``softmax_lse``; with dropout, the keep
    mask is regenerated from ``rng_state``."""
    dtype = _dtype_name(q)
    for name, t in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        _check_same(name, t, q)
    if softmax_lse.dtype != torch.float32 or softmax_lse.device != q.device:
        raise ValueError("`softmax_lse` must be the float32 lse of the forward, on the inputs' device")
    device = _device_index(q)
    cuda = device >= 0
    q, k, v, out, dout = (_kernel_layout(t, cuda) for t in (q, k, v, out, dout))
    lse = softmax_lse.contiguous()
    cu_q, cu_k = _host_i32("cu_seqlens_q", cu_seqlens_q), _host_i32("cu_seqlens_k", cu_seqlens_k)
    alibi = _host_alibi(alibi_slopes)
    dq, dk, dv = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    ), torch.empty_like(v, memory_format=torch.contiguous_format)
    seed, offset = (int(x) for x in rng_state.detach().to("cpu").tolist())
    dropout = (float(dropout_p), seed, offset) if dropout_p > 0 else None
    opts = _opts(softmax_scale, causal, window_left, window_right, softcap, alibi, cu_q, cu_k, dropout, deterministic)
    views = [_view(t) for t in (q, k, v, out, lse, dout, dq, dk, dv)]
    workspace = None
    if cuda:
        # The kernels' scratch memory (the f32 dQ accumulator, D) from torch's caching allocator.
        size = _native.bwd_workspace_bytes(dtype, device, _view(q), _view(k), _view(v), opts)
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    _native.bwd(dtype, device, _stream(device), *views, opts, None if workspace is None else _view(workspace))
    return dq, dk, dv


@bwd_op.register_fake
def _(dout, q, k, v, out, softmax_lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k, softmax_scale,
      causal, window_left, window_right, softcap, dropout_p, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_FWD_ARGS = 14


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi, cu_q, cu_k, scale, causal, wl, wr, softcap, dropout_p, deterministic, _) = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi, cu_q, cu_k)
    ctx.options = (scale, causal, wl, wr, softcap, dropout_p, deterministic)


def _backward(ctx, dout, dlse, drng):
    q, k, v, out, lse, rng_state, alibi, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, rng_state, alibi, cu_q, cu_k, *ctx.options)
    return (dq, dk, dv) + (None,) * (_FWD_ARGS - 3)


fwd_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(
    "flash_attn_rs::kvcache", mutates_args=("k_cache", "v_cache"), device_types=("cpu", "cuda")
)
def kvcache_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    cache_seqlens: Tensor,
    cache_batch_idx: Optional[Tensor],
    cache_leftpad: Optional[Tensor],
    block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
) -> Tuple[Tensor, Tensor]:
    """Attention over a KV cache, appending ``k``/``v`` into the caches in place first:
    ``(out, softmax_lse)``."""
    dtype = _dtype_name(q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None:
            _check_same(name, t, q)
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t is not None:
            # FlashAttention takes the tables in the inputs' dtype, on their device.
            _check_same(name, t, q)
    device = _device_index(q)
    if (k is None) != (v is None):
        raise ValueError("`k` and `v` come together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("`rotary_cos` and `rotary_sin` come together")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() > 0 and t.stride(-1) != 1:
            raise ValueError(f"`{name}` is written in place, so its last dimension must be contiguous")
    q = _kernel_layout(q, device >= 0)
    k, v, rotary_cos, rotary_sin = (None if t is None else _kernel_layout(t, device >= 0) for t in (k, v, rotary_cos, rotary_sin))
    if q.dim() != 4:
        raise ValueError(f"`q` must be [b, sq, hq, d], got shape {list(q.shape)}")
    out = torch.empty([*q.shape[:3], v_cache.shape[-1]], dtype=q.dtype, device=q.device)
    lse = torch.empty([q.shape[0], q.shape[2], q.shape[1]], dtype=torch.float32, device=q.device)
    seqlens = _host_i32("cache_seqlens", cache_seqlens)
    batch_idx = _host_i32("cache_batch_idx", cache_batch_idx)
    leftpad = _host_i32("cache_leftpad", cache_leftpad)
    table = _host_i32("block_table", block_table)
    alibi = _host_alibi(alibi_slopes)
    cache = {
        "cache_seqlens": _view(seqlens),
        "batch_idx": None if batch_idx is None else _view(batch_idx),
        "block_table": None if table is None else _view(table),
        "leftpad": None if leftpad is None else _view(leftpad),
        "new_kv": None if k is None else (_view(k), _view(v)),
        "rotary": None if rotary_cos is None else (_view(rotary_cos), _view(rotary_sin), bool(rotary_interleaved)),
        "num_splits": int(num_splits),
    }
    opts = _opts(softmax_scale, causal, window_left, window_right, softcap, alibi, None, None, None, False)
    _native.kvcache_fwd(
        dtype, device, _stream(device), _view(q), _view(k_cache), _view(v_cache), _view(out), _view(lse), cache, opts
    )
    return out, lse


@kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
      block_table, alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
      num_splits):
    return (
        q.new_empty([*q.shape[:3], v_cache.shape[-1]]),
        q.new_empty([q.shape[0], q.shape[2], q.shape[1]], dtype=torch.float32),
    )


def dropout_keep_mask(p: float, rng_state: Tensor, b: int, hq: int, sq: int, sk: int) -> Tensor:
    """The keep mask (bool ``[b, hq, sq, sk]``) the kernels draw for dropout ``p`` and
    ``rng_state``, positions counted within each sequence."""
    seed, offset = (int(x) for x in rng_state.detach().to("cpu").tolist())
    keep = torch.empty([b, hq, sq, sk], dtype=torch.uint8)
    _native.dropout_keep(float(p), seed, offset, b, hq, sq, sk, _view(keep))
    return keep.bool()

