"""The RLHF pipeline after SFT: engine.tasks.rlhf.reward (the score head at the sequence's final token, the Bradley-Terry loss)
and engine.tasks.rlhf.ppo (GAE, the clipped losses, rollouts, learning, exact resume), with short runs from a briefly
supervised-fine-tuned tiny LLaMA."""
import dataclasses
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.step import cast_floating
from engine.tasks import lm, text_data
from engine.tasks.rlhf import ppo, preference, reward

TOK = text_data.WordTokenizer(text_data.TOY_WORDS)


def _backbone():
    return models.create_model("llama", "tiny", vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128)


def _sft(steps):
    """The tiny LLaMA after `steps` SFT steps on the toy task (one device)."""
    model = _backbone()
    rows, _ = preference.encode_prompt_responses(preference.toy_prompt_responses(1024, seed=0), TOK, seq_len=16)
    trainer = engine.Trainer(mesh=engine.make_mesh(devices=jax.devices()[:1]),
                             collate_fn=preference.collate_preferences, loss_fn=lm.lm_loss_fn(model),
                             params=models.init_params(model, jax.random.PRNGKey(0)),
                             optimizer=optax.adam(3e-3))
    trainer.fit(rows, per_device_batch_size=16, max_steps=steps)
    return jax.device_get(trainer.params)


@pytest.fixture(scope="module")
def sft_params():
    """After 64 SFT steps the model answers most held-out prompts exactly (greedy): a backbone the reward model
    learns from quickly."""
    return _sft(64)


