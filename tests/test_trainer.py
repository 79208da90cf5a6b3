"""engine.Trainer and engine.Predictor on the 8 simulated devices."""
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import logging
from jax.sharding import PartitionSpec as P

import engine
from engine import fit_loop
from tests import trainer_task as task
from tests.test_distributed import ROOT, _free_port, _worker
from tests.xla_flags import cpu_devices

EXAMPLES = task.make_examples(64)


def _trainer(mesh=None, **kwargs):
    kwargs.setdefault("optimizer", optax.adam(1e-2))
    kwargs.setdefault("loss_fn", task.loss_fn)
    return engine.Trainer(mesh=mesh or engine.make_mesh(data=4, model=2), collate_fn=task.collate_fn,
                          params=task.init_params(), **kwargs)


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(_host(a))[0], jax.tree.leaves(_host(b))):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_loss_decreases_and_one_compile(monkeypatch):
    trainer = _trainer(logging=engine.Logging(flops_per_example=3e9))
    assert trainer.compiled_step() is None
    logged, info = [], logging.info  # absl's own verbosity may differ from test to test: record the calls
    monkeypatch.setattr(logging, "info", lambda msg, *args, **kw: logged.append(msg % args) or info(msg, *args, **kw))
    history = trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=3, log_every=4, eval_examples=EXAMPLES[:10])
    # Compiled before the first step, its memory per device logged: what it holds at once, donated state once.
    memory = engine.plan.memory_per_device(trainer.compiled_step())
    assert memory["total"] == memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
    assert 0 < memory["aliased"] <= memory["arguments"]
    (line,) = [m for m in logged if "train step (step=" in m]
    assert re.match(rf"train step \(step={trainer._step_kind}\) (compiled|loaded from the compilation cache) in "
                    rf"[0-9.]+ s: {memory['total'] / 1e6:.2f} MB per device \(arguments ", line), line
    # The latest log line's figures: model FLOP/s per device from flops_per_example; no MFU on CPU (no known peak).
    rate = trainer.throughput["examples_per_second"]
    assert rate > 0 and trainer.throughput["mfu"] is None
    assert trainer.throughput["model_tflops_per_device"] == pytest.approx(rate * 3e9 / 8 / 1e12)
    losses = [h["loss"] for h in history if "loss" in h]
    assert trainer.step == 3 * (64 // 8) and len(losses) == trainer.step
    assert np.mean(losses[-4:]) < 0.75 * np.mean(losses[:4]), losses
    assert trainer.compile_count == 1  # three epochs and evals: one train-step compilation
    assert [h for h in history if "eval_loss" in h][-1]["eval_loss"] < losses[0]
    spec = trainer.params["layers_0"]["down_proj"]["kernel"].sharding.spec
    assert spec == P("model")


def test_a_step_that_does_not_fit_the_device_is_refused_before_it_runs(monkeypatch):
    """The device's own limit (`memory_stats()['bytes_limit']` on GPU and TPU; CPUs report none) is checked against
    the compiled step's memory before the first step: one clear error instead of XLA's failed allocation."""
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    assert engine.plan.device_memory_bytes(jax.devices()[0]) is None  # CPU
    assert engine.plan.device_memory_bytes(Device({"bytes_limit": 5, "bytes_in_use": 1})) == 5
    assert engine.plan.device_memory_bytes(Device(None)) is None
    assert engine.plan.device_memory_bytes(Device(NotImplementedError())) is None
    monkeypatch.setattr(engine.plan, "device_memory_bytes", lambda device: 100_000)
    trainer = _trainer()
    with pytest.raises(ValueError, match=r"^the train step needs 0\.\d\d MB per device \(arguments .* but a cpu "
                                         r"holds 0\.10 MB; expected a layout that fits: a larger fsdp or zero_stage"):
        trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    assert trainer.step == 0 and not trainer.history
    # its device figures may count the host-resident state: a warning
    offloaded = _trainer(parallelism=engine.Parallelism(offload_optimizer=True))
    offloaded.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)
    assert offloaded.step == 1
    monkeypatch.setattr(engine.plan, "device_memory_bytes", lambda device: 10**9)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)  # the same Trainer, on a device that holds it
    assert trainer.step == 2


def test_accumulation_equals_large_batch():
    """4 micro-batches of 2 give the update of one batch of 8 (mesh data=2, model=4)."""
    mesh = engine.make_mesh(data=2, model=4)
    sgd = optax.sgd(0.5)
    a = _trainer(mesh, optimizer=sgd, accumulate_grad_batches=4)
    a.fit(EXAMPLES, per_device_batch_size=1, max_steps=2)
    b = _trainer(mesh, optimizer=sgd)
    b.fit(EXAMPLES, per_device_batch_size=4, max_steps=2)
    _assert_trees_close(a.params, b.params)
    np.testing.assert_allclose([h["loss"] for h in a.history], [h["loss"] for h in b.history], rtol=1e-6)


