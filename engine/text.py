"""Text data for language modelling: tokenisers, corpora, packing into fixed-length rows, the causal-LM loss, and
input/target pairs for sequence-to-sequence models (collation, loss, greedy-generation predictions, exact match).

Packing: documents are tokenised, each followed by EOS, and laid end to end into rows of `seq_len + 1` tokens. Every
row carries `segment_ids` (1, 2, ... per document piece, 0 on padding), which the models take as `attention_mask`:
a token attends only within its own document and positions restart at each document.

Losses: with `implementation=None` the model computes the logits [B, T, vocab] and the loss is taken from them.
With a kernel implementation ('xla', 'triton', 'mosaic_tpu', or 'auto' for the backend's best) the model returns its
hidden states and `kernels.linear_cross_entropy` applies the output head blockwise over the vocabulary, so the
[tokens, vocab] logits never exist (for a 128k vocabulary they are the largest activation of a step); token accuracy
is then not reported, as it would need them.
"""
import collections.abc
import glob
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kernels
import models


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then PAD, BOS and EOS; the vocabulary is padded to a multiple of 64 so that it
    splits over any tensor-parallel axis up to 64."""
    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 320

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class WordTokenizer:
    """Whitespace-separated words of a fixed list as tokens (the toy task's vocabulary): PAD, BOS, EOS, UNK, then
    the words; the vocabulary is padded to a multiple of 64 like ByteTokenizer's."""
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, words):
        self.words = list(words)
        self._ids = {w: i + 4 for i, w in enumerate(self.words)}
        self.vocab_size = -(-(len(self.words) + 4) // 64) * 64

    def encode(self, text):
        return [self._ids.get(w, self.unk_id) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.words[int(i) - 4] if 4 <= int(i) < len(self.words) + 4 else "<unk>"
                        for i in ids if int(i) >= 3)


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

    @classmethod
    def from_dir(cls, path, vocab_size=None):
        """The tokenizer of a Hugging Face directory (tokenizer.json, special ids from config.json), or None when it
        has no tokenizer.json. vocab_size: the model's (None: config.json's, else the tokenizer's own)."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            return None
        import tokenizers  # noqa: PLC0415 (optional: installed with transformers)

        config = {}
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
        eos = config.get("eos_token_id")
        tok = tokenizers.Tokenizer.from_file(file)
        return cls(tok, vocab_size or config.get("vocab_size") or tok.get_vocab_size(),
                   bos_id=config.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos,
                   pad_id=config.get("pad_token_id"))


def tokenizer_spec(tokenizer, directory):
    """A JSON-able description of `tokenizer` for a workdir's run.json; an HFTokenizer's tokenizer.json is copied
    into `directory` so the workdir is self-contained."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte"}
    if isinstance(tokenizer, WordTokenizer):
        return {"kind": "words", "words": tokenizer.words}
    os.makedirs(directory, exist_ok=True)
    tokenizer._tok.save(os.path.join(directory, "tokenizer.json"))
    return {"kind": "tokenizer.json", "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}


def tokenizer_from_spec(spec, directory):
    """Inverse of `tokenizer_spec`."""
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "words":
        return WordTokenizer(spec["words"])
    if spec.get("kind") != "tokenizer.json":
        raise ValueError(f"tokenizer {spec!r} in {directory}; expected kind 'byte', 'words' or 'tokenizer.json'")
    import tokenizers  # noqa: PLC0415

    return HFTokenizer(tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")), spec["vocab_size"],
                       bos_id=spec["bos_id"], eos_id=spec["eos_id"], pad_id=spec["pad_id"])


def _expand(patterns):
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise FileNotFoundError(f"data: {pattern!r} matches no file; expected .txt or .jsonl paths or globs")
        files += matched
    return files


def _jsonl(path):
    """(line number, object) of a .jsonl file, skipping blank lines; ValueError naming the line on bad JSON."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data: {path}:{n} is not JSON ({e.msg})") from None


def read_texts(patterns):
    """Documents from `.txt` files (one document per file) and `.jsonl` files (one per line: a string, or an object
    with a 'text' field). `patterns`: paths or globs."""
    return list(iter_texts(patterns))


def iter_texts(patterns):
    """`read_texts`, one document at a time (a corpus larger than memory streams through `write_tokens`)."""
    for path in _expand(patterns):
        if path.endswith(".jsonl"):
            for n, item in _jsonl(path):
                if isinstance(item, dict):
                    if "text" not in item:
                        raise ValueError(f"data: {path}:{n} has no 'text' field; expected a string or "
                                         "{\"text\": ...}")
                    item = item["text"]
                yield str(item)
        elif path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
        else:
            raise ValueError(f"data: {path!r} is neither .txt nor .jsonl")


# A tokenised corpus on disk (`write_tokens`, scripts/prepare_data.py): what `TokenWindows` reads.
TOKENS_FILE, TOKENS_META = "tokens.bin", "meta.json"


def write_tokens(docs, tokenizer, directory, *, chunk_tokens=1 << 20):
    """Tokenises `docs` (any iterable of strings, streamed) into `directory`: `tokens.bin`, every document followed
    by EOS laid end to end (uint16 when the vocabulary fits, else uint32; nanoGPT's train.bin), `meta.json` (dtype,
    token and document counts, the largest id, EOS, the tokenizer) and, for a Hugging Face tokenizer, its
    tokenizer.json. meta.json is written last, so a directory holding it is complete. Returns the meta dict."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENS_FILE)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    n_tokens = n_docs = max_id = 0
    with open(path + ".tmp", "wb") as f:
        pending = []
        for doc in docs:
            ids = tokenizer.encode(doc) + eos
            pending += ids
            n_docs += 1
            if len(pending) >= chunk_tokens:
                max_id = max(max_id, max(pending))
                f.write(np.asarray(pending, dtype).tobytes())
                n_tokens, pending = n_tokens + len(pending), []
        if pending:
            max_id = max(max_id, max(pending))
            f.write(np.asarray(pending, dtype).tobytes())
            n_tokens += len(pending)
    os.replace(path + ".tmp", path)
    meta = {"dtype": dtype.name, "num_tokens": n_tokens, "num_documents": n_docs, "max_id": int(max_id),
            "eos_id": tokenizer.eos_id, "tokenizer": tokenizer_spec(tokenizer, directory)}
    with open(os.path.join(directory, TOKENS_META + ".tmp"), "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(os.path.join(directory, TOKENS_META + ".tmp"), os.path.join(directory, TOKENS_META))
    return meta


def is_token_dir(path):
    """Whether `path` is a directory written by `write_tokens`."""
    return os.path.isfile(os.path.join(path, TOKENS_META))


def read_token_meta(directory):
    if not is_token_dir(directory):
        raise FileNotFoundError(f"data: {directory} has no {TOKENS_META}; expected a directory written by "
                                "scripts/prepare_data.py (engine.text.write_tokens)")
    with open(os.path.join(directory, TOKENS_META)) as f:
        return json.load(f)


def check_token_dir(directory, tokenizer, vocab_size):
    """ValueError unless the tokens of `directory` were written with `tokenizer` and fit a vocabulary of
    `vocab_size` (a model's)."""
    meta = read_token_meta(directory)
    spec = meta["tokenizer"]
    same = {"byte": lambda: isinstance(tokenizer, ByteTokenizer),
            "words": lambda: isinstance(tokenizer, WordTokenizer) and tokenizer.words == spec["words"],
            "tokenizer.json": lambda: isinstance(tokenizer, HFTokenizer) and tokenizer.eos_id == spec["eos_id"] and (
                _tokenizer_json(directory) == tokenizer._tok.to_str())}.get(spec.get("kind"), lambda: False)()
    if not same:
        raise ValueError(f"data: {directory} was tokenised with a {spec.get('kind')} tokenizer that is not this "
                         f"model's ({type(tokenizer).__name__}); expected scripts/prepare_data.py run with the "
                         "model's tokenizer (--tokenizer_from=<its Hugging Face directory>)")
    if meta["max_id"] >= vocab_size:
        raise ValueError(f"data: {directory} holds token id {meta['max_id']}; expected ids below the model's "
                         f"vocab_size={vocab_size}")


def _tokenizer_json(directory):
    import tokenizers  # noqa: PLC0415

    return tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")).to_str()


class TokenWindows(collections.abc.Sequence):
    """Training rows in `pack`'s format ({'tokens', 'segment_ids'} [seq_len + 1]) read from a `write_tokens`
    directory through a memory map, so a corpus larger than memory trains with only the rows of a batch read.
    Window i is tokens[i·seq_len : i·seq_len + seq_len + 1] (neighbours share one token, so every next-token pair
    is a label once); segment ids number the documents within the window (1 + the EOS tokens before a position,
    EOS ending its own document), so attention stays within a document as with `pack`. A Sequence (len, indexing,
    contiguous slices as views): the Trainer shuffles it like a list and each process reads only its own rows."""

    def __init__(self, directory, seq_len, *, _range=None):
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r}; expected an integer >= 2")
        self.directory, self.seq_len = directory, seq_len
        self.meta = read_token_meta(directory)
        self._tokens = np.memmap(os.path.join(directory, TOKENS_FILE), dtype=self.meta["dtype"], mode="r",
                                 shape=(self.meta["num_tokens"],))
        self._range = _range if _range is not None else range(max(0, (self.meta["num_tokens"] - 1) // seq_len))

    def __len__(self):
        return len(self._range)

    def __getitem__(self, i):
        if isinstance(i, slice):
            part = self._range[i]
            if part.step != 1:
                raise ValueError(f"TokenWindows[{i}]: only contiguous slices (step 1)")
            return TokenWindows(self.directory, self.seq_len, _range=part)
        start = self._range[i] * self.seq_len
        tokens = np.asarray(self._tokens[start:start + self.seq_len + 1], np.int32)
        eos = self.meta["eos_id"]
        ends = np.zeros_like(tokens) if eos is None else (tokens == eos).astype(np.int32)
        segments = 1 + np.concatenate([[0], np.cumsum(ends)[:-1]]).astype(np.int32)
        return {"tokens": tokens, "segment_ids": segments}


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


LOSS_IMPLEMENTATIONS = (None, "auto") + kernels.IMPLEMENTATIONS


def head_weight(model, params):
    """The output head of `model` as `(w [d_model, vocab], bias [vocab] | None)`: the embedding table transposed
    when the head is tied to it (LLaMA/OPT/T5 `tie_word_embeddings`), else the untied `lm_head` (with GPT-J's bias)."""
    if model.config.tie_word_embeddings:
        table = params["shared" if getattr(model, "is_encoder_decoder", False) else "embed"]["embedding"]
        return table.T, None
    return params["lm_head"]["kernel"], params["lm_head"].get("bias")


def check_implementation(implementation):
    if implementation not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"loss implementation={implementation!r}; expected one of {LOSS_IMPLEMENTATIONS} (None: "
                         "plain logits; otherwise kernels.linear_cross_entropy)")


def token_losses(model, params, out, labels, implementation=None, interpret=False):
    """Per-token cross-entropy [B, T] (float32, 0 where labels < 0) from the model's output `out`: logits [B, T, V]
    (implementation None) or hidden states [B, T, D] fed to kernels.linear_cross_entropy with the model's head, so
    the logits never exist. A token's log-probability is minus its loss."""
    valid = labels >= 0
    if implementation is None:
        losses = optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), jnp.maximum(labels, 0))
    else:
        w, bias = head_weight(model, params)
        x, w = out, w.astype(out.dtype)
        if bias is not None:
            # x @ w + b == [x, 1] @ [w; b]; padded with zeros to a multiple of 128 so the kernel's tiles stay whole.
            extra = 128 - x.shape[-1] % 128
            ones = jnp.ones(x.shape[:-1] + (1,), x.dtype)
            x = jnp.concatenate([x, ones, jnp.zeros(x.shape[:-1] + (extra - 1,), x.dtype)], axis=-1)
            w = jnp.concatenate([w, bias.astype(w.dtype)[None], jnp.zeros((extra - 1, w.shape[1]), w.dtype)], axis=0)
        losses = kernels.linear_cross_entropy(x, w, jnp.where(valid, labels, -100), ignore_index=-100,
                                              implementation=None if implementation == "auto" else implementation,
                                              interpret=interpret)
    return jnp.where(valid, losses, 0.0)


