"""Ring / zigzag context parallelism on ``torch.distributed`` (DESIGN §8).

Each rank of a process group holds a chunk of every sequence; the key/value chunks travel around
the ring (``batch_isend_irecv`` to the next rank, from the previous one) while each rank attends
its queries to the chunk it holds with this package's kernels; partial results merge by their
log-sum-exp. The backward is FlashAttention's ring backward: ``dK``/``dV`` accumulators (float32)
travel with the chunks and come home, narrowed to the dtype, after the last step. With NCCL the
transfer of step ``t + 1`` runs on NCCL's stream while step ``t`` computes on the current one.

Layouts (the schedule is the library's, ``flash_attn::ring``):

- contiguous: rank ``r`` holds the ``r``-th of ``R`` equal chunks of each sequence
  (:func:`ring_split`). Causal work is unbalanced (the last rank does ``R`` times the first's).
- zigzag: each sequence in ``2R`` chunks, rank ``r`` holds chunks ``r`` and ``2R-1-r``
  (:func:`zigzag_split`): balanced causal work, every step after the first half a product.

Supported: self-attention (``q``, ``k``, ``v`` cover the same tokens), fixed length or varlen, GQA,
scale, softcap, causal or not; float16/bfloat16 on CUDA, also float32 on the CPU. Not supported
(``ValueError``): dropout, sliding windows, ALiBi — they need global positions.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._ops import bwd_op, fwd_op

__all__ = [
    "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "ring_split",
    "zigzag_split",
    "ring_split_varlen",
    "ring_gather",
    "schedule",
]

SKIP, FULL, DIAGONAL, KEYS_FIRST_HALF, QUERIES_SECOND_HALF = "skip", "full", "diagonal", "keys1", "queries2"


def schedule(zigzag: bool, causal: bool, ranks: int, rank: int, step: int) -> str:
    """What ``rank`` computes at ``step`` with the chunk of rank ``(rank - step) mod R`` (the same
    rule as ``flash_attn::ring::schedule``)."""
    source = (rank - step) % ranks
    if not causal:
        return FULL
    if source == rank:
        return DIAGONAL
    if source < rank:
        return KEYS_FIRST_HALF if zigzag else FULL
    return QUERIES_SECOND_HALF if zigzag else SKIP


def ring_split(x: Tensor, dim: int, world_size: int, rank: int) -> Tensor:
    """Rank ``rank``'s contiguous chunk of ``x`` along ``dim`` (the sequence dim)."""
    if x.shape[dim] % world_size:
        raise ValueError(f"a length of {x.shape[dim]} does not split into {world_size} equal chunks")
    return x.chunk(world_size, dim=dim)[rank].contiguous()


def zigzag_split(x: Tensor, dim: int, world_size: int, rank: int) -> Tensor:
    """Rank ``rank``'s zigzag chunks of ``x`` along ``dim``: chunks ``rank`` and
    ``2·world_size - 1 - rank`` of ``2·world_size``, concatenated."""
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"a length of {x.shape[dim]} does not split into {2 * world_size} zigzag chunks")
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim).contiguous()


def _local_index(cu_seqlens: List[int], world_size: int, rank: int, zigzag: bool) -> Tensor:
    index = []
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        n = e - s
        parts = 2 * world_size if zigzag else world_size
        if n % parts:
            raise ValueError(f"a sequence of {n} tokens does not split into {parts} equal chunks")
        c = n // parts
        picks = [rank, 2 * world_size - 1 - rank] if zigzag else [rank]
        for p in picks:
            index.extend(range(s + p * c, s + (p + 1) * c))
    return torch.tensor(index, dtype=torch.long)


