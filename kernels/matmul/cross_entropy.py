"""Linear + cross-entropy without logits (`linear_cross_entropy`), and its vocabulary-parallel form.

The contract with a caller that re-evaluates a traced program (the engine's shard_map step, which holds the output
weight split by vocabulary columns and must not gather it): every `linear_cross_entropy` call traces as one `jit`
equation `(x [N, D], w [D, V], labels [N]) -> loss [N]` whose body opens with `loss_call_p` applied to x (for a
Pallas implementation on a mesh, inside the `shard_map` that `kernels/_partition.py` puts around it). That
primitive is the identity under every transformation; its one parameter, `loss`, is the call's static settings as a
`VocabParallelLoss`. `vocab_parallel_loss(eqn)` returns those settings for such an equation (the `jit`, or a
`shard_map` holding its operands whole around it) and None for any other, and `VocabParallelLoss.run` computes the
same loss with w's vocabulary split over a manual mesh axis. Nothing is
registered globally and no name is matched: the equation carries what the caller needs.
"""
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from kernels import _partition
from kernels.matmul import _blocks, reference
from kernels.matmul.api import _BACKENDS, _P, _check_weight, _check_x, _config, _Config, _instantiate, _marked, _rows

__all__ = ["VocabParallelLoss", "linear_cross_entropy", "linear_cross_entropy_sum", "loss_call_p",
           "vocab_parallel_loss"]


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
    view, row_spec = _rows(cfg, x)
    call = _loss_call(VocabParallelLoss(ignore_index, cfg))

    def on_block(x, w, labels):  # x [..., D], labels [...]: one block of the view
        return call(x.reshape(-1, x.shape[-1]), w, labels.reshape(-1)).reshape(labels.shape)

    loss = _partition.shard(on_block, (view, w, labels.reshape(view.shape[:-1]).astype(jnp.int32)),
                            (_P(*row_spec, None), _P(), _P(*row_spec)), _P(*row_spec), cfg.implementation)
    return loss.reshape(labels.shape)


def _with_vocab_chunk(cfg, x, w):
    """cfg with the loss's vocabulary chunk sized for rows `x` and weight `w` (unless `block_sizes` fixed it)."""
    return cfg._replace(blocks=_blocks.with_vocab_chunk(cfg.blocks, w.shape[1], cfg.implementation, w.shape[0],
                                                        jnp.dtype(x.dtype).itemsize))


class VocabParallelLoss(NamedTuple):
    """The static settings of one traced `linear_cross_entropy` call (the `loss` parameter of `loss_call_p`)."""
    ignore_index: int
    cfg: _Config

    def run(self, x, w, labels, axis_name):
        """The call's loss inside a `shard_map` over `axis_name` with the vocabulary split across it (Megatron's
        vocab-parallel cross-entropy): x [N, D] and labels [N] are this device's rows, w [D, V / G] the vocabulary
        slice `axis_index(axis_name)`. The group's rows are all-gathered, each device sweeps its own slice
        blockwise, a log-sum-exp across devices (a max and a sum of N·G floats) gives each row's loss, and the
        backward reduce-scatters the rows' gradient while each device keeps its slice's gradient whole: no device
        ever holds the whole weight or its gradient. x [..., D] and labels [...] are flattened to rows. Returns this
        device's per-token loss, labels' shape. A Pallas kernel runs inside a `shard_map` over the ambient mesh's
        automatic axes, holding every operand whole (`kernels/_partition.py`: Mosaic refuses any automatic axis)."""
        cfg = _with_vocab_chunk(self.cfg, x, w)

        def rows(x, w, labels):
            return _vocab_parallel(self.ignore_index, cfg, axis_name, x.reshape(-1, x.shape[-1]), w,
                                   labels.reshape(-1)).reshape(labels.shape)

        return _partition.shard(rows, (x, w, labels), (_P(), _P(), _P()), _P(), cfg.implementation)


