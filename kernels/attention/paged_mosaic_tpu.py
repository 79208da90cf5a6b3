"""TPU paged attention: a Pallas kernel on Mosaic.

Grid (sequence, kv head, step along the sequence's page blocks). The lengths and the flattened page table are
scalar-prefetched into SMEM, so the index maps pick the pages: each of a block's pages_per_block pages is its own
operand (the pool passed pages_per_block times, each BlockSpec a [page_size, head_dim] tile of page
table[b, block * pages_per_block + p]), which the Pallas pipeline fetches one step ahead. Step s visits the page
block `_paged.block_range`'s first + s, clamped to the last one holding a visible key, so steps past it re-use the
resident pages (no DMA) and `pl.when` skips their compute: a window of w keys reads about w keys' pages. The G query
heads of the kv head are the rows of the query tile (padded to 8 sublanes), the block's pages are stacked into one
[block_keys, head_dim] tile (one matmul per block instead of one per page); the running max, sum and output stay
in VMEM scratch across the steps. int8 pages' scales arrive as one lane-dense row per block, gathered by XLA into
each sequence's token order (the pool's [kv_heads, num_pages, page_size] pads page_size to 128 lanes on TPU).
"""
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.attention import _paged
from kernels.attention.api import _pad
from kernels.attention.mosaic_tpu import _dot, _dot_nt
from kernels.attention.reference import NEG_INF


def _precision(dtype):
    """Full precision for float32 operands (Mosaic's default rounds them to bf16, where the 'xla' path's
    matrix-vector products are exact: kernels/README.md). Decoding is bound by reading the pages, not by these few
    rows' products."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _block(length, step, plan):
    """(the page block that `step` visits, whether it holds visible keys)."""
    first, stop = _paged.block_range(length, plan)
    return jnp.minimum(first + step, jnp.maximum(stop - 1, 0)), first + step < stop


def _kernel(lengths_ref, table_ref, q_ref, *refs, plan, has_scales):
    n = plan.pages_per_block
    k_refs, v_refs, refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    ks_ref, vs_ref, o_ref, m_scr, l_scr, acc_scr = refs if has_scales else (None, None, *refs)
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
        # The block's pages stacked along sublanes (each converted first: int8 packs 32 rows a tile) into one
        # [block_keys, head_dim] tile: one q k^T and one p v per block.
        k, v = (jnp.concatenate([r[...].astype(q.dtype) for r in refs], axis=0) for refs in (k_refs, v_refs))
        pos = block * plan.block_keys + jax.lax.broadcasted_iota(jnp.int32, (1, plan.block_keys), 1)
        s = _paged.masked_logits(_dot_nt(q, k, _precision(q.dtype)), None if ks_ref is None else ks_ref[...], pos,
                                 length, plan)

        def weighted(probs):
            p = probs[0] if vs_ref is None else probs[0] * vs_ref[...]
            return _dot(p.astype(q.dtype), v, _precision(q.dtype))

        m_scr[...], l_scr[...], acc_scr[...] = _paged.online_softmax(m_scr[...], l_scr[...], acc_scr[...], [s],
                                                                     weighted)

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
    # int8 scales gathered into each sequence's token order, [KV, B, 1, max_pages * page_size]: a lane-dense
    # (1, block_keys) row per block (the pool's [KV, num_pages, page_size] pads page_size to 128 lanes on TPU).
    scale_ops = [] if scales is None else [
        s[:, jnp.clip(table, 0, num_pages - 1)].reshape(KV, B, 1, max_pages * ps) for s in scales]
    scale_spec = pl.BlockSpec((None, None, 1, plan.block_keys),
                              lambda b, h, step, lengths_ref, _: (h, b, 0, _block(lengths_ref[b], step, plan)[0]))
    q_spec = pl.BlockSpec((None, None, rows, D), lambda b, h, step, *_: (b, h, 0, 0))
    out = pl.pallas_call(
        lambda *refs: _kernel(*refs, plan=plan, has_scales=scales is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, KV, _paged.num_steps(max_pages, plan)),
            in_specs=[q_spec, *page_specs, *page_specs, *[scale_spec] * len(scale_ops)],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                            pltpu.VMEM((rows, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if plan.interpret else False,
        name="paged_attention",
        cost_estimate=_paged.cost_estimate(H, qg, k_pages, plan, [table, lengths, *scale_ops]),
    )(lengths, table.reshape(-1), qg, *[k_pages] * n, *[v_pages] * n, *scale_ops)
    return out[:, :, :G].reshape(B, H, D)
