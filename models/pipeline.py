"""Pipeline parallelism for a scanned layer stack over the mesh's `stage` axis: GPipe's schedule, or the interleaved
(circular) one with V virtual stages per device.

The layers are V S chunks of K = L / (V S); chunk j runs on stage j mod S, so stage s holds chunks s, S + s, ..., and
the weights are viewed as [V, S, K, ...] with S over `stage`. With V = 1 (GPipe) the stack's weights are [L, ...] and
that is `engine.auto_shard`'s contiguous split of the layer dim; with V > 1 they are stored [V, L / V, ...]
(`models.layers.stack.stored_rounds`) with the second dim split over `stage`: either way the view is each stage's
own weights. The rows of the batch
are cut into M micro-batches (micro-batch m = rows m, m + M, m + 2M, ...: each device's rows stay its own), and a
micro-batch passes the ring of stages V times. In tick t = 0 .. V M + S - 2 every stage runs one chunk at once
(`jax.vmap` over the stage dim, which the compiler splits over `stage`): stage s on item t - s of its V M (micro-batch
(t - s) mod M in round (t - s) // M); stage 0 takes the next input micro-batch in round 0 and the last stage's output
of the round before after that, the others what the stage before produced in tick t - 1, passed on by a roll of the
stage dim (one collective-permute of one micro-batch's activations). The backward pass is autodiff of the tick loop
(permutes reversed), so all M micro-batches' saved activations are alive at the turn (no 1F1B); with remat each layer
keeps only its input, and no tick keeps its slice of the stage's weights (each layer slices them inside its
checkpoint). The bubble: a stage idles (S - 1) of V M + S - 1 ticks, so more micro-batches and more virtual
stages waste less. A layer may hand sums beside its output (a mixture's router statistics: `pipeline(aux=)`),
which the loop adds up over the items each stage runs, so the stack yields the whole batch's.

The tick loop runs in a shard_map manual over `data` (where its blocks of rows split into the M micro-batches), so
that each device adds up its rows' weight gradients through the backward loop and they are summed over `data` once
a step, not once a tick. `fsdp` inside a stage (ZeRO-3) stays automatic by default (`fsdp_gather='tick'`): each
tick gathers its layers' weight shards and reduce-scatters their gradients, so a device holds 1/fsdp of its stage
at the cost of those collectives every tick. `fsdp_gather='step'` makes `fsdp` manual too: the stage's weights are
gathered once before the loop and their gradients reduced once after it, and every device holds the stage's whole
weights and gradients for the step (MaxText's `pipeline_fsdp_ag_once`, torchtitan's pipeline default). A step
that is manual over `fsdp` itself (the engine's shard_map step, which gathers each weight at its use) gathers each
layer in the tick that reads it out of the stage, as 'tick' does (1F1B's rules through their rule for shards,
`kernels.shard_rules`), and refuses 'step' (held whole before the loop, XLA:TPU's compiler aborted on the stage's
slices). Inside the
shard_map each device draws its own dropout masks: the micro-batch index a layer is handed counts every device's.

Nothing here knows about the engine: the stage count is the size of the ambient mesh's automatic `stage` axis
(`jax.sharding.use_abstract_mesh`, under which the Trainer traces its steps), 1 outside one.
"""
import functools
import math

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


SCHEDULES = ("gpipe", "1f1b")
FSDP_GATHERS = ("tick", "step")  # when a stage's fsdp-split weights are gathered (and their gradients reduced)


def bubble_fraction(stages, microbatches, virtual_stages=1, schedule="gpipe", one_loop=False):
    """Share of a device's time spent idle: (S - 1) / (V M + S - 1) for V virtual stages per device (V = 1: GPipe),
    and 1F1B's the same as GPipe's (its S - 1 first ticks run forwards only and its S - 1 last backwards only, so a
    stage's M + 2S - 2 ticks take the time of M + S - 1 forwards and backwards, as GPipe's), but (2S - 2) /
    (M + 2S - 2) with `one_loop`: its ticks run as one loop of both halves, as they do where the jit step's
    partitioner places a stage's ZeRO-3 gathers (`models.pipeline_1f1b`)."""
    if schedule == "1f1b" and one_loop:
        return 1 - microbatches / num_ticks(stages, microbatches, schedule="1f1b")
    return 1 - microbatches * virtual_stages / num_ticks(stages, microbatches, virtual_stages)


def num_ticks(stages, microbatches, virtual_stages=1, schedule="gpipe"):
    """Ticks of the schedule's loop: V M + S - 1 (each runs L / (V S) layers on every device); 1F1B: M + 2S - 2
    (its S - 1 first a stage's forward each, its S - 1 last a stage's backward, the M between both)."""
    if schedule == "1f1b":
        return microbatches + 2 * stages - 2
    return virtual_stages * microbatches + stages - 1


