"""Text data: tokenisers, corpora and jsonl records, token files on disk, and packing documents into fixed-length
rows.

Packing: documents are tokenised, each followed by EOS, and laid end to end into rows of `seq_len + 1` tokens. Every
row carries `segment_ids` (1, 2, ... per document piece, 0 on padding), which the models take as `attention_mask`:
a token attends only within its own document and positions restart at each document.
"""
import collections.abc
import glob
import json
import os

import numpy as np


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
                                "scripts/prepare_data.py (engine.tasks.text_data.write_tokens)")
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


TOY_WORDS = ("ant", "bee", "cat", "cow", "dog", "eel", "elk", "emu", "fox", "gnu", "hen", "owl", "pig", "ram",
             "rat", "yak")
