"""GPU flash attention: Pallas kernels on the Triton backend (FlashAttention-2 schedule).

Forward: one program per (q block, batch, head) loops over kv blocks with an online softmax in the exp2 domain
(log2(e) folded into the logit scale, so each exponential is one `ex2.approx`), and saves the output and the
base-2 log-sum-exp. Backward: a dq pass (one program per q block, looping over kv blocks) and a dk/dv pass (one
program per kv block and kv head, looping over the q heads of its group and over q blocks), so neither needs atomics
and k/v are never repeated for grouped-query attention. Under causal masking and a sliding window the loops run
over the blocks inside the band (`_band`: from the window's left edge to the diagonal); under segment ids they start
and stop at the first and last block whose id range meets the fixed block's (`_block_bounds`, computed outside the
kernel). A soft cap bends each logit (`reference.soft_cap`) and the backward passes multiply by its derivative.
Dropout regenerates its mask in every kernel from the (batch row, head) key and the tile's positions
(`reference.dropout_multiplier`).

Each kernel runs one loop over its blocks, with the position mask under a uniform branch on the blocks that straddle
the band's edges, behind a guard that skips an empty loop. One loop per region (or a zero-trip path to the loop's
exit) joins the in-flight wgmma accumulator with registers that other instructions defined, and ptxas then serializes
every wgmma of the kernel (C7515 on sm_90a); skipping a block under `lax.cond` kept Triton from pipelining the loop
at all. The registers and shared memory before and after: kernels/README.md (Hopper compile tier).
"""
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention import _band, _cost
from kernels.attention.reference import NEG_INF, attention_mask, dropout_multiplier, soft_cap

try:
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # JAX 0.11 deprecated the Pallas Triton backend; a later release may drop it
    plgpu = None
AVAILABLE = plgpu is not None
# JAX 0.10 and 0.11 export `CompilerParams`; releases before 0.7 called it `TritonCompilerParams`.
_CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)  # base-2 lse to natural
_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T


def _dot_nt(a, b):
    return lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _masked_logits(a, b, scale, q_pos, k_pos, q_ids, kv_ids, plan, on_edge):
    """(logits a @ b^T * scale, soft-capped, in the exp2 domain, with masked entries set to NEG_INF; the soft cap's
    derivative or None). `scale`: sm_scale (times int8 keys' scales). Positions and ids are shaped to broadcast in
    the result's orientation ([q, k] or [k, q]). `on_edge` (False, or a traced bool) says the block straddles an
    edge of the causal / window band: only then is the position mask applied, under a branch, so blocks inside the
    band skip its arithmetic."""
    if plan.logit_soft_cap is None:
        s, d_cap = _dot_nt(a, b) * (scale * _LOG2E), None
    else:
        s, d_cap = soft_cap(_dot_nt(a, b) * scale, plan.logit_soft_cap)
        s = s * _LOG2E
    mask = attention_mask(q_pos, k_pos, q_ids, kv_ids, causal=False, kv_len=plan.kv_len)
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    if on_edge is False:
        return s, d_cap
    visible = attention_mask(q_pos, k_pos, None, None, causal=plan.causal, kv_len=None, window=plan.window)
    return lax.cond(on_edge, lambda s: jnp.where(visible, s, NEG_INF), lambda s: s, s), d_cap


def _loop(lo, hi, on_edge, body, carry):
    """body(idx, carry, on_edge(idx)) over the blocks [lo, hi); on_edge None: no position mask. One loop, entered
    only when non-empty (see the module's docstring: C7515)."""
    run = lambda c: lax.fori_loop(  # noqa: E731
        lo, hi, lambda idx, c: body(idx, c, False if on_edge is None else on_edge(idx)), c)
    if isinstance(lo, int) and isinstance(hi, int):
        return run(carry) if lo < hi else carry
    return lax.cond(lo < hi, run, lambda c: c, carry)


def _bounded(lo, hi, bounds_refs):
    """[lo, hi) narrowed to the blocks `_block_bounds` found (bounds_refs: their first / stop refs, or None)."""
    if bounds_refs is None:
        return lo, hi
    first_ref, stop_ref = bounds_refs
    return jnp.maximum(lo, first_ref[...]), jnp.minimum(hi, stop_ref[...])


def _band_loop(visible, inner, bounds_refs, body, carry):
    """body(idx, carry, on_edge) over the `visible` blocks (first, stop) of the band, narrowed to the segment-id
    bounds; on_edge: idx outside the `inner` blocks (`_band.inner_range`), which need no position mask."""
    first, stop = inner

    def on_edge(idx):
        if first is None:
            return idx >= stop
        return idx < first if stop is None else jnp.logical_or(idx < first, idx >= stop)

    return _loop(*_bounded(*visible, bounds_refs), None if inner == (None, None) else on_edge, body, carry)


