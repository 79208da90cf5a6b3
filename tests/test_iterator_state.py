"""Streamed examples whose iterator is stateful (`get_state` / `set_state`, Grain's protocol): `fit` saves the state
of the last trained batch in every checkpoint and a restored Trainer sets a fresh iterator to it, so a restart reads
none of the examples it trained on and ends bit for bit where the uninterrupted run ends."""
import json
import os
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import optax
import pytest

import engine
from engine import data
from engine.tasks import sources, text_data
from tests import trainer_task as task

EXAMPLES = task.make_examples(64)  # 8 global batches of 8 on data=4 x model=2 with per_device_batch_size=2


class _Crash(Exception):
    pass


class CountingStream:
    """An iterable over `examples` in order (not random access: no len) whose iterators have get_state / set_state.
    Records the position of every example drawn, across its iterators; raises `_Crash` (a killed process's
    stand-in) instead of drawing the `crash_at`-th example."""

    def __init__(self, examples, crash_at=None, on_draw=None):
        self.examples, self.crash_at, self.on_draw = examples, crash_at, on_draw
        self.drawn, self.set_states = [], []

    def __iter__(self):
        return _CountingIterator(self)


class _CountingIterator:
    def __init__(self, stream):
        self.stream, self.position = stream, 0

    def __iter__(self):
        return self

    def __next__(self):
        stream = self.stream
        if self.position >= len(stream.examples):
            raise StopIteration
        if len(stream.drawn) == stream.crash_at:
            raise _Crash("killed")
        stream.drawn.append(self.position)
        self.position += 1
        if stream.on_draw is not None:
            stream.on_draw(self.position)
        return stream.examples[self.position - 1]

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.stream.set_states.append(state)
        self.position = state["position"]


class StatelessStream(CountingStream):
    """The same stream without get_state / set_state: a resume re-reads and skips."""

    def __iter__(self):
        return (example for example in _CountingIterator(self))


def _trainer(**kwargs):
    kwargs.setdefault("loss_fn", task.loss_fn)
    kwargs.setdefault("collate_fn", task.collate_fn)
    return engine.Trainer(mesh=engine.make_mesh(data=4, model=2), params=task.init_params(),
                          optimizer=optax.adam(1e-2), **kwargs)


def _assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(x, y)  # bit for bit


