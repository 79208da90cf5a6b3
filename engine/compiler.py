"""The one place that sets XLA options, so that collectives overlap compute, and where compiled programs are kept.

`configure(platform)` must run before JAX initialises its backend (the first `jax.devices()` or computation): XLA
reads `XLA_FLAGS` (GPU) and libtpu reads `LIBTPU_INIT_ARGS` (TPU) once, at start-up. It appends only the flags of
`platform`, never overrides one the user already set, and does nothing for 'cpu' (tests and plans compile as is).
Unknown flags abort XLA, so every GPU flag here is one the pinned jaxlib (0.10.2) and 0.11 both know; the TPU
tier (tests/test_tpu_step.py) compiles with every TPU flag, which libtpu would refuse if it did not know one.

Every script calls it (`engine.tasks.cli.run`, before the script's `main`); a library user calls
`engine.compiler.configure()` first thing, before anything asks JAX for a device. Called after the backend is up
it changes nothing and logs a warning saying so.

`use_compilation_cache(path)` turns on JAX's persistent compilation cache: a program that took a second or more to
compile (the train step, evals; on a GPU with its autotuning, whose per-fusion results XLA keeps there too) loads
from disk in the next process that compiles it, a restarted or re-run script included. The scripts call it
(`--compilation_cache_dir`); a library user calls it, or sets `jax_compilation_cache_dir`, before the first compile.
`cache_hits()` counts the programs loaded from it in this process.
"""
import collections
import os
import threading

import jax
from absl import logging

# XLA's elimination of a scanned stack's zero fills (below); named once, for the runs and tests that turn it off.
FILL_ELIMINATION = "xla_gpu_enable_dus_accumulator_zero_init_elimination"
# GPU (XLA_FLAGS). Why each:
GPU_FLAGS = {
    # Schedule the async collective start/done pairs against independent compute with a cost model, instead of
    # issuing each collective right where its result is needed (then the GPU would idle for it).
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # The collective pipeliner: inside a scanned layer loop, move iteration i+1's all-gather into iteration i (the
    # ZeRO-3 prefetch of the next layer's weights) and iteration i's reduce-scatter / all-reduce into iteration
    # i+1 (the backward pass reduces layer i's gradients while layer i-1 computes).
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # Unroll loops by two so the pipelined collective of the next iteration has its own (double) buffer.
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # A scanned stack's [layers, ...] buffers (its saved activations, its weights' gradients) start uninitialised
    # instead of zero-filled where XLA proves every slot is written before anything reads it (each iteration's only
    # use of the buffer a dynamic-update-slice, the iterations covering it): an AllocateBuffer, no launch, instead of a
    # memset of the whole stack a step. Off in XLA by default; what it saves: engine/README.md#figures.
    FILL_ELIMINATION: "true",
    # Collectives on the highest-priority stream: a ready collective is not starved by a long compute kernel.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # Combine small collectives (norm scales, biases, per-parameter reductions) into one up to these sizes: NCCL
    # latency (~10s of us per call) dominates for small messages. 128 MiB keeps the combined buffers modest.
    "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": "134217728",
    "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
}

# TPU (LIBTPU_INIT_ARGS). Why each:
TPU_FLAGS = {
    # As on GPU: a cost-model scheduler that overlaps async collectives with compute.
    "xla_tpu_enable_latency_hiding_scheduler": "true",
    # Turn all-gathers / reduce-scatters into async collective fusions that run on the ICI concurrently with the
    # TensorCore's compute, including across several scheduling steps (the ZeRO-3 gathers of the next layer).
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
    # Data-parallel gradient reductions are started as soon as each gradient is ready, overlapping the rest of the
    # backward pass, also when the gradients differ in size.
    "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
    "xla_tpu_data_parallel_opt_different_sized_ops": "true",
}

_ENV = {"gpu": ("XLA_FLAGS", GPU_FLAGS), "cuda": ("XLA_FLAGS", GPU_FLAGS), "rocm": ("XLA_FLAGS", GPU_FLAGS),
        "tpu": ("LIBTPU_INIT_ARGS", TPU_FLAGS)}


