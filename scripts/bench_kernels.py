"""Benchmarks the engine's kernels against XLA baselines and prints one table per kernel family.

  python scripts/bench_kernels.py --kernels=attention
  python scripts/bench_kernels.py --kernels=attention --seq_lens=2048,4096,8192,16384 --dtype=bfloat16
  python scripts/bench_kernels.py --kernels=matmul
  python scripts/bench_kernels.py --kernels=decode     # one generation step against a half-filled KV cache
  python scripts/bench_kernels.py --kernels=grouped    # the MoE grouped matmul at Mixtral-8x7B's expert sizes
  python scripts/bench_kernels.py --kernels=paged      # paged_attention against decode_attention, ragged lengths
  python scripts/bench_kernels.py --tune=attention,matmul,grouped   # search the ops' block sizes instead
  python scripts/bench_kernels.py --write_defaults=kernels/defaults.json   # measure and record the defaults

Each row: median wall time per call over --iters samples after --warmup runs (random normal inputs, jitted; a
sample is back-to-back calls blocked on once), achieved TFLOP/s and the fraction of the device's dense peak for
that dtype. On CPU the defaults are small shapes: a smoke check that every path runs, not a measurement.

`--tune` times every candidate of the ops' `TUNING_SPACE` (kernels/attention/api.py, kernels/matmul/_blocks.py,
kernels/grouped_matmul/api.py) at one benchmark shape per op and prints them fastest first, the heuristic default
marked; an interrupt (SIGINT, e.g. `timeout -s INT`) ends the search and still prints what was measured.

`--write_defaults=PATH` times every implementation the device runs per shape class (attention: each --seq_lens x
--causal x --segments, forward and forward+backward; gated_mlp and linear_cross_entropy: the fused kernel against plain XLA
matmuls, both passes) and merges the fastest of each into the defaults table at PATH (kernels/_defaults.py), for
this device kind; other entries are kept. An interrupt (SIGINT) ends the timing and still merges what was measured.
"""
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging


from engine.flops import peak_tflops
from kernels.attention import BlockSizes, decode_attention, flash_attention, paged_attention
from kernels.attention.api import TUNING_SPACE as ATTENTION_TUNING_SPACE
from kernels.attention.api import choose_block_sizes
from kernels.grouped_matmul import grouped_matmul
from kernels.grouped_matmul.api import TUNING_SPACE as GROUPED_TUNING_SPACE
from kernels import _defaults
from kernels._dispatch import is_nvidia_gpu, resolve_implementation
from kernels.attention import mosaic_gpu as attention_mosaic_gpu
from kernels.attention import triton as attention_triton
from kernels.matmul import _blocks as matmul_blocks
from kernels.matmul import benchmark as matmul_benchmark

FLAGS = flags.FLAGS
flags.DEFINE_list("kernels", ["attention"], "Kernel families to benchmark.")
flags.DEFINE_integer("warmup", 3, "Untimed runs before timing (the first also compiles).")
flags.DEFINE_integer("iters", 20, "Timed samples; the median is reported.")
flags.DEFINE_float("min_sample_ms", 20.0, "Each sample runs back-to-back calls for about this long (at most 100).")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Default bf16 on accelerators, f32 on CPU.")
flags.DEFINE_list("seq_lens", None, "Attention sequence lengths; default 2k-16k on accelerators, 128,256 on CPU.")
flags.DEFINE_integer(
    "tokens", None, "Attention batch = tokens // seq_len (FlashAttention-2 paper setup); default 16384 (CPU: 512)."
)
flags.DEFINE_integer("heads", None, "Attention query heads; default 16 (CPU: 4).")
flags.DEFINE_integer("kv_heads", None, "Attention kv heads; default = heads.")
flags.DEFINE_integer("head_dim", None, "Attention head dim; default 128 (CPU: 64).")
flags.DEFINE_list("causal", ["true", "false"], "Attention masking modes to run.")
flags.DEFINE_list("defaults_head_dims", None, "--write_defaults: the head dims whose attention classes it times, in "
                  "this order (default: --head_dim's).")
flags.DEFINE_list("segments", ["true", "false"], "--write_defaults: attention classes to time with packed-document "
                  "segment ids (true: what the training scripts' packed rows pass; cuDNN takes them as a mask) "
                  "and without (false).")
flags.DEFINE_float("attention_dropout", 0.0, "When > 0, also time flash_attention with this dropout rate on the "
                   "probabilities (the in-kernel mask hash's cost; FLOPs counted as without dropout).",
                   lower_bound=0.0, upper_bound=0.95)
