"""Building blocks shared by every family, written once; each family file composes them as `layers.X`.

- options.py: `ModelOptions` (the runtime options of every config), `sublayer_options`, `LORA_TARGETS`, the compute
  dtype rule (`compute_dtype`, `config_dtype`, `layer_dtype`: a config's dtype, else the parameters').
- linear.py: `Linear` (float / int8 / NF4 kernels, LoRA adapters, the fused-matmul path), `activation`.
- norms.py: `Norm` (RMSNorm, LayerNorm).
- rotary.py: `segment_positions`, `Rotary` (with the rope-scaling variants), `rope_from_hf` / `rope_to_hf`.
- attention.py: `attend`, `Attention` (with its KV cache), `empty_cache`.
- mlp.py: `MLP` (gated or not).
- moe.py: `MoE` (router, dropless experts on kernels.grouped_matmul), `MoEOptions`, `moe_block`,
  `is_sparse_layer` / `sparse_layers`, `router_losses` (load balancing and z-loss from the sown router statistics).
- parallel.py: `split_tokens` / `gather_tokens` (context and sequence parallelism of the residual stream).
- stack.py: `apply_layers` (scan, remat, pipeline).
- decoder.py: `DecoderLM`, `decoder_context`, `token_embedding`, `lm_output`, `stack_layers`, `sliding_layers`.

Layouts: activations [batch, len, d_model]; attention heads [batch, len, heads, head_dim]. Dense kernels are stored
[in, out] (the transpose of PyTorch's Linear.weight). Parameters are a plain nested dict of arrays.
"""
from models.layers.attention import Attention, attend, empty_cache
from models.layers.decoder import (DecoderLM, decoder_context, lm_output, sliding_layers, stack_layers,
                                   token_embedding)
from models.layers.linear import Linear, activation, lora_a_init
from models.layers.mlp import MLP
from models.layers.moe import MoE, MoEOptions, is_sparse_layer, moe_block, router_losses, sparse_layers
from models.layers.norms import Norm
from models.layers.options import (LORA_TARGETS, QUANTIZE_FORMATS, ModelOptions, compute_dtype, config_dtype,
                                   layer_dtype, sublayer_options)
from models.layers.parallel import gather_tokens, split_tokens
from models.layers.rotary import Rotary, rope_from_hf, rope_to_hf, segment_positions
from models.layers.stack import apply_layers
