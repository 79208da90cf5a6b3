"""Each family end to end on the 8 simulated devices: a Hugging Face directory loaded straight onto its auto_shard
shardings, trained through engine.Trainer, then generating from the sharded trained parameters."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.tasks import lm

SEQ = 16


def _rows(n, seed=0):
    """Packed rows as lm.collate_lm takes them: one repeated short pattern, so a few updates visibly help."""
    rng = np.random.RandomState(seed)
    pattern = rng.randint(3, 120, 8)
    return [{"tokens": np.roll(np.tile(pattern, 3)[:SEQ + 1], -i % 8).astype(np.int32),
             "segment_ids": np.ones(SEQ + 1, np.int32)} for i in range(n)]


def _seq2seq_loss(model):
    """Mean cross-entropy of T5 predicting the decoder tokens (the encoder sees the same row)."""
    def loss_fn(params, batch, rng, is_training):
        del rng, is_training
        ids, labels = batch["input_ids"], batch["labels"]
        decoder_in = jnp.concatenate([jnp.zeros_like(ids[:, :1]), jnp.maximum(labels[:, :-1], 0)], axis=1)
        logits = model.apply({"params": params}, ids, decoder_in)
        valid = labels >= 0
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        return jnp.where(valid, losses, 0.0).sum() / jnp.maximum(valid.sum(), 1)
    return loss_fn


@pytest.mark.parametrize("family", [
    "llama", pytest.param("gptj", marks=pytest.mark.slow), pytest.param("opt", marks=pytest.mark.slow),
    pytest.param("t5", marks=pytest.mark.slow)])
def test_load_sharded_train_and_generate(tmp_path, family):
    model = models.create_model(family, "tiny", scan_layers=True)
    models.save_pretrained(model, models.init_params(model, jax.random.PRNGKey(0)), str(tmp_path))
    mesh = engine.make_mesh(data=2, fsdp=2, model=2)
    model, params = models.load_pretrained(str(tmp_path), layout=engine.auto_layout(mesh))
    assert any(not x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(params))

    loss_fn = _seq2seq_loss(model) if family == "t5" else lm.lm_loss_fn(model)
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=loss_fn, params=params,
                             optimizer=optax.adam(3e-3))
    trainer.fit(_rows(32), per_device_batch_size=1, max_steps=8, log_every=8)
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < 0.9 * losses[0], losses
    assert trainer.compile_count == 1

    prompt = jnp.asarray(np.stack([r["tokens"][:6] for r in _rows(2)]))
    out = np.asarray(models.generate(model, trainer.params, prompt, max_new_tokens=4))
    single = np.asarray(models.generate(model, jax.device_get(trainer.params), prompt, max_new_tokens=4))
    np.testing.assert_array_equal(out, single)  # sharded and single-device generation agree
