"""Federated averaging (McMahan et al. 2017) on non-IID synthetic clients, with one Trainer.

Each round a few clients are drawn; each starts from the global model with a fresh optimizer (`set_params(...,
reset_optimizer=True)`), trains `local_epochs` on its own data (`fit(n_epochs=...)`), and the server averages what
they return, weighted by their data. The Trainer's step is compiled once for all rounds and clients: every client
batch has the same shapes, and `set_params` places the new parameters on the layout the step was compiled for.
RedCoast's version (examples/faderated_learning) rebuilds its train state per client and takes MNIST split into
label-sorted shards; the clients here get the same kind of split of a synthetic task.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/examples/fedavg.py
"""
import flax.linen as nn
import jax
import numpy as np
import optax

import engine

N_CLASSES, DIM = 10, 16


class MLP(nn.Module):
    widths: tuple = (64, N_CLASSES)

    @nn.compact
    def __call__(self, x):  # [B, DIM] -> logits [B, N_CLASSES]
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


MODEL = MLP()


def make_examples(n, seed):
    """One cluster per class around a fixed random prototype (the same for every seed), unit noise."""
    prototypes = np.random.RandomState(0).uniform(-2, 2, (N_CLASSES, DIM))
    rs = np.random.RandomState(seed)
    return [{"x": (prototypes[y] + rs.randn(DIM)).astype(np.float32), "y": y} for y in rs.randint(N_CLASSES, size=n)]


def split_non_iid(examples, n_clients, shards_per_client, seed):
    """McMahan et al.'s pathological split: sort by label, cut into equal shards, deal each client a few at random,
    so a client sees only a couple of classes."""
    ordered = sorted(examples, key=lambda e: e["y"])
    shards = np.array_split(np.arange(len(ordered)), n_clients * shards_per_client)
    dealt = np.random.RandomState(seed).permutation(len(shards)).reshape(n_clients, shards_per_client)
    return [[ordered[i] for s in client for i in shards[s]] for client in dealt]


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples], np.int32)}


def loss_fn(params, batch, rng, is_training):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def pred_fn(params, batch, rng):  # per example: the predicted class and its loss
    logits = MODEL.apply({"params": params}, batch["x"])
    return {"label": logits.argmax(-1), "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])}


def run(*, mesh=None, n_rounds=10, n_clients=10, clients_per_round=5, local_epochs=2, examples_per_client=64,
        per_device_batch_size=2, learning_rate=1e-2, seed=0):
    """FedAvg; returns the global model's test accuracy and loss before training and after each round, and the
    Trainer."""
    mesh = mesh or engine.make_mesh(data=-1)
    clients = split_non_iid(make_examples(n_clients * examples_per_client, seed=1), n_clients, 2, seed)
    test = make_examples(1024, seed=2)
    global_params = MODEL.init(jax.random.key(seed), np.zeros((1, DIM), np.float32))["params"]
    trainer = engine.Trainer(mesh=mesh, collate_fn=collate_fn, loss_fn=loss_fn, params=global_params,
                             optimizer=optax.adam(learning_rate), seed=seed)
    predictor = engine.Predictor(mesh=mesh, collate_fn=collate_fn, pred_fn=pred_fn)

    def evaluate(params):
        preds = predictor.predict(test, per_device_batch_size=128, params=params)
        return (float(np.mean([p["label"] == e["y"] for p, e in zip(preds, test)])),
                float(np.mean([p["loss"] for p in preds])))

    rounds = [evaluate(global_params)]
    draw = np.random.RandomState(seed)
    for _ in range(n_rounds):
        updates, weights = [], []
        for client in draw.choice(n_clients, clients_per_round, replace=False):
            trainer.set_params(global_params, reset_optimizer=True)  # every client starts from the global model
            trainer.fit(clients[client], per_device_batch_size=per_device_batch_size, n_epochs=local_epochs)
            updates.append(trainer.params)
            weights.append(len(clients[client]))
        global_params = jax.tree.map(lambda *p: sum(w * x for w, x in zip(weights, p)) / sum(weights), *updates)
        rounds.append(evaluate(global_params))
    return {"accuracy": [a for a, _ in rounds], "loss": [l for _, l in rounds], "trainer": trainer}


if __name__ == "__main__":
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    result = run()
    print("round  test accuracy  test loss")
    for i, (acc, loss) in enumerate(zip(result["accuracy"], result["loss"])):
        print(f"{i:5d}  {acc:13.3f}  {loss:9.3f}")
    print(f"train steps {result['trainer'].step}, compilations of the step {result['trainer'].compile_count}")
