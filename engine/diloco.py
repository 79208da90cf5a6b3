"""DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"): data
parallelism that communicates across the mesh's `data` axis once every `inner_steps` steps instead of every step.

Each position along `data` (a host, a pod, a weakly connected site) keeps its own replica of the parameters and its
own inner optimizer state: a leading [replicas] dimension split over `data`, while `fsdp` and `model` still split each
replica as usual. Every step, every replica takes an inner optimizer step on its own rows of the global batch, with no
collective over `data` (per-replica metrics too are averaged on the host). Every `inner_steps` steps the outer step
averages what the replicas travelled, the outer gradient `global - mean(replicas)` (one all-reduce of the
parameters over `data`), applies the outer optimizer to the global parameters and resets every replica to them. The
paper's outer optimizer, SGD with Nesterov momentum 0.9 and learning rate 0.7, is the default. With `inner_steps=1`,
an SGD inner optimizer and `optax.sgd(1.0)` outside it is plain data parallelism (tests/test_diloco.py).

`Trainer(diloco=DiLoCo(...))` uses it: `trainer.params` is the global model (updated every `inner_steps` steps), and
the replicas and both optimizer states make up `trainer.opt_state` and the checkpoints.
"""
import dataclasses

import jax
import jax.numpy as jnp
import optax

from engine.step import accumulate_gradients, apply_update, combine, partition, trained_grad_fn


def _paper_outer_optimizer():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """inner_steps: steps between two outer steps (the paper: 500). outer_optimizer: applied to the outer gradient
    `global - mean(replicas)` every inner_steps steps."""

    inner_steps: int = 500
    outer_optimizer: optax.GradientTransformation = dataclasses.field(default_factory=_paper_outer_optimizer)

    def __post_init__(self):
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"DiLoCo.inner_steps={self.inner_steps!r}; expected an integer >= 1")
        if not (hasattr(self.outer_optimizer, "init") and hasattr(self.outer_optimizer, "update")):
            raise ValueError(f"DiLoCo.outer_optimizer={self.outer_optimizer!r}; expected an "
                             "optax.GradientTransformation")


def replicate(tree, replicas):
    """Each leaf broadcast to a leading [replicas] dimension."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas,) + x.shape), tree)


def init_state(diloco, optimizer, params, replicas):
    """{'replicas': params [R, ...], 'inner': the inner optimizer's state per replica, 'outer': the outer
    optimizer's state of the global params}."""
    reps = replicate(params, replicas)
    return {"replicas": reps, "inner": jax.vmap(optimizer.init)(reps), "outer": diloco.outer_optimizer.init(params)}


def diloco_train_step(*, diloco, replicas, loss_fn, optimizer, accumulate, compute_dtype, remat, key,
                      trainable=None):
    """`step(global_params, state, batch, step) -> (global_params, state, metrics)`: one inner step on every replica
    and, when `step + 1` completes a round of inner_steps, the outer step. The batch [accumulate, rows, ...] is split
    into replicas along its data-major rows; every metric is per replica, [R]. trainable: as in
    `engine.step.jit_train_step`; the state (`init_state` of the trained leaves) then replicates only the trained
    parameters, and every replica reads the one copy of the frozen ones."""
    def inner(params, opt_state, batch, rng, frozen):
        grad_fn = trained_grad_fn(loss_fn, compute_dtype, remat, frozen, trainable)
        loss, metrics, grads = accumulate_gradients(grad_fn, params, batch, rng, accumulate)
        return apply_update(optimizer, params, opt_state, grads, loss, metrics)

    def outer(args):
        global_params, reps, outer_state = args
        outer_grads = jax.tree.map(lambda g, r: g - r.mean(0, dtype=jnp.float32).astype(g.dtype), global_params, reps)
        updates, outer_state = diloco.outer_optimizer.update(outer_grads, outer_state, global_params)
        global_params = optax.apply_updates(global_params, updates)
        return global_params, replicate(global_params, replicas), outer_state

    def step(global_params, state, batch, step):
        split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], replicas, x.shape[1] // replicas, *x.shape[2:]), 1, 0)
        rngs = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, step), r))(jnp.arange(replicas))
        global_params, frozen = partition(global_params, trainable)
        reps, inner_state, metrics = jax.vmap(inner, in_axes=(0, 0, 0, 0, None), spmd_axis_name="data")(
            state["replicas"], state["inner"], jax.tree.map(split, batch), rngs, frozen)
        sync = (step + 1) % diloco.inner_steps == 0
        global_params, reps, outer_state = jax.lax.cond(sync, outer, lambda args: args,
                                                        (global_params, reps, state["outer"]))
        return (combine(global_params, frozen, trainable), {"replicas": reps, "inner": inner_state,
                                                            "outer": outer_state}, metrics)

    return step
