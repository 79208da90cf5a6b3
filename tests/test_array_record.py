"""ArrayRecord files of pre-tokenised documents (engine.tasks.array_records): written by
`write_tokens(format='array_record')` and read back as exactly the token directory's windows, MaxText's
tf.train.Example records read beside int32 ones, a fit resumed exactly, flat memory, one-line errors, and
prepare_data.py -> train_lm.py end to end.

`python -m tests.test_array_record` prints the peak memory of reading ArrayRecord corpora of growing size (the
figure in scripts/README.md#data-formats)."""
import logging
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from engine.tasks import array_records, text_data

pytest.importorskip("array_record")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = text_data.ByteTokenizer()


def _docs(n=60, seed=0):
    """Documents of 1 to 40 words: windows of 16 tokens cross many of them, and some lie inside one."""
    rng = np.random.default_rng(seed)
    words = ["owl", "bee", "ant", "a", "the", "quick", "fox", "jumps", "over"]
    return [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(n)]


def _writer(path):
    from array_record.python import array_record_module  # noqa: PLC0415

    return array_record_module.ArrayRecordWriter(str(path), "group_size:1")


def _write_records(path, records):
    writer = _writer(path)
    for record in records:
        writer.write(record)
    writer.close()
    return str(path)


def example_class():
    """tf.train.Example built from its schema (tensorflow/core/example/{feature,example}.proto: Example.features 1;
    Features.feature 1, map<string, Feature>; Feature's oneof bytes_list 1, float_list 2, int64_list 3; each list's
    value 1) by protobuf's descriptor API: a real protobuf serializer, no TensorFlow."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # noqa: PLC0415

    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="redline_test_example.proto", package="tensorflow",
                                              syntax="proto3")

    def message(name, *fields):
        m = file.message_type.add(name=name)
        if name == "Feature":
            m.oneof_decl.add(name="kind")
        for field_name, number, kind, label, type_name in fields:
            f = m.field.add(name=field_name, number=number, type=kind, label=label, type_name=type_name)
            if name == "Feature":
                f.oneof_index = 0
        return m

    rep, opt = field.LABEL_REPEATED, field.LABEL_OPTIONAL
    message("BytesList", ("value", 1, field.TYPE_BYTES, rep, None))
    message("FloatList", ("value", 1, field.TYPE_FLOAT, rep, None))
    message("Int64List", ("value", 1, field.TYPE_INT64, rep, None))
    message("Feature", ("bytes_list", 1, field.TYPE_MESSAGE, opt, ".tensorflow.BytesList"),
            ("float_list", 2, field.TYPE_MESSAGE, opt, ".tensorflow.FloatList"),
            ("int64_list", 3, field.TYPE_MESSAGE, opt, ".tensorflow.Int64List"))
    features = message("Features", ("feature", 1, field.TYPE_MESSAGE, rep, ".tensorflow.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=field.TYPE_MESSAGE, label=opt, type_name=".tensorflow.Feature")
    message("Example", ("features", 1, field.TYPE_MESSAGE, opt, ".tensorflow.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def _example(ids, name="text", **others):
    example = example_class()()
    example.features.feature[name].int64_list.value.extend(int(i) for i in ids)
    for key, value in others.items():
        example.features.feature[key].bytes_list.value.append(value)
    return example.SerializeToString()


def _assert_same_windows(a, b):
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        for key in ("tokens", "segment_ids"):
            np.testing.assert_array_equal(a[i][key], b[i][key])
            assert b[i][key].dtype == np.int32


def test_array_records_read_back_as_the_token_directorys_windows(tmp_path):
    """write_tokens(format='array_record') (here a few files) read by ArrayRecordWindows gives the tokens.bin
    directory's windows, token for token and segment for segment, across its files; a glob of the files the same; slices and
    pickles (what a data worker receives: the index, not the tokens) too."""
    docs = _docs()
    text_data.write_tokens(docs, TOKENIZER, str(tmp_path / "bin"))
    meta = text_data.write_tokens(docs, TOKENIZER, str(tmp_path / "ar"), format="array_record", shard_tokens=1500)
    assert meta["format"] == "array_record" and len(meta["files"]) > 2 and meta["num_documents"] == 60
    assert sorted(os.listdir(tmp_path / "ar")) == sorted(
        meta["files"] + [f + array_records.INDEX_SUFFIX for f in meta["files"]] + ["meta.json"])
    for seq_len in (5, 16):
        reference = text_data.TokenWindows(str(tmp_path / "bin"), seq_len)
        windows = text_data.token_windows(str(tmp_path / "ar"), seq_len)
        assert isinstance(windows, array_records.ArrayRecordWindows) and windows.directory == str(tmp_path / "ar")
        _assert_same_windows(reference, windows)
        _assert_same_windows(reference, text_data.token_windows([f"{tmp_path}/ar/*.array_record"], seq_len))
        _assert_same_windows(reference[3:-2], windows[3:-2])
        sent = pickle.dumps(windows[3:])
        assert len(sent) < 4000
        _assert_same_windows(reference[3:], pickle.loads(sent))
    assert (windows.meta["num_tokens"], windows.meta["max_id"]) == (meta["num_tokens"], 258)
    from engine import data  # noqa: PLC0415

    assert data.is_random_access(windows)
    assert text_data.is_token_data([str(tmp_path / "ar")]) and text_data.is_token_data([f"{tmp_path}/ar/x.array_record"])
    assert not text_data.is_token_data([f"{tmp_path}/a.jsonl"])


def test_the_written_index_is_loaded_and_a_stale_one_rebuilt(tmp_path, monkeypatch, caplog):
    """Files written by write_tokens open from their indexes without reading a record; a file rewritten since its
    index (other documents), or an index that is not one, is detected in one warning line, read, and its index
    rewritten, so the next open reads nothing again. The windows are the scanned files' in every case."""
    docs = _docs()
    text_data.write_tokens(docs, TOKENIZER, str(tmp_path / "ar"), format="array_record", shard_tokens=1500)
    monkeypatch.setattr(array_records, "INDEX_SUFFIX", ".none")
    reference = array_records.ArrayRecordWindows(str(tmp_path / "ar"), 16)  # scanned: no index under that name
    monkeypatch.undo()
    scan = array_records._scan_file

    def no_scan(path, feature):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(array_records, "_scan_file", no_scan)
    indexed = array_records.ArrayRecordWindows(str(tmp_path / "ar"), 16)
    _assert_same_windows(reference, indexed)
    assert indexed.meta == reference.meta

    first, second = sorted(str(p) for p in (tmp_path / "ar").glob("*.array_record"))[:2]
    ids = [TOKENIZER.encode(doc) + [TOKENIZER.eos_id] for doc in _docs(7, seed=5)]
    os.remove(first)
    _write_records(first, [np.asarray(x, "<i4").tobytes() for x in ids])  # other documents, the old index beside
    with open(second + array_records.INDEX_SUFFIX, "wb") as f:
        f.write(b"not an index")
    monkeypatch.setattr(array_records, "_scan_file", scan)
    with caplog.at_level(logging.WARNING):
        rebuilt = array_records.ArrayRecordWindows(str(tmp_path / "ar"), 16)
    stale = [r.getMessage() for r in caplog.records if "is stale" in r.getMessage()]
    assert len(stale) == 2 and "changed since it was written" in stale[0] and "unreadable" in stale[1], stale
    monkeypatch.setattr(array_records, "INDEX_SUFFIX", ".none")
    _assert_same_windows(array_records.ArrayRecordWindows(str(tmp_path / "ar"), 16), rebuilt)
    monkeypatch.undo()
    monkeypatch.setattr(array_records, "_scan_file", no_scan)
    _assert_same_windows(rebuilt, array_records.ArrayRecordWindows(str(tmp_path / "ar"), 16))


