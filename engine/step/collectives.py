"""The shard_map step's collectives over the manual data axes, float and int8 (ZeRO++, `Int8`): the ZeRO-3 gather of
a parameter shard with its reduce-scatter as the backward pass (`zero3_gather`), and the gradient reductions
(`reduce_gradient`); each on every device's `model` block where the parameter is split over `model` too
(`in_model_blocks`). `dims` arguments are `((dim, axes), ...)`: the dims a shard is split along and the mesh axes
that split each.
"""
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

import kernels
from kernels.axes import entry_axes


class Int8(NamedTuple):
    """ZeRO++'s quantized communication (Wang et al., 2023) in the shard_map step, for every ZeRO-3 parameter of two
    or more dims (vectors, such as norm scales, travel as before). `weights` (qwZ): each shard is all-gathered as
    int8 codes with a float32 absmax scale per row of its last dim (half the bytes of a bf16 gather), so the
    forward and backward passes see the dequantised weights (an error of at most 1/254 of a row's largest value,
    the same in both, so the recompute is consistent). `gradients` (qgZ): every gradient reduction of a parameter of
    two or more dims: a reduce-scatter (ZeRO-3's over `fsdp`, ZeRO-1/2's over `data`) becomes an all-to-all of int8
    chunks with per-row scales, summed in float32 on the receiving device (a quarter of a float32 reduce-scatter's
    bytes), and an all-reduce (ZeRO-0's over `data`) that exchange followed by an int8 all-gather of the summed
    chunks (`all_reduce_int8`). The optimizer's master weights and state are untouched."""

    weights: bool = False
    gradients: bool = False


def _int8_rows(x):
    """x (float) -> int8 codes and float32 scales [..., 1], absmax per row of the last dim (`kernels.quantize_int8`'s
    format along axis -1, the scales kept as a trailing dim so that they gather and exchange like the codes)."""
    q, scale = kernels.quantize_int8(x, axis=-1)
    return q, scale[..., None]


def to_bfloat16(x):
    """float32 -> bfloat16 rounded to nearest even, exactly as `x.astype(jnp.bfloat16)`, through the integer bits.
    Why not `astype`: XLA:TPU's bfloat16 propagation sees a stacked fp32 weight whose only use in the layer loop is
    its bf16 cast, and casts the whole stack once outside the loop, alive from the forward pass to the end of the
    backward (3.2 GB per chip for LLaMA-7B on v5p-8); the integer ops keep the stack fp32 and cast one layer at a
    time."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = bits + ((bits >> 16) & 1) + jnp.uint32(0x7FFF)
    y = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.isnan(x), jnp.bfloat16(jnp.nan), y)


def cast(x, dtype):
    """`x.astype(dtype)`; fp32 -> bf16 through `to_bfloat16`."""
    if x.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
        return to_bfloat16(x)
    return x.astype(dtype)


def all_gather(x, dims, dtype, int8=False):
    """A shard `x` all-gathered in `dtype` over `dims` ((dim, axes), ...); with `int8` (and two or more dims) as
    codes and row scales (`Int8.weights`; floating shards only: an int8 base weight already travels as int8)."""
    if not (int8 and x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)):
        y = cast(x, dtype)
        for dim, axes in dims:
            y = jax.lax.all_gather(y, axes, axis=dim, tiled=True)
        return y
    q, scale = _int8_rows(x)
    for dim, axes in dims:  # gathered along the last dim, the scales become one column per shard
        q, scale = (jax.lax.all_gather(a, axes, axis=dim, tiled=True) for a in (q, scale))
    shards = scale.shape[-1]
    blocks = q.reshape(*q.shape[:-1], shards, q.shape[-1] // shards).astype(jnp.float32)
    return (blocks * scale[..., None]).reshape(q.shape).astype(dtype)


def reduce_scatter(g, dims, reduce_dtype, dtype, int8=False):
    """The transpose of `all_gather`: a full-size gradient summed in `reduce_dtype` and scattered back to the shard
    layout, returned in `dtype`. With `int8` (and two or more dims; `Int8.gradients`): per axis group, the gradient
    cut into one chunk per device, each chunk sent as int8 codes and row scales by an all-to-all, the received
    chunks dequantised and summed in float32."""
    if not (int8 and g.ndim >= 2):
        g = g.astype(reduce_dtype)
        for dim, axes in reversed(dims):
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        return g.astype(dtype)
    g = g.astype(jnp.float32)
    for dim, axes in reversed(dims):
        n = math.prod(jax.lax.axis_size(a) for a in axes)
        chunks = jnp.moveaxis(g.reshape(*g.shape[:dim], n, g.shape[dim] // n, *g.shape[dim + 1:]), dim, 0)
        q, scale = (jax.lax.all_to_all(a, axes, 0, 0, tiled=True) for a in _int8_rows(chunks))
        g = jnp.sum(q.astype(jnp.float32) * scale, axis=0)  # chunk i from device i: this device's part
    return g.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def zero3_gather(x, dims, dtype, reduce_dtype, int8, grad_dtype=None):
    """ZeRO-3 all-gather of a parameter shard in `dtype` (the compute dtype: bf16 gathers move half the bytes of
    fp32); its backward reduce-scatters the gradient in `reduce_dtype`, rounds it to `grad_dtype` (None: no rounding)
    and returns it in the shard's dtype. `int8`: an `Int8`."""
    return all_gather(x, dims, dtype, int8.weights)


