"""`flash_attention(implementation='cudnn')`: cuDNN's fused flash attention, forward and its own backward, through
`jax.nn.dot_product_attention(implementation='cudnn')` (whose VJP is cuDNN's backward). A baseline for our kernels
and, where `kernels/defaults.json` measured it fastest, the default.

Unlike the other implementation modules this one has no `forward` / `backward` on padded tiles: cuDNN takes any
length, picks its own tiles and differentiates itself, and the public API returns no log-sum-exp to the backward
(so ring attention and `decode_attention`, which merge partial results by it, do not take 'cudnn').

What that API expresses (JAX 0.10.2 and 0.11.2 alike) and how `flash_attention`'s arguments map onto it:
- grouped-query heads (heads % kv_heads == 0, no repeat), `sm_scale` -> `scale`, `causal` -> `is_causal` (top-left
  aligned, as ours);
- `window=(left, right)`: cuDNN's window is a left one ending at the query (`local_window_size=(left, 0)` becomes
  its sliding_window_length left + 1, keys i - left ... i), so it is exact with `causal=True` (causal cuts any right
  side) or `right == 0` (which is causal): both run as causal with (left, 0); a right side without causal is refused;
- bf16 / fp16 only (cuDNN's fused kernels), head_dim a multiple of 8 up to 256 (128 before Hopper: cuDNN refuses);
- `segment_ids` as one [B, T] array (self-attention, T == S) -> a boolean `mask` [B, 1, T, T] of equal ids, which
  JAX turns into an additive bias cuDNN reads beside its causal mask or window (no bias gradient under JAX 0.11):
  the same set of keys per query as the other implementations', each query seeing at least itself. It costs a
  [B, 1, T, T] bf16 bias per call (32 MiB at B 4, T 2048; 512 MiB at B 1, T 16384) and its reads. The API's packed
  layout (per-segment offsets) would need a static bound on the documents a row holds; it is not used;
- not expressible, refused: `segment_ids` as a (q_ids, kv_ids) pair (a query whose id no key carries would see
  cuDNN's uniform weights over masked logits where the others give 0), `dropout_rate` (no dropout argument),
  `logit_soft_cap` (none), `block_sizes` (cuDNN's own tiles), interpret mode and any device but an NVIDIA GPU.
"""
from jax.nn import dot_product_attention
import jax.numpy as jnp

from kernels import _dispatch

_OTHERS = "'xla', 'triton' or 'mosaic_tpu'"
DTYPES = (jnp.bfloat16, jnp.float16)


def check_device(interpret):
    """Raises ValueError unless the trace is for an NVIDIA GPU (`_dispatch.target_device`) and not interpreted."""
    if interpret:
        raise ValueError("implementation='cudnn' with interpret=True; cuDNN runs on an NVIDIA GPU only (interpret "
                         "mode is for the Pallas kernels 'triton' and 'mosaic_tpu')")
    device = _dispatch.target_device()
    if not _dispatch.is_nvidia_gpu(device):
        raise ValueError(f"implementation='cudnn' on {device.platform} ({device.device_kind}); cuDNN runs on an "
                         f"NVIDIA GPU only: expected {_OTHERS} here")


def check(q, k, *, segment_ids, dropout_rate, window, causal, logit_soft_cap, block_sizes):
    """Raises a one-line ValueError for what cuDNN through `jax.nn.dot_product_attention` cannot express."""
    refused = (("segment_ids", isinstance(segment_ids, (tuple, list)), "as a (q_ids, kv_ids) pair a query may see "
                "no key, where cuDNN's masked softmax is uniform instead of 0: one [B, T] array (self-attention) is "
                "taken"),
               ("dropout_rate", bool(dropout_rate), "jax.nn.dot_product_attention has no dropout"),
               ("logit_soft_cap", logit_soft_cap is not None, "jax.nn.dot_product_attention has no soft cap"),
               ("block_sizes", block_sizes is not None, "cuDNN picks its own tiles"))
    for name, given, why in refused:
        if given:
            raise ValueError(f"{name} with implementation='cudnn'; {why}: expected {_OTHERS} for it")
    if window is not None and window[1] and not causal:
        raise ValueError(f"window={window} without causal with implementation='cudnn'; cuDNN's window ends at the "
                         f"query (right 0, or causal=True): expected {_OTHERS} for a right side")
    if q.dtype not in DTYPES:
        raise ValueError(f"q.dtype={q.dtype} with implementation='cudnn'; expected bfloat16 or float16 (cuDNN's "
                         f"fused attention), or {_OTHERS}")
    D = q.shape[3]
    if D % 8 or D > 256:
        raise ValueError(f"head_dim={D} with implementation='cudnn'; expected a multiple of 8 up to 256 (cuDNN), or "
                         f"{_OTHERS}")


def attention(q, k, v, ids=None, *, causal, sm_scale, window):
    """cuDNN's attention of q [B, T, H, D], k / v [B, S, KVH, D] with `flash_attention`'s (checked) causal,
    sm_scale (None: 1 / sqrt(D)) and window, and segment ids [B, T] (None: none; T == S); differentiable (cuDNN's
    backward)."""
    if window is not None:  # keys i - left ... i, as `check` allows
        causal, window = True, (window[0], 0)
    mask = None if ids is None else ids[:, None, :, None] == ids[:, None, None, :]
    return dot_product_attention(q, k, v, mask=mask, scale=sm_scale, is_causal=causal, local_window_size=window,
                                 implementation="cudnn")
