"""Fused matmul kernels: matmul + bias + activation, the gated MLP, and linear + cross-entropy without logits.

Every op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'` (see `kernels._dispatch`), `interpret=True`
to run a Pallas kernel in Pallas's interpreter on CPU, and `block_sizes=BlockSizes(...)` to override the per-backend
table in `_blocks.py`. Inputs are checked here, before anything is traced; the backward passes (`jax.custom_vjp`)
are written once below on top of a backend's tiled `matmul` (see `reference.py` for that interface), so the 'xla'
path runs the same algorithm with XLA dots.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from kernels import _partition
from kernels._dispatch import resolve_implementation
from kernels.matmul import _blocks, mosaic_tpu, reference, triton
from kernels.matmul._blocks import BlockSizes

__all__ = ["BlockSizes", "fused_matmul", "gated_mlp", "is_loss_call", "linear_cross_entropy", "vocab_parallel_call"]

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
               out_dtypes, trans_lhs=False, trans_rhs=False):
        return _BACKENDS[self.implementation].matmul(
            lhs, rhs, extras, terms=terms, epilogue=epilogue, extra_kinds=extra_kinds, out_dtypes=out_dtypes,
            trans_lhs=trans_lhs, trans_rhs=trans_rhs, blocks=self.blocks, interpret=self.interpret)


def _config(implementation, interpret, block_sizes, op):
    implementation = resolve_implementation(implementation, interpret=interpret)
    _blocks.validate(block_sizes, implementation)
    blocks = block_sizes or _blocks.default_block_sizes(implementation, op)
    return _Config(implementation, blocks, bool(interpret))


def _check_float(name, a):
    if jnp.dtype(a.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype={a.dtype}; expected one of float32, bfloat16, float16")


def _check_weight(name, w, x):
    _check_float(name, w)
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}.shape={tuple(w.shape)}; expected [{x.shape[-1]}, n] to match x.shape[-1]")
    if w.dtype != x.dtype:
        raise ValueError(f"{name}.dtype={w.dtype}; expected x.dtype={x.dtype}")


def _check_x(x):
    _check_float("x", x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x.shape={tuple(x.shape)}; expected [..., k] with k > 0")


def _check_activation(activation, allow_none):
    allowed = ((None,) if allow_none else ()) + tuple(reference.ACTIVATIONS)
    if activation not in allowed:
        raise ValueError(f"activation={activation!r}; expected one of {allowed}")


# ---- fused_matmul ----

def fused_matmul(x, w, bias=None, *, activation=None, implementation=None, interpret=False, block_sizes=None):
    """`activation(x @ w + bias)` with float32 accumulation, output in x's dtype.

    x: [..., K]; w: [K, N] (same dtype as x); bias: [N] or None; activation: None, 'relu', 'gelu', 'gelu_tanh' or
    'silu'. Returns [..., N]. The backward recomputes `x @ w + bias` fused with the activation's derivative instead
    of saving the pre-activation.
    """
    _check_x(x)
    _check_weight("w", w, x)
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (w.shape[1],):
            raise ValueError(f"bias.shape={tuple(bias.shape)}; expected ({w.shape[1]},)")
    _check_activation(activation, allow_none=True)
    cfg = _config(implementation, interpret, block_sizes, "matmul")
    rows, cols, bias_spec = _column_specs(cfg, x, w.shape[1])
    args, specs = (x.reshape(-1, x.shape[-1]), w), (rows, cols)
    if bias is not None:
        args, specs = args + (bias,), specs + (bias_spec,)
    out = _partition.shard(lambda x, w, bias=None: _fused_matmul(x, w, bias, activation, cfg), args, specs,
                           _P(rows[0], cols[1]), cfg.implementation)
    return out.reshape(*x.shape[:-1], w.shape[1])


def _column_specs(cfg, x, n):
    """Layouts a Pallas matmul runs in on a mesh (kernels/_partition.py): x's rows over the batch axes, the weight's
    columns (and the bias) over `model` (column parallelism, as auto_shard splits up/gate/fc1)."""
    axes = _partition.auto_axes(cfg.implementation)
    rows = x.size // x.shape[-1]
    b, m = _partition.batch_axes(axes, rows), _partition.model_axis(axes, n)
    return _P(b, None), _P(None, m), _P(m)


def _marked(fwd):
    """A custom_vjp forward rule for `defvjp(..., symbolic_zeros=True)`: calls `fwd` on the primal values and adds
    to its residuals which of the (up to three) differentiable inputs are perturbed, as () or None, so the backward
    rule computes only the gradients asked for: a frozen weight (Trainer(trainable=...), LoRA) gets no weight
    gradient matmul and no weight-sized buffer."""
    def marked(*args):
        diff, static = args[:3], args[3:]
        y, res = fwd(*(None if a is None else a.value for a in diff), *static)
        return y, (res, tuple(() if a is not None and a.perturbed else None for a in diff))
    return marked


def _instantiate(ct):
    """A cotangent that may be symbolically zero, as an array."""
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_matmul(x, w, bias, activation, cfg):
    return _fused_matmul_fwd(x, w, bias, activation, cfg)[0]


def _fused_matmul_fwd(x, w, bias, activation, cfg):
    extras = () if bias is None else (bias.reshape(1, -1),)
    (y,) = cfg.matmul((x,), (w,), extras, extra_kinds=("col",) * len(extras),
                      epilogue=reference.epilogue_bias_act(activation, bias is not None), out_dtypes=(x.dtype,))
    return y, (x, w, bias)


def _fused_matmul_bwd(activation, cfg, res_marks, dy):
    (x, w, bias), marks = res_marks
    want_x, want_w, want_bias = (m is not None for m in marks)
    dy = _instantiate(dy)
    if activation is None:
        dz = dy
    else:
        extras = ((bias.reshape(1, -1),) if bias is not None else ()) + (dy,)
        kinds = ("col",) * (bias is not None) + ("tile",)
        (dz,) = cfg.matmul((x,), (w,), extras, extra_kinds=kinds, out_dtypes=(x.dtype,),
                           epilogue=reference.epilogue_bias_act_grad(activation, bias is not None))
    dx = cfg.matmul((dz,), (w,), out_dtypes=(x.dtype,), trans_rhs=True)[0] if want_x else None
    dw = cfg.matmul((x,), (dz,), out_dtypes=(w.dtype,), trans_lhs=True)[0] if want_w else None
    dbias = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(bias.dtype) if want_bias else None
    return dx, dw, dbias


_fused_matmul.defvjp(_marked(_fused_matmul_fwd), _fused_matmul_bwd, symbolic_zeros=True)


# ---- gated_mlp ----

def gated_mlp(x, w_gate, w_up, *, activation="silu", implementation=None, interpret=False, block_sizes=None):
    """`activation(x @ w_gate) * (x @ w_up)` in one kernel (SwiGLU with 'silu', GeGLU with 'gelu'/'gelu_tanh').

    x: [..., D]; w_gate, w_up: [D, F] (same dtype as x). Returns [..., F] in x's dtype. The backward recomputes both
    products from x rather than saving them.
    """
    _check_x(x)
    _check_weight("w_gate", w_gate, x)
    _check_weight("w_up", w_up, x)
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up.shape={tuple(w_up.shape)}; expected w_gate.shape={tuple(w_gate.shape)}")
    _check_activation(activation, allow_none=False)
    cfg = _config(implementation, interpret, block_sizes, "gated")
    rows, cols, _ = _column_specs(cfg, x, w_gate.shape[1])
    out = _partition.shard(lambda x, w_gate, w_up: _gated_mlp(x, w_gate, w_up, activation, cfg),
                           (x.reshape(-1, x.shape[-1]), w_gate, w_up), (rows, cols, cols), _P(rows[0], cols[1]),
                           cfg.implementation)
    return out.reshape(*x.shape[:-1], w_gate.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gated_mlp(x, w_gate, w_up, activation, cfg):
    return _gated_mlp_fwd(x, w_gate, w_up, activation, cfg)[0]


def _gated_mlp_fwd(x, w_gate, w_up, activation, cfg):
    (h,) = cfg.matmul((x,), (w_gate, w_up), terms=_TWO, epilogue=reference.epilogue_gate(activation),
                      out_dtypes=(x.dtype,))
    return h, (x, w_gate, w_up)


def _gated_mlp_bwd(activation, cfg, res_marks, dh):
    (x, w_gate, w_up), marks = res_marks
    want_x, want_gate, want_up = (m is not None for m in marks)
    d_gate, d_up = cfg.matmul((x,), (w_gate, w_up), (_instantiate(dh),), extra_kinds=("tile",), terms=_TWO,
                              epilogue=reference.epilogue_gate_grad(activation), out_dtypes=(x.dtype, x.dtype))
    dx = cfg.matmul((d_gate, d_up), (w_gate, w_up), terms=(((0, 0), (1, 1)),), out_dtypes=(x.dtype,),
                    trans_rhs=True)[0] if want_x else None
    if want_gate and want_up:
        dw_gate, dw_up = cfg.matmul((x,), (d_gate, d_up), terms=_TWO, out_dtypes=(w_gate.dtype,) * 2,
                                    trans_lhs=True)
    else:
        dw_gate = cfg.matmul((x,), (d_gate,), out_dtypes=(w_gate.dtype,), trans_lhs=True)[0] if want_gate else None
        dw_up = cfg.matmul((x,), (d_up,), out_dtypes=(w_up.dtype,), trans_lhs=True)[0] if want_up else None
    return dx, dw_gate, dw_up


_gated_mlp.defvjp(_marked(_gated_mlp_fwd), _gated_mlp_bwd, symbolic_zeros=True)


# ---- linear_cross_entropy ----

def linear_cross_entropy(x, w, labels, *, ignore_index=-100, implementation=None, interpret=False,
                         block_sizes=None):
    """Per-token softmax cross-entropy of the logits `x @ w`, without materialising them.

    x: [..., D]; w: [D, V] (same dtype as x); labels: integer [...], with `ignore_index` marking tokens that get zero
    loss and zero gradient. Returns float32 [...]. The forward sweeps the vocabulary blockwise with an online
    log-sum-exp and keeps only the log-sum-exp per token; the backward recomputes the logits one vocabulary chunk of
    `block_sizes.vocab_chunk` columns at a time, so no temporary is larger than [tokens, vocab_chunk].
    """
    _check_x(x)
    _check_weight("w", w, x)
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels.shape={tuple(labels.shape)}; expected x.shape[:-1]={tuple(x.shape[:-1])}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels.dtype={labels.dtype}; expected an integer dtype")
    if not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index={ignore_index!r}; expected an int")
    cfg = _config(implementation, interpret, block_sizes, "loss")
    # On a mesh only the rows are split: a vocabulary split over `model` would need a log-sum-exp across devices.
    rows, _, _ = _column_specs(cfg, x, 1)
    loss = _partition.shard(_loss_call(ignore_index, cfg),
                            (x.reshape(-1, x.shape[-1]), w, labels.reshape(-1).astype(jnp.int32)),
                            (rows, _P(), _P(rows[0])), _P(rows[0]), cfg.implementation)
    return loss.reshape(labels.shape)


_LOSS_CALLS = {}  # jit name -> (ignore_index, cfg) of every traced linear_cross_entropy


def _with_vocab_chunk(cfg, vocab):
    """cfg with the loss's vocabulary chunk sized for `vocab` columns (unless `block_sizes` fixed it)."""
    return cfg._replace(blocks=_blocks.with_vocab_chunk(cfg.blocks, vocab, cfg.implementation))


