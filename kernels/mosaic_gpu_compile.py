"""The project's Mosaic GPU kernels (and XLA's own GEMM fusions) compiled for Hopper (`sm_90a`) without a GPU, and
what ptxas says about each.

XLA compiles ahead of time for a GPU it does not have once the cuda PJRT plugin (`jax-cuda13-plugin`,
`jax-cuda13-pjrt`) builds a compile-only topology from a `GpuTargetConfigProto` (`TARGET_CONFIG`, an H100 SXM's).
Compiling a program that holds a Mosaic GPU kernel (`plgpu.kernel`, a `mosaic_gpu_v2` custom call) runs Mosaic's
own pipeline to PTX and ptxas to a cubin; with `MOSAIC_GPU_DUMP_TO` set it writes each kernel's PTX, ptxas's `-v`
log, its shared-memory need and, where nvdisasm is installed (`nvidia-cuda-nvdisasm`), its SASS. Unlike
kernels/gpu_compile.py's Triton tier these are the very compilers (Mosaic GPU, ptxas) a GPU run uses; timing still
needs a GPU.

Mosaic keeps compiled kernels in a per-process cache keyed by the module's hash, so a kernel compiled twice in one
process is dumped once: `compile_for_hopper` reports the kernels it found dumped, and `report()` compiles each case
once. Needs JAX >= 0.11 with the cuda plugin: `make test-gpu-compile` builds that environment.
"""
import dataclasses
import functools
import glob
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp

# Shared memory a Hopper thread block may use (227 KiB; the kernel fails to launch above it).
MAX_SHARED_BYTES = 227 * 1024
# XLA's h100_sxm target spec (xla/backends/gpu/target_config/specs/h100_sxm.txtpb), throughput tables dropped; a
# Hopper of another name, memory or bandwidth (an H200) differs only there.
_TARGET_TEMPLATE = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 feature_extension: ACCELERATED_FEATURES }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  thread_dim_limit_x: 1024 thread_dim_limit_y: 1024 thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation" platform_version: "Compute Capability 9.0a" name: "{name}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{name}"
"""


def hopper_target_config(name="NVIDIA H100 80GB HBM3", memory=84942979072, bandwidth=3352320000000):
    """The `GpuTargetConfigProto` text of an H100 SXM (by default), or of a Hopper GPU named `name` with `memory`
    bytes at `bandwidth` bytes/s (the CUDA plugin's compile-only devices take that name as their `device_kind`)."""
    return _TARGET_TEMPLATE.format(name=name, memory=int(memory), bandwidth=int(bandwidth))


TARGET_CONFIG = hopper_target_config()
_HOPPER = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One Mosaic GPU kernel compiled for sm_90a: registers per thread, spilled bytes (stores, loads), the shared
    memory Mosaic allocates (bytes), wgmma instructions in the PTX and HGMMA in the SASS (None without nvdisasm),
    ptxas's advisories by code, and the program's compile seconds."""
    label: str
    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    wgmma: int
    hgmma: int | None
    advisories: dict
    seconds: float
    ptx: str = dataclasses.field(repr=False, default="")

    @property
    def spilled(self):
        return self.spill_stores + self.spill_loads > 0


def available():
    """Why a deviceless sm_90a compile cannot run here (a one-line reason), or None when it can."""
    try:
        from jax.experimental import topologies
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:
        return f"no Mosaic GPU in this JAX ({e})"
    if not hasattr(plgpu, "kernel"):
        return f"JAX {jax.__version__} has no plgpu.kernel; expected >= 0.11"
    try:
        topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG, topology="1x1x1")
    except Exception as e:  # noqa: BLE001  (no cuda plugin: one line saying so)
        return f"no compile-only cuda topology (jax-cuda13-plugin / -pjrt not installed?): {str(e).splitlines()[0]}"
    return None


def _parse(label, base, seconds):
    text = open(base + ".ptxas").read()
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    resources = open(base + ".resources.txt").read() if os.path.exists(base + ".resources.txt") else ""
    shared = re.search(r"smem_scratch_bytes=(\d+)", resources)
    ptx = open(base + ".ptx").read() if os.path.exists(base + ".ptx") else ""
    sass = open(base + ".sass_ctrl").read() if os.path.exists(base + ".sass_ctrl") else None
    return KernelReport(
        label=label, kernel=os.path.basename(base), registers=int(registers.group(1)) if registers else 0,
        spill_stores=int(spills.group(1)) if spills else 0, spill_loads=int(spills.group(2)) if spills else 0,
        shared_bytes=int(shared.group(1)) if shared else 0, wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
        hgmma=None if sass is None else len(re.findall(r"\bHGMMA\.", sass)),
        advisories=dict(re.findall(r"\((C\d{4})\) (.*?)$", text, re.M)), seconds=seconds, ptx=ptx)


def _compile_deviceless(fn, args, compiler_options=None):
    """`jax.jit(fn)` compiled for one compile-only H100 at `args` (pytrees of arrays or ShapeDtypeStructs, placed
    on it), with XLA's `compiler_options`."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG, topology="1x1x1")
    replicated = jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), args)
    target = jax.sharding.AbstractMesh((), ()).update(abstract_device=_HOPPER)
    with jax.sharding.use_abstract_mesh(target):
        return jax.jit(fn).trace(*args).lower().compile(compiler_options=compiler_options)


