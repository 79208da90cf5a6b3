"""`Sharded`: a parameter still split over the manual axes inside the shard_map step's re-evaluated loss, gathered
only where an equation uses it whole."""
import jax
from jax.ad_checkpoint import checkpoint_name

from engine.step.collectives import Int8, in_model_blocks, zero3_gather

GATHERED = "zero3_gathered"  # checkpoint name of every ZeRO-3-gathered weight: never saved for the backward pass
# Element-wise casts of a parameter, deferred to after its gather (`Sharded.cast`): the gather moves the fewest bytes.
CASTS = ("convert_element_type", "reduce_precision", "copy", "copy_p")


class Sharded:
    """A parameter still split over manual axes inside the traced loss: the local shard, how to gather it (`int8`: an
    `Int8`), the element-wise casts the loss applied to it (deferred to after the gather, so the gather moves the
    fewest bytes), the dtype its gradient is held in (`grad_dtype`, None: the shard's) and that gradient's device
    layout where it is not row-major, and its split over the automatic axes (`auto`, a PartitionSpec or None)."""

    def __init__(self, local, dims, dtype, reduce_dtype, casts=(), int8=Int8(), layout=None, auto=None,
                 grad_dtype=None):
        self.local, self.dims, self.dtype, self.reduce_dtype, self.casts = local, dims, dtype, reduce_dtype, casts
        self.int8, self.layout, self.auto, self.grad_dtype = int8, layout, auto, grad_dtype

    def full(self):
        return self.apply_casts(checkpoint_name(self.in_blocks(
            lambda x: zero3_gather(x, self.dims, self.dtype, self.reduce_dtype, self.int8, self.grad_dtype),
            self.local), GATHERED))

    def gather(self, local):
        """The whole parameter from `local`, this shard or a slice of it along dims the split leaves alone, in the
        compute dtype with the loss's casts; its gradient is reduce-scattered back to `local`'s layout
        (`kernels.shard_rules`' protocol: a custom_vjp's own rule for shards)."""
        return self.rebuild(local).full()

    def in_blocks(self, collective, x):
        """`collective(x)` (a gather or reduce-scatter over the manual axes, of the shard or one layer of it) on each
        device's `model` block where the parameter is split over `model` too (`collectives.in_model_blocks`)."""
        return in_model_blocks(collective, x, self.auto, self.dims)

    def apply_casts(self, y):
        """The loss's element-wise casts of this parameter, applied to `y` (gathered, or any part of it)."""
        for eqn in self.casts:
            y, = bind_eqn(eqn, [y])
        return y

    def rebuild(self, local):
        return Sharded(local, self.dims, self.dtype, self.reduce_dtype, self.casts, self.int8, self.layout, self.auto,
                       self.grad_dtype)

    def cast(self, eqn):
        return Sharded(self.local, self.dims, self.dtype, self.reduce_dtype, self.casts + (eqn,), self.int8,
                       self.layout, self.auto, self.grad_dtype)

    def layer(self):
        """How one slice along the (unsplit) leading dim of this stacked parameter is gathered: a scan's layer."""
        auto = None if self.auto is None else jax.sharding.PartitionSpec(*tuple(self.auto)[1:])
        return Sharded(None, tuple((dim - 1, axes) for dim, axes in self.dims), self.dtype, self.reduce_dtype,
                       self.casts, self.int8, auto=auto, grad_dtype=self.grad_dtype)


def full(x):
    return x.full() if isinstance(x, Sharded) else x


def bind_eqn(eqn, invals):
    """Re-binds one equation as `jax.core.eval_jaxpr` does (`get_bind_params` returns the params in JAX >= 0.10,
    `(subfuns, params)` before)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]  # shard_map's bind returns a FlatTree


def local_cast(x):
    """A `Sharded`'s local shard in the compute dtype, with the loss's element-wise casts applied."""
    return x.apply_casts(x.local.astype(x.dtype))
