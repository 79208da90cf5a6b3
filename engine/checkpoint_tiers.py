"""Multi-tier checkpoints: frequent saves of each process's own shards to fast local storage (`LocalCheckpoints`)
beside the persistent Orbax checkpoints of the workdir (`engine.checkpoint.Checkpointer`), and a restore from the
newest complete copy of either (`TieredCheckpointer`).

A local save copies only what a process's devices hold (one copy of each distinct block) to the host, its blocking
part, and writes it in a background thread under `<local_dir>/run-<hash of the workdir>/process_<i>/<step>/`: a raw
`blocks.bin`, the `index.json` that says where each block lies in its global array with its CRC-32, and the step's
`meta.json` (the data position, a digest of the index and its own). A step is written into `<step>.tmp` and
renamed when complete, and the previous local step is deleted only after that, so a process killed mid-write leaves
its last good copy. Nothing runs on the devices but the replicas' transfer: a process reads back only the blocks it
wrote (or its peer's replica of them, below), so per-block checksums on the host replace the persistent tier's global
ones (a pass over the state on the devices and an all-reduce per save).

Peer replicas (`Checkpointing(local_replicas=1)`, more than one process): each save also sends the process's blocks,
with their index, to the previous process, which writes them beside its own under `replica_of_process_<p + 1>/`, with
CRC-32s of its own over the bytes it received (process p holds process (p + 1) mod n's). The bytes cross as a
collective permute over one device per process, in chunks of at most 64 MiB staged on that device (`_Transfer`);
hosts need no shared storage and no connection beyond the devices'. The transfer is off the step's critical path:
the save only launches its first chunks (asynchronous dispatch) and a receiver thread waits for the bytes and writes
the replica, so the next steps run while they cross. Every chunk is launched on the thread that dispatches the
steps, at points the same on every process: the save launches `_WINDOW` chunks, each `local_due` between steps
`_WINDOW` more, and the next save, `wait` or `close` the rest, a chunk only once the one `_WINDOW` before it has been
read to the host (by the receiver, else right there), which bounds the device memory a transfer holds. The counts
depend on the payloads' sizes only (agreed by all processes), never on how far a transfer got, so each device runs
the permutes and the steps' own collectives in one order on every process; a collective launched from a background
thread could land before a step's on one process and after it on another, and both would wait for ever. A replica
is written (into `<step>.tmp`, then renamed) only once all its bytes arrived, so a process killed mid-transfer
leaves none that passes as complete.

A restart tries steps newest first over both tiers. A local step is a candidate when every process holds it, or, for
a process that lost it (a wiped `/dev/shm`, a replaced node), its peer holds a replica; and when the restore's layout
needs no block that a process did not write itself (the same mesh and process count: an elastic restart reads the
persistent tier, which restores onto any mesh). A lost copy is written back first: the peer checks the replica's
checksums and sends its files the same way, and the process writes them as its own step. Its meta, index and every
block are checked against their checksums; a local step (or replica) that fails is deleted (the copy is a cache of
the run, not its record) and the next candidate, the same step's persistent copy included, is tried. This is
MaxText's emergency checkpointing (Orbax's `experimental.emergency`) reduced to what one shared persistent directory
needs: one replica per process, so two lost hosts next to each other in process order, or a host lost with
`local_replicas=0`, cost the steps since the last persistent save.
"""
import functools
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

from engine.checkpoint import (_META_DIGEST, Checkpointer, CorruptCheckpointError, StateMismatchError, _agreed,
                               _meta_digest, check_leaves)

_INDEX_DIGEST = "index_sha256"  # the local meta's key of its index file's digest


def open_checkpointer(workdir, checkpointing):
    """The workdir's checkpointer for an `engine.Checkpointing`: tiered when it names a `local_dir`."""
    if checkpointing.local_dir is None:
        return Checkpointer(workdir, keep=checkpointing.keep)
    return TieredCheckpointer(workdir, keep=checkpointing.keep, local_dir=checkpointing.local_dir,
                              local_every=checkpointing.local_every, local_replicas=checkpointing.local_replicas)