def pipeline(layer_fn, params, x, ctx, *, stages, microbatches, virtual_stages=1, policy=None, fsdp_gather="tick",
             aux=None):
    """The stack `x -> layer_fn(params[L-1], ... layer_fn(params[0], x, ctx, 0, m) ..., ctx, L-1, m)` run as a
    pipeline of `stages` stages over `microbatches` micro-batches of the rows, each stage `virtual_stages` times
    (V = 1: GPipe; V > 1: the interleaved schedule, which needs microbatches >= stages).

    layer_fn(layer params, h [rows, ...], ctx of those rows, layer index, micro-batch index) -> h; the index is one
    of M x the batch shards (`_micro_index`), for the layer's dropout key. params: a pytree of [L, ...] arrays (V > 1:
    [V, L / V, ...], the interleaved schedule's stored form, `models.layers.stack.stored_rounds`); x [B,
    ...]; ctx: a pytree of [B, ...] arrays (per-row inputs such as segment ids and positions). Each layer runs under
    `jax.checkpoint` with `policy` (None: it keeps only its input; without remat `models.layers.stack`'s, which
    recomputes slices), which must not save the layer's weights: they are sliced inside it. fsdp_gather: 'tick' or
    'step' (the module's docstring).
    Returns the stack's output [B, ...].

    aux: a pytree of zeros (float arrays) when layer_fn returns (h, a layer's aux of that structure), e.g. a mixture
    of experts' router statistics, which are sums: then (the output, aux summed over every layer and micro-batch of
    the whole batch), differentiable like the output (the same sums as the unpipelined stack's layers give)."""
    num_layers = _num_layers(params, virtual_stages)
    rows = x.shape[0]
    _check(num_layers, rows, stages, microbatches, virtual_stages, fsdp_gather)
    loop = functools.partial(_tick_loop, layer_fn, stages=stages, microbatches=microbatches,
                             virtual_stages=virtual_stages, policy=policy, aux=aux)
    # The tick loop runs manual over the batch axes its rows split over: each device accumulates its own rows' weight
    # gradients through the backward loop, and the shard_map's transpose sums them over those axes once (its
    # inputs' cotangents, psummed over the axes their specs leave out), where the partitioner, left to itself,
    # reduced every tick's contribution into a replicated accumulator: V M + S - 1 reductions a step (the tiny LLaMA
    # on stage 2 x data 4 at M = 8: 4.68 MB of all-reduce, models/README.md#the-pipeline).
    manual = _manual_batch_axes(params, rows, microbatches, fsdp_gather)
    if manual:
        rows_spec = P(manual)
        dtypes = jax.tree.map(lambda w: w.dtype, params)
        # The weights enter in float32, so that the one reduction of their gradients is in float32 (XLA:CPU's
        # promotion of a bfloat16 all-reduce aborted on the one the transpose makes: "Invalid binary instruction
        # opcode copy"); inside, the loop runs on them in their own dtype.
        def body(p, x, c):
            out = loop(jax.tree.map(lambda w, d: w.astype(d), p, dtypes), x, c, shard=jax.lax.axis_index(manual))
            # the aux sums of a device's rows, summed over the batch shards: the whole batch's
            return out if aux is None else (out[0], jax.lax.psum(out[1], manual))
        sharded = jax.shard_map(
            body, in_specs=(P(), rows_spec, jax.tree.map(lambda _: rows_spec, ctx)),
            out_specs=rows_spec if aux is None else (rows_spec, jax.tree.map(lambda _: P(), aux)),
            axis_names=set(manual), check_vma=False)
        out = sharded(jax.tree.map(_widened, params), x, ctx)
    else:
        out = loop(params, x, ctx)
    if aux is not None:
        return _spread_rows(out[0], x, stages), out[1]
    return _spread_rows(out, x, stages)


