"""Gemma 3 text (model_type 'gemma3_text'): Gemma 2's layout (`models/gemma2.py`) with each q and k head
RMS-normalised (scale 1 + w) before rope, five local layers to a global one (layer_types, else
sliding_window_pattern, 6), separate ropes for local layers (rope_local_base_freq) and global ones (rope_theta, with
rope_scaling: linear factor 8 in the 4B-27B models), and no soft-capping of the attention logits (transformers'
Gemma 3 ignores attn_logit_softcapping; the final soft-cap stays, off in the released models). The multimodal
'gemma3' checkpoints (vision tower, `language_model.` names) are another family."""
import dataclasses

from models import gemma2, layers, llama
from models.gemma2 import FULL, SLIDING


@dataclasses.dataclass(frozen=True)
class Gemma3Config(gemma2.GemmaConfig):
    """GemmaConfig's fields; rope_theta and rope_scaling are the global layers' rope, rope_local_theta and
    rope_local_scaling the local layers'."""
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_local_scaling: tuple = ()
    qk_norm = True
    sliding_pattern = 6

    def __post_init__(self):
        super().__post_init__()
        # transformers' local layers without a window attend to everything but keep their own rope; ours would not
        if self.sliding_window is None and any(t == SLIDING for t in self.layer_types):
            raise ValueError("sliding_window=None with 'sliding_attention' layers; expected a window (Gemma 3's local "
                             "layers)")


_GEMMA3 = dict(vocab_size=262208, max_position_embeddings=131072, norm_eps=1e-6, rope_theta=1_000_000.0,
               rope_scaling=(("factor", 8.0), ("rope_type", "linear")), rope_local_theta=10_000.0,
               sliding_window=1024)
NAMED_CONFIGS = {
    # Gemma 2's with 6 layers: 5 local, then a global one
    "tiny": dict(gemma2.NAMED_CONFIGS["tiny"], num_layers=6),
    # google/gemma-3-12b-pt and gemma-3-27b-pt's text_config (their vision towers are not counted)
    "gemma-3-12b": dict(_GEMMA3, hidden_size=3840, intermediate_size=15360, num_layers=48, num_heads=16,
                        num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma-3-27b": dict(_GEMMA3, hidden_size=5376, intermediate_size=21504, num_layers=62, num_heads=32,
                        num_kv_heads=16, head_dim=128, query_pre_attn_scalar=168),
}


class Gemma3(layers.DecoderLM):
    """Decoder-only LM; the call signature is layers.DecoderLM's."""
    block = llama.LlamaBlock
    norm_kind = "rms"


# ----------------------------------------------------------------------------------------------- Hugging Face

def _ropes(hf):
    """(global (theta, scaling), local (theta, scaling)) from transformers 5's rope_parameters per layer type, or
    the released config.json's rope_theta + rope_scaling (global) and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full, local = dict(hf.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    length = hf.get("max_position_embeddings", 131072)
    return [layers.rope_from_hf({"rope_parameters": p, "max_position_embeddings": length}) for p in (full, local)]


def config_from_hf(hf, **options):
    """transformers' Gemma3TextConfig dict (config.json) -> Gemma3Config; `options` set ModelOptions fields."""
    (theta, scaling), (local_theta, local_scaling) = _ropes(hf)
    pattern = hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"])]
    return gemma2.from_hf(Gemma3Config, {**hf, "rope_parameters": dict(scaling, rope_theta=theta)}, options,
                          max_position_embeddings=hf.get("max_position_embeddings", 131072), layer_types=tuple(types),
                          rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                          rope_local_scaling=local_scaling, final_logit_softcap=hf.get("final_logit_softcapping"))


def config_to_hf(c):
    return gemma2.to_hf(c, "gemma3_text", "Gemma3ForCausalLM", rope_local_base_freq=c.rope_local_theta,
                        rope_parameters={FULL: layers.rope_to_hf(c.rope_theta, c.rope_scaling),
                                         SLIDING: layers.rope_to_hf(c.rope_local_theta, c.rope_local_scaling)})


hf_tensor_map = llama.hf_tensor_map
Config, Model = Gemma3Config, Gemma3
