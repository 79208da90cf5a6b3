"""The measured default implementation of an op, per device kind and shape class.

`default_implementation(op, *, device_kind=None, table=None, **shape)` reads the checked-in table
(`kernels/defaults.json`), which `scripts/bench_kernels.py --write_defaults=PATH` writes from timings on a
device: each entry names the fastest measured path of one (op, device kind, shape class). Where the table has no
entry (or names a path the device cannot run) the answer is the per-backend rule, `implementation_for_platform`.

- `'flash_attention'`: one of `ATTENTION_IMPLEMENTATIONS`. Shape: `head_dim`, `seq_len` (the longer of len and
  kv_len), `causal`, `dtype`, `segments` (False, the default; True: the call has segment ids, packed documents,
  which cuDNN's path takes as a mask), `training` (True, the default: the forward + backward entry; False: forward
  only). Classes: dtype, head dim, causal, the length's power-of-two bucket (4096 holds 2049 ... 4096), segments and
  pass.
- `'gated_mlp'`, `'linear_cross_entropy'`: `'plain'` (plain XLA matmuls beat the fused kernel: `silu(x @ w_gate) *
  (x @ w_up)`; logits, then the cross-entropy) or the fused kernel's implementation; for the loss also `'chunked'`
  (`linear_cross_entropy_sum`: row chunks through XLA matmuls, gradients taken in the forward). Shape: `dtype`,
  `training`. Classes: dtype and pass.

A class measured on one kind answers for its near neighbours where they have no entry of their own: first another
GPU of the same architecture (an H100 takes an H200's measurement: the same SMs and instructions decide which
kernel is faster), then, for attention, a class one step away in length bucket or head dim or both (a length or a
head dim half or twice its own; fewer steps first, a length step before a head-dim one, the smaller first; the kind
itself before its architecture's others): 2048 and 16384 tokens take what 4096 and 8192 measured, head dim 64 or
256 what 128 did; last, the same steps in the other masking (causal for full attention and back: the same kernels
with and without the causal tiles skipped, each implementation skipping them). Dtypes, segments (cuDNN's path for them
is another kernel, its mask read as a bias) and passes never stand in for each other.
"""
import datetime
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
from absl import logging

from kernels._dispatch import ATTENTION_IMPLEMENTATIONS, IMPLEMENTATIONS, implementation_for_platform, target_device

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "defaults.json")
PLAIN = "plain"
CHUNKED = "chunked"  # linear_cross_entropy only: kernels.linear_cross_entropy_sum (row chunks, forward gradients)
# Each op's shape-class keys (a table entry's "class") and the choices an entry may name.
CLASS_KEYS = {"flash_attention": ("dtype", "head_dim", "causal", "seq_len", "segments", "pass"),
              "gated_mlp": ("dtype", "pass"), "linear_cross_entropy": ("dtype", "pass")}
CHOICES = {"flash_attention": ATTENTION_IMPLEMENTATIONS, "gated_mlp": (PLAIN, *IMPLEMENTATIONS),
           "linear_cross_entropy": (PLAIN, CHUNKED, *IMPLEMENTATIONS)}
_SHAPE_ARGS = {"flash_attention": ("head_dim", "seq_len", "causal", "dtype"), "gated_mlp": ("dtype",),
               "linear_cross_entropy": ("dtype",)}
_RUNS_ON = {"triton": ("gpu",), "cudnn": ("gpu",), "mosaic_gpu": ("gpu",), "mosaic_tpu": ("tpu",)}  # else everywhere


