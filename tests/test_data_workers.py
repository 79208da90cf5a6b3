"""Grain datasets as examples and worker processes in `engine.data.iterate_batches`: a grain.MapDataset is shuffled
per (seed, epoch) and resumed like a list, batches built in worker processes equal those built in-process, and what
cannot run in workers is refused in one line."""
import multiprocessing
import re
import threading

import numpy as np
import pytest

import engine
from engine import data
from engine.tasks import lm, sources, text_data

grain = pytest.importorskip("grain")

TOKENIZER = text_data.ByteTokenizer()
SEQ_LEN = 16


def encode_row(text):
    """A lazy dataset's per-example work: tokenise one document into one row of `pack`'s format (module level, so
    the worker processes unpickle it by reference)."""
    return sources.pack([text], TOKENIZER, SEQ_LEN)[0]


def _texts(n=150):
    return [f"document {i}: " + "word " * (i % 7) for i in range(n)]


def _batches(examples, workers=0, **kwargs):
    mesh = engine.make_mesh(data=4, model=2)
    kwargs = {"per_device_batch_size": 2, "accumulate": 2, "seed": 3, **kwargs}
    return [(i, n, {k: np.asarray(v) for k, v in b.items()})
            for i, n, b in data.iterate_batches(mesh, examples, lm.collate_lm, workers=workers, **kwargs)]


def _assert_same(a, b):
    assert [(i, n) for i, n, _ in a] == [(i, n) for i, n, _ in b]
    for (_, _, x), (_, _, y) in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


class _Source:
    """A Grain RandomAccessDataSource: len and indexing, nothing else."""

    def __init__(self, items):
        self._items = items

    def __len__(self):
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]


def test_is_random_access_reads_grain_and_streams_the_rest(tmp_path):
    texts = _texts(20)
    dataset = grain.MapDataset.source(texts).map(encode_row)
    for examples in (texts, tuple(texts), np.zeros((4, 3)), dataset, _Source(texts), grain.MapDataset.range(5)):
        assert data.is_random_access(examples), type(examples)
    (tmp_path / "a.jsonl").write_text("\n".join(f'"{t}"' for t in texts))
    text_data.write_tokens(texts, TOKENIZER, str(tmp_path / "tokens"))
    assert data.is_random_access(text_data.TokenWindows(str(tmp_path / "tokens"), SEQ_LEN))
    streamed = [(t for t in texts), iter(texts), dataset.to_iter_dataset(), sources.Mixture(
        str(tmp_path / "a.jsonl"), TOKENIZER, SEQ_LEN), {"a": 1}, "text", b"bytes", {1, 2}]
    for examples in streamed:
        assert not data.is_random_access(examples), type(examples)


def test_grain_dataset_is_shuffled_and_resumed_like_a_list():
    texts = _texts()
    rows = [encode_row(t) for t in texts]
    for examples in (grain.MapDataset.source(texts).map(encode_row), grain.MapDataset.source(_Source(rows))):
        for epoch in (0, 1):
            whole = _batches(examples, epoch=epoch)
            _assert_same(whole, _batches(rows, epoch=epoch))
            _assert_same(whole[3:], _batches(examples, epoch=epoch, start_batch=3))
        assert len(whole) == len(texts) // 16
        assert not np.array_equal(_batches(examples, epoch=0)[0][2]["input_ids"], whole[0][2]["input_ids"])
    ordered = _batches(grain.MapDataset.source(rows), shuffle=False, drop_remainder=False)
    assert ordered[-1][1] == len(texts) % 16
    _assert_same(ordered, _batches(rows, shuffle=False, drop_remainder=False))


@pytest.mark.slow  # starting the workers imports jax and grain in each: 20-60 s on a loaded 2-core machine
def test_workers_build_the_same_batches():
    dataset = grain.MapDataset.source(_texts()).map(encode_row)
    for kwargs in ({"epoch": 1, "start_batch": 2}, {"shuffle": False, "drop_remainder": False, "accumulate": 1}):
        _assert_same(_batches(dataset, workers=2, **kwargs), _batches(dataset, **kwargs))
    mesh = engine.make_mesh(data=4, model=2)
    batches = data.iterate_batches(mesh, dataset, lm.collate_lm, per_device_batch_size=2, workers=2)
    next(batches)
    batches.close()  # a consumer that stops early: the worker processes end with the generator
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"^collate_fn returned leaf \['x'\] of shape \(3,\); expected a leading batch "
                                         r"dimension of 8"):
        list(data.iterate_batches(mesh, dataset, _bad_collate, per_device_batch_size=2, workers=2))


@pytest.mark.slow  # worker start-up, as above
def test_fit_with_data_workers_trains_exactly_as_in_process():
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from tests import trainer_task as task  # noqa: PLC0415

    def run(workers):
        trainer = engine.Trainer(mesh=engine.make_mesh(data=4, model=2), collate_fn=task.collate_fn,
                                 loss_fn=task.loss_fn, params=task.init_params(), optimizer=optax.adam(1e-2))
        trainer.fit(grain.MapDataset.source(task.make_examples(64)), per_device_batch_size=2, max_steps=10,
                    data_workers=workers)
        return jax.device_get(trainer.params)

    for a, b in zip(jax.tree.leaves(run(2)), jax.tree.leaves(run(0))):
        np.testing.assert_array_equal(a, b)


