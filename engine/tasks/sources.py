"""Documents from files as users bring them, packed into training rows, and weighted mixtures of such sources.

Formats: `.txt` (one document per file), `.jsonl` / `.ndjson` (one per line: a string or an object with a text
field; a `.json` file named as such also, or one JSON array of them, read whole), `.parquet`, Arrow IPC `.arrow`
files (file or stream format) and `datasets.save_to_disk` directories (their `data-*.arrow` stream files in
`state.json`'s order), the last three read by a named text column; JSON Lines and text also compressed
(`.jsonl.gz`, `.json.zst`, `.txt.xz`, ...: `files.COMPRESSIONS`), decompressed as they are read. Paths, globs and
directories mix freely. Parquet and Arrow are read a record batch at a time, so memory stays flat
however large the corpus (scripts/README.md#data-formats has the measurement).

Packing: documents are tokenised, each followed by EOS, and laid end to end into rows of `seq_len + 1` tokens. Every
row carries `segment_ids` (1, 2, ... per document piece, 0 on padding), which the models take as `attention_mask`:
a token attends only within its own document and positions restart at each document.

This module imports only `files` and `array_records` of ours (tokenizers are duck-typed: `encode`, `eos_id`,
`pad_id`, `vocab_size`), so `text_data` re-exports its readers and `pack` without a cycle.
"""
import contextlib
import hashlib
import json
import lzma
import math
import os

import numpy as np
from absl import logging

from engine.tasks import array_records
from engine.tasks.files import TEXT_SUFFIXES, _shown, expand_files  # noqa: F401 (named here, as they always were)
from engine.tasks.files import JSON_SUFFIXES, RECORD_SUFFIXES, compression, formats, open_file

DECODE_ERRORS = ("strict", "replace")
_BATCH_ROWS = 1024  # rows converted to Python strings at a time: a few MB of text, whatever the file's row groups
_CHUNK = 1 << 16  # bytes read at a time looking for a file's first character
_READ_BUFFER = 1 << 20  # Parquet pages read through a 1 MiB buffer rather than a whole column chunk at once
_NESTED = (" (a nested value, e.g. chat messages: render it to one string per row, e.g. with the tokenizer's chat "
           "template, into a column or key of its own)")
MIXTURE_FORM = ("PATH[#COLUMN][:WEIGHT],PATH[#COLUMN][:WEIGHT],... (e.g. code.parquet#content:0.7,"
                "web/*.jsonl:0.3)")


def _check_decode_errors(decode_errors):
    if decode_errors not in DECODE_ERRORS:
        raise ValueError(f"decode_errors={decode_errors!r}; expected one of {DECODE_ERRORS}")


def _decode(data, path, offset, decode_errors):
    """`data` (bytes at `offset` of the file `path`) as text; a ValueError naming the file and the byte offset of
    the first invalid byte unless decode_errors='replace' (which writes U+FFFD in their place)."""
    try:
        text = data.decode("utf-8", errors=decode_errors)
    except UnicodeDecodeError as e:
        where = f"byte {offset + e.start}" + (" of its decompressed text" if compression(path) else "")
        raise ValueError(f"{path}: not UTF-8 at {where} (0x{data[e.start]:02x}: {e.reason}); pass "
                         "--decode_errors=replace to replace invalid bytes") from None
    return text[1:] if offset == 0 and text.startswith("\ufeff") else text  # a byte-order mark is no text


@contextlib.contextmanager
def _reading(path):
    """`open_file(path)`, a file that is not of its compression or ends inside it a ValueError naming it while it is
    read (opening it, a missing file or a permission, fails as the OS says)."""
    with open_file(path) as f:
        try:
            yield f
        except (OSError, EOFError, lzma.LZMAError) as e:
            if not compression(path):
                raise
            raise ValueError(f"data: {path} is not a valid {compression(path)} file ({e})") from None


