"""Qwen3 (dense): the LLaMA layout (`llama.LlamaBlock`) with each q and k head RMS-normalised over head_dim before
rope (`q_norm` / `k_norm`, one scale per head dim shared by the heads) and an explicit head_dim (Qwen3-32B: 64 heads
of 128 on a 5120-wide residual). attention_bias (off in the released models) puts biases on q, k, v and o. The
Hugging Face conversion is Qwen2's (`models/qwen2.py`)."""
import dataclasses

from models import layers, llama, qwen2


@dataclasses.dataclass(frozen=True)
class Qwen3Config(qwen2.QwenConfig):
    """QwenConfig's fields (the window as Qwen2's); q and k heads normalised (the scales' epsilon is norm_eps, as in
    transformers)."""
    qk_norm = True


_QWEN3 = dict(vocab_size=151936, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=False)
NAMED_CONFIGS = {
    # head_dim 32 on a 64-wide residual of 4 heads: q projects 64 -> 128
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, max_position_embeddings=128),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32),  # Qwen/Qwen3-8B
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64),
}


class Qwen3(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


def config_from_hf(hf, **options):
    """transformers' Qwen3Config dict (config.json) -> Qwen3Config; `options` set ModelOptions fields."""
    return qwen2.from_hf(Qwen3Config, hf, options, head_dim=hf.get("head_dim", 128))  # transformers' default


def config_to_hf(c):
    return qwen2.to_hf(c, "qwen3", "Qwen3ForCausalLM")


hf_tensor_map = llama.hf_tensor_map
Config, Model = Qwen3Config, Qwen3
