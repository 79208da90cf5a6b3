"""FP8 matmul (`fp8_dot`) with per-tensor scales, current or delayed: the training recipes of torchtitan's float8
linear (its default, "dynamic" scaling) and of Transformer Engine / MaxText's fp8 (delayed scaling from an amax
history), after the FP8 papers (Micikevicius et al., 2022, "FP8 Formats for Deep Learning").

Forward: x and w are each quantised to float8_e4m3fn (3 mantissa bits, max 448) with one float32 scale per tensor;
the fp8 operands are multiplied with float32 accumulation and the product scaled back. Backward: the output gradient
is quantised to float8_e5m2 (2 mantissa bits, max 57344: the wider range gradients need) with its own scale, and
both gradient products (dx = g w^T, dw = x^T g) take it with the forward's saved e4m3 operands, so the residuals
are the two fp8 tensors and two scalars (half a bf16 activation's bytes).

Current scaling (no history): each scale is amax / max of the tensor itself, in the step. Delayed scaling (a
`history` [3, H] of the last H amaxes of x, w and the output gradient, newest first): each scale is the largest amax
of its row / max, known before the tensor is (so a GPU need not read the tensor twice), values beyond it saturate;
a row still all zero (a fresh run's first step) takes the current amax. The tensors' own amaxes are pushed into the
history, and the new history is the cotangent `fp8_dot` returns for `history`: the engine's steps keep it as the
parameter's next value instead of handing it to the optimizer (`OVERWRITE`: "overwrite with gradient", Flax's
fp8_ops and MaxText's name), taking the largest over micro-batches (engine/step/update.py). The history is a
parameter used once per forward, so its cotangent is never a sum of several uses.

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
both steps scale, round and train alike, and every device pushes the same amaxes into the history.
"""
import functools

import jax
import jax.numpy as jnp

from kernels._partition import manual_batch_axes

E4M3 = jnp.dtype(jnp.float8_e4m3fn)   # forward operands
E5M2 = jnp.dtype(jnp.float8_e5m2)     # output gradients
OVERWRITE = "fp8_history"  # the parameter name of an amax history: its cotangent is its next value
HISTORY_ROWS = 3           # x, w, the output gradient


def amax(x):
    """max |x| in float32: of the whole tensor where its rows are split over manual batch axes."""
    out = jnp.max(jnp.abs(x.astype(jnp.float32)))
    manual = manual_batch_axes()
    # each device holds its own rows (the engine's shard_map step): the whole tensor's amax
    return jax.lax.pmax(out, manual) if manual else out


def delayed_amax(history_max, own):
    """The amax a delayed scale is taken from: the history's largest, or the tensor's `own` while the history is
    still all zero (a fresh run's first step)."""
    return jnp.where(history_max > 0, history_max, own)


def quantize_fp8(x, dtype, by=None):
    """(q, scale): `x` scaled by one float32 scale, amax / max(dtype) (1 for an all-zero x), and rounded to the fp8
    `dtype` (nearest even); x ~= q * scale. amax: `by` when given (delayed scaling, `delayed_amax`: values beyond it
    saturate at the format's largest), else the tensor's own (`amax`), so its largest magnitude lands on the
    format's largest value."""
    dtype = jnp.dtype(dtype)
    top = float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    by = amax(x) if by is None else by
    scale = jnp.where(by > 0, by / top, 1.0)
    # The clip saturates values past a delayed scale and guards the rounding of x / scale (1 ulp past the top would
    # be NaN in e4m3fn, inf in e5m2).
    return jnp.clip(x / scale, -top, top).astype(dtype), scale


def pushed(history, amaxes):
    """`history` [3, H] with each row's newest amax (`amaxes` [3]) in front and its oldest dropped."""
    return jnp.concatenate([amaxes[:, None].astype(history.dtype), history[:, :-1]], axis=1)


