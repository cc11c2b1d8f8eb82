#!/usr/bin/env python3
# The backward pass alone of torch SDPA (one backend), BENCH.md's `gpu` convention (b·s = 16k tokens,
# hq = 2048 // d): autograd.grad of one forward's graph, retained, timed by triton's do_bench (median).
# Prints one JSON line per shape, like `cuda_bench bench --pass bwd`.
import argparse, json
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="flash")
ap.add_argument("--d", default="256")
ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
ap.add_argument("--dtypes", default="bf16,f16")
a = ap.parse_args()
B = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[a.backend]
TD = {"bf16": torch.bfloat16, "f16": torch.float16}
for dt in a.dtypes.split(","):
    for d in map(int, a.d.split(",")):
        for s in map(int, a.seqs.split(",")):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=TD[dt], requires_grad=True) for _ in range(3))
                g = torch.randn(b, h, s, d, device="cuda", dtype=TD[dt])
                try:
                    with sdpa_kernel(B):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        ms = do_bench(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True), warmup=25, rep=100,
                                      return_mode="median")
                    fl = 4.0 * b * h * s * s * d * 2.5 / (2 if causal else 1)
                    print(json.dumps({"torch": a.backend, "dtype": dt, "b": b, "hq": h, "s": s, "d": d, "causal": causal,
                                      "bwd_ms": round(ms, 4), "tflops": round(fl / ms / 1e9, 1)}), flush=True)
                except Exception as e:
                    print(json.dumps({"torch": a.backend, "dtype": dt, "s": s, "d": d, "causal": causal,
                                      "error": str(e)[:200]}), flush=True)
                del q, k, v, g