@pytest.mark.parametrize("step", ["jit", "shard_map", pytest.param("diloco", marks=pytest.mark.slow)])
def test_accumulating_a_token_mean_equals_the_large_batch(step):
    """A loss that is a mean over tokens (`weight_metric='tokens'`) on rows of unequal token counts: 2 micro-batches
    of 4 rows give one batch of 8's loss, metrics and update, as 4 shards of 2 rows do (each micro-batch weighed by
    its tokens, as the shards are; a mean of the micro-batches' means was 1e-3 off in the loss, 8e-3 in a weight).
    The jit and shard_map steps, and DiLoCo's inner steps."""
    import models  # noqa: PLC0415
    from engine.tasks import lm  # noqa: PLC0415

    model = models.create_model("llama", "tiny", num_layers=2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = task.lm_rows(8)
    rows[0]["segment_ids"][2:] = 0  # one row of 2 tokens among rows of 17: its micro-batch has fewer

    def fit(accumulate, mesh):
        kwargs = {"diloco": engine.DiLoCo(inner_steps=1)} if step == "diloco" else {
            "parallelism": engine.Parallelism(step=step)}
        trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model), params=params,
                                 optimizer=optax.sgd(1.0), accumulate_grad_batches=accumulate, **kwargs)
        trainer.fit(rows, per_device_batch_size=8 // accumulate // mesh.shape["data"], max_steps=1, log_every=1)
        return trainer

    one = fit(1, engine.make_mesh(data=1, devices=jax.devices()[:1]))
    # DiLoCo's replicas over `data` train apart: its case is one replica (an outer step after each inner one)
    for accumulate, data in ((2, 1),) if step == "diloco" else ((2, 1), (2, 2), (1, 4)):
        got = fit(accumulate, engine.make_mesh(data=data, devices=jax.devices()[:data]))
        for key in ("loss", "accuracy", "tokens"):
            want = one.history[-1][key] / (accumulate if key == "tokens" else 1)
            assert got.history[-1][key] == pytest.approx(want, rel=1e-5), (accumulate, data, key)
        _assert_trees_close(got.params, one.params)


def test_eval_loss_is_one_batchs_whatever_the_batch_size_and_padding():
    """`eval_loss` of a token mean over rows of unequal token counts equals the loss of one batch holding them all,
    at any eval batch size and device count: each batch weighed by its tokens, and the last batch's padding (copies
    of its last row) taken out. Also for a stream, and for a loss without a weight_metric (a mean over rows). Weighed
    by rows with the copies left in, the token mean was up to 3.5e-4 off here (a random model's token losses are
    alike) and the row mean 2.4 % to 6.1 %."""
    import models  # noqa: PLC0415
    from engine.tasks import lm  # noqa: PLC0415

    model = models.create_model("llama", "tiny", num_layers=1)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = task.lm_rows(11)
    for i, n in ((0, 2), (5, 4), (10, 9)):  # the last row, which the padding copies, has fewer tokens
        rows[i]["segment_ids"][n:] = 0
    token_mean = lm.lm_loss_fn(model)

    def row_mean(params, batch, rng, train):  # a mean over rows of each row's token count
        return jnp.mean(batch["segment_ids"].sum(-1).astype(jnp.float32))

    for loss_fn in (token_mean, row_mean):
        want = float(jax.jit(lambda p, b, f=loss_fn: engine.step.split_loss(f(p, b, None, False))[0])(
            params, lm.collate_lm(rows)))
        for devices, size in ((1, 4), (4, 2), (2, 3), (8, 1)):
            trainer = engine.Trainer(mesh=engine.make_mesh(data=devices, devices=jax.devices()[:devices]),
                                     collate_fn=lm.collate_lm, loss_fn=loss_fn, params=params,
                                     optimizer=optax.sgd(1.0))
            assert trainer.eval_loss(rows, per_device_batch_size=size) == pytest.approx(want, rel=1e-5), (devices, size)
            if (devices, size) == (4, 2):
                assert trainer.eval_loss(iter(rows), per_device_batch_size=size) == pytest.approx(want, rel=1e-5)


def test_schedule_counts_updates_not_micro_batches():
    """With accumulation 4 the schedule still reaches its end at the last update (optax.MultiSteps would be at 1/4)."""
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=4)
    trainer = _trainer(optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=schedule),
                       accumulate_grad_batches=4)
    trainer.fit(EXAMPLES, per_device_batch_size=1, max_steps=4, log_every=1)
    lrs = [h["learning_rate"] for h in trainer.history]
    np.testing.assert_allclose(lrs, [0.1, 0.075, 0.05, 0.025], rtol=1e-6)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_stages_split_state_and_match(zero_stage):
    mesh = engine.make_mesh(data=4, model=2)
    ref = _trainer(mesh)
    ref.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    z = _trainer(mesh, parallelism=engine.Parallelism(zero_stage=zero_stage))
    z.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    mu = z.opt_state[0].mu["layers_0"]["gate_proj"]["kernel"]
    assert "data" in str(mu.sharding.spec), mu.sharding.spec
    assert z.params["layers_0"]["gate_proj"]["kernel"].sharding.spec == P(None, "model")  # weights not split
    _assert_trees_close(z.params, ref.params)


def test_bf16_compute_trains_with_fp32_masters():
    trainer = _trainer(precision=engine.Precision(compute_dtype=jnp.bfloat16))
    history = trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=2, log_every=8)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.params))
    assert history[-1]["loss"] < 0.8 * history[0]["loss"]


def _tiny_loss_fn(params, batch, rng, is_training):
    """The task's loss times 2^-24: its float16 cotangents (about 2^-31) lie below float16's smallest subnormal."""
    loss, metrics = task.loss_fn(params, batch, rng, is_training)
    return loss * 2.0**-24, metrics


def _norms(trainer):
    return np.array([h["grad_norm"] for h in trainer.history if "grad_norm" in h])


def _fp16_runs(names):
    runs = {}
    for name in names:
        fp16 = engine.Precision(compute_dtype=jnp.float16)  # loss_scale 'auto': dynamic for float16
        kwargs = {"fp32": {}, "fp16 unscaled": dict(precision=engine.Precision(compute_dtype=jnp.float16,
                                                                               loss_scale=None)),
                  "fp16": dict(precision=fp16),
                  "fp16 shard_map": dict(precision=fp16, parallelism=engine.Parallelism(step="shard_map"))}[name]
        mesh = engine.make_mesh(data=2, fsdp=2, model=2) if name == "fp16 shard_map" else None
        runs[name] = _trainer(mesh, loss_fn=_tiny_loss_fn, optimizer=optax.sgd(2.0**23), **kwargs)
        runs[name].fit(EXAMPLES, per_device_batch_size=2, max_steps=3, log_every=1)
    return runs


def test_float16_compute_scales_the_loss_so_small_gradients_survive():
    runs = _fp16_runs(["fp32", "fp16 unscaled", "fp16"])
    reference = _norms(runs["fp32"])
    assert np.all(_norms(runs["fp16 unscaled"]) < 0.1 * reference)  # the gradients underflowed
    np.testing.assert_allclose(_norms(runs["fp16"]), reference, rtol=2e-3)
    _assert_trees_close(runs["fp16"].params, runs["fp32"].params, rtol=1e-2, atol=2e-3)
    assert [h["loss_scale"] for h in runs["fp16"].history] == [2.0**15] * 3
    assert {k: int(v) for k, v in _host(runs["fp16"].opt_state["loss_scale"]).items()} == {"scale": 2**15,
                                                                                           "good_steps": 3}


@pytest.mark.slow
def test_float16_loss_scaling_in_the_shard_map_step():
    runs = _fp16_runs(["fp32", "fp16 shard_map"])  # ZeRO-3 on 2x2x2: the scale enters the manual region
    np.testing.assert_allclose(_norms(runs["fp16 shard_map"]), _norms(runs["fp32"]), rtol=2e-3)
    _assert_trees_close(runs["fp16 shard_map"].params, runs["fp32"].params, rtol=1e-2, atol=2e-3)


def _diloco_run(**kwargs):
    trainer = _trainer(loss_fn=_tiny_loss_fn, optimizer=optax.sgd(2.0**23), diloco=engine.DiLoCo(inner_steps=2),
                       **kwargs)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=4, log_every=1)
    return trainer


def test_float16_diloco_scales_each_replica():
    """DiLoCo in float16 (4 replicas, an outer step every 2 steps): each replica scales its loss by its own dynamic
    scale (in its inner state), so the gradient norms and the global model follow the float32 run."""
    fp32, fp16 = _diloco_run(), _diloco_run(precision=engine.Precision(compute_dtype=jnp.float16))  # 'auto': dynamic
    np.testing.assert_allclose(_norms(fp16), _norms(fp32), rtol=2e-3)
    _assert_trees_close(fp16.params, fp32.params, rtol=1e-2, atol=2e-3)
    scales = _host(fp16.opt_state["inner"]["loss_scale"])
    assert scales["scale"].shape == (4,) and (scales["scale"] == 2.0**15).all() and (scales["good_steps"] == 4).all()