def steps_in(directory):
    """The complete steps a directory of checkpoints holds (`<step>` directories: a step still being written, here or
    by Orbax, has a suffix), newest first; [] for a missing directory."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted((int(n) for n in names if n.isdigit()), reverse=True)


class _Steps:
    """A directory of complete steps, each `<step>/{blocks.bin, index.json, meta.json}` (module docstring); the
    newest `keep` are kept."""

    def __init__(self, directory, keep):
        self.directory, self.keep = directory, keep

    def steps(self):
        """The complete steps held, newest first."""
        return steps_in(self.directory)

    def write(self, step, blocks, index, meta):
        """Writes `blocks` (host arrays or bytes), `index` (an entry per block; offsets and CRC-32s added here) and
        `meta` into `<step>.tmp`, renames it `<step>` and then deletes the steps past `keep`."""
        partial = os.path.join(self.directory, f"{step}.tmp")
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
        self._publish(step, partial)

    def _publish(self, step, partial):
        final = os.path.join(self.directory, str(step))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        for old in self.steps()[self.keep:]:
            shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)

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

    def check_leaves(self, step, abstract_state):
        """StateMismatchError when `step` holds other leaves than `abstract_state` (`checkpoint.check_leaves`; every
        process holds a block of every leaf); an unreadable index is left to `restore`."""
        try:
            index = self._index(step)
        except (OSError, ValueError):
            return
        check_leaves(step, self.directory, {leaf for leaf, _ in index}, abstract_state)

    def _index(self, step):
        """{(leaf, block): its entry} of `step`, the file checked against the meta's digest of it."""
        with open(os.path.join(self.directory, str(step), "index.json")) as f:
            text = f.read()
        if hashlib.sha256(text.encode()).hexdigest() != self.read_meta(step).get(_INDEX_DIGEST):
            raise ValueError("its index does not match its checksum")
        return {(e["leaf"], tuple(map(tuple, e["block"]))): e for e in json.loads(text)}

    def _block(self, data, entry):
        """The bytes of one block of `data` (a step's blocks.bin), checked against its CRC-32."""
        raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
        if len(raw) != entry["nbytes"] or zlib.crc32(raw) != entry["crc32"]:
            raise ValueError(f"leaf {entry['leaf']} block {list(entry['block'])} does not match its checksum")
        return raw

    def _data(self, step, index):
        path = os.path.join(self.directory, str(step), "blocks.bin")
        return np.memmap(path, np.uint8, mode="r") if index else np.zeros(0, np.uint8)

    def restore(self, step, abstract_state):
        """`abstract_state`'s arrays from this process's blocks of `step` (`covers` said it holds them), each checked
        against its CRC-32; raises ValueError naming a block that does not match."""
        index = self._index(step)
        data = self._data(step, index)

        def read(path, target):
            name, sharding, arrays = jax.tree_util.keystr(path), target.sharding, []
            for device, where in sharding.addressable_devices_indices_map(target.shape).items():
                e = index[(name, _block_key(where, target.shape))]
                raw = self._block(data, e)
                block = np.frombuffer(raw, np.dtype(jax.numpy.dtype(e["dtype"]))).reshape(e["shape"])
                arrays.append(jax.device_put(block, jax.sharding.SingleDeviceSharding(
                    device, memory_kind=sharding.memory_kind)))
            return jax.make_array_from_single_device_arrays(target.shape, sharding, arrays)
        return jax.tree_util.tree_map_with_path(read, abstract_state)

    def files(self, step):
        """`step` as one uint8 array (its meta and index as a JSON header, then its blocks), every checksum
        verified first; `put_files` writes it back. Raises ValueError or OSError."""
        index = self._index(step)
        data = self._data(step, index)
        for entry in index.values():
            self._block(data, entry)
        with open(os.path.join(self.directory, str(step), "meta.json")) as f:
            meta = f.read()
        with open(os.path.join(self.directory, str(step), "index.json")) as f:
            header = json.dumps({"meta": meta, "index": f.read()}).encode()
        return _pack(header, [data])

    def put_files(self, step, payload):
        """Writes `files`' array as `step` (its checksums are checked again when it restores)."""
        header, data = _unpack(payload)
        partial = os.path.join(self.directory, f"{step}.tmp")
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        for name, text in (("meta.json", header["meta"]), ("index.json", header["index"])):
            with open(os.path.join(partial, name), "w") as f:
                f.write(text)
        with open(os.path.join(partial, "blocks.bin"), "wb") as f:
            f.write(memoryview(data))
        self._publish(step, partial)

    def remove(self, step):
        shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)


def local_run_dir(local_dir, workdir):
    """The directory under `local_dir` that holds `workdir`'s local copies (a `process_<p>` and a
    `replica_of_process_<q>` directory of steps per process)."""
    run = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(local_dir), f"run-{run}")


