"""Mistral (models/mistral.py) against transformers on tiny random models whose sliding window (4) is shorter than
the rows: logits of a left-padded batch, greedy generation past the window through the ring-buffer KV cache,
checkpoint round trips; a sharded load trained on 2x2x2, LoRA on an int8 base, the named real size and a memory
plan. `parity` and `hf_builder` serve tests/test_gemma.py too."""
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from engine.tasks import planning
from tests.test_models import _assert_same_tree
from tests.test_models_train import test_load_sharded_train_and_generate as train_and_generate
from tests.test_qwen import test_lora_on_an_int8_base_loaded_onto_a_mesh as lora_on_an_int8_base

# 16 tokens a row, the second row left-padded by 5: every real query past the 4th sees more than the window.
B, T = 2, 16
IDS = np.random.RandomState(0).randint(3, 128, (B, T))
MASK = np.ones((B, T), np.int64)
MASK[1, :5] = 0

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def hf_builder(tmp_path_factory, configs):
    """name -> (torch model, directory it was saved to) for `configs` {name: (transformers config class, model
    class, fields)}, built once each with every weight perturbed so that norms are not their initial ones (or
    zeros)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    @functools.cache
    def get(name):
        config_cls, model_cls, fields = configs[name]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval()
        model.load_state_dict({k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()})
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        return model, path

    return get


def hf_logits(hf_model, ids=IDS, mask=MASK):
    import torch

    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)  # what transformers' generate uses for left padding
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                        position_ids=torch.tensor(positions)).logits.numpy()


@functools.lru_cache
def _jit_apply(model):
    return jax.jit(model.apply)


def our_logits(model, params, ids=IDS, mask=MASK):
    return np.asarray(_jit_apply(model)({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))


def parity(hf_model, model, params):
    """Max |logit difference| with transformers over the real (unpadded) positions of the left-padded batch."""
    return np.abs(our_logits(model, params) - hf_logits(hf_model))[MASK.astype(bool)].max()


def check_round_trip(hf_model, path, tmp_path, scan):
    """Logits within 1e-4 of transformers (returned); load -> save -> load is an identity; transformers reads the
    export to the same logits."""
    model, params = models.load_pretrained(path, scan_layers=scan)
    assert model.config.scan_layers == scan
    diff = parity(hf_model, model, params)
    assert diff <= 1e-4
    models.save_pretrained(model, params, str(tmp_path))
    again_model, again = models.load_pretrained(str(tmp_path), scan_layers=scan)
    assert again_model.config == model.config
    _assert_same_tree(params, again)
    import transformers

    assert parity(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval(), model, params) <= 1e-4
    return model, params


def check_greedy_generate(hf_model, model, params, new=12):
    """Greedy tokens equal transformers' for `new` tokens (past the window)."""
    import torch

    ours = np.asarray(models.generate(model, params, jnp.asarray(IDS), attention_mask=jnp.asarray(MASK),
                                      max_new_tokens=new, eos_token_id=2, pad_token_id=0))
    theirs = hf_model.generate(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK), max_new_tokens=new,
                               do_sample=False, eos_token_id=2, pad_token_id=0).numpy()
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], theirs)
    assert (ours[:, theirs.shape[1]:] == 0).all()  # transformers stops once every row has finished


_CONFIGS = {
    "window": ("MistralConfig", "MistralForCausalLM", dict(TINY, sliding_window=4)),
    "no-window": ("MistralConfig", "MistralForCausalLM", dict(TINY, sliding_window=None)),
}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return hf_builder(tmp_path_factory, _CONFIGS)


@pytest.mark.parametrize("name,scan", [("window", False), ("window", True), ("no-window", False)])
def test_logits_match_transformers_and_round_trip(hf_checkpoint, tmp_path, name, scan):
    hf_model, path = hf_checkpoint(name)
    model, params = check_round_trip(hf_model, path, tmp_path, scan)
    assert models.registry.model_type(model) == "mistral"
    assert model.config.sliding_window == (4 if name == "window" else None)
    if name == "window":  # the window matters: the same weights attending to everything differ
        full = models.Mistral(dataclasses.replace(model.config, sliding_window=None))
        assert np.abs(our_logits(full, params) - our_logits(model, params))[MASK.astype(bool)].max() > 1e-2


