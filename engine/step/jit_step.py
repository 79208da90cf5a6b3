"""The reference train step (`jit_train_step`): plain `jax.jit` semantics, the compiler partitions everything."""
import jax

from engine.step.update import (accumulate_gradients, apply_update, combine, current_loss_scale, partition,
                                trained_grad_fn)


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
