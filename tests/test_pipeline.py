"""Pipeline parallelism (models/pipeline.py, the mesh's `stage` axis, engine.auto_shard's stage rule): the pipelined
stack equals the plain one, values and gradients, on meshes that mix stages with data, ZeRO-3 and tensor
parallelism, with GPipe's and the interleaved schedule; each stage holds only its layers and GPipe's compiled step
passes activations (collective-permutes), never weights, between stages, and reduces weight gradients over `data`
once a step; the compiled tick loops run V M + S - 1 ticks; the Trainer trains the same on a pipeline as without;
bad input fails in one line."""
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

import engine
import kernels
import models
from engine.tasks import lm
from models import pipeline
from tests import trainer_task as tt

ROWS, SEQ = 8, 16


def _model(family="llama", **options):
    return models.create_model(family, "tiny", **{"scan_layers": True, "num_layers": 4, **options})


def _loss(model):
    def loss(params, ids):
        logits = model.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
    return loss


def _ids(model, rows=ROWS):
    return jax.random.randint(jax.random.PRNGKey(1), (rows, SEQ), 0, model.config.vocab_size)


def _on_mesh(loss, params, ids, mesh):
    """(value_and_grad compiled for `mesh` under it, placed params, placed ids), the params on auto_shard's layout."""
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: loss(p, ids))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def value_and_grad(p, ids):
        with kernels.under_mesh(mesh):
            return jax.value_and_grad(loss)(p, ids)

    return (jax.jit(value_and_grad), jax.device_put(params, shardings),
            jax.device_put(ids, NamedSharding(mesh, P(("data", "fsdp")))))


@pytest.mark.parametrize("family, mesh, options", [
    ("llama", dict(stage=2, data=2, model=2), dict(remat="full", pipeline_microbatches=4)),
    pytest.param("gptj", dict(stage=4, data=2), dict(remat="none"), marks=pytest.mark.slow),
    pytest.param("opt", dict(stage=2, fsdp=2, model=2), dict(remat="dots", pipeline_microbatches=2),
                 marks=pytest.mark.slow),
    # Sequence parallelism inside the stages: the token constraints gain the stages' `stage` dim.
    pytest.param("llama", dict(stage=2, data=2, model=2), dict(remat="full", pipeline_microbatches=2,
                                                              sequence_parallel=True), marks=pytest.mark.slow),
    # The Pallas kernels inside the stages (interpreted): their shard_map takes `stage` as a manual axis.
    pytest.param("llama", dict(stage=2, data=2, model=2), dict(
        remat="full", pipeline_microbatches=2, attention_implementation="triton", mlp_implementation="triton",
        kernel_interpret=True), marks=pytest.mark.slow),
    # Context parallelism inside the stages: Ulysses (4 heads over context 2), the zigzag ring (1 head per model
    # shard), interpreted Triton kernels; the exchange's shard_map takes `stage` as a manual axis ('xla' too).
    ("llama", dict(stage=2, context=2, data=2), dict(remat="full", pipeline_microbatches=2)),
    pytest.param("llama", dict(stage=2, context=2, model=2), dict(remat="full", pipeline_microbatches=2, num_heads=2),
                 marks=pytest.mark.slow),
    pytest.param("llama", dict(stage=2, context=2, data=2), dict(
        remat="full", pipeline_microbatches=2, attention_implementation="triton", mlp_implementation="triton",
        kernel_interpret=True), marks=pytest.mark.slow),
    # The interleaved schedule: 4 layers = 2 stages x 2 virtual stages of 1 layer; 8 = 4 x 2 x 1 beside ZeRO-3, with
    # more micro-batches than stages (the last stage's outputs wait for stage 0).
    ("llama", dict(stage=2, data=2, model=2), dict(remat="full", pipeline_microbatches=2, pipeline_virtual_stages=2)),
    pytest.param("llama", dict(stage=4, fsdp=2), dict(remat="full", pipeline_microbatches=8, num_layers=8,
                                                     pipeline_virtual_stages=2), marks=pytest.mark.slow),
    pytest.param("gptj", dict(stage=2, data=4), dict(remat="none", pipeline_microbatches=4, num_layers=6,
                                                    pipeline_virtual_stages=3), marks=pytest.mark.slow),
    # ZeRO-3 inside the stages gathered once a step (the tick loop manual over data and fsdp), with GPipe and the
    # interleaved schedule.
    ("llama", dict(stage=2, fsdp=2, data=2), dict(remat="full", pipeline_microbatches=2, pipeline_fsdp_gather="step")),
    pytest.param("llama", dict(stage=2, fsdp=4), dict(remat="none", pipeline_microbatches=2,
                                                     pipeline_virtual_stages=2, pipeline_fsdp_gather="step"),
                 marks=pytest.mark.slow),
])
def test_pipelined_stack_equals_the_plain_one(family, mesh, options):
    model = _model(family, **options)
    params = models.init_params(model, jax.random.PRNGKey(0))
    ids = _ids(model)
    loss = _loss(model)
    want, want_grads = jax.jit(jax.value_and_grad(loss))(params, ids)
    fn, placed, placed_ids = _on_mesh(loss, params, ids, engine.make_mesh(**mesh))
    got, grads = fn(placed, placed_ids)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want_grads))
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * scale, jax.tree_util.keystr(path)


