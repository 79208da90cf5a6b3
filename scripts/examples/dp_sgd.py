"""DP-SGD (Abadi et al. 2016) on a small classifier, with the engine's `grad_fn`.

Every example's gradient is clipped to L2 norm <= C before the batch is averaged, and Gaussian noise of standard
deviation sigma * C / B (B: the global batch) is added once per update. Clipping is a rule on single examples, so
it goes in `grad_fn` (the engine calls it on the rows a step gives it and averages the results over devices); the
noise acts on the averaged gradient, so it goes in the optax chain, where every device draws the same noise.
RedCoast's version (examples/differential_private_training) replaces its whole train step instead and takes
MNIST; the privacy accounting (epsilon for a given sigma) is left to a library such as dp_accounting.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/examples/dp_sgd.py
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import engine

N_CLASSES, DIM = 4, 16


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):  # [B, DIM] -> logits [B, N_CLASSES]
        return nn.Dense(N_CLASSES)(nn.relu(nn.Dense(32)(x)))


MODEL = MLP()


def make_examples(n, seed):
    """Gaussian blobs that overlap: one fixed centre per class (the same for every seed), unit noise around it."""
    centres = 0.4 * np.random.RandomState(0).randn(N_CLASSES, DIM).astype(np.float32)
    rs = np.random.RandomState(seed)
    labels = rs.randint(N_CLASSES, size=n)
    points = centres[labels] + rs.randn(n, DIM).astype(np.float32)
    return [{"x": x, "y": y} for x, y in zip(points, labels)]


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples], np.int32)}


def loss_fn(params, batch, rng, is_training):  # the eval loss; training differentiates through grad_fn
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def pred_fn(params, batch, rng):
    return MODEL.apply({"params": params}, batch["x"]).argmax(-1)


def clipped_grads(params, batch, clip):
    """Per-example losses [B], gradients (each leaf [B, ...]) with every example's scaled to norm <= clip, and the
    norms before clipping [B]."""
    def one(p, x, y):  # the loss of a single example: vmap gives each its own gradient
        return optax.softmax_cross_entropy_with_integer_labels(MODEL.apply({"params": p}, x[None]), y[None])[0]

    losses, grads = jax.vmap(jax.value_and_grad(one), in_axes=(None, 0, 0))(params, batch["x"], batch["y"])
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(losses), -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, clip / (norms + 1e-12))
    return losses, jax.tree.map(lambda g: g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), grads), norms


def grad_fn(params, batch, rng, clip):
    losses, grads, norms = clipped_grads(params, batch, clip)
    # The mean over these rows; the engine's mean over devices then makes it sum(clipped) / B.
    return (losses.mean(), {"clipped_fraction": jnp.mean(norms > clip)}), jax.tree.map(lambda g: g.mean(0), grads)


def make_trainer(mesh, *, clip, sigma, global_batch, learning_rate, step="auto", seed=0):
    params = MODEL.init(jax.random.key(seed), np.zeros((1, DIM), np.float32))["params"]
    # Noise on the averaged gradient: std sigma * clip / B per coordinate (optax's eta is the variance).
    optimizer = optax.chain(optax.add_noise(eta=(sigma * clip / global_batch) ** 2, gamma=0.0, key=seed),
                            optax.sgd(learning_rate))
    return engine.Trainer(mesh=mesh, collate_fn=collate_fn, loss_fn=loss_fn, params=params, optimizer=optimizer,
                          grad_fn=functools.partial(grad_fn, clip=clip), seed=seed,
                          parallelism=engine.Parallelism(step=step))


def accuracy(examples, preds):
    return {"accuracy": float(np.mean(np.array(preds) == np.array([e["y"] for e in examples])))}


def run(*, mesh=None, n_epochs=4, n_train=2048, per_device_batch_size=8, clip=1.0, sigma=1.0, learning_rate=0.5,
        step="auto", seed=0):
    """Trains with DP-SGD; returns the test accuracy before training and after each epoch, the share of examples
    whose gradient was clipped, and the Trainer."""
    mesh = mesh or engine.make_mesh(data=-1)
    global_batch = engine.global_batch_size(mesh, per_device_batch_size)
    trainer = make_trainer(mesh, clip=clip, sigma=sigma, global_batch=global_batch, learning_rate=learning_rate,
                           step=step, seed=seed)
    predictor = engine.Predictor(mesh=mesh, collate_fn=collate_fn, pred_fn=pred_fn)
    train, test = make_examples(n_train, seed=1), make_examples(512, seed=2)
    before = accuracy(test, predictor.predict(test, per_device_batch_size=64, params=trainer.params))["accuracy"]
    trainer.fit(train, per_device_batch_size=per_device_batch_size, n_epochs=n_epochs, eval_examples=test,
                eval_per_device_batch_size=64, eval_predictor=predictor, eval_metric_fn=accuracy)
    after = [h["eval_accuracy"] for h in trainer.history if "eval_accuracy" in h]
    clipped = np.mean([h["clipped_fraction"] for h in trainer.history if "clipped_fraction" in h])
    return {"accuracy_before": before, "accuracy": after, "clipped_fraction": float(clipped), "trainer": trainer}


def noise_norm(*, mesh=None, sigma=1.0, clip=1.0, per_device_batch_size=8, step="auto"):
    """The norm of the noise one update adds, measured through the engine: the same first update (same data, same
    seed) with and without noise, under SGD with learning rate 1, differ by exactly the noise. Returns it and
    sigma * clip / B * sqrt(number of parameters), its expected value."""
    mesh = mesh or engine.make_mesh(data=-1)
    global_batch = engine.global_batch_size(mesh, per_device_batch_size)
    updated = []
    for s in (sigma, 0.0):
        trainer = make_trainer(mesh, clip=clip, sigma=s, global_batch=global_batch, learning_rate=1.0, step=step)
        trainer.fit(make_examples(global_batch, seed=1), per_device_batch_size=per_device_batch_size, max_steps=1)
        updated.append(jax.device_get(trainer.params))
    diff = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, *updated))
    size = sum(d.size for d in diff)
    return float(np.sqrt(sum(np.sum(d ** 2) for d in diff))), sigma * clip / global_batch * np.sqrt(size)


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    result = run()
    measured, expected = noise_norm()
    print(f"test accuracy before training {result['accuracy_before']:.3f} (chance {1 / N_CLASSES:.2f})")
    for epoch, acc in enumerate(result["accuracy"]):
        print(f"epoch {epoch + 1}: test accuracy {acc:.3f}")
    print(f"examples clipped: {result['clipped_fraction']:.2f}; noise norm of one update {measured:.4f} "
          f"(sigma C / B sqrt(d) = {expected:.4f})")
