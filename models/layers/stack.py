"""The layer stack: a block applied num_layers times, as one nn.scan over stacked weights or as separate sub-trees,
with remat, and as a pipeline (`models.pipeline`) under a mesh with a `stage` axis."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from models import pipeline, pipeline_1f1b
from models.layers import moe

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight-matmul outputs
}

# What a scanned stack without remat recomputes in the backward pass instead of keeping: elementwise arithmetic,
# casts, comparisons, layout ops and random bits (the norms' outputs, rotary embeddings, activations, residual sums,
# a dropout mask) and checkpoint names (a named value is kept where its input is). Each value a scan keeps is
# zero-filled, copied into its [layers, ...] buffer and copied back out; one of these is recomputed from kept values
# in a pass the backward mostly makes anyway. Matmuls, kernels (attention), reductions (their outputs are small;
# recomputed, their inputs would be kept), collectives, sorts and gathers are kept (the engine's shard_map step
# gathers a ZeRO-3 layer's weights again in the backward whatever the policy). Unscanned layers keep everything (a
# kept value is then only held).
_RECOMPUTED = frozenset((
    "neg", "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "abs", "sign", "pow", "integer_pow", "square",
    "sqrt", "rsqrt", "exp", "exp2", "log", "log1p", "tanh", "logistic", "erf", "erf_inv", "sin", "cos", "floor",
    "ceil", "round", "clamp", "is_finite", "one_minus_square", "select_n", "convert_element_type",
    "bitcast_convert_type", "reduce_precision", "copy", "copy_p", "stop_gradient", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "not", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic", "broadcast_in_dim",
    "reshape", "squeeze", "expand_dims", "transpose", "concatenate", "stack", "slice", "split", "pad", "rev", "iota",
    "random_bits", "random_wrap", "random_unwrap", "random_fold_in", "random_split", "random_seed", "threefry2x32",
    "name"))


def _keep_costly(prim, *_, **__):
    """remat policy of a scanned stack with remat='none': keep all but `_RECOMPUTED`'s outputs."""
    return prim.name not in _RECOMPUTED


def _keep_costly_but_slices(prim, *_, **__):
    """GPipe's remat policy of a layer with remat='none': `_keep_costly`'s, gathers and dynamic slices recomputed too
    (each tick slices its layer out of the stage's weights: kept, every tick's slice would be held to the backward)."""
    return _keep_costly(prim) and prim.name not in ("gather", "dynamic_slice")


