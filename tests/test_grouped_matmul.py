"""Grouped matmul: every implementation (the Pallas ones in interpret mode) against the materialising reference,
value and both gradients, over ragged groups (empty first, middle and last groups, tiles straddling group
boundaries, padding rows past the groups); the (row tile, group) visits the kernels walk; a frozen weight; the op on a
mesh; input validation; lowering for GPU and TPU at Mixtral-8x7B's sizes."""
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import grouped_matmul
from kernels.grouped_matmul import _groups
from kernels.grouped_matmul.reference import grouped_matmul_reference
from kernels.matmul import BlockSizes
from tests.targets import for_gpu

S = jax.ShapeDtypeStruct

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}  # relative to the largest magnitude of the float32 result

# Small blocks so the small shapes span several row tiles, K and N not block multiples (zero-padded); Mosaic needs
# multiples of 128 (its TPU interpreter is the slowest, so its case has one column and one contraction block).
IMPLEMENTATIONS = {
    "xla": dict(blocks=BlockSizes(16, 16, 16), interpret=False, shape=(50, 40, 56)),
    "triton": dict(blocks=BlockSizes(16, 16, 16, num_warps=1, num_stages=1), interpret=True, shape=(50, 40, 56)),
    "mosaic_tpu": dict(blocks=BlockSizes(128, 128, 128), interpret=True, shape=(300, 128, 128)),
}
# Group sizes per case, as fractions of M: "ragged" holds an empty first, middle and last group, groups straddling
# row tiles and padding rows past the groups (the default case); the others run with -m slow.
GROUPS = {
    "ragged": (0.0, 0.26, 0.0, 0.4, 0.1, 0.0),
    "no_padding": (0.3, 0.0, 0.7),
    "one_group": (0.0, 1.0, 0.0),
    "all_empty": (0.0, 0.0),
}


def _group_sizes(m, fractions):
    sizes = [int(f * m) for f in fractions]
    if sum(fractions) == 1.0:  # exactly M rows, whatever the rounding
        sizes[int(np.argmax(fractions))] += m - sum(sizes)
    return jnp.asarray(sizes, jnp.int32)


CASES = [pytest.param(impl, dtype, groups, id=f"{impl}-{jnp.dtype(dtype).name}-{groups}",
                      marks=[] if (dtype, groups) == (jnp.float32, "ragged") else [pytest.mark.slow])
         for impl in IMPLEMENTATIONS for dtype in TOLERANCE for groups in GROUPS]