flags.DEFINE_enum("implementation", None, ["xla", "triton", "mosaic_tpu"], "Our kernels' implementation; default the "
                  "backend's fastest (with --interpret on CPU: 'triton').")
flags.DEFINE_bool("splash_interpret", False, "Also time JAX's TPU splash attention (a TPU's baseline row) in "
                  "Pallas's interpreter: a CPU smoke check of that row.")
flags.DEFINE_bool("interpret", False, "Run the Pallas kernels in Pallas's interpreter (a CPU smoke check).")
flags.DEFINE_integer("max_candidates", 0, "--tune: time at most this many candidates per table (0: all).")
flags.DEFINE_list("tune", [], "Kernel families whose block sizes to search instead of printing the benchmark tables: "
                  "attention at the first --seq_lens and --causal entries, the matmuls and grouped at their benchmark "
                  "sizes.")
flags.DEFINE_string("write_defaults", None, "Instead of the tables: time every implementation this device runs per "
                    "shape class (--kernels' attention and matmul: each --seq_lens x --causal; gated_mlp and "
                    "linear_cross_entropy fused against plain XLA matmuls; forward and forward+backward) and merge "
                    "the fastest into this defaults table (the checked-in one: kernels/defaults.json).")
flags.DEFINE_list(
    "attention_blocks", None, "Override: block_q,block_k,block_q_bwd,block_k_bwd[,num_warps,num_stages] (for tuning)."
)

flags.DEFINE_list("decode_batches", None, "decode: sequences per step; default 1,8 (CPU: 2).")
flags.DEFINE_list("grouped_shape", None, "grouped: rows,k,n,groups; default Mixtral-8x7B's experts on 8192 "
                  "tokens routed top-2, 16384,4096,14336,8 (CPU: 512,128,256,4).")
flags.DEFINE_list("decode_cache_lens", None, "decode: KV cache slots, half of them filled; default 8192,32768 "
                  "(CPU: 512). paged: the most tokens a sequence holds, lengths drawn from its upper half.")
flags.DEFINE_list("page_sizes", None, "paged: tokens per page; default 16,64 (CPU: 16).")


def _ours():
    """(implementation name, keyword arguments selecting it) of the kernels under test."""
    impl = resolve_implementation(FLAGS.implementation, interpret=FLAGS.interpret)
    return impl, dict(implementation=impl, interpret=FLAGS.interpret)


def _peak_tflops():
    return peak_tflops(jax.devices()[0])


