"""The project's Triton kernels compiled for Hopper (`sm_90a`) without a GPU, and what `ptxas` says about each.

JAX 0.11 lowers a Pallas Triton kernel for `cuda` on a host without a GPU once an abstract device names the target
(`HOPPER`). The `__gpu$xla.gpu.triton` custom call carries the kernel's Triton IR (`mhlo.backend_config` -> `ir`,
MLIR bytecode), which is printed as text in Pallas's own MLIR context (the `triton` package's bytecode reader
rejects jaxlib's; its text parser accepts the text) and taken by the `triton` package's NVIDIA backend through its
TTIR passes, TTGIR, LLVM IR and PTX to a cubin; `ptxas -v` reports registers, spills, and advisories such as C7515
(wgmma serialized), and the cubin's SASS (`cuobjdump -sass`, the one the triton package ships) shows which matmuls
became warpgroup MMA (HGMMA), which warp MMA (HMMA), local-memory traffic (LDL / STL) and whether ptxas serialized
the wgmma (each HGMMA its own commit group, waited before the next). XLA compiles the same IR with its own Triton
pipeline (jaxlib's Triton, not this package's), so these are the facts of Triton 3.x on the kernel's IR, not of
the very binary a GPU runs; timing needs a GPU (`scripts/device_check.sh`).

Needs JAX >= 0.11 and the `triton` package: `make test-gpu-compile` builds that environment, and
`scripts/gpu_compile_report.py` prints `report()` as the table kernels/README.md records.
"""
import contextlib
import dataclasses
import io
import re
import time

import jax
import jax.numpy as jnp

