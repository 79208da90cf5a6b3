"""Correctness of the compiled kernels on the machine it runs on: one table, exit status 1 on any failure.

  python scripts/check_kernels.py                 # on a GPU/TPU: the default (Pallas) implementation, compiled
  python scripts/check_kernels.py --interpret     # on CPU: the Triton kernels in Pallas's interpreter (a smoke run)

Every row draws fresh random normal inputs, runs the kernel forward and backward under a random cotangent, and
compares the output and every gradient with the 'xla' implementation run in float32 at the highest matmul precision
on the same (rounded) inputs, by ||ours - reference|| / ||reference||. Limits (device/METHOD.md): float32 1e-3 (GPU
matrix units run float32 dots as tf32, about 3e-4), 16-bit inputs 2e-2. A NaN or inf fails.
"""
import os
import sys

import numpy as np
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_bool("interpret", False, "Run the Triton kernels in Pallas's interpreter (CPU smoke run).")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Input dtypes.")
flags.DEFINE_enum("size", None, ["small", "large"], "Shapes; default large on an accelerator, small on CPU.")
flags.DEFINE_integer("seed", 0, "First random key; every row uses a fresh one.")

LIMITS = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}


def cases(size):
    """(name, shape text, fn(impl_kwargs, *args), arg shapes, integer arg makers) per kernel."""
    import jax.numpy as jnp

    import kernels
    small = size == "small"
    B, T, H, KVH, D = (2, 64, 4, 2, 64) if small else (2, 2048, 16, 4, 128)
    N, K, F, V = (48, 64, 96, 160) if small else (4096, 4096, 11008, 32000)
    seg = (np.arange(T) >= T // 3).astype(np.int32) + 1

    def labels(n, v):
        out = np.random.RandomState(n).randint(0, v, n).astype(np.int32)
        out[::7] = -100  # ignored tokens
        return jnp.asarray(out)

    return [
        ("flash_attention causal GQA", f"B{B} T{T} H{H}/{KVH} D{D}",
         lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, **impl),
         [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D)]),
        ("flash_attention segments", f"B{B} T{T} H{H} D{D}",
         lambda impl, q, k, v: kernels.flash_attention(q, k, v, segment_ids=jnp.asarray(np.tile(seg, (B, 1))),
                                                       **impl),
         [(B, T, H, D), (B, T, H, D), (B, T, H, D)]),
        ("fused_matmul bias+gelu", f"{N}x{K}x{F}",
         lambda impl, x, w, b: kernels.fused_matmul(x, w, b, activation="gelu", **impl), [(N, K), (K, F), (F,)]),
        ("gated_mlp silu", f"{N}x{K}x{F}",
         lambda impl, x, g, u: kernels.gated_mlp(x, g, u, **impl), [(N, K), (K, F), (K, F)]),
        ("linear_cross_entropy", f"N{N} D{K} V{V}",
         lambda impl, x, w: kernels.linear_cross_entropy(x, w, labels(N, V), **impl), [(N, K), (K, V)]),
    ]


def relative_error(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(ours)):
        return float("inf")
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def check(name, fn, shapes, dtype, impl, key):
    """max relative error over the output and the gradients, and the worst part's name."""
    import jax
    import jax.numpy as jnp
    keys = jax.random.split(key, len(shapes) + 1)
    args = [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]

    def value_and_vjp(impl, *args):
        out, vjp = jax.vjp(lambda *a: fn(impl, *a), *args)
        cotangent = jax.random.normal(keys[-1], out.shape, jnp.float32).astype(out.dtype)
        return out, vjp(cotangent)

    ours = jax.jit(lambda *a: value_and_vjp(impl, *a))(*args)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda *a: value_and_vjp({"implementation": "xla"}, *a))(*[a.astype(jnp.float32) for a in args])
    parts = ["out"] + [f"d{i}" for i in range(len(args))]
    errors = [relative_error(o, r) for o, r in zip(jax.tree.leaves(ours), jax.tree.leaves(ref))]
    worst = int(np.argmax(errors))
    return errors[worst], parts[worst]


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from kernels import resolve_implementation
    on_cpu = jax.default_backend() == "cpu"
    impl = {"implementation": "triton", "interpret": True} if FLAGS.interpret else {}
    chosen = impl.get("implementation") or resolve_implementation(None)
    if chosen == "xla":
        raise ValueError("no Pallas kernel to check on this backend; expected a GPU/TPU, or --interpret")
    size = FLAGS.size or ("small" if on_cpu else "large")
    rows, failed, key = [], 0, jax.random.key(FLAGS.seed)
    for dtype_name in FLAGS.dtypes:
        if dtype_name not in LIMITS:
            raise ValueError(f"--dtypes has {dtype_name!r}; expected some of {sorted(LIMITS)}")
        for name, shape, fn, shapes in cases(size):
            key, sub = jax.random.split(key)
            try:
                error, part = check(name, fn, shapes, jnp.dtype(dtype_name), impl, sub)
                ok = error <= LIMITS[dtype_name]
                rows.append((name, shape, dtype_name, f"{error:.2e}", part, "ok" if ok else "FAIL"))
            except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a failed row, not a crash
                ok = False
                rows.append((name, shape, dtype_name, "-", "-", f"FAIL {type(e).__name__}: {str(e)[:80]}"))
            failed += not ok
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  implementation: {chosen}"
          f"{' (interpret)' if FLAGS.interpret else ''}")
    header = ("kernel", "shape", "dtype", "rel err", "worst", "result")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"{len(rows) - failed}/{len(rows)} passed")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    from engine import cli
    cli.run(main)
