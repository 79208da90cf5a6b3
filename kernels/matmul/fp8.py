"""FP8 matmul with per-tensor current scaling (`fp8_dot`): the training recipe of torchtitan's float8 linear (its
default, "dynamic" scaling) and of the FP8 papers (Micikevicius et al., 2022, "FP8 Formats for Deep Learning").

Forward: x and w are each quantised to float8_e4m3fn (3 mantissa bits, max 448) with one float32 scale per tensor,
scale = amax / 448, computed from this very tensor in the step (no amax history, so nothing joins the training
state); the fp8 operands are multiplied with float32 accumulation and the product scaled back. Backward: the output gradient
is quantised to float8_e5m2 (2 mantissa bits, max 57344: the wider range gradients need) with its own scale, and
both gradient products (dx = g w^T, dw = x^T g) take it with the forward's saved e4m3 operands, so the residuals
are the two fp8 tensors and two scalars (half a bf16 activation's bytes).

Every product is a dot_general of the two fp8 arrays themselves (preferred_element_type float32) whose result is
multiplied by the two scalar scales. Compiled for an H100 (deviceless, the GPU compile tier: models/README.md#fp8)
XLA makes each of the three products a Triton GEMM fusion reading the f8e4m3fn / f8e5m2 operands, the scales and
the cast to the compute dtype in its epilogue. The other form, dot(convert(q_a) * s_a, convert(q_b) * s_b), is the
one XLA's cuBLAS rewriter folds into `__cublas$lt$matmul$f8` when it can; in that compile it did not (no cuBLASLt
FP8 there), the Triton rewriter took the dot on the dequantised float32 operands, and XLA's simplify-fp-conversions
pass then dropped the f32 -> f8 -> f32 round trips: neither FP8 speed nor FP8 rounding. On CPU the fp8 dot is
emulated (the converts round exactly as FP8 hardware does, the products are exact in float32). Inside a shard_map
over batch axes (the engine's shard_map step, each device on its own rows) an activation's or a gradient's amax is
the maximum over those axes (one scalar all-reduce, as the jit step's partitioner inserts for a split tensor), so
both steps scale, round and train alike.
"""
import functools

import jax
import jax.numpy as jnp

from kernels._partition import manual_batch_axes

E4M3 = jnp.dtype(jnp.float8_e4m3fn)   # forward operands
E5M2 = jnp.dtype(jnp.float8_e5m2)     # output gradients


def quantize_fp8(x, dtype):
    """(q, scale): `x` scaled by one float32 scale, amax(|x|) / max(dtype) (1 for an all-zero x; the amax of the
    whole tensor where its rows are split over manual batch axes), so its largest magnitude lands on the format's
    largest value, and rounded to the fp8 `dtype` (nearest even). x ~= q * scale."""
    dtype = jnp.dtype(dtype)
    top = float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    manual = manual_batch_axes()
    if manual:  # each device holds its own rows (the engine's shard_map step): the scale is the whole tensor's
        amax = jax.lax.pmax(amax, manual)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    # The clip only guards the rounding of x / scale (1 ulp past the top would be NaN in e4m3fn, inf in e5m2).
    return jnp.clip(x / scale, -top, top).astype(dtype), scale


def _dot(a, b, dimension_numbers, dtype):
    """The product of two (q, scale) pairs in `dtype`: the fp8 operands multiplied as they are, accumulated in
    float32, then scaled once by the product of the two per-tensor scales (which commutes with the sum)."""
    (qa, scale_a), (qb, scale_b) = a, b
    out = jax.lax.dot_general(qa, qb, dimension_numbers, preferred_element_type=jnp.float32)
    return (out * (scale_a * scale_b)).astype(dtype)


def _forward(x, w):
    xq, wq = quantize_fp8(x, E4M3), quantize_fp8(w, E4M3)
    return _dot(xq, wq, (((x.ndim - 1,), (0,)), ((), ())), x.dtype), (xq, wq)


def fp8_dot(x, w):
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, both operands rounded to float8_e4m3fn under per-tensor
    current scales; the backward pass rounds the output gradient to float8_e5m2 and takes dx [..., K] (x's dtype)
    and dw [K, N] (w's dtype) from the saved e4m3 operands. x and w are floating arrays of any dtype (the compute
    dtype); accumulation is float32."""
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_dot of x {x.shape} and w {w.shape}; expected x [..., K] and w [K, N]")
    return _fp8_dot((jnp.dtype(x.dtype), jnp.dtype(w.dtype)), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(dtypes, x, w):
    return _forward(x, w)[0]


def _fp8_dot_fwd(dtypes, x, w):
    return _forward(x, w)


def _fp8_dot_bwd(dtypes, residuals, g):
    (xq, wq), (x_dtype, w_dtype) = residuals, dtypes
    gq = quantize_fp8(g, E5M2)
    rows = tuple(range(g.ndim - 1))  # every leading dim of x and g: the weight gradient sums over them
    dx = _dot(gq, wq, (((g.ndim - 1,), (1,)), ((), ())), x_dtype)
    dw = _dot(xq, gq, ((rows, rows), ((), ())), w_dtype)
    return dx, dw


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)
