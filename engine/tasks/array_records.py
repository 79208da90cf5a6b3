"""ArrayRecord files of pre-tokenised documents (the random-access format Grain and MaxText read), as training
windows packed across documents, and their writer (`text_data.write_tokens(..., format='array_record')`).

A record is one document, in either of two encodings (a file's first record decides; every record must then hold
the same):
- **int32**: the document's token ids as little-endian int32 bytes (`np.asarray(ids, '<i4').tobytes()`). This is
  what scripts/prepare_data.py --format=array_record writes, each document followed by EOS as in tokens.bin.
- **tf.train.Example**: the serialized protocol buffer that MaxText's Grain pipeline reads when its data is already
  tokenised (`tokenize_train_data=False`): an int64_list feature (`feature`, MaxText's `train_data_columns`, 'text'
  by default) holds the ids. It is parsed here from the protobuf wire format by hand (under 80 lines), so reading a
  MaxText corpus needs neither TensorFlow nor generated protobuf classes.

Windows follow `text_data.TokenWindows`: the records laid end to end, window i is tokens [i·seq_len, i·seq_len +
seq_len + 1) and its segment ids number the documents within it; here a record's end ends a document (whether or not
the record ends with EOS). Opening indexes the documents' lengths (8 bytes per document are held, never the
tokens): from each file's index `<file>.index.npz` where one is beside it and still matches the file (its size,
record count and a digest of its last MiB; `RecordWriter` writes them), else by reading every record once and
writing the index, so a file is read whole once: beside the file where it can be written (an index found stale is
rewritten), else in the user's cache (`index_cache_dir()`: `$XDG_CACHE_HOME/redline/array_record_index`,
`~/.cache/...` by default, named by the file's absolute path), which the next open looks in too. A window then reads only the records it overlaps, so a corpus larger than memory
trains in flat memory (scripts/README.md#data-formats has the measurements).

This module imports `array_record` (installed with Grain: the `data` extra) only when a file is opened or written.
"""
import collections.abc
import hashlib
import json
import os

import numpy as np
from absl import logging

from engine.tasks.files import expand_files

SUFFIX = ".array_record"
_SCAN_RECORDS = 64  # records decoded at a time while indexing
_READ_OPTIONS = "readahead_buffer_size:0"  # random access: no read-ahead buffers (array_record's advice for Grain)
_WRITE_OPTIONS = "group_size:1"  # one record per chunk: a random read decompresses only its own document
INDEX_SUFFIX = ".index.npz"  # beside each file: its documents' lengths, and what identifies the file they index
_INDEX_VERSION = 1
_TAIL_BYTES = 1 << 20  # the digested end of a file: ArrayRecord's footer there holds every chunk's offset


class _Malformed(Exception):
    """Bytes that are not the protobuf wire format of a tf.train.Example."""


