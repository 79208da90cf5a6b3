"""What each attention kernel costs, as the `pl.CostEstimate` its `pallas_call` declares (both backends), so that
XLA's scheduler and cost model see the kernels' work instead of an opaque custom call.

Shapes are the kernel's operands after padding: q [B, T, H, D], k and v [B, S, Hkv, D]; `kv_len` is the real key
count when k was padded (the padded keys are masked and their blocks never visited).

- flops: the matmuls over the (query, key) pairs a query sees (`visible_pairs`; causal: about half; a sliding
  window of w keys: about w per query), 2·D per pair
  and product: 2 products forward (q k^T, p v), 3 in the dq kernel (q k^T, do v^T, ds k), 4 in the dk/dv kernel
  (k q^T, v do^T, p^T do, ds^T q). The softmax's elementwise work (a few flops per pair) is left out; segment ids
  and dropout are not known statically, so a segmented input is counted as one sequence (an upper bound).
- transcendentals: one exp per visible pair (and one log per query forward).
- bytes_accessed: every operand and output once, plus what the kernels stream again: the kv tiles for every q block
  that sees them (forward, dq; per query head, as the grids run), the q / do tiles and their row statistics for
  every kv block that sees them (dk/dv); the small operands (`others`: segment ids, their block ranges, dropout
  keys, int8 scales) once.

`window` is `flash_attention`'s (None or (left, right)); the tiles seen are `_band`'s ranges, the kernels' own.
"""
import math

import numpy as np
from jax.experimental import pallas as pl

from kernels.attention import _band

_F32 = 4


def visible_pairs(T, S, causal, kv_len=None, window=None):
    """(query, key) pairs with the key visible to the query, per batch row and head: query i sees the keys j of the
    band i - left <= j <= i + right (causal: right = 0; top-left aligned) below the real length."""
    keys = kv_len or S
    left, right = _band.edges(causal, window)
    i = np.arange(T, dtype=np.int64)
    first = np.zeros_like(i) if left is None else np.maximum(i - left, 0)
    stop = np.full_like(i, keys) if right is None else np.minimum(i + right + 1, keys)
    return int(np.maximum(stop - first, 0).sum())


def _kv_rows_streamed(T, S, bq, bk, causal, kv_len, window):
    """Key rows the forward and dq kernels read per query head: each q block reads the kv blocks it sees."""
    return int(_band.tiles_seen(T // bq, bq, bk, -(-(kv_len or S) // bk), _band.edges(causal, window),
                                _band.kv_range).sum()) * bk


def band_of(plan):
    """The window and soft-cap arguments of the estimates below, from a kernel's plan."""
    return dict(window=plan.window, soft_cap=plan.logit_soft_cap is not None)


def _nbytes(arrays):
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)


def _q_rows_streamed(T, S, bq, bk, causal, window):
    """Query rows the dk/dv kernel reads per query head: each kv block reads the q blocks that see it."""
    return int(_band.tiles_seen(S // bk, bq, bk, T // bq, _band.edges(causal, window), _band.q_range).sum()) * bq


def _q_major(q_shape, k_shape, blocks, causal, kv_len, window):
    """(visible pairs, kv rows streamed, query rows) over every batch row and query head, for the kernels whose grid
    walks q blocks and streams the kv blocks each one sees (forward, dq)."""
    B, T, H, _ = q_shape
    S = k_shape[1]
    rows = B * H
    return (rows * visible_pairs(T, S, causal, kv_len, window),
            rows * _kv_rows_streamed(T, S, *blocks, causal, kv_len, window), rows * T)


def forward(q_shape, k_shape, q_itemsize, kv_itemsize, blocks, causal, kv_len=None, others=(), window=None,
            soft_cap=False):
    """The forward kernel's: reads q, streams k and v, writes out and lse; blocks: (block_q, block_k); others: the
    arrays passed besides q, k and v; soft_cap: one tanh per visible pair more."""
    D = q_shape[3]
    pairs, kv_rows, q_rows = _q_major(q_shape, k_shape, blocks, causal, kv_len, window)
    return pl.CostEstimate(
        flops=4 * D * pairs,
        transcendentals=(1 + soft_cap) * pairs + q_rows,
        bytes_accessed=q_rows * (2 * D * q_itemsize + _F32) + 2 * kv_rows * D * kv_itemsize + _nbytes(others),
    )


def backward_dq(q_shape, k_shape, itemsize, blocks, causal, kv_len=None, others=(), window=None, soft_cap=False):
    """The dq kernel's: reads q, do, lse and delta, streams k and v, writes dq; blocks: (block_q_bwd,
    block_k_bwd)."""
    D = q_shape[3]
    pairs, kv_rows, q_rows = _q_major(q_shape, k_shape, blocks, causal, kv_len, window)
    return pl.CostEstimate(
        flops=6 * D * pairs,
        transcendentals=(1 + soft_cap) * pairs,
        bytes_accessed=q_rows * (3 * D * itemsize + 2 * _F32) + 2 * kv_rows * D * itemsize + _nbytes(others),
    )


def backward_dkv(q_shape, k_shape, itemsize, blocks, causal, kv_len=None, others=(), window=None, soft_cap=False):
    """The dk/dv kernel's: reads k and v, streams q, do, lse and delta, writes dk and dv."""
    B, T, H, D = q_shape
    S = k_shape[1]
    pairs = B * H * visible_pairs(T, S, causal, kv_len, window)
    q_rows = B * H * _q_rows_streamed(T, S, *blocks, causal, window)
    return pl.CostEstimate(
        flops=8 * D * pairs,
        transcendentals=(1 + soft_cap) * pairs,
        bytes_accessed=4 * math.prod(k_shape) * itemsize + q_rows * (2 * D * itemsize + 2 * _F32) + _nbytes(others),
    )
