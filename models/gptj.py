"""GPT-J: attention and MLP in parallel off one LayerNorm, partial interleaved rotary embeddings (rotate_every_two on
the first rotary_dim features of each head), GELU MLP with biases, untied head with a bias. Config, module and
Hugging Face conversion."""
import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from models import layers


@dataclasses.dataclass(frozen=True)
class GPTJConfig(layers.ModelOptions):
    vocab_size: int = 50400
    hidden_size: int = 4096
    intermediate_size: int | None = None  # None: 4 * hidden_size
    num_layers: int = 28
    num_heads: int = 16
    rotary_dim: int | None = 64  # None: the whole head
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-5
    activation: str = "gelu_new"
    initializer_range: float = 0.02
    hf_config: str = dataclasses.field(default="", repr=False, compare=False)

    tie_word_embeddings = False  # the head has its own weight and bias



NAMED_CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, rotary_dim=8, max_position_embeddings=128),
    "gptj-6b": dict(),
}


class GPTJBlock(nn.Module):
    config: GPTJConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, ctx, cache):
        c = self.config
        kw = dict(dtype=layers.config_dtype(c), param_dtype=jnp.dtype(c.param_dtype))
        rotary = layers.Rotary(c.rotary_dim or c.dim_per_head, 10000.0, interleaved=True,
                               max_position_embeddings=c.max_position_embeddings)
        h = layers.Norm("layer", c.norm_eps, name="norm", **kw)(x)
        a, cache = layers.Attention(c.num_heads, c.num_heads, c.dim_per_head, causal=True, rotary=rotary,
                                    std=c.initializer_range, implementation=c.attention_implementation,
                                    interpret=c.kernel_interpret, dropout_rate=c.attention_dropout_rate,
                                    deterministic=self.deterministic, name="attn", **kw,
                                    **layers.sublayer_options(c))(h, ctx, cache)
        m = layers.MLP(c.intermediate_size or 4 * c.hidden_size, c.activation, gated=False, use_bias=True,
                       std=c.initializer_range, implementation=c.mlp_implementation, interpret=c.kernel_interpret,
                       name="mlp", deterministic=self.deterministic, **kw, **layers.sublayer_options(c))(h)
        drop = nn.Dropout(c.dropout_rate, deterministic=self.deterministic)
        return x + drop(a) + drop(m), cache


class GPTJ(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = GPTJBlock
    norm_kind = "layer"
    head_bias = True
    embed_dropout = True


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    if hf.get("tie_word_embeddings", False):
        raise ValueError("GPT-J with tie_word_embeddings=True is not supported (its head has its own bias)")
    return GPTJConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], intermediate_size=hf.get("n_inner"),
        num_layers=hf["n_layer"], num_heads=hf["n_head"], rotary_dim=hf.get("rotary_dim"),
        max_position_embeddings=hf.get("n_positions", 2048), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=hf.get("activation_function", "gelu_new"), initializer_range=hf.get("initializer_range", 0.02),
        **{"dropout_rate": hf.get("resid_pdrop", 0.0), "attention_dropout_rate": hf.get("attn_pdrop", 0.0), **options})


def config_to_hf(c):
    return dict(model_type="gptj", architectures=["GPTJForCausalLM"], vocab_size=c.vocab_size, n_embd=c.hidden_size,
                n_inner=c.intermediate_size, n_layer=c.num_layers, n_head=c.num_heads, rotary_dim=c.rotary_dim,
                n_positions=c.max_position_embeddings, layer_norm_epsilon=c.norm_eps,
                activation_function=c.activation, initializer_range=c.initializer_range, tie_word_embeddings=False,
                resid_pdrop=c.dropout_rate, embd_pdrop=c.dropout_rate, attn_pdrop=c.attention_dropout_rate)


def hf_tensor_map(c):
    """[(our param path, Hugging Face tensor name ('{i}' = layer index), transpose, layers or None)]."""
    L, h = c.num_layers, "transformer.h.{i}"
    out = [(("embed", "embedding"), "transformer.wte.weight", False, None),
           (("final_norm", "scale"), "transformer.ln_f.weight", False, None),
           (("final_norm", "bias"), "transformer.ln_f.bias", False, None),
           (("lm_head", "kernel"), "lm_head.weight", True, None),
           (("lm_head", "bias"), "lm_head.bias", False, None),
           (("layers", "norm", "scale"), f"{h}.ln_1.weight", False, L),
           (("layers", "norm", "bias"), f"{h}.ln_1.bias", False, L)]
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
        out.append((("layers", "attn", ours, "kernel"), f"{h}.attn.{theirs}.weight", True, L))
    for ours, theirs in (("up", "fc_in"), ("down", "fc_out")):
        out.append((("layers", "mlp", ours, "kernel"), f"{h}.mlp.{theirs}.weight", True, L))
        out.append((("layers", "mlp", ours, "bias"), f"{h}.mlp.{theirs}.bias", False, L))
    return out


Config, Model = GPTJConfig, GPTJ