def _assert_close(actual, expected, dtype, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape, what
    error = np.max(np.abs(actual - expected), initial=0.0) / max(np.max(np.abs(expected), initial=0.0), 1e-6)
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def _value_and_vjp(fn):
    return jax.jit(lambda cot, *a: (lambda out, vjp: (out, vjp(cot)))(*jax.vjp(fn, *a)))


@pytest.mark.parametrize("impl, dtype, groups", CASES)
def test_grouped_matmul_matches_reference(impl, dtype, groups):
    config = IMPLEMENTATIONS[impl]
    m, k, n = config["shape"]
    sizes = _group_sizes(m, GROUPS[groups])
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32) * k ** -0.5).astype(dtype)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
    fn = lambda x, w: grouped_matmul(x, w, sizes, implementation=impl, interpret=config["interpret"],
                                     block_sizes=config["blocks"])
    out, (dx, dw) = _value_and_vjp(fn)(dy, x, w)
    ref = lambda x, w: grouped_matmul_reference(x, w, sizes)
    out_ref, (dx_ref, dw_ref) = _value_and_vjp(ref)(dy.astype(jnp.float32), x.astype(jnp.float32),
                                                    w.astype(jnp.float32))
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    for what, got, want in (("value", out, out_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        _assert_close(got, want, dtype, f"grouped_matmul[{impl}] {what}")
    used = int(jnp.sum(sizes))
    assert not np.any(np.asarray(out[used:])) and not np.any(np.asarray(dx[used:])), "padding rows are not zero"
    for g in np.flatnonzero(np.asarray(sizes) == 0):
        assert not np.any(np.asarray(dw[g])), f"empty group {g} has a nonzero weight gradient"


def test_reference_is_jax_ragged_dot():
    """The materialising reference the kernels are checked against agrees with jax.lax.ragged_dot, value and
    gradients (an independent definition of the same product)."""
    sizes = _group_sizes(40, GROUPS["ragged"])
    x, w = jax.random.normal(jax.random.key(1), (40, 24)), jax.random.normal(jax.random.key(2), (6, 24, 16))
    ref_value, ref_grads = jax.value_and_grad(lambda x, w: (grouped_matmul_reference(x, w, sizes) ** 2).sum(),
                                              (0, 1))(x, w)
    rd_value, rd_grads = jax.value_and_grad(lambda x, w: (jax.lax.ragged_dot(x, w, sizes) ** 2).sum(), (0, 1))(x, w)
    np.testing.assert_allclose(ref_value, rd_value, rtol=1e-5)
    for a, b in zip(ref_grads, rd_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_visits_cover_each_tile_of_each_group_once(seed):
    """Every (row tile, segment) pair with rows in common is visited exactly once, in row order, an empty segment
    once, within the static bound; the visits past the count repeat the last one."""
    rng = np.random.RandomState(seed)
    block_m, num_tiles = 8, 7
    sizes = rng.choice([0, 0, 1, 3, 8, 13], size=6)
    offsets = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), block_m * num_tiles)
    v = jax.jit(_groups.visits, static_argnums=(1, 2))(jnp.asarray(offsets, jnp.int32), block_m, num_tiles)
    count, segment, tile = int(v.count[0]), np.asarray(v.segment), np.asarray(v.tile)
    assert len(segment) == _groups.num_visits(num_tiles, len(sizes)) >= count
    expected = []
    for s, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        tiles = range(start // block_m, (end - 1) // block_m + 1) if end > start else [min(start // block_m,
                                                                                             num_tiles - 1)]
        expected += [(s, t) for t in tiles]
    assert list(zip(segment[:count], tile[:count])) == expected
    assert set(zip(segment[count:], tile[count:])) <= {expected[-1]}


def test_a_frozen_weight_gets_no_gradient_product():
    """Differentiated with respect to x alone (a frozen expert weight under LoRA), the backward runs dx only."""
    x, w, sizes = jnp.ones((40, 16)), jnp.ones((3, 16, 8)), jnp.array([10, 0, 25], jnp.int32)
    fn = lambda x, w: grouped_matmul(x, w, sizes, implementation="triton", interpret=True,
                                     block_sizes=IMPLEMENTATIONS["triton"]["blocks"]).sum()
    names = lambda f: [name for name in str(jax.make_jaxpr(f)(x, w)).split() if name.startswith("name=")]
    assert names(jax.grad(fn, (0, 1))).count("name=grouped_matmul_transposed") == 1
    assert names(jax.grad(fn)).count("name=grouped_matmul_transposed") == 0
    np.testing.assert_allclose(jax.grad(fn)(x, w), jax.grad(fn, (0, 1))(x, w)[0])


X, W, SIZES = jnp.zeros((8, 4)), jnp.zeros((2, 4, 3)), jnp.array([3, 5], jnp.int32)
BAD_INPUTS = [
    (lambda: grouped_matmul(X[0], W, SIZES), "x.shape=(4,); expected [m, k]"),
    (lambda: grouped_matmul(X.astype(jnp.int32), W, SIZES), "x.dtype=int32"),
    (lambda: grouped_matmul(X, W[0], SIZES), "w.shape=(4, 3); expected [groups, 4, n]"),
    (lambda: grouped_matmul(X, jnp.zeros((2, 5, 3)), SIZES), "w.shape=(2, 5, 3); expected [groups, 4, n]"),
    (lambda: grouped_matmul(X, W.astype(jnp.bfloat16), SIZES), "w.dtype=bfloat16; expected x.dtype=float32"),
    (lambda: grouped_matmul(X, W, SIZES.astype(jnp.float32)), "group_sizes.dtype=float32; expected int32"),
    (lambda: grouped_matmul(X, W, jnp.array([8], jnp.int32)), "group_sizes.shape=(1,); expected (2,)"),
    (lambda: grouped_matmul(X, W, SIZES, implementation="cuda"), "implementation='cuda'"),
    (lambda: grouped_matmul(X, W, SIZES, implementation="mosaic_tpu", block_sizes=BlockSizes(block_m=64)),
     "block_sizes.block_m=64; the Mosaic TPU backend needs a multiple of 128"),
]


