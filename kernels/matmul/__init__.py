"""Fused matmul kernels: matmul + bias + activation (`fused_matmul`), the gated MLP (`gated_mlp`), and linear +
cross-entropy without logits (`linear_cross_entropy`, with its vocabulary-parallel form `vocab_parallel_loss`; its
row-chunked weighted sum with the gradients taken in the forward, `linear_cross_entropy_sum`).

Every op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'` (see `kernels._dispatch`), `interpret=True`
to run a Pallas kernel in Pallas's interpreter on CPU, and `block_sizes=BlockSizes(...)` to override the per-backend
table in `_blocks.py`. `api.py` holds the matmul ops and what the family shares, `cross_entropy.py` the loss,
`reference.py` the plain-JAX backend and the interface every backend implements, `triton.py` / `mosaic_tpu.py` the
Pallas kernels, `formats.py` the int8 / NF4 weight formats.
"""
from kernels.matmul._blocks import BlockSizes
from kernels.matmul.api import fused_matmul, gated_mlp
from kernels.matmul.cross_entropy import (VocabParallelLoss, linear_cross_entropy, linear_cross_entropy_sum,
                                         vocab_parallel_loss)
from kernels.matmul.formats import dequantize_nf4, quantize_int8, quantize_nf4

__all__ = ["BlockSizes", "VocabParallelLoss", "dequantize_nf4", "fused_matmul", "gated_mlp", "linear_cross_entropy",
           "linear_cross_entropy_sum", "quantize_int8", "quantize_nf4", "vocab_parallel_loss"]
