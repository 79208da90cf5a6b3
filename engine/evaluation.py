"""The Trainer's evaluation loss (`EvalLoss`): `loss_fn(..., is_training=False)` over examples in global batches, the
batches weighed by what the loss is a mean over, and the padding of the last batch taken out exactly."""
import itertools

import jax
import jax.numpy as jnp

import kernels
from engine import data as data_lib
from engine.step import cast_floating, micro_weight, split_loss, weight_metric_of


class EvalLoss:
    """`loss_fn`'s mean over examples, as one batch holding them all would give it: each global batch's loss weighed
    by `loss_fn.weight_metric` (e.g. 'tokens'; its rows without one), and the last batch's padding (copies of its
    last example, `engine.data.iterate_batches`) taken out: a batch of those copies alone is evaluated too and its
    share subtracted, which is exact for a loss that is a mean over its weight (a sum of per-row parts divided by
    the sum of per-row weights). The eval program is compiled once, at the first call."""

    def __init__(self, mesh, loss_fn, collate_fn, compute_dtype, key):
        self.mesh, self.loss_fn, self.collate_fn, self.key = mesh, loss_fn, collate_fn, key
        self.compute_dtype = compute_dtype
        self.weight_metric = weight_metric_of(loss_fn)
        self._fn = None

    def __call__(self, params_fn, examples, per_device_batch_size, note_batch=lambda batch: None):
        """The mean loss of the parameters `params_fn()` returns over `examples` (a sequence or an iterable);
        note_batch(batch) sees each global batch before it runs (the Trainer's state lays itself out on the first,
        and its parameters are read after it)."""
        kept = {}

        def remembered(stream):  # a stream's last example, for the padded batch's copies
            for example in stream:
                kept["last"] = example
                yield example

        source = examples if data_lib.is_random_access(examples) else remembered(iter(examples))
        rows = per_device_batch_size * data_lib.data_parallel_size(self.mesh)
        total, weight, padded, seen = 0.0, 0.0, 0, 0
        for _, n_real, batch in self._batches(source, per_device_batch_size):
            note_batch(batch)
            loss, w = self._run(params_fn(), batch, rows)
            total, weight, padded, seen = total + loss * w, weight + w, padded + rows - n_real, seen + 1
        if not seen:
            raise ValueError("eval_loss: examples is empty; expected at least one example")
        if padded:
            last = examples[len(examples) - 1] if data_lib.is_random_access(examples) else kept["last"]
            _, _, copies = next(iter(self._batches(itertools.repeat(last, rows), per_device_batch_size)))
            loss, w = self._run(params_fn(), copies, rows)
            total, weight = total - loss * w * padded / rows, weight - w * padded / rows
        return total / weight if weight > 0 else 0.0

    def _batches(self, examples, per_device_batch_size):
        return data_lib.iterate_batches(self.mesh, examples, self.collate_fn,
                                        per_device_batch_size=per_device_batch_size, shuffle=False,
                                        drop_remainder=False)

    def _run(self, params, batch, rows):
        """(the batch's loss, its weight) as Python floats."""
        if self._fn is None:
            def eval_step(params, batch):
                with kernels.under_mesh(self.mesh):  # as the train step: kernels see the mesh's axes
                    loss, metrics = split_loss(self.loss_fn(cast_floating(params, self.compute_dtype),
                                                            jax.tree.map(lambda x: x[0], batch),
                                                            jax.random.fold_in(self.key, 2**31 - 1), False))
                w = None if self.weight_metric is None else micro_weight(metrics, self.weight_metric)
                return jnp.asarray(loss, jnp.float32), w
            self._fn = jax.jit(eval_step)
        loss, w = self._fn(params, batch)
        return float(loss), float(rows if w is None else w)
