"""Ahead-of-time plans: compile a Trainer's real train step on a mesh of (simulated) devices without allocating a
parameter, and read per-device memory and communication off the compiled program; and the automatic choice of a
layout (`rank_meshes`: the same measurements of any Trainer on every mesh of the devices). Plans of a named model
config live with the tasks (`engine.tasks.planning`).

Memory comes from `compiled.memory_analysis()`: the per-device peak is arguments + outputs - aliased (donated) +
temporaries. Communication is read off the compiled HLO: every collective, times the trip count of the loops it sits
in, converted to bytes one device sends with ring algorithms over its replica group of n devices: all-gather (n-1)/n
x output, reduce-scatter (n-1)/n x input, all-reduce 2(n-1)/n x size, all-to-all (n-1)/n x size, collective-permute
1 x size (a group's devices: `replica_groups`). A ragged all-to-all sends rows its offsets and sizes choose when the
program runs; it is counted as balanced routing sends them: (n-1)/n x the smaller of its operand and its output
buffer (a device sends as many rows as it receives, and one of the two holds exactly those: the expert exchange's
tokens, models/layers/moe.py, where the other is padded to the most a device could get). The XLA CPU compiler widens
bf16 all-gathers to f32 (it computes bf16 matmuls in f32 and moves the up-convert in front of the gather); an f32
all-gather of an up-converted bf16 value is counted at its bf16 size, as GPUs and TPUs run it. Reductions are
counted as compiled.
"""
import math
import os
import re

import jax
import numpy as np
from absl import logging

from engine.mesh import make_mesh

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")


