"""XLA flags of every test process (pytest's and the scripts it starts).

The suite's time is mostly XLA:CPU compiling many small programs, not running them. LLVM at -O0 without its
expensive passes, and XLA:CPU's older fusion code generator (whose code -O0 compiles quickly; at the default -O2 it
compiles slower than the new emitters; JAX 0.11's XLA has only the new ones) took the default suite from 16:02 to
8:45 on 2 cores (JAX 0.10.2), every test passing.
Nothing a test asserts depends on them: the HLO passes (fusion, sharding, buffer assignment, hence
`memory_analysis`) are unchanged; only the machine code differs. `make train` and the scripts keep XLA's defaults.
"""
from importlib import metadata


def _fast_compile():
    flags = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    # XLA aborts on a flag it does not know, and the older emitters (with their flag) are gone from JAX 0.11's.
    if tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2]) < (0, 11):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return " ".join(flags)


FAST_COMPILE = _fast_compile()  # read without importing jax: XLA_FLAGS must be set before it is


def cpu_devices(n):
    """XLA_FLAGS for a test process with `n` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}"
