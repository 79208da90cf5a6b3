"""Mixtral: Mistral's layout (`llama.LlamaBlock`, an optional sliding window) with a mixture of experts in every
layer (`layers.MoE`: E experts of intermediate_size, softmax top-k, the k weights renormalised). Config, named
configs and the Hugging Face conversion (transformers' checkpoints keep each expert's w1 / w2 / w3, gate / down /
up, as tensors of their own; ours stacks them [E, ...])."""
import dataclasses

from models import layers, llama, mistral


@dataclasses.dataclass(frozen=True)
class MixtralConfig(layers.MoEOptions, mistral.MistralConfig):
    """MistralConfig's fields (no window unless given: transformers' Mixtral default) and the MoE fields
    (`layers.MoEOptions`; intermediate_size is each expert's width, and every layer is sparse)."""
    sliding_window: int | None = None
    router_aux_loss_coef: float = 0.02


NAMED_CONFIGS = {
    # 4 experts, top-2, in the tiny LLaMA's shapes
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=128, num_experts=4),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, max_position_embeddings=32768, norm_eps=1e-5, rope_theta=1000000.0),
}


class Mixtral(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """transformers' MixtralConfig dict (config.json) -> MixtralConfig; `options` set ModelOptions fields."""
    return llama.from_hf(MixtralConfig, hf, options, sliding_window=hf.get("sliding_window"),
                         num_experts=hf.get("num_local_experts", 8),
                         num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                         router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(c):
    return {**mistral.config_to_hf(c), "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "head_dim": c.head_dim,  # transformers' Mixtral keeps null for hidden_size // heads
            "num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "router_aux_loss_coef": c.router_aux_loss_coef}


def hf_tensor_map(c):
    """LLaMA's map with the MLP replaced by the router and the experts (w1 gate, w2 down, w3 up)."""
    moe = "model.layers.{i}.block_sparse_moe"
    return ([e for e in llama.hf_tensor_map(c) if e[0][:2] != ("layers", "mlp")]
            + [(("layers", "mlp", "router", "kernel"), f"{moe}.gate.weight", True, c.num_layers)]
            + [(("layers", "mlp", "experts", ours), f"{moe}.experts.{{e}}.{theirs}.weight", True, c.num_layers,
                c.num_experts) for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2"))])


Config, Model = MixtralConfig, Mixtral
