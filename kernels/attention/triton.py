"""GPU flash attention: Pallas kernels on the Triton backend (FlashAttention-2 schedule).

Forward: one program per (q block, batch, head) loops over kv blocks with an online softmax in the exp2 domain
(log2(e) folded into the logit scale, so each exponential is one `ex2.approx`), and saves the output and the
base-2 log-sum-exp. Backward: a dq pass (one program per q block, looping over kv blocks) and a dk/dv pass (one
program per kv block and kv head, looping over the q heads of its group and over q blocks), so neither needs atomics
and k/v are never repeated for grouped-query attention. Under causal masking the loops start/stop at the diagonal;
under segment ids a kv block whose id range cannot meet the q block's is skipped. Dropout regenerates its mask in
every kernel from the (batch row, head) key and the tile's positions (`reference.dropout_multiplier`).
"""
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention import _cost
from kernels.attention.reference import NEG_INF, attention_mask, dropout_multiplier

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


def _masked_logits(a, b, scale, q_pos, k_pos, q_ids, kv_ids, plan, causal):
    """Scaled logits a @ b^T with masked entries set to NEG_INF. Positions and ids are shaped to broadcast in the
    result's orientation ([q, k] or [k, q]); `causal` is False for blocks known to lie below the diagonal."""
    s = _dot_nt(a, b) * scale
    mask = attention_mask(q_pos, k_pos, q_ids, kv_ids, causal=causal, kv_len=plan.kv_len)
    return s if mask is None else jnp.where(mask, s, NEG_INF)


def _loop_split_at_diagonal(lo, hi, first_masked, last_masked, body, carry):
    """Runs body(idx, carry, causal) over [lo, hi): blocks in [first_masked, last_masked) straddle the diagonal and
    need the causal mask; the others lie wholly on the visible side and skip the mask arithmetic."""
    carry = lax.fori_loop(lo, first_masked, lambda idx, c: body(idx, c, False), carry)
    carry = lax.fori_loop(first_masked, last_masked, lambda idx, c: body(idx, c, True), carry)
    return lax.fori_loop(last_masked, hi, lambda idx, c: body(idx, c, False), carry)


def _skip_disjoint(body, fixed_ids, loop_ids_ref, block):
    """Wraps a fori_loop body over blocks of `loop_ids_ref` so blocks whose segment-id range cannot meet the fixed
    block's range are skipped (a cheap, conservative test that is exact for packed, sorted ids)."""
    if fixed_ids is None:
        return body
    lo, hi = jnp.min(fixed_ids), jnp.max(fixed_ids)

    def maybe_body(idx, carry, causal):
        ids = loop_ids_ref[pl.ds(idx * block, block)]
        overlap = jnp.logical_and(jnp.min(ids) <= hi, jnp.max(ids) >= lo)
        return lax.cond(overlap, lambda c: body(idx, c, causal), lambda c: c, carry)

    return maybe_body


def _loop_over_kv_blocks(i, block_q, block_k, num_kv_blocks, causal, body, carry):
    """body(j, carry, causal) over the kv blocks q block i can see: all, or up to the diagonal under causal."""
    if not causal:
        return lax.fori_loop(0, num_kv_blocks, lambda j, c: body(j, c, False), carry)
    end = jnp.minimum(num_kv_blocks, lax.div((i + 1) * block_q + block_k - 1, block_k))
    unmasked_end = jnp.minimum(end, lax.div(i * block_q + 1, block_k))  # blocks whose last key <= first query
    return _loop_split_at_diagonal(0, end, unmasked_end, end, body, carry)


def _split_refs(refs, has_ids, has_keys, num_inputs):
    """(inputs, (q_ids_ref, kv_ids_ref), keys_ref, outputs), with the id refs None when there are no segment ids and
    keys_ref None without dropout."""
    refs = list(refs)
    inputs, refs = refs[:num_inputs], refs[num_inputs:]
    ids = (refs.pop(0), refs.pop(0)) if has_ids else (None, None)
    keys_ref = refs.pop(0) if has_keys else None
    return inputs, ids, keys_ref, refs


