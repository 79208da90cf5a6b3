"""Checkpoints damaged after they were written (garbage, truncated or missing files, a stray step directory, bit
flips, a meta edited by hand): a resume falls back to the newest step that restores, bit for bit, naming each skipped
step in a warning; the checksums stored with each step catch the damage that would otherwise read as wrong values."""
import glob
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

import engine
from engine.checkpoint import Checkpointer, StateMismatchError, checksums
from tests import trainer_task as task

EXAMPLES = task.make_examples(64)
# Orbax leaves tensorstore reads pending when a restore fails; their callbacks then find its event loop closed.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _trainer(workdir, optimizer=None, **kwargs):
    return engine.Trainer(mesh=engine.make_mesh(data=4, model=2), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                          params=task.init_params(), optimizer=optimizer or optax.adam(1e-2), workdir=str(workdir),
                          **kwargs)


def _host(trainer):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), {"params": trainer.params,
                                                                  "opt_state": trainer.opt_state})


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.fixture
def warnings(monkeypatch):
    """The checkpoint warnings logged during the test, formatted (Orbax's own, through absl too, left out)."""
    logged, warn = [], logging.warning

    def record(msg, *args, **kwargs):
        if str(msg).startswith("checkpoint:"):
            logged.append(msg % args)
        warn(msg, *args, **kwargs)
    monkeypatch.setattr(logging, "warning", record)
    return logged


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir holding steps 2 and 4, and each step's state as it was saved."""
    workdir = tmp_path_factory.mktemp("trained")
    trainer, states = _trainer(workdir), {}
    for steps in (2, 4):
        trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=steps)
        states[steps] = _host(trainer)
    trainer.close()
    return workdir, states


def _copy(trained, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    return workdir


def _data_files(step_dir):
    """The files holding the state's arrays (OCDBT's b-tree nodes and chunks: `d/` under `state/`)."""
    return sorted(f for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True) if os.path.isfile(f))


def _garbage(step_dir):
    rs = np.random.RandomState(0)
    for f in _data_files(step_dir):
        data = rs.bytes(os.path.getsize(f))
        with open(f, "wb") as out:
            out.write(data)


def _truncate(step_dir):
    for f in _data_files(step_dir):
        os.truncate(f, os.path.getsize(f) // 2)


def _flip_bits(path, rs, n=1):
    data = bytearray(open(path, "rb").read())
    for bit in rs.randint(len(data) * 8, size=n):
        data[bit // 8] ^= 1 << (bit % 8)
    with open(path, "wb") as out:
        out.write(data)


FAULTS = {  # name -> (what it does to a workdir, the step it damages, the step a resume then restores)
    "garbage data files": (lambda w: _garbage(w / "checkpoints" / "4"), 4, 2),
    "truncated data files": (lambda w: _truncate(w / "checkpoints" / "4"), 4, 2),
    "deleted state dir": (lambda w: shutil.rmtree(w / "checkpoints" / "4" / "state"), 4, 2),
    "empty step folder": (lambda w: (w / "checkpoints" / "205").mkdir(), 205, 4),
    "another step's state": (lambda w: (shutil.rmtree(w / "checkpoints" / "4" / "state"), shutil.copytree(
        w / "checkpoints" / "2" / "state", w / "checkpoints" / "4" / "state")), 4, 2),  # reads, but wrong values
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_newest_step_falls_back_bit_exactly(trained, tmp_path, warnings, fault):
    damage, bad, good = FAULTS[fault]
    workdir = _copy(trained, tmp_path)
    damage(workdir)
    resumed = _trainer(workdir)
    assert resumed.step == good
    _assert_same(_host(resumed), trained[1][good])
    (skipped,) = [w for w in warnings if "skipping" in w]
    assert f"skipping step {bad} of {workdir / 'checkpoints'}, it does not restore (" in skipped
    assert "\n" not in skipped
    if fault == "another step's state":
        assert "leaf ['opt_state'][0].count does not match its checksum (and" in skipped
    # Set aside, not deleted: out of Orbax's step list (its keep-k would count it, a save of that step collide).
    assert sorted(os.listdir(workdir / "checkpoints")) == sorted({"2", "4", f"{bad}.corrupt"} - {str(bad)})
    resumed.close()


def test_bit_flips_are_caught_and_never_restored_as_values(tmp_path, warnings):
    """Flips in OCDBT's b-tree nodes fail their CRC-32C; flips in a chunk (no checksum of its own: before, 18 of 20
    restored as wrong finite values) fail the step's checksums. Either way the older step restores; a flip in bytes
    nothing reads restores the newest step unchanged."""
    mesh = jax.make_mesh((8,), ("d",))
    rs = np.random.RandomState(0)
    states = {step: {"w": jax.device_put(rs.randn(256, 256).astype(np.float32), NamedSharding(mesh, P("d"))),
                     "b": jnp.arange(8, dtype=jnp.bfloat16) * step, "count": jnp.int32(step)} for step in (1, 2)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), states[1])
    source = tmp_path / "source"
    saver = Checkpointer(str(source), async_save=False)
    for step, state in states.items():
        saver.save(step, state, {"step": step})
    saver.close()
    outcomes = []
    for trial in range(6):
        workdir = tmp_path / f"trial{trial}"
        shutil.copytree(source, workdir)
        files = _data_files(workdir / "checkpoints" / "2")
        for f in files if trial % 2 else [max(files, key=os.path.getsize)]:  # each file, or the chunks' only
            _flip_bits(f, rs, n=1 + trial % 3)
        checkpointer, warnings[:] = Checkpointer(str(workdir)), []
        step, (state, _) = checkpointer.restore_newest(lambda s: checkpointer.restore(s, abstract), set_aside=False)
        checkpointer.close()
        _assert_same(jax.device_get(state), jax.device_get(states[step]))
        outcomes.append("checksum" if "match its checksum" in "".join(warnings) else "read" if step == 1 else "none")
        assert (step == 1) == any("skipping step 2 of" in w for w in warnings)
    assert outcomes.count("checksum") >= 2, outcomes  # ['checksum', 'read'] * 3 here


def test_meta_edits_and_checkpoints_without_checksums(tmp_path, warnings):
    state = {"w": jnp.ones((4, 4))}
    saver = Checkpointer(str(tmp_path), async_save=False)
    saver.save(1, state, {"step": 1})
    saver.save(2, state, {"step": 2})
    saver.close()
    path = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "step": 6}))  # a flip of one bit: '2' -> '6'; still valid JSON
    checkpointer = Checkpointer(str(tmp_path))
    step, meta = checkpointer.restore_newest(checkpointer.read_meta, set_aside=False)
    assert (step, meta["step"]) == (1, 1) and "step 2 of" in warnings[0] and "its meta does not match" in warnings[0]
    # Saved before checksums: restored, with a warning that it was not verified.
    path.write_text(json.dumps({"step": 2}))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    assert checkpointer.restore(2, abstract)[1] == {"step": 2}
    assert "step 2 restored unverified" in warnings[-1]
    checkpointer.close()


