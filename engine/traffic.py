"""What a compiled XLA:GPU program launches and the device-memory bytes each launch moves, read off its optimised HLO
(`kernel_traffic`): the compile tier's view of where a step's time goes besides its FLOPs, for a program compiled for a
GPU without one (`engine.plan.target_devices`).

Every launch of the program's top level and of its loops' bodies, times the loops' trip counts (of a conditional, the
costliest branch: a step's update rather than its skip of a non-finite one), in one of these kinds: 'matmul' (XLA's GEMM
fusions, cuBLAS calls), 'kernel' (other custom calls: cuDNN's attention, Pallas kernels through Triton or Mosaic GPU),
'collective', 'fill' (a fusion of no operand: a buffer set to a constant, such as the zeros a scanned stack's saved
activations start from; an `AllocateBuffer`, the uninitialised buffer XLA puts in their place where every slot is
written before it is read, launches nothing), 'stack write' (a dynamic-update-slice into a larger buffer, in place: a
scan writing one layer's value into its [layers, ...] stack), 'stack read' (a dynamic slice out of one), 'copy' and
'elementwise' (every other fusion: elementwise work, reductions, transposes). Its bytes: every operand read once and the
result written once, except that an operand a fusion only slices or gathers from (through bitcasts and converts) is read
as the elements it selects, an in-place update reads its inputs (not the buffer) and writes the update alone and a
cuBLAS call's scratch workspace is not counted; with XLA's Triton GEMMs off, cuBLAS calls fused with a stack's slices
(XLA's dynamic-slice fusion) are 'matmul' launches reading their operands' slices and writing their update in place. An
estimate, not a profile: caches, a GEMM's re-reads of its tiles and what overlaps are not modelled. Time at the device's
bandwidth is a floor for the memory-bound kinds (everything but 'matmul' and 'kernel', whose FLOPs usually bound
them)."""
import re

from engine.plan import _BYTES, _INSTR, _computations, _shapes, branches_of, loop_trips

KINDS = ("matmul", "kernel", "collective", "fill", "stack write", "stack read", "copy", "elementwise")
_PARAM = re.compile(r"^\s*%([\w.\-]+) = \S+ parameter\((\d+)\)")
# Instructions that launch nothing (or whose work the matching -start / -done half counts).
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "fusion-done", "copy-done", "async-done",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "send-done", "recv-done"}
_COLLECTIVE = re.compile(r"^(all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|"
                         r"collective-permute)(-start)?$")


def _bytes(type_text):
    return sum(_BYTES[dtype] * n for dtype, n in _shapes(type_text))


