"""Multi-tier checkpoints: frequent saves of each process's own shards to fast local storage (`LocalCheckpoints`)
beside the persistent Orbax checkpoints of the workdir (`engine.checkpoint.Checkpointer`), and a restore from the
newest complete copy of either (`TieredCheckpointer`).

A local save copies only what a process's devices hold (one copy of each distinct block) to the host, its only
blocking part, and writes it in a background thread under `<local_dir>/run-<hash of the workdir>/process_<i>/<step>/`:
a raw `blocks.bin`, the `index.json` that says where each block lies in its global array with its CRC-32, and the
step's `meta.json` (the data position, a digest of the index and its own). A step is written into `<step>.tmp` and
renamed when complete, and the previous local step is deleted only after that, so a process killed mid-write leaves
its last good copy. Nothing crosses hosts and nothing runs on the devices: a process reads back only the blocks it
wrote, so per-block checksums on the host replace the persistent tier's global ones (a pass over the state on the
devices and an all-reduce per save).

A restart tries steps newest first over both tiers. A local step is a candidate only when every process holds it
(a host whose local copy is gone, a wiped `/dev/shm` or a replaced node, makes it none) and when the restore's layout
needs no block that a process did not write itself (the same mesh and process count: an elastic restart reads the
persistent tier, which restores onto any mesh). Its meta, index and every block are checked against their
checksums; a local step that fails is deleted (the copy is a cache of the run, not its record) and the next candidate,
the same step's persistent copy included, is tried. This is MaxText's emergency checkpointing (Orbax's
`experimental.emergency`) reduced to what one shared persistent directory needs: its peer-to-peer replication of
local copies between hosts is not done, so a lost host costs the steps since the last persistent save.
"""
import hashlib
import json
import os
import shutil
import threading
import zlib

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from engine.checkpoint import _META_DIGEST, Checkpointer, CorruptCheckpointError, _agreed, _meta_digest

_INDEX_DIGEST = "index_sha256"  # the local meta's key of its index file's digest


def open_checkpointer(workdir, checkpointing):
    """The workdir's checkpointer for an `engine.Checkpointing`: tiered when it names a `local_dir`."""
    if checkpointing.local_dir is None:
        return Checkpointer(workdir, keep=checkpointing.keep)
    return TieredCheckpointer(workdir, keep=checkpointing.keep, local_dir=checkpointing.local_dir,
                              local_every=checkpointing.local_every)


