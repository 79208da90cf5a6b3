"""What `paged_attention`'s three implementations share: the static plan, which keys the new token sees, which page
blocks hold them, the masked logits and the online-softmax step of one block, and the kernels' cost estimate.

Positions: sequence b's cache holds tokens 0 ... length - 1, token t in slot t % page_size of page
page_table[b, t // page_size]; the query is token length - 1 (its own key already written). A block is
`pages_per_block` consecutive entries of the page table, `block_keys` tokens.
"""
import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention.reference import NEG_INF, soft_cap


@dataclasses.dataclass(frozen=True)
class Plan:
    implementation: str
    scale: float
    logit_soft_cap: float | None
    window_left: int | None  # the query (token length - 1) sees tokens length - 1 - window_left ... length - 1
    page_size: int
    pages_per_block: int
    interpret: bool
    max_keys: int  # the page table's tokens (before its padding to whole blocks): no length exceeds it

    @property
    def block_keys(self):
        return self.page_size * self.pages_per_block


def visible(pos, length, plan):
    """Whether the keys at token positions `pos` are visible to the query of a sequence of `length` tokens."""
    mask = pos < length
    if plan.window_left is not None:
        mask = jnp.logical_and(mask, pos >= length - 1 - plan.window_left)
    return mask


def block_range(length, plan):
    """[first, stop) of the page blocks holding the visible keys (empty for length 0); `lax.div` truncates, which is
    floor division here (numerators >= 0)."""
    bk = plan.block_keys
    first = 0 if plan.window_left is None else lax.div(jnp.maximum(length - 1 - plan.window_left, 0), bk)
    return first, lax.div(length + bk - 1, bk)


def num_steps(max_pages, plan):
    """The most page blocks any sequence visits: every block of the table, or with a window of w + 1 keys the
    blocks those keys can straddle."""
    blocks = -(-max_pages // plan.pages_per_block)
    if plan.window_left is None:
        return blocks
    return min(blocks, -(-(plan.window_left + 1) // plan.block_keys) + 1)


def masked_logits(s, k_scale, pos, length, plan):
    """Logits of raw products s = q . k (float32, keys on the last axis): scaled (int8 keys: times their scales),
    soft-capped, NEG_INF where the key is not visible."""
    s = s * plan.scale
    s = s if k_scale is None else s * k_scale
    s, _ = soft_cap(s, plan.logit_soft_cap)
    return jnp.where(visible(pos, length, plan), s, NEG_INF)


def online_softmax(m, l, acc, tiles, weighted_sum):
    """One block of the online softmax: (m, l, acc) the running max, sum and output (keepdims shapes); tiles: the
    block's logit tiles (keys on the last axis), one running max over them all; weighted_sum(probs): the sum of
    each tile's probabilities times its values. A block whose keys are all masked for a row leaves it at NEG_INF;
    the next visible block's alpha = 0 wipes what it summed."""
    m_new = m
    for s in tiles:
        m_new = jnp.maximum(m_new, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    probs = [jnp.exp(s - m_new) for s in tiles]
    total = sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
    return m_new, alpha * l + total, alpha * acc + weighted_sum(probs)


def finish(m, l, acc, dtype):
    """The output rows acc / l, zeros for a row that saw no key (length 0)."""
    seen = m > NEG_INF / 2
    return jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0).astype(dtype)


def cost_estimate(heads, q_tiles, pool, plan, others=()):
    """The pl.CostEstimate of a paged-attention kernel: every sequence counted at the table's full length (or its
    window), since lengths are runtime values (an upper bound). heads: the real query heads; q_tiles: the kernel's
    query operand [B, KV, rows, D] (read, and an output like it written); pool: k_pages' [KV, num_pages,
    page_size, D] (each sequence's visited pages of k and v read once per kv head); others: the remaining
    operands (page table, lengths, int8 scales), once."""
    B, KV, _, D = q_tiles.shape
    keys = plan.max_keys
    if plan.window_left is not None:
        keys = min(keys, plan.window_left + 1)
    pairs = B * heads * keys
    nbytes = lambda a: math.prod(a.shape) * a.dtype.itemsize  # noqa: E731
    return pl.CostEstimate(
        flops=4 * D * pairs,
        transcendentals=(1 + (plan.logit_soft_cap is not None)) * pairs,
        bytes_accessed=2 * nbytes(q_tiles) + 2 * B * KV * keys * D * pool.dtype.itemsize
        + sum(nbytes(a) for a in others),
    )
