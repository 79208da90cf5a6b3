"""Mistral: the LLaMA layout (`llama.LlamaBlock`) with sliding-window attention in every layer (`sliding_window`:
a query sees that many newest positions, its own included, as in transformers; null: full attention), whose KV
cache is then a ring of the window (`layers.empty_cache`). Config, named configs and the Hugging Face conversion."""
import dataclasses

from models import layers, llama


@dataclasses.dataclass(frozen=True)
class MistralConfig(llama.LlamaConfig):
    """LlamaConfig's fields (no biases in Mistral) and the window."""
    sliding_window: int | None = 4096

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r}; expected a positive integer or None")


NAMED_CONFIGS = {
    # a window of 8 inside the 16-token rows the tests train on
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=128, sliding_window=8),
    # mistralai/Mistral-7B-v0.1 (v0.2 / v0.3: no window, rope_theta 1e6; v0.3 a 32768-token vocabulary)
    "mistral-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, max_position_embeddings=32768, norm_eps=1e-5, rope_theta=10000.0,
                       sliding_window=4096),
}


class Mistral(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """transformers' MistralConfig dict (config.json) -> MistralConfig; `options` set ModelOptions fields. A missing
    sliding_window is transformers' default, 4096."""
    return llama.from_hf(MistralConfig, hf, options, sliding_window=hf.get("sliding_window", 4096))


def config_to_hf(c):
    return {**llama.to_hf(c, "mistral", "MistralForCausalLM", drop=("attention_bias", "mlp_bias")),
            "sliding_window": c.sliding_window}


hf_tensor_map = llama.hf_tensor_map
Config, Model = MistralConfig, Mistral
