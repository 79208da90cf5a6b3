"""The 1F1B schedule of the pipeline over the mesh's `stage` axis (`pipeline_1f1b`): each micro-batch's backward as
soon as it leaves the last stage, the loss inside the pipeline, a `custom_vjp` running every stage's forward and
backward in its ticks' three loops, and its rule for ZeRO-3 shards (`kernels.shard_rules`). The stage count, the
micro-batches' split of the rows, the loop's batch shards and GPipe's forward (its evaluation) are
`models.pipeline`'s.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import kernels
from kernels import axes
from models.pipeline import (_check, _manual_batch_axes, _micro_index, _on_stages, _splitter,  # the schedules' own
                             _whole_on_device, num_ticks, pipeline)


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