def test_no_step_restores_is_one_line_naming_the_workdir_and_the_newest_problem(trained, tmp_path, warnings):
    workdir = _copy(trained, tmp_path)
    _truncate(workdir / "checkpoints" / "2")
    shutil.rmtree(workdir / "checkpoints" / "4" / "state")
    with pytest.raises(ValueError) as error:
        _trainer(workdir)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"workdir={workdir}: none of the 2 checkpoints in ")
    assert "restores; the newest, step 4: its state does not read: FileNotFoundError" in message
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]  # nothing moved when nothing restores


def test_a_state_of_other_leaves_is_refused_in_one_line_and_no_step_is_skipped(trained, tmp_path, warnings):
    """A resume under another optimizer (its state of other leaves) is not damage: one line naming the step, the
    leaves on either side and the ways on, no older step tried, nothing moved aside; params_only restores."""
    workdir = _copy(trained, tmp_path)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    with pytest.raises(StateMismatchError) as error:
        _trainer(workdir, optimizer=clipped)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"step 4 of {workdir / 'checkpoints'} holds another training "
                                                      "state than this run's (") and re.search(
        r"\d+ of its leaves not in this run's state, e\.g\. \['opt_state'\]\[0\]\.count; \d+ of this run's leaves "
        r"not saved, e\.g\. \['opt_state'\]\[1\]\[0\]\.count\)", message), message
    assert "Checkpointing(params_only=True)" in message
    assert warnings == [] and sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    fresh = _trainer(workdir, optimizer=clipped, checkpointing=engine.Checkpointing(params_only=True))
    assert fresh.step == 4
    _assert_same(jax.device_get(fresh.params), trained[1][4]["params"])
    fresh.close()


