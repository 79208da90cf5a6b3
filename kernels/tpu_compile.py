"""The project's Mosaic kernels compiled for TPU generations without a TPU: what the real compilers accept, and what
each kernel needs of VMEM and HBM.

libtpu (`jax[tpu]`; the `tpu` test tier's environment, `make test-tpu`) compiles for the compile-only devices of a
topology (`jax.experimental.topologies`): a mesh over them and `jax.jit(f).trace(...).lower().compile()` run Mosaic
and XLA:TPU as on the chip, and `memory_analysis()` gives the program's real bytes per device. A Mosaic call sits
inside a `shard_map` (`kernels._partition`), which every op does by itself under a mesh.

VMEM: a kernel's pipelined windows, scratch and temporaries must fit the scoped VMEM XLA lends a custom call
(`SCOPED_VMEM_BYTES`, read from Mosaic's errors; the libtpu option `xla_tpu_scoped_vmem_limit_kib` sets it per
compile). `overflow(error)` reads the kernel and sizes off a failed compile, `min_scoped_vmem` finds the least limit
a program compiles under. `cases(generation)` is the catalogue the `tpu` tests compile and
`scripts/tpu_compile_report.py` tabulates (kernels/README.md).
"""
import contextlib
import dataclasses
import functools
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kernels import axes
from kernels._dispatch import TPU_DEVICE_KINDS, compiler_scoped_vmem
from kernels.attention import flash_attention
from kernels.matmul import fused_matmul, gated_mlp, linear_cross_entropy

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# One small slice per generation: the topology name `get_topology_desc` takes.
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x4", "v5p": "v5p:2x2x1", "v6e": "v6e:2x4"}
# HBM per compile-only device: one TensorCore (v4's topology lists both cores of each chip, without megacore, each
# with half the chip's 32 GiB); Google Cloud's TPU system architecture pages.
HBM_BYTES = {"v4": 16 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
# Scoped VMEM a custom call may use by default, as libtpu's errors state it ("Scoped allocation with size ... and
# limit ..."; on v4 "Used ... of 16.00M vmem": the whole VMEM of a core).
SCOPED_VMEM_BYTES = {"v4": 16 * MiB, "v5e": 16 * MiB, "v5p": 16 * MiB, "v6e": 32 * MiB}
BF16 = jnp.bfloat16


@functools.cache
def devices(generation):
    """The compile-only devices of `generation`'s slice in TOPOLOGIES (needs libtpu)."""
    from jax.experimental import topologies  # noqa: PLC0415  (libtpu is only in the tpu tier's environment)

    return tuple(topologies.get_topology_desc(topology_name=TOPOLOGIES[generation], platform="tpu").devices)


def lower(generation, fn, shapes, *, num_devices=1, axis_names=(axes.DATA,), specs=None):
    """fn lowered for `generation` on a mesh of its first `num_devices` devices (all along the first of
    `axis_names`); shapes: (shape, dtype) per argument, laid out by `specs` (replicated when None)."""
    grid = (num_devices,) + (1,) * (len(axis_names) - 1)
    mesh = Mesh(np.array(devices(generation)[:num_devices]).reshape(grid), axis_names)
    specs = specs or [P()] * len(shapes)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
            for (shape, dtype), spec in zip(shapes, specs)]
    with jax.set_mesh(mesh):
        return jax.jit(fn).trace(*args).lower()


