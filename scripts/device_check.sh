#!/usr/bin/env bash
# The one prepared run for a lent GPU (the device tool runs it from the repository root), about 5-8 minutes on an
# H200: kernel correctness (scripts/check_kernels.py, compiled Triton kernels against the float32 reference), then
# the kernel benchmark tables of issues 5 and 6 (scripts/bench_kernels.py: flash attention at 2k-16k, the fused
# matmuls at LLM sizes, beside XLA and cuDNN). Full logs go to $OUT (./device_out when unset); the tables come last.
#   run: command="bash scripts/device_check.sh", timeout_s=540
# On the device image the packages are the image's own (python3 holds jax with CUDA); nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/devices.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$OUT/devices.log"
$PY scripts/check_kernels.py > "$OUT/check_kernels.log" 2>&1
check=$?
$PY scripts/bench_kernels.py --kernels=attention,matmul > "$OUT/bench_kernels.log" 2>&1
bench=$?
grep -E "blocks|BlockSizes" "$OUT/bench_kernels.log" | head -20
grep -v -E "^[IWE][0-9]{4} " "$OUT/bench_kernels.log" | tail -60
grep -v -E "^[IWE][0-9]{4} " "$OUT/check_kernels.log" | tail -14
echo "check_kernels exit $check, bench_kernels exit $bench"
exit $((check || bench))
