#!/usr/bin/env python3
"""DRAM bytes of attention measured with Nsight Compute, next to the IO model.

Forward mode (`all`): one forward call, (a) our CUDA forward (`flash-attn bench --device cuda`),
(b) torch SDPA's MATH backend (materialises S and P), (c) times without ncu.

Forward+backward mode (`all --backward`): one forward plus one backward call, (a) ours through
`flash-attn run --device cuda --backward` on a safetensors file written here (forward kernel
`flash_fwd`, backward kernels `flash_bwd_prep`, `flash_bwd`, `flash_bwd_convert`), (b) torch SDPA
MATH with autograd, (c) times without ncu (ours `bench --backward`, torch math and flash backends),
(d) a per-head table with the IO model's standard / FlashAttention-2 forward and backward counts
(`flash-attn io --json`), and the seeds' GPT-2 table (forward+backward, GB and ms).

    python3 io_measure.py all --ours ./carry-cuda/flash-attn --out $OUT              # forward
    python3 io_measure.py all --backward --ours ./carry-cuda/flash-attn --out $OUT   # fwd+bwd
    python3 io_measure.py torch-target --mode bf16 --shapes ...      # run under ncu (forward)
    python3 io_measure.py torch-bwd-target --mode bf16 --shapes ...  # run under ncu (fwd+bwd)
    python3 io_measure.py torch-time --shapes ...                    # times, no ncu (forward)
    python3 io_measure.py torch-bwd-time --shapes ...                # times, no ncu (fwd+bwd)
    python3 io_measure.py selftest [--ours target/release/flash-attn]  # local, no GPU needed

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
    """Runs cmd in its own process group (so that a timeout also ends ncu's target process), with a
    time limit; logs the command, its rc and its output (to `logf`)."""
    import signal
    t = time.time()
    log("$", " ".join(cmd))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        so, se = p.communicate(timeout=max(timeout, 1))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        so, se = p.communicate()
        rc = 124
        log("  TIMEOUT after", timeout, "s")
    p = subprocess.CompletedProcess(cmd, rc, so or "", se or "")
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


# ================================================================ forward + backward (`all --backward`)
SRAM = 116736  # the H100's 228 KiB of shared memory per SM, in bf16 elements (docs/io-measured.md)
SEEDS_GPT2 = {"standard": (40.3, 41.7), "flash": (4.4, 7.3)}  # seeds, A100: GB HBM R/W, ms (fwd+bwd)
R, W, T = "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum"


def bwd_shapes(args):
    """N ascending, the GPT-2 shape (the seeds' table, the headline) before the slowest N = 16384."""
    ss = [(1, HEADS, HEADS, n, n, D) for n in (args.ns or NS)]
    if not args.no_gpt2:
        ss.insert(len([s for s in ss if s[3] < 16384]), GPT2)
    return ss


# ---------------------------------------------------------------- safetensors, written by hand
def write_safetensors(path, tensors):
    """tensors: [(name, dtype, shape, raw little-endian bytes)] -> a safetensors file: 8-byte
    little-endian header length, JSON header (padded with spaces to a multiple of 8), then the data
    in the header's order (offsets relative to the start of the data)."""
    header, off = {}, 0
    for name, dtype, shape, data in tensors:
        n = 1
        for x in shape:
            n *= x
        size = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "U8": 1}[dtype]
        if len(data) != n * size:
            raise ValueError("%s: %d bytes for shape %s %s" % (name, len(data), shape, dtype))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for _, _, _, data in tensors:
            f.write(data)


def read_safetensors(path, names=None):
    """{name: (dtype, shape, raw bytes)} (for the local self-test; the data only of `names`)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        res = {}
        for name, t in header.items():
            if name == "__metadata__":
                continue
            data = None
            if names is None or name in names:
                f.seek(base + t["data_offsets"][0])
                data = f.read(t["data_offsets"][1] - t["data_offsets"][0])
            res[name] = (t["dtype"], t["shape"], data)
    return res


def rand_bf16(n, seed, backend=None):
    """n random values as raw bf16 bytes: standard normal from numpy or torch (CPU) when present,
    else (pure Python, fast) random signs and magnitudes in [2^-8, 2). The values do not change the
    traffic; they only have to be finite and of a sane size."""
    if backend in (None, "numpy"):
        try:
            import numpy as np
            x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32).view(np.uint32)
            # round to nearest even: the bf16 of x is the top 16 bits after adding 0x7fff + lsb
            x = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return x.astype("<u2").tobytes()
        except ImportError:
            pass
    if backend in (None, "torch"):
        try:
            import ctypes
            import torch
            t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).contiguous()
            return ctypes.string_at(t.data_ptr(), n * 2)
        except ImportError:
            pass
    import random
    b = bytearray(random.Random(seed).randbytes(2 * n))
    # high byte = sign bit + the top 7 exponent bits 0x3c..0x3f (exponent 120..127)
    b[1::2] = bytes(b[1::2]).translate(bytes((x & 0x80) | 0x3C | (x & 3) for x in range(256)))
    return bytes(b)


def write_bwd_input(path, s, seed=0):
    """q [b,sq,hq,d], k, v [b,sk,hk,d], dout [b,sq,hq,d] (our layout, docs/semantics.md), bf16."""
    b, hq, hk, sq, sk, d = s
    qs, ks = [b, sq, hq, d], [b, sk, hk, d]
    write_safetensors(path, [(name, "BF16", shp, rand_bf16(b * shp[1] * shp[2] * d, seed + i))
                             for i, (name, shp) in enumerate([("q", qs), ("k", ks), ("v", ks), ("dout", qs)])])


def ours_memset_bytes(s):
    """Bytes our CUDA path zeroes with cuMemsetD8Async (`alloc_zeros`, not kernels, so not in ncu's
    kernel metrics), from crates/flash-attn/src/cuda/{mod,launch}.rs: forward `out`, `lse`;
    backward dq, dk, dv, the f32 dQ accumulator, D (f32, one per row) and one semaphore."""
    b, hq, hk, sq, sk, d = s
    fwd = b * sq * hq * d * 2 + b * hq * sq * 4
    bwd = (b * sq * hq * d + 2 * b * sk * hk * d) * 2 + b * sq * hq * d * 4 + b * hq * sq * 4 + 4
    return {"fwd": fwd, "bwd": bwd}


def compulsory(s):
    """Per head, bytes: forward reads Q, K, V, writes O, LSE; backward reads Q, K, V, O, dO, LSE,
    writes dQ, dK, dV."""
    n, d = s[3], s[5]
    return {"fwd": (3 * n * d * 2, n * d * 2 + n * 4), "bwd": (5 * n * d * 2 + n * 4, 3 * n * d * 2)}


def io_model(ours, n, logf):
    p = run_cmd([ours, "io", "--n", str(n), "--d", str(D), "--sram", str(SRAM), "--dtype", "bf16", "--json"], 30, logf)
    try:
        return json.loads(p.stdout)
    except ValueError:
        return None


# ---------------------------------------------------------------- torch side (on the GPU machine)
def torch_bwd_inputs(torch, s, mode):
    q, k, v = make_inputs(torch, s)
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    return [x.requires_grad_() for x in (q, k, v)] + [dout]


def torch_bwd_target(args):
    """Under `ncu --profile-from-start off`: per shape, a warm-up forward+backward, then inside one
    cudaProfilerStart/Stop: marker, the forward, marker, the backward (torch.autograd.grad, so no
    accumulation into .grad). Two marker kernels (torch.cuda._sleep -> spin_kernel) per shape that
    printed `TARGET ... done`; shapes that fail (out of memory) in the warm-up print `skipped` and
    launch no marker."""
    torch = torch_setup(args.mode)
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    cudart = torch.cuda.cudart()
    for s in [tuple(map(int, x.split(","))) for x in args.shapes]:
        try:
            q, k, v, dout = torch_bwd_inputs(torch, s, args.mode)
            with sdpa_kernel(SDPBackend.MATH):
                o = F.scaled_dot_product_attention(q, k, v)  # warm-up (allocator, cuBLAS handles)
                torch.autograd.grad(o, (q, k, v), dout)
                del o
                torch.cuda.synchronize()
        except RuntimeError as e:  # out of memory: no marker launched
            print("TARGET", args.mode, sh(s), "skipped", str(e)[:200], flush=True)
            q = k = v = dout = o = None
            torch.cuda.empty_cache()
            continue
        with sdpa_kernel(SDPBackend.MATH):
            cudart.cudaProfilerStart()
            torch.cuda._sleep(1000)  # marker: the forward follows
            o = F.scaled_dot_product_attention(q, k, v)
            torch.cuda._sleep(1000)  # marker: the backward follows
            grads = torch.autograd.grad(o, (q, k, v), dout)
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
        print("TARGET", args.mode, sh(s), "done", flush=True)
        del q, k, v, dout, o, grads
        torch.cuda.empty_cache()


def torch_bwd_time(args):
    """Median fwd+bwd time (triton do_bench, L2 flushed between calls) of torch SDPA math (bf16 S,
    P) and flash backends."""
    torch = torch_setup("bf16")
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    from triton.testing import do_bench
    for s in [tuple(map(int, x.split(","))) for x in args.shapes]:
        row = {"shape": sh(s)}
        try:
            q, k, v, dout = torch_bwd_inputs(torch, s, "bf16")
        except RuntimeError as e:
            row["err"] = str(e)[:200]
            print("TIME", json.dumps(row), flush=True)
            continue
        for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("math_bf16", SDPBackend.MATH)]:
            def run():
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(q, k, v)
                    torch.autograd.grad(o, (q, k, v), dout)

            def fwd():
                with torch.no_grad(), sdpa_kernel(be):
                    F.scaled_dot_product_attention(q, k, v)
            try:
                row[name + "_fwdbwd_ms"] = do_bench(run, warmup=25, rep=100, return_mode="median")
                row[name + "_fwd_ms"] = do_bench(fwd, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001
                row[name + "_err"] = str(e)[:200]
            torch.cuda.empty_cache()
        print("TIME", json.dumps(row), flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the driver
def split_torch_bwd(ks, done):
    """Kernels of the torch fwd+bwd ncu run -> {shape: {"fwd": [...], "bwd": [...]}}: the marker
    kernels (spin_kernel) split the list; two segments per shape in `done` (launch order)."""
    segs, cur = [], None
    for k in ks:
        if "spin" in k["name"] or "sleep" in k["name"].lower():
            cur = []
            segs.append(cur)
        elif cur is not None:
            cur.append(k)
    res = {}
    for i, s in enumerate(done):
        if 2 * i + 1 < len(segs):
            res[s] = {"fwd": segs[2 * i], "bwd": segs[2 * i + 1]}
    return res, len(segs)


def split_ours(ks):
    """Kernels of one `flash-attn run --device cuda --backward` -> fwd (flash_fwd*), bwd
    (flash_bwd*: prep, main, convert), other (anything else ncu saw, e.g. memsets if it profiled
    them; none expected)."""
    res = {"fwd": [], "bwd": [], "other": []}
    for k in ks:
        n = k["name"]
        res["fwd" if n.startswith("flash_fwd") else "bwd" if n.startswith("flash_bwd") else "other"].append(k)
    return res


def rw(ks):
    return tot(ks, R), tot(ks, W)


def driver_bwd(args):
    out = args.out
    os.makedirs(out, exist_ok=True)
    logf = os.path.join(out, "io_bwd_commands.log")  # every command's stdout and stderr
    rawf = os.path.join(out, "io_bwd_ncu_raw.csv")   # every ncu CSV, one `# ...` line before each
    jsonf = os.path.join(out, "io_bwd.json")
    t0 = time.time()
    deadline = t0 + args.budget_s
    metrics = [R, W, T]
    ss = bwd_shapes(args)
    result = {"metrics": metrics, "shapes": [sh(s) for s in ss], "sram": SRAM, "model": {}, "ours": {},
              "torch": {}, "times": {}, "memset": {sh(s): ours_memset_bytes(s) for s in ss},
              "compulsory": {sh(s): compulsory(s) for s in ss}, "notes": []}

    def save():
        json.dump(result, open(jsonf, "w"), indent=1)

    def left(step):
        r = deadline - time.time()
        return max(0, min(step, r))

    def raw(tag, f):
        with open(rawf, "a") as g:
            g.write("# %s\n" % tag)
            g.write(open(f, errors="replace").read() if os.path.exists(f) else "(no ncu output)\n")

    # (0) the model, per N (CPU only, fast)
    for n in sorted({s[3] for s in ss}):
        result["model"][str(n)] = io_model(args.ours, n, logf)
    save()
    log("model done at %.0f s" % (time.time() - t0))

    # (1) warm the kernel cache (NVRTC compile of flash_fwd and flash_bwd, bf16 d64) without ncu
    inp, outp = "/tmp/io_bwd_in.safetensors", "/tmp/io_bwd_out.safetensors"
    write_bwd_input(inp, (1, 2, 2, 256, 256, D))
    run_cmd([args.ours, "run", "--device", "cuda", "--backward", "--input", inp, "--output", outp], left(150), logf)

    # (2) ours under ncu: one process per shape, every kernel (no name filter), one fwd + one bwd
    for cache in args.caches:
        for s in ss:
            if left(60) < 20:
                log("budget: skipping ours ncu", sh(s), cache)
                continue
            for f in (inp, outp):
                if os.path.exists(f):
                    os.remove(f)
            tw = time.time()
            write_bwd_input(inp, s)
            log("  input %s written in %.1f s (%.0f MB)" % (sh(s), time.time() - tw, os.path.getsize(inp) / 1e6))
            f = "/tmp/ncu_ours_bwd.csv"
            if os.path.exists(f):
                os.remove(f)
            cmd = ncu_base(metrics, cache) + ["--log-file", f, args.ours, "run", "--device", "cuda", "--backward",
                                              "--input", inp, "--output", outp]
            p = run_cmd(cmd, left(120), logf)
            raw("ours %s cache=%s rc=%s" % (sh(s), cache, p.returncode), f)
            ks = parse_ncu(f) if os.path.exists(f) else []
            parts = split_ours(ks)
            result["ours"]["%s|%s" % (sh(s), cache)] = dict(parts, rc=p.returncode)
            log("  ours", sh(s), cache, {k: [(x["name"], x.get(R), x.get(W)) for x in v] for k, v in parts.items()})
            save()
    for f in (inp, outp):
        if os.path.exists(f):
            os.remove(f)
    log("ours ncu done at %.0f s" % (time.time() - t0))

    # (3) torch math fwd+bwd under ncu: one process per (dtype mode, cache mode), all shapes
    for mode in args.modes:
        for cache in args.caches:
            if left(200) < 30:
                log("budget: skipping torch ncu", mode, cache)
                continue
            f = "/tmp/ncu_torch_bwd.csv"
            if os.path.exists(f):
                os.remove(f)
            tss = [s for s in ss if not (mode == "f32" and s[3] > args.max_n_f32)]
            cmd = ncu_base(metrics, cache) + ["--profile-from-start", "off", "--log-file", f,
                                              sys.executable, os.path.abspath(__file__), "torch-bwd-target",
                                              "--mode", mode, "--shapes"] + [sh(s) for s in tss]
            p = run_cmd(cmd, left(args.torch_ncu_s), logf)
            raw("torch %s cache=%s rc=%s" % (mode, cache, p.returncode), f)
            done = [l.split()[2] for l in (p.stdout or "").splitlines()
                    if l.startswith("TARGET ") and l.rstrip().endswith("done")]
            ks = parse_ncu(f) if os.path.exists(f) else []
            segs, nseg = split_torch_bwd(ks, done)
            log("  torch", mode, cache, "kernels", len(ks), "segments", nseg, "shapes done", len(done), "of", len(tss))
            for s, parts in segs.items():
                result["torch"]["%s|%s|%s" % (s, mode, cache)] = parts
                log("   ", s, "fwd", len(parts["fwd"]), "kernels R/W", rw(parts["fwd"]),
                    "bwd", len(parts["bwd"]), "kernels R/W", rw(parts["bwd"]))
            save()
    log("torch ncu done at %.0f s" % (time.time() - t0))

    # (4) times without ncu: ours (bench --backward: fwd_ms and fwdbwd_ms), then torch
    for s in ss:
        if left(60) < 10:
            log("budget: skipping ours time", sh(s))
            continue
        p = run_cmd([args.ours, "bench", "--device", "cuda", "--dtype", "bf16", "--shape", sh(s), "--backward",
                     "--json"], left(60), logf)
        lines = [l for l in (p.stdout or "").splitlines() if l.strip().startswith("{")]
        if lines:
            result["times"]["ours|" + sh(s)] = json.loads(lines[-1])
    save()
    if not args.no_torch_time and left(180) > 20:
        p = run_cmd([sys.executable, os.path.abspath(__file__), "torch-bwd-time", "--shapes"] + [sh(s) for s in ss],
                    left(180), logf)
        for l in (p.stdout or "").splitlines():
            if l.startswith("TIME "):
                r = json.loads(l[5:])
                result["times"]["torch|" + r["shape"]] = r
    save()
    lines = summary_bwd(result)
    with open(os.path.join(out, "io_bwd_summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("total %.0f s" % (time.time() - t0))


# ---------------------------------------------------------------- the summary
def _mb(x, heads):
    return "-" if x is None else "%.3f" % (x / heads / 1e6)


def _rw(pair, heads):
    return "-" if pair is None else "%s / %s" % (_mb(pair[0], heads), _mb(pair[1], heads))


def _model_rw(model, key):
    t = (model or {}).get(key)
    return None if not t else (t["read_bytes"], t["write_bytes"])


def _ratio(a, b):
    return "-" if not a or not b else "%.2f" % (a / b)


def _ms(x):
    return "-" if x is None else "%.3f" % x


def summary_bwd(result, cache="all", mode="bf16"):
    """Markdown tables from `result` (the JSON the driver writes): per head (bytes / (b·h)), MB.
    Printed, and returned as a list of lines."""
    lines = []

    def log(*a):
        lines.append(" ".join(map(str, a)))
        print(*a, flush=True)
    ss = sorted((tuple(map(int, x.split(","))) for x in result["shapes"]), key=lambda s: (s[3], s[0]))
    log("\n== Per head (total / (b·hq)), one forward + one backward call, DRAM R / W in MB "
        "(ncu --cache-control %s; ours = flash_fwd + flash_bwd_prep/flash_bwd/flash_bwd_convert; "
        "math = torch SDPA MATH, %s S and P). Model: flash-attn io --sram %d --dtype bf16." % (cache, mode, SRAM))
    log("| shape | model std fwd | model std bwd | **math fwd** | **math bwd** | math / std model (fwd+bwd) "
        "| model FA2 fwd | model FA2 bwd | compulsory bwd | **ours fwd** | **ours bwd** | ours / FA2 model (fwd+bwd) "
        "| math / ours (fwd+bwd) | ours memset fwd / bwd (not measured) |")
    log("|---" * 14 + "|")
    for s in ss:
        heads = s[0] * s[1]
        m = result["model"].get(str(s[3]))
        mstd_f, mstd_b = _model_rw(m, "algorithm0"), _model_rw(m, "standard_backward")
        mfa_f, mfa_b = _model_rw(m, "fa2_forward"), _model_rw(m, "fa2_backward")
        tp = result["torch"].get("%s|%s|%s" % (sh(s), mode, cache))
        op = result["ours"].get("%s|%s" % (sh(s), cache))
        tf, tb = (rw(tp["fwd"]), rw(tp["bwd"])) if tp else (None, None)
        of, ob = (rw(op["fwd"]), rw(op["bwd"])) if op and op["fwd"] else (None, None)
        if op and op["bwd"] == []:
            ob = None
        comp = result["compulsory"][sh(s)]["bwd"]
        ms = result["memset"][sh(s)]
        t_total = sum(tf) + sum(tb) if tf and tb else None
        o_total = sum(of) + sum(ob) if of and ob else None
        std_total = sum(mstd_f) + sum(mstd_b) if mstd_f and mstd_b else None
        fa_total = sum(mfa_f) + sum(mfa_b) if mfa_f and mfa_b else None
        log("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s |" % (
            sh(s), _rw(mstd_f, 1), _rw(mstd_b, 1), _rw(tf, heads), _rw(tb, heads), _ratio(t_total, std_total and std_total * heads),
            _rw(mfa_f, 1), _rw(mfa_b, 1), _rw(comp, 1), _rw(of, heads), _rw(ob, heads),
            _ratio(o_total, fa_total and fa_total * heads), _ratio(t_total, o_total),
            _mb(ms["fwd"], heads), _mb(ms["bwd"], heads)))
        if op and op.get("other"):
            log("   (ours, other kernels seen by ncu: %s)" % [(k["name"], k.get(R), k.get(W)) for k in op["other"]])
    log("\n== Times (whole call, all heads, no ncu), ms; ours from `flash-attn bench --backward` (median, "
        "back-to-back), torch from triton do_bench (median, L2 flushed)")
    log("| shape | ours fwd | ours fwd+bwd | torch flash fwd | torch flash fwd+bwd | math fwd | math fwd+bwd "
        "| math / ours (fwd+bwd) | ours kernels under ncu: fwd / bwd |")
    log("|---" * 9 + "|")
    for s in ss:
        t = result["times"].get("ours|" + sh(s), {})
        tt = result["times"].get("torch|" + sh(s), {})
        op = result["ours"].get("%s|%s" % (sh(s), cache)) or {"fwd": [], "bwd": []}
        kt = "%s / %s" % (_ms(tot(op["fwd"], T) / 1e6 if op["fwd"] else None),
                          _ms(tot(op["bwd"], T) / 1e6 if op["bwd"] else None))
        log("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            sh(s), _ms(t.get("fwd_ms")), _ms(t.get("fwdbwd_ms")), _ms(tt.get("flash_fwd_ms")),
            _ms(tt.get("flash_fwdbwd_ms")), _ms(tt.get("math_bf16_fwd_ms")), _ms(tt.get("math_bf16_fwdbwd_ms")),
            _ratio(tt.get("math_bf16_fwdbwd_ms"), t.get("fwdbwd_ms")), kt))

    # the seeds' GPT-2 table
    g = sh(GPT2)
    if g not in result["shapes"]:
        return lines
    heads = GPT2[0] * GPT2[1]
    m = result["model"].get(str(GPT2[3])) or {}
    tp = result["torch"].get("%s|%s|%s" % (g, mode, cache))
    op = result["ours"].get("%s|%s" % (g, cache))
    t = result["times"].get("ours|" + g, {})
    tt = result["times"].get("torch|" + g, {})

    def gb(x):
        return "-" if x is None else "%.2f" % (x / 1e9)

    def row(name, r, w, ms):
        total = None if r is None or w is None else r + w
        log("| %s | %s | %s | %s | %s |" % (name, gb(r), gb(w), gb(total), _ms(ms)))
    log("\n== GPT-2 medium (b = 64, h = 16, N = 1024, d = 64, bf16; %d heads), forward + backward, "
        "HBM (DRAM) R / W in GB, time in ms" % heads)
    log("| | DRAM read | DRAM write | total | time |")
    log("|---|---|---|---|---|")
    log("| seeds (A100): standard attention | | | %.1f | %.1f |" % SEEDS_GPT2["standard"])
    log("| seeds (A100): FlashAttention | | | %.1f | %.1f |" % SEEDS_GPT2["flash"])
    for key, name in [("standard_training", "IO model: standard fwd + bwd"),
                      ("fa2_training", "IO model: FA2 fwd + bwd (M = %d)" % SRAM)]:
        mt = m.get(key)
        row(name, mt and mt["read_bytes"] * heads, mt and mt["write_bytes"] * heads, None)
    if tp:
        r = rw(tp["fwd"] + tp["bwd"])
        row("torch MATH (bf16 S, P), measured", r[0], r[1], tt.get("math_bf16_fwdbwd_ms"))
    else:
        row("torch MATH (bf16 S, P), measured", None, None, tt.get("math_bf16_fwdbwd_ms"))
    if op and op["fwd"] and op["bwd"]:
        r = rw(op["fwd"] + op["bwd"])
        row("ours (flash_fwd + flash_bwd*), measured", r[0], r[1], t.get("fwdbwd_ms"))
    else:
        row("ours (flash_fwd + flash_bwd*), measured", None, None, t.get("fwdbwd_ms"))
    row("torch flash (FA2), time only", None, None, tt.get("flash_fwdbwd_ms"))
    ms = result["memset"][g]
    log("(ours also zeroes %.2f GB with cuMemsetD8 (out, lse, dq/dk/dv, dQ accumulator, D), not kernels, "
        "not in the measured columns)" % ((ms["fwd"] + ms["bwd"]) / 1e9))
    return lines


# ---------------------------------------------------------------- local self-test (no GPU)
FAKE_NCU = '''==PROF== Connected to process 4242 (/x/flash-attn)
==PROF== Profiling "flash_fwd": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","flash-attn","127.0.0.1","flash_fwd","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","3,170,304"
"0","4242","flash-attn","127.0.0.1","flash_fwd","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"0","4242","flash-attn","127.0.0.1","flash_fwd","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","15,104"
"1","4242","flash-attn","127.0.0.1","flash_bwd_prep","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,097,152"
"1","4242","flash-attn","127.0.0.1","flash_bwd_prep","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"1","4242","flash-attn","127.0.0.1","flash_bwd_prep","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","4,000"
"2","4242","flash-attn","127.0.0.1","flash_bwd","1","7","(128, 1, 1)","(128, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","5,300,000"
"2","4242","flash-attn","127.0.0.1","flash_bwd","1","7","(128, 1, 1)","(128, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","1,000,000"
"2","4242","flash-attn","127.0.0.1","flash_bwd","1","7","(128, 1, 1)","(128, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","60,000"
"3","4242","flash-attn","127.0.0.1","flash_bwd_convert","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","2,097,152"
"3","4242","flash-attn","127.0.0.1","flash_bwd_convert","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"3","4242","flash-attn","127.0.0.1","flash_bwd_convert","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,000"
==PROF== Disconnected from process 4242
'''


def fake_torch_csv(nshapes):
    """A torch-like ncu CSV: per shape spin, 3 fwd kernels, spin, 4 bwd kernels."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    rows, i = [head], 0
    for s in range(nshapes):
        for part, names in (("fwd", ["gemm", "softmax", "gemm"]), ("bwd", ["gemm", "gemm", "softmax_bwd", "gemm"])):
            for name in ["spin_kernel(long)"] + names:
                for m, u, v in ((R, "byte", 1000 * (s + 1)), (W, "byte", 500 * (s + 1)), (T, "nsecond", 10)):
                    if name.startswith("spin"):
                        v = 0
                    rows.append('"%d","1","python3","h","%s","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","x","%s","%s","%s"\n'
                                % (i, name, m, u, "{:,}".format(v)))
                i += 1
    return "==PROF== Connected\n" + "".join(rows)


def selftest(args):
    import tempfile
    ok = True

    def check(cond, what):
        nonlocal ok
        log(("ok   " if cond else "FAIL ") + what)
        ok = ok and cond
    tmp = tempfile.mkdtemp(prefix="io_measure_selftest_")
    # 1. safetensors writer: read back here, and (with --ours) by the CLI on the CPU
    s = (1, 2, 2, 33, 33, 16)
    inp, outp = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
    write_bwd_input(inp, s)
    back = read_safetensors(inp)
    check(sorted(back) == ["dout", "k", "q", "v"] and back["q"][1] == [1, 33, 2, 16] and back["q"][0] == "BF16"
          and len(back["dout"][2]) == 33 * 2 * 16 * 2, "safetensors header and sizes read back")
    with open(inp, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    check(n % 8 == 0 and os.path.getsize(inp) == 8 + n + 4 * 33 * 2 * 16 * 2, "safetensors layout (8-aligned header, no gaps)")
    import struct
    vals = [struct.unpack("<f", struct.pack("<I", x << 16))[0] for x in struct.unpack("<16H", back["q"][2][:32])]
    check(all(abs(v) < 8 for v in vals) and len(set(vals)) > 8, "bf16 values look standard-normal: %s" % vals[:4])
    if args.ours:
        p = subprocess.run([args.ours, "run", "--backward", "--input", inp, "--output", outp], capture_output=True, text=True)
        check(p.returncode == 0, "CLI (cpu) accepts the file: rc %d %s" % (p.returncode, p.stderr.strip()[-300:]))
        if p.returncode == 0:
            o = read_safetensors(outp, names=())
            check(sorted(o) == ["dk", "dq", "dv", "lse", "out"] and o["dq"][:2] == ("BF16", [1, 33, 2, 16])
                  and o["lse"][:2] == ("F32", [1, 2, 33]), "CLI output: %s" % {k: v[:2] for k, v in o.items()})
        m = io_model(args.ours, 1024, os.path.join(tmp, "cmd.log"))
        check(bool(m) and all(k in m for k in ("algorithm0", "fa2_forward", "standard_backward", "fa2_backward",
                                                 "standard_training", "fa2_training")), "flash-attn io --json keys")
    else:
        m = None
    # 2. ncu CSV parsing: ours
    f = os.path.join(tmp, "ours.csv")
    open(f, "w").write(FAKE_NCU)
    parts = split_ours(parse_ncu(f))
    check([k["name"] for k in parts["fwd"]] == ["flash_fwd"]
          and [k["name"] for k in parts["bwd"]] == ["flash_bwd_prep", "flash_bwd", "flash_bwd_convert"]
          and parts["other"] == [], "ours kernels split fwd / bwd")
    check(rw(parts["fwd"]) == (3170304.0, 0.0) and rw(parts["bwd"]) == (9494304.0, 1000000.0), "ours bytes summed: %s %s"
          % (rw(parts["fwd"]), rw(parts["bwd"])))
    # 3. torch: 3 shapes launched, the 2nd skipped (no markers) -> 2 done
    f = os.path.join(tmp, "torch.csv")
    open(f, "w").write(fake_torch_csv(2))
    segs, nseg = split_torch_bwd(parse_ncu(f), ["1,16,16,512,512,64", "1,16,16,2048,2048,64"])
    check(nseg == 4 and len(segs["1,16,16,512,512,64"]["fwd"]) == 3 and len(segs["1,16,16,2048,2048,64"]["bwd"]) == 4
          and rw(segs["1,16,16,2048,2048,64"]["bwd"]) == (8000.0, 4000.0), "torch kernels split by markers")
    # 4. the summary from fake data (every column filled for two shapes, GPT-2 partly missing)
    ss = [(1, 16, 16, 512, 512, 64), (1, 16, 16, 1024, 1024, 64), GPT2]
    fake_model = m or {k: {"read_bytes": 1000, "write_bytes": 500} for k in
                       ("algorithm0", "fa2_forward", "standard_backward", "fa2_backward", "standard_training", "fa2_training")}
    result = {"shapes": [sh(x) for x in ss], "model": {"512": fake_model, "1024": fake_model},
              "ours": {sh(ss[0]) + "|all": parts, sh(GPT2) + "|all": dict(parts, other=parts["fwd"])},
              "torch": {sh(ss[0]) + "|bf16|all": segs["1,16,16,512,512,64"],
                        sh(GPT2) + "|bf16|all": segs["1,16,16,2048,2048,64"]},
              "times": {"ours|" + sh(ss[0]): {"fwd_ms": 0.015, "fwdbwd_ms": 0.08},
                        "torch|" + sh(ss[0]): {"flash_fwd_ms": 0.07, "flash_fwdbwd_ms": 0.2, "math_bf16_fwd_ms": 0.3,
                                               "math_bf16_fwdbwd_ms": 0.9},
                        "ours|" + sh(GPT2): {"fwd_ms": 0.98, "fwdbwd_ms": 4.0}},
              "memset": {sh(x): ours_memset_bytes(x) for x in ss}, "compulsory": {sh(x): compulsory(x) for x in ss}}
    json.loads(json.dumps(result))
    lines = summary_bwd(result)
    check(len(lines) > 15 and all(l.count("|") in (0, 10, 15, 6) for l in lines if l.startswith("|")),
          "summary printed from fake data (%d lines, tables well-formed)" % len(lines))
    check(ours_memset_bytes(GPT2)["bwd"] == (3 * 67108864 * 2 + 67108864 * 4 + 1048576 * 4 + 4), "memset bytes of GPT-2")
    log("selftest", "PASSED" if ok else "FAILED", "(files in %s)" % tmp)
    sys.exit(0 if ok else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["all", "torch-target", "torch-time", "torch-bwd-target", "torch-bwd-time",
                                    "selftest"])
    ap.add_argument("--backward", action="store_true",
                    help="with `all`: forward + backward (ours via `run --backward`, torch math with autograd)")
    ap.add_argument("--ours", default=None, help="the CUDA-built flash-attn (default ./carry-cuda/flash-attn; "
                    "for selftest an optional CPU build to check the safetensors file against)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--modes", nargs="*", default=None, help="torch math S/P dtype modes (default: forward "
                    "bf16 f32; backward bf16)")
    ap.add_argument("--caches", nargs="+", default=None, help="ncu --cache-control modes (default: forward "
                    "all none; backward all)")
    ap.add_argument("--max-n-f32", type=int, default=16384)
    ap.add_argument("--budget-s", type=float, default=None, help="forward: seconds after which torch ncu "
                    "runs are skipped (300); backward: deadline for every step (460)")
    ap.add_argument("--torch-ncu-s", type=float, default=200, help="backward: time limit of the torch ncu process")
    ap.add_argument("--ns", type=int, nargs="*", default=None, help="backward: sequence lengths (default 512..16384)")
    ap.add_argument("--no-gpt2", action="store_true", help="backward: leave out the GPT-2 shape")
    ap.add_argument("--no-torch-time", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=[])
    args = ap.parse_args()
    if args.cmd != "selftest" and args.ours is None:
        args.ours = "./carry-cuda/flash-attn"
    if args.modes is None:
        args.modes = ["bf16"] if args.backward else ["bf16", "f32"]
    if args.caches is None:
        args.caches = ["all"] if args.backward else ["all", "none"]
    if args.budget_s is None:
        args.budget_s = 460 if args.backward else 300
    if args.cmd == "all":
        driver_bwd(args) if args.backward else driver(args)
    elif args.cmd == "torch-target":
        torch_target(args)
    elif args.cmd == "torch-time":
        torch_time(args)
    elif args.cmd == "torch-bwd-target":
        torch_bwd_target(args)
    elif args.cmd == "torch-bwd-time":
        torch_bwd_time(args)
    else:
        selftest(args)


if __name__ == "__main__":
    main()
