"""Lowering for an accelerator this machine does not have, and reading what a traced program holds.

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


def kernel_operands_of_train_step(trainer, rows, seq_len, platform="cuda"):
    """The operand types of every Pallas custom call (Triton for `cuda`, Mosaic for `tpu`) in `trainer`'s step (an
    LM batch of `rows` x `seq_len` tokens, its state laid out abstractly, nothing allocated) lowered for `platform`
    (on an H200 for cuda)."""
    import re

    import jax.numpy as jnp
    import numpy as np

    batch = {k: jax.ShapeDtypeStruct((1, rows, seq_len), jnp.int32) for k in ("input_ids", "labels", "segment_ids")}
    target = for_gpu(trainer.mesh) if platform == "cuda" else jax.sharding.use_abstract_mesh(trainer.mesh.abstract_mesh)
    with target:
        lowered = trainer.lower(batch, platforms=(platform,)).as_text()
    call = r"__gpu\$xla\.gpu\.triton" if platform == "cuda" else "tpu_custom_call"
    return re.findall(rf"custom_call @{call}\(.*?\).*?: \((.*?)\) ->", lowered)


def jaxpr_shapes(jaxpr):
    """Shapes of every intermediate of a jaxpr, sub-jaxprs (scan, cond, custom_vjp, pjit) included."""
    for eqn in jaxpr.eqns:
        yield from (tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_shapes(inner)