def _jsonl(path, decode_errors="strict", start=0):
    """(n, object, where) of a JSON Lines file (`JSONL_SUFFIXES`, compressed ones decompressed as they are read)
    from line `start` on (n the line number; `where` 'path:n' for messages), skipping blank lines (lines before
    `start` are not parsed); ValueError naming the line on bad JSON, and the byte offset on bytes that are not UTF-8
    (unless decode_errors='replace'). A plain `.json` file may also be one JSON array: its items from index `start`
    on (n the index, `where` 'path item n'), the file read whole."""
    if path.endswith(".json") and _first_character(path) == "[":
        yield from _json_array(path, decode_errors, start)
        return
    with _reading(path) as f:
        offset, parsed = 0, start > 1
        for n, raw in enumerate(f, 1):  # b"\n" never occurs inside a UTF-8 sequence: lines split before decoding
            if n < start:
                offset += len(raw)
                continue
            line = _decode(raw, path, offset, decode_errors)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                hint = ("; a JSON array or object over several lines? expected JSON Lines, one document per line"
                        if not parsed and line.lstrip()[:1] in ("[", "{") else "")
                raise ValueError(f"data: {path}:{n} is not JSON ({e.msg} column {e.colno}){hint}") from None
            parsed = True
            yield n, item, f"{path}:{n}"


def _first_character(path):
    """The first character of a file that is not white space or a byte-order mark ('' for none)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return ""
            chunk = chunk.removeprefix(b"\xef\xbb\xbf") if f.tell() == len(chunk) else chunk
            if chunk.strip():
                return chr(chunk.strip()[0])


def _json_array(path, decode_errors, start):
    """(index, item, where) of a `.json` file holding one JSON array (Alpaca's `alpaca_data.json`), from `start`."""
    with _reading(path) as f:
        text = _decode(f.read(), path, 0, decode_errors)
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"data: {path} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); expected JSON "
                         "Lines or one JSON array") from None
    for i in range(start, len(items)):
        yield i, items[i], f"{path} item {i}"


def _json_type(value):
    """The JSON name of a parsed value's type, with its article ('an array', 'null')."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")


def _jsonl_texts(path, column, decode_errors, start):
    """(line number, document) of a .jsonl file from line `start` on: a string, or an object's `column` string."""
    for n, item, where in _jsonl(path, decode_errors, start):
        if isinstance(item, dict):
            if column not in item:
                raise ValueError(f"data: {where} has no {column!r} field; expected a string or "
                                 f"{{{json.dumps(column)}: ...}}")
            item = item[column]
            if not isinstance(item, str):
                raise ValueError(f"data: {where}: {column!r} is {_json_type(item)}; expected a string")
        elif not isinstance(item, str):
            raise ValueError(f"data: {where} is {_json_type(item)}; expected a string or "
                             f"{{{json.dumps(column)}: \"...\"}}")
        yield n, item


def _is_text_type(kind):
    import pyarrow as pa  # noqa: PLC0415 (the Arrow formats only)

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _column_rows(path, schema, batches, columns, row, start, hint):
    """(row, values) of record `batches` whose first row is `row`, from row `start` on: a tuple of the strings of
    `columns` per row, converted a batch at a time. ValueError naming the file and row for a missing column (`hint`
    appended), a column of another type or a null."""
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ValueError(f"data: {path} has no column {missing[0]!r}; its columns: {', '.join(schema.names)}{hint}")
    import pyarrow as pa  # noqa: PLC0415

    batches = iter(batches)
    while True:
        try:  # a damaged page or a stream cut short fails here, row groups or batches after the last good one
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"data: {path} cannot be read after row {row} ({str(e).splitlines()[0]})") from None
        if batch is None:
            return
        if row + batch.num_rows <= start:
            row += batch.num_rows
            continue
        for column in columns:
            kind = schema.field(column).type
            if not _is_text_type(kind):
                raise ValueError(f"data: {path} row {max(row, start)}: {column!r} is {kind}; expected a string"
                                 + (_NESTED if pa.types.is_nested(kind) else ""))
        values = [batch.column(column).to_pylist() for column in columns]
        for j in range(max(0, start - row), batch.num_rows):
            strings = tuple(v[j] for v in values)
            if None in strings:
                raise ValueError(f"data: {path} row {row + j}: {columns[strings.index(None)]!r} is null; expected "
                                 "a string")
            yield row + j, strings
        row += batch.num_rows


