"""What each fused-matmul kernel costs, as the `pl.CostEstimate` its `pallas_call` declares (both backends), so that
XLA's scheduler and cost model see the kernels' work instead of an opaque custom call.

Shapes are the padded operands the kernels run on. flops: 2·M·N·K per product summed into an accumulator, plus the
epilogue's (or the online log-sum-exp's) elementwise work per output tile, counted by tracing it on one tile
(`_per_tile`), so an epilogue written once in `reference.py` is costed once. transcendentals: the same trace's
exps, logs, tanhs and logistics. bytes_accessed: as the grids stream them: each lhs row block once per
output column block, each rhs column block once per output row block, the extras and outputs once.
"""
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.extend.core import ClosedJaxpr

from kernels.matmul import reference


def _nbytes(a):
    return math.prod(a.shape) * jnp.dtype(a.dtype).itemsize


# Counted as XLA's cost analysis counts them: one transcendental per output element of these, one flop per output
# element of every other arithmetic primitive; layout, conversion and index primitives are free.
_TRANSCENDENTAL = frozenset({"exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erfc", "erf_inv",
                             "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "pow", "atan2"})
_FREE = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "convert_element_type",
                   "iota", "slice", "concatenate", "copy", "copy_p", "pjit", "jit", "custom_jvp_call",
                   "custom_vjp_call"})


def _per_tile(fn, *args):
    """(flops, transcendentals) of `fn` traced on abstract tiles. Not `pl.estimate_cost`: it fails on a negative
    integer power (math.log of the exponent), which the derivative of a quotient in an epilogue has."""
    flops = transcendentals = 0

    def walk(jaxpr):
        nonlocal flops, transcendentals
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                if isinstance(param, ClosedJaxpr):
                    walk(param.jaxpr)
            if eqn.primitive.name in _FREE:
                continue
            size = sum(math.prod(v.aval.shape) for v in eqn.outvars)
            if eqn.primitive.name in _TRANSCENDENTAL:
                transcendentals += size
            else:
                flops += size

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return flops, transcendentals


def matmul(lhs, rhs, extras, extra_kinds, out_dtypes, *, terms, epilogue, tiles, padded):
    """The tiled matmul's estimate (the `matmul` interface in `reference.py`) on padded operands; tiles:
    (block_m, block_n, block_k), padded: (m, n, k)."""
    (bm, bn, _), (mp, np_, kp) = tiles, padded
    num_tiles = (mp // bm) * (np_ // bn)
    tile = {"row": (bm, 1), "col": (1, bn), "tile": (bm, bn)}
    acc = jax.ShapeDtypeStruct((bm, bn), jnp.float32)
    ep_flops, ep_transcendentals = _per_tile(
        epilogue, tuple(acc for _ in terms), jax.ShapeDtypeStruct((1, bn), jnp.int32),
        *(jax.ShapeDtypeStruct(tile[kind], e.dtype) for e, kind in zip(extras, extra_kinds)))
    products = sum(len(term) for term in terms)
    return pl.CostEstimate(
        flops=2 * mp * np_ * kp * products + num_tiles * ep_flops,
        transcendentals=num_tiles * ep_transcendentals,
        bytes_accessed=(sum(map(_nbytes, lhs)) * (np_ // bn) + sum(map(_nbytes, rhs)) * (mp // bm)
                        + sum(map(_nbytes, extras)) + sum(mp * np_ * jnp.dtype(d).itemsize for d in out_dtypes)),
    )


def lce_forward(x, w, *, vocab, tiles):
    """linear + cross-entropy forward's estimate on padded x [N, D], w [D, V]: the logits' matmul, the online
    log-sum-exp per [block_m, block_v] tile (`reference.lse_update`), a log per row; tiles: (block_m, block_v,
    block_d)."""
    (n, d), v = x.shape, w.shape[1]
    bm, bv, _ = tiles
    num_tiles = (n // bm) * (v // bv)
    row = jax.ShapeDtypeStruct((bm, 1), jnp.float32)
    lse_flops, lse_transcendentals = _per_tile(
        lambda carry, logits, cols, labels: reference.lse_update(carry, logits, cols, labels, vocab),
        (row, row, row), jax.ShapeDtypeStruct((bm, bv), jnp.float32), jax.ShapeDtypeStruct((1, bv), jnp.int32),
        jax.ShapeDtypeStruct((bm, 1), jnp.int32))
    return pl.CostEstimate(
        flops=2 * n * v * d + num_tiles * lse_flops,
        transcendentals=num_tiles * lse_transcendentals + n,
        bytes_accessed=_nbytes(x) * (v // bv) + _nbytes(w) * (n // bm) + 3 * n * 4,  # labels, lse, label logit
    )
