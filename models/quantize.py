"""Weight-only storage of the attention and MLP projections (q, k, v, o, gate, up, down): a frozen base for LoRA
(QLoRA's idea) in the formats of `kernels.matmul.formats`.
- 'int8' (a quarter of float32's bytes): each kernel W [..., in, out] becomes `kernel` int8 q = round(W / s) and
  `kernel_scale` float32 s [..., out] = max|W[:, j]| / 127; layers.Linear computes (x q) s.
- 'nf4' (QLoRA's 4-bit NormalFloat, 4.5 bits a weight): `kernel` uint8 [..., in / 2, out] (two codes a byte) and
  `kernel_scale` float32 [..., in / 64, out] (an absmax per 64 rows); layers.Linear dequantises, then multiplies.
Quantised weights cannot train: train adapters on them (`models.LORA_TRAINABLE`).
"""
import dataclasses

import jax
import jax.numpy as jnp

from kernels.matmul.formats import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from models.layers import LORA_TARGETS

__all__ = ["QUANTIZERS", "dequantize", "is_quantized_kernel", "quantize", "quantize_int8", "quantize_nf4"]
QUANTIZERS = {"int8": quantize_int8, "nf4": quantize_nf4}
_DEQUANTIZERS = {"int8": dequantize_int8, "nf4": dequantize_nf4}


def is_quantized_kernel(path):
    """Whether a parameter path (tuple of names) is a projection kernel that `quantize` stores as int8."""
    return len(path) >= 2 and path[-1] == "kernel" and path[-2] in LORA_TARGETS


def _map_projections(params, fn, path=()):
    if not isinstance(params, dict):
        return params
    if "kernel" in params and is_quantized_kernel(path + ("kernel",)):
        return fn(params)
    return {k: _map_projections(v, fn, path + (k,)) for k, v in params.items()}


def quantize(model, params, fmt="int8"):
    """(model with quantize=fmt, params with every projection kernel stored as `fmt` ('int8' or 'nf4') + its
    kernel_scale). A model quantised in another format is dequantised first."""
    if fmt not in QUANTIZERS:
        raise ValueError(f"fmt={fmt!r}; expected one of {tuple(QUANTIZERS)}")
    if model.config.quantize == fmt:
        return model, params
    model, params = dequantize(model, params)

    def one(node):
        q, scale = jax.jit(QUANTIZERS[fmt])(node["kernel"])
        return {**node, "kernel": q, "kernel_scale": scale}

    return model.clone(config=dataclasses.replace(model.config, quantize=fmt)), _map_projections(params, one)


def dequantize(model, params):
    """(model without quantisation, params with float kernels q s in the config's param_dtype); a model without
    quantisation is returned as it is."""
    if model.config.quantize is None:
        return model, params
    dtype = jnp.dtype(model.config.param_dtype)

    def one(node):
        kernel = _DEQUANTIZERS[model.config.quantize](node["kernel"], node["kernel_scale"], dtype)
        return {**{k: v for k, v in node.items() if k != "kernel_scale"}, "kernel": kernel}

    return model.clone(config=dataclasses.replace(model.config, quantize=None)), _map_projections(params, one)
