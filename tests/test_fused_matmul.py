"""Fused matmul kernel family: parity of every implementation (Pallas ones in interpret mode) with the materialising
references, values and gradients; input validation; lowering for GPU and TPU at LLM sizes; the loss's memory."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.matmul import (BlockSizes, fused_matmul, gated_mlp, linear_cross_entropy, linear_cross_entropy_sum,
                            quantize_int8)
from kernels.matmul import reference
from tests.targets import for_gpu, jaxpr_shapes

# Largest error allowed, relative to the largest magnitude of the float32 result computed from the same inputs.
# bf16 keeps 8 bits of mantissa and the backward stores bf16 intermediates (dz, d logits): a few ulps of 2**-8.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}

# Small blocks so the small test shapes still span several tiles; Mosaic needs multiples of 128, so its shapes are
# larger. "ragged" shapes are not block multiples and have two leading dims.
IMPLEMENTATIONS = {
    "xla": dict(blocks=BlockSizes(16, 16, 16), interpret=False,
                shapes={"aligned": ((32,), 48, 64), "ragged": ((2, 5), 40, 70)}),
    "triton": dict(blocks=BlockSizes(16, 16, 16, num_warps=1, num_stages=1), interpret=True,
                   shapes={"aligned": ((32,), 48, 64), "ragged": ((2, 5), 40, 70)}),
    "mosaic_tpu": dict(blocks=BlockSizes(128, 128, 128), interpret=True,
                       shapes={"aligned": ((128,), 256, 256), "ragged": ((2, 70), 136, 200)}),
}
# The default run covers every implementation on ragged shapes (fp32; bf16 for all but Mosaic, whose TPU interpreter
# is the slowest) and the aligned path once (Triton, fp32); the rest run with -m slow, to keep the default suite
# fast on a 2-core CPU.
def _is_slow(impl, dtype, shape):
    return (shape == "aligned" and (impl, dtype) != ("triton", jnp.float32)) or (impl, dtype) == ("mosaic_tpu",
                                                                                               jnp.bfloat16)


CASES = [pytest.param(impl, dtype, shape, id=f"{impl}-{jnp.dtype(dtype).name}-{shape}",
                      marks=[pytest.mark.slow] if _is_slow(impl, dtype, shape) else [])
         for impl in IMPLEMENTATIONS for dtype in TOLERANCE for shape in ("aligned", "ragged")]


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _assert_close(actual, expected, dtype, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, what
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-6)
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def _check_value_and_grads(fn, ref, args, dtype, what):
    """fn's value and its gradients under a random cotangent match ref run in float32 on the same (rounded) inputs."""
    args32 = [a.astype(jnp.float32) for a in args]
    out = fn(*args)
    cotangent = _normal(jax.random.key(7), out.shape, out.dtype)
    # One jit per side: compiling the whole forward + backward is faster on CPU than dispatching op by op.
    value_and_vjp = jax.jit(lambda cot, *a: (lambda o, vjp: (o, vjp(cot)))(*jax.vjp(fn, *a)))
    value_and_vjp_ref = jax.jit(lambda cot, *a: (lambda o, vjp: (o, vjp(cot)))(*jax.vjp(ref, *a)))
    out, grads = value_and_vjp(cotangent, *args)
    out_ref, grads_ref = value_and_vjp_ref(cotangent.astype(jnp.float32), *args32)
    _assert_close(out, out_ref, dtype, f"{what} value")
    for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        assert g.dtype == args[i].dtype, f"{what} grad {i} dtype"
        _assert_close(g, g_ref, dtype, f"{what} grad {i}")


