"""LLaMA (1, 2, 3, 3.1 and its relatives with the same layout): RMSNorm, rotary embeddings with the rope-scaling
variants, grouped-query attention, SwiGLU, tied or untied embeddings. Config, module and Hugging Face conversion."""
import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp

from models import layers


@dataclasses.dataclass(frozen=True)
class LlamaConfig(layers.ModelOptions):
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = None  # None: num_heads (multi-head attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs of transformers' rope_parameters, minus rope_theta
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    # the config.json this came from: export writes its other keys back
    hf_config: str = dataclasses.field(default="", repr=False, compare=False)
    # Set by the families of this layout that differ in attention alone (models/qwen2.py, qwen3.py): o's bias apart
    # from attention_bias (None: the same), RMSNorm of each q and k head before rope.
    o_bias: ClassVar[bool | None] = None
    qk_norm: ClassVar[bool] = False
    # Fields of the families of this layout with windows, post-norms and soft-caps (models/mistral.py, gemma.py),
    # constants here: the sliding window (transformers' sliding_window: a query sees that many newest positions),
    # the logit scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), attention and final logit
    # soft-caps, the sliding layers' own rope (theta None: the global one), a norm after attention and after the
    # MLP, norms scaling by norm_offset + w, embeddings times sqrt(hidden_size).
    sliding_window: ClassVar[int | None] = None
    query_pre_attn_scalar: ClassVar[float | None] = None
    attn_logit_softcap: ClassVar[float | None] = None
    final_logit_softcap: ClassVar[float | None] = None
    rope_local_theta: ClassVar[float | None] = None
    rope_local_scaling: ClassVar[tuple] = ()
    post_norms: ClassVar[bool] = False
    norm_offset: ClassVar[float] = 0.0
    scale_embeddings: ClassVar[bool] = False


_LLAMA2 = dict(norm_eps=1e-5, max_position_embeddings=4096)
_LLAMA3 = dict(vocab_size=128256, intermediate_size=14336, num_kv_heads=8, norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=8192)
_LLAMA31_ROPE = dict(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                   ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
                     max_position_embeddings=131072)
NAMED_CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=128),
    "llama-7b": dict(),
    "llama-13b": dict(hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40),
    "llama-30b": dict(hidden_size=6656, intermediate_size=17920, num_layers=60, num_heads=52),
    "llama-65b": dict(hidden_size=8192, intermediate_size=22016, num_layers=80, num_heads=64),
    "llama2-7b": dict(_LLAMA2),
    "llama2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40),
    "llama2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       num_kv_heads=8),
    "llama3-8b": dict(_LLAMA3),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64),
    "llama3.1-8b": dict(_LLAMA3, **_LLAMA31_ROPE),
    "llama3.1-70b": dict(_LLAMA3, **_LLAMA31_ROPE, hidden_size=8192, intermediate_size=28672, num_layers=80,
                         num_heads=64),
}


class LlamaBlock(nn.Module):
    """Pre-norm attention and gated MLP, each added to the residual stream; with the config's options (above) a
    sliding window, soft-caps, a second rope, and post-norms on both branches (Gemma). `layer` ({'sliding': bool,
    traced under a layer scan}) is given where the layers differ (`layers.apply_layers`)."""
    config: LlamaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, ctx, cache, layer=None):
        c = self.config
        kw = dict(dtype=layers.config_dtype(c), param_dtype=jnp.dtype(c.param_dtype))
        norm = functools.partial(layers.Norm, "rms", c.norm_eps, offset=c.norm_offset, **kw)
        rope = functools.partial(layers.Rotary, c.dim_per_head, interleaved=False,
                                 max_position_embeddings=c.max_position_embeddings)
        rotary_sliding = None if c.rope_local_theta is None else rope(c.rope_local_theta,
                                                                       scaling=c.rope_local_scaling)
        sliding = any(layers.sliding_layers(c)) if layer is None else layer["sliding"]
        h = norm(name="attn_norm")(x)
        h, cache = layers.Attention(c.num_heads, c.kv_heads, c.dim_per_head, causal=True, use_bias=c.attention_bias,
                                    out_bias=c.o_bias, qk_norm_eps=c.norm_eps if c.qk_norm else None,
                                    norm_offset=c.norm_offset, rotary=rope(c.rope_theta, scaling=c.rope_scaling),
                                    rotary_sliding=rotary_sliding, window=c.sliding_window,
                                    logit_soft_cap=c.attn_logit_softcap,
                                    sm_scale=c.query_pre_attn_scalar and c.query_pre_attn_scalar ** -0.5,
                                    std=c.initializer_range,
                                    implementation=c.attention_implementation, interpret=c.kernel_interpret,
                                    dropout_rate=c.attention_dropout_rate, deterministic=self.deterministic,
                                    name="attn", **kw, **layers.sublayer_options(c))(h, ctx, cache, sliding=sliding)
        if c.post_norms:
            h = norm(name="attn_post_norm")(h)
        drop = nn.Dropout(c.dropout_rate, deterministic=self.deterministic)
        x = x + drop(h)
        h = norm(name="mlp_norm")(x)
        if layers.is_sparse_layer(c, self.name):  # a mixture of experts (models/mixtral.py, qwen3_moe.py)
            h = layers.moe_block(c, name="mlp", **kw)(h, None if ctx["segment_ids"] is None else ctx["segment_ids"] > 0)
        else:
            h = layers.MLP(c.intermediate_size, c.hidden_act, gated=True, use_bias=c.mlp_bias,
                           std=c.initializer_range, implementation=c.mlp_implementation,
                           interpret=c.kernel_interpret, name="mlp", **kw, deterministic=self.deterministic,
                           **layers.sublayer_options(c))(h)
        if c.post_norms:
            h = norm(name="mlp_post_norm")(h)
        return x + drop(h), cache