@pytest.mark.slow
def test_float16_diloco_underflows_unscaled_and_each_replica_skips_its_overflows():
    """Unscaled float16 DiLoCo gradients underflow; from 2^52 every replica overflows, skips its update and lowers
    its own scale (logged, not an error under nan_policy='raise')."""
    unscaled = _diloco_run(precision=engine.Precision(compute_dtype=jnp.float16, loss_scale=None))
    assert np.all(_norms(unscaled) < 0.1 * _norms(_diloco_run()))
    big = _diloco_run(precision=engine.Precision(
        compute_dtype=jnp.float16, loss_scale=engine.LossScale(initial=2.0**52, factor=2.0**16), nan_policy="raise"))
    assert big.history[0]["loss_scale"] == 2.0**52 and not np.isfinite(big.history[0]["grad_norm"])
    assert big.history[1]["loss_scale"] == 2.0**36


def test_dynamic_loss_scale_skips_overflows_lowers_and_grows():
    """From 2^52 the scaled gradients overflow float16: each such step is skipped (logged, not an error under
    nan_policy='raise') and the scale divided by 16; two finite steps in a row multiply it by 16."""
    scale = engine.LossScale(initial=2.0**52, factor=16.0, growth_interval=2)
    trainer = _trainer(loss_fn=_tiny_loss_fn,
                       precision=engine.Precision(compute_dtype=jnp.float16, loss_scale=scale, nan_policy="raise"))
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=8, log_every=1)
    want, good = 2.0**52, 0
    for record in trainer.history:
        assert record["loss_scale"] == want
        if np.isfinite(record["grad_norm"]):
            good = (good + 1) % 2
            want = want * 16 if good == 0 else want
        else:
            want, good = max(want / 16, 1.0), 0
    finite = [bool(np.isfinite(h["grad_norm"])) for h in trainer.history]
    assert finite[0] is False and any(finite) and trainer.history[-1]["loss"] > 0
    with pytest.raises(ValueError, match=r"loss_scale='static'; expected None, 'auto', 'dynamic', a number >= 1"):
        _trainer(precision=engine.Precision(loss_scale="static"))
    with pytest.raises(ValueError, match=r"LossScale\(factor=1.0\); expected initial >= minimum >= 1"):
        engine.LossScale(factor=1.0)


def test_resume_is_bit_exact(tmp_path):
    full = _trainer(workdir=str(tmp_path / "a"))
    full.fit(EXAMPLES, per_device_batch_size=2, n_epochs=2, max_steps=12, log_every=3, save_every=100)
    first = _trainer(workdir=str(tmp_path / "b"))
    first.fit(EXAMPLES, per_device_batch_size=2, n_epochs=2, max_steps=5, log_every=3)
    first.close()
    saved = _host(first.params)
    resumed = _trainer(workdir=str(tmp_path / "b"))
    assert resumed.step == 5  # restored in the constructor
    _assert_trees_close(resumed.params, saved, rtol=0, atol=0)
    resumed.fit(EXAMPLES, per_device_batch_size=2, n_epochs=2, max_steps=12, log_every=3)
    want = [h["loss"] for h in full.history]
    got = [h["loss"] for h in first.history] + [h["loss"] for h in resumed.history]
    assert got == want  # bit for bit, across the epoch boundary at step 8
    _assert_trees_close(resumed.params, full.params, rtol=0, atol=0)


def test_restore_onto_another_mesh_and_zero_stage(tmp_path):
    a = _trainer(engine.make_mesh(data=8), workdir=str(tmp_path))
    a.fit(EXAMPLES, per_device_batch_size=1, max_steps=3)
    a.close()
    b = _trainer(engine.make_mesh(data=2, model=4), workdir=str(tmp_path), parallelism=engine.Parallelism(zero_stage=1))
    assert b.step == 3
    assert b.params["layers_0"]["up_proj"]["kernel"].sharding.spec == P(None, "model")
    _assert_trees_close(b.params, a.params, rtol=0, atol=0)
    _assert_trees_close(b.opt_state, a.opt_state, rtol=0, atol=0)
    b.fit(EXAMPLES, per_device_batch_size=4, max_steps=4)
    assert b.step == 4


def test_state_api_lays_out_without_allocating_and_restores_params_alone(tmp_path):
    # abstract_state / lower on abstract parameters: the layout the trained state then rests in, nothing allocated.
    abstract = jax.eval_shape(task.init_params)
    planner = engine.Trainer(mesh=engine.make_mesh(data=4, model=2), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                             params=abstract, optimizer=optax.adam(1e-2))
    assert planner.state_shardings is None and planner.batch_spec is None
    batch = {k: jax.ShapeDtypeStruct((1,) + v.shape, v.dtype) for k, v in task.collate_fn(EXAMPLES[:8]).items()}
    state = planner.abstract_state(batch)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    assert planner.batch_spec == {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in batch.items()}
    assert planner.compile(batch).memory_analysis().argument_size_in_bytes > 0
    trained = _trainer(workdir=str(tmp_path))
    trained.fit(EXAMPLES, per_device_batch_size=1, max_steps=2)
    trained.close()
    assert jax.tree.map(lambda x: x.sharding, state) == trained.state_shardings
    # Parameters alone, onto another mesh, from shapes only: the optimizer and its state are never built.
    params, step = engine.restore_params(str(tmp_path), mesh=engine.make_mesh(data=2, model=4), params=abstract,
                                         loss_fn=task.loss_fn)
    assert step == 2 and params["layers_0"]["up_proj"]["kernel"].sharding.spec == P(None, "model")
    _assert_trees_close(params, trained.params, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match=r"checkpoint='best': workdir=.* has no best checkpoint yet"):
        engine.restore_params(str(tmp_path), mesh=trained.mesh, params=abstract, loss_fn=task.loss_fn,
                              checkpoint="best")
    with pytest.raises(ValueError, match=r"checkpoint='last'; expected one of"):
        engine.restore_params(str(tmp_path), mesh=trained.mesh, params=abstract, loss_fn=task.loss_fn,
                              checkpoint="last")


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    a = _trainer(workdir=str(tmp_path))
    a.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    a.close()
    # A save of step 7 that died mid-write: Orbax's temporary directory, never finalised.
    broken = tmp_path / "checkpoints" / "7.orbax-checkpoint-tmp-1234567"
    (broken / "state").mkdir(parents=True)
    (broken / "state" / "partial").write_bytes(b"\0" * 100)
    b = _trainer(workdir=str(tmp_path))
    assert b.step == 2
    _assert_trees_close(b.params, a.params, rtol=0, atol=0)