@pytest.mark.parametrize("mesh, rounds", [(dict(stage=4, data=2), 1), (dict(stage=2, data=4), 2)])
def test_stacked_layers_split_over_stage_and_only_activations_move(mesh, rounds):
    """GPipe's stack [L, ...] split over `stage` along L, the interleaved schedule's (V = 2) stored [V, L / V, ...]
    along its second dim: each stage holds its chunk of every round, and neither compiled step moves a weight."""
    model = _model(lora_rank=4, pipeline_virtual_stages=rounds, pipeline_microbatches=2)  # GPipe: M < S
    params = models.init_params(model, jax.random.PRNGKey(0))
    assert params["layers"]["mlp"]["up"]["kernel"].shape[:2] == ((4, 64) if rounds == 1 else (2, 2))
    ids = _ids(model)
    loss = _loss(model)
    mesh = engine.make_mesh(**mesh)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: loss(p, ids))
    layer_dim = 0 if rounds == 1 else 1
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]:
        name = engine.sharding.path_str(path)
        stage_dims = [d for d, e in enumerate(spec) if e == "stage"]
        assert stage_dims == ([layer_dim] if name.startswith("layers/") else []), (name, spec)  # adapters too
    fn, placed, placed_ids = _on_mesh(loss, params, ids, mesh)
    kernel = placed["layers"]["mlp"]["up"]["kernel"]
    assert kernel.addressable_shards[0].data.shape[:layer_dim + 1] == ((1,) if rounds == 1 else (2, 1))
    hlo = fn.lower(placed, placed_ids).compile().as_text()
    assert "collective-permute" in hlo and "all-to-all" not in hlo
    # What is gathered is activations [..., T, D] (the last stage's outputs), never a weight.
    gathered = re.findall(r"= \w+\[([\d,]*)\][^=]* all-gather(?:-start)?\(", hlo)
    assert all(shape.split(",")[-2:] == [str(SEQ), str(model.config.hidden_size)] for shape in gathered), gathered


