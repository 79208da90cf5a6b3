"""The Trainer: three user functions in, a sharded, checkpointed, exactly resumable training loop out.

User functions:
  collate_fn(examples: list) -> dict of numpy arrays, one row per example.
  loss_fn(params, batch, rng, is_training) -> loss | (loss, metrics_dict): pure JAX, scalar mean loss.

Data flow of one optimizer update: `per_device_batch_size x (data x fsdp x expert)` examples per micro-batch (devices
along `model` share examples), `accumulate_grad_batches` micro-batches per update. Each host collates its own rows
(engine/data.py), a background thread places the next batch on the devices while the current step runs, and one
compiled step scans over the micro-batches, accumulates gradients (sharded like the parameters, or further split over
`data` with ZeRO-2), applies the optimizer and returns the donated state.
"""
import functools
import os
import re
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine import data as data_lib
from engine import fit_loop
from engine import diloco as diloco_lib
from engine import step as step_lib
from engine.step import cast_floating, partition, split_loss
from engine.checkpoint import Checkpointer, abstract_like
from engine.config import RESTORE_CHECKPOINTS, Checkpointing, Logging, Parallelism, Precision, check
from engine.flops import peak_tflops
from engine import plan as plan_lib
from engine.sharding import add_axis, auto_shard, device_tile, log_sharding, path_str
import kernels

_validate = check


def _place(x, sharding):
    """Host or device array -> global array on `sharding` (every process must pass the same host values)."""
    if isinstance(x, jax.Array):
        # A fresh buffer, never the caller's: the train step donates its inputs, and device_put may reuse the
        # caller's buffer for one shard (then the donation would delete the caller's array).
        return jax.jit(jnp.copy, out_shardings=sharding)(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _state_specs(state, param_specs, param_shapes, scalar):
    """A PartitionSpec for every leaf of an (abstract) optimizer state. Optax keeps per-parameter values (moments,
    the inner states of masked or multi_transform optimizers, ...) in trees of the parameters' structure, so a leaf
    whose path ends with a parameter's path and whose shape is that parameter's takes its spec; any other leaf
    (step counts, hyperparameters) gets `scalar`. (optax.tree_map_params cannot see through multi_transform's
    masked states.)"""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    table = {}
    for (path, spec), shape in zip(jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_spec)[0],
                                   jax.tree.leaves(param_shapes, is_leaf=lambda x: isinstance(x, tuple))):
        table[tuple(path)] = (spec, tuple(shape))

    def spec_of(path, leaf):
        for start in range(len(path)):  # the longest suffix first
            found = table.get(tuple(path[start:]))
            if found is not None and found[1] == tuple(leaf.shape):
                return found[0]
        return scalar
    return jax.tree_util.tree_map_with_path(spec_of, state)


def _trainable_mask(trainable, params):
    """Trainer's `trainable` argument -> None (everything trains) or a tree of bools of `params`' structure. Refuses
    a selection that holds an integer parameter (quantised weights cannot train)."""
    mask = None if trainable is None else _mask_of(trainable, params)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    wants = jax.tree.leaves(mask) if mask is not None else [True] * len(leaves)
    integer = [path_str(p) for (p, x), m in zip(leaves, wants) if m and not jnp.issubdtype(x.dtype, jnp.inexact)]
    if integer:
        raise ValueError(f"trainable={trainable!r} selects integer parameter {integer[0]} (and {len(integer) - 1} "
                         "more), which cannot train (quantised weights); expected a trainable set of floating "
                         "parameters, e.g. models.LORA_TRAINABLE")
    return mask


def _mask_of(trainable, params):
    """A regex or a tree of bools -> a tree of bools of `params`' structure that selects at least one parameter."""
    if isinstance(trainable, str):
        try:
            pattern = re.compile(trainable)
        except re.error as e:
            raise ValueError(f"trainable={trainable!r} is not a regular expression: {e}") from None
        mask = jax.tree_util.tree_map_with_path(lambda p, _: bool(pattern.search(path_str(p))), params)
    else:
        try:
            mask = jax.tree.map(lambda _, m: m, params, trainable)
        except (ValueError, TypeError):
            mask = None
        if mask is None or not all(isinstance(m, (bool, np.bool_)) for m in jax.tree.leaves(mask)):
            raise ValueError(f"trainable={trainable!r}; expected None, a regex matched against the '/'-joined "
                             "parameter paths, or a tree of bools of the parameters' structure")
        mask = jax.tree.map(bool, mask)
    if not any(jax.tree.leaves(mask)):
        example = path_str(jax.tree_util.tree_flatten_with_path(params)[0][0][0])
        raise ValueError(f"trainable={trainable!r} selects no parameter; parameter paths look like {example!r}")
    return mask


def _fetch(tree):
    """Host copies of a pytree of arrays. Arrays split across processes (DiLoCo's per-replica metrics, one replica
    per host) are gathered: a collective at log time only, which every process reaches at the same step."""
    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(get, tree)


def check_zero_quantized(int8, mesh, step="auto", diloco=False):
    """Raises a one-line ValueError unless the `engine.step.Int8` settings (`Trainer(zero_quantized_weights=,
    zero_quantized_gradients=)`) can run on `mesh` with `step` (and DiLoCo when `diloco`)."""
    sizes = dict(mesh.shape)
    for name, value in zip(("zero_quantized_weights", "zero_quantized_gradients"), int8):
        _validate(name, value, isinstance(value, bool), "a bool")
        if value:
            _validate(name, value, step in ("auto", "shard_map") and not diloco and sizes.get("context", 1) == 1,
                      "False unless the step is 'shard_map' or 'auto' without diloco or context parallelism "
                      "(it quantizes the shard_map step's own collectives)")
    if int8.weights:
        _validate("zero_quantized_weights", True, sizes.get("fsdp", 1) > 1,
                  f"False on a mesh with fsdp={sizes.get('fsdp', 1)}: it quantizes the ZeRO-3 weight gathers over "
                  "fsdp; expected fsdp > 1")
    if int8.gradients:
        _validate("zero_quantized_gradients", True, sizes.get("data", 1) * sizes.get("fsdp", 1) > 1,
                  "False on a mesh with data=1 and fsdp=1: no gradient is reduced; expected data or fsdp > 1")


