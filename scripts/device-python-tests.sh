#!/usr/bin/env bash
# The Python suite on the GPU machine, which has torch and transformers but no Rust: the wheel built
# here (`maturin build --release --compatibility linux -o .devcarry/wheels` in python/) and pytest's
# wheels (.devcarry/pywheels) are unpacked into a folder on PYTHONPATH; kernels come from the
# carried NVRTC cache (.devcarry/kcache) when it matches. Then the whole suite (CPU and CUDA
# tensors), and with MEMCHECK=1 compute-sanitizer's memcheck over the CUDA attention tests with
# torch's caching allocator off (so that every tensor is its own allocation).
set -uo pipefail
repo=$PWD
site=/tmp/fa-site
rm -rf "$site" && mkdir -p "$site"
for w in .devcarry/wheels/*.whl .devcarry/pywheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done
export PYTHONPATH="$site" FLASH_ATTN_CACHE="$repo/.devcarry/kcache"
cd /tmp
python3 -c "import sys, torch, transformers, flash_attn_rs as f; print(sys.version.split()[0], torch.__version__, transformers.__version__, f.cuda_status(), f.cpu_isa())"
pytest=(python3 -m pytest -q -p no:cacheprovider --rootdir "$repo/python" -c "$repo/python/pyproject.toml")
"${pytest[@]}" "$repo/python/tests" "$@"
status=$?
if [ "${MEMCHECK:-0}" = 1 ]; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --print-limit 20 \
        "${pytest[@]}" "$repo/python/tests/test_attention.py" "$repo/python/tests/test_kvcache.py" \
        "$repo/python/tests/test_fp8.py" \
        -k "cuda and (forward or backward or varlen or strided or dropout or packed or kvcache or scratch)" 2>&1 | tail -25
fi
exit $status
