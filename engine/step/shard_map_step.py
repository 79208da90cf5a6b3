"""The overlapped step (`shard_map_train_step`): a `jax.shard_map` manual over `data`, `fsdp`, `expert` and
`context` (the `model` axis stays automatic, split by the compiler from the parameter specs) computes the gradients
with explicit collectives; the optimizer update then runs auto-partitioned on the gradient shards, as in
`jit_train_step`.

Inside the shard_map each device runs `loss_fn` on its own rows of every micro-batch:
  - ZeRO-3 (every parameter split over a data axis in `param_specs`, i.e. `fsdp`): the shard is all-gathered in
    the compute dtype right before its first use and the gathered copy is never kept for the backward pass (it
    is gathered again there); the gradient is reduce-scattered in `reduce_dtype` by the gather's backward. For a
    scan-over-layers model the loss's jaxpr is re-evaluated so that the stacked weights enter the layer loop as
    shards and each iteration gathers only its own layer; with remat='full' the stack is pipelined by hand
    (`engine.step.layer_scan`: layer t+1's gather and layer t+1's gradient reduce-scatter run beside layer t). A
    parameter split over `model` too is gathered and reduce-scattered on each device's `model` block
    (`engine.step.collectives.in_model_blocks`), so the compiler keeps its `model` split through them. A
    row-split embedding table is looked up vocab-parallel (`engine.step.gathering`), never gathered, and so is a
    `kernels.linear_cross_entropy` head split by vocabulary columns (`kernels.matmul.vocab_parallel_loss`).
  - accumulation: partial gradients stay in the parameter's (ZeRO-2: the update's) layout between micro-batches.
  - expert parallelism: the rows are split over `expert` too; a parameter split over it (a mixture's stacked
    experts) stays split, each device computing with its own experts (the MoE layer sends the tokens to them,
    models/layers/moe.py), and its gradient is not summed over `expert`; every other gradient is, like over `data`.
  - context parallelism: every row's tokens are split over `context` too (a batch leaf [rows, tokens, ...]), each
    device tracing the loss on its slice: the decoder takes the tokens' positions in the whole rows and attention
    exchanges them over `context` (kernels.flash_attention), the shards' losses are weighted by `weight_metric`
    and every gradient is summed over `context` (or reduce-scattered, where auto_shard split the weight over it as
    ZeRO-3). Only a loss with `token_parallel` set runs so (`check_token_parallel`).
  - an FP8 amax history (`engine.step.update.is_overwrite`) is whole on every device and so is its "gradient" (the
    amaxes are maxima over the batch axes): it is not reduced, its micro-batches' values are combined by maximum.
  - the remaining data-parallel reduction (`data`, `expert`, and `fsdp` for unsplit parameters) is one all-reduce, or a
    reduce-scatter into `update_specs` (ZeRO-1/2: each device then updates only its optimizer-state shard and the
    compiler all-gathers the new weights).
"""
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

import kernels
from engine.step.collectives import Int8, all_gather, in_model_blocks, reduce_gradient, reduce_scatter
from engine.step.gathering import eval_gathering
from engine.step.shards import Sharded
from engine.step.update import (apply_update, checked_user_gradients, combine, current_loss_scale, is_overwrite,
                                micro_loss_fn, micro_weight, partition, scaled_metrics, select_guard)
from kernels import axes

_P = jax.sharding.PartitionSpec
# The axes the step handles by hand; the others stay with the compiler. `expert` splits the rows like `data`, and a
# mixture's experts: a parameter split over it is expert-parallel (each device keeps its block, never gathered, its
# gradient not summed over `expert`), and the MoE layer exchanges the device's tokens over it directly
# (models/layers/moe.py). Left automatic beside an automatic `model`, rows split over it aborted XLA's SPMD
# partitioner (jaxlib 0.10.2, "partition_group_list ... Check failed", dense models too).
# `context` splits every row's tokens: each device traces its own slice of them (models/layers/decoder.py gives
# those tokens their positions in the whole rows, kernels.flash_attention exchanges them over `context`), so a loss
# runs here on a context mesh only where it says it can (`loss_fn.token_parallel`, `check_token_parallel`); left
# automatic beside `model`, the token split aborted the same partitioner.
MANUAL_AXES = (axes.DATA, axes.FSDP, axes.EXPERT, axes.CONTEXT)
_ROW_AXES = axes.BATCH  # the manual axes a batch's rows are split over (its tokens over `context`)
_KEPT_AXES = (axes.EXPERT,)  # manual axes a parameter stays split over inside the step


