"""From user examples to global device batches: shuffling, per-host collation, device placement, prefetch.

A training batch has a leading micro-batch axis: `[accumulate, global_micro_batch, ...]`, split over the data axes
(`data` x `fsdp` x `expert`) along its second axis. Each process collates only the rows its own devices hold and
the global array is assembled with `jax.make_array_from_process_local_data`, so no host ever collates the whole
global batch. With `workers`, that per-batch work (reading examples, where a lazy dataset tokenises, and collating)
runs in Grain's worker processes and this process only places the batches.
"""
import collections.abc
import contextlib
import functools
import itertools
import json
import os
import queue
import signal
import sys
import threading
from multiprocessing import resource_tracker

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.axes import BATCH

DATA_AXES = BATCH


def data_parallel_size(mesh):
    """Number of distinct example shards: devices along `model` share examples."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    return int(np.prod([sizes.get(a, 1) for a in DATA_AXES]))


def batch_sharding(mesh, leading_axes=1):
    """Sharding of a batch leaf: `leading_axes - 1` unsplit axes, then the example axis over (data, fsdp)."""
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    return NamedSharding(mesh, P(*([None] * (leading_axes - 1)), axes))


def _local_rows(mesh, global_rows):
    """[start, stop) of the example rows this process's devices hold along the data axes."""
    sharding = batch_sharding(mesh)
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else global_rows for idx in index_map.values()})
    start, stop = starts[0], stops[-1]
    if stop - start != len(starts) * (global_rows // data_parallel_size(mesh)):
        raise ValueError("this process's devices do not hold a contiguous block of the batch; build the mesh with "
                         "engine.make_mesh so that each host's devices are adjacent along the data axes")
    return start, stop


def _stack(batches):
    """[{k: [b, ...]}] * n -> {k: [n, b, ...]}; any pytree of arrays works."""
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def place_batch(mesh, local_batch, global_rows):
    """Assembles one global array per leaf from this process's rows `[micro, local_rows, ...]`."""
    def place(x):
        x = np.asarray(x)
        global_shape = (x.shape[0], global_rows) + x.shape[2:]
        return jax.make_array_from_process_local_data(batch_sharding(mesh, 2), x, global_shape)
    return jax.tree.map(place, local_batch)


def check_batch(batch, rows, where):
    """One-line errors for a batch that is not a pytree of arrays with `rows` rows: a leaf that is not an array of
    numbers (a string, None, an object), or whose leading dimension differs."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(f"{where} returned {type(batch).__name__} {batch!r} with no arrays; expected a pytree (dict, "
                         "list, tuple, nested) of arrays with one row per example")
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "(the batch)"
        kind = np.asarray(leaf).dtype.kind if isinstance(leaf, (np.ndarray, jax.Array, np.generic, list, int,
                                                                  float, bool)) else None
        if kind is None or kind not in "biufc":
            raise ValueError(f"{where} returned leaf {name} of type {type(leaf).__name__}; expected an array of "
                             "numbers with a leading batch dimension")
        shape = np.shape(leaf)
        if not shape or shape[0] != rows:
            raise ValueError(f"{where} returned leaf {name} of shape {shape}; expected a leading "
                             f"batch dimension of {rows} (one row per example)")


def spec_to_json(spec):
    """A pytree of `jax.ShapeDtypeStruct` (dicts, lists and tuples as nodes) -> JSON-able nested values, for a
    checkpoint's metadata; `spec_from_json` reverses it."""
    if isinstance(spec, jax.ShapeDtypeStruct):
        return {"shape": list(spec.shape), "dtype": str(spec.dtype)}
    if isinstance(spec, dict):
        return {"dict": {str(k): spec_to_json(v) for k, v in spec.items()}}
    if isinstance(spec, (list, tuple)) and type(spec) in (list, tuple):
        return {type(spec).__name__: [spec_to_json(v) for v in spec]}
    raise ValueError(f"the batch holds a {type(spec).__name__} node; expected dicts, lists and tuples of arrays "
                     "(other pytree nodes cannot be written to a checkpoint's metadata)")


def spec_from_json(value):
    if "shape" in value:
        return jax.ShapeDtypeStruct(tuple(value["shape"]), np.dtype(value["dtype"]))
    if "dict" in value:
        return {k: spec_from_json(v) for k, v in value["dict"].items()}
    kind, items = next(iter(value.items()))
    return (list if kind == "list" else tuple)(spec_from_json(v) for v in items)


def example_batch(spec):
    """Zeros of a batch spec (a pytree of `jax.ShapeDtypeStruct`): what the layout is traced on."""
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)


