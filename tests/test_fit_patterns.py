"""RedCoast's patterns on the Trainer: repeated `fit`, a user gradient rule (`grad_fn`), parameters set on a live
Trainer, pytree batches and epoch-dependent examples, the progress bar."""
import collections.abc
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
from engine import fit_loop
from tests import trainer_task as task

EXAMPLES = task.make_examples(64)


def _trainer(mesh=None, **kwargs):
    kwargs.setdefault("optimizer", optax.adam(1e-2))
    kwargs.setdefault("loss_fn", task.loss_fn)
    kwargs.setdefault("collate_fn", task.collate_fn)
    return engine.Trainer(mesh=mesh or engine.make_mesh(data=4, model=2), params=task.init_params(), **kwargs)


def _close(a, b, rtol=1e-5, atol=1e-6):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(a))[0],
                            jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------------------ repeated fit
def test_each_fit_trains_n_epochs_more_and_total_epochs_is_counted_over_the_trainers_life():
    trainer = _trainer()
    trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=1, save_every=3)  # no workdir: nothing to save
    assert (trainer.step, trainer.epoch) == (8, 1)
    trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=1)  # RedCoast's agent.train(n_epochs=...) per episode
    assert (trainer.step, trainer.epoch) == (16, 2)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=19)  # stops inside epoch 2 ...
    trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=1)  # ... which is finished first, then one whole epoch
    assert (trainer.step, trainer.epoch) == (32, 4)
    with pytest.raises(ValueError, match=r"^n_epochs=1 and total_epochs=2; expected one of them"):
        trainer.fit(EXAMPLES, per_device_batch_size=2, n_epochs=1, total_epochs=2)
    fresh = _trainer()  # max_steps alone bounds the call, over as many epochs as it takes (it stopped after one)
    fresh.fit(EXAMPLES, per_device_batch_size=2, max_steps=20)
    assert (fresh.step, fresh.epoch) == (20, 2)
    fresh.fit(EXAMPLES, per_device_batch_size=2, max_steps=40, n_epochs=1)  # beside an epoch bound: the first
    assert (fresh.step, fresh.epoch) == (32, 4)  # (epoch 2's rest, then epoch 3)
    once = _trainer()  # a one-shot iterator used up by its first epoch ends the call there (logged), not in an error
    once.fit(iter(EXAMPLES), per_device_batch_size=2, max_steps=100)
    assert (once.step, once.epoch) == (8, 1)
    with pytest.raises(ValueError, match=r"^train_examples yielded fewer examples than one global batch of 8$"):
        _trainer().fit(iter(EXAMPLES[:7]), per_device_batch_size=2, max_steps=100)  # none at all: an error


@pytest.mark.slow  # CI time (three Trainers, 8-13 s)
def test_a_resume_mid_epoch_over_other_examples_says_its_order_is_drawn_anew(tmp_path, caplog):
    import logging  # noqa: PLC0415

    mesh = engine.make_mesh(data=1, devices=jax.devices()[:1])  # the cheapest compile
    first = _trainer(mesh, workdir=str(tmp_path))
    first.fit(EXAMPLES, per_device_batch_size=2, max_steps=3, save_every=3)
    first.close()
    more = EXAMPLES + task.make_examples(16)
    for steps, warned in ((4, True), (5, False)):  # the second resume finds the epoch of 80 it saved
        caplog.clear()
        again = _trainer(mesh, workdir=str(tmp_path))
        with caplog.at_level(logging.WARNING):
            again.fit(more, per_device_batch_size=2, max_steps=steps)
        again.close()
        line = f"resuming epoch 0 at batch {steps - 1} over 80 examples where the checkpoint's epoch had 64: its order"
        assert (line in caplog.text) == warned and again.step == steps, caplog.text


def test_a_stream_without_max_steps_says_its_epoch_ends_with_the_stream(caplog):
    import logging  # noqa: PLC0415

    with caplog.at_level(logging.INFO):
        _trainer().fit(EXAMPLES, per_device_batch_size=2)
        _trainer().fit(iter(EXAMPLES), per_device_batch_size=2, max_steps=4)
        assert not [r for r in caplog.records if "is streamed" in r.getMessage()]
        _trainer().fit(iter(EXAMPLES), per_device_batch_size=2)
    said = [r.getMessage() for r in caplog.records if "is streamed" in r.getMessage()]
    assert said == ["fit: train_examples is streamed (no len): an epoch ends when its iterator does, so an endless "
                    "stream trains until max_steps or a signal, and max_steps is not set"]


class _Crash(Exception):
    pass