def _spec_axes(spec, ndim, manual=True):
    """PartitionSpec -> per-dimension tuple of the manual axes it names (in order); the other axes with
    manual=False."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    out = []
    for e in entries:
        out.append(tuple(a for a in axes.entry_axes(e) if (a in MANUAL_AXES) == manual))
    return tuple(out)


def _manual_spec(axes_per_dim):
    return jax.sharding.PartitionSpec(*[None if not a else (a[0] if len(a) == 1 else a) for a in axes_per_dim])


class _LeafPlan:
    """How one parameter travels through the step.

    gather: ((dim, axes), ...) the parameter is split over (gathered at use, its gradient reduce-scattered in the
      backward pass). kept: ((dim, axes), ...) it stays split over (`expert`: a mixture's experts, each device's
      own; its gradient is not summed over them). scatter: ((dim, axes), ...) the gradient is further
      reduce-scattered over (ZeRO-1/2 `data`). reduce: the remaining manual axes the gradient is summed over
      (all-reduce). auto_spec: the parameter's split over the automatic axes (`model`), or None."""

    def __init__(self, param_spec, update_spec, shape, sizes):
        live = lambda axes: tuple(a for a in axes if sizes.get(a, 1) > 1)  # noqa: E731
        p_axes, u_axes = _spec_axes(param_spec, len(shape)), _spec_axes(update_spec, len(shape))
        self.in_spec, self.out_spec = _manual_spec(p_axes), _manual_spec(u_axes)
        auto = [live(a) for a in _spec_axes(param_spec, len(shape), manual=False)]
        self.auto_spec = _manual_spec(auto) if any(auto) else None
        split = lambda axes, kept: live(tuple(a for a in axes if (a in _KEPT_AXES) == kept))  # noqa: E731
        self.gather = tuple((d, split(a, False)) for d, a in enumerate(p_axes) if split(a, False))
        self.kept = tuple((d, split(a, True)) for d, a in enumerate(p_axes) if split(a, True))
        self.scatter = tuple((d, live(tuple(x for x in u if x not in p)))
                             for d, (p, u) in enumerate(zip(p_axes, u_axes)) if live(tuple(x for x in u if x not in p)))
        used = {a for _, axes in self.gather + self.kept + self.scatter for a in axes}
        self.reduce = tuple(a for a in MANUAL_AXES if sizes.get(a, 1) > 1 and a not in used)
        kept = dict(self.kept)
        self.traced_shape = tuple(n // math.prod(sizes[a] for a in kept.get(d, ())) for d, n in enumerate(shape))


def check_token_parallel(loss_fn, mesh, weight_metric, grad_fn=None):
    """Raises a one-line ValueError unless the shard_map step can run `loss_fn` on `mesh`'s `context` split (each
    device its slice of every row's tokens): nothing to check without one; else the loss must say it is computed
    from the model's outputs token by token, the model taking its positions and attention over the whole rows
    (`loss_fn.token_parallel`, set by `engine.tasks.lm.lm_loss_fn` for a decoder-only model), and what its loss is a
    mean over (`weight_metric`, e.g. 'tokens'), so that the shards' means combine into the batch's."""
    context = dict(mesh.shape).get(axes.CONTEXT, 1)
    if context == 1:
        return
    if grad_fn is not None:
        raise ValueError(f"grad_fn with step='shard_map' on a mesh with context={context}; expected step='jit' or "
                         "'auto' (a grad_fn sees whole rows)")
    if not getattr(loss_fn, "token_parallel", False) or weight_metric is None:
        raise ValueError(f"step='shard_map' on a mesh with context={context} with a loss_fn that does not set "
                         "token_parallel = True and a weight_metric (each device computes it on its slice of every "
                         "row's tokens: engine.tasks.lm.lm_loss_fn of a decoder-only model does); expected step='jit' "
                         "or 'auto' for this loss")


def _batch_spec(x, sizes):
    """A batch leaf [accumulate, rows, ...]'s spec: rows over the row axes, and on a context mesh tokens (dim 2) over
    `context`."""
    context = sizes.get(axes.CONTEXT, 1)
    if context == 1:
        return _P(None, _ROW_AXES)
    if x.ndim < 3 or x.shape[2] % context:
        raise ValueError(f"a batch leaf of shape {tuple(x.shape[1:])} on a mesh with context={context}; expected "
                         f"[rows, tokens, ...] with tokens divisible by {context} (the shard_map step splits them)")
    return _P(None, _ROW_AXES, axes.CONTEXT)


def _shard_map(fn, mesh, in_specs, out_specs):
    """`jax.shard_map`, manual over the data axes only (`context` only where it splits the tokens: a manual
    `context` of size 1 before an automatic `stage` made JAX 0.11 abort on a pipeline's shardings, "Manual axes must
    be sorted by mesh axis index"); replication is not type-checked because every reduction here is explicit. Over
    the abstract mesh the step is traced under (`kernels.tracing_mesh`): a concrete mesh must equal the context's,
    which names a target device when lowering for an accelerator this host lacks."""
    sizes = dict(mesh.shape)
    manual = {a for a in MANUAL_AXES if a != axes.CONTEXT or sizes.get(a, 1) > 1}
    return jax.shard_map(fn, mesh=kernels.tracing_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                         axis_names=manual, check_vma=False)


def shard_map_train_step(*, loss_fn, optimizer, mesh, param_specs, update_specs, zero_stage, accumulate,
                         compute_dtype, remat, key, reduce_dtype=jnp.float32, weight_metric=None, trainable=None,
                         loss_scale=None, int8=Int8(), grad_fn=None, grad_dtype=None):
    """The overlapped step (see the module's docstring); the arguments are `jit_train_step`'s, and:

    `param_specs`: the parameters' PartitionSpecs; a parameter split over a data axis (`fsdp`) is ZeRO-3's.
    `update_specs`: the parameter-shaped layout the optimizer works in (`param_specs` with `data` added for ZeRO-1/2).
    `reduce_dtype`: jnp.float32 or jnp.bfloat16, the dtype of every gradient reduction (bf16 halves the bytes on
      GPU/TPU; the XLA CPU compiler of jaxlib 0.10.2 aborts on it, so CPU runs keep fp32).
    `weight_metric`: None (every shard's loss counts equally: exact for losses that are means over rows), or the name
      of a metric of `loss_fn` holding what its loss is a mean over (e.g. 'tokens' for `engine.tasks.lm.lm_loss_fn`):
      loss, gradients and every other metric are then averaged with those weights across shards, and that metric is
      summed, which reproduces the global-batch values of `jit_train_step` exactly.
    `trainable`: as in `jit_train_step`. A frozen parameter is gathered like any other but never differentiated:
      no weight gradient, no reduction.
    `int8`: an `Int8`, ZeRO++'s int8 weight gathers of the ZeRO-3 parameters and / or int8 gradient reductions
      (every reduce-scatter and all-reduce of a gradient of two or more dims; the others stay in `reduce_dtype`).
    Metrics, the NaN/inf guard, the learning rate and `loss_scale` are those of `jit_train_step` (the scale enters
    the manual region as a replicated scalar; gradients are reduced scaled, unscaled in the update). rng: micro-batch
    i of update `step` uses `fold_in(fold_in(key, step), i)`, further folded with the shard index when there are
    several shards (so that dropout masks of different shards are independent).
    `grad_fn`: None, or the Trainer's `grad_fn(params, micro_batch, rng) -> ((loss, metrics), grads)` on each
    device's rows in place of differentiating `loss_fn`: the ZeRO-3 shards are gathered whole before it (no
    layer-by-layer gathering) and its gradients reduce-scattered back after it; the reductions are the same.
    `grad_dtype`: None or the dtype the gradients are held in from their reduction to the update
      (`Precision.grad_dtype`): each is summed over `fsdp` in `reduce_dtype` and rounded to it (a `data` axis then
      adds the rounded partial sums); the ZeRO-3 layer stack's buffers (remat='full') and the micro-batches' running
      sum are in it.
    """
    check_token_parallel(loss_fn, mesh, weight_metric, grad_fn)
    settings = _Settings.checked(mesh, micro_loss_fn(loss_fn, None), key, compute_dtype, reduce_dtype, remat,
                                 accumulate, zero_stage, weight_metric, int8, grad_dtype)
    if grad_fn is not None:
        if loss_scale is not None:
            raise ValueError("grad_fn with a loss scale; expected loss_scale=None (the loss is scaled before the "
                             "engine differentiates it)")
        settings = dataclasses.replace(settings, grad_fn=grad_fn)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    update_sh = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), update_specs, is_leaf=is_spec)

    def step(params, opt_state, batch, step):
        layout = _Layout.of(params, param_specs, update_specs, trainable, settings)
        fn = _shard_map(functools.partial(_local_gradients, settings, layout), mesh,
                        in_specs=(layout.treedef.unflatten([pl.in_spec for pl in layout.plans]),
                                  jax.tree.map(lambda x: _batch_spec(x, settings.sizes), batch), _P(), _P()),
                        out_specs=([pl.out_spec for pl in layout.trained(layout.plans)], _P(), _P()))
        grads, loss, metrics = fn(params, batch, step, current_loss_scale(opt_state, loss_scale))
        trained, frozen = partition(params, trainable)
        grads = [jax.lax.with_sharding_constraint(g, sh)
                 for g, sh in zip(grads, layout.trained(layout.treedef.flatten_up_to(update_sh)))]
        grads = jax.tree.structure(trained).unflatten(grads)
        trained, opt_state, metrics = apply_update(optimizer, trained, opt_state, grads, loss, metrics, loss_scale,
                                                           select_guard(settings.device))
        return combine(trained, frozen, trainable), opt_state, metrics

    return step


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The step's static settings, checked. micro: `loss_fn` as a micro-batch loss with no cast (the cast to
    `compute_dtype` happens on the shards, before any gather); sizes: the mesh's axis sizes."""
    micro: object
    key: object
    compute_dtype: object
    reduce_dtype: jnp.dtype
    remat: bool
    accumulate: int
    zero_stage: int
    weight_metric: object
    int8: Int8
    sizes: dict
    grad_fn: object = None
    device: object = None
    grad_dtype: object = None

    @classmethod
    def checked(cls, mesh, micro, key, compute_dtype, reduce_dtype, remat, accumulate, zero_stage, weight_metric,
                int8, grad_dtype=None):
        if jnp.dtype(reduce_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"reduce_dtype={reduce_dtype!r}; expected jnp.float32 or jnp.bfloat16")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r}; expected 0, 1 or 2")
        if not isinstance(int8, Int8):
            raise ValueError(f"int8={int8!r}; expected an engine.step.Int8")
        return cls(micro, key, compute_dtype, jnp.dtype(reduce_dtype), remat, accumulate, zero_stage, weight_metric,
                   int8, dict(zip(mesh.axis_names, mesh.devices.shape)), device=mesh.devices.flat[0],
                   grad_dtype=None if grad_dtype is None else jnp.dtype(grad_dtype))

    def layout(self, shape, dtype):
        """The layout the mesh's devices give an array of this (per-device) shape and dtype by default, which is
        how the parameters and the optimizer state lie between steps, where it is not row-major (XLA:TPU puts an
        unaligned minor dim first: f32[32, 4096, 2752] is {1,2,0}); else None."""
        try:
            default = self.device.client.get_default_layout(jnp.dtype(dtype), tuple(shape), self.device)
        except Exception:  # noqa: BLE001 - a client without default layouts: row-major
            return None
        order = Layout.from_pjrt_layout(default).major_to_minor
        return None if order == tuple(range(len(shape))) else Layout(order)

    def constrain(self, g):
        """A gradient in its default layout (`layout`): left to itself, XLA:TPU lays the gradient stacks out
        row-major and then copies every parameter and moment of the update to match (4 x 1.4 GB at once for
        LLaMA-7B on v5p-8)."""
        layout = self.layout(g.shape, g.dtype)
        return g if layout is None else with_layout_constraint(g, layout)

    @property
    def live(self):
        """The manual axes of size > 1 (the shard index runs over them)."""
        return tuple(a for a in MANUAL_AXES if self.sizes.get(a, 1) > 1)

    @property
    def n_shards(self):
        return math.prod(self.sizes.get(a, 1) for a in MANUAL_AXES)

    def held_type(self, x):
        """The dtype the gradient of parameter `x` is held in."""
        return x.dtype if self.grad_dtype is None else self.grad_dtype

    def compute_type(self, x):
        floating = self.compute_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating)
        return jnp.dtype(self.compute_dtype) if floating else x.dtype