def apply_layers(block_cls, x, ctx, cache, config, *, num_layers=None, name="layers", owner=None, per_layer=None,
                 loss_tail=None, **block_kwargs):
    """Runs the blocks of a stack (config.num_layers unless given); call from inside a parent's compact method.

    A block is a Module whose __call__(x, ctx, layer_cache) returns (x, layer_cache); it is built with
    config=config and block_kwargs. config.scan_layers: one nn.scan with parameters stacked along a leading
    [num_layers] axis under `name` (stored [V, num_layers / V] for an interleaved pipeline: `stored_rounds`); else
    separate `{name}_{i}` sub-trees. cache: the model's cache dict or None; its 'layers' are stacked
    [num_layers, ...] either way, so generation does not care which. config.remat wraps each block in nn.remat.
    Under a mesh with a `stage` axis (and no cache) the scanned stack runs as a pipeline (`models.pipeline`);
    `owner`, the calling module, lends it the stacked weights, and a stack without an owner refuses such a mesh.
    Returns (x, new cache['layers'] or None).

    per_layer {name: one value per layer} (Gemma: which layers attend within the sliding window) is for layers that
    differ: each block gets a fourth argument {name: its value}. Unscanned, the values are Python constants. Scanned,
    they are [num_layers] arrays scanned beside the stacked weights, so one compiled body still serves every layer
    (the block branches on the traced value with lax.cond / jnp.where), and remat, the pipeline (which indexes them
    by layer) and the engine's overlapped ZeRO-3 stack see the same single-block scan as for uniform layers. Such a
    stack's cache has no common per-layer shape (sliding layers keep rings of the window, the others every
    position: `empty_cache`'s {'full', 'sliding'}), so a cached call (generation) of a scanned stack runs its layers
    one after the other on slices of the stacked weights, each with its kind's cache; with one cache shape a cached
    call is a `lax.scan` over the stacked weights and cache (`_cached_scan`).

    What a block sows into 'intermediates' (the MoE router's statistics, `layers.moe`) comes out stacked
    [num_layers, ...] from a scan, per `{name}_{i}` otherwise; GPipe's pipeline sows its sums over the layers and
    micro-batches (`moe.summed_stats`; a mixture's router statistics are what blocks sow), and so does 1F1B's.

    loss_tail (tail_fn, inputs): what follows the stack down to a loss, for the 1F1B pipeline
    (config.pipeline_schedule='1f1b', which runs it per micro-batch: `models.pipeline_1f1b`), tail_fn taking
    `owner`'s other parameters, the stack's output rows and those rows of `inputs`. When that pipeline runs, the
    first result is tail_fn's (loss, aux) summed over the micro-batches instead of the stack's output; it refuses a
    call without a tail. Other calls ignore it."""
    num_layers = config.num_layers if num_layers is None else num_layers
    scan, remat = config.scan_layers, config.remat
    rounds = stored_rounds(config, num_layers)
    cache = None if cache is None else cache["layers"]
    block_kwargs = {"config": config, **block_kwargs}
    if remat != "none" and remat not in _REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; expected 'none', 'full' or 'dots'")
    if rounds > 1 and owner is None:
        raise ValueError(f"pipeline_virtual_stages={rounds} stores the layer stack '{name}' for an interleaved "
                         "pipeline, which this model's stack cannot run (decoder-only families can); expected "
                         "pipeline_virtual_stages=1")
    stages = pipeline.num_stages()
    if stages > 1 and cache is None:
        if owner is None:
            raise ValueError(f"a mesh with stage={stages}: this model's layer stack '{name}' cannot run as a "
                             "pipeline (decoder-only families can); expected a mesh with stage=1")
        if not scan:
            raise ValueError(f"a mesh with stage={stages} needs scan_layers=True (the pipeline splits the stacked "
                             "layer weights); got scan_layers=False")
        if config.fp8 and config.fp8_history:  # a stage's layers run once a tick: their cotangents would add
            raise ValueError(f"a mesh with stage={stages} and fp8_history={config.fp8_history}: a pipeline runs FP8 "
                             "with current scaling only; expected fp8_history=0")
        if not owner.is_initializing():
            return _pipelined(owner, block_cls, x, ctx, config, name, block_kwargs, stages, per_layer,
                              loss_tail), None
    layered = per_layer is not None or isinstance(cache, list)
    if layered and cache is not None and scan and not owner.is_initializing():
        return _layer_by_layer(owner, block_cls, x, ctx, cache, name, block_kwargs, per_layer, num_layers, rounds)
    if cache is not None and scan and not owner.is_initializing():
        return _cached_scan(owner, block_cls, x, ctx, cache, name, block_kwargs, rounds)
    if remat != "none":
        block_cls = nn.remat(block_cls, policy=_REMAT_POLICIES[remat], prevent_cse=not scan)
    elif scan:
        block_cls = nn.remat(block_cls, policy=_keep_costly, prevent_cse=False)
    if scan:
        layer = () if per_layer is None else ({k: jnp.asarray(v) for k, v in per_layer.items()},)
        stack = nn.scan(block_cls, variable_axes={"params": 0, "intermediates": 0},
                        split_rngs={"params": True, "dropout": True},
                        in_axes=(nn.broadcast, 0) + (0,) * len(layer), length=num_layers)
        if rounds > 1:  # the scan sees [L, ...]; the weights are stored [V, L / V, ...] (`stored_rounds`). Mapped
            # out at init only: flax's map_variables(init=True) calls the scan on the stored weights whenever a
            # collection is mutable (a mixture's sown statistics).
            stack = nn.map_variables(stack, "params", trans_in_fn=lambda t: layer_major(t, rounds),
                                     trans_out_fn=lambda t: stored_form(t, rounds), init=owner.is_initializing(),
                                     mutable=owner.is_initializing())
        return stack(name=name, **block_kwargs)(x, ctx, cache, *layer)
    caches = [(None, None)] * num_layers if cache is None else _layer_caches(cache, per_layer, num_layers)
    for i in range(num_layers):
        layer = () if per_layer is None else ({k: v[i] for k, v in per_layer.items()},)
        x, layer_cache = block_cls(name=f"{name}_{i}", **block_kwargs)(x, ctx, caches[i][1], *layer)
        caches[i] = (caches[i][0], layer_cache)
    if cache is None:
        return x, None
    return x, _restack(caches)