class _CrashesInEpoch1(collections.abc.Sequence):
    """The examples, with a crash (a killed process's stand-in) when example 5 is read the second time: in epoch 1,
    after the checkpoints `save_every` wrote."""

    def __init__(self, examples):
        self.examples, self.reads = examples, 0

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        self.reads += i == 5
        if i == 5 and self.reads == 2:
            raise _Crash("killed")
        return self.examples[i]


TARGETS = {"n_epochs": dict(n_epochs=2), "total_epochs": dict(total_epochs=2),
           "max_steps": dict(n_epochs=5, max_steps=21), "max_steps alone": dict(max_steps=21)}


@pytest.mark.parametrize("step", ["jit", pytest.param("shard_map", marks=pytest.mark.slow)])
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_restarted_script_ends_exactly_where_the_uninterrupted_run_ends(target, step, tmp_path):
    common = dict(parallelism=engine.Parallelism(step=step))
    whole = _trainer(**common)
    whole.fit(EXAMPLES, per_device_batch_size=2, **TARGETS[target])
    crashed = _trainer(workdir=str(tmp_path), **common)
    with pytest.raises(_Crash):
        crashed.fit(_CrashesInEpoch1(EXAMPLES), per_device_batch_size=2, save_every=3, **TARGETS[target])
    crashed.close()
    assert crashed.epoch == 1
    rerun = _trainer(workdir=str(tmp_path), **common)  # the same script, run again: the same call
    assert 0 < rerun.step < whole.step
    rerun.fit(EXAMPLES, per_device_batch_size=2, **TARGETS[target])
    assert (rerun.step, rerun.epoch) == (whole.step, whole.epoch)
    for a, b in zip(jax.tree.leaves(jax.device_get(rerun.params)), jax.tree.leaves(jax.device_get(whole.params))):
        np.testing.assert_array_equal(a, b)  # bit for bit
    rerun.close()
    again = _trainer(workdir=str(tmp_path), **common)  # re-run once more: that call had ended, nothing to train
    again.fit(EXAMPLES, per_device_batch_size=2, **TARGETS[target])
    assert again.step == whole.step
    if target == "n_epochs":
        again.fit(EXAMPLES, per_device_batch_size=2, n_epochs=1)  # a later call trains again
        assert (again.step, again.epoch) == (whole.step + 8, 3)
    again.close()


# ------------------------------------------------------------------------------------------ grad_fn
def _engine_grad_fn(params, batch, rng):
    return jax.value_and_grad(lambda p: task.loss_fn(p, batch, rng, True), has_aux=True)(params)


STEP_KINDS = {
    "jit": (dict(data=4, model=2), engine.Parallelism(step="jit")),
    "shard_map": (dict(data=4, model=2), engine.Parallelism(step="shard_map")),
    "zero2": (dict(data=4, model=2), engine.Parallelism(step="shard_map", zero_stage=2)),
    "zero3": (dict(data=2, fsdp=2, model=2), engine.Parallelism(step="shard_map", zero_stage=1)),
}


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_grad_fn_replaces_the_engines_differentiation_on_every_step_kind(kind):
    mesh_axes, parallelism = STEP_KINDS[kind]
    mesh = engine.make_mesh(**mesh_axes)
    common = dict(optimizer=optax.sgd(0.5), parallelism=parallelism, accumulate_grad_batches=2)
    own = _trainer(mesh, **common)
    own.fit(EXAMPLES, per_device_batch_size=2, max_steps=2, log_every=1)
    user = _trainer(mesh, grad_fn=_engine_grad_fn, **common)
    user.fit(EXAMPLES, per_device_batch_size=2, max_steps=2, log_every=1)
    _close(user.params, own.params)
    np.testing.assert_allclose([h["grad_norm"] for h in user.history], [h["grad_norm"] for h in own.history],
                               rtol=1e-5)
    np.testing.assert_allclose([h["accuracy"] for h in user.history], [h["accuracy"] for h in own.history])
    # The rule is the user's: halving the gradients halves the first update.
    half = _trainer(mesh, grad_fn=lambda p, b, r: jax.tree.map(lambda g: g / 2, _engine_grad_fn(p, b, r)), **common)
    half.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)
    start = task.init_params()
    once = _trainer(mesh, **common)
    once.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)
    _close(jax.tree.map(lambda h, s: 2 * (h - s), half.params, start),
           jax.tree.map(lambda o, s: o - s, once.params, start), rtol=1e-4, atol=1e-6)


