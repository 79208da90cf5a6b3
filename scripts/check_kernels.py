"""Correctness of the compiled kernels on the machine it runs on: one table, printed row by row as each is measured,
exit status 1 on any failure.

  python scripts/check_kernels.py                 # on a GPU/TPU: the default (Pallas) implementation, compiled
  python scripts/check_kernels.py --interpret     # on CPU: the Triton kernels in Pallas's interpreter (a smoke run)

Every row draws fresh random normal inputs, runs the kernel forward and backward under a random cotangent, and
compares the output and every gradient with the 'xla' implementation run in float32 on the same (rounded) inputs, by
||ours - reference|| / ||reference||. The reference runs on the host's CPU by default (`--reference=host`): XLA:CPU
computes float32 dots in float32 and compiles these programs in about a second, where a GPU compiles (and autotunes)
every float32 dot at `Precision.HIGHEST` as a multi-pass gemm that XLA autotunes (on an H200 the first such reference
took 90 s to compile). `--reference=device` runs it on the accelerator at the highest matmul precision, as before. Limits
(device/METHOD.md): float32 1e-3 (GPU matrix units run float32 dots as tf32, about 3e-4), 16-bit inputs 2e-2; a row
also passes at no more than twice the error of the plain 'xla' path run in the same dtype on the device (shown beside
it). A NaN or inf fails. paged_attention is forward only (it has no gradient), so its rows compare the output alone.
Rows run cheapest first; the last is a small LLaMA (scanned, rematerialised) with the kernels in its attention and
MLP, its arguments every parameter. Each row shows the seconds spent compiling ours and the plain path on the device
and the reference's seconds (compile and run), so a slow check says where its time goes.
"""
import sys
import time
from typing import Callable, NamedTuple, Sequence, Union

import numpy as np
from absl import flags


FLAGS = flags.FLAGS
flags.DEFINE_bool("interpret", False, "Run the Triton kernels in Pallas's interpreter (CPU smoke run).")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Input dtypes.")
flags.DEFINE_enum("size", None, ["small", "large"], "Shapes; default large on an accelerator, small on CPU.")
flags.DEFINE_integer("seed", 0, "First random key; every row uses a fresh one.")
flags.DEFINE_list("only", None, "Check only the rows whose kernel name contains one of these (e.g. paged,gated); "
                  "unset: every row.")
flags.DEFINE_enum("reference", "host", ["host", "device"], "Where the float32 reference runs: the host's CPU (exact "
                  "float32 dots, compiled in seconds) or the accelerator at the highest matmul precision.")

LIMITS = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}


class Case(NamedTuple):
    """One row per dtype: `fn(impl_kwargs, *args)`, its args as float shapes (fresh normal draws in the row's dtype)
    or `make_args(key, dtype)`; `backward`: also compare the gradients of every arg under a random cotangent;
    `dtypes`: the only dtypes it runs in (None: every --dtypes)."""
    name: str
    shape: str
    fn: Callable
    args: Union[Sequence[tuple], Callable]
    backward: bool = True
    dtypes: Union[tuple, None] = None


