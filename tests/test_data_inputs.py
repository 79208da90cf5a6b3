"""Data inputs (engine.tasks.text_data, engine.tasks.sources and the record readers): tokenizer files (SentencePiece,
tokenizers' tokenizer.json) and `load_tokenizer`'s resolution, files that are not UTF-8, JSONL values of the wrong
type, records with nothing to train on, `pack` on one very long document; Parquet, Arrow and `save_to_disk` corpora
(streamed in flat memory), and weighted mixtures (shares, exact resume, errors).

`python -m tests.test_data_inputs` prints the peak memory of reading Parquet and Arrow corpora of growing size (the
figure in scripts/README.md#data-formats)."""
import json
import logging
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from engine.tasks import seq2seq, sources, text_data
from engine.tasks.rlhf import preference

SENTENCES = ["the quick brown fox jumps over the lazy dog", "a cat and a dog sat on the mat",
             "owls and bees fly over the green field", "pack the rows of tokens end to end"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A SentencePiece model of 64 pieces (LLaMA's special ids: unk 0, bos 1, eos 2, no pad) trained here."""
    import sentencepiece  # noqa: PLC0415

    root = tmp_path_factory.mktemp("sp")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.sample(s.split(), len(s.split()))) for s in SENTENCES * 50) + "\n")
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / "tokenizer"), vocab_size=64,
                                             model_type="bpe", minloglevel=2)
    return root / "tokenizer.model"


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    """A byte-level BPE tokenizer.json (tokenizers) with <pad> 0, <s> 1, </s> 2, trained here."""
    import tokenizers  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    root = tmp_path_factory.mktemp("hf")
    tok.save(str(root / "tokenizer.json"))
    return root / "tokenizer.json"


def test_sentencepiece_tokenizer_round_trips_and_persists(sp_model, tmp_path):
    tok = text_data.load_tokenizer(str(sp_model))
    assert isinstance(tok, text_data.SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (64, 1, 2, 2)  # no pad piece: PAD is EOS
    for text in SENTENCES + ["dog fox owl"]:
        ids = tok.encode(text)
        assert ids and all(3 <= i < 64 for i in ids) and tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *tok.encode("the dog"), tok.eos_id, 63, 64, 100]) == tok.decode(
        tok.encode("the dog") + [63])  # special ids and ids past the pieces (a padded vocabulary) decode to nothing

    # A model directory: config.json's special ids and vocabulary win, as for tokenizer.json.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 128, "bos_token_id": 1, "eos_token_id": [2, 3]}))
    in_dir = text_data.load_tokenizer(None, model_dir=str(model_dir))
    assert (in_dir.vocab_size, in_dir.bos_id, in_dir.eos_id) == (128, 1, 2)
    assert text_data.load_tokenizer(str(model_dir), vocab_size=256).vocab_size == 256

    # run.json / token directories keep the model file and its ids.
    spec = text_data.tokenizer_spec(in_dir, str(tmp_path / "work"))
    assert spec == {"kind": "tokenizer.model", "vocab_size": 128, "bos_id": 1, "eos_id": 2, "pad_id": 2}
    back = text_data.tokenizer_from_spec(spec, str(tmp_path / "work"))
    assert back.encode(SENTENCES[0]) == tok.encode(SENTENCES[0]) and back.eos_id == 2
    meta = text_data.write_tokens(SENTENCES, in_dir, str(tmp_path / "tokens"))
    assert meta["tokenizer"]["kind"] == "tokenizer.model" and meta["num_documents"] == 4
    text_data.check_token_dir(str(tmp_path / "tokens"), in_dir, vocab_size=128)
    with pytest.raises(ValueError, match=r"tokenised with a tokenizer.model tokenizer that is not this model's"):
        text_data.check_token_dir(str(tmp_path / "tokens"), text_data.ByteTokenizer(), vocab_size=320)


def test_tokenizer_json_keeps_the_hugging_face_directory_behaviour(hf_json, tmp_path):
    tok = text_data.load_tokenizer(str(hf_json))
    assert isinstance(tok, text_data.HFTokenizer)
    assert tok.vocab_size == tok._tok.get_vocab_size() and (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, 0)
    for text in SENTENCES + ["unseen wörds, too"]:
        assert tok.decode(tok.encode(text)) == text

    # Beside a config.json: its ids and vocabulary, exactly what HFTokenizer.from_dir (the scripts' path) gives.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text(hf_json.read_text())
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
                                                       "pad_token_id": 0}))
    for found in (text_data.load_tokenizer(None, model_dir=str(model_dir)),
                  text_data.load_tokenizer(str(model_dir / "tokenizer.json"), vocab_size=512)):
        old = text_data.HFTokenizer.from_dir(str(model_dir), 512)
        assert (found.vocab_size, found.bos_id, found.eos_id, found.pad_id) == (
            old.vocab_size, old.bos_id, old.eos_id, old.pad_id) == (512, 1, 2, 0)
        assert found.encode(SENTENCES[1]) == old.encode(SENTENCES[1])

    # Without config.json ids: the tokens tokenizer_config.json names.
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                                 "pad_token": None}))
    named = text_data.load_tokenizer(str(model_dir))
    assert (named.bos_id, named.eos_id, named.pad_id) == (1, 2, 2)