def _result_type(type_text, op):
    """The result part of an instruction's type: an async start's `((operands...), result, context)` without its
    operands and context."""
    if not op.endswith("-start") or not type_text.startswith("(("):
        return type_text
    depth = 0
    for i, c in enumerate(type_text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 1 and c == ")":
            parts = re.findall(r"\w+\[[\d,]*\]", type_text[i + 1:])
            return parts[0] if parts else ""
    return type_text


def _operands(rest):
    """The instruction names an instruction's operand list (the text after its opcode's parenthesis) names."""
    return re.findall(r"%([\w.\-]+)", rest.split("), ")[0])


class _Module:
    def __init__(self, hlo):
        self.comps, self.entry = _computations(hlo)
        self.types, self.roots, self.instrs = {}, {}, {}
        for name, lines in self.comps.items():
            for line in lines:
                m = _INSTR.match(line)
                if m:
                    self.types[(name, m.group(1))] = m.group(2)
                    self.instrs[(name, m.group(1))] = m
                    if line.lstrip().startswith("ROOT"):
                        self.roots[name] = m.group(3)
                        self.instrs[(name, None)] = m

    def _users(self, callee, name, through=("bitcast",)):
        """The instructions of `callee` that use `name`, through the ops in `through` (bitcasts move nothing; an
        element's convert reads that element alone): (instruction, whether `name`, or what it passed through, is its
        first operand)."""
        found = []
        for line in self.comps.get(callee, ()):
            m = _INSTR.match(line)
            if not m or m.group(1) == name or name not in _operands(m.group(4)):
                continue
            if m.group(3) in through:
                found += self._users(callee, m.group(1), through)
            else:
                found.append((m, _operands(m.group(4))[0] == name))
        return found

    def operand_read(self, callee, index, full):
        """Bytes a fused computation reads of its parameter `index` (`full` bytes): the elements it selects where it
        only slices it (dynamic or static slices) or gathers from it (a label's logit), through bitcasts and converts,
        none where it is only the buffer an update writes in place (through bitcasts)."""
        lines = self.comps.get(callee, ())
        name = next((m.group(1) for m in map(_PARAM.match, lines) if m and int(m.group(2)) == index), None)
        if name is None:
            return full
        users = self._users(callee, name, ("bitcast", "convert"))
        if users and all(u.group(3) in ("dynamic-slice", "slice", "gather") and first for u, first in users):
            shapes = _shapes(self.types[(callee, name)])
            size = _BYTES[shapes[0][0]] if len(shapes) == 1 else None
            if size is not None:
                return sum(size * n for u, _ in users for _, n in _shapes(u.group(2)))
        users = self._users(callee, name)
        if users and all(u.group(3) == "dynamic-update-slice" and first for u, first in users):
            return 0
        return full

    def written(self, callee, result):
        """Bytes a fused computation writes of its `result`: an output updated in place (a dynamic-update-slice) as
        its update, a cuBLAS call's workspace not at all."""
        root = self.instrs.get((callee, None))
        if root is None:
            return _bytes(result)
        outputs = _operands(root.group(4)) if root.group(3) == "tuple" else [root.group(1)]
        total = 0
        for name in outputs:
            m = self.instrs.get((callee, name))
            while m is not None and m.group(3) == "bitcast":
                m = self.instrs.get((callee, _operands(m.group(4))[0]))
            if m is None:
                continue
            source = self.instrs.get((callee, _operands(m.group(4))[0])) if m.group(3) == "get-tuple-element" else None
            if m.group(3) == "dynamic-update-slice":
                total += _bytes(self.types.get((callee, _operands(m.group(4))[1]), ""))
            elif not (_is_cublas(source) and _workspace(source.group(2)) == _bytes(m.group(2))):
                total += _bytes(m.group(2)) - (_workspace(m.group(2)) if _is_cublas(m) else 0)
        return total


def _is_cublas(m):
    return m is not None and m.group(3) == "custom-call" and "__cublas" in m.group(4)


def _workspace(type_text):
    """The bytes of a cuBLAS call's result that are its scratch workspace (the s8 buffer that ends its tuple)."""
    shapes = _shapes(type_text)
    return shapes[-1][1] if type_text.startswith("(") and len(shapes) > 1 and shapes[-1][0] == "s8" else 0


def _launch(module, comp, line):
    """(kind, bytes) of one instruction of a launching computation, or None where it launches nothing."""
    m = _INSTR.match(line)
    if not m or m.group(3) in _FREE:
        return None
    _, type_text, op, rest = m.groups()
    operands = [module.types.get((comp, o), "") for o in _operands(rest)]
    result = _result_type(type_text, op)
    callee = re.search(r"\bcalls=%([\w.\-]+)", line)
    callee = callee.group(1) if callee else None
    root = module.roots.get(callee, op) if callee else op
    if _COLLECTIVE.match(op):
        return "collective", _bytes(result)
    if op == "custom-call":
        if 'custom_call_target="AllocateBuffer"' in rest:  # an uninitialised buffer: no thunk, nothing moved
            return None
        if _is_cublas(m):
            return "matmul", _bytes(result) - _workspace(result) + sum(map(_bytes, operands))
        return "kernel", _bytes(result) + sum(map(_bytes, operands))
    reads = [module.operand_read(callee, i, _bytes(t)) if callee else _bytes(t) for i, t in enumerate(operands)]
    read = sum(reads)
    body = module.comps.get(callee, ()) if callee else ()
    if 'kind=kCustom' in line and any(" dot(" in b or '"__cublas' in b for b in body):
        # A GEMM fusion, or cuBLAS with its operands sliced out of a stack and its result written into one in place
        # (XLA's dynamic-slice fusion): its slices read, its update written.
        return "matmul", read + module.written(callee, result)
    if root == "dynamic-update-slice":  # in place: the update read (its slices where sliced) and written, not the
        # buffer (the largest operand, of which the fusion reads nothing), nor indices
        if callee:
            return "stack write", 2 * sum(r for r, t in zip(reads, operands) if _bytes(t) > 8)
        sizes = sorted(b for b in map(_bytes, operands) if b > 8)
        return "stack write", 2 * (sum(sizes) - (sizes[-1] if sizes else 0))
    if root == "dynamic-slice":
        return "stack read", 2 * _bytes(result)
    if op in ("fusion", "fusion-start") and not operands:
        return "fill", _bytes(result)
    if op in ("copy", "copy-start"):
        return "copy", read + _bytes(result)
    return "elementwise", read + (module.written(callee, result) if callee else _bytes(result))


def _count(module, comp, times, kinds):
    """Adds the launches of computation `comp`, run `times` times, to `kinds`: a loop's body times its trip count, a
    conditional's costliest branch (the path a step takes when it applies its update, not the skip)."""
    for line in module.comps.get(comp, ()):
        body = re.search(r"\bbody=%([\w.\-]+)", line)
        if body and " while(" in line:
            _count(module, body.group(1), times * loop_trips(module.comps, comp, line), kinds)
            continue
        branches = branches_of(line) if " conditional(" in line else []
        if branches:
            taken = []
            for branch in branches:
                taken.append({k: {"launches": 0, "bytes": 0} for k in KINDS})
                _count(module, branch, times, taken[-1])
            costliest = max(taken, key=lambda t: sum(v["bytes"] for v in t.values()))
            for kind, v in costliest.items():
                kinds[kind]["launches"] += v["launches"]
                kinds[kind]["bytes"] += v["bytes"]
            continue
        launch = _launch(module, comp, line)
        if launch:
            kinds[launch[0]]["launches"] += times
            kinds[launch[0]]["bytes"] += times * launch[1]


def kernel_traffic(hlo):
    """{'launches': n, 'bytes': b, 'kinds': {kind: {'launches', 'bytes'}}} of a compiled XLA:GPU module's text (the
    module docstring says what is counted), per run of the program."""
    module = _Module(hlo)
    kinds = {k: {"launches": 0, "bytes": 0} for k in KINDS}
    _count(module, module.entry, 1, kinds)
    return {"launches": sum(k["launches"] for k in kinds.values()), "bytes": sum(k["bytes"] for k in kinds.values()),
            "kinds": kinds}


def format_traffic(traffic, bandwidth):
    """A markdown table of `kernel_traffic`'s result: per kind, launches, GB and ms at `bandwidth` bytes/s."""
    lines = ["| kind | launches | GB | ms at the memory bandwidth |", "|---|---|---|---|"]
    rows = [(k, v) for k, v in traffic["kinds"].items() if v["launches"]] + [("all", traffic)]
    for kind, v in rows:
        lines.append(f"| {kind} | {v['launches']} | {v['bytes'] / 1e9:.2f} | {v['bytes'] / bandwidth * 1e3:.2f} |")
    return "\n".join(lines)