SIGTERM_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "%s"
os.environ["JAX_PLATFORMS"] = "cpu"
from absl import logging
import optax, engine
from tests import trainer_task as task

class Examples:  # streamed; prints STARTED once, when the fourth batch of the first round is being collated
    started = False

    def __iter__(self):
        for i, e in enumerate(task.make_examples(64)):
            if i == 8 * 3 and not Examples.started:
                Examples.started = True
                print("STARTED", flush=True)
            yield e

trainer = engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                         params=task.init_params(), optimizer=optax.adam(1e-3), workdir=sys.argv[1])
try:
    for round in range(10_000):  # RedCoast's PPO / FedAvg / MAML: fit once per round in the user's own loop
        trainer.fit(Examples(), per_device_batch_size=1, n_epochs=1, log_every=1)
except Exception:
    print("SWALLOWED", flush=True)  # a signal's stop is not an Exception: a user's except clause lets it through
finally:
    print("STOPPED", trainer.stopped_by_signal, trainer.step, flush=True)
""" % cpu_devices(8)


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_sigterm_or_ctrl_c_saves_and_ends_a_users_own_fit_loop_too(tmp_path, signum):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("STARTED"):
            proc.send_signal(signum)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-3000:]  # the loop ended too
    stopped = out.split()
    assert stopped[:2] == ["STOPPED", "True"], out
    step = int(stopped[2])
    assert 1 <= step < 10_000 * 8
    resumed = _trainer(engine.make_mesh(data=8), workdir=str(tmp_path))
    assert resumed.step == step


def test_the_stop_line_says_whether_a_checkpoint_was_saved():
    from engine import fit_loop  # noqa: PLC0415

    assert str(fit_loop.StoppedBySignal(signal.SIGTERM, 7)) == ("stopped by SIGTERM at step 7 (checkpoint saved); "
                                                                 "exit status 143")
    assert str(fit_loop.StoppedBySignal(signal.SIGINT, 7, saved=False)) == (
        "stopped by SIGINT at step 7 (nothing saved: no workdir, or no step trained); exit status 130")


@pytest.mark.slow  # CI time; one process: test_sigterm_or_ctrl_c_saves_and_exits_cleanly
def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """A scheduler's SIGTERM reaching one process of two: the stop is agreed at the next log point, both save the
    same step and return (before, the other process waited in the next step's collective forever)."""
    out = tmp_path / "stop"
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, 2, pid, out, 60, "signal") for pid in (0, 1)]
    for line in procs[1].stdout:
        if line.startswith("STARTED"):
            procs[1].send_signal(signal.SIGTERM)
            break
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    (step0, stopped0), (step1, stopped1) = (np.load(f"{out}.{pid}.npy") for pid in (0, 1))
    assert stopped0 == stopped1 == 1 and step0 == step1 and step0 % 2 == 0 and 0 < step0 < 1000, (step0, step1)
    assert sorted(os.listdir(tmp_path / "w" / "checkpoints"))[-1] == str(step0)


@pytest.mark.slow  # two processes for about 20 s
def test_a_killed_process_ends_the_other_within_the_heartbeat_timeout_naming_it(tmp_path):
    """kill -9 of process 1 mid-run (a lost host): process 0 does not hang in the next collective; the runtime's
    heartbeat (`--peer_timeout`, here 5 s) ends it with a non-zero status and a line naming the lost process."""
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, 2, pid, tmp_path / "run", 60, "killed") for pid in (0, 1)]
    for line in procs[1].stdout:
        if line.startswith("STARTED"):
            procs[1].kill()
            killed = time.monotonic()
            break
    log = procs[0].communicate(timeout=120)[0]
    procs[1].communicate(timeout=30)
    assert procs[0].returncode != 0, log[-3000:]
    assert time.monotonic() - killed < 5 + 25, time.monotonic() - killed
    assert re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b", log), log[-3000:]


def test_processes_that_do_not_share_the_workdir_fail_at_start_in_one_line(tmp_path):
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, 2, pid, tmp_path / "run", 60, "workdirs") for pid in (0, 1)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode != 0 and "STARTED" not in log, log[-3000:]
        assert re.search(r"ValueError: workdir=\S+ is not the same directory on every process: process\(es\) \[1\] do not "
                         r"see what process 0 wrote there", log), log[-3000:]


def test_a_second_signal_interrupts_at_once_without_a_new_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(workdir=str(tmp_path))
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    updates, update = [], fit_loop.ProgressBar.update

    def update_and_signal(self, step, *args, **kwargs):  # runs on the main thread after every step
        updates.append(step)
        if len(updates) == 2:  # two signals in a row during the run (a scheduler's TERM twice, Ctrl-C twice)
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        return update(self, step, *args, **kwargs)

    monkeypatch.setattr(fit_loop.ProgressBar, "update", update_and_signal)
    with pytest.raises(KeyboardInterrupt, match=r"second signal \(SIGTERM\): stopped at once"):
        trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=50, log_every=1, save_every=100)
    assert trainer.step < 50
    trainer.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]  # the last finished checkpoint, nothing newer


def test_no_checkpoint_of_an_unchecked_state_and_a_resume_converts_the_data_position(tmp_path):
    # With log_every above save_every, the checks of the steps before a save run before it: the non-finite step
    # stops fit before any checkpoint of a state after it is written.
    def poisoned_loss(params, batch, rng, is_training):
        loss, metrics = task.loss_fn(params, batch, rng, is_training)
        return jnp.where(jnp.any(batch["labels"] < 0), jnp.nan, loss), metrics

    class Ordered:  # in order: the third global batch (rows 16..23) holds a poisoned example
        def __iter__(self):
            exs = [dict(e) for e in EXAMPLES]
            exs[18] = {"token_ids": [-1] * (task.SEQ + 1)}
            return iter(exs)

    blowup = _trainer(workdir=str(tmp_path / "nan"), loss_fn=poisoned_loss)
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 3"):
        blowup.fit(Ordered(), per_device_batch_size=2, max_steps=40, log_every=20, save_every=2)
    blowup.close()
    assert sorted(os.listdir(tmp_path / "nan" / "checkpoints")) == ["2"]  # not 4: its steps were not yet checked
    # 3 updates of 8 examples = 24 examples into epoch 0: 6 batches of 4, refused for batches of 16.
    first = _trainer(workdir=str(tmp_path / "rows"))
    first.fit(EXAMPLES, per_device_batch_size=2, max_steps=3)
    first.close()
    with pytest.raises(ValueError, match=r"^fit: 16 examples per update, but the checkpoint of step 3 was trained "
                                         r"with 8 and stopped 24 examples into epoch 0"):
        _trainer(workdir=str(tmp_path / "rows")).fit(EXAMPLES, per_device_batch_size=4, max_steps=4)
    smaller = _trainer(workdir=str(tmp_path / "rows"))
    smaller.fit(EXAMPLES, per_device_batch_size=1, max_steps=4)
    assert (smaller.step, smaller.epoch) == (4, 0) and smaller._state.batch_in_epoch == 7  # 24 / 4 + 1
    smaller.close()


