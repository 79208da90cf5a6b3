"""Goodput (engine/goodput.py): every second of a `fit` call is in one category, the record a restart reads is
written as the run goes, and a restart counts the work done again past the checkpoint it restored and its restore."""
import json

import optax
import pytest

import engine
from engine.goodput import FILE, Goodput
from tests import trainer_task as task


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_categories_and_the_time_a_restart_lost(tmp_path):
    clock = _Clock()
    first = Goodput(str(tmp_path), step=0, clock=clock)
    with first.timed("compile"):
        clock.now += 4.0
    first.add("input", 1.0)
    clock.now += 4.0
    first.note_save(6)  # step 6 saved 8 s into the run ...
    clock.now += 6.0
    run = first.record(9)  # ... which reached step 9 at 14 s, then died
    assert run["wall_s"] == 14.0 and run["productive_s"] == 9.0 and run["compile_s"] == 4.0
    assert json.loads((tmp_path / FILE).read_text())[0]["step"] == 9
    second = Goodput(str(tmp_path), step=6, restore_s=2.0, clock=clock)  # restored step 6: steps 7-9 again
    assert second.redone_s == 6.0
    clock.now += 5.0
    scalars = second.scalars(12)
    assert scalars["lost_to_restart"] == 8.0 and scalars["productive"] == 5.0
    assert scalars["fraction"] == pytest.approx(5.0 / 13.0)
    line = second.summary(scalars)
    assert line.startswith("goodput 38.5% of 13.0 s: productive 5.0 s, compile 0.0 s, input 0.0 s, checkpoint "
                           "0.0 s, eval 0.0 s, lost_to_restart 8.0 s; this workdir's 2 runs: "), line
    assert [r["step"] for r in json.loads((tmp_path / FILE).read_text())] == [9, 12]


class _Crash(Exception):
    pass


def test_fit_accounts_its_wall_time_and_a_restart_reads_what_was_lost(tmp_path):
    def trainer(collate_fn=task.collate_fn):
        return engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=collate_fn, loss_fn=task.loss_fn,
                              params=task.init_params(), optimizer=optax.adam(1e-3), workdir=str(tmp_path))

    def crashing(epoch):  # streamed in order in epoch 1, whose fourth batch never comes: the process dies
        if epoch == 0:
            return task.make_examples(64)
        return iter(task.make_examples(64)[:3 * 8] + [None] * 8)

    def collate(examples):
        if any(e is None for e in examples):
            raise _Crash
        return task.collate_fn(examples)

    first = trainer(collate)
    with pytest.raises(_Crash):
        first.fit(crashing, per_device_batch_size=1, n_epochs=2, save_every=5, log_every=1)
    first.close()
    (run,) = json.loads((tmp_path / FILE).read_text())
    assert run["step"] == 11 and run["saved_step"] == 10 and run["compile_s"] > 0
    assert run["productive_s"] + sum(run[f"{k}_s"] for k in ("compile", "input", "checkpoint", "eval")) == (
        pytest.approx(run["wall_s"]))
    again = trainer()
    again.fit(lambda epoch: task.make_examples(64), per_device_batch_size=1, n_epochs=2, log_every=1)
    runs = json.loads((tmp_path / FILE).read_text())
    assert [r["step"] for r in runs] == [11, 16] and runs[1]["start_step"] == 10
    assert runs[1]["restore_s"] > 0 and 0 < runs[1]["redone_s"] < run["wall_s"]
