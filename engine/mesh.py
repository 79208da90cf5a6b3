"""The device mesh: six named axes, `('data', 'fsdp', 'expert', 'context', 'stage', 'model')`.

- `data`: pure data parallelism; weights replicated (ZeRO-1/2 may still split optimizer state / gradients over it).
- `fsdp`: ZeRO-3 / fully sharded data parallelism; weights, gradients and optimizer state split.
- `expert`: expert parallelism: rows split as over `data`, and each mixture-of-experts layer's experts split over it
  (`engine.auto_shard`); the layer sends each token to its experts' devices and back by all-to-all
  (`models.layers.moe`). Size 1 unless asked for.
- `stage`: pipeline parallelism; each stage holds a contiguous block of the layer stack (GPipe schedule in
  `models.pipeline`, weights placed by `engine.auto_shard`). Size 1 unless asked for.
- `context`: context (sequence) parallelism: each device of a group holds a contiguous slice of every row's tokens;
  attention exchanges sequence slices for head slices (DeepSpeed-Ulysses, `kernels.flash_attention`), and the
  weights are split over it like over `fsdp` (ZeRO-3). Size 1 unless asked for.
- `model`: tensor parallelism (Megatron layout chosen by `engine.auto_shard`).

The `model` and `context` axes are innermost (their all-reduces and all-to-alls sit on every layer's path) so that,
on several hosts, they stay inside one host's fast interconnect (NVLink / ICI)
and the pipeline and data-parallel axes, which send less, cross the slower network (Megatron's layout): devices are
placed stage-major, then data, fsdp, expert, context, model. The axes' order in the mesh differs from that placement
because XLA (JAX 0.11) requires the shard_map step's manual axes (`data`, `fsdp`, `expert`, `context`) to precede the
automatic `stage` (a manual `context` after it aborted the compile: "Manual axes must be sorted by mesh axis index").
"""
import math

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from kernels.axes import AXES, CONTEXT, DATA, EXPERT, FSDP, MODEL, STAGE

_PLACEMENT = (STAGE, DATA, FSDP, EXPERT, CONTEXT, MODEL)  # the device grid's order, outermost first


def _resolve_sizes(sizes, n_devices):
    named = dict(zip(AXES, sizes))
    for name, size in named.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or (size != -1 and size < 1):
            raise ValueError(f"make_mesh: {name}={size!r}; expected a positive integer or -1 (fill)")
    fill = [name for name, size in named.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"make_mesh: only one axis size may be -1, got {' and '.join(f'{n}=-1' for n in fill)}")
    known = math.prod(size for size in sizes if size != -1)
    # The messages leave out expert, stage and context axes of 1 (no pipeline, no context parallelism: the usual case).
    shown = " x ".join(f"{n}={s}" for n, s in named.items() if n not in (EXPERT, STAGE, CONTEXT) or s != 1)
    if fill:
        if n_devices % known:
            raise ValueError(f"make_mesh: {n_devices} devices cannot be split into {shown} ({known} does not divide "
                             f"{n_devices})")
        named[fill[0]] = n_devices // known
    elif known != n_devices:
        raise ValueError(f"make_mesh: {shown} = {known} devices, but {n_devices} devices are available")
    return tuple(named[n] for n in AXES)


def _device_grid(shape, devices):
    """Places devices on the `_PLACEMENT`-ordered grid `shape`: per-host blocks for the stage and data axes, the
    model axis inside a host."""
    n_hosts = len({d.process_index for d in devices})
    stage, data, fsdp, expert, context, model = shape
    data *= stage  # the stages split the outer (data) block: stage-major, then data
    fsdp *= expert  # expert sits inside the fsdp block: fsdp-major, then expert
    model *= context  # context and model share the inner (in-host) block: context-major, then model
    if n_hosts > 1:
        per_host = len(devices) // n_hosts
        # Spread hosts over the outer (data, then fsdp) axes; each host keeps a whole inner block.
        dcn_data = math.gcd(data, n_hosts)
        dcn_fsdp = n_hosts // dcn_data
        if fsdp % dcn_fsdp == 0 and per_host * n_hosts == len(devices):
            ici = (data // dcn_data, fsdp // dcn_fsdp, model)
            try:
                return mesh_utils.create_hybrid_device_mesh(ici, (dcn_data, dcn_fsdp, 1), devices,
                                                            process_is_granule=True,
                                                            allow_split_physical_axes=True).reshape(shape)
            except (ValueError, AssertionError, NotImplementedError) as e:
                logging.warning("make_mesh: hybrid mesh failed (%s); ordering devices by host instead", e)
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return np.array(ordered, dtype=object).reshape(shape)
    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, AssertionError, NotImplementedError) as e:
        logging.warning("make_mesh: topology-aware mesh failed (%s); using device order", e)
        return np.array(devices, dtype=object).reshape(shape)


def make_mesh(*, data=-1, fsdp=1, model=1, stage=1, context=1, expert=1, devices=None):
    """Builds a `Mesh` with axes `('data', 'fsdp', 'expert', 'context', 'stage', 'model')`; one size may be -1 to
    take the remaining devices.

    `devices` defaults to all devices of all processes (`jax.devices()`). Raises `ValueError` when the sizes do not
    multiply to the device count, when more than one size is -1, or a size is 0 or negative.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: devices is empty; expected at least one device")
    given = {DATA: data, FSDP: fsdp, EXPERT: expert, STAGE: stage, CONTEXT: context, MODEL: model}
    shape = _resolve_sizes(tuple(given[a] for a in AXES), len(devices))
    placed = tuple(shape[AXES.index(a)] for a in _PLACEMENT)
    grid = np.transpose(_device_grid(placed, devices), [_PLACEMENT.index(a) for a in AXES])
    return Mesh(grid, AXES)
