"""T5 encoder-decoder: RMSNorm without bias, unscaled dot-product attention with a learned relative position bias
(bucketed; one table per stack, owned by the first layer in transformers), T5 v1.0 ReLU or v1.1 / FLAN gated-GELU
MLP, head tied to the shared embedding (outputs scaled by d_model^-0.5) or untied. Config, module and Hugging Face
conversion.

The relative position bias is an additive [heads, len, keys] term that kernels.flash_attention does not take, so
self-attention here runs the plain-jnp path of layers.attend; cross-attention has no bias and uses the kernel.
"""
import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from models import layers


@dataclasses.dataclass(frozen=True)
class T5Config(layers.ModelOptions):
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # None: num_layers
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_eps: float = 1e-6
    feed_forward_proj: str = "relu"  # 'relu' (v1.0) or 'gated-gelu' (v1.1, FLAN)
    tie_word_embeddings: bool = True  # lm_head shares the embedding table
    scale_decoder_outputs: bool = True  # multiply the decoder output by d_model**-0.5 before the head
    decoder_start_token_id: int = 0
    initializer_factor: float = 1.0
    hf_config: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def decoder_layers(self):
        return self.num_decoder_layers or self.num_layers

    @property
    def gated(self):
        return self.feed_forward_proj.startswith("gated-")

    @property
    def act(self):
        act = self.feed_forward_proj.split("-")[-1]
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else act


_FLAN = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, scale_decoder_outputs=False)
NAMED_CONFIGS = {
    "tiny": dict(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, **_FLAN),
    "t5-small": dict(),
    "t5-base": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "t5-large": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "t5-3b": dict(d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32),
    "t5-11b": dict(d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128),
    "flan-t5-small": dict(_FLAN, d_ff=1024, num_layers=8, num_heads=6),
    "flan-t5-base": dict(_FLAN, d_model=768, d_ff=2048, num_layers=12, num_heads=12),
    "flan-t5-large": dict(_FLAN, d_model=1024, d_ff=2816, num_layers=24, num_heads=16),
    "flan-t5-xl": dict(_FLAN, d_model=2048, d_ff=5120, num_layers=24, num_heads=32),
    "flan-t5-xxl": dict(_FLAN, d_model=4096, d_ff=10240, num_layers=24, num_heads=64),
}


