"""`grouped_matmul`: one weight matrix per group of rows (a mixture-of-experts layer's experts on its tokens sorted
by expert), with the input checks, the per-backend tiles and the custom_vjp over a backend's `gmm` / `tgmm` (the
interface in `reference.py`).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _partition
from kernels._dispatch import resolve_implementation
from kernels.grouped_matmul import mosaic_tpu, reference, triton
from kernels.matmul import _blocks
from kernels.matmul._blocks import BlockSizes
from kernels.matmul.api import _instantiate, _marked  # the family's custom_vjp helpers: skip a frozen weight's dw

__all__ = ["TRACE_NAME", "grouped_matmul"]

# The name of the `jit` equation a traced call shows (its operands x, w, group_sizes): `engine.auto_shard` reads the
# weights' group dim there (the experts of a mixture-of-experts layer, split over the `expert` axis).
TRACE_NAME = "grouped_matmul"

_BACKENDS = {"xla": reference, "triton": triton, "mosaic_tpu": mosaic_tpu}
_P = jax.sharding.PartitionSpec
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Starting points, not timings: the fused matmul's Triton tiles (kernels/matmul/_blocks.py); on TPU 256 rows, since
# every group boundary inside a row tile costs one more tile's product (kernels/README.md, grouped matmul), and
# Mixtral's experts compile at these tiles on v4-v6e within the default scoped VMEM; the 'xla' scan's 512-row steps
# (block_m; block_k in dw) keep its dots large.
DEFAULT_BLOCK_SIZES = {
    "triton": BlockSizes(128, 128, 64, num_warps=8, num_stages=3),
    "mosaic_tpu": BlockSizes(256, 1024, 512),
    "xla": BlockSizes(512, 128, 512),
}

# What `scripts/bench_kernels.py --tune=grouped` times, the default first: the Triton tiles of the fused matmul's
# search; on TPU fewer rows (less work re-done at group boundaries) against more (fewer re-reads of the weights).
TUNING_SPACE = {
    "triton": [BlockSizes(m, n, k, num_warps=w, num_stages=s) for m, n, k, w, s in (
        (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 3), (128, 256, 64, 8, 3), (128, 128, 32, 4, 4),
        (64, 256, 32, 4, 4))],
    "mosaic_tpu": [BlockSizes(m, n, k) for m, n, k in (
        (256, 1024, 512), (128, 1024, 512), (512, 1024, 512), (256, 512, 512), (256, 2048, 512), (512, 512, 1024))],
}


class _Config(NamedTuple):
    implementation: str
    blocks: BlockSizes
    interpret: bool

    @property
    def backend(self):
        return _BACKENDS[self.implementation]


def _check(x, w, group_sizes):
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"x.dtype={x.dtype}; expected one of float32, bfloat16, float16")
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"x.shape={tuple(x.shape)}; expected [m, k] with m, k > 0")
    if w.ndim != 3 or w.shape[1] != x.shape[1] or 0 in w.shape:
        raise ValueError(f"w.shape={tuple(w.shape)}; expected [groups, {x.shape[1]}, n] (k of x.shape[1])")
    if w.dtype != x.dtype:
        raise ValueError(f"w.dtype={w.dtype}; expected x.dtype={x.dtype}")
    if jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise ValueError(f"group_sizes.dtype={group_sizes.dtype}; expected int32")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes.shape={tuple(group_sizes.shape)}; expected ({w.shape[0]},), one per group "
                         f"of w")


def grouped_matmul(x, w, group_sizes, *, implementation=None, interpret=False, block_sizes=None):
    """Row r of group g is `x[r] @ w[g]`, float32 accumulation, output in x's dtype.

    x: [M, K], its rows sorted by group: group g is the `group_sizes[g]` rows after groups 0 ... g - 1; w: [G, K, N]
    in x's dtype, one weight per group; group_sizes: int32 [G], summing to at most M (the rows past the sum are
    padding and come out zero; a larger sum is cut at M). Returns [M, N].

    The backward is two grouped products: dx = dy @ w[g].T per group, and dw[g] = x[rows of g].T @ dy[rows of g]
    (zero for an empty group); group_sizes gets no gradient, and a frozen w (not differentiated: LoRA, a frozen
    base) no dw product. `block_sizes` (kernels.matmul.BlockSizes, replacing `DEFAULT_BLOCK_SIZES` whole): block_m
    rows, block_n output columns, block_k contraction per tile (dw, as the fused matmul's: [block_m, block_n] tiles of
    [K, N], block_k rows per step).

    On a mesh a Pallas implementation runs in a shard_map over the automatic axes (kernels/_partition.py): x's rows
    over the batch axes where they divide (each block's groups cut from the global sizes), w's columns over `model`;
    call it inside your own shard_map (expert parallelism) with each block's sizes.
    """
    _check(x, w, group_sizes)
    implementation = resolve_implementation(implementation, interpret=interpret)
    _blocks.validate(block_sizes, implementation)
    cfg = _Config(implementation, block_sizes or DEFAULT_BLOCK_SIZES[implementation], bool(interpret))
    axes = _partition.auto_axes(implementation)
    rows, cols = _partition.batch_axes(axes, x.shape[0]), _partition.model_axis(axes, w.shape[2])

    def grouped_matmul(x, w, group_sizes):  # named: the traced `jit` equation carries TRACE_NAME
        return _partition.shard(lambda x, w, sizes: _grouped(x, w, _local_sizes(sizes, x.shape[0], rows), cfg),
                                (x, w, group_sizes), (_P(rows, None), _P(None, None, cols), _P()), _P(rows, cols),
                                implementation)
    return jax.jit(grouped_matmul)(x, w, group_sizes)


def _local_sizes(group_sizes, num_rows, row_axes):
    """The group sizes within this block of `num_rows` rows of x split over `row_axes` (a contiguous slice of the
    sorted rows: a group may straddle blocks), or as given when the rows are whole."""
    if row_axes is None:
        return group_sizes
    start = lax.axis_index(row_axes) * num_rows
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    local = lambda row: jnp.clip(row - start, 0, num_rows)  # noqa: E731
    return (local(ends) - local(ends - jnp.maximum(group_sizes, 0))).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, cfg):
    return cfg.backend.gmm(x, w, group_sizes, blocks=cfg.blocks, interpret=cfg.interpret)


def _grouped_fwd(x, w, group_sizes, cfg):
    return _grouped(x, w, group_sizes, cfg), (x, w, group_sizes)


def _grouped_bwd(cfg, residuals_marks, dy):
    (x, w, group_sizes), (want_x, want_w, _) = residuals_marks
    dy, run = _instantiate(dy), dict(blocks=cfg.blocks, interpret=cfg.interpret)
    dx = cfg.backend.gmm(dy, w, group_sizes, trans_rhs=True, **run) if want_x is not None else None
    dw = cfg.backend.tgmm(x, dy, group_sizes, out_dtype=w.dtype, **run) if want_w is not None else None
    return dx, dw, None


_grouped.defvjp(_marked(_grouped_fwd, 3), _grouped_bwd, symbolic_zeros=True)
