"""Qwen2 and Qwen2.5: the LLaMA layout (`llama.LlamaBlock`) with biases on q, k and v and none on o, which
transformers' Qwen2Attention hard-codes. Config, named configs and the Hugging Face conversion; Qwen3
(`models/qwen3.py`) reuses the conversion.

Sliding-window attention (`use_sliding_window`, off in every released Qwen2 / 2.5 checkpoint) is refused; the block
would take it as Gemma's per-layer kinds (`models/gemma2.py`), but no checkpoint to check it against exists."""
import dataclasses
import json

from models import layers, llama


@dataclasses.dataclass(frozen=True)
class Qwen2Config(llama.LlamaConfig):
    """LlamaConfig's fields; attention_bias stands for q, k and v (always on in Qwen2), mlp_bias stays off."""
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
    """`config_cls` (a LlamaConfig) from a Qwen config.json dict: LLaMA's fields, then `fields`. ValueError for a
    sliding window, which no released Qwen2 / 2.5 / 3 dense model turns on."""
    if hf.get("use_sliding_window"):
        raise ValueError(f"'use_sliding_window' is {json.dumps(hf['use_sliding_window'])}; sliding-window attention is "
                         "not supported yet (expected false)")
    if "sliding_attention" in (hf.get("layer_types") or ()):
        layer = hf["layer_types"].index("sliding_attention")
        raise ValueError(f"'layer_types' has 'sliding_attention' at layer {layer}; sliding-window attention is not "
                         "supported yet (expected only 'full_attention')")
    return llama.from_hf(config_cls, hf, options, **fields)


def to_hf(c, model_type, architecture, drop=()):
    """LLaMA's config.json dict as `model_type`'s, without the keys in `drop` and mlp_bias (no Qwen field)."""
    return {**llama.to_hf(c, model_type, architecture, ("mlp_bias", *drop)), "use_sliding_window": False}


hf_tensor_map = llama.hf_tensor_map


Config, Model = Qwen2Config, Qwen2