def test_reward_is_the_score_head_at_the_final_token():
    """A sequence's reward is score(hidden state at its EOS), the EOS being a label of the row and not an input; the
    backbone's parameters are used as they are."""
    backbone = _backbone()
    lm_params = models.init_params(backbone, jax.random.PRNGKey(0))
    model = models.RewardModel(backbone)
    params = models.init_reward_params(model, lm_params, jax.random.PRNGKey(1))
    assert params["backbone"] is lm_params and params["score"]["kernel"].shape == (64, 1)
    examples, _ = preference.encode_preferences(preference.toy_preferences(3, seed=0), TOK, seq_len=16)
    batch = preference.collate_preferences(examples)
    got = reward.sequence_rewards(model, params, batch)
    assert got.shape == (3, 2)
    # The whole sequences, right-padded (causal attention: the padding does not change the states before it).
    sequences = [TOK.encode(t["prompt"]) + [TOK.bos_id] + TOK.encode(t[key]) + [TOK.eos_id]
                 for t in preference.toy_preferences(3, seed=0) for key in ("chosen", "rejected")]
    ids = np.zeros((6, 16), np.int32)
    for i, tokens in enumerate(sequences):
        ids[i, :len(tokens)] = tokens
    hidden = backbone.apply({"params": lm_params}, jnp.asarray(ids), jnp.asarray(ids > 0, jnp.int32),
                            return_hidden=True)
    want = [hidden[i, len(tokens) - 1] @ params["score"]["kernel"][:, 0] for i, tokens in enumerate(sequences)]
    np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="backbone_params do not fit"):
        models.init_reward_params(model, {"embed": lm_params["embed"]}, jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match="expected a models.RewardModel"):
        reward.reward_loss_fn(backbone)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_reward_models_read_and_write_transformers_sequence_classifiers(tmp_path, family):
    """A transformers *ForSequenceClassification (one label) loads as a RewardModel whose rewards are transformers'
    scores of right-padded rows (read at the last token that is not padding); our export reads back in transformers
    to the same scores."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=96, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, num_labels=1,
                  pad_token_id=0)
    config = (tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=2, **common)
              if family == "llama" else tf.OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=32, **common))
    torch.manual_seed(0)
    hf = tf.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    ids = np.array([[5, 9, 17, 3, 4, 8, 0, 0], [7, 7, 2, 30, 31, 40, 41, 6]], np.int32)
    seg = (ids > 0).astype(np.int32)
    # engine.tasks.rlhf.preference rows: inputs = tokens[:-1], the last token a label
    last = seg.sum(1) - 1
    batch = {"input_ids": np.where(np.arange(8) < last[:, None], ids, 0), "segment_ids": (np.arange(8) < last[:, None])
             .astype(np.int32), "labels": np.where(np.arange(8) == last[:, None] - 1, ids[np.arange(2), last][:, None],
                                                   -100)}
    with torch.no_grad():
        want = hf(torch.tensor(ids, dtype=torch.long)).logits[:, 0].numpy()
    model, params = models.load_reward_model(str(tmp_path / "hf"))
    np.testing.assert_allclose(reward.sequence_rewards(model, params, batch), want, rtol=1e-4, atol=1e-5)
    models.save_reward_model(model, params, str(tmp_path / "ours"), pad_token_id=0)
    with torch.no_grad():
        again = tf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
        np.testing.assert_allclose(again(torch.tensor(ids, dtype=torch.long)).logits[:, 0].numpy(), want, rtol=1e-4,
                                   atol=1e-5)
    with pytest.raises(ValueError, match="expected a language model"):
        models.load_pretrained(str(tmp_path / "hf"))


def test_reward_loss_is_bradley_terry_and_training_ranks_the_sorted_list_first(sft_params):
    """The loss is mean -log sigmoid(r_chosen - r_rejected) with its metrics; from the SFT backbone, 32 steps on a
    4x1x2 mesh rank held-out sorted lists over other orders of the same names."""
    model = models.RewardModel(_backbone())
    params = models.init_reward_params(model, sft_params, jax.random.PRNGKey(1))
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


def test_with_lora_the_score_head_trains_beside_the_adapters(sft_params):
    """`models.SCORE_TRAINABLE` (train_reward.py's and train_ppo.py's head with --lora_rank) matches the head's leaf
    paths, alone or under PPO's 'critic': with the adapters it trains while every base weight stays. The scripts'
    patterns until stop 27 ('^score$', '^critic/score$') matched no leaf ('score/kernel'), so a LoRA reward model or
    critic kept its fresh head."""
    import re
    backbone = models.create_model("llama", "tiny", vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128,
                                   lora_rank=2)
    model = models.RewardModel(backbone)
    params = models.init_reward_params(model, models.add_lora(backbone, sft_params, jax.random.PRNGKey(5)),
                                jax.random.PRNGKey(1))
    paths = [engine.sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert [p for p in paths if re.search(models.SCORE_TRAINABLE, p)] == ["score/kernel"]
    assert re.search(models.SCORE_TRAINABLE, "critic/score/kernel")
    assert not any(re.search(models.SCORE_TRAINABLE, "actor/" + p) for p in paths if p != "score/kernel")
    train, _ = preference.encode_preferences(preference.toy_preferences(64, seed=0), TOK, seq_len=16)
    trainer = engine.Trainer(mesh=engine.make_mesh(devices=jax.devices()[:1]),
                             collate_fn=preference.collate_preferences, loss_fn=reward.reward_loss_fn(model),
                             params=params, optimizer=optax.adam(1e-2),
                             trainable=f"{models.LORA_TRAINABLE}|{models.SCORE_TRAINABLE}")
    trainer.fit(train, per_device_batch_size=8, max_steps=2)
    after = {engine.sharding.path_str(p): np.asarray(x)
             for p, x in jax.tree_util.tree_flatten_with_path(trainer.params)[0]}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = engine.sharding.path_str(path)
        moved = not np.array_equal(after[path], np.asarray(x))
        assert moved == (path == "score/kernel" or "/lora_" in path), path


# ------------------------------------------------------------------------------------------------------------ PPO

def test_gae_is_the_discounted_sum_of_td_errors_over_the_response():
    rng = np.random.default_rng(0)
    B, T = 4, 12
    rewards, values = rng.normal(size=(B, T)).astype(np.float32), rng.normal(size=(B, T)).astype(np.float32)
    mask = np.zeros((B, T), bool)
    for b, (start, stop) in enumerate([(0, 12), (3, 9), (5, 6), (2, 11)]):
        mask[b, start:stop] = True
    gamma, lam = 0.9, 0.8
    adv, returns = ppo.advantages_and_returns(rewards, values, mask, gamma=gamma, lam=lam)
    for b in range(B):
        steps = np.flatnonzero(mask[b])
        v = np.append(values[b, steps], 0.0)  # no value after the last response token
        deltas = rewards[b, steps] + gamma * v[1:] - v[:-1]
        for i, t in enumerate(steps):
            want = sum((gamma * lam) ** k * deltas[i + k] for k in range(len(steps) - i))
            np.testing.assert_allclose(adv[b, t], want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(returns[b, t], want + values[b, t], rtol=1e-5, atol=1e-6)
    assert not adv[~mask].any() and not returns[~mask].any()


def _ppo(sft_params, mesh, **config):
    actor = _backbone()
    critic = models.RewardModel(actor)
    task = ppo.PPO(actor=actor, critic=critic, ref_params=sft_params, tokenizer=TOK, mesh=mesh, seq_len=7 + 8 - 1,
                   reward_fn=preference.toy_reward, config=ppo.PPOConfig(max_new_tokens=8, **config))
    params = {"actor": sft_params,
              "critic": models.init_reward_params(critic, sft_params, jax.random.PRNGKey(1))}
    return task, jax.tree.map(jnp.asarray, params)


@pytest.mark.slow
def test_rollouts_with_an_int8_kv_cache_score_what_they_sample(sft_params):
    """PPOConfig(kv_cache_dtype='int8'): the rollouts sample through an int8 cache; the rows are scored by full
    forward passes, so each row's old log-probabilities are the reference's on its own tokens (KL 0), as with a
    float cache; greedy responses mostly equal a float cache's."""
    mesh = engine.make_mesh(data=4, model=2)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(8, seed=7)]
    (task, params), (task8, _) = _ppo(sft_params, mesh), _ppo(sft_params, mesh, kv_cache_dtype="int8")
    greedy, greedy8 = (t.generate_and_score(params, prompts, seed=3, temperature=0.0)[0] for t in (task, task8))
    # 7 of the 8 greedy responses are equal (measured; the eighth flips a near-tie and ends a token early)
    assert sum(a == b for a, b in zip(greedy, greedy8)) >= 6, (greedy, greedy8)
    examples, stats = task8.rollout(params, prompts, seed=3)
    assert stats["kl"] == 0.0 and all(np.isfinite(ex["old_log_probs"]).all() for ex in examples)
    # The paged engine's pages in int8 (kernels.quantize_kv's, as generate's int8 cache): the same greedy tokens.
    task8.config = dataclasses.replace(task8.config, rollout_engine="paged")
    assert task8.generate_and_score(params, prompts, seed=3, temperature=0.0)[0] == greedy8
    assert task8.paged_engine.cache_dtype == jnp.int8
    with pytest.raises(ValueError, match="PPOConfig.kv_cache_dtype='int4' is out of range"):
        ppo.PPOConfig(kv_cache_dtype="int4")