def _median_seconds(fn, *args, outputs=None):
    """Median seconds per call over --iters samples. A sample is enough back-to-back calls to last about
    --min_sample_ms, blocked on once, so the host's dispatch and sync (tens of microseconds) are not counted per
    call: a 0.4 ms kernel timed one call at a time would read ~10% slow. outputs: a list the last call's result is
    appended to."""
    for _ in range(FLAGS.warmup):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(100, int(FLAGS.min_sample_ms / 1e3 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(FLAGS.iters):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    if outputs is not None:
        outputs.append(out)
    return statistics.median(times)


def _measure(name, shape, fn, args, flops, outputs=None):
    """One table row; a path that fails (OOM, unsupported) is reported instead of measured. outputs: as
    `_median_seconds`'."""
    try:
        seconds = _median_seconds(jax.jit(fn), *args, outputs=outputs)
    except Exception as e:  # a baseline such as cuDNN may not support this shape or device
        logging.warning("%s %s failed: %s", name, shape, e)
        return [name, shape, "-", "-", "-", type(e).__name__]
    tflops = flops / seconds / 1e12
    peak = _peak_tflops()
    row = [name, shape, f"{seconds * 1e3:.3f}", f"{tflops:.2f}", f"{100 * tflops / peak:.1f}" if peak else "-", ""]
    logging.info("measured %s", row)  # in the log as it happens, should the run be cut short
    return row


def _attention_setup():
    """(dtype, seq_lens, tokens, heads, kv_heads, head_dim, causal modes) from the flags and the backend."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(FLAGS.dtype or ("float32" if on_cpu else "bfloat16"))
    seq_lens = [int(n) for n in FLAGS.seq_lens or (["128", "256"] if on_cpu else ["2048", "4096", "8192", "16384"])]
    heads = FLAGS.heads or (4 if on_cpu else 16)
    return (dtype, seq_lens, FLAGS.tokens or (512 if on_cpu else 16384), heads, FLAGS.kv_heads or heads,
            FLAGS.head_dim or (64 if on_cpu else 128), [c.lower() == "true" for c in FLAGS.causal])


def _attention_inputs(dtype, seq_len, tokens, heads, kv_heads, head_dim, causal):
    """(q, k, v), the forward FLOPs and the shape label of one benchmark row."""
    batch = max(1, tokens // seq_len)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seq_len), 3)
    q = jax.random.normal(key_q, (batch, seq_len, heads, head_dim), dtype)
    k = jax.random.normal(key_k, (batch, seq_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(key_v, (batch, seq_len, kv_heads, head_dim), dtype)
    # 2 matmuls of 2*T*S*D flops per head; causal does half; the backward is 2.5x the forward (5 matmuls).
    fwd_flops = 4 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    shape = f"B{batch} T{seq_len} H{heads}/{kv_heads} D{head_dim} {'causal' if causal else 'full'}"
    return (q, k, v), fwd_flops, shape


def _packed_ids(batch, seq_len):
    """Segment ids [batch, seq_len] of packed documents (1, 2, ... per row) whose lengths are drawn from
    seq_len / 8 ... seq_len / 2, the last one cut at the row's end: a training row of the scripts' `pack`."""
    rng = np.random.default_rng(seq_len)
    rows = []
    for _ in range(batch):
        lengths = rng.integers(max(1, seq_len // 8), max(2, seq_len // 2) + 1, size=seq_len)
        ids = np.repeat(np.arange(1, seq_len + 1), lengths)[:seq_len]
        rows.append(ids)
    return jnp.asarray(np.stack(rows), jnp.int32)


def _attention_grads(attend):
    return jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))


def bench_attention():
    """flash_attention (default implementation) vs jax.nn.dot_product_attention, forward and forward+backward."""
    dtype, seq_lens, tokens, heads, kv_heads, head_dim, causal_modes = _attention_setup()
    ours, selection = _ours()
    override = BlockSizes(*map(int, FLAGS.attention_blocks)) if FLAGS.attention_blocks else None
    with_cudnn = ours != "cudnn" and "cudnn" in _attention_candidates()

    rows = []
    for seq_len in seq_lens:
        for causal in causal_modes:
            (q, k, v), fwd_flops, shape = _attention_inputs(dtype, seq_len, tokens, heads, kv_heads, head_dim, causal)
            blocks = choose_block_sizes(ours, head_dim, seq_len, seq_len, override)
            logging.info("%s: %s blocks %s", shape, ours, blocks)
            ours_fn = functools.partial(flash_attention, causal=causal, block_sizes=override, **selection)
            paths = {f"flash_attention[{ours}]": ours_fn}
            if with_cudnn:  # cuDNN's fused attention, forward and backward
                paths["flash_attention[cudnn]"] = functools.partial(flash_attention, causal=causal,
                                                                    implementation="cudnn")
            if FLAGS.attention_dropout:
                paths[f"flash_attention[{ours}] dropout {FLAGS.attention_dropout:g}"] = functools.partial(
                    ours_fn, dropout_rate=FLAGS.attention_dropout, dropout_rng=jax.random.key(0))
            paths["jax.nn[xla]"] = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                     implementation="xla")
            if jax.default_backend() == "tpu" or FLAGS.splash_interpret:
                paths["splash (MaxText's TPU kernel)"] = _splash_attention(causal, heads, kv_heads, seq_len)
            for name, attend in paths.items():
                rows.append(_measure(f"{name} fwd", shape, attend, (q, k, v), fwd_flops))
            for name, attend in paths.items():
                rows.append(_measure(f"{name} fwd+bwd", shape, _attention_grads(attend), (q, k, v), 3.5 * fwd_flops))
    return rows


def _splash_attention(causal, heads, kv_heads, seq_len):
    """JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention), what MaxText trains with on TPU:
    attend(q, k, v) over [B, T, H, D] inputs as flash_attention takes them. The MQA kernel per batch row and key /
    value head (GQA as MaxText runs it), 512-token blocks everywhere (MaxText's defaults, at most T), the queries
    scaled first (splash does not scale); the transposes to its head-major layout are timed with it, as MaxText's."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    block = min(512, seq_len)
    one = masks.CausalMask((seq_len, seq_len)) if causal else masks.FullMask((seq_len, seq_len))
    kernel = splash.make_splash_mqa_single_device(
        masks.MultiHeadMask([one] * (heads // kv_heads)), interpret=FLAGS.splash_interpret,
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                      block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                      block_kv_dq=block))

    def attend(q, k, v):
        b, t, h, d = q.shape
        q = (q * (d ** -0.5)).astype(q.dtype).reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
        k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B, KV, T, D]
        out = jax.vmap(jax.vmap(kernel))(q, k, v)  # [B, KV, H / KV, T, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return attend


def _attention_candidates():
    """{implementation: flash_attention's selecting arguments} of every attention implementation this device runs:
    'xla'; on an NVIDIA GPU 'triton' and 'cudnn', and on a Hopper one (compute capability 9.x, JAX >= 0.11)
    'mosaic_gpu'; on a TPU 'mosaic_tpu'; with --interpret the interpreted 'triton'."""
    device = jax.devices()[0]
    names = ["xla"]
    if FLAGS.interpret:
        names.append("triton")
    elif device.platform == "gpu":
        hopper = str(getattr(device, "compute_capability", "")).startswith("9")
        names += (["triton"] * attention_triton.AVAILABLE + ["cudnn"] * is_nvidia_gpu(device)
                  + ["mosaic_gpu"] * (attention_mosaic_gpu.AVAILABLE and hopper))
    elif device.platform == "tpu":
        names.append("mosaic_tpu")
    return {name: dict(implementation=name, interpret=FLAGS.interpret and name == "triton") for name in names}


def _timed(rows, times, name, label, shape, fn, args, flops, outputs):
    """Measures candidate `name` of `label` ('op pass'): its row appended to `rows`, its milliseconds to
    `times[name]` and (its result, its row) to `outputs[name]` where it ran."""
    op, direction = label.split(" ")
    got = []
    row = _measure(f"{op}[{name}] {direction}", shape, fn, args, flops, outputs=got)
    rows.append(row)
    if row[2] != "-":
        times[name], outputs[name] = float(row[2]), (got[0], row)


# How far a candidate's result may be from the reference candidate's (relative, over the output or each gradient)
# for the defaults table to take it: both computed in the dtype timed, so two 16-bit roundings apart.
AGREEMENT = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 1e-2}


def _relative_error(got, want):
    """Relative error of `got` against `want` (inf where `got` is not finite), on the device: check_kernels.py's
    `relative_error` in float64 on the host would copy gigabytes of gradients at the matmul sizes. A summed result
    (the loss's chunked path, a scalar) against the sum of `want` (its per-token losses)."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    if not bool(jnp.isfinite(got).all()):
        return float("inf")  # a NaN would drop out of max() over the leaves
    if got.shape == () and want.shape != ():
        want = want.sum()
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.maximum(jnp.linalg.norm(want.ravel()), 1e-30))


def _agreeing(times, outputs, reference, dtype):
    """`times` without the candidates whose results differ from `reference`'s by more than `AGREEMENT` (each such
    candidate's row noted 'disagrees'): a wrong path is never a default, however fast."""
    if reference not in outputs:
        return times
    kept = {}
    for name, ms in times.items():
        (result, row), want = outputs[name], outputs[reference][0]
        error = max(_relative_error(a, b) for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(want)))
        if error <= AGREEMENT[jnp.dtype(dtype).name]:
            kept[name] = ms
        else:
            row[5] = f"disagrees with {reference}: {error:.2g}"
            logging.warning("%s disagrees with %s (relative error %.3g): not a default", name, reference, error)
    return kept