def test_load_tokenizer_resolution_and_errors(sp_model, hf_json, tmp_path, caplog):
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert isinstance(text_data.load_tokenizer(str(both)), text_data.SentencePieceTokenizer)
    (both / "tokenizer.json").write_text(hf_json.read_text())
    assert isinstance(text_data.load_tokenizer(str(both)), text_data.HFTokenizer)  # tokenizer.json first
    assert isinstance(text_data.load_tokenizer(None, model_dir=str(both)), text_data.HFTokenizer)
    assert isinstance(text_data.load_tokenizer("word"), text_data.WordTokenizer)
    assert isinstance(text_data.load_tokenizer("byte"), text_data.ByteTokenizer)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"empty has neither tokenizer.json nor tokenizer.model; pass "
                                         r"--tokenizer=PATH to one, or --tokenizer=byte to choose byte-level ids"):
        text_data.load_tokenizer(None, model_dir=str(empty))
    with caplog.at_level(logging.WARNING):
        assert isinstance(text_data.load_tokenizer("byte", model_dir=str(empty)), text_data.ByteTokenizer)
    assert "ByteTokenizer ids (--tokenizer=byte) for" in caplog.text
    with pytest.raises(ValueError, match=r"--tokenizer=.*empty: the directory has neither"):
        text_data.load_tokenizer(str(empty))
    with pytest.raises(FileNotFoundError, match=r"--tokenizer=/nonexistent: no such file or directory"):
        text_data.load_tokenizer("/nonexistent")
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"vocab.txt; expected a tokenizer.json .* or a tokenizer.model"):
        text_data.load_tokenizer(str(tmp_path / "vocab.txt"))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"bad.model is not a SentencePiece model"):
        text_data.load_tokenizer(str(tmp_path / "bad.model"))
    with pytest.raises(ValueError, match=r"tokenizer --tokenizer=byte has 320 ids; the model's vocabulary holds only "
                                         r"256"):
        text_data.load_tokenizer("byte", vocab_size=256)
    with pytest.raises(ValueError, match=r"tokenizer.model has 64 ids; the model's vocabulary holds only 32"):
        text_data.load_tokenizer(str(sp_model), vocab_size=32)


def test_files_that_are_not_utf8_name_the_byte_unless_replaced(tmp_path):
    (tmp_path / "data.txt").write_bytes(b"hello \xff world")
    with pytest.raises(ValueError, match=r"data.txt: not UTF-8 at byte 6 \(0xff: invalid start byte\); pass "
                                         r"--decode_errors=replace to replace invalid bytes"):
        text_data.read_texts(str(tmp_path / "data.txt"))
    assert text_data.read_texts(str(tmp_path / "data.txt"), decode_errors="replace") == ["hello \ufffd world"]

    lines = b'{"text": "ok"}\n"fine \xc3\xa9"\n{"text": "cut \xe2\x82"}\n'  # line 3: a truncated 3-byte sequence
    (tmp_path / "d.jsonl").write_bytes(lines)
    offset = lines.index(b"\xe2")
    with pytest.raises(ValueError, match=rf"d.jsonl: not UTF-8 at byte {offset} \(0xe2: invalid continuation byte\)"):
        list(text_data.iter_texts(str(tmp_path / "d.jsonl")))
    assert text_data.read_texts(str(tmp_path / "d.jsonl"), decode_errors="replace") == ["ok", "fine é", "cut \ufffd"]

    records = b'{"prompt": "p", "response": "r"}\n{"prompt": "\xfe", "response": "r"}\n'
    (tmp_path / "r.jsonl").write_bytes(records)
    offset = records.index(b"\xfe")
    for read in (preference.read_prompt_responses, lambda p, **kw: text_data.read_records(p, ("prompt",), **kw)):
        with pytest.raises(ValueError, match=rf"r.jsonl: not UTF-8 at byte {offset} \(0xfe"):
            read(str(tmp_path / "r.jsonl"))
        assert read(str(tmp_path / "r.jsonl"), decode_errors="replace")[1]["prompt"] == "\ufffd"
    triple = b'{"prompt": "p", "chosen": "\x80", "rejected": "r"}\n'
    (tmp_path / "t.jsonl").write_bytes(triple)
    offset = triple.index(b"\x80")
    with pytest.raises(ValueError, match=rf"t.jsonl: not UTF-8 at byte {offset} "):
        preference.read_preferences(str(tmp_path / "t.jsonl"))
    (tmp_path / "s.jsonl").write_bytes(b'{"input": "\xc0", "target": "t"}\n')
    with pytest.raises(ValueError, match=r"s.jsonl: not UTF-8 at byte 11"):
        seq2seq.read_pairs(str(tmp_path / "s.jsonl"))
    assert seq2seq.read_pairs(str(tmp_path / "s.jsonl"), decode_errors="replace") == [{"input": "\ufffd",
                                                                                     "target": "t"}]
    with pytest.raises(ValueError, match=r"decode_errors='ignore'; expected one of \('strict', 'replace'\)"):
        text_data.read_texts(str(tmp_path / "data.txt"), decode_errors="ignore")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhi")  # a byte-order mark is not text
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf"hi"\n')
    assert text_data.read_texts([str(tmp_path / "bom.txt"), str(tmp_path / "bom.jsonl")]) == ["hi", "hi"]


@pytest.mark.parametrize("line, found", [
    ('{"text": ["a"]}', ": 'text' is an array"), ('{"text": null}', ": 'text' is null"),
    ('{"text": 3}', ": 'text' is a number"), ('{"text": {"a": 1}}', ": 'text' is an object"),
    ('{"text": true}', ": 'text' is a boolean"), ("12", " is a number"), ('["a"]', " is an array"),
    ("null", " is null")])
def test_jsonl_values_of_another_type_are_refused(tmp_path, line, found):
    (tmp_path / "d.jsonl").write_text(f'"ok"\n\n{line}\n')
    with pytest.raises(ValueError, match=rf"data: .*d.jsonl:3{found}; expected a string"):
        text_data.read_texts(str(tmp_path / "d.jsonl"))


