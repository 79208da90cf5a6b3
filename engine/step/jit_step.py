"""The reference train step (`jit_train_step`): plain `jax.jit` semantics, the compiler partitions everything."""
import jax

from engine.step.update import (accumulate_gradients, apply_update, combine, current_loss_scale, partition,
                                select_guard, trained_grad_fn, trained_user_grad_fn, weight_metric_of)


def jit_train_step(*, loss_fn, optimizer, grad_shardings, accumulate, compute_dtype, remat, key, trainable=None,
                   loss_scale=None, grad_fn=None, grad_dtype=None):
    """The reference step: plain `jax.jit` semantics, the compiler's partitioner does every collective.
    trainable: None (every parameter trains) or a tree of bools of the parameters' structure; the optimizer state
    and `grad_shardings` then cover the trained leaves only (`partition(...)[0]`), the frozen ones pass through.
    loss_scale: None or a `LossScale` (its state in the optimizer state, see `init_opt_state`).
    grad_fn: None, or the Trainer's `grad_fn(params, micro_batch, rng) -> ((loss, metrics), grads)` in place of
    differentiating `loss_fn` (no loss scale).
    grad_dtype: None or the dtype the gradients are held in until the update (`Precision.grad_dtype`)."""
    constrain = lambda g: jax.tree.map(jax.lax.with_sharding_constraint, g, grad_shardings)  # noqa: E731
    mesh = next((getattr(s, "mesh", None) for s in jax.tree.leaves(grad_shardings)), None)
    select = select_guard(mesh)

    def step(params, opt_state, batch, step):
        rng = jax.random.fold_in(key, step)
        trained, frozen = partition(params, trainable)
        if grad_fn is None:
            value_and_grad = trained_grad_fn(loss_fn, compute_dtype, remat, frozen, trainable,
                                             current_loss_scale(opt_state, loss_scale))
        else:
            value_and_grad = trained_user_grad_fn(grad_fn, compute_dtype, frozen, trainable)
        loss, metrics, grads = accumulate_gradients(value_and_grad, trained, batch, rng, accumulate, constrain,
                                                     grad_dtype, weight_metric_of(loss_fn))
        trained, opt_state, metrics = apply_update(optimizer, trained, opt_state, grads, loss, metrics, loss_scale,
                                                   select)
        return combine(trained, frozen, trainable), opt_state, metrics

    return step