def write_defaults(path, families):
    """Times every candidate of each shape class of `families` ('attention', 'matmul') and merges the fastest into
    the defaults table at `path` for this device kind; prints the timings and the choices."""
    kind = jax.devices()[0].device_kind
    provenance = dict(jax=jax.__version__, command=" ".join(["scripts/bench_kernels.py", *sys.argv[1:]]))
    entries, rows = [], []
    try:
        if "attention" in families:
            _attention_defaults(kind, provenance, entries, rows)
        if "matmul" in families:
            _matmul_defaults(kind, provenance, entries, rows)
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        print(f"\ninterrupted: {len(entries)} shape classes measured", flush=True)
    _print_table("defaults: candidates", rows)
    _defaults.merge_table(path, entries)
    print(f"\n## defaults written to {path} for {kind}")
    for entry in entries:
        print(f"{entry['op']} {entry['class']}: {entry['choice']}  ({entry['times']} {entry['unit']})")


def _attention_defaults(kind, provenance, entries, rows):
    """Times the attention candidates of each --defaults_head_dims x --seq_lens x --causal x --segments class into
    `entries`, forward + backward first (the entry `flash_attention` reads), those whose results agree with 'xla''s
    (`_agreeing`)."""
    dtype, seq_lens, tokens, heads, kv_heads, head_dim, causal_modes = _attention_setup()
    for head_dim in [int(d) for d in FLAGS.defaults_head_dims or [head_dim]]:
        for seq_len in seq_lens:
            for causal in causal_modes:
                _attention_class_defaults(kind, provenance, entries, rows, dtype, seq_len, tokens, heads, kv_heads,
                                          head_dim, causal)