def _model_case(small):
    """A scanned, rematerialised LLaMA with the kernels in both its attention and its MLP (packed rows of two
    segments): logits and the gradients of every parameter, so each kernel's backward is checked where a model
    calls it. Its arguments are the parameters at their initial scale, fresh per row."""
    import jax
    import jax.numpy as jnp

    import models
    B, T = (2, 64) if small else (2, 1024)
    config = dict(scan_layers=True, remat="full") if small else dict(
        scan_layers=True, remat="full", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_heads=8,
        num_kv_heads=2, max_position_embeddings=T)
    ids = jnp.asarray(np.random.RandomState(T).randint(0, 128, (B, T)), jnp.int32)
    segments = jnp.asarray(np.tile((np.arange(T) >= T // 3).astype(np.int32) + 1, (B, 1)))

    def model(impl, dtype):
        kernel = impl.get("implementation")
        return models.create_model("llama", "tiny", attention_implementation=kernel, mlp_implementation=kernel,
                                   kernel_interpret=impl.get("interpret", False), dtype=dtype, **config)

    def fn(impl, params):
        dtype = jax.tree.leaves(params)[0].dtype.name
        return model(impl, dtype).apply({"params": params}, ids, segments)

    def make_args(key, dtype):
        params = models.init_params(model({}, "float32"), key)
        return [jax.tree.map(lambda p: p.astype(dtype), params)]

    cfg = model({}, "float32").config
    return Case("llama layers (scan, remat)", f"B{B} T{T} d{cfg.hidden_size} H{cfg.num_heads}/{cfg.kv_heads} "
                f"L{cfg.num_layers}", fn, make_args)


def _grouped_cases(small):
    """grouped_matmul forward and both backward products (d0: dx = dy @ w[g].T, d1: dw[g] = x[g].T @ dy[g]) at
    Mixtral-8x7B's experts (top-2 of 8 over 2048 tokens: 4096 rows, 4096 -> 14336) or a small shape. The groups are
    ragged, one is empty, and the last rows belong to none (padding: zero out, zero dx)."""
    import jax.numpy as jnp

    import kernels
    M, K, N, G = (200, 64, 96, 4) if small else (4096, 4096, 14336, 8)
    weights = [3, 0, 1, 2] if small else [5, 1, 0, 3, 2, 4, 1, 2]  # group 1 (small) / 2 (large) is empty
    used = M - 8  # padding rows past the last group
    sizes = [used * w // sum(weights) for w in weights]
    sizes[-1] += used - sum(sizes)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    return [Case("grouped_matmul ragged", f"{M}x{K}x{N} G{G} sizes {'/'.join(map(str, sizes))}",
                 lambda impl, x, w: kernels.grouped_matmul(x, w, group_sizes, **impl), [(M, K), (G, K, N)])]


def _paged_cases(small):
    """paged_attention (forward only) for one decoding step: GQA, ragged lengths including an empty sequence and one
    filling its whole table, pages in a random order of a pool larger than the batch needs; bf16 / f32 pages, and
    int8 pages (fixed) whose per-token scales are the arguments."""
    import jax
    import jax.numpy as jnp

    import kernels
    B, H, KVH, D, T, P = (4, 4, 2, 64, 96, 16) if small else (8, 32, 8, 128, 2048, 16)
    max_pages, num_pages = T // P, B * (T // P) + 3
    rng = np.random.RandomState(T)
    table = jnp.asarray(rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages), jnp.int32)
    lengths = rng.randint(1, T, B)
    lengths[0], lengths[-1] = 0, T
    lengths = jnp.asarray(lengths, jnp.int32)
    pages = (KVH, num_pages, P, D)
    k8, v8 = (jnp.asarray(rng.randint(-127, 128, pages), jnp.int8) for _ in range(2))

    def int8_args(key, dtype):
        kq, ks, kv = jax.random.split(key, 3)
        scale = lambda k: (jnp.abs(jax.random.normal(k, pages[:3])) / 127).astype(jnp.float32)  # noqa: E731
        return [jax.random.normal(kq, (B, H, D), jnp.float32).astype(dtype), scale(ks), scale(kv)]

    shape = f"B{B} T{T} page {P} H{H}/{KVH} D{D} lengths {int(lengths.min())}-{int(lengths.max())}"
    return [
        Case("paged_attention GQA", shape,
             lambda impl, q, k, v: kernels.paged_attention(q, k, v, table, lengths, **impl),
             [(B, H, D), pages, pages], backward=False),
        Case("paged_attention int8 pages", shape,
             lambda impl, q, ks, vs: kernels.paged_attention(q, k8, v8, table, lengths, k_scale=ks, v_scale=vs,
                                                             **impl),
             int8_args, backward=False),
    ]


def _cudnn_cases(B, T, H, KVH, D, seg):
    """`flash_attention(implementation='cudnn')` itself, 16-bit only: causal GQA, and packed segment ids (its boolean
    mask read as a bias), whatever the default implementation is."""
    import jax.numpy as jnp

    import kernels
    cudnn = dict(implementation="cudnn")
    return [
        Case("flash_attention[cudnn] causal GQA", f"B{B} T{T} H{H}/{KVH} D{D}",
             lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, **cudnn),
             [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D)], dtypes=("bfloat16", "float16")),
        Case("flash_attention[cudnn] causal segments", f"B{B} T{T} H{H}/{KVH} D{D}",
             lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, **cudnn,
                                                           segment_ids=jnp.asarray(np.tile(seg, (B, 1)))),
             [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D)], dtypes=("bfloat16", "float16")),
    ]