def ring_split_varlen(x: Tensor, cu_seqlens: Tensor, world_size: int, rank: int, zigzag: bool = False
                      ) -> Tuple[Tensor, Tensor]:
    """Rank ``rank``'s tokens of packed ``x [t, ...]`` (every sequence split as above) and the
    local ``cu_seqlens`` (every length divided by ``world_size``)."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    index = _local_index(cu, world_size, rank, zigzag).to(x.device)
    local_cu = torch.tensor([c // world_size for c in cu], dtype=torch.int32, device=cu_seqlens.device)
    return x.index_select(0, index).contiguous(), local_cu


def ring_gather(local: Tensor, dim: int, group=None, zigzag: bool = False) -> Tensor:
    """The inverse of :func:`ring_split` / :func:`zigzag_split` for fixed-length tensors: every
    rank's chunk gathered (``all_gather``) and put back in sequence order."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if not zigzag:
        return torch.cat(parts, dim=dim)
    halves = [p.chunk(2, dim=dim) for p in parts]
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim=dim)


class _Ring:
    """One rank's view of the problem: the local token layout and the communication."""

    def __init__(self, q: Tensor, group, zigzag: bool, causal: bool, cu: Optional[Tensor]):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.zigzag = zigzag
        self.causal = causal
        self.varlen = cu is not None
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.next = ranks[(self.rank + 1) % self.world]
        self.prev = ranks[(self.rank - 1) % self.world]
        if self.varlen:
            cu_list = [int(c) for c in cu.tolist()]
            self.cu = cu.to(torch.int32)
            self.half_cu = torch.tensor([c // 2 for c in cu_list], dtype=torch.int32, device=cu.device)
            first, second = [], []
            for s, e in zip(cu_list[:-1], cu_list[1:]):
                if (e - s) % 2 and zigzag:
                    raise ValueError("zigzag: every local sequence length must be even")
                h = (e - s) // 2
                first.extend(range(s, s + h))
                second.extend(range(s + h, e))
            self.first = torch.tensor(first, dtype=torch.long, device=q.device)
            self.second = torch.tensor(second, dtype=torch.long, device=q.device)
        else:
            if zigzag and q.shape[1] % 2:
                raise ValueError("zigzag: the local sequence length must be even")
            self.half = q.shape[1] // 2

    # Token selections: the token dim is 0 (varlen) or 1 (fixed length); lse's token dim is last.
    def take(self, x: Tensor, second: bool) -> Tensor:
        if self.varlen:
            return x.index_select(0, self.second if second else self.first)
        return x[:, self.half:] if second else x[:, : self.half]

    def take_lse(self, lse: Tensor, second: bool) -> Tensor:
        if self.varlen:
            return lse.index_select(1, self.second if second else self.first).contiguous()
        return (lse[..., self.half:] if second else lse[..., : self.half]).contiguous()

    def exchange(self, tensors: List[Tensor], tag: int) -> Tuple[List[Tensor], list]:
        """Starts sending ``tensors`` to the next rank and receiving as many from the previous,
        tagged ``tag, tag + 1, ...`` (the message kinds of a step stay apart on transports that
        match by tag, like gloo; NCCL matches by order)."""
        # Contiguous both ways: a permuted but dense tensor would keep its strides in empty_like.
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        if self.world == 1:
            for r, t in zip(received, tensors):
                r.copy_(t)
            return received, []
        ops = []
        for i, (t, r) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs) -> None:
        for r in reqs:
            r.wait()


def _call_fwd(ring, q, k, v, scale, softcap, deterministic, work, cu_q, cu_k):
    out, lse, _ = fwd_op(q, k, v, None, cu_q, cu_k, scale, work == DIAGONAL, -1, -1, softcap, 0.0,
                         deterministic, None)
    return out, lse


def _merge(acc: Optional[Tensor], acc_lse: Optional[Tensor], out: Tensor, lse: Tensor, varlen: bool):
    """``(acc, acc_lse)`` merged with a step's ``(out, lse)`` (float32 accumulators)."""
    # lse is [b, h, s] (or [h, t]); out is [b, s, h, d] (or [t, h, d]).
    lse_t = (lse.transpose(0, 1) if varlen else lse.transpose(1, 2)).unsqueeze(-1)
    if acc is None:
        return out.float(), lse.clone()
    acc_t = (acc_lse.transpose(0, 1) if varlen else acc_lse.transpose(1, 2)).unsqueeze(-1)
    new = torch.logaddexp(acc_t, lse_t)
    seen = torch.isfinite(new)
    wa = torch.where(seen, torch.exp(acc_t - new), torch.zeros_like(new))
    wb = torch.where(seen, torch.exp(lse_t - new), torch.zeros_like(new))
    merged = acc * wa + out.float() * wb
    new_lse = new.squeeze(-1)
    new_lse = new_lse.transpose(0, 1) if varlen else new_lse.transpose(1, 2)
    return merged, new_lse.contiguous()


def _ring_forward(ring: _Ring, q, k, v, scale, softcap, deterministic):
    acc = acc_lse = None
    half_acc = half_lse = None  # queries2 steps merge into the second half
    cu, half_cu = (ring.cu, ring.half_cu) if ring.varlen else (None, None)
    for step in range(ring.world):
        if step + 1 < ring.world:
            (next_k, next_v), reqs = ring.exchange([k, v], 4 * step)
        work = schedule(ring.zigzag, ring.causal, ring.world, ring.rank, step)
        if work in (FULL, DIAGONAL):
            out, lse = _call_fwd(ring, q, k, v, scale, softcap, deterministic, work, cu, cu)
            acc, acc_lse = _merge(acc, acc_lse, out, lse, ring.varlen)
        elif work == KEYS_FIRST_HALF:
            kh, vh = ring.take(k, False), ring.take(v, False)
            out, lse = _call_fwd(ring, q, kh, vh, scale, softcap, deterministic, work, cu, half_cu)
            acc, acc_lse = _merge(acc, acc_lse, out, lse, ring.varlen)
        elif work == QUERIES_SECOND_HALF:
            qh = ring.take(q, True)
            out, lse = _call_fwd(ring, qh, k, v, scale, softcap, deterministic, work, half_cu, cu)
            half_acc, half_lse = _merge(half_acc, half_lse, out, lse, ring.varlen)
        if step + 1 < ring.world:
            ring.wait(reqs)
            k, v = next_k, next_v
    if half_acc is not None:
        # Merge the second half's partials into the step-0 result's second half.
        a2, l2 = _merge(ring.take(acc, True), ring.take_lse(acc_lse, True), half_acc, half_lse, ring.varlen)
        if ring.varlen:
            acc = acc.index_copy(0, ring.second, a2)
            acc_lse = acc_lse.index_copy(1, ring.second, l2)
        else:
            acc = torch.cat([acc[:, : ring.half], a2], dim=1)
            acc_lse = torch.cat([acc_lse[..., : ring.half], l2], dim=-1)
    return acc.to(q.dtype), acc_lse.contiguous()


def _ring_backward(ring: _Ring, dout, q, k, v, out, lse, scale, softcap, deterministic):
    cu, half_cu = (ring.cu, ring.half_cu) if ring.varlen else (None, None)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)

    def call(q_, k_, v_, o_, lse_, do_, work, cu_q, cu_k):
        return bwd_op(do_, q_, k_, v_, o_, lse_, torch.zeros(2, dtype=torch.int64), None, cu_q, cu_k, scale,
                      work == DIAGONAL, -1, -1, softcap, 0.0, deterministic)

    pending = None  # the dK/dV exchange of the previous step, waited for only when needed
    for step in range(ring.world):
        if step + 1 < ring.world:
            (next_k, next_v), reqs = ring.exchange([k, v], 4 * step)
        work = schedule(ring.zigzag, ring.causal, ring.world, ring.rank, step)
        g = None
        if work in (FULL, DIAGONAL):
            g = call(q, k, v, out, lse, dout, work, cu, cu)
        elif work == KEYS_FIRST_HALF:
            g = call(q, ring.take(k, False), ring.take(v, False), out, lse, dout, work, cu, half_cu)
        elif work == QUERIES_SECOND_HALF:
            g = call(ring.take(q, True), k, v, ring.take(out, True), ring.take_lse(lse, True), ring.take(dout, True),
                     work, half_cu, cu)
        if pending is not None:
            # dK/dV of the chunk held now, from the previous rank (which held it the step before).
            (dk, dv), dreqs = pending
            ring.wait(dreqs)
        if work in (FULL, DIAGONAL):
            dq += g[0]
            dk += g[1]
            dv += g[2]
        elif work == KEYS_FIRST_HALF:
            dq += g[0]
            if ring.varlen:
                dk.index_add_(0, ring.first, g[1].float())
                dv.index_add_(0, ring.first, g[2].float())
            else:
                dk[:, : ring.half] += g[1]
                dv[:, : ring.half] += g[2]
        elif work == QUERIES_SECOND_HALF:
            if ring.varlen:
                dq.index_add_(0, ring.second, g[0].float())
            else:
                dq[:, ring.half:] += g[0]
            dk += g[1]
            dv += g[2]
        # On to the next rank, which holds this chunk at the next step. After the last step the
        # chunk's dK/dV are complete and go to their owner narrowed to the dtype (the rounding
        # the owner would do): the same values, half the bytes of float32 for float16/bfloat16.
        if step + 1 == ring.world:
            dk, dv = dk.to(k.dtype), dv.to(v.dtype)
        pending = ring.exchange([dk, dv], 4 * step + 2)
        if step + 1 < ring.world:
            ring.wait(reqs)
            k, v = next_k, next_v
    (dk, dv), dreqs = pending
    ring.wait(dreqs)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, scale, softcap, causal, zigzag, deterministic, group):
        ring = _Ring(q, group, zigzag, causal, cu)
        out, lse = _ring_forward(ring, q, k, v, scale, softcap, deterministic)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.options = (scale, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, dout.contiguous(), q, k, v, out, lse, *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None, None


def _check(q, k, v, dropout_p, window_size, alibi_slopes, group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring attention needs an initialised torch.distributed process group")
    if float(dropout_p) != 0.0:
        raise ValueError("ring attention does not support dropout")
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise ValueError("ring attention does not support sliding windows")
    if alibi_slopes is not None:
        raise ValueError("ring attention does not support ALiBi")
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        raise ValueError("ring attention is self-attention: q, k and v must cover the same tokens")


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                         zigzag=False):
    """Context-parallel :func:`flash_attn_rs.flash_attn_func` over ``group`` (default: the world).

    ``q [b, s_local, hq, d]``, ``k``/``v [b, s_local, hk, d]`` are this rank's chunk of each
    sequence: :func:`ring_split` (``zigzag=False``) or :func:`zigzag_split` (``zigzag=True``, for
    causal). Returns this rank's ``out`` (and with ``return_attn_probs``, ``(out, softmax_lse
    [b, hq, s_local], None)``). Differentiable: ``dq``, ``dk``, ``dv`` are this rank's chunks.
    """
    _check(q, k, v, dropout_p, window_size, alibi_slopes, group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttention.apply(q, k, v, None, scale, float(softcap or 0.0), bool(causal), bool(zigzag),
                                    bool(deterministic), group)
    return (out, lse, None) if return_attn_probs else out


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None):
    """:func:`ring_flash_attn_func` with ``zigzag=True`` (inputs split by :func:`zigzag_split`)."""
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs, group, zigzag=True)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen=None, dropout_p=0.0, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, return_attn_probs=False, group=None, zigzag=False):
    """Context-parallel varlen attention: ``q [t_local, hq, d]`` etc. are this rank's tokens and
    ``cu_seqlens`` (int32) the local one, as :func:`ring_split_varlen` returns them. Returns this
    rank's ``out [t_local, hq, dv]`` (with ``return_attn_probs``: ``(out, softmax_lse [hq, t_local],
    None)``)."""
    _check(q, k, v, dropout_p, window_size, alibi_slopes, group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttention.apply(q, k, v, cu_seqlens, scale, float(softcap or 0.0), bool(causal), bool(zigzag),
                                    bool(deterministic), group)
    return (out, lse, None) if return_attn_probs else out
