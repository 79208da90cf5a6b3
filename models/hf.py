"""Hugging Face checkpoint directories: read and write config.json + safetensors (single file or sharded with
model.safetensors.index.json), dispatching on config.json's `model_type`. Each family file supplies
config_from_hf / config_to_hf / hf_tensor_map (expanded to the parameter tree by `models.checkpoint`, which LoRA's PEFT
adapters share); everything else format-related lives here, once."""
import dataclasses
import json
import os
import re
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models import checkpoint, layers, lora, registry
from models.quantize import QUANTIZERS, dequantize

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


# config.json's key for the training task an export came from (scripts/export_hf.py writes it; a later export of a
# model read from there writes its own run's, never this one carried over).
EXPORTED_TASK = "redline_task"

def config_from_hf(hf, **options):
    """A transformers config dict -> our config for its family (options: ModelOptions fields such as dtype)."""
    return _config_from_hf(hf, "config", options)


def _config_from_hf(hf, source, options):
    """config_from_hf with `source` (the config file) named in every error: a missing field, a value of the wrong
    type, one the family refuses. One line each, raised here rather than deep inside the model."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source} holds a JSON {type(hf).__name__}; expected an object of config fields")
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"{source} has no 'model_type' (keys: {sorted(hf)}); expected one of "
                         f"{sorted(registry.FAMILIES)}")
    layers.ModelOptions(**options)  # the caller's own errors, checked first so that none is blamed on the file
    try:
        fam = registry.family(model_type)
        config = fam.config_from_hf(hf, hf_config=json.dumps(hf, sort_keys=True), **options)
    except KeyError as e:
        raise ValueError(f"{source} has no {e.args[0]!r}, which a {model_type} config needs") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{source}: {e}") from None
    _check_field_types(config, hf, source, options)
    return config


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _fits(value, kind):
    if kind is bool or isinstance(value, bool):  # JSON true is no number, 1 no boolean
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def _check_field_types(config, hf, source, options):
    """Every int / float / bool / str field of `config` (or None where the field allows it) holds that type: a JSON
    "64" where a number belongs would otherwise fail far from the file, inside the model."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        hint, value = hints[field.name], getattr(config, field.name)
        allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kinds = [t for t in allowed if t in _KINDS]
        if not kinds or (value is None and type(None) in allowed) or any(_fits(value, t) for t in kinds):
            continue
        expected = " or ".join(_KINDS[t] for t in kinds) + (" or null" if type(None) in allowed else "")
        keys = [k for k, v in hf.items() if v is value]  # the config.json field the value came from
        if field.name in options:
            where = f"option {field.name}={value!r}"
        elif keys:
            where = f"{source}: {(field.name if field.name in keys else keys[0])!r} is {value!r}"
        else:
            where = f"{source}: {type(config).__name__}.{field.name} is {value!r}"
        raise ValueError(f"{where} ({type(value).__name__}); expected {expected}")


class _MissingTensorsError(ValueError, KeyError):
    """A checkpoint lacks tensors its config needs. A ValueError like every other broken checkpoint, and a KeyError
    as it was before."""
    __str__ = ValueError.__str__  # KeyError's would quote the message


# Tensors a transformers checkpoint may hold that carry nothing a model lacks: buffers older transformers saved
# (rotary inv_freq, GPT-J's causal-mask biases) and copies of a tied embedding. Any other tensor the model does not
# read is refused: it is most often a trained layer the config does not count.
_REDUNDANT = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.(masked_)?bias|^lm_head\.weight"
                        r"|^(encoder|decoder)\.embed_tokens\.weight)$")


def exported_task(path):
    """The training task (`'sft'`, `'dpo'`, ...) scripts/export_hf.py recorded in a directory's config.json; None for
    other directories."""
    task = _read_json(os.path.join(path, "config.json")).get(EXPORTED_TASK)
    return task if isinstance(task, str) else None


def _read_json(file):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def _tensor_names(file):
    """The names in a safetensors file's header; ValueError naming the file when it cannot be one."""
    try:
        with safe_open(file, "np") as f:
            return set(f.keys())
    except SafetensorError as e:
        size = os.path.getsize(file)
        raise ValueError(f"{file} is empty (0 bytes); expected a safetensors file" if size == 0 else
                         f"{file} is not a readable safetensors file ({size} bytes, truncated or corrupt: {e})"
                         ) from None


