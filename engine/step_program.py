"""The Trainer's one compiled train step: which step runs, its body built over the state's layout, and its
ahead-of-time compile per batch signature (memory logged, and checked against the device, before the first step).
"""
import functools
import math
import time

import jax
import jax.numpy as jnp
from absl import logging

from engine import compiler
from engine import data as data_lib
from engine import diloco as diloco_lib
from engine import plan as plan_lib
from engine import step as step_lib
from engine.config import Checkpointing, Logging, Parallelism, Precision, check
from engine.step import partition
import kernels


def check_trainer_arguments(*, mesh, collate_fn, loss_fn, optimizer, workdir, accumulate_grad_batches, precision,
                            parallelism, checkpointing, logging, diloco, grad_fn):
    """The Trainer's argument checks across its groups (each config checked its own fields when built). Returns
    the step it runs: 'jit', 'shard_map' or 'diloco'."""
    check("mesh", mesh, isinstance(mesh, jax.sharding.Mesh), "a jax.sharding.Mesh, e.g. engine.make_mesh()")
    for name, value, kind in (("precision", precision, Precision), ("parallelism", parallelism, Parallelism),
                              ("checkpointing", checkpointing, Checkpointing), ("logging", logging, Logging)):
        check(name, value, isinstance(value, kind), f"an engine.{kind.__name__}")
    check("accumulate_grad_batches", accumulate_grad_batches,
          isinstance(accumulate_grad_batches, int) and accumulate_grad_batches >= 1, "an integer >= 1")
    check("optimizer", optimizer, hasattr(optimizer, "init") and hasattr(optimizer, "update"),
          "an optax.GradientTransformation")
    for name, fn in (("collate_fn", collate_fn), ("loss_fn", loss_fn)):
        check(name, fn, callable(fn), "a callable")
    check("diloco", diloco, diloco is None or isinstance(diloco, diloco_lib.DiLoCo), "None or an engine.DiLoCo")
    if grad_fn is not None:
        check("grad_fn", grad_fn, callable(grad_fn), "None or a callable (params, batch, rng) -> ((loss, "
              "metrics), grads)")
        check("grad_fn", grad_fn, diloco is None, "None with diloco (DiLoCo's replicas differentiate loss_fn)")
        check("grad_fn", grad_fn, precision.resolved_loss_scale() is None, "None with loss scaling (float16 "
              "compute scales the loss before the engine differentiates it); expected Precision(loss_scale=None)")
    if checkpointing.restore == "best":
        check("Checkpointing.restore", checkpointing.restore, checkpointing.params_only and workdir is not None,
              "'latest', or 'best' with Checkpointing.params_only=True and a workdir")
    return choose_step(mesh, precision, parallelism, diloco, loss_fn, grad_fn)


def check_zero_quantized(int8, mesh, step="auto", diloco=False):
    """Raises a one-line ValueError unless the `engine.step.Int8` settings (`Trainer(zero_quantized_weights=,
    zero_quantized_gradients=)`) can run on `mesh` with `step` (and DiLoCo when `diloco`)."""
    sizes = dict(mesh.shape)
    for name, value in zip(("zero_quantized_weights", "zero_quantized_gradients"), int8):
        check(name, value, isinstance(value, bool), "a bool")
        if value:
            check(name, value, step in ("auto", "shard_map") and not diloco,
                  "False unless the step is 'shard_map' or 'auto' without diloco (it quantizes the shard_map step's "
                  "own collectives)")
    if int8.weights:
        check("zero_quantized_weights", True, sizes.get("fsdp", 1) > 1,
              f"False on a mesh with fsdp={sizes.get('fsdp', 1)}: it quantizes the ZeRO-3 weight gathers over "
              "fsdp; expected fsdp > 1")
    if int8.gradients:
        reduced = math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert", "context"))
        check("zero_quantized_gradients", True, reduced > 1, "False on a mesh with data=1, fsdp=1, expert=1 and "
              "context=1: no gradient is reduced; expected data, fsdp, expert or context > 1")


