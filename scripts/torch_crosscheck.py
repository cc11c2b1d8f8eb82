#!/usr/bin/env python3
"""Outside-tool conformance check of `flash-attn run` against PyTorch.

The reference is computed independently in torch float64, exactly per DESIGN.md §2; the
tolerance follows the numerics contract of §2:

    max|ours - ref64| <= 2 * max|naive_T - ref64| + eps_T * max(1, magnitude)

where naive_T is Algorithm 0 computed in the input dtype (scores from a matmul in the dtype,
softmax in float32 then cast to the dtype, P@V in the dtype), and eps_T and the magnitude are the
project's (docs/semantics.md): eps_T = 2^-18 (f32 forward), 2^-16 (f32 gradients), 4 * 2^-10
(f16), 4 * 2^-7 (bf16), twice those for f16/bf16 gradients; magnitude = max|ref| of the output, or for gradients the largest max|ref|
of dq, dk, dv. -inf LSE positions (fully masked rows) must match exactly.

Modes:
    torch_crosscheck.py --bin PATH [--cases N] [--seed S] [--backward] [--keep DIR]
    torch_crosscheck.py --bin PATH --bad-inputs
    torch_crosscheck.py --self-test        (no binary needed)

See scripts/README.md.
"""
import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAME = {v: k for k, v in DTYPES.items()}
EPS = {torch.float32: 2.0 ** -18, torch.float16: 4 * 2.0 ** -10, torch.bfloat16: 4 * 2.0 ** -7}
EPS_GRAD = {torch.float32: 2.0 ** -16, torch.float16: 8 * 2.0 ** -10, torch.bfloat16: 8 * 2.0 ** -7}
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Reference (Algorithm 0), float64 oracle and naive_T
# --------------------------------------------------------------------------------------------

def sequences(t):
    """Yield (batch index, q slice, k slice, v slice) per sequence; slices are views [s, h, d]."""
    q, k, v = t["q"], t["k"], t["v"]
    if "cu_seqlens_q" in t:
        cq = [int(x) for x in t["cu_seqlens_q"].tolist()]
        ck = [int(x) for x in t["cu_seqlens_k"].tolist()]
        for bi in range(len(cq) - 1):
            yield bi, q[cq[bi]:cq[bi + 1]], k[ck[bi]:ck[bi + 1]], v[ck[bi]:ck[bi + 1]]
    else:
        for bi in range(q.shape[0]):
            yield bi, q[bi], k[bi], v[bi]