def is_random_access(examples):
    """Whether `examples` is shuffled per epoch and read by index (anything with `len` and indexing: a list, tuple,
    numpy array, `engine.tasks.text_data.TokenWindows`, a `grain.MapDataset` or a Grain `RandomAccessDataSource`)
    rather than streamed in order (generators, iterators, other iterables such as `engine.tasks.sources.Mixture`).
    Mappings, strings and bytes are not collections of examples."""
    if isinstance(examples, (str, bytes, collections.abc.Mapping)):
        return False
    return hasattr(type(examples), "__len__") and hasattr(type(examples), "__getitem__")


class _LocalBatch:
    """Global batch b -> (real examples in it, this process's rows of it collated and stacked
    `[accumulate, local_rows, ...]` in numpy). A picklable callable: with workers it runs in Grain's worker processes,
    each of which draws the epoch's permutation itself (cheaper than pickling one per worker)."""

    def __init__(self, examples, collate_fn, *, rows_per_batch, micro_rows, local_rows, seed, epoch, shuffle):
        self.examples, self.collate_fn = examples, collate_fn
        self.rows_per_batch, self.micro_rows, self.local_rows = rows_per_batch, micro_rows, local_rows
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self._order = None

    def __getstate__(self):
        return {**self.__dict__, "_order": None}

    def order(self):
        if self._order is None:
            n = len(self.examples)
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
        return self._order

    def __call__(self, b):
        chunk = self.order()[b * self.rows_per_batch:(b + 1) * self.rows_per_batch].tolist()
        return len(chunk), _collate_local(chunk, self.examples.__getitem__, self.collate_fn, self.rows_per_batch,
                                          self.micro_rows, self.local_rows, f"batch {b} of epoch {self.epoch}")


def _same(example):
    """A streamed example as it is (`_collate_local`'s fetch for streams)."""
    return example


