"""Hugging Face ``transformers`` integration: ``attn_implementation="fa_rs"``.

::

    import flash_attn_rs.transformers
    name = flash_attn_rs.transformers.register()   # "fa_rs"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

The name has no "flash" in it on purpose: transformers treats any implementation whose name
contains "flash" as one of its FlashAttention kernels and tries to fetch it from the Hub.

:func:`register` adds :func:`attention_forward` to ``AttentionInterface`` and FlashAttention's
mask function (``None`` without padding, else the 2-D padding mask) to
``AttentionMaskInterface``, under the same name. Padded batches are unpadded into a varlen call,
as transformers does for FlashAttention 2; the causal mask is bottom-right aligned, so decoding
with a KV cache needs no mask either.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .interface import flash_attn_func, flash_attn_varlen_func

NAME = "fa_rs"


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [b, hq, sq, d]``, ``key/value
    [b, hk, sk, d]`` in, ``(out [b, sq, hq, dv], None)`` out."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (`s_aux`) are not supported by flash_attn_rs")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    args = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal, window_size=window,
                softcap=float(softcap or 0.0))
    if attention_mask is None:
        return flash_attn_func(q, k, v, **args), None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"flash_attn_rs takes a 2-D padding mask [b, kv_len], got shape {list(attention_mask.shape)}; "
            "register() installs the mask function that makes one"
        )
    b, sq, hq, _ = q.shape
    keys = attention_mask[:, -k.shape[1]:].bool()
    queries = keys[:, -sq:]
    idx_q = queries.reshape(-1).nonzero().squeeze(1)
    idx_k = keys.reshape(-1).nonzero().squeeze(1)
    len_q, len_k = queries.sum(1, dtype=torch.int32), keys.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(len_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(len_k.cumsum(0, dtype=torch.int32), (1, 0))
    out = flash_attn_varlen_func(
        q.reshape(b * sq, hq, -1).index_select(0, idx_q),
        k.reshape(-1, k.shape[2], k.shape[3]).index_select(0, idx_k),
        v.reshape(-1, v.shape[2], v.shape[3]).index_select(0, idx_k),
        cu_q, cu_k, int(len_q.max()), int(len_k.max()), **args,
    )
    padded = out.new_zeros(b * sq, hq, out.shape[-1]).index_copy(0, idx_q, out)
    return padded.view(b, sq, hq, -1), None


def register(name: str = NAME) -> str:
    """Registers :func:`attention_forward` (and FlashAttention's mask function) with
    transformers under ``name``; returns the name to pass as ``attn_implementation``. A name
    containing "flash" is refused (see the module docs)."""
    if "flash" in name:
        raise ValueError(f"transformers takes any attention name containing 'flash' for a Hub kernel: {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
