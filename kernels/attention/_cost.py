"""What each attention kernel costs, as the `pl.CostEstimate` its `pallas_call` declares (both backends), so that
XLA's scheduler and cost model see the kernels' work instead of an opaque custom call.

Shapes are the kernel's operands after padding: q [B, T, H, D], k and v [B, S, Hkv, D]; `kv_len` is the real key
count when k was padded (the padded keys are masked and their blocks never visited).

- flops: the matmuls over the (query, key) pairs a query sees (`visible_pairs`; causal: about half), 2·D per pair
  and product: 2 products forward (q k^T, p v), 3 in the dq kernel (q k^T, do v^T, ds k), 4 in the dk/dv kernel
  (k q^T, v do^T, p^T do, ds^T q). The softmax's elementwise work (a few flops per pair) is left out; segment ids
  and dropout are not known statically, so a segmented input is counted as one sequence (an upper bound).
- transcendentals: one exp per visible pair (and one log per query forward).
- bytes_accessed: every operand and output once, plus what the kernels stream again: the kv tiles for every q block
  that sees them (forward, dq; per query head, as the grids run), the q / do tiles and their row statistics for
  every kv block that sees them (dk/dv); the small operands (`others`: segment ids, their block ranges, dropout
  keys, int8 scales) once.
"""
import math

from jax.experimental import pallas as pl

_F32 = 4


def visible_pairs(T, S, causal, kv_len=None):
    """(query, key) pairs with the key visible to the query, per batch row and head: T * keys, or under causal
    masking (query i sees keys <= i, top-left aligned) 1 + 2 + ... per query, at most `keys` each."""
    keys = kv_len or S
    if not causal:
        return T * keys
    full = min(T, keys)  # queries i < keys see i + 1 keys; the rest see all of them
    return full * (full + 1) // 2 + (T - full) * keys


def _kv_rows_streamed(T, S, bq, bk, causal, kv_len):
    """Key rows the forward and dq kernels read per query head: each q block reads the kv blocks it sees."""
    blocks = -(-(kv_len or S) // bk)
    if not causal:
        return (T // bq) * blocks * bk
    return sum(min(blocks, ((i + 1) * bq - 1) // bk + 1) * bk for i in range(T // bq))


def _nbytes(arrays):
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)


def _q_rows_streamed(T, S, bq, bk, causal):
    """Query rows the dk/dv kernel reads per query head: each kv block reads the q blocks that see it."""
    if not causal:
        return (S // bk) * T
    return sum(T - min(T // bq, j * bk // bq) * bq for j in range(S // bk))


def _q_major(q_shape, k_shape, blocks, causal, kv_len):
    """(visible pairs, kv rows streamed, query rows) over every batch row and query head, for the kernels whose grid
    walks q blocks and streams the kv blocks each one sees (forward, dq)."""
    B, T, H, _ = q_shape
    S = k_shape[1]
    rows = B * H
    return (rows * visible_pairs(T, S, causal, kv_len), rows * _kv_rows_streamed(T, S, *blocks, causal, kv_len),
            rows * T)


def forward(q_shape, k_shape, q_itemsize, kv_itemsize, blocks, causal, kv_len=None, others=()):
    """The forward kernel's: reads q, streams k and v, writes out and lse; blocks: (block_q, block_k); others: the
    arrays passed besides q, k and v."""
    D = q_shape[3]
    pairs, kv_rows, q_rows = _q_major(q_shape, k_shape, blocks, causal, kv_len)
    return pl.CostEstimate(
        flops=4 * D * pairs,
        transcendentals=pairs + q_rows,
        bytes_accessed=q_rows * (2 * D * q_itemsize + _F32) + 2 * kv_rows * D * kv_itemsize + _nbytes(others),
    )


def backward_dq(q_shape, k_shape, itemsize, blocks, causal, kv_len=None, others=()):
    """The dq kernel's: reads q, do, lse and delta, streams k and v, writes dq; blocks: (block_q_bwd,
    block_k_bwd)."""
    D = q_shape[3]
    pairs, kv_rows, q_rows = _q_major(q_shape, k_shape, blocks, causal, kv_len)
    return pl.CostEstimate(
        flops=6 * D * pairs,
        transcendentals=pairs,
        bytes_accessed=q_rows * (3 * D * itemsize + 2 * _F32) + 2 * kv_rows * D * itemsize + _nbytes(others),
    )


def backward_dkv(q_shape, k_shape, itemsize, blocks, causal, kv_len=None, others=()):
    """The dk/dv kernel's: reads k and v, streams q, do, lse and delta, writes dk and dv."""
    B, T, H, D = q_shape
    S = k_shape[1]
    pairs = B * H * visible_pairs(T, S, causal, kv_len)
    q_rows = B * H * _q_rows_streamed(T, S, *blocks, causal)
    return pl.CostEstimate(
        flops=8 * D * pairs,
        transcendentals=pairs,
        bytes_accessed=4 * math.prod(k_shape) * itemsize + q_rows * (2 * D * itemsize + 2 * _F32) + _nbytes(others),
    )