class _Layout(NamedTuple):
    """The parameters' flat layout: their treedef, each leaf's `_LeafPlan`, whether it trains (mask), its abstract
    value in the compute dtype as the loss sees it (what the loss is traced with): full size, but for the dims it
    stays split over (`_LeafPlan.kept`), and whether it is an `is_overwrite` leaf (kept in float32, not reduced)."""
    treedef: object
    plans: list
    mask: list
    full: list
    overwrite: list

    @classmethod
    def of(cls, params, param_specs, update_specs, trainable, settings):
        paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        leaves, overwrite = [x for _, x in paths], [is_overwrite(p) for p, _ in paths]
        plans = [_LeafPlan(s, u, x.shape, settings.sizes) for s, u, x in
                 zip(treedef.flatten_up_to(param_specs), treedef.flatten_up_to(update_specs), leaves)]
        mask = [True] * len(leaves) if trainable is None else treedef.flatten_up_to(trainable)
        return cls(treedef, plans, mask, [jax.ShapeDtypeStruct(pl.traced_shape, x.dtype if o else
                                                               settings.compute_type(x))
                                          for pl, x, o in zip(plans, leaves, overwrite)], overwrite)

    def trained(self, xs, want=True):
        """The entries of the per-leaf list `xs` that train (want=False: that are frozen)."""
        return [x for x, m in zip(xs, self.mask) if m == want]

    def cast(self, s, xs):
        """The per-leaf list `xs` as the loss takes them: in the compute dtype, but the `is_overwrite` leaves, and
        the ZeRO-3 shards as they are (their gathers cast each use, a layer at a time: cast here, a compute-dtype copy
        of every shard stayed alive through the step, LLaMA-7B on v5p-8 3.2 GB a chip)."""
        return [x if o or pl.gather else x.astype(s.compute_type(x))
                for x, o, pl in zip(xs, self.overwrite, self.plans)]


