"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") around the native models.

A config with `lora_rank > 0` gives every projection named in `lora_targets` two float32 adapters beside its kernel,
`lora_a` [in, rank] and `lora_b` [rank, out] (layers.Linear): y = x W + (x A) B alpha / rank; a mixture's expert
stacks named there (gate, up, down) get a pair per expert under `experts/lora/<name>/` ([E, in, rank], [E, rank,
out]: layers.MoE; merged like the others, not written as PEFT adapters). Training only the
adapters (`engine.Trainer(trainable=LORA_TRAINABLE)`) keeps the base weights frozen, so they need no gradient, no
optimizer state and may be stored in 16 bits or as int8 (`models.quantize`): what lets a 7B model fine-tune on one
GPU. `add_lora` puts fresh
adapters on a model read without them (a Hugging Face checkpoint, a finished run); `merge_lora` folds them into the
kernels (for export, or before the next stage adds its own).
"""
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from models import checkpoint, registry
from models.layers import LORA_TARGETS, lora_a_init
from models.quantize import dequantize

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
    and the adapters removed). Parameters without adapters are returned as they are; int8 kernels
    (`models.quantize`) stay int8 without adapters and are dequantised to fold adapters in."""
    if has_lora(params):
        model, params = dequantize(model, params)
    if not has_lora(params):
        return (without_lora(model) if model.config.lora_rank else model), params
    scale = model.config.lora_alpha / model.config.lora_rank

    def folded(weight, pair):
        delta = jnp.einsum("...ir,...ro->...io", pair["lora_a"].astype(jnp.float32),
                           pair["lora_b"].astype(jnp.float32)) * scale
        return (weight.astype(jnp.float32) + delta).astype(weight.dtype)

    def merge(tree):
        if not isinstance(tree, dict):
            return tree
        if "lora_a" in tree and "lora_b" in tree:
            merged = {k: v for k, v in tree.items() if k not in ("lora_a", "lora_b")}
            merged["kernel"] = folded(tree["kernel"], tree)
            return merged
        if isinstance(tree.get("lora"), dict) and "gate" in tree:  # a mixture's experts: a pair per expert weight
            merged = {k: v for k, v in tree.items() if k != "lora"}
            merged.update({name: folded(tree[name], pair) for name, pair in tree["lora"].items()})
            return merged
        return {k: merge(v) for k, v in tree.items()}

    return without_lora(model), merge(params)


def add_lora(model, params, rng=None, *, layout=None):
    """Parameters of `model` (a config with lora_rank > 0) from `params` of the same model without adapters: fresh
    adapters (A random, B zero: the model computes what it computed before) beside every targeted kernel, on the
    shardings of `layout` when given (`models.param_shardings`). ValueError when `params` do not fit the model."""
    if not model.config.lora_rank:
        raise ValueError("add_lora: the model's config has lora_rank=0; expected a model built with lora_rank > 0")
    if has_lora(params):
        raise ValueError("add_lora: params already hold LoRA adapters; merge them first (models.merge_lora)")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    abstract = jax.eval_shape(lambda: registry.init_params(model))
    shardings = None if layout is None else registry.param_shardings(model, abstract, layout)
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


# ----------------------------------------------------------------------------------------------- PEFT adapters
# The adapters alone in the layout of Hugging Face PEFT's `save_pretrained` (what `PeftModel.from_pretrained`, and
# LoRA-serving inference engines, read beside the base model): adapter_config.json and adapter_model.safetensors with
# `base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] for each adapted transformers module.
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _adapted_modules(model):
    """(our module path as stored, [transformers module names, one per layer], stacked) of every projection that
    `model`'s config adapts, from the family's checkpoint map."""
    config = model.config
    for path, names, transpose, stacked in checkpoint.model_entries(model):
        if path[-1] == "kernel" and path[-2] in config.lora_targets and transpose:
            yield path[:-1], [n[:-len(".weight")] for n in names], stacked


