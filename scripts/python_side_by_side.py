#!/usr/bin/env python3
"""flash_attn_rs from Python against torch SDPA (FlashAttention-2 and cuDNN backends) and against
the CLI's own bench of the same problem, on one GPU.

    python3 scripts/python_side_by_side.py --cli ./flash-attn [--grid gpu-py] [--rounds 2]

Every timer is the CLI's (`flash-attn bench`): CUDA events made up front, the calls queued back to
back each between its own pair of events, one synchronisation, the median; after a warm-up. The
four sides alternate per shape and round. Columns: ms of torch flash, torch cuDNN, ours through
Python and ours through the CLI; `vs_flash` and `vs_cudnn` = torch_ms / ours_py_ms (> 1: ours
faster); `overhead` = ours_py_ms / ours_cli_ms - 1 (the binding's cost over the Rust API).
"""

import argparse
import json
import statistics
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn_rs as fa

GRIDS = {
    # (b, hq, hk, s, d): BENCH.md's `gpu` convention, b·s = 16k tokens, hq·d = 2048.
    "gpu-py": [(16384 // s, 2048 // d, 2048 // d, s, d) for d in (64, 128) for s in (1024, 4096, 16384)],
    "gpu-quick": [(16384 // s, 2048 // d, 2048 // d, s, d) for d in (64, 128) for s in (2048, 8192)],
    "tiny": [(1, 4, 4, 128, 64)],
}
BUDGET_MS, MIN_RUNS, MAX_RUNS = 200.0, 10, 2000


def event_median(call):
    """The CLI's timer (see the module docs)."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end)
    runs = int(BUDGET_MS / estimate) if estimate > 0 else MAX_RUNS
    runs = max(MIN_RUNS, min(MAX_RUNS, runs))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for a, b in pairs:
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def make_call(side, shape, causal, backward, dtype):
    b, hq, hk, s, d = shape
    ours = side == "ours"
    layout = (b, s, hq, d) if ours else (b, hq, s, d)
    kv_layout = (b, s, hk, d) if ours else (b, hk, s, d)
    q = torch.randn(layout, device="cuda", dtype=dtype, requires_grad=backward)
    k = torch.randn(kv_layout, device="cuda", dtype=dtype, requires_grad=backward)
    v = torch.randn(kv_layout, device="cuda", dtype=dtype, requires_grad=backward)
    g = torch.randn(layout, device="cuda", dtype=dtype)
    if ours:
        def attend():
            return fa.flash_attn_func(q, k, v, causal=causal)
    else:
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[side]

        def attend():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)

    def call():
        if backward:
            q.grad = k.grad = v.grad = None
            attend().backward(g)
        else:
            with torch.no_grad():
                attend()

    return call


def cli_time(cli, shape, causal, backward, dtype):
    b, hq, hk, s, d = shape
    args = [cli, "bench", "--device", "cuda", "--dtype", dtype, "--shape", f"{b},{hq},{hk},{s},{s},{d}", "--json"]
    if causal:
        args.append("--causal")
    if backward:
        args.append("--backward")
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError("the CLI failed: " + (p.stderr or p.stdout).strip()[:300])
    line = [x for x in p.stdout.splitlines() if x.strip().startswith("{")][-1]
    r = json.loads(line)
    return r["fwdbwd_ms" if backward else "fwd_ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True, help="the CUDA build of the flash-attn CLI")
    ap.add_argument("--grid", default="gpu-py", choices=sorted(GRIDS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="fwd,fwdbwd")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, flash_attn_rs {fa.__version__}, {a.dtype}")
    print(f"{'mode':7} {'b,hq,hk,s,d':22} {'causal':6} {'flash_ms':>9} {'cudnn_ms':>9} {'py_ms':>9} {'cli_ms':>9} "
          f"{'vs_flash':>8} {'vs_cudnn':>8} {'overhead':>8} {'py_TF/s':>8}")
    summary = {}
    for mode in a.modes.split(","):
        backward = mode == "fwdbwd"
        for shape in GRIDS[a.grid]:
            for causal in (False, True):
                times = {"flash": [], "cudnn": [], "ours": [], "cli": []}
                for _ in range(a.rounds):
                    for side in ("flash", "cudnn", "ours"):
                        call = make_call(side, shape, causal, backward, dtype)
                        times[side].append(event_median(call))
                        del call
                    times["cli"].append(cli_time(a.cli, shape, causal, backward, a.dtype))
                m = {k: statistics.median(v) for k, v in times.items()}
                b, hq, hk, s, d = shape
                flops = 4.0 * b * hq * s * s * d / (2 if causal else 1) * (3.5 if backward else 1.0)
                row = (m["flash"] / m["ours"], m["cudnn"] / m["ours"], m["ours"] / m["cli"] - 1)
                summary.setdefault(mode, []).append(row)
                print(f"{mode:7} {','.join(map(str, shape)):22} {str(causal):6} {m['flash']:9.3f} {m['cudnn']:9.3f} "
                      f"{m['ours']:9.3f} {m['cli']:9.3f} {row[0]:8.2f} {row[1]:8.2f} {row[2]:+8.1%} "
                      f"{flops / m['ours'] / 1e9:8.1f}", flush=True)
    for mode, rows in summary.items():
        cols = list(zip(*rows))
        print(f"{mode}: vs torch flash median {statistics.median(cols[0]):.2f} (min {min(cols[0]):.2f}), "
              f"vs cuDNN median {statistics.median(cols[1]):.2f} (min {min(cols[1]):.2f}), "
              f"binding overhead median {statistics.median(cols[2]):+.1%} (max {max(cols[2]):+.1%})")


if __name__ == "__main__":
    main()