@pytest.mark.parametrize("mesh, kwargs", [
    (dict(stage=2, data=2, model=2), dict(parallelism=engine.Parallelism(step="jit"))),
    pytest.param(dict(stage=2, fsdp=2, model=2), dict(parallelism=engine.Parallelism(step="shard_map")),
                 marks=pytest.mark.slow),
    pytest.param(dict(stage=2, data=2, model=2), dict(parallelism=engine.Parallelism(step="shard_map", zero_stage=1)),
                 marks=pytest.mark.slow),
    pytest.param(dict(stage=2, data=2, model=2), dict(diloco="diloco"), marks=pytest.mark.slow),
    # Streaming: the stacked layers are cut into 2 parts along the stage-split layer dim (4 layers = 2 stages x 2
    # parts), as without the pipeline.
    pytest.param(dict(stage=2, data=2, model=2), dict(diloco="streaming"), marks=pytest.mark.slow),
    pytest.param(dict(stage=2, context=2), dict(parallelism=engine.Parallelism(step="jit")), marks=pytest.mark.slow),
    pytest.param(dict(stage=2, data=2, model=2), dict(parallelism=engine.Parallelism(step="jit"), virtual_stages=2),
                 marks=pytest.mark.slow),
    # The interleaved stack stored [V, L / V, ...]: the shard_map step's ZeRO-3 gathers of its `stage`-split second
    # dim, and streaming DiLoCo's parts of it.
    pytest.param(dict(stage=2, fsdp=2, data=2), dict(parallelism=engine.Parallelism(step="shard_map"),
                                                     virtual_stages=2), marks=pytest.mark.slow),
    pytest.param(dict(stage=2, data=2, model=2), dict(diloco="streaming", virtual_stages=2), marks=pytest.mark.slow),
    pytest.param(dict(stage=2, fsdp=2, data=2), dict(parallelism=engine.Parallelism(step="jit"), fsdp_gather="step"),
                 marks=pytest.mark.slow),
])
def test_trainer_on_a_pipeline_trains_like_without(mesh, kwargs):
    kwargs = dict(kwargs)
    model = _model(vocab_size=tt.VOCAB, remat="full", pipeline_microbatches=2,
                   pipeline_virtual_stages=kwargs.pop("virtual_stages", 1),
                   pipeline_fsdp_gather=kwargs.pop("fsdp_gather", "tick"))

    def loss_fn(params, batch, rng, is_training):
        logits = model.apply({"params": params}, batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean(), {}

    params = models.init_params(model, jax.random.PRNGKey(0))
    examples = tt.make_examples(64)

    def losses(mesh, **kwargs):
        if kwargs.get("diloco"):
            kwargs["diloco"] = engine.DiLoCo(inner_steps=2, fragments=2 if kwargs["diloco"] == "streaming" else 1)
        trainer = engine.Trainer(mesh=mesh, collate_fn=tt.collate_fn, loss_fn=loss_fn, params=params,
                                 optimizer=optax.adam(1e-2), **kwargs)
        trainer.fit(examples, per_device_batch_size=4, max_steps=4, log_every=1)
        return [h["loss"] for h in trainer.history]

    flat = {k: v for k, v in mesh.items() if k != "stage"}
    want = losses(engine.make_mesh(**flat, devices=jax.devices()[:4]), **{k: v for k, v in kwargs.items()
                                                                          if k == "diloco"})
    np.testing.assert_allclose(losses(engine.make_mesh(**mesh), **kwargs), want, rtol=1e-5)
    assert want[-1] < want[0]


@pytest.mark.parametrize("mesh, options, step", [
    (dict(stage=2, data=2, model=2), dict(pipeline_microbatches=2), "jit"),
    pytest.param(dict(stage=2, expert=4), dict(num_layers=4, pipeline_microbatches=2,
                                                      pipeline_virtual_stages=2), "jit", marks=pytest.mark.slow),
    pytest.param(dict(stage=2, data=2, fsdp=2), dict(pipeline_microbatches=2), "shard_map", marks=pytest.mark.slow),
    # 1F1B: the statistics an output of its custom_vjp beside the loss, its backward run from both cotangents (the
    # stage at once without remat, layer by layer with it; the rule for ZeRO-3 shards in the shard_map step)
    (dict(stage=2, data=2, model=2), dict(num_layers=4, pipeline_microbatches=2, pipeline_schedule="1f1b"), "jit"),
    pytest.param(dict(stage=2, data=2, model=2), dict(num_layers=4, pipeline_microbatches=2, remat="none",
                                                      pipeline_schedule="1f1b"), "jit", marks=pytest.mark.slow),
    pytest.param(dict(stage=2, data=2, fsdp=2), dict(num_layers=4, pipeline_microbatches=2,
                                                     pipeline_schedule="1f1b"), "shard_map", marks=pytest.mark.slow),
])
def test_a_mixture_on_a_pipeline_adds_the_whole_batchs_router_losses(mesh, options, step):
    """One SGD step of the tiny Mixtral through the Trainer on a stage mesh equals one device's: the loss with both
    router terms (the load-balancing one weighing 0.5, 25x Mixtral's), the terms themselves and every updated weight.
    The pipeline sums each layer's router statistics over its layers and micro-batches (without that, the loss of
    a stage mesh lost both terms); GPipe, the interleaved schedule beside `expert`, the shard_map step, 1F1B."""
    model = models.create_model("mixtral", "tiny", scan_layers=True, **{
        "remat": "full", "router_aux_loss_coef": 0.5, "router_z_loss_coef": 1e-2, **options})
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows = tt.lm_rows(8)
    rows[3]["segment_ids"][12:] = 0  # padding: the statistics count valid tokens only
    _, grads = tt.assert_sgd_step_equals_one_device(model, params, rows, engine.make_mesh(**mesh), step)
    assert float(jnp.abs(grads["layers"]["mlp"]["router"]["kernel"]).max()) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [1, 2])
def test_generation_under_a_pipeline_mesh_matches(rounds):
    model = _model(pipeline_virtual_stages=rounds, pipeline_microbatches=2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    prompts = _ids(model, rows=2)[:, :4]
    want = models.generate(model, params, prompts, max_new_tokens=4)
    mesh = engine.make_mesh(stage=2, data=4)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: _loss(model)(p, _ids(model)))
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, P)))
    np.testing.assert_array_equal(models.generate(model, placed, prompts, max_new_tokens=4), want)


def test_bubble_fraction():
    assert pipeline.bubble_fraction(1, 4) == 0
    assert pipeline.bubble_fraction(8, 8) == pytest.approx(7 / 15)
    assert pipeline.bubble_fraction(4, 28) == pytest.approx(3 / 31)
    assert pipeline.bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 19)
    assert pipeline.bubble_fraction(8, 8, 4) == pytest.approx(7 / 39)