def cases(size, cudnn=False):
    """A `Case` per kernel; with `cudnn` (an NVIDIA GPU, not interpreted) also cuDNN's attention."""
    import jax
    import jax.numpy as jnp

    import kernels
    small = size == "small"
    B, T, H, KVH, D = (2, 64, 4, 2, 64) if small else (2, 2048, 16, 4, 128)
    N, K, F, V = (48, 64, 96, 160) if small else (4096, 4096, 11008, 32000)
    seg = (np.arange(T) >= T // 3).astype(np.int32) + 1

    q_gate, q_up = (jnp.asarray(np.random.RandomState(i).randint(-127, 128, (K, F)), jnp.int8) for i in (1, 2))

    def labels(n, v):
        out = np.random.RandomState(n).randint(0, v, n).astype(np.int32)
        out[::7] = -100  # ignored tokens
        return jnp.asarray(out)

    # Cheapest first (forward-only paged decoding, then attention, the matmuls, the experts, the model), so the first
    # rows print within seconds and a run cut short keeps the most rows.
    return [
        *_paged_cases(small),
        *(_cudnn_cases(B, T, H, KVH, D, seg) if cudnn else []),
        Case("flash_attention causal GQA", f"B{B} T{T} H{H}/{KVH} D{D}",
             lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, **impl),
             [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D)]),
        Case("flash_attention segments", f"B{B} T{T} H{H} D{D}",
             lambda impl, q, k, v: kernels.flash_attention(q, k, v, segment_ids=jnp.asarray(np.tile(seg, (B, 1))),
                                                           **impl),
             [(B, T, H, D), (B, T, H, D), (B, T, H, D)]),
        # The mask is a hash computed in the kernel: this row checks the GPU's integer ops give the reference's mask.
        Case("flash_attention dropout 0.1", f"B{B} T{T} H{H}/{KVH} D{D}",
             lambda impl, q, k, v: kernels.flash_attention(q, k, v, causal=True, dropout_rate=0.1,
                                                           dropout_rng=jax.random.key(0), **impl),
             [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D)]),
        Case("fused_matmul bias+gelu", f"{N}x{K}x{F}",
             lambda impl, x, w, b: kernels.fused_matmul(x, w, b, activation="gelu", **impl), [(N, K), (K, F), (F,)]),
        Case("gated_mlp silu", f"{N}x{K}x{F}",
             lambda impl, x, g, u: kernels.gated_mlp(x, g, u, **impl), [(N, K), (K, F), (K, F)]),
        # int8 weights (fixed) converted in the kernel; the arguments are x and the two column scales.
        Case("gated_mlp int8 weights", f"{N}x{K}x{F}",
             lambda impl, x, sg, su: kernels.gated_mlp(x, q_gate, q_up, w_gate_scale=sg, w_up_scale=su, **impl),
             [(N, K), (F,), (F,)]),
        Case("linear_cross_entropy", f"N{N} D{K} V{V}",
             lambda impl, x, w: kernels.linear_cross_entropy(x, w, labels(N, V), **impl), [(N, K), (K, V)]),
        *_grouped_cases(small),
        _model_case(small),
    ]


def relative_error(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(ours)):
        return float("inf")
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def passes(error, plain_error, dtype_name):
    """Within the dtype's limit, or no more than twice the plain XLA path's own error in that dtype (a whole model
    in 16 bits drifts further than one kernel, for XLA too)."""
    return np.isfinite(error) and (error <= LIMITS[dtype_name] or error <= 2 * plain_error)


def _part_names(args):
    """'out' then one name per argument leaf: d0, d1, ... or d0:layers/attn/q/kernel for a parameter tree."""
    import jax
    names = ["out"]
    for path, _ in jax.tree_util.tree_leaves_with_path(args):
        inner = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path[1:])
        names.append(f"d{path[0].idx}" + (f":{inner}" if inner else ""))
    return names


class Result(NamedTuple):
    """A row's measurement: `error` (max relative error over the output and the gradients, the output alone without
    `backward`), `part` (the worst part's name), `plain_error` (the same error of the plain 'xla' implementation run
    in the row's dtype), `seconds` {'ours', 'xla': compile seconds on the device; 'reference': compile + run}."""
    error: float
    part: str
    plain_error: float
    seconds: dict