class LocalCheckpoints(_Steps):
    """This process's local copies of its own shards (module docstring); the newest `keep` steps are kept. With
    `replicas=1` in a multi-process run each save also hands its blocks to the previous process, and `replica`
    holds the next process's (process p keeps process (p + 1) mod n's); a run of one process has no `replica`."""

    def __init__(self, local_dir, workdir, *, keep=1, replicas=0):
        run_dir = local_run_dir(local_dir, workdir)
        super().__init__(os.path.join(run_dir, f"process_{jax.process_index()}"), keep)
        os.makedirs(self.directory, exist_ok=True)
        peer = (jax.process_index() + 1) % jax.process_count()
        self.replica = _Steps(os.path.join(run_dir, f"replica_of_process_{peer}"), keep) if (
            jax.process_count() > 1) else None
        self.replicas = replicas if self.replica is not None else 0
        self._threads, self._transfer, self._error = [], None, None

    def save(self, step, state, meta):
        """Copies this process's blocks of `state` to the host (the save's blocking part) and writes them, each with
        its CRC-32, and `meta` in a background thread; with replicas it launches their transfer (module docstring),
        and a receiver thread writes the next process's blocks as they arrive. The previous save is awaited first."""
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
        self._threads = [threading.Thread(target=self._write, args=(step, blocks, index, meta), daemon=True,
                                          name="local-checkpoint")]
        if self.replicas:  # process p's blocks go to process p - 1; p + 1's arrive
            header = json.dumps({"meta": meta, "index": index, "sizes": [b.nbytes for b in blocks]}).encode()
            transfer = _Transfer(_pack(header, blocks), -1)
            self._transfer = None if transfer.launch(_WINDOW) else transfer  # the rest: `launch_more`, `wait`
            self._threads.append(threading.Thread(target=self._receive, args=(step, transfer), daemon=True,
                                                  name="local-checkpoint-replica"))
        for thread in self._threads:
            thread.start()

    def launch_more(self):
        """Launches the replica transfer's next chunks; on the thread that dispatches the steps, between steps."""
        if self._transfer is not None and self._transfer.launch(_WINDOW):
            self._transfer = None  # the receiver thread holds it, and lets go of its bytes once it wrote them

    def _write(self, step, blocks, index, meta):
        try:
            self.write(step, blocks, index, meta)
        except Exception as e:  # noqa: BLE001 - reported by the next save or wait, in the training thread
            self._error = self._error or e

    def _receive(self, step, transfer):
        try:
            header, data = _unpack(transfer.result())
            ends = np.cumsum([0] + header["sizes"])
            self.replica.write(step, [data[a:b] for a, b in zip(ends[:-1], ends[1:])], header["index"],
                               header["meta"])
        except Exception as e:  # noqa: BLE001 - reported by the next save or wait, in the training thread
            self._error = self._error or e

    def wait(self):
        """Launches what is left of the replica transfer, waits for the writes in flight and raises what they failed
        with (a full local disk, say) as one line."""
        if self._transfer is not None:
            self._transfer.launch()
            self._transfer = None
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"local checkpoint under {self.directory} failed to write: {error}") from error