def choose_step(mesh, precision, parallelism, diloco, loss_fn=None, grad_fn=None):
    """The step a Trainer runs on `mesh`: 'jit', 'shard_map' or 'diloco' (`Parallelism.step='auto'` resolved), after
    refusing the settings that step cannot run (`loss_fn`, `grad_fn`: the Trainer's, checked for the shard_map step
    on a context mesh)."""
    step, offload = parallelism.step, parallelism.offload_optimizer
    if diloco is not None:
        check("zero_stage", parallelism.zero_stage, parallelism.zero_stage == 0, "0 with diloco (each data "
              "position keeps a whole replica and its optimizer state)")
        check("step", step, step == "auto", "'auto' with diloco (DiLoCo has its own step)")
        check("offload_optimizer", offload, not offload, "False with diloco (its optimizer state holds the "
              "replicas the steps compute with)")
    if offload:
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        check("offload_optimizer", offload, "pinned_host" in kinds, f"False on {mesh.devices.flat[0].platform}, "
              f"whose devices have no pinned_host memory (only {sorted(kinds)})")
    sizes = dict(mesh.shape)
    context = sizes.get("context", 1)
    check_zero_quantized(parallelism.int8, mesh, step, diloco is not None)
    if diloco is not None:
        check("reduce_dtype", precision.reduce_dtype, not precision.reduces_narrow, "None with diloco (its "
              "replicas reduce nothing per step)")
        return "diloco"
    if step == "auto" and any(parallelism.int8):
        step = "shard_map"
    elif step == "auto":  # stage x fsdp: XLA:GPU aborts on the shard_map step beside `model`; 1F1B gathers a stage
        pipeline_fsdp = sizes.get("stage", 1) > 1 and sizes.get("fsdp", 1) > 1
        jit = mesh.devices.flat[0].platform == "cpu" or pipeline_fsdp or context > 1
        step = "jit" if jit else "shard_map"
    if precision.reduces_narrow:
        platform = mesh.devices.flat[0].platform
        check("reduce_dtype", precision.reduce_dtype, step == "shard_map" and platform != "cpu",
              f"None with the {step} step on {platform} devices (bf16 reductions run in the shard_map step on "
              "GPU and TPU; the jit step's are the compiler's, and XLA:CPU aborts on them)")
    if step == "shard_map":
        step_lib.check_token_parallel(loss_fn, mesh, step_lib.weight_metric_of(loss_fn), grad_fn)
    return step


def _size_text(n_bytes):
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.2f} MB"


