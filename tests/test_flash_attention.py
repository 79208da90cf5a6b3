"""kernels.flash_attention: every implementation against jax.nn.dot_product_attention, forward and gradients.

The Pallas kernels run in Pallas's interpreter on CPU ('triton' with interpret=True, 'mosaic_tpu' with the TPU
interpreter), with small tiles so that every case spans several blocks and exercises block skipping and padding.
"""
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import (BlockSizes, decode_attention, dropout_keys, dropout_multiplier, flash_attention,
                               mha_reference, quantize_kv)
from tests.targets import for_gpu

# Max |error| relative to max |reference|, per dtype: (forward, gradients). The reference runs in float32 on the
# same (rounded) inputs, so bf16/f16 errors are those of the kernel's own low-precision matmul operands (measured
# about 4e-3 for bf16, 1e-6 for f32).
TOLERANCE = {
    jnp.float32: (1e-5, 2e-5),
    jnp.bfloat16: (1e-2, 2e-2),
    jnp.float16: (2e-3, 4e-3),
}

# name -> (flash_attention kwargs, sequence-length multiplier, indices of CORE_CASES in the default run or None for
# all). Tiles are small so that every case spans several of them (block skipping, padding, unequal forward/backward
# tiles). Mosaic tiles are at least 128 wide, so its cases are 6x longer, and its interpreter is the slowest, so
# its default run keeps the two cases that mix the most features.
VARIANTS = {
    "xla": (dict(implementation="xla", block_sizes=BlockSizes(block_k=16)), 1, None),
    "triton": (dict(implementation="triton", interpret=True, block_sizes=BlockSizes(32, 16, 16, 32)), 1, None),
    "mosaic_tpu": (
        dict(implementation="mosaic_tpu", interpret=True, block_sizes=BlockSizes(128, 128, 128, 128)),
        6,
        (0, 2),
    ),
}

# (causal, segments, heads, kv_heads, q_len, kv_len, head_dim, dtype). CORE_CASES (default run) cover every value of
# every factor of the product: causal or not, segment ids or not, grouped-query ratio 1/2/4, lengths that
# are and are not tile multiples, q_len != kv_len, head_dim 64/128, f32/bf16. EXTRA_CASES (slow) add interactions.
CORE_CASES = [
    (True, True, 4, 1, 40, 40, 64, jnp.float32),
    (False, True, 2, 1, 24, 56, 128, jnp.float32),
    (True, True, 4, 2, 32, 64, 128, jnp.bfloat16),
    (False, False, 4, 4, 48, 48, 64, jnp.bfloat16),
]
EXTRA_CASES = [
    (False, False, 2, 2, 32, 32, 64, jnp.float32),
    (True, False, 4, 2, 48, 48, 64, jnp.float32),
    (True, True, 4, 4, 56, 24, 128, jnp.float32),
    (True, False, 2, 1, 33, 50, 64, jnp.float32),
    (False, False, 4, 1, 40, 40, 128, jnp.bfloat16),
    (True, True, 4, 2, 45, 45, 64, jnp.bfloat16),
    (False, True, 4, 4, 50, 30, 64, jnp.bfloat16),
    (True, True, 4, 2, 40, 40, 64, jnp.float16),
]


def _case_id(case):
    causal, segments, h, hkv, t, s, d, dtype = case
    mask = f"{'causal' if causal else 'full'}-{'seg' if segments else 'noseg'}"
    return f"{mask}-h{h}kv{hkv}-t{t}s{s}-d{d}-{dtype.__name__}"


def _inputs(case, batch=2, seed=0):
    """q, k, v, a cotangent and segment ids, built in numpy (eager jnp ops would each compile on the shared CPU)."""
    causal, segments, h, hkv, t, s, d, dtype = case
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, t, h, d), np.float32).astype(dtype))
    k = jnp.asarray(rng.standard_normal((batch, s, hkv, d), np.float32).astype(dtype))
    v = jnp.asarray(rng.standard_normal((batch, s, hkv, d), np.float32).astype(dtype))
    ct = rng.standard_normal((batch, t, h, d), np.float32)
    segment_ids = None
    if segments:
        # Packed sequences: three segments per row, with boundaries at different fractions in q and kv (and per row),
        # so some q blocks see no key of their segment in some kv blocks (segment block skipping).
        cuts = np.array([[0.3, 0.7], [0.5, 0.8]])[:batch]
        q_ids = jnp.asarray((np.arange(t)[None, :, None] >= cuts[:, None, :] * t).sum(-1), jnp.int32)
        kv_ids = jnp.asarray((np.arange(s)[None, :, None] >= cuts[:, None, :] * s).sum(-1), jnp.int32)
        segment_ids = q_ids if t == s else (q_ids, kv_ids)
    return q, k, v, ct, segment_ids


def _mask(case, segment_ids, batch=2):
    """[B, 1, T, S] numpy mask for jax.nn.dot_product_attention, and [B, T] rows that see at least one key."""
    causal, segments, h, hkv, t, s, d, dtype = case
    mask = np.ones((batch, 1, t, s), bool)
    if causal:
        mask = mask & np.tril(np.ones((t, s), bool))
    if segments:
        q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
        mask = mask & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    return mask, mask.any(-1)[:, 0]


def _relative_error(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-6))


