"""`paged_attention`: one decoding step's attention to a paged KV cache (vLLM's PagedAttention), with its `'xla'`
reference; the kernels are `paged_triton.py` (GPU) and `paged_mosaic_tpu.py` (TPU), their shared math `_paged.py`.

Layout: one pool of pages per layer, k_pages / v_pages [kv_heads, num_pages, page_size, head_dim], as JAX's TPU
paged_attention lays it out: a (kv head, page) is one contiguous [page_size, head_dim] tile, a single DMA on TPU
and page_size contiguous rows of one gather on GPU. Sequence b's token t lives in slot t % page_size of page
page_table[b, t // page_size].
"""
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from kernels import _partition
from kernels.attention import _paged, paged_mosaic_tpu, paged_triton
from kernels.attention.api import (_DTYPES, _implementation, _validate_kv_scales, _validate_soft_cap,
                                   _validate_window)
from kernels.attention.reference import NEG_INF

_KERNELS = {"triton": paged_triton, "mosaic_tpu": paged_mosaic_tpu}
# Keys per page block by default: Triton's forward attention tile (64 keys at head_dim 128); on TPU each page of a
# block is its own pipelined DMA, so blocks of up to 16 pages and 512 keys amortise the grid step's fixed cost.
_BLOCK_KEYS = {"xla": 512, "triton": 64, "mosaic_tpu": 512}
_MAX_PAGES_PER_BLOCK = {"xla": 64, "triton": 64, "mosaic_tpu": 16}


def paged_attention(q, k_pages, v_pages, page_table, lengths, *, k_scale=None, v_scale=None, scale=None,
                    logit_soft_cap=None, window=None, implementation=None, interpret=False, pages_per_block=None):
    """Attention of each sequence's new token to its cached tokens, read through a page table.

    Args:
      q: [batch, heads, head_dim], one new token per sequence; float32, bfloat16 or float16.
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], the layer's pool, q's dtype or int8 (with
        k_scale / v_scale); heads % kv_heads == 0 (query head h reads kv head h // (heads // kv_heads)).
      page_table: int32 [batch, max_pages_per_seq]: sequence b's token t is in slot t % page_size of page
        page_table[b, t // page_size]. Entries past a sequence's pages are never used (any value).
      lengths: int32 [batch]: tokens in each sequence's cache, the new token's key and value included (written by
        the caller); 0 gives zeros. Clipped to max_pages_per_seq * page_size.
      k_scale, v_scale: with int8 pages (`kernels.quantize_kv` of the pages), float [kv_heads, num_pages,
        page_size]: k = k_int8 * k_scale per token and head, likewise v.
      scale: logit scale; default 1 / sqrt(head_dim).
      logit_soft_cap: None or c > 0: logits s become c * tanh(s / c) (Gemma 2).
      window: None or `flash_attention`'s (left, right): the new token (position length - 1) sees the tokens
        length - 1 - left ... length - 1 (right has nothing to its right to act on). Mistral's and Gemma's window
        of W keys is (W - 1, 0). Only the pages covering them are read.
      implementation: None (the backend's), 'xla', 'triton' or 'mosaic_tpu'; interpret: Pallas's interpreter.
      pages_per_block: pages each step of a kernel's loop reads (default about `_BLOCK_KEYS` keys); Triton needs
        pages_per_block * page_size a power of two >= 16.
    Returns:
      [batch, heads, head_dim] in q's dtype, float32 softmax. Forward only.
    """
    scales = _validate(q, k_pages, v_pages, page_table, lengths, k_scale, v_scale, scale, interpret)
    window, logit_soft_cap = _validate_window(window), _validate_soft_cap(logit_soft_cap)
    impl = _implementation(implementation, interpret)
    B, H, D = q.shape
    KV, num_pages, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    ppb = _pages_per_block(pages_per_block, impl, page_size, max_pages)
    plan = _paged.Plan(implementation=impl, scale=float(D**-0.5 if scale is None else scale),
                       logit_soft_cap=logit_soft_cap, window_left=None if window is None else window[0],
                       page_size=page_size, pages_per_block=ppb, interpret=interpret,
                       max_keys=max_pages * page_size)
    # Whole blocks of table entries (the padding is never read: it lies past every length).
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, -max_pages % ppb)))
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_pages * page_size)
    scales = None if scales is None else tuple(s.astype(jnp.float32) for s in scales)
    if impl == "xla":
        return _reference(q, k_pages, v_pages, table, lengths, scales, plan)
    return _on_mesh(q, k_pages, v_pages, table, lengths, scales, plan)


def _on_mesh(q, k_pages, v_pages, table, lengths, scales, plan):
    """The kernel on the ambient mesh's automatic axes (kernels/_partition.py): sequences over the batch axes and
    kv heads (with their query heads and their part of the pool) over `model`, where they divide. The pool is
    whole on every device of the batch axes: any sequence may own any page."""
    H, KV = q.shape[1], k_pages.shape[0]
    axes = _partition.auto_axes(plan.implementation)
    b, m = _partition.batch_axes(axes, q.shape[0]), _partition.model_axis(axes, H, KV)
    P = jax.sharding.PartitionSpec
    scales = () if scales is None else scales
    kernel = _KERNELS[plan.implementation].paged_attention
    return _partition.shard(lambda q, k, v, table, lengths, *scales: kernel(q, k, v, table, lengths, scales or None,
                                                                            plan),
                            (q, k_pages, v_pages, table, lengths, *scales),
                            (P(b, m, None), *[P(m, None, None, None)] * 2, P(b, None), P(b),
                             *[P(m, None, None)] * len(scales)), P(b, m, None), plan.implementation)