def _collate_local(chunk, fetch, collate_fn, rows_per_batch, micro_rows, local_rows, where):
    """This process's rows of one global batch `chunk` (its examples, or their indices read by `fetch`), padded to
    `rows_per_batch` by repeating the last, collated per micro-batch and stacked `[accumulate, local_rows, ...]`. An
    exception of `collate_fn` gets a note naming `where` (the batch) and, for random access, the examples' indices."""
    chunk = chunk + [chunk[-1]] * (rows_per_batch - len(chunk))
    lo, hi = local_rows
    micro = []
    for m in range(rows_per_batch // micro_rows):
        part = chunk[m * micro_rows:(m + 1) * micro_rows][lo:hi]
        rows = [fetch(x) for x in part]
        try:
            batch = collate_fn(rows)
        except Exception as e:
            which = (f"{len(rows)} examples" if fetch is _same
                     else f"examples {', '.join(map(str, part[:8]))}{', ...' * (len(part) > 8)}")
            e.add_note(f"raised by collate_fn on {where}, micro-batch {m} ({which})")
            raise
        check_batch(batch, hi - lo, "collate_fn")
        micro.append(batch)
    return _stack(micro)


def _check_workers(workers, examples, collate_fn, name):
    """One-line errors for `workers` (the caller's argument `name`) that cannot run: not an integer >= 0, streamed
    examples, no grain, a main script without a `__main__` guard, or examples / collate_fn that do not pickle
    (Grain's workers are spawned processes that receive both pickled)."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"{name}={workers!r}; expected an integer >= 0 (0: batches built in this process)")
    if not workers:
        return
    if not is_random_access(examples):
        raise ValueError(f"{name}={workers} needs random-access examples (len and indexing: a list, TokenWindows, "
                         f"a grain.MapDataset); got {type(examples).__name__}, which streams in order and so is "
                         f"read in this process: pass {name}=0")
    try:
        import cloudpickle  # noqa: PLC0415 (installed with grain, which pickles with it)
        import grain  # noqa: F401, PLC0415 (optional: the `data` extra)
    except ImportError:
        raise ValueError(f"{name}={workers} needs the grain package (pip install 'redline[data]'); "
                         f"{name}=0 builds batches in this process without it") from None
    script = _unguarded_main()
    if script:
        raise ValueError(f"{name}={workers}: {script} has no `if __name__ == \"__main__\":` guard, and every worker "
                         "process imports it again (they are spawned), running its training there too; expected its "
                         f"top-level training code under that guard, or {name}=0")
    for what, value in (("examples", examples), ("collate_fn", collate_fn)):
        try:
            size = len(cloudpickle.dumps(value))
        except Exception as e:  # noqa: BLE001 (pickling raises whatever the object's __reduce__ raises)
            raise ValueError(f"{name}={workers}: {what} ({type(value).__name__}) cannot be pickled for the worker "
                             f"processes ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); expected "
                             f"a picklable object (open files and locks in __setstate__), or {name}=0") from None
        if size > _MAX_PICKLED:
            raise ValueError(f"{name}={workers}: {what} ({type(value).__name__}) pickles to {size >> 20} MiB, "
                             f"copied into every worker; expected under {_MAX_PICKLED >> 20} MiB: hold file paths "
                             f"and open them lazily (a memory map pickles as a copy of its data), or {name}=0")


def _unguarded_main():
    """The path of the main script when a spawned worker would run it again: a `.py` file that never mentions
    `__main__` (multiprocessing's spawn imports the main module in every child, and without the guard its top level,
    the training, runs there). None for an interactive session, `python -c`, or a guarded script."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return None if "__main__" in f.read() else path
    except OSError:
        return None


_MAX_PICKLED = 256 << 20
# A worker's arrays under this size are pickled to this process rather than passed in shared-memory blocks: Grain
# unlinks a block when its array is freed, in a thread that a process ending right after its last step does not run,
# so every run with workers ended with the resource tracker's warning of "leaked shared_memory objects" (the tracker
# removed them). A language model's batches (token ids: kilobytes to megabytes) now use none; larger arrays keep
# shared memory, where a copy through a pipe would cost more.
_MIN_SHARED_MEMORY = 64 << 20
_NONE = object()  # an exhausted iterator's next() default


_PARENT_POLL_S = 1.0


def _worker_init(parent, worker_index, worker_count):
    """A Grain worker ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and the training process
    saves its checkpoint and then ends the workers itself (each printed a KeyboardInterrupt traceback before). And it
    ends itself within a second of the death of the training process `parent` (a kill -9, an out-of-memory kill, even
    during the worker's start-up), which cannot end it: orphaned workers kept their memory (a few hundred MB each)
    for as long as anyone looked."""
    del worker_index, worker_count
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch():
        while os.getppid() == parent:  # a process whose parent died is adopted by another (init, a subreaper)
            threading.Event().wait(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="redline-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _sigint_blocked():
    """SIGINT blocked in this thread while Grain starts its threads and worker processes, which inherit the mask: a
    Ctrl-C during a worker's start-up (seconds of imports before `worker_init_fn` runs) printed its traceback. This
    thread's own SIGINT is held, not lost: another thread takes it, or it arrives at the unblock. The resource
    tracker is started first: starting it unblocks SIGINT in the thread that does (multiprocessing's own mask dance),
    and Grain's worker start-up (its queues and shared memory register there) would start it in that thread."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _in_workers(build, start, stop, workers):
    """build(b) for b in [start, stop), in order, computed `workers` processes ahead through Grain. Each worker holds
    a slice of the batch indices and keeps two built batches ahead; one thread per worker, since the batch's work
    is Python (tokenisers) that threads would only serialise on the GIL."""
    import grain  # noqa: PLC0415
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():  # grain 0.2.18 reads its absl flags unguarded; outside an absl app: defaults
        flags.FLAGS.mark_as_parsed()
    dataset = grain.experimental.WithOptionsIterDataset(
        grain.MapDataset.range(start, stop).map(build).to_iter_dataset(
            grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)),
        grain.experimental.DatasetOptions(min_shm_size=_MIN_SHARED_MEMORY))
    iterator = None
    try:
        with _sigint_blocked():  # the first batch starts every worker and thread of Grain's
            iterator = iter(dataset.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2),
                worker_init_fn=functools.partial(_worker_init, os.getpid())))
            first = next(iterator, _NONE)
        if first is not _NONE:
            yield first
            yield from iterator
    finally:
        if iterator is not None:
            iterator.close()  # its worker processes end here, not at garbage collection


def iterate_batches(mesh, examples, collate_fn, *, per_device_batch_size, accumulate=1, seed=0, epoch=0,
                    start_batch=0, shuffle=True, drop_remainder=True, workers=0, start_state=None, states=False,
                    workers_name="workers"):
    """Yields `(batch_index, n_real, placed_batch)` for one epoch, starting at `start_batch`; with `states`,
    `(batch_index, n_real, placed_batch, iterator_state)`.

    Random-access examples (see `is_random_access`: lists, `engine.tasks.text_data.TokenWindows`, a
    `grain.MapDataset`, ...) are shuffled with a permutation drawn from `(seed, epoch)`, and each process reads only
    the rows its devices hold, so batch b is the same on any number of processes and a resume at `start_batch` is
    exact (their iterator_state is None). Other iterables are streamed in order, every process drawing every example
    and collating its own rows. A stream whose iterator is stateful (`get_state()` -> a JSON-able value and
    `set_state(state)`, as Grain's `DatasetIterator` and `engine.tasks.sources.Mixture`'s) reports with each batch
    the iterator's state after that batch's last example was drawn (taken here, with the batch, so a consumer
    behind a `Prefetcher` holds the state of the batch it trained on, not of one read ahead), and resumes by
    `set_state(start_state)` on a fresh iterator; without `start_state` or without the methods it is re-read and
    skipped to `start_batch`. The state is global: every process reads the same stream to the same point. The last
    incomplete global batch is dropped when `drop_remainder`, so the step compiles once; otherwise it is padded by
    repeating its last example (callers drop the padded outputs).

    `workers` > 0: reading this process's rows (`examples[i]`, where a lazy dataset tokenises and packs) and
    `collate_fn` run in that many Grain worker processes, batches in order and identical to `workers=0`; this
    process only places them on the devices. Needs random-access, picklable examples and collate_fn (the grain
    package) and, run from a script, its `if __name__ == "__main__":` guard; the workers start with each call (once
    per epoch). `workers_name`: the caller's name for `workers`, in its errors.
    """
    _check_workers(workers, examples, collate_fn, workers_name)
    micro_rows = per_device_batch_size * data_parallel_size(mesh)
    rows_per_batch = micro_rows * accumulate
    local_rows = _local_rows(mesh, micro_rows)
    if is_random_access(examples):  # the source yields indices; only this process's rows are read
        n = len(examples)
        if n >= sys.maxsize:
            raise ValueError(f"examples ({type(examples).__name__}) has {n} examples, an endless dataset (a "
                             "repeated grain.MapDataset?); expected a finite one: fit's epochs repeat it")
        build = _LocalBatch(examples, collate_fn, rows_per_batch=rows_per_batch, micro_rows=micro_rows,
                            local_rows=local_rows, seed=seed, epoch=epoch, shuffle=shuffle)
        n_batches = n // rows_per_batch if drop_remainder else -(-n // rows_per_batch)
        built = (_in_workers(build, start_batch, n_batches, workers) if workers
                 else (build(b) for b in range(start_batch, n_batches)))
        for index, (n_real, local) in enumerate(built, start_batch):
            yield (index, n_real, place_batch(mesh, local, micro_rows)) + ((None,) if states else ())
        return
    source = _resume_stream(examples, start_batch * rows_per_batch, start_state)
    stateful = states and _is_stateful(source)
    for index in itertools.count(start_batch):
        chunk = list(itertools.islice(source, rows_per_batch))
        if not chunk or (drop_remainder and len(chunk) < rows_per_batch):
            return
        state = _iterator_state(source) if stateful else None
        local = _collate_local(chunk, _same, collate_fn, rows_per_batch, micro_rows, local_rows,
                               f"streamed batch {index} of epoch {epoch}")
        yield (index, len(chunk), place_batch(mesh, local, micro_rows)) + ((state,) if states else ())


def _is_stateful(iterator):
    """Whether an iterator can report and restore its position: `get_state()` and `set_state(state)`, the protocol
    of Grain's `DatasetIterator`."""
    return callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))


