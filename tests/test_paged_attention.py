"""kernels.paged_attention: every implementation against `decode_attention` on the equivalent contiguous cache.

The pages are a contiguous cache cut into pages and scattered over a larger pool in a random order (the other
pages hold noise), the page-table entries past each sequence's pages point anywhere, even outside the pool. The
Pallas kernels run in Pallas's interpreter ('triton' with interpret=True, 'mosaic_tpu' with the TPU interpreter).
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import decode_attention, paged_attention, quantize_kv
from tests.targets import for_gpu

# Max |error| relative to max |reference| (the reference: decode_attention's 'xla' path on the same rounded inputs).
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
VARIANTS = {
    "xla": dict(implementation="xla"),
    "triton": dict(implementation="triton", interpret=True),
    "mosaic_tpu": dict(implementation="mosaic_tpu", interpret=True),
}
B, H, KV, D, PAGE, MAX_PAGES = 5, 8, 2, 64, 16, 4
# Empty, mid-page, one whole page, mid-page of the last page, the whole table.
LENGTHS = (0, 37, 16, 55, 64)


def _paged_cache(lengths, dtype, *, seed=0, page=PAGE, max_pages=MAX_PAGES, nan_before=None):
    """(q [B, H, D], contiguous k and v [B, S, KV, D], k_pages and v_pages [KV, num_pages, page, D], page_table
    [B, max_pages]). Sequence b's pages are pages of its contiguous cache at random places of a pool with spare
    noise pages; nan_before=n: the table entries of the pages wholly before token length - n point to NaN pages
    instead (pages a kernel must not read)."""
    batch, S = len(lengths), page * max_pages
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(batch, S, KV, D)).astype(np.float32) for _ in range(2))
    num_pages = batch * max_pages + 3
    order = rng.permutation(num_pages)
    pools = [rng.normal(size=(KV, num_pages, page, D)).astype(np.float32) for _ in range(2)]
    table = np.zeros((batch, max_pages), np.int32)
    for b, length in enumerate(lengths):
        for i in range(max_pages):
            table[b, i] = order[b * max_pages + i]
            for pool, cache in zip(pools, (k, v)):
                pool[:, table[b, i]] = cache[b, i * page:(i + 1) * page].transpose(1, 0, 2)
            if nan_before is not None and (i + 1) * page <= length - nan_before:
                table[b, i] = num_pages - 1 - b % 3  # one of the spare pages, NaN below
            elif i * page >= length:
                table[b, i] = (10**6, -7, order[0])[i % 3]  # past the sequence: any value
    if nan_before is not None:
        for pool in pools:
            pool[:, -3:] = np.nan
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(pools[0]), cast(pools[1]), jnp.asarray(table)


def _decode(q, k, v, lengths, **kwargs):
    """decode_attention of the new tokens (position length - 1) to the contiguous cache's first `length` slots."""
    S = k.shape[1]
    lengths = jnp.asarray(lengths, jnp.int32)
    ids = (jnp.ones((len(lengths), 1), jnp.int32), (jnp.arange(S)[None] < lengths[:, None]).astype(jnp.int32))
    window = kwargs.get("window")
    out = decode_attention(q[:, None], k, v, segment_ids=ids, implementation="xla",
                           q_positions=None if window is None else (lengths - 1)[:, None], **kwargs)
    return out[:, 0]


