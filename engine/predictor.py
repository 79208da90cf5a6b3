"""The Predictor: `pred_fn` over a list of examples, sharded over the data axes, outputs in input order.

User functions:
  pred_fn(params, batch, rng) -> pytree with a leading batch dimension (pure JAX).
  output_fn(batch_preds) -> list, one entry per example (host numpy in, anything out). Default: one pytree per row.
"""
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine import data as data_lib
import kernels


def _rows(preds):
    """{k: [b, ...]} -> [{k: [...]}] * b."""
    leaves, treedef = jax.tree.flatten(preds)
    return [jax.tree.unflatten(treedef, [leaf[i] for leaf in leaves]) for i in range(len(leaves[0]))]


class Predictor:
    """Runs `pred_fn` batch by batch. The global batch is `per_device_batch_size x data x fsdp x expert` examples
    (devices along `model` share examples); the last batch is padded and the padding dropped, so `predict` returns
    exactly `len(examples)` outputs in input order."""

    def __init__(self, *, mesh, collate_fn, pred_fn, output_fn=None, seed=0):
        for name, fn in (("collate_fn", collate_fn), ("pred_fn", pred_fn)):
            if not callable(fn):
                raise ValueError(f"{name}={fn!r}; expected a callable")
        if output_fn is not None and not callable(output_fn):
            raise ValueError(f"output_fn={output_fn!r}; expected a callable or None")
        self.mesh, self.collate_fn, self.pred_fn = mesh, collate_fn, pred_fn
        self.output_fn = output_fn or _rows
        self._key = jax.random.key(seed)
        self._compiled = None
        self.compile_count = 0

    def _step(self, params, batch, step):
        self.compile_count += 1
        with kernels.under_mesh(self.mesh):  # see Trainer._train_step
            return self.pred_fn(params, jax.tree.map(lambda x: x[0], batch), jax.random.fold_in(self._key, step))

    def predict(self, examples, *, per_device_batch_size, params, data_workers=0):
        """`output_fn`'s entries for every example, in input order. examples: a list or other random-access
        collection (a `grain.MapDataset`: each process reads only its rows), or any iterable (read whole first).
        data_workers: each batch read and collated in that many Grain worker processes (`Trainer.fit`'s)."""
        if not isinstance(per_device_batch_size, int) or per_device_batch_size < 1:
            raise ValueError(f"per_device_batch_size={per_device_batch_size!r}; expected an integer >= 1")
        if not data_lib.is_random_access(examples):
            examples = list(examples)
        if not len(examples):
            return []
        if self._compiled is None:
            replicated = NamedSharding(self.mesh, P())
            self._compiled = jax.jit(self._step, out_shardings=replicated)
        outputs = []
        batches = data_lib.iterate_batches(self.mesh, examples, self.collate_fn,
                                           per_device_batch_size=per_device_batch_size, shuffle=False,
                                           drop_remainder=False, workers=data_workers,
                                           workers_name="data_workers")
        for index, n_real, batch in batches:
            preds = self._compiled(params, batch, np.int32(index))
            # Replicated outputs: every process reads its local copy, no cross-host gather needed.
            host = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), preds)
            data_lib.check_batch(host, len(jax.tree.leaves(batch)[0][0]), "pred_fn")
            out = list(self.output_fn(host))
            if len(out) < n_real:
                raise ValueError(f"output_fn returned {len(out)} entries for a batch of {n_real} examples; expected "
                                 "one per example")
            outputs.extend(out[:n_real])
        return outputs