def _attention_class_defaults(kind, provenance, entries, rows, dtype, seq_len, tokens, heads, kv_heads, head_dim,
                              causal):
    args, fwd_flops, shape = _attention_inputs(dtype, seq_len, tokens, heads, kv_heads, head_dim, causal)
    for segments in (s.lower() == "true" for s in FLAGS.segments):
        ids = _packed_ids(args[0].shape[0], seq_len) if segments else None
        label = f"{shape}{' packed' if segments else ''} {dtype.name}"
        for training in (True, False):
            times, outputs = {}, {}
            for name, selection in _attention_candidates().items():
                attend = functools.partial(flash_attention, causal=causal, segment_ids=ids, **selection)
                _timed(rows, times, name, f"flash_attention {'fwd+bwd' if training else 'fwd'}", label,
                       _attention_grads(attend) if training else attend, args, fwd_flops * (3.5 if training else 1.0),
                       outputs)
            times = _agreeing(times, outputs, "xla", dtype)
            if times:
                cls = _defaults.shape_class("flash_attention", head_dim=head_dim, seq_len=seq_len, causal=causal,
                                            dtype=dtype, segments=segments, training=training)
                entries.append(_defaults.make_entry("flash_attention", kind, cls, times, shape=label, **provenance))


def _matmul_defaults(kind, provenance, entries, rows):
    """Times gated_mlp's and linear_cross_entropy's fused kernels against plain XLA (and the loss's chunked sum),
    both passes, into `entries`."""
    dtype, size = _matmul_setup()
    impl, selection = _ours()
    for case in matmul_benchmark.cases(size, dtype, impl, ("gated_mlp", "linear_cross_entropy"),
                                       interpret=selection["interpret"]):
        fused, plain, *chunked = case.paths.values()  # the fused kernel, plain XLA[, the chunked sum]
        times, outputs = {}, {}
        for name, fn in ((impl, fused), (_defaults.PLAIN, plain), *((_defaults.CHUNKED, f) for f in chunked)):
            _timed(rows, times, name, f"{case.kernel} {case.direction}", case.shape, fn, case.args, case.flops,
                   outputs)
        times = _agreeing(times, outputs, _defaults.PLAIN, dtype)
        if times:
            cls = _defaults.shape_class(case.kernel, dtype=dtype, training=case.direction == "fwd+bwd")
            entries.append(_defaults.make_entry(case.kernel, kind, cls, times, shape=case.shape, **provenance))


def _matmul_setup():
    """(dtype, size) of the matmul cases: bf16 at LLM sizes on an accelerator, f32 small shapes on CPU."""
    on_cpu = jax.default_backend() == "cpu"
    return jnp.dtype(FLAGS.dtype or ("float32" if on_cpu else "bfloat16")), "small" if on_cpu else "large"


def bench_matmul():
    """fused_matmul, gated_mlp and linear_cross_entropy (default implementation) vs XLA's unfused ops, forward and
    forward+backward; the loss rows also note the compiled temporary memory (the materialised logits, for XLA)."""
    dtype, size = _matmul_setup()
    rows = []
    impl, selection = _ours()
    for case in matmul_benchmark.cases(size, dtype, impl, interpret=selection["interpret"]):
        for name, fn in case.paths.items():
            row = _measure(f"{name} {case.direction}", case.shape, fn, case.args, case.flops)
            if case.kernel == "linear_cross_entropy" and not row[-1]:
                row[-1] = f"temp {matmul_benchmark.temp_bytes(fn, case.args) / 2**20:.1f} MiB"
            rows.append(row)
    return rows


def _describe(blocks):
    return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(blocks).items() if v is not None)