def visibility(sq, sk, bi, hq, opts, block_mask, bug=None):
    """Boolean [1 or hq, sq, sk] visibility per §2.4 (within one sequence)."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    off = sk - sq
    vis = torch.ones(sq, sk, dtype=torch.bool)
    causal = opts.get("causal")
    if bug == "causal_tl" and causal == "br":
        causal = "tl"
    if causal == "br":
        vis &= j <= i + off
    elif causal == "tl":
        vis &= j <= i
    win = opts.get("window")
    if win is not None:
        left, right = win
        if bug == "window_swap":
            left, right = right, left
        if left >= 0:
            vis &= j >= i + off - left
        if right >= 0:
            vis &= j <= i + off + right
    vis = vis.unsqueeze(0)
    if block_mask is not None:
        bq, bk = opts["block_size"]
        m = block_mask if block_mask.dim() == 2 else block_mask[bi]
        m = m != 0
        qi = torch.arange(sq) // bq
        kj = torch.arange(sk) // bk
        mv = m[..., qi, :][..., kj]
        vis = vis & (mv if mv.dim() == 3 else mv.unsqueeze(0))
    return vis.expand(hq, sq, sk)


# --------------------------------------------------------------------------------------------
# Dropout: Philox4x32-10 keep mask, written here from the definition in docs/semantics.md (not
# from the Rust code), so a mismatch in either shows.
# --------------------------------------------------------------------------------------------

_U32 = 0xFFFFFFFF


def philox4x32_10(c, k0, k1):
    """c: list of 4 numpy uint64 arrays holding u32 values; k0, k1: ints. Returns 4 arrays."""
    import numpy as np
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    c = [x.astype(np.uint64) for x in c]
    for r in range(10):
        if r:
            k0 = (k0 + 0x9E3779B9) & _U32
            k1 = (k1 + 0xBB67AE85) & _U32
        p0 = m0 * c[0]          # < 2^64: exact in uint64
        p1 = m1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(_U32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(_U32)
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
    return c


def keep_factors(p, seed, offset, bi, hq, sq, sk):
    """[hq, sq, sk] float64 tensor: 1/(1-p) (as f32) where kept, 0 where dropped."""
    import numpy as np
    h, i, j = np.meshgrid(np.arange(hq), np.arange(sq), np.arange(sk), indexing="ij")
    cnt = [(j // 4).astype(np.uint64), i.astype(np.uint64),
           ((bi * hq + h) & _U32).astype(np.uint64), np.full(h.shape, offset, dtype=np.uint64)]
    words = philox4x32_10(cnt, seed & _U32, (seed >> 32) & _U32)
    lane = j % 4
    u = np.choose(lane, words)
    threshold = math.ceil(float(np.float32(p)) * 2.0 ** 32)
    scale = float(np.float32(1.0) / (np.float32(1.0) - np.float32(p)))
    return torch.from_numpy(np.where(u >= threshold, scale, 0.0))


def reference(t, opts, mode, backward=False, bug=None):
    """Algorithm 0 over tensors `t` (as in the input file) and CLI options `opts`.

    mode 'f64': everything in float64 (the oracle).
    mode 'naive': naive_T: scores/softcap in the input dtype, mask+softmax+lse in float32,
                  P cast to the dtype, P@V in the dtype.
    Returns dict with out, lse and, if backward, dq, dk, dv.
    """
    T = t["q"].dtype
    work = torch.float64 if mode == "f64" else T
    q = t["q"].to(work).detach().clone()
    k = t["k"].to(work).detach().clone()
    v = t["v"].to(work).detach().clone()
    if backward:
        for x in (q, k, v):
            x.requires_grad_(True)
    tt = dict(t, q=q, k=k, v=v)
    varlen = "cu_seqlens_q" in t
    slopes = t.get("alibi_slopes")
    block_mask = t.get("block_mask")
    softcap = opts.get("softcap")
    if bug == "no_softcap":
        softcap = None
    outs, lses = [], []
    with torch.set_grad_enabled(backward):
        for bi, qs, ks, vs in sequences(tt):
            sq, hq, d = qs.shape
            sk, hk, _ = ks.shape
            g = hq // hk
            if bug == "gqa_mod":
                idx = torch.arange(hq) % hk
            else:
                idx = torch.arange(hq) // g
            qh = qs.transpose(0, 1)                      # [hq, sq, d]
            kh = ks[:, idx].transpose(0, 1)              # [hq, sk, d]
            vh = vs[:, idx].transpose(0, 1)              # [hq, sk, dv]
            scale = opts.get("scale")
            if scale is None:
                scale = 1.0 / math.sqrt(d)
            s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if mode != "f64":
                s = s.float()
            if slopes is not None:
                m = slopes if slopes.dim() == 1 else slopes[bi]
                m = m.to(s.dtype).view(hq, 1, 1)
                off = sk - sq if bug != "alibi_no_off" else 0
                dist = (torch.arange(sq).unsqueeze(1) + off - torch.arange(sk).unsqueeze(0)).abs()
                s = s - m * dist.to(s.dtype)
            vis = visibility(sq, sk, bi, hq, opts, block_mask, bug)
            row_any = vis.any(-1, keepdim=True)
            sm = torch.where(vis, s, torch.full_like(s, NEG_INF))
            lse = torch.logsumexp(sm.detach(), dim=-1)                 # [hq, sq]
            safe = torch.where(row_any, sm, torch.zeros_like(sm))
            p = torch.where(vis, torch.softmax(safe, dim=-1), torch.zeros_like(safe))
            p = p.to(work)
            if "dropout" in opts:
                dp, dseed, doff = opts["dropout"]
                p = (p * keep_factors(dp, dseed, doff, bi, hq, sq, sk).to(p.dtype)).to(work)
            o = torch.matmul(p, vh)                                     # [hq, sq, dv]
            outs.append(o.transpose(0, 1))                              # [sq, hq, dv]
            lses.append(lse.float() if mode != "f64" else lse)
        if varlen:
            out = torch.cat(outs, 0)
            lse = torch.cat(lses, 1)
        else:
            out = torch.stack(outs, 0)
            lse = torch.stack(lses, 0)
        res = {"out": out, "lse": lse}
        if backward:
            dout = t["dout"].to(out.dtype)
            out.backward(dout)
            res.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return {kk: vv.detach() for kk, vv in res.items()}


# --------------------------------------------------------------------------------------------
# Random cases
# --------------------------------------------------------------------------------------------

def rand_len(rng, allow_zero=False):
    r = rng.random()
    if allow_zero and r < 0.12:
        return 0
    if r < 0.22:
        return 1
    if r < 0.45:
        return rng.randint(2, 20)
    if r < 0.6:
        return rng.choice([16, 31, 32, 33, 63, 64, 65, 127, 128, 129])
    return rng.randint(2, 150)


def rand_dim(rng):
    if rng.random() < 0.35:
        return rng.choice([8, 16, 32, 64, 80, 96, 128, 160])
    return rng.randint(1, 160)


def gen_case(seed, idx, backward):
    rng = random.Random(f"{seed}:{idx}")
    gen = torch.Generator().manual_seed((seed * 1000003 + idx) % (2**63))
    dtn = rng.choice(list(DTYPES))
    T = DTYPES[dtn]
    b = rng.randint(1, 3)
    hq = rng.choice([1, 2, 3, 4, 6, 8])
    hk = rng.choice([x for x in range(1, hq + 1) if hq % x == 0])
    d = rand_dim(rng)
    dv = d if rng.random() < 0.5 else rand_dim(rng)
    varlen = rng.random() < 0.3
    if varlen:
        lq = [rand_len(rng, True) for _ in range(b)]
        lk = [rand_len(rng, True) for _ in range(b)]
        if sum(lq) == 0:
            lq[rng.randrange(b)] = rng.randint(1, 40)
        if sum(lk) == 0:
            lk[rng.randrange(b)] = rng.randint(1, 40)
    else:
        lq = [rand_len(rng)] * b
        lk = [rand_len(rng)] * b
    opts = {}
    r = rng.random()
    if r < 0.3:
        opts["causal"] = "br"
    elif r < 0.45:
        opts["causal"] = "tl"
    if rng.random() < 0.3:
        opts["window"] = [rng.randint(-1, 40), rng.randint(-1, 40)]
    if rng.random() < 0.25:
        opts["softcap"] = float(rng.randint(5, 50))
    if rng.random() < 0.25:
        opts["scale"] = rng.randint(3, 128) / 64.0      # exact in f32
    alibi = rng.choice([None, None, None, "h", "bh"])
    block = None
    if rng.random() < 0.25:
        bsz = [1, 3, 7, 16, 17, 32, 64, 128]
        opts["block_size"] = [rng.choice(bsz), rng.choice(bsz)]
        block = {"shape": rng.choice(["2d", "4d"]), "dtype": rng.choice(["u8", "bool"]),
                 "density": rng.choice([0.3, 0.6, 0.9])}

    if rng.random() < 0.3:
        # p with a short binary expansion, so the CLI's f32 parse and ours agree exactly.
        opts["dropout"] = [rng.choice([0.125, 0.25, 0.5, 0.3]), rng.randrange(2**64), rng.randrange(2**32)]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(T)

    t = {}
    if varlen:
        tq, tk = sum(lq), sum(lk)
        t["q"] = randn(tq, hq, d)
        t["k"] = randn(tk, hk, d)
        t["v"] = randn(tk, hk, dv)
        t["cu_seqlens_q"] = torch.tensor([0] + list(_cumsum(lq)), dtype=torch.int32)
        t["cu_seqlens_k"] = torch.tensor([0] + list(_cumsum(lk)), dtype=torch.int32)
        out_shape = (tq, hq, dv)
    else:
        t["q"] = randn(b, lq[0], hq, d)
        t["k"] = randn(b, lk[0], hk, d)
        t["v"] = randn(b, lk[0], hk, dv)
        out_shape = (b, lq[0], hq, dv)
    if alibi == "h":
        t["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.5
    elif alibi == "bh":
        t["alibi_slopes"] = torch.rand(b, hq, generator=gen) * 0.5
    if block is not None:
        bq, bk = opts["block_size"]
        qb = -(-max(lq) // bq)
        kb = -(-max(lk) // bk)
        shape = (qb, kb) if block["shape"] == "2d" else (b, hq, qb, kb)
        m = torch.rand(*shape, generator=gen) < block["density"]
        t["block_mask"] = m if block["dtype"] == "bool" else m.to(torch.uint8)
    if backward:
        t["dout"] = randn(*out_shape)
    desc = {"idx": idx, "dtype": dtn, "b": b, "hq": hq, "hk": hk, "d": d, "dv": dv,
            "varlen": varlen, "seqlens_q": lq, "seqlens_k": lk, "alibi": alibi,
            "block": block, **opts}
    return t, opts, desc


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def cli_args(opts, backward):
    a = []
    if opts.get("causal") == "br":
        a.append("--causal")
    elif opts.get("causal") == "tl":
        a.append("--causal-top-left")
    if "window" in opts:
        a.append("--window=%d,%d" % tuple(opts["window"]))
    if "softcap" in opts:
        a += ["--softcap", repr(opts["softcap"])]
    if "scale" in opts:
        a += ["--scale", repr(opts["scale"])]
    if "block_size" in opts:
        a += ["--block-size", "%d,%d" % tuple(opts["block_size"])]
    if "dropout" in opts:
        p, seed, offset = opts["dropout"]
        a += ["--dropout", repr(p), "--seed", str(seed), "--offset", str(offset)]
    if backward:
        a.append("--backward")
    return a


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

def _amax(x):
    return float(x.abs().max()) if x.numel() else 0.0


def compare(name, ours, ref, naive, T, problems, expect_dtype, expect_shape, magnitude=0.0, eps=None):
    """Numerics contract on one tensor; appends messages to problems; returns error summary.

    The floor is eps_T * max(1, magnitude, max|ref|); magnitude > 0 only with
    --grad-magnitude shared (the largest |ref| over dq, dk, dv, as `flash-attn check` does)."""
    if ours is None:
        problems.append(f"{name}: missing in output")
        return None
    if ours.dtype != expect_dtype:
        problems.append(f"{name}: dtype {ours.dtype} != {expect_dtype}")
        return None
    if tuple(ours.shape) != tuple(expect_shape):
        problems.append(f"{name}: shape {tuple(ours.shape)} != {tuple(expect_shape)}")
        return None
    o, r, n = ours.double(), ref.double(), naive.double()
    r_inf = torch.isneginf(r)
    if bool(r_inf.any()) or bool(torch.isneginf(o).any()):
        o_inf = torch.isneginf(o)
        bad = int((o_inf != r_inf).sum())
        if bad:
            problems.append(f"{name}: {bad} positions where -inf does not match "
                            f"(ref -inf: {int(r_inf.sum())}, ours -inf: {int(o_inf.sum())})")
        fin = ~r_inf
        o, r, n = o[fin], r[fin], n[fin]
    nonfinite = int((~torch.isfinite(o)).sum())
    if nonfinite:
        problems.append(f"{name}: {nonfinite} non-finite values where the reference is finite")
        o = torch.where(torch.isfinite(o), o, torch.zeros_like(o))
    err = _amax(o - r)
    nerr = _amax(n - r)
    tol = 2 * nerr + (eps or EPS)[T] * max(1.0, magnitude, _amax(r))
    if not err <= tol:
        problems.append(f"{name}: max err {err:.3e} > tol {tol:.3e} (naive err {nerr:.3e})")
    return err, tol


def check_outputs(t, opts, res, backward, shared_grad_magnitude=False):
    T = t["q"].dtype
    ref = reference(t, opts, "f64", backward)
    naive = reference(t, opts, "naive", backward)
    problems = []
    summ = {}
    summ["out"] = compare("out", res.get("out"), ref["out"], naive["out"], T, problems, T,
                          ref["out"].shape)
    summ["lse"] = compare("lse", res.get("lse"), ref["lse"], naive["lse"], T, problems,
                          torch.float32, ref["lse"].shape)
    if backward:
        mag = max(_amax(ref[g]) for g in ("dq", "dk", "dv")) if shared_grad_magnitude else 0.0
        for g, src in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            summ[g] = compare(g, res.get(g), ref[g], naive[g], T, problems, t[src].dtype,
                              t[src].shape, mag, EPS_GRAD)
    # rows with no visible key: out = 0 and no gradient, exactly (§2.5)
    dead = torch.isneginf(ref["lse"])
    if bool(dead.any()):
        dead = dead.t() if "cu_seqlens_q" in t else dead.transpose(1, 2)   # out's row layout
        for name in (("out", "dq") if backward else ("out",)):
            x = res.get(name)
            if x is not None and tuple(x.shape[:-1]) == tuple(dead.shape):
                nz = int((x[dead] != 0).any(-1).sum())
                if nz:
                    problems.append(f"{name}: {nz} fully masked rows are not exactly 0")
    return problems, summ


# --------------------------------------------------------------------------------------------
# Running the binary
# --------------------------------------------------------------------------------------------

def run_bin(binary, inp, outp, args, extra, timeout):
    cmd = [binary, "run", "--input", inp, "--output", outp] + args + extra
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return cmd, None, "", f"timeout after {timeout}s"
    return cmd, p.returncode, p.stdout, p.stderr


def shape_str(desc):
    s = f"{desc['dtype']} b={desc['b']} hq={desc['hq']} hk={desc['hk']} d={desc['d']} dv={desc['dv']}"
    if desc["varlen"]:
        s += f" varlen sq={desc['seqlens_q']} sk={desc['seqlens_k']}"
    else:
        s += f" sq={desc['seqlens_q'][0]} sk={desc['seqlens_k'][0]}"
    if desc["alibi"]:
        s += f" alibi={'[hq]' if desc['alibi'] == 'h' else '[b,hq]'}"
    if desc["block"]:
        s += f" block_mask={desc['block']['shape']}/{desc['block']['dtype']}"
    return s


def crosscheck(a):
    extra = a.extra_args.split() if a.extra_args else []
    work = tempfile.mkdtemp(prefix="fa-xcheck-")
    passed = failed = 0
    worst = {}
    indices = [a.only] if a.only is not None else range(a.cases)
    try:
        for idx in indices:
            t, opts, desc = gen_case(a.seed, idx, a.backward)
            inp = os.path.join(work, "in.safetensors")
            outp = os.path.join(work, "out.safetensors")
            if os.path.exists(outp):
                os.remove(outp)
            save_file({k: v.contiguous() for k, v in t.items()}, inp)
            args = cli_args(opts, a.backward)
            cmd, rc, so, se = run_bin(a.bin, inp, outp, args, extra, a.timeout)
            problems = []
            if rc != 0:
                line = (se.strip().splitlines() or [""])[-1] if se else ""
                problems.append(f"exit code {rc}: {line[:300]}")
            else:
                try:
                    res = load_file(outp)
                except Exception as e:  # noqa: BLE001
                    res = None
                    problems.append(f"cannot read output: {e}")
                if res is not None:
                    problems, summ = check_outputs(t, opts, res, a.backward,
                                                   a.grad_magnitude == "shared")
                    for k, v in summ.items():
                        if v is not None and v[1] > 0:
                            worst[k] = max(worst.get(k, 0.0), v[0] / v[1])
            if problems:
                failed += 1
                print(f"FAIL case {idx} [{shape_str(desc)}] args: {' '.join(args + extra)}"
                      f" :: {'; '.join(problems)}", flush=True)
                if a.keep:
                    cdir = os.path.join(a.keep, f"case_{a.seed}_{idx}")
                    os.makedirs(cdir, exist_ok=True)
                    shutil.copy(inp, os.path.join(cdir, "in.safetensors"))
                    if os.path.exists(outp):
                        shutil.copy(outp, os.path.join(cdir, "out.safetensors"))
                    with open(os.path.join(cdir, "case.json"), "w") as f:
                        json.dump({"desc": desc, "cmd": cmd, "problems": problems,
                                   "stderr": se}, f, indent=1)
                if a.max_failures and failed >= a.max_failures:
                    print(f"stopping after {failed} failure(s) (--max-failures)")
                    break
            else:
                passed += 1
                if a.verbose:
                    print(f"ok   case {idx} [{shape_str(desc)}] {' '.join(args)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if worst and a.verbose:
        print("worst err/tol: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(worst.items())))
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------

def bad_input_cases():
    g = torch.Generator().manual_seed(7)

    def rn(*s, dt=torch.float32):
        return torch.randn(*s, generator=g).to(dt)

    base = {"q": rn(1, 5, 4, 8), "k": rn(1, 7, 2, 8), "v": rn(1, 7, 2, 8)}
    vl = {"q": rn(9, 4, 8), "k": rn(11, 2, 8), "v": rn(11, 2, 8),
          "cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 5, 11], dtype=torch.int32)}

    def w(**kw):
        d = dict(base)
        for k, v in kw.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
        return d

    def wv(**kw):
        d = dict(vl)
        for k, v in kw.items():
            if v is None:
                d.pop(k, None)
            else:
                d[k] = v
        return d

    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    C = []  # (name, tensors | bytes | None(=nonexistent), args)
    C.append(("missing v", w(v=None), []))
    C.append(("missing q", w(q=None), []))
    C.append(("q dtype I64", w(q=torch.randint(0, 5, (1, 5, 4, 8), dtype=torch.int64)), []))
    C.append(("q dtype F64", w(q=rn(1, 5, 4, 8, dt=torch.float64)), []))
    C.append(("corrupt file", b"\x13\x00\x00\x00\x00\x00\x00\x00{not json at all}" + bytes(range(256)), []))
    C.append(("truncated file", "TRUNCATE", []))
    C.append(("empty file", b"", []))
    C.append(("nonexistent input", None, []))
    C.append(("hq % hk != 0", w(q=rn(1, 5, 3, 8)), []))
    C.append(("head dim q != k", w(k=rn(1, 7, 2, 6)), []))
    C.append(("k/v seqlen mismatch", w(v=rn(1, 6, 2, 8)), []))
    C.append(("batch mismatch", w(k=rn(2, 7, 2, 8), v=rn(2, 7, 2, 8)), []))
    C.append(("q rank 3 without cu_seqlens", w(q=rn(5, 4, 8)), []))
    C.append(("cu_seqlens not starting at 0", wv(cu_seqlens_q=i32([1, 4, 9])), []))
    C.append(("cu_seqlens decreasing", wv(cu_seqlens_k=i32([0, 6, 5])), []))
    # (cu_seqlens ending before the packed total is not listed: §2 asks only for length b+1,
    #  start 0 and non-decreasing; trailing tokens then simply see no key.)
    C.append(("cu_seqlens beyond total", wv(cu_seqlens_k=i32([0, 5, 12])), []))
    C.append(("cu_seqlens q/k length differ", wv(cu_seqlens_k=i32([0, 3, 5, 11])), []))
    C.append(("cu_seqlens dtype I64", wv(cu_seqlens_q=torch.tensor([0, 4, 9])), []))
    C.append(("cu_seqlens_k missing", wv(cu_seqlens_k=None), []))
    C.append(("block_mask without --block-size",
              w(block_mask=torch.ones(1, 1, dtype=torch.uint8)), []))
    C.append(("block_mask wrong shape",
              w(block_mask=torch.ones(3, 3, dtype=torch.uint8)), ["--block-size", "4,4"]))
    C.append(("block_mask F32", w(block_mask=torch.ones(2, 2)), ["--block-size", "4,4"]))
    C.append(("--block-size 0,16", w(block_mask=torch.ones(1, 1, dtype=torch.uint8)),
              ["--block-size", "0,16"]))
    C.append(("alibi_slopes wrong shape", w(alibi_slopes=torch.rand(5)), []))
    C.append(("alibi_slopes I32", w(alibi_slopes=torch.ones(4, dtype=torch.int32)), []))
    C.append(("--window=-2,0", w(), ["--window=-2,0"]))
    C.append(("--window=0,-5", w(), ["--window=0,-5"]))
    C.append(("--backward without dout", w(), ["--backward"]))
    C.append(("dout wrong shape", w(dout=rn(1, 5, 4, 7)), ["--backward"]))
    return base, C


def bad_inputs(a):
    extra = a.extra_args.split() if a.extra_args else []
    work = tempfile.mkdtemp(prefix="fa-bad-")
    passed = failed = 0
    try:
        base, cases = bad_input_cases()
        inp = os.path.join(work, "in.safetensors")
        outp = os.path.join(work, "out.safetensors")
        # control: a valid input must succeed (so failures below are not just a broken binary)
        save_file(base, inp)
        sentinel = os.urandom(333)
        with open(outp, "wb") as f:
            f.write(sentinel)
        _, rc, _, se = run_bin(a.bin, inp, outp, [], extra, a.timeout)
        probs = []
        if rc != 0:
            probs.append(f"valid control input: exit {rc}: {se.strip()[:300]}")
        else:
            try:
                r = load_file(outp)
                if "out" not in r or "lse" not in r:
                    probs.append(f"valid control input: output keys {sorted(r)}")
            except Exception as e:  # noqa: BLE001
                probs.append(f"valid control input: unreadable output ({e})")
        if probs:
            failed += 1
            print("FAIL " + "; ".join(probs), flush=True)
        else:
            passed += 1
        with open(inp, "rb") as f:
            valid_bytes = f.read()
        for name, content, args in cases:
            path = inp
            if content is None:
                path = os.path.join(work, "does-not-exist.safetensors")
            elif isinstance(content, bytes):
                with open(inp, "wb") as f:
                    f.write(content)
            elif content == "TRUNCATE":
                with open(inp, "wb") as f:
                    f.write(valid_bytes[: len(valid_bytes) // 2])
            else:
                save_file({k: v.contiguous() for k, v in content.items()}, inp)
            sentinel = os.urandom(257)
            with open(outp, "wb") as f:
                f.write(sentinel)
            _, rc, so, se = run_bin(a.bin, path, outp, args, extra, a.timeout)
            probs = []
            if rc != 2:
                probs.append(f"exit code {rc} (want 2)")
            lines = se.strip().splitlines() if se else []
            if len(lines) != 1:
                probs.append(f"stderr has {len(lines)} lines (want 1): {se.strip()[:300]!r}")
            if "panicked" in se or "RUST_BACKTRACE" in se:
                probs.append("stderr shows a panic")
            with open(outp, "rb") as f:
                if f.read() != sentinel:
                    probs.append("output file was modified")
            leftovers = [x for x in os.listdir(work)
                         if x not in ("in.safetensors", "out.safetensors")]
            if leftovers:
                probs.append(f"left files behind: {leftovers}")
                for x in leftovers:
                    p = os.path.join(work, x)
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            if probs:
                failed += 1
                print(f"FAIL bad input '{name}' {' '.join(args)} :: {'; '.join(probs)}", flush=True)
            else:
                passed += 1
                if a.verbose:
                    print(f"ok   bad input '{name}': {lines[0][:200]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# Self-test: an element-wise loop oracle, torch SDPA, and a mock binary
# --------------------------------------------------------------------------------------------

def loop_reference(t, opts):
    """Pure-Python element-by-element Algorithm 0 in float64, written straight from §2."""
    q = t["q"].double()
    k = t["k"].double()
    v = t["v"].double()
    varlen = "cu_seqlens_q" in t
    if varlen:
        cq = t["cu_seqlens_q"].tolist()
        ck = t["cu_seqlens_k"].tolist()
        nb = len(cq) - 1
        hq, d = q.shape[1], q.shape[2]
        hk, dv = k.shape[1], v.shape[2]
        out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64)
        lse = torch.zeros(hq, q.shape[0], dtype=torch.float64)
    else:
        nb, sq_, hq, d = q.shape
        sk_, hk, dv = k.shape[1], k.shape[2], v.shape[3]
        out = torch.zeros(nb, sq_, hq, dv, dtype=torch.float64)
        lse = torch.zeros(nb, hq, sq_, dtype=torch.float64)
    ql, kl, vl = q.tolist(), k.tolist(), v.tolist()
    sl = t["alibi_slopes"].double().tolist() if "alibi_slopes" in t else None
    bm = t["block_mask"].to(torch.int64).tolist() if "block_mask" in t else None
    scale = opts.get("scale") or 1.0 / math.sqrt(d)
    for bi in range(nb):
        if varlen:
            q0, q1, k0, k1 = cq[bi], cq[bi + 1], ck[bi], ck[bi + 1]
        else:
            q0, q1, k0, k1 = 0, sq_, 0, sk_
        sq, sk = q1 - q0, k1 - k0
        off = sk - sq
        for h in range(hq):
            kvh = h // (hq // hk)
            for i in range(sq):
                qi = ql[q0 + i][h] if varlen else ql[bi][i][h]
                scores = []
                for j in range(sk):
                    kj = kl[k0 + j][kvh] if varlen else kl[bi][j][kvh]
                    s = scale * sum(a * b for a, b in zip(qi, kj))
                    if opts.get("softcap"):
                        c = opts["softcap"]
                        s = c * math.tanh(s / c)
                    if sl is not None:
                        m = sl[h] if isinstance(sl[0], float) else sl[bi][h]
                        s = s - m * abs(i + off - j)
                    ok = True
                    if opts.get("causal") == "br" and not j <= i + off:
                        ok = False
                    if opts.get("causal") == "tl" and not j <= i:
                        ok = False
                    if "window" in opts:
                        left, right = opts["window"]
                        if left != -1 and not i + off - left <= j:
                            ok = False
                        if right != -1 and not j <= i + off + right:
                            ok = False
                    if bm is not None:
                        bq, bk = opts["block_size"]
                        mm = bm if not isinstance(bm[0][0], list) else bm[bi][h]
                        if mm[i // bq][j // bk] == 0:
                            ok = False
                    if ok:
                        scores.append((s, j))
                if not scores:
                    l_, o = NEG_INF, [0.0] * dv
                else:
                    mx = max(s for s, _ in scores)
                    z = sum(math.exp(s - mx) for s, _ in scores)
                    l_ = mx + math.log(z)
                    o = [0.0] * dv
                    for s, j in scores:
                        p = math.exp(s - mx) / z
                        vj = vl[k0 + j][kvh] if varlen else vl[bi][j][kvh]
                        for e in range(dv):
                            o[e] += p * vj[e]
                if varlen:
                    out[q0 + i, h] = torch.tensor(o, dtype=torch.float64)
                    lse[h, q0 + i] = l_
                else:
                    out[bi, i, h] = torch.tensor(o, dtype=torch.float64)
                    lse[bi, h, i] = l_
    return out, lse


def _same64(a, b):
    ia, ib = torch.isneginf(a), torch.isneginf(b)
    if not torch.equal(ia, ib):
        return float("inf")
    return _amax(torch.where(ia, 0.0, a) - torch.where(ib, 0.0, b))


def self_test(a):
    import torch.nn.functional as F
    ok = True
    torch.manual_seed(0)
    t0 = time.time()

    # 1. element-wise loop oracle vs the vectorised float64 reference, on small random cases
    worst = 0.0
    n = 0
    cover = {}
    for idx in range(a.self_test_loop):
        t, opts, desc = gen_case(12345, idx, False)
        sizes = desc["seqlens_q"] + desc["seqlens_k"]
        if max(sizes) * desc["hq"] * desc["b"] > 200 and idx % 4:   # keep the loop fast
            continue
        if max(sizes) > 40:
            continue
        for key in ("causal", "window", "softcap", "scale", "block_size"):
            cover[key] = cover.get(key, 0) + (key in opts)
        for key in ("varlen", "alibi"):
            cover[key] = cover.get(key, 0) + bool(desc[key])
        cover["gqa"] = cover.get("gqa", 0) + (desc["hq"] != desc["hk"])
        cover["dead rows"] = cover.get("dead rows", 0)
        ref = reference(t, opts, "f64")
        cover["dead rows"] += bool(torch.isneginf(ref["lse"]).any())
        lo, ll = loop_reference(t, opts)
        e = max(_same64(ref["out"], lo), _same64(ref["lse"], ll))
        worst = max(worst, e)
        n += 1
        if e > 1e-9:
            ok = False
            print(f"self-test loop-oracle mismatch case {idx} [{shape_str(desc)}] {opts}: {e:.3e}")
    print(f"[1] loop oracle vs vectorised f64 reference: {n} cases, max diff {worst:.2e}"
          f" ({time.time() - t0:.0f}s)", flush=True)
    print("    cases with: " + ", ".join(f"{k} {v}" for k, v in cover.items()), flush=True)
    t0 = time.time()

    # 2. torch SDPA (float64) vs the reference, forward and backward
    worst_f = worst_b = 0.0
    n = 0
    rng = random.Random(99)
    for it in range(150):
        b, hq = rng.randint(1, 3), rng.choice([1, 2, 3, 4, 6, 8])
        hk = rng.choice([x for x in range(1, hq + 1) if hq % x == 0])
        sq, sk = rng.randint(1, 70), rng.randint(1, 70)
        d, dv = rng.randint(1, 70), rng.randint(1, 70)
        kind = ["none", "top-left", "bool-mask", "alibi-float-mask", "scale"][it % 5]
        q = torch.randn(b, sq, hq, d, dtype=torch.float64)
        k = torch.randn(b, sk, hk, d, dtype=torch.float64)
        v = torch.randn(b, sk, hk, dv, dtype=torch.float64)
        dout = torch.randn(b, sq, hq, dv, dtype=torch.float64)
        t = {"q": q, "k": k, "v": v, "dout": dout}
        opts = {}
        kw = {}
        attn_mask = None
        if kind == "top-left":
            opts["causal"] = "tl"
            kw["is_causal"] = True
        elif kind in ("bool-mask", "alibi-float-mask"):
            opts["causal"] = rng.choice([None, "br", "tl"])
            opts["window"] = [rng.randint(-1, 30), rng.randint(-1, 30)]
            opts["block_size"] = [rng.choice([1, 4, 16, 7]), rng.choice([1, 4, 16, 9])]
            qb, kb = -(-sq // opts["block_size"][0]), -(-sk // opts["block_size"][1])
            t["block_mask"] = (torch.rand(b, hq, qb, kb) < 0.7).to(torch.uint8)
            if kind == "alibi-float-mask":
                t["alibi_slopes"] = torch.rand(b, hq) * 0.5
            # independent mask/bias built element by element from the §2 text
            bias = torch.zeros(b, hq, sq, sk, dtype=torch.float64)
            bm = t["block_mask"].tolist()
            L, R = opts["window"]
            BQ, BK = opts["block_size"]
            off = sk - sq
            for bb in range(b):
                for h in range(hq):
                    for i in range(sq):
                        for j in range(sk):
                            vis = True
                            if opts["causal"] == "br":
                                vis &= j <= i + off
                            if opts["causal"] == "tl":
                                vis &= j <= i
                            if L != -1:
                                vis &= j >= i + off - L
                            if R != -1:
                                vis &= j <= i + off + R
                            vis &= bm[bb][h][i // BQ][j // BK] != 0
                            if not vis:
                                bias[bb, h, i, j] = NEG_INF
                            elif "alibi_slopes" in t:
                                bias[bb, h, i, j] = -float(t["alibi_slopes"][bb, h]) * abs(i + off - j)
            attn_mask = (bias == 0) if kind == "bool-mask" else bias
            if kind == "bool-mask":
                bias = torch.where(attn_mask, 0.0, NEG_INF)
        elif kind == "scale":
            opts["scale"] = rng.randint(3, 128) / 64.0
            kw["scale"] = opts["scale"]
        # (no scale kwarg otherwise: SDPA's own default 1/sqrt(d) is then being checked)
        # rows with no visible key: SDPA gives NaN, our rule gives 0; compare only live rows
        live = None
        if attn_mask is not None:
            live = (bias > NEG_INF).any(-1)                          # [b, hq, sq]
        g = hq // hk
        qs = q.transpose(1, 2).clone().requires_grad_(True)
        ks = k.transpose(1, 2).clone().requires_grad_(True)
        vs = v.transpose(1, 2).clone().requires_grad_(True)
        use_gqa_kw = it % 2 == 0
        if use_gqa_kw:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=attn_mask,
                                               enable_gqa=True, **kw)
        else:
            o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, 1),
                                               vs.repeat_interleave(g, 1),
                                               attn_mask=attn_mask, **kw)
        o = o.transpose(1, 2)                                        # [b, sq, hq, dv]
        ref = reference(t, opts, "f64", backward=(live is None or bool(live.all())))
        if live is not None:
            lv = live.transpose(1, 2).unsqueeze(-1)                  # [b, sq, hq, 1]
            ef = _amax(torch.where(lv, o.detach() - ref["out"], 0.0))
            dead = ref["out"][~lv.expand_as(ref["out"])]
            ef = max(ef, _amax(dead))
            lse_dead = ref["lse"][~live]
            if lse_dead.numel() and not bool(torch.isneginf(lse_dead).all()):
                ef = float("inf")
        else:
            ef = _amax(o.detach() - ref["out"])
        worst_f = max(worst_f, ef)
        if ef > 1e-10:
            ok = False
            print(f"self-test SDPA forward mismatch it={it} kind={kind} {opts}: {ef:.3e}")
        if "dq" in ref:
            o.backward(dout)
            eb = max(_amax(qs.grad.transpose(1, 2) - ref["dq"]),
                     _amax(ks.grad.transpose(1, 2) - ref["dk"]),
                     _amax(vs.grad.transpose(1, 2) - ref["dv"]))
            worst_b = max(worst_b, eb)
            if eb > 1e-9:
                ok = False
                print(f"self-test SDPA backward mismatch it={it} kind={kind}: {eb:.3e}")
        n += 1
    print(f"[2] torch SDPA f64 vs reference: {n} cases (none/top-left causal/bool mask/"
          f"ALiBi float mask/scale, GQA via enable_gqa and expanded), "
          f"max fwd diff {worst_f:.2e}, max grad diff {worst_b:.2e} ({time.time() - t0:.0f}s)",
          flush=True)

    # 3. whole pipeline through a mock binary (this script in --mock-run mode)
    work = tempfile.mkdtemp(prefix="fa-selftest-")
    try:
        mock = os.path.join(work, "mock-flash-attn")
        with open(mock, "w") as f:
            f.write(f"#!/bin/sh\nexec {sys.executable} {os.path.abspath(__file__)} --mock-run \"$@\"\n")
        os.chmod(mock, 0o755)

        def sub(args, bug=None):
            env = dict(os.environ)
            env.pop("FA_MOCK_BUG", None)
            if bug:
                env["FA_MOCK_BUG"] = bug
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--bin", mock] + args,
                               capture_output=True, text=True, env=env)
            last = (p.stdout.strip().splitlines() or [""])[-1]
            return p.returncode, last, p.stdout

        nc = str(a.self_test_cases)
        rc, last, out = sub(["--cases", nc, "--seed", "1"])
        print(f"[3] mock binary, correct, forward:  {last} (rc={rc})", flush=True)
        ok &= rc == 0
        if rc:
            print(out)
        rc, last, out = sub(["--cases", nc, "--seed", "2", "--backward"])
        print(f"    mock binary, correct, backward: {last} (rc={rc})", flush=True)
        ok &= rc == 0
        if rc:
            print(out)
        rc, last, out = sub(["--bad-inputs"])
        print(f"    mock binary, --bad-inputs:      {last} (rc={rc})", flush=True)
        ok &= rc == 0
        if rc:
            print(out)
        for bug, extra in [("causal_tl", []), ("gqa_mod", []), ("window_swap", []),
                           ("no_softcap", []), ("alibi_no_off", []), ("lse_log2", []),
                           ("masked_row_nan", []), ("out_noise", []), ("lse_layout", []),
                           ("dk_scale", ["--backward"]), ("bad_exit1", ["--bad-inputs"]),
                           ("bad_touch_out", ["--bad-inputs"])]:
            args = extra if extra == ["--bad-inputs"] else \
                ["--cases", nc, "--seed", "3", "--max-failures", "1"] + extra
            rc, last, _ = sub(args, bug)
            caught = rc != 0
            ok &= caught
            print(f"    mock bug {bug:15s} {'caught' if caught else 'NOT CAUGHT'}: {last}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("self-test " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


def mock_run(argv):
    """A stand-in for `flash-attn run` (self-test only): validates, computes ref64, writes."""
    bug = os.environ.get("FA_MOCK_BUG")
    p = argparse.ArgumentParser(prog="mock")
    p.add_argument("cmd")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--causal", action="store_true")
    g.add_argument("--causal-top-left", action="store_true")
    p.add_argument("--window")
    p.add_argument("--softcap", type=float)
    p.add_argument("--scale", type=float)
    p.add_argument("--block-size")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)

    def die(msg):
        sys.stderr.write(f"error: {msg}\n")
        if bug == "bad_touch_out":
            open(a.output, "wb").close()
        sys.exit(1 if bug == "bad_exit1" else 2)

    try:
        t = load_file(a.input)
    except Exception as e:  # noqa: BLE001
        die(f"cannot read {a.input}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    opts = {}
    if a.causal:
        opts["causal"] = "br"
    if a.causal_top_left:
        opts["causal"] = "tl"
    try:
        if a.window is not None:
            opts["window"] = [int(x) for x in a.window.split(",")]
            if len(opts["window"]) != 2 or min(opts["window"]) < -1:
                die("window sides must be >= -1")
        if a.block_size is not None:
            opts["block_size"] = [int(x) for x in a.block_size.split(",")]
            if len(opts["block_size"]) != 2 or min(opts["block_size"]) < 1:
                die("block size must be two positive integers")
    except ValueError:
        die("bad number in option")
    if a.softcap is not None:
        opts["softcap"] = a.softcap
    if a.scale is not None:
        opts["scale"] = a.scale
    for n in ("q", "k", "v"):
        if n not in t:
            die(f"missing tensor '{n}'")
        if t[n].dtype not in DTYPE_NAME:
            die(f"tensor '{n}' has unsupported dtype {t[n].dtype}")
    q, k, v = t["q"], t["k"], t["v"]
    varlen = "cu_seqlens_q" in t or "cu_seqlens_k" in t
    r = 3 if varlen else 4
    if q.dim() != r or k.dim() != r or v.dim() != r:
        die("wrong rank")
    if q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1] or q.shape[-2] % k.shape[-2]:
        die("inconsistent shapes")
    if not varlen and q.shape[0] != k.shape[0]:
        die("batch mismatch")
    if varlen:
        if "cu_seqlens_q" not in t or "cu_seqlens_k" not in t:
            die("need both cu_seqlens")
        for n, tot in (("cu_seqlens_q", q.shape[0]), ("cu_seqlens_k", k.shape[0])):
            c = t[n]
            if c.dtype != torch.int32 or c.dim() != 1 or c.numel() < 2:
                die(f"bad {n}")
            c = c.tolist()
            if c[0] != 0 or c[-1] != tot or any(x > y for x, y in zip(c, c[1:])):
                die(f"bad {n}")
        if t["cu_seqlens_q"].numel() != t["cu_seqlens_k"].numel():
            die("cu_seqlens lengths differ")
        nb = t["cu_seqlens_q"].numel() - 1
        cq, ck = t["cu_seqlens_q"].tolist(), t["cu_seqlens_k"].tolist()
        msq = max(y - x for x, y in zip(cq, cq[1:]))
        msk = max(y - x for x, y in zip(ck, ck[1:]))
        out_shape = (q.shape[0], q.shape[1], v.shape[2])
    else:
        nb, msq, msk = q.shape[0], q.shape[1], k.shape[1]
        out_shape = (nb, q.shape[1], q.shape[2], v.shape[3])
    hq = q.shape[-2]
    if "alibi_slopes" in t:
        s = t["alibi_slopes"]
        if s.dtype != torch.float32 or tuple(s.shape) not in ((hq,), (nb, hq)):
            die("bad alibi_slopes")
    if "block_mask" in t:
        m = t["block_mask"]
        if "block_size" not in opts:
            die("block_mask needs --block-size")
        bq, bk = opts["block_size"]
        qb, kb = -(-msq // bq), -(-msk // bk)
        if m.dtype not in (torch.uint8, torch.bool) or tuple(m.shape) not in ((qb, kb), (nb, hq, qb, kb)):
            die("bad block_mask")
    if a.backward and ("dout" not in t or tuple(t["dout"].shape) != out_shape):
        die("--backward needs dout of the output's shape")
    res = reference(t, opts, "f64", a.backward, bug=bug)
    T = q.dtype
    o = {"out": res["out"].to(T), "lse": res["lse"].float()}
    if bug == "lse_log2":
        o["lse"] = o["lse"] / math.log(2)
    if bug == "lse_layout" and varlen:
        o["lse"] = o["lse"].t()
    if bug == "lse_layout" and not varlen:
        o["lse"] = o["lse"].transpose(1, 2)
    if bug == "masked_row_nan":
        dead = torch.isneginf(o["lse"])
        o["lse"] = torch.where(dead, torch.zeros_like(o["lse"]), o["lse"])
    if bug == "out_noise":
        o["out"] = (res["out"] * (1 + 3e-3)).to(T)
    if a.backward:
        o.update(dq=res["dq"].to(t["q"].dtype), dk=res["dk"].to(t["k"].dtype),
                 dv=res["dv"].to(t["v"].dtype))
        if bug == "dk_scale":
            o["dk"] = (res["dk"] * 1.02).to(t["k"].dtype)
    tmp = a.output + ".tmp"
    save_file({k2: v2.contiguous() for k2, v2 in o.items()}, tmp)
    os.replace(tmp, a.output)
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--mock-run":
        sys.exit(mock_run(sys.argv[2:]))
    ap = argparse.ArgumentParser(description="Cross-check `flash-attn run` against PyTorch.")
    ap.add_argument("--bin", help="path to the flash-attn binary")
    ap.add_argument("--cases", type=int, default=200, help="number of random cases (200)")
    ap.add_argument("--seed", type=int, default=0, help="base seed (0)")
    ap.add_argument("--only", type=int, help="run only case index K of this seed")
    ap.add_argument("--backward", action="store_true",
                    help="also pass a random dout and --backward; check dq, dk, dv")
    ap.add_argument("--keep", metavar="DIR", help="keep failing cases' files under DIR")
    ap.add_argument("--bad-inputs", action="store_true",
                    help="check malformed inputs give exit 2, one stderr line, OUT untouched")
    ap.add_argument("--extra-args", default="",
                    help="extra arguments for every run, e.g. '--device cuda'")
    ap.add_argument("--eps", default="",
                    help="override eps_T, e.g. 'f32=3.8e-6,f16=3.9e-3,bf16=3.1e-2' "
                         "(default f32=1e-6,f16=1e-3,bf16=8e-3)")
    ap.add_argument("--grad-magnitude", choices=["own", "shared"], default="shared",
                    help="gradient floor eps_T*max(1,max|ref|) over each gradient itself (own) "
                         "or over the largest of dq, dk, dv (shared, as `flash-attn check`)")
    ap.add_argument("--max-failures", type=int, default=0,
                    help="stop after this many failing cases (0 = never)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per binary run")
    ap.add_argument("--self-test", action="store_true",
                    help="test this script's reference and harness (no binary needed)")
    ap.add_argument("--self-test-cases", type=int, default=60, help=argparse.SUPPRESS)
    ap.add_argument("--self-test-loop", type=int, default=1500, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    for item in filter(None, a.eps.split(",")):
        name, val = item.split("=")
        EPS[DTYPES[name.strip()]] = float(val)
    if a.self_test:
        sys.exit(self_test(a))
    if not a.bin:
        ap.error("--bin is required (or use --self-test)")
    if not os.path.exists(a.bin):
        ap.error(f"binary not found: {a.bin}")
    sys.exit(bad_inputs(a) if a.bad_inputs else crosscheck(a))


if __name__ == "__main__":
    main()
