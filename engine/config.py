"""The Trainer's settings, grouped by concern: small frozen dataclasses that each check their own fields when built.

`Trainer(precision=Precision(compute_dtype=jnp.bfloat16), parallelism=Parallelism(zero_stage=2), ...)`. Checks that
need more than one group or the mesh (DiLoCo against ZeRO, the step against context parallelism) are the Trainer's.
"""
import dataclasses
import os
import sys

import jax.numpy as jnp

from engine import step as step_lib

NAN_POLICIES = ("raise", "skip")
STEPS = ("auto", "shard_map", "jit")
RESTORE_CHECKPOINTS = ("latest", "best")
GRAD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check(name, value, ok, expected):
    """Raises the engine's one-line ValueError for a bad argument: its name, its value, what was expected."""
    if not ok:
        raise ValueError(f"{name}={value!r}; expected {expected}")


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Precision:
    """Numerics of the step.

    compute_dtype: e.g. `jnp.bfloat16`: forward and backward in that dtype; master weights and optimizer state stay
      in the parameters' dtype. None: the parameters' dtype. FP8 matmuls are the model's setting, not a field here:
      `models.ModelOptions(fp8=True)` (the scripts' --fp8) runs the projections in FP8 within this compute dtype; the
      step only sees parameters, so a second switch here could disagree with the model it trains.
    loss_scale: loss scaling for float16 compute (`engine.LossScale`): 'auto' ('dynamic' when compute_dtype is
      float16, else None), 'dynamic' (`LossScale()`: start at 2^15, halve and skip the step on an overflow, double
      after 2000 finite steps), a number >= 1 (a fixed scale), an `engine.LossScale`, or None. Its state rides in the
      optimizer state (checkpointed, so a resume continues it); each step's scale is the `loss_scale` metric. A
      skipped overflow step is logged, not an error, until the scale reaches its minimum. With diloco every replica
      keeps, applies and adjusts its own scale.
    nan_policy: 'raise' (stop with an error naming the step) or 'skip' (drop that update). Either way a non-finite
      update is never applied.
    grad_dtype: the dtype the gradients are held in from the backward pass to the optimizer update, the running sum
      over micro-batches included (MaxText's grad_dtype). None: the parameters' dtype. jnp.bfloat16 halves the
      memory they take (engine/README.md#figures): the shard_map step still sums each gradient over `fsdp` in
      float32 and rounds the sum (a `data` axis then adds the rounded partial sums in float32); the update (gradient
      norm, non-finite guard, optimizer) computes in the parameters' dtype.
    reduce_dtype: the dtype the shard_map step's gradient reductions across devices (ZeRO-3's per-layer
      reduce-scatters, the data-parallel all-reduce) carry and sum in, as FSDP's reduce_dtype. None: float32.
      jnp.bfloat16 halves the bytes sent and the full-size gradients waiting for their reduction (MaxText's step
      reduces in bf16 too; engine/README.md#figures); GPU and TPU only (XLA:CPU aborts on bf16 reductions in this
      step), and not in the jit step, whose reductions the compiler places in the backward pass's dtype.
    """
    compute_dtype: object = None
    loss_scale: object = "auto"
    nan_policy: str = "raise"
    grad_dtype: object = None
    reduce_dtype: object = None

    def __post_init__(self):
        if self.compute_dtype is not None:
            try:
                floating = jnp.issubdtype(jnp.dtype(self.compute_dtype), jnp.floating)
            except TypeError:
                floating = False
            check("compute_dtype", self.compute_dtype, floating, "a floating dtype such as jnp.bfloat16")
            object.__setattr__(self, "compute_dtype", jnp.dtype(self.compute_dtype))
        scale = self.loss_scale
        check("loss_scale", scale, scale in (None, "auto", "dynamic") or (_is_number(scale) and scale >= 1)
              or isinstance(scale, step_lib.LossScale),
              "None, 'auto', 'dynamic', a number >= 1 (a fixed scale) or an engine.LossScale")
        check("nan_policy", self.nan_policy, self.nan_policy in NAN_POLICIES, f"one of {NAN_POLICIES}")
        for name in ("grad_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                try:
                    dtype = jnp.dtype(value)
                except TypeError:
                    dtype = None
                check(name, value, dtype in GRAD_DTYPES, "None, jnp.float32 or jnp.bfloat16")
                object.__setattr__(self, name, dtype)

    @property
    def reduces_narrow(self):
        """Whether gradient reductions are asked for in a dtype narrower than float32."""
        return self.reduce_dtype not in (None, jnp.dtype(jnp.float32))

    def resolved_loss_scale(self):
        """None or the `engine.LossScale` the step applies ('auto' decided by compute_dtype)."""
        scale = self.loss_scale
        if scale == "auto":
            scale = "dynamic" if self.compute_dtype == jnp.dtype(jnp.float16) else None
        if scale is None or isinstance(scale, step_lib.LossScale):
            return scale
        return step_lib.LossScale() if scale == "dynamic" else step_lib.LossScale(float(scale), dynamic=False)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How the step splits its work and state over the mesh.

    step: 'shard_map' (`engine.step.shard_map_train_step`: explicit ZeRO gathers and gradient reductions over
      `data` x `fsdp`, each device running `loss_fn` on its own rows; when `loss_fn` averages over something other
      than rows, name that count in `loss_fn.weight_metric`, e.g. 'tokens', to get the global-batch mean) or 'jit'
      (`engine.step.jit_train_step`: the reference, `loss_fn` on the global micro-batch, the compiler partitions).
      'auto' (default): 'shard_map' on GPU and TPU, where its explicit collectives send less (scripts/plan_memory.py
      measures both); 'jit' on CPU, where the simulated devices' collectives are memory copies (bench_step.py);
      'jit' for a pipeline (mesh `stage` > 1) with `fsdp` > 1, where the shard_map step's ZeRO-3 gathers all of a
      stage's layers at once; 'jit' with context parallelism (mesh `context` > 1), the only step that runs it (XLA's
      partitioner aborts on the attention's manual all-to-all region nested in the shard_map step's); 'shard_map'
      whenever zero_quantized_weights or zero_quantized_gradients is set (they quantize its own collectives). Both
      give the same results (tests/test_step.py, tests/test_pipeline.py).
    zero_stage: 0, 1 (optimizer state also split over `data`) or 2 (gradients too). The `fsdp` axis always splits
      weights, gradients and optimizer state (ZeRO-3).
    remat: rematerialise `loss_fn`'s forward in the backward pass.
    sharding_rules: `[(regex, PartitionSpec)]` overrides for `engine.auto_shard` (the rest is automatic), or a full
      pytree of `PartitionSpec`s.
    offload_optimizer: keep the optimizer state in pinned host memory between steps (ZeRO-Offload's placement, as
      MaxText's optimizer_memory_host_offload): each step brings it to the device for the update and writes it back,
      trading two host-link transfers of it per step for its device memory. Not with diloco.
    zero_quantized_weights, zero_quantized_gradients: ZeRO++'s quantized communication (DeepSpeed's options of these
      names; `engine.step.Int8`) in the shard_map step, which 'auto' then picks: every ZeRO-3 parameter of two or
      more dims is all-gathered over `fsdp` as int8 codes with per-row scales (the master weights stay exact; needs
      fsdp > 1), and / or every gradient of two or more dims is reduced as int8. Not with diloco or context
      parallelism.
    """
    step: str = "auto"
    zero_stage: int = 0
    remat: bool = False
    sharding_rules: object = None
    offload_optimizer: bool = False
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False

    def __post_init__(self):
        check("step", self.step, self.step in STEPS, f"one of {STEPS}")
        check("zero_stage", self.zero_stage, self.zero_stage in (0, 1, 2), "0, 1 or 2")
        for name in ("offload_optimizer", "zero_quantized_weights", "zero_quantized_gradients"):
            check(name, getattr(self, name), isinstance(getattr(self, name), bool), "a bool")

    @property
    def int8(self):
        return step_lib.Int8(weights=self.zero_quantized_weights, gradients=self.zero_quantized_gradients)


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """What the workdir keeps and what a Trainer on it restores.

    keep: how many recent checkpoints to keep.
    restore: which of the workdir's checkpoints the constructor restores: 'latest' or 'best' (the one
      `fit(save_best=...)` kept, under `workdir/best`; with params_only=True only, and such a Trainer neither trains
      nor saves: it would write over the later checkpoints' steps).
    params_only: restore only the parameters (and the step and data position) of the checkpoint, with a fresh
      optimizer state: to use a model whatever optimizer or DiLoCo replicas trained it. Otherwise a restore takes the
      whole state, and a DiLoCo checkpoint needs the same DiLoCo data size and fragments.
    local_dir: a directory on fast storage local to each host (a local disk, `/dev/shm`) for a second tier of
      checkpoints (engine/checkpoint_tiers.py): every `local_every` updates each process writes its own shards
      there, and a restart restores the newest complete copy of either tier. None: the workdir's checkpoints only.
    local_every: updates between local saves (with `local_dir`).
    local_replicas: 1: in a multi-process run each local save also sends the process's blocks to a peer, which
      keeps them beside its own, so a restart where a host lost its local copy still restores the local step; 0
      (the default: the transfer is in the save's blocking part, engine/README.md#figures): none, and such a restart
      falls back to the persistent tier. One process: no effect.
    """
    keep: int = 3
    restore: str = "latest"
    params_only: bool = False
    local_dir: object = None
    local_every: int = 10
    local_replicas: int = 0

    def __post_init__(self):
        check("Checkpointing.keep", self.keep, isinstance(self.keep, int) and not isinstance(self.keep, bool)
              and self.keep >= 1, "an integer >= 1")
        check("Checkpointing.restore", self.restore, self.restore in RESTORE_CHECKPOINTS,
              f"one of {RESTORE_CHECKPOINTS}")
        check("Checkpointing.params_only", self.params_only, isinstance(self.params_only, bool), "a bool")
        check("Checkpointing.local_dir", self.local_dir, self.local_dir is None or (
            isinstance(self.local_dir, (str, os.PathLike)) and str(self.local_dir) != ""), "None or a directory path")
        check("Checkpointing.local_every", self.local_every, isinstance(self.local_every, int) and not isinstance(
            self.local_every, bool) and self.local_every >= 1, "an integer >= 1")
        check("Checkpointing.local_replicas", self.local_replicas, isinstance(self.local_replicas, int) and not
              isinstance(self.local_replicas, bool) and self.local_replicas in (0, 1), "0 or 1")


@dataclasses.dataclass(frozen=True)
class Logging:
    """What `fit` reports.

    flops_per_example: model FLOPs of one training example, forward and backward (for the native models:
      `models.flops.train_flops_per_example`). Each log line then adds the model TFLOP/s per device and, on a device
      of known peak (`engine.flops.PEAK_TFLOPS`), the model FLOPs utilisation (MFU); `Trainer.throughput` holds the
      latest figures.
    progress: a progress bar on stderr (steps, loss, examples/s, time left) with each eval as one line above it, on
      process 0. None: when stderr is a terminal (not in CI or when redirected); True / False: always / never. The
      absl log lines carry the same figures either way.
    """
    flops_per_example: object = None
    progress: object = None

    def __post_init__(self):
        value = self.flops_per_example
        check("flops_per_example", value, value is None or (_is_number(value) and value > 0),
              "None or a positive number")
        check("progress", self.progress, self.progress in (None, True, False), "None (when stderr is a terminal), "
              "True or False")

    def shows_progress(self):
        return sys.stderr.isatty() if self.progress is None else self.progress