@pytest.mark.parametrize("impl, dtype, shape", CASES)
def test_fused_matmul_matches_reference(impl, dtype, shape):
    config = IMPLEMENTATIONS[impl]
    lead, k, n = config["shapes"][shape]
    keys = jax.random.split(jax.random.key(0), 3)
    args = (_normal(keys[0], (*lead, k), dtype), _normal(keys[1], (k, n), dtype, k ** -0.5),
            _normal(keys[2], (n,), dtype))
    activation = "silu" if shape == "aligned" else "gelu_tanh"
    fn = lambda x, w, b: fused_matmul(x, w, b, activation=activation, implementation=impl,
                                      interpret=config["interpret"], block_sizes=config["blocks"])
    ref = lambda x, w, b: reference.fused_matmul_reference(x, w, b, activation=activation)
    _check_value_and_grads(fn, ref, args, dtype, f"fused_matmul[{impl}]")


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("impl", ["xla", pytest.param("triton", marks=pytest.mark.slow)])
def test_fused_matmul_activations_without_bias(activation, impl):
    config = IMPLEMENTATIONS[impl]
    keys = jax.random.split(jax.random.key(1), 2)
    args = (_normal(keys[0], (10, 40), jnp.float32), _normal(keys[1], (40, 70), jnp.float32, 40 ** -0.5))
    fn = lambda x, w: fused_matmul(x, w, activation=activation, implementation=impl, interpret=config["interpret"],
                                   block_sizes=config["blocks"])
    ref = lambda x, w: reference.fused_matmul_reference(x, w, activation=activation)
    _check_value_and_grads(fn, ref, args, jnp.float32, f"fused_matmul[{impl}, {activation}]")


@pytest.mark.parametrize("impl, dtype, shape", CASES)
def test_gated_mlp_matches_reference(impl, dtype, shape):
    config = IMPLEMENTATIONS[impl]
    lead, d, f = config["shapes"][shape]
    keys = jax.random.split(jax.random.key(2), 3)
    args = (_normal(keys[0], (*lead, d), dtype), _normal(keys[1], (d, f), dtype, d ** -0.5),
            _normal(keys[2], (d, f), dtype, d ** -0.5))
    activation = "silu" if shape == "aligned" else "gelu"
    fn = lambda x, wg, wu: gated_mlp(x, wg, wu, activation=activation, implementation=impl,
                                     interpret=config["interpret"], block_sizes=config["blocks"])
    ref = lambda x, wg, wu: reference.gated_mlp_reference(x, wg, wu, activation=activation)
    _check_value_and_grads(fn, ref, args, dtype, f"gated_mlp[{impl}]")


@pytest.mark.parametrize("impl, dtype", [("xla", jnp.float32), ("triton", jnp.bfloat16),
                                         pytest.param("mosaic_tpu", jnp.float32, marks=pytest.mark.slow)])
def test_int8_weights_match_the_dequantised_reference(impl, dtype):
    """Weight-only int8 (models/quantize.py): the kernels read int8 tiles and scale the accumulator; the reference
    multiplies by the dequantised weight q * s. Values, and gradients for x, the scales and the bias (none for q)."""
    config = IMPLEMENTATIONS[impl]
    lead, k, n = config["shapes"]["ragged"]
    keys = jax.random.split(jax.random.key(5), 4)
    (q, s), (q_up, s_up) = (quantize_int8(_normal(key, (k, n), jnp.float32, k ** -0.5)) for key in keys[:2])
    x, b = _normal(keys[2], (*lead, k), dtype), _normal(keys[3], (n,), dtype)
    opts = dict(implementation=impl, interpret=config["interpret"], block_sizes=config["blocks"])
    fn = lambda x, s, b: fused_matmul(x, q, b, w_scale=s, activation="gelu", **opts)
    ref = lambda x, s, b: reference.fused_matmul_reference(x, q, b, w_scale=s, activation="gelu")
    _check_value_and_grads(fn, ref, (x, s, b), dtype, f"fused_matmul[{impl}, int8]")
    fn = lambda x, s, s_up: gated_mlp(x, q, q_up, w_gate_scale=s, w_up_scale=s_up, **opts)
    ref = lambda x, s, s_up: reference.gated_mlp_reference(x, q, q_up, w_gate_scale=s, w_up_scale=s_up)
    _check_value_and_grads(fn, ref, (x, s, s_up), dtype, f"gated_mlp[{impl}, int8]")


