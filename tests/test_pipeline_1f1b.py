"""The 1F1B pipeline schedule (models/pipeline.py `pipeline_1f1b`, `pipeline_schedule='1f1b'`): the LM loss of a
tiny LLaMA run through it equals the unpipelined model's, values and gradients, on meshes that mix stages with data,
tensor parallelism and ZeRO-3, and through the Trainer; dropout masks are GPipe's; the compiled program keeps less
temporary memory than GPipe's at M = 4S and runs its M + 2S - 2 ticks in three phases (forward only, both, backward
only); what it does not support fails in one line."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import kernels
import models
from engine.tasks import lm
from models import pipeline
from tests import trainer_task as tt
from tests.test_pipeline import _on_mesh, assert_train_lm_flag_trains_alike

SEQ = 16


def _model(**options):
    return models.create_model("llama", "tiny", **{"scan_layers": True, "num_layers": 4, "remat": "full",
                                                   "pipeline_schedule": "1f1b", **options})


def _batch(model, rows=8, seq=SEQ):
    ids = jax.random.randint(jax.random.PRNGKey(1), (rows, seq + 1), 0, model.config.vocab_size)
    labels = ids[:, 1:].at[0, :5].set(-100)  # unlabelled positions: the mean is over the batch's labelled tokens
    segments = jnp.ones((rows, seq), jnp.int32).at[1, seq // 2:].set(2)  # a packed row
    return {"input_ids": ids[:, :-1], "labels": labels, "segment_ids": segments}


def _loss(model, train=False, rng=None, implementation=None):
    loss_fn = lm.lm_loss_fn(model, implementation, interpret=implementation == "triton")
    return lambda params, batch: loss_fn(params, batch, rng, train)[0]


def _as_gpipe(model):
    return model.clone(config=dataclasses.replace(model.config, pipeline_schedule="gpipe"))


def _assert_close(got, grads, want, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want_grads))
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * scale, jax.tree_util.keystr(path)


@pytest.mark.parametrize("mesh, options", [
    (dict(stage=2, data=2, model=2), dict(pipeline_microbatches=4)),
    # 8 layers on 4 stages beside ZeRO-3, a micro-batch per stage, no remat (each backward keeps its stage's layers'
    # activations while it runs), the head tied to the embedding (its gradient from both ends of the pipeline).
    pytest.param(dict(stage=4, fsdp=2), dict(num_layers=8, remat="none", tie_word_embeddings=True),
                 marks=pytest.mark.slow),
    # ZeRO-3 inside the stages gathered once a step: the loop, the tail and its tied head manual over data and fsdp.
    (dict(stage=2, fsdp=2, data=2), dict(pipeline_microbatches=2, pipeline_fsdp_gather="step",
                                         tie_word_embeddings=True)),
])
def test_1f1b_equals_the_plain_model(mesh, options):
    model = _model(**options)
    params = models.init_params(model, jax.random.PRNGKey(0))
    batch = _batch(model)
    want, want_grads = jax.jit(jax.value_and_grad(_loss(_as_gpipe(model))))(params, batch)
    fn, placed, placed_batch = _on_mesh(_loss(model), params, batch, engine.make_mesh(**mesh))
    got, grads = fn(placed, placed_batch)
    _assert_close(got, grads, want, want_grads)


@pytest.mark.parametrize("implementation, mesh, options", [
    ("xla", dict(stage=2, data=2, model=2), dict(pipeline_microbatches=4)),
    # the summed loss with the batch's weights, the head tied (its gradient from both ends of the pipeline)
    pytest.param("chunked", dict(stage=2, data=4), dict(pipeline_microbatches=2, tie_word_embeddings=True),
                 marks=pytest.mark.slow),
    # the Triton kernel interpreted, inside the loop's shard_map over data and the custom_vjp's rules
    pytest.param("triton", dict(stage=2, data=2, model=2), dict(pipeline_microbatches=2), marks=pytest.mark.slow),
])
def test_1f1b_takes_the_fused_head_and_loss(implementation, mesh, options):
    """1F1B's tail is given the hidden states and the head's weight (`DecoderLM(loss_tail=, return_hidden=True)`)
    and runs the fused head + loss per micro-batch: the loss and gradients of GPipe's model with the same kernel."""
    model = _model(**options)
    params = models.init_params(model, jax.random.PRNGKey(0))
    batch = _batch(model)
    want, want_grads = jax.jit(jax.value_and_grad(_loss(_as_gpipe(model), implementation=implementation)))(
        params, batch)
    fn, placed, placed_batch = _on_mesh(_loss(model, implementation=implementation), params, batch,
                                        engine.make_mesh(**mesh))
    got, grads = fn(placed, placed_batch)
    _assert_close(got, grads, want, want_grads)