@pytest.mark.parametrize("scan", [False, True])
def test_greedy_generate_matches_transformers_past_the_window(hf_checkpoint, scan):
    """12 new tokens after 16-token prompts, through a KV cache that keeps 4 slots a layer."""
    hf_model, path = hf_checkpoint("window")
    model, params = models.load_pretrained(path, scan_layers=scan)
    assert model.init_cache(B, 28)["layers"]["k"].shape == (2, B, 4, 2, 16)
    check_greedy_generate(hf_model, model, params)


def test_bad_window_is_refused_in_one_line(hf_checkpoint, tmp_path):
    config = json.loads(open(f"{hf_checkpoint('window')[1]}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 0}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}/config\.json: sliding_window=0; expected a "
                                         r"positive integer or None$"):
        models.load_model(str(tmp_path))


def test_load_sharded_train_and_generate(tmp_path):
    """tests/test_models_train.py's run: the tiny config (window 8 in 16-token rows) saved, loaded onto 2x2x2,
    trained through the Trainer (the loss falls, one compilation), sharded and single-device generation agree."""
    train_and_generate(tmp_path, "mistral")


@pytest.mark.slow  # the same run on Gemma 3 and Qwen is in the default suite
def test_sharded_checkpoint_streams_onto_a_mesh_and_lora_on_an_int8_base(hf_checkpoint, tmp_path):
    """tests/test_qwen.py's LoRA run on a Mistral directory rewritten as several safetensors files: read with
    lora_rank and quantize='int8' straight onto 2x2x2, adapter-only training lowers the loss, the export gives
    transformers the trained model's logits."""
    lora_on_an_int8_base(lambda _: (None, sharded_copy(hf_checkpoint("window")[1], tmp_path / "sharded")), tmp_path)


def sharded_copy(path, to):
    """The checkpoint at `path` rewritten as several safetensors files in `to` (returned as a string)."""
    models.save_pretrained(*models.load_pretrained(path), str(to), max_shard_bytes=64 * 1024)
    assert len(set(json.loads((to / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    return str(to)


@pytest.mark.parametrize("family,name,params", [("mistral", "mistral-7b", 7_241_732_096)])
def test_named_configs_have_the_released_parameter_counts(family, name, params):
    """The counts transformers reports for the released config.json (mistralai/Mistral-7B-v0.1)."""
    shapes = jax.eval_shape(lambda: models.init_params(models.create_model(family, name, scan_layers=True)))
    assert sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(shapes)) == params


@pytest.mark.parametrize("family", ["mistral"])
def test_memory_plan_of_a_tiny_model(family):
    r = planning.plan(model=family, model_config="tiny", mesh="1,8,1", num_devices=8, seq_len=16,
                      compute_dtype="float32")
    tiny = jax.eval_shape(lambda: models.init_params(models.create_model(family, "tiny")))
    assert r["params"] == sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(tiny))
    assert r["bytes"]["total"] > 0 and r["collective_bytes_total"] > 0


def test_train_flops_count_the_keys_inside_the_window():
    """Model FLOPs of a windowed model: a window as long as the rows changes nothing; a shorter one removes the
    attention to the keys outside it (W(W + 1)/2 + (T - W)W pairs a layer instead of T(T + 1)/2)."""
    def flops(window, T):
        return models.train_flops_per_example(models.create_model("mistral", "tiny", sliding_window=window), T)

    assert flops(64, 64) == flops(None, 64)
    per_pair = 12 * 4 * 16 * 2  # heads x head_dim x layers
    assert flops(None, 64) - flops(8, 64) == per_pair * (64 * 65 / 2 - (8 * 9 / 2 + 56 * 8))