def test_nf4_format_keeps_each_weight_at_its_nearest_level():
    """quantize_nf4 (numpy on the host as jax): each weight's code is its nearest NF4 level of w / absmax per 64 rows,
    row 2i in the low nibble and 2i + 1 in the high one; dequantising and quantising again changes nothing."""
    from kernels.matmul.formats import NF4_LEVELS, dequantize_nf4, quantize_nf4
    w = np.random.RandomState(0).standard_t(4, (2, 192, 24)).astype(np.float32)  # heavy tails: outliers set absmax
    packed, absmax = quantize_nf4(w)
    assert packed.dtype == np.uint8 and packed.shape == (2, 96, 24) and absmax.shape == (2, 3, 24)
    jax_packed, jax_absmax = quantize_nf4(jnp.asarray(w))
    np.testing.assert_array_equal(packed, jax_packed)
    np.testing.assert_allclose(absmax, jax_absmax, rtol=1e-7)
    levels = np.asarray(NF4_LEVELS, np.float32)
    normed = w.reshape(2, 3, 64, 24) / absmax[:, :, None, :]
    nearest = np.argmin(np.abs(normed[..., None] - levels), axis=-1).reshape(2, 192, 24)
    np.testing.assert_array_equal(packed & 15, nearest[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, nearest[:, 1::2])
    back = np.asarray(dequantize_nf4(packed, absmax))
    np.testing.assert_allclose(back, levels[nearest] * np.repeat(absmax, 64, axis=1), rtol=1e-6)
    again = quantize_nf4(back)
    np.testing.assert_array_equal(again[0], packed)
    np.testing.assert_allclose(again[1], absmax, rtol=1e-7)
    with pytest.raises(ValueError, match=r"weight.shape=\(100, 8\); nf4 needs its rows K a multiple of 64"):
        quantize_nf4(np.zeros((100, 8), np.float32))


@pytest.mark.parametrize("impl, dtype, shape", CASES)
def test_linear_cross_entropy_matches_reference(impl, dtype, shape):
    config = IMPLEMENTATIONS[impl]
    lead, d, vocab = config["shapes"][shape]
    vocab = vocab + 100 if impl == "mosaic_tpu" else vocab  # Mosaic: three 128-column vocabulary chunks.
    keys = jax.random.split(jax.random.key(3), 3)
    x, w = _normal(keys[0], (*lead, d), dtype), _normal(keys[1], (d, vocab), dtype, 2 * d ** -0.5)
    labels = jax.random.randint(keys[2], lead, 0, vocab).reshape(-1).at[::3].set(-100).reshape(lead)
    fn = lambda x, w: linear_cross_entropy(x, w, labels, implementation=impl, interpret=config["interpret"],
                                           block_sizes=config["blocks"])
    ref = lambda x, w: reference.linear_cross_entropy_reference(x, w, labels)
    _check_value_and_grads(fn, ref, (x, w), dtype, f"linear_cross_entropy[{impl}]")


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_ignored_tokens_have_zero_loss_and_gradient(impl):
    config = IMPLEMENTATIONS[impl]
    keys = jax.random.split(jax.random.key(4), 3)
    x, w = _normal(keys[0], (6, 24), jnp.float32), _normal(keys[1], (24, 50), jnp.float32)
    labels = jnp.array([3, -1, 7, -1, 49, 0])
    fn = lambda x: linear_cross_entropy(x, w, labels, ignore_index=-1, implementation=impl,
                                        interpret=config["interpret"], block_sizes=config["blocks"])
    loss, dx = jax.jit(lambda x: (fn(x), jax.grad(lambda x: fn(x).sum())(x)))(x)
    np.testing.assert_array_equal(np.asarray(loss)[[1, 3]], 0.0)
    np.testing.assert_array_equal(np.asarray(dx)[[1, 3]], 0.0)
    assert np.all(np.asarray(loss)[[0, 2, 4, 5]] > 0) and np.all(np.abs(np.asarray(dx)[[0, 2, 4, 5]]).sum(-1) > 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_loss_sum_matches_the_weighted_reference_and_takes_three_matmuls(dtype):
    """linear_cross_entropy_sum: the weighted sum of the reference's per-token losses and its gradients under a
    random scalar cotangent (rows not a multiple of the chunk, ignored tokens, two leading dims), with no
    [rows, vocab] temporary beyond one chunk's; differentiated, its program holds three matmuls (logits, d x,
    d w) where linear_cross_entropy's holds four (its backward recomputes the logits)."""
    keys = jax.random.split(jax.random.key(5), 4)
    lead, d, vocab, chunk = (2, 7), 40, 70, 4
    x, w = _normal(keys[0], (*lead, d), dtype), _normal(keys[1], (d, vocab), dtype, 2 * d ** -0.5)
    labels = jax.random.randint(keys[2], lead, 0, vocab).reshape(-1).at[::3].set(-100).reshape(lead)
    weights = jax.random.uniform(keys[3], lead)
    fn = lambda x, w: linear_cross_entropy_sum(x, w, labels, weights, chunk_rows=chunk)  # noqa: E731
    ref = lambda x, w: (reference.linear_cross_entropy_reference(x, w, labels) * weights).sum()  # noqa: E731
    _check_value_and_grads(fn, ref, (x, w), dtype, "linear_cross_entropy_sum")
    assert float(fn(x, w)) == pytest.approx(float(jax.jit(fn)(x, w)), rel=1e-6)  # the primal path: no gradients

    def dots_and_widest(f):
        jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)))(x, w)
        text = str(jaxpr)
        rows_by_vocab = [s for s in jaxpr_shapes(jaxpr.jaxpr) if len(s) == 2 and s[1] == vocab and s[0] != d]
        return text.count("dot_general"), max(rows for rows, _ in rows_by_vocab)
    dots, widest = dots_and_widest(lambda x, w: fn(x, w))
    assert dots == 3 and widest == chunk, (dots, widest)
    blockwise = lambda x, w: linear_cross_entropy(x, w, labels, implementation="xla").sum()  # noqa: E731
    assert dots_and_widest(blockwise)[0] == 4
    with pytest.raises(ValueError, match=r"^chunk_rows=0; expected a positive int$"):
        linear_cross_entropy_sum(x, w, labels, weights, chunk_rows=0)
    with pytest.raises(ValueError, match=r"^labels.shape=\(2, 7\), weights.shape=\(14,\); expected"):
        linear_cross_entropy_sum(x, w, labels, weights.reshape(-1))


