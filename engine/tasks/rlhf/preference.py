"""Prompt/response rows for the decoder-only models: supervised fine-tuning (SFT) and preference tuning with DPO
(Rafailov et al., 2023, "Direct Preference Optimization").

An SFT pair {"prompt", "response"} becomes one row, prompt + separator + response + EOS, with only the response (and
its EOS) labelled: `lm.lm_loss_fn` on it is the response's cross-entropy given the prompt. A DPO triple {"prompt",
"chosen", "rejected"} becomes two such rows, so a response's log-probability is the sum of its tokens'
log-probabilities given the prompt. The frozen reference model's log-probabilities are computed once, before training
(`reference_log_probs`), and travel with the examples: the reference parameters never sit in device memory beside the
policy's and its optimizer state, which is what lets the pipeline SFT -> DPO fit the device that fits SFT. The loss of
a triple is -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), the implicit rewards beta * (pi - ref).
"""
import random

import jax
import jax.numpy as jnp
import numpy as np

from engine.tasks import lm, text_data
from engine.predictor import Predictor
from engine.step import cast_floating

FIELDS = ("prompt", "chosen", "rejected")
RESPONSES = ("chosen", "rejected")


def read_preferences(patterns, *, decode_errors="strict", record_columns=None):
    """`{"prompt", "chosen", "rejected"}` string triples from JSON Lines (`.jsonl`, `.ndjson`, a named `.json`) or
    `.parquet` / `.arrow` rows (paths, globs or directories; `text_data.read_records`, its record_columns for other
    names); a triple whose chosen and rejected responses are both empty (no preference to learn) is refused naming its
    line or row."""
    return text_data.read_records(patterns, FIELDS, decode_errors=decode_errors, nonempty=RESPONSES,
                                  record_columns=record_columns)


NEGATIVES = ("order", "dropped", "added", "replaced")


def toy_preferences(n, seed, *, min_words=3, max_words=6, negatives=NEGATIVES):
    """The embedded preference task: a list of distinct animal names (`text_data.TOY_WORDS`), the chosen response sorted
    alphabetically. The rejected one is, in equal shares, each kind of `negatives`: 'order' (another order of the
    same names) or the sorted list with one name 'dropped', 'added' or 'replaced' (so that a reward model learnt
    from all four cannot be satisfied by any sorted list). Deterministic in `seed`."""
    if not negatives or not set(negatives) <= set(NEGATIVES):
        raise ValueError(f"negatives={negatives!r}; expected a non-empty subset of {NEGATIVES}")
    rng = random.Random(seed)
    triples = []
    for _ in range(n):
        words = rng.sample(text_data.TOY_WORDS, rng.randint(min_words, max_words))
        chosen = sorted(words)
        kind = negatives[rng.randrange(len(negatives))]
        if kind == "order":
            rejected = chosen
            while rejected == chosen:
                rejected = rng.sample(words, len(words))
        else:
            dropped, added = rng.choice(chosen), rng.choice([w for w in text_data.TOY_WORDS if w not in words])
            rejected = sorted(([w for w in chosen if w != dropped] if kind != "added" else chosen)
                              + ([added] if kind != "dropped" else []))
        triples.append({"prompt": " ".join(words), "chosen": " ".join(chosen), "rejected": " ".join(rejected)})
    return triples


def toy_reward(prompt, response):
    """The toy task's verifiable reward, with partial credit: `lcs_reward` of `response` against the sorted names of
    `prompt`, so right names in the right order count and missing or extra ones cost; 1.0 exactly for the sorted
    list."""
    return lcs_reward(response, " ".join(sorted(prompt.split())))


def lcs_reward(response, target):
    """Partial credit of a response against a reference answer: 2 LCS / (words of response + words of target) over
    their white-space separated words (LCS: the longest common subsequence); 1.0 exactly when they are equal word
    for word."""
    got, want = response.split(), target.split()
    lcs = [0] * (len(want) + 1)  # one row of the LCS table at a time
    for a in got:
        diagonal = 0
        for j, b in enumerate(want):
            diagonal, lcs[j + 1] = lcs[j + 1], diagonal + 1 if a == b else max(lcs[j + 1], lcs[j])
    return 2 * lcs[-1] / (len(got) + len(want)) if got or want else 1.0


VERIFIABLE_REWARDS = ("exact_match", "lcs")