def _check_against_jax_nn(case, **kwargs):
    q, k, v, ct, segment_ids = _inputs(case)
    mask, visible = _mask(case, segment_ids)
    # jax.nn attends uniformly on rows with no visible key where ours outputs zeros; zeroing those rows of the
    # cotangent makes both sides' gradients agree exactly in that convention too.
    ct = jnp.asarray((ct * visible[:, :, None, None]).astype(q.dtype))

    def loss(f, q, k, v):
        out = f(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    ours = lambda q, k, v: flash_attention(q, k, v, causal=case[0], segment_ids=segment_ids, **kwargs)
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))
    (_, out), grads = jax.jit(jax.value_and_grad(lambda *a: loss(ours, *a), (0, 1, 2), has_aux=True))(q, k, v)
    (_, ref), ref_grads = jax.jit(jax.value_and_grad(lambda *a: loss(theirs, *a), (0, 1, 2), has_aux=True))(
        f32(q), f32(k), f32(v)
    )
    fwd_tol, grad_tol = TOLERANCE[case[-1]]
    assert out.dtype == q.dtype and out.shape == q.shape
    rows = visible[:, :, None, None]
    assert _relative_error(np.asarray(out, np.float32) * rows, np.asarray(ref) * rows) < fwd_tol
    assert np.all(np.asarray(out)[~np.asarray(visible)] == 0)
    for name, g, ref_g, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert _relative_error(g, ref_g) < grad_tol, name


def _scaled(case, multiplier):
    return (*case[:4], case[4] * multiplier, case[5] * multiplier, *case[6:])


def _parity_params():
    """Every (variant, case); all but the default-run ones (CORE_CASES, fewer for slow interpreters) marked slow."""
    for variant, (_, _, default_run) in VARIANTS.items():
        for index, case in enumerate(CORE_CASES + EXTRA_CASES):
            slow = index >= len(CORE_CASES) or (default_run is not None and index not in default_run)
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(variant, case, id=f"{variant}-{_case_id(case)}", marks=marks)


@pytest.mark.parametrize("variant, case", _parity_params())
def test_matches_jax_nn(variant, case):
    kwargs, multiplier, _ = VARIANTS[variant]
    _check_against_jax_nn((*case[:4], case[4] * multiplier, case[5] * multiplier, *case[6:]), **kwargs)


@pytest.mark.parametrize("case", CORE_CASES, ids=_case_id)
def test_mha_reference_matches_jax_nn(case):
    q, k, v, _, segment_ids = _inputs(case)
    mask, visible = _mask(case, segment_ids)
    out = jax.jit(lambda *a: mha_reference(*a, causal=case[0], segment_ids=segment_ids))(q, k, v)
    ref = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, mask=mask))(q, k, v)
    rows = visible[:, :, None, None]
    assert _relative_error(np.asarray(out) * rows, np.asarray(ref) * rows) < TOLERANCE[q.dtype.type][0]


# The Pallas variants also meet fully-masked rows in the default run, in the causal cross-attention parity case.
@pytest.mark.parametrize("variant", ["xla", *(pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS if v != "xla")])
def test_fully_masked_rows_give_zeros_and_finite_gradients(variant):
    # Query segment 7 (padding) matches no key: those rows must be 0, not NaN or an average of v.
    q, k, v, ct, _ = _inputs((False, False, 2, 1, 24, 40, 64, jnp.float32))
    q_ids = jnp.asarray(np.where(np.arange(24) < 16, 0, 7)[None].repeat(2, 0), jnp.int32)
    kv_ids = jnp.asarray(np.zeros((2, 40), np.int32))
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=(q_ids, kv_ids), **VARIANTS[variant][0])
    out, grads = jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * ct), (0, 1, 2))(*a)))(q, k, v)
    assert np.all(np.asarray(out[:, 16:]) == 0)
    assert np.all(np.isfinite(np.asarray(out)))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    ref = jax.jit(lambda *a: mha_reference(*a, causal=True, segment_ids=(q_ids, kv_ids)))(q, k, v)
    assert _relative_error(out, ref) < TOLERANCE[jnp.float32][0]


@pytest.mark.parametrize("mode", ["causal", "segments"])
@pytest.mark.parametrize("variant, q_len", [("triton", 32), ("mosaic_tpu", 256)])
def test_invisible_kv_blocks_are_skipped_not_just_masked(variant, q_len, mode):
    # kv_len = 2 q_len; no query can see the second half (causal: it lies past every query; segments: its id matches
    # no query). It holds NaN, so a kernel that loaded and masked those blocks instead of skipping them would return
    # NaN through 0 * NaN; the result must instead equal attention over the first half, with zero gradient beyond.
    kwargs = VARIANTS[variant][0]
    q, k, v, ct, _ = _inputs((False, False, 2, 1, q_len, 2 * q_len, 64, jnp.float32), batch=1)
    beyond = (np.arange(2 * q_len) >= q_len)[None, :, None, None]
    k_nan, v_nan = (jnp.asarray(np.where(beyond, np.nan, np.asarray(x))) for x in (k, v))
    causal = mode == "causal"
    segment_ids = None
    if not causal:
        segment_ids = (jnp.zeros((1, q_len), jnp.int32), jnp.asarray(beyond[:, :, 0, 0], jnp.int32))

    def out_and_grads(f, q, k, v):
        return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * ct), (0, 1, 2))(q, k, v)

    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, **kwargs)
    out, (dq, dk, dv) = jax.jit(functools.partial(out_and_grads, ours))(q, k_nan, v_nan)
    half = lambda q, k, v: mha_reference(q, k, v, causal=causal)
    ref, (ref_dq, ref_dk, ref_dv) = jax.jit(functools.partial(out_and_grads, half))(q, k[:, :q_len], v[:, :q_len])
    fwd_tol, grad_tol = TOLERANCE[jnp.float32]
    assert _relative_error(out, ref) < fwd_tol
    for g, ref_g in ((dq, ref_dq), (dk[:, :q_len], ref_dk), (dv[:, :q_len], ref_dv)):
        assert _relative_error(g, ref_g) < grad_tol
    assert np.all(np.asarray(dk[:, q_len:]) == 0) and np.all(np.asarray(dv[:, q_len:]) == 0)


