#!/usr/bin/env python3
"""DRAM bytes of one attention forward call, measured with Nsight Compute, for
(a) our CUDA forward (`flash-attn bench --device cuda`) and (b) torch SDPA's MATH backend
(materialises S and P), plus (c) times without ncu.

    python3 io_measure.py all --ours ./carry-cuda/flash-attn --out $OUT      # the driver
    python3 io_measure.py torch-target --mode bf16 --shapes ...               # run under ncu
    python3 io_measure.py torch-time --shapes ...                             # times, no ncu

Shapes are b,hq,hk,sq,sk,d; bf16; non-causal."""
import argparse, csv, io, json, os, subprocess, sys, time

NS = [512, 1024, 2048, 4096, 8192, 16384]
HEADS = 16
D = 64
GPT2 = (64, 16, 16, 1024, 1024, 64)  # the seeds' GPT-2 medium shape (batch 64), forward only


def shapes():
    return [(1, HEADS, HEADS, n, n, D) for n in NS] + [GPT2]


def sh(s):
    return ",".join(map(str, s))


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- torch side (on the GPU machine)
def torch_setup(mode):
    import torch
    if mode == "bf16":
        # keep S and P in bf16 (the model's Algorithm 0 in the problem's dtype)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    else:
        # torch's default: the math path upcasts bf16 q, k, v to f32 (S and P in f32)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    return torch


def make_inputs(torch, s):
    b, hq, hk, sq, sk, d = s
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def torch_target(args):
    """Under `ncu --profile-from-start off`: per shape, a warm-up call, then a marker kernel
    (torch.cuda._sleep -> spin_kernel) and exactly one SDPA call inside cudaProfilerStart/Stop."""
    torch = torch_setup(args.mode)
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    cudart = torch.cuda.cudart()
    for s in [tuple(map(int, x.split(","))) for x in args.shapes]:
        q, k, v = make_inputs(torch, s)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(q, k, v)  # warm-up (allocator, handles)
            del o
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            torch.cuda._sleep(1000)  # marker: one spin_kernel before each profiled call
            o = F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
        print("TARGET", args.mode, sh(s), "done", flush=True)
        del q, k, v, o
        torch.cuda.empty_cache()