# A process reading batches built by one Grain worker until Ctrl-C (SIGINT to its whole process group, as a terminal
# sends it), which it catches as the Trainer's handler would.
_INTERRUPTED = """
import sys
from absl import flags
flags.FLAGS.mark_as_parsed()
from engine import data
try:
    for k, item in enumerate(data._in_workers(lambda b: b, 0, 10**9, 1)):
        if k == 20:
            print("reading", flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def _ctrl_c(script, when, *, pythonpath=()):
    """Runs `script` in its own process group, sends the group SIGINT once the script prints the line `when` and
    returns (stdout, stderr)."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # SIGUSR1 dumps the script's threads: a script still running 120 s after the SIGINT fails with its stacks. SIGINT
    # raises KeyboardInterrupt as in a terminal even when pytest was started with it ignored (a background job of a
    # non-interactive shell: the script inherited SIG_IGN and never stopped).
    script = ("import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n" + script)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=":".join([root, *pythonpath])))
    try:
        assert proc.stdout.readline().strip() == when
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            with open(f"/proc/{proc.pid}/status") as f:  # whether SIGINT is blocked or ignored there
                masks = " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn")))
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)  # the dump written
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            pytest.fail(f"still running 120 s after SIGINT ({masks}); its threads:\n{err[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its workers too, whatever happened
        except ProcessLookupError:
            pass


@pytest.mark.slow  # worker start-up, as above
def test_ctrl_c_reaches_the_training_process_alone():
    """The workers ignore SIGINT: the process that runs them stops them (each printed a KeyboardInterrupt
    traceback before)."""
    out, err = _ctrl_c(_INTERRUPTED, "reading")
    assert out.strip() == "stopped" and "Traceback" not in err, err[-3000:]


# A fit with two Grain workers whose process is killed (as by the kernel's out-of-memory killer: no cleanup of any
# kind) once both workers run.
_KILLED = """
import os, threading, time
import jax, optax
import engine
from tests import trainer_task as task

def children():
    mine = str(os.getpid())
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == mine:
                    found.append(p)
        except OSError:
            pass
    return found

def kill_once_the_workers_run():
    while len(children()) < 3:  # two workers and the resource tracker
        time.sleep(0.2)
    time.sleep(1)
    print(os.getpid(), flush=True)
    os.kill(os.getpid(), 9)

if __name__ == "__main__":
    threading.Thread(target=kill_once_the_workers_run, daemon=True).start()
    trainer = engine.Trainer(mesh=engine.make_mesh(data=1, devices=jax.devices()[:1]), params=task.init_params(),
                             optimizer=optax.adam(1e-2), loss_fn=task.loss_fn, collate_fn=task.collate_fn)
    trainer.fit(task.make_examples(64), per_device_batch_size=2, max_steps=10**6, data_workers=2)
"""


@pytest.mark.slow  # worker start-up, as above
def test_workers_end_when_the_training_process_is_killed():
    """A kill -9 of the training process left its Grain workers orphaned (they kept running, a few hundred MB each,
    for minutes, and the resource tracker with them); each ends within a second or two of its parent's death."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED], cwd=root, stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    try:
        pid = int(proc.stdout.readline())
        proc.wait(timeout=60)
        assert pid == proc.pid
        group = lambda: [p for p in os.listdir("/proc") if p.isdigit() and _group_of(p) == pid]  # noqa: E731
        deadline = time.time() + 15
        while group() and time.time() < deadline:
            time.sleep(0.5)
        assert not group(), f"processes of the killed run still alive 15 s on: {group()}"
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def _group_of(pid):
    """The process group of /proc's `pid` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


# Reads every batch of two Grain workers and ends holding the last ones, as a training process ends right after its
# last steps.
_TO_THE_END = """
import numpy as np
from absl import flags
flags.FLAGS.mark_as_parsed()
from engine import data
batches = list(data._in_workers(lambda b: {"tokens": np.full((8, 2049), b, np.int32)}, 0, 12, 2))
print(len(batches), flush=True)
"""


@pytest.mark.slow  # worker start-up, as above
def test_a_run_with_workers_ends_without_a_leaked_shared_memory_warning():
    """A batch of token ids comes through a pipe, not a shared-memory block that Grain unlinks in a thread the
    ending process never runs (the resource tracker warned of "leaked shared_memory objects" at each run's end)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _TO_THE_END], cwd=root, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    assert done.returncode == 0 and done.stdout.split() == ["12"], done.stderr[-3000:]
    assert "leaked" not in done.stderr, done.stderr[-3000:]


# A module whose import in a Grain worker announces itself and then takes seconds, as a worker re-importing the
# script's modules does: a Ctrl-C sent then reaches a worker that has not yet run `worker_init_fn`.
_SLOW_START = """
import multiprocessing
import time

if multiprocessing.parent_process() is not None:
    print("worker starting", flush=True)
    time.sleep(3)


def build(b):
    return b
"""

_INTERRUPTED_AT_START = """
from absl import flags
flags.FLAGS.mark_as_parsed()
import slow_start
from engine import data
try:
    for item in data._in_workers(slow_start.build, 0, 10**9, 2):
        pass
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


@pytest.mark.slow  # worker start-up, as above
def test_ctrl_c_while_workers_start_reaches_the_training_process_alone(tmp_path):
    """SIGINT is blocked while Grain starts its workers, so one arriving during a worker's imports, before its
    `worker_init_fn`, prints no traceback there; the reading process still stops (a traceback per worker before)."""
    (tmp_path / "slow_start.py").write_text(_SLOW_START)
    out, err = _ctrl_c(_INTERRUPTED_AT_START, "worker starting", pythonpath=[str(tmp_path)])
    assert out.split()[-1:] == ["stopped"] and "Traceback" not in err, (out, err[-3000:])


def test_a_script_without_a_main_guard_is_refused_before_workers_start(tmp_path, monkeypatch):
    """Spawned workers import the main script again: without `if __name__ == "__main__":` its training ran in every
    worker, which died with pages of multiprocessing's bootstrapping error; refused in one line instead."""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    script = tmp_path / "train.py"
    script.write_text("import engine\ntrainer.fit(examples, per_device_batch_size=2, data_workers=2)\n")
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__=str(script)))
    dataset = grain.MapDataset.source(_texts(40)).map(encode_row)
    batches = data.iterate_batches(engine.make_mesh(data=4, model=2), dataset, lm.collate_lm, per_device_batch_size=2,
                                   workers=2, workers_name="data_workers")
    with pytest.raises(ValueError, match=rf"^data_workers=2: {re.escape(str(script))} has no `if __name__ == "
                                         r"\"__main__\":` guard, and every worker process imports it again .*, or "
                                         r"data_workers=0$"):
        next(batches)
    script.write_text("import engine\n\nif __name__ == '__main__':\n    main()\n")
    assert data._unguarded_main() is None  # noqa: SLF001
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace())  # an interactive session: no file
    assert data._unguarded_main() is None  # noqa: SLF001


