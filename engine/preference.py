"""Preference tuning with DPO (Rafailov et al., 2023, "Direct Preference Optimization") for the decoder-only models.

A triple {"prompt", "chosen", "rejected"} becomes two token rows, prompt + separator + response + EOS, in which only
the response (and its EOS) is labelled, so a response's log-probability is the sum of its tokens' log-probabilities
given the prompt. The frozen reference model's log-probabilities are computed once, before training
(`reference_log_probs`), and travel with the examples: the reference parameters never sit in device memory beside the
policy's and its optimizer state, which is what lets the pipeline SFT -> DPO fit the device that fits SFT. The loss of
a triple is -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), the implicit rewards beta * (pi - ref).
"""
import random

import jax
import jax.numpy as jnp
import numpy as np

from engine import text
from engine.predictor import Predictor

FIELDS = ("prompt", "chosen", "rejected")


def read_preferences(patterns):
    """`{"prompt", "chosen", "rejected"}` string triples from `.jsonl` files (paths or globs), one per line."""
    return text.read_records(patterns, FIELDS)


def toy_preferences(n, seed, *, min_words=3, max_words=6):
    """The embedded preference task: a list of distinct animal names (`text.TOY_WORDS`), the chosen response sorted
    alphabetically, the rejected one another order. Deterministic in `seed`."""
    rng = random.Random(seed)
    triples = []
    for _ in range(n):
        words = rng.sample(text.TOY_WORDS, rng.randint(min_words, max_words))
        chosen = sorted(words)
        rejected = chosen
        while rejected == chosen:
            rejected = rng.sample(words, len(words))
        triples.append({"prompt": " ".join(words), "chosen": " ".join(chosen), "rejected": " ".join(rejected)})
    return triples


def separator(tokenizer):
    """The token between prompt and response: the tokenizer's BOS, else its EOS (None when it has neither)."""
    return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id


def encode_preferences(triples, tokenizer, *, seq_len):
    """Triples -> (examples, cut): each example holds 'input_ids', 'labels' and 'segment_ids' int32 [2, seq_len],
    row 0 the chosen and row 1 the rejected sequence. The separator between prompt and response is the tokenizer's
    BOS (else EOS). Labels are the next tokens where those are response tokens (EOS included), else -100. Sequences
    longer than seq_len + 1 tokens lose their end (`cut` counts the triples that did)."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}; expected an int >= 2")
    sep = separator(tokenizer)
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    examples, cut = [], 0
    for n, triple in enumerate(triples):
        prompt = tokenizer.encode(triple["prompt"]) + ([sep] if sep is not None else [])
        if not prompt:
            raise ValueError(f"triple {n}'s prompt {triple['prompt']!r} has no tokens and the tokenizer no separator; "
                             "expected a non-empty prompt")
        if len(prompt) >= seq_len:
            raise ValueError(f"seq_len={seq_len}: triple {n}'s prompt takes {len(prompt)} tokens; expected room for "
                             "a response")
        ex = {k: np.zeros((2, seq_len), np.int32) for k in ("input_ids", "segment_ids")}
        ex["labels"] = np.full((2, seq_len), -100, np.int32)
        was_cut = False
        for row, key in enumerate(("chosen", "rejected")):
            tokens = prompt + tokenizer.encode(triple[key]) + eos
            if len(tokens) == len(prompt):
                raise ValueError(f"triple {n}'s {key} response {triple[key]!r} has no tokens and the tokenizer no EOS; "
                                 "expected a non-empty response")
            was_cut |= len(tokens) > seq_len + 1
            tokens = np.asarray(tokens[:seq_len + 1], np.int32)
            m = len(tokens) - 1
            ex["input_ids"][row, :m], ex["segment_ids"][row, :m] = tokens[:-1], 1
            ex["labels"][row, len(prompt) - 1:m] = tokens[len(prompt):]
        cut += was_cut
        examples.append(ex)
    return examples, cut


def collate_preferences(examples):
    """Examples of `encode_preferences` (with 'ref_log_probs' [2] once `with_reference` added them) -> a batch of
    the same keys with a leading batch dimension."""
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def sequence_log_probs(model, params, batch, *, implementation=None, interpret=False, train=False, rng=None):
    """log p(response | prompt) of both rows of each example: float32 [B, 2]. implementation: None (plain logits)
    or a kernel implementation for the fused head (`text.token_losses`)."""
    B, R, T = batch["input_ids"].shape
    flat = lambda x: x.reshape(B * R, T)  # noqa: E731
    out = model.apply({"params": params}, flat(batch["input_ids"]), flat(batch["segment_ids"]),
                      return_hidden=implementation is not None, train=train, rngs=text.dropout_rngs(rng))
    losses = text.token_losses(model, params, out, flat(batch["labels"]), implementation, interpret)
    return -losses.sum(-1).reshape(B, R)


def reference_log_probs(model, params, examples, *, mesh, per_device_batch_size, implementation=None):
    """The reference model's `sequence_log_probs` of every example ([2] float32 each, in order), computed with a
    `Predictor` over `mesh`."""
    predictor = Predictor(mesh=mesh, collate_fn=collate_preferences,
                          pred_fn=preference_pred_fn(model, implementation=implementation))
    return [np.asarray(x, np.float32) for x in
            predictor.predict(examples, per_device_batch_size=per_device_batch_size, params=params)]


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


def dpo_loss_fn(model, *, beta=0.1, implementation=None, interpret=False):
    """`loss_fn(params, batch, rng, is_training)` for `Trainer`: the mean DPO loss of the batch's triples, plus
    metrics reward_accuracy (chosen reward > rejected), reward_margin, chosen_reward and rejected_reward. The batch
    must carry 'ref_log_probs' (`with_reference`)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
        raise ValueError(f"beta={beta!r}; expected a positive number")
    text.check_implementation(implementation)

    def loss_fn(params, batch, rng, is_training):
        if "ref_log_probs" not in batch:
            raise ValueError("the batch has no 'ref_log_probs'; expected examples from preference.with_reference")
        log_probs = sequence_log_probs(model, params, batch, implementation=implementation, interpret=interpret,
                                       train=is_training, rng=rng)
        chosen, rejected = _rewards(beta, log_probs, batch["ref_log_probs"])
        margin = chosen - rejected
        metrics = {"reward_accuracy": jnp.mean(margin > 0), "reward_margin": jnp.mean(margin),
                   "chosen_reward": jnp.mean(chosen), "rejected_reward": jnp.mean(rejected)}
        return -jnp.mean(jax.nn.log_sigmoid(margin)), metrics
    return loss_fn


def preference_pred_fn(model, *, implementation=None):
    """`pred_fn` for an `engine.Predictor` (e.g. `Trainer.fit`'s eval_predictor): the current `sequence_log_probs`."""
    return lambda params, batch, rng: sequence_log_probs(model, params, batch, implementation=implementation)


def preference_accuracy(examples, log_probs):
    """{'preference_accuracy': the fraction of examples whose chosen response gains more log-probability over the
    reference than the rejected one} (`eval_metric_fn` for `Trainer.fit`; any beta > 0 ranks alike)."""
    wins = [float((lp[0] - ex["ref_log_probs"][0]) > (lp[1] - ex["ref_log_probs"][1]))
            for ex, lp in zip(examples, log_probs)]
    return {"preference_accuracy": float(np.mean(wins)) if wins else float("nan")}
