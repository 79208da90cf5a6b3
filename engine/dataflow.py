"""The dataflow analysis behind `engine.sharding.auto_shard` (whose docstring states the rules it derives): the
program `trace_fn` builds is traced abstractly (`jax.make_jaxpr`, nothing runs), every intermediate value carries
which of its dims is split over `model` and every parameter which of its dims it came from, and each matmul with a
parameter operand decides that parameter's split. The same walk records what a `scan` iterates over (stacked
layers, for `stage`) and what `kernels.grouped_matmul` takes (experts, for `expert`)."""
import math

import jax
import numpy as np
from jax.extend import core as jex_core

from kernels.grouped_matmul import TRACE_NAME as GROUPED_MATMUL


# ----------------------------------------------------------------------------------------------------------------
# Parameter paths, shared with `engine.sharding`.

def key_str(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path):
    return "/".join(key_str(k) for k in path)


def leaf_shape(x):
    return tuple(getattr(x, "shape", np.shape(x)))


def is_adapter(key):
    """Whether a '/'-joined parameter path names a LoRA adapter (`lora_a` / `lora_b`)."""
    return key.rsplit("/", 1)[-1] in ("lora_a", "lora_b")


# ----------------------------------------------------------------------------------------------------------------
# The analysis.

def scan_counts(params):
    """(consts, carry) operand counts of a `scan` equation: JAX 0.10 records them as `num_consts` / `num_carry`,
    JAX 0.11 as the groups of its `ft_in` tree (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


class _Info:
    """What the analysis knows about one value: which dim is split over `model` (or None), and, when the value is a
    parameter or a pure re-shaping of one, (param index, param dim for each of its dims)."""
    __slots__ = ("split", "origin")

    def __init__(self, split=None, origin=None):
        self.split, self.origin = split, origin


_REPLICATED = _Info()
_SHAPE_ONLY = {"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier"}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
               "reduce_xor"}
_SLICING = {"slice", "dynamic_slice", "dynamic_update_slice", "pad", "rev", "concatenate", "cumsum", "cumprod",
            "cummax", "cumlogsumexp", "sort"}


def _reshape_map(in_shape, out_shape, divisor):
    """For each input dim, the output dim its split moves to (None when it is a non-leading part of a merge). A dim
    split into factors moves to the first factor `divisor` divides: [b, t, 3*h*d] -> [b, t, 3, h, d] lands on h."""
    mapping = [None] * len(in_shape)
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        i0, j0 = i, j
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]
                i += 1
            else:
                pj *= out_shape[j]
                j += 1
        # Group in[i0:i] == out[j0:j]: the first non-trivial input dim maps to the first non-trivial output dim.
        lead_out = next((d for d in range(j0, j) if out_shape[d] != 1 and out_shape[d] % divisor == 0),
                        next((d for d in range(j0, j) if out_shape[d] != 1), j0))
        lead_in = next((d for d in range(i0, i) if in_shape[d] != 1), None)
        if lead_in is not None:
            mapping[lead_in] = lead_out
        if i - i0 == 1 and j - j0 == 1:
            mapping[i0] = j0
    return mapping


def _remap(info, dim_map, out_rank):
    """Moves `info` through a dim mapping (input dim -> output dim or None)."""
    split = dim_map[info.split] if info.split is not None else None
    origin = None
    if info.origin is not None:
        pid, pdims = info.origin
        out = [None] * out_rank
        for d_in, d_out in enumerate(dim_map):
            if d_out is not None:
                out[d_out] = pdims[d_in]
        origin = (pid, tuple(out))
    return _Info(split, origin)


def _inner_jaxpr(params):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = params.get(name)
        if j is not None:
            return j.jaxpr if hasattr(j, "jaxpr") and not hasattr(j, "eqns") else j
    return None


class _Analysis:
    def __init__(self, shapes, model_size):
        self.shapes = shapes          # param index -> shape
        self.model_size = model_size
        self.decided = {}             # param index -> param dim split over `model` (or None: replicated)
        self.kind = {}                # param index -> 'column' | 'row' | 'embedding' | 'follow'
        self.used = set()             # param indices the program reads
        self.scanned = {}             # param index -> the param dim a scan iterates over (stacked layers)
        self.companions = {}          # param index -> (param it is combined with, {its dim: our dim}): see `combine`
        self.experts = {}             # param index -> its group dim in a grouped matmul (a mixture's experts)

    def _divisible(self, pid, pdim):
        return pdim is not None and self.shapes[pid][pdim] % self.model_size == 0

    def _layer_dim(self, pid, pdim, length):
        """The param dim a scan of `length` steps iterates over, from the leading one it starts at: where the scanned
        dim merges param dims pdim .. e (an interleaved pipeline's stack stored [V, L / V, ...] and scanned as [L],
        `models.layers.stack`), the last of them, which split over `stage` gives each stage its chunk of every
        round."""
        shape, size, dim = self.shapes[pid], 1, pdim
        for dim in range(pdim, len(shape)):
            size *= shape[dim]
            if size >= length:
                break
        return dim if size == length else pdim

    def _decide(self, pid, pdim, kind):
        if pid not in self.decided:
            self.decided[pid] = pdim
            self.kind[pid] = kind

    # -- walking -----------------------------------------------------------------------------------------------
    def walk(self, jaxpr, in_infos):
        env = {}

        def read(v):
            if isinstance(v, jex_core.Literal):
                return _REPLICATED
            return env.get(v, _REPLICATED)

        for v, info in zip(jaxpr.invars, in_infos):
            env[v] = info
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            for v, info in zip(eqn.outvars, outs):
                env[v] = info
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins):
        name = eqn.primitive.name
        self.used.update(info.origin[0] for info in ins if info.origin is not None)
        p = eqn.params
        in_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        if name == "dot_general":
            return [self.dot(ins, in_shapes, p["dimension_numbers"])]
        if name == "gather":
            if ins[0].origin is None and ins[1].origin is not None and out_shapes[0] == in_shapes[1][:-1]:
                # A lookup in a constant table indexed by a parameter's codes (an nf4 kernel's levels): the
                # result is that parameter, elementwise.
                return [_Info(ins[1].split, (ins[1].origin[0], ins[1].origin[1][:-1]))]
            return [self.gather(ins[0], p["dimension_numbers"])]
        if name in _SHAPE_ONLY:
            return [ins[0] for _ in eqn.outvars]
        if name == "transpose":
            perm = p["permutation"]
            return [_remap(ins[0], [perm.index(d) for d in range(len(perm))], len(perm))]
        if name == "broadcast_in_dim":
            dims = p["broadcast_dimensions"]
            dmap = [d if in_shapes[0][i] == out_shapes[0][d] else None for i, d in enumerate(dims)]
            return [_remap(ins[0], dmap, len(out_shapes[0]))]
        if name == "reshape":
            return [_remap(ins[0], _reshape_map(in_shapes[0], out_shapes[0], self.model_size), len(out_shapes[0]))]
        if name == "squeeze":
            gone = set(d % len(in_shapes[0]) for d in p["dimensions"])
            kept = [d for d in range(len(in_shapes[0])) if d not in gone]
            return [_remap(ins[0], [kept.index(d) if d in kept else None for d in range(len(in_shapes[0]))],
                           len(kept))]
        if name == "expand_dims":
            new = sorted(p["dimensions"])
            kept = [d for d in range(len(out_shapes[0])) if d not in new]
            return [_remap(ins[0], kept, len(out_shapes[0]))]
        if name in _REDUCTIONS:
            axes = set(p["axes"])
            dmap = []
            for d in range(len(in_shapes[0])):
                dmap.append(None if d in axes else d - sum(a < d for a in axes))
            info = _remap(ins[0], dmap, len(out_shapes[0]))
            return [_Info(info.split) for _ in eqn.outvars]
        if name in ("concatenate", "stack") and ins[0].origin is not None and all(
                i.origin == ins[0].origin for i in ins):
            # Pieces of one parameter side by side (a packed kernel's two nibbles stacked): still that parameter,
            # with no parameter dim along the joined (or new) one.
            pid, pdims = ins[0].origin
            dim = p["dimension"] if name == "concatenate" else p["axis"]
            split = ins[0].split
            if name == "stack":
                split = None if split is None else split + (split >= dim)
                return [_Info(split, (pid, pdims[:dim] + (None,) + pdims[dim:]))]
            return [_Info(split, (pid, pdims[:dim] + (None,) + pdims[dim + 1:]))]
        if name in _SLICING or name == "split":
            info = ins[0]
            if name == "concatenate":
                info = next((i for i in ins if i.split is not None), ins[0])
            return [_Info(info.split if len(s) == len(in_shapes[0]) else None,
                          info.origin if name in ("slice", "dynamic_slice") else None) for s in out_shapes]
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "while":
            body = p["body_jaxpr"].jaxpr
            nc = p["body_nconsts"]
            carry = ins[p["cond_nconsts"] + nc:]
            return self.walk(body, ins[p["cond_nconsts"]:p["cond_nconsts"] + nc] + carry)
        if name == "cond":
            return self.walk(p["branches"][0].jaxpr, ins[1:])
        if (name in ("jit", "pjit") and p.get("name") == GROUPED_MATMUL and len(in_shapes) == 3
                and len(in_shapes[1]) == 3 and ins[1].origin is not None):
            return [self.grouped(ins[0], ins[1])]
        inner = _inner_jaxpr(p)
        if inner is not None and len(inner.invars) == len(ins):
            return self.walk(inner, ins)
        return self.elementwise_or_opaque(ins, in_shapes, out_shapes)

    def elementwise_or_opaque(self, ins, in_shapes, out_shapes):
        """Elementwise ops keep a split and make split-matching parameters (biases) follow it. Any other op (e.g. a
        Pallas kernel) passes a split on to outputs shaped like the split input."""
        split_in = next(((info, s) for info, s in zip(ins, in_shapes) if info.split is not None), None)
        # Same shapes, scalars, or (lax's implicit broadcasting) size-1 dims: x [B, T, D] * scale [1, 1, D].
        fits = lambda s: s == () or (len(s) == len(out_shapes[0]) and all(  # noqa: E731
            a in (b, 1) for a, b in zip(s, out_shapes[0])))
        elementwise = len(out_shapes) == 1 and all(fits(s) for s in in_shapes)
        if elementwise:
            combined = self.combine(ins, in_shapes, out_shapes[0])
            if combined is not None:
                return [combined]
            split = split_in[0].split if split_in else None
            if split is not None:
                for info, s in zip(ins, in_shapes):
                    if info.origin is not None and s and s[split] == out_shapes[0][split]:
                        pid, pdims = info.origin
                        if self._divisible(pid, pdims[split]):
                            self._decide(pid, pdims[split], "follow")
            return [_Info(split)]
        if split_in is None:
            return [_REPLICATED for _ in out_shapes]
        return [_Info(split_in[0].split if s == split_in[1] else None) for s in out_shapes]

    def combine(self, ins, in_shapes, out_shape):
        """A parameter's value through an elementwise op with scalars only (an nf4 kernel's nibbles: `q & 15`,
        `q >> 4`), or several parameters combined elementwise at one shape (its levels times its block scales):
        the result is the largest of them, and the others are its companions (they later take the split it gets,
        dim for dim). None for anything else (x * norm scale: an activation, whose split the caller keeps)."""
        params = [(info, s) for info, s in zip(ins, in_shapes) if info.origin is not None]
        rest = [(info, s) for info, s in zip(ins, in_shapes) if info.origin is None]
        if not params or any(s != () or info.split is not None for info, s in rest):
            return None
        if any(len(s) != len(out_shape) for _, s in params):  # (size-1 dims broadcast, as `fits` allows)
            return None
        main = max(params, key=lambda p: math.prod(self.shapes[p[0].origin[0]]))[0]
        pid, pdims = main.origin
        for info, _ in params:
            other, odims = info.origin
            if other != pid:
                self.companions.setdefault(other, (pid, {m: o for m, o in zip(pdims, odims)
                                                         if m is not None and o is not None}))
        return _Info(main.split, main.origin)

    def follow_companions(self):
        """Companions take their parameter's decided split along the matching dim, where it divides."""
        for other, (pid, dims) in self.companions.items():
            if other not in self.decided and pid in self.decided:
                mine = dims.get(self.decided[pid])
                self._decide(other, mine if self._divisible(other, mine) else None, "follow")

    def scan(self, eqn, ins):
        p = eqn.params
        nc, ncarry = scan_counts(p)
        xs = []
        for var, info in zip(eqn.invars[nc + ncarry:], ins[nc + ncarry:]):  # the body sees xs without their
            if info.origin is not None and info.origin[1] and info.origin[1][0] is not None:  # leading dim
                pid = info.origin[0]
                self.scanned.setdefault(pid, self._layer_dim(pid, info.origin[1][0], var.aval.shape[0]))
            origin = (info.origin[0], info.origin[1][1:]) if info.origin is not None else None
            xs.append(_Info(info.split - 1 if info.split else None, origin))
        outs = self.walk(p["jaxpr"].jaxpr, ins[:nc + ncarry] + xs)
        carry, ys = outs[:ncarry], outs[ncarry:]
        return carry + [_Info(y.split + 1 if y.split is not None else None) for y in ys]

    def grouped(self, x, w):
        """`kernels.grouped_matmul`: x [M, K] times the weight w [G, K, N] of each row's group. w's group dim is an
        expert dim (`expert`); over `model` w is a matmul weight contracted over K, split like a `dot`'s."""
        pid, pdims = w.origin
        self.experts.setdefault(pid, pdims[0])
        if pid not in self.decided:
            if x.split == 1 and self._divisible(pid, pdims[1]):
                self._decide(pid, pdims[1], "row")
            elif self._divisible(pid, pdims[2]) or not self._divisible(pid, pdims[1]):
                self._decide(pid, pdims[2] if self._divisible(pid, pdims[2]) else None, "column")
            else:
                self._decide(pid, pdims[1], "row")
        return _Info(1 if self.decided[pid] is not None and self.decided[pid] == pdims[2] else None)

    def gather(self, operand, dnums):
        """A gather from a parameter is an embedding lookup: split its vocabulary (indexed) dim, else the hidden one."""
        if operand.origin is not None:
            pid, pdims = operand.origin
            indexed = [pdims[d] for d in dnums.start_index_map]
            vocab = indexed[0] if indexed else None
            if self._divisible(pid, vocab):
                self._decide(pid, vocab, "embedding")
            else:
                other = [d for d in range(len(self.shapes[pid])) if d != vocab and self._divisible(pid, d)]
                self._decide(pid, other[0] if other else None, "embedding")
        return _REPLICATED

    def dot(self, ins, shapes, dnums):
        (lc, rc), (lb, rb) = dnums
        lhs, rhs = ins
        l_free = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        r_free = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]

        def out_pos(side, dim):
            """Output position of operand dim `dim` of side 0 (lhs) or 1 (rhs); None if contracted."""
            batch, free = (lb, l_free) if side == 0 else (rb, r_free)
            if dim in batch:
                return batch.index(dim)
            if dim in free:
                return len(lb) + (free.index(dim) if side == 0 else len(l_free) + free.index(dim))
            return None

        weight_side = None
        if (lhs.origin is None) != (rhs.origin is None):
            weight_side = 0 if lhs.origin is not None else 1
        if weight_side is None:  # activation x activation (attention scores, attention x values)
            # A split batch dim (the heads) wins over a split free dim (a head_dim split by an indivisible GQA).
            splits = [(side, info.split) for side, info in ((0, lhs), (1, rhs)) if info.split is not None]
            splits.sort(key=lambda s: s[1] not in (lb if s[0] == 0 else rb))
            for side, dim in splits:
                if out_pos(side, dim) is not None:
                    return _Info(out_pos(side, dim))
            return _REPLICATED

        w, a = (lhs, rhs) if weight_side == 0 else (rhs, lhs)
        a_side = 1 - weight_side
        w_contract, a_contract = (lc, rc) if weight_side == 0 else (rc, lc)
        w_free = l_free if weight_side == 0 else r_free
        pid, pdims = w.origin
        if pid not in self.decided:
            if a.split is not None and a.split in a_contract:
                row = pdims[w_contract[list(a_contract).index(a.split)]]
                col = next((pdims[d] for d in w_free if self._divisible(pid, pdims[d])), None)
                if self._divisible(pid, row):
                    self._decide(pid, row, "row")
                else:
                    self._decide(pid, col, "column")
            else:
                col = next((pdims[d] for d in w_free if self._divisible(pid, pdims[d])), None)
                row = next((pdims[d] for d in w_contract if self._divisible(pid, pdims[d])), None)
                if col is not None:
                    self._decide(pid, col, "column")
                else:
                    self._decide(pid, row, "row")
        # The result's split follows from the (possibly earlier) decision for this weight.
        pdim = self.decided[pid]
        if pdim is not None and pdim in pdims:
            return _Info(out_pos(weight_side, pdims.index(pdim)))
        if a.split is not None:
            return _Info(out_pos(a_side, a.split))
        return _REPLICATED


