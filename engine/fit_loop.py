"""The pieces `Trainer.fit` calls around its step: its argument checks, the progress bar and the log line's progress,
the profiler window and the signals that stop it. Logging, eval and checkpoints stay with the Trainer, whose state
they read."""
import contextlib
import signal
import sys
import threading
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from engine.config import check

BEST_MODES = ("min", "max")


def _count(value, minimum):
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_fit_arguments(*, workdir, per_device_batch_size, n_epochs, total_epochs, max_steps, log_every, save_every,
                        eval_examples, eval_predictor, eval_metric_fn, eval_every, save_best, early_stopping_patience,
                        profile_steps):
    """`fit`'s one-line ValueErrors for its arguments, each naming the argument, its value and what was expected."""
    check("per_device_batch_size", per_device_batch_size, _count(per_device_batch_size, 1), "an integer >= 1")
    check("n_epochs", n_epochs, n_epochs is None or _count(n_epochs, 1), "None or an integer >= 1")
    check("total_epochs", total_epochs, total_epochs is None or _count(total_epochs, 1), "None or an integer >= 1")
    if n_epochs is not None and total_epochs is not None:
        raise ValueError(f"n_epochs={n_epochs} and total_epochs={total_epochs}; expected one of them (n_epochs: "
                         "epochs more from this call; total_epochs: the epoch count over the Trainer's life)")
    check("max_steps", max_steps, max_steps is None or (isinstance(max_steps, int) and max_steps >= 0),
          "None or an integer >= 0")
    check("log_every", log_every, isinstance(log_every, int) and log_every >= 1, "an integer >= 1")
    check("save_every", save_every, save_every is None or (isinstance(save_every, int) and save_every >= 1),
          "None or an integer >= 1")
    if (eval_predictor is None) != (eval_metric_fn is None):
        raise ValueError("eval_predictor and eval_metric_fn go together; got only one of them")
    check("eval_every", eval_every, eval_every is None or (_count(eval_every, 1) and eval_examples is not None),
          "None or an integer >= 1, with eval_examples")
    if save_best is not None:
        ok = (isinstance(save_best, (tuple, list)) and len(save_best) == 2 and isinstance(save_best[0], str)
              and save_best[1] in BEST_MODES)
        check("save_best", save_best, ok, "None or (metric, 'min' | 'max'), e.g. ('loss', 'min')")
        check("save_best", save_best, eval_examples is not None and workdir is not None,
              "None without eval_examples and a workdir (the best is chosen by eval and saved there)")
        check("save_best", save_best, save_best[0] == "loss" or eval_metric_fn is not None,
              "('loss', mode) without eval_metric_fn (the eval reports only its loss)")
    check("early_stopping_patience", early_stopping_patience, early_stopping_patience is None or (
        _count(early_stopping_patience, 1) and save_best is not None), "None or an integer >= 1, with save_best")
    if profile_steps is not None:
        ok = (isinstance(profile_steps, (tuple, list)) and len(profile_steps) == 2
              and all(isinstance(x, int) for x in profile_steps) and 0 <= profile_steps[0] < profile_steps[1])
        check("profile_steps", profile_steps, ok and workdir is not None,
              "(start, end) with 0 <= start < end, and a workdir to write the trace to")


class SecondSignal(KeyboardInterrupt):
    """A second SIGTERM / SIGINT during `fit`: the run ends at once. `signum` is that signal's number (a script exits
    with 128 + it)."""

    def __init__(self, signum):
        super().__init__(f"second signal ({signal.Signals(signum).name}): stopped at once")
        self.signum = signum


class StoppedBySignal(SystemExit):
    """Raised by `fit` after a SIGTERM / SIGINT stopped it and its checkpoint was saved, so that the program ends
    even when `fit` is called in the user's own loop (a `SystemExit`: `except Exception` does not catch it, and
    uncaught it ends the process with status 128 + the signal's number, 143 for SIGTERM, as a shell reports a
    signal; a scheduler then tells a preempted run from a finished one). `signum`: the signal (SIGTERM when a
    peer process received it); `step`: the step the checkpoint holds; `saved`: whether one was saved (False
    without a workdir)."""

    def __init__(self, signum, step, saved=True):
        super().__init__(128 + signum)
        self.signum, self.step, self.saved = signum, step, saved

    def __str__(self):
        saved = "checkpoint saved" if self.saved else "nothing saved: no workdir, or no step trained"
        return f"stopped by {signal.Signals(self.signum).name} at step {self.step} ({saved}); exit status {self.code}"