def _shapes(type_text):
    """[(dtype, elements)] of an HLO result type (an array or a tuple of arrays)."""
    return [(dt, math.prod(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(type_text)
            if dt in _BYTES]


def _async_results(type_text):
    """The results' part of an async collective's start type: XLA:GPU's `((operands...), results...)` without its
    operands (counting both, a reduce-scatter's input was added to its result and the sum taken n times); any other
    type as it is."""
    if not type_text.startswith("(("):
        return type_text
    depth = 0
    for i, c in enumerate(type_text[1:], 1):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return type_text[i + 1:]
    return type_text


def _computations(hlo):
    """{name: [instruction lines]} and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _multiplicities(comps, entry):
    """How many times each computation runs per step: while bodies by their known trip count (1 when unknown), every
    branch of a conditional once."""
    mult = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, ()):
            callees = []
            body = re.search(r"\bbody=%([\w.\-]+)", line)
            if body:
                callees.append((body.group(1), loop_trips(comps, name, line)))
            for key in ("calls", "to_apply"):
                callees += [(c, 1) for c in re.findall(rf"\b{key}=%([\w.\-]+)", line)]
            callees += [(c, 1) for c in branches_of(line)]
            for callee, times in callees:
                if callee in comps and callee not in mult:
                    mult[callee] = mult[name] * times
                    stack.append(callee)
    return mult


def loop_trips(comps, comp, line):
    """The trip count of the while loop on `line` of computation `comp`: its backend config's known count, else
    `_trip_count`'s reading of its condition."""
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    return int(trip.group(1)) if trip else _trip_count(comps, comp, line)


def branches_of(line):
    """The computations the conditional on `line` chooses between: an n-way one's `branch_computations`, a two-way
    one's true / false computations (XLA:GPU's non-finite guard: ZeRO-1 / 2's weight gathers sit in its update)."""
    found = re.search(r"branch_computations=\{([^}]*)\}", line)
    names = re.findall(r"%([\w.\-]+)", found.group(1)) if found else []
    return names + re.findall(r"\b(?:true|false)_computation=%([\w.\-]+)", line)


def _trip_count(comps, comp, line):
    """The trip count of a while loop whose backend config does not state it (XLA:TPU's): its condition `i < N`
    on the counter at tuple index 0, N a constant, from the counter's initial constant (0 when not found); 1 when
    the condition is another."""
    cond = re.search(r"\bcondition=%([\w.\-]+)", line)
    lines = comps.get(cond.group(1), ()) if cond else ()
    consts = {m.group(1): int(m.group(2)) for m in (re.match(r"\s*%([\w.\-]+) = s32\[\]\S* constant\((-?\d+)\)", l)
                                                    for l in lines) if m}
    counters = {m.group(1) for m in (re.match(r"\s*%([\w.\-]+) = s32\[\]\S* get-tuple-element\(.*index=0\b", l)
                                     for l in lines) if m}
    bound = next((consts[m.group(2)] for m in (re.search(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT", l)
                                                for l in lines) if m and m.group(1) in counters
                  and m.group(2) in consts), None)
    if bound is None:
        return 1
    init = 0
    operand = re.search(r" while\(%([\w.\-]+)\)", line)
    defs = {m.group(1): m.group(2) for m in (re.match(r"\s*%([\w.\-]+) = .*? tuple\((.*?)\)", l)
                                             for l in comps.get(comp, ())) if m}
    first = re.match(r"%([\w.\-]+)", defs.get(operand.group(1), "")) if operand else None
    if first:
        start = next((re.search(r"constant\((-?\d+)\)", l) for l in comps.get(comp, ())
                      if re.match(rf"\s*%{re.escape(first.group(1))} = s32\[\]", l)), None)
        init = int(start.group(1)) if start else 0
    return max(bound - init, 1)


def _operand_shape(comps, comp, operand):
    """(dtype, elements) of the value `operand` defines in computation `comp` (a parameter's too), or None."""
    for line in comps.get(comp, ()):
        m = re.match(rf"\s*(?:ROOT )?%{re.escape(operand)} = (\S+)", line)
        if m:
            shapes = _shapes(m.group(1))
            return shapes[0] if len(shapes) == 1 else None
    return None


def _narrow_source(comps, comp, operand):
    """'bf16' / 'f16' when `operand` (in computation `comp`) is an up-convert of a narrower float, else None."""
    defs = {}
    for line in comps.get(comp, ()):
        m = _INSTR.match(line)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3), m.group(4), line)
    for _ in range(8):
        if operand not in defs:
            return None
        type_text, op, args, line = defs[operand]
        first = re.match(r"\s*%([\w.\-]+)", args)
        if op == "fusion":
            called = re.search(r"\bcalls=%([\w.\-]+)", line)
            root = next((l for l in comps.get(called.group(1), ()) if l.strip().startswith("ROOT")), None) \
                if called else None
            m = _INSTR.match(root) if root else None
            return _narrow_source(comps, called.group(1), m.group(1)) if m else None
        if op in ("bitcast", "copy", "reshape", "transpose") and first:
            operand = first.group(1)
            continue
        if op == "convert" and first and first.group(1) in defs:
            source = _shapes(defs[first.group(1)][0])
            return source[0][0] if source and source[0][0] in ("bf16", "f16") else None
        return None
    return None


def replica_groups(line, num_devices):
    """The replica groups of a collective's HLO line as arrays of logical device ids (positions in the program's
    device assignment), in any of XLA's spellings: explicit ({{0,2},{1,3}}), iota ([2,4]<=[4,2]T(1,0): the ids
    arange(8).reshape(4,2).T, then one group per row of [2,4]) and by mesh axes (mesh['axis_0'=2,'axis_1'=4]
    {'axis_1'}: the ids laid out row-major over the axes, or in the order of its `device_ids=(...)` (an iota as
    above, or a list), a group per position of the axes not named; a sub-axis 'axis_1':(m)k is the middle k of that
    axis split major to minor as [m, k, rest], Shardy's pre-size notation)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^{]*)\))?\s*\{([^}]*)\}", line)
    if mesh:
        names = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        parts, grouped = [], []  # every axis as its [pre, size, rest] parts; the grouped parts' positions
        named = {name: (int(pre), int(sub)) if sub else None
                 for name, pre, sub in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", mesh.group(3))}
        for name, size in names:
            size = int(size)
            pre, sub = named[name] if named.get(name) else (1, size)
            grouped += [len(parts) + 1] if name in named else []
            parts += [pre, sub, size // (pre * sub)]
        ids = np.arange(num_devices)
        if mesh.group(2):
            ids = _iota(mesh.group(2), num_devices) if "[" in mesh.group(2) else np.array(
                [int(x) for x in mesh.group(2).split(",")])
        ids = ids.reshape(parts)
        rest = [i for i in range(len(parts)) if i not in grouped]
        return list(ids.transpose(rest + grouped).reshape(-1, math.prod(parts[i] for i in grouped)))
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return [np.array([int(x) for x in g.split(",") if x]) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if iota:
        return list(_iota(iota.group(2), num_devices).reshape(-1, int(iota.group(1).split(",")[-1])))
    return [np.arange(num_devices)]


def _iota(text, num_devices):
    """The ids of an HLO iota `[4,2]T(1,0)` (arange reshaped, then transposed), flattened."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    ids = np.arange(num_devices).reshape([int(x) for x in m.group(1).split(",")])
    return (ids.transpose([int(x) for x in m.group(2).split(",")]) if m.group(2) else ids).reshape(-1)


def conditional_branches(hlo):
    """The branch computations of every conditional in compiled HLO text: a list of lists of names."""
    return [re.findall(r"%([\w.\-]+)", b) for b in re.findall(r"branch_computations=\{([^}]*)\}", hlo)]


def collective_bytes(hlo, num_devices, root=None, hosts=None):
    """{collective type: bytes one device sends per step} from compiled HLO text (see the module docstring); with
    `root` (a computation's name, e.g. one of `conditional_branches`), per run of that computation instead. Every
    branch of a conditional counts as run (the sum over branches, not the one taken). hosts: the host of each
    logical device id (`hosts_of`); then only the collectives whose replica groups span hosts are counted."""
    out = {c: 0 for c in COLLECTIVES}
    for kind, groups, sent in _collectives(hlo, num_devices, root):
        if hosts is None or any(len({hosts[i] for i in g}) > 1 for g in groups):
            out[kind] += sent
    return out


def bytes_by_axes(hlo, mesh):
    """{'fsdp': bytes, 'data,fsdp': bytes, ...}: the bytes one device sends per step (as `collective_bytes`),
    grouped by the mesh axes its collectives' groups span (a group's devices differ along exactly those axes;
    the program's logical ids are `mesh.devices` in row-major order)."""
    out = {}
    shape = mesh.devices.shape
    for _, groups, sent in _collectives(hlo, mesh.devices.size):
        coords = [np.unravel_index(np.asarray(g), shape) for g in groups]
        spanned = [a for i, a in enumerate(mesh.axis_names) if any(len(set(c[i].tolist())) > 1 for c in coords)]
        key = ",".join(spanned) or "none"
        out[key] = out.get(key, 0) + sent
    return out


def _collectives(hlo, num_devices, root=None):
    """(type, replica groups, bytes one device sends per step) of every collective of compiled HLO text (see
    `collective_bytes`); a collective-permute's groups are its source-target pairs."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, root or entry)
    for comp, lines in comps.items():
        times = mult.get(comp, 0)
        # XLA:TPU's async collective fusions repeat their collective in the fusions that continue and finish it
        # (AsyncCollectiveDone, async_collective_fusion.*): one transfer, counted where it starts.
        if not times or comp.startswith("async_collective_fusion") or any(
                'custom_call_target="AsyncCollectiveDone"' in line for line in lines):
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            kind = m.group(3).removesuffix("-start")
            if kind not in COLLECTIVES:
                continue
            # XLA:TPU's reduce-scatter: an all-reduce sliced by partition id, fused (all-reduce-scatter.*)
            whole = kind == "all-reduce" and comp.startswith("all-reduce-scatter")
            kind = "reduce-scatter" if whole else kind
            groups = replica_groups(line, num_devices)
            pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
            if kind == "collective-permute" and pairs:
                groups = [np.array([int(a), int(b)]) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
            n = len(groups[0]) if groups else 1
            shapes = _shapes(m.group(2))
            if m.group(3).endswith("-start"):
                results = _async_results(m.group(2))
                shapes = [x for x in _shapes(results) if x[1] > 1 or x[0] not in ("u32", "s32")]  # TPU's sync words
                if results == m.group(2) and kind in ("all-gather", "collective-permute") and len(shapes) > 1:
                    shapes = shapes[len(shapes) // 2:]  # (operands..., results...): count the results
            operands = re.findall(r"%([\w.\-]+)", m.group(4).split(")")[0])
            if kind == "ragged-all-to-all":  # (operand, output, offsets and sizes) -> output: see the docstring
                shapes = [min(shapes[0], _operand_shape(comps, comp, operands[0]) or shapes[0], key=lambda x: x[1])]
            size = 0
            for i, (dtype, elements) in enumerate(shapes):
                narrow = None
                if kind == "all-gather" and dtype == "f32" and i < len(operands):
                    narrow = _narrow_source(comps, comp, operands[i])
                size += elements * _BYTES[narrow or dtype]
            if kind == "reduce-scatter" and not whole:
                size *= n  # the result is 1/n of what each device feeds in
            factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)
            yield kind, groups, int(size * factor * times)


MESH_AXES = ("data", "fsdp", "model", "expert")  # a layout's sizes, in this order (expert only when > 1)


def parse_mesh(mesh):
    """'data,fsdp,model[,expert]' (or a tuple of them) -> the sizes as a tuple; ValueError naming `mesh` otherwise."""
    sizes = mesh
    if isinstance(mesh, str):
        try:
            sizes = tuple(int(x) for x in mesh.split(","))
        except ValueError:
            sizes = None
    if not (isinstance(sizes, (tuple, list)) and len(sizes) in (3, 4)
            and all(isinstance(x, int) and x >= 1 for x in sizes)):
        raise ValueError(f"mesh={mesh!r}; expected three or four positive sizes 'data,fsdp,model[,expert]', e.g. "
                         "'1,8,1'")
    return tuple(sizes)


def mesh_sizes(mesh):
    """A layout's sizes (data, fsdp, model[, expert]) as `make_mesh`'s keyword arguments."""
    return dict(zip(MESH_AXES, mesh))


def mesh_shapes(num_devices, experts=0):
    """Every (data, fsdp, model) whose product is `num_devices`; with `experts` (a mixture's expert count), also
    every (data, fsdp, model, expert) with an expert size > 1 dividing it."""
    divisors = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
    shapes = [(d, f, num_devices // (d * f)) for d in divisors(num_devices) for f in divisors(num_devices)
              if num_devices % (d * f) == 0]
    for e in divisors(num_devices)[1:]:
        if experts and experts % e == 0:
            shapes += [shape + (e,) for shape in mesh_shapes(num_devices // e)]
    return shapes


def memory_per_device(compiled):
    """{'arguments', 'outputs', 'aliased', 'temporaries', 'total'} bytes per device of a `jax.stages.Compiled`
    (total: what the program holds at once, its donated arguments counted once), plus 'peak' where the compiler
    reports its heap's high-water mark (XLA:TPU; below the total by what its temporaries' block holds beyond it), or
    None where the backend does not report them."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    result = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
              "aliased": mem.alias_size_in_bytes, "temporaries": mem.temp_size_in_bytes, "total": total}
    if getattr(mem, "peak_memory_in_bytes", 0) > 0:
        result["peak"] = mem.peak_memory_in_bytes
    return result