def _parquet_rows(path, columns, start, hint):
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:  # no pre-buffering: a whole row group's column chunk would be held at once
        parquet = pq.ParquetFile(path, buffer_size=_READ_BUFFER, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"data: {path} is not a Parquet file ({str(e).splitlines()[0]})") from None
    groups, row = [], 0  # row groups wholly before `start` are skipped by their metadata, unread
    for g in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(g).num_rows
        if groups or row + rows > start:
            groups.append(g)
        else:
            row += rows
    read = list(columns) if set(columns) <= set(parquet.schema_arrow.names) else None
    batches = parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=read) if groups else []
    yield from _column_rows(path, parquet.schema_arrow, batches, columns, row, start, hint)


def _arrow_rows(path, columns, start, hint):
    """An Arrow IPC file (random-access format: 'ARROW1' magic) or stream (`datasets`' data-*.arrow). Read from an
    OSFile, not a memory map, whose touched pages would count in the process's resident memory."""
    import pyarrow as pa  # noqa: PLC0415

    with open(path, "rb") as f:
        is_file_format = f.read(6) == b"ARROW1"
    try:
        if is_file_format:
            reader = pa.ipc.open_file(pa.OSFile(path))
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            reader = batches = pa.ipc.open_stream(pa.OSFile(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"data: {path} is not an Arrow IPC file or stream ({str(e).splitlines()[0]})") from None
    yield from _column_rows(path, reader.schema, batches, columns, 0, start, hint)


def _table_rows(path, columns, start=0, hint=""):
    """(row, strings of `columns`) of a Parquet or Arrow file from row `start` on; `hint` ends a missing column's
    error."""
    return (_parquet_rows if path.endswith(".parquet") else _arrow_rows)(path, columns, start, hint)


def _file_texts(path, column, decode_errors, start=0):
    """(row, document) of one file from row `start` on; rows are line numbers in a .jsonl file (item indices in a
    .json file of one array), 0-based rows in Parquet and Arrow files, 0 for a .txt file."""
    if path.endswith(JSON_SUFFIXES):
        yield from _jsonl_texts(path, column, decode_errors, start)
    elif path.endswith(".txt" + compression(path)):
        if start == 0:
            with _reading(path) as f:
                yield 0, _decode(f.read(), path, 0, decode_errors)
    elif path.endswith((".parquet", ".arrow")):
        for row, (text,) in _table_rows(path, (column,), start):
            yield row, text
    else:
        raise ValueError(f"data: {path!r} is none of {formats(TEXT_SUFFIXES)}")


def _documents(files, column, decode_errors, what, start=(0, 0)):
    """((file index, row), document) of `files` from position `start`. Read from the beginning, a corpus without
    any text is a ValueError naming `what`."""
    any_text = False
    for i in range(start[0], len(files)):
        for row, text in _file_texts(files[i], column, decode_errors, start[1] if i == start[0] else 0):
            any_text = any_text or bool(text.strip())
            yield (i, row), text
    if not any_text and start == (0, 0):
        raise ValueError(f"data: {what} holds no text; expected documents (.txt files, .jsonl lines, or a text "
                         f"column {column!r} of Parquet / Arrow files)")


def read_texts(patterns, *, decode_errors="strict", text_column="text"):
    """Documents from files: `.txt` (one document per file), `.jsonl` (one per line: a string, or an object with a
    `text_column` string), `.parquet` and `.arrow` files and `datasets.save_to_disk` directories (their
    `text_column` column); JSON Lines and text also compressed (.gz, .zst, .bz2, .xz; `.json.gz` as JSON Lines).
    `patterns`: paths, globs or directories (their files of those kinds, mixed). Text files must be UTF-8: a
    ValueError names the file and the offset of the first invalid byte, unless decode_errors='replace'. A missing
    column (the file's columns named), a value that is not a string (file and row or line), a compressed file that
    is not whole and a corpus without any text are ValueErrors."""
    return list(iter_texts(patterns, decode_errors=decode_errors, text_column=text_column))


def iter_texts(patterns, *, decode_errors="strict", text_column="text"):
    """`read_texts`, one document at a time (a corpus larger than memory streams through `write_tokens`)."""
    _check_decode_errors(decode_errors)
    files = expand_files(patterns)
    for _, text in _documents(files, text_column, decode_errors, _shown(files)):
        yield text


def pack(docs, tokenizer, seq_len):
    """Packs documents into examples `{'tokens': [seq_len + 1], 'segment_ids': [seq_len + 1]}`; the last row is
    padded with PAD and segment id 0. Long documents are split across rows (each piece its own segment). Linear in
    the tokens: a document is tokenised once and cut into views, never re-sliced from the front."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}; expected at least 2")
    width = seq_len + 1
    return [_packed_row(pieces, width, tokenizer.pad_id)
            for pieces, _, _ in _fill_rows(((None, doc) for doc in docs), tokenizer, width)]


def _fill_rows(documents, tokenizer, width, offset=0):
    """Cuts `documents` ((key, text) pairs), each tokenised and ended by EOS, end to end into rows of `width`
    tokens (a document already tokenised, an int32 array, is taken as it is: its EOS, if any, is in it). Yields
    (pieces, key, end) per full row, `key` the document the row ends in and `end` its tokens used so
    far; then any last partial row's pieces with key and end None. `offset`: tokens of the first document already
    used (a resumed position)."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    pieces, filled = [], 0  # the open row's document pieces and their tokens
    for key, doc in documents:
        ids = doc if isinstance(doc, np.ndarray) else np.asarray(tokenizer.encode(doc) + eos, np.int32)
        start, offset = offset, 0
        while start < len(ids):
            piece = ids[start:start + width - filled]
            pieces.append(piece)
            start, filled = start + len(piece), filled + len(piece)
            if filled == width:
                yield pieces, key, start
                pieces, filled = [], 0
    if pieces:
        yield pieces, None, None


def _packed_row(pieces, width, pad_id):
    """One row of `pack`: the pieces end to end, numbered 1, 2, ...; PAD under segment id 0 after them."""
    tokens, segments = np.full(width, pad_id, np.int32), np.zeros(width, np.int32)
    at = 0
    for segment, piece in enumerate(pieces, 1):
        tokens[at:at + len(piece)], segments[at:at + len(piece)] = piece, segment
        at += len(piece)
    return {"tokens": tokens, "segment_ids": segments}


def read_records(patterns, fields, *, decode_errors="strict", nonempty=None, record_columns=None):
    """Objects with the string `fields` from files (paths, globs or directories): `.jsonl` / `.ndjson` files,
    compressed or not, one object per line (other keys dropped), a `.json` file named as such (JSON Lines or one
    array), and the rows of `.parquet` and `.arrow` files and `save_to_disk` directories (other columns unread).
    `record_columns`: {field: the key or column the files hold it under} for fields named otherwise (e.g.
    {'response': 'completion'}). ValueError naming the file and line (or row) for a record that is not such an
    object (and the type found), or whose `nonempty` fields (default: all of `fields`) are all empty or white space:
    a record with nothing to train on. Encoding as in `read_texts` (decode_errors)."""
    _check_decode_errors(decode_errors)
    names = _record_names(fields, record_columns or {})
    hint = "; --record_columns=FIELD:NAME,... reads fields from keys or columns of other names"
    records = []
    for path in expand_files(patterns, RECORD_SUFFIXES):
        if path.endswith(JSON_SUFFIXES):
            rows = _jsonl_records(path, fields, names, decode_errors, hint)
        elif path.endswith((".parquet", ".arrow")):
            rows = ((f"{path} row {n}", dict(zip(fields, strings)))
                    for n, strings in _table_rows(path, names, hint=hint))
        else:
            raise ValueError(f"data: {path!r} is none of {formats(RECORD_SUFFIXES)} (or a .json file); expected "
                             f"records with the string fields {_names(names)}")
        for where, record in rows:
            check_not_empty(record, nonempty or fields, f"data: {where}")
            records.append(record)
    return records


def _record_names(fields, record_columns):
    """The key or column of each of `fields` in the files, in their order (`read_records`' record_columns)."""
    unknown = sorted(set(record_columns) - set(fields))
    if unknown:
        raise ValueError(f"record_columns names {unknown[0]!r}, which is not a field of these records; expected "
                         f"some of {_names(fields)}")
    names = tuple(record_columns.get(f, f) for f in fields)
    twice = [n for n in names if names.count(n) > 1]
    if twice:
        raise ValueError(f"record_columns reads two fields from {twice[0]!r}; expected a key or column per field")
    return names


def _jsonl_records(path, fields, names, decode_errors, hint):
    """(where, record) of a JSON Lines file's objects: `fields` read from the keys `names`."""
    for _, item, where in _jsonl(path, decode_errors):
        wrong = _not_strings(item, names)
        if wrong:
            missing = isinstance(item, dict) and any(name not in item for name in names)
            nested = isinstance(item, dict) and any(isinstance(item.get(name), (list, dict)) for name in names)
            raise ValueError(f"data: {where} is not an object with string fields {_names(names)} ({wrong})"
                             + (hint if missing else _NESTED if nested else ""))
        yield where, {f: item[name] for f, name in zip(fields, names)}


def _not_strings(item, fields):
    """What keeps a parsed line from being an object with the string `fields` ('' when nothing does)."""
    if not isinstance(item, dict):
        return f"it is {_json_type(item)}"
    for f in fields:
        if f not in item:
            return f"{f!r} is missing"
        if not isinstance(item[f], str):
            return f"{f!r} is {_json_type(item[f])}"
    return ""


def _names(fields):
    """'a', 'b' and 'c'."""
    return " and ".join(", ".join(repr(f) for f in fields).rsplit(", ", 1))


def check_not_empty(record, fields, where):
    """ValueError naming `where` (a file and line, or 'pair 3') when every one of `fields` of `record` is empty or
    white space: such a record (an empty prompt and an empty response, say) has nothing to train on."""
    if all(not record[f].strip() for f in fields):
        verb = "is" if len(fields) == 1 else "are both" if len(fields) == 2 else "are all"
        raise ValueError(f"{where}: {_names(fields)} {verb} empty; expected text to train on")


def is_mixture(spec):
    """Whether a --data value (a string or a list flag's items) is a mixture: some item has a ':WEIGHT' or a
    '#COLUMN' (`parse_mixture`'s rule, so a path holding ':' must take a weight too, and one holding '#' a column)."""
    return any(":" in item or "#" in item for item in (spec.split(",") if isinstance(spec, str) else spec))


def split_column(pattern):
    """(path, column) of a mixture source 'PATH[#COLUMN]' (`parse_mixture`'s, its weight taken off): the column
    (Parquet, Arrow, JSONL) or Example feature (ArrayRecord) that holds that source's documents, or None (the
    mixture's `text_column`). The last '#' holds the column."""
    path, column = pattern.rsplit("#", 1) if "#" in pattern else (pattern, None)
    return path, column


def parse_mixture(spec):
    """[(pattern, weight)] of a mixture spec: 'PATH[#COLUMN][:WEIGHT],...' as a string or a list of its items (an
    absl list flag's value); a pattern keeps its '#COLUMN' (`split_column`). Weights are positive numbers, given for
    every source or for none (equal shares), and normalised to sum to 1. A path holding ':' takes a weight so that
    its last ':' is the weight's; one holding '#' takes a column so that its last '#' is the column's."""
    items = [part.strip() for part in (spec.split(",") if isinstance(spec, str) else spec)]
    shown = spec if isinstance(spec, str) else ",".join(spec)
    if not items or not all(items):
        raise ValueError(f"data mixture {shown!r} has an empty source; expected {MIXTURE_FORM}")
    sources = []
    for item in items:
        pattern, weight = item.rsplit(":", 1) if ":" in item else (item, None)
        if weight is not None:
            try:
                weight = float(weight) if "_" not in weight else -1.0  # float() takes '1_0'; a weight is a number
            except ValueError:
                weight = -1.0
            if not (math.isfinite(weight) and weight > 0) or not pattern:
                raise ValueError(f"data mixture {shown!r}: {item!r} has no positive weight after its last ':'; "
                                 f"expected {MIXTURE_FORM}")
        if "#" in pattern and not all(split_column(pattern)):
            raise ValueError(f"data mixture {shown!r}: {item!r} needs a path before its last '#' and a column after "
                             f"it; expected {MIXTURE_FORM}")
        sources.append((pattern, weight))
    given = [w is not None for _, w in sources]
    if any(given) and not all(given):
        raise ValueError(f"data mixture {shown!r} weighs some sources but not all; expected a weight on every "
                         f"source or on none, {MIXTURE_FORM}")
    weights = [w if w is not None else 1.0 for _, w in sources]
    if not math.isfinite(sum(weights)):
        raise ValueError(f"data mixture {shown!r}: its weights sum past a float's range; expected {MIXTURE_FORM} "
                         "(weights are relative: 0.7 and 0.3, or 7 and 3)")
    return [(pattern, w / sum(weights)) for (pattern, _), w in zip(sources, weights)]


def _source_files(pattern):
    """('text' or 'records', files) of a mixture source: text files of the formats above, or pre-tokenised
    ArrayRecord files (`.array_record` paths, globs, directories, a prepare_data.py --format=array_record
    directory). A tokens.bin directory, or a source holding both kinds, is a ValueError naming it."""
    meta = os.path.join(pattern, "meta.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            if json.load(f).get("format") != "array_record":
                raise ValueError(f"data mixture source {pattern!r} is a prepare_data.py directory of tokens.bin; "
                                 "expected text files or ArrayRecord files (prepare_data.py --format=array_record)")
        return "records", array_records.record_files(pattern)
    files = expand_files(pattern, TEXT_SUFFIXES + (array_records.SUFFIX,))
    records = [f for f in files if f.endswith(array_records.SUFFIX)]
    if records and len(records) < len(files):
        raise ValueError(f"data mixture source {pattern!r} holds both ArrayRecord files ({_shown(records)}) and "
                         f"text files ({_shown([f for f in files if f not in records])}); expected one kind per "
                         "source (make them two sources)")
    return ("records" if records else "text"), files


def _columns(sources, text_column):
    """The text column of each of a mixture's (pattern, weight) sources: its own '#COLUMN', else `text_column`."""
    return [split_column(pattern)[1] or text_column for pattern, _ in sources]


def _sizes_digest(files):
    """A source's files' sizes as a digest: a file rewritten in place (regenerated, appended to) changes it."""
    return hashlib.sha256(" ".join(str(os.path.getsize(f)) for f in files).encode()).hexdigest()[:16]


def _files_digest(files, absolute=True):
    """A source's files as a digest: of their absolute paths (a relative spelling of the same files matches), or
    as listed (`absolute=False`: the digest of states saved before)."""
    paths = [os.path.abspath(f) for f in files] if absolute else list(files)
    return hashlib.sha256("\n".join(paths).encode()).hexdigest()[:16]


def shares_line(state):
    """One line of a mixture's shares: the windows each source gave so far (a `MixtureIterator.get_state()`'s), as a
    share of all of them beside its weight."""
    windows, sources = state["windows"], parse_mixture(state["spec"])
    total = sum(windows) or 1
    return (f"data mixture shares of {sum(windows)} windows: " +
            ", ".join(f"{pattern} {k / total:.4f} (weight {w:.4f})" for (pattern, w), k in zip(sources, windows)))


class Mixture:
    """Training windows from weighted sources: each source (a pattern of `parse_mixture`'s spec: files of any format
    above, their documents in the source's '#COLUMN' or else `text_column`) is tokenised and packed on its own into full
    rows of `pack`'s format ({'tokens', 'segment_ids'} [seq_len + 1]), and the rows are interleaved so that each
    source's share of the windows, and so of the tokens, follows its weight: window n comes from the source furthest
    behind its share (weight·(n + 1) − its windows so far; ties to the earlier source), which keeps every source's count
    within two windows of weight·n (the tests hold it there): each share is within 1% of its weight from the 200th
    window on. A source that runs out restarts from its beginning (logged once), packing on across the epoch boundary,
    so the stream never ends.

    A source of ArrayRecord files (`array_records`' int32 or tf.train.Example records; `text_column` names the
    Example feature) is pre-tokenised: its records' ids are packed as they are (no EOS added: prepare_data.py wrote
    one), the text sources tokenised with `tokenizer`, which must be the one the records were written with; an id
    at or past `tokenizer.vocab_size` is refused naming file and record (scripts/train_lm.py also checks a
    prepare_data.py directory's meta.json tokenizer). Its position's row is the record index.

    An iterable: each `iter()` starts afresh from where the mixture was built (the beginning, or `from_state`'s
    state). Its iterator is stateful as Grain's are: `get_state()` is a JSON-able position (windows per source, and
    each source's epoch, file, row and tokens used of that row's document) and `set_state(state)` moves a fresh
    iterator there, so `Trainer.fit` resumes it from its checkpoint without reading the trained windows again;
    `Mixture.from_state(state, tokenizer)` is a mixture whose iterators start there. Either continues with exactly
    the next window, tokenising again only the document each source stood in (earlier rows of its file are passed
    over unread in Parquet's skipped row groups, read past but not tokenised elsewhere)."""

    def __init__(self, spec, tokenizer, seq_len, *, text_column="text", decode_errors="strict"):
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len={seq_len!r}; expected an integer >= 2")
        _check_decode_errors(decode_errors)
        self.spec = spec.split(",") if isinstance(spec, str) else list(spec)
        self.sources = parse_mixture(self.spec)
        self.tokenizer, self.seq_len, self.text_column = tokenizer, seq_len, text_column
        self.decode_errors = decode_errors
        self.columns = _columns(self.sources, text_column)
        self.kinds, self.files = zip(*[_source_files(split_column(pattern)[0]) for pattern, _ in self.sources]) or (
            (), ())
        self.weights = [w for _, w in self.sources]
        self.sizes = [_sizes_digest(files) for files in self.files]
        self._start = {"windows": [0] * len(self.sources),
                       "positions": [{"epoch": 0, "file": 0, "row": 0, "offset": 0} for _ in self.sources],
                       "restart": [[0, 0] for _ in self.sources]}

    @classmethod
    def from_state(cls, state, tokenizer, *, decode_errors="strict", hold_out=False):
        """The mixture `state` (a `MixtureIterator.get_state()`) was taken from, iterating on from that position;
        the tokenizer must be the one it was taken with. A source whose files changed since is a ValueError.
        hold_out: the windows read so far were held out (an eval set): each source goes on from its next whole
        document, and its later epochs start there instead of at its beginning, so that no document of those
        windows is trained on (a source those windows hold wholly restarts from its beginning, logged)."""
        mixture = cls(state["spec"], tokenizer, state["seq_len"], text_column=state["text_column"],
                      decode_errors=decode_errors)
        start = mixture._position(state)
        if hold_out:
            for i, position in enumerate(start["positions"]):
                if position["epoch"]:
                    logging.info("data: mixture source %r: the held-out windows hold all of it; its later epochs "
                                 "start from its beginning", mixture.sources[i][0])
                    continue
                if position["offset"]:  # the rest of the document the last held-out window ended in
                    position.update(row=position["row"] + 1, offset=0)
                start["restart"][i] = [position["file"], position["row"]]
        mixture._start = start
        return mixture

    def _position(self, state):
        """{'windows', 'positions', 'restart'} of `state`, which must be this mixture's (its sources' weights, text
        columns and files, however spelt; positions count documents and tokens, so another seq_len packs on from the
        same token; a state without 'restart' restarts each source at its beginning)."""
        keys = {"spec", "text_column", "files", "windows", "positions"}
        if not isinstance(state, dict) or not keys <= set(state):
            raise ValueError(f"data: a {type(state).__name__} is not a position of this mixture; expected a "
                             f"MixtureIterator.get_state(), a dict of {sorted(keys)}")
        theirs = parse_mixture(state["spec"])
        columns = _columns(theirs, state["text_column"])
        same = (columns == self.columns and len(theirs) == len(self.weights)
                and all(math.isclose(w, mine, rel_tol=1e-9) for (_, w), mine in zip(theirs, self.weights)))
        if not same:
            raise ValueError(f"data: the state is a position of the mixture {','.join(state['spec'])!r} (text columns "
                             f"{','.join(columns)}), not of {','.join(self.spec)!r} (text columns "
                             f"{','.join(self.columns)}); expected the same sources, weights and text columns to "
                             "resume")
        sizes = state.get("sizes", [None] * len(self.files))  # states saved before sizes were recorded have none
        for (pattern, _), files, digest, size in zip(self.sources, self.files, state["files"], sizes):
            if digest not in (_files_digest(files), _files_digest(files, absolute=False)):
                raise ValueError(f"data: the files of {pattern!r} changed since the mixture's state was saved "
                                 f"(now {len(files)}: {_shown(files)}); expected the same files to resume")
            if size not in (None, _sizes_digest(files)):
                raise ValueError(f"data: the files of {pattern!r} were rewritten since the mixture's state was saved "
                                 f"(their sizes differ: {_shown(files)}); expected the same files to resume")
        return {"windows": list(state["windows"]), "positions": [dict(p) for p in state["positions"]],
                "restart": [list(r) for r in state.get("restart", [[0, 0]] * len(self.sources))]}

    def __iter__(self):
        return MixtureIterator(self, self._start)


class MixtureIterator:
    """The endless window stream of a `Mixture`, with its position (`get_state()`) after the windows taken so far
    and `set_state` to move there: Grain's stateful-iterator protocol."""

    def __init__(self, mixture, start):
        self._mixture = mixture
        self._start_at(start)

    def _start_at(self, start):
        self.windows = list(start["windows"])
        self.positions = [dict(p) for p in start["positions"]]
        self.restart = [list(r) for r in start["restart"]]  # where each source's next epoch starts
        self._streams = [self._source_rows(i) for i in range(len(self._mixture.sources))]

    def __iter__(self):
        return self

    def __next__(self):
        n, weights = sum(self.windows), self._mixture.weights
        behind = [w * (n + 1) - k for w, k in zip(weights, self.windows)]
        i = behind.index(max(behind))
        row, self.positions[i] = next(self._streams[i])
        self.windows[i] += 1
        return row

    def get_state(self):
        """JSON-able: what `set_state` and `Mixture.from_state` need to continue with the next window."""
        m = self._mixture
        return {"spec": m.spec, "seq_len": m.seq_len, "text_column": m.text_column,
                "files": [_files_digest(files) for files in m.files], "sizes": m.sizes, "windows": list(self.windows),
                "positions": [dict(p) for p in self.positions], "restart": [list(r) for r in self.restart]}

    def set_state(self, state):
        """Continues from `state` (a `get_state()` of an iterator of this mixture) with exactly the next window; a
        state of another mixture, or whose files changed since, is a ValueError."""
        self._start_at(self._mixture._position(state))

    def _source_rows(self, i):
        """(row, position after it) of source i, endlessly, from its current position."""
        m, width = self._mixture, self._mixture.seq_len + 1
        for pieces, (epoch, file, row), end in _fill_rows(self._epochs(i), m.tokenizer, width,
                                                            self.positions[i]["offset"]):
            yield _packed_row(pieces, width, m.tokenizer.pad_id), {"epoch": epoch, "file": file, "row": row,
                                                                   "offset": end}

    def _epochs(self, i):
        """((epoch, file index, row), document) of source i from its position on, its files over and over."""
        m, position = self._mixture, self.positions[i]
        pattern, files = m.sources[i][0], m.files[i]
        epoch, start = position["epoch"], (position["file"], position["row"])
        while True:
            if m.kinds[i] == "records":
                documents = array_records.iter_documents(files, feature=m.columns[i], start=start, what=repr(pattern),
                                                         vocab_size=m.tokenizer.vocab_size)
            else:
                documents = _documents(files, m.columns[i], m.decode_errors, repr(pattern), start)
            read = False
            for (file, row), doc in documents:
                read = True
                yield (epoch, file, row), doc
            restart = tuple(self.restart[i])
            if epoch > position["epoch"] and not read and restart != (0, 0):  # the held-out windows held it all
                logging.info("data: mixture source %r has no document after its held-out ones; it restarts from its "
                             "beginning", pattern)
                self.restart[i] = [0, 0]
                restart = (0, 0)
            if epoch == position["epoch"]:
                logging.info("data: mixture source %r (weight %.3g) ran out after epoch %d; it restarts from %s "
                             "(logged once)", pattern, m.weights[i], epoch,
                             "its beginning" if restart == (0, 0) else
                             f"file {restart[0]}, row {restart[1]}, after the documents held out for eval")
            epoch, start = epoch + 1, restart
