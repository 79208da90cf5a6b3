"""Train-step bodies: `step(params, opt_state, batch, step) -> (params, opt_state, metrics)`, to be wrapped in
`jax.jit` by the Trainer with the parameter / optimizer-state / batch shardings.

`batch` leaves are `[accumulate, global_micro_batch, ...]`; `step` is the int32 update number (the per-step rng is
`fold_in(key, step)`, micro-batch i uses `fold_in(that, i)`). A non-finite loss or gradient norm leaves params and
optimizer state unchanged; `metrics['finite']` tells the Trainer.

With a `LossScale` (float16 compute) the optimizer state is `{'optimizer': the optimizer's state, 'loss_scale':
{'scale', 'good_steps'}}`: the loss is multiplied by the scale before differentiation, so float16 cotangents that would
underflow to zero stay representable, and the float32 gradients are divided by it before the update.
"""
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.custom_derivatives import SymbolicZero

import kernels
from engine.sharding import scan_counts


def split_loss(out):
    """loss_fn may return `loss` or `(loss, metrics)`."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise ValueError("loss_fn returned a tuple; expected `loss` or `(loss, metrics_dict)`")
        return out
    return out, {}


def find_learning_rate(opt_state):
    """The learning rate of the last update, when the optimizer was built with `optax.inject_hyperparams`."""
    found = []

    def visit(x):
        hp = getattr(x, "hyperparams", None)
        if isinstance(hp, dict) and "learning_rate" in hp:
            found.append(hp["learning_rate"])
        if isinstance(x, (tuple, list)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)
        for y in getattr(x, "_asdict", lambda: {})().values() if hasattr(x, "_asdict") else ():
            visit(y)

    visit(opt_state)
    return found[0] if found else None


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Loss scaling for float16 compute (PyTorch's GradScaler, DeepSpeed's fp16 `loss_scale: 0`): the loss is scaled
    by `scale` before the backward pass and the gradients unscaled after it. Dynamic (default): a step whose
    gradients overflow (inf / NaN) is skipped and the scale divided by `factor` (not below `minimum`); after
    `growth_interval` finite steps in a row it is multiplied by `factor`. `dynamic=False`: a fixed scale `initial`.
    float16's gradients underflow below 6e-8 (2^-24) and overflow above 65504, so without a scale the small ones
    vanish: the toy test's gradients were exactly zero (tests/test_trainer.py)."""
    initial: float = 2.0 ** 15
    growth_interval: int = 2000
    factor: float = 2.0
    minimum: float = 1.0
    dynamic: bool = True

    def __post_init__(self):
        for name, ok in (("initial", self.initial >= 1), ("growth_interval", self.growth_interval >= 1),
                         ("factor", self.factor > 1), ("minimum", 1 <= self.minimum <= self.initial)):
            if not ok:
                raise ValueError(f"LossScale({name}={getattr(self, name)!r}); expected initial >= minimum >= 1, "
                                 "growth_interval >= 1 and factor > 1")

    def init(self):
        return {"scale": jnp.float32(self.initial), "good_steps": jnp.int32(0)}

    def next(self, state, finite):
        """The state after a step whose unscaled loss and gradients were `finite` (or not)."""
        if not self.dynamic:
            return state
        grow = finite & (state["good_steps"] + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, state["scale"] * self.factor, state["scale"]),
                          jnp.maximum(state["scale"] / self.factor, self.minimum))
        return {"scale": scale.astype(jnp.float32),
                "good_steps": jnp.where(finite & ~grow, state["good_steps"] + 1, 0).astype(jnp.int32)}


def init_opt_state(optimizer, trained, loss_scale=None):
    """The optimizer state of the trained parameters, with the loss scale's beside it when there is one."""
    if loss_scale is None:
        return optimizer.init(trained)
    return {"optimizer": optimizer.init(trained), "loss_scale": loss_scale.init()}


def current_loss_scale(opt_state, loss_scale):
    """The float32 scale this step multiplies the loss by (None without loss scaling)."""
    return None if loss_scale is None else opt_state["loss_scale"]["scale"]


def cast_floating(tree, dtype):
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def micro_loss_fn(loss_fn, compute_dtype):
    """`(params, micro_batch, rng) -> (fp32 loss, fp32 metrics)` with params cast to `compute_dtype`."""
    def micro_loss(params, batch, rng):
        loss, metrics = split_loss(loss_fn(cast_floating(params, compute_dtype), batch, rng, True))
        return jnp.asarray(loss, jnp.float32), jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)
    return micro_loss


def partition(params, trainable):
    """(trained, frozen): two trees of `params`' structure holding its trained / frozen leaves and None elsewhere.
    trainable: a tree of bools of that structure, or None (everything trains; frozen is None). `params` may be any
    tree of that structure whose entries are whole subtrees (PartitionSpecs, shapes, shardings)."""
    if trainable is None:
        return params, None
    return (jax.tree.map(lambda m, p: p if m else None, trainable, params),
            jax.tree.map(lambda m, p: None if m else p, trainable, params))


def combine(trained, frozen, trainable):
    """The inverse of `partition`."""
    if trainable is None:
        return trained
    return jax.tree.map(lambda m, a, b: a if m else b, trainable, trained, frozen, is_leaf=lambda x: x is None)


def trained_grad_fn(loss_fn, compute_dtype, remat, frozen, trainable, scale=None):
    """`value_and_grad` of the micro-batch loss with respect to the trained parameters only (None leaves where
    frozen): the frozen ones enter as constants, so no weight gradient is computed for them. scale: the loss scale
    (the gradients come out multiplied by it; the loss does not)."""
    micro_loss = micro_loss_fn(loss_fn, compute_dtype)
    if trainable is not None:
        full = micro_loss
        micro_loss = lambda trained, batch, rng: full(combine(trained, frozen, trainable), batch, rng)  # noqa: E731
    micro_loss = jax.checkpoint(micro_loss) if remat else micro_loss
    if scale is None:
        return jax.value_and_grad(micro_loss, has_aux=True)

    def scaled(trained, batch, rng):
        loss, metrics = micro_loss(trained, batch, rng)
        return loss * scale, (loss, metrics)

    grad_fn = jax.value_and_grad(scaled, has_aux=True)

    def unscaled_value(trained, batch, rng):
        (_, aux), grads = grad_fn(trained, batch, rng)
        return aux, grads

    return unscaled_value


