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
import numpy as np
from jax.ad_checkpoint import checkpoint_name
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
    partitioner places a stage's ZeRO-3 gathers (`pipeline_1f1b`)."""
    if schedule == "1f1b" and one_loop:
        return 1 - microbatches / num_ticks(stages, microbatches, schedule="1f1b")
    return 1 - microbatches * virtual_stages / num_ticks(stages, microbatches, virtual_stages)


def num_ticks(stages, microbatches, virtual_stages=1, schedule="gpipe"):
    """Ticks of the schedule's loop: V M + S - 1 (each runs L / (V S) layers on every device); 1F1B: M + 2S - 2
    (its S - 1 first a stage's forward each, its S - 1 last a stage's backward, the M between both)."""
    if schedule == "1f1b":
        return microbatches + 2 * stages - 2
    return virtual_stages * microbatches + stages - 1


_STAGE_WEIGHTS = "pipeline_stage_weights"
# The checkpoint policy of layers without remat: every intermediate saved but the layer's slice of the stage's weights.
SAVE_ALL_BUT_WEIGHTS = jax.checkpoint_policies.save_anything_except_these_names(_STAGE_WEIGHTS)


def pipeline(layer_fn, params, x, ctx, *, stages, microbatches, virtual_stages=1, policy=None, fsdp_gather="tick",
             aux=None):
    """The stack `x -> layer_fn(params[L-1], ... layer_fn(params[0], x, ctx, 0, m) ..., ctx, L-1, m)` run as a
    pipeline of `stages` stages over `microbatches` micro-batches of the rows, each stage `virtual_stages` times
    (V = 1: GPipe; V > 1: the interleaved schedule, which needs microbatches >= stages).

    layer_fn(layer params, h [rows, ...], ctx of those rows, layer index, micro-batch index) -> h; the index is one
    of M x the batch shards (`_micro_index`), for the layer's dropout key. params: a pytree of [L, ...] arrays; x [B,
    ...]; ctx: a pytree of [B, ...] arrays (per-row inputs such as segment ids and positions). Each layer runs under
    `jax.checkpoint` with `policy` (None: it keeps only its input; without remat `SAVE_ALL_BUT_WEIGHTS`), which must
    not save the layer's weights: they are sliced inside it. fsdp_gather: 'tick' or 'step' (the module's docstring).
    Returns the stack's output [B, ...].

    aux: a pytree of zeros (float arrays) when layer_fn returns (h, a layer's aux of that structure), e.g. a mixture
    of experts' router statistics, which are sums: then (the output, aux summed over every layer and micro-batch of
    the whole batch), differentiable like the output (the same sums as the unpipelined stack's layers give)."""
    num_layers = jax.tree.leaves(params)[0].shape[0]
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
    num_layers = jax.tree.leaves(params)[0].shape[0]
    rows, chunks = x.shape[0], stages * virtual_stages
    per_chunk = num_layers // chunks
    split = _splitter(rows, microbatches)
    inputs, ctx_mb = split(x), _whole_on_device(jax.tree.map(split, ctx), shard)
    # [L, ...] -> [V, S, K, ...] (layer (v S + s) K + k) -> [S, V, K, ...]: stage s's chunks s, S + s, 2S + s, ...
    stage_params = jax.tree.map(lambda w: _on_stages(
        w.reshape(virtual_stages, stages, per_chunk, *w.shape[1:]).swapaxes(0, 1)), params)
    stage_ids = jnp.arange(stages)

    # Layer j of round rnd's chunk is sliced out of the stage's weights p [V, K, ...] inside the layer's checkpoint,
    # whose policy never saves the slice: the backward slices the loop-invariant p again. Sliced outside (as the
    # layers' xs), autodiff of the tick loop saved every tick's slice: V M + S - 1 copies of a stage's weights
    # (LLaMA-3-8B on stage 8, M = 32: 188 GB of temporaries a device, models/README.md#the-pipeline).
    @functools.partial(jax.checkpoint, policy=policy, prevent_cse=False)
    def layer_of_stage(p, h, c, rnd, j, layer, micro):
        w = jax.tree.map(lambda a: checkpoint_name(a[rnd, j], _STAGE_WEIGHTS), p)
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
        return (out, done, *total), None

    start = _on_stages(jnp.zeros((stages,) + inputs.shape[1:], x.dtype))
    sums = () if aux is None else (jax.tree.map(lambda a: jnp.zeros((stages,) + jnp.shape(a), jnp.result_type(a)),
                                                aux),)
    (_, done, *sums), _ = jax.lax.scan(tick, (start, jnp.zeros_like(inputs), *sums),
                                       jnp.arange(num_ticks(stages, microbatches, virtual_stages)))
    out = done.swapaxes(0, 1).reshape(x.shape)  # [M, m_rows, ...] -> rows
    return out if aux is None else (out, jax.tree.map(lambda a: a.sum(0), sums[0]))


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


