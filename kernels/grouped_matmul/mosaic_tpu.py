"""TPU kernels: Pallas on Mosaic (the backend interface is described in `reference.py`), megablox-style.

The wrapper lists the (row tile, group) visits in row order (`_groups.visits`) and prefetches them into SMEM; the
grid walks them sequentially, the contraction innermost with a float32 accumulator in VMEM scratch. The forward
(grid: column block, visit, contraction) stores only its group's rows of a visit's tile: the output tile stays in
VMEM while consecutive visits share it, so a straddling tile is assembled from its groups' visits; the rows past
the groups are one more segment, written as zeros. The weight gradient (grid: k block, n block, visit) carries one
group's accumulator across its visits, zeroing the other groups' rows of the lhs tile, and stores it at the
group's last visit; an empty group has one visit with nothing to add. Visits past the dynamic count skip their work.
Blocks are multiples of 128 (`kernels.matmul._blocks.fit`).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels._dispatch import mosaic_vmem_limit
from kernels.grouped_matmul import _cost, _groups
from kernels.matmul.mosaic_tpu import _interpret
from kernels.matmul.reference import dot


def _rows_of(offsets_ref, segment, tile, shape):
    """[shape] mask of the rows of a visit's row tile that belong to `segment`."""
    rows = tile * shape[0] + lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= offsets_ref[segment]) & (rows < offsets_ref[segment + 1])


def _gmm_kernel(offsets_ref, segment_ref, tile_ref, count_ref, x_ref, w_ref, o_ref, acc_ref, *, trans_rhs,
                num_groups):
    t, kb = pl.program_id(1), pl.program_id(2)
    s, live = segment_ref[t], t < count_ref[0]

    @pl.when(kb == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live & (s < num_groups))  # the padding segment's product is zero
    def _product():
        acc_ref[...] += dot(x_ref[...], w_ref[...], False, trans_rhs)

    @pl.when(live & (kb == pl.num_programs(2) - 1))
    def _store():
        inside = _rows_of(offsets_ref, s, tile_ref[t], o_ref.shape)
        o_ref[...] = jnp.where(inside, acc_ref[...], o_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def gmm(lhs, rhs, group_sizes, *, trans_rhs=False, blocks, interpret=False):
    g = rhs.shape[0]
    x, w, (m, n), (bm, bn, bk), (mp, np_, cp) = _groups.gmm_operands(lhs, rhs, trans_rhs=trans_rhs, blocks=blocks,
                                                                    implementation="mosaic_tpu")
    v = _groups.visits(_groups.with_padding_segment(_groups.group_offsets(group_sizes, m), mp), bm, mp // bm)

    def w_index(j, t, kb, offsets, segment, tile, count):
        s = jnp.minimum(segment[t], g - 1)  # the padding segment reads the last weight and multiplies nothing
        return (s, j, kb) if trans_rhs else (s, kb, j)

    out = pl.pallas_call(
        functools.partial(_gmm_kernel, trans_rhs=trans_rhs, num_groups=g),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(np_ // bn, v.segment.shape[0], cp // bk),
            in_specs=[pl.BlockSpec((bm, bk), lambda j, t, kb, offsets, segment, tile, count: (tile[t], kb)),
                      pl.BlockSpec((None, bn, bk) if trans_rhs else (None, bk, bn), w_index)],
            out_specs=pl.BlockSpec((bm, bn), lambda j, t, kb, offsets, segment, tile, count: (tile[t], j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY, pltpu.ARBITRARY),
            vmem_limit_bytes=mosaic_vmem_limit()),
        interpret=_interpret(interpret),
        name="grouped_matmul",
        cost_estimate=_cost.gmm(rows=mp, contraction=cp, cols=np_, num_visits=v.segment.shape[0], block_m=bm,
                                block_n=bn, in_dtype=lhs.dtype, out_dtype=lhs.dtype),
    )(*v, x, w)
    return out[:m, :n]


def _tgmm_kernel(offsets_ref, segment_ref, tile_ref, count_ref, x_ref, dy_ref, o_ref, acc_ref):
    t, last = pl.program_id(2), pl.num_programs(2) - 1
    s, count = segment_ref[t], count_ref[0]

    @pl.when((t == 0) | (s != segment_ref[jnp.maximum(t - 1, 0)]))  # the group's first visit
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(t < count)
    def _product():
        inside = _rows_of(offsets_ref, s, tile_ref[t], x_ref.shape)
        acc_ref[...] += dot(jnp.where(inside, x_ref[...], 0), dy_ref[...], True, False)

    @pl.when((t == count - 1) | ((t < count) & (s != segment_ref[jnp.minimum(t + 1, last)])))  # its last visit
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tgmm(lhs, rhs, group_sizes, *, out_dtype, blocks, interpret=False):
    m, g = lhs.shape[0], group_sizes.shape[0]
    x, dy, (k, n), (bm, bk, bn), (mp, kp, np_) = _groups.tgmm_operands(lhs, rhs, blocks=blocks,
                                                                      implementation="mosaic_tpu")
    v = _groups.visits(_groups.group_offsets(group_sizes, m), bm, mp // bm)
    out = pl.pallas_call(
        _tgmm_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(kp // bk, np_ // bn, v.segment.shape[0]),
            in_specs=[pl.BlockSpec((bm, bk), lambda i, j, t, offsets, segment, tile, count: (tile[t], i)),
                      pl.BlockSpec((bm, bn), lambda i, j, t, offsets, segment, tile, count: (tile[t], j))],
            out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, t, offsets, segment, tile, count: (segment[t], i, j)),
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((g, kp, np_), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY),
            vmem_limit_bytes=mosaic_vmem_limit()),
        interpret=_interpret(interpret),
        name="grouped_matmul_transposed",
        cost_estimate=_cost.tgmm(rows=mp, k=kp, n=np_, num_groups=g, num_visits=v.segment.shape[0], block_m=bm,
                                 block_k=bk, block_n=bn, in_dtype=lhs.dtype, out_dtype=out_dtype),
    )(*v, x, dy)
    return out[:, :k, :n]