def test_saves_after_a_fallback_write_the_same_steps_again_and_keep_k_prunes(trained, tmp_path, warnings):
    workdir = _copy(trained, tmp_path)
    _garbage(workdir / "checkpoints" / "4")
    (workdir / "checkpoints" / "205").mkdir()
    resumed = _trainer(workdir, checkpointing=engine.Checkpointing(keep=2))
    assert resumed.step == 2 and [w.split(",")[0] for w in warnings if "skipping" in w] == [
        "checkpoint: skipping step 205 of " + str(workdir / "checkpoints"),
        "checkpoint: skipping step 4 of " + str(workdir / "checkpoints")]
    resumed.fit(EXAMPLES, per_device_batch_size=2, max_steps=8, save_every=2)
    resumed.close()
    assert sorted(os.listdir(workdir / "checkpoints")) == ["205.corrupt", "4.corrupt", "6", "8"]
    warnings[:] = []
    again = _trainer(workdir)
    assert again.step == 8 and not warnings
    _assert_same(_host(again), _host(resumed))
    again.close()


def test_best_and_restore_params_fall_back_and_verify(trained, tmp_path, warnings):
    workdir = _copy(trained, tmp_path)
    for step in (2, 4):  # the best checkpoints: the same format, under workdir/best
        shutil.copytree(workdir / "checkpoints" / str(step), workdir / "best" / str(step))
    _truncate(workdir / "checkpoints" / "4")
    shutil.rmtree(workdir / "best" / "4" / "state")
    abstract, mesh = jax.eval_shape(task.init_params), engine.make_mesh(data=2, model=4)
    for checkpoint in ("latest", "best"):
        warnings[:] = []
        params, step = engine.restore_params(str(workdir), mesh=mesh, params=abstract, loss_fn=task.loss_fn,
                                             checkpoint=checkpoint)
        assert step == 2 and "skipping step 4 of" in warnings[0]
        _assert_same(jax.device_get(params), trained[1][2]["params"])
    best = _trainer(workdir, checkpointing=engine.Checkpointing(restore="best", params_only=True))
    assert best.step == 2
    _assert_same(_host(best)["params"], trained[1][2]["params"])
    assert sorted(os.listdir(workdir / "best")) == ["2", "4"]  # readers move nothing
    shutil.rmtree(workdir / "best" / "2" / "meta")
    with pytest.raises(ValueError, match=r"^workdir=.*: none of the 2 checkpoints in .*best restores; the newest, "
                                         r"step 4: its state does not read"):
        engine.restore_params(str(workdir), mesh=mesh, params=abstract, loss_fn=task.loss_fn, checkpoint="best")


def test_fit_with_save_best_sets_an_unreadable_best_aside(trained, tmp_path, warnings):
    workdir = _copy(trained, tmp_path)
    (workdir / "best" / "205").mkdir(parents=True)
    trainer = _trainer(workdir)
    trainer.fit(EXAMPLES, per_device_batch_size=2, max_steps=5, eval_examples=EXAMPLES[:8], eval_every=1,
                save_best=("loss", "min"))
    trainer.close()
    assert trainer.best["step"] == 5 and sorted(os.listdir(workdir / "best")) == ["205.corrupt", "5"]
    assert any("skipping step 205 of" in w for w in warnings)


def test_checksums_do_not_depend_on_the_mesh_and_catch_every_single_bit_flip():
    rs = np.random.RandomState(0)
    tree = {"f32": rs.randn(8, 6).astype(np.float32), "bf16": rs.randn(4, 8).astype(jnp.bfloat16),
            "i8": rs.randint(-100, 100, (16,)).astype(np.int8), "mask": rs.rand(8, 2) > 0.5,
            "scalar": np.float32(3.0), "empty": np.zeros((0, 3), np.float32)}
    want = checksums(tree)
    on = lambda mesh, spec: {k: jax.device_put(v, NamedSharding(mesh, spec(v))) for k, v in tree.items()}  # noqa
    assert checksums(on(jax.make_mesh((8,), ("a",)), lambda v: P("a") if v.ndim and v.shape[0] == 8 else P())) == want
    assert checksums(on(jax.make_mesh((2, 4), ("x", "y")),
                        lambda v: P("y", "x") if v.shape[:2] in ((8, 6), (4, 8)) else P())) == want
    host = NamedSharding(jax.make_mesh((8,), ("a",)), P()).with_memory_kind("pinned_host")
    assert checksums({k: jax.device_put(v, host) for k, v in tree.items()}) == want  # an offloaded state
    for name in ("f32", "bf16", "i8", "scalar"):
        raw = np.atleast_1d(tree[name]).view(np.uint8).reshape(-1)
        for bit in range(raw.size * 8):
            flipped = raw.copy()
            flipped[bit // 8] ^= 1 << (bit % 8)
            leaf = flipped.view(tree[name].dtype).reshape(np.shape(tree[name]))
            assert checksums({name: leaf})[f"['{name}']"] != want[f"['{name}']"], (name, bit)
    swapped = dict(tree, f32=tree["f32"][::-1])
    assert checksums(swapped)["['f32']"] != want["['f32']"]
