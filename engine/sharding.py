"""Automatic parameter sharding: RedCoast's two tensor-parallel rules, derived from the dataflow, plus ZeRO-3.

Rule 1 (attention): q/k/v projections are split over `model` along their output (heads) dimension and the output
projection along its input dimension. Rule 2 (every other linear layer): column and row splits alternate in the
order the layers run, so each row-split layer consumes a column-split layer's output (Megatron layout: one
all-reduce per pair).

With `trace_fn`, both rules fall out of one analysis of the traced program (`engine.dataflow`; `jax.make_jaxpr`, nothing
runs): every intermediate value carries "which of its dimensions is split over `model`", and every parameter carries
"which of its dimensions it came from". At a matmul with a parameter operand, an activation split along a contracted
dimension makes the weight row-split (and the result a partial sum, i.e. replicated after the all-reduce); otherwise the
weight is column-split along its first splittable output dimension and the result is split there. Reshapes carry the
split into the heads dimension, attention einsums keep it, and the output projection finds it contracted. Names play no
part, so `Dense_0 ... Dense_7` or a fused `qkv` kernel come out right, and so does GPT-2's `c_fc` / `c_proj`.

Without `trace_fn`, parameter names and the pytree's insertion order are used (Flax keeps creation order in its dicts;
`jax.tree_util` would sort the keys, so the walk here does not use it).

Pipeline parallelism: on a mesh with a `stage` axis, every parameter the traced program scans over (a stacked layer
weight [layers, ...], the xs of a `scan`) is split over `stage` along that dim, so each stage holds its contiguous
block of layers (`models.pipeline` runs them); this needs `trace_fn`.
"""
import math
import re

import jax
import numpy as np
from absl import logging
from jax.sharding import PartitionSpec as P

from engine.dataflow import is_adapter, key_str, leaf_shape, path_str, trace_decisions
from engine.dataflow import scan_counts  # noqa: F401  (engine.sharding.scan_counts: the steps' spelling)
from kernels.axes import CONTEXT, EXPERT, FSDP, MODEL, STAGE
from kernels.matmul.fp8 import OVERWRITE

# Parameters smaller than this (elements) stay replicated over `fsdp`: splitting norms and small biases saves
# nothing and costs a gather each.
FSDP_MIN_ELEMENTS = 1024


# ----------------------------------------------------------------------------------------------------------------
# Pytree helpers: paths in insertion order.

def _leaves_in_creation_order(tree, prefix=()):
    """[(path tuple, leaf)] walking Mappings in their own (insertion) order."""
    if hasattr(tree, "keys") and hasattr(tree, "__getitem__") and not hasattr(tree, "shape"):
        out = []
        for k in tree.keys():
            out += _leaves_in_creation_order(tree[k], prefix + (str(k),))
        return out
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if len(flat) == 1 and flat[0][0] == ():
        return [(prefix, flat[0][1])]
    return [(prefix + tuple(key_str(k) for k in p), leaf) for p, leaf in flat]


def _axis_sizes(mesh):
    return dict(zip(mesh.axis_names, mesh.devices.shape))


# ----------------------------------------------------------------------------------------------------------------
# Name-based fallback.

_LEAF_NAMES = {"kernel", "weight", "w", "bias", "b", "scale", "embedding"}
_NORM = re.compile(r"(norm|^ln|_ln|ln_)", re.I)
_QKV = re.compile(r"^(q|k|v|query|key|value|qkv|wq|wk|wv|wqkv|c_attn|query_key_value|in_proj|q_proj|k_proj|v_proj|"
                  r"qkv_proj|kv_proj|to_q|to_k|to_v)$", re.I)
_ATTN_OUT = re.compile(r"^(o|o_proj|out_proj|wo|out|c_proj|dense|proj|to_out|output)$", re.I)
_COLUMN = re.compile(r"^(gate_proj|up_proj|wi|wi_0|wi_1|fc1|fc_in|c_fc|w1|w3|dense_h_to_4h|gate|up|intermediate|"
                     r"lm_head|head)$", re.I)