def test_a_jsonl_line_that_is_not_json_is_refused_with_its_column(tmp_path):
    (tmp_path / "d.jsonl").write_text('"ok"\n{"text": "a\tb"}\n')  # a raw tab inside a JSON string
    with pytest.raises(ValueError, match=r"^data: .*d.jsonl:2 is not JSON \(Invalid control character at column "
                                         r"12\)$"):
        text_data.read_texts(str(tmp_path / "d.jsonl"))
    (tmp_path / "a.jsonl").write_text('\n[\n  {"text": "a"},\n  {"text": "b"}\n]\n')  # a pretty-printed array
    with pytest.raises(ValueError, match=r"^data: .*a.jsonl:2 is not JSON \(Expecting value column 1\); a JSON array "
                                         r"or object over several lines\? expected JSON Lines, one document per line$"):
        text_data.read_texts(str(tmp_path / "a.jsonl"))


def test_records_of_the_wrong_type_or_with_nothing_to_train_on_are_refused(tmp_path):
    def write(name, *records):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(tmp_path / name)

    ok = {"prompt": "p", "response": "r"}
    for record, found in (({"prompt": "p", "response": None}, "'response' is null"),
                          ({"prompt": ["p"], "response": "r"}, "'prompt' is an array"),
                          ({"prompt": "p"}, "'response' is missing"), ("p", "it is a string")):
        with pytest.raises(ValueError, match=rf"sft.jsonl:2 is not an object with string fields 'prompt' and "
                                             rf"'response' \({found}\)"):
            preference.read_prompt_responses(write("sft.jsonl", ok, record))
    with pytest.raises(ValueError, match=r"sft.jsonl:2: 'prompt' and 'response' are both empty; expected text"):
        preference.read_prompt_responses(write("sft.jsonl", ok, {"prompt": "", "response": " \n"}))
    assert len(preference.read_prompt_responses(write("sft.jsonl", ok, {"prompt": "", "response": "r"}))) == 2
    with pytest.raises(ValueError, match=r"dpo.jsonl:1: 'chosen' and 'rejected' are both empty"):
        preference.read_preferences(write("dpo.jsonl", {"prompt": "p", "chosen": "", "rejected": ""}))
    with pytest.raises(ValueError, match=r"s2s.jsonl:1: 'input' and 'target' are both empty"):
        seq2seq.read_pairs(write("s2s.jsonl", {"input": "", "target": ""}))
    with pytest.raises(ValueError, match=r"ppo.jsonl:1: 'prompt' is empty"):
        text_data.read_records(write("ppo.jsonl", {"prompt": ""}), ("prompt",))

    # Records built in code are refused by the encoders, naming their index.
    tok = text_data.ByteTokenizer()
    with pytest.raises(ValueError, match=r"pair 1: 'prompt' and 'response' are both empty"):
        preference.encode_prompt_responses([ok, {"prompt": "", "response": ""}], tok, seq_len=16)
    with pytest.raises(ValueError, match=r"triple 0: 'chosen' and 'rejected' are both empty"):
        preference.encode_preferences([{"prompt": "p", "chosen": "", "rejected": " "}], tok, seq_len=16)
    with pytest.raises(ValueError, match=r"pair 0: 'input' and 'target' are both empty"):
        seq2seq.encode_pairs([{"input": "", "target": ""}], tok, max_input_len=4, max_target_len=4,
                             decoder_start_id=tok.bos_id)

    # A corpus without text at all, and a directory of files.
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(" \n")
    (tmp_path / "corpus" / "b.jsonl").write_text('""\n{"text": ""}\n')
    with pytest.raises(ValueError, match=r"a.txt, .*b.jsonl holds no text"):
        text_data.read_texts(str(tmp_path / "corpus"))
    (tmp_path / "corpus" / "sub").mkdir()
    (tmp_path / "corpus" / "sub" / "c.txt").write_text("words")
    (tmp_path / "corpus" / "notes.md").write_text("skipped")
    assert text_data.read_texts(str(tmp_path / "corpus")) == [" \n", "", "", "words"]
    with pytest.raises(FileNotFoundError, match=r"the directory .*sub holds no .jsonl / .ndjson / .parquet / "
                                                r".arrow \(or .jsonl / .ndjson / .json compressed: .gz, .zst, .bz2, "
                                                r".xz\) file"):
        text_data.read_records(str(tmp_path / "corpus" / "sub"), ("prompt",))


def _pack_reference(docs, tokenizer, seq_len):
    """pack as it was (quadratic in a document's length: the rest re-sliced for every row)."""
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


class _NoEos(text_data.ByteTokenizer):
    eos_id = None


@pytest.mark.parametrize("tokenizer", [text_data.ByteTokenizer(), text_data.WordTokenizer(text_data.TOY_WORDS),
                                       _NoEos()], ids=["byte", "word", "no_eos"])
