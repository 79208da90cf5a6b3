"""Where a --data value's files are: paths, globs and directories (a `datasets.save_to_disk` directory as its
Arrow files), for `sources`' readers and `array_records`; and `open_file`, their bytes decompressed. Imports nothing
of ours."""
import bz2
import glob
import gzip
import io
import json
import lzma
import os
import re

COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
# JSON Lines and text also compressed (Dolma ships .json.gz of JSON Lines, The Pile and SlimPajama .jsonl.zst); an
# uncompressed .json is read only when named as a file (JSON Lines, or one JSON array): a directory's .json files are
# its configs more often than its documents.
JSONL_SUFFIXES = ((".jsonl", ".ndjson")
                  + tuple(base + c for base in (".jsonl", ".ndjson", ".json") for c in COMPRESSIONS))
TEXT_SUFFIXES = ((".txt", ".jsonl", ".ndjson", ".parquet", ".arrow") + JSONL_SUFFIXES[2:]
                 + tuple(".txt" + c for c in COMPRESSIONS))
JSON_SUFFIXES = JSONL_SUFFIXES + (".json",)  # read as JSON: a plain .json only when named (or globbed) as a file
RECORD_SUFFIXES = JSONL_SUFFIXES + (".parquet", ".arrow")  # records: objects per line, or rows of named columns
_CHUNK = 1 << 16  # compressed bytes read at a time
# The split names of Hugging Face layouts (data/train-00000-of-00002.parquet, default/validation/0000.parquet, a
# builder cache's name-test.arrow): a directory whose files name two of them holds separate corpora.
_SPLITS = ("train", "validation", "valid", "val", "test", "dev", "eval", "evaluation")


def expand_files(patterns, suffixes=TEXT_SUFFIXES):
    """The files of paths or globs; a directory stands for the files under it (recursively, sorted; hidden files and
    directories skipped) whose names end with one of `suffixes`, and a `datasets.save_to_disk` directory for its
    Arrow files. Refused in one line: a directory whose files belong to two or more splits (`_SPLITS`: a dataset's
    train and test files are separate corpora) or that holds `datasets` cache files (`cache-*.arrow`, outputs of
    `.map()`), and a file named twice."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files, named = [], {}
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise FileNotFoundError(f"data: {pattern!r} matches no file; expected {formats(suffixes)} paths, "
                                    "globs or directories")
        for path in matched:
            if not os.path.isdir(path):
                found = [path]
            elif ".arrow" in suffixes and _is_saved_dataset(path):
                found = _saved_dataset_files(path)
            else:
                found = _walk(path, suffixes)
            for f in found:
                real = os.path.realpath(f)
                if real in named:
                    raise ValueError(f"data: {f} is named twice (by {named[real]!r} and {pattern!r}); expected each "
                                     "file once (a mixture's weights weigh sources: PATH:WEIGHT,...)")
                named[real] = pattern
            files += found
    return files


def _walk(path, suffixes):
    """The files under directory `path` that `expand_files` takes (its docstring)."""
    inside = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .ipynb_checkpoints, .git, .cache
        inside += [os.path.join(root, n) for n in names if n.endswith(suffixes) and not n.startswith(".")]
    inside.sort()
    if not inside:
        raise FileNotFoundError(f"data: the directory {path} holds no {formats(suffixes)} file")
    cached = [f for f in inside if os.path.basename(f).startswith("cache-") and f.endswith(".arrow")]
    if cached:
        raise ValueError(f"data: the directory {path} holds datasets cache files ({_shown(cached)}: outputs of "
                         "Dataset.map, not the dataset's text); expected its split's own files, a glob of them, or "
                         "a save_to_disk directory")
    parts = [os.path.relpath(f, path).split(os.sep) for f in inside]
    revisions = {p[p.index("snapshots") + 1] for p in parts if "snapshots" in p[:-1]}
    if len(revisions) > 1:  # a huggingface_hub cache: datasets--org--name/snapshots/<revision>/...
        raise ValueError(f"data: the directory {path} holds {len(revisions)} snapshots of a Hugging Face repository "
                         f"({', '.join(sorted(revisions))}); expected one snapshot's files, e.g. "
                         f"--data={os.path.join(path, 'snapshots', sorted(revisions)[0])}")
    splits = {}
    for f, p in zip(inside, parts):
        names = {t for t in re.split(r"[-_./]+", "/".join(p).lower()) if t in _SPLITS}
        if len(names) == 1:
            splits.setdefault(names.pop(), []).append(f)
    if len(splits) > 1:
        split = "train" if "train" in splits else next(iter(splits))
        folder, name = os.path.split(splits[split][0])
        in_folder = split in re.split(r"[-_./]+", os.path.relpath(folder, path).lower())  # default/train/0000.parquet
        example = os.path.join(folder, "*" + os.path.splitext(name)[1] if in_folder else f"*{split}*")
        shown = ", ".join(f"{name} ({len(fs)} file{'s' if len(fs) > 1 else ''})" for name, fs in splits.items())
        raise ValueError(f"data: the directory {path} holds the splits {shown} of a dataset, which are separate "
                         f"corpora; expected one split's files, e.g. --data='{example}'")
    return inside


def _is_saved_dataset(path):
    """A `save_to_disk` directory: a Dataset's (state.json) or a DatasetDict's (dataset_dict.json). dataset_info.json
    alone is also in `datasets`' builder caches and some hub repositories, whose files are walked."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def _saved_dataset_files(path):
    """The Arrow stream files of a `Dataset.save_to_disk` directory, in the order its state.json lists them (a
    DatasetDict's directory is refused: its splits are separate corpora)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(f"data: {path} is a saved DatasetDict (splits: {', '.join(splits)}); expected one split's "
                         f"directory, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):
        with open(state) as f:
            names = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    else:
        names = sorted(n for n in os.listdir(path) if n.startswith("data-") and n.endswith(".arrow"))
    files = [os.path.join(path, name) for name in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise FileNotFoundError(f"data: the saved dataset {path} lacks its Arrow files "
                                f"({', '.join(missing) if missing else 'none listed'})")
    return files


def _shown(files):
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more files" if len(files) > 3 else "")


def formats(suffixes):
    """`suffixes` for a message: '.txt / .jsonl / .parquet / .arrow (or .jsonl / .json / .txt compressed: .gz, .zst,
    .bz2, .xz)'."""
    plain = [s for s in suffixes if not s.endswith(COMPRESSIONS)]
    packed = list(dict.fromkeys(os.path.splitext(s)[0] for s in suffixes if s.endswith(COMPRESSIONS)))
    shown = " / ".join(plain)
    return shown + (f" (or {' / '.join(packed)} compressed: {', '.join(COMPRESSIONS)})" if packed else "")


