"""GPU kernels: Pallas on its Triton backend (the backend interface is described in `reference.py`).

Triton programs run concurrently, so no two may write one output tile (a megablox visit list would have the visits
of a straddling row tile race). Instead each program owns its output tile and loops over the groups it holds rows
of: the forward's [block_m, block_n] tile over the groups of its row tile (the ranges come from the wrapper), the
weight gradient's [block_k, block_n] tile of group g over g's row tiles. Rows of other groups are zeroed in the
lhs tile before each product, and an empty group runs no contraction step. Operands are zero-padded to whole
blocks.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.grouped_matmul import _cost, _groups
from kernels.matmul.reference import dot
from kernels.matmul.triton import _tile  # the L2-friendly order of output tiles, shared with the fused matmul


def _params(blocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _loop(lo, hi, body, acc):
    """fori_loop over [lo, hi) entered only when non-empty: a zero-trip path out of a loop of wgmmas makes ptxas
    serialize them (advisory C7515, kernels/README.md's Hopper compile tier)."""
    return lax.cond(lo < hi, lambda acc: lax.fori_loop(lo, hi, body, acc), lambda acc: acc, acc)


def _gmm_kernel(first_ref, stop_ref, offsets_ref, x_ref, w_ref, o_ref, *, trans_rhs, block_k, num_k, tile):
    i = tile(pl.program_id(0))[0]
    block_m, block_n = o_ref.shape
    rows = i * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)

    def group(g, acc):
        start, end = offsets_ref[g], offsets_ref[g + 1]
        inside = (rows >= start) & (rows < end)

        def step(kb, acc):
            ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
            w = w_ref[g, :, ks] if trans_rhs else w_ref[g, ks, :]
            return acc + dot(jnp.where(inside, x_ref[:, ks], 0), w, False, trans_rhs)

        return lax.cond(start < end, lambda acc: lax.fori_loop(0, num_k, step, acc), lambda acc: acc, acc)

    acc = _loop(first_ref[i], stop_ref[i], group, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gmm(lhs, rhs, group_sizes, *, trans_rhs=False, blocks, interpret=False):
    g = rhs.shape[0]
    x, w, (m, n), (bm, bn, bk), (mp, np_, cp) = _groups.gmm_operands(lhs, rhs, trans_rhs=trans_rhs, blocks=blocks,
                                                                    implementation="triton")
    offsets = _groups.group_offsets(group_sizes, m)
    tile_starts = jnp.arange(mp // bm, dtype=jnp.int32) * bm
    # The groups with rows in row tile i: those ending after its first row and starting before its end.
    first = jnp.searchsorted(offsets[1:], tile_starts, side="right").astype(jnp.int32)
    stop = jnp.searchsorted(offsets[:-1], tile_starts + bm, side="left").astype(jnp.int32)
    tile = functools.partial(_tile, num_m=mp // bm, num_n=np_ // bn)

    def spec(shape, index):  # index: (row block, column block) -> block index
        return pl.BlockSpec(shape, lambda pid: index(*tile(pid)))

    w_spec = (spec((g, bn, cp), lambda i, j: (0, j, 0)) if trans_rhs else spec((g, cp, bn), lambda i, j: (0, 0, j)))
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, trans_rhs=trans_rhs, block_k=bk, num_k=cp // bk, tile=tile),
        grid=((mp // bm) * (np_ // bn),),
        in_specs=[pl.BlockSpec(first.shape, lambda pid: (0,)), pl.BlockSpec(stop.shape, lambda pid: (0,)),
                  pl.BlockSpec(offsets.shape, lambda pid: (0,)), spec((bm, cp), lambda i, j: (i, 0)), w_spec],
        out_specs=spec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
        compiler_params=_params(blocks),
        interpret=interpret,
        name="grouped_matmul",
        cost_estimate=_cost.gmm(rows=mp, contraction=cp, cols=np_, num_visits=_groups.num_visits(mp // bm, g),
                                block_m=bm, block_n=bn, in_dtype=lhs.dtype, out_dtype=lhs.dtype),
    )(first, stop, offsets, x, w)
    return out[:m, :n]


def _tgmm_kernel(offsets_ref, x_ref, dy_ref, o_ref, *, block_m):
    g = pl.program_id(2)
    start, end = offsets_ref[g], offsets_ref[g + 1]

    def step(t, acc):
        ms = pl.ds(pl.multiple_of(t * block_m, block_m), block_m)
        rows = t * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        inside = (rows >= start) & (rows < end)
        return acc + dot(jnp.where(inside, x_ref[ms, :], 0), dy_ref[ms, :], True, False)

    first = start // block_m
    stop = jnp.where(end > start, (end - 1) // block_m + 1, first)  # an empty group: no step, a zero gradient
    acc = _loop(first, stop, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def tgmm(lhs, rhs, group_sizes, *, out_dtype, blocks, interpret=False):
    m, g = lhs.shape[0], group_sizes.shape[0]
    x, dy, (k, n), (bm, bk, bn), (mp, kp, np_) = _groups.tgmm_operands(lhs, rhs, blocks=blocks,
                                                                      implementation="triton")
    offsets = _groups.group_offsets(group_sizes, m)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=bm),
        grid=(kp // bk, np_ // bn, g),
        in_specs=[pl.BlockSpec(offsets.shape, lambda i, j, g: (0,)), pl.BlockSpec((mp, bk), lambda i, j, g: (0, i)),
                  pl.BlockSpec((mp, bn), lambda i, j, g: (0, j))],
        out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, g: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((g, kp, np_), out_dtype),
        compiler_params=_params(blocks),
        interpret=interpret,
        name="grouped_matmul_transposed",
        cost_estimate=_cost.tgmm(rows=mp, k=kp, n=np_, num_groups=g, num_visits=_groups.num_visits(mp // bm, g),
                                 block_m=bm, block_k=bk, block_n=bn, in_dtype=lhs.dtype, out_dtype=out_dtype),
    )(offsets, x, dy)
    return out[:, :k, :n]