def pipeline_1f1b(layer_fn, tail_fn, params, x, ctx, tail_params, tail_inputs, *, stages, microbatches,
                  fsdp_gather="tick", layer_inputs=(), full_remat=False, aux=None):
    """`tail_fn(tail_params, stack(x), tail_inputs)` with the stack of `pipeline` (V = 1) run on the 1F1B schedule:
    (loss, aux), each summed over the micro-batches, differentiable in params, x and tail_params.

    tail_fn(tail_params, h [rows, ...], tail_inputs of those rows) -> (loss, aux): what follows the stack (final norm,
    head, the loss of those rows), a sum over rows (a mean divides by the whole batch's count), so the micro-batches'
    add up to the batch's; aux (metrics) has no gradient. tail_inputs: a pytree of [B, ...] arrays (labels).
    layer_inputs: a pytree of arrays `layer_fn` takes as a sixth argument (a dropout key, per-layer values: what it
    would otherwise close over), not differentiated. full_remat: `layer_fn` is a `jax.checkpoint` that saves nothing
    (its backward recomputes it from its input). Neither function may close over a traced value: the custom_vjp
    rules run them, and a rule closing over a value traced outside it fails where the engine's shard_map step
    re-traces the loss's equations (engine/step/gathering.py).

    Differentiated (a custom_vjp), the forward runs the whole schedule and keeps the gradients, scaled by the loss's
    cotangent in the backward. Tick t = 0 .. M + 2S - 3: every stage (vmapped over the stage dim, as in `pipeline`)
    runs the forward of micro-batch t - s and the backward of micro-batch t - 2(S - 1) + s: the micro-batch leaving
    the last stage goes through `jax.vjp(tail_fn)` in the same tick, whose gradient in h starts its backward there;
    stage s < S - 1 takes the input gradient stage s + 1 made last tick (a roll the other way). A stage keeps what
    its backward needs of the micro-batches between their forward and their backward (the stage's input, or with
    `full_remat` every layer's): 2 (S - 1 - s) + 1 of them, in a ring of R = min(2S - 1, M) slots (GPipe keeps all
    M); slot t mod R takes tick t's. The loop runs M + 2S - 2 ticks in three phases (`_phases_1f1b`): the
    first S - 1 forwards only (no micro-batch has reached its backward), the last S - 1 backwards only (every one has
    left its forward), so a stage computes for as long as GPipe's M + S - 1 forward and M + S - 1 backward ticks
    take (run as one lock-step loop, every tick a forward and a backward, it took M + 2S - 2 of each; it still does
    beside an automatic `fsdp`, where XLA's partitioner moved weights in the loops of one half). The loop runs manual
    over the batch axes as `pipeline`'s (`fsdp_gather`): each device adds up its rows' gradients, summed over those
    axes once, in float32, after the loop. Not differentiated (evaluation), it is `pipeline` and then the tail. Where
    the stage's weights arrive as ZeRO-3 shards (the engine's shard_map step, through the rule this registers:
    `kernels.shard_rules`), each tick gathers the layers it runs one at a time and reduce-scatters their gradients
    into float32 sums of the shards' size; as those sums add up the devices' parts, which the step weighs (its
    cotangent, a device's share of the tokens) before the sum, that rule's forward computes the loss alone and its
    backward runs the schedule from the cotangent. With
    `full_remat` the backward runs that way too, layer by layer, each layer's gradient added into the sums' slice:
    no stage-sized gradient per tick, and no more computation (a checkpoint saving nothing recomputes its layer in
    either form; without it, or saving some of it, the stage is differentiated at once, its forward run once).

    aux: as `pipeline`'s (layer_fn then returns (h, a layer's aux), a mixture's router statistics): the result is
    (loss, metrics, the aux summed over every layer and micro-batch), for a loss of the whole batch's sums outside
    it. As those sums are complete only after every forward, the forward rule computes the loss and the sums
    (GPipe's forward) and the backward rule runs the schedule from both cotangents: a forward of the stack more."""
    num_layers = jax.tree.leaves(params)[0].shape[0]
    rows = x.shape[0]
    _check(num_layers, rows, stages, microbatches, 1, fsdp_gather)
    # The ring: 2S - 1 slots, or M where fewer micro-batches are ever in flight (then a stage writes a slot only
    # for a micro-batch it runs, so that no idle tick overwrites one still to be read).
    per_chunk, ring = num_layers // stages, min(2 * stages - 1, microbatches)
    # Host constants, not traced values: the custom_vjp's rules below close over them, and a rule closing over a
    # value traced outside it fails where the step re-traces the loss's equations (engine.step.gathering).
    stage_ids = np.arange(stages, dtype=np.int32)
    last = stage_ids == stages - 1

    def run_stage(p, h, c, stage, micro, extra):
        """The stage's output, and with `aux` (h, its layers' aux summed)."""
        def body(carry, layer):
            w, j = layer
            out = layer_fn(w, carry[0], c, stage * per_chunk + j, micro, extra)
            return ((out, None) if aux is None else (out[0], jax.tree.map(jnp.add, carry[1], out[1]))), None
        out = jax.lax.scan(body, (h, aux), (p, jnp.arange(per_chunk)))[0]
        return out[0] if aux is None else out

    def stage_grads(p, h, c, stage, micro, extra, dout, d_aux=None):
        pull = jax.vjp(lambda p, h: run_stage(p, h, c, stage, micro, extra), p, h)[1]
        return pull(dout if aux is None else (dout, d_aux))

    def layerwise_pass(gathers, shard, d_aux=None):
        """`stage_pass` for stage weights p [S, K, ...] some of which may be ZeRO-3 shards (`gathers`: per leaf of
        p, its `kernels.shard_rules` shard or None). The forward runs the layers in order, each layer's slice [S, ...]
        gathered, and keeps every layer's input [S, K, ...] (the ring holds them until the micro-batch's backward);
        the backward runs the layers in reverse, each gathered again, recomputed from its kept input and
        differentiated in the shards (the gather's backward reduce-scatters the layer's gradient to them), and adds
        that gradient into the sums' slice of the layer. A stage holds one layer whole at a time and no gradient of
        the stage's size but the sums. With `aux` the forward's output is (h, the layers' aux summed [S, ...]) and
        the backward takes `d_aux` (each stage's cotangent of it, [S, ...]) beside h's."""
        def layer_of(p, j):
            """Layer j's slice [S, ...] of each leaf of p (shards where they are)."""
            return [jax.lax.dynamic_index_in_dim(a, j, axis=1, keepdims=False) for a in jax.tree.leaves(p)]

        def run(w, h, c, micro, j, extra):
            """Layer j of every stage on h [S, rows, ...]."""
            one = jax.vmap(lambda w, h, c, stage, micro: layer_fn(
                w, h, c, stage * per_chunk + j, _micro_index(micro, microbatches, shard), extra),
                spmd_axis_name=axes.STAGE)
            with kernels.vmapped(axes.STAGE):
                return one(w, h, c, stage_ids, micro)

        def stage_pass(p, h, c, micro, extra, forward=True):
            out = entering = None
            if forward:
                def layer_forward(carry, j):
                    out = run(_gathered(p, layer_of(p, j), gathers), carry[0], c, micro, j, extra)
                    if aux is None:
                        return (out, None), carry[0]
                    return (out[0], jax.tree.map(jnp.add, carry[1], out[1])), carry[0]

                zeros = None if aux is None else jax.tree.map(lambda a: jnp.zeros((stages,) + a.shape, a.dtype), aux)
                out, entering = jax.lax.scan(layer_forward, (h, zeros), jnp.arange(per_chunk))
                out = out[0] if aux is None else out
                entering = entering.swapaxes(0, 1)  # [K, S, ...] -> [S, K, ...]: the stage dim first, as the ring's

            def backward(stored, c_back, back, d_h, grads, on):
                kept = stored.swapaxes(0, 1)  # each layer's input of micro-batches `back`, [K, S, ...]

                def layer(carry, j):
                    d, grads = carry
                    _, pull = jax.vjp(lambda sliced, r: run(_gathered(p, sliced, gathers), r, c_back, back, j, extra),
                                      layer_of(p, j), kept[j])
                    d_sliced, d = pull(d if aux is None else (d, _on_schedule(d_aux, on)))
                    grads = jax.tree.unflatten(jax.tree.structure(grads), [
                        jax.lax.dynamic_update_index_in_dim(
                            a, jax.lax.dynamic_index_in_dim(a, j, axis=1) + jnp.where(
                                _along(on, g.ndim + 1), g[:, None], 0).astype(a.dtype), j, axis=1)
                        for a, g in zip(jax.tree.leaves(grads), d_sliced)])
                    return (d, grads), None

                (d_in, grads), _ = jax.lax.scan(layer, (d_h, grads), jnp.arange(per_chunk), reverse=True)
                return grads, d_in

            return out, entering, backward

        return stage_pass

    read_slot = jax.vmap(lambda ring_, i: jax.lax.dynamic_index_in_dim(ring_, i, keepdims=False),
                         spmd_axis_name=axes.STAGE)

    def one_f_one_b(params, x, tail_params, ctx, tail_inputs, extra, gathers=None, seed=None, d_aux=None):
        """(loss, aux), (the gradients of params, x and tail_params, in their dtypes); `gathers`: as
        `layerwise_pass`' (params are then the shards' local parts); seed: the loss's cotangent the backward starts
        from (None: 1); d_aux: with `aux`, the cotangent of the layers' aux sums."""
        results, (grads, dx, tail_grads) = on_batch_shards(params, x, tail_params, ctx, tail_inputs, extra, gathers,
                                                           seed, d_aux)
        in_dtypes = functools.partial(jax.tree.map, lambda g, w: g.astype(w.dtype))
        return results, (in_dtypes(grads, params), dx, in_dtypes(tail_grads, tail_params))

    def on_batch_shards(params, x, tail_params, ctx, tail_inputs, extra, gathers=None, seed=None, d_aux=None):
        manual = _manual_batch_axes(params, rows, microbatches, fsdp_gather)
        # With `data` manual and the rows also split over an automatic `fsdp`, XLA's partitioner aborts on the tail's
        # gathers (jaxlib 0.10.2: "partition_group_list ... Check failed"): there the loop stays automatic.
        if kernels.automatic_axes().get(axes.FSDP, 1) > 1 and axes.FSDP not in manual:
            manual = ()
        if not manual:
            return local_1f1b(params, x, tail_params, ctx, tail_inputs, extra, gathers=gathers, seed=seed,
                              d_aux=d_aux)
        assert gathers is None, "shards come from a step manual over the batch axes"  # on_shards checked it
        rows_spec = P(manual)

        def on_shard(params, x, tail_params, ctx, tail_inputs, extra, seed, d_aux):
            (loss, metrics), (grads, dx, tail_grads) = local_1f1b(params, x, tail_params, ctx, tail_inputs, extra,
                                                              shard=jax.lax.axis_index(manual), seed=seed,
                                                              d_aux=d_aux)
            total = functools.partial(jax.tree.map, lambda a: jax.lax.psum(a, manual))
            return total((loss, metrics)), (total(grads), dx, total(tail_grads))

        along_rows = lambda tree: jax.tree.map(lambda _: rows_spec, tree)  # noqa: E731
        replicated = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
        return jax.shard_map(on_shard, in_specs=(P(), rows_spec, P(), along_rows(ctx), along_rows(tail_inputs),
                                                 replicated(extra), replicated(seed), replicated(d_aux)),
                             out_specs=((P(), P()), (P(), rows_spec, P())), axis_names=set(manual),
                             check_vma=False)(params, x, tail_params, ctx, tail_inputs, extra, seed, d_aux)

    def local_1f1b(params, x, tail_params, ctx, tail_inputs, extra, shard=None, gathers=None, seed=None, d_aux=None):
        """(loss, aux), (float32 gradients of params, of x, float32 of tail_params) of the rows x (all of them, or a
        device's inside the shard_map over the batch axes, whose index there is `shard`); `gathers`: as
        `layerwise_pass`'; seed, d_aux: as `one_f_one_b`'s."""
        at_shard = lambda fn: lambda p, h, c, stage, micro, *rest: fn(  # noqa: E731
            p, h, c, stage, _micro_index(micro, microbatches, shard), *rest)

        def in_stages(fn, in_axes):
            vmapped = jax.vmap(at_shard(fn), in_axes=in_axes, spmd_axis_name=axes.STAGE)

            def run(*args):
                with kernels.vmapped(axes.STAGE):
                    return vmapped(*args)
            return run

        forward_all = in_stages(run_stage, (0, 0, 0, 0, 0, None))
        backward_all = in_stages(stage_grads, (0, 0, 0, 0, 0, None, 0) + (() if aux is None else (0,)))

        def stage_pass(p, h, c, micro, extra, forward=True):
            """(every stage's forward of micro-batches `micro` from h, what the ring keeps of them until their
            backward (here h), both None where not `forward`; `backward(stored, c_back, back, d_h, grads, on)`: the
            backward of micro-batches `back` from what the ring kept of them, recomputed, given their output gradient
            d_h: (the gradient sums `grads` plus p's gradient in the stages where `on`, the input's gradient))."""
            out = forward_all(p, h, c, stage_ids, micro, extra) if forward else None

            def backward(stored, c_back, back, d_h, grads, on):
                per_stage = () if aux is None else (_on_schedule(d_aux, on),)
                d_params, d_in = backward_all(p, stored, c_back, stage_ids, back, extra, d_h, *per_stage)
                return jax.tree.map(lambda a, g: a + jnp.where(_along(on, g.ndim), g, 0), grads, d_params), d_in
            return out, h, backward

        layerwise = gathers is not None or full_remat
        if layerwise:
            stage_pass = layerwise_pass(gathers or [None] * len(jax.tree.leaves(params)), shard, d_aux)
        split = _splitter(x.shape[0], microbatches)
        inputs = split(x)
        ctx_mb, tail_mb = _whole_on_device((jax.tree.map(split, ctx), jax.tree.map(split, tail_inputs)), shard)
        stage_params = jax.tree.map(lambda w: _on_stages(w.reshape(stages, per_chunk, *w.shape[1:])), params)

        def tick(carry, t, forward, backward):
            """Tick t of a phase: `forward` (a micro-batch enters some stage) and `backward` (one leaves some stage
            backward) are the phase's, False where no stage has that half to run."""
            previous, grad_in, saved, grads, tail_grads, dx, loss, metrics = carry
            # Forward: stage s on micro-batch t - s, what the ring keeps of it (its input, or every layer's) in slot
            # t mod R (whose micro-batch finished its backward on this stage at least one tick ago).
            micro = jnp.clip(t - stage_ids, 0, microbatches - 1)
            h = None
            if forward:
                h = _on_stages(jnp.where(_along(stage_ids == 0, inputs.ndim), inputs[micro[0]][None],
                                         jnp.roll(previous, 1, axis=0)))
            out, keep, stage_grads_of = stage_pass(stage_params, h, jax.tree.map(lambda a: a[micro], ctx_mb), micro,
                                                   extra, forward=forward)
            if forward and aux is not None:  # the aux sums are the forward rule's (`forward_loss`)
                out = out[0]
            if forward:
                if ring < 2 * stages - 1:
                    running = (t - stage_ids >= 0) & (t - stage_ids < microbatches)
                    keep = jnp.where(_along(running, keep.ndim), keep,
                                     jax.lax.dynamic_index_in_dim(saved, t % ring, axis=1, keepdims=False))
                saved = _on_stages(jax.lax.dynamic_update_index_in_dim(saved, keep, t % ring, axis=1))
            if not backward:
                return (_on_stages(out), grad_in, saved, grads, tail_grads, dx, loss, metrics), None
            d_h = jnp.roll(grad_in, -1, axis=0)
            if forward:
                # The tail on the micro-batch leaving the last stage (one does in every tick with both halves); its
                # gradient in h starts that micro-batch's backward in this tick.
                out = _on_stages(out)
                leaving = t - (stages - 1)
                tail_on = (leaving >= 0) & (leaving < microbatches)
                leaving = jnp.clip(leaving, 0, microbatches - 1)
                part, pull, part_aux = jax.vjp(
                    lambda tp, h: tail_fn(tp, h, jax.tree.map(lambda a: a[leaving], tail_mb)), tail_params,
                    out[stages - 1], has_aux=True)
                d_tail, d_out = pull(jnp.ones_like(part) if seed is None else jnp.full_like(part, seed))
                d_h = jnp.where(_along(last, grad_in.ndim), d_out[None], d_h)
                tail_grads = jax.tree.map(lambda a, g: a + jnp.where(tail_on, g, 0), tail_grads, d_tail)
                loss, metrics = jax.tree.map(lambda a, v: a + jnp.where(tail_on, v, 0), (loss, metrics),
                                             (part, part_aux))
            else:
                out = previous
            # Backward: stage s on micro-batch t - 2(S - 1) + s, from what the ring kept of it (written in tick
            # t - 2(S - 1 - s)); off the schedule its output gradient is zero and its gradients are dropped.
            back = t - 2 * (stages - 1) + stage_ids
            back_on = (back >= 0) & (back < microbatches)
            back = jnp.clip(back, 0, microbatches - 1)
            stored = _on_stages(read_slot(saved, (t - 2 * (stages - 1 - stage_ids)) % ring))
            grads, d_in = stage_grads_of(stored, jax.tree.map(lambda a: a[back], ctx_mb), back,
                                         _on_stages(jnp.where(_along(back_on, d_h.ndim), d_h, 0)), grads, back_on)
            dx = dx.at[back[0]].set(jnp.where(back_on[0], d_in[0], dx[back[0]]))
            return (out, _on_stages(d_in), saved, grads, tail_grads, dx, loss, metrics), None

        # Gradients add up in float32 (M micro-batches' worth; bfloat16 parameters would lose the small ones).
        def zeros(tree, dtype=None):
            return jax.tree.map(lambda a: jnp.zeros(a.shape, dtype or a.dtype), tree)

        results = jax.eval_shape(lambda tp, h: tail_fn(tp, h, jax.tree.map(lambda a: a[0], tail_mb)), tail_params,
                                 inputs[0])
        start = _on_stages(jnp.zeros((stages,) + inputs.shape[1:], x.dtype))
        # The ring: a stage's input of each micro-batch in flight, or (layer by layer) every layer's input of it.
        kept_shape = (stages, ring) + ((per_chunk,) if layerwise else ()) + inputs.shape[1:]
        carry = (start, start, _on_stages(jnp.zeros(kept_shape, x.dtype)),
                 jax.tree.map(_on_stages, zeros(stage_params, jnp.float32)), zeros(tail_params, jnp.float32),
                 jnp.zeros_like(inputs), *zeros(results))
        # Where XLA's partitioner places the loop's ZeRO-3 gathers (an automatic `fsdp` in the jit step), it moved
        # weights in the loops of one half where it moved activations in the loop of both (LLaMA-3-70B on stage 8
        # x fsdp 8 x model 8, XLA:GPU: 97.1 GB sent a step against 23.0, models/README.md#the-pipeline): there the
        # ticks stay one loop.
        phased = gathers is not None or kernels.automatic_axes().get(axes.FSDP, 1) == 1
        for first, stop, forward, backward in _phases_1f1b(stages, microbatches, phased):
            if stop > first:
                carry, _ = jax.lax.scan(functools.partial(tick, forward=forward, backward=backward), carry,
                                        jnp.arange(first, stop))
        _, _, _, grads, tail_grads, dx, loss, metrics = carry
        grads = jax.tree.map(lambda g, w: g.reshape(w.shape), grads, params)
        dx = dx.swapaxes(0, 1).reshape(x.shape)
        return (loss, metrics), (grads, dx, tail_grads)

    def forward_loss(params, x, tail_params, ctx, tail_inputs, extra, gathers):
        """(loss, aux) of the stage weights' shards (local parts, `gathers` as `layerwise_pass`'), each layer
        gathered in the tick that runs it: the schedule's M + S - 1 forward ticks, each micro-batch through the tail
        as it leaves the last stage; with `aux`, (loss, aux, the layers' aux summed over the batch)."""
        stage_pass = layerwise_pass(gathers, None)
        split = _splitter(x.shape[0], microbatches)
        inputs, ctx_mb, tail_mb = split(x), jax.tree.map(split, ctx), jax.tree.map(split, tail_inputs)
        stage_params = jax.tree.map(lambda w: _on_stages(w.reshape(stages, per_chunk, *w.shape[1:])), params)

        def tick(carry, t):
            previous, results = carry
            micro = jnp.clip(t - stage_ids, 0, microbatches - 1)
            h = _on_stages(jnp.where(_along(stage_ids == 0, inputs.ndim), inputs[micro[0]][None],
                                     jnp.roll(previous, 1, axis=0)))
            out = stage_pass(stage_params, h, jax.tree.map(lambda a: a[micro], ctx_mb), micro, extra)[0]
            if aux is not None:  # each stage's sums of the micro-batch it ran (none in the ticks it idles)
                out, sums = out
                running = (t - stage_ids >= 0) & (t - stage_ids < microbatches)
                results = (*results[:2], jax.tree.map(lambda a, b: a + jnp.where(_along(running, b.ndim), b, 0).sum(0),
                                                      results[2], sums))
            out = _on_stages(out)
            leaving = t - (stages - 1)
            on = (leaving >= 0) & (leaving < microbatches)
            part = tail_fn(tail_params, out[stages - 1],
                           jax.tree.map(lambda a: a[jnp.clip(leaving, 0, microbatches - 1)], tail_mb))
            return (out, (*jax.tree.map(lambda a, v: a + jnp.where(on, v, 0), results[:2], part), *results[2:])), None

        results = jax.eval_shape(lambda tp, h: tail_fn(tp, h, jax.tree.map(lambda a: a[0], tail_mb)), tail_params,
                                 inputs[0])
        results = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), results)
        start = _on_stages(jnp.zeros((stages,) + inputs.shape[1:], x.dtype))
        carry = (start, tuple(results) + (() if aux is None else (jax.tree.map(jnp.asarray, aux),)))
        return jax.lax.scan(tick, carry, jnp.arange(num_ticks(stages, microbatches)))[0][1]

    def evaluate(params, x, tail_params, ctx, tail_inputs, extra):
        out = pipeline(lambda w, h, c, layer, micro: layer_fn(w, h, c, layer, micro, extra), params, x, ctx,
                       stages=stages, microbatches=microbatches, fsdp_gather=fsdp_gather, aux=aux)
        if aux is None:
            return tail_fn(tail_params, out, tail_inputs)
        return (*tail_fn(tail_params, out[0], tail_inputs), out[1])

    run = jax.custom_vjp(evaluate)
    if aux is None:
        def backward(grads, cotangent):  # this call's own function: the key of its shard rule
            return _scaled_by_cotangent(grads, cotangent)

        run.defvjp(one_f_one_b, backward)
    else:
        # The aux sums (a mixture's router statistics) are an output beside the loss, and what the caller makes of
        # them (its router losses, of the whole batch's sums) is known only by their cotangent: the forward rule
        # computes the loss and the sums, and the backward runs the schedule from both cotangents, a forward of the
        # stack more.
        def forward_rule(*inputs):
            return evaluate(*inputs), inputs

        def backward(inputs, cotangent):  # the key of its shard rule
            return (*one_f_one_b(*inputs, seed=cotangent[0], d_aux=cotangent[2])[1], None, None, None)

        run.defvjp(forward_rule, backward)
    in_tree = jax.tree.structure((params, x, tail_params, ctx, tail_inputs, layer_inputs))

    def on_shards(inputs):
        """`kernels.shard_rules`' rule (the engine's shard_map step, its ZeRO-3 shards still split): the stage's
        weights enter as the shards' local parts and each tick gathers the layers it runs one at a time, their
        gradients reduce-scattered to the shards layer by layer and summed there (`layerwise_pass`), instead of the
        stage's weights and their float32 gradients held whole for the step. Other split inputs (the tail's) are
        gathered whole, as the step would."""
        params, x, tail_params, ctx, tail_inputs, extra = jax.tree.unflatten(in_tree, inputs)
        leaves, tree = jax.tree.flatten(params, is_leaf=kernels.is_shard)
        gathers = [v if kernels.is_shard(v) else None for v in leaves]  # the rules below use their gather only
        local = jax.tree.unflatten(tree, [v.local if kernels.is_shard(v) else v for v in leaves])
        if not any(g is not None for g in gathers) or _manual_batch_axes(local, rows, microbatches, fsdp_gather):
            return None
        x, tail_params, ctx, tail_inputs, extra = jax.tree.map(
            lambda v: v.gather(v.local) if kernels.is_shard(v) else v, (x, tail_params, ctx, tail_inputs, extra),
            is_leaf=kernels.is_shard)

        def whole(local, *rest):
            return evaluate(_gathered(local, jax.tree.leaves(local), gathers), *rest)

        # The shards' gradients are reduce-scattered as each layer's backward runs, and a device's share of the step's
        # loss (its cotangent: the shard_map step weighs a device's mean by its tokens) must scale its part before
        # that sum, not the sum after it (as the rule for whole weights does): the forward rule computes only the
        # loss, and the backward rule runs the schedule from the cotangent, a forward of the stack more.
        def forward(local, *rest):
            return forward_loss(local, *rest, gathers=gathers), (local, *rest)

        def from_cotangent(inputs, cotangent):
            return (*one_f_one_b(*inputs, gathers=gathers, seed=cotangent[0],
                                 d_aux=None if aux is None else cotangent[2])[1], None, None, None)

        on_local = jax.custom_vjp(whole)
        on_local.defvjp(forward, from_cotangent)
        return jax.tree.leaves(on_local(local, x, tail_params, ctx, tail_inputs, extra))

    kernels.register_shard_rule(backward, on_shards)
    return run(params, x, tail_params, ctx, tail_inputs, layer_inputs)