def _loop_over_kv_blocks(i, block_q, block_k, num_kv_blocks, plan, bounds_refs, body, carry):
    """body(j, carry, on_edge) over the kv blocks q block i can see: those in the causal / window band, within the
    segment-id bounds."""
    band = _band.edges(plan.causal, plan.window)
    return _band_loop(_band.kv_range(i, block_q, block_k, num_kv_blocks, band),
                      _band.inner_range(i, block_q, block_k, band), bounds_refs, body, carry)


def _split_refs(refs, has_ids, has_keys, num_inputs):
    """(inputs, (q_ids_ref, kv_ids_ref), bounds_refs, keys_ref, outputs): the id refs None and bounds_refs (the
    loop's `_block_bounds`, first and stop) None when there are no segment ids; keys_ref None without dropout."""
    refs = list(refs)
    inputs, refs = refs[:num_inputs], refs[num_inputs:]
    ids = (refs.pop(0), refs.pop(0)) if has_ids else (None, None)
    bounds = (refs.pop(0), refs.pop(0)) if has_ids else None
    keys_ref = refs.pop(0) if has_keys else None
    return inputs, ids, bounds, keys_ref, refs


def _block_ranges(ids, block):
    """(min, max) of each block of `block` ids: [B, n * block] -> two [B, n]."""
    blocks = ids.reshape(ids.shape[0], -1, block)
    return jnp.min(blocks, axis=-1), jnp.max(blocks, axis=-1)


def _block_bounds(ids, block, other_ids, other_block):
    """For each block of `ids` [B, n * block]: the first block of `other_ids` [B, m * other_block] whose id range
    meets its own, and one past the last (int32 [B, n] each; first >= stop when none does). A kernel's loop over
    the other blocks runs between them: for sorted (packed) ids exactly the blocks that share an id, for any ids a
    superset of them (the mask does the rest). One small XLA computation, so the kernel's loop has no
    data-dependent skip (which Triton cannot pipeline)."""
    lo, hi = _block_ranges(ids, block)
    other_lo, other_hi = _block_ranges(other_ids, other_block)
    meets = (other_lo[:, None, :] <= hi[:, :, None]) & (other_hi[:, None, :] >= lo[:, :, None])
    m = meets.shape[-1]
    index = jnp.arange(m, dtype=jnp.int32)
    return (jnp.min(jnp.where(meets, index, m), axis=-1).astype(jnp.int32),
            jnp.max(jnp.where(meets, index + 1, 0), axis=-1).astype(jnp.int32))