DROPOUT_CASES = [CORE_CASES[0], CORE_CASES[1], (True, False, 4, 2, 33, 50, 64, jnp.float32)]


def _dropout_params():
    """Every (variant, case); the Mosaic interpreter (the slowest) runs in the slow set only."""
    for variant in VARIANTS:
        for case in DROPOUT_CASES:
            marks = [pytest.mark.slow] if variant == "mosaic_tpu" else []
            yield pytest.param(variant, case, id=f"{variant}-{_case_id(case)}", marks=marks)


@pytest.mark.parametrize("variant, case", _dropout_params())
def test_dropout_matches_autodiff_of_the_materialised_oracle(variant, case):
    """Dropout on the probabilities: output and all three gradients equal jax.grad of `mha_reference`, which
    materialises [B, H, T, S], applies the same hashed mask and is differentiated by JAX. So the kernels' backward
    (dv from the kept probabilities, dp masked, delta = <out, do> unchanged) is checked against autodiff, and every
    implementation regenerates the same mask in every pass whatever its tiles. Packed, GQA, unaligned cross
    attention."""
    kwargs, multiplier, _ = VARIANTS[variant]
    case = _scaled(case, multiplier)
    q, k, v, ct, segment_ids = _inputs(case)
    rate, key = 0.3, jax.random.key(11)
    keys = dropout_keys(key, q.shape[0], q.shape[2])
    ours = lambda q, k, v: flash_attention(q, k, v, causal=case[0], segment_ids=segment_ids, dropout_rate=rate,
                                           dropout_rng=key, **kwargs)
    oracle = lambda q, k, v: mha_reference(q, k, v, causal=case[0], segment_ids=segment_ids, dropout_rate=rate,
                                           dropout_keys=keys)
    run = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * ct), (0, 1, 2))(*a)))(q, k, v)
    (out, grads), (ref, ref_grads) = run(ours), run(oracle)
    assert _relative_error(out, ref) < TOLERANCE[jnp.float32][0]
    for name, g, ref_g in zip("qkv", grads, ref_grads):
        assert _relative_error(g, ref_g) < TOLERANCE[jnp.float32][1], name
    plain = mha_reference(q, k, v, causal=case[0], segment_ids=segment_ids)
    assert _relative_error(out, plain) > 0.1  # dropout is on


def test_dropout_mask_is_a_fair_independent_coin_per_entry():
    """Over 4 rows x 8 heads x 256 x 256 entries: the kept fraction is 1 - rate within 5 standard errors for several
    rates, kept entries are scaled by 1 / (1 - rate), and masks of neighbouring keys, queries, heads, rows and of
    another seed agree only as often as independent coins would."""
    B, H, T = 4, 8, 256
    for rate in (0.1, 0.5, 0.9):
        mult = np.asarray(jax.jit(lambda key: dropout_multiplier(
            dropout_keys(key, B, H)[:, :, None, None], jnp.arange(T)[:, None], jnp.arange(T)[None, :], rate))(
            jax.random.key(0)))
        assert set(np.unique(mult)) == {0.0, np.float32(1 / (1 - rate))}
        kept = mult > 0
        n = kept.size
        assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n), (rate, kept.mean())
        other = np.asarray(jax.jit(lambda key: dropout_multiplier(
            dropout_keys(key, B, H)[:, :, None, None], jnp.arange(T)[:, None], jnp.arange(T)[None, :], rate))(
            jax.random.key(1))) > 0
        agree = rate**2 + (1 - rate) ** 2  # chance that two independent coins agree
        for a, b in ((kept[..., 1:], kept[..., :-1]), (kept[:, :, 1:], kept[:, :, :-1]), (kept[:, 1:], kept[:, :-1]),
                     (kept[1:], kept[:-1]), (kept, other)):
            assert abs((a == b).mean() - agree) < 5 * np.sqrt(agree * (1 - agree) / a.size), rate


def test_dropout_rate_zero_is_the_plain_kernel_and_the_key_decides_the_mask():
    q, k, v, _, _ = _inputs((True, False, 2, 2, 32, 32, 64, jnp.float32))
    f = jax.jit(lambda rate, seed: flash_attention(q, k, v, causal=True, dropout_rate=rate,
                                                    dropout_rng=jax.random.key(seed), implementation="xla"),
                static_argnums=(0, 1))
    plain = jax.jit(lambda: flash_attention(q, k, v, causal=True, implementation="xla"))
    np.testing.assert_array_equal(f(0.0, 0), plain())
    np.testing.assert_array_equal(f(0.2, 0), f(0.2, 0))
    assert np.abs(np.asarray(f(0.2, 0)) - np.asarray(f(0.2, 1))).max() > 1e-2


def test_default_implementation_on_cpu_is_xla():
    q, k, v, _, _ = _inputs((True, False, 2, 2, 16, 16, 64, jnp.float32))
    np.testing.assert_allclose(
        flash_attention(q, k, v, causal=True), flash_attention(q, k, v, causal=True, implementation="xla"), rtol=0
    )


def test_xla_path_never_materialises_the_full_matrix():
    # Compiled (not run) forward+backward at len 8192: XLA's temp buffers stay far below one f32 [len, len] matrix.
    T, H, D = 8192, 2, 64
    q = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)
    grad = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="xla").sum(), (0, 1, 2))
    temp_bytes = jax.jit(grad).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
    assert temp_bytes < H * T * T * 4 / 2, temp_bytes


