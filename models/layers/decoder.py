"""The decoder-only shell every decoder family shares (`DecoderLM`), its ends (token embedding, output head) and
per-call context, and `stack_layers` (an unscanned decoder's parameters in the scanned layout a pipeline splits)."""
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import kernels
from models.layers.attention import empty_cache
from models.layers.linear import Linear
from models.layers.norms import Norm
from models.layers.options import compute_dtype, config_dtype
from models.layers.parallel import gather_tokens, split_tokens
from models.layers.rotary import segment_positions
from models.layers.stack import apply_layers, layer_major, stored_form, stored_rounds


def decoder_context(input_ids, attention_mask, positions, cache):
    """Builds the per-call context for a (cached) decoder.

    attention_mask int [B, T]: 0 = padding, 1 = token; larger ids mark packed sequences (a token sees only its own
    sequence); None without a cache: every row one whole sequence, ctx 'segment_ids' None (attention takes no
    segment ids: the defaults table's unsegmented class, cuDNN's unmasked path where it measured that fastest).
    Positions default to the position within the sequence, counting the tokens already in the cache. A paged cache
    (with 'page_table') gives row b positions lengths[b] + t and ctx 'page_table' / 'lengths'.
    Returns (ctx, cache without 'layers' but with index / segment ids (or lengths) advanced, or None)."""
    B, T = input_ids.shape
    if cache is None:
        seg = None if attention_mask is None else attention_mask.astype(jnp.int32)
        return {"segment_ids": seg, "positions": _token_positions(seg, B, T) if positions is None else positions}, None
    seg = jnp.ones((B, T), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
    ctx = {"segment_ids": seg}
    if "page_table" in cache:  # a paged cache (models/layers/attention.py): each row continues at its own length
        lengths = cache["lengths"]
        if positions is None:
            positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        ctx.update(positions=positions, page_table=cache["page_table"], lengths=lengths)
        added = jnp.sum(seg > 0, axis=1, dtype=jnp.int32)
        return ctx, {"page_table": cache["page_table"], "lengths": lengths + added}
    idx = cache["index"]
    if positions is None:
        seen = jnp.sum(cache["segment_ids"] > 0, axis=1, dtype=jnp.int32)
        positions = seen[:, None] + segment_positions(seg)
    kv_seg = jax.lax.dynamic_update_slice(cache["segment_ids"], seg, (0, idx))
    ctx.update(positions=positions, cache_index=idx, kv_segment_ids=kv_seg)
    return ctx, {"index": idx + T, "segment_ids": kv_seg}


def _token_positions(seg, B, T):
    """`segment_positions(seg)` (seg None: B whole rows of T tokens, positions 0 ... T - 1); inside the engine's
    shard_map step on a context mesh, where seg [B, T/C] is this device's slice of its rows, the positions of those
    tokens in the whole rows (from the rows' segment ids, a few ints per token, gathered over `context`)."""
    context = kernels.manual_context_size()
    if seg is None:
        start = 0 if context == 1 else jax.lax.axis_index(kernels.CONTEXT_AXIS) * T
        return jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    if context == 1:
        return segment_positions(seg)
    whole = segment_positions(jax.lax.all_gather(seg, kernels.CONTEXT_AXIS, axis=1, tiled=True))
    c = jax.lax.axis_index(kernels.CONTEXT_AXIS)
    return jax.lax.dynamic_slice_in_dim(whole, c * seg.shape[1], seg.shape[1], axis=1)


def token_embedding(vocab_size, features, *, std=0.02, name=None, dtype=None, param_dtype=jnp.float32):
    """Token embedding table 'embedding' [vocab, features] (dtype None: vectors in the table's dtype)."""
    return nn.Embed(vocab_size, features, embedding_init=nn.initializers.normal(std), dtype=dtype,
                    param_dtype=param_dtype, name=name)


def lm_output(x, embed, tied, new_cache, layer_cache, return_hidden, *, head_bias=False, logit_soft_cap=None,
              std=0.02, dtype=None, param_dtype=jnp.float32):
    """Final projection of a decoder (call from its compact method). Tied heads reuse the embedding table; an untied
    head is 'lm_head' [d_model, vocab]. logit_soft_cap c: logits c * tanh(logits / c) (Gemma 2). Returns float32
    logits [B, T, vocab] (or the hidden states [B, T, d_model] when return_hidden, for a fused linear +
    cross-entropy, which then has to apply the soft-cap), plus the updated cache when there is one."""
    if tied:
        head = embed.attend
    else:
        linear = Linear(x.shape[-1], embed.num_embeddings, head_bias, std=std, dtype=dtype, param_dtype=param_dtype,
                        name="lm_head")
        _ = linear.kernel  # create the head's parameters even when only hidden states are returned
        head = linear
    out = x if return_hidden else head(x).astype(jnp.float32)
    if logit_soft_cap is not None and not return_hidden:
        out = logit_soft_cap * jnp.tanh(out / logit_soft_cap)
    if new_cache is None:
        return out
    return out, {**new_cache, "layers": layer_cache}


class DecoderLM(nn.Module):
    """The shell every decoder-only family shares: token (+ learned position) embeddings -> blocks -> final norm ->
    head. A family subclasses it and sets `block` (its layer), `norm_kind`, `head_bias` and, for OPT,
    `position_offset`; its config provides num_layers, hidden_size, vocab_size, norm_eps, initializer_range,
    tie_word_embeddings, kv_heads and dim_per_head (and optionally embed_dim, final_layer_norm,
    layer_norm_elementwise_affine, max_position_embeddings, and the LLaMA layout's options: norm_offset (norms scale
    by offset + w), scale_embeddings (embeddings times sqrt(hidden_size) in the compute dtype, as transformers'
    Gemma), final_logit_softcap, sliding_window and sliding_layers (one bool per layer; where they differ each block
    gets {'sliding': its flag}, `apply_layers`)).

    __call__(input_ids [B, T], attention_mask [B, T] | None, *, positions, cache, return_hidden, train) -> logits
    [B, T, vocab] float32, or (logits, cache) when a cache (from init_cache) is passed; see decoder_context for the
    mask and the positions. train=True applies dropout (config.dropout_rate) and needs a 'dropout' rng. Blocks take
    a `deterministic` attribute (False in training calls).

    loss_tail (loss_fn, inputs): the call returns loss_fn(logits, inputs, params) instead of the logits, where
    loss_fn(logits [b, T, vocab] of some rows, or with return_hidden their hidden states [b, T, D] (for a fused head +
    loss), those rows of the pytree `inputs` of [B, ...] arrays, the model's parameters but the layer stack's (the
    head's among them)) -> (loss, aux) is a sum over rows. The 1F1B pipeline (config.pipeline_schedule='1f1b') needs
    it: it runs the final norm, the head and loss_fn per micro-batch inside the pipeline (`apply_layers`) and returns
    (loss, aux) summed over the micro-batches.
    hidden_states [B, T, D]: the layer stack's output, given instead of input_ids: the call runs only what follows
    the stack (that per-micro-batch tail)."""
    config: Any
    block = None
    norm_kind = "rms"
    head_bias = False
    position_offset = None  # learned absolute positions, read at position + offset (OPT)
    embed_dropout = False  # dropout after the embeddings in training calls (OPT, GPT-J)

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, *, positions=None, cache=None, return_hidden=False,
                 train=False, loss_tail=None, hidden_states=None):
        c = self.config
        kw = dict(dtype=config_dtype(c), param_dtype=jnp.dtype(c.param_dtype))
        lin = dict(std=c.initializer_range, **kw)
        embed_dim = getattr(c, "embed_dim", c.hidden_size)
        affine = getattr(c, "layer_norm_elementwise_affine", True)
        embed = token_embedding(c.vocab_size, embed_dim, name="embed", **lin)
        if hidden_states is None:
            x, new_cache, layer_cache = self._stack(input_ids, attention_mask, positions, cache, train, embed,
                                                    loss_tail, return_hidden, lin)
            if isinstance(x, tuple):  # the 1F1B pipeline's (loss, aux): the tail ran inside it
                return x
        else:
            x, new_cache, layer_cache = hidden_states, None, None
        if getattr(c, "final_layer_norm", True):
            x = Norm(self.norm_kind, c.norm_eps, use_scale=affine, offset=getattr(c, "norm_offset", 0.0),
                     name="final_norm", **kw)(x)
        x = gather_tokens(x, c.sequence_parallel)
        if embed_dim != c.hidden_size:
            x = Linear(c.hidden_size, embed_dim, name="project_out", **lin)(x)
        out = lm_output(x, embed, c.tie_word_embeddings, new_cache, layer_cache, return_hidden,
                        head_bias=self.head_bias, logit_soft_cap=getattr(c, "final_logit_softcap", None), **lin)
        if loss_tail is None or hidden_states is not None:
            return out
        return loss_tail[0](out, loss_tail[1], self.variables["params"])

    def _stack(self, input_ids, attention_mask, positions, cache, train, embed, loss_tail, return_hidden, lin):
        """(the layer stack's output, or the 1F1B pipeline's (loss, aux), the cache without 'layers' or None, the
        layers' cache or None): the embeddings and the stack of __call__."""
        c = self.config
        embed_dim = getattr(c, "embed_dim", c.hidden_size)
        ctx, new_cache = decoder_context(input_ids, attention_mask, positions, cache)
        x = embed(input_ids)
        if getattr(c, "scale_embeddings", False):
            x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
        if embed_dim != c.hidden_size:
            x = Linear(embed_dim, c.hidden_size, name="project_in", **lin)(x)
        if self.position_offset is not None:
            table = token_embedding(c.max_position_embeddings + self.position_offset, c.hidden_size,
                                    name="embed_positions", **lin)
            x = x + table(ctx["positions"] + self.position_offset)
        if self.embed_dropout:
            x = nn.Dropout(c.dropout_rate, deterministic=not train)(x)
        sliding = sliding_layers(c)
        if loss_tail is not None:  # what follows the stack, as a function of the parameters (the 1F1B pipeline's)
            model, (loss_fn, inputs) = self.clone(parent=None), loss_tail
            loss_tail = (lambda params, h, rows: loss_fn(
                model.apply({"params": params}, None, hidden_states=h, return_hidden=return_hidden), rows, params),
                         inputs)
        x, layer_cache = apply_layers(self.block, split_tokens(x, c.sequence_parallel), ctx, cache, c, owner=self,
                                      per_layer={"sliding": sliding} if len(set(sliding)) > 1 else None,
                                      loss_tail=loss_tail, deterministic=not train)
        return x, new_cache, layer_cache

    def init_cache(self, batch, max_len, dtype=None):
        """An empty KV cache for `batch` rows of up to `max_len` tokens (prompt + generated); sliding layers keep
        rings of their window. dtype None: `compute_dtype(config)` (generation passes its parameters' dtype)."""
        c = self.config
        return empty_cache(c.num_layers, batch, max_len, c.kv_heads, c.dim_per_head, dtype or compute_dtype(c),
                           window=getattr(c, "sliding_window", None), sliding=sliding_layers(c))


