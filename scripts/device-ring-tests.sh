#!/usr/bin/env bash
# Context parallelism on the GPU machine (no Rust there): the test binary and the ring benchmark
# built here (`cargo test --release -p flash-attn --features cuda --test cuda_ring --no-run`,
# `cargo build --release -p flash-attn --features cuda --example ring_bench`), stripped into
# .devcarry/ring/. NCCL comes from torch's wheel, which ships libnccl.so.2 only: cudarc looks for
# libnccl.so, so a link of that name goes in a folder on LD_LIBRARY_PATH.
#   MEMCHECK=1  compute-sanitizer memcheck over a few simulated-ring cases
#   BENCH="--seqs 32768,65536 ..."  ring_bench with these options
#   TESTS=0     skip the test binary (bench only)
set -uo pipefail
lib=$(python3 - <<'PY'
import glob, site
for d in site.getsitepackages():
    for f in glob.glob(d + "/nvidia/nccl/lib/libnccl.so*"):
        print(f)
        raise SystemExit
PY
)
links=/tmp/fa-nccl
mkdir -p "$links"
[ -n "$lib" ] && ln -sf "$lib" "$links/libnccl.so"
wheel=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH="$links:/usr/local/cuda/lib64:${wheel}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLASH_ATTN_CACHE="$PWD/.devcarry/kcache"
echo "NCCL: ${lib:-not found}; GPUs: $(nvidia-smi -L | wc -l)"
status=0
if [ "${TESTS:-1}" = 1 ]; then
    .devcarry/ring/cuda_ring --include-ignored --test-threads 1 || status=1
fi
if [ "${MEMCHECK:-0}" = 1 ]; then
    RING_GPU_CASES=6 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 10 .devcarry/ring/cuda_ring \
        --include-ignored --test-threads 1 2>&1 | tail -4
fi
if [ -n "${BENCH:-}" ]; then
    # shellcheck disable=SC2086
    .devcarry/ring/ring_bench $BENCH || status=1
fi
exit $status
