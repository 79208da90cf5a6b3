"""The Trainer: three user functions in, a sharded, checkpointed, exactly resumable training loop out.

User functions:
  collate_fn(examples: list) -> dict of numpy arrays, one row per example.
  loss_fn(params, batch, rng, is_training) -> loss | (loss, metrics_dict): pure JAX, scalar mean loss.

Data flow of one optimizer update: `per_device_batch_size x (data x fsdp x expert)` examples per micro-batch (devices
along `model` share examples), `accumulate_grad_batches` micro-batches per update. Each host collates its own rows
(engine/data.py), a background thread places the next batch on the devices while the current step runs, and one
compiled step scans over the micro-batches, accumulates gradients (sharded like the parameters, or further split over
`data` with ZeRO-2), applies the optimizer and returns the donated state.

Here: the constructor, `fit`'s loop, eval and logging. The state (its layout, placement, restore and the data
position) is an `engine.train_state.TrainState`; the step, built and compiled in one place, an
`engine.step_program.StepProgram`.
"""
import functools
import os
import signal
import time

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from engine import data as data_lib
from engine import fit_loop, workdir_lock
from engine.checkpoint import Checkpointer
from engine.checkpoint_tiers import open_checkpointer
from engine.config import Checkpointing, Logging, Parallelism, Precision, check
from engine.evaluation import EvalLoss
from engine.flops import peak_tflops
from engine.goodput import Goodput
from engine.sharding import path_str
from engine.step_program import StepProgram, check_trainer_arguments
from engine.train_state import TrainState, check_shared_workdir
from engine.watchdog import Watchdog

_validate = check


def _fetch(tree):
    """Host copies of a pytree of arrays. Arrays split across processes (DiLoCo's per-replica metrics, one replica
    per host) are gathered: a collective at log time only, which every process reaches at the same step."""
    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(get, tree)