def _check_arguments(*, mesh, collate_fn, loss_fn, optimizer, workdir, accumulate_grad_batches, precision,
                     parallelism, checkpointing, logging, diloco, grad_fn):
    """The Trainer's argument checks across its groups (each config checked its own fields when built). Returns
    the step it runs: 'jit', 'shard_map' or 'diloco'."""
    _validate("mesh", mesh, isinstance(mesh, jax.sharding.Mesh), "a jax.sharding.Mesh, e.g. engine.make_mesh()")
    for name, value, kind in (("precision", precision, Precision), ("parallelism", parallelism, Parallelism),
                              ("checkpointing", checkpointing, Checkpointing), ("logging", logging, Logging)):
        _validate(name, value, isinstance(value, kind), f"an engine.{kind.__name__}")
    _validate("accumulate_grad_batches", accumulate_grad_batches,
              isinstance(accumulate_grad_batches, int) and accumulate_grad_batches >= 1, "an integer >= 1")
    _validate("optimizer", optimizer, hasattr(optimizer, "init") and hasattr(optimizer, "update"),
              "an optax.GradientTransformation")
    for name, fn in (("collate_fn", collate_fn), ("loss_fn", loss_fn)):
        _validate(name, fn, callable(fn), "a callable")
    _validate("diloco", diloco, diloco is None or isinstance(diloco, diloco_lib.DiLoCo), "None or an engine.DiLoCo")
    if grad_fn is not None:
        _validate("grad_fn", grad_fn, callable(grad_fn), "None or a callable (params, batch, rng) -> ((loss, "
                  "metrics), grads)")
        _validate("grad_fn", grad_fn, diloco is None, "None with diloco (DiLoCo's replicas differentiate loss_fn)")
        _validate("grad_fn", grad_fn, precision.resolved_loss_scale() is None, "None with loss scaling (float16 "
                  "compute scales the loss before the engine differentiates it); expected Precision(loss_scale=None)")
    step, offload = parallelism.step, parallelism.offload_optimizer
    if diloco is not None:
        _validate("zero_stage", parallelism.zero_stage, parallelism.zero_stage == 0, "0 with diloco (each data "
                  "position keeps a whole replica and its optimizer state)")
        _validate("step", step, step == "auto", "'auto' with diloco (DiLoCo has its own step)")
        _validate("offload_optimizer", offload, not offload, "False with diloco (its optimizer state holds the "
                  "replicas the steps compute with)")
    if checkpointing.restore == "best":
        _validate("Checkpointing.restore", checkpointing.restore, checkpointing.params_only and workdir is not None,
                  "'latest', or 'best' with Checkpointing.params_only=True and a workdir")
    if offload:
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        _validate("offload_optimizer", offload, "pinned_host" in kinds, f"False on {mesh.devices.flat[0].platform}, "
                  f"whose devices have no pinned_host memory (only {sorted(kinds)})")
    sizes = dict(mesh.shape)
    context = sizes.get("context", 1)
    if step == "shard_map" and context > 1:
        raise ValueError(f"step='shard_map' on a mesh with context={context}; expected step='jit' or 'auto' "
                         "(context parallelism runs in the jit step)")
    check_zero_quantized(parallelism.int8, mesh, step, diloco is not None)
    if diloco is not None:
        _validate("reduce_dtype", precision.reduce_dtype, not precision.reduces_narrow, "None with diloco (its "
                  "replicas reduce nothing per step)")
        return "diloco"
    # Rows split over `expert` beside an automatic `model` inside the shard_map step abort XLA's SPMD partitioner
    # (jaxlib 0.10.2, dense models too: "partition_group_list ... Check failed").
    expert_model = sizes.get("expert", 1) > 1 and sizes.get("model", 1) > 1
    if step == "auto" and any(parallelism.int8):
        step = "shard_map"
    elif step == "auto":  # with a pipeline, the shard_map step's ZeRO-3 gathers a stage's layers at once
        pipeline_fsdp = sizes.get("stage", 1) > 1 and sizes.get("fsdp", 1) > 1
        jit = mesh.devices.flat[0].platform == "cpu" or pipeline_fsdp or context > 1 or expert_model
        step = "jit" if jit else "shard_map"
    if step == "shard_map" and expert_model:
        raise ValueError(f"the shard_map step on a mesh with expert={sizes['expert']} and model={sizes['model']}; "
                         "expected step='jit' (and no Parallelism.int8), or expert or model of 1")
    if precision.reduces_narrow:
        platform = mesh.devices.flat[0].platform
        _validate("reduce_dtype", precision.reduce_dtype, step == "shard_map" and platform != "cpu",
                  f"None with the {step} step on {platform} devices (bf16 reductions run in the shard_map step on "
                  "GPU and TPU; the jit step's are the compiler's, and XLA:CPU aborts on them)")
    return step


def _auto_specs(params, mesh, loss_fn, batch_spec, rules=None):
    """`engine.auto_shard`'s PartitionSpecs of `params` for `loss_fn` traced (abstractly) on one global micro-batch
    of `batch_spec` (a pytree of `jax.ShapeDtypeStruct`): the layout a Trainer picks."""
    example = data_lib.example_batch(batch_spec)
    trace_fn = lambda p: split_loss(loss_fn(p, example, jax.random.key(0), True))[0]  # noqa: E731
    return auto_shard(params, mesh, trace_fn=trace_fn, rules=rules)


def _check_shared_workdir(workdir):
    """Every process of a multi-process run must see the same workdir (a shared filesystem): process 0 writes a fresh
    token there, the others read it back. Without this, checkpoint saves waited on files no other process could see,
    with no message and no bound. Raises the same one-line error on every process."""
    token = int(np.random.default_rng().integers(1, 2**31 - 1))
    token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    path = os.path.join(workdir, ".run_token")
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w") as f:
            f.write(str(token))
    multihost_utils.sync_global_devices("engine.trainer.workdir_token")
    try:
        with open(path) as f:
            seen = int(f.read())
    except (OSError, ValueError):
        seen = None
    agree = multihost_utils.process_allgather(np.int32(seen == token))
    if not np.all(agree):
        missing = [i for i, ok in enumerate(np.ravel(agree)) if not ok]
        raise ValueError(f"workdir={workdir} is not the same directory on every process: process(es) {missing} do "
                         "not see what process 0 wrote there; expected a workdir on a filesystem all processes share")


def _micro_batch_spec(batch):
    """A global batch [accumulate, rows, ...] (arrays or jax.ShapeDtypeStruct) -> the pytree of one micro-batch's
    jax.ShapeDtypeStruct [rows, ...]."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), np.dtype(x.dtype)), batch)


def _saved_batch_spec(meta):
    """The micro-batch spec a checkpoint's metadata recorded (a flat {name: [shape, dtype]} before pytree batches)."""
    if "batch" in meta:
        return data_lib.spec_from_json(meta["batch"])
    return {k: jax.ShapeDtypeStruct(tuple(v[0]), np.dtype(v[1])) for k, v in meta["batch_spec"].items()}