def _natural(name):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class _Reader:
    """Tensors of a checkpoint directory by name, read lazily one at a time (memory-mapped by safetensors). Every
    file's header is read first, so a missing, empty, truncated or foreign file is refused before a tensor is read."""

    def __init__(self, path):
        index, single = os.path.join(path, _INDEX), os.path.join(path, _SINGLE)
        if os.path.exists(index):
            weight_map = _read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
                raise ValueError(f"{index} has no 'weight_map' object (tensor name -> file name)")
            self.where = {name: os.path.join(path, file) for name, file in weight_map.items()}
            for file in sorted(set(self.where.values())):
                names = [n for n, f in self.where.items() if f == file]
                if not os.path.isfile(file):
                    raise ValueError(f"{index} names {os.path.basename(file)} (for {len(names)} tensors, e.g. "
                                     f"{names[0]!r}), which {path} does not have")
                absent = sorted(set(names) - _tensor_names(file), key=_natural)
                if absent:
                    raise ValueError(f"{index} puts {len(absent)} tensors in {os.path.basename(file)}, which does "
                                     f"not hold them, e.g. {absent[0]!r}")
        elif os.path.exists(single):
            self.where = dict.fromkeys(_tensor_names(single), single)
        else:
            raise FileNotFoundError(f"{path} has neither {_SINGLE} nor {_INDEX}")
        self.path = path

    def check(self, needed):
        """Refuses, before anything is read, a checkpoint that lacks a tensor of `needed` ({name: the parameter it
        is for}) or holds one the model would drop."""
        missing = [name for name in needed if name not in self.where]
        if missing:
            raise _MissingTensorsError(
                f"checkpoint {self.path} lacks {len(missing)} of the {len(needed)} tensors its config.json needs, the "
                f"first {missing[0]!r} (for params{needed[missing[0]]}); does config.json count more layers than "
                "the checkpoint holds?")
        unused = sorted(set(self.where) - set(needed), key=_natural)
        dropped = [name for name in unused if not _REDUNDANT.search(name)]
        if dropped:
            raise ValueError(f"checkpoint {self.path} holds {len(dropped)} tensors that the model its config.json "
                             f"describes does not use, e.g. {dropped[:3]}; loading would drop them (does config.json "
                             "count fewer layers than the checkpoint holds?)")
        if unused:
            logging.info("load_pretrained(%s): ignored %d redundant tensors: %s", self.path, len(unused), unused[:10])

    def get(self, name):
        try:
            with safe_open(self.where[name], "np") as f:
                return f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{self.where[name]}: tensor {name!r} cannot be read ({e})") from None


def load_pretrained(path, *, dtype=jnp.float32, layout=None, **options):
    """Reads a transformers `save_pretrained` directory. Returns (model, params).

    dtype: the parameters' dtype; the model computes in the dtype of the parameters it is handed (so a Trainer's
    `Precision(compute_dtype=)` governs) unless options name a `dtype`. layout: where parameters go
    (`param_shardings`; e.g. `engine.auto_layout(mesh)`); each tensor is placed directly onto its sharding as it is
    read, so host memory peaks near one (layer-stacked) tensor, not the model.
    options: ModelOptions fields (scan_layers, remat, attention_implementation, mlp_implementation; lora_rank > 0
    adds fresh LoRA adapters, `models.add_lora`).
    """
    model, params, _ = _load(path, dtype, layout, options, classifier=False)
    return model, params


def load_sequence_classifier(path, *, dtype=jnp.float32, layout=None, **options):
    """Reads a transformers `*ForSequenceClassification` directory of a decoder family (LLaMA, GPT-J, OPT): the
    decoder under the classifier and its `score` weight. Returns (model, params, score): the decoder as
    `load_pretrained` gives it, its output head (absent from the checkpoint, unused by a classifier) zero-filled,
    and score float [d_model, num_labels]. Arguments as `load_pretrained`'s."""
    return _load(path, dtype, layout, options, classifier=True)


def load_model(path, *, dtype=jnp.float32, **options):
    """The model a transformers directory holds, from its config.json alone (no weight is read): what
    `load_pretrained` returns beside the parameters."""
    return _model(path, dtype, options)[1]