def test_nan_loss_stops_naming_the_step_or_is_skipped():
    def poisoned_loss(params, batch, rng, is_training):
        loss, metrics = task.loss_fn(params, batch, rng, is_training)
        return jnp.where(jnp.any(batch["labels"] < 0), jnp.nan, loss), metrics

    def examples():  # in order: the third global batch (rows 16..23) holds a poisoned example
        exs = [dict(e) for e in EXAMPLES]
        exs[18] = {"token_ids": [-1] * (task.SEQ + 1)}
        return exs

    class Ordered:
        def __iter__(self):
            return iter(examples())

    mesh = engine.make_mesh(data=4, model=2)
    trainer = engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=poisoned_loss, params=task.init_params(),
                             optimizer=optax.adam(1e-2))
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 3"):
        trainer.fit(Ordered(), per_device_batch_size=2, log_every=2)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.params))
    skipping = engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=poisoned_loss,
                              params=task.init_params(), optimizer=optax.adam(1e-2),
                              precision=engine.Precision(nan_policy="skip"))
    skipping.fit(Ordered(), per_device_batch_size=2, log_every=2)
    assert skipping.step == 8 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(skipping.params))


def test_predictor_keeps_order_and_drops_padding():
    mesh = engine.make_mesh(data=4, model=2)
    predictor = engine.Predictor(mesh=mesh, collate_fn=lambda exs: {"x": np.array([e["x"] for e in exs])},
                                 pred_fn=lambda params, batch, rng: {"y": batch["x"] * params["scale"]})
    examples = [{"x": np.float32(i)} for i in range(13)]  # 4 per batch: 4 batches, the last padded from 1
    out = predictor.predict(examples, per_device_batch_size=1, params={"scale": jnp.float32(3)})
    assert [float(o["y"]) for o in out] == [3.0 * i for i in range(13)]
    assert predictor.compile_count == 1


def _scored_eval(scores):
    """fit's eval_predictor and eval_metric_fn reporting `scores` in turn as 'score' (a metric whose best step the
    test chooses)."""
    predictor = engine.Predictor(mesh=engine.make_mesh(data=4, model=2), collate_fn=task.collate_fn,
                                 pred_fn=lambda params, batch, rng: {"first": batch["input_ids"][:, 0]})
    scores = iter(scores)
    return dict(eval_examples=EXAMPLES[:8], eval_predictor=predictor,
                eval_metric_fn=lambda examples, predictions: {"score": next(scores)})


def test_eval_every_keeps_the_best_checkpoint_across_a_resume(tmp_path):
    fit = dict(per_device_batch_size=2, log_every=2, eval_every=2, save_best=("score", "max"))
    trainer = _trainer(workdir=str(tmp_path))
    trainer.fit(EXAMPLES, max_steps=6, save_every=2, **fit, **_scored_eval([0.1, 0.5, 0.3]))
    trainer.close()
    assert [h["step"] for h in trainer.history if "eval_score" in h] == [2, 4, 6]  # mid-epoch (8 steps an epoch)
    assert trainer.best == {"step": 4, "metric": "score", "mode": "max", "value": 0.5}
    assert sorted(os.listdir(tmp_path / "best")) == ["4"]
    # The best checkpoint holds step 4's state: the regular checkpoint of step 4's.
    best = _trainer(workdir=str(tmp_path), checkpointing=engine.Checkpointing(params_only=True, restore="best"))
    assert best.step == 4 and best.best["value"] == 0.5
    regular = engine.checkpoint.Checkpointer(str(tmp_path)).restore_params(4, jax.eval_shape(lambda: best.params))
    _assert_trees_close(best.params, regular, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"fit: this Trainer restored the best checkpoint"):
        best.fit(EXAMPLES, per_device_batch_size=2, max_steps=8)
    # A resume reads the best value back: 0.45 at step 8 does not replace it (nor does the epoch's end, the same
    # step), 0.9 at step 10 does; the eval schedule goes on by step number.
    resumed = _trainer(workdir=str(tmp_path))
    assert resumed.step == 6
    resumed.fit(EXAMPLES, max_steps=10, n_epochs=2, **fit, **_scored_eval([0.45, 0.9]))
    resumed.close()
    assert [h["step"] for h in resumed.history if "eval_score" in h] == [8, 10]
    assert resumed.best["step"] == 10 and sorted(os.listdir(tmp_path / "best")) == ["10"]
    with pytest.raises(ValueError, match=r"save_best=\('loss', 'min'\): workdir=.* keeps the best checkpoint by "
                                         r"\('score', 'max'\) \(step 10\)"):
        _trainer(workdir=str(tmp_path)).fit(EXAMPLES, per_device_batch_size=2, max_steps=12,
                                            eval_examples=EXAMPLES[:8], save_best=("loss", "min"))


def test_early_stopping_after_evals_without_improvement_survives_a_restart(tmp_path):
    fit = dict(per_device_batch_size=2, max_steps=8, eval_every=1, save_best=("score", "max"),
               early_stopping_patience=2)
    trainer = _trainer(workdir=str(tmp_path))
    trainer.fit(EXAMPLES, **fit, **_scored_eval([0.1, 0.5, 0.4, 0.3, 0.9]))
    trainer.close()
    assert trainer.step == 4 and trainer.best["step"] == 2  # evals 3 and 4 did not improve on step 2's 0.5
    again = _trainer(workdir=str(tmp_path))
    again.fit(EXAMPLES, **fit, **_scored_eval([0.9]))  # the count came back with the checkpoint: nothing to do
    assert again.step == 4
    with pytest.raises(ValueError, match=r"early_stopping_patience=2; expected None or an integer >= 1, with "
                                         r"save_best"):
        _trainer().fit(EXAMPLES, per_device_batch_size=2, eval_examples=EXAMPLES[:8], early_stopping_patience=2)


