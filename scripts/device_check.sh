#!/usr/bin/env bash
# The one prepared run for a lent GPU (the device tool runs it from the repository root), inside a 450 s budget, each
# part capped and its summary printed as soon as it ends (a run cut short keeps what it printed):
#   1. kernel correctness (scripts/check_kernels.py: compiled Triton kernels against the float32 reference on the host,
#      the grouped matmul at Mixtral-8x7B's experts and paged attention included; 120 s at most): its rows print as
#      they are measured, the first within seconds, each with its compile seconds. It runs with XLA's gemm autotuning
#      off (--xla_gpu_autotune_level=0): a correctness check needs no tuned gemm, and the hypothesis to verify here is
#      that autotuning the float32 dots is where the 90 s of its first reference went (its compile columns say);
#   2. the training step against torch.compile at TinyLlama-1.1B's shape, 2k tokens a row, and beside it the same step
#      with its scanned stacks zero-filled (XLA's default: its loss must equal the engine's) (scripts/bench_gpu_step.py;
#      180 s at most; `step` mode runs the whole benchmark: both shapes at 2k and 8k, both PyTorch peers);
#   3. the main job end to end (scripts/train_lm.py, README line 1, with the Triton MLP and the fused loss too; 90 s
#      at most): its eval losses compare with the CPU run's (scripts/README.md);
#   4. the benchmark tables of issues 5 and 6 (scripts/bench_kernels.py: flash attention at 2k-16k, the fused
#      matmuls at LLM sizes, beside XLA and cuDNN; one decoding step against 8k and 32k caches), then the grouped
#      matmul at Mixtral-8x7B's experts (beside its 'xla' path and ragged_dot) and paged decoding (beside
#      decode_attention): last, so that the older tables still print if the budget runs out; 45 s are kept for 5;
#   5. with what is left of the budget, the block-size search (bench_kernels.py --tune): attention at 8k causal, then
#      the matmuls; interrupted (SIGINT) at the deadline, it still prints what it measured.
# Full logs go to $OUT (./device_out when unset); every measured row is also logged as it happens.
#   run: command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=480   (BUDGET=seconds overrides the 450)
# `bash scripts/device_check.sh tune` runs step 5 alone on the whole budget (a second call while the machine is warm,
# e.g. BUDGET=240 with timeout_s=260). `step` runs the whole step benchmark alone (whole rows, as the peers; the engine scanned,
# unrolled and with cuBLAS GEMMs), then the engine's rows again on packed rows with the Mosaic GPU attention and (TinyLlama) cuDNN's masked one, then FP8
# beside bf16 at LLaMA-3-8B's shape, while the budget lasts (carry=[".peers"]; the
# PyTorch peer's script travels in the ignored .peers/: `mkdir -p .peers && cp ../shared/peers/torch_llama_step.py
# .peers/ && echo /.peers/ >> .git/info/exclude`). `defaults` measures every attention / loss / MLP implementation per shape
# class (attention: head dims 128, 64, 256 at 4k and 16k tokens, causal and not, packed and not) and writes the merged
# table to $OUT/defaults.json (bench_kernels.py --write_defaults; copy it over kernels/defaults.json after reading it).
# `data` measures issue 45's input wait under TinyLlama's real step (scripts/bench_data.py; carry=[".whl"] with Grain's
# wheels). On the device image the packages are the image's own (python3 holds jax with CUDA). It lacks tensorboardX,
# which the training script needs, and Grain, which bench_data.py needs: their wheels are carried in .whl/ (ignored by
# git; WORKSPACE.md says how to fetch them) and installed first, in every mode.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
case "$MODE" in all|tune|step|defaults|data) ;; *) echo "error: mode=$MODE; expected all, tune, step, defaults or data" >&2
  exit 2;; esac
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-450}
start=$(date +%s)
left() { local s=$((BUDGET - ($(date +%s) - start))); echo $((s > 1 ? s : 1)); }  # timeout 0 would mean none
cap() { local t; t=$(left); echo $((t < $1 ? t : $1)); }  # what is left, at most $1 seconds
quiet() { grep --line-buffered -v -E "^[IWE][0-9]{4} "; }  # the console without absl's log lines