def default_implementation(op, *, device_kind=None, table=None, **shape):
    """The implementation `op` runs by default on `device_kind` (None: the device the trace is for,
    `kernels._dispatch.target_device`: the ambient abstract mesh's, so a plan compiled for another target resolves
    as a run there would, else the default backend's first device's; e.g. 'NVIDIA H200', 'NVIDIA H100 80GB HBM3',
    'TPU v5 lite') for calls of `shape` (see the module docstring), read from `table` (a path; None: the checked-in
    one). Raises ValueError for an unknown op or shape argument."""
    cls = shape_class(op, **shape)
    if device_kind is None:
        device = target_device()
        device_kind, platform = device.device_kind, device.platform
    else:
        platform = _platform(device_kind)
    entry = measured_entry(op, device_kind, cls, table)
    if entry is not None and platform in _RUNS_ON.get(entry["choice"], (platform,)):
        if (entry["device_kind"], entry["class"]) != (device_kind, cls):
            _note_neighbour(op, device_kind, _key(op, device_kind, cls), _key(op, entry["device_kind"], entry["class"]),
                            entry["choice"])
        return entry["choice"]
    return implementation_for_platform(platform)


@functools.lru_cache(maxsize=256)
def _note_neighbour(op, device_kind, asked, answered, choice):
    """Logs once per class that a neighbour's measurement chose its implementation."""
    logging.info("kernels: %s on %s, class %s: %r, as measured on %s for class %s (no entry of its own)", op,
                 device_kind, asked[2], choice, answered[1], answered[2])


def measured_entry(op, device_kind, cls, table=None):
    """The table entry that answers for class `cls` (`shape_class`'s) of `op` on `device_kind`: its own, else a
    near neighbour's (the module docstring), else None."""
    index = _index(table or TABLE)
    arch = architecture(device_kind)
    siblings = {key[1] for key in index if key[0] == op and key[1] != device_kind}
    kinds = [device_kind, *sorted(kind for kind in siblings if arch is not None and architecture(kind) == arch)]
    for near in _near_classes(op, cls):
        for kind in kinds:
            entry = index.get(_key(op, kind, near))
            if entry is not None:
                return entry
    return None


# GPU architectures by the device kind's name (`jax.devices()[0].device_kind`: 'NVIDIA H100 80GB HBM3', 'NVIDIA GH200
# 480GB', 'NVIDIA A100-SXM4-80GB', ...); kinds outside these answer from their own entries only.
_ARCHITECTURES = (("sm_90", re.compile(r"\b(GH200|H100|H200|H800|H20)\b")),
                  ("sm_80", re.compile(r"\b(A100|A800|A30)\b")),
                  ("sm_100", re.compile(r"\b(GB200|B200|B100)\b")))


def architecture(device_kind):
    """The GPU architecture ('sm_90', ...) a device kind's name belongs to; None for any other kind."""
    if device_kind.startswith(("NVIDIA", "Tesla")):
        for name, pattern in _ARCHITECTURES:
            if pattern.search(device_kind):
                return name
    return None


# Attention's neighbours, as (length, head dim) steps in powers of two, nearest first (the module docstring).
_STEPS = sorted(((dl, dh) for dl in (-1, 0, 1) for dh in (-1, 0, 1)), key=lambda s: (abs(s[0]) + abs(s[1]),
                                                                                      abs(s[1]), s))


def _near_classes(op, cls):
    """`cls`, then (attention) the classes one length bucket and / or one head-dim doubling away, nearest first;
    then the same with causal flipped."""
    if op != "flash_attention":
        yield cls
        return
    for causal in (cls["causal"], not cls["causal"]):
        for dl, dh in _STEPS:
            seq_len, head_dim = cls["seq_len"] * 2.0 ** dl, cls["head_dim"] * 2.0 ** dh
            if seq_len >= 1 and head_dim == int(head_dim) >= 1:
                yield {**cls, "causal": causal, "seq_len": int(seq_len), "head_dim": int(head_dim)}


