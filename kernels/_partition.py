"""Pallas calls on a mesh.

A Pallas kernel is one opaque custom call: the compiler's partitioner cannot split it, so under a sharded `jit` it
gathers every input onto every device and each device computes the whole op. When the trace runs under a mesh
(`jax.set_mesh(mesh)`, or inside the engine's shard_map step, whose `model` axis stays automatic), each op instead
runs its kernel in a `jax.shard_map` over the mesh's automatic axes, on the blocks the engine's layout gives it
(engine/sharding.py): rows (batch) over `data`, `fsdp` and `expert`, attention heads and output features over
`model`, each only where the size divides. Outside a mesh, or on axes that are already manual, nothing changes. A
`context` axis (context parallelism: each device holds a slice of every row's tokens) is manual around attention
for every implementation ('xla' too), which trades sequence slices for head slices (`kernels.attention.api`).
"""
import contextlib
import contextvars
import math

import jax

from kernels import axes

BATCH_AXES = axes.BATCH
MODEL_AXIS = axes.MODEL
CONTEXT_AXIS = axes.CONTEXT  # context parallelism: tokens of a row split over it
# Axes of the enclosing `jax.vmap(..., spmd_axis_name=...)`s being traced (`vmapped`).
_VMAPPED = contextvars.ContextVar("vmapped_axes", default=())


def tracing_mesh(mesh):
    """The abstract mesh to trace a program for `mesh` under: the ambient one when it has the same axes, since it
    may name the target device of an ahead-of-time lowering (a `jax.sharding.AbstractDevice`, which JAX 0.11's
    Triton lowering needs on a host without a GPU), else `mesh.abstract_mesh`."""
    ambient, target = jax.sharding.get_abstract_mesh(), mesh.abstract_mesh
    same_axes = lambda m: (m.axis_names, m.axis_sizes, m.axis_types)  # noqa: E731
    return ambient if ambient is not None and same_axes(ambient) == same_axes(target) else target


def under_mesh(mesh):
    """Context for tracing a program for `mesh` (`tracing_mesh`), so that its kernels are partitioned over it.
    `mesh=None`: the ambient context unchanged."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(tracing_mesh(mesh))


@contextlib.contextmanager
def vmapped(axis):
    """Context for tracing the body of a `jax.vmap(..., spmd_axis_name=axis)` over `axis`'s blocks (DiLoCo's
    replicas over `data`, a pipeline's stages over `stage`). The batching adds `axis` to the specs of every
    shard_map inside (each block runs on its own devices), so the kernels' specs must not name it (JAX refuses
    that: "vmap spmd_axis_name cannot appear in shard_map in_specs") and their shard_map must make it manual."""
    token = _VMAPPED.set(_VMAPPED.get() + (axis,))
    try:
        yield
    finally:
        _VMAPPED.reset(token)


def auto_axes(implementation):
    """{axis name: size} of the ambient mesh's automatic axes larger than 1 that a kernel of `implementation` must be
    split over by hand: {} outside a mesh, and for 'xla' (plain JAX, which the compiler partitions itself)."""
    return {} if implementation == "xla" else automatic_axes()


def automatic_axes():
    """{axis name: size} of the ambient mesh's automatic axes larger than 1 that a kernel may split its operands
    over ({} outside a mesh): not those of an enclosing vmap (`vmapped`), whose blocks the batching splits."""
    vmapped_axes = _VMAPPED.get()
    return {name: size for name, size in _automatic_axes(include_size_one=False).items() if name not in vmapped_axes}


def _automatic_axes(include_size_one):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return {}
    auto = jax.sharding.AxisType.Auto
    return {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
            if kind == auto and (size > 1 or include_size_one)}


def auto_axis_size(name):
    """Size of the ambient mesh's axis `name` when it is automatic; 1 outside a mesh, where the mesh lacks it and
    where it is manual (inside a shard_map over it)."""
    return _axis_size(name, jax.sharding.AxisType.Auto)


def manual_axis_size(name):
    """Size of the ambient mesh's axis `name` when it is manual (inside a shard_map over it, as the engine's shard_map
    step is over `data`, `fsdp` and `expert`); 1 outside a mesh, where the mesh lacks it and where it is automatic."""
    return _axis_size(name, jax.sharding.AxisType.Manual)


def _axis_size(name, kind):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or name not in mesh.axis_names:
        return 1
    i = mesh.axis_names.index(name)
    return mesh.axis_sizes[i] if mesh.axis_types[i] == kind else 1


def manual_batch_axes():
    """The ambient mesh's batch axes larger than 1 that are manual (inside a shard_map over them, as the engine's
    shard_map step is over `data`, `fsdp`, `expert` and, on a context mesh, `context`), in mesh order: the axes a
    statistic of the whole batch (its rows and their tokens) must be summed over. () outside a mesh and where they
    are automatic (the partitioner sums over them itself)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    return tuple(name for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
                 if name in BATCH_AXES + (CONTEXT_AXIS,) and size > 1 and kind == jax.sharding.AxisType.Manual)