def _local_gradients(s, layout, local_params, local_batch, step, scale):
    """The shard_map's body on one device: (the trained leaves' gradients in their `out_spec` layouts, loss, metrics),
    means over the micro-batches and over the shards. scale: the loss scale or None."""
    rng = jax.random.fold_in(s.key, step)
    shard = jax.lax.axis_index(s.live) if s.live else None
    grad_fn = (_shard_grad_fn(s, layout, local_batch, rng, scale) if s.grad_fn is None else
               _user_shard_grad_fn(s, layout))
    local_leaves = jax.tree.leaves(local_params)
    one = functools.partial(_micro_gradients, s, layout, grad_fn, rng, shard, local_leaves)
    maxed = layout.trained(layout.overwrite)
    grads, loss, metrics, total = _sum_micro_batches(one, local_batch, s.accumulate, maxed)
    inv = 1.0 / jnp.where(total > 0, total, 1.0)  # 1 / accumulate without a weight_metric
    grads = [g if o else reduce_gradient(g, () if s.zero_stage == 2 else pl.scatter, pl.reduce, s.reduce_dtype,
                                         pl.auto_spec, s.int8.gradients) * inv
             for g, pl, o in zip(grads, layout.trained(layout.plans), maxed)]
    grads = [g if o else s.constrain(g.astype(s.held_type(x)))
             for g, x, o in zip(grads, layout.trained(local_leaves), maxed)]
    loss, metrics = jax.tree.map(lambda v: jax.lax.psum(v, s.live) if s.live else v, (loss, metrics))
    return grads, loss * inv, scaled_metrics(metrics, inv, s.weight_metric, 1.0 / s.accumulate)


