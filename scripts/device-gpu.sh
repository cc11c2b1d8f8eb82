#!/usr/bin/env bash
# The GPU checks of a session, in two halves: `prepare` here (no GPU: builds the test and benchmark
# binaries and the CLI, strips them into .devcarry/bin, compiles every kernel for sm_90a (the
# GPU machine's; the sm_80 builds are CI's compile gate's) into the carried NVRTC cache
# .devcarry/kcache and drops the cache's stale entries: ~4 minutes on two cores when every kernel
# changed, seconds when none did), then on the GPU
# machine (the device tool, carrying ".devcarry") one or more phases, each logging under $OUT:
#
#   scripts/device-gpu.sh prepare
#   scripts/device-gpu.sh tests [FILTER...]   the GPU test suite (all but the compile test, which CI's
#                                             compile gate repeats with spill budgets; or the tests
#                                             matching FILTER)
#                                             (FLASH_ATTN_TEST_VARIANTS=a,b: the variant sweeps only
#                                             over variants whose name holds a or b; TEST_THREADS,
#                                             default 8; the backward cases' phases traced with
#                                             timestamps into tests.log)
#   scripts/device-gpu.sh check               cuda_bench check 100 (random cases vs the f64 oracle)
#   scripts/device-gpu.sh sanitize [NAME]     memcheck, racecheck and synccheck over
#                                             `cuda_bench sanitize NAME` (default _ws), and
#                                             racecheck over `cuda_bench racecheck-probe`
#   scripts/device-gpu.sh bench [ARGS...]     cuda_bench bench ARGS (e.g. --variants hopper --d 128)
#   scripts/device-gpu.sh side-by-side [ARGS...]
#                                             side_by_side.py against cuDNN, forward (ARGS e.g.
#                                             --backward); needs .devcarry/side_by_side.py
#
# Each phase has a time limit (TIMEOUT, seconds, default 300) so that a hung kernel costs minutes,
# not the session's device time. Each GPU phase ends by listing the kernels it had to compile there
# (cache entries newer than the phase's start) into $OUT/compiled-on-device.txt: a carried cache
# that serves the whole run leaves it empty.
set -uo pipefail
phase=${1:-}
shift || true
B=.devcarry/bin
out=${OUT:-/tmp/device-gpu-out}
limit=${TIMEOUT:-300}

gpu_env() {
    local wheel
    wheel=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))")
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:$wheel" FLASH_ATTN_CACHE=$PWD/.devcarry/kcache
    mkdir -p "$out"
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
    touch "$out/.phase-start"
    trap 'find .devcarry/kcache -name "*.cubin" -newer "$out/.phase-start" -printf "%f\n" >>"$out/compiled-on-device.txt"; echo "compiled on the device: $(grep -c . "$out/compiled-on-device.txt") kernels"' EXIT
}

case "$phase" in
prepare)
    set -e
    cargo test --release -p flash-attn --features cuda --test cuda --no-run 2>&1 | tail -1
    cargo build --release -p flash-attn --features cuda --example cuda_bench
    cargo build --release -p flash-attn-cli --features cuda
    tests=$(cargo test --release -p flash-attn --features cuda --test cuda --no-run --message-format=json 2>/dev/null |
        python3 -c "import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m.get('target', {}).get('name') == 'cuda' and m.get('executable'):
        print(m['executable'])")
    mkdir -p "$B" .devcarry/kcache
    cp "$tests" "$B/cuda_tests"
    cp target/release/examples/cuda_bench target/release/flash-attn "$B/"
    strip "$B"/*
    venv=$HOME/.cache/flash-attn-ci-nvrtc
    LD_LIBRARY_PATH=$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13/lib) FLASH_ATTN_CACHE=$PWD/.devcarry/kcache \
        target/release/examples/cuda_bench compile sm_90a >/dev/null
    # Keep the newest entry of each kernel (its name and extension); older ones are stale sources.
    python3 - <<'EOF'
import collections, os
d = ".devcarry/kcache"
groups = collections.defaultdict(list)
for f in os.listdir(d):
    name, _, rest = f.rpartition("-")
    groups[(name, rest.split(".", 1)[-1])].append(f)
gone = 0
for files in groups.values():
    files.sort(key=lambda f: os.path.getmtime(os.path.join(d, f)))
    for f in files[:-1]:
        os.remove(os.path.join(d, f))
        gone += 1
print(f"kernel cache: {sum(len(v) for v in groups.values()) - gone} entries kept, {gone} stale removed")
EOF
    du -sh .devcarry
    ;;
tests)
    gpu_env
    # Without a filter, all but the compile test (sm_80 and sm_90a: the carried cache holds sm_90a
    # only; in session 53, 92 of the 138 kernels a call compiled on the device were its sm_80 ones).
    if [ $# -eq 0 ]; then set -- --skip every_variant_compiles_for_sm80_and_sm90a; fi
    FLASH_ATTN_TEST_TRACE=1 timeout "$limit" "$B/cuda_tests" --include-ignored --nocapture \
        --test-threads "${TEST_THREADS:-8}" "$@" 2>&1 | tee "$out/tests.log" |
        grep -E "^test |\.\.\. (ok|FAILED)|^(ok|FAILED)$|test result|panicked"
    ;;
check)
    gpu_env
    timeout "$limit" "$B/cuda_bench" check 100 2>&1 | tee "$out/check.log" | tail -2
    ;;
sanitize)
    gpu_env
    name=${1:-_ws}
    for tool in memcheck racecheck synccheck; do
        timeout "$limit" compute-sanitizer --tool "$tool" "$B/cuda_bench" sanitize "$name" >"$out/$tool.log" 2>&1
        echo "$tool (sanitize $name): rc $? $(grep -E 'SUMMARY' "$out/$tool.log") pass $(grep -c ': pass' "$out/$tool.log") fail $(grep -c FAIL "$out/$tool.log")"
    done
    timeout 60 compute-sanitizer --tool racecheck "$B/cuda_bench" racecheck-probe >"$out/racecheck-probe.log" 2>&1
    echo "racecheck-probe: rc $?"
    grep -E "racecheck-probe mode|Race reported|SUMMARY" "$out/racecheck-probe.log"
    ;;
bench)
    gpu_env
    timeout "$limit" "$B/cuda_bench" bench "$@" 2>&1 | tee "$out/bench.log" |
        grep -o '"d":[0-9]*,"causal":[a-z]*,"fwd_ms":[0-9.]*.\{0,80\}'
    ;;
side-by-side)
    gpu_env
    timeout "$limit" python3 .devcarry/side_by_side.py --ours "$B/flash-attn" --device cuda --grid gpu --dtypes bf16 \
        --rounds 2 --torch-backend cudnn "$@" 2>&1 | tee "$out/side-by-side.log" | tail -30
    ;;
*)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
