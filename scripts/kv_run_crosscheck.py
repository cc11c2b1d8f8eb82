#!/usr/bin/env python3
"""`flash-attn run` in KV-cache mode on two devices, compared: writes a random paged bf16 input
(append + rotary + GQA), runs `run --device cpu` and `run --device cuda`, and prints the largest
differences of `out` and `lse` and whether the updated caches agree. Needs torch and safetensors.

    python3 scripts/kv_run_crosscheck.py --ours ./flash-attn
"""
import argparse, subprocess, tempfile, os
import torch
import safetensors.torch as st

ap = argparse.ArgumentParser()
ap.add_argument("--ours", required=True)
args = ap.parse_args()

g = torch.Generator().manual_seed(0)
b, hq, hk, d, ps, pages, rd = 3, 16, 4, 128, 16, 24, 64
r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
seqlens = torch.tensor([100, 3, 57], dtype=torch.int32)
table = torch.randperm(pages, generator=g).to(torch.int32).reshape(b, pages // b)
ang = torch.rand(256, rd // 2, generator=g) * 6.28
inputs = {"q": r(b, 1, hq, d), "k_cache": r(pages, ps, hk, d), "v_cache": r(pages, ps, hk, d),
          "cache_seqlens": seqlens, "block_table": table.contiguous(), "k": r(b, 1, hk, d), "v": r(b, 1, hk, d),
          "rotary_cos": ang.cos().to(torch.bfloat16), "rotary_sin": ang.sin().to(torch.bfloat16)}
with tempfile.TemporaryDirectory() as tmp:
    inp = os.path.join(tmp, "in.safetensors")
    st.save_file(inputs, inp)
    res = {}
    for dev in ("cpu", "cuda"):
        out = os.path.join(tmp, f"{dev}.safetensors")
        subprocess.run([args.ours, "run", "--input", inp, "--output", out, "--device", dev, "--causal"], check=True)
        res[dev] = st.load_file(out)
    c, gp = res["cpu"], res["cuda"]
    print("out max |cpu - cuda|:", (c["out"].float() - gp["out"].float()).abs().max().item(),
          " max |out|:", c["out"].float().abs().max().item())
    print("lse max |cpu - cuda|:", (c["lse"] - gp["lse"]).abs().max().item())
    for name in ("k_cache", "v_cache"):
        diff = (c[name].float() - gp[name].float()).abs()
        print(f"{name}: {int((diff > 0).sum())} elements differ, max {diff.max().item()}")
