"""Pipeline parallelism for a scanned layer stack: GPipe's schedule over the mesh's `stage` axis.

The stack's weights [L, ...] keep their checkpoint layout; `engine.auto_shard` splits their layer dim over `stage`,
so stage s holds layers s*L/S .. (s+1)*L/S - 1 and viewing them as [S, L/S, ...] moves nothing. The rows of the
batch are cut into M micro-batches (micro-batch m = rows m, m + M, m + 2M, ...: each device's rows stay its own).
In tick t = 0 .. M + S - 2 every stage runs its layers at once (`jax.vmap` over the stage dim, which the compiler
splits over `stage`): stage s on micro-batch t - s, stage 0 on the next input micro-batch, the others on what the
stage before produced in tick t - 1, passed on by a roll of the stage dim (one collective-permute of one
micro-batch's activations). The last stage's outputs of ticks S - 1 .. M + S - 2 are the stack's output. The
backward pass is autodiff of the tick loop (permutes reversed); with remat each layer keeps only its input. The
bubble: a stage idles (S - 1) of M + S - 1 ticks, so more micro-batches waste less.

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


def bubble_fraction(stages, microbatches):
    """Share of a stage's ticks spent idle in the GPipe schedule: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline(layer_fn, params, x, ctx, *, stages, microbatches):
    """The stack `x -> layer_fn(params[L-1], ... layer_fn(params[0], x, ctx, 0, m) ..., ctx, L-1, m)` run as a
    pipeline of `stages` stages over `microbatches` micro-batches of the rows.

    layer_fn(layer params, h [rows, ...], ctx of those rows, layer index, micro-batch index) -> h. params: a pytree
    of [L, ...] arrays; x [B, ...]; ctx: a pytree of [B, ...] arrays (per-row inputs such as segment ids and
    positions). Returns the stack's output [B, ...]."""
    num_layers = jax.tree.leaves(params)[0].shape[0]
    rows = x.shape[0]
    if num_layers % stages:
        raise ValueError(f"a mesh with stage={stages} splits a stack of {num_layers} layers; expected a stage count "
                         f"that divides the number of layers")
    if rows % microbatches:
        raise ValueError(f"pipeline_microbatches={microbatches} does not divide the {rows} rows of the batch; "
                         "expected a divisor of the rows each pipeline step sees")
    per_stage, m_rows = num_layers // stages, rows // microbatches
    split = lambda a: a.reshape(m_rows, microbatches, *a.shape[1:]).swapaxes(0, 1)  # noqa: E731  [M, m_rows, ...]
    inputs, ctx_mb = split(x), jax.tree.map(split, ctx)
    stage_params = jax.tree.map(lambda w: _on_stages(w.reshape(stages, per_stage, *w.shape[1:])), params)
    stage_ids = jnp.arange(stages)

    def run_stage(p, h, c, stage, micro):
        def body(h, layer):
            w, j = layer
            return layer_fn(w, h, c, stage * per_stage + j, micro), None
        return jax.lax.scan(body, h, (p, jnp.arange(per_stage)))[0]

    run = jax.vmap(run_stage, spmd_axis_name=axes.STAGE)

    def tick(previous, t):
        # Stage s > 0 takes what stage s - 1 produced last tick (the roll is the collective-permute); stage 0 the
        # next input micro-batch (past the last one it recomputes it: those results are never read).
        fresh = inputs[jnp.minimum(t, microbatches - 1)]
        first = (stage_ids == 0).reshape((stages,) + (1,) * fresh.ndim)
        h = _on_stages(jnp.where(first, fresh[None], jnp.roll(previous, 1, axis=0)))
        micro = jnp.clip(t - stage_ids, 0, microbatches - 1)
        c = jax.tree.map(lambda a: _on_stages(a[micro]), ctx_mb)
        with kernels.vmapped(axes.STAGE):
            out = _on_stages(run(stage_params, h, c, stage_ids, micro))
        return out, out[stages - 1]

    start = _on_stages(jnp.zeros((stages,) + inputs.shape[1:], x.dtype))
    _, last = jax.lax.scan(tick, start, jnp.arange(microbatches + stages - 1))
    out = last[stages - 1:]  # [M, m_rows, ...]: tick S - 1 + m carries micro-batch m
    out = out.swapaxes(0, 1).reshape(x.shape)
    if rows % stages:
        return out
    # What follows the stack (final norm, head, loss) would run on every row in every stage: give each stage every
    # S-th row instead (row r to stage r mod S keeps a device's rows within its data position).
    out = out.reshape(rows // stages, stages, *x.shape[1:])
    out = jax.lax.with_sharding_constraint(out, P(P.UNCONSTRAINED, axes.STAGE, *[P.UNCONSTRAINED] * (x.ndim - 1)))
    return out.reshape(x.shape)
