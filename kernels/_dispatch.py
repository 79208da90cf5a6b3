"""Choosing a kernel implementation: one rule shared by every kernel family.

Every public op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'`; `flash_attention` also takes
`'cudnn'` (cuDNN's fused attention through `jax.nn.dot_product_attention`, NVIDIA GPUs only). `None` picks the
own kernels of the device the trace is for (`target_device`: a lowering for another target under its abstract mesh
picks that target's; `flash_attention` first reads the measured defaults table, `kernels/_defaults.py`); `'xla'`
is the plain-JAX reference that runs everywhere. `interpret=True` runs a Pallas implementation in Pallas's
interpreter (on CPU), so `None` + `interpret=True` on a CPU picks the GPU-flavoured kernel.
"""
import contextlib
import contextvars

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


# The scoped VMEM the tiled matmul kernels (fused, gated, loss, grouped) ask Mosaic for, per generation: three
# quarters of the core's VMEM (128 MiB on v5e and v6e, 64 MiB on v5p). The default scoped limit (16 MiB; v6e 32)
# holds their bf16 tiles but not float32 operands, int8 weights or the fused epilogue's backward, which overflowed
# it on a real v5e (kernels/README.md). v4's core has 16 MiB in all: there such tiles are halved instead
# (`kernels.matmul._blocks.fit_vmem`).
MOSAIC_VMEM_LIMIT = {"v5e": 96 << 20, "v5p": 48 << 20, "v6e": 96 << 20}


_OWN_VMEM_LIMIT = contextvars.ContextVar("own_vmem_limit", default=True)


def mosaic_vmem_limit():
    """`MOSAIC_VMEM_LIMIT` for the TPU generation being traced for (None: the compiler's scoped limit governs, as
    inside `compiler_scoped_vmem`)."""
    return MOSAIC_VMEM_LIMIT.get(tpu_generation()) if _OWN_VMEM_LIMIT.get() else None


@contextlib.contextmanager
def compiler_scoped_vmem():
    """Traced within, the tiled matmul kernels ask for no VMEM limit of their own: the compiler's scoped limit
    (`xla_tpu_scoped_vmem_limit_kib`) governs them as it does every kernel (the TPU compile tier's brackets and tile
    searches, `kernels/tpu_compile.py`). JAX's trace caches do not key on this switch, so they are cleared on the way
    in and out: a kernel traced on one side is traced again on the other."""
    jax.clear_caches()
    token = _OWN_VMEM_LIMIT.set(False)
    try:
        yield
    finally:
        _OWN_VMEM_LIMIT.reset(token)
        jax.clear_caches()


def tpu_generation():
    """'v4', 'v5e', 'v5p' or 'v6e': the TPU a kernel is being traced for (`target_device`), or None off TPU or for
    an unknown generation. Picks the Mosaic kernels' per-generation block tables."""
    device = target_device()
    return _TPU_GENERATIONS.get(device.device_kind) if device.platform == "tpu" else None
