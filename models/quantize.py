"""Weight-only storage of the attention and MLP projections (q, k, v, o, gate, up, down) and of a mixture's stacked
experts (gate, up, down [E, ...], with a scale per expert): a frozen base for LoRA (QLoRA's idea) in the formats of
`kernels.matmul.formats`.
- 'int8' (a quarter of float32's bytes): each kernel W [..., in, out] becomes `kernel` int8 q = round(W / s) and
  `kernel_scale` float32 s [..., out] = max|W[:, j]| / 127; layers.Linear computes (x q) s.
- 'nf4' (QLoRA's 4-bit NormalFloat, 4.5 bits a weight): `kernel` uint8 [..., in / 2, out] (two codes a byte) and
  `kernel_scale` float32 [..., in / 64, out] (an absmax per 64 rows); layers.Linear dequantises, then multiplies.
Quantised weights cannot train: train adapters on them (`models.LORA_TRAINABLE`).
"""
import dataclasses

import jax
import jax.numpy as jnp

from kernels.matmul.formats import DEQUANTIZERS, quantize_int8, quantize_nf4
from models.layers import LORA_TARGETS
from models.layers.moe import EXPERT_WEIGHTS

__all__ = ["QUANTIZERS", "dequantize", "is_quantized_kernel", "quantize", "quantize_int8", "quantize_nf4"]
QUANTIZERS = {"int8": quantize_int8, "nf4": quantize_nf4}


def is_quantized_kernel(path):
    """Whether a parameter path (tuple of names) is a weight that `quantize` stores quantised: a projection kernel,
    or one of a mixture's stacked expert weights."""
    return len(path) >= 2 and ((path[-1] == "kernel" and path[-2] in LORA_TARGETS)
                               or (path[-2] == "experts" and path[-1] in EXPERT_WEIGHTS))


def _map_projections(params, fn, path=()):
    """params with fn(node, name, path to the weight) applied to every dict holding a quantisable weight `name` (a
    projection's 'kernel', an expert stack's 'gate' / 'up' / 'down')."""
    if not isinstance(params, dict):
        return params
    names = [k for k in params if is_quantized_kernel(path + (k,))]
    for name in names:
        params = fn(params, name, path + (name,))
    return {k: v if k in names or k.endswith("_scale") and k[:-len("_scale")] in names
            else _map_projections(v, fn, path + (k,)) for k, v in params.items()}


def quantize(model, params, fmt="int8"):
    """(model with quantize=fmt, params with every projection kernel stored as `fmt` ('int8' or 'nf4') + its
    kernel_scale). A model quantised in another format is dequantised first."""
    if fmt not in QUANTIZERS:
        raise ValueError(f"fmt={fmt!r}; expected one of {tuple(QUANTIZERS)}")
    if model.config.quantize == fmt:
        return model, params
    model, params = dequantize(model, params)

    def one(node, name, path):
        try:
            q, scale = jax.jit(QUANTIZERS[fmt])(node[name])
        except ValueError as e:  # a weight the format cannot store (nf4: rows not a multiple of its block)
            raise ValueError(f"{'/'.join(path)}: {e}") from None
        return {**node, name: q, f"{name}_scale": scale}

    return model.clone(config=dataclasses.replace(model.config, quantize=fmt)), _map_projections(params, one)


def dequantize(model, params):
    """(model without quantisation, params with float kernels q s in the config's param_dtype); a model without
    quantisation is returned as it is."""
    if model.config.quantize is None:
        return model, params
    dtype = jnp.dtype(model.config.param_dtype)

    def one(node, name, path):
        weight = DEQUANTIZERS[model.config.quantize](node[name], node[f"{name}_scale"], dtype)
        return {**{k: v for k, v in node.items() if k != f"{name}_scale"}, name: weight}

    return model.clone(config=dataclasses.replace(model.config, quantize=None)), _map_projections(params, one)