_ROW = re.compile(r"^(down_proj|wo|fc2|fc_out|c_proj|w2|dense_4h_to_h|down|output|out_proj)$", re.I)
_EMBED = re.compile(r"(embed|wte|wpe|shared|tok_embeddings|word_embeddings|position_embeddings)", re.I)
_ATTN_SCOPE = re.compile(r"(attn|attention)", re.I)


def _layer_name(path):
    return path[-2] if len(path) > 1 and path[-1].lower() in _LEAF_NAMES else path[-1]


def _natural_key(text):
    """'Dense_10' after 'Dense_2': Flax's automatic names number layers in creation order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _name_decisions(leaves, model_size):
    """{path: (param dim or None, kind)} from names and creation order. Kernels are taken as [in, out...]."""
    kinds, generic = {}, {}
    for path, leaf in leaves:
        shape = leaf_shape(leaf)
        key, layer = "/".join(path), _layer_name(path)
        scope = "/".join(path[:-2] if len(path) > 1 and path[-1].lower() in _LEAF_NAMES else path[:-1])
        if _EMBED.search(layer) or path[-1] == "embedding":
            if len(shape) == 2:
                kinds[key] = "embedding"
            continue
        if len(shape) < 2 or path[-1] == "scale" or _NORM.search(layer):
            continue
        in_attn = bool(_ATTN_SCOPE.search(scope)) or bool(_ATTN_SCOPE.search(layer))
        if _QKV.match(layer) and (in_attn or len(layer) > 1):
            kinds[key] = "column"
        elif in_attn and _ATTN_OUT.match(layer):
            kinds[key] = "row"
        elif _COLUMN.match(layer):
            kinds[key] = "column"
        elif _ROW.match(layer):
            kinds[key] = "row"
        else:
            generic.setdefault(scope, []).append(key)
    # Generically named layers alternate column / row in creation order within their scope.
    for keys in generic.values():
        for i, key in enumerate(sorted(keys, key=_natural_key)):
            kinds[key] = "column" if i % 2 == 0 else "row"
    shapes = {"/".join(p): leaf_shape(l) for p, l in leaves}
    out = {}
    for key, kind in kinds.items():
        shape = shapes[key]
        if kind == "embedding":
            dims = [d for d in (0, 1) if shape[d] % model_size == 0]
            out[key] = (dims[0] if dims else None, kind)
            continue
        want, other = (1, 0) if kind == "column" else (0, 1)
        if shape[want] % model_size == 0:
            out[key] = (want, kind)
        elif shape[other] % model_size == 0:
            out[key] = (other, "row" if kind == "column" else "column")
        else:
            out[key] = (None, kind)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Public API.

def _follow_column_kernels(leaves, decisions, model_size):
    """1-D leaves nothing decided (biases) follow a column-split kernel of the same layer when their sizes match."""
    shapes = {"/".join(p): leaf_shape(l) for p, l in leaves}
    for path, _ in leaves:
        key, layer = "/".join(path), "/".join(path[:-1]) + "/"
        if key in decisions or len(shapes[key]) != 1 or shapes[key][0] % model_size:
            continue
        for other, (dim, kind) in list(decisions.items()):
            if (other.startswith(layer) and kind == "column" and dim is not None
                    and shapes[other][dim] == shapes[key][0]):
                decisions[key] = (0, "follow")
                break


def _follow_adapted_kernels(leaves, decisions):
    """LoRA adapters (`lora_a` [..., in, r], `lora_b` [..., r, out] beside a `kernel` [..., in, out], or a mixture's
    pair beside its expert stack: `_adapted_weight`) follow their kernel: a column-split kernel splits B's columns
    (A replicated: x A needs no collective), a row-split one A's rows (x A is then summed across `model`, only r
    wide). Traced alone, A's small r dim would be split and B's
    product all-reduced at full width."""
    keys = {"/".join(p) for p, _ in leaves}
    for path, leaf in leaves:
        key = "/".join(path)
        if path[-1] not in ("lora_a", "lora_b") or _adapted_weight(path) not in keys:
            continue
        dim = decisions.get(_adapted_weight(path), (None, None))[0]
        ndim = len(leaf_shape(leaf))
        follows = (dim == ndim - 1) if path[-1] == "lora_b" else (dim == ndim - 2)
        decisions[key] = (dim if follows else None, "follow")


def _adapted_weight(path):
    """The path of the weight a LoRA adapter (path tuple ending in lora_a / lora_b) belongs to: its `kernel`, or
    for a mixture's pair `experts/lora/<name>/` the expert stack `experts/<name>`."""
    if len(path) >= 4 and path[-4:-2] == ("experts", "lora"):
        return "/".join(path[:-3] + (path[-2],))
    return "/".join(path[:-1] + ("kernel",))