def accumulate_gradients(grad_fn, params, batch, rng, accumulate, constrain=lambda g: g):
    """Mean loss, metrics and gradients over the `accumulate` micro-batches of `batch`, in one `lax.scan`; the running
    sum stays in fp32 and is passed through `constrain` (its sharding) after every micro-batch."""
    if accumulate == 1:
        (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch), jax.random.fold_in(rng, 0))
        return loss, metrics, constrain(grads)

    def body(carry, xs):
        micro_batch, i = xs
        (loss, metrics), g = grad_fn(params, micro_batch, jax.random.fold_in(rng, i))
        acc_g, acc_loss, acc_m = carry
        acc_g = constrain(jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc_g, g))
        return (acc_g, acc_loss + loss, jax.tree.map(jnp.add, acc_m, metrics)), None

    zeros = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    (_, metric_shapes), _ = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], batch), rng)
    init = (zeros, jnp.zeros((), jnp.float32), jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), metric_shapes))
    (grads, loss, metrics), _ = jax.lax.scan(body, init, (batch, jnp.arange(accumulate)))
    scale = 1.0 / accumulate
    grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads, params)
    return loss * scale, jax.tree.map(lambda m: m * scale, metrics), grads


def apply_update(optimizer, params, opt_state, grads, loss, metrics, loss_scale=None):
    """The optimizer update, applied only when loss and gradient norm are finite; returns (params, opt_state, metrics).

    The guard is a `lax.cond` around the whole update rather than a `where` on its result: the where keeps old and
    new state alive together (+1 gradient-sized temporary per device: 3.4 GB for LLaMA-7B on 8 devices), the cond
    lets the update run in place in the donated buffers. loss_scale: the `LossScale` the gradients were computed
    under (they are unscaled here, and the scale moves on; metrics['loss_scale'] is this step's)."""
    if loss_scale is not None:
        state, opt_state = opt_state["loss_scale"], opt_state["optimizer"]
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / state["scale"]).astype(g.dtype), grads)
        params, opt_state, metrics = apply_update(optimizer, params, opt_state, grads, loss, metrics)
        metrics["loss_scale"] = state["scale"]
        return params, {"optimizer": opt_state, "loss_scale": loss_scale.next(state, metrics["finite"])}, metrics
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(state):
        params, opt_state, grads = state
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    new_params, new_opt_state = jax.lax.cond(finite, update, lambda state: state[:2], (params, opt_state, grads))
    out = {"loss": loss, "grad_norm": grad_norm, "finite": finite, **metrics}
    lr = find_learning_rate(new_opt_state)
    if lr is not None:
        out["learning_rate"] = lr
    return new_params, new_opt_state, out


def jit_train_step(*, loss_fn, optimizer, grad_shardings, accumulate, compute_dtype, remat, key, trainable=None,
                   loss_scale=None):
    """The reference step: plain `jax.jit` semantics, the compiler's partitioner does every collective.
    trainable: None (every parameter trains) or a tree of bools of the parameters' structure; the optimizer state
    and `grad_shardings` then cover the trained leaves only (`partition(...)[0]`), the frozen ones pass through.
    loss_scale: None or a `LossScale` (its state in the optimizer state, see `init_opt_state`)."""
    constrain = lambda g: jax.tree.map(jax.lax.with_sharding_constraint, g, grad_shardings)  # noqa: E731

    def step(params, opt_state, batch, step):
        rng = jax.random.fold_in(key, step)
        trained, frozen = partition(params, trainable)
        grad_fn = trained_grad_fn(loss_fn, compute_dtype, remat, frozen, trainable,
                                  current_loss_scale(opt_state, loss_scale))
        loss, metrics, grads = accumulate_gradients(grad_fn, trained, batch, rng, accumulate, constrain)
        trained, opt_state, metrics = apply_update(optimizer, trained, opt_state, grads, loss, metrics, loss_scale)
        return combine(trained, frozen, trainable), opt_state, metrics

    return step


# ----------------------------------------------------------------------------------------------------------------
# The shard_map step: `data` and `fsdp` by hand, `model` left to the compiler.

MANUAL_AXES = ("data", "fsdp")
GATHERED = "zero3_gathered"  # checkpoint name of every ZeRO-3-gathered weight: never saved for the backward pass


def _spec_axes(spec, ndim, manual=True):
    """PartitionSpec -> per-dimension tuple of the manual axes it names (in order); the other axes with
    manual=False."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    out = []
    for e in entries:
        axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        out.append(tuple(a for a in axes if (a in MANUAL_AXES) == manual))
    return tuple(out)


def _manual_spec(axes_per_dim):
    return jax.sharding.PartitionSpec(*[None if not a else (a[0] if len(a) == 1 else a) for a in axes_per_dim])


class _LeafPlan:
    """How one parameter travels through the step.

    gather: ((dim, axes), ...) the parameter is split over (gathered at use, its gradient reduce-scattered in the
      backward pass). scatter: ((dim, axes), ...) the gradient is further reduce-scattered over (ZeRO-1/2 `data`).
      reduce: the remaining manual axes the gradient is summed over (all-reduce).
      auto_spec: the parameter's split over the automatic axes (`model`), or None."""

    def __init__(self, param_spec, update_spec, shape, sizes):
        live = lambda axes: tuple(a for a in axes if sizes.get(a, 1) > 1)  # noqa: E731
        p_axes, u_axes = _spec_axes(param_spec, len(shape)), _spec_axes(update_spec, len(shape))
        self.in_spec, self.out_spec = _manual_spec(p_axes), _manual_spec(u_axes)
        auto = [live(a) for a in _spec_axes(param_spec, len(shape), manual=False)]
        self.auto_spec = _manual_spec(auto) if any(auto) else None
        self.gather = tuple((d, live(a)) for d, a in enumerate(p_axes) if live(a))
        self.scatter = tuple((d, live(tuple(x for x in u if x not in p)))
                             for d, (p, u) in enumerate(zip(p_axes, u_axes)) if live(tuple(x for x in u if x not in p)))
        used = {a for _, axes in self.gather + self.scatter for a in axes}
        self.reduce = tuple(a for a in MANUAL_AXES if sizes.get(a, 1) > 1 and a not in used)