def _error(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# (dtype, int8 pages, paged_attention options); the default run covers each once per implementation.
FEATURES = {
    "f32": (jnp.float32, False, {}),
    "int8": (jnp.float32, True, {}),
    "bf16-window-softcap": (jnp.bfloat16, False, dict(window=(20, 0), logit_soft_cap=5.0)),
}


# Mosaic's float32 case is slow: its interpreter is the slowest, and the window test below runs float pages there.
@pytest.mark.parametrize("variant, feature", [
    pytest.param(variant, feature, marks=[pytest.mark.slow] if (variant, feature) == ("mosaic_tpu", "f32") else [])
    for variant in VARIANTS for feature in FEATURES])
def test_equals_decode_attention_on_the_contiguous_cache(variant, feature):
    """GQA 8 / 2, ragged lengths (0, mid-page, page-aligned, the whole table), blocks of several pages (partly filled
    and skipped): equal to decode_attention over the contiguous cache, zeros for length 0."""
    dtype, int8, options = FEATURES[feature]
    q, k, v, k_pages, v_pages, table = _paged_cache(LENGTHS, dtype)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    scales = {}
    if int8:
        (k_pages, k_scale), (v_pages, v_scale) = quantize_kv(k_pages), quantize_kv(v_pages)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        # The contiguous cache dequantised the same way: quantize_kv is per (token, head), so it commutes with paging.
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        k, v = k8.astype(jnp.float32) * ks[..., None], v8.astype(jnp.float32) * vs[..., None]
    # Two pages per block on Triton (its tiles are powers of two), three elsewhere (the table padded to whole blocks).
    ppb = 2 if variant == "triton" else 3
    got = jax.jit(lambda *a: paged_attention(*a, pages_per_block=ppb, **scales, **options, **VARIANTS[variant]))(
        q, k_pages, v_pages, table, lengths)
    assert got.shape == q.shape and got.dtype == dtype
    want = _decode(q, k, v, LENGTHS, **options)
    assert _error(got, want) <= TOLERANCE[dtype], _error(got, want)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), 0.0)


@pytest.mark.parametrize("pool", ["float", "int8"])
def test_on_a_mesh_equals_the_reference(pool):
    """Under a data 2 x fsdp 2 x model 2 mesh (sequences over data x fsdp, kv heads and the pool's over model): the
    interpreted Triton kernel equals the unsharded 'xla' path, with float and int8 pages."""
    import engine
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    lengths = (0, 37, 64, 9)
    q, _, _, k_pages, v_pages, table = _paged_cache(lengths, jnp.float32, seed=2)
    scales = {}
    if pool == "int8":
        (k_pages, k_scale), (v_pages, v_scale) = quantize_kv(k_pages), quantize_kv(v_pages)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    args = (q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32))
    run = lambda impl: jax.jit(lambda *a, **s: paged_attention(*a, **s, **impl))  # noqa: E731
    want = run(VARIANTS["xla"])(*args, **scales)
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    placed = (put(q, ("data", "fsdp"), "model"), put(k_pages, "model"), put(v_pages, "model"),
              put(table, ("data", "fsdp")), put(args[4], ("data", "fsdp")))
    with jax.set_mesh(mesh):
        placed_scales = {n: put(s, "model") for n, s in scales.items()}
        got = run(VARIANTS["triton"])(*placed, **placed_scales)
        text = run(dict(implementation="mosaic_tpu")).trace(*placed, **placed_scales).lower(
            lowering_platforms=("tpu",)).as_text()
    assert _error(got, want) <= TOLERANCE[jnp.float32]
    np.testing.assert_array_equal(np.asarray(got[0]), 0.0)
    # The Mosaic kernel lowers for tpu on each device's block: 1 sequence, 1 kv head (its 4 query heads, 8 rows).
    assert text.count("@tpu_custom_call(") == 1 and "tensor<1x1x8x64xf32>" in text


@pytest.mark.parametrize("variant", ["triton", "mosaic_tpu"])
def test_kernels_read_only_the_pages_of_the_window(variant):
    """A window of 20 keys: the pages wholly before it are NaN (and whole blocks of one page), which the kernels
    never visit, so the output is that of the plain cache."""
    lengths = (0, 37, 64, 50, 17)
    q, k, v, k_pages, v_pages, table = _paged_cache(lengths, jnp.float32, seed=1, nan_before=20)
    options = dict(window=(19, 0), pages_per_block=1)
    got = paged_attention(q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32), **options,
                          **VARIANTS[variant])
    want = _decode(q, k, v, lengths, window=(19, 0))
    assert np.isfinite(np.asarray(got)).all()
    assert _error(got, want) <= TOLERANCE[jnp.float32]


