"""scripts/examples: RedCoast's pipelines written on the public API, each checked to learn measurably."""
import importlib.util
import os

import jax
import numpy as np
import pytest

import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name):
    """scripts/examples/<name>.py as a module (scripts/examples is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "scripts", "examples",
                                                                                  f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ DP-SGD
def test_dp_sgd_clips_each_example_adds_the_noise_once_and_learns():
    dp = _example("dp_sgd")
    mesh = engine.make_mesh(data=-1)
    # (a) The jit and the shard_map step give the same updates, noise included (same seed, same noise).
    params = []
    for step in ("jit", "shard_map"):
        trainer = dp.make_trainer(mesh, clip=0.5, sigma=1.0, global_batch=32, learning_rate=0.5, step=step)
        trainer.fit(dp.make_examples(160, seed=1), per_device_batch_size=4, max_steps=5)
        params.append(jax.device_get(trainer.params))
    for a, b in zip(*map(jax.tree.leaves, params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # (b) Every per-example gradient leaves clipping with norm <= C, and some were longer before.
    batch = dp.collate_fn(dp.make_examples(64, seed=3))
    _, clipped, norms = dp.clipped_grads(params[0], batch, 0.1)
    clipped_norms = np.sqrt(sum(np.sum(np.reshape(g, (64, -1)) ** 2, axis=1) for g in jax.tree.leaves(clipped)))
    assert clipped_norms.max() <= 0.1 * (1 + 1e-5) and (np.asarray(norms) > 0.1).any()
    # (c) The noise one update adds has norm sigma C / B sqrt(d): drawn once for the global batch, on either step.
    for step in ("jit", "shard_map"):
        measured, expected = dp.noise_norm(mesh=mesh, sigma=2.0, clip=0.5, step=step)
        assert measured == pytest.approx(expected, rel=0.1), step
    # (d) It learns: test accuracy well above chance.
    result = dp.run(mesh=mesh, n_epochs=2)
    assert result["accuracy_before"] < 0.4 and result["accuracy"][-1] > 0.6, result
    assert result["trainer"].compile_count == 1


# ------------------------------------------------------------------------------------------ FedAvg
def test_fedavg_improves_the_global_model_with_one_compiled_step():
    result = _example("fedavg").run(n_rounds=8)
    accuracy, loss = result["accuracy"], result["loss"]
    assert accuracy[-1] > accuracy[0] + 0.4 and loss[-1] < 0.5 * loss[0], result
    assert np.mean(accuracy[-3:]) > np.mean(accuracy[1:4]), result  # still improving after the first rounds
    trainer = result["trainer"]
    assert trainer.step == 8 * 5 * 2 * 4  # rounds x clients x local epochs x updates per epoch: every fit trained
    assert trainer.compile_count == 1  # every round and client reused the one compiled step


# ------------------------------------------------------------------------------------------ MAML
def test_maml_adapts_to_held_out_classes_well_above_chance():
    maml = _example("maml")
    result = maml.run(n_epochs=6, tasks_per_epoch=1024)
    before, last, chance = result["before"], result["epochs"][-1], 1 / maml.WAYS
    # Labels are permuted per task, so without adapting even the meta-trained model is at chance; from a random
    # initialisation the inner steps barely help (the classes hide among larger nuisance dimensions).
    assert abs(last["unadapted"] - chance) < 0.05 and before["adapted"] < 0.4, result
    # Meta-trained, the same inner steps on 5 shots classify held-out classes well above chance.
    assert last["adapted"] >= max(0.6, 2.5 * chance), result
    assert last["adapted"] > before["adapted"] + 0.3 and last["adapted"] > last["unadapted"] + 0.3, result
    assert result["trainer"].step == 6 * 1024 // 32 and result["trainer"].compile_count == 1


# ------------------------------------------------------------------------------------------ PPO
def test_ppo_raises_the_return_and_every_fit_trains():
    result = _example("ppo_control").run(n_iterations=10)
    returns, steps = result["returns"], result["steps"]
    assert np.mean(returns[-2:]) > max(100.0, 4 * returns[0]), returns  # a random policy lasts ~20 steps
    assert all(b > a for a, b in zip([0] + steps, steps)), steps  # fit(n_epochs=4) trained on every call
    assert result["trainer"].compile_count == 1  # however many transitions an iteration brought