def _follow_expert_adapters(leaves, experts):
    """A mixture's LoRA pairs (`experts/lora/<name>/lora_a|b` [..., E, in, r] / [..., E, r, out]) take their expert
    stack's expert dim: traced as plain replicated values (`is_adapter`), they are not seen entering the grouped
    matmul themselves."""
    for path, _ in leaves:
        if is_adapter("/".join(path)) and _adapted_weight(path) in experts:
            experts["/".join(path)] = experts[_adapted_weight(path)]


def _follow_stacked_kernels(leaves, stacked):
    """LoRA adapters, which the trace leaves out, are stacked like the kernel beside them."""
    out = dict(stacked)
    for path, _ in leaves:
        kernel = "/".join(path[:-1] + ("kernel",))
        if is_adapter("/".join(path)) and kernel in stacked:
            out["/".join(path)] = stacked[kernel]
    return out


def _spec_tuple(spec, ndim):
    entries = list(spec) + [None] * (ndim - len(spec))
    return entries


def _axes_of(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _compact(entries):
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def add_axis(spec, shape, axis, axis_sizes, *, min_elements=FSDP_MIN_ELEMENTS, tile=None):
    """Adds mesh axis `axis` to `spec` on the largest dimension it does not split yet and that the axis size divides;
    failing that, on an already-split dimension that stays divisible (e.g. `('model', 'fsdp')`). Arrays under
    `min_elements` or indivisible keep `spec`. Used for ZeRO-3 (`fsdp`) on weights and ZeRO-1/2 (`data`) on optimizer
    state and gradients. `axis_sizes`: {axis name: size}. `tile`: (rows, columns) of the devices' memory tiles
    (`device_tile`); a dimension whose split leaves the shard's last two dims whole tiles is preferred, since
    XLA:TPU turns a reduce-scatter into partial tiles into an all-reduce of the whole array and a slice (LLaMA-7B's
    MLP kernels split into 2752 columns on 4 chips: every layer's fp32 gradient all-reduced whole)."""
    size = axis_sizes.get(axis, 1)
    entries = _spec_tuple(spec, len(shape))
    if size <= 1 or math.prod(shape) < min_elements or any(axis in _axes_of(e) for e in entries):
        return _compact(entries)
    free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % size == 0]
    if free:
        entries[max(free, key=lambda d: (_whole_tiles(shape, d, size, tile), shape[d], -d))] = axis
        return _compact(entries)
    for d, e in enumerate(entries):
        axes = _axes_of(e)
        if axes and shape[d] % (size * math.prod(axis_sizes[a] for a in axes)) == 0:
            entries[d] = axes + (axis,)
            break
    return _compact(entries)


def device_tile(mesh):
    """(rows, columns) of a memory tile of `mesh`'s devices where the layout should respect it (TPU: 8 x 128 32-bit
    words), else None."""
    return (8, 128) if mesh.devices.flat[0].platform == "tpu" else None


def _whole_tiles(shape, dim, size, tile):
    """Whether splitting `dim` of `shape` `size` ways leaves the last two dims multiples of `tile` (True without
    one)."""
    if tile is None:
        return True
    local = list(shape)
    local[dim] //= size
    return local[-1] % tile[1] == 0 and (len(local) < 2 or local[-2] % tile[0] == 0)