def stored_rounds(config, num_layers):
    """V where a scanned stack's weights are stored [V, L / V, ...] instead of [L, ...]: an interleaved pipeline's
    (`pipeline_virtual_stages` V > 1), whose stage s runs the layer chunks s, S + s, 2S + s, ... of L / (V S) layers.
    Stored so, with the second dim split over `stage` (`engine.auto_shard`), each stage holds its chunks of every
    round, and the schedule's [V, S, K, ...] view of them moves no weight ([L, ...] split over `stage` holds a
    stage's layers in one contiguous block, which the schedule would re-lay out every step). The same layers in the
    same memory order (`layer_major` is a reshape), so a checkpoint converts at its boundary (`models.stack_layers`,
    the Hugging Face maps). 1 otherwise (unscanned, or V = 1)."""
    rounds = getattr(config, "pipeline_virtual_stages", 1)
    if not config.scan_layers or rounds == 1:
        return 1
    if num_layers % rounds:
        raise ValueError(f"pipeline_virtual_stages={rounds} cuts a stack of {num_layers} layers into rounds of unequal "
                         "length; expected a value that divides the number of layers")
    return rounds


def layer_major(weights, rounds):
    """A stack's weights [L, ...] from their stored form (`stored_rounds`: [V, L / V, ...] for rounds = V > 1, else
    [L, ...] as they are)."""
    if rounds == 1:
        return weights
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), weights)