class Int8(NamedTuple):
    """ZeRO++'s quantized communication (Wang et al., 2023) in the shard_map step, for every ZeRO-3 parameter of two
    or more dims (vectors, such as norm scales, travel as before). `weights` (qwZ): each shard is all-gathered as
    int8 codes with a float32 absmax scale per row of its last dim (half the bytes of a bf16 gather), so the
    forward and backward passes see the dequantised weights (an error of at most 1/254 of a row's largest value,
    the same in both, so the recompute is consistent). `gradients` (qgZ): every gradient reduction of a parameter of
    two or more dims: a reduce-scatter (ZeRO-3's over `fsdp`, ZeRO-1/2's over `data`) becomes an all-to-all of int8
    chunks with per-row scales, summed in float32 on the receiving device (a quarter of a float32 reduce-scatter's
    bytes), and an all-reduce (ZeRO-0's over `data`) that exchange followed by an int8 all-gather of the summed
    chunks (`_all_reduce_int8`). The optimizer's master weights and state are untouched."""

    weights: bool = False
    gradients: bool = False


def _int8_rows(x):
    """x (float) -> int8 codes and float32 scales [..., 1], absmax per row of the last dim (`kernels.quantize_int8`'s
    format along axis -1, the scales kept as a trailing dim so that they gather and exchange like the codes)."""
    q, scale = kernels.quantize_int8(x, axis=-1)
    return q, scale[..., None]


