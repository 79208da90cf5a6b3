"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") around the native models.

A config with `lora_rank > 0` gives every projection named in `lora_targets` two float32 adapters beside its kernel,
`lora_a` [in, rank] and `lora_b` [rank, out] (layers.Linear): y = x W + (x A) B alpha / rank. Training only the
adapters (`engine.Trainer(trainable=LORA_TRAINABLE)`) keeps the base weights frozen, so they need no gradient, no
optimizer state and may be stored in 16 bits: what lets a 7B model fine-tune on one GPU. `add_lora` puts fresh
adapters on a model read without them (a Hugging Face checkpoint, a finished run); `merge_lora` folds them into the
kernels (for export, or before the next stage adds its own).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp

from models import hf
from models.layers import lora_a_init

# Engine.Trainer(trainable=...) for adapter-only training: the '/'-joined paths of every lora_a and lora_b.
LORA_TRAINABLE = r"(^|/)lora_[ab]$"
_ADAPTER = re.compile(LORA_TRAINABLE)


def _path(path):
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def has_lora(params):
    """Whether a parameter tree holds LoRA adapters."""
    return any(_ADAPTER.search(_path(p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def adapters_off(params):
    """`params` with every lora_b zero: the model without its adapters' contribution, sharing every other array
    (inside a compiled function the zeros cost nothing): the base model of an adapter-trained run, e.g. PPO's
    reference policy, without a second copy of its weights."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if _path(p).endswith("lora_b") else x, params)


def without_lora(model):
    """`model` with lora_rank 0 (the structure `merge_lora`'s parameters have)."""
    return model.clone(config=dataclasses.replace(model.config, lora_rank=0))


def merge_lora(model, params):
    """(model without LoRA, params with each adapter pair folded into its kernel: W + A B alpha / rank, in W's dtype,
    and the adapters removed). Parameters without adapters are returned as they are."""
    if not has_lora(params):
        return (without_lora(model) if model.config.lora_rank else model), params
    scale = model.config.lora_alpha / model.config.lora_rank

    def merge(tree):
        if not isinstance(tree, dict):
            return tree
        if "lora_a" in tree and "lora_b" in tree:
            kernel = tree["kernel"]
            delta = jnp.einsum("...ir,...ro->...io", tree["lora_a"].astype(jnp.float32),
                               tree["lora_b"].astype(jnp.float32)) * scale
            merged = {k: v for k, v in tree.items() if k not in ("lora_a", "lora_b")}
            merged["kernel"] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
            return merged
        return {k: merge(v) for k, v in tree.items()}

    return without_lora(model), merge(params)


def add_lora(model, params, rng=None, *, mesh=None):
    """Parameters of `model` (a config with lora_rank > 0) from `params` of the same model without adapters: fresh
    adapters (A random, B zero: the model computes what it computed before) beside every targeted kernel, on the
    auto_shard layout of `mesh` when given. ValueError when `params` do not fit the model."""
    if not model.config.lora_rank:
        raise ValueError("add_lora: the model's config has lora_rank=0; expected a model built with lora_rank > 0")
    if has_lora(params):
        raise ValueError("add_lora: params already hold LoRA adapters; merge them first (models.merge_lora)")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    abstract = jax.eval_shape(lambda: hf.init_params(model))
    shardings = None if mesh is None else hf._shardings(model, abstract, mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    keys = [_path(p) for p, _ in flat]
    new = [i for i, key in enumerate(keys) if _ADAPTER.search(key)]
    given = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    for key, (_, like) in zip(keys, flat):
        if not _ADAPTER.search(key) and (key not in given or tuple(given[key].shape) != tuple(like.shape)):
            found = "missing" if key not in given else f"of shape {tuple(given[key].shape)}"
            raise ValueError(f"add_lora: parameter {key} is {found}; the model needs {tuple(like.shape)}")
    if len(given) != len(flat) - len(new):
        raise ValueError("add_lora: params hold parameters the model does not have")

    def adapters(rng):  # one compiled call makes every adapter
        return [lora_a_init(jax.random.fold_in(rng, i), flat[i][1].shape) if keys[i].endswith("lora_a")
                else jnp.zeros(flat[i][1].shape, jnp.float32) for i in new]

    placements = None if shardings is None else [jax.tree_util.tree_leaves(shardings)[i] for i in new]
    made = dict(zip(new, jax.jit(adapters, out_shardings=placements)(rng)))
    leaves = [made[i] if i in made else given[key] for i, key in enumerate(keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