class LocalCheckpoints:
    """This process's local copies of its own shards (module docstring); the newest `keep` steps are kept."""

    def __init__(self, local_dir, workdir, *, keep=1):
        run = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:16]
        self.directory = os.path.join(os.path.abspath(local_dir), f"run-{run}", f"process_{jax.process_index()}")
        os.makedirs(self.directory, exist_ok=True)
        self.keep = keep
        self._writer, self._error = None, None

    def steps(self):
        """The complete steps this process holds, newest first."""
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        return sorted((int(n) for n in names if n.isdigit()), reverse=True)

    def save(self, step, state, meta):
        """Copies this process's blocks of `state` to the host (returns once they are there: the save's only
        blocking part) and writes them, each with its CRC-32, and `meta` in a background thread; the previous write
        is awaited first."""
        self.wait()
        blocks, index = [], []
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            seen = set()
            for shard in leaf.addressable_shards:
                where = _block_key(shard.index, leaf.shape)
                if where not in seen:
                    seen.add(where)
                    shard.data.copy_to_host_async()
                    blocks.append(shard.data)
                    index.append({"leaf": jax.tree_util.keystr(path), "block": where,
                                  "dtype": str(leaf.dtype), "shape": list(shard.data.shape)})
        blocks = [np.asarray(b) for b in blocks]
        self._writer = threading.Thread(target=self._write, args=(step, blocks, index, meta), daemon=True,
                                        name="local-checkpoint")
        self._writer.start()

    def _write(self, step, blocks, index, meta):
        try:
            final = os.path.join(self.directory, str(step))
            partial = final + ".tmp"
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            offset = 0
            with open(os.path.join(partial, "blocks.bin"), "wb") as f:
                for entry, block in zip(index, blocks):
                    data = memoryview(np.ascontiguousarray(block)).cast("B")
                    entry.update(offset=offset, nbytes=len(data), crc32=zlib.crc32(data))
                    f.write(data)
                    offset += len(data)
            text = json.dumps(index)
            with open(os.path.join(partial, "index.json"), "w") as f:
                f.write(text)
            meta = {**meta, _INDEX_DIGEST: hashlib.sha256(text.encode()).hexdigest()}
            with open(os.path.join(partial, "meta.json"), "w") as f:
                json.dump({**meta, _META_DIGEST: _meta_digest(meta)}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
            for old in self.steps()[self.keep:]:
                shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - reported by the next save or wait, in the training thread
            self._error = e

    def wait(self):
        """Waits for the write in flight; raises what it failed with (a full local disk, say) as one line."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"local checkpoint under {self.directory} failed to write: {error}") from error

    def read_meta(self, step):
        with open(os.path.join(self.directory, str(step), "meta.json")) as f:
            meta = json.load(f)
        if meta.get(_META_DIGEST) != _meta_digest(meta):
            raise ValueError("its meta does not match its checksum")
        return meta

    def covers(self, step, abstract_state):
        """Whether this process wrote every block of `step` that `abstract_state`'s layout puts on its devices."""
        try:
            index = self._index(step)
        except (OSError, ValueError):
            return True  # unreadable: left to `restore`, which reports it as corrupt
        return all(key in index for key in _needed(abstract_state))

    def _index(self, step):
        """{(leaf, block): its entry} of `step`, the file checked against the meta's digest of it."""
        with open(os.path.join(self.directory, str(step), "index.json")) as f:
            text = f.read()
        if hashlib.sha256(text.encode()).hexdigest() != self.read_meta(step).get(_INDEX_DIGEST):
            raise ValueError("its index does not match its checksum")
        return {(e["leaf"], tuple(map(tuple, e["block"]))): e for e in json.loads(text)}

    def restore(self, step, abstract_state):
        """`abstract_state`'s arrays from this process's blocks of `step` (`covers` said it holds them), each checked
        against its CRC-32; raises ValueError naming a block that does not match."""
        index = self._index(step)
        data = np.memmap(os.path.join(self.directory, str(step), "blocks.bin"), np.uint8, mode="r") if index else None

        def read(path, target):
            name, sharding, arrays = jax.tree_util.keystr(path), target.sharding, []
            for device, where in sharding.addressable_devices_indices_map(target.shape).items():
                e = index[(name, _block_key(where, target.shape))]
                raw = data[e["offset"]:e["offset"] + e["nbytes"]]
                if len(raw) != e["nbytes"] or zlib.crc32(raw) != e["crc32"]:
                    raise ValueError(f"leaf {name} block {list(e['block'])} does not match its checksum")
                block = np.frombuffer(raw, np.dtype(jax.numpy.dtype(e["dtype"]))).reshape(e["shape"])
                arrays.append(jax.device_put(block, jax.sharding.SingleDeviceSharding(
                    device, memory_kind=sharding.memory_kind)))
            return jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)
        return jax.tree_util.tree_map_with_path(read, abstract_state)

    def remove(self, step):
        shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)