def _array(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((_array((2, 8, 4)), _array((2, 8, 4, 16)), _array((2, 8, 4, 16))), {}, r"q\.shape"),
        ((_array((2, 8, 4, 16)), _array((3, 8, 4, 16)), _array((3, 8, 4, 16))), {}, "batch"),
        ((_array((2, 8, 4, 16)), _array((2, 8, 4, 32)), _array((2, 8, 4, 32))), {}, "head_dim"),
        ((_array((2, 8, 4, 16)), _array((2, 8, 3, 16)), _array((2, 8, 3, 16))), {}, "divisible"),
        ((_array((2, 8, 4, 16)), _array((2, 8, 4, 16)), _array((2, 9, 4, 16))), {}, r"v\.shape"),
        ((_array((2, 8, 4, 16), jnp.int32),) * 3, {}, r"q\.dtype"),
        ((_array((2, 8, 4, 16)), _array((2, 8, 4, 16), jnp.bfloat16), _array((2, 8, 4, 16))), {}, "dtypes"),
        ((_array((2, 8, 4, 16)),) * 3, {"segment_ids": _array((2, 9), jnp.int32)}, "segment_ids.shape"),
        ((_array((2, 8, 4, 16)),) * 3, {"segment_ids": _array((2, 8), jnp.float32)}, "segment_ids.dtype"),
        (
            (_array((2, 8, 4, 16)), _array((2, 6, 4, 16)), _array((2, 6, 4, 16))),
            {"segment_ids": _array((2, 8), jnp.int32)},
            "pair",
        ),
        ((_array((2, 8, 4, 16)),) * 3, {"sm_scale": -1.0}, "sm_scale"),
        ((_array((2, 8, 4, 16)),) * 3, {"causal": 1}, "causal"),
        ((_array((2, 8, 4, 16)),) * 3, {"dropout_rate": 1.0, "dropout_rng": jax.random.key(0)}, "dropout_rate=1.0"),
        ((_array((2, 8, 4, 16)),) * 3, {"dropout_rate": -0.1, "dropout_rng": jax.random.key(0)}, "dropout_rate"),
        ((_array((2, 8, 4, 16)),) * 3, {"dropout_rate": 0.1}, "dropout_rng=None"),
        ((_array((2, 8, 4, 16)),) * 3, {"dropout_rate": 0.1, "dropout_rng": 3}, "dropout_rng has"),
        ((_array((2, 8, 4, 16)),) * 3, {"dropout_rate": 0.1, "dropout_rng": jax.random.split(jax.random.key(0))},
         "dropout_rng has"),
        ((_array((2, 8, 4, 16)),) * 3, {"implementation": "cuda"}, "implementation"),
        ((_array((2, 8, 4, 16)),) * 3, {"block_sizes": {"block_q": 64}}, "block_sizes"),
        ((_array((2, 8, 4, 16)),) * 3, {"block_sizes": BlockSizes(block_q=0)}, "block_sizes.block_q"),
        (
            (_array((2, 8, 4, 16)),) * 3,
            {"block_sizes": BlockSizes(block_k=64), "implementation": "mosaic_tpu"},
            "block_sizes.block_k=64; expected a multiple of 128",
        ),
        (
            (_array((2, 8, 4, 16)),) * 3,
            {"block_sizes": BlockSizes(block_q_bwd=48), "implementation": "triton"},
            "block_sizes.block_q_bwd=48; expected a power of two",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: flash_attention(*a, **kwargs), *args)


@pytest.mark.parametrize(
    "implementation, platform, custom_call",
    [("triton", "cuda", "__gpu$xla.gpu.triton"), ("mosaic_tpu", "tpu", "tpu_custom_call")],
)
def test_lowers_for_the_accelerator(implementation, platform, custom_call):
    # Realistic training shape (batch 2, len 4096, 32 heads over 8 kv heads, head_dim 128, bf16, causal, packed):
    # forward and backward lower to exactly the three Pallas kernels, with no device and nothing allocated.
    B, T, H, Hkv, D = 2, 4096, 32, 8, 128
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, ids, key):
        out = flash_attention(q, k, v, causal=True, segment_ids=ids, implementation=implementation,
                              dropout_rate=0.1 if key is not None else 0.0, dropout_rng=key)
        return out.astype(jnp.float32).sum()

    for key in (None, jax.random.key(0)):  # without and with dropout
        with for_gpu() if platform == "cuda" else contextlib.nullcontext():
            lowered = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, ids, key).lower(
                lowering_platforms=(platform,))
        text = lowered.as_text()
        assert text.count(f"@{custom_call}(") == 3
        for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
            assert kernel in text


def test_forward_and_backward_kernels_take_their_own_triton_launch_settings():
    """num_warps/num_stages go to the forward kernel, num_warps_bwd/num_stages_bwd to the dq and dk/dv kernels (the
    Triton custom calls' attributes in the cuda lowering), so the tuner can pick each pass's best."""
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    blocks = BlockSizes(num_warps=2, num_stages=1, num_warps_bwd=8, num_stages_bwd=4)
    grads = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="triton",
                                                     block_sizes=blocks).astype(jnp.float32).sum(), (0, 1, 2))
    with for_gpu():
        text = jax.jit(grads).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    settings = {}
    for line in text.splitlines():
        name = re.search(r'name = "(flash_attention_\w+)"', line)
        if name and "xla.gpu.triton" in line:
            settings[name.group(1)] = tuple(int(re.search(rf"{k} = (\d+)", line).group(1))
                                            for k in ("num_warps", "num_stages"))
    assert settings == {"flash_attention_fwd": (2, 1), "flash_attention_dq": (8, 4), "flash_attention_dkv": (8, 4)}


