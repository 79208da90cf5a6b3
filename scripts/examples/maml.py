"""MAML (Finn et al. 2017): N-way K-shot classification of synthetic classes never seen in meta-training.

A class is a random prototype in a 16-dimensional signal space; each example is its prototype plus noise, next to
48 dimensions of larger nuisance that every class shares, mixed by a fixed random rotation and bent by a fixed
nonlinearity. A task draws N classes and labels them 0..N-1 in a random order, so no initialisation can classify
without adapting (chance is 1/N): K examples per class (`train`) adapt the model by a few gradient steps, and the
adapted model is scored on other examples of the same classes (`val`). MAML learns the initial parameters from which
those steps go furthest: the outer loss differentiates through the inner steps. A batch is a pytree
`{'train': {'x', 'y'}, 'val': {'x', 'y'}}` with one row per task; the inner loop is plain `jax.grad` inside
`loss_fn`, vmapped over the tasks; tasks are drawn afresh each epoch (`train_examples=lambda epoch: ...`) from the
meta-training classes, and scored on tasks of held-out classes. RedCoast's version (examples/meta_learning) does
the same on Omniglot through learn2learn.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/examples/maml.py
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import engine

WAYS, SHOTS, QUERIES = 5, 5, 5  # classes per task; examples per class to adapt on, and to score the adapted model on
SIGNAL, NUISANCE = 16, 48  # dimensions that tell the classes apart, and those that do not
WORLD = np.random.RandomState(0)  # the classes and the distortion, fixed for every seed
PROTOTYPES = WORLD.randn(1200, SIGNAL)
META_TRAIN, HELD_OUT = np.arange(1000), np.arange(1000, 1200)  # disjoint classes
ROTATION = np.linalg.qr(WORLD.randn(SIGNAL + NUISANCE, SIGNAL + NUISANCE))[0]


class Classifier(nn.Module):
    """x [n, SIGNAL + NUISANCE] -> logits [n, WAYS]."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(WAYS)(x)


MODEL = Classifier()


def examples_of(classes, n, rs):
    """n examples of each class: [len(classes) * n, SIGNAL + NUISANCE]."""
    signal = np.repeat(PROTOTYPES[classes], n, axis=0) + 0.5 * rs.randn(len(classes) * n, SIGNAL)
    nuisance = 3.0 * rs.randn(len(classes) * n, NUISANCE)  # nearest class mean on raw shots: 0.33 held out
    x = np.concatenate([signal, nuisance], axis=1) @ ROTATION
    return (x + np.sin(2 * x)).astype(np.float32)


def sample_tasks(n_tasks, seed, classes=META_TRAIN):
    """n_tasks tasks of WAYS classes drawn from `classes`, each labelled 0..WAYS-1 in a new random order."""
    rs = np.random.RandomState(seed)
    tasks = []
    for _ in range(n_tasks):
        chosen = rs.choice(classes, WAYS, replace=False)  # label i is class chosen[i]
        tasks.append({part: {"x": examples_of(chosen, n, rs), "y": np.repeat(np.arange(WAYS, dtype=np.int32), n)}
                      for part, n in (("train", SHOTS), ("val", QUERIES))})
    return tasks


def collate_fn(tasks):  # the same pytree as one task, each leaf stacked to [n_tasks, ...]
    return jax.tree.map(lambda *leaves: np.stack(leaves), *tasks)


def cross_entropy(params, points):
    logits = MODEL.apply({"params": params}, points["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, points["y"]).mean()


def accuracy(params, points):
    return jnp.mean(MODEL.apply({"params": params}, points["x"]).argmax(-1) == points["y"])


def adapt(params, points, inner_lr, inner_steps):
    """The inner loop: plain gradient descent on one task's `train` points, differentiable end to end."""
    for _ in range(inner_steps):
        params = jax.tree.map(lambda p, g: p - inner_lr * g, params, jax.grad(cross_entropy)(params, points))
    return params


def loss_fn(params, batch, rng, is_training, inner_lr, inner_steps):
    """The outer loss: each task's `val` loss after adapting on its `train` points, averaged over the tasks."""
    def one_task(task):
        return cross_entropy(adapt(params, task["train"], inner_lr, inner_steps), task["val"])
    return jnp.mean(jax.vmap(one_task)(batch))


def pred_fn(params, batch, rng, inner_lr, inner_steps):
    """Per task: the `val` accuracy of the model as it is and after adapting on the task's `train` points."""
    def one_task(task):
        return {"unadapted": accuracy(params, task["val"]),
                "adapted": accuracy(adapt(params, task["train"], inner_lr, inner_steps), task["val"])}
    return jax.vmap(one_task)(batch)


def mean_accuracies(tasks, preds):
    return {kind: float(np.mean([p[kind] for p in preds])) for kind in ("unadapted", "adapted")}


def run(*, mesh=None, n_epochs=10, tasks_per_epoch=1024, per_device_batch_size=4, inner_lr=0.1, inner_steps=3,
        learning_rate=3e-3, seed=0):
    """Meta-trains; returns the held-out classes' val accuracies (unadapted and adapted) before training and after
    each epoch, and the Trainer."""
    mesh = mesh or engine.make_mesh(data=-1)
    inner = dict(inner_lr=inner_lr, inner_steps=inner_steps)
    params = MODEL.init(jax.random.key(seed), np.zeros((1, SIGNAL + NUISANCE), np.float32))["params"]
    trainer = engine.Trainer(mesh=mesh, collate_fn=collate_fn, loss_fn=functools.partial(loss_fn, **inner),
                             params=params, optimizer=optax.adam(learning_rate), seed=seed)
    predictor = engine.Predictor(mesh=mesh, collate_fn=collate_fn, pred_fn=functools.partial(pred_fn, **inner))
    held_out = sample_tasks(256, seed=10 ** 6, classes=HELD_OUT)  # seeds below are the training epochs'
    before = mean_accuracies(held_out, predictor.predict(held_out, per_device_batch_size=32, params=params))
    trainer.fit(lambda epoch: sample_tasks(tasks_per_epoch, seed=epoch), per_device_batch_size=per_device_batch_size,
                n_epochs=n_epochs, eval_examples=held_out, eval_per_device_batch_size=32, eval_predictor=predictor,
                eval_metric_fn=mean_accuracies)
    evals = [{kind: h[f"eval_{kind}"] for kind in ("unadapted", "adapted")} for h in trainer.history
             if "eval_adapted" in h]
    return {"before": before, "epochs": evals, "trainer": trainer}


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    result = run()
    print(f"256 tasks of {len(HELD_OUT)} held-out classes, {WAYS}-way {SHOTS}-shot (chance {1 / WAYS:.2f}): "
          f"accuracy on {QUERIES} more examples per class")
    print("epoch  unadapted  adapted (3 inner steps)")
    for epoch, acc in enumerate([result["before"]] + result["epochs"]):
        print(f"{epoch:5d}  {acc['unadapted']:9.3f}  {acc['adapted']:23.3f}")
    print(f"train steps {result['trainer'].step}, compilations of the step {result['trainer'].compile_count}")