def test_pack_equals_the_old_packing(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        docs = [" ".join(rng.choice(("ant", "bee", "x", "")) for _ in range(rng.randint(0, 12)))
                for _ in range(rng.randint(0, 6))]
        seq_len = rng.randint(2, 12)
        got, want = text_data.pack(docs, tokenizer, seq_len), _pack_reference(docs, tokenizer, seq_len)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            for key in ("tokens", "segment_ids"):
                assert a[key].dtype == b[key].dtype and a[key].tolist() == b[key].tolist()


def test_pack_one_4mb_document():
    """Finishes: packing is linear in a document's length (it was quadratic, re-slicing the rest for every row)."""
    doc = "abcdefghij" * 400_000
    rows = text_data.pack(["xy", doc], text_data.ByteTokenizer(), seq_len=127)
    assert len(rows) == -(-(len(doc) + 4) // 128)
    assert rows[0]["tokens"][:4].tolist() == [120, 121, 258, 97] and rows[0]["segment_ids"][:4].tolist() == [1, 1, 1, 2]
    assert rows[1]["tokens"][0] == ord(doc[125]) and (rows[1]["segment_ids"] == 1).all()
    tail = (len(doc) + 4) % 128
    assert rows[-1]["tokens"][tail - 1] == 258 and rows[-1]["segment_ids"][tail:].tolist() == [0] * (128 - tail)


def _table(**columns):
    import pyarrow as pa  # noqa: PLC0415

    return pa.table(columns)


def _write_parquet(path, table, row_group_size=None):
    import pyarrow.parquet as pq  # noqa: PLC0415

    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def _write_arrow(path, table, *, stream, max_chunksize=3):
    """An Arrow IPC stream (datasets' format) or file (random access, 'ARROW1' magic) of small record batches."""
    import pyarrow as pa  # noqa: PLC0415

    with pa.OSFile(str(path), "wb") as sink, (pa.ipc.new_stream if stream else pa.ipc.new_file)(
            sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max_chunksize)
    return str(path)


def _save_to_disk(directory, table, shards=2):
    """The layout of `datasets.Dataset.save_to_disk`: data-0000k-of-0000n.arrow stream files, the state.json that
    lists them, dataset_info.json with the features."""
    os.makedirs(directory)
    names, at = [], 0
    for k in range(shards):
        rows = -(-(table.num_rows - at) // (shards - k))
        names.append(f"data-{k:05d}-of-{shards:05d}.arrow")
        _write_arrow(os.path.join(directory, names[-1]), table.slice(at, rows), stream=True)
        at += rows
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
                   "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}, f)
    with open(os.path.join(directory, "dataset_info.json"), "w") as f:
        json.dump({"features": {name: {"dtype": str(table.schema.field(name).type), "_type": "Value"}
                                for name in table.schema.names}}, f)
    return str(directory)


def test_parquet_arrow_and_saved_datasets_read_beside_text_and_jsonl(tmp_path):
    import pyarrow as pa  # noqa: PLC0415

    docs = [f"doc {i} " + "é" * i for i in range(12)]
    _write_parquet(tmp_path / "a.parquet", _table(id=list(range(4)), text=docs[:4]), row_group_size=3)
    _write_arrow(tmp_path / "b.arrow", _table(text=docs[4:6]), stream=False)
    _write_arrow(tmp_path / "c.arrow", _table(text=docs[6:7]), stream=True)
    _save_to_disk(tmp_path / "saved", _table(text=docs[7:10], id=[7, 8, 9]))
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": docs[10]}) + "\n")
    (tmp_path / "e.txt").write_text(docs[11])
    patterns = [str(tmp_path / "a.parquet"), str(tmp_path / "*.arrow"), str(tmp_path / "saved"),
                str(tmp_path / "d.jsonl"), str(tmp_path / "e.txt")]
    assert text_data.read_texts(patterns) == docs
    assert sorted(text_data.read_texts(str(tmp_path))) == sorted(docs)  # a directory: every kind under it

    # Another column name, in Parquet and JSONL alike; dictionary-encoded and large strings are strings.
    _write_parquet(tmp_path / "other.parquet", pa.table({
        "content": pa.array(["x", "y", "x"]).dictionary_encode(), "text": [1, 2, 3]}))
    _write_arrow(tmp_path / "large.arrow", pa.table({"content": pa.array(["big"], pa.large_string())}), stream=True)
    (tmp_path / "other.jsonl").write_text('{"content": "z", "text": 3}\n"plain"\n')
    assert text_data.read_texts([str(tmp_path / f) for f in ("other.parquet", "large.arrow", "other.jsonl")],
                                text_column="content") == ["x", "y", "x", "big", "z", "plain"]


def _one_line_error(kind, pattern, read):
    with pytest.raises(kind, match=pattern) as caught:
        read()
    assert "\n" not in str(caught.value)


def test_bad_parquet_and_arrow_inputs_are_refused_in_one_line(tmp_path):
    import pyarrow as pa  # noqa: PLC0415

    read = lambda *p, **kw: lambda: text_data.read_texts([str(tmp_path / x) for x in p], **kw)  # noqa: E731
    _write_parquet(tmp_path / "cols.parquet", _table(content=["a"], id=[1]))
    _one_line_error(ValueError, r"data: .*cols.parquet has no column 'text'; its columns: content, id",
                    read("cols.parquet"))
    _write_parquet(tmp_path / "ints.parquet", _table(text=[5, 6]))
    _one_line_error(ValueError, r"data: .*ints.parquet row 0: 'text' is int64; expected a string",
                    read("ints.parquet"))
    _write_parquet(tmp_path / "null.parquet", _table(text=["a", "b", "c", "d", "e", None, "g"]), row_group_size=2)
    _one_line_error(ValueError, r"data: .*null.parquet row 5: 'text' is null; expected a string",
                    read("null.parquet"))
    _write_arrow(tmp_path / "null.arrow", _table(text=["a", "b", "c", "d", None]), stream=True, max_chunksize=2)
    _one_line_error(ValueError, r"data: .*null.arrow row 4: 'text' is null", read("null.arrow"))
    _write_arrow(tmp_path / "list.arrow", pa.table({"text": [["a"]]}), stream=False)
    _one_line_error(ValueError, r"data: .*list.arrow row 0: 'text' is list<item: string>; expected a string",
                    read("list.arrow"))
    _save_to_disk(tmp_path / "saved", _table(body=["a", "b"]))
    _one_line_error(ValueError, r"data-00000-of-00002.arrow has no column 'text'; its columns: body",
                    read("saved"))
    assert text_data.read_texts(str(tmp_path / "saved"), text_column="body") == ["a", "b"]

    # Empty sources: a glob matching nothing, files without rows or without any text.
    _one_line_error(FileNotFoundError, r"data: .*nothing\*.parquet' matches no file; expected .txt / .jsonl / "
                    r".ndjson / .parquet / .arrow \(or .jsonl / .ndjson / .json / .txt compressed: .gz, .zst, .bz2, "
                    r".xz\) paths",
                    read("nothing*.parquet"))
    _write_parquet(tmp_path / "empty.parquet", _table(text=pa.array([], pa.string())))
    _write_arrow(tmp_path / "blank.arrow", _table(text=["", " \n"]), stream=True)
    _one_line_error(ValueError, r"data: .*empty.parquet, .*blank.arrow holds no text", read("empty.parquet",
                                                                                             "blank.arrow"))
    # Files that are not what their names say, a saved DatasetDict, a file of another kind.
    (tmp_path / "fake.parquet").write_text("not parquet")
    _one_line_error(ValueError, r"data: .*fake.parquet is not a Parquet file", read("fake.parquet"))
    (tmp_path / "fake.arrow").write_text("not arrow at all")
    _one_line_error(ValueError, r"data: .*fake.arrow is not an Arrow IPC file or stream", read("fake.arrow"))
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    _one_line_error(ValueError, r"data: .*dict is a saved DatasetDict \(splits: train, test\); expected one split's "
                    r"directory, e.g. .*dict/train", read("dict"))
    (tmp_path / "notes.md").write_text("x")
    _one_line_error(ValueError, r"data: .*notes.md' is none of .txt / .jsonl / .ndjson / .parquet / .arrow \(or ",
                    read("notes.md"))


def test_mixture_specs_are_parsed_and_bad_weights_refused():
    assert sources.parse_mixture("code.parquet:0.7,web/*.jsonl:0.3") == [("code.parquet", 0.7), ("web/*.jsonl", 0.3)]
    assert sources.parse_mixture(["a.txt:2", "b/*:6"]) == [("a.txt", 0.25), ("b/*", 0.75)]  # a list flag's value
    assert sources.parse_mixture("a.txt") == [("a.txt", 1.0)]
    assert sources.parse_mixture(" a.txt , b.txt ") == [("a.txt", 0.5), ("b.txt", 0.5)]
    assert sources.parse_mixture("dir:v2/a.txt:1") == [("dir:v2/a.txt", 1.0)]  # the last ':' holds the weight
    assert sources.is_mixture(["a.txt", "b.parquet:2"]) and sources.is_mixture("a:x") and not sources.is_mixture(
        ["a.txt", "b/*.parquet"])
    # '#COLUMN' stays on the pattern (split_column takes it off); the last '#' holds it; a column alone is a mixture
    assert sources.parse_mixture("code.parquet#content:0.7,web/*.jsonl:0.3") == [("code.parquet#content", 0.7),
                                                                                ("web/*.jsonl", 0.3)]
    assert sources.is_mixture(["a.parquet#content"]) and sources.parse_mixture("a.parquet#content") == [
        ("a.parquet#content", 1.0)]
    assert [sources.split_column(p) for p in ("a.parquet#content", "dir#2/a.jsonl#body", "a.txt")] == [
        ("a.parquet", "content"), ("dir#2/a.jsonl", "body"), ("a.txt", None)]
    for spec, found in (("a.txt:0.7,b.txt:x", "'b.txt:x' has no positive weight after its last ':'"),
                        ("a.txt:0", "'a.txt:0' has no positive weight"), ("a.txt:-1", "'a.txt:-1' has no positive"),
                        ("a.txt:nan", "'a.txt:nan' has no positive"), ("a.txt:inf", "'a.txt:inf' has no positive"),
                        ("a.txt:1_0", "'a.txt:1_0' has no positive"),
                        ("a.txt:1e308,b.txt:1e308", "its weights sum past a float's range"),
                        (":3", "':3' has no positive"), ("a.txt:1,b.txt", "weighs some sources but not all"),
                        ("a.txt:1,,b.txt:1", "has an empty source"), ("", "has an empty source"),
                        ("a.parquet#:1", "'a.parquet#:1' needs a path before its last '#' and a column after it"),
                        ("#text,b.txt", "'#text' needs a path before its last '#'")):
        _one_line_error(ValueError, rf"data mixture '{spec}'.*{found}.*expected .*PATH\[#COLUMN\]\[:WEIGHT\],"
                        r"PATH\[#COLUMN\]\[:WEIGHT\],\.\.\. \(e\.g\. code\.parquet#content:0\.7,web/\*\.jsonl:0\.3\)",
                        lambda spec=spec: sources.parse_mixture(spec))


def test_a_mixtures_shares_line_names_each_source_beside_its_weight(tmp_path):
    spec, _ = _mixture_corpus(tmp_path)
    it = iter(sources.Mixture(spec, text_data.ByteTokenizer(), 16))
    for _ in range(400):
        next(it)
    line = sources.shares_line(it.get_state())
    found = re.findall(r"(\S+) ([0-9.]+) \(weight ([0-9.]+)\)", line)
    assert line.startswith("data mixture shares of 400 windows: ") and len(found) == 3, line
    assert [p.rsplit("/", 1)[-1] for p, _, _ in found] == ["a.parquet", "*.jsonl", "small"]
    assert all(abs(float(share) - float(weight)) < 0.01 for _, share, weight in found), line


def test_windows_held_out_for_eval_are_never_trained_on(tmp_path):
    """`Mixture.from_state(..., hold_out=True)` after the eval windows: no document of theirs comes again, in the
    epoch they end in or in any later one (each source restarts after them), resumed from any state alike; a source
    the eval windows hold wholly restarts from its beginning."""
    tok = text_data.ByteTokenizer()
    (tmp_path / "small.jsonl").write_text("".join(json.dumps({"text": chr(65 + k) * (5 + 7 * k)}) + "\n"
                                                  for k in range(8)))  # documents A, B, ... of 5-54 letters
    (tmp_path / "tiny.txt").write_text("z" * 9)
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": "x" * 40}) + "\n" for _ in range(50)))
    spec = f"{tmp_path}/small.jsonl:0.3,{tmp_path}/tiny.txt:0.1,{tmp_path}/big.jsonl:0.6"
    letters = lambda rows: {chr(t) for r in rows for t in r["tokens"].tolist() if 65 <= t < 65 + 8}  # noqa: E731
    stream = iter(sources.Mixture(spec, tok, 16))
    held = [next(stream) for _ in range(12)]
    train = sources.Mixture.from_state(stream.get_state(), tok, hold_out=True)
    it = iter(train)
    rows = [next(it) for _ in range(300)]  # the small source's 216 tokens come round many times
    assert letters(held) and letters(rows) and not letters(held) & letters(rows), (letters(held), letters(rows))
    assert letters(held) | letters(rows) == set("ABCDEFGH")
    assert any(r["tokens"][0] == ord("z") for r in rows)  # the tiny source, wholly held out, is trained on again
    it = iter(train)
    for _ in range(137):
        next(it)
    resumed = iter(sources.Mixture.from_state(json.loads(json.dumps(it.get_state())), tok))
    assert all((next(resumed)["tokens"] == r["tokens"]).all() for r in rows[137:])


def check_mixture_resumes(mixture, tok, windows, taken, follow):
    """`mixture` resumed from its state (through JSON) after each of `taken` windows yields the next `follow`
    windows of an uninterrupted pass of `windows`."""
    whole = [w for _, w in zip(range(windows), mixture)]
    for n in taken:
        it = iter(mixture)
        for _ in range(n):
            next(it)
        resumed = iter(sources.Mixture.from_state(json.loads(json.dumps(it.get_state())), tok))
        for want in whole[n:n + follow]:
            got = next(resumed)
            assert (got["tokens"] == want["tokens"]).all() and (got["segment_ids"] == want["segment_ids"]).all()
    return whole


def _mixture_corpus(tmp_path):
    """Three sources of uneven documents, one letter each (so a window names its source): Parquet of two row
    groups, JSONL with long documents, and a small saved dataset that runs out many times."""
    rng = random.Random(0)
    docs = {"a": ["a" * rng.randint(1, 300) for _ in range(40)], "b": ["b" * rng.randint(1, 2000) for _ in range(30)],
            "c": ["c" * rng.randint(1, 50) for _ in range(5)]}
    _write_parquet(tmp_path / "a.parquet", _table(text=docs["a"]), row_group_size=16)
    (tmp_path / "web").mkdir()
    for k in range(2):
        (tmp_path / "web" / f"{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs["b"][k::2]))
    _save_to_disk(tmp_path / "small", _table(text=docs["c"]))
    docs["b"] = docs["b"][0::2] + docs["b"][1::2]  # the files' order
    spec = f"{tmp_path}/a.parquet:0.5,{tmp_path}/web/*.jsonl:0.3,{tmp_path}/small:0.2"
    return spec, docs


def _letter(window, tok):
    letters = {chr(t) for t in window["tokens"].tolist() if t != tok.eos_id}
    assert len(letters) == 1, letters
    return letters.pop()


def test_mixture_shares_follow_the_weights_and_sources_pack_as_pack_does(tmp_path, caplog):
    tok, seq_len, n = text_data.ByteTokenizer(), 32, 3000
    spec, docs = _mixture_corpus(tmp_path)
    with caplog.at_level(logging.INFO):
        windows = [w for _, w in zip(range(n), sources.Mixture(spec, tok, seq_len))]
    weights = dict(zip("abc", (0.5, 0.3, 0.2)))
    counts = dict.fromkeys("abc", 0)
    for i, window in enumerate(windows, 1):
        counts[_letter(window, tok)] += 1
        assert all(abs(counts[s] - weights[s] * i) <= 2 for s in counts)
    assert all(abs(counts[s] / n - weights[s]) < 0.01 for s in counts), counts
    # Each source's windows are `pack` of its documents cycled (packing runs on across epochs: no padding).
    for s in "abc":
        mine = [w for w in windows if _letter(w, tok) == s]
        tokens = sum(len(d) + 1 for d in docs[s])
        want = text_data.pack(docs[s] * -(-(len(mine) * (seq_len + 1)) // tokens), tok, seq_len)[:len(mine)]
        assert all((a["tokens"] == b["tokens"]).all() and (a["segment_ids"] == b["segment_ids"]).all()
                   for a, b in zip(mine, want))
    ran_out = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert any("small" in m for m in ran_out) and len(ran_out) == len({m.split("'")[1] for m in ran_out})


def test_mixture_resumes_with_exactly_the_next_window(tmp_path):
    tok, seq_len = text_data.ByteTokenizer(), 16
    spec, _ = _mixture_corpus(tmp_path)
    mixture = sources.Mixture(spec, tok, seq_len)
    whole = [w for _, w in zip(range(700), mixture)]
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(whole, iter(mixture)))  # each iter() starts afresh
    for taken in (0, 1, 37, 333, 650):
        it = iter(mixture)
        for _ in range(taken):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        resumed = iter(sources.Mixture.from_state(state, tok))
        for want in whole[taken:taken + 50]:
            got = next(resumed)
            assert (got["tokens"] == want["tokens"]).all() and (got["segment_ids"] == want["segment_ids"]).all()
    # By 650 windows the small source is epochs in and the Parquet source is past its first row group.
    assert state["positions"][2]["epoch"] > 1 and any(p["row"] >= 16 for p in [state["positions"][0]])

    with open(tmp_path / "web" / "1.jsonl", "a") as f:  # a shard regenerated in place: its rows are other rows
        f.write('"more"\n')
    _one_line_error(ValueError, r"data: the files of '.*web/\*.jsonl' were rewritten since the mixture's state was "
                    r"saved \(their sizes differ: .*web/0.jsonl, .*web/1.jsonl\); expected the same files to resume$",
                    lambda: sources.Mixture.from_state(state, tok))
    (tmp_path / "web" / "2.jsonl").write_text('"new"\n')
    _one_line_error(ValueError, r"data: the files of '.*web/\*.jsonl' changed since the mixture's state was saved "
                    r"\(now 3:", lambda: sources.Mixture.from_state(state, tok))


def test_a_mixture_takes_array_record_sources_as_their_ids(tmp_path):
    """A pre-tokenised source (a prepare_data.py --format=array_record directory, or a glob of its files) beside
    text sources: its shares follow the weights within 1%, its windows are `pack` of its documents cycled (the
    records' ids as they are), and a state taken mid-stream resumes with exactly the next windows, through
    set_state and from_state, across the records source's epochs."""
    pytest.importorskip("array_record")
    tok, seq_len, n = text_data.ByteTokenizer(), 32, 2000
    spec, docs = _mixture_corpus(tmp_path)
    rng = random.Random(1)
    docs["d"] = ["d" * rng.randint(1, 400) for _ in range(25)]
    text_data.write_tokens(docs["d"], tok, str(tmp_path / "tok"), format="array_record", shard_tokens=2000)
    for records in (f"{tmp_path}/tok", f"{tmp_path}/tok/*.array_record"):
        mixture = sources.Mixture(f"{records}:0.4,{spec.split(',')[1].rsplit(':', 1)[0]}:0.6", tok, seq_len)
        assert mixture.kinds == ("records", "text") and len(mixture.files[0]) > 2
        windows = [w for _, w in zip(range(n), mixture)]
        counts = dict.fromkeys("bd", 0)
        for i, window in enumerate(windows, 1):
            counts[_letter(window, tok)] += 1
            assert abs(counts["d"] - 0.4 * i) <= 2
        assert all(abs(counts[s] / n - w) < 0.01 for s, w in (("d", 0.4), ("b", 0.6))), counts
        mine = [w for w in windows if _letter(w, tok) == "d"]
        want = text_data.pack(docs["d"] * -(-(len(mine) * (seq_len + 1)) // sum(len(d) + 1 for d in docs["d"])),
                              tok, seq_len)[:len(mine)]
        assert all((a["tokens"] == b["tokens"]).all() and (a["segment_ids"] == b["segment_ids"]).all()
                   for a, b in zip(mine, want))
    for stop in (1, 777):  # 777: the records source is in its third epoch, mid-document
        it = iter(mixture)
        for _ in range(stop):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        fresh = iter(mixture)
        fresh.set_state(state)
        for resumed in (fresh, iter(sources.Mixture.from_state(state, tok))):
            assert all((a["tokens"] == b["tokens"]).all() and (a["segment_ids"] == b["segment_ids"]).all()
                       for a, b in zip(windows[stop:stop + 300], [next(resumed) for _ in range(300)]))


def test_a_mixture_refuses_pre_tokenised_sources_it_cannot_take(tmp_path):
    """A tokens.bin directory, a source of ArrayRecord and text files at once, and records holding ids the
    tokenizer has not (another tokenizer's) are refused in one line naming the source, file or record."""
    pytest.importorskip("array_record")
    tok = text_data.ByteTokenizer()
    (tmp_path / "a.txt").write_text("some text " * 50)
    text_data.write_tokens(["x" * 100], tok, str(tmp_path / "bin"))
    _one_line_error(ValueError, r"data mixture source '.*bin' is a prepare_data.py directory of tokens.bin; expected "
                    r"text files or ArrayRecord files \(prepare_data.py --format=array_record\)",
                    lambda: sources.Mixture(f"{tmp_path}/bin:0.5,{tmp_path}/a.txt:0.5", tok, 8))
    text_data.write_tokens(["y" * 100], tok, str(tmp_path / "both"), format="array_record")
    (tmp_path / "both" / "extra.txt").write_text("text")
    _one_line_error(ValueError, r"data mixture source '.*both/\*' holds both ArrayRecord files \(.*tokens-00000"
                    r"\.array_record\) and text files \(.*extra.txt.*\); expected one kind per source",
                    lambda: sources.Mixture(f"{tmp_path}/both/*:0.5,{tmp_path}/a.txt:0.5", tok, 8))
    words = text_data.WordTokenizer(["w"] * 400)  # "w" is id 403, past the byte tokenizer's 320
    text_data.write_tokens([" ".join(["w"] * 5)], words, str(tmp_path / "words"), format="array_record")
    _one_line_error(ValueError, r"data: .*words/tokens-00000.array_record record 0 holds token id \d+; expected ids "
                    r"below the tokenizer's vocab_size=320",
                    lambda: next(iter(sources.Mixture(f"{tmp_path}/words:0.5,{tmp_path}/a.txt:0.5", tok, 8))))


def test_mixture_errors_name_the_source(tmp_path):
    tok = text_data.ByteTokenizer()
    (tmp_path / "a.txt").write_text("text")
    _write_parquet(tmp_path / "empty.parquet", _table(text=["", ""]))
    mixture = sources.Mixture(f"{tmp_path}/a.txt:0.5,{tmp_path}/empty.parquet:0.5", tok, 8)
    windows = iter(mixture)
    assert next(windows)["tokens"].tolist() == [116, 101, 120, 116, 258, 116, 101, 120, 116]  # a.txt's turn first
    _one_line_error(ValueError, r"data: '.*empty.parquet' holds no text", lambda: next(windows))
    _one_line_error(FileNotFoundError, r"data: '.*none\*.jsonl' matches no file",
                    lambda: sources.Mixture(f"{tmp_path}/a.txt:1,{tmp_path}/none*.jsonl:1", tok, 8))
    _one_line_error(ValueError, r"seq_len=1; expected an integer >= 2", lambda: sources.Mixture(
        str(tmp_path / "a.txt"), tok, 1))


def test_mixture_sources_name_their_own_text_columns(tmp_path):
    """'PATH#COLUMN' reads that source's documents from its column (Parquet), field (JSONL) or Example feature, the
    others from `text_column`; a source whose files lack its column is refused naming the file and the column."""
    tok = text_data.ByteTokenizer()
    _write_parquet(tmp_path / "code.parquet", _table(content=["c" * 40] * 8, text=["x" * 40] * 8))
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"body": "w" * 30, "text": "y"}) + "\n" for _ in range(8)))
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"text": "n" * 20}) + "\n" for _ in range(8)))
    spec = f"{tmp_path}/code.parquet#content:0.5,{tmp_path}/web.jsonl#body:0.25,{tmp_path}/notes.jsonl:0.25"
    mixture = sources.Mixture(spec, tok, 16)
    assert mixture.columns == ["content", "body", "text"]
    windows = [w for _, w in zip(range(40), mixture)]
    assert [sum(_letter(w, tok) == s for w in windows) for s in "cwn"] == [20, 10, 10]
    it = iter(mixture)
    for _ in range(13):
        next(it)
    state, want = json.loads(json.dumps(it.get_state())), next(it)
    assert (next(iter(sources.Mixture.from_state(state, tok)))["tokens"] == want["tokens"]).all()
    # --text_column=content naming the Parquet's column for every source is the same mixture, resumed alike
    same = sources.Mixture(f"{tmp_path}/code.parquet:0.5,{tmp_path}/web.jsonl#body:0.25,"
                           f"{tmp_path}/notes.jsonl#text:0.25", tok, 16, text_column="content")
    resumed = iter(same)
    resumed.set_state(state)
    assert (next(resumed)["tokens"] == want["tokens"]).all()
    missing = iter(sources.Mixture(f"{tmp_path}/code.parquet#body:1,{tmp_path}/notes.jsonl:1", tok, 16))
    _one_line_error(ValueError, r"data: .*code.parquet.*'body'", lambda: next(missing))


