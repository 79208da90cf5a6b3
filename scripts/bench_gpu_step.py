"""The training step on one GPU at LLM shapes, beside transformers + PyTorch eager and torch.compile (issue 44).

For each shape and row length: the engine's step (a native LLaMA, scanned layers, bf16 compute over fp32 master weights,
AdamW, `engine.Trainer` on a one-device mesh; with `--engine_runs=bf16,fp8` also with the projections' matmuls in FP8,
`models.ModelOptions.fp8`, issue 47's row), then `--torch_peer` (transformers' LlamaForCausalLM, autocast bf16 over fp32
weights, fused AdamW) eager and under torch.compile at the same shape and tokens a step. Every run is a subprocess of
its own: it frees the device between runs (JAX keeps its memory pool until the process ends), JAX and PyTorch never
share the GPU, and `--per_run_timeout` bounds each one. Each prints one `RESULT {json}` line; this process only counts
model FLOPs (on the CPU backend, so it takes no GPU memory) and prints the table.

The engine is timed as `fit` runs it: `fit` warms up (its first step compiles), then the compiled step is called
directly on one placed batch, each step waited for, and the median taken. MFU counts `models.train_flops_per_example`
(PaLM's 6N + causal attention, no recomputation) over `engine.flops.peak_tflops` of the device, for the peers too.

  .venv/bin/python scripts/bench_gpu_step.py --shapes=tiny --seq_lens=64 --tokens_per_step=256   # CPU smoke test
  python3 scripts/bench_gpu_step.py --shapes=tinyllama,llama3_8b --seq_lens=2048,8192 --out=$OUT/bench_gpu_step.jsonl
  python3 scripts/bench_gpu_step.py --shapes=llama3_8b --engine_runs=bf16,fp8 --peers=   # FP8 against bf16
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from absl import flags

import kernels
from engine import compiler
from engine.tasks import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS

# Shapes: a named LLaMA config and the fields that differ from it. TinyLlama-1.1B is LLaMA-2's layout at d 2048.
# LLaMA-3-8B keeps its width and vocabulary but runs --llama3_layers of its 32 layers, so that it and both peers fit one
# H200 (139 GiB) at 16384 tokens a step. 8 layers: 8 x 218.1M + 2 x 525.3M (embedding, untied head) = 2.80B parameters;
# fp32 master weights, fp32 gradients and AdamW's two fp32 moments are 16 B each (44.7 GB), a bf16 copy for the matmuls
# 5.6 GB. Activations: without remat (the default, as the peers) PyTorch eager keeps every activation in bf16, about 4.4
# GB a layer (the engine less: scripts/README.md plans it), and 25 GB around the loss (the fp32 logits [16384, 128256]
# and their gradient): about 110 GB. 12 layers would add some 31 GB (141 GB, at the card's edge), so 8 leave room for
# allocator slack. On a smaller card (an 80 GB H100) `peer_layers` takes the most layers that this arithmetic fits in
# 85% of its memory (3 there), so that both peers still run beside the engine. --remat=dots keeps only the weight-matmul
# outputs (q, k, v, o, gate, up, down: 43008 values a token) for less memory and more time.
SHAPES = {
    "tiny": ("tiny", dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          vocab_size=256)),
    "tinyllama": ("llama2-7b", dict(hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                                    num_kv_heads=4, vocab_size=32000)),
    "llama3_8b": ("llama3-8b", {}),  # num_layers: --llama3_layers
}
PEER_NAMES = {"eager": "torch eager", "compile": "torch.compile"}
PEER_FILE = "torch_llama_step.py"
DEFAULT_PEER = next((p for p in (os.path.join(ROOT, ".peers", PEER_FILE),
                                 os.path.join(ROOT, "..", "shared", "peers", PEER_FILE)) if os.path.exists(p)),
                    os.path.join(ROOT, ".peers", PEER_FILE))
TARGET_RATIO, TARGET_MFU = 1.15, 0.50  # issue 44: over torch.compile's tokens/s; MFU at the LLaMA-3-8B shape
TARGET_FP8 = 1.3  # issue 47: the FP8 step's tokens/s over the bf16 step's at the LLaMA-3-8B shape
ENGINE_RUNS = {"bf16": "engine", "unrolled": "engine unrolled", "cublas": "engine cuBLAS", "fills": "engine zero fills",
               "fp8": "engine fp8"}
# The XLA flags a run adds to its subprocess's XLA_FLAGS: 'cublas' turns XLA's Triton GEMM fusions off, so that every
# matmul is a cuBLAS call, which XLA can fuse with a scanned stack's slices (its operands read and its result written
# in place there: engine/README.md's traffic figures); the autotuner, which times each GEMM alone, cannot weigh that.
# 'fills' turns off what engine.compiler turns on, XLA's elimination of a scanned stack's zero fills: the same
# program with its stacks zeroed first, whose loss must equal the engine's (`agreement_lines`).
RUN_XLA_FLAGS = {"cublas": "--xla_gpu_enable_triton_gemm=false",
                 "fills": f"--{compiler.FILL_ELIMINATION}=false"}

flags.DEFINE_list("shapes", ["tinyllama", "llama3_8b"], f"Model shapes, of {sorted(SHAPES)}.")
flags.DEFINE_list("seq_lens", ["2048", "8192"], "Tokens a row.")
flags.DEFINE_integer("tokens_per_step", 16384, "Tokens a step; rows = tokens_per_step // seq_len (at least 1).")
flags.DEFINE_integer("steps", 10, "Timed steps of each run.")
flags.DEFINE_integer("warmup", 3, "Untimed steps before them (the first compiles).")
flags.DEFINE_integer("llama3_layers", 0, "Layers of the llama3_8b shape (of LLaMA-3-8B's 32; the comment at SHAPES "
                     "says why 8 fit one H200). 0: by the first GPU's memory (nvidia-smi): 8 on an H200, fewer on "
                     "a card where the PyTorch peers would not fit them (3 on an 80 GB H100); 8 without nvidia-smi.")
flags.DEFINE_bool("scan_layers", True, "Scan the engine's layers (one compiled layer, its saved activations stacked "
                  "[layers, ...]); false: unrolled, each layer its own code and buffers (longer compile, no stacks to "
                  "fill and copy in and out).")
flags.DEFINE_enum("remat", "none", ["full", "dots", "none"], "The engine's rematerialisation of each layer (none: "
                  "as the PyTorch peers, which keep every activation).")
flags.DEFINE_enum("attention_implementation", None, list(kernels.ATTENTION_IMPLEMENTATIONS), "The engine's attention "
                  "kernel (unset: kernels.default_implementation's choice for the device and shape).")
flags.DEFINE_bool("packed", False, "Give the engine's rows segment ids (one document a row), as the training "
                  "scripts' packed rows carry them: attention then runs the defaults table's segment-id class. "
                  "Default: whole rows, as the PyTorch peers train on.")
flags.DEFINE_enum("loss_implementation", "plain", ["plain", "chunked", "auto", *kernels.IMPLEMENTATIONS],
                  "The engine's loss: plain logits, 'chunked' (kernels.linear_cross_entropy_sum), or the fused head + "
                  "loss kernel (kernels.linear_cross_entropy).")
flags.DEFINE_list("engine_runs", ["bf16"], "The engine's runs, in this order, of: bf16 (every matmul in bf16), "
                  "unrolled (the same with the layers unrolled), cublas (the same with XLA's Triton GEMMs off: every "
                  "matmul through cuBLAS), fills (the same with the scanned stacks zero-filled first, as XLA does by "
                  "default: its loss must equal bf16's) and fp8 (the attention and MLP projections' matmuls in FP8, "
                  "models.ModelOptions.fp8).")
flags.DEFINE_list("peers", ["compile", "eager"], "PyTorch peers to run after the engine, in this order. Skipped "
                  "with a note when torch has no CUDA, unless this flag is given explicitly (a CPU smoke test).")
flags.DEFINE_string("torch_peer", DEFAULT_PEER, "Path of torch_llama_step.py (the GPU machine receives only the "
                    "repository: copy it into .peers/).")
flags.DEFINE_string("torch_python", sys.executable, "Python that runs the PyTorch peers.")
flags.DEFINE_integer("per_run_timeout", 300, "Seconds each run (subprocess) may take.")
flags.DEFINE_string("out", None, "Append every run's result to this JSON-lines file as it finishes.")
flags.DEFINE_string("worker", None, "Internal: measure the engine at SHAPE:SEQ_LEN and print its RESULT line.")


# ------------------------------------------------------------------------------------------------ shapes and FLOPs
def make_model(shape, seq_len, *, llama3_layers=8, remat="none", attention_implementation=None, fp8=False,
               scan_layers=True):
    """The native LLaMA (`models.create_model('llama', ...)`) of a shape at rows of `seq_len` tokens, scanned (unless
    not `scan_layers`), with the given remat and attention kernel (and FP8 projections with `fp8`). The model's dtype
    is left at its default: the step's compute dtype comes from `engine.Precision`, as a user's does."""
    import models
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}; expected one of {sorted(SHAPES)}")
    base, overrides = SHAPES[shape]
    overrides = dict(overrides, scan_layers=scan_layers, remat=remat, attention_implementation=attention_implementation,
                     fp8=fp8)
    if shape == "llama3_8b":
        overrides["num_layers"] = llama3_layers
    overrides["max_position_embeddings"] = max(seq_len, models.get_config("llama", base).max_position_embeddings)
    return models.create_model("llama", base, **overrides)


def rows_of(tokens_per_step, seq_len):
    return max(1, tokens_per_step // seq_len)


def peer_args(config, seq_len, tokens_per_step, steps, warmup):
    """torch_llama_step.py's flags for the same shape (its head dim is hidden / heads, as every shape here has)."""
    return [f"--seq={seq_len}", f"--tokens={tokens_per_step}", f"--layers={config.num_layers}",
            f"--hidden={config.hidden_size}", f"--ff={config.intermediate_size}", f"--heads={config.num_heads}",
            f"--kv_heads={config.kv_heads}", f"--vocab={config.vocab_size}", f"--steps={steps}",
            f"--warmup={warmup}"]


