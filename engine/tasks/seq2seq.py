"""Sequence-to-sequence pairs for encoder-decoder models (T5): reading and the embedded toy task, encoding and
packing several pairs per row, collation, the loss, greedy-generation predictions and exact match."""
import random

import numpy as np

import models
from engine.tasks.lm import check_implementation, dropout_rngs, loss_and_metrics, until_eos
from engine.tasks.text_data import TOY_WORDS, check_not_empty, read_records

FIELDS = ("input", "target")


def read_pairs(patterns, *, decode_errors="strict", record_columns=None):
    """`{"input": str, "target": str}` pairs from JSON Lines (`.jsonl`, `.ndjson`, a named `.json`) or `.parquet` /
    `.arrow` rows (paths, globs or directories; `text_data.read_records`, its record_columns for other names); a pair
    whose input and target are both empty is refused naming its line or row."""
    return read_records(patterns, FIELDS, decode_errors=decode_errors, record_columns=record_columns)


def toy_pairs(n, seed, *, min_words=3, max_words=6):
    """The embedded sequence-to-sequence task: sort a list of distinct animal names alphabetically, e.g.
    {"input": "owl cat yak bee", "target": "bee cat owl yak"}. Deterministic in `seed`. Its tokens are words
    (`WordTokenizer(TOY_WORDS)`): at byte level a small T5 learns the task far more slowly."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = rng.sample(TOY_WORDS, rng.randint(min_words, max_words))
        pairs.append({"input": " ".join(words), "target": " ".join(sorted(words))})
    return pairs


def encode_pairs(pairs, tokenizer, *, max_input_len, max_target_len, decoder_start_id):
    """Input/target pairs -> fixed-width examples {'input_ids', 'attention_mask' [max_input_len],
    'decoder_input_ids', 'labels' [max_target_len]}: targets end with EOS, labels are -100 on padding, the decoder
    sees the start token then the target shifted right. Longer texts are cut (and counted in the second return).
    A pair with both texts empty is a ValueError naming its index."""
    examples, cut = [], 0
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    for n, pair in enumerate(pairs):
        check_not_empty(pair, FIELDS, f"pair {n}")
        src = tokenizer.encode(pair["input"]) + eos
        tgt = tokenizer.encode(pair["target"]) + eos
        cut += len(src) > max_input_len or len(tgt) > max_target_len
        src, tgt = src[:max_input_len], tgt[:max_target_len]
        ex = {"input_ids": np.full(max_input_len, tokenizer.pad_id, np.int32),
              "attention_mask": np.zeros(max_input_len, np.int32),
              "decoder_input_ids": np.full(max_target_len, tokenizer.pad_id, np.int32),
              "labels": np.full(max_target_len, -100, np.int32)}
        ex["input_ids"][:len(src)], ex["attention_mask"][:len(src)] = src, 1
        ex["labels"][:len(tgt)] = tgt
        ex["decoder_input_ids"][:len(tgt)] = [decoder_start_id] + tgt[:-1]
        examples.append(ex)
    return examples, cut


def pack_pairs(examples, input_len=None, target_len=None):
    """Packs `encode_pairs` examples into rows `input_len` / `target_len` wide (default: the examples' widths, which
    must not be wider), several whole pairs per row (as T5X packs): the inputs side by side in 'input_ids', the
    targets in 'decoder_input_ids' / 'labels', numbered 1, 2, ... in
    'attention_mask' (encoder) and 'decoder_attention_mask' (decoder), so each target attends to its own input and
    earlier tokens of its own target only. Each pair goes into the first of the last 16 rows with room for it (a
    window keeps packing linear in the number of pairs). Unused slots hold token 0 under id 0, which no real token
    sees."""
    if not examples:
        return []
    in_width, out_width = input_len or len(examples[0]["input_ids"]), target_len or len(examples[0]["labels"])
    if in_width < len(examples[0]["input_ids"]) or out_width < len(examples[0]["labels"]):
        raise ValueError(f"input_len={input_len}, target_len={target_len}; expected at least the examples' widths "
                         f"{len(examples[0]['input_ids'])} and {len(examples[0]['labels'])}")
    rows, used = [], []  # used[r] = (input tokens, target tokens, pairs) taken in row r
    for ex in examples:
        n_in, n_out = int(np.sum(ex["attention_mask"] > 0)), int(np.sum(ex["labels"] != -100))
        r = next((r for r in range(max(0, len(rows) - 16), len(rows))
                  if used[r][0] + n_in <= in_width and used[r][1] + n_out <= out_width), None)
        if r is None:
            r = len(rows)
            rows.append({"input_ids": np.zeros(in_width, np.int32), "attention_mask": np.zeros(in_width, np.int32),
                         "decoder_input_ids": np.zeros(out_width, np.int32),
                         "decoder_attention_mask": np.zeros(out_width, np.int32),
                         "labels": np.full(out_width, -100, np.int32)})
            used.append((0, 0, 0))
        row, (a, b, pairs) = rows[r], used[r]
        seg = pairs + 1
        row["input_ids"][a:a + n_in], row["attention_mask"][a:a + n_in] = ex["input_ids"][:n_in], seg
        row["decoder_input_ids"][b:b + n_out] = ex["decoder_input_ids"][:n_out]
        row["labels"][b:b + n_out], row["decoder_attention_mask"][b:b + n_out] = ex["labels"][:n_out], seg
        used[r] = (a + n_in, b + n_out, seg)
    return rows


def collate_seq2seq(examples):
    """Examples of `encode_pairs` (or rows of `pack_pairs`, which add 'decoder_attention_mask') -> a batch of the
    same keys, [B, len] each."""
    keys = ("input_ids", "attention_mask", "decoder_input_ids", "labels", "decoder_attention_mask")
    return {k: np.stack([e[k] for e in examples]) for k in keys if k in examples[0]}


def seq2seq_loss_fn(model, implementation=None, *, interpret=False):
    """`loss_fn` for an encoder-decoder model (T5) on `collate_seq2seq` batches: mean cross-entropy of the target
    tokens; `implementation` as in `lm_loss_fn`."""
    check_implementation(implementation)

    def loss_fn(params, batch, rng, is_training):
        out = model.apply({"params": params}, batch["input_ids"], batch["decoder_input_ids"], batch["attention_mask"],
                          batch.get("decoder_attention_mask"), return_hidden=implementation is not None,
                          train=is_training, rngs=dropout_rngs(rng))
        return loss_and_metrics(model, params, out, batch["labels"], implementation, interpret)
    loss_fn.weight_metric = "tokens"
    return loss_fn


def seq2seq_pred_fn(model, *, max_new_tokens, eos_id, pad_id):
    """`pred_fn(params, batch, rng)` for an `engine.Predictor`: greedy `models.generate` from the inputs ->
    generated ids [B, max_new_tokens] (after EOS: pad_id)."""
    def pred_fn(params, batch, rng):
        del rng
        out = models.generate(model, params, batch["input_ids"], attention_mask=batch["attention_mask"],
                              max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id)
        return out[:, 1:]  # drop the decoder start token
    return pred_fn


def exact_match(examples, predictions, eos_id):
    """{'exact_match': fraction of examples whose generated ids equal the target ids (through EOS)}: an
    `eval_metric_fn` for `Trainer.fit` (predictions: generated ids, one row per example)."""
    hits = []
    for example, pred in zip(examples, predictions):
        target = until_eos(example["labels"], eos_id)
        # A target cut to max_target_len has no EOS: then only its kept tokens are compared.
        hits.append(until_eos(pred, eos_id)[:len(target)] == target)
    return {"exact_match": float(np.mean(hits)) if hits else 0.0}
