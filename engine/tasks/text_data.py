"""Text data: tokenisers, token files on disk (`write_tokens`, `TokenWindows`; ArrayRecord files through
`array_records.ArrayRecordWindows`, named here too; `token_windows` opens either), the embedded corpus and the toy
task's words. Reading documents and records from files, `pack` and data mixtures live in `engine.tasks.sources`;
its readers and `pack` are named here too, where the scripts and tasks have always found them.
"""
import glob
import json
import os

import numpy as np
from absl import logging

from engine.tasks.array_records import SUFFIX as ARRAY_RECORD_SUFFIX
from engine.tasks.array_records import ArrayRecordWindows, RecordWriter, WindowSequence
from engine.tasks.sources import (DECODE_ERRORS, check_not_empty, iter_texts, pack, read_records,  # noqa: F401
                                  read_texts)


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
        return cls.from_file(file, vocab_size) if os.path.exists(file) else None

    @classmethod
    def from_file(cls, file, vocab_size=None):
        """The tokenizer of a tokenizer.json file; special ids from the config.json beside it (else the tokens its
        tokenizer_config.json names); vocab_size as in `from_dir`."""
        import tokenizers  # noqa: PLC0415 (optional: installed with transformers)

        tok = tokenizers.Tokenizer.from_file(file)
        config, ids = _special_ids(os.path.dirname(file), tok.token_to_id)
        return cls(tok, vocab_size or config.get("vocab_size") or tok.get_vocab_size(), **ids)