def _spread_rows(out, x, stages):
    """The stack's output out [B, ...] with each stage given every S-th row."""
    rows = x.shape[0]
    if rows % stages:
        return out
    # What follows the stack (final norm, head, loss) would run on every row in every stage: give each stage every
    # S-th row instead (row r to stage r mod S keeps a device's rows within its data position).
    out = out.reshape(rows // stages, stages, *x.shape[1:])
    out = jax.lax.with_sharding_constraint(out, P(P.UNCONSTRAINED, axes.STAGE, *[P.UNCONSTRAINED] * (x.ndim - 1)))
    return out.reshape(x.shape)


def _tick_loop(layer_fn, params, x, ctx, *, stages, microbatches, virtual_stages, policy, aux=None, shard=None):
    """`pipeline`'s tick loop on the rows x [B, ...] (all of them, or a device's inside the shard_map over the batch
    axes, whose index there is `shard`): the stack's output [B, ...], and with `aux` (zeros of layer_fn's aux) its
    sum over the layers of every item the stages ran (not the clipped ones of idle ticks)."""
    num_layers = _num_layers(params, virtual_stages)
    rows, chunks = x.shape[0], stages * virtual_stages
    per_chunk = num_layers // chunks
    split = _splitter(rows, microbatches)
    inputs, ctx_mb = split(x), _whole_on_device(jax.tree.map(split, ctx), shard)
    # [V, L / V, ...] -> [V, S, K, ...] (layer (v S + s) K + k) -> [S, V, K, ...]: stage s's chunks s, S + s, 2S + s,
    # ..., where the stored second dim's split over `stage` already puts them (GPipe's [L] likewise).
    stage_params = jax.tree.map(lambda w: _on_stages(
        w.reshape(virtual_stages, stages, per_chunk, *w.shape[1 if virtual_stages == 1 else 2:]).swapaxes(0, 1)),
        params)
    stage_ids = jnp.arange(stages)

    # Layer j of round rnd's chunk is sliced out of the stage's weights p [V, K, ...] inside the layer's checkpoint,
    # whose policy never saves the slice: the backward slices the loop-invariant p again. Sliced outside (as the
    # layers' xs), autodiff of the tick loop saved every tick's slice: V M + S - 1 copies of a stage's weights
    # (LLaMA-3-8B on stage 8, M = 32: 188 GB of temporaries a device, models/README.md#the-pipeline).
    @functools.partial(jax.checkpoint, policy=policy, prevent_cse=False)
    def layer_of_stage(p, h, c, rnd, j, layer, micro):
        w = jax.tree.map(lambda a: a[rnd, j], p)
        return layer_fn(w, h, c, layer, _micro_index(micro, microbatches, shard))

    def run_stage(p, h, c, stage, micro, rnd):
        chunk = rnd * stages + stage  # the virtual stage this tick runs
        if aux is None:
            def body(h, j):
                return layer_of_stage(p, h, c, rnd, j, chunk * per_chunk + j, micro), None
            return jax.lax.scan(body, h, jnp.arange(per_chunk))[0]

        def body_aux(carry, j):
            h, total = layer_of_stage(p, carry[0], c, rnd, j, chunk * per_chunk + j, micro)
            return (h, jax.tree.map(jnp.add, carry[1], total)), None
        return jax.lax.scan(body_aux, (h, aux), jnp.arange(per_chunk))[0]

    run = jax.vmap(run_stage, spmd_axis_name=axes.STAGE)

    def tick(carry, t):
        (previous, done), total = carry[:2], carry[2:]
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
            out = run(stage_params, h, c, stage_ids, micro, rnd)
        if aux is not None:  # each stage's sums of the item it ran (none in the ticks it idles)
            out, layers_aux = out
            running = (t - stage_ids >= 0) & (t - stage_ids < virtual_stages * microbatches)
            total = (jax.tree.map(lambda a, b: a + jnp.where(running.reshape((stages,) + (1,) * (b.ndim - 1)), b, 0),
                                  total[0], layers_aux),)
        out = _on_stages(out)
        # The last stage's output of its item; its final round's stays as the stack's output.
        finished = t >= stages - 1
        done = done.at[micro[stages - 1]].set(jnp.where(finished, out[stages - 1], done[micro[stages - 1]]))
        if microbatches % stages:  # whole on each stage: propagation split its micro-batch rows over part of
            # `stage`, and XLA's SPMD partitioner (JAX 0.11) aborted on the gather of a micro-batch from it at M = 2
            # on stage 4 x data 2 ("partition_group_list ... Check failed"); JAX 0.10 compiles the same bytes either way
            done = jax.lax.with_sharding_constraint(done, P())
        return (out, done, *total), None

    start = _on_stages(jnp.zeros((stages,) + inputs.shape[1:], x.dtype))
    sums = () if aux is None else (jax.tree.map(lambda a: jnp.zeros((stages,) + jnp.shape(a), jnp.result_type(a)),
                                                aux),)
    (_, done, *sums), _ = jax.lax.scan(tick, (start, jnp.zeros_like(inputs), *sums),
                                       jnp.arange(num_ticks(stages, microbatches, virtual_stages)))
    out = done.swapaxes(0, 1).reshape(x.shape)  # [M, m_rows, ...] -> rows
    return out if aux is None else (out, jax.tree.map(lambda a: a.sum(0), sums[0]))


def _num_layers(params, virtual_stages):
    """L of a stack's weights: [L, ...] for V = 1, stored [V, L / V, ...] for V > 1 (`models.layers.stack`)."""
    shape = jax.tree.leaves(params)[0].shape
    if virtual_stages == 1:
        return shape[0]
    if len(shape) < 2 or shape[0] != virtual_stages:
        raise ValueError(f"pipeline_virtual_stages={virtual_stages} runs a stack stored [{virtual_stages}, layers / "
                         f"{virtual_stages}, ...]; got weights of shape {shape} (models.stack_layers converts)")
    return shape[0] * shape[1]


def _widened(w):
    """w in float32 when it is a narrower float (integer and wider weights as they are)."""
    return w.astype(jnp.float32) if jnp.issubdtype(w.dtype, jnp.floating) and w.dtype.itemsize < 4 else w


def _whole_on_device(ctx, shard):
    """The per-row inputs (segment ids, positions: small integer arrays) whole on each device inside the shard_map
    over the batch axes (`shard` not None), where each device holds only its rows anyway: picking a tick's micro-batch
    from them otherwise made XLA's partitioner abort (jaxlib 0.10.2, "partition_group_list ... Check failed") when
    the rows came in split over the automatic `stage` or `model` axes too (a reward model's completed rows)."""
    if shard is None:
        return ctx
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P()), ctx)