# Packages the device image lacks (tensorboardX for the training script; grain, array_record and portpicker for
# bench_data.py), carried as wheels in .whl/ (WORKSPACE.md says how to fetch them), installed without their
# dependencies, which the image holds, into /tmp/site.
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/devices.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$OUT/devices.log"
check=0 train=0 bench=0 step=0
if [ "$MODE" = step ]; then
  # The engine scanned, unrolled (no [layers, ...] stacks of saved activations to fill, copy into and copy out of,
  # against a longer compile) and scanned with every matmul through cuBLAS (XLA's Triton GEMMs off: cuBLAS reads and
  # writes the stacks' slices in place), then the peers, at each shape.
  timeout -s INT "$(left)" $PY scripts/bench_gpu_step.py --per_run_timeout=240 --engine_runs=bf16,unrolled,cublas \
    --out="$OUT/bench_gpu_step.jsonl" 2>&1 | tee "$OUT/bench_gpu_step.log" | quiet
  status=${PIPESTATUS[0]}
  # The engine again with the Mosaic GPU attention on packed rows (segment ids, as the training scripts' rows carry
  # them; the run above has whole rows, as the peers), while time is left.
  if [ "$(left)" -gt 60 ]; then
    timeout -s INT "$(left)" $PY scripts/bench_gpu_step.py --per_run_timeout=120 --peers= --packed \
      --attention_implementation=mosaic_gpu --out="$OUT/bench_gpu_step.jsonl" 2>&1 | tee -a "$OUT/bench_gpu_step.log" \
      | quiet | tail -8
  fi
  # And with cuDNN's attention on the packed rows (their segment ids as a mask), TinyLlama's shape only.
  if [ "$(left)" -gt 60 ]; then
    timeout -s INT "$(left)" $PY scripts/bench_gpu_step.py --per_run_timeout=120 --peers= --packed --shapes=tinyllama \
      --attention_implementation=cudnn --out="$OUT/bench_gpu_step.jsonl" 2>&1 | tee -a "$OUT/bench_gpu_step.log" \
      | quiet | tail -5
  fi
  # FP8 against bf16 at LLaMA-3-8B's shape, side by side in one run (issue 47's 1.3x), while time is left: 8 layers,
  # which the engine fits on an 80 GB H100 too (no peer here; the runs above take fewer there, to fit the peers).
  if [ "$(left)" -gt 60 ]; then
    timeout -s INT "$(left)" $PY scripts/bench_gpu_step.py --per_run_timeout=120 --peers= --shapes=llama3_8b \
      --llama3_layers=8 --seq_lens=2048 --engine_runs=bf16,fp8 --out="$OUT/bench_gpu_step.jsonl" 2>&1 \
      | tee -a "$OUT/bench_gpu_step.log" | quiet | tail -6
  fi
  exit "$status"
fi
if [ "$MODE" = data ]; then
  # Issue 45's input wait under a real GPU step: TinyLlama's shape (d 2048, ff 5632, 22 layers, 32 / 4 heads, bf16
  # compute) trained by Trainer.fit on the generated corpus's MapDataset rows through its trained 32000-word BPE, 4 rows
  # of 2048 a step (issue 44's 8192 tokens), the rows built in this process and in 2 workers: the share of each step
  # spent waiting for input (the target: under 2 %), after the pipeline's own tokens/s (4x the step's rate wanted).
  timeout -s INT "$(left)" $PY scripts/bench_data.py --corpus_mb=64 --bpe_train_mb=8 \
    --seq_len=2048 --batch_rows=4 --batches=10 --workers=0,2 --tokenizers=bpe --train_steps=25 --hidden=2048 \
    --layers=22 --heads=32 --kv_heads=4 --intermediate=5632 2>&1 | tee "$OUT/bench_data.log" | quiet
  exit "${PIPESTATUS[0]}"
