"""Pipeline parallelism for a scanned layer stack over the mesh's `stage` axis: GPipe's schedule, or the interleaved
(circular) one with V virtual stages per device.

The stack's weights [L, ...] keep their checkpoint layout. The layers are V S chunks of K = L / (V S); chunk j runs on
stage j mod S, so stage s holds chunks s, S + s, ..., and the weights are viewed as [V, S, K, ...] with S over
`stage`. With V = 1 (GPipe) that is `engine.auto_shard`'s contiguous split of the layer dim, and the view moves
nothing; with V > 1 the chunks of a stage are strided in [L], which no sharding of that dim expresses, so the compiled
step re-lays the weights out every step (models/README.md#the-pipeline says what that costs). The rows of the batch
are cut into M micro-batches (micro-batch m = rows m, m + M, m + 2M, ...: each device's rows stay its own), and a
micro-batch passes the ring of stages V times. In tick t = 0 .. V M + S - 2 every stage runs one chunk at once
(`jax.vmap` over the stage dim, which the compiler splits over `stage`): stage s on item t - s of its V M (micro-batch
(t - s) mod M in round (t - s) // M); stage 0 takes the next input micro-batch in round 0 and the last stage's output
of the round before after that, the others what the stage before produced in tick t - 1, passed on by a roll of the
stage dim (one collective-permute of one micro-batch's activations). The backward pass is autodiff of the tick loop
(permutes reversed), so all M micro-batches' saved activations are alive at the turn (no 1F1B); with remat each layer
keeps only its input. The bubble: a stage idles (S - 1) of V M + S - 1 ticks, so more micro-batches and more virtual
stages waste less.

Nothing here knows about the engine: the stage count is the size of the ambient mesh's automatic `stage` axis
(`jax.sharding.use_abstract_mesh`, under which the Trainer traces its steps), 1 outside one.
"""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import kernels
from kernels import axes


def num_stages():
    """Size of the ambient mesh's automatic `stage` axis; 1 outside a mesh or where it is manual."""
    return kernels.auto_axis_size(axes.STAGE)


def _on_stages(x):
    """x [S, ...] with its leading dim over `stage` (the other dims as the compiler likes)."""
    return jax.lax.with_sharding_constraint(x, P(axes.STAGE, *[P.UNCONSTRAINED] * (x.ndim - 1)))


def bubble_fraction(stages, microbatches, virtual_stages=1):
    """Share of a device's ticks spent idle: (S - 1) / (V M + S - 1) for V virtual stages per device (V = 1: GPipe)."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def num_ticks(stages, microbatches, virtual_stages=1):
    """Ticks of the schedule's loop: V M + S - 1 (each runs L / (V S) layers on every device)."""
    return virtual_stages * microbatches + stages - 1


