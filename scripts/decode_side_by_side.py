#!/usr/bin/env python3
"""Decode with a KV cache, side by side: PyTorch scaled_dot_product_attention (enable_gqa) against
`flash-attn bench --decode`, alternating per shape within each round, medians over rounds.

    python3 scripts/decode_side_by_side.py --ours target/release/flash-attn --device cpu --dtype bf16
    python3 scripts/decode_side_by_side.py --ours ./flash-attn --device cuda --torch-backend cudnn

Bandwidth = bytes of the cached keys and values (b * sk * hk * 2d * size) / median time, the
measure of the issue's table. torch reads a contiguous [b, hk, sk, d] cache; ours a [b, sk, hk, d]
one, or a paged one with --page-size. On cpu `mem` is the machine's read bandwidth measured by
ours in the same run. Ratio = torch_ms / ours_ms (> 1: ours faster). Prints a table, then
JSON lines (one per shape) for plotting.
"""
import argparse, json, statistics, subprocess, sys, time

GRIDS = {
    # (b, hq, hk, sq, sk, d)
    "cpu": [
        (1, 32, 8, 1, 4096, 128),
        (1, 32, 8, 1, 16384, 128),
        (1, 32, 8, 1, 32768, 128),
        (16, 32, 8, 1, 4096, 128),
        (4, 32, 8, 1, 16384, 128),
        (8, 32, 8, 4, 8192, 128),
        (1, 32, 8, 1, 32768, 64),
        (16, 32, 8, 1, 4096, 64),
    ],
    "gpu-sweep": [(1, 32, 8, 1, sk, 128) for sk in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)],
    "cpu-sweep": [(1, 32, 8, 1, sk, 128) for sk in (1024, 2048, 4096, 8192, 16384, 32768, 65536)],
    "gpu": [
        (1, 32, 8, 1, 4096, 128),
        (1, 32, 8, 1, 32768, 128),
        (1, 32, 8, 1, 131072, 128),
        (16, 32, 8, 1, 4096, 128),
        (16, 32, 8, 1, 32768, 128),
        (64, 32, 8, 1, 4096, 128),
        (8, 32, 8, 4, 32768, 128),
        (1, 32, 8, 1, 32768, 64),
        (16, 32, 8, 1, 32768, 64),
    ],
}


def kv_bytes(shape, size):
    b, hq, hk, sq, sk, d = shape
    return b * sk * hk * 2 * d * size


def torch_ms(torch, F, dev, dt, shape, backend, reps):
    b, hq, hk, sq, sk, d = shape
    q = torch.randn(b, hq, sq, d, device=dev, dtype=dt)
    k = torch.randn(b, hk, sk, d, device=dev, dtype=dt)
    v = torch.randn(b, hk, sk, d, device=dev, dtype=dt)
    kw = {"enable_gqa": hq != hk}
    if sq > 1:
        from torch.nn.attention.bias import causal_lower_right
        kw["attn_mask"] = causal_lower_right(sq, sk)
    ctx = None
    if backend != "auto":
        from torch.nn.attention import sdpa_kernel, SDPBackend
        ctx = sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend])
        ctx.__enter__()
    try:
        def run():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, **kw)
        if dev == "cuda":
            from triton.testing import do_bench
            return do_bench(run, warmup=25, rep=100, return_mode="median")
        run()
        ts = []
        start = time.perf_counter()
        while len(ts) < reps or (time.perf_counter() - start < 0.5 and len(ts) < 1000):
            t = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def ours(exe, device, dtype, shape, page_size):
    cmd = [exe, "bench", "--decode", "--device", device, "--dtype", dtype, "--json",
           "--shape", ",".join(map(str, shape))]
    if page_size:
        cmd += ["--page-size", str(page_size)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ours", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    ap.add_argument("--grid", default=None, choices=sorted(GRIDS))
    ap.add_argument("--page-size", type=int, default=0, help="ours on a paged cache of P tokens a page")
    ap.add_argument("--torch-backend", default="auto", choices=["auto", "flash", "cudnn", "efficient", "math"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    size = {"f32": 4, "f16": 2, "bf16": 2}[args.dtype]
    grid = GRIDS[args.grid or ("gpu" if args.device == "cuda" else "cpu")]
    if args.device == "cpu":
        print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
              f"{torch.get_num_threads()} threads", file=sys.stderr)
    else:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, backend {args.torch_backend}",
              file=sys.stderr)

    tor = {s: [] for s in grid}
    our = {s: [] for s in grid}
    mem = {s: [] for s in grid}
    for r in range(args.rounds):
        for s in grid:
            tor[s].append(torch_ms(torch, F, args.device, dt, s, args.torch_backend, args.reps))
            o = ours(args.ours, args.device, args.dtype, s, args.page_size)
            our[s].append(o["fwd_ms"])
            if o.get("mem_gbps") is not None:
                mem[s].append(o["mem_gbps"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    ratios = []
    lines = []
    print(f"{'b':>3} {'hq':>3} {'hk':>3} {'sq':>3} {'sk':>7} {'d':>4} | {'torch ms':>9} {'GB/s':>7} | "
          f"{'ours ms':>9} {'GB/s':>7} | {'mem GB/s':>8} {'ours/mem':>8} | {'torch/ours':>10}")
    for s in grid:
        t, o = statistics.median(tor[s]), statistics.median(our[s])
        m = statistics.median(mem[s]) if mem[s] else None
        tb, ob = kv_bytes(s, size) / t / 1e6, kv_bytes(s, size) / o / 1e6
        ratios.append((t / o, s))
        print(f"{s[0]:>3} {s[1]:>3} {s[2]:>3} {s[3]:>3} {s[4]:>7} {s[5]:>4} | {t:>9.4f} {tb:>7.1f} | "
              f"{o:>9.4f} {ob:>7.1f} | {m if m is not None else float('nan'):>8.1f} "
              f"{ob / m if m else float('nan'):>8.2f} | {t / o:>10.2f}")
        lines.append({"b": s[0], "hq": s[1], "hk": s[2], "sq": s[3], "sk": s[4], "d": s[5],
                      "dtype": args.dtype, "device": args.device, "page_size": args.page_size or None,
                      "torch_ms": t, "torch_gbps": tb, "ours_ms": o, "ours_gbps": ob, "mem_gbps": m,
                      "torch_backend": args.torch_backend})
    lo = min(ratios)
    print(f"min ratio {lo[0]:.2f} ({lo[1]}), median ratio {statistics.median(r for r, _ in ratios):.2f}")
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
