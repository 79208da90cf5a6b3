"""DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"): data
parallelism that communicates across the mesh's `data` axis once every `inner_steps` steps instead of every step.

Each position along `data` (a host, a pod, a weakly connected site) keeps its own replica of the parameters and its
own inner optimizer state: a leading [replicas] dimension split over `data`, while `fsdp` and `model` still split each
replica as usual. Every step, every replica takes an inner optimizer step on its own rows of the global batch, with no
collective over `data` (per-replica metrics too are averaged on the host). Every `inner_steps` steps the outer step
averages what the replicas travelled, the outer gradient `global - mean(replicas)` (one all-reduce of the
parameters over `data`), applies the outer optimizer to the global parameters and resets every replica to them. The
paper's outer optimizer, SGD with Nesterov momentum 0.9 and learning rate 0.7, is the default. With `inner_steps=1`,
an SGD inner optimizer and `optax.sgd(1.0)` outside it is plain data parallelism (tests/test_diloco.py).

`Trainer(diloco=DiLoCo(...))` uses it: `trainer.params` is the global model (updated every `inner_steps` steps), and
the replicas and both optimizer states make up `trainer.opt_state` and the checkpoints.

Streaming DiLoCo (Douillard et al., 2025, "Streaming DiLoCo with overlapping communication"), two of its three
changes: `fragments=P` cuts the parameters into P parts that take their outer steps in turn, part p whenever
`(step + 1) % inner_steps` is its offset `(p + 1) * inner_steps // P % inner_steps`, so one outer step sends 1/P of
the model (the peak bandwidth a link must carry, and the outer step's temporaries, shrink P-fold; the total stays).
Each leaf is cut strided along its first dimension that the part of every device can be cut locally along (the
stacked layer dim of a scanned model: part p gets layers p, p + P, ..., the paper's strided fragments); a leaf with
no such dimension goes whole to the lightest part. Each part has its own outer optimizer state. `outer_dtype`
is the wire format of the outer gradient: 'float32' (the compiler's all-reduce), or 'bfloat16', 'int8' or 'int4'
(absmax-scaled per block of 256 values, two 4-bit values per byte: the paper's 4-bit exchange), sent as an
all-to-all of each replica's quantized delta (every device then sums its 1/R chunk in fp32) and an all-gather of
the quantized mean (ZeRO++'s quantized reduce-scatter pattern), 2x / 3.9x / 7.8x fewer bytes than fp32. The third,
`overlap=True`, with a delay of one step: no compiler overlaps a collective inside a conditional with work outside
it, so the Trainer compiles two programs and picks one per step on the host (`DiLoCo.syncs_at`): the inner step
alone, or the inner step plus the outer step of the part that fell due the step before, exchanged from the step's
input replicas (nothing of the inner step feeds it); the part's replicas then take the new global part plus the
inner update they made meanwhile. A part falling due at the last step of a `fit` takes its outer step in the next
one's first step (a resume does the same: the program follows from the step number).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import kernels
from kernels import axes
from engine.step import (accumulate_gradients, apply_update, combine, current_loss_scale, init_opt_state, partition,
                         select_guard, trained_grad_fn, weight_metric_of)


def _paper_outer_optimizer():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """inner_steps: steps between two outer steps (the paper: 500). outer_optimizer: applied to the outer gradient
    `global - mean(replicas)` every inner_steps steps."""

    inner_steps: int = 500
    outer_optimizer: optax.GradientTransformation = dataclasses.field(default_factory=_paper_outer_optimizer)
    fragments: int = 1
    outer_dtype: str = "float32"
    overlap: bool = False

    def __post_init__(self):
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"DiLoCo.inner_steps={self.inner_steps!r}; expected an integer >= 1")
        if not (hasattr(self.outer_optimizer, "init") and hasattr(self.outer_optimizer, "update")):
            raise ValueError(f"DiLoCo.outer_optimizer={self.outer_optimizer!r}; expected an "
                             "optax.GradientTransformation")
        if (isinstance(self.fragments, bool) or not isinstance(self.fragments, int)
                or not 1 <= self.fragments <= self.inner_steps):
            raise ValueError(f"DiLoCo.fragments={self.fragments!r}; expected an integer from 1 to inner_steps="
                             f"{self.inner_steps} (each part takes its outer step at its own inner step)")
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(f"DiLoCo.outer_dtype={self.outer_dtype!r}; expected one of {OUTER_DTYPES}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"DiLoCo.overlap={self.overlap!r}; expected a bool")

    def offsets(self):
        """The value of `(step + 1) % inner_steps` at which each part takes its outer step."""
        return [(p + 1) * self.inner_steps // self.fragments % self.inner_steps for p in range(self.fragments)]

    def due_part(self, step):
        """The part whose outer step falls due at (0-based) `step`, or None."""
        return next((p for p, o in enumerate(self.offsets()) if (step + 1) % self.inner_steps == o), None)

    def syncs_at(self, step):
        """With overlap: whether `step` runs the exchange (that of the part due the step before)."""
        return self.overlap and step > 0 and self.due_part(step - 1) is not None


OUTER_DTYPES = ("float32", "bfloat16", "int8", "int4")
_BLOCK = 256  # values per fp32 scale of the int8 / int4 wire formats (1.6% more bytes)


@dataclasses.dataclass(frozen=True)
class _Cut:
    """Where a leaf's share of each part lies: with `dim`, part p is the strided view
    `x.reshape(..., n / P, P, ...)[..., p, ...]` of that dim; else the whole leaf belongs to part `owner`."""
    dim: int = None
    owner: int = 0


def fragment_plan(diloco, shapes, specs, axis_sizes):
    """A `_Cut` for every leaf of `shapes` (a tree of shape tuples; None leaves stay None) laid out by `specs`
    (PartitionSpecs) on a mesh of `axis_sizes`: the first dim whose size the part count times the devices splitting
    it divides (so the view is local to each device), or, failing that, the whole leaf to the part with the fewest
    values so far, largest leaves first."""
    n = diloco.fragments
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    spec_leaves = treedef.flatten_up_to(specs)
    cuts, load = [None] * len(leaves), [0] * n
    for i, (shape, spec) in enumerate(zip(leaves, spec_leaves)):
        for dim, size in enumerate(shape):
            entry = spec[dim] if dim < len(spec) else None
            names = axes.entry_axes(entry)
            if size % (n * math.prod(axis_sizes[a] for a in names)) == 0:
                cuts[i] = _Cut(dim=dim)
                break
    for i in sorted((i for i, c in enumerate(cuts) if c is None), key=lambda i: -math.prod(leaves[i])):
        owner = min(range(n), key=lambda p: load[p])
        cuts[i], load[owner] = _Cut(owner=owner), load[owner] + math.prod(leaves[i])
    return treedef.unflatten(cuts)


def _split(x, dim, parts):
    return x.reshape(x.shape[:dim] + (x.shape[dim] // parts, parts) + x.shape[dim + 1:])


def fragment(tree, plan, part, parts, lead=0):
    """Part `part` of `tree` (leaves with `lead` extra leading dims, e.g. the replicas' 1): the strided views, the
    whole leaves it owns, None elsewhere."""
    return _zip(plan, _owned(part), _take(tree, plan, part, parts, lead), tree)


def _owned(part):
    """`_zip`'s merge of part `part`'s cut values (`_take`'s) with the whole leaves it owns."""
    return lambda cut, value, whole: value if cut.dim is not None else whole if cut.owner == part else None


def _whole(cut, x):
    """For `_zip`: a tree's whole leaves, None at the cut ones."""
    return x if cut.dim is None else None


def _cut(cut, x):
    """For `_zip`: a tree's cut leaves, None at the whole ones."""
    return None if cut.dim is None else x


def _merge(cut, cut_value, whole_value):
    """For `_zip`: the cut leaves of one tree with the whole leaves of another."""
    return cut_value if cut.dim is not None else whole_value


def _whole_after(part):
    """For `_zip`: the whole leaves after part `part`'s outer step: `new` where the part owns them, else `old`."""
    return lambda cut, new, old: None if cut.dim is not None else new if cut.owner == part else old


def fragment_specs(plan, specs, part):
    """The PartitionSpecs of `fragment(params, plan, part, ...)`: a cut leaf keeps its spec (the cut is local)."""
    return jax.tree.map(lambda cut, s: s if cut.dim is not None or cut.owner == part else None, plan, specs,
                        is_leaf=lambda x: isinstance(x, P))


def _zip(plan, fn, *trees):
    """`fn(cut, *leaves)` at every leaf of `plan`, the trees' entries there (None included) as the leaves."""
    cuts, treedef = jax.tree.flatten(plan, is_leaf=lambda x: isinstance(x, _Cut))
    columns = [treedef.flatten_up_to(t) for t in trees]
    return treedef.unflatten([fn(cut, *row) for cut, *row in zip(cuts, *columns)])


def _take(tree, plan, part, parts, lead=0):
    """Part `part` (traced or not) of every cut leaf of `tree`; None at the whole ones."""
    def take(cut, x):
        d = None if cut.dim is None else cut.dim + lead
        return None if d is None else jax.lax.dynamic_index_in_dim(_split(x, d, parts), part, d + 1, keepdims=False)
    return _zip(plan, take, tree)


def _give(tree, plan, part, parts, values, lead=0):
    """`tree` with part `part` of every cut leaf replaced by `values` (as `_take` gives them): a dynamic update
    slice outside any conditional, so in place (inside a branch, each tree updated so was copied whole)."""
    # Measured: the copy in a branch cost 6.7 GB more per device for LLaMA-7B's replicas on data 2 x fsdp 4.
    def give(cut, x, v):
        if cut.dim is None:
            return x
        d = cut.dim + lead
        return jax.lax.dynamic_update_index_in_dim(_split(x, d, parts), v, part, d + 1).reshape(x.shape)
    return _zip(plan, give, tree, values)


def replicate(tree, replicas):
    """Each leaf broadcast to a leading [replicas] dimension."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas,) + x.shape), tree)


def init_state(diloco, optimizer, params, replicas, plan=None, loss_scale=None):
    """{'replicas': params [R, ...], 'inner': the inner optimizer's state per replica (with `loss_scale`, an
    `engine.LossScale`, each replica's own scale beside it), 'outer': the outer optimizer's state of the global
    params (with fragments > 1: a list of one state per part of `plan`)}."""
    reps = replicate(params, replicas)
    outer = diloco.outer_optimizer
    states = (outer.init(params) if diloco.fragments == 1 else
              [outer.init(fragment(params, plan, p, diloco.fragments)) for p in range(diloco.fragments)])
    inner = jax.vmap(lambda p: init_opt_state(optimizer, p, loss_scale))(reps)
    return {"replicas": reps, "inner": inner, "outer": states}


def _encode(x, dtype):
    """[rows, n] fp32 (n a multiple of _BLOCK) -> its wire format: a tuple of arrays with a leading [rows]."""
    if dtype == "bfloat16":
        return (x.astype(jnp.bfloat16),)
    levels = 127 if dtype == "int8" else 7
    blocks = x.reshape(x.shape[0], -1, _BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / levels
    q = jnp.clip(jnp.round(blocks / jnp.where(scale > 0, scale, 1.0)[..., None]), -levels, levels).reshape(x.shape)
    if dtype == "int8":
        return q.astype(jnp.int8), scale
    nibbles = (q + 8).astype(jnp.uint8).reshape(x.shape[0], -1, 2)  # [1, 15]: two per byte
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scale


def _decode(wire, dtype):
    if dtype == "bfloat16":
        return wire[0].astype(jnp.float32)
    q, scale = wire
    if dtype == "int4":
        q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1).astype(jnp.float32) - 8
    q = q.astype(jnp.float32)
    return (q.reshape(q.shape[0], -1, _BLOCK) * scale[..., None]).reshape(q.shape)


def _mean_delta(global_part, replicas_part, specs, mesh, dtype, replicas):
    """mean over replicas of `global - replica`, exchanged in `dtype` (module docstring): in a shard_map manual over
    every mesh axis, each device flattens its blocks of the part, sends chunk i of its quantized delta to the i-th
    replica (all-to-all over `data`), sums what it gets in fp32 and all-gathers the quantized mean."""
    g_leaves, treedef = jax.tree.flatten(global_part)
    if not g_leaves:
        return global_part
    r_leaves = treedef.flatten_up_to(replicas_part)
    g_specs = treedef.flatten_up_to(specs)

    def local(g_leaves, r_leaves):
        # Each leaf padded to whole blocks in each of the R chunks, so no scale spans two leaves: a leaf that
        # several devices hold whole (replicated over `model`, say) then rounds the same on each of them.
        chunks = [-(-g.size // (replicas * _BLOCK)) * _BLOCK for g in g_leaves]
        rows = jnp.concatenate([jnp.pad((g - r[0]).astype(jnp.float32).ravel(), (0, replicas * c - g.size))
                                .reshape(replicas, c) for g, r, c in zip(g_leaves, r_leaves, chunks)], axis=1)
        mine = tuple(jax.lax.all_to_all(w, axes.DATA, 0, 0) for w in _encode(rows, dtype))
        mean = _decode(mine, dtype).mean(0, keepdims=True)
        every = _decode(tuple(jax.lax.all_gather(w, axes.DATA, axis=0, tiled=True) for w in _encode(mean, dtype)),
                        dtype)
        out, start = [], 0
        for g, c in zip(g_leaves, chunks):
            out.append(every[:, start:start + c].reshape(-1)[:g.size].reshape(g.shape).astype(g.dtype))
            start += c
        return out

    out = jax.shard_map(local, mesh=kernels.tracing_mesh(mesh), in_specs=(g_specs, [P(axes.DATA, *s) for s in g_specs]),
                        out_specs=g_specs, check_vma=False)(g_leaves, r_leaves)
    return treedef.unflatten(out)


def diloco_train_step(*, diloco, replicas, loss_fn, optimizer, accumulate, compute_dtype, remat, key,
                      trainable=None, plan=None, mesh=None, specs=None, sync=False, loss_scale=None,
                      grad_dtype=None):
    """`step(global_params, state, batch, step) -> (global_params, state, metrics)`: one inner step on every replica
    and the outer step of each part whose offset `step + 1` reaches. The batch [accumulate, rows, ...] is split
    into replicas along its data-major rows; every metric is per replica, [R]. trainable: as in
    `engine.step.jit_train_step`; the state (`init_state` of the trained leaves) then replicates only the trained
    parameters, and every replica reads the one copy of the frozen ones. plan (`fragment_plan`), mesh and specs
    (of the trained parameters): needed with fragments > 1 or an outer_dtype other than 'float32'.

    With `diloco.overlap` the step has no conditional: sync=False is the inner step alone, sync=True also the outer
    step of the part that fell due the step before (`DiLoCo.syncs_at`), whose exchange reads the step's input
    replicas, so nothing of the inner step feeds it and the compiler may run it under the inner step's compute;
    the part's replicas then take the new global part plus the inner update they made meanwhile.

    loss_scale: an `engine.LossScale` (float16 compute): each replica scales its loss by its own scale (in its inner
    state) and skips and lowers it on its own overflows, as `jit_train_step` does for the whole model; the outer
    step sees the replicas' parameters only. grad_dtype: as in `engine.step.jit_train_step`, for the inner steps."""
    return _DiLoCoStep(diloco, replicas, loss_fn, optimizer, accumulate, compute_dtype, remat, key, trainable, plan,
                       mesh, specs, sync, loss_scale, grad_dtype).step


@dataclasses.dataclass(frozen=True)
class _DiLoCoStep:
    """`diloco_train_step`'s settings, and its step as methods: the replicas' inner step, and the outer step (whole
    trees, a due fragment, or the overlapped fragment of the step before)."""
    diloco: object
    replicas: int
    loss_fn: object
    optimizer: object
    accumulate: int
    compute_dtype: object
    remat: object
    key: object
    trainable: object
    plan: object
    mesh: object
    specs: object
    sync: bool
    loss_scale: object
    grad_dtype: object = None

    @property
    def parts(self):
        return self.diloco.fragments

    def inner(self, params, opt_state, batch, rng, frozen):
        grad_fn = trained_grad_fn(self.loss_fn, self.compute_dtype, self.remat, frozen, self.trainable,
                                  current_loss_scale(opt_state, self.loss_scale))
        loss, metrics, grads = accumulate_gradients(grad_fn, params, batch, rng, self.accumulate,
                                                     grad_dtype=self.grad_dtype,
                                                     weight_metric=weight_metric_of(self.loss_fn))
        return apply_update(self.optimizer, params, opt_state, grads, loss, metrics, self.loss_scale,
                            select_guard(self.mesh))

    def outer(self, args):  # fragments=1: the whole trees
        replicas, specs = self.replicas, self.specs
        global_params, reps, outer_state = args
        outer_grads = self.outer_grads(global_params, reps, specs)
        updates, outer_state = self.diloco.outer_optimizer.update(outer_grads, outer_state, global_params)
        global_params = optax.apply_updates(global_params, updates)
        return global_params, replicate(global_params, replicas), outer_state

    def outer_grads(self, g, r, part_specs):
        replicas = self.replicas
        if self.diloco.outer_dtype == "float32":
            return jax.tree.map(lambda g, r: g - r.mean(0, dtype=jnp.float32).astype(g.dtype), g, r)
        return _mean_delta(g, r, part_specs, self.mesh, self.diloco.outer_dtype, replicas)

    def outer_part(self, part, args):
        """Part `part`'s outer step on its cut leaves (taken out of the trees before the switch) and the whole
        leaves it owns."""
        plan, replicas, specs = self.plan, self.replicas, self.specs
        cut_g, cut_r, whole_g, whole_r, states = args
        g, r = _zip(plan, _owned(part), cut_g, whole_g), _zip(plan, _owned(part), cut_r, whole_r)
        updates, state = self.diloco.outer_optimizer.update(
            self.outer_grads(g, r, fragment_specs(plan, specs, part)), states[part], g)
        g = optax.apply_updates(g, updates)
        r = replicate(g, replicas)
        states = [state if p == part else s for p, s in enumerate(states)]
        return (_zip(plan, _cut, g), _zip(plan, _cut, r), _zip(plan, _whole_after(part), g, whole_g),
                _zip(plan, _whole_after(part), r, whole_r), states)

    def overlapped_part(self, part, args):
        """Part `part`'s outer update from the exchanged outer gradients of its cut leaves, and the exchange, update
        and replica move of the whole leaves it owns (small: their exchange may sit in this branch)."""
        plan, specs = self.plan, self.specs
        cut_grads, cut_g, whole_g, whole_before, whole_after, states = args
        mine = lambda cut, x: x if cut.dim is None and cut.owner == part else None  # noqa: E731
        g_whole, before_whole = _zip(plan, mine, whole_g), _zip(plan, mine, whole_before)
        whole_grads = self.outer_grads(g_whole, before_whole, _zip(plan, mine, specs))
        g = _zip(plan, _owned(part), cut_g, g_whole)
        updates, state = self.diloco.outer_optimizer.update(_zip(plan, _owned(part), cut_grads, whole_grads),
                                                            states[part], g)
        g = optax.apply_updates(g, updates)
        moved = lambda cut, new, b, a: (  # noqa: E731
            None if cut.dim is not None else new + (a - b) if cut.owner == part else a)
        states = [state if p == part else s for p, s in enumerate(states)]
        new_whole = _zip(plan, _whole_after(part), g, whole_g)
        return (_zip(plan, _cut, g), new_whole, _zip(plan, moved, new_whole, whole_before, whole_after), states)

    def overlapped(self, global_params, before, after, outer_state, step):
        """The part due at `step - 1`: its exchange from the replicas `before` the inner step (nothing of the inner
        step feeds it), its outer update, and its replicas `after` the inner step moved by the global part's change:
        new global + (after - before)."""
        plan, parts, specs = self.plan, self.parts, self.specs
        states = [outer_state] if parts == 1 else outer_state
        offsets = self.diloco.offsets()
        part = sum(p * (step % self.diloco.inner_steps == o).astype(jnp.int32) for p, o in enumerate(offsets))
        cut_g, cut_before = _take(global_params, plan, part, parts), _take(before, plan, part, parts, lead=1)
        cut_grads = self.outer_grads(cut_g, cut_before, _zip(plan, _cut, specs))
        new_cut, new_whole, whole_after, states = jax.lax.switch(
            part, [functools.partial(self.overlapped_part, p) for p in range(parts)],
            (cut_grads, cut_g, _zip(plan, _whole, global_params), _zip(plan, _whole, before),
             _zip(plan, _whole, after), states))
        moved = lambda cut, new, b, a: None if cut.dim is None else new + (a - b)  # noqa: E731
        cut_after = _zip(plan, moved, new_cut, cut_before, _take(after, plan, part, parts, lead=1))
        global_params = _zip(plan, _merge, _give(global_params, plan, part, parts, new_cut), new_whole)
        after = _zip(plan, _merge, _give(after, plan, part, parts, cut_after, lead=1), whole_after)
        return global_params, after, states[0] if parts == 1 else states

    def step(self, global_params, state, batch, step):
        plan, parts, replicas = self.plan, self.parts, self.replicas
        split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], replicas, x.shape[1] // replicas, *x.shape[2:]), 1, 0)
        rngs = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(self.key, step), r))(jnp.arange(replicas))
        global_params, frozen = partition(global_params, self.trainable)
        with kernels.vmapped(axes.DATA):  # each replica's kernels on its own rows
            reps, inner_state, metrics = jax.vmap(self.inner, in_axes=(0, 0, 0, 0, None), spmd_axis_name=axes.DATA)(
                state["replicas"], state["inner"], jax.tree.map(split, batch), rngs, frozen)
        if self.diloco.overlap:
            outer_state = state["outer"]
            if self.sync:
                global_params, reps, outer_state = self.overlapped(global_params, state["replicas"], reps,
                                                                   outer_state, step)
            return (combine(global_params, frozen, self.trainable),
                    {"replicas": reps, "inner": inner_state, "outer": outer_state}, metrics)
        # Branch 0: no outer step; branch p + 1: part p's.
        due = [((step + 1) % self.diloco.inner_steps == offset).astype(jnp.int32) for offset in self.diloco.offsets()]
        branch = sum((p + 1) * hit for p, hit in enumerate(due))
        if parts == 1:
            global_params, reps, outer_state = jax.lax.switch(branch, [lambda args: args, self.outer],
                                                              (global_params, reps, state["outer"]))
        else:  # the due part (any when none is) taken out, stepped in the switch, put back in place
            part = sum(p * hit for p, hit in enumerate(due))
            cut_g, cut_r, whole_g, whole_r, outer_state = jax.lax.switch(
                branch, [lambda args: args] + [functools.partial(self.outer_part, p) for p in range(parts)],
                (_take(global_params, plan, part, parts), _take(reps, plan, part, parts, lead=1),
                 _zip(plan, _whole, global_params), _zip(plan, _whole, reps), state["outer"]))
            global_params = _zip(plan, _merge, _give(global_params, plan, part, parts, cut_g), whole_g)
            reps = _zip(plan, _merge, _give(reps, plan, part, parts, cut_r, lead=1), whole_r)
        return (combine(global_params, frozen, self.trainable),
                {"replicas": reps, "inner": inner_state, "outer": outer_state}, metrics)
