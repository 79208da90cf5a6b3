"""TPU flash attention: Pallas kernels on Mosaic.

Arrays are moved to [batch, heads, len, head_dim] so every block's last two dims are (seq tile, head_dim): Mosaic
wants them to be multiples of (8, 128) or the full array dims. Each kernel walks its reduction axis as the last,
'arbitrary', grid axes with the running state in VMEM scratch, so the Pallas pipeline overlaps the next block's DMA
with this block's compute. Skipping: under causal masking and a sliding window the reduction axis walks only the
band's blocks (`_band`: its extent is the most blocks any block sees, step s of block i visits the band's first
block + s), the index map clamped to the last visible block, so steps past it re-use the resident block and issue
no DMA, and `pl.when` skips their compute; a window of w keys takes O(len * w) steps. Segment-id ranges per block
are scalar-prefetched into SMEM so disjoint blocks skip compute too. So are the dropout
keys [B, H], from which each kernel regenerates its tile of the mask (`reference.dropout_multiplier`).

Per-row statistics (lse, delta) and q segment ids are stored as columns [len, 1] for the forward and dq kernels
and as rows [1, len] for the dk/dv kernel, which works on transposed [kv, q] blocks so that every matmul is
A @ B or A @ B^T.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.attention import _band, _cost
from kernels.attention.reference import NEG_INF, attention_mask, dropout_multiplier, soft_cap

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T


def _dot_nt(a, b, precision=None):
    return lax.dot_general(a, b, _NT, precision=precision, preferred_element_type=jnp.float32)


def _dot(a, b, precision=None):
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)  # [B, L, H, D] <-> [B, H, L, D]


def _block_ranges(ids, block):
    """Per-block (min, max) of segment ids [B, L] -> two [B, L // block] int32 arrays, for SMEM prefetch."""
    blocks = ids.reshape(ids.shape[0], -1, block)
    return blocks.min(axis=-1), blocks.max(axis=-1)


def _kv_step(plan, i, step, bq, bk, num_kv_blocks):
    """(the kv block that step `step` of q block i visits, whether it is in the band): the band's first block +
    step, clamped to its last so that the steps past it issue no DMA."""
    first, stop = _band.kv_range(i, bq, bk, num_kv_blocks, _band.edges(plan.causal, plan.window))
    return jnp.minimum(first + step, stop - 1), first + step < stop


def _q_step(plan, j, step, bq, bk, num_q_blocks):
    """`_kv_step` of the dk/dv grid: the q block that step `step` of kv block j visits, whether it is in the band."""
    first, stop = _band.q_range(j, bq, bk, num_q_blocks, _band.edges(plan.causal, plan.window))
    return jnp.minimum(first + step, stop - 1), first + step < stop


def _steps(plan, num_blocks, bq, bk, num_other_blocks, ranges):
    """The extent of a grid's reduction axis: the most blocks of the band any of `num_blocks` blocks sees."""
    return max(int(_band.tiles_seen(num_blocks, bq, bk, num_other_blocks, _band.edges(plan.causal, plan.window),
                                    ranges).max()), 1)


def _block_needed(ranges, b, q_block, kv_block, in_band):
    """Scalar predicate: may q block `q_block` attend to anything in kv block `kv_block`? in_band: whether the step
    that visits them lies in the causal / window band."""
    needed = [in_band]
    if ranges:
        q_lo, q_hi, k_lo, k_hi = ranges
        needed.append(k_lo[b, kv_block] <= q_hi[b, q_block])
        needed.append(k_hi[b, kv_block] >= q_lo[b, q_block])
    result = True
    for term in needed:
        result = jnp.logical_and(result, term)
    return result


def _masked_logits(q, k, plan, q_start, k_start, qid_ref, kid_ref, transposed, k_scale=None):
    """(scaled logits q @ k^T ([bq, bk]) or k @ q^T ([bk, bq] when transposed), soft-capped, masked entries set to
    NEG_INF; the soft cap's derivative or None). The id refs (or None) hold the blocks' segment ids already shaped
    to broadcast in that orientation; k_scale (int8 keys, [1, bk], not transposed) multiplies the columns before
    the cap and the mask."""
    s = (_dot_nt(k, q) if transposed else _dot_nt(q, k)) * plan.sm_scale
    s = s if k_scale is None else s * k_scale
    s, d_cap = soft_cap(s, plan.logit_soft_cap)
    q_axis = 1 if transposed else 0
    mask = attention_mask(
        q_start + lax.broadcasted_iota(jnp.int32, s.shape, q_axis),
        k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1 - q_axis),
        None if qid_ref is None else qid_ref[...],
        None if kid_ref is None else kid_ref[...],
        causal=plan.causal,
        kv_len=plan.kv_len,
        window=plan.window,
    )
    return (s if mask is None else jnp.where(mask, s, NEG_INF)), d_cap


