"""The hang watchdog: a loop that makes no progress for longer than a limit writes every thread's stack to the log,
names what it was waiting for, and ends the process with `HANG_EXIT_CODE`, so that a scheduler restarts the job
(which then resumes from its last checkpoint).

    with Watchdog(limit_s=None) as watchdog:            # None: derived from the measured steps
        for step in ...:
            with watchdog.waiting(f"the input pipeline (batch {i} of epoch {epoch})"):
                batch = next(batches)
            with watchdog.waiting(f"step {step}"):
                with watchdog.waiting("compiling the train step", judged=False):
                    executable = compile_if_new(batch)
                state = executable(state, batch)
            watchdog.progress()                          # a step is done: the clock starts again

The clock runs from the last `progress()` (or the start); a judged=False wait (a compile) stops it, and its time is
neither judged nor measured. The default limit is `factor` x the slowest interval between two `progress()` calls
measured so far, at least `minimum_s`; it arms once one interval has been measured, so a first step slower than the
minimum never trips. The slowest interval rather than the median: with asynchronous dispatch most steps return at
once and the host waits for the device only at a log point, where one interval holds up to `log_every` steps; an
interval with a checkpoint save or an eval only raises the limit, and a false trip (a restart of the whole job)
costs more than a late one. Each process judges its own progress: a process stuck in a collective because a peer
hangs trips its own watchdog too, and the scheduler restarts them all.

The watchdog is a Python thread: it needs the GIL, which JAX releases while it waits on a device, a collective or
a host transfer, and `threading.Event.wait`, `queue.get` and I/O release too. A debugger paused in the loop looks
like a hang: `limit_s=0` turns the watchdog off."""
import faulthandler
import math
import os
import sys
import threading
import time
import traceback

from absl import logging

from engine.config import check

# EX_TEMPFAIL (sysexits.h: "a temporary failure; the user is invited to retry"): a hang is not a bug of the run
# but a stall of a device, a peer or a file system, so the job should be restarted, and a scheduler can match the
# status (a Kubernetes podFailurePolicy `onExitCodes`, a SLURM epilog) apart from 1 (run-time failure), 2 (bad
# input), 128 + n (signals), 124 / 137 (`timeout`) and tests/multihost_worker.py's 3 (a simulated crash).
HANG_EXIT_CODE = 75
DEFAULT_FACTOR = 10.0
# torch.distributed's default collective timeout (NCCL, 10 minutes): it also has to cover, until the first log
# point is measured, a first eval's compile, a checkpoint save and a first log window (log_every steps the host
# waits for at once with asynchronous dispatch).
DEFAULT_MINIMUM_S = 600.0
# How long the stacks' log record may take (a hung thread can hold a logging handler's lock) before faulthandler
# writes them to stderr without any lock and the process exits anyway.
_REPORT_TIMEOUT_S = 10.0
_IDLE_POLL_S = 1.0  # how often an unarmed or paused watchdog looks again (a tenth of a smaller limit)