class SentencePieceTokenizer:
    """A SentencePiece model (a checkpoint's tokenizer.model: LLaMA 1 and 2, T5, Mistral) behind the same small
    interface. Ids past the model's pieces (a vocabulary padded for the embedding) decode to nothing."""

    def __init__(self, processor, vocab_size=None, *, bos_id=None, eos_id=None, pad_id=None):
        self._sp = processor
        self.vocab_size = vocab_size or processor.get_piece_size()
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)

    def encode(self, text):
        return self._sp.encode(text)

    def decode(self, ids):
        n = self._sp.get_piece_size()
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < n])

    @classmethod
    def from_file(cls, file, vocab_size=None):
        """The tokenizer of a tokenizer.model file. Special ids: config.json's beside it (as for tokenizer.json),
        else the tokens its tokenizer_config.json names, else the model's own (None where it has none).
        vocab_size: the model's (None: config.json's, else the number of pieces)."""
        import sentencepiece  # noqa: PLC0415 (optional, like tokenizers)

        sp = sentencepiece.SentencePieceProcessor(model_file=file)

        def piece_id(piece):  # piece_to_id answers the UNK id for a piece the model lacks
            i = sp.piece_to_id(piece)
            return i if sp.id_to_piece(i) == piece else None
        config, ids = _special_ids(os.path.dirname(file), piece_id)
        own = {"bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "pad_id": sp.pad_id()}  # -1: none
        ids = {k: v if v is not None else (own[k] if own[k] >= 0 else None) for k, v in ids.items()}
        return cls(sp, vocab_size or config.get("vocab_size") or sp.get_piece_size(), **ids)


def _special_ids(directory, token_to_id):
    """(config.json as a dict, {'bos_id', 'eos_id', 'pad_id'}) of a checkpoint directory: config.json's
    *_token_id fields (EOS: the first of a list), else the ids (`token_to_id`) of the tokens tokenizer_config.json
    names, else None."""
    def read(name):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    config, named = read("config.json"), None
    ids = {}
    for key in ("bos", "eos", "pad"):
        value = config.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None:
            named = read("tokenizer_config.json") if named is None else named
            token = named.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            value = token_to_id(token) if isinstance(token, str) else None
        ids[f"{key}_id"] = value
    return config, ids


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(spec, *, model_dir=None, vocab_size=None):
    """The tokenizer `spec` names (the --tokenizer flag): a tokenizer.json file -> HFTokenizer; a tokenizer.model
    file (SentencePiece) -> SentencePieceTokenizer; a directory -> its tokenizer.json, else its tokenizer.model;
    'byte' -> ByteTokenizer; 'word' -> the toy task's WordTokenizer(TOY_WORDS). spec None: `model_dir`'s
    tokenizer.json, else its tokenizer.model; a directory with neither is a ValueError (byte-level ids only when
    asked for, never as a silent fallback). Special ids (BOS, EOS, PAD) come from the config.json beside the file
    as in `HFTokenizer.from_dir`. vocab_size: the model's (None: config.json's, else the tokenizer's own); a
    tokenizer with more ids than that is a ValueError."""
    if spec is None:
        if model_dir is None:
            raise ValueError("tokenizer: neither a spec nor a model directory; expected --tokenizer='byte', 'word', "
                             "a tokenizer.json / tokenizer.model path or a directory holding one")
        file = _tokenizer_file(model_dir)
        if file is None:
            raise ValueError(f"{model_dir} has neither tokenizer.json nor tokenizer.model; pass --tokenizer=PATH to "
                             "one, or --tokenizer=byte to choose byte-level ids explicitly")
        tokenizer, what = _tokenizer_of_file(file, vocab_size), file
    elif spec in ("byte", "word"):
        tokenizer, what = ByteTokenizer() if spec == "byte" else WordTokenizer(TOY_WORDS), f"--tokenizer={spec}"
        if model_dir is not None:
            logging.warning("tokenizer: %s ids (%s) for %s, not a tokenizer file of that directory",
                            type(tokenizer).__name__, what, model_dir)
    else:
        path = os.path.expanduser(spec)
        if os.path.isdir(path):
            file = _tokenizer_file(path)
            if file is None:
                raise ValueError(f"--tokenizer={spec}: the directory has neither tokenizer.json nor tokenizer.model")
        elif os.path.isfile(path):
            file = path
        else:
            raise FileNotFoundError(f"--tokenizer={spec}: no such file or directory; expected 'byte', 'word', a "
                                    "tokenizer.json / tokenizer.model path or a directory holding one")
        tokenizer, what = _tokenizer_of_file(file, vocab_size), file
    own = _own_vocab_size(tokenizer)
    if vocab_size is not None and own > vocab_size:
        raise ValueError(f"tokenizer {what} has {own} ids; the model's vocabulary holds only {vocab_size}")
    logging.info("tokenizer: %s (%s, vocab_size %d, bos %s, eos %s, pad %s)", what, type(tokenizer).__name__,
                 tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    if tokenizer.eos_id is None:
        logging.warning("tokenizer %s has no EOS id: documents are not ended by EOS", what)
    return tokenizer


def _tokenizer_file(directory):
    return next((os.path.join(directory, name) for name in TOKENIZER_FILES
                 if os.path.isfile(os.path.join(directory, name))), None)


def _tokenizer_of_file(file, vocab_size):
    """An HFTokenizer for a .json file, a SentencePieceTokenizer for a .model file."""
    if file.endswith(".json"):
        try:
            return HFTokenizer.from_file(file, vocab_size)
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on a bad file)
            raise ValueError(f"tokenizer {file} is not a tokenizer.json ({str(e).splitlines()[0]})") from None
    if file.endswith(".model"):
        try:
            return SentencePieceTokenizer.from_file(file, vocab_size)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"tokenizer {file} is not a SentencePiece model ({str(e).splitlines()[0]})") from None
    raise ValueError(f"tokenizer {file}; expected a tokenizer.json (Hugging Face tokenizers) or a tokenizer.model "
                     "(SentencePiece) file")