class StepProgram:
    """The train step `(params, opt_state, batch, step) -> (params, opt_state, metrics)` of `kind` over `state`'s
    layout (an `engine.train_state.TrainState`, laid out before the first `jitted` call): built once per program
    (DiLoCo's overlap has two, picked by `sync`), compiled ahead of time once per batch signature."""

    def __init__(self, *, kind, state, loss_fn, optimizer, accumulate, precision, parallelism, diloco, grad_fn):
        self.kind, self.state, self.loss_fn, self.optimizer = kind, state, loss_fn, optimizer
        self.accumulate, self.precision, self.parallelism = accumulate, precision, parallelism
        self.diloco, self.grad_fn = diloco, grad_fn
        self.compile_count = 0  # traces (= compilations) of the train step
        self.impls = {}         # {sync: the traceable body}, for tests and tools
        self._jitted = {}
        self._executables = {}  # {(sync, batch signature): the step compiled ahead of time}

    def _body(self, impl, params, opt_state, batch, step):
        self.compile_count += 1  # runs only while tracing
        offload = self.parallelism.offload_optimizer
        # The mesh as the trace's context: Pallas kernels then run on each device's own block (kernels/_partition.py).
        with kernels.under_mesh(self.state.mesh):
            if offload:
                opt_state = jax.device_put(opt_state, self.state.opt_device_sh)
            params, opt_state, metrics = impl(params, opt_state, batch, step)
            if offload:
                opt_state = jax.device_put(opt_state, self.state.opt_sh)
            return params, opt_state, metrics

    def jitted(self, sync=False):
        """The jitted train step. sync: with DiLoCo's overlap, the program that also runs an outer step
        (`DiLoCo.syncs_at`); the host picks it by step number, so neither program holds a conditional."""
        if sync not in self._jitted:
            state, precision, parallelism, mesh = self.state, self.precision, self.parallelism, self.state.mesh
            common = dict(loss_fn=self.loss_fn, optimizer=self.optimizer, accumulate=self.accumulate,
                          compute_dtype=precision.compute_dtype, remat=parallelism.remat, key=state.key,
                          trainable=state.trainable, grad_dtype=precision.grad_dtype)
            user = {} if self.grad_fn is None else {"grad_fn": self.grad_fn}
            if self.kind == "diloco":
                impl = diloco_lib.diloco_train_step(
                    diloco=self.diloco, replicas=state.diloco_replicas(), plan=state.diloco_plan, mesh=mesh,
                    specs=partition(state.param_specs, state.trainable)[0], sync=sync, loss_scale=state.loss_scale,
                    **common)
            elif self.kind == "shard_map":
                impl = step_lib.shard_map_train_step(
                    mesh=mesh, param_specs=state.param_specs, update_specs=state.update_specs,
                    zero_stage=parallelism.zero_stage, weight_metric=step_lib.weight_metric_of(self.loss_fn),
                    loss_scale=state.loss_scale, int8=parallelism.int8,
                    reduce_dtype=precision.reduce_dtype or jnp.float32, **user, **common)
            else:
                impl = step_lib.jit_train_step(grad_shardings=state.grad_sh, loss_scale=state.loss_scale, **user,
                                               **common)
            self.impls[sync] = impl
            batch_sh = data_lib.batch_sharding(mesh, 2)
            self._jitted[sync] = jax.jit(functools.partial(self._body, impl),
                                         in_shardings=(state.param_sh, state.opt_sh, batch_sh, None),
                                         out_shardings=(state.param_sh, state.opt_sh, None), donate_argnums=(0, 1))
        return self._jitted[sync]

    def executable(self, sync, params, opt_state, batch, step):
        """`jitted(sync)` compiled ahead of time for these arguments (one program per batch signature), so its
        memory per device is known, and logged, before the first step runs (MaxText prints it the same way)."""
        key = (sync, jax.tree.structure(batch), tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch)))
        if key not in self._executables:
            hits, start = compiler.cache_hits(), time.perf_counter()
            compiled = self.jitted(sync).lower(params, opt_state, batch, step).compile()
            seconds = time.perf_counter() - start
            how = (f"loaded from the compilation cache in {seconds:.1f} s" if compiler.cache_hits() > hits
                   else f"compiled in {seconds:.1f} s")
            memory = plan_lib.memory_per_device(compiled)
            if memory is None:
                logging.info("train step (step=%s) %s", self.kind, how)
            else:
                size = {k: _size_text(v) for k, v in memory.items()}
                logging.info("train step (step=%s) %s: %s per device (arguments %s, outputs %s, aliased %s, "
                             "temporaries %s)", self.kind, how, size["total"], size["arguments"], size["outputs"],
                             size["aliased"], size["temporaries"])
                self._check_fits(memory, size)
            self._executables[key] = compiled
        return self._executables[key]

    def _check_fits(self, memory, size):
        """Refuses, before the first step, a step that needs more memory than a device holds: XLA would fail on its
        first allocation (after the data is loaded) with a less helpful message. Not with offload_optimizer: that
        the device figures then leave out the host-resident state is not checked on a device yet."""
        device = self.state.mesh.devices.flat[0]
        limit = plan_lib.device_memory_bytes(device)
        if limit is None or memory["total"] <= limit:
            return
        if self.parallelism.offload_optimizer:
            logging.warning("train step needs %s per device, above the %s %s holds (its optimizer state is "
                            "offloaded to the host, which these figures may count)", size["total"],
                            _size_text(limit), device.device_kind)
            return
        raise ValueError(
            f"the train step needs {size['total']} per device (arguments {size['arguments']}, temporaries "
            f"{size['temporaries']}) but a {device.device_kind} holds {_size_text(limit)}; expected a layout that "
            "fits: a larger fsdp or zero_stage, remat, a smaller per_device_batch_size or offload_optimizer "
            "(scripts/plan_memory.py --sweep ranks the layouts)")

    def latest(self, sync=False):
        """The step as last compiled ahead of time (a `jax.stages.Compiled`), None before the first."""
        found = [c for (s, *_), c in self._executables.items() if s == sync]
        return found[-1] if found else None