def test_a_file_without_an_index_is_read_once(tmp_path, monkeypatch):
    """A third party's file (no index beside it) is read whole at its first open and indexed beside it; where that
    cannot be written, into the user's cache, which the next open finds: no later open reads a record, and every
    open gives the same windows."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids = [TOKENIZER.encode(doc) + [TOKENIZER.eos_id] for doc in _docs(30)]
    records = [np.asarray(x, "<i4").tobytes() for x in ids]
    own, shared = (_write_records(tmp_path / f"{name}.array_record", records) for name in ("own", "shared"))
    scan, write = array_records._scan_file, array_records.write_index
    scanned = []
    monkeypatch.setattr(array_records, "_scan_file", lambda path, feature: scanned.append(path) or scan(path, feature))

    def beside_refused(path, *args, index=None, **kwargs):  # a directory this process cannot write
        if path == shared and index == shared + array_records.INDEX_SUFFIX:
            raise PermissionError(13, "Permission denied", index)
        return write(path, *args, index=index, **kwargs)

    monkeypatch.setattr(array_records, "write_index", beside_refused)
    first = [array_records.ArrayRecordWindows(path, 16) for path in (own, shared)]
    assert scanned == [own, shared] and os.path.isfile(own + array_records.INDEX_SUFFIX)
    assert not os.path.exists(shared + array_records.INDEX_SUFFIX)
    cached = os.listdir(array_records.index_cache_dir())
    assert len(cached) == 1 and cached[0].endswith("-shared.array_record" + array_records.INDEX_SUFFIX)
    again = [array_records.ArrayRecordWindows(path, 16) for path in (own, shared)]
    assert scanned == [own, shared]  # both opened from their indexes
    for a, b in zip(first, again):
        _assert_same_windows(a, b)
    _assert_same_windows(first[0], first[1])


def test_maxtext_tf_examples_read_as_the_same_windows(tmp_path):
    """Records that are tf.train.Examples with an int64 feature (MaxText's pre-tokenised ArrayRecord) read as the
    int32 records of the same ids do, whatever other features they carry; a record's end ends a document."""
    ids = [TOKENIZER.encode(doc) + [TOKENIZER.eos_id] for doc in _docs(30)]
    _write_records(tmp_path / "int32.array_record", [np.asarray(x, "<i4").tobytes() for x in ids])
    _write_records(tmp_path / "examples.array_record", [_example(x, "input_ids", url=b"x") for x in ids])
    reference = array_records.ArrayRecordWindows(str(tmp_path / "int32.array_record"), 16)
    _assert_same_windows(reference, array_records.ArrayRecordWindows(str(tmp_path / "examples.array_record"), 16,
                                                                     feature="input_ids"))
    no_eos = [x[:-1] for x in ids]  # MaxText's records need not end with EOS: segments still split at each record
    _write_records(tmp_path / "plain.array_record", [_example(x) for x in no_eos])
    rows = array_records.ArrayRecordWindows(str(tmp_path / "plain.array_record"), 16)
    flat, ends = np.concatenate(no_eos), np.cumsum([len(x) for x in no_eos])
    for i in (0, 7, len(rows) - 1):
        np.testing.assert_array_equal(rows[i]["tokens"], flat[16 * i:16 * i + 17])
        positions = np.arange(16 * i, 16 * i + 17)
        segments = np.searchsorted(ends, positions, side="right")
        np.testing.assert_array_equal(rows[i]["segment_ids"], segments - segments[0] + 1)


def _one_line_error(kind, pattern, read):
    with pytest.raises(kind, match=pattern) as caught:
        read()
    assert "\n" not in str(caught.value)


def test_bad_array_records_are_refused_in_one_line(tmp_path):
    ok = np.arange(1, 9, dtype="<i4").tobytes()
    (tmp_path / "text.array_record").write_text("not an array record\n" * 50)
    _one_line_error(ValueError, r"data: .*text.array_record is not an ArrayRecord file",
                    lambda: array_records.ArrayRecordWindows(str(tmp_path / "text.array_record"), 4))
    odd = _write_records(tmp_path / "odd.array_record", [ok, ok, ok[:6]])
    _one_line_error(ValueError, r"data: .*odd.array_record record 2 holds 6 bytes; expected token ids as little-endian "
                                r"int32 \(a multiple of 4 bytes\) or a serialized tf.train.Example",
                    lambda: array_records.ArrayRecordWindows(odd, 4))
    negative = _write_records(tmp_path / "negative.array_record", [ok, np.asarray([5, -3], "<i4").tobytes()])
    _one_line_error(ValueError, r"negative.array_record record 1 holds token id -3; expected ids in \[0, 2\*\*31\)",
                    lambda: array_records.ArrayRecordWindows(negative, 4))
    empty = _write_records(tmp_path / "empty.array_record", [])
    _one_line_error(ValueError, r"data: .*empty.array_record holds no records",
                    lambda: array_records.ArrayRecordWindows(empty, 4))
    blank = _write_records(tmp_path / "blank.array_record", [b"", b""])
    _one_line_error(ValueError, r"data: .*blank.array_record holds 0 tokens; expected at least 2",
                    lambda: array_records.ArrayRecordWindows(blank, 4))
    _one_line_error(FileNotFoundError, r"data: '.*none\*.array_record' matches no file",
                    lambda: array_records.ArrayRecordWindows(f"{tmp_path}/none*.array_record", 4))
    named = _write_records(tmp_path / "named.array_record", [_example([1, 2, 3], "input_ids", url=b"u")])
    _one_line_error(ValueError, r"named.array_record record 0 is a tf.train.Example without an int64 feature 'text' "
                                r"\(its features: 'input_ids' \(int64\), 'url' \(bytes\)\); expected the token ids",
                    lambda: array_records.ArrayRecordWindows(named, 4))
    mixed = _write_records(tmp_path / "mixed.array_record", [_example([1, 2, 3]), ok])
    _one_line_error(ValueError, r"mixed.array_record record 1 is not a serialized tf.train.Example, as the file's "
                                r"first record is",
                    lambda: array_records.ArrayRecordWindows(mixed, 4))
    _one_line_error(ValueError, r"seq_len=1; expected an integer >= 2",
                    lambda: array_records.ArrayRecordWindows(str(tmp_path / "odd.array_record"), 1))
    # Vocabulary: a prepare_data directory names its tokenizer; bare files are checked by their largest id.
    text_data.write_tokens(_docs(5), TOKENIZER, str(tmp_path / "ar"), format="array_record")
    windows = text_data.token_windows(str(tmp_path / "ar"), 4)
    text_data.check_token_windows(windows, TOKENIZER, 320)
    _one_line_error(ValueError, r"tokenised with a byte tokenizer that is not this model's \(WordTokenizer\)",
                    lambda: text_data.check_token_windows(windows, text_data.WordTokenizer(["a"]), 320))
    _one_line_error(ValueError, r"holds token id 258; expected ids below the model's vocab_size=256",
                    lambda: text_data.check_token_windows(windows, TOKENIZER, 256))
    bare = text_data.token_windows([f"{tmp_path}/ar/*.array_record"], 4)
    text_data.check_token_windows(bare, text_data.WordTokenizer(["a"]), 320)  # no tokenizer recorded: ids only
    _one_line_error(ValueError, r"tokens-00000.array_record hold token id 258; expected ids below the model's "
                                r"vocab_size=256", lambda: text_data.check_token_windows(bare, TOKENIZER, 256))
    _one_line_error(ValueError, r"holds array_record files, not tokens.bin; read it with ArrayRecordWindows",
                    lambda: text_data.TokenWindows(str(tmp_path / "ar"), 4))
    _one_line_error(ValueError, r"format='parquet'; expected 'bin' \(tokens.bin\) or 'array_record'",
                    lambda: text_data.write_tokens(["a"], TOKENIZER, str(tmp_path / "x"), format="parquet"))


@pytest.mark.slow  # three fits' compiles: about 20 s on a loaded 2-core machine
def test_a_fit_on_array_records_resumes_exactly_and_reads_no_trained_window_again(tmp_path, monkeypatch):
    """A fit stopped after 3 steps and resumed from its workdir ends bit for bit where the uninterrupted fit ends
    (2 epochs of 5 batches of 4 windows: the resume crosses an epoch), and the resumed run reads the windows
    the uninterrupted one read after its third batch, in the same order: none of the 12 trained ones again."""
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import engine  # noqa: PLC0415
    from tests import trainer_task as task  # noqa: PLC0415

    def collate(rows):
        tokens = np.stack([row["tokens"] for row in rows]) % task.VOCAB
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def trainer(**kwargs):
        return engine.Trainer(mesh=engine.make_mesh(data=4, model=2), collate_fn=collate, loss_fn=task.loss_fn,
                              params=task.init_params(), optimizer=optax.adam(1e-2), **kwargs)

    read = []
    get = array_records.ArrayRecordWindows.__getitem__
    monkeypatch.setattr(array_records.ArrayRecordWindows, "__getitem__",
                        lambda self, i: get(self, i) if isinstance(i, slice) else read.append(i) or get(self, i))
    text_data.write_tokens(_docs(40), TOKENIZER, str(tmp_path / "ar"), format="array_record", shard_tokens=300)
    windows = text_data.token_windows(str(tmp_path / "ar"), task.SEQ)[:20]  # 5 global batches of 4 an epoch
    whole = trainer()
    whole.fit(windows, per_device_batch_size=1, n_epochs=2)
    read_whole = read[:]
    first = trainer(workdir=str(tmp_path / "work"))
    first.fit(windows, per_device_batch_size=1, n_epochs=2, max_steps=3)
    first.close()
    rerun = trainer(workdir=str(tmp_path / "work"))
    assert rerun.step == 3
    read.clear()
    rerun.fit(windows, per_device_batch_size=1, n_epochs=2)
    assert whole.step == rerun.step == 10 and len(read) >= 7 * 4 and read == read_whole[3 * 4:3 * 4 + len(read)]
    for a, b in zip(jax.tree.leaves(jax.device_get(rerun.params)), jax.tree.leaves(jax.device_get(whole.params))):
        np.testing.assert_array_equal(a, b)  # bit for bit
    rerun.close()


# Opens an ArrayRecord corpus in a process of its own, reads every window in a random order (a global shuffle's
# access pattern) and prints the peak resident memory (sampled every 64 windows) above the memory before opening.
_PEAK_RSS = """
import resource, sys
import numpy as np
from engine.tasks import array_records
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
base = rss()
windows = array_records.ArrayRecordWindows(sys.argv[1], 1024)
peak = rss() - base
for n, i in enumerate(np.random.default_rng(0).permutation(len(windows)), 1):
    windows[int(i)]
    if n % 64 == 0:
        peak = max(peak, rss() - base)
print(peak)
"""


def _peak_rss_reading(path):
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path)], capture_output=True, text=True, timeout=1200,
                         cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout)