# The target named to the lowering: any Hopper kind gives compute capability 9.0 (num_cores: an H200's SMs).
HOPPER = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
CAPABILITY = 90
# Shared memory a Hopper thread block may use (227 KiB; the kernel fails to launch above it).
MAX_SHARED_BYTES = 227 * 1024
_TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas Triton kernel as XLA receives it: `ir` is its Triton IR as MLIR text."""
    name: str
    ir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Sass:
    """What a cubin's SASS shows (`parse_sass`), in static instruction counts.

    hgmma, hmma: warpgroup MMA (Hopper's wgmma.mma_async) and warp MMA (mma.sync) instructions.
    hgmma_groups: wgmma commit groups (an HGMMA carrying `gsb0` closes one; `WARPGROUP.DEPBAR` waits on them).
    lone_hgmma: groups of one HGMMA. A tl.dot of K = 16 is one instruction, but every dot of this project's kernels
      contracts at least 32 (two HGMMAs); ptxas's serialization (C7515) issues each HGMMA in a group of its own
      between a `WARPGROUP.ARRIVE` and a `WARPGROUP.DEPBAR.LE gsb0, 0x0`, so there lone == hgmma.
    in_flight: the most wgmma groups any `WARPGROUP.DEPBAR.LE gsb0, N` leaves pending (N): 0 when every wait
      drains the warpgroup's MMAs, so none overlaps the work after its wait; a software-pipelined matmul loop
      waits with 1 pending (the next tile's MMA issued before the last one is waited for).
    local_loads, local_stores: LDL / STL, local memory (spills, or arrays indexed dynamically).
    """
    hgmma: int = 0
    hmma: int = 0
    hgmma_groups: int = 0
    lone_hgmma: int = 0
    in_flight: int = 0
    local_loads: int = 0
    local_stores: int = 0


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What compiling one kernel for sm_90a gave: shared memory in bytes (Triton's allocation), registers per
    thread, spilled bytes (stores, loads), ptxas's advisories by code ({'C7515': message}), the compile's seconds,
    the tl.dots of its Triton IR (`source_dots`) and what Triton made of each (`dots`: 'wgmma', 'mma.sync' or
    'fma', in TTGIR order), what its SASS shows (`Sass`), and the kernel's Triton IR, TTGIR, PTX and SASS for a
    closer look."""
    label: str
    name: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    advisories: dict
    seconds: float
    source_dots: int = 0
    dots: tuple = ()
    sass: Sass = Sass()
    ttir: str = dataclasses.field(repr=False, default="")
    ttgir: str = dataclasses.field(repr=False, default="")
    ptx: str = dataclasses.field(repr=False, default="")
    sass_text: str = dataclasses.field(repr=False, default="")

    @property
    def spilled(self):
        return self.spill_stores + self.spill_loads > 0

    @property
    def serialization_advisories(self):
        """ptxas's advisories that say it serialized wgmma (C7515 and its siblings: 'wgmma.mma_async instructions
        are serialized due to ...')."""
        return {code: text for code, text in self.advisories.items() if code == "C7515" or "serialized" in text}

    @property
    def wgmma_serialized(self):
        """ptxas said so, or the SASS shows it (HGMMAs each in a group of their own)."""
        return bool(self.serialization_advisories) or self.sass.lone_hgmma > 0

    @property
    def all_dots_wgmma(self):
        """Every tl.dot of the kernel became warpgroup MMA, and the SASS has HGMMA and no HMMA."""
        return (bool(self.dots) and set(self.dots) == {"wgmma"} and self.sass.hgmma > 0
                and self.sass.hmma == 0)


def _hopper_target():
    mesh = jax.sharding.AbstractMesh((), ()).update(abstract_device=HOPPER)
    return jax.sharding.use_abstract_mesh(mesh)


def triton_kernels(fn, *args):
    """The Triton kernels of `jax.jit(fn)` lowered for `cuda` on `HOPPER` at the abstract `args`
    (`jax.ShapeDtypeStruct`s), in the lowered module's order."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering  # the MLIR context Pallas builds the kernels in

    with _hopper_target():
        module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if (inner.name == "stablehlo.custom_call"
                            and ir.StringAttr(inner.attributes["call_target_name"]).value == _TRITON_CALL):
                        calls.append(inner)
                    walk(inner)

    walk(module.operation)
    kernels = []
    for call in calls:
        config = call.attributes["mhlo.backend_config"]
        attrs = {config[i].name: config[i].attr for i in range(len(config))}
        with lowering._new_ir_context():
            text = str(ir.Module.parse(ir.StringAttr(attrs["ir"]).value_bytes))
        integer = lambda key: ir.IntegerAttr(attrs[key]).value  # noqa: E731
        kernels.append(TritonKernel(ir.StringAttr(attrs["name"]).value, text, integer("num_warps"),
                                    integer("num_stages"), tuple(integer(f"grid_{d}") for d in "xyz")))
    return kernels


def parse_ptxas_log(log):
    """(registers, spill stores, spill loads, {code: advisory}) from the log of `ptxas -v` for one kernel; a
    warning without a code is keyed 'warning'."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    advisories = dict(re.findall(r"\((C\d{4})\) (.*?)(?: in the function '[^']*')?(?: in line \d+)?$", log, re.M))
    for warning in re.findall(r"ptxas\S* warning\s*: (?!\(C\d{4}\))(.*)$", log, re.M):
        advisories.setdefault("warning", warning)
    return (int(registers.group(1)) if registers else 0, int(spills.group(1)) if spills else 0,
            int(spills.group(2)) if spills else 0, advisories)


_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.M)


def parse_sass(text):
    """A `Sass` of `cuobjdump -sass`'s text for one kernel."""
    counts = dict(hgmma=0, hmma=0, hgmma_groups=0, lone_hgmma=0, in_flight=0, local_loads=0, local_stores=0)
    in_group = 0  # HGMMAs issued since the group's WARPGROUP.ARRIVE (or the last group's end)
    for opcode, operands in _SASS_INSTRUCTION.findall(text):
        if opcode.startswith("HGMMA"):
            counts["hgmma"] += 1
            in_group += 1
            if "gsb0" in operands:
                counts["hgmma_groups"] += 1
                counts["lone_hgmma"] += in_group == 1
                in_group = 0
        elif opcode.startswith("HMMA"):
            counts["hmma"] += 1
        elif opcode.startswith("LDL"):
            counts["local_loads"] += 1
        elif opcode.startswith("STL"):
            counts["local_stores"] += 1
        elif opcode == "WARPGROUP.ARRIVE":
            in_group = 0
        elif opcode == "WARPGROUP.DEPBAR.LE":
            counts["in_flight"] = max(counts["in_flight"], int(operands.split(",")[-1], 0))
    return Sass(**counts)


def parse_dots(ttgir):
    """What Triton made of each tl.dot, in TTGIR order: 'wgmma' (ttng.warp_group_dot: Hopper's asynchronous
    warpgroup MMA), 'mma.sync' (tt.dot with an MMA v2 layout: warp MMA, Ampere's path) or 'fma' (tt.dot with a
    blocked layout: no tensor cores). Triton takes the wgmma path on sm_90a only where a warpgroup's tile fits it:
    num_warps a multiple of 4, the dot's rows a multiple of 64 and its columns of 8 (`supportMMA`, MMA v3)."""
    versions = dict(re.findall(r"^(#\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir, re.M))
    dots = []
    for line in ttgir.splitlines():
        if re.search(r"= ttng\.warp_group_dot ", line):
            dots.append("wgmma")
        elif re.search(r"= tt\.dot ", line):
            layout = re.search(r"-> tensor<[^>]*, (#\w+)>", line)
            dots.append("mma.sync" if layout and versions.get(layout.group(1)) == "2" else "fma")
    return tuple(dots)


def _sass(cubin):
    """`cuobjdump -sass` of a cubin (the triton package's cuobjdump; the CUDA toolkit's works the same)."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout


def compile_kernel(kernel, label=None):
    """A `KernelReport` of `kernel` (a `TritonKernel`) compiled for sm_90a by the `triton` package."""
    import tempfile

    from triton import knobs
    from triton._C.libtriton import ir as tir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import Language, make_backend

    start = time.perf_counter()
    target = GPUTarget("cuda", CAPABILITY, 32)
    backend = make_backend(target)
    # FP fusion on: Triton's default, stated because triton 3.9 warns that the default will change.
    options = backend.parse_options({"num_warps": kernel.num_warps, "num_stages": kernel.num_stages,
                                     "enable_fp_fusion": True})
    context = tir.context()
    tir.load_dialects(context)
    backend.load_dialects(context)
    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as source:
        source.write(kernel.ir)
        source.flush()
        module = tir.parse_mlir_module(source.name, context)
    module.context = context
    stages = {}
    backend.add_stages(stages, options, Language.TRITON)
    metadata = {"hash": kernel.name, "target": target, **options.__dict__}
    texts, log = {}, io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas's -v report
        for ext, run in stages.items():  # ttir (inlining, dot + add combining, CSE), ttgir, llir, ptx, cubin
            module = run(module, metadata)
            if ext in ("ttgir", "ptx"):
                texts[ext] = str(module)
    registers, spill_stores, spill_loads, advisories = parse_ptxas_log(log.getvalue())
    sass = _sass(module)  # the last stage's output: the cubin's bytes
    return KernelReport(label or kernel.name, kernel.name, kernel.num_warps, kernel.num_stages, metadata["shared"],
                        registers, spill_stores, spill_loads, advisories, time.perf_counter() - start,
                        len(re.findall(r"= tt\.dot ", kernel.ir)), parse_dots(texts["ttgir"]), parse_sass(sass),
                        kernel.ir, texts["ttgir"], texts["ptx"], sass)


# ---- The production kernels: each op at a training shape with its default (production) block sizes. ----

# Attention: one 4096-token sequence, 32 query heads over 8 kv heads of 128 (LLaMA-3-8B's layout), bf16, causal.
ATTENTION_SHAPE = dict(batch=1, seq_len=4096, heads=32, kv_heads=8, head_dim=128)
# Decoding: one step of one sequence against an 8192-slot cache, same heads.
DECODE_CACHE = 8192
# The matmuls: 4096 tokens through LLaMA-7B's MLP (4096 -> 11008) and head (32000 words).
MLP_SHAPE = dict(tokens=4096, model=4096, hidden=11008, vocab=32000)
# Mixtral-8x7B's experts: 4096 tokens routed top-2 of 8 (8192 rows sorted by expert), 4096 -> 14336 (w1 / w3) and
# 14336 -> 4096 (w2).
EXPERTS_SHAPE = dict(rows=8192, model=4096, hidden=14336, experts=8)
# Paged decoding: one step of 64 sequences with up to 2048 cached tokens each in pages of 16, same heads as
# `ATTENTION_SHAPE`; the pool holds every sequence's pages (8192).
PAGED_SHAPE = dict(batch=64, heads=32, kv_heads=8, head_dim=128, max_tokens=2048, page_size=16)


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _summed(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32))


def production_cases():
    """{case: (fn, abstract args, labels of its kernels in lowered order)}: every Triton kernel the project runs
    in training and generation, at `ATTENTION_SHAPE` / `MLP_SHAPE` with the default block sizes."""
    from kernels.attention import decode_attention, flash_attention, paged_attention
    from kernels.grouped_matmul import grouped_matmul
    from kernels.matmul import fused_matmul, gated_mlp, linear_cross_entropy

    a = ATTENTION_SHAPE
    q = _sds((a["batch"], a["seq_len"], a["heads"], a["head_dim"]))
    kv = _sds((a["batch"], a["seq_len"], a["kv_heads"], a["head_dim"]))
    ids = _sds((a["batch"], a["seq_len"]), jnp.int32)
    attention = lambda **kw: _summed(lambda q, k, v, *ids: flash_attention(  # noqa: E731
        q, k, v, causal=True, segment_ids=ids[0] if ids else None, implementation="triton", **kw))
    grad3 = lambda f: jax.grad(f, (0, 1, 2))  # noqa: E731
    step_q = _sds((a["batch"], 1, a["heads"], a["head_dim"]))
    cache = _sds((a["batch"], DECODE_CACHE, a["kv_heads"], a["head_dim"]))
    cache_ids = (_sds((a["batch"], 1), jnp.int32), _sds((a["batch"], DECODE_CACHE), jnp.int32))
    int8_cache = _sds(cache.shape, jnp.int8)
    scale = _sds(cache.shape[:3], jnp.float32)

    m = MLP_SHAPE
    x, labels = _sds((m["tokens"], m["model"])), _sds((m["tokens"],), jnp.int32)
    w_up, w_head = _sds((m["model"], m["hidden"])), _sds((m["model"], m["vocab"]))
    w_int8, w_scale = _sds(w_up.shape, jnp.int8), _sds((m["hidden"],), jnp.float32)
    value_and_grad = lambda f, n: jax.value_and_grad(f, tuple(range(n)))  # noqa: E731
    loss = lambda x, w, labels: jnp.sum(linear_cross_entropy(x, w, labels, implementation="triton"))  # noqa: E731
    e = EXPERTS_SHAPE
    group_sizes = _sds((e["experts"],), jnp.int32)
    experts = lambda x, w, sizes: grouped_matmul(x, w, sizes, implementation="triton")  # noqa: E731
    p = PAGED_SHAPE
    max_pages = p["max_tokens"] // p["page_size"]
    pool_shape = (p["kv_heads"], p["batch"] * max_pages, p["page_size"], p["head_dim"])
    paged_q, pool, int8_pool = (_sds((p["batch"], p["heads"], p["head_dim"])), _sds(pool_shape),
                                _sds(pool_shape, jnp.int8))
    table, lengths, pool_scale = (_sds((p["batch"], max_pages), jnp.int32), _sds((p["batch"],), jnp.int32),
                                  _sds(pool_shape[:3], jnp.float32))
    # The loss's backward sweeps the vocabulary in chunks (kernels/matmul/_blocks.py); 32000 leaves a last, narrower
    # chunk, whose three kernels are the same code at another width.
    return {
        "attention": (grad3(attention()), (q, kv, kv), ("fwd", "dq", "dk/dv")),
        # Head dims beside 128: 64 (small models) and 256 (Gemma), each with its own row of the block table.
        **{f"attention, head_dim {d}": (grad3(attention()), (q_d, kv_d, kv_d), ("fwd", "dq", "dk/dv"))
           for d, q_d, kv_d in ((d, _sds(q.shape[:3] + (d,)), _sds(kv.shape[:3] + (d,))) for d in (64, 256))},
        "attention, packed": (grad3(attention()), (q, kv, kv, ids), ("fwd", "dq", "dk/dv")),
        "attention, dropout 0.1": (grad3(attention(dropout_rate=0.1, dropout_rng=jax.random.key(0))), (q, kv, kv),
                                   ("fwd", "dq", "dk/dv")),
        # Gemma 2's local layers: a causal window of 1024 keys, logits soft-capped at 50.
        "attention, window 1024, soft cap 50": (grad3(attention(window=(1023, 0), logit_soft_cap=50.0)),
                                                (q, kv, kv), ("fwd", "dq", "dk/dv")),
        "decode": (lambda q, k, v, ids: decode_attention(q, k, v, segment_ids=ids, implementation="triton"),
                   (step_q, cache, cache, cache_ids), ("fwd",)),
        "decode, int8 cache": (
            lambda q, k, v, ks, vs, ids: decode_attention(q, k, v, k_scale=ks, v_scale=vs, segment_ids=ids,
                                                          implementation="triton"),
            (step_q, int8_cache, int8_cache, scale, scale, cache_ids), ("fwd",)),
        "fused_matmul (silu)": (
            value_and_grad(_summed(lambda x, w: fused_matmul(x, w, activation="silu", implementation="triton")), 2),
            (x, w_up), ("fwd", "bwd: d act", "bwd: dx", "bwd: dw")),
        "gated_mlp (silu)": (
            value_and_grad(_summed(lambda x, g, u: gated_mlp(x, g, u, implementation="triton")), 3),
            (x, w_up, w_up), ("fwd", "bwd: d gate, d up", "bwd: dx", "bwd: dw_gate, dw_up")),
        # Frozen int8 bases (models/quantize.py, under LoRA): no weight gradients.
        "fused_matmul (silu), int8 weight": (
            jax.grad(_summed(lambda x, w, s: fused_matmul(x, w, w_scale=s, activation="silu",
                                                          implementation="triton"))),
            (x, w_int8, w_scale), ("fwd", "bwd: d act", "bwd: dx")),
        "gated_mlp (silu), int8 weights": (
            jax.grad(_summed(lambda x, g, u, s: gated_mlp(x, g, u, w_gate_scale=s, w_up_scale=s,
                                                          implementation="triton"))),
            (x, w_int8, w_int8, w_scale), ("fwd", "bwd: d gate, d up", "bwd: dx")),
        "linear_cross_entropy": (
            value_and_grad(loss, 2), (x, w_head, labels),
            ("fwd", "bwd: d logits", "bwd: dx", "bwd: dw", "bwd: d logits (last chunk)", "bwd: dx (last chunk)",
             "bwd: dw (last chunk)")),
        # Mixture-of-experts experts: the up projection (w1 / w3) and the down projection (w2), each forward, dx
        # (a grouped product against w[g].T) and dw (the transposed product, one [K, N] per expert).
        "grouped_matmul, Mixtral-8x7B w1": (
            value_and_grad(_summed(experts), 2), (_sds((e["rows"], e["model"])),
                                                  _sds((e["experts"], e["model"], e["hidden"])), group_sizes),
            ("fwd", "bwd: dx", "bwd: dw")),
        "grouped_matmul, Mixtral-8x7B w2": (
            value_and_grad(_summed(experts), 2), (_sds((e["rows"], e["hidden"])),
                                                  _sds((e["experts"], e["hidden"], e["model"])), group_sizes),
            ("fwd", "bwd: dx", "bwd: dw")),
        "paged decode": (lambda q, k, v, table, lengths: paged_attention(q, k, v, table, lengths,
                                                                         implementation="triton"),
                         (paged_q, pool, pool, table, lengths), ("fwd",)),
        "paged decode, int8 pages": (
            lambda q, k, v, table, lengths, ks, vs: paged_attention(q, k, v, table, lengths, k_scale=ks, v_scale=vs,
                                                                    implementation="triton"),
            (paged_q, int8_pool, int8_pool, table, lengths, pool_scale, pool_scale), ("fwd",)),
    }


def report(cases=None):
    """`KernelReport`s of every kernel of `cases` (default `production_cases()`), labelled 'case: pass'."""
    reports = []
    for case, (fn, args, labels) in (cases or production_cases()).items():
        kernels = triton_kernels(fn, *args)
        if len(kernels) != len(labels):
            raise ValueError(f"case {case!r} lowered to {len(kernels)} Triton kernels "
                             f"({[k.name for k in kernels]}); its labels name {len(labels)}")
        reports += [compile_kernel(k, f"{case}: {label}") for k, label in zip(kernels, labels)]
    return reports


def _dots_cell(r):
    counts = {kind: r.dots.count(kind) for kind in ("wgmma", "mma.sync", "fma") if kind in r.dots}
    return f"{r.source_dots}: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()) if r.dots else "0"


def _serialized_cell(r):
    reasons = sorted(r.serialization_advisories)
    if r.sass.lone_hgmma:
        reasons.append(f"{r.sass.lone_hgmma}/{r.sass.hgmma} HGMMA alone")
    return ", ".join(reasons) or "no"


def format_table(reports):
    """A markdown table of `reports`, one row per kernel: tl.dot (TTIR) -> what Triton made of each (TTGIR);
    HGMMA / HMMA, wgmma groups left in flight at a wait (`Sass.in_flight`) and LDL / STL from the SASS; serialized:
    ptxas's advisory, or HGMMAs alone in the SASS."""
    rows = ["| kernel | warps / stages | shared memory | registers | spills (bytes) | tl.dot -> | HGMMA / HMMA "
            "| wgmma in flight | LDL / STL | wgmma serialized | ptxas advisories | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        spills = f"{r.spill_stores} st / {r.spill_loads} ld" if r.spilled else "0"
        advisories = ", ".join(sorted(r.advisories)) or "—"
        rows.append(f"| {r.label} | {r.num_warps} / {r.num_stages} | {r.shared_bytes / 1024:g} KiB | {r.registers} "
                    f"| {spills} | {_dots_cell(r)} | {r.sass.hgmma} / {r.sass.hmma} | {r.sass.in_flight} "
                    f"| {r.sass.local_loads} / {r.sass.local_stores} | {_serialized_cell(r)} | {advisories} "
                    f"| {r.seconds:.1f} |")
    return "\n".join(rows)


# ---- Roofline on an H200: what a kernel's work and traffic allow at best, from its shapes alone. ----

H200_TFLOPS = 989.0  # dense bf16, the datasheet (engine/flops.py's MFU denominator)
H200_MEASURED_TFLOPS = 790.0  # a bf16 matmul on random data, as measured on the device
H200_HBM_TBPS = 4.8


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One op at one shape. flops: the products no implementation avoids (forward; backward dx and dw, attention's
    dq, dk, dv and dp); flops_run: what this project's kernels compute, recomputed products included (attention's
    dq and dk/dv kernels each recompute q k^T and do v^T, the matmuls' backward recomputes x w for the activation's
    derivative, the loss's backward the logits); min_bytes: every input read once and every output written once
    (bf16 tensors, float32 row statistics), the floor of HBM traffic."""
    label: str
    flops: int
    flops_run: int
    min_bytes: int

    @property
    def intensity(self):
        return self.flops / self.min_bytes

    @property
    def bound(self):
        return "compute" if self.intensity > H200_TFLOPS / H200_HBM_TBPS else "memory"

    def floor_ms(self, tflops=H200_TFLOPS, flops=None):
        """The least time: the slower of the FLOPs at `tflops` and the minimum bytes at the H200's bandwidth."""
        return max((flops or self.flops) / (tflops * 1e9), self.min_bytes / (H200_HBM_TBPS * 1e9))


# The training shapes of the roofline (kernels/README.md, "Roofline on H200"): attention at LLaMA-3-8B's heads,
# the loss and the MLP at a 1B-class model (8192 tokens, model 2048, MLP 5632, vocabulary 32000).
ROOFLINE_ATTENTION = dict(batch=2, heads=32, kv_heads=8, head_dim=128, seq_lens=(4096, 8192))
ROOFLINE_MATMUL = dict(tokens=8192, model=2048, hidden=5632, vocab=32000)


def roofline_cases():
    """`Roofline`s of the main training path's kernels at `ROOFLINE_ATTENTION` / `ROOFLINE_MATMUL`, bf16."""
    from kernels.attention._cost import visible_pairs

    bf16, f32 = 2, 4
    rows = []
    a = ROOFLINE_ATTENTION
    B, H, Hkv, D = a["batch"], a["heads"], a["kv_heads"], a["head_dim"]
    for T in a["seq_lens"]:
        product = 2 * D * visible_pairs(T, T, causal=True) * B * H  # one [T, T] x [T, D] product, causal
        q = o = B * T * H * D * bf16
        kv = B * T * Hkv * D * bf16
        lse = B * H * T * f32
        fwd_bytes = q + 2 * kv + o + lse
        # backward: reads q, k, v, o, do, lse; writes dq, dk, dv
        bwd_bytes = q + 2 * kv + o + q + lse + q + 2 * kv
        shape = f"B{B} H{H}/{Hkv} D{D} T{T} causal"
        rows.append(Roofline(f"flash attention fwd, {shape}", 2 * product, 2 * product, fwd_bytes))
        rows.append(Roofline(f"flash attention fwd+bwd, {shape}", 6 * product, (2 + 3 + 4) * product,
                             fwd_bytes + bwd_bytes))
    m = ROOFLINE_MATMUL
    N, Dm, F, V = m["tokens"], m["model"], m["hidden"], m["vocab"]
    x, labels, stats = N * Dm * bf16, N * f32, N * f32
    head = 2 * N * Dm * V
    w = Dm * V * bf16
    # forward: x, w, labels in; the loss and the lse out. Backward: x, w, labels, lse and d loss in; dx, dw out.
    lce_fwd = x + w + labels + 2 * stats
    lce_bwd = x + w + labels + 2 * stats + x + w
    rows.append(Roofline(f"linear_cross_entropy fwd, {N} x {Dm} x {V}", head, head, lce_fwd))
    rows.append(Roofline(f"linear_cross_entropy fwd+bwd, {N} x {Dm} x {V}", 3 * head, 4 * head, lce_fwd + lce_bwd))
    up = 2 * N * Dm * F
    w, h = Dm * F * bf16, N * F * bf16
    # gated: x, w_gate, w_up in, h out; backward x, both weights and dh in, dx and both weight gradients out.
    rows.append(Roofline(f"gated_mlp fwd, {N} x {Dm} x {F}", 2 * up, 2 * up, x + 2 * w + h))
    rows.append(Roofline(f"gated_mlp fwd+bwd, {N} x {Dm} x {F}", 6 * up, 8 * up,
                         (x + 2 * w + h) + (x + 2 * w + h) + (x + 2 * w)))
    rows.append(Roofline(f"fused_matmul (silu) fwd, {N} x {Dm} x {F}", up, up, x + w + h))
    rows.append(Roofline(f"fused_matmul (silu) fwd+bwd, {N} x {Dm} x {F}", 3 * up, 4 * up,
                         (x + w + h) + (x + w + h) + (x + w)))
    return rows


def format_roofline(rows, measured=None):
    """A markdown table of `rows` (`roofline_cases()`). `measured` maps a row's label to ((who, ms), ...), each
    shown with its multiple of the row's floor at `H200_TFLOPS`."""
    measured = measured or {}
    table = [f"| op, shape | GFLOP (as run) | min HBM MB | FLOP / byte | bound | floor ms at {H200_TFLOPS:g} / "
             f"{H200_MEASURED_TFLOPS:g} TFLOP/s | as run at {H200_MEASURED_TFLOPS:g} | measured ms (x floor at "
             f"{H200_TFLOPS:g}) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        times = ", ".join(f"{who} {ms:g} ({ms / r.floor_ms():.1f}x)" for who, ms in measured.get(r.label, ())) or "—"
        table.append(f"| {r.label} | {r.flops / 1e9:,.0f} ({r.flops_run / 1e9:,.0f}) | {r.min_bytes / 1e6:,.0f} "
                     f"| {r.intensity:,.0f} | {r.bound} | {r.floor_ms():.2f} / {r.floor_ms(H200_MEASURED_TFLOPS):.2f} "
                     f"| {r.floor_ms(H200_MEASURED_TFLOPS, r.flops_run):.2f} | {times} |")
    return "\n".join(table)
