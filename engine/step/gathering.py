"""The shard_map step's evaluation of the traced loss with `Sharded` parameters (`eval_gathering`): each shard is
gathered right at its use; a scanned layer stack gathers one layer per iteration (`engine.step.layer_scan`
pipelines a remat'd one by hand); a row-split embedding table and a vocabulary-split output head with
`kernels.linear_cross_entropy` run vocab-parallel without gathering the weight; a custom_vjp whose author registered
a rule for shards (`kernels.shard_rules`: 1F1B's pipeline) runs on them through it.
"""
import jax
import jax.numpy as jnp

import kernels
from engine.sharding import scan_counts
from engine.step import layer_scan
from engine.step.collectives import is_zero3_gather
from engine.step.shard_views import sliced_in_loop, varying_vars, view
from engine.step.shards import CASTS, Sharded, bind_eqn, full, local_cast


def _open(values, fn):
    """Calls `fn(values)` inside a `jax.checkpoint` whose inputs are the shards, not the gathered weights: the
    backward pass gathers again instead of keeping a full weight alive from its forward use to its backward use."""
    slots = [x if isinstance(x, Sharded) else None for x in values]
    arrays = [x.local if isinstance(x, Sharded) else x for x in values]

    def inner(*arrays):
        return fn([s.rebuild(a) if s is not None else a for s, a in zip(slots, arrays)])

    return inner, arrays


def eval_gathering(jaxpr, consts, args, in_remat=False, varying=None):
    """Evaluates `jaxpr` where some arguments are `Sharded`: each is gathered right at its use. Through `scan`
    (stacked layer weights as `xs`, or as constants the body slices), `checkpoint` (remat), `jit`, element-wise
    casts and views (`shard_views.view`) the shards travel unopened, so a scanned layer stack gathers one layer's
    weights per iteration. Outside a remat region every equation that opens a shard runs in its own
    `jax.checkpoint`, so no gathered weight is saved for the backward pass. varying: the variables that may differ
    between devices (`shard_views.varying_vars`; None: all but the `Sharded` arguments' dependents may)."""
    from jax.extend import core as jex_core
    if varying is None:
        varying = varying_vars(jaxpr, [not isinstance(x, Sharded) for x in args])
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if not any(isinstance(x, Sharded) for x in invals):
            outs = bind_eqn(eqn, invals)
        elif name in CASTS and len(invals) == 1:
            outs = [invals[0].cast(eqn)]
        elif (moved := view(eqn, invals, varying)) is not None:
            outs = [moved]
        elif name == "gather" and _is_row_lookup(eqn, invals):
            outs = [_vocab_parallel_lookup(eqn, *invals)]
        elif (loss := _vocab_split_loss(eqn, invals)) is not None:
            x, w, labels = invals
            outs = [loss.run(x, local_cast(w), labels, w.dims[0][1])]
        elif name == "scan":
            if layer_scan.is_remat_layer_stack(eqn, invals):
                outs = layer_scan.pipelined_scan(eqn, invals, in_remat)
            else:
                outs = _scan_gathering(eqn, invals, in_remat, varying)
        elif name in ("checkpoint", "remat", "remat2"):
            p = eqn.params
            inner, arrays = _open(invals, lambda vals: eval_gathering(p["jaxpr"], (), vals, True, varying))
            outs = jax.checkpoint(inner, prevent_cse=p["prevent_cse"], policy=_regathered(p["policy"]))(*arrays)
        elif name in ("jit", "pjit", "closed_call"):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            outs = eval_gathering(inner.jaxpr, inner.consts, invals, in_remat, varying)
        elif (rule := kernels.shard_rule(eqn)) is not None and (ruled := rule(invals)) is not None:
            outs = ruled  # a custom_vjp that runs on shards itself (kernels.shard_rules: a 1F1B pipeline's)
        elif in_remat:
            outs = bind_eqn(eqn, [full(x) for x in invals])
        else:
            inner, arrays = _open(invals, lambda vals, eqn=eqn: bind_eqn(eqn, [full(x) for x in vals]))
            outs = jax.checkpoint(inner)(*arrays)
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [full(read(v)) for v in jaxpr.outvars]


def _regathered(policy):
    """A remat region's `policy` (None: save nothing) that never saves a shard's gather (`collectives.zero3_gather`):
    a policy that keeps what is costly to recompute (a scanned stack's without remat, `models.layers.stack`) would
    otherwise keep every gathered weight from the forward pass to the backward, where it is gathered again."""
    if policy is None:
        return None

    def regathered(prim, *avals, **params):
        return False if prim.name == "custom_vjp_call" and is_zero3_gather(params) else policy(prim, *avals, **params)

    return regathered