def verifiable_reward(rule, pairs):
    """`reward_fn(prompt, response)` for `engine.tasks.rlhf.ppo.PPO` from `{"prompt", "response"}` pairs whose response is the
    prompt's reference answer (RL with verifiable rewards: a rule instead of a reward model). rule 'exact_match':
    1.0 when the response is the reference (surrounding white space ignored), else 0.0; 'lcs': `lcs_reward`. A
    prompt given two different references is refused; asking for one without a reference raises ValueError."""
    if rule not in VERIFIABLE_REWARDS:
        raise ValueError(f"rule={rule!r}; expected one of {VERIFIABLE_REWARDS}")
    references = {}
    for n, pair in enumerate(pairs):
        known = references.setdefault(pair["prompt"], pair["response"].strip())
        if known != pair["response"].strip():
            raise ValueError(f"pair {n}: prompt {pair['prompt'][:60]!r} has two reference answers ({known[:40]!r} "
                             f"and {pair['response'].strip()[:40]!r}); expected one answer per prompt")

    def reward_fn(prompt, response):
        if prompt not in references:
            raise ValueError(f"prompt {prompt[:60]!r} has no reference answer; expected one of the pairs' prompts")
        target = references[prompt]
        return float(response.strip() == target) if rule == "exact_match" else lcs_reward(response, target)
    return reward_fn


SFT_FIELDS = ("prompt", "response")


def read_prompt_responses(patterns, *, decode_errors="strict", record_columns=None):
    """`{"prompt", "response"}` string pairs from JSON Lines (`.jsonl`, `.ndjson`, a named `.json`) or `.parquet` /
    `.arrow` rows (paths, globs or directories; `text_data.read_records`, its record_columns for other names); a pair
    whose prompt and response are both empty is refused naming its line or row."""
    return text_data.read_records(patterns, SFT_FIELDS, decode_errors=decode_errors, record_columns=record_columns)


def toy_prompt_responses(n, seed):
    """The embedded task's supervised pairs: the prompt of each `toy_preferences` triple and its chosen (sorted)
    response."""
    return [{"prompt": t["prompt"], "response": t["chosen"]} for t in toy_preferences(n, seed)]


def separator(tokenizer):
    """The token between prompt and response: the tokenizer's BOS, else its EOS (None when it has neither)."""
    return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id


def prompt_tokens(tokenizer, prompt, seq_len, record="the prompt"):
    """The token ids of a prompt followed by the separator; ValueError naming the `record` (e.g. 'triple 3') when
    there is no room for a response."""
    sep = separator(tokenizer)
    tokens = tokenizer.encode(prompt) + ([sep] if sep is not None else [])
    if not tokens:
        raise ValueError(f"{record}'s prompt {prompt!r} has no tokens and the tokenizer no separator; expected a "
                         "non-empty prompt")
    if len(tokens) >= seq_len:
        raise ValueError(f"seq_len={seq_len}: {record}'s prompt takes {len(tokens)} tokens; expected room for a "
                         "response")
    return tokens


def token_row(prompt_tokens, response_tokens, seq_len):
    """(input_ids, labels, segment_ids) int32 [seq_len] of prompt + response token ids with only the response
    labelled, and whether the row lost its end to seq_len (more than seq_len + 1 tokens)."""
    tokens = list(prompt_tokens) + list(response_tokens)
    was_cut = len(tokens) > seq_len + 1
    tokens = np.asarray(tokens[:seq_len + 1], np.int32)
    m = len(tokens) - 1
    ids, segments = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32)
    labels = np.full(seq_len, -100, np.int32)
    ids[:m], segments[:m] = tokens[:-1], 1
    labels[len(prompt_tokens) - 1:m] = tokens[len(prompt_tokens):]
    return ids, labels, segments, was_cut


