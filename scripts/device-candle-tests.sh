#!/usr/bin/env bash
# flash-attn-candle's CUDA tests and its overhead bench on the GPU machine (no Rust there): the
# test binaries and the example built here by scripts/candle-cuda-build.sh, stripped and
# xz-compressed into .devcarry/candlexz/ (candle's kernels make each 50 MB). candle links cuBLAS,
# cuRAND and NVRTC: they come from the machine's CUDA toolkit or torch's wheels.
set -uo pipefail
dir=/tmp/fa-candle
mkdir -p "$dir"
for f in .devcarry/candlexz/*.xz; do
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
        "$f" "$dir/$(basename "$f" .xz)"
done
chmod +x "$dir"/*
libs=/usr/local/cuda/lib64
wheel=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null || true)
export LD_LIBRARY_PATH="$libs:${wheel}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLASH_ATTN_CACHE="$PWD/.devcarry/kcache"
status=0
for t in ops model; do
    "$dir/$t" || status=1
done
if [ "${MEMCHECK:-0}" = 1 ]; then
    compute-sanitizer --tool memcheck --print-limit 10 "$dir/ops" cuda_ 2>&1 | tail -4
fi
if [ "${BENCH:-0}" = 1 ]; then
    "$dir/candle_bench"
    "$dir/candle_bench" --backward
fi
exit $status