def relative_position_bucket(relative_position, *, bidirectional, num_buckets, max_distance):
    """Mesh TensorFlow's bucketing of key - query distances: exact for small ones, logarithmic up to max_distance."""
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = -jnp.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    safe = jnp.maximum(distance, 1).astype(jnp.float32)  # log(0) is never selected below; keep it finite
    large = max_exact + (jnp.log(safe / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).astype(relative_position.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(distance < max_exact, distance, large)


class T5Block(nn.Module):
    config: T5Config
    decoder: bool
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, ctx, cache):
        c = self.config
        kw = dict(dtype=layers.config_dtype(c), param_dtype=jnp.dtype(c.param_dtype))
        # transformers' T5 initialisation: q (d_model * d_kv)^-0.5 (T5 does not scale its logits), k and v
        # d_model^-0.5, o (heads * d_kv)^-0.5; MLP in d_model^-0.5, out d_ff^-0.5; all times initializer_factor.
        f = c.initializer_factor
        attn = dict(num_heads=c.num_heads, num_kv_heads=c.num_heads, head_dim=c.d_kv, sm_scale=1.0,
                    std=f * c.d_model ** -0.5, q_std=f * (c.d_model * c.d_kv) ** -0.5,
                    out_std=f * (c.num_heads * c.d_kv) ** -0.5, implementation=c.attention_implementation,
                    interpret=c.kernel_interpret, dropout_rate=c.attention_dropout_rate,
                    deterministic=self.deterministic, **kw, **layers.sublayer_options(c))
        drop = nn.Dropout(c.dropout_rate, deterministic=self.deterministic)
        h = layers.Norm("rms", c.layer_norm_eps, name="attn_norm", **kw)(x)
        h, cache = layers.Attention(causal=self.decoder, name="attn", **attn)(h, ctx, cache, bias=ctx["position_bias"])
        x = x + drop(h)
        if self.decoder:
            h = layers.Norm("rms", c.layer_norm_eps, name="cross_norm", **kw)(x)
            h, cache = layers.Attention(causal=False, name="cross_attn", **attn)(h, ctx, cache,
                                                                                kv_input=ctx["encoder_out"])
            x = x + drop(h)
        h = layers.Norm("rms", c.layer_norm_eps, name="mlp_norm", **kw)(x)
        h = layers.MLP(c.d_ff, c.act, gated=c.gated, use_bias=False, std=f * c.d_model ** -0.5,
                       out_std=f * c.d_ff ** -0.5, implementation=c.mlp_implementation, interpret=c.kernel_interpret,
                       name="mlp", deterministic=self.deterministic, **kw, **layers.sublayer_options(c))(h)
        return x + drop(h), cache


class T5Stack(nn.Module):
    """The encoder (decoder=False) or the decoder: embeddings from the shared table, relative position bias,
    layers, final norm."""
    config: T5Config
    decoder: bool
    embed: nn.Module

    @nn.compact
    def __call__(self, input_ids, attention_mask, cache=None, encoder_out=None, encoder_mask=None, train=False):
        c = self.config
        drop = nn.Dropout(c.dropout_rate, deterministic=not train)
        B, T = input_ids.shape
        ctx, new_cache = layers.decoder_context(input_ids, attention_mask, None, cache)
        # Bias from slot indices: relative distances within a (left-padded or packed) sequence are unchanged, and
        # one [1, heads, T, keys] table serves the whole batch.
        start = 0 if cache is None else cache["index"]
        q_pos = start + jnp.arange(T)
        k_pos = jnp.arange(cache["segment_ids"].shape[1]) if (cache is not None and T == 1) else q_pos
        buckets = relative_position_bucket(k_pos[None, :] - q_pos[:, None], bidirectional=not self.decoder,
                                           num_buckets=c.relative_attention_num_buckets,
                                           max_distance=c.relative_attention_max_distance)
        table = self.param("relative_attention_bias", nn.initializers.normal(c.initializer_factor * c.d_model ** -0.5),
                           (c.relative_attention_num_buckets, c.num_heads), jnp.dtype(c.param_dtype))
        ctx["position_bias"] = jnp.transpose(table[buckets], (2, 0, 1))[None]
        if self.decoder:
            ctx.update(encoder_out=encoder_out, encoder_segment_ids=(
                jnp.ones(encoder_out.shape[:2], jnp.int32) if encoder_mask is None else encoder_mask))
        x = layers.split_tokens(drop(self.embed(input_ids)), c.sequence_parallel)
        x, layer_cache = layers.apply_layers(T5Block, x, ctx, cache, c, decoder=self.decoder, deterministic=not train,
                                             num_layers=c.decoder_layers if self.decoder else c.num_layers)
        x = drop(layers.Norm("rms", c.layer_norm_eps, name="final_norm", dtype=layers.config_dtype(c),
                             param_dtype=jnp.dtype(c.param_dtype))(x))
        x = layers.gather_tokens(x, c.sequence_parallel)
        return x if cache is None else (x, {**new_cache, "layers": layer_cache})


class T5(nn.Module):
    """Encoder-decoder LM.

    __call__(input_ids [B, S], decoder_input_ids [B, T], attention_mask=None, decoder_attention_mask=None, *,
      return_hidden=False, train=False) -> logits [B, T, vocab] float32.
    encode(input_ids, attention_mask=None, train=False) -> encoder states [B, S, d_model].
    decode(decoder_input_ids, encoder_out, attention_mask=None, decoder_attention_mask=None, *, cache=None,
      return_hidden=False, train=False) -> logits, or (logits, cache) with a cache from init_cache.
    train=True applies dropout (config.dropout_rate) and needs a 'dropout' rng.
    """
    config: T5Config
    is_encoder_decoder = True

    def setup(self):
        c = self.config
        kw = dict(dtype=layers.config_dtype(c), param_dtype=jnp.dtype(c.param_dtype))
        self.shared = layers.token_embedding(c.vocab_size, c.d_model, std=c.initializer_factor, **kw)
        self.encoder = T5Stack(c, decoder=False, embed=self.shared)
        self.decoder = T5Stack(c, decoder=True, embed=self.shared)
        if not c.tie_word_embeddings:
            self.lm_head = layers.Linear(c.d_model, c.vocab_size, std=c.initializer_factor, **kw)

    def __call__(self, input_ids, decoder_input_ids, attention_mask=None, decoder_attention_mask=None, *,
                 return_hidden=False, train=False):
        encoder_out = self.encode(input_ids, attention_mask, train=train)
        return self.decode(decoder_input_ids, encoder_out, attention_mask, decoder_attention_mask,
                           return_hidden=return_hidden, train=train)

    def encode(self, input_ids, attention_mask=None, train=False):
        return self.encoder(input_ids, attention_mask, train=train)

    def decode(self, decoder_input_ids, encoder_out, attention_mask=None, decoder_attention_mask=None, *,
               cache=None, return_hidden=False, train=False):
        out = self.decoder(decoder_input_ids, decoder_attention_mask, cache, encoder_out, attention_mask, train=train)
        x, new_cache = (out, None) if cache is None else out
        if self.config.scale_decoder_outputs:
            x = x * self.config.d_model ** -0.5
        if not self.config.tie_word_embeddings:
            _ = self.lm_head.kernel  # create the head's parameters even when only hidden states are returned
        if not return_hidden:
            head = self.shared.attend if self.config.tie_word_embeddings else self.lm_head
            x = head(x).astype(jnp.float32)
        return x if cache is None else (x, new_cache)

    def init_cache(self, batch, max_len, dtype=None):
        c = self.config
        return layers.empty_cache(c.decoder_layers, batch, max_len, c.num_heads, c.d_kv,
                                  dtype or layers.compute_dtype(c))


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """Ties and output scaling: transformers >= 5 writes `scale_decoder_outputs` (and always ties); older configs
    say `tie_word_embeddings`, which then also decides the scaling (False for T5 v1.1 / FLAN)."""
    tie = hf.get("tie_word_embeddings", True)
    return T5Config(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"], d_kv=hf["d_kv"], d_ff=hf["d_ff"],
        num_layers=hf["num_layers"], num_decoder_layers=hf.get("num_decoder_layers"), num_heads=hf["num_heads"],
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6), feed_forward_proj=hf.get("feed_forward_proj", "relu"),
        tie_word_embeddings=tie, scale_decoder_outputs=hf.get("scale_decoder_outputs", tie),
        decoder_start_token_id=hf.get("decoder_start_token_id", 0) or 0,
        initializer_factor=hf.get("initializer_factor", 1.0),
        **{"dropout_rate": hf.get("dropout_rate", 0.1), "attention_dropout_rate": hf.get("dropout_rate", 0.1),
           **options})