class TieredCheckpointer:
    """The persistent `Checkpointer` of `workdir` and this process's `LocalCheckpoints` under `local_dir`, saved
    every `local_every` updates (`local_due`); the Checkpointer's interface, its steps those of both tiers. The
    persistent tier's `save`, `latest_step`, `wait` and `directory` are unchanged; `save_local` writes the local one."""

    def __init__(self, workdir, *, keep, local_dir, local_every, local_replicas=0):
        self.persistent = Checkpointer(workdir, keep=keep)
        self.local = LocalCheckpoints(local_dir, workdir, replicas=local_replicas)
        self.local_every, self.workdir = local_every, workdir
        self._reading = self.persistent  # the tier `read_meta` / `restore` read, set by `restore_newest`
        self._restored_directory = None
        self._lost = {}  # local step -> the processes that hold no copy of it (their peers hold a replica)

    @property
    def directory(self):
        return self._restored_directory or self.persistent.directory

    def latest_step(self):
        return self.persistent.latest_step()

    def all_steps(self):
        """Every step a restore may try: the persistent ones and the local ones every process holds."""
        return sorted(set(self.persistent.all_steps()) | set(self._agreed_local_steps()))

    def local_due(self, step):
        """Whether `step` saves locally. The Trainer asks between steps on the thread that dispatches them, the
        same steps on every process: the point where a replica transfer's next chunks are launched."""
        self.local.launch_more()
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

    def restore(self, step, abstract_state, *, whole=True):
        """whole=False: `abstract_state` is part of the saved state (`restore_params`'s), its leaves not checked
        against the saved ones."""
        if self._reading is self.persistent:
            return self.persistent.restore(step, abstract_state)
        meta = self.read_meta(step)
        mismatch = None
        try:
            if whole:
                self.local.check_leaves(step, abstract_state)
        except StateMismatchError as e:
            mismatch = e
        found = np.array([self.local.covers(step, abstract_state), mismatch is not None], np.int32)
        if jax.process_count() > 1:  # decided together: a process going on alone would wait in the next collective
            every = np.asarray(multihost_utils.process_allgather(found))
            found = np.array([every[:, 0].min(), every[:, 1].max()], np.int32)
        if found[1]:
            raise mismatch or StateMismatchError(f"step {step} of {self.local.directory} holds another training "
                                                 "state than this run's on another process")
        if not found[0]:
            raise _OtherLayout(step, "its local copy holds the blocks of another mesh or process count")
        state = _agreed(step, "local state", lambda: self.local.restore(step, abstract_state))
        return state, meta

    def restore_params(self, step, abstract_params):
        if self._reading is self.persistent:
            return self.persistent.restore_params(step, abstract_params)
        return self.restore(step, {"params": abstract_params}, whole=False)[0]["params"]

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
                if tier == "local":
                    self._recover(step)
                result = attempt(step)
            except CorruptCheckpointError as e:
                logging.warning("checkpoint: skipping the %s copy of step %d, it does not restore (%s)", tier,
                                step, e.reason)
                if tier == "persistent":
                    skipped.append(step)
                elif not isinstance(e, _OtherLayout):
                    self.local.remove(step)
                    if self.local.replica is not None:
                        self.local.replica.remove(step)
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
        """The local steps of which every process holds a copy, or its peer a replica (`_recover` brings it back)."""
        mine = self.local.steps()
        if jax.process_count() == 1:
            return mine
        width = 8  # the newest few are enough: keep is 1
        row = np.full(2 * width, -1, np.int64)
        held = self.local.replica.steps()
        row[:min(width, len(mine))] = mine[:width]
        row[width:width + min(width, len(held))] = held[:width]
        every = np.asarray(multihost_utils.process_allgather(row))
        n = len(every)
        own = [set(r[:width]) - {-1} for r in every]
        replica = [set(every[(p - 1) % n][width:]) - {-1} for p in range(n)]  # process p's, held by p - 1
        common = set.intersection(*(own[p] | replica[p] for p in range(n)))
        self._lost = {int(s): [p for p in range(n) if s not in own[p]] for s in common}
        return sorted((int(s) for s in common), reverse=True)

    def _recover(self, step):
        """Writes the local copy of `step` back on each process that lost it, from the replica its peer (the
        previous process) holds; the bytes travel as a collective. A replica that fails its checksums is deleted
        and the step does not restore (CorruptCheckpointError on every process)."""
        lost = self._lost.get(step, [])
        if not lost:
            return
        me, n = jax.process_index(), jax.process_count()
        owner = (me + 1) % n

        def read():
            if owner not in lost:
                return np.zeros(0, np.uint8)
            try:
                return self.local.replica.files(step)
            except (OSError, ValueError):
                self.local.replica.remove(step)
                raise
        payload = _agreed(step, "replica of a lost local copy", read)
        received = _send(payload, +1)
        if me in lost:
            logging.info("checkpoint: this process's local copy of step %d is gone; writing it back from process "
                         "%d's replica", step, (me - 1) % n)
        _agreed(step, "local copy written back from its replica",
                lambda: self.local.put_files(step, received) if me in lost else None)

    def wait(self):
        self.persistent.wait()
        self.local.wait()

    def close(self):
        self.local.wait()
        self.persistent.close()


class _OtherLayout(CorruptCheckpointError):
    """A local step whose blocks do not cover the restore's layout: skipped, not deleted."""


def _pack(header, blocks):
    """One uint8 array: the length of `header` (bytes) in 8 bytes, `header`, then every block's bytes."""
    parts = [np.frombuffer(len(header).to_bytes(8, "little") + header, np.uint8)]
    parts += [np.frombuffer(memoryview(np.ascontiguousarray(b)).cast("B"), np.uint8) for b in blocks]
    return np.concatenate(parts)


def _unpack(payload):
    """`_pack`'s (header as JSON, the blocks' bytes as one uint8 array)."""
    length = int.from_bytes(payload[:8].tobytes(), "little")
    return json.loads(payload[8:8 + length].tobytes()), payload[8 + length:]


_CHUNK = 64 << 20  # bytes a permute moves at once
_WINDOW = 4  # chunks in flight: a transfer stages at most 2 x _WINDOW x _CHUNK bytes on one device per process