def _dropout(plan, keys_ref, b, h, shape, q_start, k_start, transposed):
    """The dropout multiplier of a [bq, bk] (or transposed [bk, bq]) tile of head h, or None without dropout."""
    if keys_ref is None:
        return None
    q_axis = 1 if transposed else 0
    return dropout_multiplier(keys_ref[b, h], q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis),
                              k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis), plan.dropout_rate)


def _unpack(refs, has_ids, has_keys, num_inputs, num_outputs):
    """Splits a kernel's refs into (prefetched ranges, prefetched dropout keys or None, inputs, (q_ids, kv_ids),
    outputs, scratch)."""
    refs = list(refs)
    ranges = [refs.pop(0) for _ in range(4)] if has_ids else []
    keys = refs.pop(0) if has_keys else None
    inputs = [refs.pop(0) for _ in range(num_inputs)]
    ids = (refs.pop(0), refs.pop(0)) if has_ids else (None, None)
    outputs = [refs.pop(0) for _ in range(num_outputs)]
    return ranges, keys, inputs, ids, outputs, refs


def _fwd_kernel(*refs, plan, has_ids, has_keys, num_kv_blocks, has_scales=False):
    if has_scales:  # int8 k and v with their per-row scales, after the ids
        refs = list(refs)
        at = 4 * has_ids + has_keys + 3 + 2 * has_ids
        ks_ref, vs_ref = refs.pop(at), refs.pop(at)
    ranges, keys_ref, (q_ref, k_ref, v_ref), (qid_ref, kid_ref), (o_ref, lse_ref), (m_scr, l_scr, acc_scr) = _unpack(
        refs, has_ids, has_keys, 3, 2
    )
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    b, h, i, step = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    j, in_band = _kv_step(plan, i, step, bq, bk, num_kv_blocks)

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(_block_needed(ranges, b, i, j, in_band))
    def _visit():
        k, v = k_ref[...], v_ref[...]
        if has_scales:  # int8 tiles converted where read; scales on the logits' and p's columns
            k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
        s, _ = _masked_logits(q_ref[...], k, plan, i * bq, j * bk, qid_ref, kid_ref, transposed=False,
                              k_scale=ks_ref[...] if has_scales else None)
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)  # rescales what was summed under the old max (0 wipes masked-only rows)
        p = jnp.exp(s - m_new)
        l_scr[...] = alpha * l_scr[...] + p.sum(axis=1, keepdims=True)
        keep = _dropout(plan, keys_ref, b, h, s.shape, i * bq, j * bk, transposed=False)
        p = p if keep is None else p * keep  # the sum above is the softmax's own; only kept terms reach the output
        p = p * vs_ref[...] if has_scales else p
        acc_scr[...] = alpha * acc_scr[...] + _dot(p.astype(v.dtype), v)
        m_scr[...] = m_new

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        m = m_scr[...]
        visible = m > NEG_INF / 2
        l = jnp.where(visible, l_scr[...], 1.0)
        o_ref[...] = jnp.where(visible, acc_scr[...] / l, 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(visible, m + jnp.log(l), jnp.inf)  # +inf: every p recomputed from it is 0


def _dq_kernel(*refs, plan, has_ids, has_keys, num_kv_blocks):
    ranges, keys_ref, inputs, (qid_ref, kid_ref), (dq_ref,), (dq_scr,) = _unpack(refs, has_ids, has_keys, 6, 1)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    b, h, i, step = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    j, in_band = _kv_step(plan, i, step, bq, bk, num_kv_blocks)

    @pl.when(step == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(_block_needed(ranges, b, i, j, in_band))
    def _visit():
        k = k_ref[...]
        s, d_cap = _masked_logits(q_ref[...], k, plan, i * bq, j * bk, qid_ref, kid_ref, transposed=False)
        p = jnp.exp(s - lse_ref[...])
        p = p if d_cap is None else p * d_cap  # folded in at once: one [bq, bk] temporary fewer across the dot
        # (dk/dv cannot: dv reads p; issuing dv before dp fits v6e's tiles but not v5e's: kernels/README.md)
        dp = _dot_nt(do_ref[...], v_ref[...])
        keep = _dropout(plan, keys_ref, b, h, s.shape, i * bq, j * bk, transposed=False)
        ds = p * ((dp if keep is None else dp * keep) - delta_ref[...])
        dq_scr[...] += _dot(ds.astype(k.dtype), k)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_scr[...] * plan.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, plan, has_ids, has_keys, num_q_blocks):
    ranges, keys_ref, inputs, (qid_ref, kid_ref), (dk_ref, dv_ref), (dk_scr, dv_scr) = _unpack(
        refs, has_ids, has_keys, 6, 2
    )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    b, h_kv, j, g, step = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    i, in_band = _q_step(plan, j, step, bq, bk, num_q_blocks)

    @pl.when(jnp.logical_and(g == 0, step == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(_block_needed(ranges, b, i, j, in_band))
    def _visit():
        q, do = q_ref[...], do_ref[...]
        s_t, d_cap = _masked_logits(q, k_ref[...], plan, i * bq, j * bk, qid_ref, kid_ref, transposed=True)
        p_t = jnp.exp(s_t - lse_ref[...])
        dp_t = _dot_nt(v_ref[...], do)
        keep = _dropout(plan, keys_ref, b, h_kv * pl.num_programs(3) + g, s_t.shape, i * bq, j * bk, transposed=True)
        p_kept = p_t if keep is None else p_t * keep
        dp_t = dp_t if keep is None else dp_t * keep
        dv_scr[...] += _dot(p_kept.astype(do.dtype), do)
        ds_t = p_t * (dp_t - delta_ref[...])
        ds_t = ds_t if d_cap is None else ds_t * d_cap
        dk_scr[...] += _dot(ds_t.astype(q.dtype), q)

    @pl.when(jnp.logical_and(g == pl.num_programs(3) - 1, step == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_scr[...] * plan.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _call(kernel, plan, has_ids, has_keys, *, grid, num_prefetch_args, in_specs, out_specs, out_shape, scratch,
          semantics, name, cost):
    return pl.pallas_call(
        lambda *refs: kernel(*refs, plan=plan, has_ids=has_ids, has_keys=has_keys),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_prefetch_args,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in scratch],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=pltpu.InterpretParams() if plan.interpret else False,
        name=name,
        cost_estimate=cost,
    )


def _prefetch(q_ids, kv_ids, keys, bq, bk):
    """The SMEM operands: per-block segment-id ranges (with segment ids), then the dropout keys (with dropout)."""
    ranges = [] if q_ids is None else [*_block_ranges(q_ids, bq), *_block_ranges(kv_ids, bk)]
    return ranges + ([] if keys is None else [keys])


def _q_major_specs(plan, D, G, bq, bk, num_kv_blocks, has_ids):
    """BlockSpecs for grids (batch, head, q block, step along the band's kv blocks): q-like blocks, kv blocks, row
    stats, ids."""

    def kv_index(b, h, i, step, *_):
        return b, lax.div(h, G), _kv_step(plan, i, step, bq, bk, num_kv_blocks)[0], 0

    q_spec = pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, D), kv_index)
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j, *_: (b, h, i, 0))
    id_specs = []
    if has_ids:
        id_specs = [
            pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *_: (b, i, 0)),
            pl.BlockSpec((None, 1, bk), lambda b, h, i, j, *_: (b, 0, kv_index(b, h, i, j)[2])),
        ]
    return q_spec, kv_spec, row_spec, id_specs


def forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales=None):
    """Returns (out [B, T, H, D], lse [B, H, T, 1] float32). kv_scales: see `reference.forward`."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    has_ids = q_ids is not None
    num_kv_blocks = pl.cdiv(plan.kv_len or S, bk)
    q_spec, kv_spec, row_spec, id_specs = _q_major_specs(plan, D, H // Hkv, bq, bk, num_kv_blocks, has_ids)
    prefetch = _prefetch(q_ids, kv_ids, keys, bq, bk)
    ids = [q_ids[:, :, None], kv_ids[:, None, :]] if has_ids else []
    scales, scale_specs = [], []
    if kv_scales is not None:  # [B, S, Hkv] -> [B, Hkv, 1, S]: a (1, bk) row per kv block
        scales = [jnp.transpose(s, (0, 2, 1))[:, :, None, :] for s in kv_scales]
        index = lambda b, h, i, j, *_: (b, lax.div(h, H // Hkv), 0, kv_spec.index_map(b, h, i, j)[2])  # noqa: E731
        scale_specs = [pl.BlockSpec((None, None, 1, bk), index)] * 2
    out, lse = _call(
        functools.partial(_fwd_kernel, has_scales=bool(scales), num_kv_blocks=num_kv_blocks),
        plan,
        has_ids,
        keys is not None,
        grid=(B, H, T // bq, _steps(plan, T // bq, bq, bk, num_kv_blocks, _band.kv_range)),
        num_prefetch_args=len(prefetch),
        in_specs=[q_spec, kv_spec, kv_spec, *id_specs, *scale_specs],
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, T, D), q.dtype), jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32)],
        scratch=[(bq, 1), (bq, 1), (bq, D)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
        name="flash_attention_fwd",
        cost=_cost.forward(q.shape, k.shape, q.dtype.itemsize, k.dtype.itemsize, (bq, bk), plan.causal, plan.kv_len,
                           [*prefetch, *ids, *scales], **_cost.band_of(plan)),
    )(*prefetch, _heads_major(q), _heads_major(k), _heads_major(v), *ids, *scales)
    return _heads_major(out), lse


def lse_rows(lse, shape):
    """`forward`'s lse as [B, T, H], natural log (+inf where a query saw no key); shape: q's [B, T, H, D]."""
    del shape
    return jnp.swapaxes(lse[..., 0], 1, 2)


def lse_from_rows(rows, kv_heads):
    """`lse_rows`' inverse: [B, T, H] natural log (+inf where a query sees no key) as `backward` reads it."""
    del kv_heads
    return jnp.swapaxes(rows, 1, 2)[..., None]


def backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan):
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    has_ids = q_ids is not None
    prefetch = _prefetch(q_ids, kv_ids, keys, bq, bk)
    # delta_i = <out_i, do_i> = sum_j p_ij dp_ij, one fused XLA reduction.
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))[..., None]
    qt, kt, vt, dot_ = _heads_major(q), _heads_major(k), _heads_major(v), _heads_major(do)

    num_kv_blocks, num_q_blocks = pl.cdiv(plan.kv_len or S, bk), T // bq
    q_spec, kv_spec, row_spec, id_specs = _q_major_specs(plan, D, G, bq, bk, num_kv_blocks, has_ids)
    ids = [q_ids[:, :, None], kv_ids[:, None, :]] if has_ids else []
    dq = _call(
        functools.partial(_dq_kernel, num_kv_blocks=num_kv_blocks),
        plan,
        has_ids,
        keys is not None,
        grid=(B, H, num_q_blocks, _steps(plan, num_q_blocks, bq, bk, num_kv_blocks, _band.kv_range)),
        num_prefetch_args=len(prefetch),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *id_specs],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((B, H, T, D), q.dtype),
        scratch=[(bq, D)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
        name="flash_attention_dq",
        cost=_cost.backward_dq(q.shape, k.shape, q.dtype.itemsize, (bq, bk), plan.causal, plan.kv_len,
                               [*prefetch, *ids], **_cost.band_of(plan)),
    )(*prefetch, qt, kt, vt, dot_, lse, delta, *ids)

    # Grid (batch, kv head, kv block, q head in group, step along the band's q blocks): the last two axes reduce
    # into dk/dv scratch.
    def q_index(b, h, j, g, step, *_):
        return b, h * G + g, _q_step(plan, j, step, bq, bk, num_q_blocks)[0]

    q_spec = pl.BlockSpec((None, None, bq, D), lambda *idx: (*q_index(*idx), 0))
    kv_spec = pl.BlockSpec((None, None, bk, D), lambda b, h, j, g, i, *_: (b, h, j, 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda *idx: (*q_index(*idx)[:2], 0, q_index(*idx)[2]))
    id_specs = []
    if has_ids:
        id_specs = [
            pl.BlockSpec((None, 1, bq), lambda *idx: (idx[0], 0, q_index(*idx)[2])),
            pl.BlockSpec((None, bk, 1), lambda b, h, j, g, i, *_: (b, j, 0)),
        ]
    ids = [q_ids[:, None, :], kv_ids[:, :, None]] if has_ids else []
    as_rows = lambda x: x.reshape(B, H, 1, T)
    dk, dv = _call(
        functools.partial(_dkv_kernel, num_q_blocks=num_q_blocks),
        plan,
        has_ids,
        keys is not None,
        grid=(B, Hkv, S // bk, G, _steps(plan, S // bk, bq, bk, num_q_blocks, _band.q_range)),
        num_prefetch_args=len(prefetch),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *id_specs],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(kt.shape, k.dtype), jax.ShapeDtypeStruct(vt.shape, v.dtype)],
        scratch=[(bk, D), (bk, D)],
        semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        name="flash_attention_dkv",
        cost=_cost.backward_dkv(q.shape, k.shape, q.dtype.itemsize, (bq, bk), plan.causal, plan.kv_len,
                                [*prefetch, *ids], **_cost.band_of(plan)),
    )(*prefetch, qt, kt, vt, dot_, as_rows(lse), as_rows(delta), *ids)
    return _heads_major(dq), _heads_major(dk), _heads_major(dv)