def test_rollout_rows_rewards_and_the_first_update_of_the_clipped_loss(sft_params):
    """The rollout's rows hold prompt + separator + response with only the response labelled; its score is the
    reward of the decoded response (unfinished_reward for one cut off before its EOS); with the policy still the
    reference the KL is 0, so with gamma = lam = 1 every response token's return is the score. At the rollout's
    policy the ratio is 1: the policy loss is -mean(advantage) and its gradient that of -mean(advantage x log pi)."""
    mesh = engine.make_mesh(data=4, model=2)
    task, params = _ppo(sft_params, mesh, lam=1.0, unfinished_reward=-2.0)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(16, seed=7)]
    examples, stats = task.rollout(params, prompts, seed=3)
    responses, _, scored = task.generate_and_score(params, prompts, seed=3)
    assert stats["kl"] == 0.0 and 0 < stats["ended"] <= 1
    for prompt, response, ex, s in zip(prompts, responses, examples, scored):
        labelled = ex["labels"][ex["labels"] >= 0].tolist()
        assert labelled == response[:len(labelled)]
        assert ex["input_ids"][:len(TOK.encode(prompt)) + 1].tolist() == TOK.encode(prompt) + [TOK.bos_id]
        ended = response[-1] == TOK.eos_id
        want = preference.toy_reward(prompt, TOK.decode([i for i in response if i != TOK.eos_id])) if ended else -2.0
        np.testing.assert_allclose(s["score"], want, rtol=1e-6)
        mask = ex["labels"] >= 0
        np.testing.assert_allclose(ex["returns"][mask], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(ex["old_log_probs"], s["ref_log_probs"])
    batch = preference.collate_preferences(examples)
    loss_fn = ppo.ppo_loss_fn(task.actor, task.critic, dataclasses.replace(task.config, value_coef=0.0))
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, None, True)
    mask = batch["labels"] >= 0
    np.testing.assert_allclose(loss, -batch["advantages"][mask].mean(), rtol=1e-5, atol=1e-6)
    assert metrics["approx_kl"] == 0 and metrics["clip_fraction"] == 0 and metrics["tokens"] == mask.sum()

    def surrogate(actor_params):
        out = task.actor.apply({"params": actor_params}, batch["input_ids"], batch["segment_ids"])
        log_probs = -lm.token_losses(task.actor, actor_params, out, batch["labels"])
        return -(batch["advantages"] * log_probs).sum() / mask.sum()
    want = jax.grad(surrogate)(params["actor"])
    for got, ref in zip(jax.tree.leaves(grads["actor"]), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)


def _run_ppo(task_and_params, workdir, max_steps, rollout_batch_size=32, ppo_epochs=2):
    task, params = task_and_params
    mesh = task.mesh
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=task.loss_fn(),
                             params=params, optimizer=optimizer, workdir=workdir and str(workdir))
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(2048, seed=0)]
    stats = ppo.fit_ppo(trainer, task, prompts, max_steps=max_steps, rollout_batch_size=rollout_batch_size,
                        per_device_batch_size=4, ppo_epochs=ppo_epochs, log_every=4)
    trainer.close()
    return trainer, stats


@pytest.mark.slow  # CI time; PPO's first update is checked exactly by a fast test
@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_ppo_resumes_exactly_mid_iteration(sft_params, tmp_path, estimator):
    """On a 2x1x2 mesh, a PPO (or GRPO) run stopped mid-iteration (max_steps) and resumed by a new Trainer on its
    workdir ends with the uninterrupted run's parameters bit for bit: the stopped iteration's experience is read
    back."""
    # One PPO (one compiled scoring pass) for the three runs, on 4 of the devices (a quicker compilation).
    task = {"gae": _ppo, "grpo": _grpo}[estimator](sft_params, engine.make_mesh(data=2, model=2,
                                                                              devices=jax.devices()[:4]))
    run = lambda workdir, max_steps: _run_ppo(task, workdir, max_steps, rollout_batch_size=16)  # noqa: E731
    whole, stats = run(tmp_path / "whole", 8)  # 2 iterations of 2 epochs x 2 updates
    assert len(stats) == 2
    stopped, stats = run(tmp_path / "parts", 3)  # mid-iteration 0, mid-epoch
    assert stopped.step == 3 and not stats
    resumed, stats = run(tmp_path / "parts", 8)
    assert len(stats) == 2  # iteration 0 (its rest: the stats saved with its experience), then iteration 1
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    events = b"".join(p.read_bytes() for p in (tmp_path / "whole" / "tensorboard").glob("events.out.tfevents*"))
    assert b"rollout/score" in events and b"rollout/kl" in events and b"train/policy_loss" in events
    assert (b"train/kl" if estimator == "grpo" else b"train/value_loss") in events


@pytest.mark.slow
def test_ppo_raises_the_rule_reward():
    """On a 4x1x2 mesh, 20 iterations of PPO with the toy task's rule reward, from a model after 32 SFT steps, raise
    the sampled responses' mean reward."""
    _, stats = _run_ppo(_ppo(_sft(32), engine.make_mesh(data=4, model=2)), None, 80, rollout_batch_size=64,
                        ppo_epochs=1)
    scores = [s["score"] for s in stats]
    assert np.mean(scores[-3:]) > np.mean(scores[:3]) + 0.08, scores


@pytest.mark.slow
def test_grpo_raises_the_rule_reward():
    """As above with GRPO (no critic): 20 iterations of 16 prompts x 4 responses raise the sampled mean reward."""
    _, stats = _run_ppo(_grpo(_sft(32), engine.make_mesh(data=4, model=2)), None, 80, rollout_batch_size=64,
                        ppo_epochs=1)
    scores = [s["score"] for s in stats]
    # Means of five iterations (single ones move by +-0.04): a rounding-level change of the loss's arithmetic moved the
    # gain of three-iteration means from 0.082 to 0.071, that of five-iteration ones from 0.079 to 0.074.
    assert np.mean(scores[-5:]) > np.mean(scores[:5]) + 0.05, scores


