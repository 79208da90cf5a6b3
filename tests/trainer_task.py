"""A small learnable language-modelling task shared by the Trainer tests and the 2-process worker: the next token is
the previous one plus one (mod vocab), with a little noise."""
import jax
import numpy as np
import optax

from tests import toy_models as tm

VOCAB, SEQ = 64, 16
MODEL = tm.LlamaLike(vocab=VOCAB, d=32, n_layers=2)


def make_examples(n, seed=0):
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        s = [rs.randint(VOCAB)]
        for _ in range(SEQ):
            s.append((s[-1] + 1) % VOCAB if rs.rand() < 0.9 else rs.randint(VOCAB))
        out.append({"token_ids": s})
    return out


def collate_fn(examples):
    t = np.array([e["token_ids"] for e in examples], np.int32)
    return {"input_ids": t[:, :-1], "labels": t[:, 1:]}


def loss_fn(params, batch, rng, is_training):
    logits = MODEL.apply({"params": params}, batch["input_ids"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), batch["labels"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["labels"]).mean()}


def init_params(seed=0):
    return MODEL.init(jax.random.key(seed), np.zeros((1, SEQ), np.int32))["params"]


def lm_rows(n, length=17, seed=0):
    """n `collate_lm` rows of random tokens, every position valid."""
    rng = np.random.RandomState(seed)
    return [{"tokens": rng.randint(3, 120, length).astype(np.int32), "segment_ids": np.ones(length, np.int32)}
            for _ in range(n)]


def assert_sgd_step_equals_one_device(model, params, rows, mesh, step="auto",
                                      metrics=("load_balancing_loss", "router_z_loss"), implementation=None,
                                      accumulate=1):
    """One SGD step (learning rate 1: the update is the gradient; Adam's first step would amplify rounding in the
    near-zero ones) of `model`'s LM loss (`lm_loss_fn(model, implementation)`) on `rows` (one global batch) through
    the Trainer on `mesh` equals one device's: the loss, `metrics` and every updated weight. With `accumulate` > 1
    the rows are read in order as `accumulate` micro-batches, and one device's results are their mean weighted by
    their tokens (`loss_fn.weight_metric`). Returns (the Trainer, one device's gradients)."""
    import engine  # noqa: PLC0415 (the Trainer tests' task needs none of these)
    import pytest  # noqa: PLC0415
    from engine.tasks import lm  # noqa: PLC0415

    loss_fn = lm.lm_loss_fn(model, implementation)
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=loss_fn, params=params,
                             optimizer=optax.sgd(1.0), parallelism=engine.Parallelism(step=step),
                             accumulate_grad_batches=accumulate)
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    trainer.fit(iter(rows) if accumulate > 1 else rows,  # a stream is read in order: micro-batches as below
                per_device_batch_size=len(rows) // (data_parallel * accumulate), max_steps=1, log_every=1)
    split = trainer.history[-1]
    value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(2, 3))
    micro = len(rows) // accumulate
    runs = [value_and_grad(params, lm.collate_lm(rows[m * micro:(m + 1) * micro]), None, True)
            for m in range(accumulate)]
    weights = np.array([float(single[loss_fn.weight_metric]) if accumulate > 1 else 1.0 for (_, single), _ in runs])
    weights = weights / weights.sum()
    mean = lambda *xs: sum(w * np.asarray(x, np.float64) for w, x in zip(weights, xs))  # noqa: E731
    loss = mean(*(loss for (loss, _), _ in runs))
    single = {key: mean(*(s[key] for (_, s), _ in runs)) for key in metrics}
    grads = jax.tree.map(mean, *(g for _, g in runs))
    assert split["loss"] == pytest.approx(float(loss), rel=1e-5)
    for key in metrics:
        assert split[key] == pytest.approx(float(single[key]), rel=1e-5), key
    for (path, a), p, g in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0],
                               jax.tree.leaves(params), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, p - g, atol=1e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
    return trainer, grads
