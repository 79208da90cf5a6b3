"""Plain-JAX attention: the test oracle `mha_reference` and the memory-efficient `'xla'` implementation.

`mha_reference` materialises the [len, kv_len] logits and is only meant for tests and tiny shapes. The `'xla'`
implementation (`forward` / `backward`, glued by `kernels.attention.api`) is FlashAttention written with `lax.scan`
over kv blocks: the forward keeps a running max and sum (online softmax) and saves only the output and the
log-sum-exp; the backward recomputes each block's probabilities from the lse. Peak memory is one
[batch, heads, len, block_k] block instead of the full matrix, which is what lets the models train on CPU. Under a
sliding window the queries are cut into chunks, each scanning only the kv blocks it sees (`_Chunks`).

Dropout on the attention probabilities draws no random numbers: whether (query i, key j) of head h in batch row b is
kept is a hash of (seed, b, h, i, j) (`dropout_keys`, `dropout_multiplier`), so every implementation, forward and
backward, regenerates the same mask tile by tile, and it does not depend on tiles or on how a mesh splits the batch
and the heads.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.attention import _band

# Logit of a masked entry: finite so that `s - max` never computes inf - inf. A row whose running max is still
# NEG_INF has seen no visible key; the kernels test `m > NEG_INF / 2` to find fully-masked rows (output 0, lse +inf).
NEG_INF = -0.7 * float(np.finfo(np.float32).max)


def attention_mask(q_pos, k_pos, q_ids, kv_ids, *, causal, kv_len, window=None):
    """Which (query, key) pairs may attend, or None when all may. Shared by every implementation.

    Operands broadcast against each other, so the caller picks the orientation ([q, k] or [k, q]) and rank.
    Causal is top-left aligned like `jax.nn.dot_product_attention`: query i sees keys j <= i. `window` (or None),
    a pair (left, right), keeps i - left <= j <= i + right, in the same positions. `kv_len` (or None) masks keys
    past the real length when kv was padded to a block multiple.
    """
    terms = []
    if causal:
        terms.append(q_pos >= k_pos)
    if window is not None:
        terms += [k_pos >= q_pos - window[0], k_pos <= q_pos + window[1]]
    if kv_len is not None:
        terms.append(k_pos < kv_len)
    if q_ids is not None:
        terms.append(q_ids == kv_ids)
    if not terms:
        return None
    mask = terms[0]
    for term in terms[1:]:
        mask = jnp.logical_and(mask, term)
    return mask


def soft_cap(s, cap):
    """(cap * tanh(s / cap), its derivative 1 - tanh^2 in s) of logits s (Gemma 2's attention logit soft-capping:
    logits bounded to (-cap, cap), nearly unchanged well inside), or (s, None) when cap is None. The backward
    passes multiply the logits' gradient by the derivative, recomputed from s like the probabilities."""
    if cap is None:
        return s, None
    t = jnp.tanh(s * (1.0 / cap))
    return cap * t, 1.0 - t * t


def _int32(value):
    return np.asarray(value, np.uint32).view(np.int32)[()]


_FMIX_1, _FMIX_2, _GOLDEN = _int32(0x85EBCA6B), _int32(0xC2B2AE35), _int32(0x9E3779B9)
_DROPOUT_BITS = 24  # a keep test compares the hash's top 24 bits with the rate


def _fmix(x):
    """MurmurHash3's 32-bit finaliser on int32 (wrapping multiplies, logical shifts): a bijection in which every
    input bit flips each output bit with probability ~1/2. Plain integer ops, so XLA, Triton and Mosaic all run it."""
    x = x ^ lax.shift_right_logical(x, np.int32(16))
    x = x * _FMIX_1
    x = x ^ lax.shift_right_logical(x, np.int32(13))
    x = x * _FMIX_2
    return x ^ lax.shift_right_logical(x, np.int32(16))


def _mix(key, value):
    return _fmix(key ^ (value * _GOLDEN))


