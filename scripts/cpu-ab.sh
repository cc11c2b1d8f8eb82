#!/usr/bin/env bash
# A/B of two CLI builds on the CPU: for each shape, BEFORE and AFTER alternating ROUNDS times,
# medians of each and before / after (> 1: AFTER faster). The shapes are a spread of the `cpu` grid.
#
#   scripts/cpu-ab.sh BEFORE AFTER [ROUNDS] [DTYPE] [--backward]
#   FLASH_ATTN_CPU_ISA=avx2 scripts/cpu-ab.sh /tmp/fa-before target/release/flash-attn 3 bf16
set -euo pipefail
before=$1 after=$2 rounds=${3:-3} dtype=${4:-bf16} extra=${5:-}
ms() {
    "$1" bench --dtype "$dtype" --shape "$2" $3 $extra --json 2>/dev/null | tail -1 |
        python3 -c "import sys, json; j = json.loads(sys.stdin.read()); print(j.get('fwdbwd_ms') or j['fwd_ms'])"
}
for shape in 1,8,8,512,512,128 1,8,8,1024,1024,64 1,8,8,2048,2048,128 4,12,12,512,512,64; do
    for causal in "" --causal; do
        a="" b=""
        for _ in $(seq "$rounds"); do
            a="$a $(ms "$before" $shape "$causal")"
            b="$b $(ms "$after" $shape "$causal")"
        done
        python3 -c "
import statistics as s
a, b = [float(x) for x in '$a'.split()], [float(x) for x in '$b'.split()]
print('$shape', '${causal:-non-causal}', 'before %.3f after %.3f ratio %.3f' % (s.median(a), s.median(b), s.median(a) / s.median(b)))"
    done
done