@pytest.mark.parametrize("num_m, num_n", [(1, 1), (3, 5), (8, 8), (17, 4), (20, 1)])
def test_triton_grouped_tile_order_visits_every_tile_once(num_m, num_n):
    from kernels.matmul.triton import _tile
    tiles = jax.jit(jax.vmap(lambda pid: _tile(pid, num_m, num_n)))(jnp.arange(num_m * num_n))
    assert sorted(zip(*map(np.asarray, tiles))) == [(i, j) for i in range(num_m) for j in range(num_n)]


X = jnp.zeros((4, 8), jnp.float32)
W = jnp.zeros((8, 16), jnp.float32)
LABELS = jnp.zeros((4,), jnp.int32)
BAD_INPUTS = [
    (lambda: fused_matmul(X, jnp.zeros((9, 16))), "w.shape=(9, 16)"),
    (lambda: fused_matmul(X, W.astype(jnp.bfloat16)), "w.dtype=bfloat16; expected x.dtype=float32"),
    (lambda: fused_matmul(X.astype(jnp.int32), W), "x.dtype=int32"),
    (lambda: fused_matmul(X, W, jnp.zeros((15,))), "bias.shape=(15,); expected (16,)"),
    (lambda: fused_matmul(X, W.astype(jnp.int8)), "w.dtype=int8 needs w_scale"),
    (lambda: fused_matmul(X, W.astype(jnp.int8), w_scale=jnp.ones((8,))), "w_scale.shape=(8,); expected (16,)"),
    (lambda: fused_matmul(X, W.astype(jnp.int8), w_scale=jnp.ones((16,), jnp.int32)), "w_scale.dtype=int32"),
    (lambda: fused_matmul(X, W.astype(jnp.int32)), "w.dtype=int32"),
    (lambda: gated_mlp(X, W, W, w_up_scale=jnp.ones((16,))), "w_gate_scale and w_up_scale: expected both"),
    (lambda: fused_matmul(X, W, activation="tanh"), "activation='tanh'"),
    (lambda: fused_matmul(X, W, implementation="cuda"), "implementation='cuda'"),
    (lambda: fused_matmul(X, W, block_sizes=BlockSizes(block_m=48), implementation="triton"),
     "block_sizes.block_m=48; the Triton backend needs a power of two"),
    (lambda: fused_matmul(X, W, block_sizes=BlockSizes(block_k=64), implementation="mosaic_tpu"),
     "block_sizes.block_k=64; the Mosaic TPU backend needs a multiple of 128"),
    (lambda: fused_matmul(X, W, block_sizes={"block_m": 16}), "expected None or kernels.matmul.BlockSizes"),
    (lambda: gated_mlp(X, W, jnp.zeros((8, 8))), "w_up.shape=(8, 8); expected w_gate.shape=(8, 16)"),
    (lambda: gated_mlp(X, W, W, activation=None), "activation=None"),
    (lambda: linear_cross_entropy(X, W, jnp.zeros((5,), jnp.int32)), "labels.shape=(5,); expected"),
    (lambda: linear_cross_entropy(X, W, LABELS.astype(jnp.float32)), "labels.dtype=float32"),
    (lambda: linear_cross_entropy(X, W, LABELS, ignore_index=-1.0), "ignore_index=-1.0"),
]