def test_bad_eval_and_best_checkpoint_settings(tmp_path):
    fit = dict(per_device_batch_size=2, max_steps=2)
    with pytest.raises(ValueError, match=r"eval_every=0; expected None or an integer >= 1, with eval_examples"):
        _trainer().fit(EXAMPLES, eval_every=0, eval_examples=EXAMPLES[:8], **fit)
    with pytest.raises(ValueError, match=r"eval_every=2; expected None or an integer >= 1, with eval_examples"):
        _trainer().fit(EXAMPLES, eval_every=2, **fit)
    with pytest.raises(ValueError, match=r"save_best=\('loss', 'lowest'\); expected None or \(metric, 'min' \| "
                                         r"'max'\)"):
        _trainer(workdir=str(tmp_path)).fit(EXAMPLES, eval_examples=EXAMPLES[:8], save_best=("loss", "lowest"), **fit)
    with pytest.raises(ValueError, match=r"expected None without eval_examples and a workdir"):
        _trainer().fit(EXAMPLES, eval_examples=EXAMPLES[:8], save_best=("loss", "min"), **fit)
    with pytest.raises(ValueError, match=r"expected \('loss', mode\) without eval_metric_fn"):
        _trainer(workdir=str(tmp_path)).fit(EXAMPLES, eval_examples=EXAMPLES[:8], save_best=("bleu", "max"), **fit)
    with pytest.raises(ValueError, match=r"the eval reports no 'bleu'; expected one of \['loss', 'score'\]"):
        _trainer(workdir=str(tmp_path)).fit(EXAMPLES, eval_every=1, save_best=("bleu", "max"), **fit,
                                            **_scored_eval([0.1]))
    with pytest.raises(ValueError, match=r"Checkpointing.restore='best'; expected 'latest', or 'best' with "
                                         r"Checkpointing.params_only=True and a workdir"):
        _trainer(workdir=str(tmp_path), checkpointing=engine.Checkpointing(restore="best"))
    with pytest.raises(FileNotFoundError, match=r"has no best checkpoint"):
        _trainer(workdir=str(tmp_path / "empty"), checkpointing=engine.Checkpointing(params_only=True, restore="best"))
    assert not os.path.exists(tmp_path / "empty" / "best")


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"train_examples has 5 examples, fewer than one global batch of 8"):
        _trainer().fit(EXAMPLES[:5], per_device_batch_size=2)
    with pytest.raises(ValueError, match=r"mesh=None; expected a jax.sharding.Mesh"):
        engine.Trainer(mesh=None, collate_fn=task.collate_fn, loss_fn=task.loss_fn, params={}, optimizer=optax.sgd(1))
    with pytest.raises(ValueError, match=r"zero_stage=3; expected 0, 1 or 2"):
        _trainer(parallelism=engine.Parallelism(zero_stage=3))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=0; expected an integer >= 1"):
        _trainer(accumulate_grad_batches=0)
    with pytest.raises(ValueError, match=r"nan_policy='ignore'; expected one of"):
        _trainer(precision=engine.Precision(nan_policy="ignore"))
    with pytest.raises(ValueError, match=r"flops_per_example=-1; expected None or a positive number"):
        _trainer(logging=engine.Logging(flops_per_example=-1))
    with pytest.raises(ValueError, match=r"offload_optimizer=True; expected False with diloco"):
        _trainer(diloco=engine.DiLoCo(), parallelism=engine.Parallelism(offload_optimizer=True))
    with pytest.raises(ValueError, match=r"per_device_batch_size=0; expected an integer >= 1"):
        _trainer().fit(EXAMPLES, per_device_batch_size=0)
    with pytest.raises(ValueError, match=r"collate_fn returned leaf \['input_ids'\] of shape \(9, 16\); expected a "
                                         r"leading batch dimension of 8"):
        engine.Trainer(mesh=engine.make_mesh(data=4, model=2), collate_fn=lambda exs: task.collate_fn(exs + exs[:1]),
                       loss_fn=task.loss_fn, params=task.init_params(),
                       optimizer=optax.sgd(0.1)).fit(EXAMPLES, per_device_batch_size=2)


def test_offloaded_optimizer_state_rests_on_the_host_and_changes_nothing(tmp_path):
    """offload_optimizer=True: the same updates bit for bit; the optimizer state sits in pinned host memory after
    init, steps and a restore; the step lowered for a GPU takes and returns it in host memory and moves it to the
    device for the update (the device-memory saving itself needs a GPU to measure)."""
    import re

    from tests.targets import for_gpu
    plain = _trainer()
    plain.fit(EXAMPLES, per_device_batch_size=2, max_steps=3)
    offloaded = _trainer(workdir=str(tmp_path), parallelism=engine.Parallelism(offload_optimizer=True))
    offloaded.fit(EXAMPLES, per_device_batch_size=2, max_steps=3)
    offloaded.close()
    _assert_trees_close(offloaded.params, plain.params, rtol=0, atol=0)
    _assert_trees_close(offloaded.opt_state, plain.opt_state, rtol=0, atol=0)
    kinds = lambda t: {x.sharding.memory_kind for x in jax.tree.leaves(t)}  # noqa: E731
    assert kinds(offloaded.opt_state) == {"pinned_host"} and kinds(offloaded.params) == {"device"}
    resumed = _trainer(workdir=str(tmp_path), parallelism=engine.Parallelism(offload_optimizer=True))
    assert resumed.step == 3 and kinds(resumed.opt_state) == {"pinned_host"}
    _assert_trees_close(resumed.opt_state, plain.opt_state, rtol=0, atol=0)

    batch = {k: jax.ShapeDtypeStruct((1, *x.shape), x.dtype) for k, x in resumed.batch_spec.items()}
    with for_gpu(resumed.mesh):
        text = resumed.lower(batch, platforms=("cuda",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    n_opt, n_params = len(jax.tree.leaves(resumed.opt_state)), len(jax.tree.leaves(resumed.params))
    assert main.count('mhlo.memory_kind = "pinned_host"') == 2 * n_opt  # arguments and results
    assert main.count('mhlo.memory_kind = "device"') >= 2 * n_params
    assert len(re.findall("annotate_device_placement", text)) >= 2 * n_opt  # to the device and back


def test_peak_tflops_by_device_kind():
    from engine.flops import peak_tflops
    device = lambda kind: type("Device", (), {"device_kind": kind})()  # noqa: E731
    assert peak_tflops(device("NVIDIA H100 80GB HBM3")) == 989.0 and peak_tflops(device("TPU v5 lite")) == 197.0
    assert peak_tflops(device("TPU v5p")) == 459.0 and peak_tflops(jax.devices()[0]) is None


def _two_workers(tmp_path, mode):
    """Runs tests/multihost_worker.py in `mode` as 2 processes x 4 devices; returns what process 0 saved."""
    out = tmp_path / f"{mode}.npy"
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, 2, pid, out, 60, mode) for pid in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return np.load(out)


def _two_workers_die(tmp_path, mode):
    """Runs tests/multihost_worker.py in `mode` as 2 processes x 4 devices, which both end with status 3."""
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, 2, pid, tmp_path / f"{mode}.npy", 60, mode) for pid in (0, 1)]
    for p in procs:
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 3, log[-3000:]


@pytest.mark.slow  # three two-process runs; tests/test_fit_patterns.py checks the restart in one process
def test_two_processes_restarted_after_dying_together_end_where_the_uninterrupted_run_ends(tmp_path):
    """Both processes of a `fit(n_epochs=2)` run die at once in epoch 1; the same command re-run continues the
    interrupted call from the last checkpoint and ends bit for bit where a run without the crash ends."""
    whole = _two_workers(tmp_path, "whole")
    _two_workers_die(tmp_path, "crash")
    assert os.listdir(tmp_path / "w" / "checkpoints")
    resumed = _two_workers(tmp_path, "resume")
    assert resumed[0] == whole[0] == 16
    np.testing.assert_array_equal(resumed, whole)