def pipeline(layer_fn, params, x, ctx, *, stages, microbatches, virtual_stages=1):
    """The stack `x -> layer_fn(params[L-1], ... layer_fn(params[0], x, ctx, 0, m) ..., ctx, L-1, m)` run as a
    pipeline of `stages` stages over `microbatches` micro-batches of the rows, each stage `virtual_stages` times
    (V = 1: GPipe; V > 1: the interleaved schedule, which needs microbatches >= stages).

    layer_fn(layer params, h [rows, ...], ctx of those rows, layer index, micro-batch index) -> h. params: a pytree
    of [L, ...] arrays; x [B, ...]; ctx: a pytree of [B, ...] arrays (per-row inputs such as segment ids and
    positions). Returns the stack's output [B, ...]."""
    num_layers = jax.tree.leaves(params)[0].shape[0]
    rows, chunks = x.shape[0], stages * virtual_stages
    if num_layers % chunks:
        what = f"stage={stages}" + (f" x pipeline_virtual_stages={virtual_stages}" if virtual_stages > 1 else "")
        raise ValueError(f"a mesh with {what} splits a stack of {num_layers} layers; expected a stage count"
                         f"{' x virtual stages' if virtual_stages > 1 else ''} that divides the number of layers")
    if rows % microbatches:
        raise ValueError(f"pipeline_microbatches={microbatches} does not divide the {rows} rows of the batch; "
                         "expected a divisor of the rows each pipeline step sees")
    if virtual_stages > 1 and microbatches < stages:
        raise ValueError(f"pipeline_microbatches={microbatches} with pipeline_virtual_stages={virtual_stages} on "
                         f"stage={stages}; expected at least {stages} micro-batches (one per stage)")
    per_chunk, m_rows = num_layers // chunks, rows // microbatches
    split = lambda a: a.reshape(m_rows, microbatches, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731  [M, m_rows, ...]
    inputs, ctx_mb = split(x), jax.tree.map(split, ctx)
    # [L, ...] -> [V, S, K, ...] (layer (v S + s) K + k) -> [S, V, K, ...]: stage s's chunks s, S + s, 2S + s, ...
    stage_params = jax.tree.map(lambda w: _on_stages(
        w.reshape(virtual_stages, stages, per_chunk, *w.shape[1:]).swapaxes(0, 1)), params)
    stage_ids = jnp.arange(stages)

    def run_stage(p, h, c, stage, micro, rnd):
        chunk = rnd * stages + stage  # the virtual stage this tick runs
        def body(h, layer):
            w, j = layer
            return layer_fn(w, h, c, chunk * per_chunk + j, micro), None
        weights = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, rnd, keepdims=False), p)
        return jax.lax.scan(body, h, (weights, jnp.arange(per_chunk)))[0]

    run = jax.vmap(run_stage, spmd_axis_name=axes.STAGE)

    def tick(carry, t):
        previous, done = carry
        # Stage s runs item t - s of its V M: micro-batch (t - s) mod M in round (t - s) // M. Stage s > 0 takes
        # what stage s - 1 produced last tick (the roll is the collective-permute); stage 0 the input micro-batch
        # in round 0, else that micro-batch's output of the last stage in the round before, kept in `done` (it was
        # written at least one tick ago because M >= S). Items outside 0 .. V M - 1 compute on clipped indices and
        # are never read.
        item = jnp.clip(t - stage_ids, 0, virtual_stages * microbatches - 1)
        micro, rnd = item % microbatches, item // microbatches
        fresh = jnp.where(rnd[0] == 0, inputs[micro[0]], done[micro[0]])
        first = (stage_ids == 0).reshape((stages,) + (1,) * fresh.ndim)
        h = _on_stages(jnp.where(first, fresh[None], jnp.roll(previous, 1, axis=0)))
        c = jax.tree.map(lambda a: _on_stages(a[micro]), ctx_mb)
        with kernels.vmapped(axes.STAGE):
            out = _on_stages(run(stage_params, h, c, stage_ids, micro, rnd))
        # The last stage's output of its item; its final round's stays as the stack's output.
        finished = t >= stages - 1
        done = done.at[micro[stages - 1]].set(jnp.where(finished, out[stages - 1], done[micro[stages - 1]]))
        return (out, done), None

    start = _on_stages(jnp.zeros((stages,) + inputs.shape[1:], x.dtype))
    (_, done), _ = jax.lax.scan(tick, (start, jnp.zeros_like(inputs)),
                                jnp.arange(num_ticks(stages, microbatches, virtual_stages)))
    out = done.swapaxes(0, 1).reshape(x.shape)  # [M, m_rows, ...] -> rows
    if rows % stages:
        return out
    # What follows the stack (final norm, head, loss) would run on every row in every stage: give each stage every
    # S-th row instead (row r to stage r mod S keeps a device's rows within its data position).
    out = out.reshape(rows // stages, stages, *x.shape[1:])
    out = jax.lax.with_sharding_constraint(out, P(P.UNCONSTRAINED, axes.STAGE, *[P.UNCONSTRAINED] * (x.ndim - 1)))
    return out.reshape(x.shape)
