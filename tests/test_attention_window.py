"""Sliding-window attention and logit soft-capping (`window=`, `logit_soft_cap=` of `kernels.flash_attention` and
`kernels.decode_attention`): every implementation against a plain float32 attention that builds the whole mask,
forward and gradients; the kernels skip the tiles outside the window; bad values are refused in one line.

The Pallas kernels run in Pallas's interpreter on CPU, with small tiles so that each window spans several of them
and leaves whole tiles outside (the tiles a kernel must skip).
"""
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine
from kernels.attention import (BlockSizes, _band, _cost, decode_attention, dropout_keys, flash_attention,
                               mha_reference)
from tests.targets import for_gpu
from tests.test_cost_estimates import _pallas_calls

# (flash_attention kwargs, length multiplier): Mosaic's tiles are at least 128 wide, so its cases are 8x longer
# (windows too). Its interpreter is the slowest: the default run keeps `MOSAIC_DEFAULT`'s cases, the rest are slow.
VARIANTS = {
    "xla": (dict(implementation="xla", block_sizes=BlockSizes(block_k=16)), 1),
    "triton": (dict(implementation="triton", interpret=True, block_sizes=BlockSizes(16, 16, 16, 32)), 1),
    "mosaic_tpu": (dict(implementation="mosaic_tpu", interpret=True, block_sizes=BlockSizes(128, 128, 128, 256)), 8),
}
# Relative max error, float32 inputs: (forward, gradients).
TOLERANCE = (2e-5, 5e-5)

# (causal, window, soft cap, segments, heads, kv_heads, q_len, kv_len). Window alone (two-sided, and reaching past
# the keys on one side), causal + window (Mistral's), soft cap alone (Gemma 2's 50.0 would leave these logits
# unchanged; 2.0 bends them), both; GQA, segment ids, lengths that are not tile multiples, cross attention.
CASES = [
    (False, (5, 9), None, False, 4, 2, 40, 40),
    (True, (12, 0), None, True, 4, 1, 50, 50),
    (False, None, 2.0, True, 2, 2, 33, 47),
    (True, (20, 0), 1.5, True, 4, 2, 45, 45),
    (False, (0, 30), 3.0, False, 2, 1, 24, 56),
]
MOSAIC_DEFAULT = (3, 4)


def _case_id(case):
    causal, window, cap, segments, h, hkv, t, s = case
    band = "nowindow" if window is None else f"w{window[0]}_{window[1]}"
    return f"{'causal' if causal else 'full'}-{band}-cap{cap}-{'seg' if segments else 'noseg'}-h{h}kv{hkv}-t{t}s{s}"


def _scaled(case, m):
    causal, window, cap, segments, h, hkv, t, s = case
    return causal, None if window is None else (window[0] * m, window[1] * m), cap, segments, h, hkv, t * m, s * m


def _inputs(case, batch=2, head_dim=32, seed=0):
    """q, k, v, a cotangent and segment ids (None or a pair), built in numpy."""
    causal, window, cap, segments, h, hkv, t, s = case
    rng = np.random.default_rng(seed)
    # Logits of a few units, so that a soft cap of 1.5-3 changes them and the window changes the softmax.
    q = jnp.asarray(2 * rng.standard_normal((batch, t, h, head_dim), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((batch, s, hkv, head_dim), np.float32)) for _ in range(2))
    ct = jnp.asarray(rng.standard_normal((batch, t, h, head_dim), np.float32))
    ids = None
    if segments:  # packed: boundaries at different fractions per row
        cuts = np.array([[0.3, 0.7], [0.5, 0.8]])[:batch]
        ids = tuple(jnp.asarray((np.arange(n)[None, :, None] >= cuts[:, None, :] * n).sum(-1), jnp.int32)
                    for n in (t, s))
    return q, k, v, ct, ids