def flops_per_step(model, seq_len, rows):
    """Model FLOPs of one training step of `rows` rows (`models.train_flops_per_example`)."""
    import models
    return models.train_flops_per_example(model, seq_len) * rows


# ------------------------------------------------------------------------------------------------ the engine's run
def engine_case(shape, seq_len, *, tokens_per_step, steps, warmup, llama3_layers=8, remat="none",
                attention_implementation=None, loss_implementation=None, fp8=False, packed=False, scan_layers=True):
    """Measures the engine's step on the first device: {'run' ('engine', or 'engine fp8' with `fp8`), 'step_ms'
    (median), 'tokens_per_s', 'warmup_s' (`fit`'s first `warmup` steps, the compile included), 'peak_gb' (None where
    the device does not say), 'device_kind', 'peak_tflops', 'loss', 'attention' (the implementation it ran), ...}.
    Rows are whole sequences, or with `packed` carry segment ids (one document each); layers scanned unless not
    `scan_layers`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import engine
    import models
    from engine import data as data_lib
    from engine.flops import peak_tflops
    from engine.tasks import lm
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps={steps}, warmup={warmup}; expected both >= 1 (the first warm-up step compiles)")
    model = make_model(shape, seq_len, llama3_layers=llama3_layers, remat=remat,
                       attention_implementation=attention_implementation, fp8=fp8, scan_layers=scan_layers)
    config = model.config
    device = jax.devices()[0]
    mesh = engine.make_mesh(data=1, devices=[device])
    rows = rows_of(tokens_per_step, seq_len)
    rng = np.random.default_rng(0)
    examples = [{"tokens": rng.integers(0, config.vocab_size, seq_len + 1, dtype=np.int32)}
                for _ in range(rows * warmup)]
    if packed:
        examples = [{**e, "segment_ids": np.ones(seq_len + 1, np.int32)} for e in examples]
    attention = attention_implementation or kernels.default_implementation(
        "flash_attention", head_dim=config.dim_per_head, seq_len=seq_len, causal=True, dtype=jnp.bfloat16,
        segments=packed)
    params = models.init_params(model, jax.random.key(0), layout=engine.auto_layout(mesh))
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model, loss_implementation),
                             params=params, optimizer=optax.adamw(1e-4),
                             precision=engine.Precision(compute_dtype=jnp.bfloat16))
    del params
    start = time.perf_counter()
    trainer.fit(examples, per_device_batch_size=rows, max_steps=warmup, log_every=warmup)
    jax.block_until_ready(trainer.params)
    warmup_s = time.perf_counter() - start
    # The program fit ran, called on fit's state (donated to it: the Trainer is not used again).
    compiled, params, opt_state = trainer.compiled_step(), trainer.params, trainer.opt_state
    _, _, batch = next(data_lib.iterate_batches(mesh, examples[:rows], lm.collate_lm, per_device_batch_size=rows))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch, np.int32(warmup + i))
        jax.block_until_ready((params, opt_state, metrics))
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    stats = _memory_stats(device)
    peak = stats.get("peak_bytes_in_use")
    return dict(run=ENGINE_RUNS["fp8" if fp8 else "bf16"], step_ms=round(step_s * 1e3, 3),
                tokens_per_s=round(rows * seq_len / step_s, 1),
                warmup_s=round(warmup_s, 2), peak_gb=None if peak is None else round(peak / 1e9, 2),
                device_kind=device.device_kind, peak_tflops=peak_tflops(device),
                loss=float(metrics["loss"]), batch=rows, seq=seq_len, jax=jax.__version__, attention=attention,
                packed=packed, scan_layers=scan_layers)


def _memory_stats(device):
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics (CPU)
        return {}


# ------------------------------------------------------------------------------------------------ subprocesses
def parse_result(stdout):
    """The JSON of the last `RESULT {json}` line of a run's output (the engine worker's and torch_llama_step.py's
    format), or None."""
    found = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            try:
                found = json.loads(line[len("RESULT "):])
            except json.JSONDecodeError:
                continue
    return found


def run_env(env, kind):
    """The environment of engine run `kind`: `env` with the run's `RUN_XLA_FLAGS` appended to its XLA_FLAGS."""
    extra = RUN_XLA_FLAGS.get(kind)
    if not extra:
        return env
    return dict(env, XLA_FLAGS=" ".join(f for f in (env.get("XLA_FLAGS", ""), extra) if f))