def _size_text(n_bytes):
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.2f} MB"


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
      accumulate_grad_batches: micro-batches per optimizer update (scanned inside the one compiled step).
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
        self._step_kind = _check_arguments(mesh=mesh, collate_fn=collate_fn, loss_fn=loss_fn, optimizer=optimizer,
                                           workdir=workdir, accumulate_grad_batches=accumulate_grad_batches,
                                           precision=precision, parallelism=parallelism,
                                           checkpointing=checkpointing, logging=logging, diloco=diloco,
                                           grad_fn=grad_fn)
        self._trainable = _trainable_mask(trainable, params)  # None, or a tree of bools of the parameters' structure
        self.precision, self.parallelism, self.checkpointing, self.logging = (precision, parallelism, checkpointing,
                                                                              logging)
        self.mesh, self.collate_fn, self.loss_fn, self.optimizer = mesh, collate_fn, loss_fn, optimizer
        self.workdir, self.seed, self.diloco, self.accumulate = workdir, seed, diloco, accumulate_grad_batches
        self.grad_fn = grad_fn
        # The settings the step reads, under their own names.
        self.zero_stage, self.remat = parallelism.zero_stage, parallelism.remat
        self.offload_optimizer, self._int8 = parallelism.offload_optimizer, parallelism.int8
        self.compute_dtype, self.nan_policy = precision.compute_dtype, precision.nan_policy
        self._loss_scale = precision.resolved_loss_scale()
        self.flops_per_example = logging.flops_per_example
        # Figures of the latest log line: examples_per_second, seconds_per_step and, with flops_per_example,
        # model_tflops_per_device and mfu (None where the device's peak is unknown).
        self.throughput = {}
        self._init_params = params
        self._state = None            # {'params', 'opt_state'} on the mesh once set up
        self._layout = None           # the abstract state and its shardings, once the first batch fixed them
        self._param_specs = None
        self._batch_spec = None       # one global micro-batch as a pytree of jax.ShapeDtypeStruct: fixes the trace
        self._step_fn, self._step_impls = {}, {}
        self._executables = {}        # {(sync, batch signature): the step compiled ahead of time}
        self._eval_fn = None
        self._init_opt_fn = None      # the optimizer's init, compiled once for the layout
        self.compile_count = 0        # traces (= compilations) of the train step
        self.history = []             # per-step host metrics: {'step', 'loss', 'grad_norm', 'learning_rate', ...}
        self.stopped_by_signal = False
        self.stop_signal = None       # the signal number that stopped the last fit (scripts exit with 128 + it)
        self._stop = None             # fit's fit_loop.Stop while it runs
        self._pending = []            # (step, metrics on the device) not yet checked on the host
        self._rows = None             # examples per update of the running fit
        self._timers = {"data": 0.0, "checkpoint": 0.0}  # seconds since the last log line
        self._total_steps = None
        self._step, self._epoch, self._batch_in_epoch = 0, 0, 0
        # The running `fit` call's record (where it started, its target), saved in every checkpoint; the record a
        # checkpoint restored, which the first `fit` of this Trainer continues.
        self._fit_call, self._resumed_call = None, None
        self._restored_rows = None  # examples per update of the restored run (its data position counts them)
        self._restored_spec = None  # its micro-batch spec, compared with the first batch trained on after it
        self._key = jax.random.key(seed)
        if workdir and jax.process_count() > 1:
            _check_shared_workdir(workdir)
        self._checkpointer = Checkpointer(workdir, keep=checkpointing.keep) if workdir else None
        self._best_checkpointer = None  # workdir/best, opened by fit(save_best=...) or restore='best'
        self.best = None  # {'step', 'metric', 'mode', 'value'} of the checkpoint fit(save_best=...) keeps
        self._restored_best = checkpointing.restore == "best"
        self._last_eval_step = None
        self._evals_since_best = 0  # evals since the best improved (early stopping); checkpointed
        self._writer = None
        self._bar = fit_loop.ProgressBar(False)  # fit's, while it runs
        self._restore_from_workdir()

    def _restore_from_workdir(self):
        """Restores the workdir's latest checkpoint (or its best, with Checkpointing(restore='best')), if any: the
        newest step that reads and matches its checksums, each skipped one named in a warning (engine/checkpoint.py).
        Steps skipped under 'checkpoints' are moved aside, as this Trainer's saves will write there."""
        if self._restored_best:
            source = None if not os.path.isdir(os.path.join(self.workdir, "best")) else self._open_best()
            if source is None or source.latest_step() is None:
                raise FileNotFoundError(f"Checkpointing(restore='best'): workdir={self.workdir} has no best "
                                        "checkpoint; expected a workdir trained with fit(save_best=...) (--save_best)")
            source.restore_newest(lambda step: self._restore(step, source), set_aside=False)
        elif self._checkpointer is not None and self._checkpointer.latest_step() is not None:
            self._checkpointer.restore_newest(self._restore, set_aside=True)

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def step(self):
        """Optimizer updates so far (across `fit` calls and resumes)."""
        return self._step

    @property
    def epoch(self):
        return self._epoch

    @property
    def params(self):
        """The parameters, sharded on the mesh once the first batch (or a restored checkpoint) fixed the layout."""
        return self._state["params"] if self._state is not None else self._init_params

    def set_params(self, params, *, reset_optimizer=False):
        """Replaces the parameters of a live Trainer (FedAvg's per-client start, a meta-learner's outer update): the
        same tree structure, shapes and dtypes, placed on the layout it trains with, so the compiled step is reused
        (no rebuild, no recompilation). The optimizer state is kept unless `reset_optimizer` (see
        `reset_optimizer`); step, epoch and data position are kept. Before the first batch it replaces the initial
        parameters."""
        current = self.params
        flat, treedef = jax.tree_util.tree_flatten_with_path(current)
        try:
            new = treedef.flatten_up_to(params)
        except (ValueError, TypeError):
            raise ValueError(f"set_params: params has structure {jax.tree.structure(params)}; expected the "
                             f"Trainer's {treedef}") from None
        for (path, old), x in zip(flat, new):
            dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
            if np.shape(x) != np.shape(old) or np.dtype(dtype) != np.dtype(old.dtype):
                raise ValueError(f"set_params: leaf {path_str(path)} is {np.dtype(dtype)}{list(np.shape(x))}; "
                                 f"expected {np.dtype(old.dtype)}{list(np.shape(old))}")
        if self._state is None:
            self._init_params = params
            return
        placed = jax.tree.map(_place, params, self._param_sh)
        opt_state = self._state["opt_state"]
        self._state = {"params": placed, "opt_state": opt_state}
        if reset_optimizer:
            self.reset_optimizer()

    def reset_optimizer(self):
        """Sets the optimizer state to the optimizer's initial state for the current parameters (a fresh `init`;
        the loss scale too), on the layout it trains with: no recompilation of the step."""
        if self._state is None:
            return  # set up fresh at the first batch
        self._state = {"params": self._state["params"], "opt_state": self._fresh_opt_state(self._state["params"])}

    @property
    def opt_state(self):
        return self._state["opt_state"] if self._state is not None else None

    @property
    def param_specs(self):
        return self._param_specs

    @property
    def state_shardings(self):
        """{'params', 'opt_state'}: the `NamedSharding` of every leaf of the state where it rests between steps (the
        optimizer state in pinned host memory with offload_optimizer); None before the layout is decided."""
        if self._layout is None:
            return None
        return jax.tree.map(lambda x: x.sharding, self._layout)

    @property
    def batch_spec(self):
        """One global micro-batch as the first batch (or the restored checkpoint) fixed it: the batch's pytree with a
        `jax.ShapeDtypeStruct` [rows, ...] at each leaf; None before."""
        return self._batch_spec

    def trainable_paths(self):
        """The '/'-joined paths of the parameters this Trainer trains (every one without `trainable`)."""
        flat = jax.tree_util.tree_flatten_with_path(self.params)[0]
        wants = jax.tree.leaves(self._trainable) if self._trainable is not None else [True] * len(flat)
        return [path_str(p) for (p, _), m in zip(flat, wants) if m]

    # ------------------------------------------------------------------------------------------------ the state
    def abstract_state(self, batch):
        """Lays out the state for `batch` (a pytree of arrays or jax.ShapeDtypeStruct [accumulate, rows, ...], one
        global update) without allocating it (the parameters may be `jax.ShapeDtypeStruct`s). Returns {'params',
        'opt_state'} of `jax.ShapeDtypeStruct`s with their shardings: the arguments `lower` compiles the step for.
        The first batch (or a restored checkpoint) fixes the layout; later calls return it."""
        if self._batch_spec is None:
            self._batch_spec = _micro_batch_spec(batch)
        return self._lay_out()

    def lower(self, batch, *, sync=False, platforms=None):
        """The train step lowered ahead of time for `batch` (as in `abstract_state`) on the state's abstract layout:
        nothing is allocated. sync: DiLoCo's overlapped outer-step program. platforms: lower for these backends (e.g.
        ('cuda',)) instead of this machine's."""
        state = self.abstract_state(batch)
        traced = self._compiled_step(sync).trace(state["params"], state["opt_state"], batch, np.int32(0))
        return traced.lower(lowering_platforms=tuple(platforms)) if platforms else traced.lower()

    def compile(self, batch, *, sync=False):
        """`lower(batch, sync=sync)` compiled: a `jax.stages.Compiled` (`memory_analysis()`, `as_text()`)."""
        return self.lower(batch, sync=sync).compile()

    # ------------------------------------------------------------------------------------------------ set-up
    def _lay_out(self):
        """Decides the shardings of parameters, gradients and optimizer state for the recorded batch shapes, once.
        Returns the abstract, sharded state."""
        if self._layout is not None:
            return self._layout
        abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), self._init_params)
        sizes, mask = dict(self.mesh.shape), self._trainable
        if mask is not None:
            counts = [sum(int(np.prod(x.shape)) for x, m in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(
                mask)) if m == want) for want in (True, False)]
            logging.info("training %d parameters, %d frozen (%.3g%% trained)", counts[0], counts[1],
                         100 * counts[0] / max(1, sum(counts)))
        rules = self.parallelism.sharding_rules
        self._param_specs = (rules if rules is not None and not isinstance(rules, (list, tuple)) else
                             _auto_specs(abstract_params, self.mesh, self.loss_fn, self._batch_spec, rules))
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        shapes = jax.tree.map(lambda x: x.shape, abstract_params)
        data_axis = lambda spec, shape: add_axis(spec, shape, "data", sizes, tile=device_tile(self.mesh))  # noqa: E731
        grad_specs = (jax.tree.map(data_axis, self._param_specs, shapes, is_leaf=is_spec)
                      if self.zero_stage >= 2 else self._param_specs)
        self._update_specs = (jax.tree.map(data_axis, self._param_specs, shapes, is_leaf=is_spec)
                              if self.zero_stage >= 1 else self._param_specs)  # parameter-shaped, of the update
        if self.diloco is None:
            self._init_opt = lambda p: step_lib.init_opt_state(self.optimizer, partition(p, mask)[0],  # noqa: E731
                                                               self._loss_scale)
            abstract_opt = jax.eval_shape(self._init_opt, abstract_params)
            opt_specs = _state_specs(abstract_opt, self._update_specs, shapes, P())
        else:
            abstract_opt, opt_specs = self._diloco_layout(abstract_params, shapes)
        named = lambda specs: jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=is_spec)  # noqa
        self._param_sh, self._grad_sh, self._opt_sh = (named(self._param_specs), partition(named(grad_specs), mask)[0],
                                                       named(opt_specs))
        self._opt_device_sh = self._opt_sh  # where the update reads and writes it
        if self.offload_optimizer:  # where it rests between steps (and in init, restore and checkpoints)
            self._opt_sh = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), self._opt_sh)
        log_sharding(abstract_params, self._param_specs, self.mesh)
        self._layout = {"params": abstract_like(abstract_params, self._param_sh),
                        "opt_state": abstract_like(abstract_opt, self._opt_sh)}
        return self._layout

    def _diloco_layout(self, abstract_params, shapes):
        """DiLoCo's optimizer state and its specs: the replicas, their inner optimizer states (a leading [replicas]
        dim over `data`), the outer state (one per part with fragments)."""
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        mask, replicas, parts = self._trainable, self.mesh.shape["data"], self.diloco.fragments
        trained_specs, trained_shapes = partition(self._param_specs, mask)[0], partition(shapes, mask)[0]
        plan = self._diloco_plan = diloco_lib.fragment_plan(self.diloco, trained_shapes, trained_specs,
                                                            dict(self.mesh.shape))
        self._init_opt = lambda p: diloco_lib.init_state(self.diloco, self.optimizer, partition(p, mask)[0],  # noqa
                                                         replicas, plan, self._loss_scale)
        abstract_opt = jax.eval_shape(self._init_opt, abstract_params)
        replica_specs = jax.tree.map(lambda spec: P("data", *spec), trained_specs, is_leaf=is_spec)
        replica_shapes = jax.tree.map(lambda shape: (replicas, *shape), trained_shapes,
                                      is_leaf=lambda x: isinstance(x, tuple))
        part_shapes = lambda p: jax.tree.map(lambda x: x.shape, jax.eval_shape(  # noqa: E731
            lambda t: diloco_lib.fragment(t, plan, p, parts), partition(abstract_params, mask)[0]))
        outer_specs = (_state_specs(abstract_opt["outer"], self._param_specs, shapes, P()) if parts == 1 else
                       [_state_specs(state, diloco_lib.fragment_specs(plan, trained_specs, p), part_shapes(p), P())
                        for p, state in enumerate(abstract_opt["outer"])])
        return abstract_opt, {"replicas": replica_specs,
                              "inner": _state_specs(abstract_opt["inner"], replica_specs, replica_shapes, P("data")),
                              "outer": outer_specs}

    def _setup(self, restore_step=None, checkpointer=None):
        """Lays out the state and places it (or restores it from `checkpointer`, by default the workdir's)."""
        checkpointer = checkpointer or self._checkpointer
        layout = self._lay_out()
        if restore_step is None:
            params = jax.tree.map(_place, self._init_params, self._param_sh)
            self._state = {"params": params, "opt_state": self._fresh_opt_state(params)}
        elif self.checkpointing.params_only:
            params = checkpointer.restore_params(restore_step, layout["params"])
            self._state = {"params": params, "opt_state": self._fresh_opt_state(params)}
        else:
            self._state, _ = checkpointer.restore(restore_step, layout)
        self._init_params = None  # the master copy lives on the mesh from here on

    def _fresh_opt_state(self, params):
        if self._init_opt_fn is None:
            self._init_opt_fn = jax.jit(self._init_opt, out_shardings=self._opt_sh)
        return self._init_opt_fn(params)

    def _restore(self, step, checkpointer=None):
        checkpointer = checkpointer or self._checkpointer
        self._layout = None  # a step tried before may have laid out another batch spec
        meta = checkpointer.read_meta(step)
        if meta.get("seed") != self.seed:
            logging.warning("restoring a checkpoint made with seed=%s into a Trainer with seed=%s",
                            meta.get("seed"), self.seed)
        self._batch_spec = _saved_batch_spec(meta)
        self._check_diloco_matches(meta)
        self._setup(restore_step=step, checkpointer=checkpointer)
        self._step, self._epoch, self._batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        self._restored_rows, self._resumed_call = meta.get("rows"), meta.get("fit_call")
        self._restored_spec = self._batch_spec
        self.best = meta.get("best")
        self._evals_since_best = meta.get("evals_since_best", 0)
        logging.info("restored checkpoint of step %d (epoch %d, batch %d) from %s", self._step, self._epoch,
                     self._batch_in_epoch, checkpointer.directory)

    def _check_diloco_matches(self, meta):
        """A whole-state restore needs the checkpoint's DiLoCo replicas and fragments."""
        if self.checkpointing.params_only:
            return
        saved, mine = meta.get("diloco_replicas"), self._diloco_replicas()
        if saved != mine:
            have = f"DiLoCo with {saved} replicas" if saved else "no DiLoCo"
            want = f"diloco on a mesh with data={saved}" if saved else "diloco=None"
            raise ValueError(f"workdir={self.workdir} holds a checkpoint of a run with {have}; expected {want} to "
                             "resume it, or Checkpointing(params_only=True) to take its parameters only")
        saved = meta.get("diloco_fragments") or (1 if meta.get("diloco_replicas") else None)
        mine = None if self.diloco is None else self.diloco.fragments
        if saved != mine and mine is not None:
            raise ValueError(f"workdir={self.workdir} holds a checkpoint of a DiLoCo run with fragments={saved}; "
                             f"expected DiLoCo(fragments={saved}) to resume it (each part has its own outer "
                             "optimizer state), or Checkpointing(params_only=True) to take its parameters only")

    def _note_batch(self, batch):
        """Records the shapes of one global micro-batch (drops the micro-batch axis) and sets up on first sight."""
        if self._batch_spec is None:
            self._batch_spec = _micro_batch_spec(batch)
        if self._state is None:
            self._setup()

    # ------------------------------------------------------------------------------------------------ the step
    def _train_step(self, impl, params, opt_state, batch, step):
        self.compile_count += 1  # runs only while tracing
        # The mesh as the trace's context: Pallas kernels then run on each device's own block (kernels/_partition.py).
        with kernels.under_mesh(self.mesh):
            if self.offload_optimizer:
                opt_state = jax.device_put(opt_state, self._opt_device_sh)
            params, opt_state, metrics = impl(params, opt_state, batch, step)
            if self.offload_optimizer:
                opt_state = jax.device_put(opt_state, self._opt_sh)
            return params, opt_state, metrics

    def _compiled_step(self, sync=False):
        """The compiled train step. sync: with DiLoCo's overlap, the program that also runs an outer step
        (`DiLoCo.syncs_at`); the host picks it by step number, so neither program holds a conditional."""
        if self._step_fn is None:
            self._step_fn, self._step_impls = {}, {}
        if sync not in self._step_fn:
            common = dict(loss_fn=self.loss_fn, optimizer=self.optimizer, accumulate=self.accumulate,
                          compute_dtype=self.compute_dtype, remat=self.remat, key=self._key,
                          trainable=self._trainable, grad_dtype=self.precision.grad_dtype)
            user = {} if self.grad_fn is None else {"grad_fn": self.grad_fn}
            if self._step_kind == "diloco":
                impl = diloco_lib.diloco_train_step(
                    diloco=self.diloco, replicas=self._diloco_replicas(), plan=self._diloco_plan, mesh=self.mesh,
                    specs=partition(self._param_specs, self._trainable)[0], sync=sync, loss_scale=self._loss_scale,
                    **common)
            elif self._step_kind == "shard_map":
                impl = step_lib.shard_map_train_step(
                    mesh=self.mesh, param_specs=self._param_specs, update_specs=self._update_specs,
                    zero_stage=self.zero_stage, weight_metric=getattr(self.loss_fn, "weight_metric", None),
                    loss_scale=self._loss_scale, int8=self._int8,
                    reduce_dtype=self.precision.reduce_dtype or jnp.float32, **user, **common)
            else:
                impl = step_lib.jit_train_step(grad_shardings=self._grad_sh, loss_scale=self._loss_scale, **user,
                                               **common)
            self._step_impls[sync] = impl  # the traceable body, for tests and tools
            batch_sh = data_lib.batch_sharding(self.mesh, 2)
            self._step_fn[sync] = jax.jit(functools.partial(self._train_step, impl),
                                          in_shardings=(self._param_sh, self._opt_sh, batch_sh, None),
                                          out_shardings=(self._param_sh, self._opt_sh, None), donate_argnums=(0, 1))
        return self._step_fn[sync]

    def _executable(self, sync, params, opt_state, batch, step):
        """`_compiled_step(sync)` compiled ahead of time for these arguments (one program per batch signature), so
        its memory per device is known, and logged, before the first step runs (MaxText prints it the same way)."""
        key = (sync, jax.tree.structure(batch), tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch)))
        if key not in self._executables:
            compiled = self._compiled_step(sync).lower(params, opt_state, batch, step).compile()
            memory = plan_lib.memory_per_device(compiled)
            if memory is not None:
                size = {k: _size_text(v) for k, v in memory.items()}
                logging.info("train step compiled: %s per device (arguments %s, outputs %s, aliased %s, "
                             "temporaries %s)", size["total"], size["arguments"], size["outputs"], size["aliased"],
                             size["temporaries"])
                self._check_fits(memory, size)
            self._executables[key] = compiled
        return self._executables[key]

    def _check_fits(self, memory, size):
        """Refuses, before the first step, a step that needs more memory than a device holds: XLA would fail on its
        first allocation (after the data is loaded) with a less helpful message. Not with offload_optimizer: that
        the device figures then leave out the host-resident state is not checked on a device yet."""
        device = self.mesh.devices.flat[0]
        limit = plan_lib.device_memory_bytes(device)
        if limit is None or memory["total"] <= limit:
            return
        if self.offload_optimizer:
            logging.warning("train step needs %s per device, above the %s %s holds (its optimizer state is "
                            "offloaded to the host, which these figures may count)", size["total"],
                            _size_text(limit), device.device_kind)
            return
        raise ValueError(
            f"the train step needs {size['total']} per device (arguments {size['arguments']}, temporaries "
            f"{size['temporaries']}) but a {device.device_kind} holds {_size_text(limit)}; expected a layout that "
            "fits: a larger fsdp or zero_stage, remat, a smaller per_device_batch_size or offload_optimizer "
            "(scripts/plan_memory.py --sweep ranks the layouts)")

    def compiled_step(self, sync=False):
        """The train step as last compiled for `fit` (a `jax.stages.Compiled`: `as_text()`, `memory_analysis()`);
        None before the first step. sync: DiLoCo's overlapped outer-step program."""
        found = [c for (s, *_), c in self._executables.items() if s == sync]
        return found[-1] if found else None

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self, train_examples, *, per_device_batch_size, n_epochs=None, total_epochs=None, max_steps=None,
            eval_examples=None, eval_per_device_batch_size=None, eval_predictor=None, eval_metric_fn=None,
            log_every=10, save_every=None, profile_steps=None, checkpoint_at_end=True, eval_every=None,
            save_best=None, early_stopping_patience=None, data_workers=0):
        """Trains `n_epochs` more epochs (default 1; an epoch that a previous call left unfinished is finished
        first), or up to `total_epochs` epochs counted over the Trainer's life. `max_steps`: stop at that many
        optimizer updates in total (also over the Trainer's life). So `fit(n_epochs=10)` once per round trains 10
        epochs each time (RedCoast's loop). Every checkpoint records the running call (the epoch it started at and
        its target), and the first `fit` of a Trainer restored from a workdir continues that call: `n_epochs` counts
        from where the interrupted call started, so a re-run script that passes what it passed the first time ends
        exactly where the first run would have (Keras' `epochs`, Lightning's `max_epochs`), and does nothing when
        that run had finished. Later calls train again.

        The global batch of one update is `per_device_batch_size x data x fsdp x expert x accumulate_grad_batches`
        examples.
        `train_examples`: a list or other Sequence, e.g. `engine.tasks.text_data.TokenWindows` (shuffled each epoch
        from `seed`), any iterable (streamed in order, iterated once per epoch), or a callable `epoch -> examples`
        called at the start of each epoch with its index over the Trainer's life (fresh tasks or episodes per
        epoch; it should be deterministic in `epoch` for a mid-epoch resume to see the same data). A collated batch
        may be any pytree of arrays with one row per example. The last incomplete global batch of an epoch is
        dropped. Eval (after each epoch): the mean `eval_loss` and, with `eval_predictor` and
        `eval_metric_fn(examples, predictions) -> dict`, its metrics; `eval_examples` may be a callable `epoch ->
        examples` too. `eval_every`: also every that many updates (counted over the Trainer's life, so a resume
        keeps the schedule). Each eval is logged, written to TensorBoard at its step and shown on the progress bar.
        `save_best=(metric, 'min' | 'max')`, e.g. `('loss', 'min')` or `('exact_match', 'max')` (a name the eval
        reports): after each eval that improves on the best so far, the whole state is saved under `workdir/best`
        (one checkpoint, kept apart from the last `Checkpointing.keep`; a resume reads the best value back). `best`
        then holds its step and value; `Checkpointing(params_only=True, restore='best')` reads it.
        `early_stopping_patience=N` (with save_best): training stops after N evals in a row that did not improve on
        the best (the count is checkpointed, so re-running a stopped job does not train on).
        `save_every`: checkpoint every that many updates (and at the end, unless `checkpoint_at_end=False`, for a
        caller that calls `fit` often and saves itself; a signal still saves) when there is a workdir.
        `data_workers=N`: each batch (this process's rows read from random-access examples, and `collate_fn`) is
        built in N Grain worker processes, in order, the same batches as in-process (`engine.data.iterate_batches`;
        the examples and `collate_fn` must pickle; `pip install grain`). `profile_steps=(start, end)`: a
        `jax.profiler` trace of those steps under `workdir/tensorboard`. SIGTERM or Ctrl-C: the current step
        finishes, a checkpoint is saved, `stopped_by_signal` is set and `fit` raises `engine.StoppedBySignal` (a
        SystemExit with status 128 + the signal), so that the program ends even when it calls `fit` in a loop of its
        own; a second signal stops at once.
        """
        fit_loop.check_fit_arguments(
            workdir=self.workdir, per_device_batch_size=per_device_batch_size, n_epochs=n_epochs,
            total_epochs=total_epochs, max_steps=max_steps, log_every=log_every, save_every=save_every,
            eval_examples=eval_examples, eval_predictor=eval_predictor, eval_metric_fn=eval_metric_fn,
            eval_every=eval_every, save_best=save_best, early_stopping_patience=early_stopping_patience,
            profile_steps=profile_steps)
        rows = self._rows = global_batch_size(self.mesh, per_device_batch_size, self.accumulate)
        self._check_resumed_rows(rows)
        last_epoch = self._start_call(n_epochs, total_epochs, max_steps)
        self._total_steps = self._planned_steps(train_examples, rows, per_device_batch_size, last_epoch, max_steps)
        if save_best is not None:
            self._check_best_matches(tuple(save_best))
        exhausted = lambda: (early_stopping_patience is not None  # noqa: E731
                             and self._evals_since_best >= early_stopping_patience)
        if exhausted():
            logging.info("early stopping: %s; not training on", self._early_stop_note())
            return self.history
        self._refuse_if_restored_best()
        evaluate = functools.partial(self._evaluate, eval_examples, eval_per_device_batch_size or per_device_batch_size,
                                     eval_predictor, eval_metric_fn, None if save_best is None else tuple(save_best))
        every = {"log": log_every, "save": save_every, "eval": eval_every, "workers": data_workers}
        profiler = fit_loop.Profiler(profile_steps, f"{self.workdir}/tensorboard", self._wait_for_checkpoints)
        self._pending, self._last_log = [], (time.perf_counter(), self._step)
        self._timers = {"data": 0.0, "checkpoint": 0.0}
        self._bar = fit_loop.ProgressBar(self.logging.shows_progress() and jax.process_index() == 0)
        with fit_loop.stop_on_signal() as stop:
            self._stop = stop
            done = lambda: (stop() or exhausted()  # noqa: E731
                            or (max_steps is not None and self._step >= max_steps))
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
            raise fit_loop.StoppedBySignal(self.stop_signal or signal.SIGTERM, self._step)
        return self.history

    def _epochs(self, train_examples, per_device_batch_size, rows, last_epoch, profiler, done, every, evaluate):
        """The epochs up to `last_epoch` or `done()`, each followed by an eval (`evaluate`, or None)."""
        while self._epoch < last_epoch and not done():
            examples = train_examples(self._epoch) if callable(train_examples) else train_examples
            seen = self._run_epoch(examples, per_device_batch_size, rows, profiler, done, every, evaluate)
            if done():
                break  # mid-epoch, or at its end: the next fit finds no batch left and moves to the next epoch
            if seen == 0 and self._batch_in_epoch == 0:
                raise ValueError(f"train_examples yielded fewer examples than one global batch of {rows}")
            self._epoch, self._batch_in_epoch = self._epoch + 1, 0
            if self._pending:
                self._flush(rows, None)
            if evaluate is not None and self._last_eval_step != self._step:
                evaluate()
        if self._pending:
            self._flush(rows, None)

    def _refuse_if_restored_best(self):
        if self._restored_best:
            raise ValueError("fit: this Trainer restored the best checkpoint (Checkpointing(restore='best')), whose "
                             "step lies before the workdir's later checkpoints; expected its params passed to a "
                             "Trainer with another workdir to train on from them")

    def _check_resumed_rows(self, rows):
        """A resume with another number of examples per update: the data position (batches into the epoch) is
        converted exactly, or refused where the examples already seen are not a whole number of new batches."""
        old = self._restored_rows
        if old is None or old == rows:
            return
        seen = self._batch_in_epoch * old
        if seen % rows:
            raise ValueError(f"fit: {rows} examples per update, but the checkpoint of step {self._step} was trained "
                             f"with {old} and stopped {seen} examples into epoch {self._epoch}, not a whole number of "
                             f"batches of {rows}; expected a batch size (per_device_batch_size x data x fsdp x expert "
                             f"x accumulate_grad_batches) that divides {seen}, or {old}")
        logging.warning("resuming with %d examples per update instead of the checkpoint's %d: the data position "
                        "(%d examples into epoch %d) is batch %d of the new size", rows, old, seen, self._epoch,
                        seen // rows)
        self._batch_in_epoch, self._restored_rows = seen // rows, rows

    def _note_resumed_shapes(self, batch):
        """Logs the leaves whose shape past the batch dimension differs from the restored run's first batch (a
        changed sequence length changes what one example is; its data position still counts examples)."""
        old, self._restored_spec = self._restored_spec, None
        new = _micro_batch_spec(batch)
        if jax.tree.structure(old) != jax.tree.structure(new):
            logging.warning("resumed with a batch of structure %s; the checkpoint's run had %s",
                            jax.tree.structure(new), jax.tree.structure(old))
            return
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new)):
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                logging.warning("resumed with batch leaf %s of %s%s per example; the checkpoint's run had %s%s",
                                jax.tree_util.keystr(path), b.dtype, list(b.shape[1:]), a.dtype, list(a.shape[1:]))

    def _start_call(self, n_epochs, total_epochs, max_steps):
        """Records this `fit` call and returns the epoch index it stops before: `total_epochs`, or `n_epochs` whole
        epochs after the one the call starts in, that one included when a previous call left it unfinished (so a
        call never finds nothing left to train). The first call after a restore starts where the checkpoint's
        interrupted call started."""
        resumed, self._resumed_call = self._resumed_call, None
        start = ([resumed["start_epoch"], resumed["start_batch"]] if resumed
                 else [self._epoch, self._batch_in_epoch])
        target = (total_epochs if total_epochs is not None
                  else start[0] + (1 if n_epochs is None else n_epochs) + (1 if start[1] else 0))
        self._fit_call = {"start_epoch": start[0], "start_batch": start[1], "n_epochs": n_epochs,
                          "total_epochs": total_epochs, "max_steps": max_steps, "target_epoch": target}
        if resumed and total_epochs is None:
            ended = self._epoch >= target or (max_steps is not None and self._step >= max_steps)
            logging.info("fit continues the restored run's call, started at epoch %d%s: to epoch %d%s", start[0],
                         f" batch {start[1]}" if start[1] else "", target,
                         " (reached: nothing to train; a further fit call trains on)" if ended else "")
        return target

    def _planned_steps(self, train_examples, rows, per_device_batch_size, last_epoch, max_steps):
        """The step `fit` will stop at, for the progress line; None when streaming without max_steps."""
        if callable(train_examples) or not data_lib.is_random_access(train_examples):
            return max_steps
        if len(train_examples) < rows:
            raise ValueError(f"train_examples has {len(train_examples)} examples, fewer than one global batch of "
                             f"{rows} (per_device_batch_size={per_device_batch_size} x data*fsdp*expert="
                             f"{data_lib.data_parallel_size(self.mesh)} x accumulate_grad_batches={self.accumulate})")
        remaining = max(0, last_epoch - self._epoch) * (len(train_examples) // rows) - self._batch_in_epoch
        return self._step + remaining if max_steps is None else min(max_steps, self._step + remaining)

    def _run_epoch(self, train_examples, per_device_batch_size, rows, profiler, done, every, evaluate):
        """Trains on the rest of the current epoch until it ends or `done()`; returns the batches it trained on."""
        batches = data_lib.iterate_batches(
            self.mesh, train_examples, self.collate_fn, per_device_batch_size=per_device_batch_size,
            accumulate=self.accumulate, seed=self.seed, epoch=self._epoch, start_batch=self._batch_in_epoch,
            workers=every["workers"])
        prefetch = data_lib.Prefetcher(batches)
        seen = 0
        try:
            batches_iter = iter(prefetch)
            while True:
                waited = time.perf_counter()
                item = next(batches_iter, None)
                self._timers["data"] += time.perf_counter() - waited
                if item is None:
                    break
                index, _, batch = item
                profiler.before_step(self._step)
                self._train_on(batch)
                self._batch_in_epoch, seen = index + 1, seen + 1
                profiler.after_step(self._step, self._state["params"])
                self._after_step(rows, batch, every, evaluate)
                self._bar.update(self._step, self._total_steps, rows)
                if done():
                    break
        finally:
            prefetch.close()
        return seen

    def _train_on(self, batch):
        """One optimizer update on one global batch; its metrics wait on the device until the next log line."""
        self._note_batch(batch)
        if self._restored_spec is not None:
            self._note_resumed_shapes(batch)
        sync = self.diloco is not None and self.diloco.syncs_at(self._step)
        args = (self._state["params"], self._state["opt_state"], batch, np.int32(self._step))
        params, opt_state, metrics = self._executable(sync, *args)(*args)
        self._state = {"params": params, "opt_state": opt_state}
        self._step += 1
        self._pending.append((self._step, metrics))

    def _after_step(self, rows, batch, every, evaluate):
        """What runs between steps: a log line every `log` steps, a checkpoint every `save`, an eval every `eval`."""
        if len(self._pending) >= every["log"]:
            self._flush(rows, batch)
        if every["save"] and self._checkpointer is not None and self._step % every["save"] == 0:
            self.save_checkpoint()
        if every["eval"] and self._step % every["eval"] == 0:
            if self._pending:
                self._flush(rows, batch)
            evaluate()

    def _finish(self, stopped, exhausted, checkpoint_at_end):
        """After the loop: says why it stopped, saves the last checkpoint and waits for the writes."""
        if stopped:
            self.stopped_by_signal = True
            logging.warning("signal received: stopping after step %d", self._step)
        if exhausted:
            logging.info("early stopping at step %d: %s", self._step, self._early_stop_note())
        if self._checkpointer is not None and self._state is not None and (checkpoint_at_end or stopped):
            self.save_checkpoint()
            self._checkpointer.wait()
        if self._best_checkpointer is not None:
            self._best_checkpointer.wait()

    def _flush(self, rows, batch):
        """Brings the pending metrics to the host (the only host sync of the loop), checks for non-finite losses,
        and logs."""
        pending, last_log = self._pending, self._last_log
        if self._stop is not None:
            self._stop.agree()  # every process flushes at the same steps
        host = _fetch([m for _, m in pending])
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
        logging.info("%s | epoch %d | loss %.4f | grad_norm %.3g%s | %.1f examples/s%s | %.3f s/step "
                     "(data %.3f, checkpoint %.3f, compute %.3f)", self._progress(last["step"], seconds), self._epoch,
                     last["loss"], last["grad_norm"], lr, throughput, flops, seconds, data_s, ckpt_s,
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

    def _progress(self, step, seconds_per_step):
        """'step 120/400 [######----------] 30% eta 0:01:02', or 'step 120' when the total is unknown."""
        total = self._total_steps
        if not total:
            return f"step {step}"
        done = min(1.0, step / total)
        bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
        eta = int(max(0, total - step) * seconds_per_step)
        return f"step {step}/{total} [{bar}] {100 * done:.0f}% eta {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"

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
        """Mean of `loss_fn(..., is_training=False)` over `examples`, weighted by examples per batch. The last
        incomplete batch is padded by repeating its last example; its loss counts with its real examples only."""
        _validate("per_device_batch_size", per_device_batch_size,
                  isinstance(per_device_batch_size, int) and per_device_batch_size >= 1, "an integer >= 1")
        batches = data_lib.iterate_batches(self.mesh, examples, self.collate_fn,
                                           per_device_batch_size=per_device_batch_size, shuffle=False,
                                           drop_remainder=False)
        total, count = 0.0, 0
        for _, n_real, batch in batches:
            self._note_batch(batch)
            if self._eval_fn is None:
                def eval_step(params, batch):
                    with kernels.under_mesh(self.mesh):  # see _train_step
                        loss, _ = split_loss(self.loss_fn(cast_floating(params, self.compute_dtype),
                                                           jax.tree.map(lambda x: x[0], batch),
                                                           jax.random.fold_in(self._key, 2**31 - 1), False))
                    return jnp.asarray(loss, jnp.float32)
                self._eval_fn = jax.jit(eval_step)
            total += float(self._eval_fn(self._state["params"], batch)) * n_real
            count += n_real
        if count == 0:
            raise ValueError("eval_loss: examples is empty; expected at least one example")
        return total / count

    def _evaluate(self, examples, per_device_batch_size, predictor, metric_fn, save_best=None):
        examples = examples(self._epoch) if callable(examples) else examples
        results = {"loss": self.eval_loss(examples, per_device_batch_size=per_device_batch_size)}
        if predictor is not None:
            preds = predictor.predict(examples, per_device_batch_size=per_device_batch_size, params=self.params)
            results.update({k: float(v) for k, v in metric_fn(examples, preds).items()})
        self._last_eval_step = self._step
        shown = " | ".join(f"{k} {v:.4f}" for k, v in results.items())
        logging.info("eval at step %d (epoch %d, batch %d): %s", self._step, self._epoch, self._batch_in_epoch, shown)
        self._bar.line(f"eval at step {self._step}: {shown}")
        self.history.append({"step": self._step, **{f"eval_{k}": v for k, v in results.items()}})
        self.write_scalars("eval", results)
        if save_best is not None:
            self._maybe_save_best(save_best, results)
        return results

    def _early_stop_note(self):
        best = "no finite value yet" if self.best is None else \
            f"the best {self.best['metric']} {self.best['value']:.4f} at step {self.best['step']}"
        return f"{self._evals_since_best} evals in a row without improving on {best}"

    def _open_best(self):
        if self._best_checkpointer is None:
            self._best_checkpointer = Checkpointer(self.workdir, keep=1, name="best")
        return self._best_checkpointer

    def _check_best_matches(self, save_best):
        """Reads the workdir's best so far (a resume) and refuses a different criterion: replacing a best chosen by
        another metric would lose it."""
        best = self._open_best()
        if self.best is None and best.latest_step() is not None:
            try:  # an unreadable best is moved aside: the next eval's result takes its place
                self.best = best.restore_newest(best.read_meta, set_aside=True)[1].get("best")
            except ValueError as e:
                logging.warning("save_best: %s; moved aside, the next eval's result becomes the best", e)
                best.set_aside(best.all_steps())
        if self.best is not None and (self.best["metric"], self.best["mode"]) != save_best:
            raise ValueError(f"save_best={save_best!r}: workdir={self.workdir} keeps the best checkpoint by "
                             f"{(self.best['metric'], self.best['mode'])!r} (step {self.best['step']}); expected "
                             "the same save_best, or another workdir")

    def _maybe_save_best(self, save_best, results):
        metric, mode = save_best
        if metric not in results:
            raise ValueError(f"save_best={save_best!r}: the eval reports no {metric!r}; expected one of "
                             f"{sorted(results)}")
        value = results[metric]
        better = bool(np.isfinite(value)) and (self.best is None or (
            value < self.best["value"] if mode == "min" else value > self.best["value"]))
        if not better:
            self._evals_since_best += 1
            return
        self._evals_since_best = 0
        self.best = {"step": self._step, "metric": metric, "mode": mode, "value": value}
        self._open_best().save(self._step, self._state, {**self._meta(), "best": self.best})
        logging.info("best %s so far: %.4f at step %d (saved under %s)", metric, value, self._step,
                     self._best_checkpointer.directory)
        self.write_scalars("eval", {f"best_{metric}": value})

    def write_scalars(self, group, scalars):
        """Writes host numbers `{name: value}` to TensorBoard as `group/name` at the current step (process 0 with a
        workdir; elsewhere nothing): a caller's own metrics beside the Trainer's, e.g. PPO's rollout rewards."""
        writer = self._tensorboard()
        if writer is not None:
            for k, v in scalars.items():
                writer.add_scalar(f"{group}/{k}", float(v), self._step)
            writer.flush()

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self):
        """Starts an asynchronous save of parameters, optimizer state, step, rng seed and data position."""
        if self._checkpointer is None:
            raise ValueError("save_checkpoint: this Trainer has workdir=None; pass workdir= to save checkpoints")
        if self._restored_best:
            raise ValueError("save_checkpoint: this Trainer restored the best checkpoint "
                             "(Checkpointing(restore='best')); a save would write over the workdir's later steps")
        if self._state is None:
            raise ValueError("save_checkpoint: nothing to save before the first batch fixed the sharding")
        if self._checkpointer.latest_step() == self._step:
            return
        if self._pending:  # never a checkpoint of a state whose steps were not yet checked finite
            self._flush(self._rows, None)
        started = time.perf_counter()
        self._checkpointer.save(self._step, self._state, self._meta())
        self._timers["checkpoint"] += time.perf_counter() - started

    def _meta(self):
        return {"step": self._step, "epoch": self._epoch, "batch_in_epoch": self._batch_in_epoch, "seed": self.seed,
                "batch": data_lib.spec_to_json(self._batch_spec), "rows": self._rows,
                "rng": np.asarray(jax.random.key_data(self._key)).tolist(), "diloco_replicas": self._diloco_replicas(),
                "diloco_fragments": None if self.diloco is None else self.diloco.fragments,
                "evals_since_best": self._evals_since_best, "fit_call": self._fit_call}

    def _diloco_replicas(self):
        return None if self.diloco is None else self.mesh.shape["data"]

    def close(self):
        """Waits for pending checkpoint writes and closes the TensorBoard writer."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._best_checkpointer is not None:
            self._best_checkpointer.close()
        if self._writer is not None:
            self._writer.close()


def global_batch_size(mesh, per_device_batch_size, accumulate_grad_batches=1):
    """Examples per optimizer update: `per_device_batch_size x data x fsdp x expert x accumulate_grad_batches`."""
    return per_device_batch_size * data_lib.data_parallel_size(mesh) * accumulate_grad_batches



def restore_params(workdir, *, mesh, params, loss_fn, checkpoint="latest"):
    """The parameters of `workdir`'s latest checkpoint (checkpoint='best': the one `fit(save_best=...)` kept), laid
    out over `mesh` as a Trainer with `loss_fn` lays them out (`engine.auto_shard`, traced on the checkpoint's batch
    shapes), whatever mesh, optimizer or DiLoCo replicas trained them. params: the parameter pytree (arrays or
    `jax.ShapeDtypeStruct`s: only shapes and dtypes are read). Returns (params, the checkpoint's step)."""
    check("checkpoint", checkpoint, checkpoint in RESTORE_CHECKPOINTS, f"one of {RESTORE_CHECKPOINTS}")
    name = "best" if checkpoint == "best" else "checkpoints"
    source = Checkpointer(workdir, name=name) if os.path.isdir(os.path.join(workdir, name)) else None
    step = None if source is None else source.latest_step()
    if step is None:
        raise FileNotFoundError(f"checkpoint={checkpoint!r}: workdir={workdir} has no {checkpoint} checkpoint "
                                "yet; expected a workdir a Trainer saved to" + (" with fit(save_best=...) "
                                                                              "(--save_best)" if name == "best" else ""))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)

    def restore(step):
        specs = _auto_specs(abstract, mesh, loss_fn, _saved_batch_spec(source.read_meta(step)))
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        return source.restore_params(step, abstract_like(abstract, shardings))
    try:  # the newest step that restores, each skipped one named in a warning; nothing moved (only reading here)
        step, restored = source.restore_newest(restore, set_aside=False)
        return restored, step
    finally:
        source.close()