def _search(title, candidates, make_fn, args, flops, effective, baseline=None):
    """Times `make_fn(candidate)` for each candidate (the first is the default) whose `effective(candidate)` block
    sizes differ from those already timed, and prints them fastest first beside `baseline` = (name, fn), each with
    its speed relative to the default. An interrupt ends the search early; what was measured is still printed."""
    rows, seen = [], set()
    try:
        if baseline is not None:
            rows.append(_measure(baseline[0], "", baseline[1], args, flops))
        for index, cand in enumerate(candidates):
            blocks = effective(cand)
            if blocks in seen or (FLAGS.max_candidates and len(seen) >= FLAGS.max_candidates):
                continue
            seen.add(blocks)
            rows.append(_measure("candidate" if index else "default", _describe(blocks), make_fn(cand), args, flops))
    except KeyboardInterrupt:
        logging.warning("%s: interrupted after %d of %d candidates", title, len(rows), len(candidates))
    default_ms = next((float(r[2]) for r in rows if r[0] == "default" and r[2] != "-"), None)
    for row in rows:
        if default_ms and row[2] != "-":
            row[-1] = (row[-1] + " " if row[-1] else "") + f"{default_ms / float(row[2]):.2f}x default"
    rows.sort(key=lambda r: float(r[2]) if r[2] != "-" else float("inf"))
    _print_table(title, rows, first_columns=("candidate", "blocks"))
    return rows


def tune_attention():
    """The attention tuning space at the first sequence length and masking mode: forward tiles timed forward,
    backward tiles forward+backward (with the default forward)."""
    dtype, seq_lens, tokens, heads, kv_heads, head_dim, causal_modes = _attention_setup()
    impl, selection = _ours()
    args, fwd_flops, shape = _attention_inputs(dtype, seq_lens[0], tokens, heads, kv_heads, head_dim, causal_modes[0])
    effective = lambda blocks: choose_block_sizes(impl, head_dim, seq_lens[0], seq_lens[0], blocks)
    attend = lambda blocks: functools.partial(flash_attention, causal=causal_modes[0], block_sizes=blocks, **selection)
    reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal_modes[0])
    for timed, candidates in ATTENTION_TUNING_SPACE[impl].items():
        backward = timed == "fwd+bwd"
        _search(f"tune flash_attention[{impl}] {timed} {shape}", [None, *candidates],
                (lambda b: _attention_grads(attend(b))) if backward else attend, args,
                fwd_flops * (3.5 if backward else 1.0), effective,
                ("jax.nn[xla]", _attention_grads(reference) if backward else reference))


def tune_matmul():
    """Each matmul op's tuning space at its benchmark size, forward and forward+backward, beside XLA."""
    dtype, size = _matmul_setup()
    impl, selection = _ours()
    for kernel, op in (("fused_matmul", "matmul"), ("gated_mlp", "gated"), ("linear_cross_entropy", "loss")):
        space = matmul_blocks.TUNING_SPACE.get((impl, op))
        if not space:
            logging.info("tune %s: implementation %r has no block sizes to tune", kernel, impl)
            continue
        for case in matmul_benchmark.cases(size, dtype, impl, (kernel,), interpret=selection["interpret"]):
            baseline = list(case.paths.items())[1]
            _search(f"tune {kernel}[{impl}] {case.direction} {case.shape}", space, case.retile, case.args, case.flops,
                    lambda b: b, baseline)