def _model(path, dtype, options):
    """(config.json's dict, the model it describes); ValueError naming the file for anything wrong in it."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{path} has no config.json")
    hf = _read_json(config_file)
    name = jnp.dtype(dtype).name
    config = _config_from_hf(hf, config_file, {"param_dtype": name, **options})
    architectures = hf.get("architectures") or []
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise ValueError(f"{config_file}: 'architectures' is {architectures!r}; expected a list of class names")
    return hf, registry.family(hf["model_type"]).Model(config)


def _load(path, dtype, layout, options, classifier):
    hf, model = _model(path, dtype, options)
    is_classifier = any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or ())
    if is_classifier != classifier:
        raise ValueError(f"{path} holds a {(hf.get('architectures') or ['?'])[0]}; expected "
                         + ("a *ForSequenceClassification checkpoint" if classifier else
                            "a language model (a sequence classifier loads with load_sequence_classifier)"))
    fam = registry.family(hf["model_type"])
    if classifier and getattr(fam.Model, "is_encoder_decoder", False):
        raise ValueError(f"{path} holds a {hf['model_type']} classifier; expected a decoder-only family")
    config = model.config
    entries = list(checkpoint.tensor_entries(config, fam.hf_tensor_map(config)))
    reader, params = _Reader(path), {}
    reader.check({**{name: checkpoint.path_str(our_path) for our_path, names, _, _ in entries for name in names
                     if not (classifier and our_path[0] == "lm_head")},  # a classifier's head: zero-filled below
                  **({"score.weight": "['score']"} if classifier else {})})
    abstract = jax.eval_shape(lambda: registry.init_params(model))
    shardings = None if layout is None else registry.param_shardings(model, abstract, layout)
    for our_path, names, transpose, stacked in entries:
        expected = checkpoint.get_path(abstract, our_path)
        quantized = config.quantize if jnp.issubdtype(expected.dtype, jnp.integer) else None
        if quantized == "nf4":  # stored two codes a byte: the checkpoint's tensor has twice the rows
            expected = jax.ShapeDtypeStruct((*expected.shape[:-2], 2 * expected.shape[-2], expected.shape[-1]),
                                            expected.dtype)
        if classifier and our_path[0] == "lm_head":
            host = np.zeros(expected.shape, expected.dtype)
        else:
            want = expected.shape[stacked:]  # one tensor's shape (stacked: leading layer / expert dims)
            want_stored = tuple(reversed(want)) if transpose else tuple(want)
            arrays = []
            for hf_name in names:
                a = reader.get(hf_name)
                if a.shape != want_stored:
                    raise ValueError(f"tensor {hf_name!r} in {path} has shape {a.shape}; the config needs "
                                     f"{want_stored} (params{checkpoint.path_str(our_path)})")
                arrays.append(a.T if transpose else a)
            host = np.stack(arrays).reshape(expected.shape[:stacked] + want) if stacked else arrays[0]
            del arrays
            host = host.astype(np.float32 if quantized else expected.dtype)
        values = {our_path[-1]: host}
        if quantized:  # quantised as read, never whole in float on a device
            values = dict(zip((our_path[-1], f"{our_path[-1]}_scale"), QUANTIZERS[quantized](host)))
        for name, array in values.items():
            where = our_path[:-1] + (name,)
            value = (jnp.asarray(array) if shardings is None
                     else jax.device_put(array, checkpoint.get_path(shardings, where)))
            checkpoint.set_path(params, where, value)
        del host, values
    score = None
    if classifier:
        score = reader.get("score.weight").T.astype(jnp.dtype(dtype))
        width = abstract["embed"]["embedding"].shape[1]  # the head's input: hidden states (OPT: projected out)
        if score.shape[0] != width:
            raise ValueError(f"tensor 'score.weight' in {path} has shape {score.shape[::-1]}; the config needs "
                             f"(num_labels, {width})")
    if config.fp8_history:
        params = registry.add_fp8_histories(model, params, layout=layout)
    if config.lora_rank:
        params = lora.add_lora(model, params, layout=layout)
    return model, params, score


def save_pretrained(model, params, path, *, max_shard_bytes=5 * 2**30, score=None, pad_token_id=None):
    """Writes `params` as a transformers checkpoint directory (config.json + safetensors, sharded with an index past
    max_shard_bytes) that `load_pretrained` and transformers' `from_pretrained` read back; LoRA adapters are merged
    into their kernels (`models.merge_lora`). With `score` [d_model,
    num_labels] (a decoder family), a `*ForSequenceClassification` checkpoint instead: the decoder without its
    output head, and `score.weight`; `pad_token_id` tells transformers where a right-padded row ends (its score is
    read at the last token that is not padding)."""
    # A transformers checkpoint has the adapters folded in and float weights.
    model, params = lora.merge_lora(*dequantize(model, params))
    config = model.config
    fam = registry.family(registry.model_type(model))
    os.makedirs(path, exist_ok=True)
    hf = json.loads(config.hf_config) if config.hf_config else {}
    for stale in ("rope_scaling", "rope_theta", "torch_dtype", "architectures", "num_labels", "id2label",
                  "label2id", EXPORTED_TASK):
        hf.pop(stale, None)
    hf.update(fam.config_to_hf(config))
    tensors = {}
    if score is not None:
        score = np.asarray(jax.device_get(score))
        hf["architectures"] = [hf["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(score.shape[1])}
        hf["label2id"] = {v: int(k) for k, v in hf["id2label"].items()}
        if pad_token_id is not None:
            hf["pad_token_id"] = int(pad_token_id)
        tensors["score.weight"] = np.ascontiguousarray(score.T)
    for our_path, names, transpose, stacked in checkpoint.model_entries(model):
        if score is not None and our_path[0] == "lm_head":
            continue
        value = np.asarray(jax.device_get(checkpoint.get_path(params, our_path)))
        value = value.reshape((-1,) + value.shape[stacked:]) if stacked else value  # one row per name
        for i, hf_name in enumerate(names):
            a = value[i] if stacked else value
            tensors[hf_name] = np.ascontiguousarray(a.T if transpose else a)
    hf["dtype"] = str(next(iter(tensors.values())).dtype)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    shards, size = [{}], 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    for stale in [f for f in os.listdir(path) if f.endswith(".safetensors") or f == _INDEX]:
        os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(path, _INDEX), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map},
                  f, indent=2, sort_keys=True)


def load_tokenizer(path):
    """The `tokenizers.Tokenizer` from path/tokenizer.json, or None when the directory has none."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    import tokenizers  # noqa: PLC0415 (optional: installed with transformers)

    return tokenizers.Tokenizer.from_file(file)
