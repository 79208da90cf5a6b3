"""Checkpoints with Orbax: asynchronous saves, keep the last k, atomic finalisation, checksums, restore onto any
sharding, falling back past steps that do not restore.

Orbax writes each step into a temporary directory and renames it only once every process has finished, so a save
interrupted mid-write never replaces the previous good checkpoint; `latest_step` only sees finalised steps. What
happens to a finalised step afterwards (a disk's bit flips, a truncated copy, a deleted directory, a stray
`mkdir checkpoints/205`) is caught on restore: every leaf of the state carries a checksum in the step's meta, and a
step that fails to read or to match is skipped for the next older one (`restore_newest`).

The checksum of a leaf is computed on its devices, over its global array: two sums mod 2^32 over its 32-bit words,
of fmix32(word ^ key) and of word * (key | 1), the key a multiple of the word's flat index. A sum of integers does
not depend on the order it is added in, so it is the same whatever mesh or process count holds the array: a restore
onto another mesh checks against the saved value, and in a multi-process run every process computes the same
numbers (an all-reduce of 8 bytes per leaf). Both terms are bijections of the word, so one changed word always
changes both sums; other changes (words swapped, many flips) escape with probability about 2^-32. It costs one
extra read of the state in device memory on each save and each restore (XLA compiles it once per state layout) and
no device-to-host copy beyond those 8 bytes per leaf (an offloaded optimizer state is brought to the device one leaf
at a time); measured figures in engine/README.md#figures.
"""
import contextlib
import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from kernels.axes import entry_axes

_CHECKSUMS, _META_DIGEST = "checksums", "meta_sha256"  # the meta's keys of the state's and its own checksums


class CorruptCheckpointError(ValueError):
    """A step that does not restore: unreadable, incomplete, or a leaf (or the meta) that does not match its
    checksum. `step` and `reason` (one line) say which and why."""

    def __init__(self, step, reason):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason = step, reason


class StateMismatchError(ValueError):
    """A step whose saved state holds other leaves than the state restored into: the run's settings changed (another
    optimizer, trainable set or model), not the step. Older steps are not tried, nor is any step moved aside."""


def check_leaves(step, directory, saved, abstract_state):
    """Raises StateMismatchError in one line when `saved` (the leaf names, `jax.tree_util.keystr`, of `step`'s state
    in `directory`) are not those of `abstract_state`."""
    wanted = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    absent, unsaved = sorted(set(saved) - wanted), sorted(wanted - set(saved))
    if not absent and not unsaved:
        return
    parts = [f"{len(names)} {what}, e.g. {names[0]}" for names, what in (
        (absent, "of its leaves not in this run's state"), (unsaved, "of this run's leaves not saved")) if names]
    raise StateMismatchError(
        f"step {step} of {directory} holds another training state than this run's ({'; '.join(parts)}): another "
        "optimizer (a learning rate of its own for some parameters), other trainable parameters or another model "
        "than the run that saved it; expected its settings to resume it, Checkpointing(params_only=True) to take "
        "its parameters with a fresh optimizer state, or another workdir")