def _cache(B, S, KVH, D, fills, dtype=jnp.float32):
    """A KV cache [B, S, KVH, D] and its ids [B, S]: row b holds tokens at slots fills[b] = (start, stop) (left
    padding before, unfilled slots after: id 0)."""
    keys = jax.random.split(jax.random.key(3), 2)
    k, v = (jax.random.normal(key, (B, S, KVH, D), jnp.float32).astype(dtype) for key in keys)
    ids = np.zeros((B, S), np.int32)
    for b, (start, stop) in enumerate(fills):
        ids[b, start:stop] = 1
    return k, v, jnp.asarray(ids)


@pytest.mark.parametrize("variant", ["xla", "triton", pytest.param("mosaic_tpu", marks=pytest.mark.slow)])
def test_decode_attention_equals_flash_attention_over_the_filled_cache(variant):
    """Each split of the cache, merged by log-sum-exps, with a kv head's query heads as one tile: equal to
    attention over the whole cache (grouped 1 and 4, one and two new tokens, splits 2 and 4 including splits that
    hold only unfilled slots, left padding); a query whose id no key has gets zeros."""
    kwargs, _, _ = VARIANTS[variant]
    kwargs = dict(kwargs, block_sizes=None if variant == "mosaic_tpu" else kwargs["block_sizes"])
    S = 512 if variant == "mosaic_tpu" else 128
    for (H, KVH, T, dtype), splits in (((4, 4, 1, jnp.float32), (4,)), ((8, 2, 2, jnp.bfloat16), (2,))):
        k, v, kv_ids = _cache(3, S, KVH, 64, [(5, S // 3), (0, S // 2 + 7), (0, 0)], dtype)
        q = jax.random.normal(jax.random.key(4), (3, T, H, 64), jnp.float32).astype(dtype)
        q_ids = jnp.ones((3, T), jnp.int32)
        want = mha_reference(*(a.astype(jnp.float32) for a in (q, k, v)), segment_ids=(q_ids, kv_ids))
        for num_splits in splits:
            got = jax.jit(lambda q, k, v: decode_attention(q, k, v, segment_ids=(q_ids, kv_ids),
                                                           num_splits=num_splits, **kwargs))(q, k, v)
            assert got.shape == q.shape and got.dtype == dtype
            error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            assert error <= TOLERANCE[dtype][0], (H, KVH, T, num_splits, error)
            np.testing.assert_array_equal(np.asarray(got[2], np.float32), 0.0)  # row 2: an empty cache


@pytest.mark.parametrize("variant", ["xla", "triton", pytest.param("mosaic_tpu", marks=pytest.mark.slow)])
def test_decode_attention_reads_an_int8_cache(variant):
    """k, v int8 with a scale per token and head (kernels.quantize_kv), converted in the kernel, the scales on the
    logits' and probabilities' columns: equal to attention over the dequantised cache, and within 2% of the float
    cache's output."""
    kwargs, _, _ = VARIANTS[variant]
    kwargs = dict(kwargs, block_sizes=None if variant == "mosaic_tpu" else kwargs["block_sizes"])
    S = 512 if variant == "mosaic_tpu" else 128
    k, v, kv_ids = _cache(2, S, 2, 64, [(3, S // 2), (0, S - 5)])
    q = jax.random.normal(jax.random.key(5), (2, 1, 8, 64), jnp.float32)
    q_ids = jnp.ones((2, 1), jnp.int32)
    (k8, k_scale), (v8, v_scale) = quantize_kv(k), quantize_kv(v)
    assert k8.dtype == jnp.int8 and k_scale.shape == (2, S, 2)
    dequantised = [a.astype(jnp.float32) * s[..., None] for a, s in ((k8, k_scale), (v8, v_scale))]
    want = mha_reference(q, *dequantised, segment_ids=(q_ids, kv_ids))
    got = jax.jit(lambda *a: decode_attention(q, a[0], a[1], k_scale=a[2], v_scale=a[3], segment_ids=(q_ids, kv_ids),
                                              num_splits=2, **kwargs))(k8, v8, k_scale, v_scale)
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    exact = mha_reference(q, k, v, segment_ids=(q_ids, kv_ids))
    assert float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact))) < 0.02


def test_decode_attention_default_splits_and_bad_input():
    from kernels.attention.api import _decode_splits
    assert _decode_splits("triton", 8, 32768) == 32 and _decode_splits("triton", 64, 32768) == 4
    assert _decode_splits("triton", 8, 1024) == 2 and _decode_splits("triton", 512, 32768) == 1
    assert _decode_splits("mosaic_tpu", 8, 32768) == 1 and _decode_splits("xla", 8, 32768) == 1
    q, kv = _array((2, 1, 4, 16)), _array((2, 12, 2, 16))
    for bad in (5, 0, True, 2.0):
        with pytest.raises(ValueError, match=f"num_splits={bad!r}; expected None or a positive int dividing "
                                             "kv_len=12"):
            jax.eval_shape(lambda *a: decode_attention(*a, num_splits=bad), q, kv, kv)
    with pytest.raises(ValueError, match="divisible"):
        jax.eval_shape(lambda *a: decode_attention(*a), _array((2, 1, 3, 16)), kv, kv)
    kv8, scale = _array((2, 12, 2, 16), jnp.int8), _array((2, 12, 2))
    for args, kwargs, match in [((q, kv8, kv8), {}, r"k_scale=None; int8 k and v need float scales \[batch, kv_len, "
                                                     r"kv_heads\] = \(2, 12, 2\)"),
                                ((q, kv8, kv8), dict(k_scale=scale, v_scale=_array((2, 12))), r"v_scale=\(\(2, 12\)"),
                                ((q, kv8, kv), dict(k_scale=scale, v_scale=scale), "expected both int8"),
                                ((q, kv, kv), dict(k_scale=scale), "k_scale / v_scale with k.dtype=float32")]:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *a: decode_attention(*a, **kwargs), *args)


@pytest.mark.parametrize("implementation, platform, custom_call",
                         [("triton", "cuda", "__gpu$xla.gpu.triton"), ("mosaic_tpu", "tpu", "tpu_custom_call")])
def test_decode_attention_lowers_for_the_accelerator(implementation, platform, custom_call):
    """A decoding step of 8 sequences against a 32k-slot bf16 cache, 32 query heads over 8 kv heads, head_dim 128:
    one forward kernel, on [B * splits, 32768 / splits, 8, 128] slices of the cache (GPU: 4 splits, 256 programs)."""
    B, S, H, KVH, D = 8, 32768, 32, 8, 128
    q, kv = _array((B, 1, H, D), jnp.bfloat16), _array((B, S, KVH, D), jnp.bfloat16)
    ids = (_array((B, 1), jnp.int32), _array((B, S), jnp.int32))
    splits = 4 if implementation == "triton" else 1
    for dtype, scales in (("bf16", {}), ("i8", dict(k_scale=_array((B, S, KVH)), v_scale=_array((B, S, KVH))))):
        cache = kv if not scales else _array(kv.shape, jnp.int8)
        with for_gpu() if platform == "cuda" else contextlib.nullcontext():
            text = jax.jit(lambda q, k, v, a, b, s: decode_attention(q, k, v, segment_ids=(a, b), **s,
                                                                     implementation=implementation)).trace(
                q, cache, cache, *ids, scales).lower(lowering_platforms=(platform,)).as_text()
        assert text.count(f"@{custom_call}(") == 1 and "flash_attention_fwd" in text
        sliced = (f"{B * splits}x{S // splits}x{KVH}x{D}x{dtype}" if platform == "cuda"
                  else f"{B}x{KVH}x{S}x{D}x{dtype}")
        assert sliced in text, dtype  # the cache reaches the kernel in its own dtype (int8: no bf16 copy)
        assert not scales or sliced.replace("i8", "bf16") not in text


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_xla_masks_are_not_kept_for_every_block_of_a_remat_layer_scan(dropout):
    """The 'xla' path's mask (and dropout) tiles depend on the block index and segment ids alone; inside a remat'd
    scan over layers JAX's partial evaluation hoisted them out and kept all of them: here the 16 kv blocks' masks
    (pred[16, 1, 4, 1, 8192, 512], 268 MB) or dropout multipliers (f32, 1.07 GB, the whole attention matrix):
    temporaries 546 / 1620 MB, now 370 / 437 MB. Compiled, not run."""
    B, T, H, D, L = 1, 8192, 4, 64, 2
    ids = jnp.ones((B, T), jnp.int32)

    def layer(x, w):
        qk = jnp.einsum("bthd,de->bthe", x, w)
        out = flash_attention(qk, qk, x, causal=True, segment_ids=ids, implementation="xla", dropout_rate=dropout,
                              dropout_rng=jax.random.key(0) if dropout else None)
        return x + out, None

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, ws)[0])

    args = (jax.ShapeDtypeStruct((L, D, D), jnp.float32), jax.ShapeDtypeStruct((B, T, H, D), jnp.float32))
    compiled = jax.jit(jax.grad(loss)).trace(*args).lower().compile()
    assert not re.search(r"(pred|f32)\[16,1,4,1,8192,512\]", compiled.as_text())
    assert compiled.memory_analysis().temp_size_in_bytes < 0.5e9


