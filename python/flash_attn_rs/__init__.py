"""flash_attn_rs: FlashAttention in Rust for PyTorch users.

FlashAttention 2.x's functions with the same names, arguments, defaults and return values, on
CPU tensors (float32, float16, bfloat16; forward and backward) and CUDA tensors (float16,
bfloat16; kernels compiled at first use by NVRTC for the GPU at hand, so one wheel serves every
torch version and GPU generation)::

    import flash_attn_rs as flash_attn
    out = flash_attn.flash_attn_func(q, k, v, causal=True)

``flash_attn_func`` and ``flash_attn_varlen_func`` also run FlashAttention-3's FP8 forward:
``float8_e4m3fn`` inputs with per-tensor ``descale_q/k/v``, ``bfloat16`` output, no backward.

The ops are torch custom ops (``torch.ops.flash_attn_rs.fwd`` / ``fwd_fp8`` / ``bwd`` /
``kvcache``) with fake implementations and an autograd formula: ``loss.backward()`` and
``torch.compile(fullgraph=True)`` go through them (``fwd_fp8``'s backward raises).
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from . import _native
from ._ops import bwd_op, fwd_op
from .interface import (
    attn_probs,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .ring import (
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    ring_gather,
    ring_split,
    ring_split_varlen,
    zigzag_ring_flash_attn_func,
    zigzag_split,
)

__version__ = _native.__version__

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "ring_flash_attn_func",
    "zigzag_ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "ring_split",
    "zigzag_split",
    "ring_split_varlen",
    "ring_gather",
    "fwd",
    "bwd",
    "attn_probs",
    "cuda_status",
    "cpu_isa",
]


def fwd(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: Optional[float] = None, causal: bool = False,
        window_size=(-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
        rng_state: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The low-level forward, for libraries built on the kernels (ring attention):
    ``(out, softmax_lse, rng_state)``. ``rng_state`` (int64 ``[2]``: dropout seed and 32-bit
    offset) is drawn from torch's generator when not given. Differentiable like the public
    functions; :func:`bwd` is the explicit backward."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    return fwd_op(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale, bool(causal), int(left), int(right),
                  float(softcap), float(dropout_p), False, rng_state)


def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, rng_state: Tensor, *,
        softmax_scale: Optional[float] = None, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
        alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """The low-level backward: ``(dq, dk, dv)`` from the forward's ``out``, ``softmax_lse`` and
    ``rng_state`` (scores recomputed, the dropout mask regenerated)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window_size
    return bwd_op(dout, q, k, v, out, softmax_lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale,
                  bool(causal), int(left), int(right), float(softcap), float(dropout_p), bool(deterministic))


def cuda_status() -> Tuple[bool, str]:
    """Whether CUDA tensors can run here: ``(True, arch)`` or ``(False, reason)``."""
    return _native.cuda_status()


def cpu_isa() -> str:
    """The CPU instruction-set path calls take (``FLASH_ATTN_CPU_ISA`` caps it)."""
    return _native.cpu_isa()