def test_predictor_reads_a_grain_dataset_in_order():
    import jax.numpy as jnp  # noqa: PLC0415

    dataset = grain.MapDataset.source(list(range(37))).map(lambda i: {"x": np.float32(i)})
    predictor = engine.Predictor(mesh=engine.make_mesh(data=4, model=2),
                                 collate_fn=lambda rows: {"x": np.stack([r["x"] for r in rows])},
                                 pred_fn=lambda params, batch, rng: {"y": batch["x"] * params})
    out = predictor.predict(dataset, per_device_batch_size=2, params=jnp.float32(2.0))
    assert [float(o["y"]) for o in out] == [2.0 * i for i in range(37)]


def _bad_collate(rows):
    return {"x": np.zeros(3)}


def test_bad_input_is_refused_in_one_line(monkeypatch):
    texts = _texts(40)
    dataset = grain.MapDataset.source(texts).map(encode_row)
    mesh = engine.make_mesh(data=4, model=2)

    def refused(examples, collate_fn=lm.collate_lm, **kwargs):
        with pytest.raises(ValueError) as error:
            next(data.iterate_batches(mesh, examples, collate_fn, per_device_batch_size=2, **kwargs))
        assert "\n" not in str(error.value)
        return str(error.value)

    for workers in (-1, 1.5, True):
        assert refused(dataset, workers=workers).startswith(f"workers={workers!r}; expected an integer >= 0")
    assert refused(iter(texts), workers=2).startswith("workers=2 needs random-access examples (len and indexing")
    assert refused(iter(texts), workers=2, workers_name="data_workers").startswith(  # fit's and predict's name
        "data_workers=2 needs random-access examples")
    lock = threading.Lock()
    message = refused(dataset, lambda rows: lock and lm.collate_lm(rows), workers=2)
    assert message.startswith("workers=2: collate_fn (function) cannot be pickled for the worker processes "
                              "(TypeError: cannot pickle '_thread.lock' object)")
    message = refused(grain.MapDataset.source([lock] * 40), workers=2)
    assert message.startswith("workers=2: examples (SourceMapDataset) cannot be pickled")
    monkeypatch.setattr(data, "_MAX_PICKLED", 1 << 20)
    message = refused([np.zeros(SEQ_LEN + 1, np.int32)] * 4 + [np.zeros(1 << 18)], workers=2)
    assert message.startswith("workers=2: examples (list) pickles to 2 MiB, copied into every worker; expected under "
                              "1 MiB")
    assert refused(dataset.repeat()).startswith("examples (RepeatMapDataset) has 9223372036854775807 examples, an "
                                                "endless dataset")