def _random_token_corpus(path, mib, seed=0):
    """`mib` MiB of int32 token ids (random, below 50,000) in documents of 1 to 8,191 tokens."""
    rng, writer, left = np.random.default_rng(seed), _writer(path), mib * 2**20 // 4
    while left > 0:
        n = min(left, int(rng.integers(1, 8192)))
        writer.write(rng.integers(0, 50_000, n, dtype=np.int32).astype("<i4").tobytes())
        left -= n
    writer.close()
    return path


def test_reading_array_records_in_flat_memory(tmp_path):
    """Four times the tokens, not four times the memory: every window of a 32 MiB corpus read in a random order
    takes less than a quarter of the extra tokens above what an 8 MiB one takes (the index: 8 bytes a document)."""
    small, large = (_peak_rss_reading(_random_token_corpus(tmp_path / f"{mib}.array_record", mib)) for mib in (8, 32))
    assert large - small < 6 * 2**20, (small / 2**20, large / 2**20)


@pytest.mark.slow  # two train_lm runs and a refused one: about a minute on a 2-core machine
def test_prepare_data_array_records_then_train_lm_trains_and_resumes(tmp_path):
    from tests.xla_flags import cpu_devices  # noqa: PLC0415

    env = dict(os.environ, XLA_FLAGS=cpu_devices(8), JAX_PLATFORMS="cpu")

    def run(script, *args, ok=True):
        out = subprocess.run([sys.executable, f"scripts/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert (out.returncode == 0) == ok, out.stderr[-3000:]
        return out

    (tmp_path / "a.jsonl").write_text("\n".join(f'"{doc}"' for doc in _docs(400)))
    out = run("prepare_data.py", f"--data={tmp_path}/a.jsonl", f"--out={tmp_path / 'records'}",
              "--format=array_record")
    assert re.search(r"^400 documents -> \d+ tokens \(1 ArrayRecord file of int32, largest id 258\) in ", out.stdout,
                     re.M), out.stdout
    args = [f"--workdir={tmp_path / 'work'}", "--seq_len=32", "--per_device_batch_size=1", "--prompts=",
            '--model_overrides={"hidden_size": 32, "intermediate_size": 64, "num_layers": 2}', "--log_every=2"]
    first = run("train_lm.py", f"--data={tmp_path / 'records'}", "--max_steps=4", *args)
    assert "eval loss after training" in first.stdout
    again = run("train_lm.py", f"--data={tmp_path}/records/*.array_record", "--max_steps=6", *args)
    assert "resumed from" in again.stdout and "at step 6" in again.stdout
    bad = tmp_path / "bad.array_record"
    bad.write_text("not a record file")
    failed = run("train_lm.py", f"--data={bad}", "--max_steps=1", *args, ok=False)
    assert failed.returncode == 2 and "is not an ArrayRecord file" in failed.stderr.splitlines()[-1], failed.stderr


def _open_times(directory, mib, longest, repeats=3):
    """(best seconds opening `directory` with its indexes, best seconds reading every record instead, documents):
    `mib` MiB of random int32 ids in documents of 1 to `longest` - 1 tokens, written by RecordWriter."""
    import time  # noqa: PLC0415

    os.makedirs(directory)
    rng, writer, left = np.random.default_rng(0), array_records.RecordWriter(directory), mib * 2**20 // 4
    while left > 0:
        n = min(left, int(rng.integers(1, longest)))
        writer.write(rng.integers(0, 50_000, n, dtype=np.int32))
        left -= n
    writer.close()
    times, indexed = {}, array_records.INDEX_SUFFIX
    for suffix in (indexed, ".absent") * repeats:
        array_records.INDEX_SUFFIX = suffix
        start = time.perf_counter()
        windows = array_records.ArrayRecordWindows(directory, 2048)
        times[suffix] = min(times.get(suffix, float("inf")), time.perf_counter() - start)
    array_records.INDEX_SUFFIX = indexed
    return times[indexed], times[".absent"], windows.meta["num_documents"]


if __name__ == "__main__":
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as scratch:
        if sys.argv[1:] == ["open_time"]:
            for longest in (8192, 1024):
                directory = os.path.join(scratch, str(longest))
                with_index, scanned, documents = _open_times(directory, 300, longest)
                size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
                print(f"300 MiB of int32 tokens in {documents} documents of 1 to {longest - 1} tokens "
                      f"({size / 1e6:.0f} MB of files): opened in {with_index:.3f} s with the indexes, "
                      f"{scanned:.2f} s reading every record", flush=True)
            sys.exit()
        for mib in (64, 256, 1024):
            path = _random_token_corpus(os.path.join(scratch, f"{mib}.array_record"), mib)
            print(f"{mib:5d} MiB of int32 tokens ({os.path.getsize(path) / 2**20:.0f} MiB file): peak RSS "
                  f"+{_peak_rss_reading(path) / 2**20:.1f} MiB opening it and reading every window of 1024 in a "
                  "random order", flush=True)
            os.remove(path)