def _lora_ppo(sft_params, mesh):
    """(shared, copies, params, prompts, common PPO arguments): LoRA PPO with reference and reward model sharing
    the frozen weights, and the same with separate copies of them."""
    actor = models.create_model("llama", "tiny", vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128,
                                lora_rank=4)
    critic = models.RewardModel(actor)
    actor_params = models.add_lora(actor, sft_params, jax.random.PRNGKey(5))
    critic_params = models.init_reward_params(critic, actor_params, jax.random.PRNGKey(1))
    score = {"score": jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(2), x.shape),
                                   critic_params["score"])}
    config = ppo.PPOConfig(max_new_tokens=8)
    common = dict(actor=actor, critic=critic, tokenizer=TOK, mesh=mesh, seq_len=14, reward_model=critic,
                  config=config)
    shared = ppo.PPO(ref_params=None, reward_params=score, **common)
    copies = ppo.PPO(ref_params=actor_params, reward_params={"backbone": critic_params["backbone"], **score},
                     **common)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(256, seed=0)]
    return shared, copies, {"actor": actor_params, "critic": critic_params}, prompts, dict(common, reward_params=score)


@pytest.mark.slow
def test_lora_ppo_shares_the_frozen_base_with_reference_and_reward_model(sft_params):
    """With adapters on actor and critic and only they (and the critic's score head) trained, `ref_params=None` and
    `reward_params={'score': ...}` read the Trainer's frozen weights with the adapters off: rollouts and two
    iterations of updates equal those of the same run with separate reference and reward-model copies (to float
    rounding: the two scoring passes are different compiled programs)."""
    mesh = engine.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    shared, copies, params, prompts, _ = _lora_ppo(sft_params, mesh)
    runs = []
    for task in (shared, copies):
        trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=task.loss_fn(),
                                 params=params, optimizer=optax.adam(1e-2),
                                 trainable=f"{models.LORA_TRAINABLE}|{models.SCORE_TRAINABLE}")
        stats = ppo.fit_ppo(trainer, task, prompts, max_steps=4, rollout_batch_size=16, per_device_batch_size=4)
        runs.append((trainer.params, stats))
    (p1, s1), (p2, s2) = runs
    assert len(s1) == 2 and s1[0]["kl"] == 0.0 and s1[1]["kl"] != 0.0
    assert not np.array_equal(p1["critic"]["score"]["kernel"], params["critic"]["score"]["kernel"])
    for a, b in zip(s1, s2):
        assert a.keys() == b.keys() and all(np.isclose(a[k], b[k], rtol=1e-5) for k in a), (a, b)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_lora_ppo_refuses_to_train_what_the_shared_reference_reads(sft_params):
    mesh = engine.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    shared, _, params, prompts, common = _lora_ppo(sft_params, mesh)
    everything = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=shared.loss_fn(),
                                params=params, optimizer=optax.adam(1e-2))
    with pytest.raises(ValueError, match="shares with it"):
        ppo.fit_ppo(everything, shared, prompts, max_steps=2, rollout_batch_size=16, per_device_batch_size=4)
    with pytest.raises(ValueError, match="ref_params=None"):
        ppo.PPO(**{**common, "actor": _backbone()}, ref_params=None)
    with pytest.raises(ValueError, match="no 'backbone'"):
        ppo.PPO(**{**common, "critic": models.RewardModel(_backbone()), "ref_params": None})


