"""Sequence parallelism (`ModelOptions.sequence_parallel`, models/layers/parallel.py `split_tokens` / `gather_tokens`): the
residual stream between the tensor-parallel blocks split by tokens over `model`. Loss and gradients equal the
unsplit model for every family, with context parallelism and with the Pallas kernels; the shard_map step trains as
the jit step without it; the compiled step gathers tokens, not weights, and needs less memory."""
import re

import jax
import numpy as np
import optax
import pytest

import engine
import models
from engine.tasks import lm, planning, seq2seq
from tests.test_context_parallel import _assert_unsplit_gradients
from tests.test_step import _assert_same_run, _packed_rows

KERNELS = dict(attention_implementation="triton", mlp_implementation="triton", kernel_interpret=True)


def _batch(family, rows=4, seq=32):
    rng = np.random.RandomState(0)
    if family == "t5":
        batch = {"input_ids": rng.randint(1, 100, (rows, 16)), "attention_mask": np.ones((rows, 16)),
                 "decoder_input_ids": rng.randint(1, 100, (rows, 8)), "decoder_attention_mask": np.ones((rows, 8)),
                 "labels": rng.randint(1, 100, (rows, 8))}
        return {k: v.astype(np.int32) for k, v in batch.items()}
    tokens = rng.randint(0, 120, (rows, seq + 1)).astype(np.int32)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": np.ones((rows, seq), np.int32)}


@pytest.mark.parametrize("family, mesh, options", [
    ("llama", dict(data=2, context=2, model=2), {}),  # tokens over context x model (CI time: the rest are slow)
    pytest.param("llama", dict(data=2, model=4), {}, marks=pytest.mark.slow),
    pytest.param("gptj", dict(data=2, model=4), {}, marks=pytest.mark.slow),
    pytest.param("opt", dict(data=2, model=4), {}, marks=pytest.mark.slow),
    pytest.param("t5", dict(data=2, context=2, model=2), {}, marks=pytest.mark.slow),  # both stacks, cross-attention
    pytest.param("llama", dict(data=2, context=2, model=2), KERNELS, marks=pytest.mark.slow),
    # sliding windows of 8 keys in 32-token rows (Gemma 2: its local / global scan, soft-caps), Ulysses
    ("gemma2", dict(data=2, context=2, model=2), {}),
    pytest.param("mistral", dict(data=2, model=4), {}, marks=pytest.mark.slow),
])
def test_loss_and_gradients_equal_the_unsplit_model(family, mesh, options):
    model = models.create_model(family, "tiny", scan_layers=family != "t5", remat="full", sequence_parallel=True,
                                **options)
    params = models.init_params(model, jax.random.PRNGKey(0))
    loss = seq2seq.seq2seq_loss_fn(model) if family == "t5" else lm.lm_loss_fn(model)
    _assert_unsplit_gradients(loss, params, _batch(family), engine.make_mesh(**mesh))


def _llama_trainer(step, sequence_parallel):
    model = models.create_model("llama", "tiny", scan_layers=True, remat="full", sequence_parallel=sequence_parallel)
    loss_fn = lm.lm_loss_fn(model)
    loss_fn.weight_metric = "tokens"
    return engine.Trainer(mesh=engine.make_mesh(data=2, model=4), collate_fn=lm.collate_lm, loss_fn=loss_fn,
                          params=models.init_params(model, jax.random.PRNGKey(0)), optimizer=optax.sgd(0.5),
                          parallelism=engine.Parallelism(step=step))


def test_shard_map_step_trains_like_the_jit_step_and_gathers_tokens():
    """On data 2 x model 4 the shard_map step of a sequence-parallel LLaMA (the GPU/TPU default) keeps the jit
    step's losses and parameters without it, and its compiled step all-gathers the residual stream's tokens
    (dim 1 of [2 rows, 16 tokens, 64]: 4 tokens per device before) at the blocks' inputs."""
    rows = _packed_rows(16)
    ref, got = _llama_trainer("jit", False), _llama_trainer("shard_map", True)
    for trainer in (ref, got):
        trainer.fit(rows, per_device_batch_size=2, max_steps=3, log_every=3)
    _assert_same_run(ref, got)
    hlo = got.compiled_step().as_text()
    token_gathers = re.findall(r"= f32\[2,16,64\]\S* all-gather\([^\n]*dimensions=\{1\}", hlo)
    assert len(token_gathers) >= 4, "expected the blocks' token all-gathers"  # forward and backward, in loops


@pytest.mark.slow  # CI time; its values: the tests above
def test_plan_needs_less_memory():
    """A tiny LLaMA on data 4 x model 2 (every head split), 512 tokens, remat 'dots': fewer temporaries with the
    residual stream split, no all-to-all or weight gather (the backward's layouts are stated: `_reshard`), and
    the extra all-gathers are only the blocks' token gathers (CPU's XLA leaves the matching reduce-scatters as
    all-reduce + slice, so the all-reduce bytes stay)."""
    kwargs = dict(model="llama", model_config="tiny", num_devices=8, mesh="4,1,2", per_device_batch_size=4,
                  seq_len=512, remat="dots", step="jit")
    base, split = planning.plan(**kwargs), planning.plan(sequence_parallel=True, **kwargs)
    assert split["sequence_parallel"] and not base["sequence_parallel"]
    # (temporaries: 33.3 -> 31.6 MB under JAX 0.10.2, 32.0 -> 31.4 MB under 0.11.2)
    assert split["bytes"]["temporaries"] < 0.99 * base["bytes"]["temporaries"], (base["bytes"], split["bytes"])
    assert split["collective_bytes"]["all-to-all"] == base["collective_bytes"]["all-to-all"] == 0
    # 2 layers x 6 gathers (forward, recompute, backward of attention and MLP inputs) of [4, 512, 64] float32
    # rows from half the tokens: 2 * 6 * 4 * 256 * 64 * 4 bytes = 3.1 MB at most.
    extra = split["collective_bytes"]["all-gather"] - base["collective_bytes"]["all-gather"]
    assert 0 < extra <= 2 * 6 * 4 * 256 * 64 * 4, extra
    assert split["collective_bytes"]["all-reduce"] <= 1.01 * base["collective_bytes"]["all-reduce"]


def test_without_a_model_axis_nothing_changes():
    """No automatic `model` axis (or tokens it does not divide): the model traces exactly as without the option."""
    batch = _batch("llama", rows=2, seq=30)
    for mesh in (engine.make_mesh(data=8), engine.make_mesh(data=2, model=4)):  # 30 tokens: 4 does not divide
        traced = []
        for flag in (False, True):
            model = models.create_model("llama", "tiny", sequence_parallel=flag)
            params = jax.eval_shape(lambda: models.init_params(model, jax.random.PRNGKey(0)))
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                traced.append(str(jax.make_jaxpr(lambda p: model.apply({"params": p}, batch["input_ids"]))(params)))
        assert traced[0] == traced[1]