def _phases_1f1b(stages, microbatches, phased=True):
    """1F1B's tick loops (first tick, end, forward, backward): the S - 1 ticks before the first micro-batch reaches
    the last stage run forwards only, the S - 1 after the last one left it backwards only, the M between both (and
    the tail): every stage's ticks then add up to GPipe's M + S - 1 forwards and backwards. At S = 2 the last tick
    stays in the loop before it (its forward masked): XLA inlines a loop of one tick, and that tick run outside a
    loop held more temporaries than the loop (tests/test_pipeline_1f1b.py's shape: 3.44 MB against 2.58), which the
    first tick does not. Not `phased`: one loop, every tick both halves, the inactive ones masked."""
    ticks = num_ticks(stages, microbatches, schedule="1f1b")
    if not phased:
        return ((0, ticks, True, True),)
    drain = microbatches + stages - 1 if stages > 2 else ticks
    return ((0, stages - 1, True, False), (stages - 1, drain, True, True), (drain, ticks, False, True))


def _gathered(like, leaves, gathers):
    """The tree of `like` with `leaves` (its leaves, or a layer's slices of them), each gathered whole where `gathers`
    holds its `kernels.shard_rules` shard."""
    return jax.tree.unflatten(jax.tree.structure(like), [g.gather(a) if g is not None else a
                                                         for a, g in zip(leaves, gathers)])


def _scaled_by_cotangent(grads, cotangent):
    """1F1B's backward rule: the gradients its forward rule computed (of the weights, the input and the tail's
    weights), scaled by the loss's cotangent; none for the per-row inputs and the layer inputs."""
    scale = cotangent[0]
    return (*jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), None, None, None)


def _on_schedule(d_aux, on):
    """The aux cotangent d_aux (one for every stage) as each stage's [S, ...]: zero where a stage is off the schedule
    (`on` [S])."""
    return jax.tree.map(lambda a: jnp.where(_along(on, a.ndim + 1), a[None], 0).astype(a.dtype), d_aux)


def _along(mask, ndim):
    """A [S] mask broadcastable against [S, ...] arrays of `ndim` dims."""
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))