@pytest.mark.slow
def test_scores_on_a_context_mesh_equal_the_unsplit_ones():
    """PPO's scoring program reads a critic's values on the rows [B, T] and a reward model's scores on the rows with
    their EOS appended, [B, T + 1]. On a context mesh T splits and T + 1 did not, and that mix failed XLA:CPU's
    verifier ("Expected instruction to have shape equal to f32[2,13,32]"), i.e. `train_ppo.py --context_parallel`:
    the appended rows are now padded on to a multiple of the context size. Values and scores on data 2 x context 2
    x model 2 equal the unsplit ones."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    critic = models.RewardModel(models.create_model("llama", "tiny", vocab_size=64))
    params = models.init_reward_params(critic, models.init_params(critic.backbone, jax.random.PRNGKey(0)),
                                jax.random.PRNGKey(2))
    rng = np.random.RandomState(0)
    rows = [{"input_ids": rng.randint(3, 60, 12).astype(np.int32), "segment_ids": np.ones(12, np.int32),
             "labels": np.r_[np.full(11, -100), 5].astype(np.int32)} for _ in range(8)]
    collate = preference.collate_preferences  # what PPO's scorer collates its rows with

    def score(p, batch, rng=None):
        return {"values": critic.apply({"params": p["critic"]}, batch["input_ids"], batch["segment_ids"]),
                "score": reward.sequence_rewards(critic, p["reward"], batch)}

    want = score({"critic": params, "reward": params}, collate(rows))
    mesh = engine.make_mesh(data=2, context=2, model=2)
    specs = engine.auto_shard(params, mesh, trace_fn=lambda p: score({"critic": p, "reward": p}, collate(rows)))
    place = lambda: jax.device_put(params, jax.tree.map(  # noqa: E731
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))
    got = engine.Predictor(mesh=mesh, collate_fn=collate, pred_fn=score).predict(
        rows, per_device_batch_size=2, params={"critic": place(), "reward": place()})
    np.testing.assert_allclose([g["score"] for g in got], want["score"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.stack([g["values"] for g in got]), want["values"], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------- GRPO

def test_group_advantages_are_each_score_against_its_prompts_group():
    scores = np.float32([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 3, 1, 2, 0])
    adv = ppo.group_advantages(scores, 4)
    for g in range(3):
        s = scores[4 * g:4 * g + 4].astype(np.float64)
        want = (s - s.mean()) / (s.std(ddof=1) + 1e-4)
        np.testing.assert_allclose(adv[4 * g:4 * g + 4], want, rtol=1e-6, atol=1e-7)
    assert adv.dtype == np.float32 and not adv[4:8].any()  # equal scores: nothing to learn
    unscaled = ppo.group_advantages(scores, 4, scale=False)  # Dr. GRPO: centred only
    np.testing.assert_allclose(unscaled, scores - np.repeat(scores.reshape(3, 4).mean(1), 4), rtol=1e-6, atol=1e-7)


def _grpo(sft_params, mesh, **config):
    config = ppo.PPOConfig(max_new_tokens=8, advantage_estimator="grpo", samples_per_prompt=4, **config)
    task = ppo.PPO(actor=_backbone(), critic=None, ref_params=sft_params, tokenizer=TOK, mesh=mesh, seq_len=7 + 8 - 1,
                   reward_fn=preference.toy_reward, config=config)
    return task, {"actor": jax.tree.map(jnp.asarray, sft_params)}


def _log_probs_by_hand(actor, actor_params, batch):
    out = actor.apply({"params": actor_params}, batch["input_ids"], batch["segment_ids"])
    return -lm.token_losses(actor, actor_params, out, batch["labels"])


def test_grpo_rollout_groups_and_its_loss(sft_params):
    """GRPO: each prompt is answered samples_per_prompt times in consecutive rows, every response token carries its
    response's group advantage, and the rows hold the reference's log-probabilities (no values, no returns). At the
    rollout's policy (the reference) the loss is -mean(advantage) and its gradient that of -mean(advantage x log
    pi): the k3 KL term and its gradient vanish there. With the parameters moved and zero advantages the loss is
    kl_coef x the mean over response tokens of pi_ref/pi - log(pi_ref/pi) - 1, computed by hand."""
    mesh = engine.make_mesh(data=4, model=2)
    task, params = _grpo(sft_params, mesh, kl_coef=0.1)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(4, seed=7)]
    examples, stats = task.rollout(params, prompts, seed=3)
    responses, _, scored = task.generate_and_score(params, [p for p in prompts for _ in range(4)], seed=3)
    assert len(examples) == 16 and stats["kl"] == 0.0
    assert any(len({tuple(r) for r in responses[4 * g:4 * g + 4]}) > 1 for g in range(4))  # groups vary
    adv = ppo.group_advantages([s["score"] for s in scored], 4)
    for i, ex in enumerate(examples):
        prompt = TOK.encode(prompts[i // 4]) + [TOK.bos_id]
        assert ex["input_ids"][:len(prompt)].tolist() == prompt
        mask = ex["labels"] >= 0
        assert ex["labels"][mask].tolist() == responses[i][:mask.sum()]
        np.testing.assert_allclose(ex["advantages"][mask], adv[i], rtol=1e-6)
        assert not ex["advantages"][~mask].any() and not ex["ref_log_probs"][~mask].any()
        np.testing.assert_array_equal(ex["ref_log_probs"], ex["old_log_probs"])  # the policy is the reference
        assert "old_values" not in ex and "returns" not in ex
    task.config = dataclasses.replace(task.config, scale_rewards=False)  # Dr. GRPO: the same rollout, centred only
    centred = ppo.group_advantages([s["score"] for s in scored], 4, scale=False)
    for i, ex in enumerate(task.rollout(params, prompts, seed=3)[0]):
        np.testing.assert_allclose(ex["advantages"][ex["labels"] >= 0], centred[i], rtol=1e-6)
    batch = preference.collate_preferences(examples)
    mask = batch["labels"] >= 0
    loss_fn = task.loss_fn()
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, None, True)
    np.testing.assert_allclose(loss, -batch["advantages"][mask].mean(), rtol=1e-5, atol=1e-6)
    assert metrics["kl"] < 1e-6 and "value_loss" not in metrics and set(grads) == {"actor"}
    def surrogate(actor_params):
        return -(batch["advantages"] * _log_probs_by_hand(task.actor, actor_params, batch)).sum() / mask.sum()
    for got, ref in zip(jax.tree.leaves(grads["actor"]), jax.tree.leaves(jax.grad(surrogate)(params["actor"]))):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)
    moved = jax.tree.map(lambda x: x * 1.1, params)
    loss, metrics = loss_fn(moved, {**batch, "advantages": np.zeros_like(batch["advantages"])}, None, True)
    d = np.asarray(batch["ref_log_probs"] - _log_probs_by_hand(task.actor, moved["actor"], batch))[mask]
    want = (np.exp(d) - d - 1).mean()
    assert want > 1e-3
    np.testing.assert_allclose(metrics["kl"], want, rtol=1e-4)
    np.testing.assert_allclose(loss, 0.1 * want, rtol=1e-4)


def test_grpo_trains_the_actor_alone_and_its_workdir_restores(sft_params, tmp_path):
    """fit_ppo with GRPO on a 2x1x2 mesh: iterations of rollout_batch_size / samples_per_prompt prompts, a Trainer
    over {'actor'} only, and the workdir's policy read back by `run_record.restore_run` (generate.py and
    export_hf.py)."""
    from engine.tasks import run_record
    mesh = engine.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    task, params = _grpo(sft_params, mesh)
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=task.loss_fn(),
                             params=params, optimizer=optax.adam(1e-3), workdir=str(tmp_path))
    run_record.save_run(str(tmp_path), "ppo", task.actor, TOK)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(64, seed=0)]
    seen = []
    original = task.rollout
    task.rollout = lambda p, iteration_prompts, **kw: seen.append(iteration_prompts) or original(
        p, iteration_prompts, **kw)
    stats = ppo.fit_ppo(trainer, task, prompts, max_steps=4, rollout_batch_size=16, per_device_batch_size=4)
    trainer.close()
    assert len(stats) == 2 and [len(s) for s in seen] == [4, 4] and seen[0] != seen[1]
    assert set(trainer.params) == {"actor"} and stats[1]["kl"] != 0.0
    with np.load(tmp_path / ppo.EXPERIENCE_FILE.format(1)) as z:
        assert "ref_log_probs" in z.files and "old_values" not in z.files and z["input_ids"].shape[0] == 16
    task_name, model, restored, _ = run_record.restore_run(str(tmp_path), mesh)
    assert task_name == "ppo" and model.config == task.actor.config
    for a, b in zip(jax.tree.leaves(trainer.params["actor"]), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="rollout_batch_size=18; expected .* samples_per_prompt \\(4\\)"):
        ppo.fit_ppo(trainer, task, prompts, max_steps=8, rollout_batch_size=18, per_device_batch_size=1)


def test_grpo_refuses_a_critic_and_a_group_of_one(sft_params):
    mesh = engine.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    common = dict(actor=_backbone(), ref_params=sft_params, tokenizer=TOK, mesh=mesh, seq_len=14,
                  reward_fn=preference.toy_reward)
    grpo = ppo.PPOConfig(advantage_estimator="grpo", samples_per_prompt=2)
    with pytest.raises(ValueError, match="PPOConfig.samples_per_prompt=1 is out of range"):
        ppo.PPOConfig(advantage_estimator="grpo")
    with pytest.raises(ValueError, match="PPOConfig.scale_rewards=1 is out of range"):
        ppo.PPOConfig(advantage_estimator="grpo", samples_per_prompt=2, scale_rewards=1)
    with pytest.raises(ValueError, match="PPOConfig.advantage_estimator='rloo' is out of range"):
        ppo.PPOConfig(advantage_estimator="rloo")
    with pytest.raises(ValueError, match="critic given with advantage_estimator='grpo'"):
        ppo.PPO(critic=models.RewardModel(_backbone()), config=grpo, **common)
    with pytest.raises(ValueError, match="critic=NoneType with advantage_estimator='gae'"):
        ppo.PPO(critic=None, **common)
    rm = models.RewardModel(_backbone())
    with pytest.raises(ValueError, match="no 'backbone'"):
        ppo.PPO(critic=None, config=grpo, **{**common, "reward_fn": None}, reward_model=rm,
                reward_params={"score": {"kernel": jnp.zeros((64, 1))}})


# ------------------------------------------------------------------------------------------ paged-engine rollouts

def _rollouts_by_engine(task, params, prompts, seed):
    """{engine: task.rollout(...)} of one task (one compiled scoring pass) with each rollout engine."""
    out = {}
    for rollout_engine in ppo.ROLLOUT_ENGINES:
        task.config = dataclasses.replace(task.config, rollout_engine=rollout_engine)
        out[rollout_engine] = task.rollout(params, prompts, seed=seed)
    return out


def _assert_same_examples(want, got):
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_paged_greedy_ppo_equals_the_static_rollout_and_update(sft_params):
    """PPOConfig(rollout_engine='paged', temperature=0) on a 2x1x2 mesh (the engine on the placed parameters): the
    rollout's rows, log-probabilities, values, rewards, advantages and stats, and so the first update's loss and
    metrics, equal the static path's (`models.generate`) bit for bit."""
    mesh = engine.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    task, params = _ppo(sft_params, mesh, temperature=0.0)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(8, seed=7)]
    runs = _rollouts_by_engine(task, params, prompts, seed=3)
    (static, static_stats), (paged, paged_stats) = runs["static"], runs["paged"]
    assert paged_stats == static_stats
    _assert_same_examples(static, paged)
    assert len({int((ex["labels"] >= 0).sum()) for ex in static}) > 1  # rows retire at their own EOS
    assert np.abs(static[0]["advantages"]).max() > 0
    loss_fn = jax.jit(task.loss_fn(), static_argnums=(2, 3))
    (loss, metrics), (loss_p, metrics_p) = (loss_fn(params, preference.collate_preferences(rows), None, True)
                                            for rows in (static, paged))
    assert float(loss) == float(loss_p) != 0.0 and jax.device_get(metrics) == jax.device_get(metrics_p)


