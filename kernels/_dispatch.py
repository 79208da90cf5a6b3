"""Choosing a kernel implementation: one rule shared by every kernel family.

Every public op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'`; `flash_attention` also takes
`'cudnn'` (cuDNN's fused attention through `jax.nn.dot_product_attention`, NVIDIA GPUs only). `None` picks the
own kernels of the device the trace is for (`target_device`: a lowering for another target under its abstract mesh
picks that target's; `flash_attention` first reads the measured defaults table, `kernels/_defaults.py`); `'xla'`
is the plain-JAX reference that runs everywhere. `interpret=True` runs a Pallas implementation in Pallas's
interpreter (on CPU), so `None` + `interpret=True` on a CPU picks the GPU-flavoured kernel.
"""
import jax

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")  # every op's
ATTENTION_IMPLEMENTATIONS = IMPLEMENTATIONS + ("cudnn", "mosaic_gpu")  # flash_attention's
_BY_BACKEND = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def implementation_for_platform(platform, *, interpret=False):
    """The fastest implementation on `platform` ('gpu', 'cuda', 'rocm', 'tpu', 'cpu', ...): a device's own
    kernels, else 'xla' ('triton' in interpret mode)."""
    return _BY_BACKEND.get(platform, "triton" if interpret else "xla")


def resolve_implementation(implementation, *, interpret=False, allowed=IMPLEMENTATIONS):
    """Returns the implementation name to run (None: the own kernels of the platform the trace is for,
    `implementation_for_platform` of `target_device()`'s); raises ValueError for one not in `allowed` (an op's
    implementations)."""
    if implementation is None:
        return implementation_for_platform(target_device().platform, interpret=interpret)
    if implementation not in allowed:
        only = f"; {implementation!r} is flash_attention's only" if implementation in ATTENTION_IMPLEMENTATIONS else ""
        raise ValueError(f"implementation={implementation!r}; expected None or one of {allowed}{only}")
    return implementation


def target_device():
    """The device a kernel is being traced for: the ambient abstract mesh's (which may be the target of an
    ahead-of-time lowering: tests/targets.py's H200, libtpu's compile-only TPUs), else the default backend's first."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)  # an empty mesh's too: tests/targets.for_gpu() names one
    return jax.devices()[0] if device is None else device


def is_nvidia_gpu(device):
    """Whether `device` (a device or an abstract one) is an NVIDIA GPU: where cuDNN runs."""
    client = getattr(device, "client", None)
    rocm = "rocm" in str(getattr(client, "platform_version", "")).lower() or device.device_kind.startswith("AMD")
    return device.platform in ("gpu", "cuda") and not rocm


# The device kind of each TPU generation as libtpu's devices state it (a v5e is "TPU v5 lite"), and the kinds read
# back, with the spellings other releases use.
TPU_DEVICE_KINDS = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
_TPU_GENERATIONS = {**{kind: g for g, kind in TPU_DEVICE_KINDS.items()}, "TPU v5e": "v5e", "TPU v5p": "v5p",
                    "TPU v6e": "v6e"}


def tpu_generation():
    """'v4', 'v5e', 'v5p' or 'v6e': the TPU a kernel is being traced for (`target_device`), or None off TPU or for
    an unknown generation. Picks the Mosaic kernels' per-generation block tables."""
    device = target_device()
    return _TPU_GENERATIONS.get(device.device_kind) if device.platform == "tpu" else None
