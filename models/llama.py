"""LLaMA (1, 2, 3, 3.1 and its relatives with the same layout): RMSNorm, rotary embeddings with the rope-scaling
variants, grouped-query attention, SwiGLU, tied or untied embeddings. Config, module and Hugging Face conversion."""
import dataclasses
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
    config: LlamaConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, ctx, cache):
        c = self.config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        rotary = layers.Rotary(c.dim_per_head, c.rope_theta, interleaved=False, scaling=c.rope_scaling,
                               max_position_embeddings=c.max_position_embeddings)
        h = layers.Norm("rms", c.norm_eps, name="attn_norm", **kw)(x)
        h, cache = layers.Attention(c.num_heads, c.kv_heads, c.dim_per_head, causal=True, use_bias=c.attention_bias,
                                    out_bias=c.o_bias, qk_norm_eps=c.norm_eps if c.qk_norm else None,
                                    rotary=rotary, std=c.initializer_range,
                                    implementation=c.attention_implementation, interpret=c.kernel_interpret,
                                    dropout_rate=c.attention_dropout_rate, deterministic=self.deterministic,
                                    name="attn", **kw, **layers.sublayer_options(c))(h, ctx, cache)
        drop = nn.Dropout(c.dropout_rate, deterministic=self.deterministic)
        x = x + drop(h)
        h = layers.Norm("rms", c.norm_eps, name="mlp_norm", **kw)(x)
        h = layers.MLP(c.intermediate_size, c.hidden_act, gated=True, use_bias=c.mlp_bias, std=c.initializer_range,
                       implementation=c.mlp_implementation, interpret=c.kernel_interpret, name="mlp", **kw,
                       deterministic=self.deterministic, **layers.sublayer_options(c))(h)
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


def hf_tensor_map(c):
    """[(our param path, Hugging Face tensor name ('{i}' = layer index), transpose, layers or None)]."""
    L = c.num_layers
    out = [(("embed", "embedding"), "model.embed_tokens.weight", False, None),
           (("final_norm", "scale"), "model.norm.weight", False, None)]
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        out.append((("layers", "attn", ours, "kernel"), f"model.layers.{{i}}.self_attn.{theirs}.weight", True, L))
        if c.attention_bias:
            out.append((("layers", "attn", ours, "bias"), f"model.layers.{{i}}.self_attn.{theirs}.bias", False, L))
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        out.append((("layers", "mlp", ours, "kernel"), f"model.layers.{{i}}.mlp.{theirs}.weight", True, L))
        if c.mlp_bias:
            out.append((("layers", "mlp", ours, "bias"), f"model.layers.{{i}}.mlp.{theirs}.bias", False, L))
    out += [(("layers", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", False, L),
            (("layers", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", False, L)]
    if not c.tie_word_embeddings:
        out.append((("lm_head", "kernel"), "lm_head.weight", True, None))
    return out


Config, Model = LlamaConfig, Llama