def _all_gather(x, dims, dtype, int8=False):
    """A shard `x` all-gathered in `dtype` over `dims` ((dim, axes), ...); with `int8` (and two or more dims) as
    codes and row scales (`Int8.weights`; floating shards only: an int8 base weight already travels as int8)."""
    if not (int8 and x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)):
        y = x.astype(dtype)
        for dim, axes in dims:
            y = jax.lax.all_gather(y, axes, axis=dim, tiled=True)
        return y
    q, scale = _int8_rows(x)
    for dim, axes in dims:  # gathered along the last dim, the scales become one column per shard
        q, scale = (jax.lax.all_gather(a, axes, axis=dim, tiled=True) for a in (q, scale))
    shards = scale.shape[-1]
    blocks = q.reshape(*q.shape[:-1], shards, q.shape[-1] // shards).astype(jnp.float32)
    return (blocks * scale[..., None]).reshape(q.shape).astype(dtype)


def _reduce_scatter(g, dims, reduce_dtype, dtype, int8=False):
    """The transpose of `_all_gather`: a full-size gradient summed in `reduce_dtype` and scattered back to the shard
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(x, dims, dtype, reduce_dtype, int8):
    """ZeRO-3 all-gather of a parameter shard in `dtype` (the compute dtype: bf16 gathers move half the bytes of
    fp32); its backward reduce-scatters the gradient in `reduce_dtype` and returns it in the shard's dtype. `int8`:
    an `Int8`."""
    return _all_gather(x, dims, dtype, int8.weights)


def _gather_fwd(x, dims, dtype, reduce_dtype, int8):
    return _gather(x, dims, dtype, reduce_dtype, int8), jnp.zeros((0,), x.dtype)


def _gather_bwd(dims, dtype, reduce_dtype, int8, res, g):
    return (_reduce_scatter(g, dims, reduce_dtype, res.dtype, int8.gradients),)


_gather.defvjp(_gather_fwd, _gather_bwd)


class _Sharded:
    """A parameter still split over manual axes inside the traced loss: the local shard, how to gather it (`int8`: an
    `Int8`), and the element-wise casts the loss applied to it (deferred to after the gather, so the gather moves the
    fewest bytes)."""

    def __init__(self, local, dims, dtype, reduce_dtype, casts=(), int8=Int8()):
        self.local, self.dims, self.dtype, self.reduce_dtype, self.casts = local, dims, dtype, reduce_dtype, casts
        self.int8 = int8

    def full(self):
        from jax.ad_checkpoint import checkpoint_name
        return self.apply_casts(checkpoint_name(
            _gather(self.local, self.dims, self.dtype, self.reduce_dtype, self.int8), GATHERED))

    def apply_casts(self, y):
        """The loss's element-wise casts of this parameter, applied to `y` (gathered, or any part of it)."""
        for eqn in self.casts:
            y, = _bind(eqn, [y])
        return y

    def rebuild(self, local):
        return _Sharded(local, self.dims, self.dtype, self.reduce_dtype, self.casts, self.int8)

    def cast(self, eqn):
        return _Sharded(self.local, self.dims, self.dtype, self.reduce_dtype, self.casts + (eqn,), self.int8)

    def layer(self):
        """How one slice along the (unsplit) leading dim of this stacked parameter is gathered: a scan's layer."""
        return _Sharded(None, tuple((dim - 1, axes) for dim, axes in self.dims), self.dtype, self.reduce_dtype,
                        self.casts, self.int8)


def _full(x):
    return x.full() if isinstance(x, _Sharded) else x


_CASTS = ("convert_element_type", "reduce_precision", "copy", "copy_p")


def _bind(eqn, invals):
    """Re-binds one equation as `jax.core.eval_jaxpr` does (`get_bind_params` returns the params in JAX >= 0.10,
    `(subfuns, params)` before)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]  # shard_map's bind returns a FlatTree


def _open(values, fn):
    """Calls `fn(values)` inside a `jax.checkpoint` whose inputs are the shards, not the gathered weights: the
    backward pass gathers again instead of keeping a full weight alive from its forward use to its backward use."""
    slots = [x if isinstance(x, _Sharded) else None for x in values]
    arrays = [x.local if isinstance(x, _Sharded) else x for x in values]

    def inner(*arrays):
        return fn([s.rebuild(a) if s is not None else a for s, a in zip(slots, arrays)])

    return inner, arrays


def _eval_gathering(jaxpr, consts, args, in_remat=False):
    """Evaluates `jaxpr` where some arguments are `_Sharded`: each is gathered right at its use. Through `scan`
    (stacked layer weights as `xs`), `checkpoint` (remat), `jit` and element-wise casts the shards travel unopened,
    so a scanned layer stack gathers one layer's weights per iteration. Outside a remat region every equation that
    opens a shard runs in its own `jax.checkpoint`, so no gathered weight is saved for the backward pass."""
    from jax.extend import core as jex_core
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if not any(isinstance(x, _Sharded) for x in invals):
            outs = _bind(eqn, invals)
        elif name in _CASTS and len(invals) == 1:
            outs = [invals[0].cast(eqn)]
        elif name == "gather" and _is_row_lookup(eqn, invals):
            outs = [_vocab_parallel_lookup(eqn, *invals)]
        elif name in ("jit", "pjit") and _is_vocab_split_loss(eqn, invals):
            x, w, labels = invals
            outs = [kernels.matmul.vocab_parallel_call(eqn.params["name"], x, _local_cast(w), labels, w.dims[0][1])]
        elif name == "scan":
            outs = (_pipelined_scan if _is_remat_layer_stack(eqn, invals) else _scan_gathering)(eqn, invals, in_remat)
        elif name in ("checkpoint", "remat", "remat2"):
            p = eqn.params
            inner, arrays = _open(invals, lambda vals: _eval_gathering(p["jaxpr"], (), vals, in_remat=True))
            outs = jax.checkpoint(inner, prevent_cse=p["prevent_cse"], policy=p["policy"])(*arrays)
        elif name in ("jit", "pjit", "closed_call"):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            outs = _eval_gathering(inner.jaxpr, inner.consts, invals, in_remat)
        elif in_remat:
            outs = _bind(eqn, [_full(x) for x in invals])
        else:
            inner, arrays = _open(invals, lambda vals, eqn=eqn: _bind(eqn, [_full(x) for x in vals]))
            outs = jax.checkpoint(inner)(*arrays)
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [_full(read(v)) for v in jaxpr.outvars]


def _is_row_lookup(eqn, invals):
    """`table[ids]` (an embedding lookup: whole rows of a 2-D table) on a table split by rows and only by rows, where
    the group's lookups are fewer than the table's rows (then the looked-up vectors are smaller than the table: at
    2048 tokens per device and a 32k vocabulary, up to 15 devices; beyond that gathering the table moves less)."""
    table, ids = invals
    dn, out_rank = eqn.params["dimension_numbers"], len(eqn.outvars[0].aval.shape)
    return (isinstance(table, _Sharded) and not isinstance(ids, _Sharded) and len(table.dims) == 1
            and table.dims[0][0] == 0 and table.local.ndim == 2 and ids.ndim >= 2 and ids.shape[-1] == 1
            and ids.size <= table.local.shape[0]  # group x lookups per device <= group x rows per device
            and dn.collapsed_slice_dims == (0,) and dn.start_index_map == (0,) and not dn.operand_batching_dims
            and dn.offset_dims == (out_rank - 1,) and eqn.params["slice_sizes"] == (1, table.local.shape[1]))


def _is_vocab_split_loss(eqn, invals):
    """A `kernels.linear_cross_entropy` call whose weight [D, V] is split by vocabulary columns only, with at most as
    many rows per device as vocabulary columns per device (the same trade as `_is_row_lookup`)."""
    if not kernels.matmul.is_loss_call(eqn.params.get("name")) or len(invals) != 3:
        return False
    x, w, labels = invals
    return (isinstance(w, _Sharded) and not isinstance(x, _Sharded) and not isinstance(labels, _Sharded)
            and len(w.dims) == 1 and w.dims[0][0] == 1 and w.local.ndim == 2 and x.shape[0] <= w.local.shape[1])


def _local_cast(x):
    """A `_Sharded`'s local shard in the compute dtype, with the loss's element-wise casts applied."""
    return x.apply_casts(x.local.astype(x.dtype))


def _vocab_parallel_lookup(eqn, table, ids):
    """An embedding lookup on a row-split table without gathering the table (Megatron's vocab-parallel embedding,
    over the data-parallel axes): the group's ids are all-gathered (a few KB), each device looks up the rows it holds
    (zeros for the others) and one reduce-scatter of the looked-up vectors returns each device its own rows. The
    backward pass all-gathers the vectors' cotangent and scatter-adds it into the local shard. The vectors are summed
    in `reduce_dtype` (the XLA CPU compiler aborts on bf16 reductions). For LLaMA-7B on 8 devices this replaces a
    262 MB table gather and a 524 MB full-size fp32 table gradient with 268 MB of fp32 vectors. Ids outside the
    table give zeros (a plain lookup gives NaN)."""
    axes = table.dims[0][1]
    rows = table.local.shape[0]
    group_ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)
    local_ids = group_ids - jax.lax.axis_index(axes) * rows
    held = (local_ids >= 0) & (local_ids < rows)
    params = dict(eqn.params, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS, fill_value=None)
    found = jax.lax.gather(table.local, jnp.clip(local_ids, 0, rows - 1), **params)
    found = jnp.where(held, found, 0).astype(table.reduce_dtype)  # held [..., 1] broadcasts over the row
    return table.apply_casts(jax.lax.psum_scatter(found, axes, scatter_dimension=0, tiled=True).astype(table.dtype))


def _scan_gathering(eqn, invals, in_remat):
    p = eqn.params
    n_consts, n_carry = scan_counts(p)
    consts = [_full(x) for x in invals[:n_consts]]
    init = [_full(x) for x in invals[n_consts:n_consts + n_carry]]
    xs, slots = [], []
    for x in invals[n_consts + n_carry:]:
        # A weight stacked along the scanned axis slices locally when that axis is not itself split.
        if isinstance(x, _Sharded) and all(dim > 0 for dim, _ in x.dims):
            xs.append(x.local)
            slots.append(x.layer())
        else:
            xs.append(_full(x))
            slots.append(None)
    body = p["jaxpr"]

    def step(carry, x):
        x = [s.rebuild(a) if s is not None else a for s, a in zip(slots, x)]
        outs = _eval_gathering(body.jaxpr, body.consts, consts + list(carry) + x, in_remat)
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return list(carry) + list(ys)


def _is_remat_layer_stack(eqn, invals):
    """A scan over stacked ZeRO-3 weights whose body is one fully rematerialised block (a model built with
    scan-over-layers and remat='full'): the case `_pipelined_scan` handles."""
    p = eqn.params
    stacked = [x for x in invals[sum(scan_counts(p)):] if isinstance(x, _Sharded)]
    body = p["jaxpr"].jaxpr.eqns
    return (bool(stacked) and all(dim > 0 for x in stacked for dim, _ in x.dims) and len(body) == 1
            and body[0].primitive.name in ("checkpoint", "remat", "remat2") and body[0].params.get("policy") is None)


def _eval_inlined(jaxpr, consts, args):
    """`jax.core.eval_jaxpr` with remat regions inlined: the caller already keeps only the layer's input."""
    from jax.extend import core as jex_core
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
            outs = _eval_inlined(eqn.params["jaxpr"], (), invals)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _pipelined_scan(eqn, invals, in_remat):
    """A remat'd layer stack over ZeRO-3 shards, software-pipelined by hand (one `custom_vjp`):

      forward   iteration t: all-gather layer t+1's weights | run layer t with the weights gathered last iteration
      backward  iteration t: all-gather layer t-1's weights | reduce-scatter layer t+1's weight gradient |
                             recompute layer t from its saved input and back-propagate through it

    The collective of each iteration does not depend on its compute, so the scheduler can run them side by side (on
    GPU the latency-hiding scheduler overlaps them; see engine/compiler.py). Only each layer's input is saved (what
    remat='full' keeps); at most two layers' gathered weights and two layers' full-size gradients are alive at once.
    The first and last iterations are peeled so that no collective is issued twice. Only the inputs being
    differentiated get gradients (the custom_vjp sees symbolic zeros): a frozen weight (`Trainer(trainable=...)`)
    is gathered for each layer but gets no weight gradient and no reduce-scatter."""
    del in_remat  # the layer's own remat is replaced by this schedule
    p = eqn.params
    (n_consts, n_carry), n, reverse = scan_counts(p), p["length"], p["reverse"]
    body = p["jaxpr"]
    consts = [_full(x) for x in invals[:n_consts]]
    init = [_full(x) for x in invals[n_consts:n_consts + n_carry]]
    xs = invals[n_consts + n_carry:]
    is_w = [isinstance(x, _Sharded) for x in xs]
    slots = [x.layer() for x in xs if isinstance(x, _Sharded)]
    plain = [x for x in xs if not isinstance(x, _Sharded)]
    stacked = [x.local for x in xs if isinstance(x, _Sharded)]
    position = lambda t: n - 1 - t if reverse else t  # noqa: E731 - iteration t runs layer position(t)
    at = lambda x, t: jax.lax.dynamic_index_in_dim(x, position(t), 0, keepdims=False)  # noqa: E731

    def gather(ws, t):
        return [_all_gather(at(w, t), s.dims, s.dtype, s.int8.weights) for w, s in zip(ws, slots)]

    def layer(consts, carry, x_plain, gathered):
        x_plain, gathered, x = iter(x_plain), iter(gathered), []
        for i, w in enumerate(is_w):
            if w:
                x.append(slots[sum(is_w[:i])].apply_casts(next(gathered)))
            else:
                x.append(next(x_plain))
        outs = _eval_inlined(body.jaxpr, body.consts, list(consts) + list(carry) + x)
        return outs[:n_carry], outs[n_carry:]

    def forward(consts, init, plain, ws):
        def step(state, t, prefetch):
            carry, w = state
            nxt = gather(ws, t + 1) if prefetch else None
            carry_out, y = layer(consts, carry, [at(x, t) for x in plain], w)
            return (carry_out, nxt), (y, [_as_bits(c) for c in carry])

        state, saved, ys = (init, gather(ws, 0)), None, None
        if n > 1:
            state, (ys, saved) = jax.lax.scan(lambda s, t: step(s, t, True), state, jnp.arange(n - 1))
        (carry, _), (y_last, saved_last) = step(state, n - 1, False)
        ys = [y[None] if ys is None else jnp.concatenate([ys[i], y[None]]) for i, y in enumerate(y_last)]
        ys = [y[::-1] if reverse else y for y in ys]
        return (carry, ys), (consts, plain, ws, saved, saved_last)

    def forward_marked(consts, init, plain, ws):
        # Which inputs are differentiated, kept as the residuals' tree structure (() differentiated, None not).
        marks = jax.tree.map(lambda a: () if a.perturbed else None, (consts, init, plain, ws))
        out, res = forward(*jax.tree.map(lambda a: a.value, (consts, init, plain, ws)))
        return out, (res, marks)

    def backward(res_marks, cts):
        (consts, plain, ws, saved, saved_last), marks = res_marks
        c_perturbed, _, x_perturbed, w_perturbed = [[m is not None for m in ms] for ms in marks]
        zero = lambda ct: jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct  # noqa: E731
        ct_carry, ct_ys = ([zero(c) if jnp.issubdtype(c.dtype, jnp.inexact) else c for c in ct] for ct in cts)
        inexact = lambda xs: [jnp.issubdtype(x.dtype, jnp.inexact) for x in xs]  # noqa: E731
        c_mask, k_mask = [a and b for a, b in zip(inexact(consts), c_perturbed)], inexact(init)
        x_mask = [a and b for a, b in zip(inexact(plain), x_perturbed)]
        ws_all = ws
        ws = [w for w, m in zip(ws_all, w_perturbed) if m]  # the weights that get gradients
        grad_slots = [s for s, m in zip(slots, w_perturbed) if m]

        def scatter(gs):
            return [_reduce_scatter(g, s.dims, s.reduce_dtype, w.dtype, s.int8.gradients)
                    for g, w, s in zip(gs, ws, grad_slots)]
        y_mask = [jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in body.jaxpr.outvars[n_carry:]]
        pick = lambda xs, mask: [x for x, m in zip(xs, mask) if m]  # noqa: E731

        def merge(picked, mask, like):
            picked = iter(picked)
            return [next(picked) if m else x for x, m in zip(like, mask)]

        def vjp_layer(t, carry_in, w, ct_k):
            x_t = [at(x, t) for x in plain]

            def f(c, k, x, w_d):
                carry_out, ys = layer(merge(c, c_mask, consts), merge(k, k_mask, carry_in), merge(x, x_mask, x_t),
                                      merge(w_d, w_perturbed, w))
                return pick(carry_out, k_mask), pick(ys, y_mask)

            _, pullback = jax.vjp(f, pick(consts, c_mask), pick(carry_in, k_mask), pick(x_t, x_mask),
                                  pick(w, w_perturbed))
            return pullback((ct_k, pick([at(c, t) for c in ct_ys], y_mask)))

        def put(buffers, values, t):
            return [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), position(t), 0)
                    for b, v in zip(buffers, values)]

        def step(state, t, carry_in, prefetch, flush):
            ct_k, w, pending, acc_c, buf_w, buf_x = state
            carry_in = [_from_bits(c, x.dtype) for c, x in zip(carry_in, init)]
            nxt = gather(ws_all, t - 1 + shift) if prefetch else None
            if flush:  # layer t+1's gradient, reduce-scattered while layer t is recomputed and differentiated
                buf_w = put(buf_w, scatter(pending), t + 1)
            d_c, d_k, d_x, d_w = vjp_layer(t, carry_in, w, ct_k)
            acc_c = [a + d.astype(a.dtype) for a, d in zip(acc_c, d_c)]
            return d_k, nxt, d_w, acc_c, buf_w, put(buf_x, d_x, t)

        zeros = lambda xs, dtype=None: [jnp.zeros(x.shape, dtype or x.dtype) for x in xs]  # noqa: E731
        # A zero the compiler cannot fold, computed from the incoming cotangent (NaN there makes the whole update
        # skipped anyway). The gradient buffers are filled with it (every slot is overwritten) and the backward
        # gathers' layer index is offset by it, so that neither is issued before the backward pass starts: measured
        # on LLaMA-7B, an early full-size gradient buffer, or a forward gather merged with its backward twin and kept
        # alive in between, each cost hundreds of MB.
        late = jnp.zeros((), jnp.float32)
        for c in pick(ct_carry, k_mask)[:1]:
            late = jnp.ravel(c)[0].astype(jnp.float32) * 0
        shift = (late != late).astype(jnp.int32)
        buffers = lambda xs: [jnp.full(x.shape, late, x.dtype) for x in xs]  # noqa: E731
        state = (pick(ct_carry, k_mask), gather(ws_all, n - 1 + shift), None,
                 zeros(pick(consts, c_mask), jnp.float32), buffers(ws), buffers(pick(plain, x_mask)))
        state = step(state, n - 1, saved_last, n > 1, False)
        if n > 2:
            index = lambda x, t: jax.lax.dynamic_index_in_dim(x, t, 0, keepdims=False)  # noqa: E731
            state, _ = jax.lax.scan(lambda s, t: (step(s, t, [index(x, t) for x in saved], True, True), None),
                                    state, jnp.arange(1, n - 1), reverse=True)
        if n > 1:
            state = step(state, 0, [x[0] for x in saved], False, True)
        ct_k, _, pending, acc_c, buf_w, buf_x = state
        buf_w = put(buf_w, scatter(pending), 0)
        none = lambda xs: [None] * len(xs)  # noqa: E731 - a zero cotangent
        ct_consts = merge([a.astype(c.dtype) for a, c in zip(acc_c, pick(consts, c_mask))], c_mask, none(consts))
        return (ct_consts, merge(ct_k, k_mask, none(init)), merge(buf_x, x_mask, none(plain)),
                merge(buf_w, w_perturbed, none(ws_all)))

    run = jax.custom_vjp(lambda *a: forward(*a)[0])
    run.defvjp(forward_marked, backward, symbolic_zeros=True)
    carry, ys = run(consts, init, plain, stacked)
    return list(carry) + list(ys)


