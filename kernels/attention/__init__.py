"""Attention kernel family: `flash_attention` (reference 'xla', GPU 'triton' and 'cudnn', TPU 'mosaic_tpu'),
`decode_attention` (the same forward kernels split along a KV cache), `paged_attention` (a decoding step through a
page table) and `mha_reference`.

Layout [batch, len, heads, head_dim] as in `jax.nn.dot_product_attention`; see `flash_attention` for the contract.
"""
from kernels.attention.api import BlockSizes, decode_attention, flash_attention, quantize_kv
from kernels.attention.paged import paged_attention
from kernels.attention.reference import dropout_keys, dropout_multiplier, mha_reference
