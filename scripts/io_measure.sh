#!/bin/bash
# One device call: DRAM bytes (Nsight Compute) of attention, ours vs torch SDPA MATH, next to the IO model;
# b=1, hq=hk=16, d=64, bf16, N in 512..16384 (+ the GPT-2 medium shape 64,16,16,1024,1024,64); times without ncu.
#   OUT=... bash carry-cuda/io_measure.sh              # forward only (one call)
#   OUT=... bash carry-cuda/io_measure.sh --backward   # one forward + one backward call (~4-6 min, < 9 min)
# Every argument goes to `io_measure.py all` (see its --help). The binary: $FA_BIN or ./carry-cuda/flash-attn
# (a `--features cuda` build). Uses the io_measure.py next to this script.
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
PYLIB=$(python3 -c "import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],'cu13','lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${PYLIB}:${LD_LIBRARY_PATH}
export FLASH_ATTN_CACHE=/tmp/fa-cache; mkdir -p /tmp/fa-cache; cp carry-cuda/cache/* /tmp/fa-cache/ 2>/dev/null
B=${FA_BIN:-./carry-cuda/flash-attn}
chmod +x "$B"
# forward: as before; backward: the driver's own deadline is 460 s (--budget-s), this is the safety net
TO=470; case " $* " in *" --backward "*) TO=515;; esac
{
echo "== $(date -u) on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
ncu --version | tail -1
python3 -c 'import torch, triton; p=torch.cuda.get_device_properties(0); print("torch", torch.__version__, "triton", triton.__version__, p.name, "SMs", p.multi_processor_count, "L2", p.L2_cache_size, "smem/SM", getattr(p, "shared_memory_per_multiprocessor", None))'
timeout $TO python3 "$HERE/io_measure.py" all --ours "$B" --out "$OUT" "$@"
echo "io_measure exit $?"
echo "== done $(date -u)"
} 2>&1 | tee "$OUT/run.log"