def _dot(a, b, dimension_numbers, dtype):
    """The product of two (q, scale) pairs in `dtype`: the fp8 operands multiplied as they are, accumulated in
    float32, then scaled once by the product of the two per-tensor scales (which commutes with the sum)."""
    (qa, scale_a), (qb, scale_b) = a, b
    out = jax.lax.dot_general(qa, qb, dimension_numbers, preferred_element_type=jnp.float32)
    return (out * (scale_a * scale_b)).astype(dtype)


def _forward(x, w, history):
    if history is None:
        xq, wq = quantize_fp8(x, E4M3), quantize_fp8(w, E4M3)
        amaxes = None
    else:
        top = jnp.max(history, axis=1)
        amax_x, amax_w = amax(x), amax(w)  # taken once: for the history and a fresh row's scale
        xq = quantize_fp8(x, E4M3, delayed_amax(top[0], amax_x))
        wq = quantize_fp8(w, E4M3, delayed_amax(top[1], amax_w))
        amaxes = (amax_x, amax_w, top[2])
    return _dot(xq, wq, (((x.ndim - 1,), (0,)), ((), ())), x.dtype), (xq, wq, amaxes)


def fp8_dot(x, w, history=None):
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, both operands rounded to float8_e4m3fn under per-tensor
    scales; the backward pass rounds the output gradient to float8_e5m2 and takes dx [..., K] (x's dtype)
    and dw [K, N] (w's dtype) from the saved e4m3 operands. x and w are floating arrays of any dtype (the compute
    dtype); accumulation is float32. history: None (current scaling) or a float32 [3, H] amax history of x, w and
    the output gradient (delayed scaling, see the module's docstring); its cotangent is the history with this call's
    amaxes pushed in (`pushed`)."""
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_dot of x {x.shape} and w {w.shape}; expected x [..., K] and w [K, N]")
    if history is None:
        return _fp8_dot((jnp.dtype(x.dtype), jnp.dtype(w.dtype)), x, w)
    if history.ndim != 2 or history.shape[0] != HISTORY_ROWS or history.dtype != jnp.float32:
        raise ValueError(f"fp8_dot history of shape {history.shape} and dtype {history.dtype}; expected float32 "
                         f"[{HISTORY_ROWS}, length]")
    return _fp8_dot_delayed((jnp.dtype(x.dtype), jnp.dtype(w.dtype)), x, w, history)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(dtypes, x, w):
    return _forward(x, w, None)[0]


def _fp8_dot_fwd(dtypes, x, w):
    y, (xq, wq, _) = _forward(x, w, None)
    return y, (xq, wq)


def _gradients(dtypes, xq, wq, gq, g_ndim):
    (x_dtype, w_dtype), rows = dtypes, tuple(range(g_ndim - 1))  # the weight gradient sums over every leading dim
    dx = _dot(gq, wq, (((g_ndim - 1,), (1,)), ((), ())), x_dtype)
    dw = _dot(xq, gq, ((rows, rows), ((), ())), w_dtype)
    return dx, dw


def _fp8_dot_bwd(dtypes, residuals, g):
    xq, wq = residuals
    return _gradients(dtypes, xq, wq, quantize_fp8(g, E5M2), g.ndim)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot_delayed(dtypes, x, w, history):
    return _forward(x, w, history)[0]


def _fp8_dot_delayed_fwd(dtypes, x, w, history):
    y, (xq, wq, (amax_x, amax_w, g_top)) = _forward(x, w, history)
    return y, (xq, wq, amax_x, amax_w, g_top, history)


def _fp8_dot_delayed_bwd(dtypes, residuals, g):
    xq, wq, amax_x, amax_w, g_top, history = residuals
    amax_g = amax(g)
    dx, dw = _gradients(dtypes, xq, wq, quantize_fp8(g, E5M2, delayed_amax(g_top, amax_g)), g.ndim)
    return dx, dw, pushed(history, jnp.stack([amax_x, amax_w, amax_g]))


_fp8_dot_delayed.defvjp(_fp8_dot_delayed_fwd, _fp8_dot_delayed_bwd)
