"""Data directories as Hugging Face tools and notebooks leave them (engine.tasks.files.expand_files through
engine.tasks.sources): a hub snapshot's or a refs/convert/parquet layout's splits, a `datasets` builder cache's
`cache-*.arrow` files and a huggingface_hub cache's several snapshots refused in one line naming what to pass;
hidden directories skipped; a file named twice refused; Parquet and Arrow files damaged after their first rows named
with the row; a nested (chat) column's error says what to do. Records (SFT, preference, seq2seq) from Parquet and
Arrow files and save_to_disk directories, their fields under other names (`record_columns`); `.ndjson` files, and a
`.json` file named as such, of JSON Lines or one JSON array (Alpaca's `alpaca_data.json`)."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.tasks import seq2seq, sources, text_data
from engine.tasks.rlhf import preference
from tests.test_data_inputs import _save_to_disk, check_mixture_resumes


def _parquet(path, texts, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, **kw)
    return str(path)


def _arrow_stream(path, table):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=100)
    return str(path)


def _refused(pattern, read, kind=ValueError):
    with pytest.raises(kind, match=pattern) as caught:
        read()
    assert "\n" not in str(caught.value)


def test_a_directory_of_several_splits_is_refused_naming_one_to_pass(tmp_path):
    hub = tmp_path / "hub"  # a hub snapshot: data/<split>-0000k-of-0000n.parquet beside README.md, .gitattributes
    _parquet(hub / "data" / "train-00000-of-00002.parquet", ["a", "b"])
    _parquet(hub / "data" / "train-00001-of-00002.parquet", ["c"])
    _parquet(hub / "data" / "test-00000-of-00001.parquet", ["TEST"])
    (hub / "README.md").write_text("---\nconfigs: []\n---\n")
    _refused(rf"^data: the directory {hub} holds the splits test \(1 file\), train \(2 files\) of a dataset, which "
             rf"are separate corpora; expected one split's files, e.g. --data='{hub}/data/\*train\*'$",
             lambda: text_data.read_texts(str(hub)))
    assert text_data.read_texts(f"{hub}/data/*train*") == ["a", "b", "c"]
    converted = tmp_path / "convert"  # refs/convert/parquet: <config>/<split>/0000.parquet
    _parquet(converted / "default" / "train" / "0000.parquet", ["t"])
    _parquet(converted / "default" / "validation" / "0000.parquet", ["v"])
    _refused(rf"e.g. --data='{converted}/default/train/\*.parquet'$", lambda: text_data.read_texts(str(converted)))
    (tmp_path / "plain").mkdir()  # one split, or files that name none, are a corpus as before
    (tmp_path / "plain" / "train.jsonl").write_text('"x"\n')
    (tmp_path / "plain" / "notes.txt").write_text("y")
    assert text_data.read_texts(str(tmp_path / "plain")) == ["y", "x"]
    (tmp_path / "plain" / "dev.jsonl").write_text('"z"\n')  # a seq2seq user's train / dev files
    _refused(r"holds the splits dev \(1 file\), train \(1 file\)",
             lambda: text_data.read_texts(str(tmp_path / "plain")))


def test_caches_hidden_directories_and_files_named_twice(tmp_path):
    cache = tmp_path / "foo" / "default" / "0.0.0" / "abc"  # load_dataset's builder cache, after a .map()
    table = pa.table({"text": ["train doc"]})
    _arrow_stream(cache / "foo-train.arrow", table)
    _arrow_stream(cache / "cache-0123abcd.arrow", pa.table({"text": ["mapped"]}))
    (cache / "dataset_info.json").write_text(json.dumps({"dataset_name": "foo"}))
    _refused(rf"^data: the directory {cache} holds datasets cache files \({cache}/cache-0123abcd.arrow: outputs of "
             r"Dataset.map, not the dataset's text\); expected its split's own files, a glob of them, or a "
             r"save_to_disk directory$", lambda: text_data.read_texts(str(cache)))
    assert text_data.read_texts(f"{cache}/foo-train*.arrow") == ["train doc"]
    repo = tmp_path / "repo"  # a hub repository with a dataset_info.json at its root is not a save_to_disk directory
    _parquet(repo / "data.parquet", ["hi"])
    (repo / "dataset_info.json").write_text("{}")
    assert text_data.read_texts(str(repo)) == ["hi"]
    hub_cache = tmp_path / "datasets--org--name"  # huggingface_hub's cache: one directory per revision
    for revision in ("1111", "2222"):
        _parquet(hub_cache / "snapshots" / revision / "data.parquet", [revision])
    _refused(rf"holds 2 snapshots of a Hugging Face repository \(1111, 2222\); expected one snapshot's files, e.g. "
             rf"--data={hub_cache}/snapshots/1111$", lambda: text_data.read_texts(str(hub_cache)))

    corpus = tmp_path / "corpus"
    (corpus / ".ipynb_checkpoints").mkdir(parents=True)
    (corpus / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text('"old copy"\n')
    (corpus / "a.jsonl").write_text('"A"\n')
    assert text_data.read_texts(str(corpus)) == ["A"]
    _refused(rf"^data: {corpus}/a.jsonl is named twice \(by '{corpus}' and '{corpus}/a.jsonl'\); expected each file "
             r"once \(a mixture's weights weigh sources: PATH:WEIGHT,...\)$",
             lambda: text_data.read_texts([str(corpus), str(corpus / "a.jsonl")]))


def test_damage_after_the_first_rows_is_named_with_the_file_and_row(tmp_path):
    path = _parquet(tmp_path / "damaged.parquet", [f"document {i} " * 20 for i in range(3000)], row_group_size=2048)
    data = bytearray(open(path, "rb").read())
    meta = pq.ParquetFile(path).metadata
    second = meta.row_group(1).column(0)
    at = second.dictionary_page_offset or second.data_page_offset  # the second row group's first page header
    data[at:at + 64] = b"\xff" * 64
    open(path, "wb").write(bytes(data))
    read = []
    with pytest.raises(ValueError, match=rf"^data: {path} cannot be read after row 2048 \(") as caught:
        for text in text_data.iter_texts(path):
            read.append(text)
    assert len(read) == 2048 and "\n" not in str(caught.value)
    stream = _arrow_stream(tmp_path / "cut.arrow", pa.table({"text": [f"row {i}" for i in range(1000)]}))
    size = os.path.getsize(stream)
    os.truncate(stream, size - size // 3)
    _refused(rf"^data: {stream} cannot be read after row \d00 \(", lambda: text_data.read_texts(stream))


def test_a_nested_column_is_refused_saying_what_to_do(tmp_path):
    messages = pa.array([[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]])
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": messages}), path)
    _refused(r"'messages' is list<.*>; expected a string \(a nested value, e.g. chat messages: render it to one "
             r"string per row, e.g. with the tokenizer's chat template, into a column or key of its own\)$",
             lambda: text_data.read_texts(str(path), text_column="messages"))
    mixture = sources.Mixture(f"{path}#messages", text_data.ByteTokenizer(), 16)
    _refused(r"'messages' is list<.*chat template", lambda: next(iter(mixture)))


def test_records_are_read_from_parquet_arrow_and_saved_datasets_under_their_own_column_names(tmp_path):
    """trl's prompt-completion SFT layout (`completion`, beside an extra column), a preference table as a hub's
    Parquet and as an Arrow file, seq2seq pairs in a save_to_disk directory: the same records as JSON Lines."""
    sft = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(2500)]  # past one 1024-row batch
    table = pa.table({"id": list(range(len(sft))), "prompt": [r["prompt"] for r in sft],
                      "completion": [r["response"] for r in sft]})
    pq.write_table(table, tmp_path / "sft.parquet", row_group_size=700)
    columns = {"response": "completion"}
    assert preference.read_prompt_responses(str(tmp_path / "sft.parquet"), record_columns=columns) == sft
    with open(tmp_path / "sft.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": r["prompt"], "completion": r["response"]}) + "\n" for r in sft[:3])
    assert preference.read_prompt_responses(str(tmp_path / "sft.jsonl"), record_columns=columns) == sft[:3]

    triples = [{"prompt": "p", "chosen": "good", "rejected": "bad"}, {"prompt": "", "chosen": "a", "rejected": ""}]
    pq.write_table(pa.Table.from_pylist(triples), tmp_path / "dpo.parquet")
    _arrow_stream(tmp_path / "dpo.arrow", pa.Table.from_pylist(triples))
    for name in ("dpo.parquet", "dpo.arrow"):
        assert preference.read_preferences(str(tmp_path / name)) == triples
    pairs = [{"input": f"in {i}", "target": f"out {i}", "lang": "en"} for i in range(5)]
    _save_to_disk(tmp_path / "saved", pa.Table.from_pylist(pairs))
    assert seq2seq.read_pairs(str(tmp_path / "saved")) == [{"input": p["input"], "target": p["target"]} for p in pairs]


def test_records_in_tables_are_refused_naming_file_row_and_what_to_pass(tmp_path):
    def parquet(name, rows):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
        return str(tmp_path / name)

    path = parquet("alpaca.parquet", [{"instruction": "i", "output": "o"}])
    _refused(r"alpaca.parquet has no column 'prompt'; its columns: instruction, output; --record_columns=FIELD:NAME,"
             r"\.\.\. reads fields from keys or columns of other names$",
             lambda: preference.read_prompt_responses(path))
    assert preference.read_prompt_responses(path, record_columns={"prompt": "instruction", "response": "output"}) \
        == [{"prompt": "i", "response": "o"}]
    path = parquet("empty.parquet", [{"prompt": "p", "response": "r"}, {"prompt": " ", "response": ""}])
    _refused(r"data: .*empty.parquet row 1: 'prompt' and 'response' are both empty",
             lambda: preference.read_prompt_responses(path))
    path = parquet("null.parquet", [{"prompt": "p", "response": "r"}, {"prompt": "p", "response": None}])
    _refused(r"null.parquet row 1: 'response' is null; expected a string$",
             lambda: preference.read_prompt_responses(path))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = parquet("chat.parquet", [{"prompt": "hi", "chosen": chat, "rejected": chat}])
    _refused(r"chat.parquet row 0: 'chosen' is list<.*>; expected a string \(a nested value, e.g. chat messages: "
             r"render it", lambda: preference.read_preferences(path))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "hi", "chosen": chat, "rejected": "no"}) + "\n")
    _refused(r"chat.jsonl:1 is not an object with string fields 'prompt', 'chosen' and 'rejected' \('chosen' is an "
             r"array\) \(a nested value, e.g. chat messages", lambda: preference.read_preferences(
                 str(tmp_path / "chat.jsonl")))
    (tmp_path / "x.jsonl").write_text(json.dumps({"prompt": "p"}) + "\n")
    _refused(r"x.jsonl:1 is not an object with string fields 'prompt' and 'response' \('response' is missing\); "
             r"--record_columns=FIELD", lambda: preference.read_prompt_responses(str(tmp_path / "x.jsonl")))
    _refused(r"^record_columns names 'reply', which is not a field of these records; expected some of 'prompt' and "
             r"'response'$", lambda: preference.read_prompt_responses(path, record_columns={"reply": "output"}))
    _refused(r"^record_columns reads two fields from 'text'; expected a key or column per field$",
             lambda: preference.read_prompt_responses(path, record_columns={"prompt": "text", "response": "text"}))
    (tmp_path / "notes.txt").write_text("a")
    _refused(r"notes.txt' is none of .jsonl / .ndjson / .parquet / .arrow \(or .jsonl / .ndjson / .json compressed: "
             r".*\); expected "
             r"records with the string fields 'input' and 'target'$",
             lambda: seq2seq.read_pairs(str(tmp_path / "notes.txt")))


def test_ndjson_files_and_a_named_json_file_of_lines_or_one_array_are_read(tmp_path):
    docs = [f"document {i} " + "word " * (i % 7) for i in range(80)]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "d.ndjson").write_text(lines)
    (tmp_path / "lines.json").write_text(lines)  # datasets' Dataset.to_json writes JSON Lines
    (tmp_path / "array.json").write_text("\ufeff\n  " + json.dumps([{"text": d} for d in docs], indent=2))
    for name in ("d.ndjson", "lines.json", "array.json"):
        assert text_data.read_texts(str(tmp_path / name)) == docs
    (tmp_path / "dir").mkdir()  # a directory takes .ndjson files, not its .json configs
    (tmp_path / "dir" / "d.ndjson").write_text(lines)
    (tmp_path / "dir" / "config.json").write_text('{"vocab_size": 10}')
    assert text_data.read_texts(str(tmp_path / "dir")) == docs

    alpaca = [{"instruction": f"question {i}", "input": "", "output": f"answer {i}"} for i in range(3)]
    (tmp_path / "alpaca_data.json").write_text(json.dumps(alpaca, indent=4))
    assert preference.read_prompt_responses(str(tmp_path / "alpaca_data.json"), record_columns={
        "prompt": "instruction", "response": "output"}) == [{"prompt": r["instruction"], "response": r["output"]}
                                                            for r in alpaca]
    (tmp_path / "mixed.json").write_text(json.dumps([{"text": "a"}, 3]))
    _refused(r"^data: .*mixed.json item 1 is a number; expected a string or \{\"text\": \"...\"\}$",
             lambda: text_data.read_texts(str(tmp_path / "mixed.json")))
    (tmp_path / "cut.json").write_text('[{"text": "a"},\n {"text": ')
    _refused(r"^data: .*cut.json is not JSON \(Expecting value at line 2 column 11\); expected JSON Lines or one "
             r"JSON array$", lambda: text_data.read_texts(str(tmp_path / "cut.json")))

    tok = text_data.ByteTokenizer()  # a mixture of an array and a JSON Lines source resumes exactly
    mixture = sources.Mixture(f"{tmp_path / 'array.json'}:0.5,{tmp_path / 'd.ndjson'}:0.5", tok, 16)
    check_mixture_resumes(mixture, tok, 320, (1, 37, 290), 20)  # both sources an epoch in by then
