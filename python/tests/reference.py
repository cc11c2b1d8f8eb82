"""Algorithm 0 in torch, for the tests: the float64 oracle and the naive in-dtype reference of the
numerics contract (DESIGN §2):

    max|ours - oracle_f64| <= 2 * max|naive_T - oracle_f64| + eps_T * max(1, magnitude)

``eps_T``: outputs f32 2^-18, f16 4 * 2^-10, bf16 4 * 2^-7; gradients f32 2^-16, the half types
twice the output floor.

FP8 inputs (docs/semantics.md, "FP8 inputs"): the oracle and ``naive_fp8`` (``attention(...,
fp8=True)``) both run on the dequantized inputs, and the contract is the same inequality with
``eps_bf16`` (the output is bf16), for ``out`` and ``lse``.
"""

from __future__ import annotations

import math

import torch

EPS_OUT = {torch.float32: 2.0**-18, torch.float16: 4 * 2.0**-10, torch.bfloat16: 4 * 2.0**-7}
EPS_GRAD = {torch.float32: 2.0**-16, torch.float16: 8 * 2.0**-10, torch.bfloat16: 8 * 2.0**-7}
EPS_FP8 = EPS_OUT[torch.bfloat16]


def attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, alibi=None, keep=None, dropout_p=0.0,
              cu_seqlens_q=None, cu_seqlens_k=None, compute_dtype=None, fp8=False):
    """``out`` and ``lse`` of attention over ``q [b, sq, hq, d]`` (or varlen ``[tq, hq, d]``),
    computed in ``compute_dtype`` (default: the inputs'), with softmax in at least float32.
    ``keep``: bool ``[b, hq, sq, sk]`` (varlen: per-sequence positions, padded) of kept
    elements. Differentiable.

    ``fp8``: ``naive_fp8``, Algorithm 0 as an FP8 tensor-core kernel computes it, on float32
    (dequantized) inputs: scores in float32; the row sum taken from the unrounded
    ``exp(s - max)``; those unnormalised probabilities rounded to e4m3 (``float8_e4m3fn``) for
    ``P·V``, accumulated in float32, divided by the sum; ``out`` rounded to bfloat16."""
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs, lses = [], []
        for i in range(len(cq) - 1):
            o, l = attention(
                q[cq[i]:cq[i + 1]][None], k[ck[i]:ck[i + 1]][None], v[ck[i]:ck[i + 1]][None], scale=scale,
                causal=causal, window=window, softcap=softcap,
                alibi=None if alibi is None else (alibi if alibi.dim() == 1 else alibi[i:i + 1]),
                keep=None if keep is None else keep[i:i + 1, :, :cq[i + 1] - cq[i], :ck[i + 1] - ck[i]],
                dropout_p=dropout_p, compute_dtype=compute_dtype, fp8=fp8,
            )
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)
    dt = compute_dtype or q.dtype
    soft_dt = torch.float64 if dt == torch.float64 else torch.float32
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qh = q.to(dt).transpose(1, 2)
    kh = k.to(dt).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vh = v.to(dt).transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = (qh @ kh.transpose(-1, -2)).to(soft_dt) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    col = torch.arange(sk, device=q.device)[None, :]
    if alibi is not None:
        slopes = alibi.to(soft_dt)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * (row - col).abs().to(soft_dt)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= col <= row
    if window[0] >= 0:
        visible &= col >= row - window[0]
    if window[1] >= 0:
        visible &= col <= row + window[1]
    s = s.masked_fill(~visible, -math.inf)
    if fp8:
        # Rows that see no key: max 0 (not -inf), so exp gives 0, the sum 0 and lse -inf.
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = row_max.masked_fill(torch.isneginf(row_max), 0.0)
        p = torch.exp(s - row_max)
        row_sum = p.sum(dim=-1, keepdim=True)
        lse = (row_max + row_sum.log()).squeeze(-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None]).nan_to_num(nan=0.0)
    if keep is not None:
        p = p * keep.to(soft_dt) / (1.0 - dropout_p)
    if fp8:
        pv = p.to(torch.float8_e4m3fn).to(soft_dt) @ vh.to(soft_dt)
        out = torch.where(row_sum > 0, pv / row_sum, 0.0).to(torch.bfloat16).transpose(1, 2)
        return out, lse
    out = (p.to(dt) @ vh).transpose(1, 2)
    return out, lse


def bound(ours, naive, oracle, eps):
    """The contract's right-hand side, and the left: ``(max|ours - oracle|, bound)``."""
    oracle = oracle.double()
    finite = torch.isfinite(oracle)
    err = (ours.double() - oracle)[finite].abs().max().item() if finite.any() else 0.0
    naive_err = (naive.double() - oracle)[finite].abs().max().item() if finite.any() else 0.0
    magnitude = oracle[finite].abs().max().item() if finite.any() else 0.0
    return err, 2 * naive_err + eps * max(1.0, magnitude)


def assert_contract(name, ours, naive, oracle, eps):
    err, limit = bound(ours, naive, oracle, eps)
    assert err <= limit, f"{name}: max error {err:.3e} exceeds the contract's {limit:.3e}"
    # -inf lse (rows that see no key) must match exactly.
    inf = ~torch.isfinite(oracle.double())
    if inf.any():
        assert torch.equal(ours.double()[inf], oracle.double()[inf]), f"{name}: non-finite entries differ"