def _seconds(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


class Watchdog:
    """Ends the process with `exit_code` when the loop makes no progress for longer than the limit.

    limit_s: seconds without a `progress()` (judged=False waits excluded); None derives it from the measured steps:
      max(minimum_s, factor x the slowest interval between two `progress()` calls), armed after the first such
      interval; 0 turns the watchdog off (no thread; `waiting` and `progress` cost next to nothing).
    factor: the derived limit's multiple of the slowest measured interval (a number >= 1).
    minimum_s: the derived limit's floor in seconds.
    exit_code: the process's exit status on a hang (1-255).
    clock: a monotonic clock in seconds (tests pass their own).
    name: the argument `limit_s` is in the caller's words, for its error message (`fit`'s `hang_timeout`).

    Per step `waiting` and `progress` write a timestamp or a label and start no thread; the one thread sleeps until
    the current deadline. Use it as a context manager, or `close()` it."""

    def __init__(self, limit_s=None, *, factor=DEFAULT_FACTOR, minimum_s=DEFAULT_MINIMUM_S,
                 exit_code=HANG_EXIT_CODE, clock=time.monotonic, name="limit_s"):
        check(name, limit_s, limit_s is None or _seconds(limit_s),
              "None (derived from the measured steps), 0 (off) or a positive number of seconds")
        check("factor", factor, _seconds(factor) and factor >= 1, "a finite number >= 1")
        check("minimum_s", minimum_s, _seconds(minimum_s) and minimum_s > 0, "a positive number of seconds")
        check("exit_code", exit_code, isinstance(exit_code, int) and not isinstance(exit_code, bool)
              and 1 <= exit_code <= 255, "an integer status 1-255")
        self._fixed, self.factor, self.minimum_s, self.exit_code = limit_s, factor, minimum_s, exit_code
        self._clock = clock
        self._since = clock()  # the last progress (or the start), moved on by the time of judged=False waits
        self._labels = ()  # what the loop waits on, outermost first (a tuple: the thread reads it whole)
        self._paused_at, self._paused_depth = None, 0
        self._slowest, self.steps = None, 0
        self._poll_s = min(_IDLE_POLL_S, (limit_s or minimum_s) / 10)
        self._closed = threading.Event()
        self._thread = None
        if limit_s != 0:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    @property
    def limit_s(self):
        """The limit in force (seconds): the one given, else the derived one; None while unarmed or off."""
        if self._fixed is not None:
            return self._fixed or None
        if self._slowest is None:
            return None
        return max(self.minimum_s, self.factor * self._slowest)

    def waiting(self, label, *, judged=True):
        """A context: the loop waits on `label` ('step 12', 'the input pipeline (batch 12 of epoch 0)', 'a
        checkpoint save (step 12)'), which a trip names (nested waits as 'outer > inner'). judged=False (a compile,
        whose time no step predicts): the clock stops inside it."""
        return _Waiting(self, label, judged)

    def progress(self):
        """A step is done: measures the interval since the last one (judged=False waits excluded) and restarts the
        clock. Call it from the loop's thread after each step."""
        now = self._clock()
        interval = now - self._since
        self._slowest = interval if self._slowest is None else max(self._slowest, interval)
        self._since = now
        self.steps += 1

    def close(self):
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _watch(self):
        timeout = self._poll_s
        while not self._closed.wait(timeout):
            timeout = self._judge()

    def _judge(self):
        """Trips if overdue; else the seconds until the current deadline (or the idle poll)."""
        limit = self.limit_s
        if limit is None or self._paused_at is not None:
            return self._poll_s
        waited = self._clock() - self._since
        if waited <= limit:
            return limit - waited + 0.01  # progress meanwhile only moves the deadline later: look again then
        self._trip(waited, limit)

    def _trip(self, waited, limit):
        try:  # whatever goes wrong in the report, the process exits: a dead watchdog thread would hang on silently
            labels = self._labels
            what = " > ".join(labels) if labels else f"nothing named (between waits, after {self.steps} steps)"
            rule = ("as set" if self._fixed is not None else
                    f"{self.factor:g}x the slowest step, {self._slowest:.3g} s, at least {self.minimum_s:g} s")
            headline = (f"hang: no progress for {waited:.1f} s (limit {limit:.3g} s, {rule}) while waiting for "
                        f"{what}; exiting with status {self.exit_code} so that the job is restarted")
            stacks = _format_stacks()
            # In a thread of its own: a hung thread may hold a logging handler's lock; the exit must not wait on it.
            reporter = threading.Thread(target=_report, args=(headline, stacks), name="hang-report", daemon=True)
            reporter.start()
            reporter.join(_REPORT_TIMEOUT_S)
            if reporter.is_alive():
                os.write(2, (headline + " (the log did not take it; faulthandler's stacks follow)\n").encode())
                faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
        except BaseException as error:  # noqa: BLE001 - the report failed: say so in one line, then exit
            os.write(2, f"hang: no progress for {waited:.1f} s; the report failed: {error!r}\n".encode())
        finally:
            os._exit(self.exit_code)


class _Waiting:
    """`Watchdog.waiting`'s context: a class rather than a generator, as it runs a few times per step."""
    __slots__ = ("watchdog", "label", "judged", "outer")

    def __init__(self, watchdog, label, judged):
        self.watchdog, self.label, self.judged = watchdog, label, judged

    def __enter__(self):
        w = self.watchdog
        self.outer = w._labels
        w._labels = self.outer + (self.label,)
        if not self.judged:
            if w._paused_depth == 0:
                w._paused_at = w._clock()
            w._paused_depth += 1
        return self

    def __exit__(self, *exc):
        w = self.watchdog
        if not self.judged:
            w._paused_depth -= 1
            if w._paused_depth == 0:
                w._since += w._clock() - w._paused_at  # first: the thread reads _paused_at, then _since
                w._paused_at = None
        w._labels = self.outer


def _format_stacks():
    """Every thread's Python stack but the calling one's, the main thread first."""
    threads = {t.ident: t for t in threading.enumerate()}
    frames = sys._current_frames()
    me = threading.get_ident()
    order = sorted((ident for ident in frames if ident != me),
                   key=lambda i: (threads.get(i) is not threading.main_thread(), getattr(threads.get(i), "name", "")))
    parts = []
    for ident in order:
        thread = threads.get(ident)
        name = thread.name if thread is not None else "a thread Python did not start"
        daemon = " (daemon)" if thread is not None and thread.daemon else ""
        parts.append(f"Thread {name} {ident}{daemon}, most recent call last:\n"
                     + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def _report(headline, stacks):
    logging.error("%s", headline)
    logging.error("hang: every thread's stack:\n%s", stacks)
    logging.flush()
    sys.stderr.flush()
