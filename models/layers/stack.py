"""The layer stack: a block applied num_layers times, as one nn.scan over stacked weights or as separate sub-trees,
with remat, and as a pipeline (`models.pipeline`) under a mesh with a `stage` axis."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from models import pipeline

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight-matmul outputs
}


def apply_layers(block_cls, x, ctx, cache, config, *, num_layers=None, name="layers", owner=None, **block_kwargs):
    """Runs the blocks of a stack (config.num_layers unless given); call from inside a parent's compact method.

    A block is a Module whose __call__(x, ctx, layer_cache) returns (x, layer_cache); it is built with
    config=config and block_kwargs. config.scan_layers: one nn.scan with parameters stacked along a leading
    [num_layers] axis under `name`; else separate `{name}_{i}` sub-trees. cache: the model's cache dict or None; its
    'layers' are stacked [num_layers, ...] either way, so generation does not care which. config.remat wraps each
    block in nn.remat. Under a mesh with a `stage` axis (and no cache) the scanned stack runs as a pipeline
    (`models.pipeline`); `owner`, the calling module, lends it the stacked weights, and a stack without an owner
    refuses such a mesh. Returns (x, new cache['layers'] or None)."""
    num_layers = config.num_layers if num_layers is None else num_layers
    scan, remat = config.scan_layers, config.remat
    cache = None if cache is None else cache["layers"]
    block_kwargs = {"config": config, **block_kwargs}
    if remat != "none" and remat not in _REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; expected 'none', 'full' or 'dots'")
    stages = pipeline.num_stages()
    if stages > 1 and cache is None:
        if owner is None:
            raise ValueError(f"a mesh with stage={stages}: this model's layer stack '{name}' cannot run as a "
                             "pipeline (decoder-only families can); expected a mesh with stage=1")
        if not scan:
            raise ValueError(f"a mesh with stage={stages} needs scan_layers=True (the pipeline splits the stacked "
                             "layer weights); got scan_layers=False")
        if not owner.is_initializing():
            return _pipelined(owner, block_cls, x, ctx, config, name, block_kwargs, stages), None
    if remat != "none":
        block_cls = nn.remat(block_cls, policy=_REMAT_POLICIES[remat], prevent_cse=not scan)
    if scan:
        stack = nn.scan(block_cls, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                        in_axes=(nn.broadcast, 0), length=num_layers)
        return stack(name=name, **block_kwargs)(x, ctx, cache)
    caches = []
    for i in range(num_layers):
        layer_cache = None if cache is None else jax.tree_util.tree_map(lambda a: a[i], cache)
        x, layer_cache = block_cls(name=f"{name}_{i}", **block_kwargs)(x, ctx, layer_cache)
        caches.append(layer_cache)
    if cache is None:
        return x, None
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *caches)


def _pipelined(owner, block_cls, x, ctx, config, name, block_kwargs, stages):
    """The scanned stack `owner`'s `name` as a pipeline of `stages` stages: each layer is the block applied to its
    slice of the stacked weights (dropout keys folded per layer and micro-batch)."""
    block = block_cls(parent=None, **block_kwargs)
    key = None if block_kwargs.get("deterministic", True) else owner.make_rng("dropout")

    def layer_fn(w, h, c, layer, micro):
        rngs = {} if key is None else {"dropout": jax.random.fold_in(jax.random.fold_in(key, layer), micro)}
        return block.apply({"params": w}, h, c, None, rngs=rngs)[0]

    if config.remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
    return pipeline.pipeline(layer_fn, owner.variables["params"][name], x, ctx, stages=stages,
                             microbatches=config.pipeline_microbatches or stages)