def context_size(*lengths):
    """Size of the ambient mesh's automatic `context` axis when it is larger than 1 and divides every length, else
    1. Any implementation: the sequence split is not the partitioner's to undo."""
    size = auto_axis_size(CONTEXT_AXIS)
    return size if all(n % size == 0 for n in lengths) else 1


def manual_context_size():
    """Size of the ambient mesh's `context` axis when it is manual, else 1: inside the engine's shard_map step on a
    context mesh, where each device traces its own contiguous slice of every row's tokens (the lengths an op sees
    are the slice's), so that an op mixing tokens (attention, positions) exchanges them over `context` itself."""
    return manual_axis_size(CONTEXT_AXIS)


def batch_axes(axes, rows):
    """The batch axes (in mesh order) whose sizes' product divides `rows`, or None."""
    picked = []
    for name in BATCH_AXES:
        if name in axes and rows % (math.prod(axes[a] for a in picked) * axes[name]) == 0:
            picked.append(name)
    return tuple(picked) or None


def model_axis(axes, *sizes):
    """`'model'` when it is automatic and divides every size, else None."""
    size = axes.get(MODEL_AXIS)
    return MODEL_AXIS if size and all(s % size == 0 for s in sizes) else None


def shard(fn, args, in_specs, out_specs, implementation, every_axis=False):
    """`fn(*args)`, in a `jax.shard_map` over the axes the specs name (directly when they name none). Pallas outputs
    carry no varying-axes type, hence `check_vma=False`; the backward pass still sums the gradients of inputs that
    are replicated over an axis (the weights over the batch axes). For a Pallas `implementation` every automatic
    axis of the ambient mesh is manual, those the specs do not name holding the inputs whole (what the partitioner
    does around a custom call it cannot split): Mosaic refuses a custom call in a region with any automatic axis
    ("cannot be automatically partitioned"; every engine mesh has some of size 1), and so do interpret mode's
    callbacks. The axis of an enclosing vmap over blocks (`vmapped`: a pipeline's `stage`, DiLoCo's `data`) is
    manual for every implementation ('xla' too, whose only shard_map is context parallelism's), since the batching
    adds it to the specs of the vmapped dim. Otherwise 'xla' is left to the partitioner, like everywhere else.
    `every_axis`: every automatic axis manual whatever the implementation (an 'xla' body with collectives of its own
    over some axes, which XLA's partitioner may not meet beside automatic ones: models.layers.moe's expert
    exchange)."""
    named = set()
    for spec in jax.tree.leaves(in_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)):
        for entry in spec:
            named.update(axes.entry_axes(entry))
    if implementation != "xla" or every_axis:
        named.update(_automatic_axes(include_size_one=True))
    elif named:  # 'xla' context parallelism, maybe inside a vmap over blocks
        named.update(a for a in _VMAPPED.get() if a in _automatic_axes(include_size_one=True))
    if not named:
        return fn(*args)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=named, check_vma=False)(*args)
