#!/usr/bin/env python3
"""The backward pass alone of torch's SDPA on the GPU, on BENCH.md's `gpu` grid rule (b·s = 16k,
h = 2048 / d unless --heads), for comparison with `cuda_bench bench --pass bwd`: each shape's
median time of `torch.autograd.grad` of the output (triton's do_bench), one JSON line a shape in
cuda_bench's fields (`bwd_ms`, `tflops` at 2.5 × the forward's FLOPs, halved under a causal rule).

    python3 scripts/torch-backward-bench.py --backend flash --d 256 --heads 8 [--dtypes bf16,f16]
        [--seqs 512,1024,...] [--causal both|yes|no]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="flash", choices=sorted(BACKENDS))
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=0, help="query heads (default 2048 / d)")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    a = ap.parse_args()
    h = a.heads or 2048 // a.d
    causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    for name in a.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[name]
        for s in (int(x) for x in a.seqs.split(",")):
            b = max(1, 16384 // s)
            for causal in causals:
                q, k, v = (torch.randn(b, h, s, a.d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                do = torch.randn(b, h, s, a.d, device="cuda", dtype=dtype)
                with sdpa_kernel(BACKENDS[a.backend]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                flops = 2.5 * 4 * b * h * s * s * a.d / (2 if causal else 1)
                line = {"device": "cuda", "dtype": name, "b": b, "hq": h, "sq": s, "d": a.d, "causal": causal,
                        "bwd_ms": round(ms, 5), "tflops": round(flops / ms / 1e9, 1), "variant": f"torch-{a.backend}"}
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
