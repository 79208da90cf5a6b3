"""What both train steps share: the micro-batch loss and its precision casts, the trained / frozen split of the
parameters, gradient accumulation, and the update with its non-finite guard and loss scaling.

A step is `step(params, opt_state, batch, step) -> (params, opt_state, metrics)`, wrapped in `jax.jit` by the
Trainer with the parameter / optimizer-state / batch shardings. `batch` leaves are `[accumulate, global_micro_batch,
...]`; `step` is the int32 update number (the per-step rng is `fold_in(key, step)`, micro-batch i uses
`fold_in(that, i)`). A non-finite loss or gradient norm leaves params and optimizer state unchanged;
`metrics['finite']` tells the Trainer.

A parameter named `kernels.matmul.fp8.OVERWRITE` (an FP8 projection's amax history, delayed scaling) is state, not
a weight: its "gradient" is its next value (Flax's and MaxText's "overwrite with gradient"). The steps take the
largest over micro-batches (its entries are amaxes), keep it whole (its value is the same on every device: the
amaxes are maxima over the batch axes), hand the optimizer a zero in its place, and write it into the parameters
after the update when the step is finite (`is_overwrite`, `apply_update`).

With a `LossScale` (float16 compute) the optimizer state is `{'optimizer': the optimizer's state, 'loss_scale':
{'scale', 'good_steps'}}`: the loss is multiplied by the scale before differentiation, so float16 cotangents that would
underflow to zero stay representable, and the float32 gradients are divided by it before the update.
"""
import dataclasses

import jax
import jax.numpy as jnp
import optax

from kernels.matmul.fp8 import OVERWRITE


def is_overwrite(path):
    """Whether the parameter at key path `path` is overwritten with its gradient (`OVERWRITE`, see the module)."""
    return bool(path) and getattr(path[-1], "key", None) == OVERWRITE


def overwrite_tree(tree):
    """A tree of bools of `tree`'s structure (None leaves kept): True at the `is_overwrite` leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_overwrite(p), tree)


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
    """`tree`'s floating leaves in `dtype` (None: unchanged), but the `is_overwrite` ones, which stay float32."""
    if dtype is None:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and not is_overwrite(p) else x, tree)


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


def checked_user_gradients(out, params, trainable=None):
    """`grad_fn`'s output -> ((fp32 loss, fp32 metrics), the gradients of the trained leaves of `params` in their
    dtypes, None at the frozen ones), with a one-line error for another structure (raised while tracing)."""
    try:
        (loss, metrics), grads = out
    except (TypeError, ValueError):
        raise ValueError(f"grad_fn returned {type(out).__name__}; expected ((loss, metrics), grads), as "
                         "jax.value_and_grad(f, has_aux=True) returns") from None
    if jax.tree.structure(grads) != jax.tree.structure(params):
        raise ValueError(f"grad_fn returned grads of structure {jax.tree.structure(grads)}; expected the "
                         f"parameters' {jax.tree.structure(params)}")
    trained = partition(params, trainable)[0]
    grads = jax.tree.map(lambda p, g: jnp.asarray(g).astype(p.dtype), trained, partition(grads, trainable)[0])
    loss, metrics = split_loss((loss, {} if metrics is None else metrics))
    return (jnp.asarray(loss, jnp.float32), jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)), grads


def trained_user_grad_fn(grad_fn, compute_dtype, frozen, trainable):
    """A Trainer's `grad_fn` in `trained_grad_fn`'s place: called on the whole parameters in `compute_dtype`, its
    gradients kept for the trained leaves, in their master dtypes."""
    def value_and_grad(trained, batch, rng):
        params = combine(trained, frozen, trainable)
        return checked_user_gradients(grad_fn(cast_floating(params, compute_dtype), batch, rng), params, trainable)
    return value_and_grad


def accumulate_gradients(grad_fn, params, batch, rng, accumulate, constrain=lambda g: g, grad_dtype=None,
                         weight_metric=None):
    """Mean loss, metrics and gradients over the `accumulate` micro-batches of `batch`, in one `lax.scan`; the running
    sum is passed through `constrain` (its sharding) after every micro-batch. The gradients, the running sum included,
    are held in `grad_dtype` (None: the running sum in fp32, the mean in the parameters' dtypes); an `is_overwrite`
    leaf's are the largest over the micro-batches, in float32.

    weight_metric: None (each micro-batch counts equally), or the metric of `grad_fn` holding what its loss is a mean
    over (e.g. 'tokens'): the micro-batches are then weighed by it, so that the step's loss, gradients and other
    metrics are the whole batch's mean however it is cut into micro-batches (that metric itself stays a mean per
    micro-batch)."""
    if accumulate == 1:
        (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch), jax.random.fold_in(rng, 0))
        return loss, metrics, constrain(cast_floating(grads, grad_dtype))
    overwrite = overwrite_tree(params)

    def body(carry, xs):
        micro_batch, i = xs
        (loss, metrics), g = grad_fn(params, micro_batch, jax.random.fold_in(rng, i))
        acc_g, acc_loss, acc_m, acc_w = carry
        w = micro_weight(metrics, weight_metric)
        acc_g = constrain(jax.tree.map(lambda a, b, o: jnp.maximum(a, b) if o else a + (b * w).astype(a.dtype),
                                       acc_g, g, overwrite))
        metrics = scaled_metrics(metrics, w, weight_metric)
        return (acc_g, acc_loss + loss * w, jax.tree.map(jnp.add, acc_m, metrics), acc_w + w), None

    zeros = constrain(jax.tree.map(lambda p, o: jnp.zeros(p.shape, jnp.float32 if o else grad_dtype or jnp.float32),
                                   params, overwrite))
    (_, metric_shapes), _ = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], batch), rng)
    init = (zeros, jnp.zeros((), jnp.float32),
            jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.promote_types(m.dtype, jnp.float32)), metric_shapes),
            jnp.zeros((), jnp.float32))
    (grads, loss, metrics, total), _ = jax.lax.scan(body, init, (batch, jnp.arange(accumulate)))
    scale = 1.0 / jnp.where(total > 0, total, 1.0)
    grads = jax.tree.map(lambda g, p, o: g if o else (g * scale).astype(grad_dtype or p.dtype), grads, params,
                         overwrite)
    metrics = scaled_metrics(metrics, scale, weight_metric, 1.0 / accumulate)
    return loss * scale, metrics, grads