@pytest.mark.slow  # five two-process runs; tests/test_checkpoint_tiers.py checks the tiers in one process
@pytest.mark.parametrize("resume, restored", [("local_resume", 10), ("local_lost", 9)])
def test_two_processes_restart_from_the_newest_copy_every_process_holds(tmp_path, resume, restored):
    """Both processes die at once with local copies of steps 10 and persistent ones of step 9: the re-run restores
    the local step 10, or, when one host lost its local copy, the persistent step 9 on both; either ends bit for bit
    where the uninterrupted run ends."""
    whole = _two_workers(tmp_path, "whole")
    _two_workers_die(tmp_path, "local_crash")
    resumed = _two_workers(tmp_path, resume)
    assert resumed[0] == restored and resumed[1] == whole[0] == 16
    np.testing.assert_array_equal(resumed[1:], whole)


@pytest.mark.slow  # six two-process runs; tests/test_checkpoint_tiers.py checks the replica's bytes in one process
@pytest.mark.parametrize("resume, restored", [("replica_lost", 10), ("replica_corrupt", 9)])
def test_two_processes_restore_a_lost_local_copy_from_its_peers_replica(tmp_path, resume, restored):
    """Each process has its own local directory (a host's disk) and keeps a replica of the other's local blocks;
    both die with local copies of step 10 and persistent ones of step 9, and process 1's local directory is gone
    (its copy and the replica it held). The re-run writes process 1's blocks back from process 0's replica and
    restores the local step 10, or, when that replica fails its checksums, drops it and restores the persistent
    step 9; either ends bit for bit where the uninterrupted run ends."""
    whole = _two_workers(tmp_path, "whole")
    _two_workers_die(tmp_path, "replica_crash")
    run = next((tmp_path / "local0").iterdir())
    assert sorted(os.listdir(run)) == ["process_0", "replica_of_process_1"]
    assert os.listdir(run / "replica_of_process_1") == ["10"]
    resumed = _two_workers(tmp_path, resume)
    assert resumed[0] == restored and resumed[1] == whole[0] == 16
    np.testing.assert_array_equal(resumed[1:], whole)


@pytest.mark.slow  # for CI time: tests/test_readme.py runs the README's two-process example by default
def test_two_processes_match_single_process(tmp_path):
    from tests import multihost_worker
    want, _ = multihost_worker.train_losses(engine.make_mesh(data=4, model=2))
    np.testing.assert_allclose(_two_workers(tmp_path, "train"), want, rtol=1e-5)


@pytest.mark.slow
def test_diloco_with_a_replica_per_process_matches_single_process(tmp_path):
    """DiLoCo as deployed: one replica per process (data 2 x model 4 over 2 processes x 4 devices), so only the
    outer steps cross processes. Losses and the global parameters equal the single-process run's (and the
    per-replica metrics, split across processes, reach the log)."""
    from tests import multihost_worker
    want = np.concatenate(multihost_worker.diloco_run(engine.make_mesh(data=2, model=4)))
    np.testing.assert_allclose(_two_workers(tmp_path, "diloco"), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_streaming_diloco_across_processes_matches_single_process(tmp_path):
    """Streaming DiLoCo (2 parts, int8 outer gradients, overlapped) with a replica per process: the quantized
    all-to-all and all-gather cross processes (gloo) and give the single-process run's losses and global parameters,
    up to
    rounding: the two runs' inner steps differ in the last bits (2.5e-6 at most with fp32 outer gradients), which
    now and then moves a value to the next int8 level (measured: 7.6e-4 at most after 4 steps). Chunks sent to
    the wrong replica would be off by the size of the updates (1e-2)."""
    from tests import multihost_worker
    losses, params = multihost_worker.diloco_run(engine.make_mesh(data=2, model=4), **multihost_worker.STREAMING)
    got = _two_workers(tmp_path, "streaming")
    np.testing.assert_allclose(got[:len(losses)], losses, rtol=1e-3)
    np.testing.assert_allclose(got[len(losses):], params, atol=3e-3)


@pytest.mark.slow
def test_pipeline_with_a_stage_per_process_matches_single_process_without(tmp_path):
    """Pipeline parallelism as deployed: stage 2 x data 2 x model 2 over 2 processes x 4 devices, each process one
    stage, so only activations (and the head's gradients) cross processes. The losses equal a single-process run of
    the same model without a pipeline (data 2 x model 2)."""
    from tests import multihost_worker
    want = multihost_worker.llama_losses(engine.make_mesh(data=2, model=2, devices=jax.devices()[:4]))
    np.testing.assert_allclose(_two_workers(tmp_path, "pipeline"), want, rtol=1e-5)


@pytest.mark.slow
def test_context_parallelism_over_two_processes_matches_single_process_without(tmp_path):
    """Context parallelism as deployed: data 2 x context 2 x model 2 over 2 processes x 4 devices, each context group
    inside a process (the rows of a data position read by both its context devices). The losses equal a
    single-process run without it (data 2 x model 2)."""
    from tests import multihost_worker
    want = multihost_worker.llama_losses(engine.make_mesh(data=2, model=2, devices=jax.devices()[:4]))
    np.testing.assert_allclose(_two_workers(tmp_path, "context"), want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ppo", "grpo"])
def test_ppo_on_two_processes_matches_single_process(tmp_path, mode):
    """PPO (and GRPO) across processes (data 4 x model 2 over 2 processes x 4 devices): rollouts sampled on the mesh
    and gathered to every process, the scoring pass, the host's advantages and the updates give the single-process
    run's rollout stats and parameters."""
    from tests import multihost_worker
    want = multihost_worker.ppo_run(engine.make_mesh(data=4, model=2), {"ppo": "gae", "grpo": "grpo"}[mode])
    np.testing.assert_allclose(_two_workers(tmp_path, mode), want, rtol=1e-5, atol=1e-6)


def test_multi_transform_optimizer_state_is_split_like_its_parameters():
    """An optimizer with per-group transforms (optax.multi_transform: masked inner states) gets the parameters'
    layout for its moments, ZeRO-1 included, and updates only the groups that have a learning rate."""
    labels = {k: jax.tree.map(lambda _, k=k: "frozen" if k.startswith("layers_0") else "trained", v)
              for k, v in task.init_params().items()}
    optimizer = optax.multi_transform({"trained": optax.adam(1e-2), "frozen": optax.sgd(0.0)}, labels)
    trainer = _trainer(optimizer=optimizer, parallelism=engine.Parallelism(zero_stage=1))
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    before, after = task.init_params(), _host(trainer.params)
    for name in before:
        changed = not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[name]),
                                                               jax.tree.leaves(after[name])))
        assert changed == (not name.startswith("layers_0")), name
    mu = trainer.opt_state.inner_states["trained"].inner_state[0].mu
    embed_mu, embed = mu["embed_tokens"]["embedding"], trainer.params["embed_tokens"]["embedding"]
    assert embed_mu.sharding.spec == engine.add_axis(embed.sharding.spec, embed.shape, "data",
                                                     dict(trainer.mesh.shape))