@pytest.mark.parametrize("call, message", BAD_INPUTS, ids=[m.split("=")[0] for _, m in BAD_INPUTS])
def test_bad_input_raises_before_tracing(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)


# Sizes from the issue: a LLaMA-3-8B MLP (8192 tokens, 4096 -> 14336) and its loss (16384 tokens, 128256 vocabulary).
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
N_TOKENS, D_MODEL, VOCAB = 16384, 4096, 128256
LLM_SIZED = {
    "fused_matmul": (lambda impl: lambda x, w, b: fused_matmul(x, w, b, activation="gelu", implementation=impl),
                     (S((8192, 8192), BF16), S((8192, 8192), BF16), S((8192,), BF16))),
    "gated_mlp": (lambda impl: lambda x, wg, wu: gated_mlp(x, wg, wu, implementation=impl),
                  (S((8192, 4096), BF16), S((4096, 14336), BF16), S((4096, 14336), BF16))),
    "linear_cross_entropy": (lambda impl: lambda x, w, labels: linear_cross_entropy(x, w, labels,
                                                                                    implementation=impl),
                             (S((N_TOKENS, D_MODEL), BF16), S((D_MODEL, VOCAB), BF16), S((N_TOKENS,), jnp.int32))),
}
PLATFORMS = {"cuda": ("triton", "xla.gpu.triton"), "tpu": ("mosaic_tpu", "tpu_custom_call")}


@pytest.mark.parametrize("op", LLM_SIZED)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_forward_and_backward_lower_for_accelerators(platform, op):
    """The kernels lower to Triton / Mosaic custom calls at LLM sizes, forward and backward; and no [N, V] logits."""
    impl, custom_call = PLATFORMS[platform]
    make, args = LLM_SIZED[op]
    fn = make(impl)

    def loss_and_grads(*a):
        n_diff = 2 if op == "linear_cross_entropy" else 3
        return jax.value_and_grad(lambda *d: fn(*d, *a[n_diff:]).astype(jnp.float32).sum(), range(n_diff))(
            *a[:n_diff])

    with for_gpu() if platform == "cuda" else contextlib.nullcontext():
        text = jax.jit(loss_and_grads).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert custom_call in text
    assert f"{N_TOKENS}x{VOCAB}" not in text  # Neither logits nor d logits at full size, forward or backward.