# implementation='cudnn': cuDNN through jax.nn.dot_product_attention. This host has no GPU, so the tests check the
# refusals, the mapping of our arguments onto jax.nn's (its 'xla' path computing in place of its cuDNN one) and the
# lowering for cuda (cuDNN's forward and backward custom calls, whole and on a mesh's local blocks).


@pytest.fixture
def cudnn_on_xla(monkeypatch):
    """flash_attention(implementation='cudnn') runs jax.nn.dot_product_attention's 'xla' path in place of its cuDNN
    one, and on CPU; returns the list of the keyword arguments each call gave jax.nn (and its q's shape)."""
    from kernels.attention import cudnn
    calls = []

    def recorder(*args, **kwargs):
        calls.append({**kwargs, "q_shape": args[0].shape})
        return jax.nn.dot_product_attention(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(cudnn, "dot_product_attention", recorder)
    monkeypatch.setattr(cudnn, "check_device", lambda interpret: None)
    return calls


@pytest.fixture
def cudnn_lowering(monkeypatch):
    """JAX 0.10.2 asks the CUDA plugin for cuDNN's version while tracing, and this host has none: a cuDNN 9.10 is
    stated instead (JAX 0.11.2 with its CUDA plugin installed finds the library itself)."""
    from jax._src.cudnn import fused_attention_stablehlo
    try:
        fused_attention_stablehlo.check_cudnn_version()
    except RuntimeError:
        monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


@pytest.mark.parametrize("causal, window, t, s, heads, kv_heads, sm_scale, expect", [
    (True, None, 40, 40, 4, 2, None, dict(is_causal=True, local_window_size=None)),
    (False, None, 24, 40, 4, 1, 0.3, dict(is_causal=False, local_window_size=None, scale=0.3)),
    (True, (7, 3), 40, 40, 4, 4, None, dict(is_causal=True, local_window_size=(7, 0))),  # causal cuts the right side
    (False, (5, 0), 40, 40, 2, 1, None, dict(is_causal=True, local_window_size=(5, 0))),  # a left window is causal
])
def test_cudnn_maps_onto_jax_nn_exactly(cudnn_on_xla, causal, window, t, s, heads, kv_heads, sm_scale, expect):
    """Values and gradients equal the 'xla' implementation's (bf16, GQA without repeating k / v), and jax.nn gets
    implementation='cudnn' with the mapped mask arguments."""
    q, k, v, ct, _ = _inputs((causal, False, heads, kv_heads, t, s, 64, jnp.bfloat16))

    def value_and_grads(impl):
        f = lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, sm_scale=sm_scale,  # noqa: E731
                                            implementation=impl)
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct), (0, 1, 2)))(q, k, v)

    got, want = value_and_grads("cudnn"), value_and_grads("xla")
    assert _relative_error(got[0], want[0]) < 1e-2
    for g, w in zip(got[1], want[1]):
        assert g.dtype == jnp.bfloat16 and _relative_error(g, w) < TOLERANCE[jnp.bfloat16][1]
    assert cudnn_on_xla and all(c["implementation"] == "cudnn" for c in cudnn_on_xla)
    assert {k: cudnn_on_xla[0].get(k) for k in expect} == expect


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (9, 0))])
def test_cudnn_takes_segment_ids_as_a_mask(cudnn_on_xla, causal, window):
    """One [B, T] array of packed documents becomes jax.nn's boolean mask [B, 1, T, T] of equal ids beside the
    causal mask or window: values and gradients equal the 'xla' implementation's with the same segment ids."""
    q, k, v, ct, ids = _inputs((causal, True, 4, 2, 40, 40, 64, jnp.bfloat16))

    def output_and_grads(impl):
        f = lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, segment_ids=ids,  # noqa: E731
                                            implementation=impl)
        out, pull = jax.vjp(f, q, k, v)
        return out, pull(jnp.asarray(ct, out.dtype))

    got, want = jax.jit(lambda: output_and_grads("cudnn"))(), jax.jit(lambda: output_and_grads("xla"))()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _relative_error(g, w) < TOLERANCE[jnp.bfloat16][1]
    assert {(c["mask"].shape, c["mask"].dtype) for c in cudnn_on_xla} == {((2, 1, 40, 40), np.dtype(bool))}


