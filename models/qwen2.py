"""Qwen2 and Qwen2.5: the LLaMA layout (`llama.LlamaBlock`) with biases on q, k and v and none on o, which
transformers' Qwen2Attention hard-codes. Config, named configs and the Hugging Face conversion; Qwen3
(`models/qwen3.py`) reuses the config's window and the conversion.

Sliding-window attention as transformers' Qwen2 / Qwen3 (off in every released checkpoint): with
`use_sliding_window`, the layers that `layer_types` marks 'sliding_attention' (without it, transformers' rule: the
layers from `max_window_layers` on) attend within `sliding_window`; the others attend to everything. It is Gemma's
machinery (`models/gemma2.py`): the kinds scanned beside the stacked weights, local layers' KV caches rings of the
window."""
import dataclasses

from models import gemma2, layers, llama
from models.gemma2 import SLIDING


@dataclasses.dataclass(frozen=True)
class QwenConfig(llama.LlamaConfig):
    """LlamaConfig's fields and the window: sliding_window (transformers' when use_sliding_window; None: none) in
    the layers layer_types marks 'sliding_attention' (empty: layers from max_window_layers on)."""
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        gemma2.check_layer_types(self, lambda i: self.sliding_window is not None and i >= self.max_window_layers)

    @property
    def sliding_layers(self):
        return tuple(t == SLIDING for t in self.layer_types)


@dataclasses.dataclass(frozen=True)
class Qwen2Config(QwenConfig):
    """QwenConfig's fields; attention_bias stands for q, k and v (always on in Qwen2), mlp_bias stays off."""
    attention_bias: bool = True
    o_bias = False


NAMED_CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=128, tie_word_embeddings=True),
    # Qwen/Qwen2.5-7B (the Instruct model: max_position_embeddings=32768)
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, max_position_embeddings=131072, norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=False),
}


class Qwen2(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """transformers' Qwen2Config dict (config.json) -> Qwen2Config; `options` set ModelOptions fields."""
    return from_hf(Qwen2Config, hf, options, attention_bias=True)


def config_to_hf(c):
    # transformers' Qwen2 reads a head_dim when there is one (hidden_size // heads otherwise) but has no such field
    return to_hf(c, "qwen2", "Qwen2ForCausalLM", drop=("attention_bias",) + (() if c.head_dim else ("head_dim",)))


def from_hf(config_cls, hf, options, **fields):
    """`config_cls` (a QwenConfig) from a Qwen config.json dict: LLaMA's fields, the window as transformers reads it
    (sliding_window only with use_sliding_window), then `fields`."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    return llama.from_hf(config_cls, hf, options, sliding_window=window,
                         max_window_layers=hf.get("max_window_layers", 28),
                         layer_types=tuple(hf.get("layer_types") or ()), **fields)


def to_hf(c, model_type, architecture, drop=()):
    """LLaMA's config.json dict as `model_type`'s, without the keys in `drop` and mlp_bias (no Qwen field), with
    the window."""
    return {**llama.to_hf(c, model_type, architecture, ("mlp_bias", *drop)),
            "use_sliding_window": c.sliding_window is not None, "sliding_window": c.sliding_window,
            "max_window_layers": c.max_window_layers, "layer_types": list(c.layer_types)}


hf_tensor_map = llama.hf_tensor_map


Config, Model = Qwen2Config, Qwen2