def _loss_and_metrics(model, params, out, labels, implementation, interpret):
    """Mean cross-entropy over labels >= 0 (`token_losses`), the token count and, with plain logits, accuracy."""
    valid = labels >= 0
    n = jnp.maximum(valid.sum(), 1)
    metrics = {"tokens": valid.sum().astype(jnp.float32)}
    if implementation is None:
        metrics["accuracy"] = jnp.where(valid, out.argmax(-1) == labels, False).sum() / n
    return token_losses(model, params, out, labels, implementation, interpret).sum() / n, metrics


def dropout_rngs(rng):
    """Flax `rngs` for a model call: the step's key as the 'dropout' stream (none without a key)."""
    return {} if rng is None else {"dropout": rng}


def lm_loss_fn(model, implementation=None, *, interpret=False):
    """`loss_fn(params, batch, rng, is_training)` for a decoder-only model on `collate_lm` batches: mean
    next-token cross-entropy over the labelled positions, plus the number of tokens and (with plain logits) token
    accuracy. implementation: None (plain logits) or a kernel implementation for the fused head + loss ('xla',
    'triton', 'mosaic_tpu', 'auto'; see the module docstring). interpret: run a Pallas kernel in its interpreter.
    Training calls run the model with dropout (its config.dropout_rate) drawn from `rng`."""
    check_implementation(implementation)

    def loss_fn(params, batch, rng, is_training):
        out = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                          return_hidden=implementation is not None, train=is_training, rngs=dropout_rngs(rng))
        return _loss_and_metrics(model, params, out, batch["labels"], implementation, interpret)
    loss_fn.weight_metric = "tokens"  # a mean over tokens: Trainer(step='shard_map') weights shards by it
    return loss_fn