def torch_time(args):
    torch = torch_setup("bf16")
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    from triton.testing import do_bench
    res = []
    for s in [tuple(map(int, x.split(","))) for x in args.shapes]:
        q, k, v = make_inputs(torch, s)
        row = {"shape": sh(s)}
        for name, be, red in [("math_bf16", SDPBackend.MATH, True), ("math_f32", SDPBackend.MATH, False),
                              ("flash", SDPBackend.FLASH_ATTENTION, True)]:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(red)

            def run():
                with torch.no_grad(), sdpa_kernel(be):
                    F.scaled_dot_product_attention(q, k, v)
            try:
                row[name + "_ms"] = do_bench(run, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001
                row[name + "_ms"] = None
                row[name + "_err"] = str(e)[:200]
        print("TIME", json.dumps(row), flush=True)
        res.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------- ncu parsing and the driver
def parse_ncu(path):
    """Rows of `ncu --csv --print-units base` (details page) -> list of kernels in launch order:
    {"id", "name", metric: value}."""
    text = open(path, encoding="utf-8", errors="replace").read()
    lines = [l for l in text.splitlines() if l.startswith('"')]
    kernels = {}
    order = []
    for r in csv.DictReader(io.StringIO("\n".join(lines))):
        kid = r.get("ID")
        if kid is None:
            continue
        if kid not in kernels:
            kernels[kid] = {"id": int(kid), "name": r.get("Kernel Name", ""),
                            "grid": r.get("Grid Size", ""), "block": r.get("Block Size", "")}
            order.append(kid)
        val = r.get("Metric Value", "").replace(",", "")
        try:
            kernels[kid][r["Metric Name"]] = float(val)
        except ValueError:
            kernels[kid][r["Metric Name"]] = val
    return [kernels[k] for k in sorted(order, key=int)]


def ncu_base(metrics, cache):
    return ["ncu", "--clock-control", "none", "--cache-control", cache, "--metrics", ",".join(metrics),
            "--csv", "--print-units", "base"]


def run_cmd(cmd, timeout, logf):
    t = time.time()
    log("$", " ".join(cmd))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        p = subprocess.CompletedProcess(cmd, 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                                        (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))
        log("  TIMEOUT after", timeout, "s")
    with open(logf, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + p.stdout + "\n--- stderr\n" + p.stderr + "\n")
    log("  rc", p.returncode, "in %.1f s" % (time.time() - t))
    if p.returncode != 0:
        log("  stderr tail:", p.stderr[-800:], "stdout tail:", p.stdout[-800:])
    return p


def driver(args):
    out = args.out
    os.makedirs(out, exist_ok=True)
    logf = os.path.join(out, "io_measure.log")
    metrics = ["dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum"]
    q = subprocess.run(["ncu", "--query-metrics", "--chip", "gh100"], capture_output=True, text=True)
    if "lts__t_bytes " in q.stdout or "lts__t_bytes\n" in q.stdout or "\nlts__t_bytes" in q.stdout:
        metrics.append("lts__t_bytes.sum")
    log("metrics", metrics)
    result = {"metrics": metrics, "ours": {}, "torch": {}, "times": {}}
    t0 = time.time()

    # (a) ours, one process per shape and cache mode; skip the 3 warm-up launches.
    for cache in args.caches:
        for s in shapes():
            f = "/tmp/ncu_ours.csv"
            if os.path.exists(f):
                os.remove(f)
            cmd = ncu_base(metrics, cache) + ["--kernel-name", "regex:flash_fwd", "--launch-skip", "3",
                                              "--launch-count", "1", "--log-file", f,
                                              args.ours, "bench", "--device", "cuda", "--dtype", "bf16",
                                              "--shape", sh(s), "--json"]
            p = run_cmd(cmd, 120, logf)
            ks = parse_ncu(f) if os.path.exists(f) else []
            with open(os.path.join(out, "ncu_ours_all.csv"), "a") as g:
                g.write("# %s cache=%s\n" % (sh(s), cache))
                g.write(open(f).read() if os.path.exists(f) else "(none)\n")
            result["ours"]["%s|%s" % (sh(s), cache)] = ks
            log("  ours", sh(s), cache, [(k["name"][:40], k.get("dram__bytes_read.sum"),
                                          k.get("dram__bytes_write.sum")) for k in ks])
    log("ours ncu done at %.0f s" % (time.time() - t0))

    # (b) torch math: one process per (dtype mode, cache mode), all shapes, split at spin_kernel.
    for mode in args.modes:
        for cache in args.caches:
            if time.time() - t0 > args.budget_s:
                log("budget reached, skipping torch", mode, cache)
                continue
            f = os.path.join(out, "ncu_torch_%s_%s.csv" % (mode, cache))
            ss = [s for s in shapes() if not (mode == "f32" and s[3] > args.max_n_f32)]
            cmd = ncu_base(metrics, cache) + ["--profile-from-start", "off", "--log-file", f,
                                              sys.executable, os.path.abspath(__file__), "torch-target",
                                              "--mode", mode, "--shapes"] + [sh(s) for s in ss]
            p = run_cmd(cmd, 150, logf)
            json.dump(result, open(os.path.join(out, "io_measure.json"), "w"), indent=1)
            ks = parse_ncu(f) if os.path.exists(f) else []
            segs, cur = [], None
            for k in ks:
                if "spin" in k["name"] or "sleep" in k["name"].lower():
                    cur = []
                    segs.append(cur)
                elif cur is not None:
                    cur.append(k)
            log("  torch", mode, cache, "kernels", len(ks), "segments", len(segs), "shapes", len(ss))
            for s, seg in zip(ss, segs):
                result["torch"]["%s|%s|%s" % (sh(s), mode, cache)] = seg
                log("   ", sh(s), [(k["name"][:50], k.get("dram__bytes_read.sum"), k.get("dram__bytes_write.sum"))
                                   for k in seg])
    log("torch ncu done at %.0f s" % (time.time() - t0))

    # (c) times without ncu
    for s in shapes():
        p = run_cmd([args.ours, "bench", "--device", "cuda", "--dtype", "bf16", "--shape", sh(s), "--json"],
                    60, logf)
        lines = [l for l in p.stdout.splitlines() if l.strip().startswith("{")]
        if lines:
            result["times"]["ours|" + sh(s)] = json.loads(lines[-1])
    p = subprocess.CompletedProcess([], 0, "", "") if args.no_torch_time else run_cmd([sys.executable, os.path.abspath(__file__), "torch-time", "--shapes"] + [sh(s) for s in shapes()],
                240, logf)
    for l in p.stdout.splitlines():
        if l.startswith("TIME "):
            r = json.loads(l[5:])
            result["times"]["torch|" + r["shape"]] = r
    json.dump(result, open(os.path.join(out, "io_measure.json"), "w"), indent=1)
    summary(result)
    log("total %.0f s" % (time.time() - t0))


def tot(ks, m):
    return sum(k.get(m, 0) or 0 for k in ks if isinstance(k.get(m, 0), (int, float)))


def summary(result):
    log("\n== per-head DRAM bytes (total / heads), read / write, MB; time ms (no ncu)")
    for s in shapes():
        heads = s[0] * s[1]
        row = [sh(s)]
        for cache in ("all", "none"):
            ks = result["ours"].get("%s|%s" % (sh(s), cache))
            if ks:
                row.append("ours[%s] %.3f/%.3f" % (cache, tot(ks, "dram__bytes_read.sum") / heads / 1e6,
                                                  tot(ks, "dram__bytes_write.sum") / heads / 1e6))
        for mode in ("bf16", "f32"):
            for cache in ("all", "none"):
                ks = result["torch"].get("%s|%s|%s" % (sh(s), mode, cache))
                if ks:
                    row.append("math%s[%s] %.3f/%.3f" % (mode, cache, tot(ks, "dram__bytes_read.sum") / heads / 1e6,
                                                        tot(ks, "dram__bytes_write.sum") / heads / 1e6))
        t = result["times"].get("ours|" + sh(s), {})
        tt = result["times"].get("torch|" + sh(s), {})
        row.append("t ours %s math_bf16 %s math_f32 %s flash %s" % (t.get("fwd_ms"), tt.get("math_bf16_ms"),
                                                                  tt.get("math_f32_ms"), tt.get("flash_ms")))
        log(" | ".join(row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["all", "torch-target", "torch-time"])
    ap.add_argument("--ours", default="./carry-cuda/flash-attn")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--modes", nargs="*", default=["bf16", "f32"])
    ap.add_argument("--caches", nargs="+", default=["all", "none"])
    ap.add_argument("--max-n-f32", type=int, default=16384)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--no-torch-time", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=[])
    args = ap.parse_args()
    if args.cmd == "all":
        driver(args)
    elif args.cmd == "torch-target":
        torch_target(args)
    else:
        torch_time(args)


if __name__ == "__main__":
    main()
