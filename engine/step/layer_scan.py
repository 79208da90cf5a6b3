"""A remat'd scan over stacked ZeRO-3 layer weights, software-pipelined by hand (`pipelined_scan`): each
iteration's collective runs beside the previous layer's compute, in the forward and the backward pass."""
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from engine.sharding import scan_counts
from engine.step.collectives import all_gather, reduce_scatter
from engine.step.shards import Sharded, bind_eqn, full


def is_remat_layer_stack(eqn, invals):
    """A scan over stacked ZeRO-3 weights whose body is one fully rematerialised block (a model built with
    scan-over-layers and remat='full'): the case `pipelined_scan` handles."""
    p = eqn.params
    stacked = [x for x in invals[sum(scan_counts(p)):] if isinstance(x, Sharded)]
    body = p["jaxpr"].jaxpr.eqns
    return (bool(stacked) and all(dim > 0 for x in stacked for dim, _ in x.dims) and len(body) == 1
            and body[0].primitive.name in ("checkpoint", "remat", "remat2") and body[0].params.get("policy") is None)


def _eval_inlined(jaxpr, consts, args):
    """`jax.core.eval_jaxpr` with remat regions inlined: the caller already keeps only the layer's input."""
    from jax.extend import core as jex_core
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
            outs = _eval_inlined(eqn.params["jaxpr"], (), invals)
        else:
            outs = bind_eqn(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def pipelined_scan(eqn, invals, in_remat):
    """A remat'd layer stack over ZeRO-3 shards, software-pipelined by hand (one `custom_vjp`):

      forward   iteration t: all-gather layer t+1's weights | run layer t with the weights gathered last iteration
      backward  iteration t: all-gather layer t-1's weights | reduce-scatter layer t+1's weight gradient |
                             recompute layer t from its saved input and back-propagate through it

    The collective of each iteration does not depend on its compute, so the scheduler can run them side by side (on
    GPU the latency-hiding scheduler overlaps them; see engine/compiler.py). Only each layer's input is saved (what
    remat='full' keeps); at most two layers' gathered weights and two layers' full-size gradients are alive at once.
    The first and last iterations are peeled so that no collective is issued twice. Only the inputs being
    differentiated get gradients (the custom_vjp sees symbolic zeros): a frozen weight (`Trainer(trainable=...)`)
    is gathered for each layer but gets no weight gradient and no reduce-scatter."""
    del in_remat  # the layer's own remat is replaced by this schedule
    p = eqn.params
    (n_consts, n_carry), n, reverse = scan_counts(p), p["length"], p["reverse"]
    body = p["jaxpr"]
    consts = [full(x) for x in invals[:n_consts]]
    init = [full(x) for x in invals[n_consts:n_consts + n_carry]]
    xs = invals[n_consts + n_carry:]
    is_w = [isinstance(x, Sharded) for x in xs]
    slots = [x.layer() for x in xs if isinstance(x, Sharded)]
    plain = [x for x in xs if not isinstance(x, Sharded)]
    stacked = [x.local for x in xs if isinstance(x, Sharded)]
    position = lambda t: n - 1 - t if reverse else t  # noqa: E731 - iteration t runs layer position(t)
    at = lambda x, t: jax.lax.dynamic_index_in_dim(x, position(t), 0, keepdims=False)  # noqa: E731

    def gather(ws, t):
        return [all_gather(at(w, t), s.dims, s.dtype, s.int8.weights) for w, s in zip(ws, slots)]

    def layer(consts, carry, x_plain, gathered):
        x_plain, gathered, x = iter(x_plain), iter(gathered), []
        for i, w in enumerate(is_w):
            if w:
                x.append(slots[sum(is_w[:i])].apply_casts(next(gathered)))
            else:
                x.append(next(x_plain))
        outs = _eval_inlined(body.jaxpr, body.consts, list(consts) + list(carry) + x)
        return outs[:n_carry], outs[n_carry:]

    def forward(consts, init, plain, ws):
        def step(state, t, prefetch):
            carry, w = state
            nxt = gather(ws, t + 1) if prefetch else None
            carry_out, y = layer(consts, carry, [at(x, t) for x in plain], w)
            return (carry_out, nxt), (y, [_as_bits(c) for c in carry])

        state, saved, ys = (init, gather(ws, 0)), None, None
        if n > 1:
            state, (ys, saved) = jax.lax.scan(lambda s, t: step(s, t, True), state, jnp.arange(n - 1))
        (carry, _), (y_last, saved_last) = step(state, n - 1, False)
        ys = [y[None] if ys is None else jnp.concatenate([ys[i], y[None]]) for i, y in enumerate(y_last)]
        ys = [y[::-1] if reverse else y for y in ys]
        return (carry, ys), (consts, plain, ws, saved, saved_last)

    def forward_marked(consts, init, plain, ws):
        # Which inputs are differentiated, kept as the residuals' tree structure (() differentiated, None not).
        marks = jax.tree.map(lambda a: () if a.perturbed else None, (consts, init, plain, ws))
        out, res = forward(*jax.tree.map(lambda a: a.value, (consts, init, plain, ws)))
        return out, (res, marks)

    def backward(res_marks, cts):
        (consts, plain, ws, saved, saved_last), marks = res_marks
        c_perturbed, _, x_perturbed, w_perturbed = [[m is not None for m in ms] for ms in marks]
        zero = lambda ct: jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct  # noqa: E731
        ct_carry, ct_ys = ([zero(c) if jnp.issubdtype(c.dtype, jnp.inexact) else c for c in ct] for ct in cts)
        inexact = lambda xs: [jnp.issubdtype(x.dtype, jnp.inexact) for x in xs]  # noqa: E731
        c_mask, k_mask = [a and b for a, b in zip(inexact(consts), c_perturbed)], inexact(init)
        x_mask = [a and b for a, b in zip(inexact(plain), x_perturbed)]
        ws_all = ws
        ws = [w for w, m in zip(ws_all, w_perturbed) if m]  # the weights that get gradients
        grad_slots = [s for s, m in zip(slots, w_perturbed) if m]

        def scatter(gs):
            return [reduce_scatter(g, s.dims, s.reduce_dtype, w.dtype, s.int8.gradients)
                    for g, w, s in zip(gs, ws, grad_slots)]
        y_mask = [jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in body.jaxpr.outvars[n_carry:]]
        pick = lambda xs, mask: [x for x, m in zip(xs, mask) if m]  # noqa: E731

        def merge(picked, mask, like):
            picked = iter(picked)
            return [next(picked) if m else x for x, m in zip(like, mask)]

        def vjp_layer(t, carry_in, w, ct_k):
            x_t = [at(x, t) for x in plain]

            def f(c, k, x, w_d):
                carry_out, ys = layer(merge(c, c_mask, consts), merge(k, k_mask, carry_in), merge(x, x_mask, x_t),
                                      merge(w_d, w_perturbed, w))
                return pick(carry_out, k_mask), pick(ys, y_mask)

            _, pullback = jax.vjp(f, pick(consts, c_mask), pick(carry_in, k_mask), pick(x_t, x_mask),
                                  pick(w, w_perturbed))
            return pullback((ct_k, pick([at(c, t) for c in ct_ys], y_mask)))

        def put(buffers, values, t):
            return [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), position(t), 0)
                    for b, v in zip(buffers, values)]

        def step(state, t, carry_in, prefetch, flush):
            ct_k, w, pending, acc_c, buf_w, buf_x = state
            carry_in = [_from_bits(c, x.dtype) for c, x in zip(carry_in, init)]
            nxt = gather(ws_all, t - 1 + shift) if prefetch else None
            if flush:  # layer t+1's gradient, reduce-scattered while layer t is recomputed and differentiated
                buf_w = put(buf_w, scatter(pending), t + 1)
            d_c, d_k, d_x, d_w = vjp_layer(t, carry_in, w, ct_k)
            acc_c = [a + d.astype(a.dtype) for a, d in zip(acc_c, d_c)]
            return d_k, nxt, d_w, acc_c, buf_w, put(buf_x, d_x, t)

        zeros = lambda xs, dtype=None: [jnp.zeros(x.shape, dtype or x.dtype) for x in xs]  # noqa: E731
        # A zero the compiler cannot fold, computed from the incoming cotangent (NaN there makes the whole update
        # skipped anyway). The gradient buffers are filled with it (every slot is overwritten) and the backward
        # gathers' layer index is offset by it, so that neither is issued before the backward pass starts: measured
        # on LLaMA-7B, an early full-size gradient buffer, or a forward gather merged with its backward twin and kept
        # alive in between, each cost hundreds of MB.
        late = jnp.zeros((), jnp.float32)
        for c in pick(ct_carry, k_mask)[:1]:
            late = jnp.ravel(c)[0].astype(jnp.float32) * 0
        shift = (late != late).astype(jnp.int32)
        buffers = lambda xs: [jnp.full(x.shape, late, x.dtype) for x in xs]  # noqa: E731
        state = (pick(ct_carry, k_mask), gather(ws_all, n - 1 + shift), None,
                 zeros(pick(consts, c_mask), jnp.float32), buffers(ws), buffers(pick(plain, x_mask)))
        state = step(state, n - 1, saved_last, n > 1, False)
        if n > 2:
            index = lambda x, t: jax.lax.dynamic_index_in_dim(x, t, 0, keepdims=False)  # noqa: E731
            state, _ = jax.lax.scan(lambda s, t: (step(s, t, [index(x, t) for x in saved], True, True), None),
                                    state, jnp.arange(1, n - 1), reverse=True)
        if n > 1:
            state = step(state, 0, [x[0] for x in saved], False, True)
        ct_k, _, pending, acc_c, buf_w, buf_x = state
        buf_w = put(buf_w, scatter(pending), 0)
        none = lambda xs: [None] * len(xs)  # noqa: E731 - a zero cotangent
        ct_consts = merge([a.astype(c.dtype) for a, c in zip(acc_c, pick(consts, c_mask))], c_mask, none(consts))
        return (ct_consts, merge(ct_k, k_mask, none(init)), merge(buf_x, x_mask, none(plain)),
                merge(buf_w, w_perturbed, none(ws_all)))

    run = jax.custom_vjp(lambda *a: forward(*a)[0])
    run.defvjp(forward_marked, backward, symbolic_zeros=True)
    carry, ys = run(consts, init, plain, stacked)
    return list(carry) + list(ys)


def _as_bits(x):
    """16-bit floats as raw uint16 words: a saved activation stack stays 16-bit whatever a compiler does with the float
    arithmetic around it (the XLA CPU compiler otherwise widens the whole stack to fp32)."""
    # Measured: the widened stack cost 0.5 GB more for LLaMA-7B.
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _from_bits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x