class Checkpointer:
    """`workdir/<name>/<step>/{state, meta}`: `state` is a pytree of arrays, `meta` a JSON dict. The Trainer keeps
    its last `keep` states under 'checkpoints' and, with `fit(save_best=...)`, the best evaluated one under 'best'."""

    def __init__(self, workdir, *, keep=3, async_save=True, name="checkpoints", read_only=False):
        """read_only: a reader of a workdir another run may be writing (it neither creates the directory nor, as a
        writer does at its start, deletes the unfinished saves there: those may be that run's save in progress)."""
        self.workdir = workdir
        self.directory = os.path.abspath(os.path.join(workdir, name))
        options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep,  # (Orbax warns otherwise)
                                               save_interval_steps=0 if read_only else 1,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=not read_only, create=not read_only,
                                               read_only=read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self):
        return self._manager.latest_step()

    def local_due(self, step):
        """Whether `step` saves to a local tier: never here (engine/checkpoint_tiers.py has one)."""
        return False

    def all_steps(self):
        return list(self._manager.all_steps())

    def save(self, step, state, meta):
        """Starts an asynchronous save; returns once the state's checksums are computed and Orbax holds its host
        copy (the previous save is awaited first)."""
        meta = {**meta, _CHECKSUMS: checksums(state)}
        meta[_META_DIGEST] = _meta_digest(meta)
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        logging.info("checkpoint: saving step %d to %s", step, self.directory)

    def read_meta(self, step):
        """`step`'s meta, its checksum verified; raises CorruptCheckpointError."""
        meta = _agreed(step, "meta", lambda: dict(ocp.JsonCheckpointHandler().restore(
            self._item_path(step, "meta"), args=ocp.args.JsonRestore())))
        if _META_DIGEST not in meta:
            if _CHECKSUMS not in meta:  # written before checksums were stored
                return meta
            raise CorruptCheckpointError(step, "its meta lacks its checksum")
        if _meta_digest(meta) != meta[_META_DIGEST]:
            raise CorruptCheckpointError(step, "its meta does not match its checksum")
        return meta

    def restore(self, step, abstract_state):
        """Restores `step` onto the shardings of `abstract_state` (a pytree of `jax.ShapeDtypeStruct` with
        `sharding`), whatever mesh it was saved from, and verifies every leaf's checksum. Returns `(state, meta)`;
        raises CorruptCheckpointError, or StateMismatchError for a state of other leaves."""
        meta = self.read_meta(step)
        if _CHECKSUMS in meta:  # a checksum per leaf: their names are the saved state's
            check_leaves(step, self.directory, meta[_CHECKSUMS], abstract_state)

        def read():
            with contextlib.closing(ocp.StandardCheckpointHandler()) as handler:
                return handler.restore(self._item_path(step, "state"), args=ocp.args.StandardRestore(abstract_state))
        state = _agreed(step, "state", read)
        _verify(step, state, meta)
        return state, meta

    def restore_params(self, step, abstract_params):
        """Only the 'params' of `step`'s state, onto the shardings of `abstract_params` (whatever the rest of the
        state holds: another optimizer, DiLoCo replicas of another mesh), checksums verified."""
        meta = self.read_meta(step)
        target = {"params": abstract_params}

        def read():
            with contextlib.closing(ocp.PyTreeCheckpointHandler()) as handler:
                return handler.restore(self._item_path(step, "state"), args=ocp.args.PyTreeRestore(
                    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True))
        restored = _agreed(step, "state", read)
        _verify(step, restored, meta)
        return restored["params"]

    def restore_newest(self, attempt, *, set_aside):
        """`attempt(step)` on the newest step, then on each older one while it raises CorruptCheckpointError, each
        skipped step logged in one warning line. Returns `(step, attempt's result)`; raises a one-line ValueError
        when no step restores. set_aside=True (a caller that will save here) renames the skipped steps, all newer
        than the restored one, to `<step>.corrupt`: left in place, Orbax would count them among the `keep` it
        keeps (deleting good steps) and a later save of the same step would collide. Nothing is deleted."""
        steps, skipped = sorted(self.all_steps(), reverse=True), []
        for step in steps:
            try:
                result = attempt(step)
            except CorruptCheckpointError as e:
                skipped.append(e)
                older = [s for s in steps if s < step]
                logging.warning("checkpoint: skipping step %d of %s, it does not restore (%s); %s", step,
                                self.directory, e.reason, f"trying step {older[0]}" if older else "no older step")
                continue
            if set_aside and skipped:
                self.set_aside([e.step for e in skipped])
            return step, result
        newest = skipped[0] if skipped else None
        raise ValueError(f"workdir={self.workdir}: none of the {len(steps)} checkpoints in {self.directory} "
                         f"restores; the newest, step {newest.step}: {newest.reason}" if newest else
                         f"workdir={self.workdir}: no checkpoint in {self.directory}")

    def set_aside(self, steps):
        """Renames each of `steps` to `<step>.corrupt` (`.corrupt.1`, ... if taken), out of Orbax's sight."""
        if jax.process_index() == 0:
            for step in steps:
                path = os.path.join(self.directory, str(step))
                aside, n = path + ".corrupt", 0
                while os.path.exists(aside):
                    n += 1
                    aside = f"{path}.corrupt.{n}"
                os.rename(path, aside)
                logging.warning("checkpoint: moved step %d, which does not restore, aside to %s (kept for "
                                "inspection; later saves may write step %d again)", step, aside, step)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint set aside {self.directory}")
        self._manager.reload()

    def _item_path(self, step, item):
        return ocp.path.step.build_step_path(self.directory, ocp.path.step.standard_name_format(), step) / item

    def wait(self):
        self._manager.wait_until_finished()

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree, shardings):
    """`ShapeDtypeStruct`s with the given shardings: the restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def checksums(tree):
    """`{jax.tree_util.keystr(path): 16 hex digits}` for every leaf of `tree` (jax or numpy arrays), the same on
    any mesh or process count (module docstring)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    # A program per leaf, not one for the whole tree: compiled once per shape, dtype and sharding (a model's layers
    # share them, and a params-only restore reuses the save's), where one program's compile grows with the leaves.
    partials = [_partial_sums(x) for _, x in flat]  # all dispatched before the first is read
    sums = np.stack([_local_total(p) for p in partials]) if flat else np.zeros((0, 2), np.uint64)
    if jax.process_count() > 1:  # each process holds the partial sums of its own devices' shards
        sums = np.asarray(multihost_utils.process_allgather(sums.astype(np.uint32))).astype(np.uint64).sum(0)
    sums %= 2**32
    return {jax.tree_util.keystr(path): "%08x%08x" % tuple(int(v) for v in row) for (path, _), row in zip(flat, sums)}


def _verify(step, tree, meta):
    saved = meta.get(_CHECKSUMS)
    if saved is None:
        logging.warning("checkpoint: step %d restored unverified: its meta holds no checksums (saved before they "
                        "were stored)", step)
        return
    got = checksums(tree)
    unknown = [name for name in got if name not in saved]
    if unknown:  # a target of another structure than the saved state: nothing to compare with
        logging.warning("checkpoint: step %d: %d restored leaves have no saved checksum, e.g. %s", step,
                        len(unknown), unknown[0])
    bad = [name for name, value in got.items() if name in saved and saved[name] != value]
    if bad:
        more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
        raise CorruptCheckpointError(step, f"leaf {bad[0]} does not match its checksum{more}")


