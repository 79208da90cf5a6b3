"""What every backend of the grouped matmul derives from `group_sizes` before its kernel runs: the row offsets of the
groups, and (for the kernels that walk a grid of row tiles, Mosaic and 'xla') the list of (row tile, group) visits
in row order, megablox-style.

A row tile that straddles a group boundary is visited once per group it holds rows of, and each visit keeps only
its group's rows (the kernels mask them), so the visits number at most `tiles + segments - 1` for any sizes: that
static bound is the grid, and the visits past the dynamic count repeat the last one (the kernels skip them). An empty
group still gets one visit, so the transposed product writes its zero gradient.
"""
from typing import NamedTuple

import jax.numpy as jnp

from kernels.matmul import _blocks


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def group_offsets(group_sizes, num_rows):
    """int32 [G + 1]: group g is rows [offsets[g], offsets[g + 1]) (sizes clipped at 0, the ends at num_rows)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), num_rows).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


class Visits(NamedTuple):
    """The (row tile, segment) pairs a kernel's grid walks, in row order (scalar-prefetched on TPU)."""
    offsets: jnp.ndarray  # int32 [S + 1]: segment s is rows [offsets[s], offsets[s + 1])
    segment: jnp.ndarray  # int32 [V]: the segment of each visit
    tile: jnp.ndarray  # int32 [V]: its row tile
    count: jnp.ndarray  # int32 [1]: the visits in use; the rest repeat the last one


def num_visits(num_tiles, num_segments):
    """The static length of `visits`' lists: an upper bound on the visits of any sizes."""
    return num_tiles + num_segments - 1


def visits(offsets, block_m, num_tiles):
    """The visits of the segments `offsets` [S + 1] delimits over `num_tiles` row tiles of `block_m` rows: each
    non-empty segment the tiles holding its rows, an empty one the tile at its start."""
    starts, ends = offsets[:-1], offsets[1:]
    first = jnp.minimum(starts // block_m, num_tiles - 1)
    last = jnp.where(ends > starts, (ends - 1) // block_m, first)
    counts = last - first + 1
    length = num_visits(num_tiles, starts.shape[0])
    segment = jnp.repeat(jnp.arange(starts.shape[0], dtype=jnp.int32), counts, total_repeat_length=length)
    begin = jnp.cumsum(counts) - counts
    tile = jnp.minimum(first[segment] + jnp.arange(length, dtype=jnp.int32) - begin[segment], last[segment])
    return Visits(offsets, segment, tile.astype(jnp.int32), jnp.sum(counts, keepdims=True).astype(jnp.int32))


def with_padding_segment(offsets, padded_rows):
    """`offsets` [G + 1] with one more segment, the rows past the last group up to `padded_rows`: the forward
    visits it to write its zeros."""
    return jnp.concatenate([offsets, jnp.full((1,), padded_rows, jnp.int32)])


def pad_to(a, shape):
    """`a` zero-padded at the end of each dim to `shape` (no copy when it already has it)."""
    if a.shape == tuple(shape):
        return a
    return jnp.pad(a, [(0, s - d) for s, d in zip(shape, a.shape)])


def _fit(block, dim, implementation):
    block = _blocks.fit(block, dim, implementation)
    return block, round_up(dim, block)


def gmm_operands(lhs, rhs, *, trans_rhs, blocks, implementation):
    """The forward's (and dx's) operands zero-padded to whole blocks: lhs [M, C], rhs [G, C, N] ([G, N, C] when
    trans_rhs). Returns (lhs, rhs, (m, n), (block_m, block_n, block_k), (padded m, n, c))."""
    (m, c), g = lhs.shape, rhs.shape[0]
    n = rhs.shape[1] if trans_rhs else rhs.shape[2]
    (bm, mp), (bn, np_), (bk, cp) = (_fit(b, dim, implementation) for b, dim in
                                     ((blocks.block_m, m), (blocks.block_n, n), (blocks.block_k, c)))
    rhs = pad_to(rhs, (g, np_, cp) if trans_rhs else (g, cp, np_))
    return pad_to(lhs, (mp, cp)), rhs, (m, n), (bm, bn, bk), (mp, np_, cp)


def tgmm_operands(lhs, rhs, *, blocks, implementation):
    """The weight gradient's operands lhs [M, K] and rhs [M, N] zero-padded to whole blocks, its tiles as the fused
    matmul's dw: [block_m, block_n] output tiles over (K, N), block_k rows of M per step. Returns (lhs, rhs, (k, n),
    (rows per step, k tile, n tile), (padded m, k, n))."""
    (m, k), n = lhs.shape, rhs.shape[1]
    (bm, mp), (bk, kp), (bn, np_) = (_fit(b, dim, implementation) for b, dim in
                                     ((blocks.block_k, m), (blocks.block_m, k), (blocks.block_n, n)))
    return pad_to(lhs, (mp, kp)), pad_to(rhs, (mp, np_)), (k, n), (bm, bk, bn), (mp, kp, np_)