def _shard_grad_fn(s, layout, local_batch, rng, scale):
    """`value_and_grad` of this device's weighted share of the loss on one micro-batch, with respect to its trained
    leaves: `(trained, frozen, micro_batch, rng) -> ((scaled share, (loss, metrics, weights)), grads)`, with
    `_shard_weight`'s weights. The loss is traced once at full size and re-evaluated with the ZeRO-3 shards as
    `Sharded` (`eval_gathering`)."""
    first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), local_batch)
    closed, out_shape = jax.make_jaxpr(s.micro, return_shape=True)(
        layout.treedef.unflatten(layout.full), first, jax.ShapeDtypeStruct((), rng.dtype))
    out_tree = jax.tree.structure(out_shape)

    def shard_loss(trained_leaves, frozen_leaves, micro_batch, micro_rng):
        trained_iter, frozen_iter = iter(trained_leaves), iter(frozen_leaves)
        local_leaves = [next(trained_iter) if m else next(frozen_iter) for m in layout.mask]
        args = [Sharded(x, pl.gather, s.compute_type(x), s.reduce_dtype, int8=s.int8,
                        layout=s.layout(x.shape, s.held_type(x)), auto=pl.auto_spec, grad_dtype=s.grad_dtype)
                if pl.gather else x for x, pl in zip(layout.cast(s, local_leaves), layout.plans)]
        flat_in = args + jax.tree.leaves(micro_batch) + [micro_rng]
        loss, metrics = out_tree.unflatten(eval_gathering(closed.jaxpr, closed.consts, flat_in, s.remat))
        weights = _shard_weight(s, metrics)
        scaled = loss * weights[0] if scale is None else loss * weights[0] * scale
        return scaled, (loss, metrics, weights)

    return jax.value_and_grad(jax.checkpoint(shard_loss) if s.remat else shard_loss, has_aux=True)


