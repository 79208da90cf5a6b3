"""Benchmarks the engine's kernels against XLA baselines and prints one table per kernel family.

  python scripts/bench_kernels.py --kernels=attention
  python scripts/bench_kernels.py --kernels=attention --seq_lens=2048,4096,8192,16384 --dtype=bfloat16
  python scripts/bench_kernels.py --kernels=matmul

Each row: median wall time over --iters runs after --warmup runs (random normal inputs, jitted, blocked on the
result), achieved TFLOP/s and the fraction of the device's dense peak for that dtype. On CPU the defaults are small
shapes: a smoke check that every path runs, not a measurement.
"""
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.attention import BlockSizes, flash_attention  # noqa: E402
from kernels.attention.api import choose_block_sizes  # noqa: E402
from kernels._dispatch import resolve_implementation  # noqa: E402
from kernels.matmul import benchmark as matmul_benchmark  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["attention"], "Kernel families to benchmark.")
flags.DEFINE_integer("warmup", 3, "Untimed runs before timing (the first also compiles).")
flags.DEFINE_integer("iters", 20, "Timed runs; the median is reported.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Default bf16 on accelerators, f32 on CPU.")
flags.DEFINE_list("seq_lens", None, "Attention sequence lengths; default 2k-16k on accelerators, 128,256 on CPU.")
flags.DEFINE_integer(
    "tokens", None, "Attention batch = tokens // seq_len (FlashAttention-2 paper setup); default 16384 (CPU: 512)."
)
flags.DEFINE_integer("heads", None, "Attention query heads; default 16 (CPU: 4).")
flags.DEFINE_integer("kv_heads", None, "Attention kv heads; default = heads.")
flags.DEFINE_integer("head_dim", None, "Attention head dim; default 128 (CPU: 64).")
flags.DEFINE_list("causal", ["true", "false"], "Attention masking modes to run.")
flags.DEFINE_list(
    "attention_blocks", None, "Override: block_q,block_k,block_q_bwd,block_k_bwd[,num_warps,num_stages] (for tuning)."
)

# Dense peak TFLOP/s for 16-bit inputs (f32 runs use the same figure, so their % is a lower bound), by device_kind
# prefix; vendor datasheets (H100/H200 SXM: 989; A100: 312; TPU v4: 275, v5e: 197, v5p: 459, v6e: 918).
_PEAK_TFLOPS = {
    "NVIDIA H100": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA A100": 312.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6": 918.0,
}


def _peak_tflops():
    kind = jax.devices()[0].device_kind
    return next((peak for prefix, peak in _PEAK_TFLOPS.items() if kind.startswith(prefix)), None)


def _median_seconds(fn, *args):
    for _ in range(FLAGS.warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(name, shape, fn, args, flops):
    """One table row; a path that fails (OOM, unsupported) is reported instead of measured."""
    try:
        seconds = _median_seconds(jax.jit(fn), *args)
    except Exception as e:  # a baseline such as cuDNN may not support this shape or device
        logging.warning("%s %s failed: %s", name, shape, e)
        return [name, shape, "-", "-", "-", type(e).__name__]
    tflops = flops / seconds / 1e12
    peak = _peak_tflops()
    return [name, shape, f"{seconds * 1e3:.3f}", f"{tflops:.2f}", f"{100 * tflops / peak:.1f}" if peak else "-", ""]


def bench_attention():
    """flash_attention (default implementation) vs jax.nn.dot_product_attention, forward and forward+backward."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(FLAGS.dtype or ("float32" if on_cpu else "bfloat16"))
    seq_lens = [int(n) for n in FLAGS.seq_lens or (["128", "256"] if on_cpu else ["2048", "4096", "8192", "16384"])]
    tokens = FLAGS.tokens or (512 if on_cpu else 16384)
    heads = FLAGS.heads or (4 if on_cpu else 16)
    kv_heads = FLAGS.kv_heads or heads
    head_dim = FLAGS.head_dim or (64 if on_cpu else 128)
    ours = resolve_implementation(None)
    override = BlockSizes(*map(int, FLAGS.attention_blocks)) if FLAGS.attention_blocks else None
    baselines = {"jax.nn[xla]": "xla"} if on_cpu else {"jax.nn[xla]": "xla", "jax.nn[cudnn]": "cudnn"}
    if jax.default_backend() == "tpu":
        baselines.pop("jax.nn[cudnn]", None)

    rows = []
    for seq_len in seq_lens:
        batch = max(1, tokens // seq_len)
        key_q, key_k, key_v = jax.random.split(jax.random.key(seq_len), 3)
        q = jax.random.normal(key_q, (batch, seq_len, heads, head_dim), dtype)
        k = jax.random.normal(key_k, (batch, seq_len, kv_heads, head_dim), dtype)
        v = jax.random.normal(key_v, (batch, seq_len, kv_heads, head_dim), dtype)
        for causal in [c.lower() == "true" for c in FLAGS.causal]:
            # 2 matmuls of 2*T*S*D flops per head; causal does half; the backward is 2.5x the forward (5 matmuls).
            fwd_flops = 4 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
            blocks = choose_block_sizes(ours, head_dim, seq_len, seq_len, override)
            shape = f"B{batch} T{seq_len} H{heads}/{kv_heads} D{head_dim} {'causal' if causal else 'full'}"
            logging.info("%s: %s blocks %s", shape, ours, blocks)
            ours_fn = functools.partial(flash_attention, causal=causal, block_sizes=override)
            paths = {f"flash_attention[{ours}]": ours_fn}
            for name, impl in baselines.items():
                paths[name] = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=impl)
            for name, attend in paths.items():
                rows.append(_measure(f"{name} fwd", shape, attend, (q, k, v), fwd_flops))
            for name, attend in paths.items():
                loss = lambda q, k, v, attend=attend: attend(q, k, v).astype(jnp.float32).sum()
                rows.append(_measure(f"{name} fwd+bwd", shape, jax.grad(loss, (0, 1, 2)), (q, k, v), 3.5 * fwd_flops))
    return rows


def bench_matmul():
    """fused_matmul, gated_mlp and linear_cross_entropy (default implementation) vs XLA's unfused ops, forward and
    forward+backward; the loss rows also note the compiled temporary memory (the materialised logits, for XLA)."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(FLAGS.dtype or ("float32" if on_cpu else "bfloat16"))
    rows = []
    for case in matmul_benchmark.cases("small" if on_cpu else "large", dtype, resolve_implementation(None)):
        for name, fn in case.paths.items():
            row = _measure(f"{name} {case.direction}", case.shape, fn, case.args, case.flops)
            if case.kernel == "linear_cross_entropy" and not row[-1]:
                row[-1] = f"temp {matmul_benchmark.temp_bytes(fn, case.args) / 2**20:.1f} MiB"
            rows.append(row)
    return rows


_KERNEL_FAMILIES = {"attention": bench_attention, "matmul": bench_matmul}


def _print_table(title, rows):
    header = ["kernel", "shape", "median ms", "TFLOP/s", "% peak", "note"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    print(f"\n## {title} ({jax.devices()[0].device_kind}, jax {jax.__version__})")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def main(argv):
    del argv
    unknown = [name for name in FLAGS.kernels if name not in _KERNEL_FAMILIES]
    if unknown:
        raise app.UsageError(f"--kernels: unknown {unknown}; expected some of {list(_KERNEL_FAMILIES)}")
    for name in FLAGS.kernels:
        _print_table(name, _KERNEL_FAMILIES[name]())


if __name__ == "__main__":
    app.run(main)