def _is_row_lookup(eqn, invals):
    """`table[ids]` (an embedding lookup: whole rows of a 2-D table) on a table split by rows and only by rows, where
    the group's lookups are fewer than the table's rows (then the looked-up vectors are smaller than the table: at
    2048 tokens per device and a 32k vocabulary, up to 15 devices; beyond that gathering the table moves less)."""
    table, ids = invals
    dn, out_rank = eqn.params["dimension_numbers"], len(eqn.outvars[0].aval.shape)
    return (isinstance(table, Sharded) and not isinstance(ids, Sharded) and len(table.dims) == 1
            and table.dims[0][0] == 0 and table.local.ndim == 2 and ids.ndim >= 2 and ids.shape[-1] == 1
            and ids.size <= table.local.shape[0]  # group x lookups per device <= group x rows per device
            and dn.collapsed_slice_dims == (0,) and dn.start_index_map == (0,) and not dn.operand_batching_dims
            and dn.offset_dims == (out_rank - 1,) and eqn.params["slice_sizes"] == (1, table.local.shape[1]))


def _vocab_split_loss(eqn, invals):
    """The `kernels.matmul.VocabParallelLoss` of a `kernels.linear_cross_entropy` call (see
    `kernels.matmul.vocab_parallel_loss`) whose weight [D, V] is split by vocabulary columns only, with at most as
    many rows per device as vocabulary columns per device (the same trade as `_is_row_lookup`); else None."""
    loss = kernels.matmul.vocab_parallel_loss(eqn)
    if loss is None:
        return None
    x, w, labels = invals
    split = (isinstance(w, Sharded) and not isinstance(x, Sharded) and not isinstance(labels, Sharded)
             and len(w.dims) == 1 and w.dims[0][0] == 1 and w.local.ndim == 2
             and x.size // x.shape[-1] <= w.local.shape[1])
    return loss if split else None


def _vocab_parallel_lookup(eqn, table, ids):
    """An embedding lookup on a row-split table without gathering the table (Megatron's vocab-parallel embedding,
    over the data-parallel axes): the group's ids are all-gathered (a few KB), each device looks up the rows it holds
    (zeros for the others) and one reduce-scatter of the looked-up vectors returns each device its own rows. The
    backward pass all-gathers the vectors' cotangent and scatter-adds it into the local shard. The vectors are summed
    in `reduce_dtype` (the XLA CPU compiler aborts on bf16 reductions). Ids outside the table give zeros (a plain
    lookup gives NaN)."""
    # For LLaMA-7B on 8 devices: 268 MB of fp32 vectors instead of a 262 MB table gather and a 524 MB fp32 gradient.
    axes = table.dims[0][1]
    rows = table.local.shape[0]
    group_ids = jax.lax.all_gather(ids, axes, axis=0, tiled=True)
    local_ids = group_ids - jax.lax.axis_index(axes) * rows
    held = (local_ids >= 0) & (local_ids < rows)
    params = dict(eqn.params, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS, fill_value=None)
    found = jax.lax.gather(table.local, jnp.clip(local_ids, 0, rows - 1), **params)
    found = jnp.where(held, found, 0).astype(table.reduce_dtype)  # held [..., 1] broadcasts over the row
    return table.apply_casts(jax.lax.psum_scatter(found, axes, scatter_dimension=0, tiled=True).astype(table.dtype))


def _scan_gathering(eqn, invals, in_remat, varying):
    p = eqn.params
    n_consts, n_carry = scan_counts(p)
    body = p["jaxpr"]
    # A weight the body only slices (a pipeline's stage of layers, one layer per tick) stays split: each iteration
    # gathers its slice, and its gradient's slice is reduce-scattered there.
    consts = [x if isinstance(x, Sharded) and sliced_in_loop(body.jaxpr, body.jaxpr.invars[i], varying) else full(x)
              for i, x in enumerate(invals[:n_consts])]
    init = [full(x) for x in invals[n_consts:n_consts + n_carry]]
    xs, slots = [], []
    for x in invals[n_consts + n_carry:]:
        # A weight stacked along the scanned axis slices locally when that axis is not itself split.
        if isinstance(x, Sharded) and all(dim > 0 for dim, _ in x.dims):
            xs.append(x.local)
            slots.append(x.layer())
        else:
            xs.append(full(x))
            slots.append(None)

    def step(carry, x):
        x = [s.rebuild(a) if s is not None else a for s, a in zip(slots, x)]
        outs = eval_gathering(body.jaxpr, body.consts, consts + list(carry) + x, in_remat, varying)
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return list(carry) + list(ys)