def _micro_index(micro, microbatches, shard):
    """The index a layer is handed for micro-batch `micro` of batch shard `shard` (None outside the shard_map over
    the batch axes): m + M x shard, so that devices holding different rows draw different dropout masks."""
    return micro if shard is None else micro + microbatches * shard


def _manual_batch_axes(params, rows, microbatches, fsdp_gather="tick"):
    """The ambient mesh's automatic batch axes the pipeline's tick loop runs manual over, in mesh order: `data`, and
    `fsdp` with fsdp_gather='step', those larger than 1 (and no vmap's axis: DiLoCo's replicas), when their blocks
    of the rows each split into the M micro-batches (so a device's micro-batch m is its rows of the whole batch's
    micro-batch m) and the weights are traced as on a mesh, else (); with fsdp_gather='step' and `fsdp` > 1 a batch
    whose blocks do not split is refused in one line. A jit of arrays on no mesh under
    `jax.sharding.use_abstract_mesh` compiles for one device, where a shard_map cannot run ("No registered
    implementation for ... xla.sdy.GlobalToLocalShape"). With fsdp_gather='tick' `fsdp` stays automatic: manual,
    the loop needs a stage's whole weights and their gradients on every device."""
    sizes = kernels.automatic_axes()
    names = (axes.DATA, axes.FSDP) if fsdp_gather == "step" else (axes.DATA,)
    manual = tuple(a for a in names if sizes.get(a, 1) > 1)
    if not manual or jax.typeof(jax.tree.leaves(params)[0]).sharding.mesh.empty:
        return ()
    shards = math.prod(sizes[a] for a in manual)
    if rows % (shards * microbatches) == 0:
        return manual
    if axes.FSDP in manual:
        raise ValueError(f"pipeline_fsdp_gather='step' with {rows} rows over {shards} batch shards "
                         f"({' x '.join(f'{a} {sizes[a]}' for a in manual)}) in pipeline_microbatches={microbatches}; "
                         "expected each device's rows to split into the micro-batches, or pipeline_fsdp_gather='tick'")
    return ()


def _check(num_layers, rows, stages, microbatches, virtual_stages, fsdp_gather):
    if fsdp_gather not in FSDP_GATHERS:
        raise ValueError(f"pipeline_fsdp_gather={fsdp_gather!r}; expected one of {FSDP_GATHERS}")
    if fsdp_gather == "step" and kernels.manual_axis_size(axes.FSDP) > 1:
        raise ValueError("pipeline_fsdp_gather='step' inside a step manual over fsdp (the engine's shard_map step, "
                         "which gathers each layer's weights in the tick that runs it); expected 'tick', or the jit "
                         "step to gather a stage's weights once a step")
    if num_layers % (stages * virtual_stages):
        what = f"stage={stages}" + (f" x pipeline_virtual_stages={virtual_stages}" if virtual_stages > 1 else "")
        raise ValueError(f"a mesh with {what} splits a stack of {num_layers} layers; expected a stage count"
                         f"{' x virtual stages' if virtual_stages > 1 else ''} that divides the number of layers")
    if rows % microbatches:
        raise ValueError(f"pipeline_microbatches={microbatches} does not divide the {rows} rows of the batch; "
                         "expected a divisor of the rows each pipeline step sees")
    if virtual_stages > 1 and microbatches < stages:
        raise ValueError(f"pipeline_microbatches={microbatches} with pipeline_virtual_stages={virtual_stages} on "
                         f"stage={stages}; expected at least {stages} micro-batches (one per stage)")


def _splitter(rows, microbatches):
    """[B, ...] -> [M, B / M, ...]: micro-batch m is rows m, m + M, m + 2M, ... (each device's rows stay its own)."""
    return lambda a: a.reshape(rows // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)
