"""Ring / zigzag context parallelism on torch.distributed: R processes (gloo on the CPU; NCCL on
CUDA where torch sees at least two GPUs) each attend their chunk; the gathered out and gradients
meet the numerics contract against the float64 oracle of the whole problem."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_attn_rs
from flash_attn_rs import ring as fring
from ring_worker import _worker


def _backends():
    out = [("gloo", "cpu", torch.float32), ("gloo", "cpu", torch.bfloat16)]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        out += [("nccl", "cuda", torch.bfloat16), ("nccl", "cuda", torch.float16)]
    return out


CASES = [
    # (world, zigzag, causal, varlen, b, s (or lengths), hq, hk, d)
    (2, True, True, False, 2, 64, 4, 2, 32),
    (2, False, False, False, 1, 48, 2, 2, 64),
    (3, False, True, False, 1, 36, 3, 1, 16),
    (4, True, True, True, 0, [64, 16, 0, 40], 4, 2, 32),
    (2, True, False, True, 0, [24, 8], 2, 1, 16),
]


@pytest.mark.parametrize("backend,where,dtype", _backends(), ids=lambda x: str(x).split(".")[-1])
@pytest.mark.parametrize("world", sorted({c[0] for c in CASES}))
def test_ring_matches_the_oracle_of_the_whole(backend, where, dtype, world):
    if where == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} GPUs needed")
    cases = [c for c in CASES if c[0] == world]
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init_file, backend, where, dtype, cases, 1234 + world), nprocs=world,
                 join=True)


def test_the_python_schedule_is_the_librarys():
    # The Rust schedule's rules, restated: zigzag causal work is balanced, contiguous is not.
    for ranks in (2, 3, 4, 8):
        work = [[fring.schedule(True, True, ranks, r, t) for t in range(ranks)] for r in range(ranks)]
        assert all(w[0] == fring.DIAGONAL for w in work)
        assert all(sum(x != fring.SKIP for x in w) == ranks for w in work)
        contiguous = [sum(fring.schedule(False, True, ranks, r, t) != fring.SKIP for t in range(ranks))
                      for r in range(ranks)]
        assert contiguous == list(range(1, ranks + 1))


def test_unsupported_options_are_value_errors():
    if not dist.is_initialized():
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
            try:
                q = torch.randn(1, 8, 2, 16)
                for kwargs in (dict(dropout_p=0.1), dict(window_size=(4, 0)), dict(alibi_slopes=torch.ones(2))):
                    with pytest.raises(ValueError):
                        flash_attn_rs.ring_flash_attn_func(q, q, q, **kwargs)
                with pytest.raises(ValueError):
                    flash_attn_rs.ring_flash_attn_func(q, q[:, :4], q[:, :4])
                # One rank: the ring is plain attention.
                out = flash_attn_rs.ring_flash_attn_func(q, q, q, causal=True)
                assert torch.allclose(out, flash_attn_rs.flash_attn_func(q, q, q, causal=True), atol=1e-6)
            finally:
                dist.destroy_process_group()