def _user_shard_grad_fn(s, layout):
    """`_shard_grad_fn`'s contract for the Trainer's `grad_fn`: called on this device's rows with the parameters
    gathered whole in the compute dtype; its gradients weighted by the shard's share and, for the ZeRO-3 leaves,
    reduce-scattered back to the shard layout (what the gather's backward does for the engine's own loss)."""
    mask = None if all(layout.mask) else layout.treedef.unflatten(layout.mask)

    def value_and_grad(trained_leaves, frozen_leaves, micro_batch, micro_rng):
        trained_iter, frozen_iter = iter(trained_leaves), iter(frozen_leaves)
        local = [next(trained_iter) if m else next(frozen_iter) for m in layout.mask]
        whole = [in_model_blocks(lambda x, pl=pl: all_gather(x, pl.gather, s.compute_type(x), s.int8.weights), x,
                                 pl.auto_spec, pl.gather) if pl.gather
                 else x for x, pl in zip(layout.cast(s, local), layout.plans)]
        params = layout.treedef.unflatten(whole)
        (loss, metrics), grads = checked_user_gradients(s.grad_fn(params, micro_batch, micro_rng), params, mask)
        weights = _shard_weight(s, metrics)
        weight = weights[0]
        grads = [g.astype(jnp.float32) if o else
                 in_model_blocks(lambda g, pl=pl: reduce_scatter(g, pl.gather, s.reduce_dtype, jnp.float32,
                                                                 s.int8.gradients), g.astype(jnp.float32) * weight,
                                 pl.auto_spec, pl.gather) if pl.gather else g.astype(jnp.float32) * weight
                 for g, pl, o in zip(jax.tree.leaves(grads), layout.trained(layout.plans),
                                     layout.trained(layout.overwrite))]
        return (loss * weight, (loss, metrics, weights)), grads

    return value_and_grad


