#!/usr/bin/env python3
"""Time and peak extra device memory vs N on a GPU: flash-attn (forward, forward+backward) next to
torch SDPA's MATH backend (Algorithm 0: S and P materialised, bf16), as JSON lines that
`flash-attn plot --from FILE --output FILE.svg` draws (keys label, sq, fwd_ms, peak_extra_bytes).

    python3 scripts/gpu_memory.py --ours ./flash-attn > gpu-memory.jsonl

b = 1, 16 heads, d = 64, bf16, non-causal. Peak extra memory:
- ours: `flash-attn bench --device cuda --backward --json`, whose `peak_extra_bytes` /
  `bwd_peak_extra_bytes` are the device memory pool's high-water mark over one call beyond what
  was in use before it (inputs, outputs and gradients are allocated before and not counted).
- torch: torch.cuda.max_memory_allocated() over one call minus memory_allocated() before it,
  with q, k, v (and dout) allocated before; this includes the call's own outputs (out; and
  dq, dk, dv for forward+backward: 4·N·d·2 B per head), which ours does not count.
Times: ours from the same bench line; torch from triton.testing.do_bench (median)."""
import argparse, json, subprocess, sys

NS = [512, 1024, 2048, 4096, 8192, 16384]
H, D = 16, 64


def ours(binary, n):
    r = subprocess.run([binary, "bench", "--device", "cuda", "--dtype", "bf16", "--shape",
                        f"1,{H},{H},{n},{n},{D}", "--backward", "--json"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        print(f"ours N={n}: exit {r.returncode}: {r.stderr.strip()}", file=sys.stderr)
        return []
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return [
        {"label": "flash-attn forward", "sq": n, "fwd_ms": j["fwd_ms"], "peak_extra_bytes": j["peak_extra_bytes"]},
        {"label": "flash-attn forward+backward", "sq": n, "fwd_ms": j["fwdbwd_ms"],
         "peak_extra_bytes": j["bwd_peak_extra_bytes"]},
    ]


def torch_math(n):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    from triton.testing import do_bench
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    mk = lambda: torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16)
    q, k, v, g = mk(), mk(), mk(), mk()
    lines = []
    for backward in (False, True):
        for t in (q, k, v):
            t.requires_grad_(backward)

        def call():
            with sdpa_kernel(SDPBackend.MATH):
                if backward:
                    o = F.scaled_dot_product_attention(q, k, v)
                    torch.autograd.grad(o, (q, k, v), g)
                else:
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v)

        try:
            call()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            call()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = do_bench(call, return_mode="median")
        except torch.OutOfMemoryError:
            print(f"torch math N={n} backward={backward}: out of memory", file=sys.stderr)
            torch.cuda.empty_cache()
            continue
        label = "torch math (Algorithm 0) " + ("forward+backward" if backward else "forward")
        lines.append({"label": label, "sq": n, "fwd_ms": ms, "peak_extra_bytes": peak})
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", required=True, help="a flash-attn binary built with --features cuda")
    ap.add_argument("--ns", type=int, nargs="*", default=NS)
    a = ap.parse_args()
    for n in a.ns:
        for line in ours(a.ours, n) + torch_math(n):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