class Trainer:
    """Trains `params` with `loss_fn` on a mesh; see the module docstring for the user functions.

    Args:
      mesh: from `engine.make_mesh`. With a `stage` axis > 1 the native decoders run their layer stack as a pipeline
        (models/pipeline.py); every stage sees the same global micro-batch.
      collate_fn, loss_fn: the user functions.
      params: the initial parameter pytree (host or device arrays); kept as master weights in their own dtype.
      optimizer: an `optax.GradientTransformation`; build it with `optax.inject_hyperparams` to log the learning rate.
      workdir: where checkpoints and TensorBoard scalars go; a Trainer on a workdir that holds a checkpoint restores
        the latest one here, in the constructor.
      trainable: None (every parameter trains), a regex matched with `re.search` against each '/'-joined parameter
        path (e.g. `models.LORA_TRAINABLE`: only the low-rank adapters), or a tree of bools of the parameters'
        structure. Frozen parameters keep their values and get no gradient (none is computed), no optimizer state
        and no DiLoCo replicas; the optimizer sees the trained parameters only (None at the frozen ones).
      seed: fixes shuffling and the per-step rngs (`fold_in(key(seed), step)`, so a resume reproduces them).
      accumulate_grad_batches: micro-batches per optimizer update (scanned inside the one compiled step), weighed
        by `loss_fn.weight_metric` where it names one (a token mean stays the whole batch's).
      grad_fn: None (the engine differentiates `loss_fn`), or `grad_fn(params, batch, rng) -> ((loss, metrics),
        grads)`, the structure `jax.value_and_grad(f, has_aux=True)` returns, called in place of that
        differentiation on each micro-batch's rows as a step sees them (all of them in the jit step; each device's
        own rows in the shard_map step, with the ZeRO-3 parameters gathered whole), with the parameters in the
        compute dtype. Its loss and gradients are means over those rows; the engine then reduces them over devices
        and micro-batches and applies the optimizer. A rule on single examples (DP-SGD's clipping) goes here;
        anything on the reduced gradient (DP-SGD's noise) in the optax chain. `loss_fn` still gives the eval loss and
        the layout; `remat` does not apply to `grad_fn`. Not with diloco or loss scaling.
      precision: an `engine.Precision` (compute dtype, loss scaling, what a non-finite step does).
      parallelism: an `engine.Parallelism` (the step, ZeRO stage, remat, sharding rules, optimizer offload, ZeRO++).
      checkpointing: an `engine.Checkpointing` (how many to keep; what the constructor restores).
      logging: an `engine.Logging` (model FLOPs per example for the TFLOP/s and MFU of each log line).
      diloco: an `engine.DiLoCo`: low-communication data parallelism (engine/diloco.py). Every position along `data`
        trains its own replica and talks to the others once every `diloco.inner_steps` steps; `params` is then the
        global model, updated at those outer steps (with `diloco.fragments` > 1, part by part: Streaming DiLoCo).
        Needs zero_stage=0, step='auto' and no offload_optimizer (DiLoCo has its own step).
    """

    def __init__(self, *, mesh, collate_fn, loss_fn, params, optimizer, workdir=None, trainable=None, seed=0,
                 accumulate_grad_batches=1, grad_fn=None, precision=None, parallelism=None, checkpointing=None,
                 logging=None, diloco=None):
        precision = Precision() if precision is None else precision
        parallelism = Parallelism() if parallelism is None else parallelism
        checkpointing = Checkpointing() if checkpointing is None else checkpointing
        logging = Logging() if logging is None else logging  # noqa: F811 - the argument; the module is _log here
        self._step_kind = check_trainer_arguments(
            mesh=mesh, collate_fn=collate_fn, loss_fn=loss_fn, optimizer=optimizer, workdir=workdir,
            accumulate_grad_batches=accumulate_grad_batches, precision=precision, parallelism=parallelism,
            checkpointing=checkpointing, logging=logging, diloco=diloco, grad_fn=grad_fn)
        self.precision, self.parallelism, self.checkpointing, self.logging = (precision, parallelism, checkpointing,
                                                                              logging)
        self.mesh, self.collate_fn, self.loss_fn, self.optimizer = mesh, collate_fn, loss_fn, optimizer
        self.workdir, self.seed, self.diloco, self.accumulate = workdir, seed, diloco, accumulate_grad_batches
        self.grad_fn = grad_fn
        # The settings callers read, under their own names.
        self.zero_stage, self.remat = parallelism.zero_stage, parallelism.remat
        self.offload_optimizer = parallelism.offload_optimizer
        self.compute_dtype, self.nan_policy = precision.compute_dtype, precision.nan_policy
        self._loss_scale = precision.resolved_loss_scale()
        self.flops_per_example = logging.flops_per_example
        # The state (parameters, optimizer state, their layout, the data position) and the one step over it.
        self._state = TrainState(mesh=mesh, params=params, trainable=trainable, optimizer=optimizer, loss_fn=loss_fn,
                                 parallelism=parallelism, diloco=diloco, loss_scale=self._loss_scale, seed=seed)
        self._program = StepProgram(kind=self._step_kind, state=self._state, loss_fn=loss_fn, optimizer=optimizer,
                                    accumulate=accumulate_grad_batches, precision=precision,
                                    parallelism=parallelism, diloco=diloco, grad_fn=grad_fn)
        self._eval_loss = None
        # Figures of the latest log line: examples_per_second, seconds_per_step and, with flops_per_example,
        # model_tflops_per_device and mfu (None where the device's peak is unknown).
        self.throughput = {}
        self.history = []             # per-step host metrics: {'step', 'loss', 'grad_norm', 'learning_rate', ...}
        self.stopped_by_signal = False
        self.stop_signal = None       # the signal number that stopped the last fit (scripts exit with 128 + it)
        self._stop = None             # fit's fit_loop.Stop while it runs
        self._pending = []            # (step, metrics on the device) not yet checked on the host
        self._timers = {"data": 0.0, "checkpoint": 0.0}  # seconds since the last log line
        self._total_steps = None
        self._last_eval_step = None
        self._writer = None
        self._bar = fit_loop.ProgressBar(False)  # fit's, while it runs
        self._watchdog = Watchdog(0)  # fit's hang watchdog while it runs; off (no thread) outside
        # Checkpoints: the workdir's latest (or its best, with Checkpointing(restore='best')) is restored here.
        if workdir and jax.process_count() > 1:
            check_shared_workdir(workdir)
        # One run per workdir, released by close() (or the process's end); a Trainer of the best checkpoint neither
        # trains nor saves, so it may read a workdir another run is training in.
        self._locked = bool(workdir) and checkpointing.restore != "best"
        if self._locked:
            workdir_lock.hold(workdir)
        self._checkpointer = self._best_checkpointer = None  # workdir/best's: opened by fit(save_best=) or restore
        self._restored_best = checkpointing.restore == "best"
        started = time.perf_counter()
        try:
            # A Trainer of the best checkpoint reads (another run may be saving here): its steps, never a cleanup.
            self._checkpointer = None if not workdir else Checkpointer(workdir, read_only=True) if (
                self._restored_best) else open_checkpointer(workdir, checkpointing)
            self._restore_from_workdir()
        except BaseException:  # a Trainer never made holds no workdir
            self.close()
            raise
        self._restore_s = time.perf_counter() - started  # lost to a restart: the next fit's goodput counts it
        self._goodput = Goodput(None, 0)  # fit's accounting while it runs

    def _restore_from_workdir(self):
        """Restores the workdir's latest checkpoint (or its best, with Checkpointing(restore='best')), if any: the
        newest step that reads and matches its checksums, each skipped one named in a warning (engine/checkpoint.py).
        Steps skipped under 'checkpoints' are moved aside, as this Trainer's saves will write there."""
        if self._restored_best:
            source = None if not os.path.isdir(os.path.join(self.workdir, "best")) else self._open_best()
            if source is None or source.latest_step() is None:
                raise FileNotFoundError(f"Checkpointing(restore='best'): workdir={self.workdir} has no best "
                                        "checkpoint; expected a workdir trained with fit(save_best=...) (--save_best)")
            set_aside = False
        elif self._checkpointer is not None and self._checkpointer.all_steps():
            source, set_aside = self._checkpointer, True
        else:
            return
        restore = functools.partial(self._state.restore, checkpointer=source, workdir=self.workdir,
                                    params_only=self.checkpointing.params_only)
        source.restore_newest(restore, set_aside=set_aside)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def step(self):
        """Optimizer updates so far (across `fit` calls and resumes)."""
        return self._state.step

    @property
    def epoch(self):
        return self._state.epoch

    @property
    def iterator_state(self):
        """A stateful stream's iterator state after the last trained batch (`get_state()`: what a resume sets), as
        the checkpoints carry it; None for random-access examples and streams without one."""
        return self._state.iterator_state

    @property
    def best(self):
        """{'step', 'metric', 'mode', 'value'} of the checkpoint fit(save_best=...) keeps; None before."""
        return self._state.best

    @property
    def compile_count(self):
        """Traces (= compilations) of the train step."""
        return self._program.compile_count

    @property
    def params(self):
        """The parameters, sharded on the mesh once the first batch (or a restored checkpoint) fixed the layout."""
        return self._state.current_params()

    def set_params(self, params, *, reset_optimizer=False):
        """Replaces the parameters of a live Trainer (FedAvg's per-client start, a meta-learner's outer update): the
        same tree structure, shapes and dtypes, placed on the layout it trains with, so the compiled step is reused
        (no rebuild, no recompilation). The optimizer state is kept unless `reset_optimizer` (see
        `reset_optimizer`); step, epoch and data position are kept. Before the first batch it replaces the initial
        parameters."""
        self._state.set_params(params, reset_optimizer=reset_optimizer)

    def reset_optimizer(self):
        """Sets the optimizer state to the optimizer's initial state for the current parameters (a fresh `init`;
        the loss scale too), on the layout it trains with: no recompilation of the step."""
        self._state.reset_optimizer()

    @property
    def opt_state(self):
        return self._state.arrays["opt_state"] if self._state.arrays is not None else None

    @property
    def param_specs(self):
        return self._state.param_specs

    @property
    def state_shardings(self):
        """{'params', 'opt_state'}: the `NamedSharding` of every leaf of the state where it rests between steps (the
        optimizer state in pinned host memory with offload_optimizer); None before the layout is decided."""
        if self._state.layout is None:
            return None
        return jax.tree.map(lambda x: x.sharding, self._state.layout)

    @property
    def batch_spec(self):
        """One global micro-batch as the first batch (or the restored checkpoint) fixed it: the batch's pytree with a
        `jax.ShapeDtypeStruct` [rows, ...] at each leaf; None before."""
        return self._state.batch_spec

    def trainable_paths(self):
        """The '/'-joined paths of the parameters this Trainer trains (every one without `trainable`)."""
        flat = jax.tree_util.tree_flatten_with_path(self.params)[0]
        mask = self._state.trainable
        wants = jax.tree.leaves(mask) if mask is not None else [True] * len(flat)
        return [path_str(p) for (p, _), m in zip(flat, wants) if m]

    # ------------------------------------------------------------------------------------------------ the step
    def abstract_state(self, batch):
        """Lays out the state for `batch` (a pytree of arrays or jax.ShapeDtypeStruct [accumulate, rows, ...], one
        global update) without allocating it (the parameters may be `jax.ShapeDtypeStruct`s). Returns {'params',
        'opt_state'} of `jax.ShapeDtypeStruct`s with their shardings: the arguments `lower` compiles the step for.
        The first batch (or a restored checkpoint) fixes the layout; later calls return it."""
        self._state.note_spec(batch)
        return self._state.lay_out()

    def lower(self, batch, *, sync=False, platforms=None):
        """The train step lowered ahead of time for `batch` (as in `abstract_state`) on the state's abstract layout:
        nothing is allocated. sync: DiLoCo's overlapped outer-step program. platforms: lower for these backends (e.g.
        ('cuda',)) instead of this machine's."""
        state = self.abstract_state(batch)
        traced = self._program.jitted(sync).trace(state["params"], state["opt_state"], batch, np.int32(0))
        return traced.lower(lowering_platforms=tuple(platforms)) if platforms else traced.lower()

    def compile(self, batch, *, sync=False):
        """`lower(batch, sync=sync)` compiled: a `jax.stages.Compiled` (`memory_analysis()`, `as_text()`)."""
        return self.lower(batch, sync=sync).compile()

    def compiled_step(self, sync=False):
        """The train step as last compiled for `fit` (a `jax.stages.Compiled`: `as_text()`, `memory_analysis()`);
        None before the first step. sync: DiLoCo's overlapped outer-step program."""
        return self._program.latest(sync)

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self, train_examples, *, per_device_batch_size, n_epochs=None, total_epochs=None, max_steps=None,
            eval_examples=None, eval_per_device_batch_size=None, eval_predictor=None, eval_metric_fn=None,
            log_every=10, save_every=None, profile_steps=None, checkpoint_at_end=True, eval_every=None,
            save_best=None, early_stopping_patience=None, data_workers=0, hang_timeout=None):
        """Trains `n_epochs` more epochs (default 1; an epoch that a previous call left unfinished is finished first),
        or up to `total_epochs` epochs counted over the Trainer's life. `max_steps`: stop at that many optimizer updates
        in total (also over the Trainer's life); given alone, it bounds the call by itself, over as many epochs as that
        takes (the Hugging Face Trainer's and Lightning's `max_steps`). So `fit(n_epochs=10)` once per round trains 10
        epochs each time (RedCoast's loop). Every checkpoint records the running call (the epoch it started at and its
        target), and the first `fit` of a Trainer restored from a workdir continues that call: `n_epochs` counts from
        where the interrupted call started, so a re-run script that passes what it passed the first time ends exactly
        where the first run would have (Keras' `epochs`, Lightning's `max_epochs`), and does nothing when that run had
        finished. Later calls train again.

        The global batch of one update is `per_device_batch_size x data x fsdp x expert x accumulate_grad_batches`
        examples.
        `train_examples`: a list or other Sequence, e.g. `engine.tasks.text_data.TokenWindows` (shuffled each epoch
        from `seed`), any iterable (streamed in order, iterated once per epoch; one whose iterator has `get_state` /
        `set_state`, as Grain's, resumes from the state saved with the checkpoint, else by re-reading and skipping),
        or a callable `epoch -> examples` called at the start of each epoch with its index over the Trainer's life
        (fresh tasks or episodes per epoch; deterministic in `epoch` for a mid-epoch resume to see the same data).
        A collated batch may be any pytree of arrays with one row per example. The last incomplete global batch of
        an epoch is dropped. Eval (after each epoch): the mean `eval_loss` and, with `eval_predictor` and
        `eval_metric_fn(examples, predictions) -> dict`, its metrics; `eval_examples` may be a callable `epoch ->
        examples` too. `eval_every`: also every that many updates (counted over the Trainer's life, so a resume
        keeps the schedule). Each eval is logged, written to TensorBoard at its step and shown on the progress bar.
        `save_best=(metric, 'min' | 'max')`, e.g. `('loss', 'min')` or `('exact_match', 'max')` (a name the eval
        reports): after each eval that improves on the best so far, the whole state is saved under `workdir/best`
        (one checkpoint, kept apart from the last `Checkpointing.keep`; a resume reads the best value back). `best`
        then holds its step and value; `Checkpointing(params_only=True, restore='best')` reads it.
        `early_stopping_patience=N` (with save_best): training stops after N evals in a row that did not improve on
        the best (the count is checkpointed, so re-running a stopped job does not train on).
        `save_every`: checkpoint every that many updates (and at the end, unless `checkpoint_at_end=False`, for a caller
        that calls `fit` often and saves itself; a signal still saves) when there is a workdir. `data_workers=N`: each
        batch (this process's rows read from random-access examples, and `collate_fn`) is built in N Grain worker
        processes, in order, the same batches as in-process (`engine.data.iterate_batches`; the examples and
        `collate_fn` must pickle, and a script's training sit under `if __name__ == "__main__":`, as every worker
        imports the script again; `pip install grain`). `profile_steps=(start, end)`: a `jax.profiler` trace of those
        steps under `workdir/tensorboard`. SIGTERM or Ctrl-C: the current step finishes, a checkpoint is saved,
        `stopped_by_signal` is set and `fit` raises `engine.StoppedBySignal` (a SystemExit with status 128 + the
        signal), so that the program ends even when it calls `fit` in a loop of its own; a second signal stops at once.
        `hang_timeout`: seconds without a finished step (compiles excluded) after which the process logs every thread's
        stack, names what it waited for and exits with status 75 (`engine.watchdog`); default 10x the slowest step so
        far, at least 600 s; 0: off.
        """
        fit_loop.check_fit_arguments(
            workdir=self.workdir, per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
            total_epochs=total_epochs, max_steps=max_steps, log_every=log_every, save_every=save_every,
            eval_examples=eval_examples, eval_predictor=eval_predictor, eval_metric_fn=eval_metric_fn,
            eval_every=eval_every, save_best=save_best, early_stopping_patience=early_stopping_patience,
            profile_steps=profile_steps)
        watchdog = Watchdog(hang_timeout, name="hang_timeout")
        try:
            return self._fit(watchdog, train_examples, per_device_batch_size, n_epochs, total_epochs, max_steps,
                             eval_examples, eval_per_device_batch_size, eval_predictor, eval_metric_fn, log_every,
                             save_every, profile_steps, checkpoint_at_end, eval_every, save_best,
                             early_stopping_patience, data_workers)
        finally:
            watchdog.close()
            self._watchdog = Watchdog(0)

    def _fit(self, watchdog, train_examples, per_device_batch_size, n_epochs, total_epochs, max_steps, eval_examples,
             eval_per_device_batch_size, eval_predictor, eval_metric_fn, log_every, save_every, profile_steps,
             checkpoint_at_end, eval_every, save_best, early_stopping_patience, data_workers):
        """`fit` under its hang watchdog."""
        self._watchdog = watchdog
        self._goodput = Goodput(self.workdir, self._state.step, self._restore_s,
                                write=jax.process_index() == 0)
        self._restore_s = 0.0
        rows = global_batch_size(self.mesh, per_device_batch_size, self.accumulate)
        self._state.set_rows(rows)
        last_epoch = self._state.start_call(n_epochs, total_epochs, max_steps)
        self._total_steps = self._state.planned_steps(train_examples, per_device_batch_size, self.accumulate,
                                                      last_epoch, max_steps)
        if self._total_steps is None:
            logging.info("fit: train_examples is streamed (no len): an epoch ends when its iterator does, so an "
                         "endless stream trains until max_steps or a signal, and max_steps is not set")
        if save_best is not None:
            self._check_best_matches(tuple(save_best))
        exhausted = lambda: (early_stopping_patience is not None  # noqa: E731
                             and self._state.evals_since_best >= early_stopping_patience)
        if exhausted():
            logging.info("early stopping: %s; not training on", self._state.early_stop_note())
            return self.history
        self._refuse_if_restored_best()
        evaluate = functools.partial(self._watched_evaluate, eval_examples,
                                     eval_per_device_batch_size or per_device_batch_size, eval_predictor,
                                     eval_metric_fn, None if save_best is None else tuple(save_best))
        every = {"log": log_every, "save": save_every, "eval": eval_every, "workers": data_workers}
        profiler = fit_loop.Profiler(profile_steps, f"{self.workdir}/tensorboard", self._wait_for_checkpoints)
        self._pending, self._last_log = [], (time.perf_counter(), self._state.step)
        self._timers = {"data": 0.0, "checkpoint": 0.0}
        self._bar = fit_loop.ProgressBar(self.logging.shows_progress() and jax.process_index() == 0)
        with fit_loop.stop_on_signal() as stop:
            self._stop = stop
            done = lambda: (stop() or exhausted()  # noqa: E731
                            or (max_steps is not None and self._state.step >= max_steps))
            try:
                self._epochs(train_examples, per_device_batch_size, rows, last_epoch, profiler, done, every,
                             evaluate if eval_examples is not None else None)
            finally:
                profiler.stop()
                self._bar.close()
                self._stop = None
            stopped = stop()
        self.stop_signal = stop.signum if stopped else None
        self._finish(stopped, exhausted(), checkpoint_at_end)
        if stopped:  # the program ends, also when fit runs in the user's own loop
            self._close_tensorboard()  # its queue written out (a script ends with os._exit)
            raise fit_loop.StoppedBySignal(self.stop_signal or signal.SIGTERM, self._state.step,
                                           saved=self.workdir is not None and self._state.arrays is not None)
        return self.history

    def _epochs(self, train_examples, per_device_batch_size, rows, last_epoch, profiler, done, every, evaluate):
        """The epochs up to `last_epoch` or `done()`, each followed by an eval (`evaluate`, or None). An epoch with no
        batch ends the call when an earlier one of it trained (a one-shot iterator that the previous epoch used up,
        under `max_steps`: the Hugging Face Trainer stops there too), logged; the call's first epoch with none is an
        error."""
        trained = False
        while self._state.epoch < last_epoch and not done():
            examples = train_examples(self._state.epoch) if callable(train_examples) else train_examples
            seen = self._run_epoch(examples, per_device_batch_size, rows, profiler, done, every, evaluate)
            if done():
                break  # mid-epoch, or at its end: the next fit finds no batch left and moves to the next epoch
            if seen == 0 and self._state.batch_in_epoch == 0:
                if not trained:
                    raise ValueError(f"train_examples yielded fewer examples than one global batch of {rows}")
                logging.warning("fit: train_examples yielded no batch in epoch %d (an iterator the previous epoch "
                                "used up?); stopping at step %d", self._state.epoch, self._state.step)
                break
            trained = True
            self._state.next_epoch()
            if self._pending:
                self._flush(rows, None)
            if evaluate is not None and self._last_eval_step != self._state.step:
                evaluate()
        if self._pending:
            self._flush(rows, None)

    def _refuse_if_restored_best(self):
        if self._restored_best:
            raise ValueError("fit: this Trainer restored the best checkpoint (Checkpointing(restore='best')), whose "
                             "step lies before the workdir's later checkpoints; expected its params passed to a "
                             "Trainer with another workdir to train on from them")

    def _run_epoch(self, train_examples, per_device_batch_size, rows, profiler, done, every, evaluate):
        """Trains on the rest of the current epoch until it ends or `done()`; returns the batches it trained on."""
        self._state.note_examples(len(train_examples) if data_lib.is_random_access(train_examples) else None)
        batches = data_lib.iterate_batches(
            self.mesh, train_examples, self.collate_fn, per_device_batch_size=per_device_batch_size,
            accumulate=self.accumulate, seed=self.seed, epoch=self._state.epoch, start_batch=self._state.batch_in_epoch,
            workers=every["workers"], start_state=self._state.iterator_state, states=True, workers_name="data_workers")
        prefetch = data_lib.Prefetcher(batches)
        seen = 0
        try:
            batches_iter = iter(prefetch)
            while True:
                waited = time.perf_counter()
                with self._watchdog.waiting(f"the input pipeline (batch {self._state.batch_in_epoch} of epoch "
                                            f"{self._state.epoch})"):
                    item = next(batches_iter, None)
                self._timers["data"] += time.perf_counter() - waited
                self._goodput.add("input", time.perf_counter() - waited)
                if item is None:
                    break
                index, _, batch, iterator_state = item
                profiler.before_step(self._state.step)
                with self._watchdog.waiting(f"step {self._state.step + 1}"):
                    self._train_on(batch)
                self._state.batch_in_epoch, self._state.iterator_state, seen = index + 1, iterator_state, seen + 1
                profiler.after_step(self._state.step, self._state.arrays["params"])
                self._after_step(rows, batch, every, evaluate)
                self._watchdog.progress()  # after the log, save and eval: they count in the step's interval
                self._bar.update(self._state.step, self._total_steps, rows)
                if done():
                    break
        finally:
            prefetch.close()
        return seen

    def _train_on(self, batch):
        """One optimizer update on one global batch; its metrics wait on the device until the next log line."""
        state = self._state
        # The first batch lays the state out (a restore's reads included) and compiles: not judged as a step, so
        # the hang limit derived from step times stays tight.
        with self._watchdog.waiting("placing the state", judged=False), self._goodput.timed("compile"):
            state.note_batch(batch)
        state.note_resumed_shapes(batch)
        sync = self.diloco is not None and self.diloco.syncs_at(state.step)
        args = (state.arrays["params"], state.arrays["opt_state"], batch, np.int32(state.step))
        compiles, started = self._program.compile_count, time.perf_counter()
        with self._watchdog.waiting("compiling the train step", judged=False):
            executable = self._program.executable(sync, *args)
        if self._program.compile_count != compiles:
            self._goodput.add("compile", time.perf_counter() - started)
        params, opt_state, metrics = executable(*args)
        state.arrays = {"params": params, "opt_state": opt_state}
        state.step += 1
        self._pending.append((state.step, metrics))

    def _after_step(self, rows, batch, every, evaluate):
        """What runs between steps: a log line every `log` steps, a checkpoint every `save`, an eval every `eval`."""
        if len(self._pending) >= every["log"]:
            self._flush(rows, batch)
        if every["save"] and self._checkpointer is not None and self._state.step % every["save"] == 0:
            self.save_checkpoint()
        elif self._checkpointer is not None and self._checkpointer.local_due(self._state.step):
            self.save_checkpoint(local=True)
        if every["eval"] and self._state.step % every["eval"] == 0:
            if self._pending:
                self._flush(rows, batch)
            evaluate()

    def _finish(self, stopped, exhausted, checkpoint_at_end):
        """After the loop: says why it stopped, saves the last checkpoint and waits for the writes."""
        if stopped:
            self.stopped_by_signal = True
            logging.warning("signal received: stopping after step %d", self._state.step)
        if exhausted:
            logging.info("early stopping at step %d: %s", self._state.step, self._state.early_stop_note())
        with self._watchdog.waiting("the checkpoint writes to finish"):
            if self._checkpointer is not None and self._state.arrays is not None and (checkpoint_at_end or stopped):
                self.save_checkpoint()
                with self._goodput.timed("checkpoint"):
                    self._checkpointer.wait()
            if self._best_checkpointer is not None:
                with self._goodput.timed("checkpoint"):
                    self._best_checkpointer.wait()
        if self._state.arrays is not None:
            scalars = self._goodput.scalars(self._state.step)  # records the call's figures once
            logging.info("%s", self._goodput.summary(scalars))
            self.write_scalars("goodput", scalars)

    def _flush(self, rows, batch):
        """Brings the pending metrics to the host (the only host sync of the loop), checks for non-finite losses,
        and logs."""
        pending, last_log = self._pending, self._last_log
        with self._watchdog.waiting(f"the device and the other processes (steps {pending[0][0]}-{pending[-1][0]})"):
            if self._stop is not None:
                self._stop.agree()  # every process flushes at the same steps
            host = _fetch([m for _, m in pending])
        self._goodput.record(pending[-1][0])  # the record a restart reads, should this process die
        steps = [s for s, _ in pending]
        pending.clear()
        now = time.perf_counter()
        seconds = (now - last_log[0]) / max(1, steps[-1] - last_log[1])
        for step, metrics in zip(steps, host):
            # Metrics of a DiLoCo step are per replica: the mean (every replica finite) on the host. An overflow is
            # the loss scale's to handle where every replica that overflowed could still lower its own scale.
            scaled = self._loss_scale
            lowered = scaled is not None and scaled.dynamic and bool(np.all(
                np.atleast_1d(metrics["loss_scale"])[~np.atleast_1d(metrics["finite"])] > scaled.minimum))
            record = {"step": step,
                      **{k: float(np.all(v) if k == "finite" else np.mean(v)) for k, v in metrics.items()}}
            self.history.append(record)
            if not record.pop("finite"):
                if lowered:
                    logging.warning("step %d: gradients overflowed at loss scale %g; update skipped, scale lowered",
                                    step, record["loss_scale"])
                    continue
                if self.nan_policy == "raise":
                    raise FloatingPointError(f"non-finite loss or gradient at step {step} (loss={record['loss']}); "
                                             "the update was not applied. Pass nan_policy='skip' to skip such steps")
                logging.warning("step %d: non-finite loss or gradient; update skipped", step)
        last = self.history[-1]
        throughput = rows / seconds if seconds > 0 else float("nan")
        lr = f" | lr {last['learning_rate']:.3g}" if "learning_rate" in last else ""
        n = max(1, steps[-1] - last_log[1])
        data_s, ckpt_s = self._timers["data"] / n, self._timers["checkpoint"] / n
        self._timers = {"data": 0.0, "checkpoint": 0.0}
        self.throughput = {"examples_per_second": throughput, "seconds_per_step": seconds}
        self._bar.update(last["step"], self._total_steps, rows, loss=last["loss"])
        flops = ""
        if self.flops_per_example:
            tflops = throughput * self.flops_per_example / self.mesh.size / 1e12
            peak = peak_tflops(self.mesh.devices.flat[0])
            mfu = tflops / peak if peak else None
            self.throughput.update(model_tflops_per_device=tflops, mfu=mfu)
            flops = f" | {tflops:.3g} TFLOP/s/device" + (f" (MFU {100 * mfu:.1f}%)" if peak else "")
        progress = fit_loop.progress_text(last["step"], self._total_steps, seconds)
        logging.info("%s | epoch %d | loss %.4f | grad_norm %.3g%s | %.1f examples/s%s | %.3f s/step "
                     "(data %.3f, checkpoint %.3f, compute %.3f)", progress, self._state.epoch, last["loss"],
                     last["grad_norm"], lr, throughput, flops, seconds, data_s, ckpt_s,
                     max(0.0, seconds - data_s - ckpt_s))
        writer = self._tensorboard()
        if writer is not None:
            for record in self.history[-len(steps):]:
                for k, v in record.items():
                    if k not in ("step", "finite"):
                        writer.add_scalar(f"train/{k}", v, record["step"])
            writer.add_scalar("train/examples_per_second", throughput, last["step"])
            for name in ("model_tflops_per_device", "mfu"):
                if self.throughput.get(name) is not None:
                    writer.add_scalar(f"train/{name}", self.throughput[name], last["step"])
            writer.add_scalar("train/step_time_seconds", seconds, last["step"])
            writer.add_scalar("train/data_wait_seconds", data_s, last["step"])
            writer.add_scalar("train/checkpoint_seconds", ckpt_s, last["step"])
            if isinstance(batch, dict) and "input_ids" in batch:
                tokens = rows * int(np.prod(batch["input_ids"].shape[2:]))
                writer.add_scalar("train/tokens_per_second", tokens / seconds, last["step"])
            writer.flush()
        self._last_log = (now, steps[-1])

    def _wait_for_checkpoints(self):
        # Collecting the trace while an async checkpoint was still being written crashed the process (jax 0.10.2,
        # XLA:CPU: a segfault in stop_trace in 2 of 12 runs that saved inside the profiled steps).
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def _tensorboard(self):
        if self.workdir is None or jax.process_index() != 0:
            return None
        if self._writer is None:
            import tensorboardX  # imported lazily: only process 0 with a workdir writes
            self._writer = tensorboardX.SummaryWriter(f"{self.workdir}/tensorboard")
        return self._writer

    # ------------------------------------------------------------------------------------------------ eval
    def eval_loss(self, examples, *, per_device_batch_size):
        """Mean of `loss_fn(..., is_training=False)` over `examples`, as one batch of them all would give it
        (`engine.evaluation.EvalLoss`: batches weighed by `loss_fn.weight_metric`, the last one's padding taken
        out)."""
        _validate("per_device_batch_size", per_device_batch_size,
                  isinstance(per_device_batch_size, int) and per_device_batch_size >= 1, "an integer >= 1")
        if self._eval_loss is None:
            self._eval_loss = EvalLoss(self.mesh, self.loss_fn, self.collate_fn, self.compute_dtype, self._state.key)
        return self._eval_loss(lambda: self._state.arrays["params"], examples, per_device_batch_size,
                               self._state.note_batch)

    def _watched_evaluate(self, *args):
        with self._watchdog.waiting(f"eval at step {self._state.step}"), self._goodput.timed("eval"):
            return self._evaluate(*args)

    def _evaluate(self, examples, per_device_batch_size, predictor, metric_fn, save_best=None):
        examples = examples(self._state.epoch) if callable(examples) else examples
        results = {"loss": self.eval_loss(examples, per_device_batch_size=per_device_batch_size)}
        if predictor is not None:
            preds = predictor.predict(examples, per_device_batch_size=per_device_batch_size, params=self.params)
            results.update({k: float(v) for k, v in metric_fn(examples, preds).items()})
        self._last_eval_step = self._state.step
        shown = " | ".join(f"{k} {v:.4f}" for k, v in results.items())
        logging.info("eval at step %d (epoch %d, batch %d): %s", self._state.step, self._state.epoch,
                     self._state.batch_in_epoch, shown)
        self._bar.line(f"eval at step {self._state.step}: {shown}")
        self.history.append({"step": self._state.step, **{f"eval_{k}": v for k, v in results.items()}})
        self.write_scalars("eval", results)
        if save_best is not None:
            self._maybe_save_best(save_best, results)
        return results

    def _open_best(self):
        if self._best_checkpointer is None:
            self._best_checkpointer = Checkpointer(self.workdir, keep=1, name="best", read_only=self._restored_best)
        return self._best_checkpointer

    def _check_best_matches(self, save_best):
        """Reads the workdir's best so far (a resume) and refuses a different criterion: replacing a best chosen by
        another metric would lose it."""
        self._state.read_best(self._open_best(), save_best, self.workdir)

    def _maybe_save_best(self, save_best, results):
        if not self._state.note_eval(save_best, results):
            return
        metric, value = save_best[0], results[save_best[0]]
        self._open_best().save(self._state.step, self._state.arrays, {**self._state.meta(), "best": self._state.best})
        logging.info("best %s so far: %.4f at step %d (saved under %s)", metric, value, self._state.step,
                     self._best_checkpointer.directory)
        self.write_scalars("eval", {f"best_{metric}": value})

    def write_scalars(self, group, scalars):
        """Writes host numbers `{name: value}` to TensorBoard as `group/name` at the current step (process 0 with a
        workdir; elsewhere nothing): a caller's own metrics beside the Trainer's, e.g. PPO's rollout rewards."""
        writer = self._tensorboard()
        if writer is not None:
            for k, v in scalars.items():
                writer.add_scalar(f"{group}/{k}", float(v), self._state.step)
            writer.flush()

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, *, local=False):
        """Starts an asynchronous save of parameters, optimizer state, step, rng seed and data position (local=True:
        to the local tier of `Checkpointing(local_dir=...)`)."""
        if self._checkpointer is None:
            raise ValueError("save_checkpoint: this Trainer has workdir=None; pass workdir= to save checkpoints")
        if self._restored_best:
            raise ValueError("save_checkpoint: this Trainer restored the best checkpoint "
                             "(Checkpointing(restore='best')); a save would write over the workdir's later steps")
        if self._state.arrays is None:
            raise ValueError("save_checkpoint: nothing to save before the first batch fixed the sharding")
        if not local and self._checkpointer.latest_step() == self._state.step:
            return
        if self._pending:  # never a checkpoint of a state whose steps were not yet checked finite
            self._flush(self._state.rows, None)
        started = time.perf_counter()
        self._goodput.note_save(self._state.step)
        with self._watchdog.waiting(f"a {'local ' * local}checkpoint save (step {self._state.step})"):
            (self._checkpointer.save_local if local else self._checkpointer.save)(
                self._state.step, self._state.arrays, self._state.meta())
        self._timers["checkpoint"] += time.perf_counter() - started
        self._goodput.add("checkpoint", time.perf_counter() - started)

    def _close_tensorboard(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None  # a later write opens another event file

    def checkpoint_steps(self):
        """The steps of the workdir's checkpoints, which a restart may restore (both tiers with a local one; with
        several processes every one calls it); [] without a workdir."""
        return [] if self._checkpointer is None else list(self._checkpointer.all_steps())

    def close(self):
        """Waits for pending checkpoint writes, closes the TensorBoard writer and releases the workdir's lock."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._best_checkpointer is not None:
            self._best_checkpointer.close()
        self._close_tensorboard()
        if self._locked:
            self._locked = False
            workdir_lock.release(self.workdir)


def global_batch_size(mesh, per_device_batch_size, accumulate_grad_batches=1):
    """Examples per optimizer update: `per_device_batch_size x data x fsdp x expert x accumulate_grad_batches`."""
    return per_device_batch_size * data_lib.data_parallel_size(mesh) * accumulate_grad_batches

