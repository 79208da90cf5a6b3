"""Qwen3-MoE: Qwen3's attention (`llama.LlamaBlock` with q / k RMS-normalised heads, explicit head_dim) and a
mixture of experts (`layers.MoE`: E experts of moe_intermediate_size, softmax top-k, renormalised only with
norm_topk_prob) in the layers `decoder_sparse_step` and `mlp_only_layers` make sparse, the dense MLP of
intermediate_size in the others. No shared expert (transformers' modeling_qwen3_moe has none). Config, named
configs and the Hugging Face conversion (per-expert gate_proj / up_proj / down_proj tensors, stacked [E, ...])."""
import dataclasses

from models import layers, llama, qwen3


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(layers.MoEOptions, qwen3.Qwen3Config):
    """Qwen3Config's fields (a window, with use_sliding_window, in every layer as transformers' Qwen3-MoE) and the
    MoE fields (`layers.MoEOptions`); a model with dense layers among the sparse ones needs scan_layers=False."""
    max_window_layers: int = 0
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int | None = 768
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001


NAMED_CONFIGS = {
    # Qwen3's tiny attention (head_dim 32 on a 64-wide residual) with 4 experts of 32, top-2
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, max_position_embeddings=40960, norm_eps=1e-6,
                          rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True),
}


class Qwen3Moe(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def config_from_hf(hf, **options):
    """transformers' Qwen3MoeConfig dict (config.json; `num_experts` as released, `num_local_experts` as
    transformers 5 writes it) -> Qwen3MoeConfig; `options` set ModelOptions fields."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    return llama.from_hf(Qwen3MoeConfig, hf, options, head_dim=hf.get("head_dim", 128), sliding_window=window,
                         num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
                         num_experts_per_tok=hf.get("num_experts_per_tok", 8),
                         moe_intermediate_size=hf.get("moe_intermediate_size", 768),
                         norm_topk_prob=hf.get("norm_topk_prob", False),
                         decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                         mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                         router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def config_to_hf(c):
    hf = llama.to_hf(c, "qwen3_moe", "Qwen3MoeForCausalLM", drop=("mlp_bias",))
    return {**hf, "use_sliding_window": c.sliding_window is not None, "sliding_window": c.sliding_window,
            "num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
            "decoder_sparse_step": c.decoder_sparse_step, "mlp_only_layers": list(c.mlp_only_layers),
            "router_aux_loss_coef": c.router_aux_loss_coef}


def hf_tensor_map(c):
    """Qwen3's map (LLaMA's with q / k norms), the dense MLP in the dense layers only, the router and the experts in
    the sparse ones."""
    sparse = layers.sparse_layers(c)
    dense = tuple(i for i, s in enumerate(sparse) if not s)
    moe, L = tuple(i for i, s in enumerate(sparse) if s), c.num_layers
    out = [e if e[0][:2] != ("layers", "mlp") else (*e[:3], dense if len(dense) < L else L)
           for e in llama.hf_tensor_map(c) if e[0][:2] != ("layers", "mlp") or dense]
    if moe:
        at = moe if len(moe) < L else L
        out.append((("layers", "mlp", "router", "kernel"), "model.layers.{i}.mlp.gate.weight", True, at))
        out += [(("layers", "mlp", "experts", name), f"model.layers.{{i}}.mlp.experts.{{e}}.{name}_proj.weight", True,
                 at, c.num_experts) for name in ("gate", "up", "down")]
    return out


Config, Model = Qwen3MoeConfig, Qwen3Moe