@pytest.mark.parametrize("implementation", [None, pytest.param("xla", marks=pytest.mark.slow)])
def test_shard_map_step_weighs_each_devices_share_before_the_shards_sum(implementation):
    """The shard_map step with ZeRO-3 inside the stages (1F1B's rule for shards) on a batch whose devices hold
    different token counts: one SGD step equals one device's. The step weighs each device's mean by its tokens (the
    loss's cotangent there), and the layers' gradients are reduce-scattered as their backward runs: the weight must
    scale each device's part before that sum (with it applied after, the layers' gradients were 8 % off at fsdp 2,
    10 % at fsdp 4, the loss the same)."""
    model = _model(pipeline_microbatches=2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = tt.lm_rows(8)
    rows[0]["segment_ids"][2:] = 0  # its device's weight differs
    tt.assert_sgd_step_equals_one_device(model, params, rows, engine.make_mesh(stage=2, fsdp=2, model=2),
                                         "shard_map", metrics=(), implementation=implementation)


@pytest.mark.slow
def test_1f1b_dropout_masks_are_gpipes():
    """With dropout both schedules draw each layer's mask from the key folded by layer and micro-batch, and 1F1B's
    backward recomputes its stage with the forward's masks: the same loss and gradients as GPipe's."""
    model = _model(dropout_rate=0.1, attention_dropout_rate=0.1, pipeline_microbatches=4)
    params = models.init_params(model, jax.random.PRNGKey(0))
    batch = _batch(model)
    mesh = engine.make_mesh(stage=2, data=4)

    def value_and_grad(model):
        fn, placed, placed_batch = _on_mesh(_loss(model, True, jax.random.PRNGKey(3)), params, batch, mesh)
        return fn(placed, placed_batch)

    want, want_grads = value_and_grad(_as_gpipe(model))
    got, grads = value_and_grad(model)
    _assert_close(got, grads, want, want_grads)
    plain = jax.jit(_loss(_as_gpipe(model)))(params, batch)
    assert got != plain


@pytest.mark.parametrize("mesh, step", [
    pytest.param(dict(stage=2, data=2, model=2), "jit", marks=pytest.mark.slow),  # CI time: below has the Trainer
    # The shard_map step re-traces the loss's equations (its ZeRO-3 gathers at use): the 1F1B custom_vjp's rules
    # then run outside the trace that built them, so they must close over no traced value (they failed to run:
    # "Computation compiled for 48 inputs but called with 41").
    (dict(stage=2, fsdp=2, model=2), "shard_map"),
])
def test_trainer_trains_1f1b_like_without(mesh, step):
    model = _model(vocab_size=tt.VOCAB, pipeline_microbatches=4)
    params = models.init_params(model, jax.random.PRNGKey(0))
    examples = tt.make_examples(64)

    def collate(rows):
        batch = tt.collate_fn(rows)
        return {**batch, "segment_ids": np.ones_like(batch["input_ids"])}

    def history(model, mesh, step="jit"):
        trainer = engine.Trainer(mesh=mesh, collate_fn=collate, loss_fn=lm.lm_loss_fn(model), params=params,
                                 optimizer=optax.adam(1e-2), parallelism=engine.Parallelism(step=step))
        trainer.fit(examples, per_device_batch_size=4, max_steps=3, log_every=1, eval_examples=examples[:16],
                    eval_every=3)
        return trainer.history

    flat = {k: v for k, v in mesh.items() if k != "stage"}
    want = history(_as_gpipe(model), engine.make_mesh(**flat, devices=jax.devices()[:4]))
    got = history(model, engine.make_mesh(**mesh), step)
    for key in ("loss", "accuracy", "tokens", "eval_loss"):
        np.testing.assert_allclose([h[key] for h in got if key in h], [h[key] for h in want if key in h],
                                   rtol=1e-5, err_msg=key)
    assert any("eval_loss" in h for h in got) and want[2]["loss"] < want[0]["loss"]


@pytest.mark.slow
def test_train_lm_flag_trains_1f1b_like_gpipe(tmp_path):
    """train_lm.py with --pipeline_schedule=1f1b: the same training and eval losses as GPipe's on the same mesh."""
    assert_train_lm_flag_trains_alike(tmp_path, "--pipeline_schedule=1f1b", "--mesh=2,1,2",
                                      "--pipeline_microbatches=4")


def test_1f1b_keeps_less_than_gpipe_and_runs_its_phases():
    """At M = 4S the compiled 1F1B step's temporaries are below GPipe's (GPipe keeps every micro-batch's layer
    inputs and the whole batch's logits at the turn; 1F1B the layer inputs of min(2S - 1, M) micro-batches and one
    micro-batch's logits; measured 2.66 MB against 5.61 MB at S = 4), and its ticks run in three loops: S - 1 forward only, M with
    both halves, S - 1 backward only (M + 2S - 2 in all), where GPipe runs M + S - 1 forward and M + S - 1 backward:
    a stage computes as long as GPipe's (one lock-step loop of M + 2S - 2 forwards and backwards took 1.5x GPipe's
    time, scripts/bench_pipeline.py)."""
    stages, microbatches, rows = 4, 16, 64
    mesh = engine.make_mesh(stage=stages, data=2)
    model = _model(pipeline_microbatches=microbatches)
    params = models.init_params(model, jax.random.PRNGKey(0))
    batch = _batch(model, rows=rows, seq=64)
    compiled = {}
    for name, m in (("1f1b", model), ("gpipe", _as_gpipe(model))):
        fn, placed, placed_batch = _on_mesh(_loss(m), params, batch, mesh)
        compiled[name] = fn.lower(placed, placed_batch).compile()
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temp["1f1b"] < 0.8 * temp["gpipe"], temp
    ticks = pipeline.num_ticks(stages, microbatches)
    # The loops of at most GPipe's ticks (the others are the kernels' own: 128 and 2048 trips).
    trips = {k: sorted(n for n in map(int, re.findall(r'known_trip_count":\{"n":"(\d+)"', c.as_text()))
                       if n <= ticks) for k, c in compiled.items()}
    assert trips["1f1b"] == [stages - 1, stages - 1, microbatches], trips  # one layer a stage: no layer loop
    assert sum(trips["1f1b"]) == pipeline.num_ticks(stages, microbatches, schedule="1f1b")
    assert trips["gpipe"] == [ticks] * 2, trips
    assert pipeline.bubble_fraction(stages, microbatches, schedule="1f1b") == pytest.approx(
        pipeline.bubble_fraction(stages, microbatches)) == pytest.approx(3 / 19)


@pytest.mark.slow
def test_1f1b_beside_the_partitioners_fsdp_runs_one_loop():
    """Where the jit step's partitioner places a stage's ZeRO-3 gathers (an automatic `fsdp`), 1F1B's ticks stay one
    loop of both halves (in loops of one half it moved weights instead of activations: 4.2x the bytes at
    LLaMA-3-70B's size), and the plan's idle share says so."""
    stages, microbatches = 4, 8
    model = _model(pipeline_microbatches=microbatches, num_layers=8)
    params = models.init_params(model, jax.random.PRNGKey(0))
    fn, placed, placed_batch = _on_mesh(_loss(model), params, _batch(model, rows=16), engine.make_mesh(stage=4,
                                                                                                        fsdp=2))
    ticks = pipeline.num_ticks(stages, microbatches, schedule="1f1b")
    trips = [n for n in map(int, re.findall(r'known_trip_count":\{"n":"(\d+)"',
                                            fn.lower(placed, placed_batch).compile().as_text())) if n <= ticks]
    assert trips.count(ticks) == 1 and stages - 1 not in trips, trips
    assert pipeline.bubble_fraction(stages, microbatches, schedule="1f1b", one_loop=True) == pytest.approx(6 / 14)


def test_undifferentiated_1f1b_is_the_loss():
    """Evaluation (no gradient) runs GPipe's forward and the tail on every row: the same loss and metrics."""
    model = _model(pipeline_microbatches=2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    batch = _batch(model)
    loss_fn = lm.lm_loss_fn(model)
    want = jax.jit(lambda p, b: lm.lm_loss_fn(_as_gpipe(model))(p, b, None, False))(params, batch)
    mesh = engine.make_mesh(stage=2, data=4)
    with kernels.under_mesh(mesh):
        got = jax.jit(lambda p, b: loss_fn(p, b, None, False))(params, batch)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5), got, want)


def test_bad_input_fails_in_one_line():
    with pytest.raises(ValueError, match=r"pipeline_schedule='zb'; expected one of \('gpipe', '1f1b'\)"):
        _model(pipeline_schedule="zb")
    with pytest.raises(ValueError, match=r"pipeline_schedule='1f1b' with pipeline_virtual_stages=2; expected "
                                         r"pipeline_virtual_stages=1"):
        _model(pipeline_virtual_stages=2)
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"pipeline_schedule='1f1b' runs the loss inside the pipeline, and this "
                                         r"call asks for the model's output; expected pipeline_schedule='gpipe'"):
        with kernels.under_mesh(engine.make_mesh(stage=2, data=4)):
            jax.eval_shape(lambda p: model.apply({"params": p}, _batch(model)["input_ids"]), params)