# HBM per TPU device by `device_kind`, for compile-only devices, which report no memory statistics. What XLA:TPU
# lets a program use is a little less (v5e: 15.75 GiB of its 16); the compiler refuses a larger program itself.
TPU_HBM_BYTES = {"TPU v4": 32 << 30, "TPU v5 lite": 16 << 30, "TPU v5": 95 << 30, "TPU v6 lite": 32 << 30}


# Memory per GPU by `device_kind` (nvidia-smi's total), for the compile-only devices of a 'gpu:' target. What a
# JAX process's allocator may use of it is `gpu_memory_fraction()` of that.
GPU_MEMORY_BYTES = {"NVIDIA H100 80GB HBM3": 81559 << 20, "NVIDIA H200": 143771 << 20}
# The GPU targets: name -> (device kind, memory bandwidth in bytes/s) of the compile-only devices built for it.
GPU_TARGETS = {"h100": ("NVIDIA H100 80GB HBM3", 3_352_320_000_000), "h200": ("NVIDIA H200", 4_800_000_000_000)}
GPUS_PER_HOST = 8


def gpu_memory_fraction():
    """The share of a GPU's memory JAX's allocator takes (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 by default, as JAX
    reads it)."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def device_memory_bytes(device):
    """The bytes `device` can hold for a program (`memory_stats()['bytes_limit']`, what XLA's allocator may use on a
    GPU or TPU; a compile-only TPU device's HBM from `TPU_HBM_BYTES`; a compile-only GPU's memory from
    `GPU_MEMORY_BYTES` times `gpu_memory_fraction()`), or None where the backend does not say (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics (compile-only devices among them)
        stats = None
    if not stats and getattr(device, "platform", None) == "tpu":
        return TPU_HBM_BYTES.get(device.device_kind)
    if not stats and getattr(device, "platform", None) == "gpu" and device.device_kind in GPU_MEMORY_BYTES:
        return int(GPU_MEMORY_BYTES[device.device_kind] * gpu_memory_fraction())
    return (stats or {}).get("bytes_limit")


def diloco_bytes(hlo, fragments, num_devices, hosts=None):
    """(an inner step's bytes per collective, [each part's outer step's]) of a DiLoCo step's HLO, read through its
    outer steps' switch (a collective-free branch, then one per part); (all bytes, None) without one (the
    overlapped program of the inner step alone)."""
    comm = collective_bytes(hlo, num_devices, hosts=hosts)
    switches = [b for b in conditional_branches(hlo) if len(b) == fragments + 1]
    if len(switches) != 1:
        return comm, None
    outer = [collective_bytes(hlo, num_devices, root=b, hosts=hosts) for b in switches[0][1:]]
    return {k: v - sum(o[k] for o in outer) for k, v in comm.items()}, outer


def hosts_of(devices):
    """The host of each device, for telling the fast links from the slow: a TPU's slice (ICI within, DCN between; a
    single slice's devices, which carry no `slice_index`, all 0 whatever their process), else its process (one per
    machine, as jax.distributed runs on GPUs and CPUs)."""
    return [getattr(d, "slice_index", 0) if d.platform == "tpu" else d.process_index for d in devices]


# TPU generations by the name Cloud TPU gives their slices ("v5p-8"), with the suffix's unit (TensorCores for v4 and
# v5p, two per chip; chips for v5e and v6e) and their ICI torus's rank (3-D: v4, v5p; 2-D: v5e, v6e).
TPU_GENERATIONS = {"v4": (2, 3), "v5p": (2, 3), "v5e": (1, 2), "v6e": (1, 2)}
_TARGET = re.compile(r"tpu:(v4|v5p|v5e|v6e)-(\d+)(?:x(\d+))?")
_GPU_TARGET = re.compile(r"gpu:(h100|h200)(?:-(\d+))?")


def parse_target(target):
    """A target name -> None (this machine's own devices: 'cpu', None) or (generation, chips per slice, the
    topology name `jax.experimental.topologies.get_topology_desc` takes, slices). Names: 'tpu:<generation>-<n>'
    as Cloud TPU spells slices (v4-8, v5p-8: n TensorCores, two per chip; v5e-8, v6e-8: n chips), with 'x<s>' for
    s slices joined by the data-centre network (tpu:v5e-16x2); 'gpu:<h100|h200>[-<n>]' for n GPUs (1 by default)
    in hosts of `GPUS_PER_HOST` (n up to 8, or a multiple of 8), whose topology is '1x<hosts>x<GPUs a host>'. A
    bad name is a ValueError of one line."""
    if target in (None, "", "cpu"):
        return None
    gpu = _GPU_TARGET.fullmatch(str(target))
    if gpu:
        n = int(gpu.group(2) or 1)
        if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
            raise ValueError(f"target={target!r}; expected a GPU count n of 1 to {GPUS_PER_HOST} or a multiple of "
                             f"{GPUS_PER_HOST} (hosts of {GPUS_PER_HOST} GPUs), e.g. gpu:h100-8 or gpu:h200-16")
        per_host = min(n, GPUS_PER_HOST)
        return gpu.group(1), n, f"1x{n // per_host}x{per_host}", 1
    m = _TARGET.fullmatch(str(target))
    cores, rank = TPU_GENERATIONS.get(m.group(1), (1, 0)) if m else (1, 0)
    chips = int(m.group(2)) // cores if m else 0
    slices = int(m.group(3) or 1) if m else 0
    shape = _torus(chips, rank) if m and int(m.group(2)) % cores == 0 else None
    if shape is None or slices < 1:
        raise ValueError(f"target={target!r}; expected 'cpu', 'gpu:<h100|h200>[-<n>]' or "
                         f"'tpu:<generation>-<n>[x<slices>]' with generation one of {sorted(TPU_GENERATIONS)} and n "
                         "a slice size of it (v5p-8, v4-16: TensorCores, 4 or more chips, a power of two; v5e-8, "
                         "v6e-16: chips, 4 or more, a power of two), e.g. tpu:v5p-8, tpu:v5e-16x2 or gpu:h100-8")
    return m.group(1), chips, f"{m.group(1)}:{'x'.join(map(str, shape))}", slices


def _torus(chips, rank):
    """The ICI torus of `chips` chips as libtpu names it (2x2x1, 2x2x2, 2x2x4, ... for 3-D; 2x2, 2x4, 4x4, ... for
    2-D: the smallest dimension doubled first), or None unless chips is a power of two >= 4."""
    if rank not in (2, 3) or chips < 4 or chips & (chips - 1):
        return None
    dims = [2, 2] + [1] * (rank - 2)
    while math.prod(dims) < chips:
        dims[dims.index(min(dims))] *= 2
    return sorted(dims, reverse=rank == 3 and dims.count(1) > 0) if rank == 3 else sorted(dims)


def target_devices(target):
    """The compile-only devices of `target` (`parse_target`; None or 'cpu': `jax.devices()`): a TPU slice's come
    from libtpu (`jax[tpu]`) without a TPU, so a program compiled for them is what XLA:TPU and Mosaic compile for
    the real slice (memory per chip from its buffer assignment); GPUs' from the CUDA plugin (`jax[cuda13]`; make
    test-gpu-compile's environment) given the device's description, so XLA:GPU and the kernels' compilers (Triton,
    Mosaic GPU, ptxas) compile the program as for those GPUs, without autotuning (no device to time on). Run with
    JAX_PLATFORMS=cpu on a machine without a TPU or GPU."""
    parsed = parse_target(target)
    if parsed is None:
        return jax.devices()
    generation, _, topology, slices = parsed
    if generation in GPU_TARGETS:
        return _gpu_devices(generation, topology)
    try:
        import libtpu  # noqa: F401, PLC0415 - only to tell a missing install from a bad topology
    except ImportError:
        raise ValueError(f"target={target!r} needs libtpu: pip install 'jax[tpu]=={jax.__version__}' (make "
                         "test-tpu's environment has it)") from None
    from jax.experimental import topologies  # noqa: PLC0415
    try:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=slices)
    except Exception as e:  # noqa: BLE001 - libtpu's refusal, as one line
        raise ValueError(f"target={target!r} ({topology}, {slices} slice(s)): libtpu refused it: "
                         f"{str(e).splitlines()[0][:200]}") from None
    return list(desc.devices)


