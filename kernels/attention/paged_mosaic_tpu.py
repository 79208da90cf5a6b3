"""TPU paged attention: a Pallas kernel on Mosaic.

Grid (sequence, kv head, step along the sequence's page blocks). The lengths and the flattened page table are
scalar-prefetched into SMEM, so the index maps pick the pages: each of a block's pages_per_block pages is its own
operand (the pool passed pages_per_block times, each BlockSpec a [page_size, head_dim] tile of page
table[b, block * pages_per_block + p]), which the Pallas pipeline fetches one step ahead. Step s visits the page
block `_paged.block_range`'s first + s, clamped to the last one holding a visible key, so steps past it re-use the
resident pages (no DMA) and `pl.when` skips their compute: a window of w keys reads about w keys' pages. The G query
heads of the kv head are the rows of the query tile (padded to 8 sublanes); the running max, sum and output stay in
VMEM scratch across the steps.
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.attention import _paged
from kernels.attention.api import _pad
from kernels.attention.mosaic_tpu import _dot, _dot_nt
from kernels.attention.reference import NEG_INF


def _block(length, step, plan):
    """(the page block that `step` visits, whether it holds visible keys)."""
    first, stop = _paged.block_range(length, plan)
    return jnp.minimum(first + step, jnp.maximum(stop - 1, 0)), first + step < stop


def _kernel(lengths_ref, table_ref, q_ref, *refs, plan, has_scales):
    n = plan.pages_per_block
    k_refs, v_refs, refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    (ks_refs, vs_refs, refs) = (refs[:n], refs[n:2 * n], refs[2 * n:]) if has_scales else ((None,) * n,) * 2 + (refs,)
    o_ref, m_scr, l_scr, acc_scr = refs
    b, step = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    block, in_range = _block(length, step, plan)

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(in_range)
    def _visit():
        q = q_ref[...]
        pos = jax.lax.broadcasted_iota(jnp.int32, (1, plan.page_size), 1)
        # The block's pages as separate [rows, page_size] logit tiles under one running max: one rescale per block,
        # no lane concatenation of 16-wide tiles.
        logits = [_paged.masked_logits(_dot_nt(q, k_refs[p][...].astype(q.dtype)),
                                       None if ks_refs[p] is None else ks_refs[p][...],
                                       (block * n + p) * plan.page_size + pos, length, plan) for p in range(n)]

        def weighted(probs):
            total = 0.0
            for p, v_ref, vs_ref in zip(probs, v_refs, vs_refs):
                p = p if vs_ref is None else p * vs_ref[...]
                total = total + _dot(p.astype(q.dtype), v_ref[...].astype(q.dtype))
            return total

        m, l, acc = _paged.online_softmax(m_scr[...], l_scr[...], acc_scr[...], logits, weighted)
        m_scr[...], l_scr[...], acc_scr[...] = m, l, acc

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = _paged.finish(m_scr[...], l_scr[...], acc_scr[...], o_ref.dtype)


def paged_attention(q, k_pages, v_pages, table, lengths, scales, plan):
    """`kernels.attention.paged.paged_attention` of validated operands (table padded to whole blocks, lengths
    clipped, scales float32 or None) on the TPU kernel."""
    B, H, D = q.shape
    KV, num_pages, ps, _ = k_pages.shape
    G, n = H // KV, plan.pages_per_block
    rows = -(-G // 8) * 8
    qg = _pad(q.reshape(B, KV, G, D), 2, rows)
    max_pages = table.shape[1]

    def page(p):
        def index(b, h, step, lengths_ref, table_ref):
            block, _ = _block(lengths_ref[b], step, plan)
            return h, jnp.clip(table_ref[b * max_pages + block * n + p], 0, num_pages - 1), 0, 0
        return index

    page_specs = [pl.BlockSpec((None, None, ps, D), page(p)) for p in range(n)]
    # Scales [KV, num_pages, page_size] as [KV, num_pages, 1, page_size]: a (1, page_size) row per page.
    scale_ops = [] if scales is None else [s[:, :, None, :] for s in scales for _ in range(n)]
    scale_specs = [] if scales is None else [
        pl.BlockSpec((None, None, 1, ps), page(p)) for _ in scales for p in range(n)]
    q_spec = pl.BlockSpec((None, None, rows, D), lambda b, h, step, *_: (b, h, 0, 0))
    out = pl.pallas_call(
        lambda *refs: _kernel(*refs, plan=plan, has_scales=scales is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, KV, _paged.num_steps(max_pages, plan)),
            in_specs=[q_spec, *page_specs, *page_specs, *scale_specs],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                            pltpu.VMEM((rows, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if plan.interpret else False,
        name="paged_attention",
        cost_estimate=_paged.cost_estimate(H, qg, k_pages, plan, [table, lengths, *(scales or ())]),
    )(lengths, table.reshape(-1), qg, *[k_pages] * n, *[v_pages] * n, *scale_ops)
    return out[:, :, :G].reshape(B, H, D)