def stored_form(weights, rounds):
    """A stack's weights [L, ...] in their stored form (`stored_rounds`): [V, L / V, ...] for rounds = V > 1."""
    if rounds == 1:
        return weights
    return jax.tree.map(lambda a: a.reshape(rounds, a.shape[0] // rounds, *a.shape[1:]), weights)


def _layer_caches(cache, per_layer, num_layers):
    """[(kind, layer i's cache)]: slices of a stacked cache (kind None), or, with per_layer (a split cache), of the
    part ('full' or 'sliding') of each layer's kind."""
    if isinstance(cache, list):  # a cache per layer (paged pools): used as it is, never sliced out of a stack
        return [(list, c) for c in cache]
    kinds = [None if per_layer is None else ("sliding" if per_layer["sliding"][i] else "full")
             for i in range(num_layers)]
    out, taken = [], {}
    for kind in kinds:
        j = taken[kind] = taken.get(kind, -1) + 1
        out.append((kind, jax.tree_util.tree_map(lambda a, j=j: a[j], cache if kind is None else cache[kind])))
    return out


def _restack(caches):
    """[(kind or None, layer cache)] in layer order -> the stacked cache (split by kind when kinds are given)."""
    if caches[0][0] is list:
        return [c for _, c in caches]
    stacked = lambda cs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *cs)  # noqa: E731
    if caches[0][0] is None:
        return stacked([c for _, c in caches])
    return {kind: stacked([c for k, c in caches if k == kind]) for kind in ("full", "sliding")}


def _cached_scan(owner, block_cls, x, ctx, cache, name, block_kwargs, rounds):
    """A scanned stack's cached call (generation) when every layer's cache has one shape: a `lax.scan` of the block
    applied to each layer's slice of the stacked weights `owner`'s `name` and its cache. Not `nn.scan`: before it
    scans, flax traces the body once to check that nothing it broadcasts depends on the loop, and a Pallas kernel the
    body calls outside a custom_vjp (the Triton decode attention) survives that trace's dead-code elimination under
    JAX 0.11 (a `pallas_call` is never removed), so flax refused the scan ("broadcasted variable has a data
    dependency on the scan body") and a scanned model could not generate on a GPU."""
    block, weights = block_cls(parent=None, **block_kwargs), layer_major(owner.variables["params"][name], rounds)

    def body(h, layer):
        w, layer_cache = layer
        return block.apply({"params": w}, h, ctx, layer_cache)

    return jax.lax.scan(body, x, (weights, cache))


def _layer_by_layer(owner, block_cls, x, ctx, cache, name, block_kwargs, per_layer, num_layers, rounds):
    """A scanned stack's cached call when its layers' caches differ in shape: each layer is the block applied to its
    slice of the stacked weights `owner`'s `name`, with its kind's cache (`apply_layers`)."""
    block, weights = block_cls(parent=None, **block_kwargs), layer_major(owner.variables["params"][name], rounds)
    caches = _layer_caches(cache, per_layer, num_layers)
    for i, (kind, layer_cache) in enumerate(caches):
        layer = () if per_layer is None else ({k: v[i] for k, v in per_layer.items()},)
        x, layer_cache = block.apply({"params": jax.tree_util.tree_map(lambda w: w[i], weights)}, x, ctx,
                                     layer_cache, *layer)
        caches[i] = (kind, layer_cache)
    return x, _restack(caches)


def _pipelined(owner, block_cls, x, ctx, config, name, block_kwargs, stages, per_layer, loss_tail):
    """The scanned stack `owner`'s `name` as a pipeline of `stages` stages: each layer is the block applied to its
    slice of the stacked weights (dropout keys folded per layer and micro-batch; per-layer values indexed by it).
    1F1B: the stack and `loss_tail` on `owner`'s other parameters, (loss, aux) (`apply_layers`)."""
    block = block_cls(parent=None, **block_kwargs)
    key = None if block_kwargs.get("deterministic", True) else owner.make_rng("dropout")
    values = {} if per_layer is None else {k: jnp.asarray(v) for k, v in per_layer.items()}

    # A mixture's router statistics are sums: each layer returns its own beside h, and the pipeline adds them up
    # over the layers and micro-batches, so that the loss's router terms are the whole batch's, as without one.
    experts = getattr(config, "num_experts", 0)
    aux = moe.empty_stats(experts) if experts else None

    def layer_fn(w, h, c, layer, micro, closure):
        """Layer `layer` on micro-batch `micro`; closure: (the dropout key or None, the per-layer values), passed in
        (the 1F1B pipeline's custom_vjp rules run this and may not close over traced values). A mixture's layer
        returns (h, its router statistics, `moe.summed_stats`)."""
        key, values = closure
        rngs = {} if key is None else {"dropout": jax.random.fold_in(jax.random.fold_in(key, layer), micro)}
        extra = () if per_layer is None else ({k: v[layer] for k, v in values.items()},)
        if not experts:
            return block.apply({"params": w}, h, c, None, *extra, rngs=rngs)[0]
        (h, _), state = block.apply({"params": w}, h, c, None, *extra, rngs=rngs, mutable=["intermediates"])
        return h, moe.summed_stats(state.get("intermediates", {}), experts)

    weights, microbatches = owner.variables["params"][name], config.pipeline_microbatches or stages
    if config.pipeline_schedule == "1f1b":
        if config.remat != "none":
            layer_fn = jax.checkpoint(layer_fn, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
        if loss_tail is None:
            raise ValueError("pipeline_schedule='1f1b' runs the loss inside the pipeline, and this call asks for the "
                             "model's output; expected pipeline_schedule='gpipe', or the call given its loss "
                             "(DecoderLM's loss_tail, as engine.tasks.lm.lm_loss_fn passes it)")
        tail_fn, inputs = loss_tail
        rest = {k: v for k, v in owner.variables["params"].items() if k != name}
        out = pipeline_1f1b.pipeline_1f1b(
            layer_fn, tail_fn, weights, x, ctx, rest, inputs, stages=stages, microbatches=microbatches,
            fsdp_gather=config.pipeline_fsdp_gather, layer_inputs=(key, values), full_remat=config.remat == "full",
            aux=aux)
        if experts:
            owner.sow("intermediates", moe.STATS, out[2])  # the whole batch's, as router_losses reads them
        return out[:2]
    # GPipe checkpoints each layer itself (`config.remat`'s policy; without remat the scanned stack's, slices
    # recomputed too), so that no tick's slice of the stage's weights is saved for the backward.
    policy = _keep_costly_but_slices if config.remat == "none" else _REMAT_POLICIES[config.remat]
    gpipe_layer = lambda w, h, c, layer, micro: layer_fn(w, h, c, layer, micro, (key, values))  # noqa: E731
    out = pipeline.pipeline(gpipe_layer, weights, x, ctx, stages=stages, microbatches=microbatches,
                            virtual_stages=config.pipeline_virtual_stages, policy=policy,
                            fsdp_gather=config.pipeline_fsdp_gather, aux=aux)
    if not experts:
        return out
    owner.sow("intermediates", moe.STATS, out[1])  # the whole batch's, as router_losses reads them
    return out[0]