def test_grad_fn_errors():
    with pytest.raises(ValueError, match=r"^grad_fn=3; expected None or a callable"):
        _trainer(grad_fn=3)
    with pytest.raises(ValueError, match=r"expected None with diloco"):
        _trainer(engine.make_mesh(data=2, model=4), grad_fn=_engine_grad_fn, diloco=engine.DiLoCo(inner_steps=2))
    with pytest.raises(ValueError, match=r"expected Precision\(loss_scale=None\)"):
        _trainer(grad_fn=_engine_grad_fn, precision=engine.Precision(compute_dtype=jnp.float16))
    bad = _trainer(grad_fn=lambda p, b, r: (task.loss_fn(p, b, r, True), {"only": 0.0}))
    with pytest.raises(ValueError, match=r"grad_fn returned grads of structure .*; expected the parameters'"):
        bad.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)


# ------------------------------------------------------------------------------------------ live parameters
def test_set_params_and_reset_optimizer_reuse_the_compiled_step():
    trainer = _trainer()
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    assert trainer.compile_count == 1 and int(trainer.opt_state[0].count) == 2
    start = task.init_params(seed=1)
    trainer.set_params(start, reset_optimizer=True)
    assert int(trainer.opt_state[0].count) == 0
    assert trainer.params["lm_head"]["kernel"].sharding == trainer.state_shardings["params"]["lm_head"]["kernel"]
    _close(trainer.params, start, rtol=0, atol=0)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=4)
    assert trainer.compile_count == 1  # no rebuild, no recompilation
    # The same two updates from the same start as a fresh Trainer (the data position differs, so compare to one
    # that trains on the same batches: epoch 0, batches 2 and 3).
    fresh = engine.Trainer(mesh=trainer.mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn, params=start,
                           optimizer=optax.adam(1e-2))
    fresh.fit(EXAMPLES, per_device_batch_size=2, max_steps=2)
    assert not np.allclose(jax.device_get(fresh.params["lm_head"]["kernel"]), start["lm_head"]["kernel"])
    with pytest.raises(ValueError, match=r"^set_params: leaf lm_head/kernel is float32\[32, 65\]; expected "
                                         r"float32\[32, 64\]"):
        bad = jax.tree.map(lambda x: x, start)
        bad["lm_head"]["kernel"] = np.zeros((32, 65), np.float32)
        trainer.set_params(bad)
    with pytest.raises(ValueError, match=r"^set_params: params has structure"):
        trainer.set_params({"lm_head": start["lm_head"]})


# ------------------------------------------------------------------------------------------ pytree batches
def _nested_collate(examples):
    flat = task.collate_fn(examples)
    return {"train": {"input_ids": flat["input_ids"]}, "targets": [flat["labels"]]}


def _nested_loss(params, batch, rng, is_training):
    return task.loss_fn(params, {"input_ids": batch["train"]["input_ids"], "labels": batch["targets"][0]}, rng,
                        is_training)


@pytest.mark.parametrize("step", ["jit", "shard_map"])
def test_any_pytree_batch_trains_evaluates_and_predicts_like_a_flat_one(step, tmp_path):
    parallelism = engine.Parallelism(step=step)
    flat = _trainer(parallelism=parallelism, optimizer=optax.sgd(0.5))
    flat.fit(EXAMPLES, per_device_batch_size=2, max_steps=3)
    nested = _trainer(parallelism=parallelism, optimizer=optax.sgd(0.5), collate_fn=_nested_collate,
                      loss_fn=_nested_loss, workdir=str(tmp_path))
    nested.fit(EXAMPLES, per_device_batch_size=2, max_steps=3)
    _close(nested.params, flat.params)
    assert nested.eval_loss(EXAMPLES[:10], per_device_batch_size=2) == pytest.approx(
        flat.eval_loss(EXAMPLES[:10], per_device_batch_size=2), rel=1e-5)
    nested.close()
    resumed = _trainer(parallelism=parallelism, optimizer=optax.sgd(0.5), collate_fn=_nested_collate,
                       loss_fn=_nested_loss, workdir=str(tmp_path))
    assert resumed.step == 3 and set(resumed.batch_spec) == {"train", "targets"}
    _close(resumed.params, nested.params, rtol=0, atol=0)
    predictor = engine.Predictor(mesh=nested.mesh, collate_fn=_nested_collate,
                                 pred_fn=lambda p, b, r: {"argmax": [task.MODEL.apply(
                                     {"params": p}, b["train"]["input_ids"]).argmax(-1)]})
    preds = predictor.predict(EXAMPLES[:5], per_device_batch_size=1, params=nested.params)
    assert len(preds) == 5 and preds[0]["argmax"][0].shape == (task.SEQ,)