@pytest.mark.parametrize("call, message", BAD_INPUTS, ids=[m.split(";")[0] for _, m in BAD_INPUTS])
def test_bad_input_raises_before_tracing(call, message):
    pytest.raises(ValueError, call).match(re.escape(message))


def _on_mesh_case():
    """x's 64 rows over data 2 x fsdp 2 (16 per block: groups straddle blocks, one block is all padding), w's 32
    columns over model 2."""
    import engine  # noqa: PLC0415

    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    keys = jax.random.split(jax.random.key(3), 2)
    x, w = jax.random.normal(keys[0], (64, 16)), jax.random.normal(keys[1], (3, 16, 32))
    sizes = jnp.array([5, 0, 30], jnp.int32)
    put = lambda a, *spec: jax.device_put(a, jax.NamedSharding(mesh, jax.P(*spec)))  # noqa: E731
    return mesh, (x, w, sizes), (put(x, ("data", "fsdp")), put(w, None, None, "model"), put(sizes))


def test_pallas_kernel_on_a_mesh_equals_the_reference():
    mesh, args, sharded = _on_mesh_case()
    blocks = IMPLEMENTATIONS["triton"]["blocks"]
    loss = lambda impl, **kw: lambda x, w, s: jnp.sum(grouped_matmul(x, w, s, implementation=impl, **kw) ** 2)
    want = jax.value_and_grad(loss("xla", block_sizes=blocks), (0, 1))(*args)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss("triton", interpret=True, block_sizes=blocks), (0, 1)))(*sharded)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_lowering_for_tpu_on_an_engine_mesh_runs_local_blocks():
    """Mosaic refuses a custom call in a region with an automatic axis: the op's shard_map makes them manual, and
    each kernel gets its block: 256 of the 1024 rows, 256 of the 512 columns (dw: 256 rows of x and dy)."""
    mesh = _on_mesh_case()[0]
    sharded = lambda shape, dtype, *spec: S(shape, dtype, sharding=jax.NamedSharding(mesh, jax.P(*spec)))  # noqa
    args = (sharded((1024, 256), jnp.float32, ("data", "fsdp")), sharded((3, 256, 512), jnp.float32, None, None,
                                                                          "model"), sharded((3,), jnp.int32))
    loss = lambda x, w, s: jnp.sum(grouped_matmul(x, w, s, implementation="mosaic_tpu"))  # noqa: E731
    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    operands = re.findall(r"custom_call @tpu_custom_call\(.*?\).*?: \((.*?)\) ->", text)
    assert len(operands) == 3, operands
    assert all("tensor<256x256xf32>" in t and "1024x" not in t and "x512x" not in t for t in operands), operands


# Mixtral-8x7B's experts: 8192 tokens routed top-2 (16384 rows), model dim 4096, expert MLP 14336, 8 experts.
MIXTRAL = (S((16384, 4096), jnp.bfloat16), S((8, 4096, 14336), jnp.bfloat16), S((8,), jnp.int32))
PLATFORMS = {"cuda": ("triton", "__gpu$xla.gpu.triton"), "tpu": ("mosaic_tpu", "tpu_custom_call")}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_forward_and_backward_lower_for_accelerators_at_mixtral_size(platform):
    """The forward, dx and dw kernels lower to three custom calls at Mixtral-8x7B's expert sizes (no compile),
    and no [G, M, K] masked copy of x is made (what ragged_dot's fallback lowering does)."""
    impl, custom_call = PLATFORMS[platform]

    def loss_and_grads(x, w, sizes):
        fn = lambda x, w: grouped_matmul(x, w, sizes, implementation=impl).astype(jnp.float32).sum()
        return jax.value_and_grad(fn, (0, 1))(x, w)

    with for_gpu() if platform == "cuda" else contextlib.nullcontext():
        text = jax.jit(loss_and_grads).trace(*MIXTRAL).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(f"custom_call @{custom_call}(") == 3
    assert "8x16384x4096" not in text