def save_lora_adapter(model, params, path):
    """Writes the LoRA adapters of `params` (a model with lora_rank > 0) as a PEFT adapter directory; the base model
    is what `merge_lora` would fold them into, e.g. the checkpoint the run started from."""
    if any("/experts/lora/" in f"/{_path(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]):
        raise ValueError("save_lora_adapter: the model has LoRA pairs on a mixture's experts, which this PEFT "
                         "export does not write; expected the merged export (models.save_pretrained, export_hf.py "
                         "without --peft) or lora_targets without gate, up and down")
    if not model.config.lora_rank or not has_lora(params):
        raise ValueError("save_lora_adapter: expected a model with lora_rank > 0 and parameters holding its adapters")
    from safetensors.numpy import save_file  # noqa: PLC0415
    tensors, modules = {}, set()
    for module, names, stacked in _adapted_modules(model):
        node = checkpoint.get_path(params, module)
        a, b = (np.asarray(jax.device_get(node[k]), np.float32) for k in ("lora_a", "lora_b"))
        if stacked:  # one row per name ([L] or [V, L / V] layers)
            a, b = (x.reshape(len(names), *x.shape[stacked:]) for x in (a, b))
        for i, name in enumerate(names):
            tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray((a[i] if stacked else a).T)
            tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray((b[i] if stacked else b).T)
            modules.add(name.rsplit(".", 1)[-1])
    config = {"peft_type": "LORA", "task_type": "SEQ_2_SEQ_LM" if getattr(model, "is_encoder_decoder", False)
              else "CAUSAL_LM", "r": model.config.lora_rank, "lora_alpha": model.config.lora_alpha,
              "target_modules": sorted(modules), "lora_dropout": model.config.lora_dropout, "bias": "none",
              "fan_in_fan_out": False,
              "use_rslora": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
              "base_model_name_or_path": None}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def load_lora_adapter(model, params, path, *, layout=None):
    """(model with the adapter's LoRA settings, params with its adapters) from a PEFT adapter directory and the base
    model's `params` (without adapters); with `layout`, the adapters are placed on its shardings. ValueError
    for what this LoRA does not express (rsLoRA scaling, trained biases, extra trained modules, a regex target)."""
    config_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG}; expected a PEFT LoRA adapter directory")
    with open(config_file) as f:
        peft = json.load(f)
    unsupported = {"peft_type": peft.get("peft_type") != "LORA", "bias": peft.get("bias", "none") != "none",
                   "use_rslora": bool(peft.get("use_rslora")), "modules_to_save": bool(peft.get("modules_to_save")),
                   "fan_in_fan_out": bool(peft.get("fan_in_fan_out")),
                   "target_modules": not isinstance(peft.get("target_modules"), list)}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{config_file}: {bad[0]}={peft.get(bad[0])!r}; expected peft_type 'LORA', bias 'none', "
                         "no rsLoRA, no modules_to_save, fan_in_fan_out false and a list of target_modules")
    # transformers module names -> ours, from every projection the family has
    everything = model.clone(config=dataclasses.replace(model.config, lora_rank=1, lora_targets=LORA_TARGETS))
    ours = {names[0].rsplit(".", 1)[-1]: module[-1] for module, names, _ in _adapted_modules(everything)}
    unknown = sorted(set(peft["target_modules"]) - set(ours))
    if unknown:
        raise ValueError(f"{config_file}: target_modules {unknown} are not projections of this "
                         f"{registry.model_type(model)} model (those are {sorted(ours)})")
    try:
        adapted = model.clone(config=dataclasses.replace(
            model.config, lora_rank=int(peft["r"]), lora_alpha=float(peft["lora_alpha"]),
            lora_dropout=float(peft.get("lora_dropout") or 0.0),
            lora_targets=tuple(t for t in LORA_TARGETS if t in {ours[m] for m in peft["target_modules"]})))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{config_file}: r / lora_alpha: {e}") from None
    params = add_lora(adapted, params, layout=layout)
    from safetensors import safe_open  # noqa: PLC0415
    with safe_open(os.path.join(path, ADAPTER_WEIGHTS), "np") as f:
        stored = set(f.keys())
        for module, names, stacked in _adapted_modules(adapted):
            node = checkpoint.get_path(params, module)
            for key, kind in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                parts = []
                for name in names:
                    tensor = f"base_model.model.{name}.{kind}.weight"
                    if tensor not in stored:
                        raise ValueError(f"{path}/{ADAPTER_WEIGHTS} has no tensor {tensor!r}")
                    parts.append(f.get_tensor(tensor).T.astype(np.float32))
                value = np.stack(parts) if stacked else parts[0]
                if stacked and value.shape[1:] == tuple(node[key].shape[stacked:]):  # [L] or [V, L / V] layers
                    value = value.reshape(node[key].shape)
                if value.shape != tuple(node[key].shape):
                    raise ValueError(f"{path}: {kind} of {names[0]} is {parts[0].T.shape} (stored [out or r, in or "
                                     f"r]); the model needs {tuple(node[key].shape)} ([in or r, r or out])")
                node[key] = jax.device_put(value, node[key].sharding)
    return adapted, params