def test_paged_grpo_groups_share_their_prompt_pages(sft_params):
    """GRPO through the paged engine: greedy rollouts (every group's rows alike) equal the static path's, each
    prompt prefilled once for its whole group (one device: the test above has the mesh); sampled rollouts draw a
    seed per row (groups vary, the same seed gives the same rollout) and score what they sample (old log-
    probabilities the reference's, each score the rule's reward of the decoded response)."""
    mesh = engine.make_mesh(devices=jax.devices()[:1])
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(4, seed=7)]
    paged, params = _grpo(sft_params, mesh, temperature=0.0)
    runs = _rollouts_by_engine(paged, params, prompts, seed=3)
    assert runs["paged"][1] == runs["static"][1]
    _assert_same_examples(runs["static"][0], runs["paged"][0])
    pool = paged.paged_engine
    assert pool.prefills == len(prompts) and pool.traces == {"prefill": 1, "decode": 1, "sample": 1}
    assert sorted(pool.free_pages) == list(range(pool.num_pages))  # every page back
    paged.config = dataclasses.replace(paged.config, temperature=1.0)
    rows = [p for p in prompts for _ in range(4)]
    responses, _, scored = paged.generate_and_score(params, rows, seed=5)
    assert any(len({tuple(r) for r in responses[4 * g:4 * g + 4]}) > 1 for g in range(len(prompts)))
    assert paged.generate_and_score(params, rows, seed=5)[0] == responses
    assert paged.generate_and_score(params, rows, seed=6)[0] != responses
    assert pool.prefills == 4 * len(prompts) and pool.traces == {"prefill": 1, "decode": 1, "sample": 1}
    for prompt, response, s in zip(rows, responses, scored):
        text = TOK.decode([i for i in response if i != TOK.eos_id])
        assert s["score"] == np.float32(preference.toy_reward(prompt, text))
        np.testing.assert_array_equal(s["log_probs"], s["ref_log_probs"])