def test_cudnn_on_a_mesh_runs_each_device_s_rows_and_heads(cudnn_on_xla):
    """On data 2 x fsdp 2 x model 2 (the Pallas kernels' shard_map): values and gradients equal the unsplit call,
    and jax.nn sees one row and half the heads."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import engine
    q, k, v, ct, _ = _inputs((True, False, 4, 2, 32, 32, 64, jnp.bfloat16), batch=4)
    grads = jax.value_and_grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, implementation="cudnn")
                                                       .astype(jnp.float32) * ct), (0, 1, 2))
    want = jax.jit(grads)(q, k, v)
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    spec = NamedSharding(mesh, P(("data", "fsdp"), None, "model", None))
    with jax.set_mesh(mesh):
        got = jax.jit(grads)(*(jax.device_put(x, spec) for x in (q, k, v)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
    assert {c["q_shape"] for c in cudnn_on_xla} == {(4, 32, 4, 64), (1, 32, 2, 64)}  # whole, then a device's


@pytest.mark.parametrize("mesh_shape", [None, dict(data=2, fsdp=2, model=2)])
def test_cudnn_lowers_to_cudnn_forward_and_backward_for_cuda(cudnn_lowering, mesh_shape):
    """forward + backward of B4 T1024 H8/2 D128 bf16 with a 64-key causal window lowered for cuda: one cuDNN
    forward and one cuDNN backward custom call, causal with sliding window 64; on a mesh, on each device's 1 row and
    4 / 1 heads."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import engine
    mesh = engine.make_mesh(**mesh_shape) if mesh_shape else None
    sharding = NamedSharding(mesh, P(("data", "fsdp"), None, "model", None)) if mesh else None
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((4, 1024, 2, 128), jnp.bfloat16, sharding=sharding)
    grads = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=True, window=(63, 0), implementation="cudnn")
                     .astype(jnp.float32).sum(), (0, 1, 2))
    with (jax.set_mesh(mesh) if mesh else contextlib.nullcontext()), for_gpu(mesh):
        text = jax.jit(grads).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$\w+)\(.*?\).*?: \((.*?)\) ->", text)
    assert [name for name, _ in calls] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"], calls
    assert re.findall(r"mask_type\\22: \\22(\w+)", text) == ["CAUSAL"] * 2
    assert re.findall(r"sliding_window_length\\22: (\d+)", text) == ["64"] * 2
    rows = "1x1024" if mesh else "4x1024"
    q_type, kv_type = (f"tensor<{rows}x{h}x128xbf16>" for h in ((4, 1) if mesh else (8, 2)))
    assert all(types.startswith(f"{q_type}, {kv_type}, {kv_type}") for _, types in calls), calls


def test_cudnn_with_segment_ids_lowers_to_cudnn_with_a_bias_for_cuda(cudnn_lowering):
    """Packed rows (segment ids [B, T]) lowered for cuda: cuDNN's forward and backward with the mask as a bias
    operand [B, 1, T, T], causal; under JAX 0.11 no bias gradient (the mask is not differentiable)."""
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 1024, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((4, 1024), jnp.int32)
    grads = jax.grad(lambda q, k, v, ids: flash_attention(q, k, v, causal=True, segment_ids=ids,
                                                          implementation="cudnn").astype(jnp.float32).sum(), (0, 1, 2))
    with for_gpu():
        text = jax.jit(grads).trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$\w+)\(.*?\).*?: \((.*?)\) ->", text)
    assert [name for name, _ in calls] == ["__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"]
    assert all("tensor<4x1x1024x1024xbf16>" in types for _, types in calls), calls
    assert re.findall(r"mask_type\\22: \\22(\w+)", text) == ["CAUSAL"] * 2
    backward_results = re.search(r"custom_call @__cudnn\$fmhaScaleBiasSoftmaxBackward\(.*?\).*?-> (.*?)\n", text)[1]
    # JAX 0.10.2 returns a bias gradient [4, 1, 1024, 1024] it then drops; 0.11.2 (the GPU machines') none
    assert ("4x1x1024x1024" in backward_results) == (jax.__version_info__ < (0, 11)), backward_results


