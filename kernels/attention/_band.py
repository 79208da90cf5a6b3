"""Which tiles the position masks leave visible: causal masking and a sliding window keep query i to keys j in the
band i - left <= j <= i + right (top-left aligned positions), so a query tile sees a contiguous range of kv tiles
and a kv tile a contiguous range of query tiles. The kernels loop over (or map their grids onto) exactly those
ranges, so a window of w keys over T queries costs O(T * w) instead of O(T * kv_len); the cost estimates count the
same ranges, the same functions run on numpy arrays of tile indices.

Every numerator below is non-negative, so `lax.div` (which truncates) is the floor division the bounds need.
"""
import jax.numpy as jnp
import numpy as np
from jax import lax


def edges(causal, window):
    """(left, right) of the band, None for an unbounded side; causal bounds the right side at 0."""
    left, right = (None, None) if window is None else window
    return left, (0 if causal else right)


def _ops(index):
    """(maximum, minimum, floor division) for a tile index: numpy's for ints and numpy arrays, jax's when traced."""
    if isinstance(index, (int, np.integer, np.ndarray)):
        return np.maximum, np.minimum, np.floor_divide
    return jnp.maximum, jnp.minimum, lax.div


def kv_range(i, block_q, block_k, num_kv_blocks, band):
    """[first, stop) of the kv tiles that query tile i sees (first >= stop: none)."""
    left, right = band
    maximum, minimum, div = _ops(i)
    first = 0 if left is None else div(maximum(i * block_q - left, 0), block_k)
    stop = num_kv_blocks if right is None else minimum(div((i + 1) * block_q - 1 + right, block_k) + 1, num_kv_blocks)
    return first, stop


def q_range(j, block_q, block_k, num_q_blocks, band):
    """[first, stop) of the query tiles that see kv tile j (first >= stop: none): key j sees query i in the mirrored
    band j - right <= i <= j + left."""
    return kv_range(j, block_k, block_q, num_q_blocks, band[::-1])


def inner_range(i, block_q, block_k, band):
    """(first, stop) of the kv tiles wholly inside query tile i's band, which need no position mask; either None
    where the band is unbounded on that side. Mirrored (`band[::-1]`, the block sizes swapped): the query tiles
    wholly inside kv tile i's band."""
    left, right = band
    maximum, _, div = _ops(i)
    # The tile's first key within `left` of the tile's last query, its last key within `right` after its first.
    first = None if left is None else div(maximum((i + 1) * block_q - 1 - left, 0) + block_k - 1, block_k)
    stop = None if right is None else div(i * block_q + right + 1, block_k)
    return first, stop


def tiles_seen(num_blocks, block_q, block_k, num_other_blocks, band, ranges):
    """int64 [num_blocks]: how many tiles each of `num_blocks` tiles sees through `ranges` (`kv_range` or
    `q_range`)."""
    first, stop = ranges(np.arange(num_blocks), block_q, block_k, num_other_blocks, band)
    return np.broadcast_to(np.maximum(np.asarray(stop) - first, 0), (num_blocks,)).astype(np.int64)
