"""MAML (Finn et al. 2017) on sinusoid regression.

A task is a sine wave y = A sin(x - phase) with its own amplitude and phase; a few points of it (`train`) adapt
the model by gradient steps, and the adapted model is scored on other points of the same wave (`val`). MAML
learns the initial parameters from which those few steps go furthest: the outer loss differentiates through the
inner steps. A batch is a pytree `{'train': {'x', 'y'}, 'val': {'x', 'y'}}` with one row per task; the inner loop
is plain `jax.grad` inside `loss_fn`, vmapped over the tasks; tasks are drawn afresh each epoch
(`train_examples=lambda epoch: ...`). RedCoast's version (examples/meta_learning) does the same on Omniglot
through learn2learn.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/examples/maml.py
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import engine

SHOTS = 10  # points per task to adapt on, and as many to score the adapted model on


class Regressor(nn.Module):
    """x [n, 1] -> y [n, 1]: Finn et al.'s two hidden layers of 40."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(40)(x))
        x = nn.relu(nn.Dense(40)(x))
        return nn.Dense(1)(x)


MODEL = Regressor()


def sample_tasks(n_tasks, seed):
    """n_tasks sine waves (amplitude in [0.1, 5], phase in [0, pi]), each with 2 x SHOTS points in [-5, 5]."""
    rs = np.random.RandomState(seed)
    tasks = []
    for amplitude, phase in zip(rs.uniform(0.1, 5.0, n_tasks), rs.uniform(0, np.pi, n_tasks)):
        x = rs.uniform(-5, 5, (2, SHOTS, 1)).astype(np.float32)
        y = (amplitude * np.sin(x - phase)).astype(np.float32)
        tasks.append({"train": {"x": x[0], "y": y[0]}, "val": {"x": x[1], "y": y[1]}})
    return tasks


def collate_fn(tasks):  # the same pytree as one task, each leaf stacked to [n_tasks, SHOTS, 1]
    return jax.tree.map(lambda *leaves: np.stack(leaves), *tasks)


def mse(params, points):
    return jnp.mean((MODEL.apply({"params": params}, points["x"]) - points["y"]) ** 2)


def adapt(params, points, inner_lr, inner_steps):
    """The inner loop: plain gradient descent on one task's `train` points, differentiable end to end."""
    for _ in range(inner_steps):
        params = jax.tree.map(lambda p, g: p - inner_lr * g, params, jax.grad(mse)(params, points))
    return params


def loss_fn(params, batch, rng, is_training, inner_lr, inner_steps):
    """The outer loss: each task's `val` error after adapting on its `train` points, averaged over the tasks."""
    one_task = lambda task: mse(adapt(params, task["train"], inner_lr, inner_steps), task["val"])  # noqa: E731
    return jnp.mean(jax.vmap(one_task)(batch))


def pred_fn(params, batch, rng, inner_lr, inner_steps):
    """Per task: the `val` error of the model as it is and after adapting on the task's `train` points."""
    def one_task(task):
        return {"unadapted": mse(params, task["val"]),
                "adapted": mse(adapt(params, task["train"], inner_lr, inner_steps), task["val"])}
    return jax.vmap(one_task)(batch)


def mean_errors(tasks, preds):
    return {kind: float(np.mean([p[kind] for p in preds])) for kind in ("unadapted", "adapted")}


def run(*, mesh=None, n_epochs=10, tasks_per_epoch=1024, per_device_batch_size=2, inner_lr=0.01, inner_steps=1,
        learning_rate=1e-2, seed=0):
    """Meta-trains; returns the held-out tasks' val errors (unadapted and adapted) before training and after each
    epoch, and the Trainer."""
    mesh = mesh or engine.make_mesh(data=-1)
    inner = dict(inner_lr=inner_lr, inner_steps=inner_steps)
    params = MODEL.init(jax.random.key(seed), np.zeros((1, 1), np.float32))["params"]
    trainer = engine.Trainer(mesh=mesh, collate_fn=collate_fn, loss_fn=functools.partial(loss_fn, **inner),
                             params=params, optimizer=optax.adam(learning_rate), seed=seed)
    predictor = engine.Predictor(mesh=mesh, collate_fn=collate_fn, pred_fn=functools.partial(pred_fn, **inner))
    held_out = sample_tasks(256, seed=10 ** 6)  # seeds below are the training epochs'
    before = mean_errors(held_out, predictor.predict(held_out, per_device_batch_size=32, params=params))
    trainer.fit(lambda epoch: sample_tasks(tasks_per_epoch, seed=epoch), per_device_batch_size=per_device_batch_size,
                n_epochs=n_epochs, eval_examples=held_out, eval_per_device_batch_size=32, eval_predictor=predictor,
                eval_metric_fn=mean_errors)
    evals = [{kind: h[f"eval_{kind}"] for kind in ("unadapted", "adapted")} for h in trainer.history
             if "eval_adapted" in h]
    return {"before": before, "epochs": evals, "trainer": trainer}


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    result = run()
    print("epoch  val MSE unadapted  val MSE adapted (1 step on 10 points)")
    for epoch, errors in enumerate([result["before"]] + result["epochs"]):
        print(f"{epoch:5d}  {errors['unadapted']:17.3f}  {errors['adapted']:20.3f}")