def _varint(buf, pos, end):
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, pos, end):
    """(field number, wire type, value) of a message's bytes [pos, end): an int for a varint, (start, stop) of a
    length-delimited field's bytes, None for fixed-width ones. Groups, field 0 or an overrun are _Malformed."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            if pos + size > end:
                raise _Malformed
            yield number, wire, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise _Malformed
            yield number, wire, None
        else:
            raise _Malformed


def _example_features(buf):
    """{name: ('int64', [varints and (start, stop) packed spans]) or (kind, None)} of a serialized tf.train.Example
    (Example.features = 1; Features.feature = 1: map<string, Feature>; Feature: bytes_list 1, float_list 2,
    int64_list 3; Int64List.value = 1, packed or not). _Malformed unless the bytes are exactly that structure."""
    features = {}
    for number, wire, span in _fields(buf, 0, len(buf)):
        if (number, wire) != (1, 2):
            raise _Malformed
        for number, wire, entry in _fields(buf, *span):
            if (number, wire) != (1, 2):
                raise _Malformed
            name, feature = b"", None
            for number, wire, part in _fields(buf, *entry):
                if wire != 2 or number not in (1, 2):
                    raise _Malformed
                name, feature = (bytes(buf[part[0]:part[1]]), feature) if number == 1 else (name, part)
            kind, values = None, None
            for number, wire, part in _fields(buf, *feature) if feature else ():
                if wire != 2 or number not in (1, 2, 3):
                    raise _Malformed
                kind = ("bytes", "float", "int64")[number - 1]
                if kind == "int64":
                    values = [value for n, w, value in _fields(buf, *part) if n == 1 and w in (0, 2)]
            features[name.decode("utf-8", "replace")] = (kind, values)
    return features


def _packed_varints(buf, start, stop):
    """The unsigned varints of buf[start:stop] as int64, decoded by numpy (a document is thousands of them)."""
    b = np.frombuffer(buf, np.uint8, stop - start, start)
    last = np.flatnonzero(b < 0x80)
    if b.size and (not last.size or last[-1] != b.size - 1):
        raise _Malformed
    first = np.concatenate([[0], last[:-1] + 1]).astype(np.int64)
    width = last - first + 1
    if width.size and width.max() > 5:  # >= 2**35, or a negative int64 (10 bytes): no token id
        return np.full(1, -1, np.int64)
    values = np.zeros(last.size, np.int64)
    for k in range(int(width.max(initial=0))):
        has = width > k
        values[has] |= (b[first[has] + k] & 0x7F).astype(np.int64) << (7 * k)
    return values


def _example_ids(record, feature, path, index):
    try:
        features = _example_features(record)
    except _Malformed:
        raise ValueError(f"data: {path} record {index} is not a serialized tf.train.Example, as the file's first "
                         "record is; expected every record in one encoding") from None
    kind, values = features.get(feature, (None, None))
    if kind != "int64":
        found = ", ".join(f"{name!r} ({k})" for name, (k, _) in sorted(features.items())) or "none"
        raise ValueError(f"data: {path} record {index} is a tf.train.Example without an int64 feature {feature!r} "
                         f"(its features: {found}); expected the token ids there (name it with feature= / "
                         "--text_column)")
    parts = [_packed_varints(record, *v) if isinstance(v, tuple) else np.array([v], np.int64) for v in values]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _is_example(record):
    try:
        return any(kind is not None for kind, _ in _example_features(record).values())
    except _Malformed:
        return False


def _int32_ids(record, path, index):
    if len(record) % 4:
        raise ValueError(f"data: {path} record {index} holds {len(record)} bytes; expected token ids as "
                         "little-endian int32 (a multiple of 4 bytes) or a serialized tf.train.Example")
    return np.frombuffer(record, "<i4")


def _checked(ids, path, index):
    """`ids` as int32; a negative id or one past int32 names the record."""
    if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ValueError(f"data: {path} record {index} holds token id {bad}; expected ids in [0, 2**31)")
    return ids.astype(np.int32, copy=False)


def _reader(path):
    from array_record.python import array_record_module  # noqa: PLC0415 (optional: installed with grain)

    reader = array_record_module.ArrayRecordReader(path, _READ_OPTIONS)
    if not reader.ok():  # array_record opens anything; a file that is not its format reads as not ok
        raise ValueError(f"data: {path} is not an ArrayRecord file (array_record cannot read it); expected files "
                         "written by array_record's ArrayRecordWriter (e.g. prepare_data.py --format=array_record)")
    return reader


def _read(reader, index):
    """One record. One at a time: array_record's multi-record reads (`read(start, stop)`, `read([i, j, ...])`) run
    in parallel and grew this process's memory with the file (+16 MiB indexing a 32 MiB file, where single reads
    stay within 3 MiB)."""
    return reader.read([index])[0]


def _scan_file(path, feature):
    """(encoding, per-record token counts, largest id) of one file, reading every record."""
    reader = _reader(path)
    try:
        n = reader.num_records()
        if n == 0:
            raise ValueError(f"data: {path} holds no records; expected one document of token ids per record")
        example = _is_example(_read(reader, 0))
        lengths, max_id = np.zeros(n, np.int64), -1
        for start in range(0, n, _SCAN_RECORDS):
            records = [_read(reader, i) for i in range(start, min(n, start + _SCAN_RECORDS))]
            if example:
                ids = [_checked(_example_ids(r, feature, path, start + i), path, start + i)
                       for i, r in enumerate(records)]
            else:
                ids = [_int32_ids(r, path, start + i) for i, r in enumerate(records)]
                low = [i for i, x in enumerate(ids) if x.size and x.min() < 0]
                if low:
                    _checked(ids[low[0]], path, start + low[0])
            lengths[start:start + len(records)] = [x.size for x in ids]
            max_id = max([max_id] + [int(x.max()) for x in ids if x.size])
        return ("example" if example else "int32"), lengths, max_id
    finally:
        reader.close()


def _identity(path):
    """What a file's index must match: its size and a digest of its last MiB (not the mtime, which a copy
    changes). The record count is checked apart, from the reader."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - _TAIL_BYTES))
        return {"size": size, "tail_sha256": hashlib.sha256(f.read()).hexdigest()}