@functools.lru_cache(maxsize=None)
def _loss_call(ignore_index, cfg):
    """The loss as a `jax.jit` whose name stands for its static settings, so that a caller evaluating the traced
    program (the engine's shard_map step) can recognise the call and rerun it vocab-parallel (`vocab_parallel_call`)."""
    name = f"linear_cross_entropy_{len(_LOSS_CALLS)}"
    _LOSS_CALLS[name] = (ignore_index, cfg)

    def call(x, w, labels):
        return _linear_cross_entropy(x, w, labels, ignore_index, _with_vocab_chunk(cfg, w.shape[1]))

    call.__name__ = call.__qualname__ = name
    return jax.jit(call)


def is_loss_call(name):
    """Whether a traced `jit` of this name is a `linear_cross_entropy` call (see `vocab_parallel_call`)."""
    return name in _LOSS_CALLS


def vocab_parallel_call(name, x, w, labels, axis_name):
    """Reruns the traced `linear_cross_entropy` call `name` inside a `shard_map` over `axis_name` with the
    vocabulary split across it (Megatron's vocab-parallel cross-entropy): x [N, D] and labels [N] are this device's
    rows, w [D, V / G] the vocabulary slice `axis_index(axis_name)`. The group's rows are all-gathered, each device
    sweeps its own slice blockwise, a log-sum-exp across devices (a max and a sum of N·G floats) gives each row's
    loss, and the backward reduce-scatters the rows' gradient while each device keeps its slice's gradient whole:
    no device ever holds the whole weight or its gradient. Returns this device's per-token loss [N]."""
    ignore_index, cfg = _LOSS_CALLS[name]
    cfg = _with_vocab_chunk(cfg, w.shape[1])  # chunks of this device's slice: [N x G, chunk] logits stay small
    # Labels of other slices become -1 (never a column; -2 if -1 means ignored), so they add no one-hot term here.
    elsewhere = -2 if ignore_index == -1 else -1

    @jax.custom_vjp
    def run(x, w, labels):
        return forward(x, w, labels)[0]

    def forward(x, w, labels):
        n, slice_len = x.shape[0], w.shape[1]
        rank = lax.axis_index(axis_name)
        x_all = lax.all_gather(x, axis_name, axis=0, tiled=True)
        labels_all = lax.all_gather(labels, axis_name, axis=0, tiled=True)
        local = labels_all - rank * slice_len
        local = jnp.where(labels_all == ignore_index, ignore_index,
                          jnp.where((local >= 0) & (local < slice_len), local, elsewhere))
        lse_part, label_part = _BACKENDS[cfg.implementation].lce_forward(x_all, w, local, blocks=cfg.blocks,
                                                                         interpret=cfg.interpret)
        top = lax.pmax(lse_part, axis_name)
        lse = top + jnp.log(lax.psum(jnp.exp(lse_part - top), axis_name))
        loss = jnp.where(labels_all != ignore_index, lse - lax.psum(label_part, axis_name), 0.0)
        return lax.dynamic_slice_in_dim(loss, rank * n, n), (x_all, w, local, lse, labels)

    def backward(res_marks, g):
        (x_all, w, local, lse, labels), marks = res_marks
        want_x, want_w = (m is not None for m in marks[:2])
        g_all = lax.all_gather(_instantiate(g), axis_name, axis=0, tiled=True)
        dx_all, dw = _lce_grads(ignore_index, cfg, (x_all, w, local, lse), g_all, want_x, want_w)
        dx = None
        if want_x:  # summed in float32: every device holds part of every row's gradient (its slice's share)
            dx = lax.psum_scatter(dx_all.astype(jnp.float32), axis_name, scatter_dimension=0, tiled=True)
            dx = dx.astype(x_all.dtype)
        return dx, dw, None

    run.defvjp(_marked(forward), backward, symbolic_zeros=True)
    return run(x, w, labels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_cross_entropy(x, w, labels, ignore_index, cfg):
    return _linear_cross_entropy_fwd(x, w, labels, ignore_index, cfg)[0]


def _linear_cross_entropy_fwd(x, w, labels, ignore_index, cfg):
    lse, label_logit = _BACKENDS[cfg.implementation].lce_forward(x, w, labels, blocks=cfg.blocks,
                                                                 interpret=cfg.interpret)
    loss = jnp.where(labels != ignore_index, lse - label_logit, 0.0)
    return loss, (x, w, labels, lse)


def _linear_cross_entropy_bwd(ignore_index, cfg, res_marks, g):
    (x, w, labels, lse), marks = res_marks
    want_x, want_w = (m is not None for m in marks[:2])
    dx, dw = _lce_grads(ignore_index, cfg, (x, w, labels, lse), _instantiate(g), want_x, want_w)
    return dx, dw, None


def _lce_grads(ignore_index, cfg, res, g, want_x=True, want_w=True):
    """(dx or None, dw or None) of the loss, recomputing the logits one vocabulary chunk at a time; only what is
    wanted is computed (a frozen head, e.g. under LoRA, costs no [D, V] gradient)."""
    x, w, labels, lse = res
    n = x.shape[0]
    # Zero cotangent for ignored tokens zeroes their whole row of d logits, hence their dx and share of dw.
    g = jnp.where(labels != ignore_index, g, 0.0).astype(jnp.float32).reshape(n, 1)

    def step(carry, w_c, start):
        dx, dw = carry
        (dlogits,) = cfg.matmul((x,), (w_c,), (lse.reshape(n, 1), (labels - start).reshape(n, 1), g),
                                extra_kinds=("row",) * 3, epilogue=reference.epilogue_dlogits,
                                out_dtypes=(x.dtype,))
        if want_x:
            dx = dx + cfg.matmul((dlogits,), (w_c,), out_dtypes=(jnp.float32,), trans_rhs=True)[0]
        if want_w:
            (dw_c,) = cfg.matmul((x,), (dlogits,), out_dtypes=(w.dtype,), trans_lhs=True)
            dw = lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=1)
        return dx, dw

    init = (jnp.zeros(x.shape, jnp.float32) if want_x else jnp.zeros((), jnp.float32),
            jnp.zeros_like(w) if want_w else jnp.zeros((), w.dtype))
    dx, dw = reference.sweep_vocab(step, init, w, cfg.blocks.vocab_chunk)
    return (dx.astype(x.dtype) if want_x else None), (dw if want_w else None)


_linear_cross_entropy.defvjp(_marked(_linear_cross_entropy_fwd), _linear_cross_entropy_bwd, symbolic_zeros=True)