def test_a_collate_fn_error_keeps_its_type_and_names_the_batch_and_examples():
    def broken(examples):
        return {"x": np.stack([e["missing"] for e in examples])}

    with pytest.raises(KeyError) as caught:
        _trainer(collate_fn=broken).fit(EXAMPLES, per_device_batch_size=2, max_steps=1)
    (note,) = caught.value.__notes__
    assert re.fullmatch(r"raised by collate_fn on batch 0 of epoch 0, micro-batch 0 \(examples (\d+, ){7}\d+\)",
                        note), note  # 2 rows a device x 4 data devices, by their shuffled indices
    with pytest.raises(KeyError) as caught:
        _trainer(collate_fn=broken).fit(iter(EXAMPLES), per_device_batch_size=1, max_steps=1)
    assert caught.value.__notes__ == ["raised by collate_fn on streamed batch 0 of epoch 0, micro-batch 0 "
                                      "(4 examples)"]


def test_batch_leaf_errors_name_the_leaf():
    strings = _trainer(collate_fn=lambda ex: {"x": {"ids": np.array(["a"] * len(ex))}})
    with pytest.raises(ValueError, match=r"^collate_fn returned leaf \['x'\]\['ids'\] of type ndarray; expected an "
                                         r"array of numbers"):
        strings.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)
    ragged = _trainer(collate_fn=lambda ex: {"a": np.zeros((len(ex), 3)), "b": [np.zeros((len(ex) + 1, 3))]})
    with pytest.raises(ValueError, match=r"^collate_fn returned leaf \['b'\]\[0\] of shape \(9, 3\); expected a "
                                         r"leading batch dimension of 8"):
        ragged.fit(EXAMPLES, per_device_batch_size=2, max_steps=1)


# ------------------------------------------------------------------------------------------ examples per epoch
def test_examples_may_be_a_function_of_the_epoch():
    asked = []

    def draw(epoch):
        asked.append(epoch)
        return task.make_examples(16, seed=epoch)

    trainer = _trainer()
    trainer.fit(draw, per_device_batch_size=2, n_epochs=2,
                eval_examples=lambda epoch: task.make_examples(8, 100 + epoch))
    trainer.fit(draw, per_device_batch_size=2, n_epochs=1)
    assert asked == [0, 1, 2] and trainer.step == 6
    evals = [h for h in trainer.history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [2, 4]


# ------------------------------------------------------------------------------------------ progress
def test_progress_bar_shows_steps_loss_eta_and_eval_lines():
    stream = io.StringIO()
    bar = fit_loop.ProgressBar(True, stream)
    bar.update(0, 10, 16)
    bar.update(5, 10, 16, loss=1.25)
    bar.line("eval at step 5: loss 1.1000")
    bar.update(10, 10, 16)
    bar.close()
    text = stream.getvalue()
    assert "step 5/10 [" in text and "50%" in text and "loss 1.2500" in text and "eta 0:00:0" in text
    assert "\r\033[Keval at step 5: loss 1.1000\n" in text and text.endswith("100% | loss 1.2500 | " + text.split(
        "100% | loss 1.2500 | ")[-1]) and text.endswith("\n")
    silent = io.StringIO()
    off = fit_loop.ProgressBar(False, silent)
    off.update(1, 2, 3, loss=1.0)
    off.line("x")
    off.close()
    assert silent.getvalue() == ""


def test_progress_is_on_for_a_terminal_only(capsys):
    assert engine.Logging().shows_progress() is False  # pytest's stderr is not a terminal
    trainer = _trainer(logging=engine.Logging(progress=True))
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=3, log_every=1, eval_examples=EXAMPLES[:8],
                eval_every=3)
    err = capsys.readouterr().err
    assert "step 3/3 [" in err and "eval at step 3: loss " in err
    with pytest.raises(ValueError, match=r"^progress='yes'; expected None"):
        engine.Logging(progress="yes")


def test_pred_fn_outputs_must_have_one_row_per_example():
    mesh = engine.make_mesh(data=4, model=2)
    predictor = engine.Predictor(mesh=mesh, collate_fn=task.collate_fn,
                                 pred_fn=lambda p, b, r: {"ok": b["input_ids"], "sum": [b["input_ids"].sum()]})
    with pytest.raises(ValueError, match=r"^pred_fn returned leaf \['sum'\]\[0\] of shape \(\); expected a leading "
                                         r"batch dimension of 8"):
        predictor.predict(EXAMPLES[:5], per_device_batch_size=2, params=task.init_params())
