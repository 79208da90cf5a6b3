"""Weight-only quantised formats of a float weight [..., K, N] (the models' frozen bases, models/quantize.py).

- int8: q = round(w / s) int8 [..., K, N] with a float32 scale s [..., N] per output column (max |w[:, j]| / 127).
  `fused_matmul` and `gated_mlp` take it as it is (each tile converted in the kernel, s on the accumulator).
- nf4 (QLoRA, Dettmers et al. 2023): blocks of `NF4_BLOCK` consecutive rows of a column share a float32 absmax;
  each value is the index (4 bits) of the nearest of the 16 NormalFloat levels to w / absmax, two per byte: row 2i
  in the low nibble, row 2i + 1 in the high one, so a split of the packed rows over devices is a split of whole
  rows. 4.5 bits per weight with the scales (QLoRA's double quantisation of the scales is not done). Dequantised
  (`dequantize_nf4`) before the matmul.
"""
import jax.numpy as jnp
import numpy as np

# The NormalFloat-4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (the QLoRA paper's NF4).
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
NF4_BLOCK = 64


def _xp(w):
    return np if isinstance(w, np.ndarray) else jnp


def quantize_int8(w, axis=-2):
    """(int8 q, float32 scale) of a float array (numpy or jax), symmetric along `axis`: q = round(w / scale),
    scale = max |w| / 127 over `axis` (which the scale lacks). The default, a weight [..., K, N] per output column,
    is the format `fused_matmul` and `gated_mlp` take; `kernels.quantize_kv` is axis -1 (per token and head)."""
    xp = _xp(w)
    w = w.astype(xp.float32)
    absmax = xp.max(xp.abs(w), axis=axis)
    scale = xp.where(absmax > 0, absmax / 127.0, 1.0).astype(xp.float32)
    q = xp.clip(xp.round(w / xp.expand_dims(scale, axis)), -127, 127).astype(xp.int8)
    return q, scale


def dequantize_int8(q, scale, dtype=jnp.float32):
    """The float array in `dtype` of `quantize_int8`'s (q, scale) for a weight [..., K, N] (scale per column)."""
    return (q.astype(jnp.float32) * scale[..., None, :].astype(jnp.float32)).astype(dtype)


def quantize_nf4(w):
    """(packed uint8 [..., K/2, N], float32 absmax [..., K/NF4_BLOCK, N]) of a float weight [..., K, N] (numpy or
    jax); K must be a multiple of NF4_BLOCK."""
    xp = _xp(w)
    *lead, k, n = w.shape
    if k % NF4_BLOCK:
        raise ValueError(f"weight.shape={tuple(w.shape)}; nf4 needs its rows K a multiple of {NF4_BLOCK}")
    blocks = w.astype(xp.float32).reshape(*lead, k // NF4_BLOCK, NF4_BLOCK, n)
    absmax = xp.max(xp.abs(blocks), axis=-2)
    absmax = xp.where(absmax > 0, absmax, 1.0).astype(xp.float32)
    levels = np.asarray(NF4_LEVELS, np.float32)
    # The nearest level: count the midpoints below the value.
    index = xp.searchsorted(xp.asarray((levels[1:] + levels[:-1]) / 2), blocks / absmax[..., None, :])
    index = index.astype(xp.uint8).reshape(*lead, k // 2, 2, n)
    return (index[..., 0, :] | (index[..., 1, :] << 4)).astype(xp.uint8), absmax


def dequantize_nf4(packed, absmax, dtype=jnp.float32):
    """The float weight [..., K, N] in `dtype` of `quantize_nf4`'s (packed, absmax)."""
    *lead, half, n = packed.shape
    index = jnp.stack([packed & 15, packed >> 4], axis=-2).reshape(*lead, 2 * half, n)
    values = jnp.asarray(NF4_LEVELS, jnp.float32)[index.astype(jnp.int32)]
    values = values.reshape(*lead, absmax.shape[-2], -1, n) * absmax[..., None, :].astype(jnp.float32)
    return values.reshape(*lead, 2 * half, n).astype(dtype)


DEQUANTIZERS = {"int8": dequantize_int8, "nf4": dequantize_nf4}  # by a config's `quantize` name