def index_cache_dir():
    """Where the indexes of files in directories this process cannot write go: `$XDG_CACHE_HOME` (else
    `~/.cache`) / redline / array_record_index."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "redline", "array_record_index")


def _cached_index(path):
    """The cache's name for `path`'s index: a digest of its absolute path, then its file name."""
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    return os.path.join(index_cache_dir(), f"{digest}-{os.path.basename(path)}{INDEX_SUFFIX}")


def write_index(path, encoding, lengths, max_id, feature=None, index=None):
    """Writes `path`'s index (at `index`; None: beside it, `path` + INDEX_SUFFIX) for a complete, closed file:
    its documents' token counts, encoding and largest id (`feature`: the tf.train.Example feature counted), and its
    identity. Written to a temporary name and renamed, so processes that rebuild one at once never leave a torn
    file."""
    index = index or path + INDEX_SUFFIX
    lengths = np.asarray(lengths, np.int64)
    info = dict(_identity(path), version=_INDEX_VERSION, records=int(lengths.size), encoding=encoding,
                max_id=int(max_id), feature=feature if encoding == "example" else None)
    tmp = f"{index}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, lengths=lengths, info=np.array(json.dumps(info)))
    os.replace(tmp, index)


def _load_index(path, feature, index):
    """(encoding, lengths, max_id) from `path`'s index at `index`, or (None, why it does not match) when it is
    stale."""
    try:
        with np.load(index, allow_pickle=False) as f:
            info, lengths = json.loads(str(f["info"])), f["lengths"]
    except (OSError, ValueError, KeyError) as e:
        return None, f"it is unreadable ({type(e).__name__})"
    if info.get("version") != _INDEX_VERSION:
        return None, f"its version is {info.get('version')}, not {_INDEX_VERSION}"
    now = _identity(path)
    reader = _reader(path)
    try:
        now["records"] = reader.num_records()
    finally:
        reader.close()
    changed = [k for k in ("size", "records", "tail_sha256") if info.get(k) != now[k]]
    if changed:
        return None, f"the file's {'/'.join(changed)} changed since it was written"
    if info["encoding"] == "example" and info["feature"] != feature:
        return None, f"it counts the feature {info['feature']!r}, not {feature!r}"
    if lengths.shape != (info["records"],):
        return None, "its lengths do not match its record count"
    return (info["encoding"], lengths, info["max_id"]), None


def _index_file(path, feature):
    """(encoding, per-record token counts, largest id) of one file: from its index, beside it or in the cache,
    when one matches it, else read and its index written (beside it where that can be written, else in the cache;
    a stale one is replaced)."""
    beside, cached = path + INDEX_SUFFIX, _cached_index(path)
    for index in (beside, cached):
        if os.path.isfile(index):
            indexed, stale = _load_index(path, feature, index)
            if indexed is not None:
                return indexed
            logging.warning("data: the index %s is stale (%s); reading every record of %s and rewriting it", index,
                            stale, path)
    scanned = _scan_file(path, feature)
    errors = []
    for index in (beside, cached):
        try:
            os.makedirs(os.path.dirname(index), exist_ok=True)
            write_index(path, *scanned, feature=feature, index=index)
        except OSError as e:
            errors.append(f"{index}: {e}")
            continue
        logging.info("data: indexed %s (%d documents) into %s", path, len(scanned[1]), index)
        return scanned
    logging.warning("data: could not write an index of %s (%s); it will be read whole at every open", path,
                    "; ".join(errors))
    return scanned


def _written_directory(data):
    """The directory of a `write_tokens` output when `data` names one, else None."""
    return data[0] if len(data) == 1 and os.path.isfile(os.path.join(data[0], "meta.json")) else None


def record_files(data):
    """The ArrayRecord files of `data`: paths, globs, directories of them (recursively, sorted) or a directory
    written by `write_tokens(format='array_record')` (its meta.json's files, in order)."""
    import json  # noqa: PLC0415

    data = [data] if isinstance(data, str) else list(data)
    if _written_directory(data):
        with open(os.path.join(data[0], "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != "array_record":
            raise ValueError(f"data: {data[0]} holds tokens.bin, not ArrayRecord files; read it with "
                             "text_data.TokenWindows")
        return [os.path.join(data[0], name) for name in meta["files"]]
    return expand_files(data, (SUFFIX,))


class WindowSequence(collections.abc.Sequence):
    """What `text_data.TokenWindows` and `ArrayRecordWindows` share: a range of window numbers (`_range`), window
    n starting at token n·seq_len (`_window(start)`), contiguous slices as new views (`_sliced(part)`)."""

    def __len__(self):
        return len(self._range)

    def __getitem__(self, i):
        if isinstance(i, slice):
            part = self._range[i]
            if part.step != 1:
                raise ValueError(f"{type(self).__name__}[{i}]: only contiguous slices (step 1)")
            return self._sliced(part)
        return self._window(self._range[i] * self.seq_len)


class ArrayRecordWindows(WindowSequence):
    """Training rows in `pack`'s format ({'tokens', 'segment_ids'} int32 [seq_len + 1]) read from ArrayRecord files
    of pre-tokenised documents (the module's docstring has the record encodings), windows exactly as
    `text_data.TokenWindows`'. `data`: see `record_files`. `feature`: a tf.train.Example's int64 feature holding the
    ids. A Sequence (len, indexing, contiguous slices): the Trainer shuffles it globally like a list, each process
    reads only its own rows' records, and it pickles as its file list and document index (a data worker opens the
    files again). `meta`: num_tokens, num_documents, max_id, files; `directory`: the `write_tokens` directory read
    (whose meta.json names the tokenizer), else None."""

    def __init__(self, data, seq_len, *, feature="text"):
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r}; expected an integer >= 2")
        data = [data] if isinstance(data, str) else list(data)
        files = record_files(data)
        scanned = [_index_file(path, feature) for path in files]
        lengths = np.concatenate([s[1] for s in scanned])
        self._state = {
            "files": files, "feature": feature, "seq_len": seq_len, "directory": _written_directory(data),
            "encodings": [s[0] for s in scanned],
            "file_starts": np.cumsum([0] + [len(s[1]) for s in scanned]),  # global index of each file's record 0
            "doc_ends": np.cumsum(lengths),  # token offset where each document ends (exclusive)
            "meta": {"num_tokens": int(lengths.sum()), "num_documents": int(lengths.size),
                     "max_id": max(s[2] for s in scanned), "files": files}}
        if self._state["meta"]["num_tokens"] < 2:
            raise ValueError(f"data: {', '.join(files[:3])} hold{'s' if len(files) == 1 else ''} "
                             f"{self._state['meta']['num_tokens']} tokens; expected at least 2 (one window)")
        self.__setstate__(dict(self._state, range=range(max(0, (self._state["meta"]["num_tokens"] - 1) // seq_len))))
        logging.info("data: %d ArrayRecord files, %d documents, %d tokens (%s records) -> %d windows of %d",
                     len(files), self.meta["num_documents"], self.meta["num_tokens"],
                     "/".join(sorted(set(self._state["encodings"]))), len(self), seq_len)

    def __getstate__(self):  # the index, not the readers: a data worker opens the files again
        return dict(self._state, range=self._range)

    def __setstate__(self, state):
        self._state = {k: v for k, v in state.items() if k != "range"}
        self._range, self.seq_len, self.meta = state["range"], state["seq_len"], state["meta"]
        self.directory = state["directory"]
        self._readers = {}

    def _sliced(self, part):
        window = ArrayRecordWindows.__new__(ArrayRecordWindows)
        window.__setstate__(dict(self._state, range=part))
        return window

    def _window(self, start):
        stop = start + self.seq_len + 1
        doc_ends = self._state["doc_ends"]
        first, last = np.searchsorted(doc_ends, [start, stop - 1], side="right")
        ids = np.concatenate(self._documents(first, last + 1))
        offset = start - (doc_ends[first - 1] if first else 0)
        tokens = np.ascontiguousarray(ids[offset:offset + self.seq_len + 1])
        # 1 + the documents ended before each position, as TokenWindows counts EOS tokens
        segments = (np.searchsorted(doc_ends, np.arange(start, stop), side="right") - first + 1).astype(np.int32)
        return {"tokens": tokens, "segment_ids": segments}

    def _documents(self, first, stop):
        """The ids of documents [first, stop)."""
        starts, out = self._state["file_starts"], []
        file = int(np.searchsorted(starts, first, side="right")) - 1
        while first < stop:
            end = min(stop, int(starts[file + 1]))
            if file not in self._readers:
                self._readers[file] = _reader(self._state["files"][file])
            example = self._state["encodings"][file] == "example"
            out += [_record_ids(self._readers[file], index, example, self._state["feature"],
                                self._state["files"][file])
                    for index in range(first - int(starts[file]), end - int(starts[file]))]
            first, file = end, file + 1
        return out


def _record_ids(reader, index, example, feature, path):
    """Record `index`'s token ids (int32; a negative id is a ValueError naming the record)."""
    record = _read(reader, index)
    if example:
        return _checked(_example_ids(record, feature, path, index), path, index)
    return _int32_ids(record, path, index)


def iter_documents(files, *, feature="text", vocab_size=None, start=(0, 0), what=None):
    """((file index, record), ids) of every record of `files` from position `start`, in order, one record read at a
    time (a data mixture's pre-tokenised source). An id >= `vocab_size` (the tokenizer's) or a negative one is a
    ValueError naming the file and record; read from the beginning, files without a token, one naming `what`."""
    any_tokens = False
    for i in range(start[0], len(files)):
        reader = _reader(files[i])
        try:
            n = reader.num_records()
            example = n > 0 and _is_example(_read(reader, 0))
            for index in range(start[1] if i == start[0] else 0, n):
                ids = _record_ids(reader, index, example, feature, files[i])
                if ids.size and ids.min() < 0:
                    _checked(ids, files[i], index)
                if vocab_size is not None and ids.size and ids.max() >= vocab_size:
                    raise ValueError(f"data: {files[i]} record {index} holds token id {ids.max()}; expected ids "
                                     f"below the tokenizer's vocab_size={vocab_size} (the same tokenizer)")
                any_tokens = any_tokens or ids.size > 0
                yield (i, index), ids
        finally:
            reader.close()
    if not any_tokens and tuple(start) == (0, 0):
        raise ValueError(f"data: {what or ', '.join(files[:3])} holds no tokens; expected records of token ids")


class RecordWriter:
    """Writes documents' ids as int32 records into `directory`/tokens-00000.array_record, -00001, ...: a new file
    after `shard_tokens` tokens, each closed with its index (`write_index`: the lengths counted while writing, so
    opening the files reads no record). `files`: the names written, in order."""

    def __init__(self, directory, shard_tokens=1 << 28):
        from array_record.python import array_record_module  # noqa: PLC0415

        self._module, self.directory, self.shard_tokens = array_record_module, directory, shard_tokens
        self.files, self._writer, self._lengths, self._max_id, self._tokens = [], None, [], -1, 0

    def write(self, ids):
        if self._writer is None or self._tokens >= self.shard_tokens:
            self.close()
            self._tokens = 0
            self.files.append(f"tokens-{len(self.files):05d}{SUFFIX}")
            self._writer = self._module.ArrayRecordWriter(os.path.join(self.directory, self.files[-1]),
                                                          _WRITE_OPTIONS)
        ids = np.asarray(ids, "<i4")
        self._writer.write(ids.tobytes())
        self._lengths.append(ids.size)
        self._tokens += ids.size
        self._max_id = max(self._max_id, int(ids.max(initial=-1)))

    def close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            write_index(os.path.join(self.directory, self.files[-1]), "int32", self._lengths, self._max_id)
            self._lengths, self._max_id = [], -1
