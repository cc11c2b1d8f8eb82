"""FlashAttention 2.x's public functions, same names, arguments, defaults and return values.

``import flash_attn_rs as flash_attn`` (or ``from flash_attn_rs import flash_attn_func``) is
enough for code written against ``flash_attn``. Differences, all documented in the README's API
table:

- CPU tensors work (float32, float16, bfloat16), forward and backward; CUDA tensors take float16
  and bfloat16.
- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` with ``S_dmask`` computed
  on a slow reference path (torch ops, float32, ``[b, hq, sq, sk]`` without FlashAttention's
  rounding to 128; dropped elements negated as FlashAttention does). It is for tests; it
  materialises the score matrix.
- The dropout ``(seed, offset)`` comes from torch's default CPU generator, so
  ``torch.manual_seed`` makes runs reproducible on both devices.
- ``flash_attn_func`` and ``flash_attn_varlen_func`` also take FlashAttention-3's FP8 forward:
  ``float8_e4m3fn`` inputs with per-tensor ``descale_q/k/v`` (FlashAttention-3's
  ``(batch, num_heads_k)`` tensors are accepted when all their elements are equal), ``bfloat16``
  output, no backward (see :func:`flash_attn_func`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ._ops import FP8, dropout_keep_mask, fwd_fp8_op, fwd_op, kvcache_op

_DESCALE_NAMES = ("descale_q", "descale_k", "descale_v")


def _scale(q: Tensor, softmax_scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _window(window_size) -> Tuple[int, int]:
    if window_size is None:
        return -1, -1
    left, right = window_size
    return int(left), int(right)


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")


def _descales(given, aliases) -> Tuple[Optional[Tensor], ...]:
    """``descale_q/k/v`` as the FP8 op takes them: ``None`` or a tensor (a Python number becomes
    a 0-d float32 tensor). ``aliases`` are FlashAttention-3's later spelling, ``q_descale``..."""
    out = []
    for name, x, alias in zip(_DESCALE_NAMES, given, aliases):
        if x is not None and alias is not None:
            raise TypeError(f"give `{name}` or its alias `{name[-1]}_descale`, not both")
        x = alias if x is None else x
        if x is not None and not isinstance(x, Tensor):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise TypeError(f"`{name}` must be a float or a tensor, got {type(x).__name__}")
            x = torch.tensor(float(x), dtype=torch.float32)
        out.append(x)
    return tuple(out)


def _dequantized(t: Tensor, descale: Optional[Tensor]) -> Tensor:
    """The real values of an FP8 tensor, float32 (for the probabilities of ``return_attn_probs``)."""
    x = t.float()
    return x if descale is None else x * descale.detach().reshape(-1)[0].to(x.device, torch.float32)