def _as_bits(x):
    """16-bit floats as raw uint16 words: a saved activation stack stays 16-bit whatever a compiler does with the float
    arithmetic around it (the XLA CPU compiler otherwise widens the whole stack to fp32: +0.5 GB for LLaMA-7B)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _from_bits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map`, manual over the data axes only; replication is not type-checked because every reduction
    here is explicit. Over the abstract mesh the step is traced under (`kernels.tracing_mesh`): a concrete mesh
    must equal the context's, which names a target device when lowering for an accelerator this host lacks."""
    return jax.shard_map(fn, mesh=kernels.tracing_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(MANUAL_AXES), check_vma=False)


def _all_reduce_int8(g, axes):
    """`psum(g, axes)` in float32 with int8 traffic: the int8 reduce-scatter of `_reduce_scatter` along the first dim
    the group size divides, then this device's summed chunk all-gathered as int8 rows (`_all_gather`), so each value
    is rounded twice (to 1/254 of its chunk row's largest, then of the sum's). Exact psum when no dim divides."""
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    dim = next((d for d in range(g.ndim) if g.shape[d] % n == 0), None)
    if dim is None:
        return jax.lax.psum(g.astype(jnp.float32), axes)
    part = _reduce_scatter(g, ((dim, axes),), jnp.float32, jnp.float32, int8=True)
    return _all_gather(part, ((dim, axes),), jnp.float32, int8=True)