@pytest.mark.parametrize("virtual_stages, microbatches", [(1, 2), (2, 2), (2, 4)])
def test_compiled_tick_loops_follow_the_schedule(virtual_stages, microbatches):
    """The forward and the backward tick loops of the compiled program each run V M + S - 1 ticks; every device
    computes in all of them, so its idle share is the (S - 1) of them `bubble_fraction` counts."""
    model = _model(pipeline_microbatches=microbatches, pipeline_virtual_stages=virtual_stages)
    hlo = _trace_on(engine.make_mesh(stage=2, data=4), model).compile().as_text()
    ticks = pipeline.num_ticks(2, microbatches, virtual_stages)
    assert ticks == virtual_stages * microbatches + 1
    trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo)]
    assert trips.count(ticks) == 2, trips  # forward and backward
    assert pipeline.bubble_fraction(2, microbatches, virtual_stages) == pytest.approx(1 / ticks)


@pytest.mark.parametrize("remat", ["full", "none"])
def test_gpipe_keeps_no_more_per_micro_batch_than_the_plain_model(remat):
    """What GPipe's compiled step (value and gradients, stage 2 x data 4) adds to its temporaries for 4 more
    micro-batches of the same size stays below half what the unpipelined model's step on data 4 adds for the same
    rows: a stage keeps each micro-batch's inputs of its own layers (remat='full'; without remat what its layers'
    policy keeps of them), half the model's, and its half of the logits (measured: 66 KB against 546 KB with
    remat='full', 333 KB against 995 KB without). Autodiff of the tick loop once kept every tick's slice of the stage's
    weights as well, which no row count explains: 1.25 MB with remat='full'; without remat the layers' policy kept
    the slices until it recomputed gathers and dynamic slices too: 1.97 MB."""
    def temporaries(mesh, microbatches):
        model = _model(remat=remat, pipeline_microbatches=microbatches)
        compiled = _trace_on(mesh, model, rows=4 * microbatches).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    stages, plain = engine.make_mesh(stage=2, data=4), engine.make_mesh(data=4, devices=jax.devices()[:4])
    grown = temporaries(stages, 8) - temporaries(stages, 4)
    plain_grown = temporaries(plain, 8) - temporaries(plain, 4)
    assert 0 < grown < plain_grown / 2, (grown, plain_grown)


def test_gpipe_reduces_weight_gradients_once_per_step():
    """GPipe's compiled step (value and gradients, stage 2 x data 4, one row of each device's per micro-batch) sends
    about the same all-reduce bytes at M = 8 as at M = 4: the tick loop runs manual over `data`, so the weight
    gradients are summed over it once, after the loop. What still grows with the ticks is the last stage's output
    handed to the batch's output (a device's [rows, T, D] micro-batch forward and its gradient backward, 8 KB a tick
    here), below half of one layer's float32 weight gradients (measured: +32 KB for 4 more ticks; reduced per tick,
    as before, +1.8 MB)."""
    def all_reduce_bytes(microbatches):
        model = _model(remat="full", pipeline_microbatches=microbatches)
        hlo = _trace_on(engine.make_mesh(stage=2, data=4), model, rows=4 * microbatches).compile().as_text()
        return engine.plan.collective_bytes(hlo, 8)["all-reduce"]

    params = models.init_params(_model(), jax.random.PRNGKey(0))
    layer_bytes = sum(w.size * 4 for w in jax.tree.leaves(params["layers"])) // 4  # fp32, 4 layers
    grown = all_reduce_bytes(8) - all_reduce_bytes(4)
    assert 0 <= grown < layer_bytes / 2, (grown, layer_bytes)