# ----------------------------------------------------------------------------------------------- input/target pairs

def read_records(patterns, fields):
    """Objects with the string `fields` from `.jsonl` files (paths or globs), one per line (other keys dropped)."""
    records = []
    for path in _expand(patterns):
        if not path.endswith(".jsonl"):
            shown = ", ".join(f'"{f}": ...' for f in fields)
            raise ValueError(f"data: {path!r} is not .jsonl; expected one {{{shown}}} per line")
        for n, item in _jsonl(path):
            if not (isinstance(item, dict) and all(isinstance(item.get(f), str) for f in fields)):
                names = " and ".join(", ".join(repr(f) for f in fields).rsplit(", ", 1))
                raise ValueError(f"data: {path}:{n} is not an object with string fields {names}")
            records.append({f: item[f] for f in fields})
    return records


def read_pairs(patterns):
    """`{"input": str, "target": str}` objects from `.jsonl` files (paths or globs), one per line."""
    return read_records(patterns, ("input", "target"))


TOY_WORDS = ("ant", "bee", "cat", "cow", "dog", "eel", "elk", "emu", "fox", "gnu", "hen", "owl", "pig", "ram",
             "rat", "yak")


def toy_pairs(n, seed, *, min_words=3, max_words=6):
    """The embedded sequence-to-sequence task: sort a list of distinct animal names alphabetically, e.g.
    {"input": "owl cat yak bee", "target": "bee cat owl yak"}. Deterministic in `seed`. Its tokens are words
    (`WordTokenizer(TOY_WORDS)`): at byte level a 2-layer T5 stalls near 55% exact match in a few CPU minutes."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = rng.sample(TOY_WORDS, rng.randint(min_words, max_words))
        pairs.append({"input": " ".join(words), "target": " ".join(sorted(words))})
    return pairs


def encode_pairs(pairs, tokenizer, *, max_input_len, max_target_len, decoder_start_id):
    """Input/target pairs -> fixed-width examples {'input_ids', 'attention_mask' [max_input_len],
    'decoder_input_ids', 'labels' [max_target_len]}: targets end with EOS, labels are -100 on padding, the decoder
    sees the start token then the target shifted right. Longer texts are cut (and counted in the second return)."""
    examples, cut = [], 0
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    for pair in pairs:
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
        return _loss_and_metrics(model, params, out, batch["labels"], implementation, interpret)
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


def until_eos(ids, eos_id):
    """Token ids up to and including the first EOS (all of them when there is none); -100 labels dropped."""
    out = []
    for i in np.asarray(ids).tolist():
        if i < 0:
            break
        out.append(i)
        if i == eos_id:
            break
    return out


def exact_match(examples, predictions, eos_id):
    """{'exact_match': fraction of examples whose generated ids equal the target ids (through EOS)}: an
    `eval_metric_fn` for `Trainer.fit` (predictions: generated ids, one row per example)."""
    hits = []
    for example, pred in zip(examples, predictions):
        target = until_eos(example["labels"], eos_id)
        # A target cut to max_target_len has no EOS: then only its kept tokens are compared.
        hits.append(until_eos(pred, eos_id)[:len(target)] == target)
    return {"exact_match": float(np.mean(hits)) if hits else 0.0}


def generate_tokens(model, params, tokenizer, prompts, *, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                    seed=0, kv_cache_dtype=None, num_beams=1, length_penalty=1.0, early_stopping=False):
    """`models.generate` on token-id prompts (lists; decoder prompts left-padded, T5 inputs right-padded): each
    row's new token ids up to and including its first EOS (all `max_new_tokens` when there is none); num_beams > 1:
    beam search (`early_stopping`: True, False or 'never', as in `models.generate`). Every process must call it
    with the same prompts (the parameters may span hosts); every process gets every row."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    if not prompts:
        raise ValueError("prompts: none given; expected at least one prompt")
    encoder_decoder = getattr(model, "is_encoder_decoder", False)
    ids, mask = left_pad(prompts, tokenizer, right=encoder_decoder)
    out = models.generate(model, params, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, rng=jax.random.PRNGKey(seed),
                          eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, kv_cache_dtype=kv_cache_dtype,
                          num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping)
    out = np.asarray(multihost_utils.process_allgather(out, tiled=True))
    new = out[:, 1:] if encoder_decoder else out[:, ids.shape[1]:]
    return [until_eos(row, tokenizer.eos_id) for row in new]


