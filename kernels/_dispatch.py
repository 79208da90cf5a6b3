"""Choosing a kernel implementation: one rule shared by every kernel family.

Every public op takes `implementation=None | 'xla' | 'triton' | 'mosaic_tpu'`. `None` picks the fastest one for the
default backend; `'xla'` is the plain-JAX reference that runs everywhere. `interpret=True` runs a Pallas
implementation in Pallas's interpreter (on CPU), so `None` + `interpret=True` on a CPU picks the GPU-flavoured kernel.
"""
import jax

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")
_BY_BACKEND = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def resolve_implementation(implementation, *, interpret=False):
    """Returns the implementation name to run; raises ValueError for an unknown one."""
    if implementation is None:
        backend = jax.default_backend()
        if backend in _BY_BACKEND:
            return _BY_BACKEND[backend]
        return "triton" if interpret else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    return implementation