def _decode_setup():
    """(on CPU?, dtype, heads, kv_heads, head_dim) of the decoding benchmarks (decode, paged)."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(FLAGS.dtype or ("float32" if on_cpu else "bfloat16"))
    heads, kv_heads = FLAGS.heads or (4 if on_cpu else 32), FLAGS.kv_heads or (2 if on_cpu else 8)
    return on_cpu, dtype, heads, kv_heads, FLAGS.head_dim or (64 if on_cpu else 128)


def bench_decode():
    """decode_attention (default splits) vs flash_attention (one program per query head over the whole cache, the
    decode path before it) and jax.nn.dot_product_attention with key lengths, for one new token against a cache
    whose first half is filled. The note is the bandwidth of reading the filled keys and values once."""
    on_cpu, dtype, heads, kv_heads, head_dim = _decode_setup()
    ours, selection = _ours()
    rows = []
    for batch in map(int, FLAGS.decode_batches or (["2"] if on_cpu else ["1", "8"])):
        for cache_len in map(int, FLAGS.decode_cache_lens or (["512"] if on_cpu else ["8192", "32768"])):
            key_q, key_k, key_v = jax.random.split(jax.random.key(cache_len), 3)
            q = jax.random.normal(key_q, (batch, 1, heads, head_dim), dtype)
            k, v = (jax.random.normal(key, (batch, cache_len, kv_heads, head_dim), dtype) for key in (key_k, key_v))
            fill = cache_len // 2
            ids = (jnp.ones((batch, 1), jnp.int32), (jnp.arange(cache_len) < fill).astype(jnp.int32)[None].repeat(
                batch, 0))
            lengths = jnp.full((batch,), fill, jnp.int32)
            paths = {f"decode_attention[{ours}]": functools.partial(decode_attention, segment_ids=ids, **selection),
                     f"flash_attention[{ours}]": functools.partial(flash_attention, segment_ids=ids, **selection),
                     "jax.nn[xla]": functools.partial(jax.nn.dot_product_attention, key_value_seq_lengths=lengths)}
            shape = f"B{batch} cache {fill}/{cache_len} H{heads}/{kv_heads} D{head_dim}"
            kv_bytes = 2 * batch * fill * kv_heads * head_dim * dtype.itemsize
            for name, attend in paths.items():
                row = _measure(name, shape, attend, (q, k, v), 4 * batch * heads * fill * head_dim)
                if row[2] != "-":
                    row[-1] = f"{kv_bytes / (float(row[2]) / 1e3) / 1e9:.0f} GB/s"
                rows.append(row)
    return rows


def _paged_inputs(batch, cache_len, page, kv_heads, head_dim, dtype):
    """(k, v contiguous [batch, cache_len, kv_heads, head_dim], their pages [kv_heads, batch * pages, page,
    head_dim] in a random order, the page table, lengths drawn uniformly from [cache_len / 2, cache_len])."""
    max_pages = cache_len // page
    key_k, key_v, key_order, key_len = jax.random.split(jax.random.key(cache_len + page), 4)
    k, v = (jax.random.normal(key, (batch, cache_len, kv_heads, head_dim), dtype) for key in (key_k, key_v))
    table = jax.random.permutation(key_order, batch * max_pages).reshape(batch, max_pages).astype(jnp.int32)

    def paged(x):  # [batch, max_pages, page, kv_heads, head_dim] -> the pool, page table[b, i] holding page i of b
        pages = x.reshape(batch, max_pages, page, kv_heads, head_dim).transpose(3, 0, 1, 2, 4)
        return jnp.zeros((kv_heads, batch * max_pages, page, head_dim), dtype).at[:, table].set(pages)

    lengths = jax.random.randint(key_len, (batch,), cache_len // 2, cache_len + 1, jnp.int32)
    return k, v, paged(k), paged(v), table, lengths


def bench_paged():
    """paged_attention (pages in a random order) vs decode_attention (default splits) on the same tokens in a
    contiguous cache, one new token per sequence of ragged length. The note is the bandwidth of reading the filled
    keys and values once."""
    on_cpu, dtype, heads, kv_heads, head_dim = _decode_setup()
    ours, selection = _ours()
    rows = []
    for batch in map(int, FLAGS.decode_batches or (["2"] if on_cpu else ["8", "64"])):
        for cache_len in map(int, FLAGS.decode_cache_lens or (["256"] if on_cpu else ["2048", "8192"])):
            for page in map(int, FLAGS.page_sizes or (["16"] if on_cpu else ["16", "64"])):
                k, v, k_pages, v_pages, table, lengths = _paged_inputs(batch, cache_len, page, kv_heads, head_dim,
                                                                       dtype)
                q = jax.random.normal(jax.random.key(1), (batch, heads, head_dim), dtype)
                ids = (jnp.ones((batch, 1), jnp.int32),
                       (jnp.arange(cache_len)[None] < lengths[:, None]).astype(jnp.int32))
                paths = {
                    f"paged_attention[{ours}]": (lambda q, k, v, table, lengths: paged_attention(
                        q, k, v, table, lengths, **selection), (q, k_pages, v_pages, table, lengths)),
                    f"decode_attention[{ours}]": (lambda q, k, v: decode_attention(
                        q[:, None], k, v, segment_ids=ids, **selection), (q, k, v)),
                }
                tokens = int(lengths.sum())
                shape = f"B{batch} {tokens // batch}/{cache_len} page {page} H{heads}/{kv_heads} D{head_dim}"
                kv_bytes = 2 * tokens * kv_heads * head_dim * dtype.itemsize
                for name, (attend, args) in paths.items():
                    row = _measure(name, shape, attend, args, 4 * heads * tokens * head_dim)
                    if row[2] != "-":
                        row[-1] = f"{kv_bytes / (float(row[2]) / 1e3) / 1e9:.0f} GB/s"
                    rows.append(row)
    return rows


def _grouped_setup():
    """(x, w, group_sizes) of the grouped benchmark, its shape label and its forward FLOPs: every row in a group, the
    groups' sizes proportional to 1, 2, ..., G (a skewed router)."""
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(FLAGS.dtype or ("float32" if on_cpu else "bfloat16"))
    m, k, n, g = map(int, FLAGS.grouped_shape or (["512", "128", "256", "4"] if on_cpu else
                                                  ["16384", "4096", "14336", "8"]))
    sizes = [m * (i + 1) // (g * (g + 1) // 2) for i in range(g)]
    sizes[-1] += m - sum(sizes)
    key_x, key_w = jax.random.split(jax.random.key(0))
    args = (jax.random.normal(key_x, (m, k), dtype), (jax.random.normal(key_w, (g, k, n)) * k ** -0.5).astype(dtype),
            jnp.asarray(sizes, jnp.int32))
    return args, f"{m}x{k}x{n} G{g} {dtype.name}", 2 * m * k * n


def _grouped_grads(fn):
    return jax.grad(lambda x, w, s: fn(x, w, s).astype(jnp.float32).sum(), (0, 1))


def bench_grouped():
    """grouped_matmul (default implementation) vs its 'xla' path and jax.lax.ragged_dot, forward and
    forward+backward (dx and dw: two more products of the forward's size)."""
    args, shape, flops = _grouped_setup()
    ours, selection = _ours()
    paths = {"grouped_matmul[xla]": functools.partial(grouped_matmul, implementation="xla"),
             "jax.lax.ragged_dot": jax.lax.ragged_dot}
    paths = {f"grouped_matmul[{ours}]": functools.partial(grouped_matmul, **selection), **paths}  # ours first
    rows = [_measure(f"{name} fwd", shape, fn, args, flops) for name, fn in paths.items()]
    rows += [_measure(f"{name} fwd+bwd", shape, _grouped_grads(fn), args, 3 * flops) for name, fn in paths.items()]
    return rows


def tune_grouped():
    """The grouped matmul's tuning space at the benchmark shape, forward and forward+backward, beside its 'xla'
    path."""
    args, shape, flops = _grouped_setup()
    impl, selection = _ours()
    if impl not in GROUPED_TUNING_SPACE:
        logging.info("tune grouped_matmul: implementation %r has no block sizes to tune", impl)
        return
    xla = functools.partial(grouped_matmul, implementation="xla")
    for backward in (False, True):
        make = lambda blocks: functools.partial(grouped_matmul, block_sizes=blocks, **selection)  # noqa: E731
        _search(f"tune grouped_matmul[{impl}] {'fwd+bwd' if backward else 'fwd'} {shape}", GROUPED_TUNING_SPACE[impl],
                (lambda b: _grouped_grads(make(b))) if backward else make, args, flops * (3 if backward else 1),
                lambda b: b, ("grouped_matmul[xla]", _grouped_grads(xla) if backward else xla))


_KERNEL_FAMILIES = {"attention": bench_attention, "matmul": bench_matmul, "decode": bench_decode,
                    "grouped": bench_grouped, "paged": bench_paged}
_TUNERS = {"attention": tune_attention, "matmul": tune_matmul, "grouped": tune_grouped}


def _print_table(title, rows, first_columns=("kernel", "shape")):
    header = [*first_columns, "median ms", "TFLOP/s", "% peak", "note"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    print(f"\n## {title} ({jax.devices()[0].device_kind}, jax {jax.__version__})")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def main(argv):
    del argv
    for flag, known in (("kernels", _KERNEL_FAMILIES), ("tune", _TUNERS)):
        unknown = [name for name in FLAGS[flag].value if name not in known]
        if unknown:
            raise app.UsageError(f"--{flag}: unknown {unknown}; expected some of {list(known)}")
    if FLAGS.write_defaults:
        families = FLAGS.kernels if FLAGS["kernels"].present else ["attention", "matmul"]
        if set(families) - {"attention", "matmul"}:
            raise app.UsageError(f"--write_defaults times attention and matmul; --kernels={','.join(families)}")
        write_defaults(FLAGS.write_defaults, families)
        return
    if FLAGS.tune:
        for name in FLAGS.tune:
            _TUNERS[name]()
        return
    for name in FLAGS.kernels:
        _print_table(name, _KERNEL_FAMILIES[name]())


if __name__ == "__main__":
    app.run(main)