# Reads a corpus in a process of its own and prints the peak resident memory (sampled every 64 documents) above
# the memory before reading, which counts the imports (sources.py's own, JAX's through engine.tasks among them) in
# neither figure.
_PEAK_RSS = """
import importlib.util, resource, sys
import pyarrow.parquet
spec = importlib.util.spec_from_file_location("sources", sys.argv[1])
sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sources)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
base, peak = rss(), 0
for n, text in enumerate(sources.iter_texts(sys.argv[2]), 1):
    if n % 64 == 0:
        peak = max(peak, rss() - base)
print(peak)
"""


def _peak_rss_reading(path):
    program = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "tasks",
                           "sources.py")
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, program, str(path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout)


def _random_text_corpus(path, mib, *, arrow=False, doc_bytes=4096):
    """`mib` MiB of random lowercase documents (incompressible enough that the file is about as large) in one
    Parquet row group, or an Arrow stream of datasets' 1000-row batches."""
    import pyarrow as pa  # noqa: PLC0415

    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    n = mib * 2**20 // doc_bytes
    text = letters[np.random.default_rng(0).integers(0, len(letters), n * doc_bytes, np.uint8)].tobytes().decode()
    table = _table(text=[text[i * doc_bytes:(i + 1) * doc_bytes] for i in range(n)])
    return (_write_arrow(path, table, stream=True, max_chunksize=1000) if arrow
            else _write_parquet(path, table, row_group_size=n))


