"""engine.tasks.rlhf.preference: the prompt/response rows of SFT and DPO, sequence log-probabilities, DPO's loss, and short
SFT and DPO runs."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import engine
import models
from engine.tasks import lm, text_data
from engine.tasks.rlhf import preference

TOK = text_data.WordTokenizer(text_data.TOY_WORDS)


def _model():
    return models.create_model("llama", "tiny", vocab_size=TOK.vocab_size, hidden_size=64, intermediate_size=128)


def test_encode_labels_only_the_response_and_its_eos():
    triple = {"prompt": "owl cat", "chosen": "cat owl", "rejected": "owl cat"}
    (ex,), cut = preference.encode_preferences([triple], TOK, seq_len=8)
    owl, cat = TOK.encode("owl cat")
    assert cut == 0
    # prompt, separator (BOS), response, EOS; the labels are the next tokens where those are the response's.
    assert ex["input_ids"][0].tolist() == [owl, cat, TOK.bos_id, cat, owl, 0, 0, 0]
    assert ex["labels"][0].tolist() == [-100, -100, cat, owl, TOK.eos_id, -100, -100, -100]
    assert ex["labels"][1].tolist() == [-100, -100, owl, cat, TOK.eos_id, -100, -100, -100]
    assert ex["segment_ids"][1].tolist() == [1] * 5 + [0] * 3
    (short,), cut = preference.encode_preferences([triple], TOK, seq_len=4)
    assert cut == 1 and short["labels"][0].tolist() == [-100, -100, cat, owl]
    with pytest.raises(ValueError, match="seq_len=3: triple 0's prompt takes 3 tokens"):
        preference.encode_preferences([triple], TOK, seq_len=3)

    class Bare:  # a tokenizer with neither BOS nor EOS: nothing marks an empty prompt or response
        bos_id = eos_id = None
        encode = staticmethod(lambda s: [ord(c) for c in s])
    with pytest.raises(ValueError, match="triple 0's prompt '' has no tokens"):
        preference.encode_preferences([{**triple, "prompt": ""}], Bare(), seq_len=8)
    with pytest.raises(ValueError, match="triple 0's rejected response '' has no tokens"):
        preference.encode_preferences([{**triple, "rejected": ""}], Bare(), seq_len=8)


def test_sft_rows_are_the_chosen_rows_of_the_preference_layout():
    triples = preference.toy_preferences(8, seed=3)
    pairs = preference.toy_prompt_responses(8, seed=3)
    assert [p["response"] for p in pairs] == [t["chosen"] for t in triples]
    rows, cut = preference.encode_prompt_responses(pairs, TOK, seq_len=16)
    prefs, _ = preference.encode_preferences(triples, TOK, seq_len=16)
    assert cut == 0
    for row, pref in zip(rows, prefs):
        assert {k: v.tolist() for k, v in row.items()} == {k: v[0].tolist() for k, v in pref.items()}
    with pytest.raises(ValueError, match="seq_len=3: pair 0's prompt takes"):
        preference.encode_prompt_responses([{"prompt": "owl cat", "response": "cat owl"}], TOK, seq_len=3)
    with pytest.raises(ValueError, match="seq_len=True; expected an int >= 2"):
        preference.encode_prompt_responses(pairs, TOK, seq_len=True)


def test_sft_loss_is_the_response_loss():
    """The SFT loss (lm.lm_loss_fn on these rows) is the mean cross-entropy of the response tokens only: it equals
    the hand-computed mean over the labelled positions, fewer than the row's tokens."""
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows, _ = preference.encode_prompt_responses(preference.toy_prompt_responses(4, seed=0), TOK, seq_len=16)
    batch = preference.collate_preferences(rows)
    loss, metrics = lm.lm_loss_fn(model)(params, batch, None, False)
    logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"])
    logp = jax.nn.log_softmax(logits)
    want = [-logp[b, t, batch["labels"][b, t]] for b in range(4) for t in range(16) if batch["labels"][b, t] >= 0]
    np.testing.assert_allclose(loss, np.mean(want), rtol=1e-5)
    assert metrics["tokens"] == len(want) < (batch["segment_ids"] > 0).sum()


@pytest.mark.slow
def test_sft_learns_to_answer_on_a_mesh():
    """64 SFT steps on a 4x1x2 mesh take the held-out greedy answers from no exact match to most."""
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    rows, _ = preference.encode_prompt_responses(preference.toy_prompt_responses(1024, seed=0), TOK, seq_len=16)
    mesh = engine.make_mesh(data=4, model=2)
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences, loss_fn=lm.lm_loss_fn(model),
                             params=params, optimizer=optax.adam(3e-3))
    held_out = preference.toy_prompt_responses(32, seed=1)
    assert preference.answer_exact_match(model, trainer.params, TOK, held_out, max_new_tokens=8) == 0.0
    trainer.fit(rows, per_device_batch_size=4, max_steps=64)
    assert preference.answer_exact_match(model, trainer.params, TOK, held_out, max_new_tokens=8) >= 0.5


