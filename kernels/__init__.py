"""Hand-written Pallas kernels (GPU: Triton backend; TPU: Mosaic) with plain-JAX references.

Each family lives in its own sub-package: reference, GPU kernel, TPU kernel and the dispatching public op.
"""
from kernels._defaults import default_implementation
from kernels._dispatch import (ATTENTION_IMPLEMENTATIONS, IMPLEMENTATIONS, implementation_for_platform,
                               resolve_implementation)
from kernels._partition import (CONTEXT_AXIS, MODEL_AXIS, auto_axis_size, automatic_axes, batch_axes, context_size,
                                manual_axis_size, manual_batch_axes, manual_context_size, shard, tracing_mesh,
                                under_mesh, vmapped)
from kernels.attention import (decode_attention, dropout_keys, dropout_multiplier, flash_attention, mha_reference,
                               paged_attention, quantize_kv)
from kernels.grouped_matmul import grouped_matmul  # the op; the sub-package stays importable by its path
from kernels.matmul import fused_matmul, gated_mlp, linear_cross_entropy, linear_cross_entropy_sum, quantize_int8
from kernels.shard_rules import is_shard, register_shard_rule, shard_rule