@pytest.mark.slow  # CI time: tests/test_models.py checks remat's logits and gradients by default
def test_remat_gives_the_same_update():
    a = _trainer(optimizer=optax.sgd(0.5))
    a.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    b = _trainer(optimizer=optax.sgd(0.5), parallelism=engine.Parallelism(remat=True))
    b.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    _assert_trees_close(a.params, b.params)
    batch = {k: jax.ShapeDtypeStruct((1, 8, task.SEQ), np.int32) for k in ("input_ids", "labels")}
    jaxprs = [str(jax.make_jaxpr(t._program.impls[False])(t.params, t.opt_state, batch, np.int32(0)))
              for t in (a, b)]
    assert "remat" not in jaxprs[0] and "remat" in jaxprs[1]  # the rematerialisation primitive


def test_keeps_the_last_k_checkpoints(tmp_path):
    trainer = _trainer(workdir=str(tmp_path), checkpointing=engine.Checkpointing(keep=2))
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=5, save_every=1)
    trainer.close()
    steps = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
    assert steps == [4, 5]


# ---------------------------------------------------------------------------------------------- frozen parameters
TRAINED = r"layers_1/|lm_head"  # the second layer and the head train; embeddings and the first layer are frozen


def _masked_reference(mesh, **kwargs):
    """The same training by masking the optimizer instead: every gradient is computed, frozen updates are zero."""
    labels = jax.tree_util.tree_map_with_path(
        lambda p, _: "t" if re.search(TRAINED, engine.sharding.path_str(p)) else "f", task.init_params())
    opt = optax.multi_transform({"t": optax.sgd(0.1, momentum=0.9), "f": optax.set_to_zero()}, labels)
    return _trainer(mesh, optimizer=opt, **kwargs)


@pytest.mark.parametrize("mesh,kwargs", [
    pytest.param(dict(data=4, model=2), dict(parallelism=engine.Parallelism(step="jit")), marks=pytest.mark.slow),
    (dict(data=2, fsdp=2, model=2), dict(parallelism=engine.Parallelism(step="shard_map", zero_stage=1),
                                         accumulate_grad_batches=2)),
    pytest.param(dict(data=1, fsdp=4, model=2), dict(parallelism=engine.Parallelism(step="shard_map", zero_stage=2)),
                 marks=pytest.mark.slow),
    pytest.param(dict(data=2, fsdp=2, model=2), dict(parallelism=engine.Parallelism(
        step="shard_map", zero_stage=1, offload_optimizer=True)), marks=pytest.mark.slow),
])
def test_frozen_parameters_stay_and_the_rest_train_as_with_a_masked_optimizer(mesh, kwargs):
    """`trainable=` (a regex over parameter paths): frozen leaves keep their exact values, the trained ones equal a
    masked optimizer's run (which computes every gradient), and the optimizer state holds the trained leaves only."""
    init = _host(task.init_params())
    got = _trainer(engine.make_mesh(**mesh), optimizer=optax.sgd(0.1, momentum=0.9), trainable=TRAINED, **kwargs)
    got.fit(EXAMPLES, per_device_batch_size=2, max_steps=4, log_every=4)
    ref = _masked_reference(engine.make_mesh(**mesh), **kwargs)
    ref.fit(EXAMPLES, per_device_batch_size=2, max_steps=4, log_every=4)
    np.testing.assert_allclose([h["loss"] for h in got.history], [h["loss"] for h in ref.history], rtol=1e-5)
    _assert_trees_close(ref.params, got.params)
    for (path, before), after in zip(jax.tree_util.tree_flatten_with_path(init)[0], jax.tree.leaves(
            _host(got.params))):
        trained = bool(re.search(TRAINED, engine.sharding.path_str(path)))
        assert trained != np.array_equal(before, after), engine.sharding.path_str(path)
    momentum = sum(x.size for x in jax.tree.leaves(got.opt_state))
    assert momentum == sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(init)[0]
                           if re.search(TRAINED, engine.sharding.path_str(p)))


@pytest.mark.slow
def test_frozen_parameters_resume_exactly_and_with_diloco(tmp_path):
    """A run with frozen parameters checkpoints (the optimizer state has no frozen leaves) and resumes bit for bit;
    DiLoCo keeps replicas of the trained parameters only."""
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    full = _trainer(mesh, trainable=TRAINED, parallelism=engine.Parallelism(zero_stage=1))
    full.fit(EXAMPLES, per_device_batch_size=2, max_steps=4, log_every=2)
    first = _trainer(mesh, trainable=TRAINED, workdir=str(tmp_path / "run"),
                     parallelism=engine.Parallelism(zero_stage=1))
    first.fit(EXAMPLES, per_device_batch_size=2, max_steps=2, log_every=2)
    first.close()
    second = _trainer(mesh, trainable=TRAINED, workdir=str(tmp_path / "run"),
                      parallelism=engine.Parallelism(zero_stage=1))
    assert second.step == 2
    second.fit(EXAMPLES, per_device_batch_size=2, max_steps=4, log_every=2)
    second.close()
    for a, b in zip(jax.tree.leaves(_host(full.params)), jax.tree.leaves(_host(second.params))):
        np.testing.assert_array_equal(a, b)

    init = _host(task.init_params())
    diloco = _trainer(engine.make_mesh(data=4, model=2), trainable=TRAINED, optimizer=optax.sgd(0.1),
                      diloco=engine.DiLoCo(inner_steps=2))
    diloco.fit(EXAMPLES, per_device_batch_size=2, max_steps=4, log_every=2)
    replicas = diloco.opt_state["replicas"]
    assert {k for k, v in replicas.items() if jax.tree.leaves(v)} == {"layers_1", "lm_head"}
    assert replicas["lm_head"]["kernel"].shape == (4, 32, 64)
    np.testing.assert_array_equal(_host(diloco.params)["layers_0"]["up_proj"]["kernel"],
                                  init["layers_0"]["up_proj"]["kernel"])
    assert not np.array_equal(_host(diloco.params)["lm_head"]["kernel"], init["lm_head"]["kernel"])


def test_bad_trainable_errors():
    mesh = engine.make_mesh(data=8)
    for bad, match in [("nothing_is_called_this", "selects no parameter"), ("(", "not a regular expression"),
                       ({"lm_head": True}, "tree of bools")]:
        with pytest.raises(ValueError, match=match):
            _trainer(mesh, trainable=bad)