def compile_for_hopper(fn, *args, label=""):
    """`KernelReport`s of the Mosaic GPU kernels in `jax.jit(fn)` compiled for an H100 (sm_90a) at `args`
    (arrays or ShapeDtypeStructs), in dump order; kernels this process compiled before are not dumped again."""
    with tempfile.TemporaryDirectory() as dump:
        before = os.environ.get("MOSAIC_GPU_DUMP_TO")
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump
        try:
            start = time.perf_counter()
            _compile_deviceless(fn, args)
            seconds = time.perf_counter() - start
        finally:
            if before is None:
                os.environ.pop("MOSAIC_GPU_DUMP_TO", None)
            else:
                os.environ["MOSAIC_GPU_DUMP_TO"] = before
        logs = sorted(glob.glob(os.path.join(dump, "*.ptxas")))
        return [_parse(label, log[:-len(".ptxas")], seconds) for log in logs]


def attention_plan(head_dim, *, causal=False, interpret=False, kv_len=None, window=None, block_k=None,
                   stages=None, block_q_bwd=64, block_k_bwd=64, logit_soft_cap=None, dropout_rate=0.0):
    """The `flash_attention` plan (kernels/attention/api.py's `_Plan`) `kernels.attention.mosaic_gpu` runs under:
    its default tiles for `head_dim` unless given."""
    from kernels.attention import mosaic_gpu
    from kernels.attention.api import BlockSizes, _Plan

    default_k, default_stages = mosaic_gpu.default_blocks(head_dim)
    blocks = BlockSizes(block_q=mosaic_gpu.BLOCK_Q, block_k=block_k or default_k, block_q_bwd=block_q_bwd,
                        block_k_bwd=block_k_bwd, num_stages=stages or default_stages, num_stages_bwd=2)
    return _Plan("mosaic_gpu", causal, head_dim**-0.5, kv_len, blocks, interpret, window=window,
                 logit_soft_cap=logit_soft_cap, dropout_rate=dropout_rate)


# The soft cap of the compiled variants: Gemma 2's attention logit cap.
SOFT_CAP = 50.0


def attention_cases():
    """{label: (fn, args)}: `kernels.attention.mosaic_gpu` at production shapes (LLaMA-3-8B's 32 / 8 heads, 4096
    tokens, bf16), causal and not, with default tiles: forward + backward (its dq and dk / dv kernels; dk and dv
    apart at 256) at head dims 64, 128 and 256; at 64 and 128 also causal with segment ids (packed documents, the
    training path's mask), with and without the soft cap, and with dropout (rate 0.1)."""
    from kernels.attention import mosaic_gpu

    def split(extra, has_ids):  # (segment ids, dropout keys) from a case's extra operands
        return extra[0] if has_ids else None, extra[-1] if len(extra) > has_ids else None

    def forward(q, k, v, *extra, plan, has_ids):
        ids, keys = split(extra, has_ids)
        return mosaic_gpu.forward(q, k, v, ids, ids, keys, plan)

    def backward(q, k, v, do, *extra, plan, has_ids):
        ids, keys = split(extra, has_ids)
        out, lse = mosaic_gpu.forward(q, k, v, ids, ids, keys, plan)
        return mosaic_gpu.backward(q, k, v, ids, ids, keys, out, lse, do, plan)

    cases = {}
    B, T, H, KVH = 1, 4096, 32, 8
    ids, keys = jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, H), jnp.int32)
    variants = {"full": ((), {}), "causal": ((), dict(causal=True)),
                "causal segments": ((ids,), dict(causal=True)),
                "causal segments soft cap": ((ids,), dict(causal=True, logit_soft_cap=SOFT_CAP)),
                "causal dropout": ((keys,), dict(causal=True, dropout_rate=0.1))}
    for D in mosaic_gpu.HEAD_DIMS:
        q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((B, T, KVH, D), jnp.bfloat16)
        for mask, (extra, options) in variants.items():
            if extra and D == 256:
                continue
            fixed = dict(plan=attention_plan(D, **options), has_ids=any(x is ids for x in extra))
            cases[f"fwd D{D} {mask}"] = (functools.partial(forward, **fixed), (q, kv, kv, *extra))
            cases[f"bwd D{D} {mask}"] = (functools.partial(backward, **fixed), (q, kv, kv, q, *extra))
    return cases