def test_reward_model_scores_on_a_pipeline_equal_the_plain_ones():
    """A reward model's sequence scores (rows completed with their last label, the score read at it) on stage 2 x
    data 2 x model 2, the stack's loop manual over `data`: equal to the plain model's. Picking each tick's
    micro-batch from those rows' segment ids aborted XLA's partitioner before they were made whole on each device."""
    from engine.tasks.rlhf import reward  # noqa: PLC0415 - the scripts' scoring, above the models
    model = _model(remat="full")
    scorer = models.RewardModel(model)
    params = models.init_reward_params(scorer, models.init_params(model, jax.random.PRNGKey(0)), jax.random.PRNGKey(1))
    ids = _ids(model, 4)
    batch = {"input_ids": ids, "segment_ids": jnp.ones_like(ids).at[1, 10:].set(0), "labels": ids}
    score = lambda p, b: reward.sequence_rewards(scorer, p, b)  # noqa: E731
    mesh = engine.make_mesh(stage=2, data=2, model=2)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: score(p, batch))
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, P)))

    def on_mesh(p, b):
        with kernels.under_mesh(mesh):
            return score(p, b)

    got = jax.jit(on_mesh)(placed, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(got, jax.jit(score)(params, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_train_lm_flag_gathers_fsdp_once_a_step_like_per_tick(tmp_path):
    """train_lm.py with --pipeline_fsdp_gather=step on stage 2 x fsdp 2 x model 2: the same training and eval losses
    as the per-tick gathers."""
    assert_train_lm_flag_trains_alike(tmp_path, "--pipeline_fsdp_gather=step", "--mesh=1,2,2",
                                      "--pipeline_microbatches=2")


def _with_segments(rows):
    batch = tt.collate_fn(rows)
    return {**batch, "segment_ids": np.ones_like(batch["input_ids"])}


@pytest.mark.parametrize("schedule", [dict(pipeline_virtual_stages=1),
                                      pytest.param(dict(pipeline_virtual_stages=2), marks=pytest.mark.slow),
                                      dict(pipeline_schedule="1f1b")], ids=["gpipe", "interleaved", "1f1b"])
def test_shard_map_step_gathers_one_layer_a_tick_inside_a_stage(schedule):
    """ZeRO-3 inside a stage in the shard_map step (stage 2 x fsdp 2 x model 2, 2 layers a stage; GPipe, the
    interleaved schedule and 1F1B): each tick gathers the one layer it runs (every weight all-gather is of one layer
    of the device's stage; before, XLA:CPU gathered the stage's 2 layers once and held them, and 1F1B's custom_vjp
    gathered them whole before its loop: its rule for shards, `kernels.shard_rules`, gathers them a layer at a time
    in the loop) and the losses are the jit step's; pipeline_fsdp_gather='step' is refused there in one line."""
    def run(step, gather="tick"):
        model = _model(vocab_size=tt.VOCAB, remat="full", pipeline_microbatches=2, pipeline_fsdp_gather=gather,
                       **schedule)
        trainer = engine.Trainer(mesh=engine.make_mesh(stage=2, fsdp=2, model=2), collate_fn=_with_segments,
                                 loss_fn=lm.lm_loss_fn(model), params=models.init_params(model, jax.random.PRNGKey(0)),
                                 optimizer=optax.adam(1e-2), parallelism=engine.Parallelism(step=step))
        trainer.fit(tt.make_examples(32), per_device_batch_size=4, max_steps=2, log_every=1)
        return [h["loss"] for h in trainer.history], trainer.compiled_step().as_text()

    losses, hlo = run("shard_map")
    # The layers in each gathered stacked kernel [..., in, out] (rows [..., SEQ, D] and 2-D weights left out).
    shapes = [tuple(map(int, d.split(","))) for d in re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather(?:-start)?\(",
                                                               hlo)]
    assert {math.prod(s[:-2]) for s in shapes if len(s) >= 3 and s[-2] != SEQ} == {1}, shapes
    np.testing.assert_allclose(losses, run("jit")[0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"pipeline_fsdp_gather='step' inside a step manual over fsdp .*; expected "
                                         r"'tick', or the jit step"):
        run("shard_map", "step")


def assert_train_lm_flag_trains_alike(tmp_path, flag, *pipeline):
    """train_lm.py on 2 stages with the `pipeline` flags (mesh, micro-batches), 4 steps, with and without `flag`:
    the same training and eval losses (rtol 1e-4), and some of them."""
    from tests.test_scripts import TINY_LM, _eval_losses, _losses, _run, _stdlib_txt  # noqa: PLC0415
    common = [f"--data={_stdlib_txt(tmp_path / 'data' / 'a.txt')}", *TINY_LM, "--max_steps=4", "--log_every=2",
              "--prompts=", "--per_device_batch_size=4", "--pipeline_stages=2", *pipeline]
    without = _run("train_lm.py", *common, f"--workdir={tmp_path / 'without'}")
    with_flag = _run("train_lm.py", *common, f"--workdir={tmp_path / 'with'}", flag)
    np.testing.assert_allclose(_losses(with_flag.stdout), _losses(without.stdout), rtol=1e-4)
    np.testing.assert_allclose(_eval_losses(with_flag.stdout), _eval_losses(without.stdout), rtol=1e-4)
    assert _losses(without.stdout)


def _weight_bytes(mesh, model, rows):
    """Bytes a device sends per step in every collective but the permutes (what moves weights and their gradients)
    in the compiled value and gradients of `model` on `mesh`: its LM loss with 1F1B, else `_loss`."""
    if model.config.pipeline_schedule == "1f1b":
        from tests.test_pipeline_1f1b import _batch, _loss as loss_1f1b  # noqa: PLC0415 - the 1F1B test's LM batch
        params = models.init_params(model, jax.random.PRNGKey(0))
        fn, placed, placed_batch = _on_mesh(loss_1f1b(model), params, _batch(model, rows=rows), mesh)
        lowered = fn.lower(placed, placed_batch)
    else:
        lowered = _trace_on(mesh, model, rows)
    sent = engine.plan.collective_bytes(lowered.compile().as_text(), mesh.size)
    return sum(v for k, v in sent.items() if k != "collective-permute")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fsdp_gathered_once_a_step_sends_the_same_at_more_micro_batches(schedule):
    """With pipeline_fsdp_gather='step' (stage 2 x fsdp 4) the weights and their gradients cross the devices once a
    step: twice the micro-batches (M 2 -> 4, one row of each device's per micro-batch) add less than a quarter of a
    layer's float32 weights to the bytes sent outside the permutes (measured: GPipe -0.2 KB, 1F1B +16 KB of rows'
    activations, against 148 KB a layer), where 'tick' adds more than one layer's (GPipe +1.04 MB, 1F1B +1.97 MB)."""
    def grown(gather):
        def sent(m):
            model = _model(remat="full", pipeline_microbatches=m, pipeline_schedule=schedule,
                           pipeline_fsdp_gather=gather)
            return _weight_bytes(engine.make_mesh(stage=2, fsdp=4), model, rows=4 * m)
        return sent(4) - sent(2)

    params = models.init_params(_model(), jax.random.PRNGKey(0))
    layer_bytes = sum(w.size * 4 for w in jax.tree.leaves(params["layers"])) // 4  # fp32, 4 layers
    once, per_tick = grown("step"), grown("tick")
    assert abs(once) < layer_bytes / 4 and per_tick > layer_bytes, (once, per_tick, layer_bytes)


@pytest.mark.slow
def test_devices_draw_their_own_dropout_masks():
    """Inside the tick loop's shard_map over `data` each device draws its own masks: two equal rows on different
    devices, in the same micro-batch at the same place, come out different (the same key and shape on every device
    would give them one mask)."""
    model = _model(dropout_rate=0.5, remat="full", pipeline_microbatches=2)
    params = models.init_params(model, jax.random.PRNGKey(0))
    ids = jnp.tile(_ids(model, 1), (8, 1))  # 8 equal rows: 2 a device on data 4, row 0 and row 2 micro-batch 0
    mesh = engine.make_mesh(stage=2, data=4)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: _loss(model)(p, ids))
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, P)))

    def logits(p, ids):
        with kernels.under_mesh(mesh):
            return model.apply({"params": p}, ids, train=True, rngs={"dropout": jax.random.PRNGKey(1)})

    out = jax.jit(logits)(placed, jax.device_put(ids, NamedSharding(mesh, P("data"))))
    assert not np.allclose(out[0], out[2])
    np.testing.assert_array_equal(out, jax.jit(logits)(placed, jax.device_put(ids, NamedSharding(mesh, P("data")))))


