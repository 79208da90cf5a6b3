"""One run per workdir (`engine.workdir_lock`): a Trainer on a workdir another process holds is refused in one line;
Trainers of one process share it; close() and the holder's death (kill -9 included) release it; a Trainer of the
best checkpoint, which writes nothing, takes none."""
import os
import signal
import socket
import subprocess
import sys

import jax
import optax
import pytest

import engine
from engine import workdir_lock
from tests import trainer_task as task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A second run: holds the workdir's lock until its stdin closes, or it is killed.
HOLDER = ("import sys; from engine import workdir_lock; workdir_lock.hold(sys.argv[1]); print('held', flush=True); "
          "sys.stdin.read()")


def _trainer(workdir, **kwargs):
    return engine.Trainer(mesh=engine.make_mesh(data=1, devices=jax.devices()[:1]),
                          params=task.init_params(), optimizer=optax.sgd(0.1), loss_fn=task.loss_fn,
                          collate_fn=task.collate_fn, workdir=workdir, **kwargs)


def _holder(workdir):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.stdout.readline().strip() == "held"
    return proc


def _can_take(workdir):
    """Whether another process can take the lock now."""
    proc = subprocess.run([sys.executable, "-c", "import sys, fcntl; f = open(sys.argv[1], 'a'); "
                           "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)", os.path.join(workdir, ".lock")],
                          capture_output=True, timeout=60)
    return proc.returncode == 0


def test_a_workdir_another_run_holds_is_refused_until_that_run_ends(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(ValueError) as refused:
            _trainer(str(tmp_path))
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"workdir={tmp_path} is in use by another run (process "
                                                          f"{holder.pid} on {socket.gethostname()}, ")
        assert message.endswith("expected one run per workdir: wait for that run to end, or use another workdir")
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: the operating system drops its lock
        holder.wait()
    trainer = _trainer(str(tmp_path))
    examples = task.make_examples(8)
    trainer.fit(examples, per_device_batch_size=4, max_steps=1, eval_examples=examples, eval_every=1,
                save_best=("loss", "min"))
    assert trainer.step == 1 and not _can_take(tmp_path)
    trainer.close()
    assert _can_take(tmp_path)
    holder = _holder(tmp_path)  # a Trainer of the best checkpoint writes nothing: it may read a workdir in use
    try:
        best = _trainer(str(tmp_path), checkpointing=engine.Checkpointing(params_only=True, restore="best"))
        assert best.step == 1
        best.close()
    finally:
        holder.stdin.close()
        holder.wait()


def test_readers_leave_the_save_another_run_has_in_progress(tmp_path):
    """engine.restore_params (generate.py, export_hf.py, --init_from) and a Trainer of the best checkpoint read a
    workdir another run may be saving to: its unfinished saves (Orbax's `<step>.orbax-checkpoint-tmp-*`
    directories) stay. A reader cleaning them up, as a writer does at its start, deleted the live run's save in
    progress and that run died."""
    trainer = _trainer(str(tmp_path))
    examples = task.make_examples(8)
    trainer.fit(examples, per_device_batch_size=4, max_steps=1, eval_examples=examples, eval_every=1,
                save_best=("loss", "min"))
    trainer.close()
    pending = [tmp_path / name / "7.orbax-checkpoint-tmp-1765000000000000" for name in ("checkpoints", "best")]
    for path in pending:
        (path / "state").mkdir(parents=True)
    mesh = engine.make_mesh(data=1, devices=jax.devices()[:1])
    for checkpoint in ("latest", "best"):
        _, step = engine.restore_params(str(tmp_path), mesh=mesh, params=task.init_params(), loss_fn=task.loss_fn,
                                        checkpoint=checkpoint)
        assert step == 1
    best = _trainer(str(tmp_path), checkpointing=engine.Checkpointing(params_only=True, restore="best"))
    assert best.step == 1
    best.close()
    assert all(path.is_dir() for path in pending)


def test_trainers_of_one_process_share_the_lock_and_the_last_close_releases_it(tmp_path):
    first, second = _trainer(str(tmp_path)), _trainer(str(tmp_path))
    first.close()
    first.close()  # a second close drops no other Trainer's hold
    assert not _can_take(tmp_path)
    second.close()
    assert _can_take(tmp_path)
    holder = _holder(tmp_path)  # and another process takes it, then this one is refused
    try:
        with pytest.raises(ValueError, match="is in use by another run"):
            _trainer(str(tmp_path))
    finally:
        holder.stdin.close()
        holder.wait()
    assert str(tmp_path / ".lock") not in workdir_lock._held  # noqa: SLF001 - the refused Trainer keeps no hold