def _gather_fwd(x, dims, dtype, reduce_dtype, int8, grad_dtype):
    return zero3_gather(x, dims, dtype, reduce_dtype, int8, grad_dtype), jnp.zeros((0,), x.dtype)


def _gather_bwd(dims, dtype, reduce_dtype, int8, grad_dtype, res, g):
    g = reduce_scatter(g, dims, reduce_dtype, grad_dtype or res.dtype, int8.gradients)
    return (g.astype(res.dtype),)


zero3_gather.defvjp(_gather_fwd, _gather_bwd)


def is_zero3_gather(params):
    """Whether a traced `custom_vjp_call` equation's `params` are a `zero3_gather`'s (its backward function named, as
    JAX 0.10 and 0.11 name it)."""
    return getattr(params.get("bwd"), "f", None) is _gather_bwd


def all_reduce_int8(g, axes):
    """`psum(g, axes)` in float32 with int8 traffic: the int8 reduce-scatter of `reduce_scatter` along the first dim
    the group size divides, then this device's summed chunk all-gathered as int8 rows (`all_gather`), so each value
    is rounded twice (to 1/254 of its chunk row's largest, then of the sum's). Exact psum when no dim divides."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    dim = next((d for d in range(g.ndim) if g.shape[d] % n == 0), None)
    if dim is None:
        return jax.lax.psum(g.astype(jnp.float32), axes)
    part = reduce_scatter(g, ((dim, axes),), jnp.float32, jnp.float32, int8=True)
    return all_gather(part, ((dim, axes),), jnp.float32, int8=True)


def reduce_gradient(g, plan_scatter, plan_reduce, reduce_dtype, auto_spec=None, int8=False):
    """Sums a local gradient over the data-parallel shards: reduce-scatter over `plan_scatter`, all-reduce over
    `plan_reduce`, in `reduce_dtype`, back in fp32; with `int8` (`Int8.gradients`, gradients of two or more dims)
    both as int8 exchanges (`reduce_scatter`, `all_reduce_int8`). A gradient split over `model` (`auto_spec`) is
    reduced block by block over `model` (`in_model_blocks`)."""
    if not plan_scatter and not plan_reduce:
        return g

    def reduce(g):
        if int8 and g.ndim >= 2:
            g = reduce_scatter(g, plan_scatter, jnp.float32, jnp.float32, int8=True)
            return all_reduce_int8(g, plan_reduce) if plan_reduce else g
        g = g.astype(reduce_dtype)
        for dim, axes in plan_scatter:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        if plan_reduce:
            g = jax.lax.psum(g, plan_reduce)
        return g.astype(jnp.float32)

    return in_model_blocks(reduce, g, auto_spec, plan_scatter)


def in_model_blocks(collective, x, auto_spec, dims):
    """`collective(x)`, a gather or reduction of `x` over the manual axes along `dims` ((dim, axes), ...), run on each
    device's block of the automatic axes (`auto_spec`: the parameter's split over `model`, or None), in a shard_map
    manual over them, so that the automatic split is kept through the collective. Left to the partitioner, a gather
    or reduce-scatter over `fsdp` or `data` of a `model`-split weight came with the `model` dim gathered around it:
    the tiny LLaMA's ZeRO-3 step on fsdp 2 x model 2 sent 1.53x fsdp 2 alone's all-gather and reduce-scatter bytes,
    block by block 0.50x (tests/test_step.py; Mixtral-8x7B: models/README.md); a ZeRO-1 reduction, 2.9 GB more per
    MLP stack for LLaMA-7B on 2x2x2. A dim in `dims` that `model` splits too stays with the partitioner: block by
    block, each device would hold a piece of every `model` block instead of one contiguous chunk."""
    if auto_spec is None or any(auto_spec[dim] for dim, _ in dims):
        return collective(x)
    named = {a for e in auto_spec for a in entry_axes(e)}
    return jax.shard_map(collective, in_specs=auto_spec, out_specs=auto_spec, axis_names=named, check_vma=False)(x)