def _gpu_devices(name, topology):
    """The compile-only devices of a 'gpu:' target (`GPU_TARGETS[name]`, `topology` as `parse_target` gives it)."""
    kind, bandwidth = GPU_TARGETS[name]
    try:
        from jax.experimental import topologies  # noqa: PLC0415

        from kernels import mosaic_gpu_compile  # noqa: PLC0415 - the Hopper description the kernels' tier compiles for
        config = mosaic_gpu_compile.hopper_target_config(kind, GPU_MEMORY_BYTES[kind], bandwidth)
        desc = topologies.get_topology_desc(platform="cuda", target_config=config, topology=topology)
    except Exception as e:  # noqa: BLE001 - no CUDA plugin: one line saying what to install
        raise ValueError(f"target='gpu:{name}...' needs JAX's CUDA plugin for compile-only GPUs (pip install "
                         f"'jax[cuda13]=={jax.__version__}'; make test-gpu-compile's .venv-gpu-compile has it): "
                         f"{str(e).splitlines()[0][:200]}") from None
    return list(desc.devices)


def _bytes_per_step(trainer, hlo, num_devices, hosts=None):
    """Bytes per collective one device sends per step (hosts: only across hosts, see `collective_bytes`), averaged
    over DiLoCo's rounds: each part's outer step runs once every inner_steps steps (overlapped: the inner program
    alone, so its outer steps are not counted)."""
    if trainer.diloco is None:
        return collective_bytes(hlo, num_devices, hosts=hosts)
    inner, outer = diloco_bytes(hlo, trainer.diloco.fragments, num_devices, hosts=hosts)
    return {k: v + sum(o[k] for o in outer or ()) / trainer.diloco.inner_steps for k, v in inner.items()}