def test_paged_rollout_settings_refused_in_one_line(sft_params):
    with pytest.raises(ValueError, match=r"^PPOConfig.kv_cache_dtype='bfloat16' with rollout_engine='paged'; "
                                         r"expected None \(the actor's compute dtype\) or 'int8'"):
        ppo.PPOConfig(rollout_engine="paged", kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^PPOConfig.rollout_kv_memory_gb=1.0 with rollout_engine='static'; "
                                         r"expected it with rollout_engine='paged' only"):
        ppo.PPOConfig(rollout_kv_memory_gb=1.0)
    with pytest.raises(ValueError, match=r"^PPOConfig.rollout_engine='vllm' is out of range"):
        ppo.PPOConfig(rollout_engine="vllm")
    with pytest.raises(ValueError, match=r"^PPOConfig.rollout_kv_memory_gb=1e-09 holds less than one row of 14 "
                                         r"tokens"):
        _ppo(sft_params, engine.make_mesh(devices=jax.devices()[:1]), rollout_engine="paged",
             rollout_kv_memory_gb=1e-9)
    # A row too short for a response: the static path generates it and refuses the cut row; the paged engine stops
    # the request at the row's end (one page-table width for every rollout) and refuses the same row.
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(8, seed=7)]
    refused = []
    for rollout_engine in ppo.ROLLOUT_ENGINES:
        task = ppo.PPO(actor=_backbone(), critic=None, ref_params=sft_params, tokenizer=TOK,
                       mesh=engine.make_mesh(devices=jax.devices()[:1]), seq_len=8, reward_fn=preference.toy_reward,
                       config=ppo.PPOConfig(advantage_estimator="grpo", samples_per_prompt=2, temperature=0.0,
                                            rollout_engine=rollout_engine))
        with pytest.raises(ValueError, match=r"^seq_len=8: prompt \d+ \(\d+ tokens with the separator\) and its "
                                             r"response \(\d+\+?\) do not fit") as e:
            task.generate_and_score({"actor": sft_params}, prompts, seed=0)
        refused.append(str(e.value).split(" and ")[0])
    assert refused[0] == refused[1], refused


@pytest.mark.slow
def test_train_ppo_script_with_paged_rollouts(tmp_path):
    """train_ppo.py --rollout_engine=paged with greedy rollouts (--temperature=0), a fresh tiny model on the toy
    task's rule reward, one iteration of 8 rollouts and 2 updates on data 4 x model 2: its iteration line, losses and
    greedy answers' reward equal --rollout_engine=static's. Bad combinations end in one error line."""
    import os
    import re

    from tests.prewarmed import run_scripts
    from tests.xla_flags import cpu_devices
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=cpu_devices(8), JAX_PLATFORMS="cpu")
    common = ["--temperature=0", "--toy_size=64", "--eval_size=16", "--per_device_batch_size=1", "--mesh=-1,1,2",
              "--rollout_batch_size=8", "--max_steps=2", "--max_new_tokens=6", "--eval_answers=4", "--log_every=1",
              '--model_overrides={"hidden_size": 32, "intermediate_size": 64}']
    cases = [("train_ppo.py", f"--workdir={tmp_path / engine_}", f"--rollout_engine={engine_}", *common)
             for engine_ in ppo.ROLLOUT_ENGINES]
    bad = {("--rollout_engine=paged", "--kv_cache_dtype=bfloat16"):
           "error: --kv_cache_dtype=bfloat16 with --rollout_engine=paged; expected auto or int8",
           ("--rollout_kv_memory_gb=2",): "error: --rollout_kv_memory_gb=2.0 with --rollout_engine=static; expected "
                                          "it with --rollout_engine=paged only",
           ("--rollout_engine=vllm",): "error: flag --rollout_engine=vllm: value should be one of <static|paged>"}
    cases += [("train_ppo.py", f"--workdir={tmp_path / 'bad'}", *args) for args in bad]
    results = run_scripts(cases, env, root)
    lines = []
    for code, out, err in results[:2]:
        assert code == 0, err[-3000:]
        lines.append(re.findall(r"^(iteration .*|step .*loss.*|after training.*)$", out, re.M))
    assert len(lines[0]) == 4 and lines[1] == lines[0], lines
    for (code, out, err), message in zip(results[2:], bad.values()):
        assert code == 2 and message in err and "Traceback" not in err, (message, err[-2000:])


