"""The fused matmul ops' public functions (matmul + bias + activation, the gated MLP) and what every op of the
family shares: the per-call configuration, the input checks, the rows' layout on a mesh and the custom_vjp helpers
(`cross_entropy.py` builds linear + cross-entropy on them).

Every op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'` (see `kernels._dispatch`), `interpret=True`
to run a Pallas kernel in Pallas's interpreter on CPU, and `block_sizes=BlockSizes(...)` to override the per-backend
table in `_blocks.py`. Inputs are checked here, before anything is traced; the backward passes (`jax.custom_vjp`)
are written once here on top of a backend's tiled `matmul` (see `reference.py` for that interface), so the 'xla'
path runs the same algorithm with XLA dots.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from kernels import _partition
from kernels._dispatch import resolve_implementation
from kernels.matmul import _blocks, mosaic_tpu, reference, triton
from kernels.matmul._blocks import BlockSizes

__all__ = ["fused_matmul", "gated_mlp"]

_BACKENDS = {"xla": reference, "triton": triton, "mosaic_tpu": mosaic_tpu}
_P = jax.sharding.PartitionSpec
_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ONE = (((0, 0),),)  # One accumulator: lhs[0] @ rhs[0].
_TWO = (((0, 0),), ((0, 1),))  # Two accumulators sharing lhs[0]: each lhs tile is read once for both.


class _Config(NamedTuple):
    implementation: str
    blocks: BlockSizes
    interpret: bool

    def matmul(self, lhs, rhs, extras=(), *, extra_kinds=(), terms=_ONE, epilogue=reference.epilogue_identity,
               out_dtypes, trans_lhs=False, trans_rhs=False, aliases=()):
        return _BACKENDS[self.implementation].matmul(
            lhs, rhs, extras, terms=terms, epilogue=epilogue, extra_kinds=extra_kinds, out_dtypes=out_dtypes,
            trans_lhs=trans_lhs, trans_rhs=trans_rhs, blocks=self.blocks, interpret=self.interpret, aliases=aliases)


def _config(implementation, interpret, block_sizes, op):
    implementation = resolve_implementation(implementation, interpret=interpret)
    _blocks.validate(block_sizes, implementation)
    blocks = block_sizes or _blocks.default_block_sizes(implementation, op)
    return _Config(implementation, blocks, bool(interpret))


def _check_float(name, a):
    if jnp.dtype(a.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype={a.dtype}; expected one of float32, bfloat16, float16")


def _check_weight(name, w, x, scale=None):
    """A weight [K, N] in x's dtype, or int8 with its float per-column `{name}_scale` [N] (weight-only
    quantisation, models/quantize.py); a scale is allowed with a float weight too (it multiplies the product)."""
    if jnp.dtype(w.dtype) != jnp.int8:
        _check_float(name, w)
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}.shape={tuple(w.shape)}; expected [{x.shape[-1]}, n] to match x.shape[-1]")
    if jnp.dtype(w.dtype) == jnp.int8 and scale is None:
        raise ValueError(f"{name}.dtype=int8 needs {name}_scale, its float per-column scale [{w.shape[1]}]")
    if jnp.dtype(w.dtype) != jnp.int8 and w.dtype != x.dtype:
        raise ValueError(f"{name}.dtype={w.dtype}; expected x.dtype={x.dtype} (or int8 with {name}_scale)")
    if scale is not None:
        _check_float(f"{name}_scale", scale)
        if scale.shape != (w.shape[1],):
            raise ValueError(f"{name}_scale.shape={tuple(scale.shape)}; expected ({w.shape[1]},)")


def _check_x(x):
    _check_float("x", x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x.shape={tuple(x.shape)}; expected [..., k] with k > 0")


def _check_activation(activation, allow_none):
    allowed = ((None,) if allow_none else ()) + tuple(reference.ACTIVATIONS)
    if activation not in allowed:
        raise ValueError(f"activation={activation!r}; expected one of {allowed}")


# ---- fused_matmul ----

def fused_matmul(x, w, bias=None, *, w_scale=None, activation=None, implementation=None, interpret=False,
                 block_sizes=None):
    """`activation(x @ w * w_scale + bias)` with float32 accumulation, output in x's dtype.

    x: [..., K]; w: [K, N] in x's dtype, or int8 with `w_scale` (weight-only quantisation: each int8 tile is
    converted where the kernel reads it, and the per-column scale [N] multiplies the accumulator in the epilogue, so
    no dequantised weight exists and the weight's HBM traffic halves against bf16); bias: [N] or None; activation:
    None, 'relu', 'gelu', 'gelu_tanh' or 'silu'. Returns [..., N]. The backward recomputes the pre-activation fused
    with the activation's derivative instead of saving it; an int8 weight gets no gradient.
    """
    _check_x(x)
    _check_weight("w", w, x, w_scale)
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (w.shape[1],):
            raise ValueError(f"bias.shape={tuple(bias.shape)}; expected ({w.shape[1]},)")
    _check_activation(activation, allow_none=True)
    cfg = _config(implementation, interpret, block_sizes, "matmul")
    (view, row_spec), m = _rows(cfg, x), _model_axis(cfg, w.shape[1])
    out = _partition.shard(_on_rows(lambda x, w, bias, scale: _fused_matmul(x, w, bias, scale, activation, cfg)),
                           (view, w, bias, w_scale), (_P(*row_spec, None), _P(None, m), _P(m), _P(m)),
                           _P(*row_spec, m), cfg.implementation)
    return out.reshape(*x.shape[:-1], w.shape[1])


def _rows(cfg, x):
    """x's rows as a Pallas matmul's operand on a mesh (kernels/_partition.py), and the spec of its leading dims:
    [B, T, K] with B over the batch axes and T over `context` when an automatic context axis splits the tokens
    (x [..., T, K]), else [rows, K] over the batch axes. Context-split tokens are not flattened into rows
    outside the kernel: with more than one row per device that reshape is a reshard, and in a scanned LLaMA
    (data 2 x context 2 x model 2, two rows per device) the partitioner's reshard gave wrong gradients (XLA of JAX
    0.10.2 and 0.11.2, CPU; right with one row per device or one layer) — `_on_rows` flattens each block instead."""
    axes = _partition.auto_axes(cfg.implementation)
    context = axes.get(_partition.CONTEXT_AXIS)
    if context and x.ndim >= 3 and x.shape[-2] % context == 0:
        view = x.reshape(-1, *x.shape[-2:])
        return view, (_partition.batch_axes(axes, view.shape[0]), _partition.CONTEXT_AXIS)
    view = x.reshape(-1, x.shape[-1])
    return view, (_partition.batch_axes(axes, view.shape[0]),)


def _model_axis(cfg, n):
    """`'model'` when a Pallas matmul of n output columns is split over it on the ambient mesh (the weight's
    columns and the bias: column parallelism, as auto_shard splits up/gate/fc1), else None."""
    return _partition.model_axis(_partition.auto_axes(cfg.implementation), n)


def _on_rows(kernel):
    """`kernel(x [rows, K], *rest) -> [rows, ...]` on a block of `_rows`' view: its leading dims flattened into
    rows and restored on the output."""
    def call(x, *rest):
        out = kernel(x.reshape(-1, x.shape[-1]), *rest)
        return out.reshape(*x.shape[:-1], *out.shape[1:])
    return call


def _marked(fwd, num_diff=3):
    """A custom_vjp forward rule for `defvjp(..., symbolic_zeros=True)`: calls `fwd` on the primal values and adds
    to its residuals which of the `num_diff` differentiable inputs are perturbed, as () or None, so the backward
    rule computes only the gradients asked for: a frozen weight (Trainer(trainable=...), LoRA) gets no weight
    gradient matmul and no weight-sized buffer (an int8 weight is never perturbed)."""
    def marked(*args):
        diff, static = args[:num_diff], args[num_diff:]
        y, res = fwd(*(None if a is None else a.value for a in diff), *static)
        return y, (res, tuple(() if a is not None and a.perturbed else None for a in diff))
    return marked


def _instantiate(ct):
    """A cotangent that may be symbolically zero, as an array."""
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_matmul(x, w, bias, scale, activation, cfg):
    return _fused_matmul_fwd(x, w, bias, scale, activation, cfg)[0]


def _cols(*vectors):
    """The [N] column vectors given (not None) as [1, N] extras, and their kinds."""
    given = tuple(v.reshape(1, -1) for v in vectors if v is not None)
    return given, ("col",) * len(given)


def _fused_matmul_fwd(x, w, bias, scale, activation, cfg):
    extras, kinds = _cols(scale, bias)
    (y,) = cfg.matmul((x,), (w,), extras, extra_kinds=kinds, out_dtypes=(x.dtype,),
                      epilogue=reference.epilogue_bias_act(activation, bias is not None, scale is not None))
    return y, (x, w, bias, scale)


def _fused_matmul_bwd(activation, cfg, res_marks, dy):
    (x, w, bias, scale), marks = res_marks
    want_x, want_w, want_bias, want_scale = (m is not None for m in marks)
    dy = _instantiate(dy)
    acc_dz = None
    if activation is None and not want_scale:
        dz = dy  # d acc = dy * scale: elementwise, no matmul to recompute
        d_acc = dy if scale is None else (dy.astype(jnp.float32) * scale.astype(jnp.float32)).astype(x.dtype)
    else:
        extras, kinds = _cols(scale, bias)
        with_dz = want_bias and scale is not None
        outs = cfg.matmul((x,), (w,), extras + (dy,), extra_kinds=kinds + ("tile",),
                          out_dtypes=(x.dtype,) * (1 + with_dz) + (jnp.float32,) * want_scale,
                          epilogue=reference.epilogue_bias_act_grad(activation, bias is not None, scale is not None,
                                                                    with_dz, want_scale))
        d_acc, outs = outs[0], outs[1:]
        dz = outs[0] if with_dz else d_acc
        acc_dz = outs[-1] if want_scale else None
    dx = cfg.matmul((d_acc,), (w,), out_dtypes=(x.dtype,), trans_rhs=True)[0] if want_x else None
    dw = cfg.matmul((x,), (d_acc,), out_dtypes=(w.dtype,), trans_lhs=True)[0] if want_w else None
    dbias = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(bias.dtype) if want_bias else None
    dscale = jnp.sum(acc_dz, axis=0).astype(scale.dtype) if want_scale else None
    return dx, dw, dbias, dscale


_fused_matmul.defvjp(_marked(_fused_matmul_fwd, 4), _fused_matmul_bwd, symbolic_zeros=True)


# ---- gated_mlp ----

def gated_mlp(x, w_gate, w_up, *, w_gate_scale=None, w_up_scale=None, activation="silu", implementation=None,
              interpret=False, block_sizes=None):
    """`activation(x @ w_gate * w_gate_scale) * (x @ w_up * w_up_scale)` in one kernel (SwiGLU with 'silu', GeGLU
    with 'gelu'/'gelu_tanh').

    x: [..., D]; w_gate, w_up: [D, F] in x's dtype, or int8 with their float per-column scales [F] (see
    `fused_matmul`). Returns [..., F] in x's dtype. The backward recomputes both products from x rather than saving
    them.
    """
    _check_x(x)
    _check_weight("w_gate", w_gate, x, w_gate_scale)
    _check_weight("w_up", w_up, x, w_up_scale)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up.shape={tuple(w_up.shape)}; expected w_gate.shape={tuple(w_gate.shape)}")
    if (w_gate_scale is None) != (w_up_scale is None):
        raise ValueError("w_gate_scale and w_up_scale: expected both or neither")
    _check_activation(activation, allow_none=False)
    cfg = _config(implementation, interpret, block_sizes, "gated")
    (view, row_spec), m = _rows(cfg, x), _model_axis(cfg, w_gate.shape[1])
    out = _partition.shard(_on_rows(lambda *a: _gated_mlp(*a, activation, cfg)),
                           (view, w_gate, w_up, w_gate_scale, w_up_scale),
                           (_P(*row_spec, None), _P(None, m), _P(None, m), _P(m), _P(m)), _P(*row_spec, m),
                           cfg.implementation)
    return out.reshape(*x.shape[:-1], w_gate.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gated_mlp(x, w_gate, w_up, gate_scale, up_scale, activation, cfg):
    return _gated_mlp_fwd(x, w_gate, w_up, gate_scale, up_scale, activation, cfg)[0]


def _gated_mlp_fwd(x, w_gate, w_up, gate_scale, up_scale, activation, cfg):
    scales, kinds = _cols(gate_scale, up_scale)
    (h,) = cfg.matmul((x,), (w_gate, w_up), scales, extra_kinds=kinds, terms=_TWO, out_dtypes=(x.dtype,),
                      epilogue=reference.epilogue_gate(activation, bool(scales)))
    return h, (x, w_gate, w_up, gate_scale, up_scale)


def _gated_mlp_bwd(activation, cfg, res_marks, dh):
    (x, w_gate, w_up, gate_scale, up_scale), marks = res_marks
    want_x, want_gate, want_up, want_gate_scale, want_up_scale = (m is not None for m in marks)
    want_scales = want_gate_scale or want_up_scale
    scales, kinds = _cols(gate_scale, up_scale)
    outs = cfg.matmul((x,), (w_gate, w_up), scales + (_instantiate(dh),), extra_kinds=kinds + ("tile",), terms=_TWO,
                      epilogue=reference.epilogue_gate_grad(activation, bool(scales), want_scales),
                      out_dtypes=(x.dtype,) * 2 + (jnp.float32,) * (2 * want_scales))
    d_gate, d_up = outs[:2]  # of the accumulators x @ w (the scales applied)
    dx = cfg.matmul((d_gate, d_up), (w_gate, w_up), terms=(((0, 0), (1, 1)),), out_dtypes=(x.dtype,),
                    trans_rhs=True)[0] if want_x else None
    if want_gate and want_up:
        dw_gate, dw_up = cfg.matmul((x,), (d_gate, d_up), terms=_TWO, out_dtypes=(w_gate.dtype,) * 2,
                                    trans_lhs=True)
    else:
        dw_gate = cfg.matmul((x,), (d_gate,), out_dtypes=(w_gate.dtype,), trans_lhs=True)[0] if want_gate else None
        dw_up = cfg.matmul((x,), (d_up,), out_dtypes=(w_up.dtype,), trans_lhs=True)[0] if want_up else None
    d_gate_scale = jnp.sum(outs[2], axis=0).astype(gate_scale.dtype) if want_gate_scale else None
    d_up_scale = jnp.sum(outs[3], axis=0).astype(up_scale.dtype) if want_up_scale else None
    return dx, dw_gate, dw_up, d_gate_scale, d_up_scale


_gated_mlp.defvjp(_marked(_gated_mlp_fwd, 5), _gated_mlp_bwd, symbolic_zeros=True)
