#!/usr/bin/env bash
# The prepared run for a lent TPU (the device tool runs it from the repository root; one chip, 16 GB), each part
# capped within BUDGET seconds (default 540) and its table printed as it is measured. Modes, one call each (the
# machine stays warm 100 s between calls; the packages stay installed while it does):
#   check     kernel correctness (scripts/check_kernels.py: every Mosaic TPU kernel, forward and backward, against the
#             float32 reference on the host's CPU), then the main job end to end (scripts/train_lm.py with its
#             defaults: bf16 compute on a TPU; its eval losses compare with the CPU run's, scripts/README.md);
#   bench     the kernel tables (scripts/bench_kernels.py: flash attention at 2k-16k beside XLA and JAX's splash
#             attention, MaxText's TPU kernel; the fused matmuls at LLM sizes; decoding, the grouped matmul at
#             Mixtral-8x7B's experts, paged decoding), then the defaults table for this device kind
#             ($OUT/defaults.json: copy it over kernels/defaults.json after reading it);
#   data      issue 45's input wait under a real accelerator step (scripts/bench_data.py): TinyLlama's widths (d 2048,
#             ff 5632, 32 / 4 heads, bf16 compute) at 8 of its 22 layers (the 22 with fp32 AdamW state exceed 16 GB),
#             4 rows of 2048 tokens a step through the trained 32000-word BPE, rows built here and in 2 workers.
#   run: command="bash scripts/tpu_check.sh check", carry=[".whl-tpu"], timeout_s=600
# Overrides: CHECK_ARGS (check_kernels.py's flags, e.g. --only=paged,gated), TRAIN=0 (no main job), BENCH_KERNELS
# (the tables' families; empty: none), DEFAULTS_ARGS (the defaults run's flags in place of attention's classes, e.g.
# --kernels=matmul).
# The TPU image holds JAX with libtpu but not the project's other packages: they install from the image's own index
# (file:///opt/pypi/simple) into /tmp/site, after its JAX on PYTHONPATH; what that index lacks (tensorboardX, Grain and
# its array_record, portpicker, cloudpickle) travels as wheels in .whl-tpu/ (ignored by git; WORKSPACE.md says how
# to fetch them).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-check}
case "$MODE" in check|bench|data) ;; *) echo "error: mode=$MODE; expected check, bench or data" >&2; exit 2;; esac
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-540}
start=$(date +%s)
left() { local s=$((BUDGET - ($(date +%s) - start))); echo $((s > 1 ? s : 1)); }  # timeout 0 would mean none
cap() { local t; t=$(left); echo $((t < $1 ? t : $1)); }  # what is left, at most $1 seconds
quiet() { grep --line-buffered -v -E "^[IWE][0-9]{4} "; }  # the console without absl's log lines
took() { echo "$1 exit $2 at $(( $(date +%s) - start )) s"; }

SITE=/tmp/site
export PYTHONPATH="$PWD:${PYTHONPATH:+$PYTHONPATH:}$SITE"  # the project is not installed there
if ! python3 -c "import flax, optax, orbax.checkpoint, tensorboardX, grain, pyarrow, tokenizers" 2> /dev/null; then
  pip_install() {
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile --no-cache-dir \
      --index-url file:///opt/pypi/simple --find-links .whl-tpu --target "$SITE" --upgrade "$@" absl-py tensorboardX \
      safetensors tokenizers sentencepiece pyarrow zstandard grain
  }
  # The versions this project's CI runs, else the index's own.
  pip_install flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 2>&1 | tail -3 \
    || pip_install flax optax orbax-checkpoint 2>&1 | tail -3
  took install 0
fi
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__,
jax.devices())" 2>&1 | tee "$OUT/devices.log"

if [ "$MODE" = check ]; then
  timeout -s INT "$(cap 300)" python3 scripts/check_kernels.py ${CHECK_ARGS:-} 2>&1 | tee -a "$OUT/check_kernels.log" \
    | quiet
  check=${PIPESTATUS[0]}
  took check_kernels "$check"
  [ "${TRAIN:-1}" = 0 ] && exit "$check"
  timeout -s INT "$(cap 150)" python3 scripts/train_lm.py --workdir=/tmp/tpu_train > "$OUT/train_lm.log" 2>&1
  train=$?
  quiet < "$OUT/train_lm.log" | grep -i -E "eval|error|step 400|goodput|compute" | tail -8
  took train_lm "$train"
  exit $((check || train))
fi
if [ "$MODE" = bench ]; then
  cp kernels/defaults.json "$OUT/defaults.json"
  bench=0
  t=$(( $(left) - 200 ))  # the rest is the defaults run's
  if [ -n "${BENCH_KERNELS-attention,matmul,decode,grouped,paged}" ] && [ "$t" -gt 30 ]; then
    timeout -s INT "$t" python3 scripts/bench_kernels.py \
      --kernels="${BENCH_KERNELS-attention,matmul,decode,grouped,paged}" --iters=10 --warmup=2 \
      > "$OUT/bench_kernels.log" 2>&1
    bench=$?
    quiet < "$OUT/bench_kernels.log" | tail -90
    took bench_kernels "$bench"
  fi
  # The defaults: head dims 128, 64 and 256, GQA 32 / 8, at 4k and 16k tokens, causal and not, packed and not.
  t=$(( $(left) - 5 ))
  timeout -s INT "$(( t > 1 ? t : 1 ))" python3 scripts/bench_kernels.py --write_defaults="$OUT/defaults.json" \
    ${DEFAULTS_ARGS:---seq_lens=4096,16384 --defaults_head_dims=128,64,256 --heads=32 --kv_heads=8 --tokens=16384} \
    --iters=5 --warmup=1 > "$OUT/defaults.log" 2>&1
  defaults=$?
  quiet < "$OUT/defaults.log" | sed -n '/^## defaults written/,$p'
  took defaults "$defaults"
  exit $((bench || defaults))
fi
timeout -s INT "$(left)" python3 scripts/bench_data.py --corpus_mb=64 --bpe_train_mb=8 --seq_len=2048 \
  --batch_rows=4 --batches=10 --workers=0,2 --tokenizers=bpe --train_steps=25 --hidden=2048 --layers=8 --heads=32 \
  --kv_heads=4 --intermediate=5632 2>&1 | tee "$OUT/bench_data.log" | quiet
took bench_data "${PIPESTATUS[0]}"