@pytest.mark.slow  # CI time (two scoring programs and two rollouts' compiles)
def test_rollouts_in_the_trainers_compute_dtype_score_what_its_step_computes(sft_params):
    """PPO.rollout(compute_dtype=bf16), as fit_ppo passes the Trainer's Precision: the policy and the reference
    sample and score with bf16 parameters, so the KL to the reference starts at 0 and the first update's log-probs,
    taken by the loss on the same bf16-cast parameters (the train step's cast), equal the old ones (ratio 1); scored
    in float32 instead, they differ by bf16's rounding."""
    mesh = engine.make_mesh(data=4, model=2)
    task, params = _ppo(sft_params, mesh)
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(8, seed=7)]
    loss_fn = ppo.ppo_loss_fn(task.actor, task.critic, task.config)
    half = cast_floating(params, jnp.bfloat16)
    kls = []
    for dtype in (jnp.bfloat16, None):
        examples, stats = task.rollout(params, prompts, seed=3, compute_dtype=dtype)
        assert stats["kl"] == 0.0
        batch = preference.collate_preferences(examples)
        kls.append(float(jax.jit(lambda p, b: loss_fn(p, b, None, True)[1]["approx_kl"])(half, batch)))
    assert kls[0] < 1e-7 < 1e-5 < kls[1], kls


def _fit_grpo(sft_params, workdir, max_steps, stop_in_rollout=None, **config):
    """(trainer, the steps it rolled out at) of fit_ppo on `workdir` with GRPO on a 2x1x2 mesh (iterations of two
    updates), sending this process a SIGTERM after its `stop_in_rollout`-th rollout. config: PPOConfig's."""
    mesh = engine.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    task, params = _grpo(sft_params, mesh, **config)
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=task.loss_fn(),
                             params=params, optimizer=optax.adam(1e-3), workdir=str(workdir))
    rollouts, original = [], task.rollout

    def rollout(*args, **kw):
        rollouts.append(trainer.step)
        out = original(*args, **kw)
        if len(rollouts) == stop_in_rollout:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    task.rollout = rollout
    prompts = [p["prompt"] for p in preference.toy_prompt_responses(64, seed=0)]
    try:
        ppo.fit_ppo(trainer, task, prompts, max_steps=max_steps, rollout_batch_size=16, per_device_batch_size=4)
    finally:
        trainer.close()
    return trainer, rollouts


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_signal_during_a_rollout_saves_and_the_resume_ends_where_the_uninterrupted_run_ends(sft_params, tmp_path):
    """A SIGTERM during a rollout (outside `fit`, whose handler is not installed there) saves the step and the
    rollout's experience and ends with StoppedBySignal; the resume trains on that experience without rolling out
    again and ends bit for bit where the uninterrupted run ends."""
    whole, _ = _fit_grpo(sft_params, tmp_path / "whole", 4)
    with pytest.raises(engine.StoppedBySignal) as stopped:
        _fit_grpo(sft_params, tmp_path / "term", 4, stop_in_rollout=2)
    assert stopped.value.step == 2 and stopped.value.saved and (tmp_path / "term" / "ppo_experience-1.npz").exists()
    resumed, rollouts = _fit_grpo(sft_params, tmp_path / "term", 4)
    assert rollouts == []  # iteration 1's experience was saved
    _assert_same_params(whole, resumed)


def test_a_signal_amid_a_paged_rollout_drops_it_and_the_resume_samples_it_again(sft_params, tmp_path, monkeypatch):
    """A SIGTERM while the paged engine decodes the second rollout stops the run at its next step: the rollout is
    dropped (no experience file), the step saved, StoppedBySignal; the resume rolls out that iteration again and
    ends bit for bit where the uninterrupted run ends."""
    steps, term = [], []  # engine steps per rollout; (rollout, step) to send a SIGTERM at
    generate, step = ppo.PPO._paged_generate, models.PagedEngine.step

    def rollout(*args, **kwargs):
        steps.append(0)
        return generate(*args, **kwargs)

    def counted(engine_, *args):
        steps[-1] += 1
        if term == [len(steps), steps[-1]]:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(engine_, *args)
    monkeypatch.setattr(ppo.PPO, "_paged_generate", rollout)
    monkeypatch.setattr(models.PagedEngine, "step", counted)
    whole, _ = _fit_grpo(sft_params, tmp_path / "whole", 4, rollout_engine="paged")
    assert len(steps) == 2 and steps[1] > 2, steps
    whole_steps, steps[:], term[:] = list(steps), [], [2, 1]  # at the second rollout's first step
    with pytest.raises(engine.StoppedBySignal) as stopped:
        _fit_grpo(sft_params, tmp_path / "term", 4, rollout_engine="paged")
    assert steps == [whole_steps[0], 1]  # dropped before its second step
    assert stopped.value.step == 2 and stopped.value.saved and not (tmp_path / "term" / "ppo_experience-1.npz").exists()
    resumed, rollouts = _fit_grpo(sft_params, tmp_path / "term", 4, rollout_engine="paged")
    assert rollouts == [2]
    _assert_same_params(whole, resumed)


@pytest.mark.slow  # CI time (four fit_ppo runs); the signal test keeps the experience files in CI
def test_a_checkpoint_older_than_the_newest_rollout_still_finds_its_experience(sft_params, tmp_path):
    """A checkpoint inside an iteration older than the newest rollout (a run killed after rolling out the next
    iteration, before its next checkpoint) resumes on its iteration's saved experience, exactly; the experience of
    iterations no checkpoint lies in is removed."""
    whole, _ = _fit_grpo(sft_params, tmp_path / "whole", 6)
    killed = tmp_path / "killed"
    _fit_grpo(sft_params, killed, 3)  # a checkpoint at step 3, inside iteration 1
    _fit_grpo(sft_params, killed, 5)  # rolls out iteration 2; then its checkpoint at 5 is lost (killed before it)
    shutil.rmtree(killed / "checkpoints" / "5")
    resumed, rollouts = _fit_grpo(sft_params, killed, 6)
    assert rollouts == [4] and not (killed / "ppo_experience-0.npz").exists()  # iteration 1's experience read
    _assert_same_params(whole, resumed)