def test_default_pages_per_block_and_bad_input():
    from kernels.attention.paged import _pages_per_block
    assert _pages_per_block(None, "triton", 16, 128) == 4 and _pages_per_block(None, "triton", 8, 1) == 2
    assert _pages_per_block(None, "mosaic_tpu", 16, 128) == 16 and _pages_per_block(None, "mosaic_tpu", 64, 5) == 5
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    i8 = jax.ShapeDtypeStruct((2, 10, 16, 64), jnp.int8)
    q, pages, table, lengths = f32(3, 8, 64), f32(2, 10, 16, 64), i32(3, 4), i32(3)
    cases = [
        ((f32(3, 1, 8, 64), pages, pages, table, lengths), {}, r"q of shape \(3, 1, 8, 64\)"),
        ((q, f32(3, 10, 16, 64), f32(3, 10, 16, 64), table, lengths), {}, "k_pages.shape=.*divisible by kv_heads"),
        ((q, pages, f32(2, 9, 16, 64), table, lengths), {}, "v_pages.shape=.*expected equal shapes"),
        ((q, pages, pages, f32(3, 4), lengths), {}, "page_table of shape .* expected int32"),
        ((q, pages, pages, table, i32(2)), {}, r"lengths of shape \(2,\)"),
        ((q, i8, i8, table, lengths), {}, r"k_scale=None; int8 pages need float scales"),
        ((q, i8, pages, table, lengths), {}, "expected both int8 or neither"),
        ((q, pages, pages, table, lengths), dict(k_scale=f32(2, 10, 16)), "k_scale / v_scale with"),
        ((q, pages, pages, table, lengths), dict(scale=-1.0), "scale=-1.0; expected None or a positive float"),
        ((q, pages, pages, table, lengths), dict(window=3), "window=3; expected None or a pair"),
        ((q, pages, pages, table, lengths), dict(logit_soft_cap=0), "logit_soft_cap=0"),
        ((q, pages, pages, table, lengths), dict(pages_per_block=0), "pages_per_block=0; expected None or a positive"),
        ((q, pages, pages, table, lengths), dict(pages_per_block=3, implementation="triton"),
         "pages_per_block=3 with page_size=16; implementation='triton' expected .* a power of two"),
        ((q, pages, pages, table, lengths), dict(implementation="cuda"), "implementation='cuda'"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *a: paged_attention(*a, **kwargs), *args)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("implementation, platform, custom_call",
                         [("triton", "cuda", "__gpu$xla.gpu.triton"), ("mosaic_tpu", "tpu", "tpu_custom_call")])
def test_lowers_for_the_accelerator(implementation, platform, custom_call, page):
    """A decoding step of 64 sequences of up to 2048 tokens, 32 query heads over 8 kv heads, head_dim 128, bf16 or
    int8 pages: one kernel, reading the pool in its own dtype (no bf16 copy of int8 pages)."""
    batch, heads, kv_heads, dim, tokens = 64, 32, 8, 128, 2048
    max_pages = tokens // page
    num_pages = batch * max_pages
    q = jax.ShapeDtypeStruct((batch, heads, dim), jnp.bfloat16)
    table, lengths = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((batch, max_pages), (batch,)))
    scale = jax.ShapeDtypeStruct((kv_heads, num_pages, page), jnp.float32)
    for dtype, scales in (("bf16", {}), ("i8", dict(k_scale=scale, v_scale=scale))):
        pool = jax.ShapeDtypeStruct((kv_heads, num_pages, page, dim), jnp.int8 if scales else jnp.bfloat16)
        with for_gpu() if platform == "cuda" else contextlib.nullcontext():
            text = jax.jit(lambda q, k, v, t, n, s: paged_attention(q, k, v, t, n, **s, window=(1023, 0),
                                                                    logit_soft_cap=50.0,
                                                                    implementation=implementation)).trace(
                q, pool, pool, table, lengths, scales).lower(lowering_platforms=(platform,)).as_text()
        assert text.count(f"@{custom_call}(") == 1 and "paged_attention" in text, dtype
        pooled = (f"{kv_heads}x{num_pages * page}x{dim}x{dtype}" if platform == "cuda"
                  else f"{kv_heads}x{num_pages}x{page}x{dim}x{dtype}")
        assert pooled in text, dtype
        assert not scales or pooled.replace("i8", "bf16") not in text
