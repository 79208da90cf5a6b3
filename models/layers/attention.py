"""Attention: `attend` (the one attention helper), the `Attention` block and its KV cache (`empty_cache`).

The KV cache of a decoder is a dict {'layers': {'k', 'v': [layers, batch, max_len, kv_heads, head_dim]},
'index': int32 scalar (slots written so far), 'segment_ids': int32 [batch, max_len] (0 = empty or padding)}. A call
with a cache writes its tokens at `index`; a call with more than one token is a prefill and must start at index 0.
A layer with a sliding window of W keeps a ring buffer of min(W, max_len) slots instead, token `index` in slot
index % W (what a query may still see: the W newest positions, its own included); a stack whose layers differ holds
{'full': ..., 'sliding': ...} under 'layers', each stacked over its own layers (`empty_cache`).

A paged cache (`models.paged_generate`) holds {'layers': [one {'k_pages', 'v_pages': [kv_heads, num_pages,
page_size, head_dim]} per layer] (int8 pages with float32 'k_scale', 'v_scale' [kv_heads, num_pages, page_size],
`kernels.quantize_kv`; a list: each layer updates its own pool in place), 'page_table': int32 [batch, max_pages],
'lengths': int32 [batch] (tokens cached per row)}:
row b's position p lives in slot p % page_size of page page_table[b, p // page_size]; padding (segment id 0) writes
to the pool's last page, a scratch page no table entry of a live sequence names. A call with more than one token is a
prefill from length 0 (flash attention over its own keys); one token attends through `kernels.paged_attention`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

import kernels
from models.layers.linear import Linear, projection_options
from models.layers.norms import Norm
from models.layers.options import Dtype
from models.layers.parallel import gather_tokens, split_tokens
from models.layers.rotary import Rotary


def attend(q, k, v, *, causal, q_segment_ids=None, kv_segment_ids=None, bias=None, sm_scale=None, window=None,
           logit_soft_cap=None, implementation=None, interpret=False, dropout_rate=0.0, dropout_rng=None):
    """The one attention helper. q [B, T, H, D]; k, v [B, S, KVH, D] (H a multiple of KVH); segment ids int32
    [B, T] / [B, S]: a query sees only keys with its id. window (left, right): query i sees key j only when
    i - left <= j <= i + right (a causal sliding window of W is (W - 1, 0)). logit_soft_cap c: the scaled logits
    become c * tanh(s / c) before masking (Gemma 2). dropout_rate > 0 (with a `dropout_rng` key) drops attention
    probabilities. Returns [B, T, H, D].

    Without `bias` everything goes through kernels.flash_attention. T5's relative position bias is an additive
    [1 or B, H, T, S] term the kernel does not take, so that case runs here in plain jnp (float32 softmax), with the
    kernels' dropout mask (and the window and soft-cap, as the kernel would apply them).
    """
    if bias is None:
        seg = None if q_segment_ids is None else (
            q_segment_ids if kv_segment_ids is None else (q_segment_ids, kv_segment_ids))
        return kernels.flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=sm_scale, window=window,
                                       logit_soft_cap=logit_soft_cap, implementation=implementation,
                                       interpret=interpret, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    if kernels.manual_context_size() > 1:  # its [T, S] bias and masks are the whole rows'
        raise ValueError(f"attention with a bias (T5's relative positions) on a {kernels.manual_context_size()}-way "
                         "token split of the shard_map step; expected step='jit' or 'auto' for this model")
    B, T, H, D = q.shape
    S, KVH = k.shape[1], k.shape[2]
    scale = D ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(B, T, KVH, H // KVH, D)
    # The product in the operands' dtype, then float32 (as transformers' T5 under bf16): a float32 product would make
    # autodiff's backward products float32 matmuls.
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) * scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
    if bias is not None:
        scores = scores + bias.reshape(bias.shape[0], KVH, H // KVH, T, S).astype(jnp.float32)
    mask = jnp.ones((1, T, S), bool)
    if causal:
        mask = jnp.tril(jnp.ones((T, S), bool))[None]  # top-left aligned, as kernels.flash_attention
    if window is not None:
        offset = jnp.arange(S)[None, :] - jnp.arange(T)[:, None]
        mask = mask & ((offset >= -window[0]) & (offset <= window[1]))[None]
    if q_segment_ids is not None:
        kv_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (q_segment_ids[:, :, None] == kv_ids[:, None, :])
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout_rate:
        keys = kernels.dropout_keys(dropout_rng, B, H).reshape(B, KVH, H // KVH, 1, 1)
        probs = probs * kernels.dropout_multiplier(keys, jnp.arange(T)[:, None], jnp.arange(S)[None, :], dropout_rate)
    return jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v).reshape(B, T, H, D)


class Attention(nn.Module):
    """Multi-head / grouped-query attention with projections q, k, v, o and an optional KV cache.

    Call: (x [B, T, d_model], ctx, cache=None, kv_input=None, bias=None, sliding=True) -> (out [B, T, d_model],
    cache). ctx (from `decoder_context`) holds 'positions' and 'segment_ids' [B, T], and with a cache 'cache_index'
    and 'kv_segment_ids' [B, max_len]. kv_input [B, S, d] makes it cross-attention (keys from the encoder, whose
    padding is ctx['encoder_segment_ids']); its keys are computed once and kept in the cache as cross_k / cross_v.
    bias: additive [1 or B, heads, T, keys] (T5), which takes the plain-jnp path of `attend`. dropout_rate drops
    attention probabilities in training calls (deterministic=False, with a 'dropout' rng). qk_norm_eps (Qwen3,
    Gemma 3): each q and k head RMS-normalised over head_dim before rope, scales 'q_norm' / 'k_norm' [head_dim]
    shared by the heads (applied as norm_offset + scale). window W (Mistral, Gemma): a query sees the W newest
    positions, its own included (transformers' sliding_window), in the calls where `sliding` is true; its cache is a
    ring of W slots (module docstring). `sliding` is a bool, or a traced bool inside a layer scan whose layers differ
    (Gemma's local and global layers): then both attentions are compiled under a lax.cond and the rope is chosen per
    layer, rotary_sliding (when given) being the sliding layers' (Gemma 3's local base). logit_soft_cap c: logits
    c * tanh(s / c) (Gemma 2).
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    use_bias: bool = False
    out_bias: bool | None = None  # None: same as use_bias
    qk_norm_eps: float | None = None  # None: no RMSNorm on the q and k heads
    norm_offset: float = 0.0  # the q / k norms' scale is norm_offset + w (`Norm`)
    rotary: Rotary | None = None
    rotary_sliding: Rotary | None = None  # None: `rotary` in sliding layers too
    window: int | None = None
    logit_soft_cap: float | None = None
    sm_scale: float | None = None  # None: head_dim ** -0.5
    std: float = 0.02  # initial weights' standard deviation; q_std and out_std (None: std) for q and o (T5)
    q_std: float | None = None
    out_std: float | None = None
    implementation: str | None = None
    interpret: bool = False
    dropout_rate: float = 0.0
    deterministic: bool = True
    lora_rank: int = 0  # LoRA on the projections in lora_targets, int8 kernels (see `sublayer_options`)
    lora_alpha: float = 16.0
    lora_targets: tuple = ()
    lora_dropout: float = 0.0
    quantize: str | None = None
    fp8: bool = False  # the q, k, v, o matmuls in FP8 (`Linear`)
    fp8_history: int = 0  # their amax histories' length (0: current scaling)
    sequence_parallel: bool = False  # x and the output with tokens split over `model` (`split_tokens`)
    dtype: Dtype | None = None  # None: the projections' kernels' dtype
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, ctx, cache=None, kv_input=None, bias=None, sliding=True):
        x = gather_tokens(x, self.sequence_parallel)
        if kv_input is not None:
            kv_input = gather_tokens(kv_input, self.sequence_parallel)
        B, T, d_model = x.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        sliding = self.window is not None and sliding
        kw = dict(std=self.std, dtype=self.dtype, param_dtype=self.param_dtype)
        q = Linear(d_model, H * D, self.use_bias, name="q", **{**kw, "std": self.q_std or self.std},
                   **projection_options(self, "q"))(x)
        q = self._rope(self._head_norm("q", q.reshape(B, T, H, D)), ctx["positions"], sliding)

        def project_kv(src):
            k = Linear(src.shape[-1], KVH * D, self.use_bias, name="k", **kw, **projection_options(self, "k"))(src)
            v = Linear(src.shape[-1], KVH * D, self.use_bias, name="v", **kw, **projection_options(self, "v"))(src)
            k, v = self._head_norm("k", k.reshape(*src.shape[:2], KVH, D)), v.reshape(*src.shape[:2], KVH, D)
            return self._rope(k, ctx["positions"], sliding), v

        # Initialisation needs only shapes: the plain path, which takes every dtype (cuDNN and Mosaic GPU take only
        # 16-bit inputs, and init traces the model in its parameters' float32).
        implementation = "xla" if self.is_initializing() else self.implementation
        opts = dict(sm_scale=self.sm_scale, implementation=implementation, interpret=self.interpret, bias=bias,
                    logit_soft_cap=self.logit_soft_cap)
        if self.dropout_rate and not self.deterministic:
            opts.update(dropout_rate=self.dropout_rate, dropout_rng=self.make_rng("dropout"))
        if kv_input is not None:
            # Cross-attention: a query of sequence s sees the encoder tokens of sequence s (ids > 0; 0 is padding)
            # so packed pairs stay apart; with 0/1 masks every query, padding included as in transformers, sees
            # every encoder token.
            if cache is not None and "cross_k" in cache:
                k, v = cache["cross_k"], cache["cross_v"]
            else:
                k, v = project_kv(kv_input)
            if cache is not None:
                cache = {**cache, "cross_k": k, "cross_v": v}
            q_ids = jnp.ones((B, T), jnp.int32) if ctx["segment_ids"] is None else jnp.maximum(ctx["segment_ids"], 1)
            out = attend(q, k, v, causal=False, q_segment_ids=q_ids,
                         kv_segment_ids=ctx["encoder_segment_ids"].astype(jnp.int32), **opts)
        else:
            k, v = project_kv(x)
            quantized = cache is not None and "k_scale" in cache  # an int8 cache (`empty_cache`)
            paged = cache is not None and "k_pages" in cache  # a paged cache (module docstring)
            if paged:
                cache = _write_pages(cache, k, v, ctx)
            elif cache is not None:
                idx = ctx["cache_index"]
                write = lambda buf, x: _write_slots(buf, x, idx)  # noqa: E731
                if quantized:
                    (k8, k_scale), (v8, v_scale) = kernels.quantize_kv(k), kernels.quantize_kv(v)
                    cache = {**cache, "k": write(cache["k"], k8), "v": write(cache["v"], v8),
                             "k_scale": write(cache["k_scale"], k_scale), "v_scale": write(cache["v_scale"], v_scale)}
                else:
                    cache = {**cache, "k": write(cache["k"], k), "v": write(cache["v"], v)}
            if paged and T == 1:
                out = self._paged_decode(q, cache, ctx, sliding, opts)
            elif cache is not None and T == 1:  # decode step: every filled slot of the cache (a ring's slots are
                # all within the window), the cache split across programs and a kv head's query heads read together
                # (kernels.decode_attention); T5's relative position bias goes through `attend`
                kv_seg = _slot_segment_ids(ctx["kv_segment_ids"], ctx["cache_index"] + T, cache["k"].shape[1])
                out = self._decode(q, cache, quantized, (ctx["segment_ids"], kv_seg), opts)
            else:  # training / prefill (a prefill starts at cache index 0, so the fresh keys are all there is)
                def attend_within(window):
                    return attend(q, k, v, causal=self.causal, q_segment_ids=ctx["segment_ids"], window=window,
                                  **opts)

                if isinstance(sliding, bool):
                    out = attend_within((self.window - 1, 0) if sliding else None)
                else:
                    out = jax.lax.cond(sliding, lambda: attend_within((self.window - 1, 0)),
                                       lambda: attend_within(None))
        out = out.reshape(B, T, H * D)
        out_bias = self.use_bias if self.out_bias is None else self.out_bias
        out = Linear(H * D, d_model, out_bias, name="o", **{**kw, "std": self.out_std or self.std},
                     **projection_options(self, "o"))(out)
        return split_tokens(out, self.sequence_parallel), cache

    def _decode(self, q, cache, quantized, segment_ids, opts):
        """A decode step's attention over the cache's filled slots."""
        if opts["bias"] is None:
            scales = dict(k_scale=cache["k_scale"], v_scale=cache["v_scale"]) if quantized else {}
            return kernels.decode_attention(
                q, *((cache["k"], cache["v"]) if quantized else (cache["k"].astype(q.dtype),
                                                                cache["v"].astype(q.dtype))),
                segment_ids=segment_ids, sm_scale=self.sm_scale, logit_soft_cap=self.logit_soft_cap,
                implementation=self.implementation, interpret=self.interpret, **scales)
        read = (lambda n: (cache[n].astype(jnp.float32) * cache[f"{n}_scale"][..., None]).astype(q.dtype)
                ) if quantized else (lambda n: cache[n].astype(q.dtype))
        return attend(q, read("k"), read("v"), causal=False, q_segment_ids=segment_ids[0],
                      kv_segment_ids=segment_ids[1], **opts)

    def _paged_decode(self, q, cache, ctx, sliding, opts):
        """A decode step's attention through the page table (`kernels.paged_attention`), the window's pages only."""
        def read(window):
            scales = {n: cache[n] for n in ("k_scale", "v_scale") if n in cache}  # int8 pages
            out = kernels.paged_attention(q[:, 0], cache["k_pages"], cache["v_pages"], ctx["page_table"],
                                          ctx["lengths"] + 1, **scales, scale=self.sm_scale, window=window,
                                          logit_soft_cap=self.logit_soft_cap, implementation=self.implementation,
                                          interpret=self.interpret)
            return out[:, None]

        if opts["bias"] is not None:
            raise ValueError("a paged cache with a relative position bias (T5); expected a decoder-only model")
        if isinstance(sliding, bool):
            return read((self.window - 1, 0) if sliding else None)
        return jax.lax.cond(sliding, lambda: read((self.window - 1, 0)), lambda: read(None))

    def _rope(self, x, positions, sliding):
        """x [B, T, heads, head_dim] rotated by this layer's rope (`rotary_sliding` where `sliding`)."""
        if self.rotary is None:
            return x
        if self.rotary_sliding is None or isinstance(sliding, bool):
            return (self.rotary_sliding if sliding is True and self.rotary_sliding else self.rotary)(x, positions)
        (inv_s, att_s), (inv, att) = self.rotary_sliding.frequencies(positions), self.rotary.frequencies(positions)
        return self.rotary.rotate(x, positions, jnp.where(sliding, inv_s, inv), jnp.where(sliding, att_s, att))

    def _head_norm(self, name, x):
        """x [B, T, heads, head_dim], with qk_norm_eps RMS-normalised per head ('q_norm' / 'k_norm')."""
        if self.qk_norm_eps is None:
            return x
        return Norm("rms", self.qk_norm_eps, offset=self.norm_offset, name=f"{name}_norm", dtype=self.dtype,
                    param_dtype=self.param_dtype)(x)