class TieredCheckpointer:
    """The persistent `Checkpointer` of `workdir` and this process's `LocalCheckpoints` under `local_dir`, saved
    every `local_every` updates (`local_due`); the Checkpointer's interface, its steps those of both tiers. The
    persistent tier's `save`, `latest_step`, `wait` and `directory` are unchanged; `save_local` writes the local one."""

    def __init__(self, workdir, *, keep, local_dir, local_every):
        self.persistent = Checkpointer(workdir, keep=keep)
        self.local = LocalCheckpoints(local_dir, workdir)
        self.local_every, self.workdir = local_every, workdir
        self._reading = self.persistent  # the tier `read_meta` / `restore` read, set by `restore_newest`
        self._restored_directory = None

    @property
    def directory(self):
        return self._restored_directory or self.persistent.directory

    def latest_step(self):
        return self.persistent.latest_step()

    def all_steps(self):
        """Every step a restore may try: the persistent ones and the local ones every process holds."""
        return sorted(set(self.persistent.all_steps()) | set(self._agreed_local_steps()))

    def local_due(self, step):
        return bool(self.local_every) and step % self.local_every == 0

    def save(self, step, state, meta):
        self.persistent.save(step, state, meta)

    def save_local(self, step, state, meta):
        self.local.save(step, state, meta)
        logging.info("checkpoint: saving step %d locally to %s", step, self.local.directory)

    def read_meta(self, step):
        if self._reading is self.persistent:
            return self.persistent.read_meta(step)
        return _agreed(step, "local meta", lambda: self.local.read_meta(step))

    def restore(self, step, abstract_state):
        if self._reading is self.persistent:
            return self.persistent.restore(step, abstract_state)
        meta = self.read_meta(step)
        covered = np.int32(self.local.covers(step, abstract_state))
        if jax.process_count() > 1:
            covered = np.asarray(multihost_utils.process_allgather(covered)).min()
        if not covered:
            raise _OtherLayout(step, "its local copy holds the blocks of another mesh or process count")
        state = _agreed(step, "local state", lambda: self.local.restore(step, abstract_state))
        return state, meta

    def restore_params(self, step, abstract_params):
        if self._reading is self.persistent:
            return self.persistent.restore_params(step, abstract_params)
        return self.restore(step, {"params": abstract_params})[0]["params"]

    def restore_newest(self, attempt, *, set_aside):
        """`Checkpointer.restore_newest` over both tiers: each step's local copy (when every process holds it)
        before its persistent one; a local copy that fails is deleted and logged in one warning line."""
        local = set(self._agreed_local_steps())
        persistent = set(self.persistent.all_steps())
        candidates = [(step, tier) for step in sorted(local | persistent, reverse=True)
                      for tier, has in (("local", local), ("persistent", persistent)) if step in has]
        skipped = []
        for step, tier in candidates:
            self._reading = self.local if tier == "local" else self.persistent
            self._restored_directory = self.local.directory if tier == "local" else None
            try:
                result = attempt(step)
            except CorruptCheckpointError as e:
                logging.warning("checkpoint: skipping the %s copy of step %d, it does not restore (%s)", tier,
                                step, e.reason)
                if tier == "persistent":
                    skipped.append(step)
                elif not isinstance(e, _OtherLayout):
                    self.local.remove(step)
                continue
            finally:
                self._reading = self.persistent
            if set_aside and skipped:
                self.persistent.set_aside(skipped)
            logging.info("checkpoint: restored step %d from the %s tier", step, tier)
            return step, result
        raise ValueError(f"workdir={self.workdir}: none of the {len(candidates)} checkpoint copies (persistent "
                         f"under {self.persistent.directory}, local under {self.local.directory}) restores")

    def _agreed_local_steps(self):
        """The local steps every process holds (a process's lost copy makes the step no candidate)."""
        mine = self.local.steps()
        if jax.process_count() == 1:
            return mine
        width = 8  # the newest few are enough: keep is 1
        row = np.full(width, -1, np.int64)
        row[:min(width, len(mine))] = mine[:width]
        every = np.asarray(multihost_utils.process_allgather(row))
        common = set(every[0]) - {-1}
        for other in every[1:]:
            common &= set(other)
        return sorted((int(s) for s in common), reverse=True)

    def wait(self):
        self.persistent.wait()
        self.local.wait()

    def close(self):
        self.local.wait()
        self.persistent.close()


class _OtherLayout(CorruptCheckpointError):
    """A local step whose blocks do not cover the restore's layout: skipped, not deleted."""


def _needed(abstract_state):
    """(leaf name, block) of every block `abstract_state`'s layout puts on this process's devices."""
    keys = set()
    for path, target in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        for where in target.sharding.addressable_devices_indices_map(target.shape).values():
            keys.add((jax.tree_util.keystr(path), _block_key(where, target.shape)))
    return keys


def _block_key(index, shape):
    """A block's place in its global array: ((start, stop), ...) per dim, from a shard's tuple of slices."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))
