"""Broken Hugging Face directories and bad sharding overrides are refused at the boundary: one ValueError line that
names the file (or parameter) and the problem, raised without a chained traceback from inside the engine."""
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import engine
import models


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny LLaMA (2 layers of 9 tensors) written by our own save_pretrained, single file and sharded."""
    model = models.create_model("llama", "tiny")
    params = models.init_params(model, jax.random.PRNGKey(0))
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    models.save_pretrained(model, params, str(single))
    models.save_pretrained(model, params, str(sharded), max_shard_bytes=32 * 1024)
    return single, sharded


@pytest.fixture
def checkpoint(saved_llama, tmp_path):
    """A fresh copy of the single-file checkpoint to break."""
    shutil.copytree(saved_llama[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def _refused(load, path, match):
    with pytest.raises(ValueError, match=match) as info:
        load(str(path))
    message, error = str(info.value), info.value
    chained = error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__)
    assert "\n" not in message and not chained, message
    return message


def _edit_config(path, change):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(change(config)))


@pytest.mark.parametrize("change, match", [
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"},
     r"config\.json has no 'hidden_size', which a llama config needs"),
    (lambda c: {**c, "hidden_size": "64"}, r"config\.json: 'hidden_size' is '64' \(str\); expected an integer"),
    (lambda c: {**c, "rms_norm_eps": "1e-6"}, r"config\.json: 'rms_norm_eps' is '1e-6' \(str\); expected a number"),
    (lambda c: {**c, "tie_word_embeddings": "no"}, r"'tie_word_embeddings' is 'no' \(str\); expected true or false"),
    (lambda c: {**c, "head_dim": [16]}, r"'head_dim' is \[16\] \(list\); expected an integer or null"),
    (lambda c: {**c, "model_type": "bloom"}, r"config\.json: model_type 'bloom' is not supported; expected one of"),
    (lambda c: {**c, "model_type": ["llama"]}, r"config\.json: model_type \['llama'\] is not supported"),
    (lambda c: {**c, "architectures": "LlamaForCausalLM"}, r"config\.json: 'architectures' is 'LlamaForCausalLM'; "
                                                           r"expected a list of class names"),
    (lambda c: [c], r"config\.json holds a JSON list; expected an object of config fields"),
])
def test_bad_config_json_is_refused_naming_the_file_and_field(checkpoint, change, match):
    _edit_config(checkpoint, change)
    for load in (models.load_pretrained, models.load_model):
        _refused(load, checkpoint, match)


def test_config_json_that_is_not_json(checkpoint):
    (checkpoint / "config.json").write_text('{"model_type": "llama",')
    _refused(models.load_model, checkpoint, r"config\.json is not valid JSON: Expecting")
    (checkpoint / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    _refused(models.load_pretrained, checkpoint, r"config\.json is not valid JSON")


def test_a_caller_option_is_not_blamed_on_the_file(checkpoint):
    with pytest.raises(ValueError, match=r"^lora_rank=-1; expected an integer >= 0"):
        models.load_pretrained(str(checkpoint), lora_rank=-1)


@pytest.mark.parametrize("corrupt, match", [
    (lambda data: data[:len(data) // 2], r"model\.safetensors is not a readable safetensors file \(\d+ bytes, "
                                         r"truncated or corrupt: .*file not fully covered\)"),
    (lambda data: data[:6], r"model\.safetensors is not a readable safetensors file \(6 bytes, truncated or corrupt"),
    (lambda data: np.random.RandomState(0).bytes(len(data)), r"model\.safetensors is not a readable safetensors"),
    (lambda data: b"", r"model\.safetensors is empty \(0 bytes\); expected a safetensors file"),
])
def test_broken_safetensors_file_is_refused(checkpoint, corrupt, match):
    file = checkpoint / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    _refused(models.load_pretrained, checkpoint, match)


def test_sharded_checkpoint_with_a_missing_or_wrong_shard(saved_llama, tmp_path):
    shutil.copytree(saved_llama[1], tmp_path, dirs_exist_ok=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    moved = tmp_path / "moved.bin"
    os.rename(tmp_path / shards[1], moved)
    _refused(models.load_pretrained, tmp_path, rf"model\.safetensors\.index\.json names {shards[1]} \(for \d+ "
                                               r"tensors, e\.g\. '.*'\), which .* does not have")
    os.rename(moved, tmp_path / shards[1])
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]  # the index says a tensor is where it is not
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(models.load_pretrained, tmp_path, rf"index\.json puts 1 tensors in {shards[1]}, which does not hold "
                                               rf"them, e\.g\. '{name}'")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": list(index["weight_map"])}))
    _refused(models.load_pretrained, tmp_path, r"index\.json has no 'weight_map' object")


def test_more_layers_in_the_config_than_in_the_checkpoint(checkpoint):
    _edit_config(checkpoint, lambda c: {**c, "num_hidden_layers": 3})
    message = _refused(models.load_pretrained, checkpoint,
                       r"lacks 9 of the 30 tensors its config\.json needs, the first "
                       r"'model\.layers\.2\.self_attn\.q_proj\.weight' \(for params\['layers_2'\]\['attn'\]\['q'\]"
                       r"\['kernel'\]\); does config\.json count more layers than the checkpoint holds\?")
    assert str(checkpoint) in message


def test_fewer_layers_in_the_config_than_in_the_checkpoint(checkpoint):
    """Loading would silently drop the trained layers past the config's count (it used to be a logged warning)."""
    _edit_config(checkpoint, lambda c: {**c, "num_hidden_layers": 1})
    _refused(models.load_pretrained, checkpoint,
             r"holds 9 tensors that the model its config\.json describes does not use, e\.g\. "
             r"\['model\.layers\.1\.input_layernorm\.weight', 'model\.layers\.1\.mlp\.down_proj\.weight', "
             r"'model\.layers\.1\.mlp\.gate_proj\.weight'\]; loading would drop them")


def test_redundant_buffers_and_tied_copies_are_still_ignored(checkpoint, saved_llama):
    """What older transformers saved beside the weights (rotary inv_freq, a tied head's copy) carries nothing."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
             "lm_head.weight": tensors["model.embed_tokens.weight"]}
    _edit_config(checkpoint, lambda c: {**c, "tie_word_embeddings": True})
    tensors.pop("lm_head.weight", None)
    save_file({**tensors, **extra}, str(checkpoint / "model.safetensors"))
    model, params = models.load_pretrained(str(checkpoint))
    assert model.config.tie_word_embeddings and "lm_head" not in params


@pytest.mark.parametrize("spec, axis", [(P("model", "model"), "model"), (P(("data", "model"), "model"), "model"),
                                        (P(("data", "data")), "data"), (P("fsdp", ("model", "fsdp")), "fsdp")])
def test_auto_shard_refuses_an_override_naming_a_mesh_axis_twice(spec, axis):
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    params = {"mlp": {"kernel": jax.ShapeDtypeStruct((64, 128), np.float32)}}
    with pytest.raises(ValueError, match=rf"sharding rule 'mlp' gives {re.escape(str(spec))}, which "
                                         rf"names mesh axis '{axis}' twice, for parameter 'mlp/kernel' of shape "
                                         r"\(64, 128\); a mesh axis may split at most one dim, once") as info:
        engine.auto_shard(params, mesh, rules=[("mlp", spec)])
    assert "\n" not in str(info.value)