def _write_slots(buf, new, index):
    """buf [B, slots, ...] with new [B, T, ...] written at positions index .. index + T - 1, position p in slot
    p % slots (a whole-length cache: slot p; a ring: of a prefill longer than the ring, its last `slots` tokens)."""
    slots, T = buf.shape[1], new.shape[1]
    new = new.astype(buf.dtype)
    if T > slots:  # a prefill (index 0) longer than a sliding layer's ring
        return jnp.roll(new[:, T - slots:], (T - slots) % slots, axis=1)
    return jax.lax.dynamic_update_slice(buf, new, (0, index % slots) + (0,) * (buf.ndim - 2))


def _write_pages(cache, k, v, ctx):
    """The paged cache with k, v [B, T, kv_heads, head_dim] written at positions lengths .. lengths + T - 1 of each
    row; padding tokens and idle rows (segment id 0) go to the scratch page (the pool's last)."""
    T = k.shape[1]
    num_pages, page_size = cache["k_pages"].shape[1:3]
    table = ctx["page_table"]
    pos = ctx["lengths"][:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    index = jnp.clip(pos // page_size, 0, table.shape[1] - 1)
    page = jnp.where(ctx["segment_ids"] > 0, jnp.take_along_axis(table, index, axis=1), num_pages - 1)
    slot = pos % page_size

    def write(pool, x):  # pool[:, page, slot] is [kv_heads, B, T, ...]
        return pool.at[:, page, slot].set(jnp.moveaxis(x, 2, 0).astype(pool.dtype))

    if "k_scale" not in cache:
        return {**cache, "k_pages": write(cache["k_pages"], k), "v_pages": write(cache["v_pages"], v)}
    (k8, k_scale), (v8, v_scale) = kernels.quantize_kv(k), kernels.quantize_kv(v)
    return {**cache, "k_pages": write(cache["k_pages"], k8), "v_pages": write(cache["v_pages"], v8),
            "k_scale": write(cache["k_scale"], k_scale), "v_scale": write(cache["v_scale"], v_scale)}


def _slot_segment_ids(kv_segment_ids, written, slots):
    """The segment ids [B, slots] of a cache's slots once `written` positions are in it: a ring's slot s holds the
    newest position p < written with p % slots == s (none, id 0, when s >= written)."""
    if slots == kv_segment_ids.shape[1]:
        return kv_segment_ids
    s = jnp.arange(slots)
    p = s + slots * ((written - 1 - s) // slots)
    return jnp.where(p >= 0, kv_segment_ids[:, jnp.maximum(p, 0)], 0)


def empty_cache(num_layers, batch, max_len, kv_heads, head_dim, dtype, *, window=None, sliding=None):
    """Zeroed decoder cache (see the module docstring for the layout). dtype int8: keys and values stored as int8
    with a float32 scale per token and head (`k_scale`, `v_scale` [layers, batch, max_len, kv_heads];
    `kernels.quantize_kv`), half of bf16's bytes, read as int8 by `kernels.decode_attention`. window: the sliding
    window of the layers flagged in `sliding` (one bool per layer; None: every layer), whose buffers hold
    min(window, max_len) slots; when only some layers slide, 'layers' is {'full', 'sliding'}, each stacked over its
    own layers in order."""
    def stack(n, length):
        shape = (n, batch, length, kv_heads, head_dim)
        layer = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
        if jnp.dtype(dtype) == jnp.int8:
            layer.update(k_scale=jnp.ones(shape[:-1], jnp.float32), v_scale=jnp.ones(shape[:-1], jnp.float32))
        return layer

    sliding = (True,) * num_layers if sliding is None else tuple(sliding)
    ring = max_len if window is None else min(window, max_len)
    if window is None or not any(sliding):
        layers = stack(num_layers, max_len)
    elif all(sliding):
        layers = stack(num_layers, ring)
    else:
        layers = {"full": stack(sliding.count(False), max_len), "sliding": stack(sliding.count(True), ring)}
    return {"layers": layers, "index": jnp.zeros((), jnp.int32),
            "segment_ids": jnp.zeros((batch, max_len), jnp.int32)}