def vocab_parallel_loss(eqn):
    """The `VocabParallelLoss` of a traced `linear_cross_entropy` call: `eqn` (an equation of a jaxpr) when it is
    the call's `jit`, whose body opens with `loss_call_p` on its first input, or a `shard_map` around that `jit` that
    splits none of its operands (a Pallas implementation's on a mesh); None for any other equation."""
    if eqn.primitive.name == "shard_map" and len(eqn.invars) == 3:
        body = eqn.params["jaxpr"]
        whole = all(not any(spec) for spec in (*eqn.params["in_specs"], *eqn.params["out_specs"]))
        calls = [e for e in body.eqns if e.primitive is jex_core.primitives.jit_p]
        if whole and len(calls) == 1 and calls[0].invars[1] is body.invars[1]:
            return vocab_parallel_loss(calls[0])
        return None
    if eqn.primitive is not jex_core.primitives.jit_p or len(eqn.invars) != 3:
        return None
    body = eqn.params["jaxpr"].jaxpr
    first = body.eqns[0] if body.eqns else None
    if first is None or first.primitive is not loss_call_p or first.invars[0] is not body.invars[0]:
        return None
    return first.params["loss"]


# The marker: identity on x, carrying the call's settings into the traced program.
loss_call_p = jex_core.Primitive("linear_cross_entropy_call")
loss_call_p.def_impl(lambda x, *, loss: x)
loss_call_p.def_abstract_eval(lambda x, *, loss: x)
mlir.register_lowering(loss_call_p, lambda ctx, x, *, loss: [x])
ad.primitive_jvps[loss_call_p] = lambda primals, tangents, *, loss: (loss_call_p.bind(*primals, loss=loss),
                                                                      tangents[0])
batching.primitive_batchers[loss_call_p] = lambda args, dims, *, loss: (loss_call_p.bind(*args, loss=loss), dims[0])


@functools.lru_cache(maxsize=None)
def _loss_call(loss):
    """The loss as one `jax.jit` per settings, its body opening with the marker (the contract above)."""
    def linear_cross_entropy(x, w, labels):
        x = loss_call_p.bind(x, loss=loss)
        return _linear_cross_entropy(x, w, labels, loss.ignore_index, _with_vocab_chunk(loss.cfg, x, w))

    return jax.jit(linear_cross_entropy)


def _vocab_parallel(ignore_index, cfg, axis_name, x, w, labels):
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
        dx_all, dw = _lce_grads(ignore_index, cfg, (x_all, w, local, lse), g_all, want_x, want_w, dx_dtype=jnp.float32)
        dx = None
        if want_x:  # summed in float32: every device holds part of every row's gradient (its slice's share)
            dx = lax.psum_scatter(dx_all, axis_name, scatter_dimension=0, tiled=True).astype(x_all.dtype)
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


def _lce_grads(ignore_index, cfg, res, g, want_x=True, want_w=True, dx_dtype=None):
    """(dx or None, dw or None) of the loss, recomputing the logits one vocabulary chunk at a time; only what is
    wanted is computed (a frozen head, e.g. under LoRA, costs no [D, V] gradient). dx in `dx_dtype` (None: x's)."""
    x, w, labels, lse = res
    n = x.shape[0]
    # Zero cotangent for ignored tokens zeroes their whole row of d logits, hence their dx and share of dw.
    g = jnp.where(labels != ignore_index, g, 0.0).astype(jnp.float32).reshape(n, 1)

    def step(carry, w_c, start):
        dx, dw = carry
        (dlogits,) = cfg.matmul((x,), (w_c,), (lse.reshape(n, 1), (labels - start).reshape(n, 1), g),
                                extra_kinds=("row",) * 3, epilogue=reference.epilogue_dlogits,
                                out_dtypes=(x.dtype,))
        if want_x and cfg.implementation == "mosaic_tpu":  # its tiles and a float32 sum tile overflow scoped VMEM
            dx = dx + cfg.matmul((dlogits,), (w_c,), out_dtypes=(jnp.float32,), trans_rhs=True)[0]
        elif want_x:  # the float32 sum over chunks, added in the matmul's epilogue and written over itself in place
            (dx,) = cfg.matmul((dlogits,), (w_c,), (dx,), extra_kinds=("tile",), epilogue=reference.epilogue_add,
                               out_dtypes=(jnp.float32,), trans_rhs=True, aliases=((0, 0),))
        if want_w:
            (dw_c,) = cfg.matmul((x,), (dlogits,), out_dtypes=(w.dtype,), trans_lhs=True)
            dw = lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=1)
        return dx, dw

    init = (jnp.zeros(x.shape, jnp.float32) if want_x else jnp.zeros((), jnp.float32),
            jnp.zeros_like(w) if want_w else jnp.zeros((), w.dtype))
    dx, dw = reference.sweep_vocab(step, init, w, cfg.blocks.vocab_chunk)
    return (dx.astype(dx_dtype or x.dtype) if want_x else None), (dw if want_w else None)


