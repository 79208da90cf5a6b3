"""From user examples to global device batches: shuffling, per-host collation, device placement, prefetch.

A training batch has a leading micro-batch axis: `[accumulate, global_micro_batch, ...]`, split over the data axes
(`data` x `fsdp` x `expert`) along its second axis. Each process collates only the rows its own devices hold and
the global array is assembled with `jax.make_array_from_process_local_data`, so no host ever collates the whole
global batch.
"""
import collections.abc
import itertools
import queue
import threading

import jax
import numpy as np
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
    """Whether `examples` is shuffled per epoch (a list, tuple or other `collections.abc.Sequence`, such as
    `engine.tasks.text_data.TokenWindows`) rather than streamed in order."""
    return isinstance(examples, collections.abc.Sequence) and not isinstance(examples, (str, bytes))


def iterate_batches(mesh, examples, collate_fn, *, per_device_batch_size, accumulate=1, seed=0, epoch=0,
                    start_batch=0, shuffle=True, drop_remainder=True):
    """Yields `(batch_index, placed_batch)` for one epoch, starting at `start_batch`.

    Sequences (lists, `engine.tasks.text_data.TokenWindows`, ...) are shuffled with a permutation drawn from `(seed, epoch)`,
    and each process reads only the rows its devices hold; other iterables are streamed in order (and skipped to
    `start_batch` on resume). The last incomplete global batch is dropped when `drop_remainder`, so the step compiles
    once; otherwise it is padded by repeating its last example (callers drop the padded outputs).
    """
    micro_rows = per_device_batch_size * data_parallel_size(mesh)
    rows_per_batch = micro_rows * accumulate
    lo, hi = _local_rows(mesh, micro_rows)
    if is_random_access(examples):  # the source yields indices; only this process's rows are read
        order = np.arange(len(examples))
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(len(examples))
        source, fetch = iter(order[start_batch * rows_per_batch:]), examples.__getitem__
    else:
        source = itertools.islice(iter(examples), start_batch * rows_per_batch, None)
        fetch = lambda example: example  # noqa: E731
    index = start_batch
    while True:
        chunk = list(itertools.islice(source, rows_per_batch))
        if not chunk or (drop_remainder and len(chunk) < rows_per_batch):
            return
        n_real = len(chunk)
        chunk += [chunk[-1]] * (rows_per_batch - n_real)
        micro = []
        for m in range(accumulate):
            rows = [fetch(x) for x in chunk[m * micro_rows:(m + 1) * micro_rows][lo:hi]]
            batch = collate_fn(rows)
            check_batch(batch, hi - lo, "collate_fn")
            micro.append(batch)
        yield index, n_real, place_batch(mesh, _stack(micro), micro_rows)
        index += 1


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
