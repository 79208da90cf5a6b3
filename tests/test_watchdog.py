"""The hang watchdog (engine/watchdog.py): an injected hang in the input pipeline and in a step ends the process with
`HANG_EXIT_CODE`, the log naming what it waited for and holding the hung thread's stack; the default limit follows
the measured steps, compiles excluded; normal steps slower than the minimum do not trip; bad arguments are one line.
A trip ends the process (os._exit), so those cases run in a subprocess (`start_python` / `finish`, for reuse by a
multi-process case)."""
import math
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from engine.watchdog import HANG_EXIT_CODE, Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A scenario's preamble: the whole log in a file, as a script's workdir log.txt (engine/tasks/cli.py) gets it.
_PREAMBLE = """\
import logging as std_logging, sys, threading
import numpy as np
from engine.watchdog import Watchdog
std_logging.getLogger().addHandler(std_logging.FileHandler(sys.argv[1]))
never = threading.Event()  # a hang: waited on, never set
"""


def start_python(code, *args, env=None):
    """Starts `python -c code args...` in the repository with JAX on the CPU; stdout and stderr together."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(process, timeout=60):
    """(exit status, output) of a `start_python` process; killed, and the test failed, after `timeout` s."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"no exit within {timeout} s:\n{output[-3000:]}")
    return process.returncode, output


def _run_scenario(body, tmp_path):
    log = tmp_path / "log.txt"
    status, output = finish(start_python(_PREAMBLE + textwrap.dedent(body), log))
    return status, output, log.read_text() if log.exists() else ""


def test_input_pipeline_hang_exits_with_the_status_and_the_stacks(tmp_path):
    """A batch iterator that blocks for ever in the Prefetcher's thread: after the minimum (the steps are
    instant), status 75, the log names the input pipeline and holds the blocked generator's frame."""
    status, output, log = _run_scenario("""
        from engine import data

        def batches():
            yield from range(3)
            never.wait()  # a read that never returns

        with Watchdog(factor=2, minimum_s=0.3) as watchdog:
            prefetched = iter(data.Prefetcher(batches()))
            for i in range(10):
                with watchdog.waiting(f"the input pipeline (batch {i} of epoch 0)"):
                    next(prefetched)
                watchdog.progress()
        print("not reached")
    """, tmp_path)
    assert status == HANG_EXIT_CODE, output[-3000:]
    assert "not reached" not in output
    assert "while waiting for the input pipeline (batch 3 of epoch 0)" in log
    assert "limit 0.3 s, 2x the slowest step" in log
    stacks = log[log.index("every thread's stack"):]
    assert stacks.startswith("every thread's stack:\nThread MainThread")  # the loop's thread first
    assert "in batches" in stacks and "in _run" in stacks  # the hung generator, inside the Prefetcher's thread
    assert "in batches" in output  # stderr has it too (absl's handler)


def test_hang_inside_a_step_exits_with_the_status(tmp_path):
    """A jitted step whose host callback blocks at step 3 (a stand-in for a device or a collective that never
    finishes): the trip names the nested waits and shows the callback's blocked frame."""
    status, output, log = _run_scenario("""
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback

        def host_read(step):
            if step == 3:
                never.wait()
            return np.int32(step)

        def train_step(step):
            return io_callback(host_read, jax.ShapeDtypeStruct((), jnp.int32), step) + 1

        with Watchdog(factor=3, minimum_s=0.3) as watchdog:
            with watchdog.waiting("compiling the train step", judged=False):
                compiled = jax.jit(train_step).lower(np.int32(0)).compile()
            for step in range(10):
                with watchdog.waiting(f"step {step}"), watchdog.waiting("the device"):
                    jax.block_until_ready(compiled(np.int32(step)))
                watchdog.progress()
        print("not reached")
    """, tmp_path)
    assert status == HANG_EXIT_CODE, output[-3000:]
    assert "while waiting for step 3 > the device;" in log
    # XLA:CPU runs so small a program in the calling thread: the callback's frame is the main thread's innermost.
    assert "in host_read" in log