@pytest.mark.parametrize("kwargs, match", [
    (dict(segment_ids=(_array((2, 64), jnp.int32),) * 2), "segment_ids with implementation='cudnn'; as a "
     r"\(q_ids, kv_ids\) pair a query may see no key"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate with implementation='cudnn'"),
    (dict(logit_soft_cap=30.0), "logit_soft_cap with implementation='cudnn'"),
    (dict(block_sizes=BlockSizes(block_q=64)), "block_sizes with implementation='cudnn'; cuDNN picks its own"),
    (dict(window=(8, 2)), r"window=\(8, 2\) without causal with implementation='cudnn'"),
    (dict(dtype=jnp.float32), "q.dtype=float32 with implementation='cudnn'; expected bfloat16 or float16"),
    (dict(head_dim=12), "head_dim=12 with implementation='cudnn'; expected a multiple of 8 up to 256"),
    (dict(head_dim=512), "head_dim=512 with implementation='cudnn'"),
    (dict(interpret=True), "implementation='cudnn' with interpret=True; cuDNN runs on an NVIDIA GPU only"),
])
def test_cudnn_refuses_what_its_api_cannot_express_in_one_line(kwargs, match):
    """Traced for an H200 (so the device is right): each argument jax.nn's cuDNN path cannot express is named, with
    the implementations that take it."""
    shape = (2, 64, 4, kwargs.pop("head_dim", 64))
    q = _array(shape, kwargs.pop("dtype", jnp.bfloat16))
    with for_gpu(), pytest.raises(ValueError, match=match) as error:
        jax.eval_shape(lambda q: flash_attention(q, q, q, implementation="cudnn", **kwargs), q)
    assert "\n" not in str(error.value)


def test_cudnn_is_refused_off_an_nvidia_gpu_and_by_the_other_ops():
    """On this CPU, and by every op but flash_attention (they validate against kernels.IMPLEMENTATIONS)."""
    import kernels
    x = _array((2, 64, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^implementation='cudnn' on cpu \(cpu\); cuDNN runs on an NVIDIA GPU only"):
        jax.eval_shape(lambda q: flash_attention(q, q, q, implementation="cudnn"), x)
    m, w, ids = _array((64, 32)), _array((32, 48)), _array((64,), jnp.int32)
    pages = _array((4, 8, 16, 64), jnp.bfloat16)
    others = {
        "decode_attention": lambda: decode_attention(x, x, x, implementation="cudnn"),
        "paged_attention": lambda: kernels.paged_attention(_array((2, 4, 64), jnp.bfloat16), pages, pages,
                                                           _array((2, 4), jnp.int32), _array((2,), jnp.int32),
                                                           implementation="cudnn"),
        "fused_matmul": lambda: kernels.fused_matmul(m, w, implementation="cudnn"),
        "gated_mlp": lambda: kernels.gated_mlp(m, w, w, implementation="cudnn"),
        "linear_cross_entropy": lambda: kernels.linear_cross_entropy(m, w, ids, implementation="cudnn"),
        "grouped_matmul": lambda: kernels.grouped_matmul(m, _array((2, 32, 48)), _array((2,), jnp.int32),
                                                         implementation="cudnn"),
    }
    for name, call in others.items():
        with pytest.raises(ValueError, match=r"^implementation='cudnn'; expected None or one of \('xla', 'triton', "
                                             r"'mosaic_tpu'\); 'cudnn' is flash_attention's only"):
            jax.eval_shape(call)


def test_cudnn_under_context_parallelism_runs_ulysses_and_refuses_ring(cudnn_on_xla):
    """data 2 x context 2 x model 2: 4 heads (2 per model device, divisible by context) exchange tokens for heads
    (Ulysses) and equal the unsplit call, jax.nn seeing every token of one head; 2 heads would need ring attention,
    whose blockwise log-sum-exp cuDNN's API does not return: refused in one line."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import engine
    q, k, v, _, _ = _inputs((True, False, 4, 4, 32, 32, 64, jnp.bfloat16))
    attend = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="cudnn"))
    want = attend(q, k, v)
    mesh = engine.make_mesh(data=2, context=2, model=2)
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context", "model"))) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        got = attend(*placed)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
        assert cudnn_on_xla[-1]["q_shape"] == (1, 32, 1, 64)
        ids = _inputs((True, True, 4, 4, 32, 32, 64, jnp.bfloat16))[4]  # packed documents: the whole rows' ids
        packed = jax.jit(lambda q, k, v, ids: flash_attention(q, k, v, causal=True, segment_ids=ids,
                                                              implementation="cudnn"))
        got = packed(*placed, jax.device_put(ids, NamedSharding(mesh, P("data", "context"))))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(packed(q, k, v, ids), np.float32),
                                   rtol=1e-2, atol=1e-2)
        assert cudnn_on_xla[-1]["mask"].shape == (1, 1, 32, 32)
        with pytest.raises(ValueError, match=r"implementation='cudnn' with 2 heads / 2 kv heads over model=2 and "
                                             r"context=2; that needs ring attention"):
            jax.eval_shape(attend, *(x[:, :, :2] for x in (q, k, v)))