def _shard_weight(s, metrics):
    """(this shard's weight in its micro-batch's mean, the micro-batch's weight among the step's): 1 / shards and 1,
    or the shard's share of the `weight_metric` summed over shards (0 where no shard has any) and that sum."""
    if s.weight_metric is None:
        return jnp.float32(1.0 / s.n_shards), jnp.float32(1.0)
    w = micro_weight(metrics, s.weight_metric)
    total = jax.lax.psum(w, s.live) if s.live else w
    return jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0), total


def _micro_gradients(s, layout, grad_fn, rng, shard, local_leaves, micro_batch, i):
    """(gradients in fp32 or grad_dtype, weighted loss, weighted metrics, the micro-batch's weight) of micro-batch i,
    each weighted by the shard's share of the micro-batch and, with more than one, by the micro-batch's weight among
    the step's (`_shard_weight`'s second: the sum over them divides at the end); under ZeRO-2 the gradients already
    reduce-scattered over `data`, so partial sums stay split between micro-batches."""
    micro_rng = jax.random.fold_in(rng, i)
    if shard is not None:
        micro_rng = jax.random.fold_in(micro_rng, shard)
    (_, (loss, metrics, (weight, part))), grads = grad_fn(layout.trained(local_leaves),
                                                         layout.trained(local_leaves, False), micro_batch, micro_rng)
    maxed = layout.trained(layout.overwrite)
    grads = [g.astype(jnp.float32 if o else s.grad_dtype or jnp.float32) for g, o in zip(grads, maxed)]
    if s.zero_stage == 2:
        grads = [g if o else
                 reduce_gradient(g, pl.scatter, (), s.reduce_dtype, pl.auto_spec, s.int8.gradients).astype(g.dtype)
                 for g, pl, o in zip(grads, layout.trained(layout.plans), maxed)]
    part = part if s.accumulate > 1 else jnp.float32(1.0)
    grads = [g if o else g * part.astype(g.dtype) for g, o in zip(grads, maxed)]
    return grads, loss * weight * part, scaled_metrics(metrics, weight * part, s.weight_metric), part


def _sum_micro_batches(one, batch, accumulate, maxed):
    """`one(micro_batch, i)`'s (gradients, loss, metrics, weight) summed over the `accumulate` micro-batches of
    `batch`, in one `lax.scan`; the gradients where `maxed` (a bool per gradient) their maximum instead."""
    if accumulate == 1:
        return one(jax.tree.map(lambda x: x[0], batch), 0)

    def body(carry, xs):
        g, l, m, w = one(*xs)
        acc_g, acc_l, acc_m, acc_w = carry
        acc_g = [jnp.maximum(a, b) if o else a + b for a, b, o in zip(acc_g, g, maxed)]
        return (acc_g, acc_l + l, jax.tree.map(jnp.add, acc_m, m), acc_w + w), None

    shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], batch), 0)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, init, (batch, jnp.arange(accumulate)))
    return total
