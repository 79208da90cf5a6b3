"""Gemma 2 and Gemma 3 text (models/gemma2.py, gemma3.py) against transformers on tiny random models whose local
layers' window (4) is shorter than the rows: logits of a left-padded batch, greedy generation past the window (ring
buffers for the local layers, whole-length caches for the global ones), checkpoint round trips, the released
config.json format; the local / global stack scanned with remat, as a pipeline and in the shard_map step's
overlapped stack; a sharded load trained on 2x2x2, LoRA on an int8 base, the named real sizes and a memory plan."""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.step import layer_scan
from engine.tasks import lm
from tests.test_mistral import (MASK, TINY, B, check_greedy_generate, check_round_trip, hf_builder, our_logits,
                                sharded_copy)
from tests.test_mistral import test_memory_plan_of_a_tiny_model as memory_plan_of_a_tiny_model
from tests.test_mistral import test_named_configs_have_the_released_parameter_counts as named_config_counts
from tests.test_models import _assert_same_loss_and_grads
from tests.test_models_train import test_load_sharded_train_and_generate as train_and_generate
from tests.test_pipeline import test_pipelined_stack_equals_the_plain_one as pipelined_stack_equals_plain
from tests.test_qwen import test_lora_on_an_int8_base_loaded_onto_a_mesh as lora_on_an_int8_base
from tests.test_step import MESHES, _assert_same_run, _packed_rows

_GEMMA = dict(TINY, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=4)
_CONFIGS = {
    # soft-caps small enough that tanh bends the logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # local, local, global twice; a linear-scaled global rope
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _GEMMA, num_hidden_layers=6, sliding_window_pattern=3, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return hf_builder(tmp_path_factory, _CONFIGS)


@pytest.mark.parametrize("name,scan", [("gemma2", False), ("gemma2", True), ("gemma3", False), ("gemma3", True)])
def test_logits_match_transformers_and_round_trip(hf_checkpoint, tmp_path, name, scan):
    """Within 1e-4 of transformers (measured 2e-6 for Gemma 2, 4e-6 for Gemma 3, logits up to 3.7), an identity
    round trip, the export read back by transformers; and the window, the soft-caps and Gemma 3's local rope each
    change the logits (so the parity covers them)."""
    hf_model, path = hf_checkpoint(name)
    model, params = check_round_trip(hf_model, path, tmp_path, scan)
    c = model.config
    assert models.registry.model_type(model) == ("gemma2" if name == "gemma2" else "gemma3_text")
    assert c.sliding_layers == ((True, False) * 2 if name == "gemma2" else (True, True, False) * 2)
    variants = [dict(sliding_window=64)]  # as long as the rows: no window
    variants += [dict(attn_logit_softcap=None), dict(final_logit_softcap=None)] if name == "gemma2" else [
        dict(rope_local_theta=c.rope_theta, rope_local_scaling=c.rope_scaling)]
    for change in variants:
        other = type(model)(dataclasses.replace(c, **change))
        assert np.abs(our_logits(other, params) - our_logits(model, params))[MASK.astype(bool)].max() > 1e-3, change


def test_released_gemma3_config_format_reads_the_same(hf_checkpoint, tmp_path):
    """A config.json as Google released Gemma 3 (transformers 4: rope_theta, rope_scaling and rope_local_base_freq,
    sliding_window_pattern instead of layer_types) gives the config transformers 5's own file gives."""
    _, path = hf_checkpoint("gemma3")
    config = json.loads(open(f"{path}/config.json").read())
    released = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    released.update(rope_theta=1000000.0, rope_scaling={"factor": 2.0, "rope_type": "linear"},
                    rope_local_base_freq=10000.0, sliding_window_pattern=3)
    (tmp_path / "config.json").write_text(json.dumps(released))
    assert models.load_model(str(tmp_path)).config == models.load_model(path).config


@pytest.mark.parametrize("name,scan", [("gemma2", True), ("gemma3", False),
                                       pytest.param("gemma3", True, marks=pytest.mark.slow)])
def test_greedy_generate_matches_transformers_past_the_window(hf_checkpoint, name, scan):
    """12 new tokens after 16-token prompts: local layers keep 4-slot rings, global ones every position."""
    hf_model, path = hf_checkpoint(name)
    model, params = models.load_pretrained(path, scan_layers=scan)
    cache = model.init_cache(B, 28)["layers"]
    local, full = (2, 2) if name == "gemma2" else (4, 2)
    assert cache["sliding"]["k"].shape == (local, B, 4, 2, 16) and cache["full"]["k"].shape == (full, B, 28, 2, 16)
    check_greedy_generate(hf_model, model, params)


@pytest.mark.slow
def test_beam_search_reorders_split_caches_like_transformers(hf_checkpoint):
    """3 beams, 8 tokens past the window: the rings and whole-length caches reordered by beam as transformers'."""
    import torch

    hf_model, path = hf_checkpoint("gemma3")
    model, params = models.load_pretrained(path, scan_layers=True)
    ids = np.random.RandomState(0).randint(3, 128, (B, 16))
    ours = np.asarray(models.generate(model, params, jnp.asarray(ids), attention_mask=jnp.asarray(MASK),
                                      max_new_tokens=8, num_beams=3, eos_token_id=2, pad_token_id=0))
    theirs = hf_model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(MASK), max_new_tokens=8,
                               num_beams=3, do_sample=False, eos_token_id=2, pad_token_id=0).numpy()
    np.testing.assert_array_equal(ours[:, :theirs.shape[1]], theirs)