def _own_vocab_size(tokenizer):
    """The ids a tokenizer itself produces (its vocab_size may be a model's larger one)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer._tok.get_vocab_size()
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer._sp.get_piece_size()
    return tokenizer.vocab_size


def tokenizer_spec(tokenizer, directory):
    """A JSON-able description of `tokenizer` for a workdir's run.json; an HFTokenizer's tokenizer.json (a
    SentencePieceTokenizer's tokenizer.model) is copied into `directory` so the workdir is self-contained."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte"}
    if isinstance(tokenizer, WordTokenizer):
        return {"kind": "words", "words": tokenizer.words}
    os.makedirs(directory, exist_ok=True)
    if isinstance(tokenizer, SentencePieceTokenizer):
        with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
            f.write(tokenizer._sp.serialized_model_proto())
        kind = "tokenizer.model"
    else:
        tokenizer._tok.save(os.path.join(directory, "tokenizer.json"))
        kind = "tokenizer.json"
    return {"kind": kind, "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}


def tokenizer_from_spec(spec, directory):
    """Inverse of `tokenizer_spec`."""
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "words":
        return WordTokenizer(spec["words"])
    ids = {k: spec.get(k) for k in ("bos_id", "eos_id", "pad_id")}
    if spec.get("kind") == "tokenizer.model":
        import sentencepiece  # noqa: PLC0415

        return SentencePieceTokenizer(sentencepiece.SentencePieceProcessor(
            model_file=os.path.join(directory, "tokenizer.model")), spec["vocab_size"], **ids)
    if spec.get("kind") != "tokenizer.json":
        raise ValueError(f"tokenizer {spec!r} in {directory}; expected kind 'byte', 'words', 'tokenizer.json' or "
                         "'tokenizer.model'")
    import tokenizers  # noqa: PLC0415

    return HFTokenizer(tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")), spec["vocab_size"],
                       **ids)


TOKENS_FILE, TOKENS_META = "tokens.bin", "meta.json"


def write_tokens(docs, tokenizer, directory, *, format="bin", chunk_tokens=1 << 20, shard_tokens=1 << 28):
    """Tokenises `docs` (any iterable of strings, streamed) into `directory`, every document followed by EOS, as
    format='bin': `tokens.bin`, the documents laid end to end (uint16 when the vocabulary fits, else uint32;
    nanoGPT's train.bin), read by `TokenWindows`; or format='array_record': `tokens-00000.array_record`, ... (a new
    file after `shard_tokens` tokens), one record per document of little-endian int32 ids, read by
    `ArrayRecordWindows` (and by Grain's `ArrayRecordDataSource`). Then `meta.json` (token and document counts, the
    largest id, EOS, the tokenizer; for ArrayRecord its format and files, for tokens.bin its dtype) and, for a
    Hugging Face tokenizer, its tokenizer.json. meta.json is written last, so a directory holding it is complete.
    Returns the meta dict."""
    if format not in ("bin", "array_record"):
        raise ValueError(f"format={format!r}; expected 'bin' (tokens.bin) or 'array_record'")
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKENS_FILE)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    n_tokens = n_docs = max_id = 0
    if format == "array_record":
        writer = RecordWriter(directory, shard_tokens)
        try:
            for doc in docs:
                ids = tokenizer.encode(doc) + eos
                writer.write(ids)
                n_docs, n_tokens, max_id = n_docs + 1, n_tokens + len(ids), max(max_id, max(ids, default=0))
        finally:
            writer.close()
        meta = {"format": "array_record", "files": writer.files}
    else:
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
        meta = {"dtype": dtype.name}
    meta.update({"num_tokens": n_tokens, "num_documents": n_docs, "max_id": int(max_id),
                 "eos_id": tokenizer.eos_id, "tokenizer": tokenizer_spec(tokenizer, directory)})
    with open(os.path.join(directory, TOKENS_META + ".tmp"), "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(os.path.join(directory, TOKENS_META + ".tmp"), os.path.join(directory, TOKENS_META))
    return meta


def is_token_dir(path):
    """Whether `path` is a directory written by `write_tokens` (either format)."""
    return os.path.isfile(os.path.join(path, TOKENS_META))


def is_token_data(data):
    """Whether `data` (a path or a --data list) is pre-tokenised: one `write_tokens` directory, or ArrayRecord
    files, globs of them or directories holding them."""
    data = [data] if isinstance(data, str) else list(data)
    if len(data) == 1 and is_token_dir(data[0]):
        return True
    return bool(data) and all(p.endswith(ARRAY_RECORD_SUFFIX) or (os.path.isdir(p) and any(
        name.endswith(ARRAY_RECORD_SUFFIX) for _, _, names in os.walk(p) for name in names)) for p in data)


def token_windows(data, seq_len, *, feature="text"):
    """The training windows of pre-tokenised `data` (see `is_token_data`): a `TokenWindows` over a tokens.bin
    directory, else an `ArrayRecordWindows` (`feature`: a tf.train.Example's feature holding the ids)."""
    data = [data] if isinstance(data, str) else list(data)
    if len(data) == 1 and is_token_dir(data[0]) and read_token_meta(data[0]).get("format", "bin") == "bin":
        return TokenWindows(data[0], seq_len)
    return ArrayRecordWindows(data, seq_len, feature=feature)


def check_token_windows(windows, tokenizer, vocab_size):
    """`check_token_dir` for windows from `token_windows`: a `write_tokens` directory's tokenizer and largest id;
    ArrayRecord files without its meta.json carry no tokenizer, so only their ids are checked (the largest is read
    while indexing them)."""
    if windows.directory is not None:
        return check_token_dir(windows.directory, tokenizer, vocab_size)
    logging.warning("data: ArrayRecord files without a prepare_data.py meta.json: their tokenizer is not known, "
                    "only their ids are checked against the model's vocabulary")
    if windows.meta["max_id"] >= vocab_size:
        raise ValueError(f"data: {', '.join(windows.meta['files'][:3])} hold token id {windows.meta['max_id']}; "
                         f"expected ids below the model's vocab_size={vocab_size}")


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
                _tokenizer_json(directory) == tokenizer._tok.to_str()),
            "tokenizer.model": lambda: isinstance(tokenizer, SentencePieceTokenizer) and (
                tokenizer.eos_id == spec["eos_id"]) and _tokenizer_model(directory) == (
                tokenizer._sp.serialized_model_proto())}.get(spec.get("kind"), lambda: False)()
    if not same:
        raise ValueError(f"data: {directory} was tokenised with a {spec.get('kind')} tokenizer that is not this "
                         f"model's ({type(tokenizer).__name__}); expected scripts/prepare_data.py run with the "
                         "model's tokenizer (--tokenizer=<its Hugging Face directory>)")
    if meta["max_id"] >= vocab_size:
        raise ValueError(f"data: {directory} holds token id {meta['max_id']}; expected ids below the model's "
                         f"vocab_size={vocab_size}")


