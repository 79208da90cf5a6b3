"""Text data for language modelling: tokenisers, corpora, packing into fixed-length rows, and the causal-LM loss.

Packing: documents are tokenised, each followed by EOS, and laid end to end into rows of `seq_len + 1` tokens. Every
row carries `segment_ids` (1, 2, ... per document piece, 0 on padding), which the models take as `attention_mask`:
a token attends only within its own document and positions restart at each document.
"""
import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import optax


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then PAD, BOS and EOS; the vocabulary is padded to a multiple of 64 so that it
    splits over any tensor-parallel axis up to 64."""
    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 320

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a checkpoint's tokenizer.json) behind the same small interface."""

    def __init__(self, tokenizer, vocab_size, *, bos_id=None, eos_id=None, pad_id=None):
        self._tok, self.vocab_size = tokenizer, vocab_size
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids])


def read_texts(patterns):
    """Documents from `.txt` files (one document per file) and `.jsonl` files (one per line: a string, or an object
    with a 'text' field). `patterns`: paths or globs."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise ValueError(f"data: {pattern!r} matches no file; expected .txt or .jsonl paths or globs")
        files += matched
    docs = []
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if isinstance(item, dict):
                        if "text" not in item:
                            raise ValueError(f"data: {path}:{n} has no 'text' field; expected a string or "
                                             "{\"text\": ...}")
                        item = item["text"]
                    docs.append(str(item))
        elif path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append(f.read())
        else:
            raise ValueError(f"data: {path!r} is neither .txt nor .jsonl")
    return docs


def default_corpus(max_bytes=600_000):
    """An embedded corpus present on every machine: the source of Python's standard library (`.py` files of the
    running interpreter, in sorted order, up to `max_bytes`). No download."""
    root = os.path.dirname(os.__file__)
    docs, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        docs.append(text[: max_bytes - total])
        total += len(docs[-1])
        if total >= max_bytes:
            break
    return docs


def pack(docs, tokenizer, seq_len):
    """Packs documents into examples `{'tokens': [seq_len + 1], 'segment_ids': [seq_len + 1]}`; the last row is
    padded with PAD and segment id 0. Long documents are split across rows (each piece its own segment)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}; expected at least 2")
    width = seq_len + 1
    rows, tokens, segments, seg = [], [], [], 0
    for doc in docs:
        ids = tokenizer.encode(doc) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        while ids:
            seg += 1
            take = ids[: width - len(tokens)]
            ids = ids[len(take):]
            tokens += take
            segments += [seg] * len(take)
            if len(tokens) == width:
                rows.append({"tokens": np.array(tokens, np.int32), "segment_ids": np.array(segments, np.int32)})
                tokens, segments, seg = [], [], 0
    if tokens:
        pad = width - len(tokens)
        rows.append({"tokens": np.array(tokens + [tokenizer.pad_id] * pad, np.int32),
                     "segment_ids": np.array(segments + [0] * pad, np.int32)})
    return rows


def collate_lm(examples):
    """Rows of `pack` -> {'input_ids', 'labels', 'segment_ids'} [B, seq_len]; labels are -100 where the next token
    is padding or starts another document."""
    tokens = np.stack([e["tokens"] for e in examples])
    seg = np.stack([e["segment_ids"] for e in examples])
    labels = np.where((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), tokens[:, 1:], -100).astype(np.int32)
    return {"input_ids": tokens[:, :-1], "labels": labels, "segment_ids": seg[:, :-1]}


def lm_loss_fn(model):
    """`loss_fn(params, batch, rng, is_training)` for a decoder-only model on `collate_lm` batches: mean
    next-token cross-entropy over the labelled positions, plus token accuracy and the number of tokens."""
    def loss_fn(params, batch, rng, is_training):
        del rng, is_training
        logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"])
        labels = batch["labels"]
        valid = labels >= 0
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.maximum(labels, 0))
        n = jnp.maximum(valid.sum(), 1)
        loss = jnp.where(valid, losses, 0.0).sum() / n
        accuracy = jnp.where(valid, logits.argmax(-1) == labels, False).sum() / n
        return loss, {"accuracy": accuracy, "tokens": valid.sum().astype(jnp.float32)}
    return loss_fn


def left_pad(prompts, tokenizer):
    """Token lists -> (ids [B, T], mask [B, T]) left-padded for generation."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return jnp.asarray(ids), jnp.asarray(mask)