def _reference(q, k_pages, v_pages, table, lengths, scales, plan):
    """The 'xla' path: a `lax.scan` over the page-table blocks, each gathering its pages for every sequence
    ([kv_heads, batch, block_keys, head_dim]) and folding them into an online softmax in float32."""
    B, H, D = q.shape
    KV, num_pages = k_pages.shape[:2]
    G, bk = H // KV, plan.block_keys
    qg = q.reshape(B, KV, G, D).astype(jnp.float32)
    blocks = table.reshape(B, -1, plan.pages_per_block).transpose(1, 0, 2)  # [steps, B, ppb]
    dot = dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    def gather(pool, pages):  # [KV, num_pages, ps, ...] -> [B, KV, bk, ...] float32
        x = pool[:, pages].reshape(KV, B, bk, *pool.shape[3:])
        return jnp.swapaxes(x, 0, 1).astype(jnp.float32)

    def step(carry, block):
        j, pages = block
        pages = jnp.clip(pages, 0, num_pages - 1)
        k, v = gather(k_pages, pages), gather(v_pages, pages)
        k_scale, v_scale = (None, None) if scales is None else (gather(s, pages)[:, :, None] for s in scales)
        pos = j * bk + jnp.arange(bk)
        s = _paged.masked_logits(jnp.einsum("bkgd,bksd->bkgs", qg, k, **dot), k_scale, pos,
                                 lengths[:, None, None, None], plan)
        weighted = lambda probs: jnp.einsum(  # noqa: E731
            "bkgs,bksd->bkgd", probs[0] if v_scale is None else probs[0] * v_scale, v, **dot)
        return _paged.online_softmax(*carry, [s], weighted), None

    init = (jnp.full((B, KV, G, 1), NEG_INF, jnp.float32), jnp.zeros((B, KV, G, 1), jnp.float32),
            jnp.zeros((B, KV, G, D), jnp.float32))
    (m, l, acc), _ = lax.scan(step, init, (jnp.arange(blocks.shape[0]), blocks))
    return _paged.finish(m, l, acc, q.dtype).reshape(B, H, D)


def _pages_per_block(pages_per_block, impl, page_size, max_pages):
    if pages_per_block is None:
        ppb = max(1, min(_MAX_PAGES_PER_BLOCK[impl], _BLOCK_KEYS[impl] // page_size))
        if impl == "triton":  # the smallest power of two of pages covering the table, at least 16 keys
            ppb = max(min(ppb, 1 << (max_pages - 1).bit_length()), -(-16 // page_size))
        else:
            ppb = min(ppb, max_pages)
    elif isinstance(pages_per_block, bool) or not isinstance(pages_per_block, numbers.Integral) or pages_per_block < 1:
        raise ValueError(f"pages_per_block={pages_per_block!r}; expected None or a positive int")
    else:
        ppb = int(pages_per_block)
    keys = ppb * page_size
    if impl == "triton" and (keys < 16 or keys & (keys - 1)):
        raise ValueError(f"pages_per_block={ppb} with page_size={page_size}; implementation='triton' expected "
                         "pages_per_block * page_size a power of two >= 16")
    return ppb


def _validate(q, k_pages, v_pages, page_table, lengths, k_scale, v_scale, scale, interpret):
    """Raises ValueError on bad input; returns None or the int8 pages' (k_scale, v_scale)."""
    if getattr(q, "ndim", None) != 3 or q.dtype not in _DTYPES:
        raise ValueError(f"q of shape {getattr(q, 'shape', None)} and dtype {getattr(q, 'dtype', None)}; expected "
                         "[batch, heads, head_dim] in float32, bfloat16 or float16")
    B, H, D = q.shape
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if getattr(x, "ndim", None) != 4 or x.shape[3] != D or H % x.shape[0]:
            raise ValueError(f"{name}.shape={getattr(x, 'shape', None)}; expected [kv_heads, num_pages, page_size, "
                             f"head_dim={D}] with heads={H} divisible by kv_heads")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages.shape={k_pages.shape}, v_pages.shape={v_pages.shape}; expected equal shapes")
    if getattr(page_table, "ndim", None) != 2 or page_table.shape[0] != B or page_table.shape[1] < 1 \
            or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table of shape {getattr(page_table, 'shape', None)} and dtype "
                         f"{getattr(page_table, 'dtype', None)}; expected int32 [batch={B}, max_pages_per_seq >= 1]")
    if tuple(getattr(lengths, "shape", ())) != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths of shape {getattr(lengths, 'shape', None)} and dtype "
                         f"{getattr(lengths, 'dtype', None)}; expected int32 [batch={B}]")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or scale <= 0):
        raise ValueError(f"scale={scale!r}; expected None or a positive float")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret={interpret!r}; expected a bool")
    if k_pages.dtype != jnp.int8 and v_pages.dtype != jnp.int8 and (k_pages.dtype != q.dtype
                                                                     or v_pages.dtype != q.dtype):
        raise ValueError(f"k_pages.dtype={k_pages.dtype}, v_pages.dtype={v_pages.dtype}; expected q's dtype "
                         f"{q.dtype} or int8")
    return _validate_kv_scales(k_pages, v_pages, k_scale, v_scale, names=("k_pages", "v_pages"), what="int8 pages",
                               layout="[kv_heads, num_pages, page_size]")

