"""Lowering for an accelerator this machine does not have.

JAX 0.11's Triton lowering reads the GPU's compute capability while lowering and, on a host without a GPU, takes it
from the ambient abstract mesh's `AbstractDevice`; JAX 0.10 does not ask. Tests that lower for `cuda` do so inside
`for_gpu(mesh)`, which works on both.
"""
import jax

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def for_gpu(mesh=None):
    """Context naming an H200 as the target device: of `mesh`'s abstract mesh, or of an empty one without a mesh (so
    no kernel is partitioned)."""
    abstract = jax.sharding.AbstractMesh((), ()) if mesh is None else mesh.abstract_mesh
    return jax.sharding.use_abstract_mesh(abstract.update(abstract_device=H200))