def _trace_on(mesh, model, rows=ROWS):
    params = models.init_params(model, jax.random.PRNGKey(0))
    ids = _ids(model, rows)
    fn, placed, placed_ids = _on_mesh(_loss(model), params, ids, mesh)
    return fn.lower(placed, placed_ids)


def test_bad_input_fails_in_one_line():
    with pytest.raises(ValueError, match=r"pipeline_fsdp_gather='layer'; expected one of \('tick', 'step'\)"):
        _model(pipeline_fsdp_gather="layer")
    model = _model(pipeline_microbatches=4, pipeline_fsdp_gather="step")
    with pytest.raises(ValueError, match=r"pipeline_fsdp_gather='step' with 8 rows over 4 batch shards \(data 2 x "
                                         r"fsdp 2\) in pipeline_microbatches=4; expected each device's rows"):
        _trace_on(engine.make_mesh(stage=2, fsdp=2, data=2), model)
    mesh = engine.make_mesh(stage=2, data=4)
    with pytest.raises(ValueError, match=r"stage=0; expected a positive integer or -1"):
        engine.make_mesh(stage=0)
    with pytest.raises(ValueError, match=r"pipeline_microbatches=-1; expected an integer >= 0"):
        _model(pipeline_microbatches=-1)
    with pytest.raises(ValueError, match=r"stage=2 splits a stack of 3 layers"):
        _trace_on(mesh, _model(num_layers=3))
    with pytest.raises(ValueError, match=r"pipeline_microbatches=3 does not divide the 8 rows"):
        _trace_on(mesh, _model(pipeline_microbatches=3))
    with pytest.raises(ValueError, match=r"pipeline_virtual_stages=0; expected an integer >= 1"):
        _model(pipeline_virtual_stages=0)
    with pytest.raises(ValueError, match=r"pipeline_virtual_stages=3 cuts a stack of 4 layers into rounds of unequal "
                                         r"length; expected a value that divides the number of layers"):
        _trace_on(mesh, _model(pipeline_virtual_stages=3))
    with pytest.raises(ValueError, match=r"stage=2 x pipeline_virtual_stages=2 splits a stack of 6 layers"):
        _trace_on(mesh, _model(pipeline_virtual_stages=2, num_layers=6))
    with pytest.raises(ValueError, match=r"pipeline_virtual_stages=2 stores the layer stack 'layers' for an "
                                         r"interleaved pipeline, which this model's stack cannot run"):
        models.init_params(models.create_model("t5", "tiny", scan_layers=True, pipeline_virtual_stages=2))
    with pytest.raises(ValueError, match=r"pipeline_microbatches=1 with pipeline_virtual_stages=2 on stage=2; "
                                         r"expected at least 2 micro-batches"):
        _trace_on(mesh, _model(pipeline_microbatches=1, pipeline_virtual_stages=2))
    with pytest.raises(ValueError, match=r"stage=2 needs scan_layers=True"):
        _trace_on(mesh, _model(scan_layers=False))
    params = models.init_params(_model(), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"stage=2 needs trace_fn"):
        engine.auto_shard(params, mesh)


