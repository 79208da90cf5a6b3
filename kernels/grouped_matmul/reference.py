"""Plain-JAX side of the grouped matmul: the `'xla'` backend and the materialising reference the tests compare with.

A backend is a module with two functions (see `triton.py`, `mosaic_tpu.py`), float32 accumulation in both:
- `gmm(lhs [M, C], rhs [G, C, N], group_sizes [G], *, trans_rhs, blocks, interpret) -> [M, N]` in lhs's dtype:
  row r of group g is `lhs[r] @ rhs[g]` (`rhs[g].T` when `trans_rhs`, rhs then [G, N, C]); the rows past the groups
  are zero.
- `tgmm(lhs [M, K], rhs [M, N], group_sizes [G], *, out_dtype, blocks, interpret) -> [G, K, N]`: per group
  `lhs[rows of g].T @ rhs[rows of g]`, zero for an empty group (the weight gradient).

The `'xla'` backend walks the same (row tile, group) visits as the Mosaic kernels (`_groups.visits`) in a
`lax.scan` of XLA dots: one [block_m, C] x [C, N] product per visit, so it does the grouped work (plus one tile per
group boundary) and holds nothing larger than the output, where `jax.lax.ragged_dot`'s CPU lowering multiplies a
[G, M, C] masked copy of lhs (G times the work and memory).
"""
import jax.numpy as jnp
from jax import lax

from kernels.grouped_matmul import _groups
from kernels.matmul.reference import dot


def _row_tiles(a, block_m):
    """a [M, C] zero-padded to whole tiles as [tiles, block_m, C], and block_m fitted to M."""
    block_m = min(block_m, _groups.round_up(a.shape[0], 8))
    padded = _groups.round_up(a.shape[0], block_m)
    return _groups.pad_to(a, (padded, a.shape[1])).reshape(padded // block_m, block_m, a.shape[1]), block_m


def _in_segment(offsets, segment, rows):
    return (rows >= offsets[segment]) & (rows < offsets[segment + 1])


def gmm(lhs, rhs, group_sizes, *, trans_rhs=False, blocks, interpret=False):
    del interpret
    m = lhs.shape[0]
    x, bm = _row_tiles(lhs, blocks.block_m)
    v = _groups.visits(_groups.group_offsets(group_sizes, m), bm, x.shape[0])
    rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

    def visit(out, t):
        s, i = v.segment[t], v.tile[t]
        keep = _in_segment(v.offsets, s, i * bm + rows) & (t < v.count[0])
        tile = jnp.where(keep, dot(x[i], rhs[s], False, trans_rhs).astype(out.dtype), out[i])
        return lax.dynamic_update_index_in_dim(out, tile, i, 0), None

    n = rhs.shape[1] if trans_rhs else rhs.shape[2]
    out, _ = lax.scan(visit, jnp.zeros((x.shape[0], bm, n), lhs.dtype), jnp.arange(v.segment.shape[0]))
    return out.reshape(-1, n)[:m]


def tgmm(lhs, rhs, group_sizes, *, out_dtype, blocks, interpret=False):
    del interpret
    m, k, n = lhs.shape[0], lhs.shape[1], rhs.shape[1]
    x, bm = _row_tiles(lhs, blocks.block_k)  # rows per step, as in the kernels' dw
    dy, _ = _row_tiles(rhs, bm)
    num_groups = group_sizes.shape[0]
    v = _groups.visits(_groups.group_offsets(group_sizes, m), bm, x.shape[0])
    rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    last_visit = v.segment.shape[0] - 1

    def visit(carry, t):
        acc, out = carry
        s, i = v.segment[t], v.tile[t]
        acc = jnp.where((t == 0) | (s != v.segment[jnp.maximum(t - 1, 0)]), 0.0, acc)  # a group's first visit
        keep = _in_segment(v.offsets, s, i * bm + rows) & (t < v.count[0])
        acc = acc + dot(jnp.where(keep, x[i], 0), dy[i], True, False)
        done = (t == v.count[0] - 1) | ((t < v.count[0]) & (s != v.segment[jnp.minimum(t + 1, last_visit)]))
        out = lax.cond(done, lambda o: lax.dynamic_update_index_in_dim(o, acc.astype(out_dtype), s, 0),
                       lambda o: o, out)
        return (acc, out), None

    init = (jnp.zeros((k, n), jnp.float32), jnp.zeros((num_groups, k, n), out_dtype))
    (_, out), _ = lax.scan(visit, init, jnp.arange(v.segment.shape[0]))
    return out


def grouped_matmul_reference(x, w, group_sizes):
    """The grouped product as G dense masked matmuls (G times the work: tests only); differentiable by autodiff."""
    rows = jnp.arange(x.shape[0])[:, None]
    offsets = _groups.group_offsets(group_sizes, x.shape[0])
    out = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for g in range(w.shape[0]):
        out = jnp.where(_in_segment(offsets, g, rows), dot(x, w[g]), out)
    return out.astype(x.dtype)
