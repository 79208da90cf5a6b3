"""Compressed JSON Lines and text (engine.tasks.files.open_file through engine.tasks.sources): `.jsonl` / `.json` /
`.txt` under gzip, Zstandard (several frames), bzip2 and xz read as their plain forms, by `read_texts`, the record
readers of the RLHF and seq2seq scripts, a directory and a mixture (resumed exactly); files that are not whole, or
not of their compression, refused in one line naming them; streamed in flat memory."""
import bz2
import gzip
import json
import lzma
import os
import sys

import numpy as np
import pytest

from engine.tasks import seq2seq, sources, text_data
from engine.tasks.rlhf import preference
from tests.test_data_inputs import _peak_rss_reading  # peak memory of reading a corpus, in a process of its own
from tests.test_data_inputs import check_mixture_resumes

zstandard = pytest.importorskip("zstandard")

COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            # two frames, the second starting inside a line, as zstd -T / pzstd write them
            ".zst": lambda data: b"".join(zstandard.ZstdCompressor().compress(part)
                                          for part in (data[:len(data) // 3], data[len(data) // 3:]))}


def _write(path, data):
    suffix = os.path.splitext(str(path))[1]
    path.write_bytes(COMPRESS[suffix](data) if suffix in COMPRESS else data)
    return str(path)


def _jsonl(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.mark.parametrize("compression", sorted(COMPRESS))
def test_compressed_json_lines_and_text_read_as_their_plain_forms(tmp_path, compression):
    docs = [{"text": f"document {i} " + "é" * (i % 5)} for i in range(300)] + [{"text": "last"}]
    plain = text_data.read_texts(_write(tmp_path / "plain.jsonl", _jsonl(docs)))
    assert plain == [d["text"] for d in docs]
    for name in ("c.jsonl", "dolma.json"):  # Dolma ships JSON Lines as .json.gz
        assert text_data.read_texts(_write(tmp_path / (name + compression), _jsonl(docs))) == plain
    assert text_data.read_texts(_write(tmp_path / ("t.txt" + compression), "one document\né\n".encode())) == [
        "one document\né\n"]
    assert len(text_data.read_texts(str(tmp_path))) == 3 * len(docs) + 1  # a directory takes the compressed files

    pairs = [{"prompt": "p", "response": "r", "input": "i", "target": "t", "chosen": "c", "rejected": "x"}] * 3
    path = _write(tmp_path / ("pairs.jsonl" + compression), _jsonl(pairs))
    assert preference.read_prompt_responses(path) == [{"prompt": "p", "response": "r"}] * 3
    assert preference.read_preferences(path)[0]["chosen"] == "c"
    assert seq2seq.read_pairs(path) == [{"input": "i", "target": "t"}] * 3


def test_a_mixture_of_compressed_sources_resumes_with_exactly_the_next_window(tmp_path):
    tok = text_data.ByteTokenizer()
    code = [{"content": f"def f{i}(): return {i * i}"} for i in range(40)]
    web = [f"web page {i} about " + "things " * (i % 9) for i in range(60)]
    _write(tmp_path / "code.jsonl.zst", _jsonl(code))
    _write(tmp_path / "web.json.gz", _jsonl(web))
    _write(tmp_path / "code.jsonl", _jsonl(code))
    _write(tmp_path / "web.jsonl", _jsonl(web))
    mixture = sources.Mixture(f"{tmp_path}/code.jsonl.zst#content:0.6,{tmp_path}/web.json.gz:0.4", tok, 24)
    plain = sources.Mixture(f"{tmp_path}/code.jsonl#content:0.6,{tmp_path}/web.jsonl:0.4", tok, 24)
    whole = check_mixture_resumes(mixture, tok, 300, (1, 57, 250), 30)  # both sources epochs in by then
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(whole, plain))


def _refused(pattern, path, **kw):
    with pytest.raises(ValueError, match=pattern) as caught:
        text_data.read_texts(path, **kw)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("compression", sorted(COMPRESS))
def test_compressed_files_not_whole_or_not_of_their_compression_are_refused_naming_them(tmp_path, compression):
    data = _jsonl([{"text": f"doc {i}"} for i in range(2000)])
    whole = COMPRESS[compression](data)
    (tmp_path / ("cut.jsonl" + compression)).write_bytes(whole[:len(whole) - 50])
    _refused(rf"^data: .*cut.jsonl{compression} is not a valid {compression} file \(Compressed file ended before "
             r"the end-of-stream marker was reached\)$", str(tmp_path / ("cut.jsonl" + compression)))
    (tmp_path / ("plain.jsonl" + compression)).write_bytes(data)  # named compressed, stored plain
    _refused(rf"^data: .*plain.jsonl{compression} is not a valid {compression} file \(", str(
        tmp_path / ("plain.jsonl" + compression)))
    bad = b'{"text": "ok"}\n{"text": "cut \xe2\x82"}\n'
    path, offset = _write(tmp_path / ("utf8.jsonl" + compression), bad), bad.index(b"\xe2")
    _refused(rf"utf8.jsonl{compression}: not UTF-8 at byte {offset} of its decompressed text "
             r"\(0xe2", path)
    assert text_data.read_texts(path, decode_errors="replace") == ["ok", "cut \ufffd"]
    _refused(r"data: .*bad.jsonl.* is not JSON", _write(tmp_path / ("bad.jsonl" + compression), b'"ok"\n{x\n'))


def test_zstandard_files_without_a_zstandard_reader_are_refused_naming_the_package(tmp_path, monkeypatch):
    try:
        from compression import zstd  # noqa: F401 (Python 3.14 reads .zst without the package)
        pytest.skip("this Python reads Zstandard itself")
    except ImportError:
        pass
    path = _write(tmp_path / "c.jsonl.zst", _jsonl(["a"]))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    _refused(r"^data: .*c.jsonl.zst is Zstandard-compressed; reading it needs the zstandard package \(pip install "
             r"zstandard\)$", path)


@pytest.mark.slow  # CI time (10 s); tests/test_data_inputs.py measures Parquet's and Arrow's in CI
@pytest.mark.parametrize("compression", [".zst", ".gz"])
def test_compressed_files_stream_in_flat_memory(tmp_path, compression):
    """Four times the corpus, not four times the memory: 64 MiB of compressed JSON Lines read within a few MiB of
    what 16 MiB take (a reader that decompressed a whole file, or a frame at once, would grow by about 48 MiB)."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    fast = {".zst": lambda d: zstandard.ZstdCompressor(level=1).compress(d), ".gz": lambda d: gzip.compress(d, 1)}
    peaks = []
    for mib in (16, 64):
        text = letters[np.random.default_rng(mib).integers(0, len(letters), mib * 2**20, np.uint8)].tobytes()
        data = b"".join(json.dumps(text[i:i + 4096].decode()).encode() + b"\n" for i in range(0, len(text), 4096))
        path = tmp_path / f"{mib}.jsonl{compression}"
        path.write_bytes(fast[compression](data))
        peaks.append(_peak_rss_reading(path))
    assert peaks[1] - peaks[0] < 12 * 2**20, [p / 2**20 for p in peaks]


def _read_rates(mib=64):
    """(format, compressed MiB, seconds, text MB/s, peak MiB) of `iter_texts` over `mib` MiB of word-like JSON Lines
    in each compression (fast compression levels: reading speed barely depends on them)."""
    import tempfile  # noqa: PLC0415
    import time  # noqa: PLC0415

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("etaoinshrdlucmfwypvbgkjqxz"), rng.integers(2, 9))) for _ in range(5000)]
    ranks = np.minimum(rng.zipf(1.2, mib * 2**20 // 5), len(words)) - 1
    text = " ".join(words[r] for r in ranks).encode()[:mib * 2**20].decode()
    data = b"".join(json.dumps({"text": text[i:i + 4096]}).encode() + b"\n" for i in range(0, len(text), 4096))
    fast = {"": lambda d: d, ".gz": lambda d: gzip.compress(d, 1), ".zst": zstandard.ZstdCompressor(level=3).compress,
            ".bz2": lambda d: bz2.compress(d, 1), ".xz": lambda d: lzma.compress(d, preset=1)}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for suffix, compress in fast.items():
            path = os.path.join(root, "corpus.jsonl" + suffix)
            with open(path, "wb") as f:
                f.write(compress(data))
            start = time.perf_counter()
            n = sum(len(t) for t in sources.iter_texts(path))
            seconds = time.perf_counter() - start
            rows.append((suffix or "(none)", os.path.getsize(path) / 2**20, seconds, n / seconds / 1e6,
                         _peak_rss_reading(path) / 2**20))
    return rows


if __name__ == "__main__":
    print("| compression | file MiB | read s | text MB/s | peak MiB above start |\n|---|---|---|---|---|")
    for row in _read_rates():
        print("| {} | {:.1f} | {:.2f} | {:.0f} | {:.1f} |".format(*row))