@pytest.mark.slow
def test_int8_kv_cache_generates_like_the_float_one(hf_checkpoint):
    _, path = hf_checkpoint("gemma3")
    model, params = models.load_pretrained(path, scan_layers=True)
    ids, mask = jnp.asarray(np.random.RandomState(0).randint(3, 128, (B, 16))), jnp.asarray(MASK)
    run = lambda dtype: np.asarray(models.generate(model, params, ids, attention_mask=mask,  # noqa: E731
                                                   max_new_tokens=8, kv_cache_dtype=dtype))
    np.testing.assert_array_equal(run("int8"), run(None))


@pytest.mark.parametrize("family", ["gemma2", pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_scanned_remat_stack_keeps_logits_and_gradients(family):
    """The local / global layers as one remat'd scan (each layer's kind scanned beside its weights) give the
    unscanned stack's loss and gradients."""
    model = models.create_model(family, "tiny")
    params = models.init_params(model, jax.random.PRNGKey(1))
    scanned, stacked = models.stack_layers(model, params)
    _assert_same_loss_and_grads(stacked, scanned.clone(config=dataclasses.replace(scanned.config, remat="full")),
                                scanned, atol=2e-6)
    np.testing.assert_allclose(our_logits(scanned, stacked), our_logits(model, params), atol=1e-5)


@pytest.mark.slow
def test_pipelined_stack_equals_the_plain_one():
    """tests/test_pipeline.py's check on Gemma 2's alternating stack: stage 2 x data 2 x model 2, remat."""
    pipelined_stack_equals_plain("gemma2", dict(stage=2, data=2, model=2), dict(remat="full",
                                                                               pipeline_microbatches=4))


@pytest.mark.slow
def test_shard_map_step_runs_the_overlapped_layer_stack():
    """The shard_map step takes Gemma 3's remat'd local / global scan as its hand-pipelined ZeRO-3 stack and updates
    as the jit step does."""
    model = models.create_model("gemma3_text", "tiny", scan_layers=True, remat="full")
    params = models.init_params(model, jax.random.PRNGKey(1))
    calls, real = [], layer_scan.pipelined_scan
    layer_scan.pipelined_scan = lambda *a: calls.append(1) or real(*a)
    try:
        runs = []
        for kind in ("jit", "shard_map"):
            trainer = engine.Trainer(mesh=engine.make_mesh(**MESHES["1x8x1"]), collate_fn=lm.collate_lm,
                                     loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(0.5),
                                     parallelism=engine.Parallelism(step=kind))
            trainer.fit(_packed_rows(16, seed=1), per_device_batch_size=1, max_steps=2, log_every=2)
            runs.append(trainer)
    finally:
        layer_scan.pipelined_scan = real
    assert calls
    _assert_same_run(*runs)


@pytest.mark.slow  # the default suite trains Gemma 2 through the scripts (tests/test_family_scripts.py)
@pytest.mark.parametrize("family", ["gemma3_text", "gemma2"])
def test_load_sharded_train_and_generate(tmp_path, family):
    """tests/test_models_train.py's run: the tiny config (window 8 in 16-token rows) saved, loaded onto 2x2x2,
    trained through the Trainer (the loss falls, one compilation), sharded and single-device generation agree."""
    train_and_generate(tmp_path, family)


@pytest.mark.parametrize("name", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_sharded_checkpoint_streams_onto_a_mesh_and_lora_on_an_int8_base(hf_checkpoint, tmp_path, name):
    """tests/test_qwen.py's LoRA run on a Gemma directory rewritten as several safetensors files: read with
    lora_rank and quantize='int8' straight onto 2x2x2 (the norms float and frozen), adapter-only training lowers the
    loss, the export gives transformers the trained model's logits."""
    # Gemma 2's reload may differ by more than 2e-5 (1.6e-5 here, 4.6e-5 reported): not the merge, nor the soft-caps or
    # the window, but float32 rounding of its trained GeGLU stack run as a scan. In float64 the int8 + LoRA model and
    # its merged export agree within 1.5e-6 (the norms' statistics stay float32); in float32 the trained scanned stack
    # ends 1.7e-5 from float64 (4e-5 with the merged weights), the same weights unscanned 2.9e-6, with fresh random
    # adapters or SiLU in place of GeLU about 1e-6, and the caps or window removed change nothing. The reload compares
    # the scanned trained model with the unscanned export, so it sees the scanned program's error.
    lora_on_an_int8_base(lambda _: (None, sharded_copy(hf_checkpoint(name)[1], tmp_path / "sharded")), tmp_path,
                         reload_atol=2e-5 if name == "gemma3" else 6e-5)


def test_bad_configs_are_refused_in_one_line(hf_checkpoint, tmp_path):
    config = json.loads(open(f"{hf_checkpoint('gemma2')[1]}/config.json").read())
    for change, match in ((dict(use_bidirectional_attention=True), "'use_bidirectional_attention' is true; expected "
                                                                   r"false or null \(a causal LM\)"),
                          (dict(layer_types=["sliding_attention"] * 3), r"layer_types=\['sliding_attention', "
                                                                        r"'sliding_attention', 'sliding_attention'\]; "
                                                                        r"expected 4 \(num_layers\) of "),
                          (dict(sliding_window=0), r"sliding_window=0; expected a positive integer or None")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}/config\.json: {match}"):
            models.load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"^sliding_window=None with 'sliding_attention' layers; expected a window"):
        models.get_config("gemma3_text", "tiny", sliding_window=None)  # its local layers' rope needs them local


@pytest.mark.parametrize("family,name,params", [
    ("gemma2", "gemma-2-2b", 2_614_341_888), ("gemma2", "gemma-2-9b", 9_241_705_984),
    ("gemma2", "gemma-2-27b", 27_227_128_320), ("gemma3_text", "gemma-3-12b", 11_766_034_176),
    ("gemma3_text", "gemma-3-27b", 27_009_346_304)])
def test_named_configs_have_the_released_parameter_counts(family, name, params):
    """The counts transformers reports for the released configs (Gemma 3: the language model of the -pt
    checkpoints, without the vision tower)."""
    named_config_counts(family, name, params)


@pytest.mark.slow  # plans of a family run by default in tests/test_mistral.py
def test_memory_plan_of_a_tiny_gemma3():
    """tests/test_mistral.py's tiny plan, through the scanned local / global stack."""
    memory_plan_of_a_tiny_model("gemma3_text")


def test_the_fused_head_and_loss_refuses_a_final_soft_cap():
    """The fused head + loss kernel computes plain logits: Gemma 2's final soft-cap would be left out of the loss
    silently, so it is refused in one line; plain logits take it."""
    model = models.create_model("gemma2", "tiny")
    with pytest.raises(ValueError, match=r"loss_implementation='xla' with a final logit soft-cap .*plain logits"):
        lm.lm_loss_fn(model, "xla")
    lm.lm_loss_fn(model, None)