def dropout_keys(rng, batch, heads):
    """int32 [batch, heads] per-(row, head) keys from one 32-bit seed drawn from the PRNG key `rng`; a kernel working
    on a slice of the batch or the heads takes the same slice of these keys, so its mask is that of the whole."""
    seed = lax.bitcast_convert_type(jax.random.bits(rng, (), jnp.uint32), jnp.int32)
    b = lax.broadcasted_iota(jnp.int32, (batch, heads), 0)
    h = lax.broadcasted_iota(jnp.int32, (batch, heads), 1)
    return _mix(_mix(_fmix(seed), b), h)


def dropout_multiplier(key, q_pos, k_pos, rate):
    """float32 1 / (1 - rate) where (query q_pos, key k_pos) is kept, else 0; operands broadcast like
    `attention_mask`'s, `key` is a `dropout_keys` entry (broadcastable too)."""
    bits = _mix(_mix(key, q_pos), k_pos)
    threshold = np.int32(round(rate * (1 << _DROPOUT_BITS)))
    keep = lax.shift_right_logical(bits, np.int32(32 - _DROPOUT_BITS)) >= threshold
    return jnp.where(keep, np.float32(1.0 / (1.0 - rate)), np.float32(0.0))


def mha_reference(q, k, v, *, causal=False, segment_ids=None, sm_scale=None, dropout_rate=0.0, dropout_keys=None,
                  window=None, logit_soft_cap=None):
    """Straightforward attention, q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, D]; materialises [B, H, T, S].

    Same semantics as `kernels.flash_attention` (no input validation): `segment_ids` is [B, T] (self-attention) or a
    pair ([B, T], [B, S]); `window` a pair (left, right); a query row with no visible key yields zeros. With
    `dropout_rate` > 0, `dropout_keys` ([B, H] from `dropout_keys`) choose the dropped probabilities.
    """
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    q_ids, kv_ids = _split_segment_ids(segment_ids)
    qg = q.reshape(B, T, Hkv, H // Hkv, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s, _ = soft_cap(s, logit_soft_cap)
    mask = attention_mask(
        jnp.arange(T)[:, None],
        jnp.arange(S)[None, :],
        None if q_ids is None else q_ids[:, None, None, :, None],
        None if kv_ids is None else kv_ids[:, None, None, None, :],
        causal=causal,
        kv_len=None,
        window=window,
    )
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    l = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    if dropout_rate:
        keys = dropout_keys.reshape(B, Hkv, H // Hkv, 1, 1)
        p = p * dropout_multiplier(keys, jnp.arange(T)[:, None], jnp.arange(S)[None, :], dropout_rate)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, D).astype(q.dtype)


def _split_segment_ids(segment_ids):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        return segment_ids[0], segment_ids[1]
    return segment_ids, segment_ids


def _kv_blocks(x, block_k):
    """[B, S, ...] -> [S // block_k, B, block_k, ...], the scan's leading axis."""
    B, S = x.shape[:2]
    return jnp.swapaxes(x.reshape(B, S // block_k, block_k, *x.shape[2:]), 0, 1)


def _positions(T, j, block_k, starts):
    """(query positions, key positions of kv block j), shaped [T, 1] and [1, bk], or with `starts` (the first query's
    and key's position per row, [B] each) [B, 1, 1, T, 1] and [B, 1, 1, 1, bk]."""
    q_pos, k_pos = jnp.arange(T)[:, None], j * block_k + jnp.arange(block_k)[None, :]
    if starts is None:
        return q_pos, k_pos
    return tuple(start[:, None, None, None, None] + pos for start, pos in zip(starts, (q_pos, k_pos)))


def _block_logits(qg, k_blk, ids_blk, j, q_ids, plan, k_scale=None, starts=None):
    """(scaled logits [B, Hkv, G, T, bk] of one kv block (times the keys' int8 scales), soft-capped, masked entries
    NEG_INF; the soft cap's derivative or None)."""
    T, bk = qg.shape[1], k_blk.shape[1]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk, preferred_element_type=jnp.float32) * plan.sm_scale
    s = s if k_scale is None else s * k_scale
    s, d_cap = soft_cap(s, plan.logit_soft_cap)
    mask = attention_mask(
        *_positions(T, j, bk, starts),
        None if q_ids is None else q_ids[:, None, None, :, None],
        None if ids_blk is None else ids_blk[:, None, None, None, :],
        causal=plan.causal,
        kv_len=plan.kv_len,
        window=plan.window,
    )
    return (s if mask is None else jnp.where(mask, s, NEG_INF)), d_cap


def _block_dropout(keys, T, j, block_k, plan, starts=None):
    """The dropout multiplier [B, Hkv, G, T, bk] of kv block j (None without dropout)."""
    if keys is None:
        return None
    return dropout_multiplier(keys[..., None, None], *_positions(T, j, block_k, starts), plan.dropout_rate)


class _Chunks:
    """A sliding window's band cut into query chunks, each with the kv blocks it sees, so that the scan runs over
    those blocks only: O(len * window) instead of O(len * kv_len). A chunk spans at least the window (and a kv
    block), so the chunks' kv slices, gathered side by side, hold each key about twice. The blockwise forward and
    backward run on the chunks as batch rows, their positions offset (`starts`); dk and dv are summed back into
    the keys. None (`of`) where a window has no left edge or one chunk would hold every query."""

    def __init__(self, T, S, plan, size):
        bk = plan.blocks.block_k
        band = _band.edges(plan.causal, plan.window)
        self.size, self.count, self.T = size, -(-T // size), T
        first, stop = _band.kv_range(np.arange(self.count), self.size, bk, S // bk, band)
        steps = max(int(np.max(stop - first)), 1)
        self.blocks = first[:, None] + np.arange(steps)  # [chunks, steps]; past the last block: masked keys
        self.starts = (np.arange(self.count) * self.size, first * bk)
        self.plan = dataclasses.replace(plan, kv_len=plan.kv_len or S)  # masks the keys of clamped blocks

    @classmethod
    def of(cls, T, S, plan):
        left, right = _band.edges(plan.causal, plan.window)
        if left is None:
            return None
        bk = plan.blocks.block_k
        size = -(-max(left + right + 1, bk) // bk) * bk  # the window's span in whole kv blocks
        return cls(T, S, plan, size) if size < T else None

    def rows(self, x, fill=0):
        """x [B, T, ...] -> [B * chunks, size, ...] (padded with `fill`); None stays None."""
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, self.count * self.size - self.T)] + [(0, 0)] * (x.ndim - 2),
                    constant_values=fill)
        return x.reshape(x.shape[0] * self.count, self.size, *x.shape[2:])

    def unrows(self, x):
        """`rows`' inverse: [B * chunks, size, ...] -> [B, T, ...]."""
        return x.reshape(-1, self.count * self.size, *x.shape[2:])[:, :self.T]

    def slices(self, x):
        """x [B, S, ...] -> [B * chunks, steps * bk, ...]: each chunk's kv blocks (the clamped ones masked); None
        stays None."""
        if x is None:
            return None
        bk = self.plan.blocks.block_k
        blocks = x.reshape(x.shape[0], -1, bk, *x.shape[2:])
        index = np.minimum(self.blocks, blocks.shape[1] - 1).reshape(-1)
        gathered = jnp.take(blocks, index, axis=1)  # [B, chunks * steps, bk, ...]
        return gathered.reshape(x.shape[0] * self.count, self.blocks.shape[1] * bk, *x.shape[2:])

    def unslices(self, x, S):
        """`slices`' adjoint: [B * chunks, steps * bk, ...] summed back into [B, S, ...]."""
        bk = self.plan.blocks.block_k
        parts = x.reshape(-1, self.blocks.size, bk, *x.shape[2:])
        index = np.minimum(self.blocks, S // bk - 1).reshape(-1)
        total = jnp.zeros((parts.shape[0], S // bk, *parts.shape[2:]), jnp.float32).at[:, index].add(parts)
        return total.reshape(parts.shape[0], S, *x.shape[2:]).astype(x.dtype)

    def row_starts(self, B):
        return tuple(jnp.asarray(np.tile(start, B), jnp.int32) for start in self.starts)

    def keys(self, keys):
        return None if keys is None else jnp.repeat(keys, self.count, axis=0)


def forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales=None):
    """Returns (out [B, T, H, D], lse [B, Hkv, G, T] float32); S must be a multiple of plan.blocks.block_k.
    kv_scales: None, or (k_scale, v_scale) float32 [B, S, Hkv] of an int8 k and v (each key's and value's row
    scale: logits are (q . k) * k_scale, and p * v_scale multiplies v)."""
    chunks = None if kv_scales is not None else _Chunks.of(q.shape[1], k.shape[1], plan)
    if chunks is None:
        return _forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales)
    out, lse = _forward(chunks.rows(q), chunks.slices(k), chunks.slices(v), chunks.rows(q_ids), chunks.slices(kv_ids),
                        chunks.keys(keys), chunks.plan, starts=chunks.row_starts(q.shape[0]))
    lse = jnp.moveaxis(lse, 3, 1)  # [B * chunks, size, Hkv, G]
    return chunks.unrows(out), jnp.moveaxis(chunks.unrows(lse), 1, 3)


def _forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales=None, starts=None):
    """`forward` by one scan over every kv block; starts: see `_positions`."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, T, Hkv, G, D)
    keys = None if keys is None else keys.reshape(B, Hkv, G)
    block_k = plan.blocks.block_k
    ids_blocks = None if kv_ids is None else _kv_blocks(kv_ids, block_k)
    scale_blocks = (None, None) if kv_scales is None else tuple(_kv_blocks(s, block_k) for s in kv_scales)
    as_columns = lambda s: jnp.transpose(s, (0, 2, 1))[:, :, None, None, :]  # noqa: E731  [B, bk, Hkv] -> logits'

    def step(carry, xs):
        acc, m, l = carry
        j, k_blk, v_blk, ids_blk, (k_scale, v_scale) = xs
        # The mask and dropout tiles depend on (j, ids) alone; left so, a remat'd layer scan's partial evaluation
        # finds them computable without the weights, hoists them out and keeps every block's (LLaMA-7B at 16k
        # tokens a device: 1 GB of pred[32, 1, 4, 1, 16384, 512]; 6.4 GB more for a ring's steps). Tied to k they
        # are recomputed with the rest of the layer.
        j, ids_blk, k_blk = lax.optimization_barrier((j, ids_blk, k_blk))
        if k_scale is not None:
            k_blk, v_blk = k_blk.astype(q.dtype), v_blk.astype(q.dtype)
        s, _ = _block_logits(qg, k_blk, ids_blk, j, q_ids, plan, None if k_scale is None else as_columns(k_scale),
                             starts)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        # Rows with no visible key so far get p = 1 on masked entries; alpha = 0 wipes that once a visible key
        # arrives, and rows that never see one are zeroed at the end.
        p = jnp.exp(s - m_new[..., None])
        l = alpha * l + p.sum(axis=-1)  # the softmax's own sum: dropout rescales the kept terms, not the sum
        keep = _block_dropout(keys, T, j, block_k, plan, starts)
        p = p if keep is None else p * keep
        p = p if v_scale is None else p * as_columns(v_scale)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
        return (alpha[..., None] * acc + pv, m_new, l), None

    nk = k.shape[1] // block_k
    init = (
        jnp.zeros((B, Hkv, G, T, D), jnp.float32),
        jnp.full((B, Hkv, G, T), NEG_INF, jnp.float32),
        jnp.zeros((B, Hkv, G, T), jnp.float32),
    )
    xs = (jnp.arange(nk), _kv_blocks(k, block_k), _kv_blocks(v, block_k), ids_blocks, scale_blocks)
    (acc, m, l), _ = jax.lax.scan(step, init, xs)
    visible = m > NEG_INF / 2
    out = jnp.where(visible[..., None], acc / jnp.where(visible, l, 1.0)[..., None], 0.0)
    lse = jnp.where(visible, m + jnp.log(jnp.where(visible, l, 1.0)), jnp.inf)
    out = jnp.moveaxis(out, 3, 1).reshape(B, T, H, D).astype(q.dtype)
    return out, lse


def lse_rows(lse, shape):
    """`forward`'s lse as [B, T, H], natural log (+inf where a query saw no key); shape: q's [B, T, H, D]."""
    B, T, H, _ = shape
    return jnp.swapaxes(lse.reshape(B, H, T), 1, 2)


def lse_from_rows(rows, kv_heads):
    """`lse_rows`' inverse: [B, T, H] natural log (+inf where a query sees no key) as `backward` reads it."""
    B, T, H = rows.shape
    return jnp.swapaxes(rows, 1, 2).reshape(B, kv_heads, H // kv_heads, T)


def backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan):
    """Returns (dq, dk, dv) by recomputing each kv block's probabilities from the saved lse.

    With dropout (out = (p * keep) v): dv = (p * keep)^T do, and dp = (do v^T) * keep enters the softmax backward;
    delta = <out, do> is still sum_j p_ij dp_ij. A soft cap multiplies the logits' gradient by its derivative."""
    chunks = _Chunks.of(q.shape[1], k.shape[1], plan)
    if chunks is None:
        return _backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan)
    B, S = q.shape[0], k.shape[1]
    lse = jnp.moveaxis(chunks.rows(jnp.moveaxis(lse, 3, 1), fill=jnp.inf), 1, 3)  # padded queries: p = 0
    dq, dk, dv = _backward(chunks.rows(q), chunks.slices(k), chunks.slices(v), chunks.rows(q_ids),
                           chunks.slices(kv_ids), chunks.keys(keys), chunks.rows(out), lse, chunks.rows(do),
                           chunks.plan, starts=chunks.row_starts(B))
    return chunks.unrows(dq), chunks.unslices(dk, S), chunks.unslices(dv, S)


def _backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan, starts=None):
    """`backward` by one scan over every kv block; starts: see `_positions`."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    keys = None if keys is None else keys.reshape(B, Hkv, G)
    block_k = plan.blocks.block_k
    qg = q.reshape(B, T, Hkv, G, D)
    dog = do.reshape(B, T, Hkv, G, D)
    # delta_i = sum_j p_ij dp_ij = <out_i, do_i> (FlashAttention-2, eq. for dS).
    delta = jnp.einsum("btkgd,btkgd->bkgt", out.reshape(qg.shape).astype(jnp.float32), dog.astype(jnp.float32))
    ids_blocks = None if kv_ids is None else _kv_blocks(kv_ids, block_k)

    def step(dq, xs):
        j, k_blk, v_blk, ids_blk = xs
        s, d_cap = _block_logits(qg, k_blk, ids_blk, j, q_ids, plan, starts=starts)
        p = jnp.exp(s - lse[..., None])  # masked entries and fully-masked rows (lse = +inf) give exactly 0
        dp = jnp.einsum("btkgd,bskd->bkgts", dog, v_blk, preferred_element_type=jnp.float32)
        keep = _block_dropout(keys, T, j, block_k, plan, starts)
        p_kept = p if keep is None else p * keep
        dp = dp if keep is None else dp * keep
        ds = p * (dp - delta[..., None]) * plan.sm_scale
        ds = ds if d_cap is None else ds * d_cap
        dv_blk = jnp.einsum("bkgts,btkgd->bskd", p_kept.astype(do.dtype), dog, preferred_element_type=jnp.float32)
        dk_blk = jnp.einsum("bkgts,btkgd->bskd", ds.astype(q.dtype), qg, preferred_element_type=jnp.float32)
        dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds.astype(k.dtype), k_blk, preferred_element_type=jnp.float32)
        return dq, (dk_blk.astype(k.dtype), dv_blk.astype(v.dtype))

    nk = S // block_k
    xs = (jnp.arange(nk), _kv_blocks(k, block_k), _kv_blocks(v, block_k), ids_blocks)
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), xs)
    unblock = lambda x: jnp.swapaxes(x, 0, 1).reshape(B, S, Hkv, D)
    return dq.reshape(B, T, H, D).astype(q.dtype), unblock(dk), unblock(dv)