def _dense_mask(T, S, causal, window, ids, q_pos=None):
    """bool [B or 1, T, S]: the whole mask, from the definitions (query positions `q_pos` [B, T] or 0 ... T - 1)."""
    i = np.arange(T)[None, :, None] if q_pos is None else np.asarray(q_pos)[:, :, None]
    j = np.arange(S)[None, None, :]
    mask = np.ones(np.broadcast_shapes(i.shape, j.shape), bool)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= (i - window[0] <= j) & (j <= i + window[1])
    if ids is not None:
        mask = mask & (np.asarray(ids[0])[:, :, None] == np.asarray(ids[1])[:, None, :])
    return mask


def _dense_attention(q, k, v, mask, cap):
    """float32 softmax(cap * tanh(q k^T / sqrt(D) / cap) masked) v over the whole [T, S] matrix; rows that see no
    key are 0."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    mask = jnp.asarray(mask)[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    top = jnp.max(jnp.where(mask, s, 0.0), axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - top), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _relative_error(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-6))


def _out_and_grads(f, q, k, v, ct):
    return jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * ct), (0, 1, 2))(q, k, v)))(
        q, k, v)


def _params():
    for variant in VARIANTS:
        for index, case in enumerate(CASES):
            slow = variant == "mosaic_tpu" and index not in MOSAIC_DEFAULT
            yield pytest.param(variant, case, id=f"{variant}-{_case_id(case)}",
                               marks=[pytest.mark.slow] if slow else [])


def _slow_on_mosaic(variants):
    return [pytest.param(v, marks=pytest.mark.slow) if v == "mosaic_tpu" else v for v in variants]


@pytest.mark.parametrize("variant, case", _params())
def test_matches_the_dense_masked_attention(variant, case):
    kwargs, multiplier = VARIANTS[variant]
    case = _scaled(case, multiplier)
    causal, window, cap = case[:3]
    q, k, v, ct, ids = _inputs(case)
    mask = _dense_mask(q.shape[1], k.shape[1], causal, window, ids)
    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=ids, window=window,  # noqa: E731
                                           logit_soft_cap=cap, **kwargs)
    out, grads = _out_and_grads(ours, q, k, v, ct)
    ref, ref_grads = _out_and_grads(lambda q, k, v: _dense_attention(q, k, v, mask, cap), q, k, v, ct)
    assert _relative_error(out, ref) < TOLERANCE[0]
    for name, g, ref_g in zip("qkv", grads, ref_grads):
        assert _relative_error(g, ref_g) < TOLERANCE[1], name
    plain = _out_and_grads(lambda q, k, v: _dense_attention(q, k, v, _dense_mask(*mask.shape[1:], causal, None, ids),
                                                            None), q, k, v, ct)[0]
    assert _relative_error(out, plain) > 0.05  # the window and the cap change the result


def test_causal_window_is_the_sliding_window_of_transformers():
    """causal + window=(W - 1, 0): each query sees itself and the W - 1 keys before it, Hugging Face's
    `q_idx - kv_idx < sliding_window` (Mistral, Gemma 2 / 3)."""
    W, T = 4, 10
    mask = _dense_mask(T, T, True, (W - 1, 0), None)[0]
    q_idx, kv_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    np.testing.assert_array_equal(mask, (kv_idx <= q_idx) & (q_idx - kv_idx < W))
    from kernels.attention.reference import attention_mask
    np.testing.assert_array_equal(attention_mask(q_idx, kv_idx, None, None, causal=True, kv_len=None,
                                                 window=(W - 1, 0)), mask)


def _cache(B, S, KVH, D, fills):
    """A float cache and its ids: row b holds tokens in slots fills[b] = (start, stop), id 1; elsewhere id 0."""
    rng = np.random.default_rng(7)
    k, v = (jnp.asarray(rng.standard_normal((B, S, KVH, D), np.float32)) for _ in range(2))
    ids = np.zeros((B, S), np.int32)
    for b, (start, stop) in enumerate(fills):
        ids[b, start:stop] = 1
    return k, v, jnp.asarray(ids)


@pytest.mark.parametrize("variant", _slow_on_mosaic(VARIANTS))
def test_decode_attention_with_a_window_and_a_soft_cap(variant):
    """A decoding step's queries at their cache slots see the slots p - left ... p + right of their own id: equal
    to the dense attention over the cache with that mask (left padding, one and two new tokens, GQA, splits)."""
    kwargs, multiplier = VARIANTS[variant]
    S, window = 64 * multiplier, (9 * multiplier, 0)
    k, v, kv_ids = _cache(2, S, 2, 32, [(5, S // 2 + 3), (0, S - 4)])
    for T, splits in ((1, 2), (2, 4)):
        q = jnp.asarray(np.random.default_rng(T).standard_normal((2, T, 8, 32), np.float32) * 2)
        positions = np.array([[S // 2 + 3 - T], [S - 4 - T]]) + np.arange(T)  # the last filled slots
        q_ids = jnp.ones((2, T), jnp.int32)
        mask = _dense_mask(T, S, False, window, (q_ids, kv_ids), q_pos=positions)
        want = _dense_attention(q, k, v, mask, 2.0)
        got = jax.jit(lambda q, k, v: decode_attention(q, k, v, segment_ids=(q_ids, kv_ids), window=window,
                                                       logit_soft_cap=2.0, q_positions=jnp.asarray(positions),
                                                       num_splits=splits, **kwargs))(q, k, v)
        assert _relative_error(got, want) < TOLERANCE[0], T
        unbanded = _dense_attention(q, k, v, _dense_mask(T, S, False, None, (q_ids, kv_ids)), 2.0)
        assert _relative_error(got, unbanded) > 0.05


def test_the_cost_estimates_count_the_band():
    """`_cost.visible_pairs` equals the dense mask's count; the kv rows the forward streams and the q rows the dk/dv
    kernel streams are the band's tiles only: O(len * window), not O(len * kv_len)."""
    for T, S, causal, window in ((40, 40, False, (5, 9)), (50, 50, True, (12, 0)), (24, 56, False, (0, 30)),
                                 (33, 20, True, None), (30, 30, False, None)):
        assert _cost.visible_pairs(T, S, causal, window=window) == _dense_mask(T, S, causal, window, None).sum()
    T = 8192
    full = _cost.forward((1, T, 1, 128), (1, T, 1, 128), 2, 2, (128, 128), True)
    banded = _cost.forward((1, T, 1, 128), (1, T, 1, 128), 2, 2, (128, 128), True, window=(255, 0))
    assert banded.flops == 4 * 128 * (256 * T - 255 * 256 // 2)
    # Each query tile reads the 3 kv tiles its 256 keys straddle (the first two tiles fewer).
    assert _cost._kv_rows_streamed(T, T, 128, 128, True, None, (255, 0)) == (3 * (T // 128) - 3) * 128
    assert _cost._q_rows_streamed(T, T, 128, 128, True, (255, 0)) == (3 * (T // 128) - 3) * 128
    assert banded.bytes_accessed < full.bytes_accessed / 5  # q, out and lse are read and written once either way
    # The tile ranges against the dense mask: a tile pair is in range exactly when some pair in it is visible, and
    # needs no position mask exactly when every pair in it is.
    def inner(index, first, stop):
        return (first is None or index >= first) & (stop is None or index < stop)

    for causal, window, bq, bk in ((True, (37, 0), 16, 32), (False, (5, 50), 32, 16), (False, None, 16, 16),
                                   (True, None, 32, 16)):
        band = _band.edges(causal, window)
        tiles = _dense_mask(128, 128, causal, window, None)[0].reshape(128 // bq, bq, 128 // bk, bk)
        visible, whole = tiles.any((1, 3)), tiles.all((1, 3))
        kv_tiles, q_tiles = np.arange(128 // bk), np.arange(128 // bq)
        for i in q_tiles:
            np.testing.assert_array_equal(kv_tiles[visible[i]], np.arange(*_band.kv_range(i, bq, bk, 128 // bk, band)))
            np.testing.assert_array_equal(whole[i], inner(kv_tiles, *_band.inner_range(i, bq, bk, band)))
        for j in kv_tiles:
            np.testing.assert_array_equal(q_tiles[visible[:, j]], np.arange(*_band.q_range(j, bq, bk, 128 // bq, band)))
            np.testing.assert_array_equal(whole[:, j], inner(q_tiles, *_band.inner_range(j, bk, bq, band[::-1])))


def _array(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=3), r"window=3; expected None or a pair \(left, right\) of ints >= 0"),
    (dict(window=(1,)), r"window=\(1,\); expected None or a pair"),
    (dict(window=(-1, 0)), r"window=\(-1, 0\)"),
    (dict(window=(2.0, 0)), r"window=\(2\.0, 0\)"),
    (dict(window=(True, 0)), r"window=\(True, 0\)"),
    (dict(logit_soft_cap=0.0), r"logit_soft_cap=0\.0; expected None or a positive float"),
    (dict(logit_soft_cap=-30.0), r"logit_soft_cap=-30\.0"),
    (dict(logit_soft_cap=True), r"logit_soft_cap=True"),
    (dict(logit_soft_cap="50"), r"logit_soft_cap='50'"),
])
def test_bad_window_or_soft_cap_is_refused_in_one_line(kwargs, match):
    x = _array((2, 8, 4, 16))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: flash_attention(*a, **kwargs), x, x, x)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: decode_attention(*a, q_positions=jnp.zeros((2, 8), jnp.int32), **kwargs), x, x, x)


def test_decode_attention_needs_the_query_slots_with_a_window():
    q, kv = _array((2, 1, 4, 16)), _array((2, 12, 2, 16))
    with pytest.raises(ValueError, match=r"q_positions=None with window=\(3, 0\); expected q_positions"):
        jax.eval_shape(lambda *a: decode_attention(*a, window=(3, 0)), q, kv, kv)
    with pytest.raises(ValueError, match="q_positions=given with window=None"):
        jax.eval_shape(lambda *a: decode_attention(*a, q_positions=3), q, kv, kv)
    with pytest.raises(ValueError, match=r"q_positions of shape \(3,\) and dtype int32; expected ints broadcastable "
                                         r"to \[batch, len\] = \(2, 1\)"):
        jax.eval_shape(lambda *a: decode_attention(*a, window=(3, 0), q_positions=jnp.zeros(3, jnp.int32)), q, kv, kv)
    with pytest.raises(ValueError, match="q_positions of shape"):
        jax.eval_shape(lambda *a: decode_attention(*a, window=(3, 0), q_positions=jnp.zeros((2, 1))), q, kv, kv)


def _ring_case(T=64, heads=4, kv_heads=2):
    rng = np.random.default_rng(3)
    return tuple(jnp.asarray(rng.standard_normal((2, T, h, 16), np.float32)) for h in (heads, kv_heads, kv_heads))


def test_context_parallel_attention_with_window_and_soft_cap():
    """Ulysses (heads divide by context) runs the unsplit attention on whole sequences: window and soft cap as
    without the split. Ring attention (they do not) takes the soft cap per block and refuses a window in one line."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    def grads(mesh_shape, heads, window):
        q, k, v = _ring_case(heads=heads)
        f = lambda q, k, v: flash_attention(q, k, v, causal=True, window=window, logit_soft_cap=2.0,  # noqa: E731
                                            implementation="xla")
        loss = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
        mesh = engine.make_mesh(**mesh_shape)
        with jax.set_mesh(mesh):
            placed = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
            got = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(*placed)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
        for g, w in zip(got[1], want[1]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)

    grads(dict(data=2, context=4), 4, (9, 0))  # Ulysses: 4 heads over context 4
    grads(dict(data=1, context=8), 4, None)  # ring: 4 heads, context 8
    with pytest.raises(ValueError, match=r"window=\(9, 0\) on a mesh with context=8 .*\(ring attention\); expected "
                                         "window=None"):
        grads(dict(data=1, context=8), 4, (9, 0))


# The Pallas variants with tiles of 16 (Triton) or 128 (Mosaic) rows in every pass, for the skipping test.
SKIP_TILES = {"triton": BlockSizes(16, 16, 16, 16), "mosaic_tpu": BlockSizes(128, 128, 128, 128)}


@pytest.mark.parametrize("variant, causal, window", [
    ("triton", True, (15, 0)), ("triton", False, (15, 15)), ("mosaic_tpu", True, (15, 0)),
    pytest.param("mosaic_tpu", False, (15, 15), marks=pytest.mark.slow)])
def test_tiles_outside_the_window_are_skipped_not_just_masked(variant, causal, window):
    """8 tiles of 16 positions (Mosaic: of 128, everything 8x) and a window of 15 (+ 15) positions: query tile i sees
    kv tiles i - 1 ... i (+ 1), kv tile j is seen by query tiles j ... j + 1 (causal). Tiles 0-1 of k and v (and
    6-7 of q, or of k and v when the window reaches right) hold NaN. A kernel that loaded and masked those tiles
    would spread NaN through 0 * NaN (and NaN statistics); skipping them, the outputs and gradients of the query
    tiles 3-5 (3-4) and of the kv tiles 3-4 (causal) equal the attention over clean inputs, though the first
    queries among them are masked against keys in a tile they do see (the tiles at the window's edge)."""
    kwargs, m = dict(VARIANTS[variant][0], block_sizes=SKIP_TILES[variant]), VARIANTS[variant][1]
    window = (window[0] * m + m - 1, window[1] * m + (m - 1 if window[1] else 0))
    case = (causal, window, None, False, 2, 1, 128 * m, 128 * m)
    q, k, v, ct, _ = _inputs(case, batch=1)
    tile = 16 * m
    nan = lambda x, tiles: jnp.asarray(np.where(  # noqa: E731
        np.isin(np.arange(x.shape[1]) // tile, tiles)[None, :, None, None], np.nan, np.asarray(x)))
    bad_q, bad_kv = ([6, 7], [0, 1]) if causal else ([], [0, 1, 6, 7])
    f = lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, **kwargs)  # noqa: E731
    out, (dq, dk, dv) = _out_and_grads(f, nan(q, bad_q), nan(k, bad_kv), nan(v, bad_kv), ct)
    mask = _dense_mask(q.shape[1], k.shape[1], causal, window, None)
    ref, (ref_dq, ref_dk, ref_dv) = _out_and_grads(lambda q, k, v: _dense_attention(q, k, v, mask, None), q, k, v, ct)
    rows = slice(3 * tile, (6 if causal else 5) * tile)
    assert np.isnan(np.asarray(out)).any()  # the NaN tiles are real
    for got, want in ((out, ref), (dq, ref_dq)):
        assert _relative_error(got[:, rows], want[:, rows]) < TOLERANCE[1]
    if causal:
        for got, want in ((dk, ref_dk), (dv, ref_dv)):
            assert _relative_error(got[:, 3 * tile:5 * tile], want[:, 3 * tile:5 * tile]) < TOLERANCE[1]


LOWERINGS = [("triton", "cuda", "__gpu$xla.gpu.triton"), ("mosaic_tpu", "tpu", "tpu_custom_call")]


@pytest.mark.parametrize("implementation, platform, custom_call", LOWERINGS)
def test_lowers_for_the_accelerator(implementation, platform, custom_call):
    """Gemma 2's local layers at a training shape (batch 2, len 4096, 16 heads over 8 kv heads, head_dim 128, bf16,
    packed, causal window of 1024 keys, soft cap 50, with and without dropout): forward and backward lower to
    exactly the three Pallas kernels, with no device. Each declares the band's cost: W keys per query, less the
    first window's triangle."""
    B, T, H, Hkv, D, W = 2, 4096, 16, 8, 128, 1024
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, ids, key):
        out = flash_attention(q, k, v, causal=True, segment_ids=ids, window=(W - 1, 0), logit_soft_cap=50.0,
                              implementation=implementation, dropout_rate=0.1 if key is not None else 0.0,
                              dropout_rng=key)
        return out.astype(jnp.float32).sum()

    for key in (None, jax.random.key(0)):
        with for_gpu() if platform == "cuda" else contextlib.nullcontext():
            text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, kv, ids, key).lower(
                lowering_platforms=(platform,)).as_text()
        assert text.count(f"@{custom_call}(") == 3
        for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
            assert kernel in text
    pairs = B * H * (W * T - W * (W - 1) // 2)
    flops = {name: cost.flops for name, cost, *_ in _pallas_calls(jax.grad(loss, (0, 1, 2)), q, kv, kv, ids, None)}
    assert flops == {"flash_attention_fwd": 4 * D * pairs, "flash_attention_dq": 6 * D * pairs,
                     "flash_attention_dkv": 8 * D * pairs}



def test_mosaic_grids_walk_only_the_band():
    """The Mosaic kernels' reduction axes span the most tiles of the band any tile sees, not every tile: at 4096
    tokens in 512-key tiles (dq: 256-query ones) a causal window of 1024 keys takes 3 kv steps per query tile
    where causal attention takes 8, and the dk/dv kernel 6 query steps of 16."""
    q = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16)
    blocks = BlockSizes(512, 512, 256, 512)

    def grids(window):
        f = lambda q, k, v: flash_attention(q, k, v, causal=True, window=window, block_sizes=blocks,  # noqa: E731
                                            implementation="mosaic_tpu").astype(jnp.float32).sum()
        text = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, q, q))
        return re.findall(r"grid=\(([\d, ]*)\)", text)

    assert grids(None) == ["1, 2, 8, 8", "1, 2, 16, 8", "1, 2, 8, 1, 16"]
    assert grids((1023, 0)) == ["1, 2, 8, 3", "1, 2, 16, 3", "1, 2, 8, 1, 6"]


@pytest.mark.parametrize("variant", _slow_on_mosaic(VARIANTS))
def test_dropout_with_a_window_and_a_soft_cap_matches_autodiff_of_the_oracle(variant):
    """Dropout's hashed mask at the band's absolute positions (the 'xla' path's query chunks included): output and
    gradients equal jax.grad of `mha_reference` with the same window, cap and mask (packed, GQA, unaligned)."""
    kwargs, m = VARIANTS[variant]
    case = _scaled((True, (12, 0), 2.0, True, 4, 2, 45, 45), m)
    causal, window, cap = case[:3]
    q, k, v, ct, ids = _inputs(case)
    rate, key = 0.3, jax.random.key(5)
    keys = dropout_keys(key, q.shape[0], q.shape[2])
    common = dict(causal=causal, segment_ids=ids, window=window, logit_soft_cap=cap, dropout_rate=rate)
    out, grads = _out_and_grads(lambda *a: flash_attention(*a, dropout_rng=key, **common, **kwargs), q, k, v, ct)
    ref, ref_grads = _out_and_grads(lambda *a: mha_reference(*a, dropout_keys=keys, **common), q, k, v, ct)
    assert _relative_error(out, ref) < TOLERANCE[0]
    for name, g, ref_g in zip("qkv", grads, ref_grads):
        assert _relative_error(g, ref_g) < TOLERANCE[1], name


def test_xla_path_runs_over_the_band_only():
    """The 'xla' path cuts the queries into chunks spanning the window and scans each over the kv blocks it sees:
    at 8192 tokens in 512-key blocks a causal window of 512 keys scans 2 blocks (forward and backward) where causal
    attention scans 16, each step's logits the same size (16 chunks of 512 queries against 512 keys, or 8192
    queries against 512 keys), so an eighth of the work."""
    x = jax.ShapeDtypeStruct((1, 8192, 2, 64), jnp.float32)

    def scans(window):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, window=window,  # noqa: E731
                                                       implementation="xla"))
        text = str(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(x, x, x))
        return re.findall(r"length=(\d+)", text), set(re.findall(r"f32\[(\d+,2,1,\d+),512\]", text))

    assert scans(None) == (["16", "16"], {"1,2,1,8192"})
    assert scans((511, 0)) == (["2", "2"], {"16,2,1,512"})