def _attention(q, k, v, cu_q, cu_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, max_seqlen_q=None, max_seqlen_k=None, descale=(None, None, None)):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    scale = _scale(q, softmax_scale)
    left, right = _window(window_size)
    fp8 = any(t.dtype == FP8 for t in (q, k, v))
    if fp8:
        if not all(t.dtype == FP8 for t in (q, k, v)):
            raise ValueError(
                f"the FP8 forward takes q, k and v all in float8_e4m3fn, got {q.dtype}, {k.dtype} and {v.dtype}: "
                f"all inputs must share one dtype"
            )
        out, lse, rng_state = fwd_fp8_op(
            q, k, v, *descale, alibi_slopes, cu_q, cu_k, scale, bool(causal), left, right, float(softcap or 0.0),
            float(dropout_p), None,
        )
    else:
        if any(d is not None for d in descale):
            raise ValueError(f"descale_q/k/v apply to float8_e4m3fn inputs only, got {q.dtype} inputs")
        out, lse, rng_state = fwd_op(
            q, k, v, alibi_slopes, cu_q, cu_k, scale, bool(causal), left, right, float(softcap or 0.0),
            float(dropout_p), bool(deterministic), None,
        )
    if not return_attn_probs:
        return out
    if fp8:
        q, k = _dequantized(q, descale[0]), _dequantized(k, descale[1])
    probs = attn_probs(
        q, k, lse, rng_state, scale=scale, causal=causal, window_size=(left, right), softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    return out, lse, probs


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, descale_q=None, descale_k=None,
                    descale_v=None, *, q_descale=None, k_descale=None, v_descale=None):
    """Attention over ``q [b, sq, hq, d]``, ``k [b, sk, hk, d]``, ``v [b, sk, hk, dv]``
    (``hq`` a multiple of ``hk``: GQA/MQA); returns ``out [b, sq, hq, dv]``.

    ``causal`` is aligned to the bottom-right corner (FlashAttention ≥ 2.1); ``window_size =
    (left, right)`` a sliding window (``-1`` unbounded); ``softcap > 0`` caps scores with
    ``softcap · tanh(s / softcap)``; ``alibi_slopes`` (float32 ``[hq]`` or ``[b, hq]``) adds
    ``-slope · |i + sk - sq - j|``. With ``return_attn_probs``, returns ``(out, softmax_lse
    [b, hq, sq], S_dmask)``.

    FP8 (FlashAttention-3's forward): ``q``, ``k``, ``v`` all ``torch.float8_e4m3fn``, with
    ``descale_q/k/v`` (also spelled ``q_descale``... as in later FlashAttention-3) the factor
    each tensor's e4m3 values are multiplied by: a float, a one-element tensor, or a ``(b, hk)``
    tensor whose elements are all equal (per-tensor factors only; ``None``: 1). ``out`` is
    ``bfloat16``; ``softmax_scale`` applies to the dequantized scores. Forward only: the output
    requires grad when an input does, and its backward raises ``NotImplementedError``. CUDA
    tensors need an sm_90a GPU (H100/H200), fixed-length batches, no dropout, softcap or ALiBi,
    ``d == dv`` a multiple of 16 up to 256 (else ``NotImplementedError``); the CPU takes every
    option. Descale tensors are read on the host (a synchronisation for CUDA tensors).
    """
    descale = _descales((descale_q, descale_k, descale_v), (q_descale, k_descale, v_descale))
    return _attention(q, k, v, None, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, descale=descale)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on ``qkv [b, s, 3, h, d]`` (read in place, no copy)."""
    _check_tensor("qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"`qkv` must be [b, s, 3, h, d], got shape {list(qkv.shape)}")
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], None, None, dropout_p, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on ``q [b, sq, hq, d]`` and ``kv [b, sk, 2, hk, d]``."""
    _check_tensor("kv", kv)
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"`kv` must be [b, sk, 2, hk, d], got shape {list(kv.shape)}")
    return _attention(q, kv[:, :, 0], kv[:, :, 1], None, None, dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, descale_q=None,
                           descale_k=None, descale_v=None, *, q_descale=None, k_descale=None, v_descale=None):
    """Attention over a packed batch: ``q [total_q, hq, d]``, ``k/v [total_k, hk, d|dv]``;
    sequence ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q`` (int32 ``[b + 1]``).
    Returns ``out [total_q, hq, dv]`` (with ``return_attn_probs``: ``softmax_lse [hq,
    total_q]``). ``max_seqlen_*`` are accepted for compatibility (the lengths come from
    ``cu_seqlens``); ``block_table`` (a paged cache) is not supported here: use
    :func:`flash_attn_with_kvcache`.

    FP8 inputs and ``descale_q/k/v`` as in :func:`flash_attn_func` (a ``(b, hk)`` descale has
    ``b = len(cu_seqlens_q) - 1``); the CPU runs them, the CUDA FP8 kernel takes fixed-length
    batches only (``NotImplementedError``).
    """
    if block_table is not None:
        raise NotImplementedError(
            "flash_attn_varlen_func with block_table is not supported; use flash_attn_with_kvcache for a paged cache"
        )
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, t)
    descale = _descales((descale_q, descale_k, descale_v), (q_descale, k_descale, v_descale))
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, max_seqlen_q, max_seqlen_k, descale)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on ``qkv [total, 3, h, d]``."""
    _check_tensor("qkv", qkv)
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"`qkv` must be [total, 3, h, d], got shape {list(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on ``q [total_q, hq, d]`` and ``kv [total_k, 2, hk, d]``."""
    _check_tensor("kv", kv)
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"`kv` must be [total_k, 2, hk, d], got shape {list(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False):
    """Inference over a KV cache, FlashAttention's ``flash_attn_with_kvcache``.

    ``q [b, sq, hq, d]``; the cache is contiguous ``[b_cache, s_cache, hk, d|dv]`` (rows chosen
    by ``cache_batch_idx``) or paged ``[num_pages, page_size, hk, d|dv]`` with ``block_table
    [b, max_pages]`` (int32; any page size). ``k``/``v [b, sn, hk, d|dv]``, when given, are
    rotated (``rotary_cos/sin [max_pos, rd / 2]``) and written into the caches **in place** at
    ``cache_seqlens`` before attending. ``cache_seqlens`` is an int or int32 ``[b]`` (``None``:
    the whole contiguous cache). Returns ``out`` or ``(out, softmax_lse)``. No autograd (an
    inference op). CUDA tensors: float16/bfloat16, ``d == dv`` a multiple of 8 up to 256; the
    index tensors are read on the host (a copy for CUDA tensors).
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
    b = q.shape[0]
    if cache_seqlens is None:
        if block_table is not None:
            raise ValueError("a paged cache needs `cache_seqlens`")
        cache_seqlens = k_cache.shape[1]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32)
    left, right = _window(window_size)
    out, lse = kvcache_op(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, alibi_slopes, _scale(q, softmax_scale), bool(causal), left, right, float(softcap or 0.0),
        bool(rotary_interleaved), int(num_splits),
    )
    return (out, lse) if return_softmax_lse else out


def attn_probs(q, k, softmax_lse, rng_state=None, *, scale, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None) -> Tensor:
    """The attention probabilities of a call, on a slow reference path (torch, float32):
    ``[b, hq, sq, sk]`` (varlen: ``[b, hq, max_sq, max_sk]``, zero past each sequence), computed
    from the call's ``softmax_lse`` so they are the ones its kernels used; with dropout, the
    elements the keep mask drops are negated (FlashAttention's ``S_dmask`` convention).
    """
    with torch.no_grad():
        if cu_seqlens_q is None:
            seqs = [(q[i], k[i], softmax_lse[i]) for i in range(q.shape[0])]
        else:
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            seqs = [(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], softmax_lse[:, cq[i]:cq[i + 1]])
                    for i in range(len(cq) - 1)]
        b, hq = len(seqs), q.shape[-2]
        msq = max([s[0].shape[0] for s in seqs], default=0)
        msk = max([s[1].shape[0] for s in seqs], default=0)
        probs = torch.zeros([b, hq, msq, msk], dtype=torch.float32, device=q.device)
        keep = None
        if dropout_p > 0:
            keep = dropout_keep_mask(dropout_p, rng_state, b, hq, msq, msk).to(q.device)
        left, right = _window(window_size)
        for i, (qi, ki, lse) in enumerate(seqs):
            sq, sk = qi.shape[0], ki.shape[0]
            kf = ki.float().repeat_interleave(hq // ki.shape[1], dim=1)
            s = torch.einsum("ihd,jhd->hij", qi.float(), kf) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            row = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            col = torch.arange(sk, device=q.device)[None, :]
            if alibi_slopes is not None:
                slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
                s = s - slopes.float().to(q.device)[:, None, None] * (row - col).abs()
            visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if causal:
                visible &= col <= row
            if left >= 0:
                visible &= col >= row - left
            if right >= 0:
                visible &= col <= row + right
            s = s.masked_fill(~visible, -math.inf)
            p = torch.exp(s - lse[:, :, None].float())
            p = torch.nan_to_num(p, nan=0.0)  # rows that see no key (lse = -inf)
            if keep is not None:
                p = torch.where(keep[i, :, :sq, :sk], p, -p)
            probs[i, :, :sq, :sk] = p
        return probs