def _agreed(step, item, read):
    """`read()` on every process, and a failure on any of them is a failure on all: a process that went on alone
    would wait for the others in the next collective. Raises CorruptCheckpointError naming the reason."""
    try:
        result, reason = read(), None
    except Exception as e:  # noqa: BLE001 - whatever fails to read (tensorstore, JSON, a missing path) is the step's
        result, reason = None, f"its {item} does not read: {_one_line(e)}"
    if jax.process_count() > 1:
        failed = np.flatnonzero(multihost_utils.process_allgather(np.int32(reason is not None)))
        if failed.size and reason is None:
            reason = f"its {item} does not read on process {int(failed[0])}"
    if reason is not None:
        raise CorruptCheckpointError(step, reason)
    return result


def _one_line(error):
    text = str(error).split("\n")[0].split(" [tensorstore_spec")[0]  # tensorstore appends its whole spec
    text = text if len(text) <= 300 else f"{text[:120]} ... {text[-180:]}"  # the cause comes last
    return f"{type(error).__name__}: {text}"


def _meta_digest(meta):
    """SHA-256 of the meta, less its own digest, as JSON reads it back (keys sorted)."""
    body = json.dumps({k: v for k, v in meta.items() if k != _META_DIGEST}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- checksums on devices
def _fmix32(h):
    """MurmurHash3's finaliser: a bijection of uint32 in which every input bit flips each output bit with p ~ 1/2."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """The leaf's bits as uint32, one per element (two, on a trailing axis, for 64-bit types)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], -1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = (jnp.finfo if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo)(x.dtype).bits
    if bits < 8:  # int4 and the like: exact in int8
        x, bits = x.astype(jnp.int8), 8
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


def _leaf_sum(block, offsets=None, shape=None):
    """[2] uint32: the sums of fmix32(word ^ key) and of word * (key | 1) over the words of `block`, the key a
    multiple of the word's flat index in the global array (`block` starts at `offsets` of the global `shape`; by
    default it is the whole array). Both terms are bijections of the word, so one changed word always changes both."""
    words = _words(block)
    shape = tuple(shape or block.shape) + words.shape[block.ndim:]  # 64-bit types: a trailing [2] of words
    offsets = tuple(offsets or (0,) * block.ndim) + (0,) * (words.ndim - block.ndim)
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):  # the flat index, from iotas: no reshape of the block
        position = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) + jnp.asarray(offsets[axis], jnp.uint32)
        index = index + position * np.uint32(stride % 2**32)
        stride *= shape[axis]
    key = index * np.uint32(0x9E3779B9) + np.uint32(0x7F4A7C15)
    return jnp.stack([jnp.sum(_fmix32(words ^ key), dtype=jnp.uint32),
                      jnp.sum(words * (key | np.uint32(1)), dtype=jnp.uint32)])


@functools.partial(jax.jit, static_argnums=1)
def _sharded_partial_sums(leaf, sharding):
    """[devices, 2]: each device's `_leaf_sum` of its own block (zero on the replicas of a block but the first),
    without any collective. XLA:CPU ran the all-reduces of independent programs at once, and they waited for each
    other until it aborted (40 s). An offloaded leaf is copied to the device inside the program, one at a time."""
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    if sharding.memory_kind not in (None, "device"):
        leaf = jax.device_put(leaf, sharding.with_memory_kind("device"))
    names = [entry_axes(entry) for entry in spec]

    def local(block):
        offsets = [jax.lax.axis_index(axes).astype(jnp.uint32) * np.uint32(block.shape[axis] % 2**32) if axes
                   else 0 for axis, axes in enumerate(names)]
        first = [jax.lax.axis_index(axis) == 0 for axis in mesh.axis_names if all(axis not in n for n in names)]
        sums = _leaf_sum(block, offsets, leaf.shape)
        return jnp.where(jnp.all(jnp.array(first)) if first else True, sums, jnp.uint32(0))[None]
    return jax.shard_map(local, mesh=mesh, in_specs=P(*spec), out_specs=P(tuple(mesh.axis_names)),
                         check_vma=False)(leaf)


_whole_sum = jax.jit(_leaf_sum)


def _partial_sums(x):
    """This process's partial sums of leaf `x` (a jax.Array: one row per device; else the whole sum, on process 0)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return _sharded_partial_sums(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(f"checksums: a leaf of sharding {sharding}; expected a NamedSharding")
    return _whole_sum(x) if jax.process_index() == 0 else np.zeros(2, np.uint32)


def _local_total(partials):
    """The sum, mod 2^32, of the rows this process holds (uint64 before the modulo)."""
    if isinstance(partials, jax.Array) and partials.ndim == 2:
        rows = [np.asarray(shard.data) for shard in partials.addressable_shards]
        return np.sum(np.concatenate(rows).astype(np.uint64), axis=0) % 2**32
    return np.asarray(partials).astype(np.uint64)
