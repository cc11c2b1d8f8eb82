#!/usr/bin/env python3
"""Summarise `ncu --page source --csv --print-source sass`: stall samples by reason, executed
instructions and samples by opcode, and the hottest instructions with their top stall reasons.

    ncu --section SourceCounters -k regex:'^flash_bwd$' --launch-skip 1 -c 1 -o rep \
        cuda_bench bench --pass bwd --dtypes bf16 --d 128 --seqs 4096 --causal no --reps 1
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 scripts/ncu_source_summary.py src.csv
"""
import collections, csv, sys

rows = list(csv.reader(open(sys.argv[1], newline="")))
hi = next(i for i, r in enumerate(rows) if "Source" in r and any("Address" in c for c in r))
head = rows[hi]
col = {h: j for j, h in enumerate(head)}
def find(*keys):
    for h, j in col.items():
        if all(k.lower() in h.lower() for k in keys):
            return j
    return None
a_src, a_addr = col["Source"], find("Address")
a_all = find("Warp Stall Sampling (All")
a_exec = find("Instructions Executed")
stall_cols = [(h, j) for h, j in col.items() if h.lower().startswith("stall_") or h.lower().startswith("smsp__pcsamp")]
print("columns:", " | ".join(h[:40] for h in head))
num = lambda r, j: float(r[j].replace(",", "")) if j is not None and j < len(r) and r[j].strip() not in ("", "-") else 0.0
body = [r for r in rows[hi + 1:] if len(r) == len(head)]
tot = collections.Counter()
for r in body:
    for h, j in stall_cols:
        tot[h] += num(r, j)
print("stall samples by reason:", ", ".join(f"{h} {int(v)}" for h, v in tot.most_common() if v > 0))
ex, sm = collections.Counter(), collections.Counter()
for r in body:
    op = r[a_src].split()
    op = [w for w in op if not w.startswith("@")]
    name = op[0] if op else "?"
    ex[name] += num(r, a_exec)
    sm[name] += num(r, a_all)
print("warp instructions executed (M):", round(sum(ex.values()) / 1e6, 2), "samples:", int(sum(sm.values())))
print("executed (M) by opcode:", ", ".join(f"{k} {v/1e6:.2f}" for k, v in ex.most_common(24)))
print("samples by opcode:", ", ".join(f"{k} {int(v)}" for k, v in sm.most_common(20)))
print("hottest instructions (address, samples, executed, top reasons, sass):")
for r in sorted(body, key=lambda r: -num(r, a_all))[:40]:
    reasons = sorted(((num(r, j), h) for h, j in stall_cols), reverse=True)[:3]
    rs = ", ".join(f"{h.replace('stall_', '').replace('smsp__pcsamp_warps_issue_stalled_', '')} {int(v)}" for v, h in reasons if v > 0)
    print(f"  {r[a_addr]:>8} {int(num(r, a_all)):6d} {int(num(r, a_exec)):9d}  {rs:50s} {r[a_src][:90]}")