def sliding_layers(config):
    """One bool per layer of a decoder config: does it attend within config.sliding_window (none without a window;
    every layer unless the config's sliding_layers says otherwise)."""
    if getattr(config, "sliding_window", None) is None:
        return (False,) * config.num_layers
    return tuple(getattr(config, "sliding_layers", (True,) * config.num_layers))


def stack_layers(model, params, virtual_stages=None):
    """(model with scan_layers=True, params with its layers stacked under `layers`): the layout a pipeline splits over
    stages. An unscanned model's `layers_{i}` sub-trees are stacked into one [num_layers, ...] tree; virtual_stages
    (None: the model's own `pipeline_virtual_stages`) sets that field, the stack stored as such a model stores it
    ([V, L / V, ...] for V > 1, `layers.stack.stored_rounds`), converted from the form `model` stores (the same
    layers in the same order). Unchanged when nothing changes. Decoder-only families (a `DecoderLM`); ValueError
    otherwise."""
    if not isinstance(model, DecoderLM):
        raise ValueError("a pipeline needs a decoder-only model (LLaMA, GPT-J, OPT, Qwen, Mistral, Gemma); got "
                         f"{type(model).__name__}")
    config, n = model.config, model.config.num_layers
    target = dataclasses.replace(config, scan_layers=True, pipeline_virtual_stages=(
        config.pipeline_virtual_stages if virtual_stages is None else virtual_stages))
    rounds = stored_rounds(target, n)  # checked before anything moves
    if target == config:
        return model, params
    params = dict(params)
    if config.scan_layers:
        params["layers"] = stored_form(layer_major(params["layers"], stored_rounds(config, n)), rounds)
        return model.clone(config=target), params
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[params.pop(f"layers_{i}") for i in range(n)])
    # The stack sits where the unscanned model creates its first layer (creation order decides auto_shard's names
    # fallback and the tables it logs).
    params = {**{k: v for k, v in params.items() if k in ("embed", "embed_positions", "project_in")},
              "layers": stored_form(stacked, rounds), **{k: v for k, v in params.items()
                                                         if k not in ("embed", "embed_positions", "project_in")}}
    return model.clone(config=target), params
