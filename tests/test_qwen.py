"""Qwen2 / 2.5 and Qwen3 (models/qwen2.py, qwen3.py) against transformers on tiny random models: logits of a
left-padded batch, greedy generation, checkpoint round trips; training a sharded load on 2x2x2, LoRA on an int8 base,
the named real sizes, a memory plan and train_lm.py from a Qwen3 directory."""
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.tasks import lm, planning, text_data
from tests.test_models import IDS, MASK, _assert_same_tree, _max_diff, _our_logits
# Other files' tests run here on Qwen checkpoints (imported under names pytest does not collect twice)
from tests.test_models import test_greedy_generate_matches_transformers as greedy_generate_matches_transformers
from tests.test_models import test_logits_match_transformers_and_round_trip as logits_match_and_round_trip
from tests.test_models_train import test_load_sharded_train_and_generate as train_and_generate
from tests.test_scripts import _run

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64,
               rope_parameters=dict(rope_type="default", rope_theta=1000000.0))


_CONFIGS = {
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    # head_dim 32 on a 64-wide residual of 4 heads: q projects 64 -> 128
    "qwen3": ("Qwen3", dict(head_dim=32)),
    "qwen3-bias": ("Qwen3", dict(head_dim=32, attention_bias=True)),
    # a window of 4 from layer max_window_layers = 1 on (transformers' rule): layer 0 full, layer 1 local
    "qwen2-window": ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # the kinds from layer_types: layer 0 local, layer 1 full
    "qwen3-window": ("Qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=4,
                                   layer_types=["sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """name -> (torch model, directory it was saved to), built once, every weight perturbed so that biases, norms and
    the q / k norm scales are not their initial zeros and ones."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    @functools.cache
    def get(name):
        kind, fields = _CONFIGS[name]
        torch.manual_seed(0)
        config = getattr(transformers, f"{kind}Config")(**_COMMON, **fields)
        model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
        model.load_state_dict({k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()})
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        return model, path

    return get


@pytest.mark.parametrize("name,scan", [("qwen2-tied", False), ("qwen3", True), ("qwen3-bias", False)])
def test_logits_match_transformers_and_round_trip(hf_checkpoint, tmp_path, name, scan):
    """tests/test_models.py's check of every family (left-padded batch within 1e-4 of transformers; load, save and
    load again is an identity; transformers reads the export to the same logits), on each Qwen attention variant."""
    logits_match_and_round_trip(hf_checkpoint, tmp_path, name, scan)
    model, params = models.load_pretrained(hf_checkpoint(name)[1], scan_layers=scan)
    family = name.split("-")[0]
    assert models.registry.model_type(model) == family
    attn = params["layers"]["attn"] if scan else params["layers_0"]["attn"]
    assert ("bias" in attn["q"]) == (name != "qwen3") and ("bias" in attn["o"]) == (name == "qwen3-bias")
    assert ("q_norm" in attn) == (family == "qwen3")


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3"])
def test_greedy_generate_matches_transformers(hf_checkpoint, name):
    greedy_generate_matches_transformers(hf_checkpoint, name)


@pytest.mark.parametrize("name,scan", [("qwen2-window", True),  # CI time: the kinds in one scan, the rest slow
                                       pytest.param("qwen2-window", False, marks=pytest.mark.slow),
                                       pytest.param("qwen3-window", True, marks=pytest.mark.slow)])
def test_sliding_window_matches_transformers(hf_checkpoint, tmp_path, name, scan):
    """use_sliding_window as transformers' Qwen2 / Qwen3 read it (the layers from max_window_layers on, or those
    layer_types marks, attend to the 4 newest positions): tests/test_mistral.py's checks on a left-padded batch of
    16 tokens (within 1e-4, the export read back) and greedy generation 12 tokens past the window; the window
    matters."""
    from tests.test_mistral import MASK as MASK16
    from tests.test_mistral import check_greedy_generate, check_round_trip, our_logits

    hf_model, path = hf_checkpoint(name)
    model, params = check_round_trip(hf_model, path, tmp_path, scan)
    assert model.config.sliding_layers == ((False, True) if name == "qwen2-window" else (True, False))
    full = type(model)(dataclasses.replace(model.config, sliding_window=None))
    assert np.abs(our_logits(full, params) - our_logits(model, params))[MASK16.astype(bool)].max() > 1e-2
    check_greedy_generate(hf_model, model, params)


def test_bad_window_configs_are_refused_in_one_line(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("qwen2-tied")
    config = json.loads(open(f"{path}/config.json").read())
    for change, match in (
            (dict(use_sliding_window=True, sliding_window=0), "sliding_window=0; expected a positive integer or None"),
            (dict(layer_types=["full_attention"]), r"layer_types=\['full_attention'\]; expected 2 \(num_layers\) of "
                                                   "'sliding_attention' / 'full_attention'")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}/config\.json: {match}$"):
            models.load_model(str(tmp_path))


def test_sharded_checkpoint_streams_onto_a_mesh(tmp_path):
    """Qwen3 (q / k norms, explicit head_dim) written as several safetensors files and read straight onto its
    auto_shard shardings on 2x2x2: heads over `model`, the per-head-dim norm scales whole, the values unchanged."""
    model = models.create_model("qwen3", "tiny", scan_layers=True)
    params = models.init_params(model, jax.random.PRNGKey(0))
    models.save_pretrained(model, params, str(tmp_path), max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    _, sharded = models.load_pretrained(str(tmp_path), scan_layers=True, layout=engine.auto_layout(mesh))
    specs = {k: tuple(v[n].sharding.spec) for k, v in sharded["layers"]["attn"].items() for n in v}
    assert specs == {"q": (None, "fsdp", "model"), "k": (None, "fsdp", "model"), "v": (None, "fsdp", "model"),
                     "o": (None, "model", "fsdp"), "q_norm": (), "k_norm": ()}
    _assert_same_tree(params, jax.device_get(sharded))


@pytest.mark.parametrize("family", ["qwen3", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_load_sharded_train_and_generate(tmp_path, family):
    """tests/test_models_train.py's run for every family: a directory loaded onto 2x2x2, trained through the Trainer
    (the loss falls, one compilation), then sharded and single-device generation agree."""
    train_and_generate(tmp_path, family)


def train_adapters_only(model, params, mesh, *, rows, steps, drop):
    """Adapter-only training (`models.LORA_TRAINABLE`, Adam 3e-2, 2 rows per device) of `model` on `rows` random
    rows of the tokens 3-10 over `mesh`: the loss falls by more than `drop` and only the adapters move. Returns the
    Trainer."""
    before = jax.device_get(params)
    rng = np.random.RandomState(0)
    examples = [{"tokens": rng.randint(3, 11, 17).astype(np.int32), "segment_ids": np.ones(17, np.int32)}
                for _ in range(rows)]
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model), params=params,
                             optimizer=optax.adam(3e-2), trainable=models.LORA_TRAINABLE)
    trainer.fit(examples, per_device_batch_size=2, max_steps=steps, log_every=steps)
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"] - drop
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(trainer.params)):
        path = engine.sharding.path_str(p)
        assert ("lora" in path) != np.array_equal(a, jax.device_get(b)), path
    return trainer


def test_lora_on_an_int8_base_loaded_onto_a_mesh(hf_checkpoint, tmp_path, reload_atol=2e-5):
    """A transformers Qwen2 directory read with lora_rank and quantize='int8' onto 2x2x2 (projections int8 as read,
    q / k / v biases float and frozen): adapter-only training lowers the loss, and the export (adapters merged,
    weights dequantised) gives transformers the trained model's logits, and ours read back unscanned within
    `reload_atol` of the trained scanned model's (other families' runs pass theirs)."""
    _, path = hf_checkpoint("qwen2-tied")
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    model, params = models.load_pretrained(path, scan_layers=True, lora_rank=8, quantize="int8",
                                           layout=engine.auto_layout(mesh))
    assert params["layers"]["attn"]["q"]["kernel"].dtype == jnp.int8 and models.has_lora(params)
    trainer = train_adapters_only(model, params, mesh, rows=64, steps=6, drop=0.2)
    after = jax.device_get(trainer.params)

    models.save_pretrained(model, trainer.params, str(tmp_path))
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert _max_diff("qwen2", exported, model, after) <= 1e-4
    np.testing.assert_allclose(_our_logits(*models.load_pretrained(str(tmp_path)), IDS, MASK),
                               _our_logits(model, after, IDS, MASK), atol=reload_atol)


@pytest.mark.parametrize("family,name,params", [
    ("qwen2", "qwen2.5-7b", 7_615_616_512), ("qwen3", "qwen3-8b", 8_190_735_360),
    ("qwen3", "qwen3-32b", 32_762_123_264)])
def test_named_configs_have_the_released_parameter_counts(family, name, params):
    """The counts transformers reports for Qwen/Qwen2.5-7B, Qwen/Qwen3-8B and Qwen/Qwen3-32B."""
    shapes = jax.eval_shape(lambda: models.init_params(models.create_model(family, name, scan_layers=True)))
    assert sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(shapes)) == params


def test_memory_plan_of_a_tiny_qwen3():
    r = planning.plan(model="qwen3", model_config="tiny", mesh="1,8,1", num_devices=8, seq_len=16,
                      compute_dtype="float32")
    tiny = jax.eval_shape(lambda: models.init_params(models.create_model("qwen3", "tiny")))
    assert r["params"] == sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(tiny))
    assert r["bytes"]["total"] > 0 and r["collective_bytes_total"] > 0


@pytest.mark.slow  # a new family's directory through a training script (SFT): tests/test_family_scripts.py
def test_train_lm_fine_tunes_a_qwen3_directory(tmp_path):
    model = models.create_model("qwen3", "tiny", vocab_size=320)  # byte-level tokens need 320
    models.save_pretrained(model, models.init_params(model, jax.random.PRNGKey(0)), str(tmp_path / "hf"))
    (tmp_path / "a.txt").write_text("".join(text_data.default_corpus(max_bytes=4_000)))
    out = _run("train_lm.py", f"--init_from={tmp_path / 'hf'}", "--tokenizer=byte", f"--data={tmp_path / 'a.txt'}",
               f"--workdir={tmp_path / 'work'}", "--max_steps=2", "--log_every=1", "--seq_len=16",
               "--per_device_batch_size=1", "--mesh=2,2,2", "--prompts=")
    assert len(re.findall(r"^step +\d+ +loss ", out.stdout, re.M)) == 2, out.stdout
    assert json.loads((tmp_path / "work" / "run.json").read_text())["family"] == "qwen3"