def _compiled(fn, args):
    """(fn jitted and compiled ahead of time for `args`, its compile seconds)."""
    import jax
    lowered = jax.jit(fn).lower(*args)
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def check(name, fn, shapes, dtype, impl, key, backward=True, reference="host"):
    """`Result` of one row: `fn(impl, *args)` (and its gradients under a random cotangent) against the 'xla'
    implementation in float32, computed on the host's CPU (`reference='host'`) or on the default device at the
    highest matmul precision ('device')."""
    import jax
    import jax.numpy as jnp
    key, cotangent_key = jax.random.split(key)
    if callable(shapes):
        args = shapes(key, dtype)
    else:
        args = [jax.random.normal(k, s, jnp.float32).astype(dtype)
                for k, s in zip(jax.random.split(key, len(shapes)), shapes)]

    def value_and_vjp(impl):
        def run(cotangent_key, *args):
            if not backward:
                return fn(impl, *args)
            out, vjp = jax.vjp(lambda *a: fn(impl, *a), *args)
            cotangent = jax.random.normal(cotangent_key, out.shape, jnp.float32).astype(out.dtype)
            return out, vjp(cotangent)
        return run

    xla = {"implementation": "xla"}
    seconds = {}
    ours, seconds["ours"] = _compiled(value_and_vjp(impl), [cotangent_key, *args])
    ours = jax.block_until_ready(ours(cotangent_key, *args))
    plain, seconds["xla"] = _compiled(value_and_vjp(xla), [cotangent_key, *args])
    plain = jax.block_until_ready(plain(cotangent_key, *args))
    start = time.perf_counter()
    ref_args = [cotangent_key, *jax.tree.map(lambda a: a.astype(jnp.float32), args)]
    host = jax.devices("cpu")[0] if reference == "host" else None
    with jax.default_device(host), jax.default_matmul_precision("highest"):
        # On the host the arguments (and the constants the cases close over, made uncommitted) follow to the CPU.
        ref = jax.jit(value_and_vjp(xla))(*jax.device_put(ref_args, host))
        ref = jax.device_get(ref)
    seconds["reference"] = time.perf_counter() - start
    errors = lambda got: [relative_error(o, r) for o, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
    ours_errors = errors(ours)
    worst = int(np.argmax(ours_errors))
    return Result(ours_errors[worst], _part_names(args)[worst], max(errors(plain)), seconds)


COLUMNS = (("kernel", 28), ("shape", 48), ("dtype", 8), ("rel err", 8), ("xla same dtype", 14), ("compile s ours/xla", 18),
           ("ref s", 6), ("worst", 12), ("result", 0))


def _row(cells):
    """One table line, printed at once (a run cut short keeps every row it measured)."""
    print("  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip(), flush=True)


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from kernels import resolve_implementation
    from kernels._dispatch import is_nvidia_gpu
    on_cpu = jax.default_backend() == "cpu"
    impl = {"implementation": "triton", "interpret": True} if FLAGS.interpret else {}
    chosen = impl.get("implementation") or resolve_implementation(None)
    if chosen == "xla":
        raise ValueError("no Pallas kernel to check on this backend; expected a GPU/TPU, or --interpret")
    for dtype_name in FLAGS.dtypes:
        if dtype_name not in LIMITS:
            raise ValueError(f"--dtypes has {dtype_name!r}; expected some of {sorted(LIMITS)}")
    size = FLAGS.size or ("small" if on_cpu else "large")
    on_nvidia = not FLAGS.interpret and is_nvidia_gpu(jax.devices()[0])
    chosen_cases = [c for c in cases(size, cudnn=on_nvidia) if not FLAGS.only or any(o in c.name for o in FLAGS.only)]
    if not chosen_cases:
        raise ValueError(f"--only={','.join(FLAGS.only)} matches no row; expected parts of the kernel names: "
                         f"{', '.join(c.name for c in cases(size, cudnn=on_nvidia))}")
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  implementation: {chosen}"
          f"{' (interpret)' if FLAGS.interpret else ''}  reference: float32 on the {FLAGS.reference}", flush=True)
    _row([name for name, _ in COLUMNS])
    rows = failed = 0
    key = jax.random.key(FLAGS.seed)
    for name, shape, fn, shapes, backward, dtypes in chosen_cases:
        for dtype_name in (d for d in FLAGS.dtypes if dtypes is None or d in dtypes):
            key, sub = jax.random.split(key)
            try:
                r = check(name, fn, shapes, jnp.dtype(dtype_name), impl, sub, backward, FLAGS.reference)
                ok = passes(r.error, r.plain_error, dtype_name)
                s = r.seconds
                _row((name, shape, dtype_name, f"{r.error:.2e}", f"{r.plain_error:.2e}",
                      f"{s['ours']:.1f}/{s['xla']:.1f}", f"{s['reference']:.1f}", r.part, "ok" if ok else "FAIL"))
            except Exception as e:  # noqa: BLE001 - a kernel that fails to compile is a failed row, not a crash
                ok = False
                _row((name, shape, dtype_name, "-", "-", "-", "-", "-", f"FAIL {type(e).__name__}: {str(e)[:80]}"))
            rows += 1
            failed += not ok
    print(f"{rows - failed}/{rows} passed")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    from engine.tasks import cli
    cli.run(main)