class Stop:
    """Whether `fit` should stop for a signal. `signum`: the first SIGTERM / SIGINT this process received. With
    several processes the decision is agreed: every process calls `agree()` at the same steps (the log points) and
    all stop when any has a signal, so their collectives stay in step (a stop seen by one process alone used to
    leave the others waiting in the next step's collective)."""

    def __init__(self):
        self.event, self.signum, self.agreed = threading.Event(), None, False
        self.processes = jax.process_count()

    def set(self, signum):
        self.signum = self.signum or signum
        self.event.set()

    def agree(self):
        if self.processes > 1:
            flags = multihost_utils.process_allgather(np.int32(self.event.is_set()))
            self.agreed = bool(np.any(flags))

    def __call__(self):
        return self.agreed if self.processes > 1 else self.event.is_set()


@contextlib.contextmanager
def stop_on_signal():
    """Yields a `Stop` that SIGTERM and SIGINT (Ctrl-C) set: the loop stops after the current step (with several
    processes, after the step they agree on) and saves. A second signal ends the run at once: `SecondSignal` (a
    KeyboardInterrupt), no new checkpoint (the last finished one stays). The previous handlers come back on exit (off
    the main thread no handler is installed)."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.event.is_set():
            raise SecondSignal(signum)
        stop.set(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


class Profiler:
    """A `jax.profiler` trace of the steps `[start, end)` (`fit(profile_steps=)`) under `directory`."""

    def __init__(self, steps, directory, before_stop):
        self.steps, self.directory, self._before_stop, self.active = steps, directory, before_stop, False

    def before_step(self, step):
        if self.steps is not None and step == self.steps[0] and not self.active:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after_step(self, step, params):
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(params)
            self.stop()
            logging.info("profile of steps %d-%d written to %s", self.steps[0], self.steps[1], self.directory)

    def stop(self):
        if self.active:
            self._before_stop()
            jax.profiler.stop_trace()
            self.active = False


def progress_text(step, total, seconds_per_step):
    """The log line's progress: 'step 120/400 [######----------] 30% eta 0:01:02', or 'step 120' when the total is
    unknown."""
    if not total:
        return f"step {step}"
    done = min(1.0, step / total)
    bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
    return f"step {step}/{total} [{bar}] {100 * done:.0f}% eta {_eta(total - step, seconds_per_step)}"


def _eta(steps_left, seconds_per_step):
    eta = int(max(0, steps_left) * seconds_per_step)
    return f"{eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"


class ProgressBar:
    """One console line redrawn in place on stderr: steps done of the planned total, a bar, the latest loss, examples
    per second and the time left; `line` prints a line above it (the evals). Disabled: does nothing."""

    def __init__(self, enabled, stream=None):
        self.enabled, self.stream = bool(enabled), stream or sys.stderr
        self._drawn, self._loss, self._start = False, None, None

    def update(self, step, total, rows, loss=None):
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = (now, step)
        self._loss = loss if loss is not None else self._loss
        seconds = (now - self._start[0]) / max(1, step - self._start[1]) if step > self._start[1] else None
        text = f"step {step}" + (f"/{total}" if total else "")
        if total:
            done = min(1.0, step / total)
            text += f" [{'#' * int(24 * done)}{'.' * (24 - int(24 * done))}] {100 * done:3.0f}%"
        if self._loss is not None:
            text += f" | loss {self._loss:.4f}"
        if seconds:
            text += f" | {rows / seconds:.1f} examples/s"
            if total:
                text += f" | eta {_eta(total - step, seconds)}"
        self.stream.write("\r" + text + "\033[K")
        self.stream.flush()
        self._drawn = True

    def line(self, text):
        if not self.enabled:
            return
        self.stream.write(("\r\033[K" if self._drawn else "") + text + "\n")
        self.stream.flush()
        self._drawn = False

    def close(self):
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