def report():
    """Every case of `attention_cases` compiled: a list of `KernelReport`."""
    return [r for label, (fn, args) in attention_cases().items() for r in compile_for_hopper(fn, *args, label=label)]


# ---- XLA's own GEMM fusions, compiled the same way (the FP8 projections' tensor-core path). ----

# A Triton GEMM tile a Hopper warpgroup MMA takes (128 x 128 x 64, 8 warps, 3 stages): the autotuner's candidates on
# a GPU include it; a deviceless compile, which cannot time candidates, otherwise takes the first that compiles
# (16 x 8 tiles, 2 warps: warp MMA).
WGMMA_GEMM_CONFIG = "block_m:128 block_n:128 block_k:64 num_stages:3 num_warps:8 num_ctas:1"


@dataclasses.dataclass(frozen=True)
class GemmFusionReport:
    """One XLA GEMM fusion kernel: its PTX's warpgroup MMA instructions by shape and operand types
    ({'m64n128k32.f32.e4m3.e4m3': 2}), ptxas's registers and spilled bytes, and the SASS's MMA opcodes ({'QGMMA': 2}:
    warpgroup FP8; 'HGMMA': warpgroup 16-bit; 'QMMA' / 'HMMA': warp MMA) and local-memory instructions (LDL / STL)."""

    kernel: str
    wgmma: dict
    registers: int
    spill_stores: int
    spill_loads: int
    sass_mma: dict
    local_memory: int


def _nvidia_tool(name):
    """A CUDA tool the `triton` package ships; ptxas: the one that reads XLA's PTX (`ptxas-blackwell`, CUDA 13, where
    triton's plain `ptxas` is CUDA 12's and refuses PTX 9.0)."""
    from triton import knobs
    bin_dir = os.path.dirname(knobs.nvidia.cuobjdump.path)
    if name == "ptxas" and os.path.exists(os.path.join(bin_dir, "ptxas-blackwell")):
        name = "ptxas-blackwell"
    return os.path.join(bin_dir, name)


def gemm_fusions_for_hopper(fn, *args, config=WGMMA_GEMM_CONFIG):
    """`GemmFusionReport`s of the Triton GEMM fusions XLA makes of `jax.jit(fn)` compiled for an H100 at `args`
    (pytrees of arrays or ShapeDtypeStructs) with every GEMM fusion at `config` (`xla_gpu_override_gemm_autotuner`;
    None: the deviceless compile's own pick): the PTX XLA writes, assembled by ptxas for sm_90a and disassembled by
    cuobjdump."""
    import subprocess

    from kernels.gpu_compile import parse_ptxas_log

    reports = []
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump, "xla_gpu_dump_llvmir": True,
                   "xla_dump_emitter_re": ".*"}  # without an emitter pattern no PTX is written
        if config is not None:
            options["xla_gpu_override_gemm_autotuner"] = config
        _compile_deviceless(fn, args, options)
        for ptx_file in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
            ptx = open(ptx_file).read()
            kernel = re.search(r"\.entry (\w*gemm_fusion\w*)\(", ptx)
            if kernel is None:
                continue
            cubin = ptx_file[:-len(".ptx")] + ".cubin"
            log = subprocess.run([_nvidia_tool("ptxas"), "-arch=sm_90a", "-v", ptx_file, "-o", cubin], check=True,
                                 capture_output=True, text=True).stderr
            sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True,
                                  text=True).stdout
            registers, spill_stores, spill_loads, _ = parse_ptxas_log(log)
            mma = re.findall(r"\b([HQI]G?MMA)\.", sass)
            reports.append(GemmFusionReport(
                kernel.group(1), {k: ptx.count(f"wgmma.mma_async.sync.aligned.{k}")
                                  for k in set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)", ptx))},
                registers, spill_stores, spill_loads, {k: mma.count(k) for k in set(mma)},
                len(re.findall(r"\b(?:LDL|STL)\b", sass))))
    return reports
