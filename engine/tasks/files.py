"""Where a --data value's files are: paths, globs and directories (a `datasets.save_to_disk` directory as its
Arrow files), for `sources`' readers and `array_records`. Imports nothing of ours."""
import glob
import json
import os

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")


def expand_files(patterns, suffixes=TEXT_SUFFIXES):
    """The files of paths or globs; a directory stands for the files under it (recursively, sorted) whose names end
    with one of `suffixes`, and a `datasets.save_to_disk` directory for its Arrow files."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise FileNotFoundError(f"data: {pattern!r} matches no file; expected {' / '.join(suffixes)} paths, "
                                    "globs or directories")
        for path in matched:
            if not os.path.isdir(path):
                files.append(path)
            elif ".arrow" in suffixes and _is_saved_dataset(path):
                files += _saved_dataset_files(path)
            else:
                inside = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                                if name.endswith(suffixes) and not name.startswith("."))
                if not inside:
                    raise FileNotFoundError(f"data: the directory {path} holds no {' or '.join(suffixes)} file")
                files += inside
    return files


def _is_saved_dataset(path):
    return any(os.path.isfile(os.path.join(path, name))
               for name in ("state.json", "dataset_info.json", "dataset_dict.json"))


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