def generate_texts(model, params, tokenizer, prompts, *, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                   seed=0, after_prompt=(), kv_cache_dtype=None, num_beams=1, length_penalty=1.0,
                   early_stopping=False):
    """Continuations of `prompts` (strings) with `generate_tokens`, decoded up to EOS. T5 inputs get EOS appended, as
    in training; decoder prompts `after_prompt`, token ids appended to every prompt (the prompt/response separator
    of a model tuned on `engine.preference` rows)."""
    encoder_decoder = getattr(model, "is_encoder_decoder", False)
    suffix = [tokenizer.eos_id] if encoder_decoder and tokenizer.eos_id is not None else list(after_prompt)
    if not prompts:
        raise ValueError("prompts: none given; expected at least one prompt")
    encoded = [tokenizer.encode(p) + suffix for p in prompts]
    for n, (prompt, tokens) in enumerate(zip(prompts, encoded)):
        if not tokens:
            raise ValueError(f"prompt {n} ({prompt!r}) has no tokens; expected a non-empty prompt")
    new = generate_tokens(model, params, tokenizer, encoded, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=seed, kv_cache_dtype=kv_cache_dtype, num_beams=num_beams,
                          length_penalty=length_penalty, early_stopping=early_stopping)
    return [tokenizer.decode([i for i in row if i != tokenizer.eos_id]) for row in new]


def left_pad(prompts, tokenizer, *, right=False):
    """Token lists -> (ids [B, T], mask [B, T]) left-padded for a decoder's generation (right-padded with
    right=True, for an encoder)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        cols = slice(0, len(p)) if right else slice(width - len(p), width)
        ids[i, cols], mask[i, cols] = p, 1
    return jnp.asarray(ids), jnp.asarray(mask)
