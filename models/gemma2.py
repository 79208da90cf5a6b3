"""Gemma 2: the LLaMA layout (`llama.LlamaBlock`) with Gemma's options. Each layer norms its input and its output on
both branches (four RMSNorms), every norm scales by 1 + w, embeddings are multiplied by sqrt(hidden_size), the MLP
is GeGLU (gelu_pytorch_tanh), logits are scaled by query_pre_attn_scalar ** -0.5 and soft-capped (attention logits
at attn_logit_softcapping, output logits at final_logit_softcapping: c * tanh(s / c)), and local layers (a sliding
window, a ring-buffer KV cache) alternate with global ones as config.json's layer_types say (transformers' rule when
it has none: even layers local). Config, named configs and the Hugging Face conversion; Gemma 3
(`models/gemma3.py`) shares the layout and the conversion.

Local and global layers share one scanned stack: `layers.apply_layers` scans each layer's kind beside its stacked
weights and the block picks its attention under a lax.cond (see there)."""
import dataclasses
from typing import ClassVar

from models import layers, llama

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclasses.dataclass(frozen=True)
class GemmaConfig(llama.LlamaConfig):
    """LlamaConfig's fields (tied embeddings, GeGLU, head_dim 256 by default) and Gemma's: the local layers' window,
    layer_types (one of 'sliding_attention' / 'full_attention' per layer; empty: every `sliding_pattern`-th layer
    global, the others local, transformers' rule), query_pre_attn_scalar (logits times its inverse square root),
    final_logit_softcap (None: none)."""
    hidden_act: str = "gelu_pytorch_tanh"
    head_dim: int | None = 256
    tie_word_embeddings: bool = True
    sliding_window: int | None = 4096
    layer_types: tuple = ()
    query_pre_attn_scalar: float = 256
    final_logit_softcap: float | None = None
    post_norms = True
    norm_offset = 1.0
    scale_embeddings = True
    sliding_pattern: ClassVar[int] = 2

    def __post_init__(self):
        super().__post_init__()
        check_layer_types(self, lambda i: (i + 1) % self.sliding_pattern)

    @property
    def sliding_layers(self):
        return tuple(t == SLIDING for t in self.layer_types)


def check_layer_types(c, sliding):
    """A config's layer_types and window (Gemma's, Qwen's): empty layer_types become layer i's kind by the family's
    rule `sliding(i)` (truthy: local); ValueError unless num_layers of 'sliding_attention' / 'full_attention' and a
    window that is a positive integer or None."""
    if not c.layer_types:
        object.__setattr__(c, "layer_types", tuple(SLIDING if sliding(i) else FULL for i in range(c.num_layers)))
    if len(c.layer_types) != c.num_layers or set(c.layer_types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types={list(c.layer_types)}; expected {c.num_layers} (num_layers) of "
                         f"{SLIDING!r} / {FULL!r}")
    if c.sliding_window is not None and (isinstance(c.sliding_window, bool) or c.sliding_window < 1):
        raise ValueError(f"sliding_window={c.sliding_window!r}; expected a positive integer or None")


@dataclasses.dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """GemmaConfig's fields and the attention logits' soft-cap (None: none)."""
    attn_logit_softcap: float | None = 50.0
    final_logit_softcap: float | None = 30.0


_GEMMA2 = dict(vocab_size=256000, max_position_embeddings=8192, norm_eps=1e-6, rope_theta=10000.0,
               sliding_window=4096, attn_logit_softcap=50.0, final_logit_softcap=30.0)
NAMED_CONFIGS = {
    # 4 layers, local and global in turn, a window of 8 inside the 16-token rows the tests train on
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=128, sliding_window=8),
    # google/gemma-2-2b, gemma-2-9b, gemma-2-27b
    "gemma-2-2b": dict(_GEMMA2, hidden_size=2304, intermediate_size=9216, num_layers=26, num_heads=8, num_kv_heads=4,
                       head_dim=256, query_pre_attn_scalar=256),
    "gemma-2-9b": dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16,
                       num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma-2-27b": dict(_GEMMA2, hidden_size=4608, intermediate_size=36864, num_layers=46, num_heads=32,
                        num_kv_heads=16, head_dim=128, query_pre_attn_scalar=144),
}


class Gemma2(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """transformers' Gemma2Config dict (config.json) -> Gemma2Config; `options` set ModelOptions fields. Missing
    keys take transformers' defaults."""
    return from_hf(Gemma2Config, hf, options, attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0),
                   final_logit_softcap=hf.get("final_logit_softcapping", 30.0))


def config_to_hf(c):
    return to_hf(c, "gemma2", "Gemma2ForCausalLM", attn_logit_softcapping=c.attn_logit_softcap)


def from_hf(config_cls, hf, options, **fields):
    """`config_cls` (a GemmaConfig) from a Gemma config.json dict: LLaMA's fields with Gemma's defaults (tied,
    head_dim 256, hidden_activation), Gemma's, then `fields`. ValueError for bidirectional attention (EmbeddingGemma),
    which is not a causal LM."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("'use_bidirectional_attention' is true; expected false or null (a causal LM)")
    return llama.from_hf(config_cls, hf, options, **{
        "hidden_act": hf.get("hidden_activation", "gelu_pytorch_tanh"), "head_dim": hf.get("head_dim", 256),
        "tie_word_embeddings": hf.get("tie_word_embeddings", True), "sliding_window": hf.get("sliding_window", 4096),
        "layer_types": tuple(hf.get("layer_types") or ()),
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256), **fields})


def to_hf(c, model_type, architecture, **fields):
    """LLaMA's config.json dict as `model_type`'s with Gemma's fields, then `fields`."""
    return {**llama.to_hf(c, model_type, architecture, drop=("mlp_bias", "hidden_act")),
            "hidden_activation": c.hidden_act, "sliding_window": c.sliding_window, "layer_types": list(c.layer_types),
            "query_pre_attn_scalar": c.query_pre_attn_scalar, "final_logit_softcapping": c.final_logit_softcap,
            **fields}


hf_tensor_map = llama.hf_tensor_map
Config, Model = Gemma2Config, Gemma2