def _response_row(tokenizer, prompt_tokens, response, seq_len, record, what):
    """`token_row` of prompt + response + EOS."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    response_tokens = tokenizer.encode(response) + eos
    if not response_tokens:
        raise ValueError(f"{record}'s {what} {response!r} has no tokens and the tokenizer no EOS; expected a "
                         "non-empty response")
    return token_row(prompt_tokens, response_tokens, seq_len)


def _check_seq_len(seq_len):
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}; expected an int >= 2")


def encode_prompt_responses(pairs, tokenizer, *, seq_len):
    """Supervised fine-tuning rows: `{"prompt", "response"}` pairs -> (examples, cut). Each example holds
    'input_ids', 'labels' and 'segment_ids' int32 [seq_len] (a `lm.lm_loss_fn` batch row once stacked by
    `collate_preferences`): prompt + separator + response + EOS with only the response and its EOS labelled, so the
    loss is the response's next-token cross-entropy given the prompt. Longer pairs lose their end (`cut` counts
    them). A pair whose prompt and response are both empty is a ValueError naming its index."""
    _check_seq_len(seq_len)
    examples, cut = [], 0
    for n, pair in enumerate(pairs):
        text_data.check_not_empty(pair, SFT_FIELDS, f"pair {n}")
        prompt = prompt_tokens(tokenizer, pair["prompt"], seq_len, f"pair {n}")
        ids, labels, segments, was_cut = _response_row(tokenizer, prompt, pair["response"], seq_len, f"pair {n}",
                                                       "response")
        examples.append({"input_ids": ids, "labels": labels, "segment_ids": segments})
        cut += was_cut
    return examples, cut


def encode_preferences(triples, tokenizer, *, seq_len):
    """Triples -> (examples, cut): each example holds 'input_ids', 'labels' and 'segment_ids' int32 [2, seq_len],
    row 0 the chosen and row 1 the rejected sequence, each laid out as in `encode_prompt_responses`. Sequences
    longer than seq_len + 1 tokens lose their end (`cut` counts the triples that did). A triple whose two responses
    are both empty is a ValueError naming its index."""
    _check_seq_len(seq_len)
    examples, cut = [], 0
    for n, triple in enumerate(triples):
        text_data.check_not_empty(triple, RESPONSES, f"triple {n}")
        prompt = prompt_tokens(tokenizer, triple["prompt"], seq_len, f"triple {n}")
        rows = [_response_row(tokenizer, prompt, triple[key], seq_len, f"triple {n}", f"{key} response")
                for key in ("chosen", "rejected")]
        examples.append({key: np.stack([row[i] for row in rows])
                         for i, key in enumerate(("input_ids", "labels", "segment_ids"))})
        cut += any(row[3] for row in rows)
    return examples, cut


def collate_preferences(examples):
    """Examples of `encode_preferences` (with 'ref_log_probs' [2] once `with_reference` added them) -> a batch of
    the same keys with a leading batch dimension."""
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def sequence_log_probs(model, params, batch, *, implementation=None, interpret=False, train=False, rng=None):
    """log p(response | prompt) of both rows of each example: float32 [B, 2]. implementation: None (plain logits)
    or a kernel implementation for the fused head (`lm.token_losses`)."""
    return _log_probs_and_sown(model, params, batch, implementation, interpret, train, rng)[0]


def _log_probs_and_sown(model, params, batch, implementation, interpret, train, rng):
    """(`sequence_log_probs`, a mixture of experts' router statistics: `lm.apply_sowing`)."""
    B, R, T = batch["input_ids"].shape
    flat = lambda x: x.reshape(B * R, T)  # noqa: E731
    out, sown = lm.apply_sowing(model, params, flat(batch["input_ids"]), flat(batch["segment_ids"]),
                                return_hidden=implementation is not None, train=train, rngs=lm.dropout_rngs(rng))
    losses = lm.token_losses(model, params, out, flat(batch["labels"]), implementation, interpret)
    return -losses.sum(-1).reshape(B, R), sown


def reference_log_probs(model, params, examples, *, mesh, per_device_batch_size, implementation=None,
                        compute_dtype=None):
    """The reference model's `sequence_log_probs` of every example ([2] float32 each, in order), computed with a
    `Predictor` over `mesh`; compute_dtype (the Trainer's `Precision.compute_dtype`): the parameters cast to it as
    the train step casts the policy's, so a policy still at the reference has log-ratio 0."""
    predictor = Predictor(mesh=mesh, collate_fn=collate_preferences,
                          pred_fn=preference_pred_fn(model, implementation=implementation))
    return [np.asarray(x, np.float32) for x in
            predictor.predict(examples, per_device_batch_size=per_device_batch_size,
                              params=cast_floating(params, compute_dtype))]


def with_reference(examples, ref_log_probs):
    """Copies of `examples`, each with its 'ref_log_probs'."""
    if len(examples) != len(ref_log_probs):
        raise ValueError(f"ref_log_probs has {len(ref_log_probs)} entries for {len(examples)} examples; expected one "
                         "per example")
    return [{**ex, "ref_log_probs": np.asarray(ref, np.float32)} for ex, ref in zip(examples, ref_log_probs)]


def _rewards(beta, log_probs, ref_log_probs):
    """Implicit rewards beta * (pi - ref) of the chosen and rejected rows: two [B] arrays."""
    rewards = beta * (log_probs - ref_log_probs)
    return rewards[:, 0], rewards[:, 1]


DPO_LOSSES = ("sigmoid", "ipo")


def dpo_loss_fn(model, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, implementation=None, interpret=False):
    """`loss_fn(params, batch, rng, is_training)` for `Trainer`: the mean preference loss of the batch's triples,
    plus metrics reward_accuracy (chosen reward > rejected), reward_margin, chosen_reward and rejected_reward. The
    batch must carry 'ref_log_probs' (`with_reference`). With h = (pi_c - ref_c) - (pi_r - ref_r) per triple:
    loss_type 'sigmoid' is DPO's -log sigmoid(beta h), and with label_smoothing e the conservative DPO of labels
    flipped with probability e, -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h); 'ipo' is IPO's
    (h - 1 / (2 beta))^2 (Azar et al., 2023), which does not drive h to infinity on deterministic preferences. A
    mixture of experts adds its router losses (`lm.add_router_losses`)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
        raise ValueError(f"beta={beta!r}; expected a positive number")
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type={loss_type!r}; expected one of {DPO_LOSSES}")
    if not 0 <= label_smoothing < 0.5 or (label_smoothing and loss_type != "sigmoid"):
        raise ValueError(f"label_smoothing={label_smoothing!r}; expected 0 <= label_smoothing < 0.5, with "
                         "loss_type='sigmoid'")
    lm.check_implementation(implementation)

    def loss_fn(params, batch, rng, is_training):
        if "ref_log_probs" not in batch:
            raise ValueError("the batch has no 'ref_log_probs'; expected examples from preference.with_reference")
        log_probs, sown = _log_probs_and_sown(model, params, batch, implementation, interpret, is_training, rng)
        chosen, rejected = _rewards(beta, log_probs, batch["ref_log_probs"])
        margin = chosen - rejected
        metrics = {"reward_accuracy": jnp.mean(margin > 0), "reward_margin": jnp.mean(margin),
                   "chosen_reward": jnp.mean(chosen), "rejected_reward": jnp.mean(rejected)}
        if loss_type == "ipo":
            losses = (margin / beta - 1 / (2 * beta)) ** 2
        else:
            losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(margin) - label_smoothing * jax.nn.log_sigmoid(
                -margin)
        return lm.add_router_losses(getattr(model, "config", None), jnp.mean(losses), metrics, sown)
    return loss_fn


def answer(model, params, tokenizer, prompts, *, max_new_tokens, temperature=0.0, seed=0):
    """Each prompt's answer (a string, up to EOS) by a model tuned on this module's rows: generated after prompt +
    separator, the layout it was trained on (greedy by default)."""
    sep = separator(tokenizer)
    return lm.generate_texts(model, params, tokenizer, prompts, max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, after_prompt=() if sep is None else (sep,))


def answer_exact_match(model, params, tokenizer, pairs, *, max_new_tokens):
    """The fraction of `{"prompt", "response"}` pairs whose greedy `answer` is the response (surrounding white space
    ignored)."""
    answers = answer(model, params, tokenizer, [p["prompt"] for p in pairs], max_new_tokens=max_new_tokens)
    return float(np.mean([a.strip() == p["response"].strip() for a, p in zip(answers, pairs)]))


def preference_pred_fn(model, *, implementation=None):
    """`pred_fn` for an `engine.Predictor` (e.g. `Trainer.fit`'s eval_predictor): the current `sequence_log_probs`."""
    return lambda params, batch, rng: sequence_log_probs(model, params, batch, implementation=implementation)


def preference_accuracy(examples, log_probs):
    """{'preference_accuracy': the fraction of examples whose chosen response gains more log-probability over the
    reference than the rejected one} (`eval_metric_fn` for `Trainer.fit`; any beta > 0 ranks alike)."""
    wins = [float((lp[0] - ex["ref_log_probs"][0]) > (lp[1] - ex["ref_log_probs"][1]))
            for ex, lp in zip(examples, log_probs)]
    return {"preference_accuracy": float(np.mean(wins)) if wins else float("nan")}