@pytest.mark.slow
def test_t5_refuses_a_stage_mesh():
    mesh = engine.make_mesh(stage=2, data=4)
    t5 = models.create_model("t5", "tiny", scan_layers=True)
    t5_params = models.init_params(t5, jax.random.PRNGKey(0))
    ids = _ids(t5, 2)
    with pytest.raises(ValueError, match=r"stack '\w+' cannot run as a pipeline"):
        with kernels.under_mesh(mesh):
            jax.eval_shape(lambda p: t5.apply({"params": p}, ids, ids), t5_params)


@pytest.mark.slow
def test_stack_layers_keeps_the_function():
    model = _model(scan_layers=False)
    params = models.init_params(model, jax.random.PRNGKey(0))
    ids = _ids(model, rows=2)
    scanned, stacked = models.stack_layers(model, params)
    assert scanned.config.scan_layers and stacked["layers"]["mlp"]["up"]["kernel"].shape[0] == 4
    assert list(stacked)[:2] == ["embed", "layers"] and not any(k.startswith("layers_") for k in stacked)
    np.testing.assert_allclose(scanned.apply({"params": stacked}, ids), model.apply({"params": params}, ids),
                               rtol=1e-5, atol=1e-5)
    assert models.stack_layers(scanned, stacked)[1] is stacked
    with pytest.raises(ValueError, match=r"a pipeline needs a decoder-only model .*; got T5"):
        models.stack_layers(models.create_model("t5", "tiny"), {})


@pytest.mark.slow
def test_pipelined_train_step_with_triton_kernels_lowers_for_cuda():
    """The Trainer's step for a pipelined LLaMA with Triton attention and MLP kernels on stage 2 x data 2 x model 2,
    lowered for cuda: the kernels are there, each on its stage's rows and its `model` half of the heads/columns."""
    from tests.targets import kernel_operands_of_train_step
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", attention_implementation="triton",
                                mlp_implementation="triton", pipeline_microbatches=2)
    params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
    trainer = engine.Trainer(mesh=engine.make_mesh(stage=2, data=2, model=2), collate_fn=lm.collate_lm,
                             loss_fn=lm.lm_loss_fn(model), params=params, optimizer=optax.sgd(0.1))
    operands = kernel_operands_of_train_step(trainer, 8, 32)
    # attention q blocks: 8 rows / 2 data / 2 micro-batches = 2 rows, 32 tokens, 4 heads / model 2, 16 wide
    attention = [t for t in operands if re.search(r"tensor<\d+x32x\d+x16x", t)]
    assert attention and all(re.search(r"tensor<2x32x2x16x", t) for t in attention), attention
    assert all("64x128x" not in t for t in operands)  # the gate/up weights are never whole