def _fwd_kernel(*refs, plan, has_ids, has_keys, num_kv_blocks, has_scales=False):
    if has_scales:  # int8 k and v with their per-row scales, after the other inputs
        refs = list(refs)
        ks_ref, vs_ref = refs.pop(3 + 4 * has_ids + has_keys), refs.pop(3 + 4 * has_ids + has_keys)
    (q_ref, k_ref, v_ref), (qid_ref, kid_ref), bounds, keys_ref, (o_ref, lse_ref) = _split_refs(
        refs, has_ids, has_keys, 3)
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    q_pos = (i * bq + jnp.arange(bq))[:, None]
    q_ids = None if qid_ref is None else qid_ref[...][:, None]
    key = None if keys_ref is None else keys_ref[...]

    def visit(j, carry, on_edge):
        acc, m, l = carry
        kv_slice = pl.ds(j * bk, bk)
        v, k = v_ref[kv_slice, :], k_ref[kv_slice, :]
        if has_scales:  # int8 tiles converted where read; the key scales multiply the logits' columns
            v, k = v.astype(q.dtype), k.astype(q.dtype)
            scale = plan.sm_scale * ks_ref[kv_slice][None, :]
        else:
            scale = plan.sm_scale
        kv_ids = None if kid_ref is None else kid_ref[kv_slice][None, :]
        k_pos = (j * bk + jnp.arange(bk))[None, :]
        s, _ = _masked_logits(q, k, scale, q_pos, k_pos, q_ids, kv_ids, plan, on_edge)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)  # rescales what was summed under the old max (0 wipes masked-only rows)
        p = jnp.exp2(s - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        if key is not None:  # the sum above is the softmax's own; only the kept terms reach the output
            p = p * dropout_multiplier(key, q_pos, k_pos, plan.dropout_rate)
        if has_scales:
            p = p * vs_ref[kv_slice][None, :]
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((bq,), NEG_INF, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, m, l = _loop_over_kv_blocks(i, bq, bk, num_kv_blocks, plan, bounds, visit, init)
    visible = m > NEG_INF / 2
    l = jnp.where(visible, l, 1.0)
    o_ref[...] = jnp.where(visible[:, None], acc / l[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(visible, m + jnp.log2(l), jnp.inf)  # +inf: every p recomputed from it is 0


def _dq_kernel(*refs, plan, has_ids, has_keys, num_kv_blocks):
    inputs, (qid_ref, kid_ref), bounds, keys_ref, (dq_ref,) = _split_refs(refs, has_ids, has_keys, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    i = pl.program_id(0)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = (i * bq + jnp.arange(bq))[:, None]
    q_ids = None if qid_ref is None else qid_ref[...][:, None]
    key = None if keys_ref is None else keys_ref[...]

    def visit(j, dq, on_edge):
        kv_slice = pl.ds(j * bk, bk)
        k = k_ref[kv_slice, :]
        kv_ids = None if kid_ref is None else kid_ref[kv_slice][None, :]
        k_pos = (j * bk + jnp.arange(bk))[None, :]
        s, d_cap = _masked_logits(q, k, plan.sm_scale, q_pos, k_pos, q_ids, kv_ids, plan, on_edge)
        p = jnp.exp2(s - lse[:, None])
        dp = _dot_nt(do, v_ref[kv_slice, :])
        if key is not None:
            dp = dp * dropout_multiplier(key, q_pos, k_pos, plan.dropout_rate)
        ds = p * (dp - delta[:, None])
        ds = ds if d_cap is None else ds * d_cap
        return dq + _dot(ds.astype(k.dtype), k)

    dq = _loop_over_kv_blocks(i, bq, bk, num_kv_blocks, plan, bounds, visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, plan, has_ids, has_keys, groups):
    inputs, (qid_ref, kid_ref), bounds, keys_ref, (dk_ref, dv_ref) = _split_refs(
        refs, has_ids, has_keys, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = (j * bk + jnp.arange(bk))[:, None]
    kv_ids = None if kid_ref is None else kid_ref[...][:, None]
    num_q_blocks = q_ref.shape[0] // bq
    band = _band.edges(plan.causal, plan.window)

    # Works on transposed blocks ([kv, q]) so that dv = p^T do and dk = ds^T q are plain matmuls.
    def visit(g, i, carry, on_edge):
        dk, dv = carry
        q_slice = pl.ds(i * bq, bq)
        q, do = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
        q_ids = None if qid_ref is None else qid_ref[q_slice][None, :]
        q_pos = (i * bq + jnp.arange(bq))[None, :]
        s_t, d_cap = _masked_logits(k, q, plan.sm_scale, q_pos, k_pos, q_ids, kv_ids, plan, on_edge)
        p_t = jnp.exp2(s_t - lse_ref[g, q_slice][None, :])
        keep = None if keys_ref is None else dropout_multiplier(keys_ref[g], q_pos, k_pos, plan.dropout_rate)
        dv = dv + _dot((p_t if keep is None else p_t * keep).astype(do.dtype), do)
        if d_cap is not None:  # folded in once dv has read p: one [bk, bq] tile fewer alive (255 registers and a
            p_t = p_t * d_cap  # spill on sm_90a with the cap's derivative kept beside p and dp)
        dp_t = _dot_nt(v, do)
        dp_t = dp_t if keep is None else dp_t * keep
        ds_t = p_t * (dp_t - delta_ref[g, q_slice][None, :])
        return dk + _dot(ds_t.astype(q.dtype), q), dv

    def per_head(g, carry):
        body = lambda i, c, on_edge: visit(g, i, c, on_edge)  # noqa: E731
        return _band_loop(_band.q_range(j, bq, bk, num_q_blocks, band), _band.inner_range(j, bk, bq, band[::-1]),
                          bounds, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, per_head, (zeros, zeros))
    dk_ref[...] = (dk * plan.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(plan, backward=False):
    b = plan.blocks
    if backward:
        return _CompilerParams(num_warps=b.num_warps_bwd, num_stages=b.num_stages_bwd)
    return _CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages)


def _bounds_of(ids, block, other_ids, other_block):
    """`_block_bounds` as two more id operands, or none without segment ids."""
    return () if ids is None else _block_bounds(ids, block, other_ids, other_block)


def _optional_operands(arrays, specs):
    """(operands, BlockSpecs) of optional inputs (segment ids, dropout keys): none when the first array is None."""
    return ([], []) if arrays[0] is None else (list(arrays), list(specs))


def forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales=None):
    """Returns (out [B, T, H, D], lse [B, H, T] float32, base 2). kv_scales: see `reference.forward`."""
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    kv_full = pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    ids, id_specs = _optional_operands(
        (q_ids, kv_ids, *_bounds_of(q_ids, bq, kv_ids, bk)),
        (pl.BlockSpec((None, bq), lambda i, b, h: (b, i)), pl.BlockSpec((None, S), lambda i, b, h: (b, 0)),
         *[pl.BlockSpec((None, None), lambda i, b, h: (b, i))] * 2))
    key_ops, key_specs = _optional_operands([keys], [pl.BlockSpec((None, None), lambda i, b, h: (b, h))])
    scales = [] if kv_scales is None else list(kv_scales)
    scale_specs = [pl.BlockSpec((None, S, None), lambda i, b, h: (b, 0, lax.div(h, G)))] * len(scales)
    kernel = lambda *refs: _fwd_kernel(
        *refs, plan=plan, has_ids=bool(ids), has_keys=bool(key_ops), num_kv_blocks=pl.cdiv(plan.kv_len or S, bk),
        has_scales=bool(scales)
    )
    return pl.pallas_call(
        kernel,
        grid=(T // bq, B, H),
        in_specs=[q_block, kv_full, kv_full, *id_specs, *key_specs, *scale_specs],
        out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        compiler_params=_compiler_params(plan),
        interpret=plan.interpret,
        name="flash_attention_fwd",
        cost_estimate=_cost.forward(q.shape, k.shape, q.dtype.itemsize, k.dtype.itemsize, (bq, bk), plan.causal,
                                    plan.kv_len, [*ids, *key_ops, *scales], **_cost.band_of(plan)),
    )(q, k, v, *ids, *key_ops, *scales)


def lse_rows(lse, shape):
    """`forward`'s lse as [B, T, H], natural log (+inf where a query saw no key); shape: q's [B, T, H, D]."""
    del shape
    return jnp.swapaxes(lse, 1, 2) * _LN2


def lse_from_rows(rows, kv_heads):
    """`lse_rows`' inverse: [B, T, H] natural log (+inf where a query sees no key) as `backward` reads it."""
    del kv_heads
    return jnp.swapaxes(rows, 1, 2) / _LN2


def backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan):
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    # delta_i = <out_i, do_i> = sum_j p_ij dp_ij, one fused XLA reduction.
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    common = dict(compiler_params=_compiler_params(plan, backward=True), interpret=plan.interpret)

    q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    kv_full = pl.BlockSpec((None, S, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    row_block = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    ids, id_specs = _optional_operands(
        (q_ids, kv_ids, *_bounds_of(q_ids, bq, kv_ids, bk)),
        (pl.BlockSpec((None, bq), lambda i, b, h: (b, i)), pl.BlockSpec((None, S), lambda i, b, h: (b, 0)),
         *[pl.BlockSpec((None, None), lambda i, b, h: (b, i))] * 2))
    key_ops, key_specs = _optional_operands([keys], [pl.BlockSpec((None, None), lambda i, b, h: (b, h))])
    dq = pl.pallas_call(
        lambda *refs: _dq_kernel(*refs, plan=plan, has_ids=bool(ids), has_keys=bool(key_ops),
                                 num_kv_blocks=pl.cdiv(plan.kv_len or S, bk)),
        grid=(T // bq, B, H),
        in_specs=[q_block, kv_full, kv_full, q_block, row_block, row_block, *id_specs, *key_specs],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_attention_dq",
        cost_estimate=_cost.backward_dq(q.shape, k.shape, q.dtype.itemsize, (bq, bk), plan.causal, plan.kv_len,
                                        [*ids, *key_ops], **_cost.band_of(plan)),
        **common,
    )(q, k, v, do, lse, delta, *ids, *key_ops)

    # One program per (kv block, batch, kv head); it reads the whole q/do/lse/delta of the head group.
    q_group = pl.BlockSpec((None, T, G, D), lambda j, b, h: (b, 0, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
    row_group = pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0))
    ids, id_specs = _optional_operands(
        (q_ids, kv_ids, *_bounds_of(kv_ids, bk, q_ids, bq)),
        (pl.BlockSpec((None, T), lambda j, b, h: (b, 0)), pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
         *[pl.BlockSpec((None, None), lambda j, b, h: (b, j))] * 2))
    # The keys of the group's q heads, [B, Hkv, G].
    key_ops, key_specs = _optional_operands([None if keys is None else keys.reshape(B, Hkv, G)],
                                            [pl.BlockSpec((None, None, G), lambda j, b, h: (b, h, 0))])
    dk, dv = pl.pallas_call(
        lambda *refs: _dkv_kernel(*refs, plan=plan, has_ids=bool(ids), has_keys=bool(key_ops), groups=G),
        grid=(S // bk, B, Hkv),
        in_specs=[q_group, kv_block, kv_block, q_group, row_group, row_group, *id_specs, *key_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_attention_dkv",
        cost_estimate=_cost.backward_dkv(q.shape, k.shape, q.dtype.itemsize, (bq, bk), plan.causal, plan.kv_len,
                                         [*ids, *key_ops], **_cost.band_of(plan)),
        **common,
    )(q, k, v, do, lse, delta, *ids, *key_ops)
    return dq, dk, dv
