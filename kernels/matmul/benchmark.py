"""Benchmark cases of the fused-matmul family beside XLA's unfused equivalents, for `scripts/bench_kernels.py`.

Each row times one kernel and its XLA baseline in the same process (median of `iters` runs after warm-up) and, for
the loss, compares the compiled temporary memory with the materialised-logits version. The script owns printing.
"""
import statistics
import time

import jax
import jax.numpy as jnp

from kernels.matmul import fused_matmul, gated_mlp, linear_cross_entropy, reference

# Dense bf16 peak TFLOP/s by device kind (vendor datasheets, no sparsity); None where unknown (e.g. CPU).
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
                "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0}

# (kernel, shape) per size: "large" are the targets (square 8192 matmul, LLaMA-3-8B MLP and loss);
# "small" is a CPU smoke check.
SIZES = {
    "large": {"fused_matmul": (8192, 8192, 8192), "gated_mlp": (8192, 4096, 14336),
              "linear_cross_entropy": (16384, 4096, 128256)},
    "small": {"fused_matmul": (256, 256, 256), "gated_mlp": (256, 128, 384),
              "linear_cross_entropy": (256, 128, 4096)},
}


def peak_tflops(device=None):
    kind = (device or jax.devices()[0]).device_kind
    return next((peak for name, peak in _PEAK_TFLOPS.items() if name in kind), None)


def median_seconds(fn, args, *, warmup=2, iters=10):
    """Median wall time of the jitted `fn(*args)`, compilation and warm-up excluded."""
    fn = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def temp_bytes(fn, args):
    return jax.jit(fn).trace(*args).lower().compile().memory_analysis().temp_size_in_bytes


def _grad_of_sum(fn, argnums):
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums)


def _cases(kernel, shape, implementation, dtype, key):
    """(args, [(pass, flops, fused fn, baseline fn)]) for one kernel; FLOPs count 2 per multiply-add."""
    m, k, n = shape
    keys = jax.random.split(key, 4)
    normal = lambda key, s, scale=1.0: (scale * jax.random.normal(key, s, jnp.float32)).astype(dtype)
    if kernel == "fused_matmul":
        args = (normal(keys[0], (m, k)), normal(keys[1], (k, n), k ** -0.5), normal(keys[2], (n,)))
        fused = lambda x, w, b: fused_matmul(x, w, b, activation="gelu_tanh", implementation=implementation)
        xla = lambda x, w, b: reference.fused_matmul_reference(x, w, b, activation="gelu_tanh")
        flops, argnums = 2 * m * k * n, (0, 1, 2)
    elif kernel == "gated_mlp":
        args = (normal(keys[0], (m, k)), normal(keys[1], (k, n), k ** -0.5), normal(keys[2], (k, n), k ** -0.5))
        fused = lambda x, wg, wu: gated_mlp(x, wg, wu, implementation=implementation)
        xla = reference.gated_mlp_reference
        flops, argnums = 4 * m * k * n, (0, 1, 2)
    else:
        args = (normal(keys[0], (m, k)), normal(keys[1], (k, n), k ** -0.5),
                jax.random.randint(keys[3], (m,), 0, n))
        fused = lambda x, w, labels: linear_cross_entropy(x, w, labels, implementation=implementation)
        xla = reference.linear_cross_entropy_reference
        flops, argnums = 2 * m * k * n, (0, 1)
    # Backward: two matmuls per forward one; the fused backward's recomputation is not counted as useful work.
    return args, [("fwd", flops, fused, xla),
                  ("fwd+bwd", 3 * flops, _grad_of_sum(fused, argnums), _grad_of_sum(xla, argnums))]


def run(size="small", kernels=("fused_matmul", "gated_mlp", "linear_cross_entropy"), implementation=None,
        dtype=jnp.bfloat16, iters=10):
    """Rows of {kernel, shape, pass, ms, tflops, pct_peak, xla_ms, xla_tflops, vs_xla[, temp_gb, xla_temp_gb]}."""
    peak = peak_tflops()
    rows = []
    for kernel in kernels:
        shape = SIZES[size][kernel]
        args, cases = _cases(kernel, shape, implementation, dtype, jax.random.key(0))
        for name, flops, fused, xla in cases:
            seconds, xla_seconds = (median_seconds(f, args, iters=iters) for f in (fused, xla))
            row = {"kernel": kernel, "shape": "x".join(map(str, shape)), "pass": name, "ms": 1e3 * seconds,
                   "tflops": flops / seconds / 1e12, "xla_ms": 1e3 * xla_seconds,
                   "xla_tflops": flops / xla_seconds / 1e12, "vs_xla": xla_seconds / seconds}
            row["pct_peak"] = None if peak is None else 100 * row["tflops"] / peak
            if kernel == "linear_cross_entropy":
                row["temp_gb"], row["xla_temp_gb"] = (temp_bytes(f, args) / 1e9 for f in (fused, xla))
            rows.append(row)
    return rows