class _Clock:
    """A monotonic clock the test moves: no test sleeps for a measured step. Each move stays below the limit in
    force, as the watchdog's thread reads this clock too."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_default_limit_follows_the_slowest_step_compile_excluded():
    clock = _Clock()
    with Watchdog(factor=10, minimum_s=1, clock=clock) as watchdog:
        assert watchdog.limit_s is None  # unarmed until a step was measured
        with watchdog.waiting("step 1"):
            with watchdog.waiting("compiling the train step", judged=False):
                clock.advance(100)
            clock.advance(0.2)
        watchdog.progress()
        assert watchdog.limit_s == pytest.approx(2.0)  # 10 x 0.2 s: the compile's 100 s excluded
        clock.advance(0.5)
        watchdog.progress()
        assert watchdog.limit_s == pytest.approx(5.0)
        clock.advance(0.05)
        watchdog.progress()
        assert watchdog.limit_s == pytest.approx(5.0)  # the slowest step stays the measure
        assert watchdog.steps == 3
    with Watchdog(factor=10, minimum_s=30, clock=clock) as floored:
        clock.advance(0.2)
        floored.progress()
        assert floored.limit_s == 30
    with Watchdog(7, clock=clock) as fixed:
        assert fixed.limit_s == 7
        clock.advance(6)
        fixed.progress()
        assert fixed.limit_s == 7  # a limit given overrides the measured steps


def test_zero_turns_the_watchdog_off():
    before = threading.active_count()
    with Watchdog(0) as off:
        with off.waiting("step 1"):
            off.progress()
        assert off.limit_s is None and threading.active_count() == before


def test_steps_slower_than_the_minimum_and_a_compile_do_not_trip(tmp_path):
    """Steps of 0.3 s against a 0.1 s minimum (the first step arms a 0.9 s limit), then a 1 s judged=False compile
    longer than that limit: the run finishes with status 0."""
    status, output, log = _run_scenario("""
        with Watchdog(factor=3, minimum_s=0.1) as watchdog:
            for step in range(4):
                with watchdog.waiting(f"step {step}"):
                    if step == 2:
                        with watchdog.waiting("compiling", judged=False):
                            never.wait(1.0)
                    never.wait(0.3)
                watchdog.progress()
            print("finished", watchdog.limit_s)
    """, tmp_path)
    assert status == 0, output[-3000:]
    assert "finished 0.9" in output and "hang" not in log


@pytest.mark.parametrize("kwargs", [
    {"limit_s": -1}, {"limit_s": math.nan}, {"limit_s": math.inf}, {"limit_s": "600"}, {"limit_s": False},
    {"factor": 0.5}, {"factor": math.nan}, {"minimum_s": 0}, {"minimum_s": -5.0},
    {"exit_code": 0}, {"exit_code": 256}, {"exit_code": 1.5}, {"exit_code": True}])
def test_bad_arguments_are_refused_in_one_line(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"^{name}=") as error:
        Watchdog(**kwargs)
    assert "\n" not in str(error.value) and "expected" in str(error.value)


# ------------------------------------------------------------------------------------------ inside Trainer.fit
_FIT_PREAMBLE = """\
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, optax, engine
from tests import trainer_task as task
trainer = engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=task.collate_fn, loss_fn=LOSS,
                         params=task.init_params(), optimizer=optax.adam(1e-3))
"""


def test_fit_with_a_hung_input_pipeline_exits_with_the_status_naming_it(tmp_path):
    status, output, log = _run_scenario(_FIT_PREAMBLE.replace("LOSS", "task.loss_fn") + textwrap.dedent("""
        def examples():  # the fourth batch never comes
            yield from task.make_examples(3 * 8)
            never.wait()

        trainer.fit(examples(), per_device_batch_size=1, log_every=1, hang_timeout=2)
        print("not reached")
    """), tmp_path)
    assert status == HANG_EXIT_CODE, output[-3000:]
    assert "not reached" not in output
    assert "while waiting for the input pipeline (batch 3 of epoch 0)" in log, log[-3000:]
    assert "in examples" in log  # the hung generator's frame


@pytest.mark.slow  # a second fit subprocess; the input pipeline's case above runs by default
def test_fit_with_a_hung_step_exits_with_the_status_naming_the_device(tmp_path):
    """A step whose host callback blocks (from its third call on): the loop waits at the next log point's fetch."""
    status, output, log = _run_scenario(textwrap.dedent("""
        import jax
        from tests import trainer_task as task
        calls = []

        def hook(loss):
            calls.append(1)
            if len(calls) >= 3:  # from the third call on
                never.wait()

        def loss_fn(params, batch, rng, is_training):
            loss, metrics = task.loss_fn(params, batch, rng, is_training)
            jax.debug.callback(hook, jax.lax.stop_gradient(loss))
            return loss, metrics
    """) + _FIT_PREAMBLE.replace("LOSS", "loss_fn") + textwrap.dedent("""
        trainer.fit(task.make_examples(64), per_device_batch_size=1, log_every=1, hang_timeout=2)
        print("not reached")
    """), tmp_path)
    assert status == HANG_EXIT_CODE, output[-3000:]
    assert "not reached" not in output
    assert "while waiting for the device and the other processes (steps " in log, log[-3000:]
    assert "in hook" in log


def test_fit_refuses_a_bad_hang_timeout_in_one_line():
    from tests import trainer_task as task  # noqa: PLC0415
    import engine  # noqa: PLC0415
    import optax  # noqa: PLC0415

    trainer = engine.Trainer(mesh=engine.make_mesh(data=8), collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                             params=task.init_params(), optimizer=optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"^hang_timeout=-1; expected None \(derived from the measured steps\)"):
        trainer.fit(task.make_examples(16), per_device_batch_size=1, hang_timeout=-1)


@pytest.mark.slow  # two processes
def test_one_of_two_processes_hung_ends_both_with_the_status(tmp_path):
    """Process 1's input pipeline blocks; process 0 then waits in the step's collectives for it. Each process's
    watchdog judges its own progress: both exit with the status, each log naming what that process waited for."""
    import socket  # noqa: PLC0415

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", f"localhost:{port}", "2", str(pid),
                               str(tmp_path / "out.npy"), "60", "hang"], cwd=ROOT, text=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for pid in (0, 1)]
    (status0, log0), (status1, log1) = (finish(p, timeout=180) for p in procs)
    assert status1 == HANG_EXIT_CODE, log1[-3000:]
    assert "while waiting for the input pipeline" in log1 and "in collate" in log1, log1[-3000:]
    assert status0 == HANG_EXIT_CODE, log0[-3000:]
    assert "while waiting for " in log0, log0[-3000:]
