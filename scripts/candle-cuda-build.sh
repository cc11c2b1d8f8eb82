#!/usr/bin/env bash
# Builds flash-attn-candle with its `cuda` feature on a machine without a GPU or a CUDA toolkit,
# for running on the GPU machine (which has no Rust). candle's CUDA backend needs, at build time,
# nvcc (candle compiles its own kernels) and the CUDA libraries to link against; this script takes
# them from PyPI (nvcc, NVVM, headers, cuBLAS, cuRAND, NVRTC, all CUDA 13.0) into a virtual
# environment, and links against a stub of the driver library (libcuda.so.1 has no wheel; the
# stub only names the symbols cudarc calls, and the real driver is loaded on the GPU machine).
# Our own kernels need none of this: NVRTC compiles them at run time.
#
#   bash scripts/candle-cuda-build.sh [cargo args...]   # default: the crate's tests, --no-run
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FA_NVCC_VENV:-$HOME/.cache/flash-attn-nvcc}"
if [ ! -x "$venv/bin/pip" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 \
    "nvidia-cuda-cccl==13.0.*" "nvidia-cublas==13.0.*" "nvidia-curand==10.4.0.*" nvidia-cuda-nvrtc==13.0.88
cuda=$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13)
# The linker wants unversioned names, and a driver library: both go beside the wheels' libraries,
# which then serve as CUDA_PATH (the stub is named libcuda.so, with the real soname).
for lib in nvrtc.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 cudart.so.13; do
    ln -sf "lib$lib" "$cuda/lib/lib${lib%%.so.*}.so"
done
cudarc=$(cargo metadata --format-version 1 | python3 -c \
    "import json,sys; print([p['manifest_path'] for p in json.load(sys.stdin)['packages'] if p['name']=='cudarc'][0])")
grep -o 'fn cu[A-Za-z0-9_]*(' "$(dirname "$cudarc")/src/driver/sys/mod.rs" | sort -u |
    sed 's/^fn \(.*\)($/void \1(void) {}/' > "$cuda/lib/cuda_stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/libcuda.so" "$cuda/lib/cuda_stub.c"
export PATH="$cuda/bin:$PATH" CUDA_HOME="$cuda" CUDA_PATH="$cuda" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
if [ $# -eq 0 ]; then
    set -- test --release -p flash-attn-candle --features cuda --no-run
fi
cargo "$@"