def trace_decisions(params, trace_fn, model_size):
    """({path: (param dim or None, kind)}, {paths the program reads}, {path: dim a scan iterates over}, {path: its
    experts' dim}) from the traced program. It is traced outside any mesh, so a model sees its plain layer stack,
    not its pipeline."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    shapes = [leaf_shape(x) for _, x in flat]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(leaf_shape(x), x.dtype), params)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        closed = jax.make_jaxpr(trace_fn)(abstract)
    analysis = _Analysis(shapes, model_size)
    n_consts = len(closed.jaxpr.invars) - len(flat)
    # LoRA adapters enter as plain replicated values: their low-rank branch must not steer the layer's decisions
    # (`_follow_adapted_kernels` places them after their kernels).
    ins = [_REPLICATED] * n_consts + [_REPLICATED if is_adapter(path) else _Info(None, (i, tuple(range(len(s)))))
                                      for i, (path, s) in enumerate(zip(paths, shapes))]
    analysis.walk(closed.jaxpr, ins)
    analysis.follow_companions()
    for other, (pid, dims) in analysis.companions.items():  # a quantised expert stack's scales: its expert dim
        if pid in analysis.experts and dims.get(analysis.experts[pid]) is not None:
            analysis.experts.setdefault(other, dims[analysis.experts[pid]])
    decided = {paths[pid]: (pdim, analysis.kind[pid]) for pid, pdim in analysis.decided.items()}
    return (decided, {paths[pid] for pid in analysis.used}, {paths[pid]: d for pid, d in analysis.scanned.items()},
            {paths[pid]: d for pid, d in analysis.experts.items()})