@pytest.mark.parametrize("step", ["jit", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_a_restart_sets_the_iterators_state_and_reads_nothing_it_trained_on(step, tmp_path):
    common, examples = dict(parallelism=engine.Parallelism(step=step)), EXAMPLES[:32]  # 4 batches an epoch
    whole = _trainer(**common)
    whole.fit(CountingStream(examples), per_device_batch_size=2, n_epochs=2)
    # Dies drawing the 53rd example: in epoch 1's batch 2 (examples 16-23), after step 6's checkpoint.
    crashed = _trainer(workdir=str(tmp_path), **common)
    with pytest.raises(_Crash):
        crashed.fit(CountingStream(examples, crash_at=32 + 20), per_device_batch_size=2, n_epochs=2, save_every=3)
    crashed.close()
    rerun = _trainer(workdir=str(tmp_path), **common)
    assert (rerun.step, rerun.epoch, rerun._state.iterator_state) == (6, 1, {"position": 16})
    stream = CountingStream(examples)
    rerun.fit(stream, per_device_batch_size=2, n_epochs=2)
    assert stream.set_states == [{"position": 16}]
    assert stream.drawn == list(range(16, 32))  # the rest of epoch 1, each example once
    assert (rerun.step, rerun.epoch, rerun._state.iterator_state) == (whole.step, whole.epoch, None) == (8, 2, None)
    _assert_equal(rerun.params, whole.params)
    rerun.close()


def test_without_get_state_a_restart_reads_the_trained_examples_again_and_ends_the_same(tmp_path):
    whole = _trainer()
    whole.fit(StatelessStream(EXAMPLES), per_device_batch_size=2, max_steps=6)
    first = _trainer(workdir=str(tmp_path))
    first.fit(StatelessStream(EXAMPLES), per_device_batch_size=2, max_steps=3)
    first.close()
    rerun = _trainer(workdir=str(tmp_path))
    assert rerun._state.iterator_state is None
    stream = StatelessStream(EXAMPLES)
    rerun.fit(stream, per_device_batch_size=2, max_steps=6)
    assert stream.drawn[:30] == list(range(30))  # the 24 trained examples read again, then skipped
    _assert_equal(rerun.params, whole.params)
    rerun.close()


def test_the_checkpoint_holds_the_state_of_the_batch_trained_on_not_of_one_read_ahead(tmp_path):
    """The prefetch thread reads batches ahead of the step: step 1 waits (in a host callback) until it has drawn
    four batches, so its checkpoint is written while the live iterator stands at example 32; it records 8."""
    read_ahead = threading.Event()

    def loss_fn(params, batch, rng, is_training):
        jax.debug.callback(lambda: read_ahead.wait(60))
        return task.loss_fn(params, batch, rng, is_training)

    stream = CountingStream(EXAMPLES, on_draw=lambda position: position >= 32 and read_ahead.set())
    trainer = _trainer(workdir=str(tmp_path), loss_fn=loss_fn)
    trainer.fit(stream, per_device_batch_size=2, max_steps=1)
    trainer.close()
    assert read_ahead.is_set() and max(stream.drawn) >= 31
    restored = _trainer(workdir=str(tmp_path))
    assert (restored.step, restored._state.iterator_state) == (1, {"position": 8})
    again = CountingStream(EXAMPLES)
    restored.fit(again, per_device_batch_size=2, max_steps=2)
    assert again.set_states == [{"position": 8}] and again.drawn[0] == 8
    restored.close()


def test_a_state_that_is_not_json_is_one_line():
    class Opaque(CountingStream):
        def __iter__(self):
            iterator = _CountingIterator(self)
            iterator.get_state = lambda: {"position": object()}
            return iterator

    with pytest.raises(ValueError, match=r"^examples' iterator \(_CountingIterator\) get_state\(\) returned a dict "
                                         r"that is not JSON-serialisable .*; expected a JSON-able value"):
        _trainer().fit(Opaque(EXAMPLES), per_device_batch_size=2, max_steps=1)


def test_iterate_batches_reports_each_batchs_state_and_resumes_from_it():
    mesh = engine.make_mesh(data=4, model=2)
    kwargs = dict(per_device_batch_size=2, states=True)
    batches = list(data.iterate_batches(mesh, CountingStream(EXAMPLES), task.collate_fn, **kwargs))
    assert [(i, n, s) for i, n, _, s in batches] == [(i, 8, {"position": 8 * (i + 1)}) for i in range(8)]
    stream = CountingStream(EXAMPLES)
    resumed = list(data.iterate_batches(mesh, stream, task.collate_fn, start_batch=5, start_state={"position": 40},
                                        **kwargs))
    assert [i for i, *_ in resumed] == [5, 6, 7] and stream.drawn == list(range(40, 64))
    _assert_equal([b for *_, b, _ in resumed], [b for *_, b, _ in batches[5:]])
    assert [s for *_, s in data.iterate_batches(mesh, EXAMPLES, task.collate_fn, **kwargs)] == [None] * 8


# ------------------------------------------------------------------------------------------ sources.Mixture
def _mixture(tmp_path):
    (tmp_path / "a.txt").write_text("\n".join("abcdefgh" * (k % 5 + 1) for k in range(60)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": "xyz" * (k % 7 + 2)}) + "\n" for k in range(40)))
    return sources.Mixture(f"{tmp_path}/a.txt:0.7,{tmp_path}/b.jsonl:0.3", text_data.ByteTokenizer(),
                           task.SEQ)


def _collate_windows(rows):
    tokens = np.stack([row["tokens"] for row in rows]) % task.VOCAB
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def test_a_mixture_resumes_through_fit_from_its_state(tmp_path, monkeypatch):
    windows_before = []  # the window count of each draw: where in the mixture's stream it reads
    draw = sources.MixtureIterator.__next__

    def counted(self):
        windows_before.append(sum(self.windows))
        return draw(self)
    monkeypatch.setattr(sources.MixtureIterator, "__next__", counted)
    whole = _trainer(collate_fn=_collate_windows)
    whole.fit(_mixture(tmp_path), per_device_batch_size=2, max_steps=5)
    first = _trainer(collate_fn=_collate_windows, workdir=str(tmp_path / "w"))
    first.fit(_mixture(tmp_path), per_device_batch_size=2, max_steps=2)
    first.close()
    rerun = _trainer(collate_fn=_collate_windows, workdir=str(tmp_path / "w"))
    assert rerun._state.iterator_state["windows"] in ([11, 5], [12, 4])  # 16 windows trained, 0.7 : 0.3
    windows_before.clear()
    rerun.fit(_mixture(tmp_path), per_device_batch_size=2, max_steps=5)
    assert windows_before[0] == 16  # the first window read is the first one not trained on
    _assert_equal(rerun.params, whole.params)
    rerun.close()


def test_a_mixture_iterator_refuses_another_mixtures_state(tmp_path):
    mixture = _mixture(tmp_path)
    state = iter(mixture).get_state()
    other = sources.Mixture(f"{tmp_path}/a.txt", text_data.ByteTokenizer(), task.SEQ)
    with pytest.raises(ValueError, match=r"^data: the state is a position of the mixture '.*a.txt:.*' \(text "
                                         r"columns text,text\), not of '.*a.txt' \(text columns text\); expected "
                                         r"the same sources, weights and text columns"):
        iter(other).set_state(state)
    elsewhere = sources.Mixture(f"{tmp_path}/a.txt:0.7,{tmp_path}/b.jsonl#body:0.3", text_data.ByteTokenizer(),
                                task.SEQ)  # the same files and weights, the JSONL's documents in another field
    with pytest.raises(ValueError, match=r"\(text columns text,text\), not of .* \(text columns text,body\)"):
        iter(elsewhere).set_state(state)
    with pytest.raises(ValueError, match=r"^data: a list is not a position of this mixture; expected a "
                                         r"MixtureIterator.get_state\(\), a dict of \['files'"):
        iter(other).set_state([state])


def test_a_mixture_resumes_under_another_spelling_of_its_sources(tmp_path, monkeypatch):
    """The same files by a relative path, the same weights as other numbers: exactly the next window; a state saved
    with the files' digest as listed (before absolute paths) too."""
    mixture = _mixture(tmp_path)
    it = iter(mixture)
    for _ in range(9):
        next(it)
    state, want = it.get_state(), next(it)
    monkeypatch.chdir(tmp_path)
    other = sources.Mixture("a.txt:7,./b.jsonl:3", text_data.ByteTokenizer(), task.SEQ)
    listed = [sources._files_digest(files, absolute=False) for files in mixture.files]  # noqa: SLF001
    legacy = dict(state, files=listed)
    for saved in (state, legacy):
        resumed = iter(other)
        resumed.set_state(saved)
        assert (next(resumed)["tokens"] == want["tokens"]).all()


# ------------------------------------------------------------------------------------------ Grain
def test_a_grain_iter_dataset_resumes_from_its_iterators_state(tmp_path):
    grain = pytest.importorskip("grain")
    reads = []  # the indices the dataset read, in any order (Grain reads ahead in threads)
    dataset = grain.MapDataset.range(len(EXAMPLES)).map(lambda i: (reads.append(i), EXAMPLES[i])[1]).to_iter_dataset()
    assert not data.is_random_access(dataset)
    whole = _trainer()
    whole.fit(dataset, per_device_batch_size=2, max_steps=5)
    first = _trainer(workdir=str(tmp_path))
    first.fit(dataset, per_device_batch_size=2, max_steps=3)
    first.close()
    rerun = _trainer(workdir=str(tmp_path))
    assert rerun._state.iterator_state == iter(dataset).get_state() | {"next_index": 24}
    reads.clear()
    rerun.fit(dataset, per_device_batch_size=2, max_steps=5)
    assert min(reads) == 24  # nothing of the 3 trained batches read again
    _assert_equal(rerun.params, whole.params)
    rerun.close()


# ------------------------------------------------------------------------------------------ processes
TWO_PROCESS_SCRIPT = """
import os, sys
from tests.xla_flags import cpu_devices
os.environ["XLA_FLAGS"], os.environ["JAX_PLATFORMS"] = cpu_devices(4), "cpu"
import engine
from tests import test_iterator_state as t
coordinator, pid, workdir, mode = sys.argv[1:]
engine.initialize_distributed(coordinator, 2, int(pid), timeout_s=60)
stream = (t.ShiftedStream if mode == "differ" and pid == "1" else t.CountingStream)(t.EXAMPLES)
trainer = t._trainer(workdir=workdir)
trainer.fit(stream, per_device_batch_size=2, max_steps=3)
trainer.close()
"""


class ShiftedStream(CountingStream):
    """Its iterators report positions one ahead: a process whose stream state differs from the other's."""

    def __iter__(self):
        iterator = _CountingIterator(self)
        iterator.get_state = lambda: {"position": iterator.position + 1}
        return iterator


def _two_processes(workdir, mode):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        address = f"localhost:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "ENGINE_", "SLURM_"))}
    env["PYTHONPATH"] = root
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESS_SCRIPT, address, str(pid), str(workdir), mode],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in (0, 1)]
    return [(p.communicate(timeout=300)[0], p.returncode) for p in procs]


@pytest.mark.slow  # two 2-process runs
def test_a_two_process_run_resumes_its_stream_on_one_process_and_differing_states_are_refused(tmp_path):
    """Every process draws the whole stream (and collates its own rows), so the state is global: 2 processes x 4
    devices train 3 steps, one process of 8 devices continues from the state without reading a trained example,
    ending where a one-process run ends. Processes whose iterators report different states are refused at the save."""
    for log, code in _two_processes(tmp_path / "w", "same"):
        assert code == 0, log[-3000:]
    whole = _trainer()
    whole.fit(CountingStream(EXAMPLES), per_device_batch_size=2, max_steps=6)
    rerun = _trainer(workdir=str(tmp_path / "w"))
    assert (rerun.step, rerun._state.iterator_state) == (3, {"position": 24})
    stream = CountingStream(EXAMPLES)
    rerun.fit(stream, per_device_batch_size=2, max_steps=6)
    assert stream.set_states == [{"position": 24}] and stream.drawn[0] == 24
    for x, y in zip(jax.tree.leaves(jax.device_get(rerun.params)), jax.tree.leaves(jax.device_get(whole.params))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # 3 of its steps reduced across two processes
    rerun.close()
    for log, code in _two_processes(tmp_path / "differ", "differ"):
        assert code != 0 and "ValueError: train_examples: the iterator states differ between processes at step 3" \
            in log, log[-3000:]
