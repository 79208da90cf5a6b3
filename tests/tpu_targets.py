"""Compile-only TPU devices for the `tpu` test tier (`make test-tpu`): the real Mosaic and XLA:TPU compilers run on
this machine through libtpu (`jax[tpu]`), without a TPU. Tests marked `tpu` call `tpu_devices(generation)`; it skips
them where libtpu is not installed (the default `.venv`)."""
import functools

import pytest

# One small slice per generation: the topology name `get_topology_desc` takes and its chip count.
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x4", "v5p": "v5p:2x2x1", "v6e": "v6e:2x4"}
GENERATIONS = tuple(TOPOLOGIES)


@functools.cache
def _topology(name, num_slices):
    from jax.experimental import topologies  # noqa: PLC0415

    return topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=num_slices)


def tpu_devices(generation, num_slices=1):
    """The compile-only devices of `generation`'s slice in TOPOLOGIES (`num_slices` of them); skips the test without
    libtpu."""
    try:
        import libtpu  # noqa: F401, PLC0415
    except ImportError:
        pytest.skip("libtpu is not installed: run the TPU compile tier with `make test-tpu`")
    return list(_topology(TOPOLOGIES[generation], num_slices).devices)