def compression(path):
    """The compression suffix of `path` ('.gz', ...), or '' for a file read as it is."""
    return next((c for c in COMPRESSIONS if path.endswith(c)), "")


def open_file(path):
    """`path` opened for reading bytes, decompressed by its suffix (`COMPRESSIONS`), streamed: memory stays flat
    however large the file. A file that is not of its compression, or ends inside a compressed frame, raises
    OSError or EOFError (lzma.LZMAError for .xz) while it is read; `sources` names the file."""
    kind = compression(path)
    if kind == ".gz":
        return gzip.open(path, "rb")
    if kind == ".bz2":
        return bz2.open(path, "rb")
    if kind == ".xz":
        return lzma.open(path, "rb")
    if kind == ".zst":
        return _open_zstd(path)
    return open(path, "rb")


def _open_zstd(path):
    try:
        from compression import zstd  # noqa: PLC0415 (Python 3.14's standard library)

        return zstd.ZstdFile(path, "rb")
    except ImportError:
        pass
    try:
        import zstandard  # noqa: PLC0415
    except ImportError:
        raise ValueError(f"data: {path} is Zstandard-compressed; reading it needs the zstandard package (pip "
                         "install zstandard)") from None
    return io.BufferedReader(_ZstdStream(open(path, "rb"), zstandard), _CHUNK)


class _ZstdStream(io.RawIOBase):
    """A .zst file's frames decompressed one after another (zstandard's own stream reader ends a truncated file
    silently; this raises EOFError, as gzip, bz2 and lzma do)."""

    def __init__(self, f, zstandard):
        self._f, self._zstandard, self._frame = f, zstandard, None
        self._out, self._at = b"", 0  # decompressed bytes and how many of them were read

    def readable(self):
        return True

    def readinto(self, buffer):
        while self._at == len(self._out):
            data = self._f.read(_CHUNK)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                return 0
            out = []
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._zstandard.ZstdDecompressor().decompressobj()
                try:
                    out.append(self._frame.decompress(data))
                except self._zstandard.ZstdError as e:
                    raise OSError(str(e)) from None
                data = self._frame.unused_data if self._frame.eof else b""
            self._out, self._at = b"".join(out), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def close(self):
        self._f.close()
        super().close()