def _tokenizer_model(directory):
    with open(os.path.join(directory, "tokenizer.model"), "rb") as f:
        return f.read()


def _tokenizer_json(directory):
    import tokenizers  # noqa: PLC0415

    return tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json")).to_str()


class TokenWindows(WindowSequence):
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
        if self.meta.get("format", "bin") != "bin":
            raise ValueError(f"data: {directory} holds {self.meta['format']} files, not tokens.bin; read it with "
                             "ArrayRecordWindows (or text_data.token_windows)")
        self._tokens = np.memmap(os.path.join(directory, TOKENS_FILE), dtype=self.meta["dtype"], mode="r",
                                 shape=(self.meta["num_tokens"],))
        self._range = _range if _range is not None else range(max(0, (self.meta["num_tokens"] - 1) // seq_len))

    def _sliced(self, part):
        return TokenWindows(self.directory, self.seq_len, _range=part)

    def _window(self, start):
        tokens = np.asarray(self._tokens[start:start + self.seq_len + 1], np.int32)
        eos = self.meta["eos_id"]
        ends = np.zeros_like(tokens) if eos is None else (tokens == eos).astype(np.int32)
        segments = 1 + np.concatenate([[0], np.cumsum(ends)[:-1]]).astype(np.int32)
        return {"tokens": tokens, "segment_ids": segments}

    def __getstate__(self):  # a data worker process maps the file again rather than receiving a copy of it
        return {"directory": self.directory, "seq_len": self.seq_len, "_range": self._range}

    def __setstate__(self, state):
        self.__init__(state["directory"], state["seq_len"], _range=state["_range"])


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


TOY_WORDS = ("ant", "bee", "cat", "cow", "dog", "eel", "elk", "emu", "fox", "gnu", "hen", "owl", "pig", "ram",
             "rat", "yak")