def _fwd_kernel(*refs, plan, has_ids, has_keys, num_kv_blocks, has_scales=False):
    if has_scales:  # int8 k and v with their per-row scales, after the other inputs
        refs = list(refs)
        ks_ref, vs_ref = refs.pop(3 + 2 * has_ids + has_keys), refs.pop(3 + 2 * has_ids + has_keys)
    (q_ref, k_ref, v_ref), (qid_ref, kid_ref), keys_ref, (o_ref, lse_ref) = _split_refs(refs, has_ids, has_keys, 3)
    bq, bk = plan.blocks.block_q, plan.blocks.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    q_pos = (i * bq + jnp.arange(bq))[:, None]
    q_ids = None if qid_ref is None else qid_ref[...][:, None]
    key = None if keys_ref is None else keys_ref[...]
    qk_scale = plan.sm_scale * _LOG2E

    def visit(j, carry, causal):
        acc, m, l = carry
        kv_slice = pl.ds(j * bk, bk)
        v, k = v_ref[kv_slice, :], k_ref[kv_slice, :]
        if has_scales:  # int8 tiles converted where read; the key scales multiply the logits' columns
            v, k = v.astype(q.dtype), k.astype(q.dtype)
            qk = qk_scale * ks_ref[kv_slice][None, :]
        else:
            qk = qk_scale
        kv_ids = None if kid_ref is None else kid_ref[kv_slice][None, :]
        k_pos = (j * bk + jnp.arange(bk))[None, :]
        s = _masked_logits(q, k, qk, q_pos, k_pos, q_ids, kv_ids, plan, causal)
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
    body = _skip_disjoint(visit, q_ids, kid_ref, bk)
    acc, m, l = _loop_over_kv_blocks(i, bq, bk, num_kv_blocks, plan.causal, body, init)
    visible = m > NEG_INF / 2
    l = jnp.where(visible, l, 1.0)
    o_ref[...] = jnp.where(visible[:, None], acc / l[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(visible, m + jnp.log2(l), jnp.inf)  # +inf: every p recomputed from it is 0


def _dq_kernel(*refs, plan, has_ids, has_keys, num_kv_blocks):
    inputs, (qid_ref, kid_ref), keys_ref, (dq_ref,) = _split_refs(refs, has_ids, has_keys, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    i = pl.program_id(0)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = (i * bq + jnp.arange(bq))[:, None]
    q_ids = None if qid_ref is None else qid_ref[...][:, None]
    key = None if keys_ref is None else keys_ref[...]
    qk_scale = plan.sm_scale * _LOG2E

    def visit(j, dq, causal):
        kv_slice = pl.ds(j * bk, bk)
        k = k_ref[kv_slice, :]
        kv_ids = None if kid_ref is None else kid_ref[kv_slice][None, :]
        k_pos = (j * bk + jnp.arange(bk))[None, :]
        s = _masked_logits(q, k, qk_scale, q_pos, k_pos, q_ids, kv_ids, plan, causal)
        p = jnp.exp2(s - lse[:, None])
        dp = _dot_nt(do, v_ref[kv_slice, :])
        if key is not None:
            dp = dp * dropout_multiplier(key, q_pos, k_pos, plan.dropout_rate)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    body = _skip_disjoint(visit, q_ids, kid_ref, bk)
    dq = _loop_over_kv_blocks(i, bq, bk, num_kv_blocks, plan.causal, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * plan.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, plan, has_ids, has_keys, groups):
    inputs, (qid_ref, kid_ref), keys_ref, (dk_ref, dv_ref) = _split_refs(refs, has_ids, has_keys, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = (j * bk + jnp.arange(bk))[:, None]
    kv_ids = None if kid_ref is None else kid_ref[...][:, None]
    qk_scale = plan.sm_scale * _LOG2E
    num_q_blocks = q_ref.shape[0] // bq

    # Works on transposed blocks ([kv, q]) so that dv = p^T do and dk = ds^T q are plain matmuls.
    def visit(g, i, carry, causal):
        dk, dv = carry
        q_slice = pl.ds(i * bq, bq)
        q, do = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
        q_ids = None if qid_ref is None else qid_ref[q_slice][None, :]
        q_pos = (i * bq + jnp.arange(bq))[None, :]
        s_t = _masked_logits(k, q, qk_scale, q_pos, k_pos, q_ids, kv_ids, plan, causal)
        p_t = jnp.exp2(s_t - lse_ref[g, q_slice][None, :])
        dp_t = _dot_nt(v, do)
        if keys_ref is not None:
            keep = dropout_multiplier(keys_ref[g], q_pos, k_pos, plan.dropout_rate)
            dv = dv + _dot((p_t * keep).astype(do.dtype), do)
            dp_t = dp_t * keep
        else:
            dv = dv + _dot(p_t.astype(do.dtype), do)
        ds_t = p_t * (dp_t - delta_ref[g, q_slice][None, :])
        return dk + _dot(ds_t.astype(q.dtype), q), dv

    def per_head(g, carry):
        body = _skip_disjoint(lambda i, c, causal: visit(g, i, c, causal), kv_ids, qid_ref, bq)
        if not plan.causal:
            return lax.fori_loop(0, num_q_blocks, lambda i, c: body(i, c, False), carry)
        # q blocks ending before this kv block starts see none of it; those starting at or after its last key see
        # all of it.
        first = jnp.minimum(num_q_blocks, lax.div(j * bk, bq))
        unmasked_start = jnp.minimum(num_q_blocks, lax.div(j * bk + bk - 1 + bq - 1, bq))
        return _loop_split_at_diagonal(first, num_q_blocks, first, unmasked_start, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, per_head, (zeros, zeros))
    dk_ref[...] = (dk * plan.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(plan, backward=False):
    b = plan.blocks
    if backward:
        return _CompilerParams(num_warps=b.num_warps_bwd, num_stages=b.num_stages_bwd)
    return _CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages)


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
        (q_ids, kv_ids), (pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                          pl.BlockSpec((None, S), lambda i, b, h: (b, 0))))
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
                                    plan.kv_len, [*ids, *key_ops, *scales]),
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
        (q_ids, kv_ids), (pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                          pl.BlockSpec((None, S), lambda i, b, h: (b, 0))))
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
                                        [*ids, *key_ops]),
        **common,
    )(q, k, v, do, lse, delta, *ids, *key_ops)

    # One program per (kv block, batch, kv head); it reads the whole q/do/lse/delta of the head group.
    q_group = pl.BlockSpec((None, T, G, D), lambda j, b, h: (b, 0, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
    row_group = pl.BlockSpec((None, G, T), lambda j, b, h: (b, h, 0))
    ids, id_specs = _optional_operands(
        (q_ids, kv_ids), (pl.BlockSpec((None, T), lambda j, b, h: (b, 0)),
                          pl.BlockSpec((None, bk), lambda j, b, h: (b, j))))
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
                                         [*ids, *key_ops]),
        **common,
    )(q, k, v, do, lse, delta, *ids, *key_ops)
    return dq, dk, dv
