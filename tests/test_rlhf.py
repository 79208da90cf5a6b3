"""The RLHF pipeline after SFT: engine.reward (the score head at the sequence's final token, the Bradley-Terry loss)
and engine.ppo (GAE, the clipped losses, rollouts, learning, exact resume), with short runs from a briefly
supervised-fine-tuned tiny LLaMA."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine import preference, reward, text

TOK = text.WordTokenizer(text.TOY_WORDS)


def _backbone():
    return models.create_model("llama", "tiny", vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def sft_params():
    """The tiny LLaMA after 64 SFT steps on the toy task (one device): it answers about half the held-out prompts
    exactly (greedy), so there is room for the reward model's and PPO's steps to show."""
    model = _backbone()
    rows, _ = preference.encode_prompt_responses(preference.toy_prompt_responses(1024, seed=0), TOK, seq_len=16)
    trainer = engine.Trainer(mesh=engine.make_mesh(devices=jax.devices()[:1]), collate_fn=preference.collate_preferences,
                             loss_fn=text.lm_loss_fn(model), params=models.init_params(model, jax.random.PRNGKey(0)),
                             optimizer=optax.adam(3e-3))
    trainer.fit(rows, per_device_batch_size=16, max_steps=64)
    return jax.device_get(trainer.params)


def test_reward_is_the_score_head_at_the_final_token():
    """A sequence's reward is score(hidden state at its EOS), the EOS being a label of the row and not an input; the
    backbone's parameters are used as they are."""
    backbone = _backbone()
    lm_params = models.init_params(backbone, jax.random.PRNGKey(0))
    model = reward.RewardModel(backbone)
    params = reward.init_params(model, lm_params, jax.random.PRNGKey(1))
    assert params["backbone"] is lm_params and params["score"]["kernel"].shape == (64, 1)
    params["score"]["bias"] = jnp.full((1,), 0.25)
    examples, _ = preference.encode_preferences(preference.toy_preferences(3, seed=0), TOK, seq_len=16)
    batch = preference.collate_preferences(examples)
    got = reward.sequence_rewards(model, params, batch)
    assert got.shape == (3, 2)
    for b, triple in enumerate(preference.toy_preferences(3, seed=0)):
        for r, key in enumerate(("chosen", "rejected")):
            tokens = TOK.encode(triple["prompt"]) + [TOK.bos_id] + TOK.encode(triple[key]) + [TOK.eos_id]
            hidden = backbone.apply({"params": lm_params}, jnp.asarray([tokens]), return_hidden=True)
            want = hidden[0, -1] @ params["score"]["kernel"][:, 0] + 0.25
            np.testing.assert_allclose(got[b, r], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="backbone_params do not fit"):
        reward.init_params(model, {"embed": lm_params["embed"]}, jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match="expected an engine.reward.RewardModel"):
        reward.reward_loss_fn(backbone)


def test_reward_loss_is_bradley_terry_and_training_ranks_the_sorted_list_first(sft_params):
    """The loss is mean -log sigmoid(r_chosen - r_rejected) with its metrics; from the SFT backbone, 32 steps on a
    4x1x2 mesh rank held-out sorted lists over other orders of the same names."""
    model = reward.RewardModel(_backbone())
    params = reward.init_params(model, sft_params, jax.random.PRNGKey(1))
    reorders = lambda n, seed: preference.toy_preferences(n, seed, negatives=("order",))  # noqa: E731
    train, _ = preference.encode_preferences(reorders(1024, 0), TOK, seq_len=16)
    evals, _ = preference.encode_preferences(reorders(64, 1), TOK, seq_len=16)
    batch = preference.collate_preferences(train[:8])
    loss, metrics = reward.reward_loss_fn(model)(params, batch, None, False)
    r = reward.sequence_rewards(model, params, batch)
    np.testing.assert_allclose(loss, -np.mean(jax.nn.log_sigmoid(r[:, 0] - r[:, 1])), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward_accuracy"], np.mean(r[:, 0] > r[:, 1]))

    mesh = engine.make_mesh(data=4, model=2)
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences,
                             loss_fn=reward.reward_loss_fn(model), params=params, optimizer=optax.adam(3e-3))
    predictor = engine.Predictor(mesh=mesh, collate_fn=preference.collate_preferences,
                                 pred_fn=reward.reward_pred_fn(model))
    accuracy = lambda: reward.reward_accuracy(  # noqa: E731
        evals, predictor.predict(evals, per_device_batch_size=4, params=trainer.params))["reward_accuracy"]
    before = accuracy()
    trainer.fit(train, per_device_batch_size=4, max_steps=32)
    assert accuracy() >= 0.9 > before
