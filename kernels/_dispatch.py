"""Choosing a kernel implementation: one rule shared by every kernel family.

Every public op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'`. `None` picks the fastest one for the
default backend; `'xla'` is the plain-JAX reference that runs everywhere. `interpret=True` runs a Pallas
implementation in Pallas's interpreter (on CPU), so `None` + `interpret=True` on a CPU picks the GPU-flavoured kernel.
"""
import jax

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")
_BY_BACKEND = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def implementation_for_platform(platform, *, interpret=False):
    """The fastest implementation on `platform` ('gpu', 'cuda', 'rocm', 'tpu', 'cpu', ...): a device's own
    kernels, else 'xla' ('triton' in interpret mode)."""
    return _BY_BACKEND.get(platform, "triton" if interpret else "xla")


def resolve_implementation(implementation, *, interpret=False):
    """Returns the implementation name to run; raises ValueError for an unknown one."""
    if implementation is None:
        return implementation_for_platform(jax.default_backend(), interpret=interpret)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    return implementation


# The device kind of each TPU generation as libtpu's devices state it (a v5e is "TPU v5 lite"), and the kinds read
# back, with the spellings other releases use.
TPU_DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
_TPU_GENERATIONS = {**{kind: g for g, kind in TPU_DEVICE_KINDS.items()}, "TPU v5e": "v5e", "TPU v5p": "v5p",
                    "TPU v6e": "v6e"}


def tpu_generation():
    """'v4', 'v5e', 'v5p' or 'v6e': the TPU a kernel is being traced for (the ambient mesh's devices, which may be
    the compile-only devices of an ahead-of-time target, else the default backend's), or None off TPU or for an
    unknown generation. Picks the Mosaic kernels' per-generation block tables."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
    if device is None:
        device = jax.devices()[0]
    return _TPU_GENERATIONS.get(device.device_kind) if device.platform == "tpu" else None
