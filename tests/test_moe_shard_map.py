"""The shard_map step with `expert` manual beside an automatic `model` (engine/step/shard_map_step.py,
models/layers/moe.py): one SGD step of the tiny Mixtral, Qwen3-MoE and LLaMA on expert x model meshes equals the
step on one device and the jit step on the same mesh; the experts stay split over `expert` and are never gathered
over it."""
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.step_program import choose_step
from engine.tasks import lm
from tests.targets import for_gpu


def _rows(n):
    rng = np.random.RandomState(0)
    return [{"tokens": rng.randint(3, 120, 17).astype(np.int32), "segment_ids": np.ones(17, np.int32)}
            for _ in range(n)]


def _trainer_step(model, params, rows, mesh, step):
    """(the logged metrics, the parameters) after one SGD step (the update is the gradient) through the Trainer."""
    mesh = engine.make_mesh(**mesh)
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model), params=params,
                             optimizer=optax.sgd(1.0), parallelism=engine.Parallelism(step=step))
    assert trainer._step_kind == step
    rows_split = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    trainer.fit(rows, per_device_batch_size=len(rows) // rows_split, max_steps=1, log_every=1)
    return trainer.history[-1], trainer.params


def _check_equals_one_device(model, params, rows, metrics, trained):
    (loss, single), grads = jax.jit(jax.value_and_grad(lm.lm_loss_fn(model), has_aux=True),
                                    static_argnums=(2, 3))(params, lm.collate_lm(rows), None, True)
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5)
    for key in ("load_balancing_loss", "router_z_loss"):
        if key in single:
            assert metrics[key] == pytest.approx(float(single[key]), rel=1e-5), key
    for (path, a), p, g in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(trained))[0],
                               jax.tree.leaves(params), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, p - g, atol=1e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("family, mesh, remat", [
    ("mixtral", dict(data=2, expert=2, model=2), "none"),
    ("mixtral", dict(fsdp=2, expert=2, model=2), "full"),
    ("qwen3_moe", dict(data=2, expert=2, model=2), "none"),
    ("qwen3_moe", dict(fsdp=2, expert=2, model=2), "none"),
])
def test_shard_map_step_on_expert_and_model_equals_one_device_and_the_jit_step(family, mesh, remat):
    """Mixtral and Qwen3-MoE (scanned, every layer sparse) with both router losses weighing in (the load-balancing
    one 25x Mixtral's): the shard_map step's loss, router losses and updated weights equal one device's and the jit
    step's on the same mesh; the experts stay split over `expert`. remat='full' beside fsdp: the hand-pipelined
    layer stack gathers each layer's own experts over fsdp."""
    model = models.create_model(family, "tiny", scan_layers=True, remat=remat, router_aux_loss_coef=0.5,
                                router_z_loss_coef=1e-2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = _rows(8)
    manual, manual_params = _trainer_step(model, params, rows, mesh, "shard_map")
    assert manual_params["layers"]["mlp"]["experts"]["gate"].sharding.spec[1] == "expert"
    grads = _check_equals_one_device(model, params, rows, manual, manual_params)
    assert np.abs(grads["layers"]["mlp"]["experts"]["gate"]).max() > 1e-4
    jit, jit_params = _trainer_step(model, params, rows, mesh, "jit")
    for key in ("loss", "load_balancing_loss", "router_z_loss"):
        assert manual[key] == pytest.approx(jit[key], rel=1e-5), key
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(manual_params))[0],
                            jax.tree.leaves(jax.device_get(jit_params))):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_dense_model_on_expert_model_and_data_equals_one_device():
    """A dense LLaMA's rows split over `expert` like over `data` (every weight replicated over it, its gradient summed
    over it) on data 2 x expert 2 x model 2."""
    model = models.create_model("llama", "tiny", scan_layers=True)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = _rows(8)
    metrics, trained = _trainer_step(model, params, rows, dict(data=2, expert=2, model=2), "shard_map")
    _check_equals_one_device(model, params, rows, metrics, trained)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_shard_map_step_on_expert_and_model_lowers_the_ragged_exchange_for_gpu_and_tpu(platform):
    """The step lowered from this CPU host for cuda or tpu: the MoE layer inside the step's manual `expert` exchanges
    the routed rows alone (ragged all-to-alls: there and back, forward and backward; none of floats padded), for
    both layers of the scanned stack at once."""
    model = models.create_model("mixtral", "tiny", scan_layers=True, mlp_implementation="xla")
    params = models.init_params(model, jax.random.PRNGKey(0))
    trainer = engine.Trainer(mesh=engine.make_mesh(fsdp=2, expert=2, model=2), collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(1.0),
                             parallelism=engine.Parallelism(step="shard_map"))
    batch = {k: jax.ShapeDtypeStruct((1, 8, 16), jnp.int32) for k in ("input_ids", "labels", "segment_ids")}
    target = for_gpu(trainer.mesh) if platform == "cuda" else jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh)
    with target:
        text = trainer.lower(batch, platforms=(platform,)).as_text()
    assert text.count("@ragged_all_to_all") >= 4
    floats = [t for t in re.findall(r'"stablehlo\.all_to_all"\(.*: \((tensor<[^>]*>)\)', text) if "xf32" in t]
    assert not floats, floats


@pytest.mark.parametrize("platform, mesh, step", [
    ("gpu", dict(data=2, expert=2, model=2), "shard_map"),
    ("tpu", dict(fsdp=2, expert=2, model=2), "shard_map"),
    ("cpu", dict(data=2, expert=2, model=2), "jit"),
    ("gpu", dict(data=2, context=2, model=2), "jit"),
])
def test_auto_picks_the_shard_map_step_beside_expert_and_model_on_gpu_and_tpu(platform, mesh, step):
    sizes = dict(dict(data=1, fsdp=1, expert=1, stage=1, context=1, model=1), **mesh)
    fake = types.SimpleNamespace(shape=sizes, devices=np.array([types.SimpleNamespace(platform=platform)]))
    assert choose_step(fake, engine.Precision(), engine.Parallelism(), None) == step


@pytest.mark.parametrize("step", ["jit", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_router_losses_under_gradient_accumulation_are_each_micro_batchs(step):
    """With `accumulate_grad_batches` the router losses are each micro-batch's, weighed like its loss by its tokens
    (Megatron's and transformers' micro-batch level auxiliary loss): a micro-batch's gradient is taken before the
    later ones' statistics exist. One SGD step of the tiny Mixtral on data 2 x expert 2 x model 2, two micro-batches
    of unequal token counts, equals that mean on one device; the whole batch's terms would give another update."""
    from tests import trainer_task as tt
    from tests.test_step import _packed_rows

    model = models.create_model("mixtral", "tiny", router_aux_loss_coef=0.5, router_z_loss_coef=1e-2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = _packed_rows(16, seq=16)
    _, grads = tt.assert_sgd_step_equals_one_device(model, params, rows, engine.make_mesh(data=2, expert=2, model=2),
                                                     step, accumulate=2)
    _, whole = jax.value_and_grad(lm.lm_loss_fn(model), has_aux=True)(params, lm.collate_lm(rows), None, True)
    router = grads["layers_0"]["mlp"]["router"]["kernel"]
    assert np.abs(router - whole["layers_0"]["mlp"]["router"]["kernel"]).max() > 1e-2 * np.abs(router).max()
