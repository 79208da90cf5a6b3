"""Goodput: where a run's wall time went. `fit` accounts every second of its call to compiling (and placing or
restoring the state), waiting for input, checkpoint stalls, evals, and the rest, the productive steps (device work
and the loop's own host time); a run's record is rewritten at each log point and save under
`workdir/goodput.json`, so a restart reads what the previous runs spent and how much of it was lost: the time a run
spent past the checkpoint its successor restored from (those steps are trained again), plus that successor's
restore. `scalars(step)` is what `fit` writes to TensorBoard (`goodput/`) at its end, `summary(scalars)` the one
line it logs.
MaxText's goodput recorder is the anchor: productive time over all the time the job held its devices."""
import json
import os
import time

from absl import logging

FILE = "goodput.json"
CATEGORIES = ("compile", "input", "checkpoint", "eval")


class Goodput:
    """One `fit` call's accounting. workdir: where the runs' records live (None: this call's figures only).
    step: the step the call starts at. restore_s: seconds the Trainer spent restoring before it (counted as lost
    to a restart). clock: seconds, monotonic (tests pass their own)."""

    def __init__(self, workdir, step, restore_s=0.0, *, clock=time.perf_counter, write=True):
        self._clock, self._started = clock, clock()
        self.workdir, self.write = workdir, write and workdir is not None
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.start_step, self.step, self.saved = step, step, (step, 0.0)  # saved: (step, seconds into the run)
        self.restore_s = restore_s
        self.runs = _read(workdir)
        previous = self.runs[-1] if self.runs else None
        # Work a previous run did past the checkpoint this one starts from is done again: lost to the restart.
        self.redone_s = 0.0
        if previous is not None and previous["step"] > step:
            self.redone_s = max(0.0, previous["wall_s"] - _seconds_at(previous, step))
        self._index = len(self.runs)

    def add(self, category, seconds):
        self.seconds[category] += seconds

    def timed(self, category):
        """A context adding its duration to `category`."""
        return _Timed(self, category)

    def note_save(self, step):
        """A checkpoint of `step` started now: work after it would be lost to a crash."""
        self.saved = (step, self.wall_s())

    def wall_s(self):
        return self._clock() - self._started

    def record(self, step):
        """This call's figures at `step` (and rewrites workdir/goodput.json with them when writing)."""
        self.step = step
        wall = self.wall_s()
        run = {"start_step": self.start_step, "step": step, "wall_s": wall, "saved_step": self.saved[0],
               "saved_at_s": self.saved[1], "restore_s": self.restore_s, "redone_s": self.redone_s,
               **{f"{k}_s": v for k, v in self.seconds.items()},
               "productive_s": max(0.0, wall - sum(self.seconds.values()))}
        self._last = run
        if self.write:
            runs = self.runs[:self._index] + [run]
            path = os.path.join(self.workdir, FILE)
            try:
                with open(path + ".tmp", "w") as f:
                    json.dump(runs, f, indent=1)
                os.replace(path + ".tmp", path)
            except OSError as e:  # the accounting never stops a run (a full disk is the checkpoints' to report)
                logging.warning("goodput: cannot write %s (%s); this run's record stops here", path, e)
                self.write = False
        return run

    def scalars(self, step):
        """{name: value} for TensorBoard: seconds per category of this call, the time lost to the restart before
        it, and `fraction`: productive seconds over this call's wall time plus that loss."""
        run = self.record(step)
        lost = run["restore_s"] + run["redone_s"]
        return {**{k: run[f"{k}_s"] for k in CATEGORIES}, "productive": run["productive_s"], "lost_to_restart": lost,
                "fraction": run["productive_s"] / max(1e-9, run["wall_s"] + lost)}

    def summary(self, scalars):
        """The one line `fit` logs at its end, from this call's `scalars(step)`: its wall time split, and the
        workdir's total over its runs."""
        s = scalars
        parts = ", ".join(f"{k} {s[k]:.1f} s" for k in ("productive", *CATEGORIES, "lost_to_restart"))
        line = f"goodput {100 * s['fraction']:.1f}% of {self._last['wall_s'] + s['lost_to_restart']:.1f} s: {parts}"
        if self.runs:
            runs = self.runs[:self._index] + [self._last]
            total = sum(r["wall_s"] + r["restore_s"] for r in runs)
            productive = sum(r["productive_s"] for r in runs) - sum(r["redone_s"] for r in runs)
            line += (f"; this workdir's {len(runs)} runs: {100 * productive / max(1e-9, total):.1f}% of "
                     f"{total:.1f} s")
        return line


class _Timed:
    def __init__(self, goodput, category):
        self._goodput, self._category = goodput, category

    def __enter__(self):
        self._started = self._goodput._clock()

    def __exit__(self, *exc):
        self._goodput.add(self._category, self._goodput._clock() - self._started)


def _read(workdir):
    path = None if workdir is None else os.path.join(workdir, FILE)
    if path is None or not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            runs = json.load(f)
        return runs if isinstance(runs, list) else []
    except (OSError, ValueError):  # a record cut short (a full disk): the accounting starts afresh, training not
        return []


def _seconds_at(run, step):
    """The seconds into `run` at which it had trained to `step` (its last save, else proportionally)."""
    if run["saved_step"] == step:
        return run["saved_at_s"]
    done = max(1, run["step"] - run["start_step"])
    return run["wall_s"] * min(1.0, max(0.0, (step - run["start_step"]) / done))
