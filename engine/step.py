"""Train-step bodies: `step(params, opt_state, batch, step) -> (params, opt_state, metrics)`, to be wrapped in
`jax.jit` by the Trainer with the parameter / optimizer-state / batch shardings.

`batch` leaves are `[accumulate, global_micro_batch, ...]`; `step` is the int32 update number (the per-step rng is
`fold_in(key, step)`, micro-batch i uses `fold_in(that, i)`). A non-finite loss or gradient norm leaves params and
optimizer state unchanged; `metrics['finite']` tells the Trainer.
"""
import jax
import jax.numpy as jnp
import optax


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


def apply_update(optimizer, params, opt_state, grads, loss, metrics):
    """The optimizer update, kept only when loss and gradient norm are finite; returns (params, opt_state, metrics)."""
    grad_norm = optax.global_norm(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
    out = {"loss": loss, "grad_norm": grad_norm, "finite": finite, **metrics}
    lr = find_learning_rate(new_opt_state)
    if lr is not None:
        out["learning_rate"] = lr
    return new_params, new_opt_state, out


def jit_train_step(*, loss_fn, optimizer, grad_shardings, accumulate, compute_dtype, remat, key):
    """The reference step: plain `jax.jit` semantics, the compiler's partitioner does every collective."""
    micro_loss = micro_loss_fn(loss_fn, compute_dtype)
    grad_fn = jax.value_and_grad(jax.checkpoint(micro_loss) if remat else micro_loss, has_aux=True)
    constrain = lambda g: jax.lax.with_sharding_constraint(g, grad_shardings)  # noqa: E731

    def step(params, opt_state, batch, step):
        rng = jax.random.fold_in(key, step)
        loss, metrics, grads = accumulate_gradients(grad_fn, params, batch, rng, accumulate, constrain)
        return apply_update(optimizer, params, opt_state, grads, loss, metrics)

    return step