def _check_rule(path, shape, spec, rule, sizes):
    entries = list(spec)
    if len(entries) > len(shape):
        raise ValueError(f"sharding rule {rule!r} gives {spec} with {len(entries)} entries for parameter '{path}' "
                         f"of shape {shape}; expected at most {len(shape)}")
    named = ()
    for d, e in enumerate(entries):
        axes = _axes_of(e)
        for a in axes:
            if a not in sizes:
                raise ValueError(f"sharding rule {rule!r} names mesh axis {a!r} for parameter '{path}' of shape "
                                 f"{shape}; the mesh has axes {tuple(sizes)}")
            if a in named or axes.count(a) > 1:
                raise ValueError(f"sharding rule {rule!r} gives {spec}, which names mesh axis {a!r} twice, for "
                                 f"parameter '{path}' of shape {shape}; a mesh axis may split at most one dim, once")
        named += axes
        n = math.prod(sizes[a] for a in axes)
        if shape[d] % n:
            raise ValueError(f"sharding rule {rule!r} splits dim {d} (size {shape[d]}) of parameter '{path}' of shape "
                             f"{shape} over {axes} = {n} devices, which does not divide it")


def _check_rules(rules):
    if rules is None:
        return []
    compiled = []
    for item in rules:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], P)):
            raise ValueError(f"rules: entry {item!r}; expected a (regex string, PartitionSpec) pair")
        try:
            compiled.append((re.compile(item[0]), item[1], item[0]))
        except re.error as e:
            raise ValueError(f"rules: regex {item[0]!r} does not compile: {e}") from None
    return compiled


def auto_shard(params, mesh, *, trace_fn=None, rules=None):
    """A `PartitionSpec` for every parameter; the result has the structure of `params`.

    Args:
      params: any parameter pytree of arrays or `jax.ShapeDtypeStruct`s (nothing is read or moved).
      mesh: a `Mesh`, usually from `engine.make_mesh` (axes 'data', 'fsdp', 'model').
      trace_fn: optional `fn(params) -> anything` closed over example inputs (e.g. a loss on one batch). It is traced
        abstractly (`jax.make_jaxpr`, never run) to find which parameter feeds which matmul; without it, names and
        creation order decide.
      rules: optional `[(regex, PartitionSpec)]` matched with `re.search` against the '/'-joined parameter path;
        first match wins; unmatched parameters get the automatic rules.

    A dimension is split only if the axis size divides it (else the other rule is tried, else the parameter is
    replicated). With `stage > 1`, stacked layer weights are split over `stage` along their layer dim (see the module
    docstring). With `expert > 1`, the weights the traced program passes to `kernels.grouped_matmul` (a mixture of
    experts' stacked experts) are split over `expert` along their group dim. With `fsdp > 1`, parameters of at
    least `FSDP_MIN_ELEMENTS` elements also get their largest remaining divisible dimension split over `fsdp` (on a
    TPU, one that leaves the shards whole memory tiles first: `add_axis`); with `context > 1`, over `context` too
    (a context group computes on the same rows, so, like ZeRO-3, it holds one copy of the weights between its
    devices, gathered where used). FP8 amax histories (`kernels.matmul.fp8.OVERWRITE`) stay whole on every device.
    """
    sizes, tile = _axis_sizes(mesh), device_tile(mesh)
    compiled_rules = _check_rules(rules)
    leaves = _leaves_in_creation_order(params)
    model_size, stage_size, expert_size = sizes.get(MODEL, 1), sizes.get(STAGE, 1), sizes.get(EXPERT, 1)
    decisions, stacked, experts = {}, {}, {}
    for axis, size, what in ((STAGE, stage_size, "are stacked layers"), (EXPERT, expert_size, "are experts")):
        if size > 1 and trace_fn is None:
            raise ValueError(f"auto_shard: a mesh with {axis}={size} needs trace_fn (the traced program shows which "
                             f"parameters {what}); got trace_fn=None")
    if trace_fn is not None and (model_size > 1 or stage_size > 1 or expert_size > 1):
        traced, used, stacked, experts = trace_decisions(params, trace_fn, model_size)
        stacked = _follow_stacked_kernels(leaves, stacked)
        _follow_expert_adapters(leaves, experts)
    if model_size > 1:
        names = _name_decisions(leaves, model_size)
        if trace_fn is None:
            decisions = names
        else:  # names only decide parameters the program never reads
            decisions = {**{k: v for k, v in names.items() if k not in used}, **traced}
        _follow_column_kernels(leaves, decisions, model_size)
        _follow_adapted_kernels(leaves, decisions)

    specs = {}
    for path, leaf in leaves:
        key = "/".join(path)
        shape = leaf_shape(leaf)
        if path[-1] == OVERWRITE:  # an FP8 amax history: a few floats, the same on every device (engine/step/update.py)
            specs[key] = P()
            continue
        rule = next(((spec, src) for rx, spec, src in compiled_rules if rx.search(key)), None)
        if rule is not None:
            _check_rule(key, shape, rule[0], rule[1], sizes)
            specs[key] = rule[0]
            continue
        entries = [None] * len(shape)
        dim = decisions.get(key, (None, None))[0]
        if dim is not None:
            entries[dim] = MODEL
        layer_dim = stacked.get(key)
        if (stage_size > 1 and layer_dim is not None and entries[layer_dim] is None
                and not shape[layer_dim] % stage_size):
            entries[layer_dim] = STAGE
        expert_dim = experts.get(key)
        if expert_size > 1 and expert_dim is not None and entries[expert_dim] is None and not (
                shape[expert_dim] % expert_size):
            entries[expert_dim] = EXPERT
        specs[key] = add_axis(add_axis(P(*entries), shape, FSDP, sizes, tile=tile), shape, CONTEXT, sizes, tile=tile)
    return jax.tree_util.tree_map_with_path(lambda p, _: specs[path_str(p)], params)


