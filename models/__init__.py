"""Native Flax model definitions (LLaMA, GPT-J, OPT, T5, Qwen2 / 2.5, Qwen3, Mistral, Gemma 2, Gemma 3 text, Mixtral,
Qwen3-MoE) with Hugging Face checkpoint import/export and generation.

Parameters are a plain nested dict of arrays; Dense kernels are [in, out]. Decoder-only models:
`model.apply({'params': p}, input_ids [B, T], attention_mask [B, T] | None) -> logits [B, T, vocab]` (float32);
attention_mask is 0 on padding, 1 on tokens, or per-sequence ids > 0 for packed sequences. T5:
`model.apply({'params': p}, input_ids, decoder_input_ids, attention_mask=None, decoder_attention_mask=None)`.
"""
from models.flops import train_flops_per_example
from models.gemma2 import Gemma2, Gemma2Config
from models.gemma3 import Gemma3, Gemma3Config
from models.generate import generate
from models.gptj import GPTJ, GPTJConfig
from models.hf import (config_from_hf, load_model, load_pretrained, load_sequence_classifier, load_tokenizer,
                       save_pretrained)
from models.layers import ModelOptions, stack_layers
from models.llama import Llama, LlamaConfig
from models.lora import (LORA_TRAINABLE, adapters_off, add_lora, has_lora, load_lora_adapter, merge_lora,
                         save_lora_adapter)
from models.mistral import Mistral, MistralConfig
from models.mixtral import Mixtral, MixtralConfig
from models.opt import OPT, OPTConfig
from models.paged_generate import PagedEngine, generate_continuous, page_bytes
from models.quantize import dequantize, quantize
from models.qwen2 import Qwen2, Qwen2Config
from models.qwen3 import Qwen3, Qwen3Config
from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from models.registry import FAMILIES, add_fp8_histories, create_model, get_config, init_params, param_shardings
from models.reward import SCORE_TRAINABLE, RewardModel, init_reward_params, load_reward_model, save_reward_model
from models.t5 import T5, T5Config
