"""OPT: learned absolute positions (table offset by 2, as fairseq left it), pre-norm (most sizes) or post-norm
(opt-350m) layers, ReLU MLP, biases everywhere, head tied to the token embedding, optional project_in / project_out
when the embedding width differs from the model width. Config, module and Hugging Face conversion."""
import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from models import layers

@dataclasses.dataclass(frozen=True)
class OPTConfig(layers.ModelOptions):
    vocab_size: int = 50272
    hidden_size: int = 768
    ffn_dim: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None  # None: hidden_size (no project_in / project_out)
    do_layer_norm_before: bool = True
    final_layer_norm: bool = True  # transformers: do_layer_norm_before and not _remove_final_layer_norm
    layer_norm_elementwise_affine: bool = True
    enable_bias: bool = True
    activation: str = "relu"
    initializer_range: float = 0.02
    hf_config: str = dataclasses.field(default="", repr=False, compare=False)

    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    @property
    def embed_dim(self):
        return self.word_embed_proj_dim or self.hidden_size



def _opt(hidden, layers_, heads):
    return dict(hidden_size=hidden, ffn_dim=4 * hidden, num_layers=layers_, num_heads=heads)


NAMED_CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, ffn_dim=128, num_layers=2, num_heads=4, max_position_embeddings=128),
    "opt-125m": _opt(768, 12, 12),
    "opt-350m": dict(_opt(1024, 24, 16), word_embed_proj_dim=512, do_layer_norm_before=False, final_layer_norm=False),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
}


class OPTBlock(nn.Module):
    config: OPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, ctx, cache):
        c = self.config
        kw = dict(dtype=layers.config_dtype(c), param_dtype=jnp.dtype(c.param_dtype))
        norm = dict(kind="layer", eps=c.norm_eps, use_scale=c.layer_norm_elementwise_affine, **kw)
        attn_norm, mlp_norm = layers.Norm(name="attn_norm", **norm), layers.Norm(name="mlp_norm", **norm)
        pre = c.do_layer_norm_before
        h, cache = layers.Attention(c.num_heads, c.num_heads, c.dim_per_head, causal=True,
                                    use_bias=c.enable_bias, std=c.initializer_range,
                                    implementation=c.attention_implementation, interpret=c.kernel_interpret,
                                    dropout_rate=c.attention_dropout_rate, deterministic=self.deterministic,
                                    name="attn", **kw, **layers.sublayer_options(c))(attn_norm(x) if pre else x, ctx,
                                                                                  cache)
        drop = nn.Dropout(c.dropout_rate, deterministic=self.deterministic)
        h = drop(h)
        x = x + h if pre else attn_norm(x + h)
        h = layers.MLP(c.ffn_dim, c.activation, gated=False, use_bias=c.enable_bias, std=c.initializer_range,
                       implementation=c.mlp_implementation, interpret=c.kernel_interpret, name="mlp",
                       deterministic=self.deterministic, **kw, **layers.sublayer_options(c))(mlp_norm(x) if pre else x)
        h = drop(h)
        return (x + h if pre else mlp_norm(x + h)), cache


class OPT(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = OPTBlock
    norm_kind = "layer"
    position_offset = 2  # OPT's position table has two leading rows that real positions never use
    embed_dropout = True


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    pre = hf.get("do_layer_norm_before", True)
    return OPTConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], ffn_dim=hf["ffn_dim"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        word_embed_proj_dim=hf.get("word_embed_proj_dim"), do_layer_norm_before=pre,
        final_layer_norm=pre and not hf.get("_remove_final_layer_norm", False),
        layer_norm_elementwise_affine=hf.get("layer_norm_elementwise_affine", True),
        enable_bias=hf.get("enable_bias", True), activation=hf.get("activation_function", "relu"),
        initializer_range=hf.get("init_std", 0.02), tie_word_embeddings=hf.get("tie_word_embeddings", True),
        **{"dropout_rate": hf.get("dropout", 0.1), "attention_dropout_rate": hf.get("attention_dropout", 0.0),
           **options})


def config_to_hf(c):
    return dict(model_type="opt", architectures=["OPTForCausalLM"], vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, ffn_dim=c.ffn_dim, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, max_position_embeddings=c.max_position_embeddings,
                word_embed_proj_dim=c.embed_dim, do_layer_norm_before=c.do_layer_norm_before,
                _remove_final_layer_norm=c.do_layer_norm_before and not c.final_layer_norm,
                layer_norm_elementwise_affine=c.layer_norm_elementwise_affine, enable_bias=c.enable_bias,
                activation_function=c.activation, init_std=c.initializer_range,
                tie_word_embeddings=c.tie_word_embeddings, dropout=c.dropout_rate,
                attention_dropout=c.attention_dropout_rate)


def hf_tensor_map(c):
    """[(our param path, Hugging Face tensor name ('{i}' = layer index), transpose, layers or None)]."""
    L, d, h = c.num_layers, "model.decoder", "model.decoder.layers.{i}"
    out = [(("embed", "embedding"), f"{d}.embed_tokens.weight", False, None),
           (("embed_positions", "embedding"), f"{d}.embed_positions.weight", False, None)]
    if not c.tie_word_embeddings:
        out.append((("lm_head", "kernel"), "lm_head.weight", True, None))
    if c.embed_dim != c.hidden_size:
        out += [(("project_in", "kernel"), f"{d}.project_in.weight", True, None),
                (("project_out", "kernel"), f"{d}.project_out.weight", True, None)]
    norms = [(("attn_norm",), f"{h}.self_attn_layer_norm", L), (("mlp_norm",), f"{h}.final_layer_norm", L)]
    if c.final_layer_norm:
        norms.append(((), f"{d}.final_layer_norm", None))
    if c.layer_norm_elementwise_affine:
        for ours, theirs, n in norms:
            prefix = ("layers",) + ours if n else ("final_norm",)
            out += [(prefix + ("scale",), f"{theirs}.weight", False, n),
                    (prefix + ("bias",), f"{theirs}.bias", False, n)]
    linears = [(("attn", "q"), "self_attn.q_proj"), (("attn", "k"), "self_attn.k_proj"),
               (("attn", "v"), "self_attn.v_proj"), (("attn", "o"), "self_attn.out_proj"), (("mlp", "up"), "fc1"),
               (("mlp", "down"), "fc2")]
    for ours, theirs in linears:
        out.append((("layers",) + ours + ("kernel",), f"{h}.{theirs}.weight", True, L))
        if c.enable_bias:
            out.append((("layers",) + ours + ("bias",), f"{h}.{theirs}.bias", False, L))
    return out


Config, Model = OPTConfig, OPT