def detect_platform():
    """The platform JAX will pick, guessed without initialising it: the first of `JAX_PLATFORMS`, else 'gpu' when an
    NVIDIA or AMD device node exists, 'tpu' when a TPU one does, else 'cpu'."""
    forced = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if forced:
        return forced
    if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"):
        return "gpu"
    if os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):
        return "tpu"
    return "cpu"


def configure(platform=None):
    """Appends the overlap flags of `platform` ('gpu', 'cuda', 'rocm', 'tpu'; 'cpu' changes nothing; None: the
    `detect_platform()` guess) to its environment variable; returns the flags it added. Call before JAX initialises
    its backend."""
    platform = detect_platform() if platform is None else platform
    if platform not in (*_ENV, "cpu"):
        raise ValueError(f"configure: platform={platform!r}; expected one of {sorted((*_ENV, 'cpu'))}")
    if platform == "cpu":
        return []
    var, flags = _ENV[platform]
    current = os.environ.get(var, "")
    added = [f"--{k}={v}" for k, v in flags.items() if f"--{k}=" not in current]
    if added:
        os.environ[var] = " ".join([current, *added]).strip()
        logging.info("compiler: %s += %s", var, " ".join(added))
        if backend_started():
            logging.warning("compiler.configure(%r) ran after JAX started its backend: the %s flags take effect "
                            "only in the next process (call it before anything asks JAX for a device)", platform,
                            var)
    return added


def backend_started():
    """Whether JAX has initialised a backend (after which XLA and libtpu no longer read their flags)."""
    from jax._src import xla_bridge  # noqa: PLC0415 - jax's own test of it; no public one
    return xla_bridge.backends_are_initialized()


# JAX's persistent compilation cache.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = collections.Counter()  # per thread: JAX records the event in the thread that compiles


def _count_cache_hit(event, **_):
    if event == _CACHE_HIT_EVENT:
        _cache_hits[threading.get_ident()] += 1


jax.monitoring.register_event_listener(_count_cache_hit)


def cache_hits():
    """Programs the calling thread loaded from the persistent compilation cache instead of compiling them."""
    return _cache_hits[threading.get_ident()]


def default_cache_dir():
    """Where the scripts keep compiled programs unless told otherwise: `$XDG_CACHE_HOME/redline/jax` (XDG_CACHE_HOME
    defaults to ~/.cache), one directory for every run of this user; deleting it only costs compile time."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "redline", "jax")


def use_compilation_cache(path=None):
    """Keeps every program that takes a second or more to compile (JAX's `jax_persistent_cache_min_compile_time_secs`)
    in JAX's persistent compilation cache at `path`, so that later processes load it instead of compiling: a
    directory (created if missing) or a URL JAX's cache takes (gs://...). '' turns the cache off; None: the directory
    JAX already has (`JAX_COMPILATION_CACHE_DIR`), else `default_cache_dir()`. Returns the directory in use, or None
    when off. A `path` that cannot be created raises ValueError; the default one is skipped with a warning (a
    read-only home must not stop a run). Call before the first compile: JAX opens its cache once per process. Only
    process 0 of a multi-process run writes entries (JAX's rule); every process reads them."""
    if path == "":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if path is None and not jax.config.jax_enable_compilation_cache:
        return None  # the user turned JAX's cache off (JAX_ENABLE_COMPILATION_CACHE=false)
    given = path is not None
    path = path or jax.config.jax_compilation_cache_dir or default_cache_dir()
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            if given:
                raise ValueError(f"cannot create {path} ({e.strerror or e}); expected a directory this process can "
                                 "create and write, or '' to compile without the cache") from None
            logging.warning("compiler: no compilation cache (%s: %s); every program compiles afresh", path,
                            e.strerror or e)
            jax.config.update("jax_enable_compilation_cache", False)
            return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