@pytest.mark.parametrize("arrow", [False, True], ids=["parquet", "arrow"])
def test_reading_streams_in_flat_memory(tmp_path, arrow):
    """Four times the corpus, not four times the memory: one 64 MiB Parquet row group (or Arrow stream) read above
    the memory a 16 MiB one takes by less than a quarter of the extra text (pre-buffered Parquet reads grow with
    the file)."""
    suffix = "arrow" if arrow else "parquet"
    small, large = (_peak_rss_reading(_random_text_corpus(tmp_path / f"{mib}.{suffix}", mib, arrow=arrow))
                    for mib in (16, 64))
    assert large - small < 12 * 2**20, (small / 2**20, large / 2**20)


@pytest.mark.slow  # CI time; the SentencePiece tokenizer itself: the tests above
def test_train_lm_takes_a_users_sentencepiece_model_and_generate_reads_the_workdir(sp_model, tmp_path):
    """A fresh model on --tokenizer=<tokenizer.model>: the vocabulary follows it, run.json and the workdir carry it,
    and generate.py decodes with it."""
    from tests.xla_flags import cpu_devices  # noqa: PLC0415
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS=cpu_devices(8), JAX_PLATFORMS="cpu")
    (tmp_path / "a.txt").write_text("\n".join(SENTENCES * 40))
    work = tmp_path / "work"
    out = subprocess.run([sys.executable, "scripts/train_lm.py", f"--tokenizer={sp_model}", f"--data={tmp_path}/a.txt",
                          f"--workdir={work}", "--max_steps=2", "--seq_len=16", "--per_device_batch_size=1",
                          "--prompts=", '--model_overrides={"hidden_size": 32, "intermediate_size": 64}'],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((work / "run.json").read_text())
    assert run["tokenizer"]["kind"] == "tokenizer.model" and run["config"]["vocab_size"] == 64
    assert (work / "tokenizer.model").read_bytes() == sp_model.read_bytes()
    gen = subprocess.run([sys.executable, "scripts/generate.py", f"--workdir={work}", "--prompts=the owls",
                          "--max_new_tokens=3"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0 and "--- 'the owls':" in gen.stdout, gen.stderr[-3000:]


if __name__ == "__main__":
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as scratch:
        for kind in ("parquet", "arrow"):
            for mib in (64, 256, 1024):
                path = _random_text_corpus(os.path.join(scratch, f"{mib}.{kind}"), mib, arrow=kind == "arrow")
                print(f"{kind:8s} {mib:5d} MiB of text ({os.path.getsize(path) / 2**20:.0f} MiB file): peak RSS "
                      f"+{_peak_rss_reading(path) / 2**20:.0f} MiB while reading", flush=True)
                os.remove(path)