fi
if [ "$MODE" = defaults ]; then
  cp kernels/defaults.json "$OUT/defaults.json"
  # Issue 44's head dims (128 first) and GQA at 4k and 16k (their neighbours cover 2k-32k), 5 samples a candidate:
  # the budget ends it where it ends, every class timed until then written.
  timeout -s INT "$(left)" $PY scripts/bench_kernels.py --write_defaults="$OUT/defaults.json" --seq_lens=4096,16384 \
    --defaults_head_dims=128,64,256 --heads=32 --kv_heads=8 --tokens=16384 --iters=5 --warmup=1 2>&1 \
    | tee "$OUT/defaults.log" | quiet
  exit "${PIPESTATUS[0]}"
fi
if [ "$MODE" = all ]; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout -s INT "$(cap 120)" $PY scripts/check_kernels.py 2>&1 \
    | tee "$OUT/check_kernels.log" | quiet
  check=${PIPESTATUS[0]}
  echo "check_kernels exit $check at $(( $(date +%s) - start )) s"

  # The engine's step, then the same with its scanned stacks zero-filled first (XLA's default, which engine.compiler
  # turns off: the losses must agree), then torch.compile.
  timeout -s INT "$(cap 180)" $PY scripts/bench_gpu_step.py --shapes=tinyllama --seq_lens=2048 --peers=compile \
    --engine_runs=bf16,fills --steps=10 --warmup=2 --per_run_timeout=100 --out="$OUT/bench_gpu_step.jsonl" 2>&1 \
    | tee "$OUT/bench_gpu_step.log" | quiet | tail -10
  step=${PIPESTATUS[0]}
  echo "bench_gpu_step exit $step at $(( $(date +%s) - start )) s"

  timeout -s INT "$(cap 90)" $PY scripts/train_lm.py --workdir=/tmp/device_train --loss_implementation=auto \
    --model_overrides='{"hidden_size": 128, "intermediate_size": 384, "num_layers": 4, "mlp_implementation": "triton"}' \
    > "$OUT/train_lm.log" 2>&1
  train=$?
  quiet < "$OUT/train_lm.log" | grep -i -E "eval|loss|error|step 400|throughput" | tail -6
  echo "train_lm exit $train at $(( $(date +%s) - start )) s"

  t=$(( $(left) - 45 ))
  if [ "$t" -gt 30 ]; then
    timeout -s INT "$t" $PY scripts/bench_kernels.py --kernels=attention,matmul,decode,grouped,paged \
      --attention_dropout=0.1 \
      > "$OUT/bench_kernels.log" 2>&1
    bench=$?
    grep -E "blocks|BlockSizes" "$OUT/bench_kernels.log" | head -20
    quiet < "$OUT/bench_kernels.log" | tail -110
    echo "bench_kernels exit $bench at $(( $(date +%s) - start )) s"
  fi
fi
tune_time=$(( $(left) - 15 ))
if [ "$tune_time" -gt 30 ]; then
  timeout -s INT "$tune_time" $PY scripts/bench_kernels.py --tune=attention,matmul --seq_lens=8192 --causal=true \
    --iters=10 --warmup=2 > "$OUT/tune.log" 2>&1
  # Per search: its title, the fastest two rows, the default and the baseline (all rows are in $OUT/tune.log).
  quiet < "$OUT/tune.log" \
    | awk '/^## /{print; n=0; next} /^-|^candidate +blocks/{next} NF{n++; if (n <= 2 || $1 != "candidate") print}'
fi
echo "check_kernels exit $check, bench_gpu_step exit $step, train_lm exit $train, bench_kernels exit $bench," \
  "$(( $(date +%s) - start )) s"
exit $((check || step || train || bench))