def compile_with(lowered, scoped_vmem=None):
    """lowered.compile(), with the scoped VMEM limit set to `scoped_vmem` bytes (whole KiB) when given."""
    options = {} if scoped_vmem is None else {"xla_tpu_scoped_vmem_limit_kib": -(-scoped_vmem // KiB)}
    return lowered.compile(compiler_options=options)


def device_bytes(compiled):
    """HBM a compiled program needs per device: arguments, outputs (less what they alias) and temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


@dataclasses.dataclass(frozen=True)
class Overflow:
    """A compile that ran out of VMEM: the kernel (its pallas_call name), the bytes it asked for and the limit it
    met (the scoped limit, or the core's VMEM)."""
    kernel: str
    needed: int
    limit: int


_SIZE = r"([\d.]+)([KMG])"
_SCOPED = re.compile(rf"allocating on stack for %([A-Za-z_]+?)(?:\.\d+)? = .*?Scoped allocation with size {_SIZE} "
                     rf"and limit {_SIZE}", re.S)
_CAPACITY = re.compile(rf"Ran out of memory in memory space vmem\. Used {_SIZE} of {_SIZE} vmem.*?"
                       r'op_name="[^"]*?/(\w+)/pallas_call"', re.S)
_UNITS = {"K": KiB, "M": MiB, "G": GiB}


def overflow(error):
    """The `Overflow` a compile error reports, or None for any other error."""
    text = str(error)
    if m := _SCOPED.search(text):
        kernel, size, unit, limit, limit_unit = m.groups()
    elif m := _CAPACITY.search(text):
        size, unit, limit, limit_unit, kernel = m.groups()
    else:
        return None
    return Overflow(kernel, round(float(size) * _UNITS[unit]), round(float(limit) * _UNITS[limit_unit]))


def try_compile(lowered, scoped_vmem=None):
    """(compiled, None), or (None, Overflow) when a kernel does not fit VMEM; other errors raise."""
    try:
        return compile_with(lowered, scoped_vmem), None
    except Exception as error:  # noqa: BLE001 - libtpu raises JaxRuntimeError / XlaRuntimeError by version
        found = overflow(error)
        if found is None:
            raise
        return None, found


def min_scoped_vmem(lowered, resolution=16 * KiB, start=256 * KiB):
    """The least scoped VMEM limit (bytes, within `resolution`) under which `lowered` compiles: the failed
    compiles' reported sizes climb to it, then a bisection. Mosaic sizes part of a kernel's temporaries by the
    limit, so this, not a failure's reported size, is the kernel's need."""
    low, high, limit = 0, None, start
    while high is None:
        compiled, over = try_compile(lowered, limit)
        if compiled is not None:
            high = limit
        else:
            low, limit = limit, max(over.needed + resolution, limit * 5 // 4)
    while high - low > resolution:
        mid = (low + high) // 2 // KiB * KiB
        if try_compile(lowered, mid)[0] is not None:
            high = mid
        else:
            low = mid
    return high


# ---- what a kernel needs of VMEM, from its own BlockSpecs and body ----

# Float32 copies of a kernel's largest intermediate its body may hold at once (logits [block_q, block_k], an
# accumulator [block_m, block_n]), per generation: measured up to 1.8 beyond the windows and scratch on v5p
# (kernels/README.md), 3.04 on v4 (the attention's dq kernel at head dim 256 with Gemma 2's soft cap; 2.3 without).
TEMPORARY_TILES = {"v4": 3.5, "v5e": 2, "v5p": 2, "v6e": 2}


def tile_bytes(shape, dtype):
    """Bytes of an array in VMEM, stored in (8, 128) tiles of 32-bit words: the last dim padded to 128, the one
    before to 8 rows (16 for 16-bit, 32 for 8-bit types; a single row is not padded), so a [block, 1] column of
    statistics takes as much as [block, 128]."""
    itemsize = jnp.dtype(dtype).itemsize
    *lead, rows, cols = (1, 1, *shape)
    sublanes = 32 // itemsize
    rows = rows if rows == 1 else -(-rows // sublanes) * sublanes
    return int(np.prod(lead)) * rows * (-(-cols // 128) * 128) * itemsize


def _largest_value(jaxpr):
    """Bytes of the largest array (rank >= 2) the kernel body computes, as float32 tiles."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if len(shape) >= 2:
                largest = max(largest, tile_bytes(shape, jnp.float32))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, _largest_value(inner))
    return largest


def pallas_call_vmem(eqn, generation=None):
    """The scoped VMEM (bytes) a traced Mosaic `pallas_call` equation needs with its blocks on `generation` (None:
    the most any generation needs): two buffers of every pipelined window (so the next block's copy overlaps this
    block's compute), its scratch, and TEMPORARY_TILES float32 copies of its body's largest value. Under a tighter limit Mosaic still compiles a kernel down to about
    one copy of its windows (it gives up the double buffers), so this is the need of the pipelined kernel."""
    grid = eqn.params["grid_mapping"]
    windows = sum(tile_bytes(m.transformed_block_aval.shape, m.array_aval.dtype) for m in grid.block_mappings)
    scratch = sum(tile_bytes(a.shape, a.dtype) for a in grid.scratch_avals)
    copies = TEMPORARY_TILES[generation] if generation else max(TEMPORARY_TILES.values())
    return 2 * windows + scratch + math.ceil(copies * _largest_value(eqn.params["jaxpr"]))


def window_bytes(eqn):
    """One copy of a traced pallas_call's windows: below it no kernel compiles."""
    return sum(tile_bytes(m.transformed_block_aval.shape, m.array_aval.dtype)
               for m in eqn.params["grid_mapping"].block_mappings)


def traced_for(generation, axis_names=(axes.DATA,), sizes=(1,)):
    """Context for tracing (not compiling) a program as for `generation`'s devices on CPU: an abstract mesh of
    `axis_names` naming a TPU of that generation, whose block tables the kernels then pick
    (`kernels._dispatch.tpu_generation`); `generation=None`: as off TPU."""
    device = None if generation is None else jax.sharding.AbstractDevice(
        device_kind=TPU_DEVICE_KINDS[generation], num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh(tuple(sizes), tuple(axis_names), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def pallas_calls(fn, *args):
    """[(kernel name, equation)] of every pallas_call in fn's traced program (abstract args; nothing compiles)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append((eqn.params["name"], eqn))
                continue
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def vmem_needs(case, generation=None):
    """{kernel name: (one copy of its windows, its need: `pallas_call_vmem`)}, the largest over the kernel's calls
    in `case`'s program, traced on CPU as for `generation` (its block tables; None: off TPU)."""
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in case.shapes]
    sizes = (case.num_devices,) + (1,) * (len(case.axis_names) - 1)
    with traced_for(generation, case.axis_names, sizes):
        calls = pallas_calls(case.fn, *args)
    needs = {}
    for name, eqn in calls:
        windows, need = needs.get(name, (0, 0))
        needs[name] = max(windows, window_bytes(eqn)), max(need, pallas_call_vmem(eqn, generation))
    return needs


# ---- the catalogue of compiled kernels ----

@dataclasses.dataclass(frozen=True)
class Case:
    """One program to compile: `fn` over arguments of `shapes` ((shape, dtype) each) on `num_devices` devices of
    the mesh `axis_names` with the arguments laid out by `specs` (None: replicated), `label` for tables."""
    kernel: str
    label: str
    fn: object = dataclasses.field(repr=False)
    shapes: tuple = dataclasses.field(repr=False)
    num_devices: int = 1
    axis_names: tuple = (axes.DATA,)
    specs: tuple | None = dataclasses.field(default=None, repr=False)

    def lower(self, generation, own_vmem=False):
        """Lowered for `generation`; the tiled matmuls' own VMEM limits (`_dispatch.mosaic_vmem_limit`) only with
        `own_vmem`, so that a scoped limit given to the compiler governs every kernel."""
        with contextlib.nullcontext() if own_vmem else compiler_scoped_vmem():
            return lower(generation, self.fn, self.shapes, num_devices=self.num_devices, axis_names=self.axis_names,
                         specs=self.specs)


def _value_and_grads(fn, num_diff):
    """value_and_grad of sum(fn(*args)) in float32 over its first num_diff arguments: forward and backward
    kernels in one program."""
    def run(*args):
        return jax.value_and_grad(lambda *d: fn(*d, *args[num_diff:]).astype(jnp.float32).sum(),
                                  tuple(range(num_diff)))(*args[:num_diff])
    return run


MASKS = {"none": (False, False), "causal": (True, False), "segments": (False, True), "causal+segments": (True, True)}


def attention_case(length, head_dim, mask, heads=32, kv_heads=8, block_sizes=None, window=None,
                   logit_soft_cap=None):
    """flash_attention forward and backward, one sequence of `length` tokens, bf16; window and logit_soft_cap as
    flash_attention's."""
    causal, segments = MASKS[mask]

    def attend(q, k, v, ids=None):
        return flash_attention(q, k, v, causal=causal, segment_ids=ids, implementation="mosaic_tpu",
                               block_sizes=block_sizes, window=window, logit_soft_cap=logit_soft_cap)

    shapes = ((1, length, heads, head_dim), BF16), ((1, length, kv_heads, head_dim), BF16)
    shapes = (shapes[0], shapes[1], shapes[1]) + ((((1, length), jnp.int32),) if segments else ())
    label = f"T{length} H{heads}/{kv_heads} D{head_dim} {mask}"
    label += "" if window is None else f", window {window[0] + window[1] + 1}"
    label += "" if logit_soft_cap is None else f", soft cap {logit_soft_cap:g}"
    return Case("flash_attention", label, _value_and_grads(attend, 3), shapes)


def context_parallel_case(generation, kind, length=32768, head_dim=128):
    """flash_attention forward and backward, causal, with the tokens split over every device of the slice (the
    `context` axis): 'ulysses' with 32 query / 8 kv heads (they divide the axis), 'ring' with 10 / 2 (they do not)."""
    heads, kv_heads = (32, 8) if kind == "ulysses" else (10, 2)
    n = len(devices(generation))

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, implementation="mosaic_tpu")

    tokens = P(None, axes.CONTEXT)
    shapes = (((1, length, heads, head_dim), BF16),) + (((1, length, kv_heads, head_dim), BF16),) * 2
    return Case(f"{kind} attention", f"T{length} over {n} H{heads}/{kv_heads} D{head_dim} causal",
                _value_and_grads(attend, 3), shapes, num_devices=n, axis_names=(axes.CONTEXT,),
                specs=(tokens,) * 3)


# LLaMA shapes (Touvron et al. 2023): model dim, MLP dim, vocabularies (LLaMA-2 32000; LLaMA-3 128256 at 70B).
LLAMA = {"7B": (4096, 11008, (32000,)), "70B": (8192, 28672, (32000, 128256))}


def matmul_cases(model, tokens=8192, block_sizes=None):
    """The MLP and the head of a LLaMA at full size, `tokens` rows, forward and backward: the gated MLP (gate and
    up), the down projection (fused_matmul) and linear + cross-entropy per vocabulary."""
    d, f, vocabs = LLAMA[model]
    kw = dict(implementation="mosaic_tpu", block_sizes=block_sizes)
    cases = [
        Case("gated_mlp", f"LLaMA-{model} [{tokens}, {d}] x [{d}, {f}] x2",
             _value_and_grads(lambda x, wg, wu: gated_mlp(x, wg, wu, **kw), 3),
             (((tokens, d), BF16), ((d, f), BF16), ((d, f), BF16))),
        Case("fused_matmul", f"LLaMA-{model} [{tokens}, {f}] x [{f}, {d}]",
             _value_and_grads(lambda x, w: fused_matmul(x, w, **kw), 2), (((tokens, f), BF16), ((f, d), BF16))),
    ]
    for vocab in vocabs:
        cases.append(Case("linear_cross_entropy", f"LLaMA-{model} [{tokens}, {d}] x [{d}, {vocab}]",
                          _value_and_grads(lambda x, w, labels: linear_cross_entropy(x, w, labels, **kw), 2),
                          (((tokens, d), BF16), ((d, vocab), BF16), ((tokens,), jnp.int32))))
    return cases


def cases(generation):
    """What the report compiles for `generation`: attention at a few representative settings (one with a sliding
    window and a soft cap), the LLaMA-7B and -70B MLP and head, ring and Ulysses attention over the slice."""
    return ([attention_case(length, d, mask) for length, d, mask in
             ((1024, 64, "segments"), (8192, 128, "causal"), (32768, 256, "causal+segments"))]
            # Gemma 2's local layers (16 / 8 heads of 256): a causal window of 4096 keys, logits soft-capped at 50
            + [attention_case(8192, 256, "causal+segments", heads=16, kv_heads=8, window=(4095, 0),
                              logit_soft_cap=50.0)]
            + matmul_cases("7B") + matmul_cases("70B")
            + [context_parallel_case(generation, kind) for kind in ("ulysses", "ring")])


@dataclasses.dataclass(frozen=True)
class Result:
    generation: str
    case: Case
    hbm_bytes: int | None  # per device; None when it did not compile
    overflow: Overflow | None
    seconds: float


def compile_case(generation, case, scoped_vmem=None, own_vmem=False):
    """Compiles `case` for `generation` (the kernels' own VMEM limits with `own_vmem`: `Case.lower`); a `Result`
    (the error raised for anything but a VMEM overflow)."""
    start = time.perf_counter()
    compiled, over = try_compile(case.lower(generation, own_vmem), scoped_vmem)
    return Result(generation, case, None if compiled is None else device_bytes(compiled), over,
                  time.perf_counter() - start)


# ---- block-size search: the largest tiles that fit the default scoped VMEM ----

_ATTENTION_TILES = ((2048, 2048), (2048, 1024), (1024, 2048), (1024, 1024), (1024, 512), (512, 1024), (512, 512),
                    (512, 256), (256, 512), (256, 256), (256, 128), (128, 256), (128, 128))
_MATMUL_TILES = tuple(sorted(((m, n, k) for m, n in ((2048, 1024), (1024, 2048), (1024, 1024), (1024, 512),
                                                     (512, 1024), (512, 512), (512, 256), (256, 512), (256, 256))
                              for k in (1024, 512, 256)), key=lambda t: (-t[0] * t[1], -t[2], -t[0])))


def largest_fitting(generation, build, candidates):
    """The largest of `candidates` (largest first) all of whose programs `build(candidate)` (a list of cases)
    compile for `generation` under the default scoped VMEM, and {candidate: [Result]} of the compiles tried. The
    first program finds the boundary by bisection of the list (a tile that fails is taken to fail for every
    larger one); then the others are compiled at it, and a failure steps down the list."""
    tried = {}

    def fits(i, cases):
        results = tried.setdefault(candidates[i], [])
        for case in cases:
            results.append(compile_case(generation, case))
            if results[-1].overflow is not None:
                return False
        return True

    low, high = -1, len(candidates)  # candidates[high:] fit the first program, candidates[:low + 1] do not
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid, build(candidates[mid])[:1]):
            high = mid
        else:
            low = mid
    for i in range(high, len(candidates)):
        if fits(i, build(candidates[i])[1:] if i == high else build(candidates[i])):
            return candidates[i], tried
    return None, tried


def search_attention(generation, head_dim, backward):
    """The largest (block_q, block_k) of the forward kernel, or of both backward kernels (`backward`), for
    `head_dim`: it must fit every mask (Mosaic's temporaries differ by mask: a tile that fits with causal masking
    and segment ids may not without them); the other pass on 128 x 128 tiles."""
    from kernels.attention import BlockSizes  # noqa: PLC0415

    def build(tiles):
        blocks = BlockSizes(128, 128, *tiles) if backward else BlockSizes(*tiles, 128, 128)
        return [attention_case(4096, head_dim, mask, heads=4, kv_heads=1, block_sizes=blocks)
                for mask in ("causal+segments", "causal", "none", "segments")]

    return largest_fitting(generation, build, _ATTENTION_TILES)


def search_matmul(generation, op):
    """The largest (block_m, block_n, block_k) of `op` ('matmul', 'gated' or 'loss': every forward and backward
    kernel of fused_matmul, gated_mlp or linear_cross_entropy) on 4096-wide bf16 operands."""
    from kernels.matmul import BlockSizes  # noqa: PLC0415

    index = {"gated": 0, "matmul": 1, "loss": 2}[op]
    return largest_fitting(generation, lambda t: [matmul_cases("7B", 4096, BlockSizes(*t))[index]], _MATMUL_TILES)


# ---- the report ----

def report_row(result, min_vmem=None):
    """A markdown row of a `Result`: generation, kernel, shape, compiled, the stated VMEM need (the largest of the
    program's kernels; `vmem_needs`), the compiler's least scoped limit (`min_scoped_vmem`, when measured), HBM per
    device and the compile's seconds."""
    need = max(need for _, need in vmem_needs(result.case, result.generation).values())
    over = result.overflow
    compiled = "yes" if over is None else f"no: {over.kernel} needs {over.needed / MiB:.1f} MiB"
    least = "" if min_vmem is None else f"{min_vmem / MiB:.1f}"
    hbm = "" if result.hbm_bytes is None else f"{result.hbm_bytes / GiB:.2f}"
    return (f"| {result.generation} | {result.case.kernel} | {result.case.label} | {compiled} | {need / MiB:.1f} | "
            f"{least} | {hbm} | {result.seconds:.0f} |")


REPORT_HEADER = ("| generation | kernel | shape (bf16, forward + backward) | compiles | VMEM need, stated (MiB) | "
                 "VMEM, compiler's least (MiB) | HBM per device (GiB) | compile (s) |\n"
                 "|---|---|---|---|---|---|---|---|")
