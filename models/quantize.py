"""int8 weight-only storage of the attention and MLP projections (q, k, v, o, gate, up, down): a frozen base for
LoRA in a quarter of float32's bytes (QLoRA's idea, with symmetric per-column int8 instead of NF4). Each kernel W
[..., in, out] becomes `kernel` int8 q = round(W / s) and `kernel_scale` float32 s [..., out] = max|W[:, j]| / 127;
layers.Linear computes (x q) s. Quantised weights cannot train: train adapters on them (`models.LORA_TRAINABLE`).
"""
import dataclasses

import jax
import jax.numpy as jnp

from kernels.matmul import quantize_int8
from models.layers import LORA_TARGETS

__all__ = ["dequantize", "is_quantized_kernel", "quantize", "quantize_int8"]


def is_quantized_kernel(path):
    """Whether a parameter path (tuple of names) is a projection kernel that `quantize` stores as int8."""
    return len(path) >= 2 and path[-1] == "kernel" and path[-2] in LORA_TARGETS


def _map_projections(params, fn, path=()):
    if not isinstance(params, dict):
        return params
    if "kernel" in params and is_quantized_kernel(path + ("kernel",)):
        return fn(params)
    return {k: _map_projections(v, fn, path + (k,)) for k, v in params.items()}


def quantize(model, params):
    """(model with quantize='int8', params with every projection kernel stored as int8 + kernel_scale)."""
    if model.config.quantize == "int8":
        return model, params

    def one(node):
        q, scale = jax.jit(quantize_int8)(node["kernel"])
        return {**node, "kernel": q, "kernel_scale": scale}

    return model.clone(config=dataclasses.replace(model.config, quantize="int8")), _map_projections(params, one)


def dequantize(model, params):
    """(model without quantisation, params with float kernels q s in the config's param_dtype); a model without
    quantisation is returned as it is."""
    if model.config.quantize is None:
        return model, params
    dtype = jnp.dtype(model.config.param_dtype)

    def one(node):
        kernel = (node["kernel"].astype(jnp.float32) * node["kernel_scale"][..., None, :]).astype(dtype)
        return {**{k: v for k, v in node.items() if k != "kernel_scale"}, "kernel": kernel}

    return model.clone(config=dataclasses.replace(model.config, quantize=None)), _map_projections(params, one)