def _reduce(g, plan_scatter, plan_reduce, reduce_dtype, auto_spec=None, int8=False):
    """Sums a local gradient over the data-parallel shards: reduce-scatter over `plan_scatter`, all-reduce over
    `plan_reduce`, in `reduce_dtype`, back in fp32; with `int8` (`Int8.gradients`, gradients of two or more dims)
    both as int8 exchanges (`_reduce_scatter`, `_all_reduce_int8`). A gradient split over `model` (`auto_spec`) is
    reduced block by block in a shard_map over `model` too: left to the partitioner, a reduce-scatter over `data`
    first gathered the whole `model` dimension (2.9 GB per MLP stack for LLaMA-7B on 2x2x2 with ZeRO-1)."""
    if not plan_scatter and not plan_reduce:
        return g

    def reduce(g):
        if int8 and g.ndim >= 2:
            g = _reduce_scatter(g, plan_scatter, jnp.float32, jnp.float32, int8=True)
            return _all_reduce_int8(g, plan_reduce) if plan_reduce else g
        g = g.astype(reduce_dtype)
        for dim, axes in plan_scatter:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        if plan_reduce:
            g = jax.lax.psum(g, plan_reduce)
        return g.astype(jnp.float32)

    # A reduce-scatter along a dimension that `model` splits too stays with the partitioner: block by block, each
    # device would keep a piece of every model block instead of one contiguous chunk.
    if auto_spec is None or any(auto_spec[dim] for dim, _ in plan_scatter):
        return reduce(g)
    named = {a for e in auto_spec for a in ((e,) if isinstance(e, str) else (e or ()))}
    return jax.shard_map(reduce, in_specs=auto_spec, out_specs=auto_spec, axis_names=named, check_vma=False)(g)


