"""Data directories as Hugging Face tools and notebooks leave them (engine.tasks.files.expand_files through
engine.tasks.sources): a hub snapshot's or a refs/convert/parquet layout's splits, a `datasets` builder cache's
`cache-*.arrow` files and a huggingface_hub cache's several snapshots refused in one line naming what to pass;
hidden directories skipped; a file named twice refused; Parquet and Arrow files damaged after their first rows named
with the row; a nested (chat) column's error says what to do."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.tasks import sources, text_data


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
    _refused(r"'messages' is list<.*>; expected a string \(a nested column, e.g. chat messages: render it to one "
             r"string per row, e.g. with the tokenizer's chat template, into a column of its own\)$",
             lambda: text_data.read_texts(str(path), text_column="messages"))
    mixture = sources.Mixture(f"{path}#messages", text_data.ByteTokenizer(), 16)
    _refused(r"'messages' is list<.*chat template", lambda: next(iter(mixture)))