def shape_class(op, *, training=True, **shape):
    """The table's class of a call of `op` with `shape` ({key: value} in `CLASS_KEYS[op]` order)."""
    if op not in CLASS_KEYS:
        raise ValueError(f"op={op!r}; expected one of {tuple(CLASS_KEYS)}")
    want, optional = _SHAPE_ARGS[op], ("training", "segments") if op == "flash_attention" else ("training",)
    segments = shape.pop("segments", False) if op == "flash_attention" else False
    if set(shape) != set(want):
        raise ValueError(f"{op} shape arguments {sorted(shape)}; expected {list(want)} and optionally "
                         f"{' and '.join(optional)}")
    for name, value in (("training", training), ("segments", segments)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}; expected a bool")
    cls = {"dtype": jnp.dtype(shape["dtype"]).name, "pass": "fwd+bwd" if training else "fwd", "segments": segments}
    if op == "flash_attention":
        for name in ("head_dim", "seq_len"):
            if isinstance(shape[name], bool) or not isinstance(shape[name], int) or shape[name] < 1:
                raise ValueError(f"{name}={shape[name]!r}; expected a positive int")
        if not isinstance(shape["causal"], bool):
            raise ValueError(f"causal={shape['causal']!r}; expected a bool")
        cls.update(head_dim=shape["head_dim"], causal=shape["causal"], seq_len=1 << (shape["seq_len"] - 1).bit_length())
    return {key: cls[key] for key in CLASS_KEYS[op]}


def _platform(device_kind):
    """The platform of a device kind: the default backend's for its own kind, else read off the name."""
    if device_kind == jax.devices()[0].device_kind:
        return jax.default_backend()
    if device_kind.startswith("TPU"):
        return "tpu"
    return "gpu" if device_kind.startswith(("NVIDIA", "Tesla", "AMD")) else "cpu"


def _key(op, device_kind, cls):
    return op, device_kind, tuple(cls[k] for k in CLASS_KEYS[op])


def _index(path):
    """{(op, device kind, class values): entry} of the table at `path`, re-read when the file changes."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return {}
    return _indexed(path, (stat.st_ino, stat.st_mtime_ns, stat.st_size))  # `merge_table` replaces the file


@functools.lru_cache(maxsize=8)
def _indexed(path, stamp):
    del stamp  # part of the cache key only
    return {_key(e["op"], e["device_kind"], e["class"]): e for e in read_table(path)}


def read_table(path=None):
    """The entries of the table at `path` (None: the checked-in one), each checked; [] for a missing file."""
    path = path or TABLE
    if not os.path.exists(path):
        return []
    with open(path) as f:
        table = json.load(f)
    entries = table.get("entries") if isinstance(table, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON object with a list of \"entries\"")
    for i, entry in enumerate(entries):
        op = entry.get("op")
        ok = (op in CLASS_KEYS and isinstance(entry.get("device_kind"), str)
              and tuple(entry.get("class", {})) == CLASS_KEYS[op] and entry.get("choice") in CHOICES[op])
        if not ok:
            raise ValueError(f"{path}: entry {i} {entry!r}; expected op in {tuple(CLASS_KEYS)}, a device_kind, "
                             "the op's class keys in order and one of its choices")
    return entries


def make_entry(op, device_kind, cls, times, *, unit="ms", **provenance):
    """A table entry choosing the fastest of `times` ({candidate: measured time}), with its provenance (the shape
    measured, the command, the date, the JAX version, ...). The date defaults to today."""
    provenance.setdefault("date", datetime.date.today().isoformat())
    choice = min(times, key=times.get)
    return {"op": op, "device_kind": device_kind, "class": dict(cls), "choice": choice, "times": dict(times),
            "unit": unit, **provenance}


def merge_table(path, entries):
    """Writes `entries` into the table at `path` (created if missing): each replaces the entry of the same (op,
    device kind, class), the others are kept. Returns the merged entries, sorted."""
    merged = {_key(e["op"], e["device_kind"], e["class"]): e for e in read_table(path)}
    merged.update({_key(e["op"], e["device_kind"], e["class"]): e for e in entries})
    ordered = [merged[key] for key in sorted(merged, key=repr)]
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        json.dump({"about": _ABOUT, "entries": ordered}, f, indent=1)
        f.write("\n")
    os.replace(partial, path)  # readers see the old table or the new one, never half of it
    return ordered


_ABOUT = ("The defaults table of kernels/_defaults.py (kernels.default_implementation): per op, device kind and shape "
          "class, the fastest path measured and what was measured. Written by scripts/bench_kernels.py "
          "--write_defaults=PATH on a device, which replaces the entries of the classes it times and keeps every "
          "other; see kernels/README.md.")
