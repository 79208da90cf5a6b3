"""Views of a `Sharded` parameter: the loss's structural equations (reshape, transpose, squeeze, a sharding
constraint, a checkpoint name, an index or slice) that leave its split dims whole run on the local shard and keep it
`Sharded`, so that it is gathered only where it is computed with, and a loop that slices a stacked weight gathers
one slice per iteration (`view`, `sliced_in_loop`). A pipeline's tick loop reads its stage's layers so: each tick
gathers the layer it runs (ZeRO-3 inside a stage) instead of the whole stage before the loop."""
import math

import jax
from jax.sharding import PartitionSpec as P

import kernels
from kernels.axes import entry_axes
from engine.sharding import scan_counts
from engine.step.shards import CASTS, Sharded, bind_eqn

_VIEWS = ("reshape", "transpose", "squeeze", "sharding_constraint", "name")
_SLICES = ("gather", "dynamic_slice")


def view(eqn, invals, varying):
    """The equation's output as a `Sharded` when its first input is one and the equation moves or slices other
    dims only (each split dim kept whole), else None. A slice must be smaller than the shard's whole and its
    indices the same on every device (none in `varying`, see `varying_vars`): each device's slice of its shard is
    then a shard of the same slice."""
    x, rest = invals[0], invals[1:]
    name = eqn.primitive.name
    if (not isinstance(x, Sharded) or x.local is None or any(isinstance(r, Sharded) for r in rest)
            or name not in _VIEWS + _SLICES):
        return None
    if name in _SLICES and (_is_varying(eqn.invars[1:], varying) or
                            math.prod(eqn.outvars[0].aval.shape) >= math.prod(eqn.invars[0].aval.shape)):
        return None
    in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    moved, batched = _dim_map(eqn, in_shape, out_shape)
    if moved is None or any(moved.get(d) is None or d in batched for d, _ in x.dims):
        return None
    local_in = x.local.shape
    factors = {d: in_shape[d] // local_in[d] for d, _ in x.dims}
    if len(local_in) != len(in_shape) or any(n != local_in[d] * factors.get(d, 1) for d, n in enumerate(in_shape)):
        return None
    params = dict(eqn.params)
    if name == "reshape":
        sizes = list(out_shape)
        for d, f in factors.items():
            sizes[moved[d]] //= f
        params["new_sizes"] = tuple(sizes)
    elif name in _SLICES:
        params["slice_sizes"] = tuple(local_in[d] if d in factors else n for d, n in enumerate(params["slice_sizes"]))
    carried = _carried(x.auto, in_shape, out_shape, moved) if name == "reshape" else moved
    auto = _moved_spec(x.auto, carried, len(out_shape))
    if auto is False:  # a dim split over an automatic axis that the output does not keep
        return None
    local, = bind_eqn(eqn.replace(params=params), [x.local, *rest])
    if name == "sharding_constraint":
        auto = _constrained(auto, eqn.params["sharding"].spec, len(out_shape))
    return Sharded(local, tuple((int(moved[d]), axes) for d, axes in x.dims), x.dtype, x.reduce_dtype, x.casts, x.int8,
                   auto=auto, grad_dtype=x.grad_dtype)


def sliced_in_loop(jaxpr, var, varying):
    """Whether every use of `var` inside the loop body `jaxpr` (through views, nested loops' constants, remat and
    jit regions) ends in an index or slice of it at indices the same on every device (none in `varying`), or in a
    nested loop's scanned inputs: a stacked weight the loop reads a part of per iteration, which is then gathered a
    part at a time (`view`) rather than whole before it."""
    from jax.extend import core as jex_core
    if any(v is var for v in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        positions = [i for i, v in enumerate(eqn.invars) if not isinstance(v, jex_core.Literal) and v is var]
        if not positions:
            continue
        name = eqn.primitive.name
        if name in _VIEWS or name in CASTS:
            if positions != [0] or not sliced_in_loop(jaxpr, eqn.outvars[0], varying):
                return False
        elif name in _SLICES:
            if (positions != [0] or _is_varying(eqn.invars[1:], varying)
                    or math.prod(eqn.outvars[0].aval.shape) >= math.prod(eqn.invars[0].aval.shape)):
                return False
        elif name == "scan":
            body, (n_consts, n_carry) = eqn.params["jaxpr"].jaxpr, scan_counts(eqn.params)
            for i in positions:
                if n_consts <= i < n_consts + n_carry or (i < n_consts and
                                                          not sliced_in_loop(body, body.invars[i], varying)):
                    return False
        elif name in ("checkpoint", "remat", "remat2", "jit", "pjit", "closed_call"):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            if not all(sliced_in_loop(inner, inner.invars[i], varying) for i in positions):
                return False
        else:
            return False
    return True


def _dim_map(eqn, in_shape, out_shape):
    """({input dim: output dim} (None where the equation merges, splits, indexes or slices that dim), the input
    dims a gather batches over, whose output dims hold one index's slice each), or (None, ()) for an equation it
    cannot read."""
    name, p = eqn.primitive.name, eqn.params
    if name in ("sharding_constraint", "name"):
        return {d: d for d in range(len(in_shape))}, ()
    if name == "transpose":
        return {d: p["permutation"].index(d) for d in range(len(in_shape))}, ()
    if name == "squeeze":
        kept = [d for d in range(len(in_shape)) if d not in p["dimensions"]]
        return {d: i for i, d in enumerate(kept)}, ()
    if name == "reshape":
        if p.get("dimensions") is not None:
            return None, ()
        return {d: _reshaped(in_shape, out_shape, d) for d in range(len(in_shape))}, ()
    if name == "dynamic_slice":
        return {d: d if p["slice_sizes"][d] == n else None for d, n in enumerate(in_shape)}, ()
    dn = p["dimension_numbers"]  # gather: its offset dims in operand order, its batch dims in the indices' order
    skipped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
    offsets = iter(dn.offset_dims)
    moved = {d: next(offsets) for d in range(len(in_shape)) if d not in skipped}
    moved = {d: (o if p["slice_sizes"][d] == in_shape[d] else None) for d, o in moved.items()}
    batch_positions = [o for o in range(len(out_shape)) if o not in dn.offset_dims]
    for d, i in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        moved[d] = batch_positions[i]
    return moved, tuple(dn.operand_batching_dims)


def _reshaped(in_shape, out_shape, d):
    """The output dim of a row-major reshape that holds input dim d unchanged (the same size after the same
    number of elements), else None."""
    before = math.prod(in_shape[:d])
    for e, n in enumerate(out_shape):
        if math.prod(out_shape[:e]) == before and n == in_shape[d]:
            return e
    return None


def _carried(spec, in_shape, out_shape, moved):
    """Where a reshape carries each input dim's automatic split: the dim that holds it unchanged, else the output
    dim that starts at the same element and is its leading part (a merge: [H, D] -> [H D] with H split) or that
    leads it and divides over its mesh axes (a split: [L] -> [S, K] with L over S stages)."""
    if spec is None:
        return moved
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    carried = dict(moved)
    for d, entry in enumerate(spec):
        if entry is None or moved.get(d) is not None:
            continue
        split = math.prod(sizes[a] for a in entry_axes(entry))
        before = math.prod(in_shape[:d])
        for e, n in enumerate(out_shape):
            if math.prod(out_shape[:e]) == before and n > 1:
                if n % in_shape[d] == 0 or (in_shape[d] % n == 0 and n % split == 0):
                    carried[d] = e
                break
    return carried


def _moved_spec(spec, moved, rank):
    """A PartitionSpec of the input carried to the output dims `moved` names, None where nothing is split, or
    False where the output keeps no dim for one of the input's dims split over `model` (whose gathers run block by
    block: `collectives.in_model_blocks`). Other automatic splits it cannot carry are left to the partitioner (an
    interleaved pipeline's [L] -> [V, S, K] has `stage` over V and S together, which its constraint then places)."""
    if spec is None:
        return None
    out = [None] * rank
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        if moved.get(d) is None:
            if kernels.MODEL_AXIS in entry_axes(entry):
                return False
            continue
        out[moved[d]] = entry
    return P(*out) if any(e is not None for e in out) else None


def _constrained(spec, constraint, rank):
    """`spec` with a sharding constraint's named entries over it (its unconstrained dims keep spec's)."""
    entries = list(tuple(spec) if spec is not None else ()) + [None] * rank
    named = {a for e in constraint if e is not P.UNCONSTRAINED for a in entry_axes(e)}
    out = []
    for d in range(rank):
        c = constraint[d] if d < len(constraint) else P.UNCONSTRAINED
        if c is P.UNCONSTRAINED:
            axes = tuple(a for a in entry_axes(entries[d]) if a not in named)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        else:
            out.append(c)
    return P(*out) if any(e is not None for e in out) else None


# Equations whose outputs differ between the devices of the manual axes even where their inputs do not.
_DEVICE_DEPENDENT = ("axis_index", "psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
                     "reduce_scatter", "pbroadcast", "ragged_all_to_all", "psum_invariant")
_REGIONS = ("checkpoint", "remat", "remat2", "jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call")


def varying_vars(jaxpr, varying_in):
    """The variables of `jaxpr` (and of the loop bodies and regions inside it) that may hold different values on
    the devices of the step's manual axes, given which of its inputs may (`varying_in`): what depends on the batch,
    the step's per-device key or a collective. Conservative: a region it does not read makes its outputs vary."""
    varying = {v for v, f in zip(jaxpr.invars, varying_in) if f}
    _propagate(jaxpr, varying)
    return varying


def _is_varying(atoms, varying):
    from jax.extend import core as jex_core
    return any(not isinstance(v, jex_core.Literal) and v in varying for v in atoms)


def _propagate(jaxpr, varying):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        flags = [_is_varying([v], varying) for v in eqn.invars]
        if name == "scan":
            body = eqn.params["jaxpr"].jaxpr
            n_consts, n_carry = scan_counts(eqn.params)
            varying.update(v for v, f in zip(body.invars, flags) if f)
            while True:  # a carry varies once its update does
                _propagate(body, varying)
                grown = [body.invars[n_consts + i] for i in range(n_carry)
                         if _is_varying([body.outvars[i]], varying) and body.invars[n_consts + i] not in varying]
                if not grown:
                    break
                varying.update(grown)
            outs = [_is_varying([v], varying) for v in body.outvars]
        elif name in _REGIONS and (inner := eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))) is not None:
            inner = getattr(inner, "jaxpr", inner)
            varying.update(v for v, f in zip(inner.invars, flags) if f)
            _propagate(inner, varying)
            outs = [_is_varying([v], varying) for v in inner.outvars]
        elif name in _DEVICE_DEPENDENT or any(_has_jaxpr(p) for p in eqn.params.values()):
            outs = [True] * len(eqn.outvars)
        else:
            outs = [any(flags)] * len(eqn.outvars)
        varying.update(v for v, f in zip(eqn.outvars, outs) if f)


def _has_jaxpr(param):
    from jax.extend import core as jex_core
    items = param if isinstance(param, (tuple, list)) else (param,)
    return any(isinstance(p, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) for p in items)
