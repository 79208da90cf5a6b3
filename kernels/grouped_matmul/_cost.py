"""The `pl.CostEstimate` each grouped-matmul kernel declares (both backends), on the padded operands.

flops: 2 · M · C · N, the grouped product's work: each row meets one weight. The extra product of a row tile that
straddles a group boundary (at most one tile per boundary) is not counted. bytes_accessed: as the grids stream
them, with the visits' static bound (`_groups.num_visits`): each visit reads its lhs row tile once per output
column block and its group's weight (all its column blocks) once; the output is written once.
"""
import jax.numpy as jnp
from jax.experimental import pallas as pl


def gmm(*, rows, contraction, cols, num_visits, block_m, block_n, in_dtype, out_dtype):
    """The grouped product [rows, contraction] x [G, contraction, cols]."""
    size = jnp.dtype(in_dtype).itemsize
    return pl.CostEstimate(
        flops=2 * rows * contraction * cols, transcendentals=0,
        bytes_accessed=(num_visits * block_m * contraction * size * (cols // block_n)
                        + num_visits * contraction * cols * size + rows * cols * jnp.dtype(out_dtype).itemsize))


def tgmm(*, rows, k, n, num_groups, num_visits, block_m, block_k, block_n, in_dtype, out_dtype):
    """The transposed product: per group lhs[rows of g].T [k, rows] x rhs[rows of g] [rows, n] -> [G, k, n]."""
    size = jnp.dtype(in_dtype).itemsize
    return pl.CostEstimate(
        flops=2 * rows * k * n, transcendentals=0,
        bytes_accessed=(num_visits * block_m * size * (k * (n // block_n) + n * (k // block_k))
                        + num_groups * k * n * jnp.dtype(out_dtype).itemsize))