_linear_cross_entropy.defvjp(_marked(_linear_cross_entropy_fwd), _linear_cross_entropy_bwd, symbolic_zeros=True)


def linear_cross_entropy_sum(x, w, labels, weights, *, ignore_index=-100, chunk_rows=1024):
    """sum_n weights[n] * cross-entropy(x[n] @ w, labels[n]) (float32 scalar), in chunks of `chunk_rows` rows, with
    its gradients taken in the forward pass: three matmuls per chunk when differentiated, as plain logits take
    (logits; d logits @ w^T; x^T @ d logits), instead of `linear_cross_entropy`'s four (its backward recomputes the
    logits), and no temporary larger than [chunk_rows, V] floats (the logits of the whole batch never exist).

    x: [..., D]; w: [D, V] (x's dtype); labels: integer [...] (`ignore_index`: no loss, no gradient); weights: float
    [...] (e.g. 1 / token count for a mean; not differentiated). The scalar's cotangent scales the gradients the
    forward took (the loss is linear in it), so any caller that reduces the losses with fixed weights gets exact
    gradients; gradient memory: x's and w's gradients (w's in float32) are held from the forward to the backward.
    Plain XLA matmuls (bf16 operands, float32 accumulation), so every backend runs it."""
    _check_x(x)
    _check_weight("w", w, x)
    if labels.shape != x.shape[:-1] or weights.shape != x.shape[:-1]:
        raise ValueError(f"labels.shape={tuple(labels.shape)}, weights.shape={tuple(weights.shape)}; expected "
                         f"x.shape[:-1]={tuple(x.shape[:-1])}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels.dtype={labels.dtype}; expected an integer dtype")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r}; expected a positive int")
    n, d = math.prod(x.shape[:-1]), x.shape[-1]
    rows = min(chunk_rows, n)
    pad = -n % rows
    valid = labels.reshape(n) != ignore_index
    scale = jnp.where(valid, weights.reshape(n).astype(jnp.float32), 0.0)
    chunks = (jnp.pad(x.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, rows, d),
              jnp.pad(jnp.where(valid, labels.reshape(n), 0).astype(jnp.int32), (0, pad)).reshape(-1, rows),
              jnp.pad(scale, (0, pad)).reshape(-1, rows))
    return _chunked_loss(w, *chunks)


def _chunk_logits(x, w, labels):
    """(lse [rows], softmax [rows, V] float32, the labels' logits [rows]) of one chunk; logits in float32."""
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return lse, logits, picked


@jax.custom_vjp
def _chunked_loss(w, x, labels, scale):
    def body(total, chunk):
        x_c, labels_c, scale_c = chunk
        lse, _, picked = _chunk_logits(x_c, w, labels_c)
        return total + jnp.sum(scale_c * (lse - picked)), None
    return lax.scan(body, jnp.zeros((), jnp.float32), (x, labels, scale))[0]


def _chunked_loss_fwd(w, x, labels, scale):
    def body(carry, chunk):
        total, dw = carry
        x_c, labels_c, scale_c = chunk
        lse, logits, picked = _chunk_logits(x_c, w, labels_c)
        probs = jnp.exp(logits - lse[:, None])
        onehot = jnp.arange(w.shape[1])[None, :] == labels_c[:, None]
        dlogits = (scale_c[:, None] * (probs - onehot)).astype(x.dtype)
        dx_c = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
        dw = dw + jnp.dot(x_c.T, dlogits, preferred_element_type=jnp.float32)
        return (total + jnp.sum(scale_c * (lse - picked)), dw), dx_c

    (total, dw), dx = lax.scan(body, (jnp.zeros((), jnp.float32), jnp.zeros(w.shape, jnp.float32)),
                               (x, labels, scale))
    return total, (dw.astype(w.dtype), dx)


def _chunked_loss_bwd(res, g):
    dw, dx = res
    return (g * dw).astype(dw.dtype), (g * dx).astype(dx.dtype), None, None


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)