def config_to_hf(c):
    return dict(model_type="t5", architectures=["T5ForConditionalGeneration"], vocab_size=c.vocab_size,
                d_model=c.d_model, d_kv=c.d_kv, d_ff=c.d_ff, num_layers=c.num_layers,
                num_decoder_layers=c.decoder_layers, num_heads=c.num_heads,
                relative_attention_num_buckets=c.relative_attention_num_buckets,
                relative_attention_max_distance=c.relative_attention_max_distance, layer_norm_epsilon=c.layer_norm_eps,
                feed_forward_proj=c.feed_forward_proj, tie_word_embeddings=c.tie_word_embeddings,
                scale_decoder_outputs=c.scale_decoder_outputs, decoder_start_token_id=c.decoder_start_token_id,
                initializer_factor=c.initializer_factor, dropout_rate=c.dropout_rate, is_encoder_decoder=True)


def hf_tensor_map(c):
    """[(our param path, Hugging Face tensor name ('{i}' = layer index), transpose, layers or None)]."""
    out = [(("shared", "embedding"), "shared.weight", False, None)]
    if not c.tie_word_embeddings:
        out.append((("lm_head", "kernel"), "lm_head.weight", True, None))
    mlp = (("gate", "wi_0"), ("up", "wi_1"), ("down", "wo")) if c.gated else (("up", "wi"), ("down", "wo"))
    for stack, n, decoder in (("encoder", c.num_layers, False), ("decoder", c.decoder_layers, True)):
        b = f"{stack}.block.{{i}}.layer"
        out += [((stack, "relative_attention_bias"), f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
                 ".weight", False, None),
                ((stack, "final_norm", "scale"), f"{stack}.final_layer_norm.weight", False, None),
                ((stack, "layers", "attn_norm", "scale"), f"{b}.0.layer_norm.weight", False, n)]
        attentions = [("attn", f"{b}.0.SelfAttention")]
        if decoder:
            attentions.append(("cross_attn", f"{b}.1.EncDecAttention"))
            out.append(((stack, "layers", "cross_norm", "scale"), f"{b}.1.layer_norm.weight", False, n))
        for ours, theirs in attentions:
            out += [((stack, "layers", ours, p, "kernel"), f"{theirs}.{p}.weight", True, n) for p in "qkvo"]
        ff = f"{b}.{2 if decoder else 1}"
        out.append(((stack, "layers", "mlp_norm", "scale"), f"{ff}.layer_norm.weight", False, n))
        out += [((stack, "layers", "mlp", ours, "kernel"), f"{ff}.DenseReluDense.{theirs}.weight", True, n)
                for ours, theirs in mlp]
    return out


Config, Model = T5Config, T5