def scaled_metrics(metrics, scale, weight_metric, own=1.0):
    """`metrics` times `scale`, but `weight_metric`'s own entry times `own`."""
    if weight_metric is None:
        return jax.tree.map(lambda v: v * scale, metrics)
    return {k: jax.tree.map(lambda v: v * (own if k == weight_metric else scale), v) for k, v in metrics.items()}


def weight_metric_of(loss_fn):
    """The metric `loss_fn.weight_metric` names, what its loss is a mean over (e.g. 'tokens'), or None: a loss that
    names none weighs its micro-batches (and a Trainer's evaluation batches) by their rows."""
    return getattr(loss_fn, "weight_metric", None)


def micro_weight(metrics, weight_metric):
    """A micro-batch's weight among the step's: its `weight_metric` (float32, no gradient), or 1 without one."""
    if weight_metric is None:
        return jnp.float32(1.0)
    if weight_metric not in metrics:
        raise ValueError(f"loss_fn.weight_metric={weight_metric!r}, a metric its loss does not return (it returns "
                         f"{sorted(metrics)}); expected the name of the metric its loss is a mean over, e.g. 'tokens'")
    return jax.lax.stop_gradient(metrics[weight_metric]).astype(jnp.float32)


def select_guard(where):
    """`apply_update`'s select= for a step compiled for the platform of `where`, a device or a mesh (its first
    device's; None or an abstract mesh: False): True on TPU and GPU."""
    device = where.devices.flat[0] if isinstance(where, jax.sharding.Mesh) else where
    return getattr(device, "platform", None) in ("tpu", "gpu")


def apply_update(optimizer, params, opt_state, grads, loss, metrics, loss_scale=None, select=False):
    """The optimizer update, applied only when loss and gradient norm are finite; returns (params, opt_state, metrics).
    An `is_overwrite` parameter takes its gradient as its new value when the step is finite (the optimizer is handed
    a zero for it, so its norm and moments leave the others alone); otherwise the update is `_update`'s."""
    overwrite = overwrite_tree(params)
    if not any(jax.tree.leaves(overwrite)):
        return _update(optimizer, params, opt_state, grads, loss, metrics, loss_scale, select)
    values = jax.tree.map(lambda g, o: g if o else None, grads, overwrite)
    grads = jax.tree.map(lambda g, o: jnp.zeros_like(g) if o else g, grads, overwrite)
    new, opt_state, metrics = _update(optimizer, params, opt_state, grads, loss, metrics, loss_scale, select)
    keep = metrics["finite"] & jnp.all(jnp.stack([jnp.isfinite(v).all() for v in jax.tree.leaves(values)]))
    new = jax.tree.map(lambda n, p, v, o: jnp.where(keep, v.astype(p.dtype), p) if o else n, new, params, values,
                       overwrite, is_leaf=lambda x: x is None)
    return new, opt_state, metrics


def _update(optimizer, params, opt_state, grads, loss, metrics, loss_scale=None, select=False):
    """`apply_update` of weights only.

    How the guard keeps the update in place in the donated buffers depends on the compiler, so the step says which
    (`select_guard`). By default (XLA:CPU) a `lax.cond` around the whole update: a `where` on its result keeps old
    and new state alive together there (LLaMA-7B on 8 devices: 3.2 GB more per device). select=True (XLA:TPU and
    XLA:GPU): a `where` on each new leaf, fused into the leaf's element-wise update. XLA:TPU lays the multi-output
    fusion inside a conditional's branch out row-major and copies every column-major parameter, moment and gradient
    into it; XLA:GPU cannot fuse across the conditional's boundary, so the gradients' widening to float32 and the
    global norm's reads were a pass of their own that wrote float32 gradients (the engine guide has the figures).
    loss_scale: the `LossScale` the gradients were computed under (they are unscaled here, and the scale moves on;
    metrics['loss_scale'] is this step's). Gradients held in a narrower dtype than their parameters
    (`Precision.grad_dtype`) are widened to it first, inside the update's fusions."""
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype) if g.dtype != p.dtype else g, grads, params)
    if loss_scale is not None:
        state, opt_state = opt_state["loss_scale"], opt_state["optimizer"]
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / state["scale"]).astype(g.dtype), grads)
        params, opt_state, metrics = _update(optimizer, params, opt_state, grads, loss, metrics, select=select)
        metrics["loss_scale"] = state["scale"]
        return params, {"optimizer": opt_state, "loss_scale": loss_scale.next(state, metrics["finite"])}, metrics
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(state):
        params, opt_state, grads = state
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    if select:
        new = update((params, opt_state, grads))
        new_params, new_opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (params, opt_state))
    else:
        new_params, new_opt_state = jax.lax.cond(finite, update, lambda state: state[:2], (params, opt_state, grads))
    out = {"loss": loss, "grad_norm": grad_norm, "finite": finite, **metrics}
    lr = find_learning_rate(new_opt_state)
    if lr is not None:
        out["learning_rate"] = lr
    return new_params, new_opt_state, out
