"""Hugging Face checkpoint directories: read and write config.json + safetensors (single file or sharded with
model.safetensors.index.json), dispatching on config.json's `model_type`. Each family file supplies
config_from_hf / config_to_hf / hf_tensor_map (expanded to the parameter tree by `models.checkpoint`, which LoRA's PEFT
adapters share); everything else format-related lives here, once."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from safetensors import safe_open
from safetensors.numpy import save_file

from models import checkpoint, lora, registry
from models.quantize import QUANTIZERS, dequantize

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def config_from_hf(hf, **options):
    """A transformers config dict -> our config for its family (options: ModelOptions fields such as dtype)."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"config has no 'model_type' (keys: {sorted(hf)}); expected one of "
                         f"{sorted(registry.FAMILIES)}")
    fam = registry.family(model_type)
    return fam.config_from_hf(hf, hf_config=json.dumps(hf, sort_keys=True), **options)


class _Reader:
    """Tensors of a checkpoint directory by name, read lazily one at a time (memory-mapped by safetensors)."""

    def __init__(self, path):
        index = os.path.join(path, _INDEX)
        if os.path.exists(index):
            with open(index) as f:
                self.where = {name: os.path.join(path, file) for name, file in json.load(f)["weight_map"].items()}
        elif os.path.exists(os.path.join(path, _SINGLE)):
            file = os.path.join(path, _SINGLE)
            with safe_open(file, "np") as f:
                self.where = {name: file for name in f.keys()}
        else:
            raise FileNotFoundError(f"{path} has neither {_SINGLE} nor {_INDEX}")
        self.path, self.used = path, set()

    def get(self, name, needed_for):
        if name not in self.where:
            raise KeyError(f"checkpoint {self.path} has no tensor {name!r} (needed for params{needed_for})")
        self.used.add(name)
        with safe_open(self.where[name], "np") as f:
            return f.get_tensor(name)


def load_pretrained(path, *, dtype=jnp.float32, layout=None, **options):
    """Reads a transformers `save_pretrained` directory. Returns (model, params).

    dtype: parameter and computation dtype. layout: where parameters go (`param_shardings`; e.g.
    `engine.auto_layout(mesh)`); each tensor is placed directly onto its sharding as it is read, so host memory peaks
    near one (layer-stacked) tensor, not the model.
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
    return _model(_read_config(path), dtype, options)


def _read_config(path):
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{path} has no config.json")
    with open(config_file) as f:
        return json.load(f)


def _model(hf, dtype, options):
    name = jnp.dtype(dtype).name
    config = config_from_hf(hf, **{"dtype": name, "param_dtype": name, **options})  # checks model_type
    return registry.family(hf["model_type"]).Model(config)


def _load(path, dtype, layout, options, classifier):
    hf = _read_config(path)
    is_classifier = any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or ())
    if is_classifier != classifier:
        raise ValueError(f"{path} holds a {(hf.get('architectures') or ['?'])[0]}; expected "
                         + ("a *ForSequenceClassification checkpoint" if classifier else
                            "a language model (a sequence classifier loads with load_sequence_classifier)"))
    model = _model(hf, dtype, options)
    fam = registry.family(hf["model_type"])
    if classifier and getattr(fam.Model, "is_encoder_decoder", False):
        raise ValueError(f"{path} holds a {hf['model_type']} classifier; expected a decoder-only family")
    config = model.config
    abstract = jax.eval_shape(lambda: registry.init_params(model))
    shardings = None if layout is None else registry.param_shardings(model, abstract, layout)
    reader, params = _Reader(path), {}
    for our_path, names, transpose, stacked in checkpoint.tensor_entries(config, fam.hf_tensor_map(config)):
        expected = checkpoint.get_path(abstract, our_path)
        quantized = config.quantize if jnp.issubdtype(expected.dtype, jnp.integer) else None
        if quantized == "nf4":  # stored two codes a byte: the checkpoint's tensor has twice the rows
            expected = jax.ShapeDtypeStruct((*expected.shape[:-2], 2 * expected.shape[-2], expected.shape[-1]),
                                            expected.dtype)
        if classifier and our_path[0] == "lm_head":
            host = np.zeros(expected.shape, expected.dtype)
        else:
            want = expected.shape[1:] if stacked else expected.shape
            want_stored = tuple(reversed(want)) if transpose else tuple(want)
            arrays = []
            for hf_name in names:
                a = reader.get(hf_name, checkpoint.path_str(our_path))
                if a.shape != want_stored:
                    raise ValueError(f"tensor {hf_name!r} in {path} has shape {a.shape}; the config needs "
                                     f"{want_stored} (params{checkpoint.path_str(our_path)})")
                arrays.append(a.T if transpose else a)
            host = np.stack(arrays) if stacked else arrays[0]
            del arrays
            host = host.astype(np.float32 if quantized else expected.dtype)
        values = {our_path[-1]: host}
        if quantized:  # quantised as read, never whole in float on a device
            values = dict(zip(("kernel", "kernel_scale"), QUANTIZERS[quantized](host)))
        for name, array in values.items():
            where = our_path[:-1] + (name,)
            value = (jnp.asarray(array) if shardings is None
                     else jax.device_put(array, checkpoint.get_path(shardings, where)))
            checkpoint.set_path(params, where, value)
        del host, values
    score = None
    if classifier:
        score = reader.get("score.weight", "['score']").T.astype(jnp.dtype(dtype))
        width = abstract["embed"]["embedding"].shape[1]  # the head's input: hidden states (OPT: projected out)
        if score.shape[0] != width:
            raise ValueError(f"tensor 'score.weight' in {path} has shape {score.shape[::-1]}; the config needs "
                             f"(num_labels, {width})")
    unused = sorted(set(reader.where) - reader.used)
    if unused:
        logging.warning("load_pretrained(%s): ignored %d tensors not used by the model: %s", path, len(unused),
                        unused[:10])
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
                  "label2id"):
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
