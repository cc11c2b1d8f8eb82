"""The per-process body of tests/test_ring.py (a module of its own: spawned processes import it by
name)."""

import os
import sys

import torch
import torch.distributed as dist

import flash_attn_rs
from flash_attn_rs import ring as fring
from reference import EPS_GRAD, EPS_OUT, assert_contract, attention


def _worker(rank, world, init_file, backend, device, dtype, cases, seed):
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            _case(rank, world, device, dtype, case, seed + i)
        # Every rank done before any tears its connections down (gloo aborts a process whose
        # peers close while it still talks to them).
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every case passed on every rank. Tearing gloo down now aborted a rank about once in thirty
    # runs on a 2-core machine ("terminate called without an active exception", SIGABRT) after
    # its work was done: leave without running the C++ destructors, with success as the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _case(rank, world, device, dtype, case, seed):
    _, zigzag, causal, varlen, b, s, hq, hk, d = case
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    if varlen:
        lens = s
        t = sum(lens)
        shapes = ([t, hq, d], [t, hk, d], [t, hk, d], [t, hq, d])
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    else:
        shapes = ([b, s, hq, d], [b, s, hk, d], [b, s, hk, d], [b, s, hq, d])
    q, k, v, dout = (torch.randn(sh, generator=g).to(dtype) for sh in shapes)
    scale = d ** -0.5

    if varlen:
        split = lambda x: fring.ring_split_varlen(x, cu, world, rank, zigzag)[0]
        local_cu = fring.ring_split_varlen(q, cu, world, rank, zigzag)[1]
    else:
        splitter = fring.zigzag_split if zigzag else fring.ring_split
        split = lambda x: splitter(x, 1, world, rank)
    lq, lk, lv, ldo = (split(x).to(dev).requires_grad_(i < 3) for i, x in enumerate((q, k, v, dout)))
    if varlen:
        out = flash_attn_rs.ring_flash_attn_varlen_func(lq, lk, lv, local_cu.to(dev), causal=causal, zigzag=zigzag)
    else:
        out = flash_attn_rs.ring_flash_attn_func(lq, lk, lv, causal=causal, zigzag=zigzag)
    out.backward(ldo)

    def gather(x):
        if not varlen:
            return fring.ring_gather(x.detach(), 1, zigzag=zigzag).cpu()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.detach().contiguous())
        full = torch.empty((sum(s),) + tuple(x.shape[1:]), dtype=x.dtype)
        for r, p in enumerate(parts):
            idx = fring._local_index(cu.tolist(), world, r, zigzag)
            full[idx] = p.cpu()
        return full

    got = {n: gather(x) for n, x in (("out", out), ("dq", lq.grad), ("dk", lk.grad), ("dv", lv.grad))}
    if rank == 0:
        cu_args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu) if varlen else {}
        ref = {}
        for name, dt in (("oracle", torch.float64), ("naive", dtype)):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            o, _ = attention(qq, kk, vv, scale=scale, causal=causal, compute_dtype=dt, **cu_args)
            o.backward(dout.to(o.dtype))
            ref[name] = {"out": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
        assert_contract("out", got["out"], ref["naive"]["out"], ref["oracle"]["out"], EPS_OUT[dtype])
        for n in ("dq", "dk", "dv"):
            assert_contract(n, got[n], ref["naive"][n], ref["oracle"][n], EPS_GRAD[dtype])