class Llama(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """transformers' LlamaConfig dict (config.json) -> LlamaConfig; `options` set ModelOptions fields."""
    theta, scaling = layers.rope_from_hf(hf)
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"], head_dim=hf.get("head_dim"),
        max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
        hidden_act=hf.get("hidden_act", "silu"), initializer_range=hf.get("initializer_range", 0.02),
        **{"attention_dropout_rate": hf.get("attention_dropout", 0.0), **options})


def config_to_hf(c):
    return dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.kv_heads, head_dim=c.dim_per_head, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps, rope_parameters=layers.rope_to_hf(c.rope_theta, c.rope_scaling),
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
        hidden_act=c.hidden_act, initializer_range=c.initializer_range, attention_dropout=c.attention_dropout_rate)


def from_hf(config_cls, hf, options, **fields):
    """`config_cls` (a LlamaConfig) from the config.json dict of a family of this layout: LLaMA's fields, then
    `fields` (models/qwen2.py, mistral.py, gemma.py)."""
    c = config_from_hf(hf, **options)
    return config_cls(**{**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}, **fields})


def to_hf(c, model_type, architecture, drop=()):
    """LLaMA's config.json dict as `model_type`'s, without the keys in `drop`."""
    hf = {k: v for k, v in config_to_hf(c).items() if k not in drop}
    return {**hf, "model_type": model_type, "architectures": [architecture]}


def hf_tensor_map(c):
    """[(our param path, Hugging Face tensor name ('{i}' = layer index), transpose, layers or None)], with the
    layout's options: o's bias only with o_bias (None: attention_bias), q_norm / k_norm with qk_norm, and with
    post_norms Gemma's four norms a layer (its post_attention_layernorm follows attention; LLaMA's precedes the
    MLP)."""
    L = c.num_layers
    out = [(("embed", "embedding"), "model.embed_tokens.weight", False, None),
           (("final_norm", "scale"), "model.norm.weight", False, None)]
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        out.append((("layers", "attn", ours, "kernel"), f"model.layers.{{i}}.self_attn.{theirs}.weight", True, L))
        if c.attention_bias if ours != "o" or c.o_bias is None else c.o_bias:
            out.append((("layers", "attn", ours, "bias"), f"model.layers.{{i}}.self_attn.{theirs}.bias", False, L))
    if c.qk_norm:
        out += [(("layers", "attn", f"{x}_norm", "scale"), f"model.layers.{{i}}.self_attn.{x}_norm.weight", False, L)
                for x in "qk"]
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        out.append((("layers", "mlp", ours, "kernel"), f"model.layers.{{i}}.mlp.{theirs}.weight", True, L))
        if c.mlp_bias:
            out.append((("layers", "mlp", ours, "bias"), f"model.layers.{{i}}.mlp.{theirs}.bias", False, L))
    norms = (("attn_norm", "input_layernorm"), ("attn_post_norm", "post_attention_layernorm"),
             ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_post_norm", "post_feedforward_layernorm")) \
        if c.post_norms else (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
    out += [(("layers", ours, "scale"), f"model.layers.{{i}}.{theirs}.weight", False, L) for ours, theirs in norms]
    if not c.tie_word_embeddings:
        out.append((("lm_head", "kernel"), "lm_head.weight", True, None))
    return out


Config, Model = LlamaConfig, Llama