@pytest.mark.slow
def test_dropout_in_a_pipeline_follows_the_key():
    """Training calls with dropout draw per-layer, per-micro-batch masks from the 'dropout' key: the same key gives
    the same loss, another key another loss, and the gradients stay finite (the masks differ from the plain
    stack's, whose keys are split per layer by nn.scan)."""
    model = _model(dropout_rate=0.1, attention_dropout_rate=0.1, remat="full")
    params = models.init_params(model, jax.random.PRNGKey(0))
    ids = _ids(model)

    def loss(p, ids, key):
        logits = model.apply({"params": p}, ids, train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    mesh = engine.make_mesh(stage=2, data=4)
    fn, placed, placed_ids = _on_mesh(lambda p, i: loss(p, i, jax.random.PRNGKey(1)), params, ids, mesh)
    other, _, _ = _on_mesh(lambda p, i: loss(p, i, jax.random.PRNGKey(2)), params, ids, mesh)
    (a, grads), (b, _), (c, _) = fn(placed, placed_ids), fn(placed, placed_ids), other(placed, placed_ids)
    assert a == b and a != c
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    plain = jax.jit(lambda p: loss(p, ids, jax.random.PRNGKey(0)))(params)
    assert abs(float(a) - float(plain)) < 0.1  # dropout of 0.1 moves a loss near 4.9 a little, not wholesale


@pytest.mark.slow
def test_interleaved_stack_is_stored_by_rounds_and_converts_at_every_boundary(tmp_path):
    """An interleaved pipeline's model (V = 2) stores its stack [V, L / V, ...]: the same layers in the same order as
    [L, ...] (its fresh init is the GPipe model's, reshaped), computing the same function on no mesh, generating
    the same tokens, converted both ways by `stack_layers`, read and written as the same transformers and PEFT
    directories, and quantised alike (its NF4 scales split over `stage` with it)."""
    plain = _model(lora_rank=2)
    params = models.init_params(plain, jax.random.PRNGKey(0))
    params = jax.tree.map(lambda a: a + 0.01, params)  # LoRA's B starts at zero: make every adapter count
    model = _model(lora_rank=2, pipeline_virtual_stages=2)
    fresh = models.init_params(model, jax.random.PRNGKey(0))
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(fresh["layers"])[0],
                                 jax.tree.leaves(models.init_params(plain, jax.random.PRNGKey(0))["layers"])):
        assert got.shape == (2, 2, *want.shape[1:]), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(got.reshape(want.shape), want)
    model_again, stored = models.stack_layers(plain, params, virtual_stages=2)
    assert model_again.config == model.config
    ids = _ids(model, rows=2)
    want = plain.apply({"params": params}, ids)
    np.testing.assert_allclose(model.apply({"params": stored}, ids), want, rtol=1e-6, atol=1e-6)
    back_model, back = models.stack_layers(model, stored, virtual_stages=1)
    assert back_model.config == plain.config
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, params))
    unscanned = _model(lora_rank=2, scan_layers=False)
    _, from_unscanned = models.stack_layers(unscanned, models.init_params(unscanned, jax.random.PRNGKey(3)),
                                            virtual_stages=2)
    assert from_unscanned["layers"]["mlp"]["up"]["kernel"].shape[:2] == (2, 2)
    np.testing.assert_array_equal(models.generate(model, stored, ids[:, :4], max_new_tokens=4),
                                  models.generate(plain, params, ids[:, :4], max_new_tokens=4))
    # Quantised bases (their scales stacked alike) compute the same and split over `stage` on the same dim.
    q_model, q_stored = models.quantize(*models.merge_lora(model, stored), "nf4")
    q_plain, q_params = models.quantize(*models.merge_lora(plain, params), "nf4")
    np.testing.assert_allclose(q_model.apply({"params": q_stored}, ids), q_plain.apply({"params": q_params}, ids),
                               rtol=1e-6, atol=1e-6)
    q_model = q_model.clone(config=dataclasses.replace(q_model.config, pipeline_microbatches=2))
    specs = engine.auto_shard(q_stored, engine.make_mesh(stage=2, data=4),
                              trace_fn=lambda p: _loss(q_model)(p, _ids(q_model)))
    assert all(s[1] == "stage" for s in jax.tree.leaves(specs["layers"], is_leaf=lambda x: isinstance(x, P)))
    # A transformers directory and a PEFT adapter: the same files from either form, read back into either.
    models.save_pretrained(model, stored, str(tmp_path / "hf_v2"))
    models.save_pretrained(plain, params, str(tmp_path / "hf_v1"))
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.3.self_attn.q_proj.weight"):
        with safe_open(str(tmp_path / "hf_v2" / "model.safetensors"), "np") as a, \
                safe_open(str(tmp_path / "hf_v1" / "model.safetensors"), "np") as b:
            np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name))
    loaded_model, loaded = models.load_pretrained(str(tmp_path / "hf_v1"), scan_layers=True, pipeline_virtual_stages=2)
    assert loaded["layers"]["mlp"]["up"]["kernel"].shape[:2] == (2, 2)
    np.testing.assert_allclose(loaded_model.apply({"params": loaded}, ids),
                               models.merge_lora(plain, params)[0].apply(
                                   {"params": models.merge_lora(plain, params)[1]}, ids), rtol=1e-5, atol=1e-5)
    models.save_lora_adapter(model, stored, str(tmp_path / "peft"))
    base_model, base = models.merge_lora(model, jax.tree.map(jnp.zeros_like, stored))
    adapted_model, adapted = models.load_lora_adapter(base_model, base, str(tmp_path / "peft"))
    np.testing.assert_array_equal(adapted["layers"]["attn"]["q"]["lora_a"], stored["layers"]["attn"]["q"]["lora_a"])