def auto_layout(mesh, *, rules=None):
    """`auto_shard` as a layout for the models' loaders (`models.init_params`, `load_pretrained`, `add_lora`, ...):
    `layout(abstract_params, apply_fn) -> NamedShardings` on `mesh`, the dataflow read from `apply_fn`. With it a
    checkpoint's tensors go straight onto their shards as they are read."""
    def layout(abstract, apply_fn):
        specs = auto_shard(abstract, mesh, trace_fn=apply_fn, rules=rules)
        return jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
    return layout


def describe_sharding(params, specs, mesh):
    """A table of path, shape, dtype, spec and bytes per device, with totals against full replication."""
    sizes = _axis_sizes(mesh)
    flat_specs = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))[0]}
    rows, total, per_device = [], 0, 0
    for path, leaf in _leaves_in_creation_order(params):
        key = "/".join(path)
        shape = leaf_shape(leaf)
        nbytes = math.prod(shape) * np.dtype(leaf.dtype).itemsize
        spec = flat_specs[key]
        split = math.prod(sizes[a] for e in spec for a in _axes_of(e))
        rows.append((key, "x".join(map(str, shape)) or "scalar", str(np.dtype(leaf.dtype)), str(spec),
                     nbytes // split))
        total += nbytes
        per_device += nbytes // split
    header = ("parameter", "shape", "dtype", "spec", "bytes/device")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
    fmt = "  ".join(f"{{:{'>' if i == 4 else '<'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header)] + [fmt.format(*r) for r in rows]
    ratio = total / per_device if per_device else 1.0
    lines.append(f"total: {total:,} bytes replicated; {per_device:,} bytes per device ({ratio:.2f}x smaller) on mesh "
                 + " x ".join(f"{a}={n}" for a, n in sizes.items()))
    return "\n".join(lines)


def log_sharding(params, specs, mesh):
    """Logs the layout: its one-line total on the console, the per-parameter table in the log file only."""
    table = describe_sharding(params, specs, mesh)
    logging.info("parameter sharding:\n%s", table, extra={"console": False})
    logging.info("parameter sharding: %s", table.splitlines()[-1].removeprefix("total: "))