@pytest.mark.parametrize("platform", PLATFORMS)
def test_int8_weights_reach_the_kernels_as_int8(platform):
    """The quantised gated MLP of the issue's size lowers with its int8 weights as the custom call's operands,
    forward and backward (dx): no bf16 copy of a [4096, 14336] weight is made."""
    impl, custom_call = PLATFORMS[platform]
    q, scale = S((4096, 14336), jnp.int8), S((14336,), jnp.float32)

    def loss_and_dx(x, wg, wu, sg, su):
        h = lambda x: gated_mlp(x, wg, wu, w_gate_scale=sg, w_up_scale=su, implementation=impl)
        return jax.value_and_grad(lambda x: h(x).astype(jnp.float32).sum())(x)

    with for_gpu() if platform == "cuda" else contextlib.nullcontext():
        text = jax.jit(loss_and_dx).trace(S((8192, 4096), BF16), q, q, scale, scale).lower(
            lowering_platforms=(platform,)).as_text()
    assert custom_call in text and "4096x14336xi8" in text
    assert "4096x14336xbf16" not in text


def test_blockwise_loss_needs_a_fraction_of_the_materialised_memory():
    """Compiled (not run) on CPU at the issue's loss size, float32 (CPU dots upcast bf16 to f32 copies)."""
    args = (S((N_TOKENS, D_MODEL), jnp.float32), S((D_MODEL, VOCAB), jnp.float32), S((N_TOKENS,), jnp.int32))

    def temp_bytes(loss_fn):
        grad_fn = jax.jit(jax.value_and_grad(lambda x, w, labels: loss_fn(x, w, labels).sum(), (0, 1)))
        return grad_fn.trace(*args).lower().compile().memory_analysis().temp_size_in_bytes

    blockwise = temp_bytes(lambda x, w, labels: linear_cross_entropy(x, w, labels, implementation="xla"))
    materialised = temp_bytes(reference.linear_cross_entropy_reference)
    logits_bytes = N_TOKENS * VOCAB * 4
    assert materialised >= logits_bytes  # The baseline does hold the logits.
    assert blockwise * 8 <= materialised, (blockwise, materialised)  # The issue's <= 1/8 (measured: 1/19).
    assert blockwise < logits_bytes / 8


@pytest.mark.slow
def test_benchmark_cases_agree_with_their_baselines_on_cpu():
    from kernels.matmul import benchmark
    cases = benchmark.cases("small", jnp.float32)
    assert {(c.kernel, c.direction) for c in cases} == {
        (k, d) for k in benchmark.KERNELS for d in ("fwd", "fwd+bwd")}
    assert {"fused_matmul", "gated_mlp", "linear_cross_entropy", "fused_matmul_int8"} == set(benchmark.KERNELS)
    retiled = BlockSizes(16, 16, 16, vocab_chunk=1024)  # what the tuner passes to `retile`
    for case in cases:
        # the fused kernel and its XLA baseline (the loss's third path, the chunked sum, is a sum: bench_kernels'
        # own check compares it)
        fused, xla = (jax.jit(fn)(*case.args) for fn in list(case.paths.values())[:2])
        for got in (fused, jax.jit(case.retile(retiled))(*case.args)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(xla)):
                _assert_close(a, b, jnp.float32, f"{case.kernel} {case.direction}")
    loss_grad = next(c for c in cases if c.kernel == "linear_cross_entropy" and c.direction == "fwd+bwd")
    fused_bytes, xla_bytes = (benchmark.temp_bytes(fn, loss_grad.args) for fn in list(loss_grad.paths.values())[:2])
    assert fused_bytes < xla_bytes


