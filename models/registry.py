"""The model families and how a model and its parameters come to be: `FAMILIES` (model_type -> family module),
`get_config` / `create_model` for a named config, `model_type` of a model, and `init_params` / `param_shardings`
for fresh parameters on a layout (`add_fp8_histories`: the fresh FP8 amax histories a loaded checkpoint lacks).
Checkpoint formats live elsewhere (`models.hf`); this table is what they read."""
import functools
import operator

import jax
import jax.numpy as jnp

from kernels.matmul.fp8 import OVERWRITE
from models import gemma2, gemma3, gptj, llama, mistral, mixtral, opt, qwen2, qwen3, qwen3_moe, t5

# model_type -> family module (each has Config, Model, NAMED_CONFIGS, config_from_hf, config_to_hf, hf_tensor_map).
FAMILIES = {"llama": llama, "gptj": gptj, "opt": opt, "t5": t5, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral,
            "gemma2": gemma2, "gemma3_text": gemma3, "mixtral": mixtral, "qwen3_moe": qwen3_moe}


def family(model_type):
    """The family module of a `model_type` (a `FAMILIES` key); ValueError for any other."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; expected one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def model_type(model):
    """The `FAMILIES` key of a model module's class; TypeError for a module of no family."""
    for name, fam in FAMILIES.items():
        if isinstance(model, fam.Model):
            return name
    raise TypeError(f"{type(model).__name__} is not one of the model classes {[f.Model for f in FAMILIES.values()]}")


def get_config(family, name="tiny", **overrides):
    """Named config of a family (a `FAMILIES` key), e.g. get_config('llama', 'llama3-8b', scan_layers=True).
    `overrides` replace any config field."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is unknown; expected one of {sorted(FAMILIES)}")
    named = FAMILIES[family].NAMED_CONFIGS
    if name not in named:
        raise ValueError(f"{family} has no config named {name!r}; expected one of {sorted(named)}")
    return FAMILIES[family].Config(**{**named[name], **overrides})


def create_model(family, name="tiny", **overrides):
    """The model module for a named config (see get_config)."""
    return FAMILIES[family].Model(get_config(family, name, **overrides))


def init_params(model, rng=None, *, layout=None):
    """Fresh random parameters (a nested dict) for `model`. With `layout` (e.g. `engine.auto_layout(mesh)`), each is
    created directly on its sharding (no whole copy on one device; every process of a multi-process run calls it)."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    init = lambda r: model.init(r, *_example_inputs(model))["params"]  # noqa: E731
    if layout is None:
        return jax.jit(init)(rng)
    return jax.jit(init, out_shardings=param_shardings(model, jax.eval_shape(init, rng), layout))(rng)


def add_fp8_histories(model, params, *, layout=None):
    """`params` with a fresh (zero) FP8 amax history (`kernels.matmul.fp8.OVERWRITE`) for every projection of
    `model` (a config with fp8_history > 0) that lacks one: what a checkpoint without them (a Hugging Face one, a run
    without delayed scaling) needs to train with delayed scaling. The other parameters are passed through as they
    are; on `layout`'s shardings when given."""
    abstract = jax.eval_shape(lambda: init_params(model))
    shardings = None if layout is None else param_shardings(model, abstract, layout)
    out = jax.tree.map(lambda x: x, params)  # a copy of the dicts: the caller's tree is not changed
    for path, like in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        keys = tuple(k.key for k in path)
        if keys[-1] != OVERWRITE:
            continue
        node = functools.reduce(lambda tree, key: tree.setdefault(key, {}), keys[:-1], out)
        if OVERWRITE not in node:
            zeros = jnp.zeros(like.shape, like.dtype)
            node[OVERWRITE] = zeros if shardings is None else jax.device_put(
                zeros, functools.reduce(operator.getitem, keys, shardings))
    return out


def param_shardings(model, abstract, layout):
    """The shardings `layout(abstract, apply_fn)` gives `model`'s parameters (shapes `abstract`); `apply_fn(params)`
    runs the model on example inputs, for a layout that reads the dataflow (`engine.auto_layout`). A layout is any
    such function: models know nothing of how the engine splits them."""
    return layout(abstract, lambda p: model.apply({"params": p}, *_example_inputs(model)))


def _example_inputs(model):
    ids = jnp.zeros((1, 8), jnp.int32)
    return (ids, ids) if getattr(model, "is_encoder_decoder", False) else (ids,)