def _iterator_state(iterator):
    """A stateful iterator's `get_state()` as a JSON round trip: a copy the iterator's later draws cannot change,
    and a one-line error now, not at the checkpoint, for a state a checkpoint's meta cannot hold."""
    state = iterator.get_state()
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise ValueError(f"examples' iterator ({type(iterator).__name__}) get_state() returned a "
                         f"{type(state).__name__} that is not JSON-serialisable ({e}); expected a JSON-able value "
                         "(dicts, lists, strings, numbers) for the checkpoint's meta") from None


def _resume_stream(examples, skip, start_state):
    """A fresh iterator over streamed `examples`, at example `skip`. A stateful iterator is set to `start_state`
    (the state recorded with the last batch trained on) instead of reading `skip` examples again; without the
    state or the methods, the examples before are read and dropped (on the first draw: in a `Prefetcher`'s thread)."""
    iterator = iter(examples)
    if not skip:
        return iterator
    name = type(iterator).__name__
    if start_state is not None and _is_stateful(iterator):
        logging.info("data: resuming %s at example %d by set_state (nothing read again)", name, skip)
        iterator.set_state(start_state)
        return iterator
    logging.info("data: resuming %s at example %d by reading and dropping the examples before it (%s)", name, skip,
                 "no state was recorded" if _is_stateful(iterator) else "its iterator has no get_state / set_state")
    collections.deque(itertools.islice(iterator, skip), maxlen=0)
    return iterator


class Prefetcher:
    """Runs an iterator in a background thread `depth` items ahead, so collation and host-to-device copies of the
    next batch overlap the current step. Exceptions are re-raised in the consumer."""
    _END = object()

    def __init__(self, iterator, depth=2):
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True)
        self._thread.start()

    def _run(self, iterator):
        try:
            for item in iterator:
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put(e)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self):
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