def run_case(cmd, timeout, env=None):
    """(RESULT dict or None, a one-line note: why it gave none) of a subprocess, in a session of its own so that a
    timeout ends its children too (torch.compile's compile workers)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout} s"
    except BaseException:  # interrupted (SIGINT, SIGTERM): the run ends with this process
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    result = parse_result(out)
    if result is not None:
        return result, ""
    lines = [line.strip() for line in (err + "\n" + out).splitlines() if line.strip()]
    return None, f"exit {proc.returncode}: {(lines[-1] if lines else 'no output')[:160]}"


# The peers' memory at the llama3_8b shape (the comment at SHAPES), in GB: the embedding's and head's fp32 state and
# bf16 copies, and per layer its state; then, per 16384 tokens a step, the loss's fp32 logits and gradient and each
# layer's activations.
PEER_GB = dict(fixed=18.9, layer=3.9, loss_per_16k=25.0, layer_per_16k=4.4)
MAX_LLAMA3_LAYERS = 8


def peer_layers(memory_gb, tokens_per_step):
    """The llama3_8b shape's layers for a GPU of `memory_gb` (None: unknown, 8): the most, up to 8, whose PyTorch
    peers' estimate (`PEER_GB`) fits 85 % of the card at `tokens_per_step`, at least 1."""
    if memory_gb is None:
        return MAX_LLAMA3_LAYERS
    t = tokens_per_step / 16384
    room = 0.85 * memory_gb - PEER_GB["fixed"] - PEER_GB["loss_per_16k"] * t
    return max(1, min(MAX_LLAMA3_LAYERS, int(room // (PEER_GB["layer"] + PEER_GB["layer_per_16k"] * t))))


def gpu_memory_gb():
    """The first GPU's memory in GB (1e9 bytes) as nvidia-smi reports it, or None (no nvidia-smi, no GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
        return int(out.stdout.split()[0]) * 2**20 / 1e9 if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def torch_has_cuda(python):
    """Whether `python` imports a torch that sees a CUDA device."""
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().endswith("True")


# ------------------------------------------------------------------------------------------------ the table
def add_figures(records, flops, peak_tflops):
    """Each record (a dict with 'shape', 'seq', 'run', 'tokens_per_s' or None) with 'mfu' (model FLOPs of the step,
    `flops[(shape, seq)]`, at its tokens/s over `peak_tflops`; None without a peak) and 'vs_compile' (its tokens/s
    over torch.compile's at the same shape and row length; None without one)."""
    compile_tps = {(r["shape"], r["seq"]): r["tokens_per_s"] for r in records
                   if r["run"] == PEER_NAMES["compile"] and r.get("tokens_per_s")}
    out = []
    for r in records:
        tps, key = r.get("tokens_per_s"), (r["shape"], r["seq"])
        mfu = ratio = None
        if tps and peak_tflops:
            mfu = tps / (r["seq"] * r["rows"]) * flops[key] / (peak_tflops * 1e12)
        if tps and key in compile_tps:
            ratio = tps / compile_tps[key]
        out.append(dict(r, mfu=mfu, vs_compile=ratio))
    return out


def _fmt(value, spec, suffix=""):
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def format_table(records):
    """The markdown table of `add_figures`' records."""
    header = ["shape", "seq", "rows", "run", "ms/step", "tokens/s", "MFU", "peak GB", "warm-up s", "vs torch.compile"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        run = r["run"] + (f" ({r['note']})" if r.get("note") else "")
        if r.get("attention"):  # the engine's: the attention it ran, and on which rows
            run += (f" [attention {r['attention']}{', packed rows' if r.get('packed') else ''}"
                    f"{', layers unrolled' if r.get('scan_layers') is False and 'unrolled' not in r['run'] else ''}]")
        shape = r["shape"] + (f" ({r['layers']} layers)" if r["shape"] == "llama3_8b" and r.get("layers") else "")
        cells = [shape, str(r["seq"]), str(r["rows"]), run, _fmt(r.get("step_ms"), ".1f"),
                 _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(None if r["mfu"] is None else 100 * r["mfu"], ".1f", " %"),
                 _fmt(r.get("peak_gb"), ".2f"), _fmt(r.get("warmup_s"), ".1f"), _fmt(r["vs_compile"], ".2f", "x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(records):
    """Issue 44's targets, one line each where the runs it needs finished: the engine's tokens/s at least 1.15x
    torch.compile's, and at least 50 % MFU at the llama3_8b shape; issue 47's: the FP8 step's tokens/s at least 1.3x
    the bf16 step's at the llama3_8b shape."""
    lines = []
    bf16 = {(r["shape"], r["seq"]): r["tokens_per_s"] for r in records
            if r["run"] == ENGINE_RUNS["bf16"] and r.get("tokens_per_s")}
    for r in records:
        key = (r["shape"], r["seq"])
        if r["run"] == ENGINE_RUNS["fp8"] and r.get("tokens_per_s") and r["shape"] == "llama3_8b" and key in bf16:
            ratio = r["tokens_per_s"] / bf16[key]
            met = "met" if ratio >= TARGET_FP8 else "not met"
            lines.append(f"target {TARGET_FP8}x the bf16 step with FP8, {r['shape']} seq {r['seq']}: {ratio:.2f}x "
                         f"({met})")
        if r["run"] != "engine" or not r.get("tokens_per_s") or r["shape"] == "tiny":
            continue
        where = f"{r['shape']} seq {r['seq']}"
        if r["vs_compile"] is not None:
            met = "met" if r["vs_compile"] >= TARGET_RATIO else "not met"
            lines.append(f"target {TARGET_RATIO}x torch.compile, {where}: {r['vs_compile']:.2f}x ({met})")
        if r["shape"] == "llama3_8b" and r["mfu"] is not None:
            met = "met" if r["mfu"] >= TARGET_MFU else "not met"
            lines.append(f"target {100 * TARGET_MFU:.0f} % MFU, {where}: {100 * r['mfu']:.1f} % ({met})")
    return lines


def agreement_lines(records):
    """One line per shape and row length where both ran: the loss of the engine's step beside the same program with
    its scanned stacks zero-filled first ('fills'). XLA's elimination of the fills is sound only if every slot is
    written before it is read, so the two must agree (bit for bit, unless a kernel's reductions are
    nondeterministic)."""
    engine = {(r["shape"], r["seq"]): r["loss"] for r in records
              if r["run"] == ENGINE_RUNS["bf16"] and r.get("loss") is not None}
    lines = []
    for r in records:
        key = (r["shape"], r["seq"])
        if r["run"] != ENGINE_RUNS["fills"] or r.get("loss") is None or key not in engine:
            continue
        diff = abs(engine[key] - r["loss"]) / max(abs(r["loss"]), 1e-30)
        verdict = "equal" if diff == 0 else ("agree" if diff < 1e-3 else "DIFFER")
        lines.append(f"stacks unfilled against zero-filled, {r['shape']} seq {r['seq']}: loss {engine[key]:.6f} "
                     f"against {r['loss']:.6f}, relative difference {diff:.1e} ({verdict})")
    return lines


# ------------------------------------------------------------------------------------------------ main
def _check_flags():
    for shape in FLAGS.shapes:
        if shape not in SHAPES:
            raise ValueError(f"--shapes: {shape!r}; expected names of {sorted(SHAPES)}")
    try:
        seq_lens = [int(s) for s in FLAGS.seq_lens]
    except ValueError:
        raise ValueError(f"--seq_lens={','.join(FLAGS.seq_lens)}; expected positive integers") from None
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"--seq_lens={','.join(FLAGS.seq_lens)}; expected positive integers")
    unknown = sorted(set(FLAGS.peers) - set(PEER_NAMES))
    if unknown:
        raise ValueError(f"--peers: {unknown}; expected names of {sorted(PEER_NAMES)}")
    unknown = sorted(set(FLAGS.engine_runs) - set(ENGINE_RUNS))
    if unknown or not FLAGS.engine_runs:
        raise ValueError(f"--engine_runs={','.join(FLAGS.engine_runs)}; expected one or more of {sorted(ENGINE_RUNS)}")
    for name in ("tokens_per_step", "steps", "warmup", "per_run_timeout"):
        if getattr(FLAGS, name) < 1:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}; expected an integer >= 1")
    if FLAGS.llama3_layers < 0:
        raise ValueError(f"--llama3_layers={FLAGS.llama3_layers}; expected an integer >= 1, or 0 (by the GPU's memory)")
    return seq_lens


def _engine_kwargs():
    return dict(tokens_per_step=FLAGS.tokens_per_step, steps=FLAGS.steps, warmup=FLAGS.warmup,
                llama3_layers=FLAGS.llama3_layers, remat=FLAGS.remat,
                attention_implementation=FLAGS.attention_implementation,
                loss_implementation=None if FLAGS.loss_implementation == "plain" else FLAGS.loss_implementation,
                packed=FLAGS.packed, scan_layers=FLAGS.scan_layers)


def _worker_cmd(shape, seq_len, kind="bf16"):
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={shape}:{seq_len}:{kind}"]
    for name in ("tokens_per_step", "steps", "warmup", "llama3_layers", "remat", "loss_implementation"):
        cmd.append(f"--{name}={getattr(FLAGS, name)}")
    if FLAGS.attention_implementation:
        cmd.append(f"--attention_implementation={FLAGS.attention_implementation}")
    return cmd + ["--packed"] * FLAGS.packed + ["--noscan_layers"] * (not FLAGS.scan_layers)


def _peers_to_run():
    """The --peers that will run, and a note on those that will not."""
    if not FLAGS.peers:
        return [], None
    if not os.path.exists(FLAGS.torch_peer):
        return [], f"PyTorch peers skipped: {FLAGS.torch_peer} not found (mkdir -p .peers && cp " \
                   f"../shared/peers/{PEER_FILE} .peers/)"
    if FLAGS["peers"].present or torch_has_cuda(FLAGS.torch_python):
        return list(FLAGS.peers), None
    return [], f"PyTorch peers skipped: {FLAGS.torch_python} has no torch with CUDA (--peers=eager runs them anyway)"


def _run_shape(shape, seq, peers, child_env, flops, records):
    """The engine's run and the peers' at one shape and row length, each added to `records`, printed and logged to
    --out as it ends; the step's model FLOPs go into `flops`."""
    model = make_model(shape, seq, llama3_layers=FLAGS.llama3_layers)
    rows = rows_of(FLAGS.tokens_per_step, seq)
    flops[(shape, seq)] = flops_per_step(model, seq, rows)
    runs = [(ENGINE_RUNS[kind], _worker_cmd(shape, seq, kind), run_env(child_env, kind)) for kind in FLAGS.engine_runs]
    args = peer_args(model.config, seq, FLAGS.tokens_per_step, FLAGS.steps, FLAGS.warmup)
    runs += [(PEER_NAMES[p], [FLAGS.torch_python, FLAGS.torch_peer, *args] + (["--compile"] if p == "compile" else []),
              child_env) for p in peers]
    for run, cmd, env in runs:
        start = time.perf_counter()
        result, why = run_case(cmd, FLAGS.per_run_timeout, env)
        record = dict(result or {}, shape=shape, seq=seq, rows=rows, run=run, layers=model.config.num_layers,
                      wall_s=round(time.perf_counter() - start, 1))
        if result is None:
            record.update(note=why, tokens_per_s=None)
        print(f"{shape} seq {seq}: {run}: " + (f"{record['step_ms']} ms/step, {record['tokens_per_s']:,.0f} tokens/s"
                                                if result else why), flush=True)
        if FLAGS.out:
            with open(FLAGS.out, "a") as f:
                f.write(json.dumps(record) + "\n")
        records.append(record)


def main(argv):
    del argv
    if FLAGS.worker:
        shape, seq, kind = FLAGS.worker.split(":")
        kwargs = _engine_kwargs()
        kwargs["scan_layers"] &= kind != "unrolled"
        result = dict(engine_case(shape, int(seq), fp8=kind == "fp8", **kwargs), run=ENGINE_RUNS[kind])
        print("RESULT " + json.dumps(result), flush=True)
        return
    seq_lens = _check_flags()
    if FLAGS.llama3_layers == 0:  # by the GPU's memory, for this process and every run's
        memory = gpu_memory_gb()
        FLAGS.llama3_layers = peer_layers(memory, FLAGS.tokens_per_step)
        if "llama3_8b" in FLAGS.shapes:
            print(f"llama3_8b: {FLAGS.llama3_layers} of LLaMA-3-8B's 32 layers (--llama3_layers=0: "
                  f"{f'a GPU of {memory:.1f} GB' if memory else 'no GPU memory reported'})", flush=True)
    child_env = dict(os.environ)
    # JAX takes 75 % of a GPU's memory by default; the llama3_8b shape wants more (the comment at SHAPES).
    child_env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    import jax
    jax.config.update("jax_platforms", "cpu")  # this process counts FLOPs only: the GPU is the runs'
    peers, note = _peers_to_run()
    if note:
        print(note, flush=True)
    print(f"engine ({', '.join(FLAGS.engine_runs)}): native LLaMA, "
          f"{'scanned' if FLAGS.scan_layers else 'unrolled'} layers, remat={FLAGS.remat}, attention="
          f"{FLAGS.attention_implementation or 'default'}, loss={FLAGS.loss_implementation}, "
          f"{'packed rows (segment ids)' if FLAGS.packed else 'whole rows'}; bf16 compute over fp32 "
          f"master weights, AdamW; one device. {FLAGS.tokens_per_step} tokens a step, median of {FLAGS.steps} steps "
          f"after {FLAGS.warmup}.", flush=True)
    records, flops, interrupted = [], {}, False
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as SIGINT: the table of what finished
    try:
        for shape in FLAGS.shapes:
            for seq in seq_lens:
                _run_shape(shape, seq, peers, child_env, flops, records)
    except KeyboardInterrupt:
        print("interrupted: the table holds the runs that finished", flush=True)
        interrupted = True
    peak = next((r["peak_tflops"] for r in records if r.get("peak_tflops")), None)
    records = add_figures(records, flops, peak)
    for line in target_lines(records) + agreement_lines(records):
        print(line)
    print()
    print(format_table(records), flush=True)
    if interrupted:
        raise SystemExit(130)  # 128 + SIGINT, as the training scripts exit when stopped


if __name__ == "__main__":
    cli.run(main)