def compile_step(trainer, batch):
    """`trainer`'s train step compiled ahead of time for `batch` on its state's abstract layout
    (`Trainer.compile`)."""
    return trainer.compile(batch)


def rank_meshes(make_trainer, batch, *, devices=None, stages=1, context=1, memory_bytes=None, experts=0):
    """The automatic choice of a layout (RedCoast's and Alpa's aim, by measurement rather than a cost model): the
    train step of `make_trainer(mesh)` (an `engine.Trainer` over abstract parameters, no workdir) compiled for the
    one global `batch` ({name: jax.ShapeDtypeStruct [accumulate, rows, ...]}) on every (data, fsdp, model) of the
    `devices` (default all) left after `stages` x `context` (with `experts`, a mixture's expert count: also every
    (data, fsdp, model, expert), `mesh_shapes`), read off the compiled programs, best first: those whose
    memory per device fits `memory_bytes` (None: any), then by bytes each device sends per step (DiLoCo's outer
    steps averaged over their rounds), then by memory. With the global batch fixed every layout does the same
    useful work, so what differs is the communication (and, for a memory limit, the fit). Devices on more than one
    host (`hosts_of`): the bytes of collectives whose groups span hosts are ranked first, before all bytes sent (the
    links between hosts are the slow ones: MaxText's DCN against ICI). Each result: {'mesh': [data, fsdp, model]
    (and expert where > 1), 'stages', 'context', 'bytes' (memory_per_device), 'collective_bytes',
    'collective_bytes_total', 'fits'}, and across hosts 'cross_host_bytes'; a layout that does not compile (heads
    that `model` does not divide, say) comes last with its 'error'."""
    devices = list(jax.devices() if devices is None else devices)
    results = []
    for shape in mesh_shapes(len(devices) // (stages * context), experts):
        try:
            mesh = make_mesh(**mesh_sizes(shape), stage=stages, context=context, devices=devices)
            trainer = make_trainer(mesh)
            compiled = compile_step(trainer, batch)
        except Exception as e:  # noqa: BLE001 - one layout that cannot run must not end the search
            logging.info("mesh %s does not compile: %s", shape, e)
            results.append({"mesh": list(shape), "stages": stages, "context": context,
                            "error": str(e).splitlines()[0][:200]})
            continue
        hlo = compiled.as_text()
        comm = _bytes_per_step(trainer, hlo, len(devices))
        memory = memory_per_device(compiled)
        results.append({"mesh": list(shape), "stages": stages, "context": context, "bytes": memory,
                        "collective_bytes": comm, "collective_bytes_total": sum(comm.values())})
        hosts = hosts_of(mesh.devices.flat)  # the program's logical ids are the mesh's devices in order
        if len(set(hosts)) > 1:
            results[-1]["cross_host_bytes"] = sum(_bytes_per_step(trainer, hlo, len(devices), hosts).values())
        logging.info("mesh %s: %s bytes per device, %d bytes sent per step", shape,
                     memory and memory["total"], sum(comm.values()))  # a long search shows its progress
    return rank_layouts(results, memory_bytes)


def rank_layouts(results, memory_bytes=None):
    """`rank_meshes`'s order of its measured layouts, each marked 'fits' for the budget `memory_bytes` (None: any)."""
    total = lambda r: r["bytes"]["total"] if r.get("bytes") else 0  # noqa: E731 - a backend without figures: 0
    ok = [{**r, "fits": memory_bytes is None or total(r) <= memory_bytes} for r in results if "error" not in r]
    ok.sort(key=lambda r: (not r["fits"], r.get("cross_host_bytes", 0), r["collective_bytes_total"], total(r)))
    return ok + [r for r in results if "error" in r]


def format_table(results):
    """A plain-text table of `sweep` or `rank_meshes` results, best first (GB, or MB when a total is under 1 GB)."""
    totals = [r["bytes"]["total"] for r in results if r.get("bytes")]
    unit, scale = ("GB", 1e9) if not totals or min(totals) >= 1e9 else ("MB", 1e6)
    hosts = any("cross_host_bytes" in r for r in results)  # a column of its own only when it was measured
    axes = ",".join(MESH_AXES[:max([len(r["mesh"]) for r in results] + [3])])
    w = len(axes)
    head = (f"{'rank':>4}  {axes:>{w}}  {'stages':>6}  {'idle':>4}  {'zero':>4}  {'total ' + unit:>9}  "
            f"{'args ' + unit:>8}  {'temp ' + unit:>8}  {'sent ' + unit:>8}  {'all-gather':>10}  {'red-scat':>9}  "
            f"{'all-red':>8}  {'a2a':>6}  {'permute':>7}  " + (f"{'x-host ' + unit:>10}  " if hosts else "") + "fits")
    lines = [head]
    size = lambda b: f"{b / scale:.2f}"  # noqa: E731
    for i, r in enumerate(results, 1):
        mesh, stages, zero = ",".join(str(x) for x in r["mesh"]), r.get("stages", 1), r.get("zero_stage", "")
        if "error" in r:
            lines.append(f"{'-':>4}  {mesh:>{w}}  {stages:>6}  {'':>4}  {zero:>4}  error: {r['error']}")
            continue
        b, c = r["bytes"] or dict.fromkeys(("total", "arguments", "temporaries"), float("nan")), r["collective_bytes"]
        idle = f"{r.get('idle_share', 0.0):.2f}"
        lines.append(f"{i:>4}  {mesh:>{w}}  {stages:>6}  {idle:>4}  {zero:>4}  {size(b['total']):>9}  "
                     f"{size(b['arguments']):>8}  "
                     f"{size(b['temporaries']):>8}  {size(r['collective_bytes_total']):>8}  "
                     f"{size(c['all-gather']):>10}  {size(c['reduce-scatter']):>9}  {size(c['all-reduce']):>8}  "
                     f"{size(c['all-to-all']):>6}  {size(c['collective-permute']):>7}  "
                     + (f"{size(r.get('cross_host_bytes', 0)):>10}  " if hosts else "") + f"{r.get('fits', '')}")
    return "\n".join(lines)
