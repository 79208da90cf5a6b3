"""GPU paged attention: a Pallas kernel on the Triton backend.

One program per (sequence, kv head): the G query heads of the kv head are the rows of one query tile (padded to
Triton's 16-row minimum), and the program loops over the sequence's page blocks that hold visible keys
(`_paged.block_range`: from the window's first page to the last filled one), gathering each block's
pages_per_block * page_size key and value rows straight from the pool through page-table entries it loads itself,
with an online softmax in float32. int8 pages are converted where read, their scales on the logits' and the
probabilities' columns.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention import _paged
from kernels.attention.api import _pad
from kernels.attention.triton import _CompilerParams, _dot, _dot_nt, _loop
from kernels.attention.reference import NEG_INF

_NUM_WARPS, _NUM_STAGES = 4, 2  # a [16, 128] query tile against 64-key blocks: a small kernel


def _kernel(q_ref, k_ref, v_ref, table_ref, length_ref, *refs, plan, num_pages, has_scales):
    ks_ref, vs_ref, o_ref = refs if has_scales else (None, None, *refs)
    ps, bk = plan.page_size, plan.block_keys
    length = length_ref[...]
    q = q_ref[...]
    offsets = jnp.arange(bk, dtype=jnp.int32)

    def visit(j, carry, on_edge):
        del on_edge
        # Each key row's page (a gather from the table: one entry per row), clamped into the pool: entries past
        # the sequence's pages may hold anything, and their keys are masked.
        pages = jnp.clip(table_ref[j * plan.pages_per_block + lax.div(offsets, ps)], 0, num_pages - 1)
        rows = pages * ps + lax.rem(offsets, ps)
        k, v = k_ref[rows, :], v_ref[rows, :]
        k_scale = None if ks_ref is None else ks_ref[rows][None, :]
        v_scale = None if vs_ref is None else vs_ref[rows][None, :]
        s = _paged.masked_logits(_dot_nt(q, k.astype(q.dtype)), k_scale, (j * bk + offsets)[None, :], length, plan)
        def weighted(probs):
            p = probs[0] if v_scale is None else probs[0] * v_scale
            return _dot(p.astype(q.dtype), v.astype(q.dtype))

        return _paged.online_softmax(*carry, [s], weighted)

    rows = q.shape[0]
    init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    first, stop = _paged.block_range(length, plan)
    o_ref[...] = _paged.finish(*_loop(first, stop, None, visit, init), o_ref.dtype)


def paged_attention(q, k_pages, v_pages, table, lengths, scales, plan):
    """`kernels.attention.paged.paged_attention` of validated operands (table padded to whole blocks, lengths
    clipped, scales float32 or None) on the GPU kernel."""
    B, H, D = q.shape
    KV, num_pages, ps, _ = k_pages.shape
    G = H // KV
    # Triton tiles are powers of two in every dim, at least 16: the query rows and (rarely) the head dim padded
    # with zeros (a padded head dim copies the pool: head dims are powers of two in practice).
    rows, d_pad = max(16, 1 << (G - 1).bit_length()), max(16, 1 << (D - 1).bit_length())
    qg = _pad(_pad(q.reshape(B, KV, G, D), 2, rows), 3, d_pad)
    pool = lambda x: _pad(x, 3, d_pad).reshape(KV, num_pages * ps, d_pad)  # noqa: E731  pages as rows
    scale_ops = [] if scales is None else [s.reshape(KV, num_pages * ps) for s in scales]
    q_spec = pl.BlockSpec((None, None, rows, d_pad), lambda b, h: (b, h, 0, 0))
    pool_spec = pl.BlockSpec((None, num_pages * ps, d_pad), lambda b, h: (h, 0, 0))
    out = pl.pallas_call(
        lambda *refs: _kernel(*refs, plan=plan, num_pages=num_pages, has_scales=scales is not None),
        grid=(B, KV),
        in_specs=[q_spec, pool_spec, pool_spec, pl.BlockSpec((None, table.shape[1]), lambda b, h: (b, 0)),
                  pl.BlockSpec((None,), lambda b, h: (b,)),
                  *[pl.BlockSpec((None, num_pages * ps), lambda b, h: (h, 0))] * len(scale_ops)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=_CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
        interpret=plan.interpret,
        name="paged_attention",
        cost_estimate=_paged.cost_estimate(H, qg, k_pages, plan, [table, lengths, *scale_ops]),
    )(qg, pool(k_pages), pool(v_pages), table, lengths, *scale_ops)
    return out[:, :, :G, :D].reshape(B, H, D)