def _count(jaxpr, names):
    """Equations named in `names` in a jaxpr, nested ones included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name in names
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += _count(sub, names)
    return total


@pytest.mark.parametrize("impl", ["xla", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_frozen_weight_gets_no_gradient_matmul(impl):
    """Differentiated with respect to x alone (a frozen weight: LoRA, Trainer(trainable=...)), each op's backward
    skips the weight-gradient product (and the loss its [D, V] buffer); dx is unchanged."""
    cfg = IMPLEMENTATIONS[impl]
    opts = dict(implementation=impl, interpret=cfg["interpret"], block_sizes=cfg["blocks"])
    rng = np.random.RandomState(0)
    x, w, w2 = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((32, 48), (48, 64), (48, 64)))
    labels = jnp.asarray(rng.randint(0, 64, 32))
    ops = {"fused_matmul": lambda x, w: fused_matmul(x, w, activation="silu", **opts).sum(),
           "gated_mlp": lambda x, w: gated_mlp(x, w, w2, **opts).sum(),
           "linear_cross_entropy": lambda x, w: linear_cross_entropy(x, w, labels, **opts).sum()}
    names = {"dot_general", "pallas_call"}
    for name, f in ops.items():
        both = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr
        only_x = jax.make_jaxpr(jax.grad(f, argnums=0))(x, w).jaxpr
        assert _count(only_x, names) < _count(both, names), name
        np.testing.assert_allclose(jax.grad(f)(x, w), jax.grad(f, argnums=(0, 1))(x, w)[0], rtol=1e-6, err_msg=name)


def _vmem_limit(eqn):
    params = eqn.params["compiler_params"]  # a dict by backend in some JAX releases
    return (params.get("mosaic_tpu", params) if isinstance(params, dict) else params).vmem_limit_bytes


@pytest.mark.parametrize("generation, limit", [("v5e", 96 << 20), ("v5p", 48 << 20), ("v6e", 96 << 20), ("v4", None)])
def test_mosaic_matmuls_ask_for_the_generations_vmem_and_v4_halves_heavy_tiles(generation, limit):
    """Float32 operands, int8 weights and the fused epilogue's backward overflowed the default scoped VMEM on a real
    v5e (kernels/README.md): every tiled matmul kernel asks for `MOSAIC_VMEM_LIMIT` of its generation, and v4, whose
    16 MiB cannot be raised, takes those tiles halved in rows and columns, keeping the searched bf16 forward's."""
    from kernels import tpu_compile
    from kernels._dispatch import compiler_scoped_vmem
    from kernels.grouped_matmul import grouped_matmul

    def traced(fn, *shapes):
        args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
        with tpu_compile.traced_for(generation):
            return tpu_compile.pallas_calls(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), (0, 1)), *args)

    def out_tiles(calls):
        return {e.params["grid_mapping"].block_mappings[-1].transformed_block_aval.shape for _, e in calls}

    k, n = 4096, 8192
    sizes = jnp.asarray([512, 512], jnp.int32)
    programs = {"bf16": traced(lambda x, w: fused_matmul(x, w, implementation="mosaic_tpu"),
                               ((4096, k), jnp.bfloat16), ((k, n), jnp.bfloat16)),
                "f32": traced(lambda x, w: fused_matmul(x, w, activation="gelu", implementation="mosaic_tpu"),
                              ((4096, k), jnp.float32), ((k, n), jnp.float32)),
                "loss": traced(lambda x, w: linear_cross_entropy(x, w, jnp.zeros(4096, jnp.int32),
                                                                 implementation="mosaic_tpu"),
                               ((4096, k), jnp.float32), ((k, 32768), jnp.float32)),
                "grouped": traced(lambda x, w: grouped_matmul(x, w, sizes, implementation="mosaic_tpu"),
                                  ((1024, k), jnp.bfloat16), ((2, k, n), jnp.bfloat16))}
    for name, calls in programs.items():
        assert calls, name
        for kernel, eqn in calls:
            assert _vmem_limit(eqn) == limit, (name, kernel)
    bf16, f32 = (max(t[0] * t[1] for t in out_tiles(programs[p])) for p in ("bf16", "f32"))
    assert f32 == (bf16 // 4 if generation == "v4" else bf16), (bf16, f32)
    with compiler_scoped_vmem():  # the compile tier's: the compiler's scoped limit governs, traced anew
        calls = traced(lambda x, w: fused_matmul(x, w, implementation="mosaic_tpu"), ((4096, k), jnp.bfloat16),
                       ((k, n), jnp.bfloat16))
    assert {_vmem_limit(eqn) for _, eqn in calls} == {None}