def _send(payload, offset):
    """Sends every process's `payload` (uint8, any length) to process (p + offset) mod n and returns the one
    process (p - offset) mod n sent, all launched and received here (`_Transfer`)."""
    transfer = _Transfer(payload, offset)
    transfer.launch()
    return transfer.result()


def _fetch(array):
    """A received chunk's bytes on the host: waits for its permute."""
    return np.asarray(array.addressable_shards[0].data)[0]


class _Transfer:
    """Every process's `payload` (uint8, any length) on its way to process (p + offset) mod n: a collective permute
    over one device per process, in chunks of at most `_CHUNK` bytes staged through it, so the devices' own links
    carry it (NCCL, the TPU interconnect, gloo on CPU) and hosts need no shared storage nor another connection.

    `__init__` (which agrees the sizes) and `launch` are collectives: only on the thread that dispatches the steps,
    at the same points on every process (module docstring). `result` may wait on any other thread."""

    def __init__(self, payload, offset):
        n, me = jax.process_count(), jax.process_index()
        sizes = np.asarray(multihost_utils.process_allgather(np.int64(payload.size))).ravel()
        size, largest = int(sizes[(me - offset) % n]), int(sizes.max())
        self.payload, self.received = payload, np.empty(size, np.uint8)
        self.chunk = min(_CHUNK, 1 << max(largest - 1, 0).bit_length())  # powers of two: few shapes to compile
        self.starts = list(range(0, largest, self.chunk))
        self.devices = tuple(min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                             for p in range(n))
        self.permute, self.sharding = _permute(self.devices, offset % n, self.chunk) if largest else (None, None)
        self.outputs = []  # each launched chunk's received array, None once read
        self.read, self.error = 0, None  # chunks read to the host; what a read failed with
        self.launched = threading.Condition()  # notified as chunks launch
        self.reading = threading.Lock()  # one reader of a chunk at a time

    def launch(self, count=None):
        """Launches the next `count` chunks (None: all), each once the chunk `_WINDOW` before it was read (read here
        when no other thread has): the count, not the progress, decides what is launched. True once all are."""
        me = jax.process_index()
        end = len(self.starts) if count is None else min(len(self.starts), len(self.outputs) + count)
        while len(self.outputs) < end:
            i = len(self.outputs)
            self._read_until(i - _WINDOW + 1)
            start = self.starts[i]
            part = self.payload[start:start + self.chunk]
            if part.size == self.chunk:
                piece = part.reshape(1, self.chunk)
            else:
                piece = np.zeros((1, self.chunk), np.uint8)
                piece[0, :part.size] = part
            out = self.permute(jax.make_array_from_single_device_arrays(
                (len(self.devices), self.chunk), self.sharding, [jax.device_put(piece, self.devices[me])]))
            with self.launched:
                self.outputs.append(out)
                self.launched.notify_all()
        return len(self.outputs) == len(self.starts)

    def _read_until(self, end):
        """Reads the chunks before `end` to `received`, each once its permute is done, and lets go of their device
        buffers; waits for a chunk's launch without holding `reading`, which the launching thread may need. After a
        failed read the rest are dropped unread (they still launch: the peers expect them) and `result` raises."""
        while True:
            with self.reading:
                if self.read >= end:
                    return
                if self.read < len(self.outputs):
                    out, self.outputs[self.read] = self.outputs[self.read], None
                    start = self.starts[self.read]
                    part = self.received[start:start + self.chunk]
                    if self.error is None:
                        try:
                            part[:] = _fetch(out)[:part.size]
                        except Exception as e:  # noqa: BLE001 - raised by `result`, in the receiving thread
                            self.error = e
                    self.read += 1
                    continue
            with self.launched:
                self.launched.wait_for(lambda: len(self.outputs) > self.read)

    def result(self):
        """The payload process (p - offset) mod n sent, once every chunk has been launched and has arrived."""
        self._read_until(len(self.starts))
        if self.error is not None:
            raise self.error
        return self.received


@functools.lru_cache(maxsize=None)
def _permute(devices, offset, chunk):
    """The jitted permute of `_Transfer` over `devices` (one per process) and its input sharding."""
    mesh = jax.sharding.Mesh(np.array(devices), ("process",))
    n = len(devices)
    body = functools.partial(jax.lax.ppermute, axis_name="process", perm=[(p, (p + offset) % n) for p in range(n)])
    spec = jax.sharding.PartitionSpec("process")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)), \
        jax.sharding.NamedSharding(mesh, spec)


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