def shard_map_train_step(*, loss_fn, optimizer, mesh, param_specs, update_specs, zero_stage, accumulate,
                         compute_dtype, remat, key, reduce_dtype=jnp.float32, weight_metric=None, trainable=None,
                         loss_scale=None, int8=Int8()):
    """The overlapped step: a `jax.shard_map` manual over `data` and `fsdp` (the `model` axis stays automatic, split by
    the compiler from the parameter specs) computes the gradients with explicit collectives; the optimizer update
    then runs auto-partitioned on the gradient shards, as in `jit_train_step`.

    Inside the shard_map each device runs `loss_fn` on its own rows of every micro-batch:
      - ZeRO-3 (every parameter split over a data axis in `param_specs`, i.e. `fsdp`): the shard is all-gathered in
        the compute dtype right before its first use and the gathered copy is never kept for the backward pass (it
        is gathered again there); the gradient is reduce-scattered in `reduce_dtype` by the gather's backward. For a
        scan-over-layers model the loss's jaxpr is re-evaluated so that the stacked weights enter the layer loop as
        shards and each iteration gathers only its own layer; with remat='full' the stack is pipelined by hand
        (`_pipelined_scan`: layer t+1's gather and layer t+1's gradient reduce-scatter run beside layer t). A
        row-split embedding table is looked up vocab-parallel (`_vocab_parallel_lookup`), never gathered.
      - accumulation: partial gradients stay in the parameter's (ZeRO-2: the update's) layout between micro-batches.
      - the remaining data-parallel reduction (`data`, and `fsdp` for unsplit parameters) is one all-reduce, or a
        reduce-scatter into `update_specs` (ZeRO-1/2: each device then updates only its optimizer-state shard and the
        compiler all-gathers the new weights).

    `update_specs`: the parameter-shaped layout the optimizer works in (`param_specs` with `data` added for ZeRO-1/2).
    `reduce_dtype`: jnp.float32 or jnp.bfloat16, the dtype of every gradient reduction (bf16 halves the bytes on
      GPU/TPU; the XLA CPU compiler of jaxlib 0.10.2 aborts on it, so CPU runs keep fp32).
    `weight_metric`: None (every shard's loss counts equally: exact for losses that are means over rows), or the name
      of a metric of `loss_fn` holding what its loss is a mean over (e.g. 'tokens' for `engine.tasks.lm.lm_loss_fn`):
      loss, gradients and every other metric are then averaged with those weights across shards, and that metric is
      summed, which reproduces the global-batch values of `jit_train_step` exactly.
    `trainable`: as in `jit_train_step`. A frozen parameter is gathered like any other but never differentiated:
      no weight gradient, no reduction.
    `int8`: an `Int8`, ZeRO++'s int8 weight gathers of the ZeRO-3 parameters and / or int8 gradient reductions
      (every reduce-scatter and all-reduce of a gradient of two or more dims; the others stay in `reduce_dtype`).
    Metrics, the NaN/inf guard, the learning rate and `loss_scale` are those of `jit_train_step` (the scale enters
    the manual region as a replicated scalar; gradients are reduced scaled, unscaled in the update). rng: micro-batch
    i of update `step` uses `fold_in(fold_in(key, step), i)`, further folded with the shard index when there are
    several shards (so that dropout masks of different shards are independent).
    """
    if jnp.dtype(reduce_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"reduce_dtype={reduce_dtype!r}; expected jnp.float32 or jnp.bfloat16")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage={zero_stage!r}; expected 0, 1 or 2")
    if not isinstance(int8, Int8):
        raise ValueError(f"int8={int8!r}; expected an engine.step.Int8")
    reduce_dtype = jnp.dtype(reduce_dtype)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    live = tuple(a for a in MANUAL_AXES if sizes.get(a, 1) > 1)
    n_shards = math.prod(sizes.get(a, 1) for a in MANUAL_AXES)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    update_sh = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), update_specs, is_leaf=is_spec)
    micro = micro_loss_fn(loss_fn, None)  # the cast to compute_dtype happens on the shards, before any gather

    def compute_type(x):
        return jnp.dtype(compute_dtype) if compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) \
            else x.dtype

    def step(params, opt_state, batch, step):
        leaves, treedef = jax.tree.flatten(params)
        plans = [_LeafPlan(s, u, x.shape, sizes) for s, u, x in
                 zip(treedef.flatten_up_to(param_specs), treedef.flatten_up_to(update_specs), leaves)]
        mask = [True] * len(leaves) if trainable is None else treedef.flatten_up_to(trainable)
        pick = lambda xs, want=True: [x for x, m in zip(xs, mask) if m == want]  # noqa: E731
        trained_plans = pick(plans)
        full_abstract = [jax.ShapeDtypeStruct(x.shape, compute_type(x)) for x in leaves]

        def local(local_params, local_batch, step, scale):
            rng = jax.random.fold_in(key, step)
            shard = jax.lax.axis_index(live) if live else None
            first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), local_batch)
            closed, out_shape = jax.make_jaxpr(micro, return_shape=True)(
                treedef.unflatten(full_abstract), first, jax.ShapeDtypeStruct((), rng.dtype))
            out_tree = jax.tree.structure(out_shape)

            def shard_loss(trained_leaves, frozen_leaves, micro_batch, micro_rng):
                trained_iter, frozen_iter = iter(trained_leaves), iter(frozen_leaves)
                local_leaves = [next(trained_iter) if m else next(frozen_iter) for m in mask]
                args = [_Sharded(x, pl.gather, compute_type(x), reduce_dtype, int8=int8) if pl.gather
                        else x.astype(compute_type(x)) for x, pl in zip(local_leaves, plans)]
                flat_in = args + jax.tree.leaves(micro_batch) + [micro_rng]
                loss, metrics = out_tree.unflatten(_eval_gathering(closed.jaxpr, closed.consts, flat_in, remat))
                if weight_metric is None:
                    weight = jnp.float32(1.0 / n_shards)
                else:
                    w = jax.lax.stop_gradient(metrics[weight_metric])
                    weight = w / (jax.lax.psum(w, live) if live else w)
                scaled = loss * weight if scale is None else loss * weight * scale
                return scaled, (loss, metrics, weight)

            grad_fn = jax.value_and_grad(jax.checkpoint(shard_loss) if remat else shard_loss, has_aux=True)

            def one(local_leaves, micro_batch, i):
                micro_rng = jax.random.fold_in(rng, i)
                if shard is not None:
                    micro_rng = jax.random.fold_in(micro_rng, shard)
                (_, (loss, metrics, weight)), grads = grad_fn(pick(local_leaves), pick(local_leaves, False),
                                                              micro_batch, micro_rng)
                grads = [g.astype(jnp.float32) for g in grads]
                if zero_stage == 2:  # ZeRO-2: partial sums leave each micro-batch already split over `data`
                    grads = [_reduce(g, pl.scatter, (), reduce_dtype, pl.auto_spec, int8.gradients)
                             for g, pl in zip(grads, trained_plans)]
                metrics = {k: v if k == weight_metric else v * weight for k, v in metrics.items()}
                return grads, loss * weight, metrics

            if accumulate == 1:
                grads, loss, metrics = one(leaves_of(local_params), jax.tree.map(lambda x: x[0], local_batch), 0)
            else:
                def body(carry, xs):
                    g, l, m = one(leaves_of(local_params), *xs)
                    acc_g, acc_l, acc_m = carry
                    return ([a + b for a, b in zip(acc_g, g)], acc_l + l, jax.tree.map(jnp.add, acc_m, m)), None

                g0, l0, m0 = jax.eval_shape(one, leaves_of(local_params), jax.tree.map(lambda x: x[0], local_batch),
                                            0)
                zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
                (grads, loss, metrics), _ = jax.lax.scan(body, (zeros(g0), zeros(l0), zeros(m0)),
                                                         (local_batch, jnp.arange(accumulate)))
            scale = 1.0 / accumulate
            grads = [_reduce(g, () if zero_stage == 2 else pl.scatter, pl.reduce, reduce_dtype, pl.auto_spec,
                             int8.gradients) * scale for g, pl in zip(grads, trained_plans)]
            grads = [g.astype(x.dtype) for g, x in zip(grads, pick(leaves_of(local_params)))]
            loss, metrics = jax.tree.map(lambda v: (jax.lax.psum(v, live) if live else v) * scale, (loss, metrics))
            return grads, loss, metrics

        leaves_of = lambda tree: jax.tree.leaves(tree)  # noqa: E731
        fn = _shard_map(local, mesh, in_specs=(treedef.unflatten([pl.in_spec for pl in plans]),
                                                jax.sharding.PartitionSpec(None, MANUAL_AXES),
                                                jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec()),
                        out_specs=([pl.out_spec for pl in trained_plans], jax.sharding.PartitionSpec(),
                                   jax.sharding.PartitionSpec()))
        grads, loss, metrics = fn(params, batch, step, current_loss_scale(opt_state, loss_scale))
        trained, frozen = partition(params, trainable)
        grads = [jax.lax.with_sharding_constraint(g, sh)
                 for g, sh in zip(grads, pick(treedef.flatten_up_to(update_sh)))]
        grads = jax.tree.structure(trained).unflatten(grads)
        trained, opt_state, metrics = apply_update(optimizer, trained, opt_state, grads, loss, metrics, loss_scale)
        return combine(trained, frozen, trainable), opt_state, metrics

    return step