def test_toy_preferences_prefer_the_sorted_list():
    triples = preference.toy_preferences(50, seed=1)
    assert triples == preference.toy_preferences(50, seed=1)
    kinds = []
    for t in triples:
        prompt, chosen, rejected = (t[k].split() for k in ("prompt", "chosen", "rejected"))
        assert chosen == sorted(prompt) != rejected
        missing, extra = set(prompt) - set(rejected), set(rejected) - set(prompt)
        kinds.append((len(missing), len(extra)))
        assert len(rejected) == len(prompt) - len(missing) + len(extra)
        if kinds[-1] == (0, 0):  # another order
            assert sorted(rejected) == chosen
        else:  # the sorted list with one name dropped, added or replaced
            assert rejected == sorted(rejected) and kinds[-1] in ((1, 0), (0, 1), (1, 1))
    assert sorted(set(kinds)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(sorted(t["rejected"].split()) == t["chosen"].split()
               for t in preference.toy_preferences(50, seed=1, negatives=("order",)))
    with pytest.raises(ValueError, match="negatives=\\('shuffled',\\); expected a non-empty subset"):
        preference.toy_preferences(5, seed=1, negatives=("shuffled",))


def test_sequence_log_probs_loss_and_metrics_match_the_formula():
    """log p(response | prompt) is the sum of the response tokens' log-softmax (plain and fused head); the DPO loss
    is -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), log 2 where the policy is the reference; the IPO and
    label-smoothed (conservative) variants are their formulas."""
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    examples, _ = preference.encode_preferences(preference.toy_preferences(4, seed=0), TOK, seq_len=16)
    batch = preference.collate_preferences(examples)
    log_probs = jax.jit(preference.sequence_log_probs, static_argnums=0, static_argnames="implementation")
    logp = log_probs(model, params, batch)
    logits = jax.jit(model.apply)({"params": params}, batch["input_ids"].reshape(8, 16),
                                  batch["segment_ids"].reshape(8, 16))
    labels = batch["labels"].reshape(8, 16)
    per_token = jnp.take_along_axis(jax.nn.log_softmax(logits), np.maximum(labels, 0)[..., None], -1)[..., 0]
    want = np.where(batch["labels"].reshape(8, 16) >= 0, per_token, 0).sum(-1).reshape(4, 2)
    np.testing.assert_allclose(logp, want, rtol=1e-5)
    np.testing.assert_allclose(log_probs(model, params, batch, implementation="xla"), want, rtol=1e-5)

    loss_fn = jax.jit(preference.dpo_loss_fn(model, beta=0.5), static_argnums=3)
    same = preference.collate_preferences(preference.with_reference(examples, list(np.asarray(logp))))
    loss, metrics = loss_fn(params, same, None, False)
    np.testing.assert_allclose(loss, np.log(2), rtol=1e-6)
    assert float(metrics["reward_accuracy"]) == 0.0  # ties
    ref = np.array([[1.0, -2.0]] * 4, np.float32)
    loss, metrics = loss_fn(params, {**batch, "ref_log_probs": ref}, None, False)
    margin = 0.5 * ((logp[:, 0] - ref[:, 0]) - (logp[:, 1] - ref[:, 1]))
    np.testing.assert_allclose(loss, np.mean(np.log1p(np.exp(-margin))), rtol=1e-5)
    np.testing.assert_allclose(metrics["reward_margin"], np.mean(margin), rtol=1e-5)
    h = (logp[:, 0] - ref[:, 0]) - (logp[:, 1] - ref[:, 1])
    loss, _ = preference.dpo_loss_fn(model, beta=0.5, loss_type="ipo")(params, {**batch, "ref_log_probs": ref}, None,
                                                                       False)
    np.testing.assert_allclose(loss, np.mean((h - 1 / (2 * 0.5)) ** 2), rtol=1e-5)
    loss, _ = preference.dpo_loss_fn(model, beta=0.5, label_smoothing=0.2)(params, {**batch, "ref_log_probs": ref},
                                                                           None, False)
    np.testing.assert_allclose(loss, np.mean(0.8 * np.log1p(np.exp(-margin)) + 0.2 * np.log1p(np.exp(margin))),
                               rtol=1e-5)
    with pytest.raises(ValueError, match="loss_type='hinge'; expected one of"):
        preference.dpo_loss_fn(model, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing=0.1; expected .* with loss_type='sigmoid'"):
        preference.dpo_loss_fn(model, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="no 'ref_log_probs'"):
        preference.dpo_loss_fn(model)(params, batch, None, False)
    with pytest.raises(ValueError, match="beta=0; expected a positive number"):
        preference.dpo_loss_fn(model, beta=0)
    with pytest.raises(ValueError, match="ref_log_probs has 1 entries for 4 examples"):
        preference.with_reference(examples, [np.zeros(2)])


@pytest.mark.slow
def test_dpo_learns_the_toy_preference_on_a_mesh():
    """From a fresh model (policy = reference), one epoch of DPO on 8 devices takes the held-out preference accuracy
    on sorted lists against other orders from 0 (ties) to >= 0.9 and the DPO loss well below log 2."""
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    mesh = engine.make_mesh(data=4, model=2)
    triples = preference.toy_preferences(1024 + 128, seed=0, negatives=("order",))
    examples, _ = preference.encode_preferences(triples, TOK, seq_len=16)
    examples = preference.with_reference(examples, preference.reference_log_probs(
        model, params, examples, mesh=mesh, per_device_batch_size=16))
    train, evals = examples[:-128], examples[-128:]
    trainer = engine.Trainer(mesh=mesh, collate_fn=preference.collate_preferences,
                             loss_fn=preference.dpo_loss_fn(model, beta=0.1), params=params,
                             optimizer=optax.adam(3e-3))
    predictor = engine.Predictor(mesh=mesh, collate_fn=preference.collate_preferences,
                                 pred_fn=preference.preference_pred_fn(model))
    accuracy = lambda: preference.preference_accuracy(  # noqa: E731
        evals, predictor.predict(evals, per_device_batch_size=4, params=trainer.params))["preference_accuracy"]
    assert accuracy() == 0.0
    trainer.fit(train, per_device_batch_size=4, max_steps=32)
    assert accuracy() >= 0.9
    assert trainer.eval_loss(evals, per_device_batch_size=4) < 0.5 * np.log(2)
    assert trainer.history[-1]["reward_accuracy"] >= 0.9


def test_generation_continues_after_the_separator():
    """A preference-tuned model answers after prompt + separator, the layout it was trained on:
    `lm.generate_texts(after_prompt=...)` (what generate.py passes for a DPO workdir) generates from exactly those
    tokens."""
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    sep = preference.separator(TOK)
    got = lm.generate_texts(model, params, TOK, ["owl cat yak"], max_new_tokens=4, after_prompt=(sep,))
    ids = np.array([TOK.encode("owl cat yak") + [sep]], np.int32)
    out = np.asarray(models.generate(model, params, ids, attention_mask=np.ones_like(ids), max_new_tokens=4,
                                     eos_token_id=TOK.eos_id, pad_token_id=TOK.pad_id))
    assert got == [TOK.decode([i for i in lm.until_eos(out[0, ids.shape[1]:], TOK.eos_id) if i != TOK.eos_id])]


def test_verifiable_rewards_score_responses_against_reference_answers():
    """RL with verifiable rewards (train_ppo.py --verifiable_reward): exact match (white space around ignored) or
    LCS partial credit against each prompt's reference; the toy task's rule is the LCS reward against its sorted
    list; two references for one prompt are refused, and so is a prompt without one."""
    assert preference.lcs_reward("a b c", "a b c") == 1.0 and preference.lcs_reward("", "") == 1.0
    assert preference.lcs_reward("a c", "a b c") == 2 * 2 / 5  # LCS "a c" of 2 + 3 words
    assert preference.lcs_reward("c b a", "a b c") == 2 * 1 / 6 and preference.lcs_reward("x y", "a b") == 0.0
    pairs = preference.toy_prompt_responses(32, seed=0)
    exact, lcs = (preference.verifiable_reward(rule, pairs + pairs[:3]) for rule in ("exact_match", "lcs"))
    for p in pairs:
        assert exact(p["prompt"], f" {p['response']}\n") == 1.0 and lcs(p["prompt"], p["response"]) == 1.0
        wrong = " ".join(reversed(p["response"].split()))
        assert exact(p["prompt"], wrong) == 0.0
        assert lcs(p["prompt"], wrong) == preference.toy_reward(p["prompt"], wrong) < 1.0
    with pytest.raises(ValueError, match="pair 1: prompt 'b a' has two reference answers \\('a b' and 'b a'\\)"):
        preference.verifiable_reward("lcs", [{"prompt": "b a", "response": r} for r in ("a b", "b a")])
    with pytest.raises(ValueError, match="prompt 'zzz' has no reference answer"):
        exact("zzz", "a")
    with pytest.raises(ValueError, match="rule='f1'; expected one of"):
        preference.verifiable_reward("f1", pairs)


def test_reference_log_probs_in_the_compute_dtype_give_a_zero_margin_at_the_start():
    """reference_log_probs(compute_dtype=bf16), as train_dpo.py passes --compute_dtype: with the policy still the
    reference, the DPO loss on the bf16-cast parameters (the train step's cast) sees zero implicit rewards; the
    float32 reference leaves bf16's rounding in them."""
    model = _model()
    params = models.init_params(model, jax.random.PRNGKey(0))
    mesh = engine.make_mesh(data=8)  # whole rows per device, as the loss below computes them
    examples, _ = preference.encode_preferences(preference.toy_preferences(16, seed=1), TOK, seq_len=16)
    loss_fn = preference.dpo_loss_fn(model, beta=1.0)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    margins = []
    for dtype in (jnp.bfloat16, None):
        rows = preference.with_reference(examples, preference.reference_log_probs(
            model, params, examples, mesh=mesh, per_device_batch_size=2, compute_dtype=dtype))
        metrics = jax.jit(lambda p, b: loss_fn(p, b, None, False)[1])(half, preference.collate_preferences(rows))
        margins.append(max(abs(float(metrics["chosen_reward"])), abs(float(metrics["rejected_reward"]))))
    assert margins[0] < 1e-6 < margins[1], margins
