"""A remat'd scan over stacked ZeRO-3 layer weights, software-pipelined by hand (`pipelined_scan`): each
iteration's collective runs beside the previous layer's compute, in the forward and the backward pass."""
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental.layout import with_layout_constraint

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
    GPU the latency-hiding scheduler overlaps them; see engine/compiler.py). Except on TPU, the loops run these
    iterations two at a time, the second's gather tied to the first's layer (`_tie`), so that the weights a loop
    iteration carries out are made after the ones it carried in were last read, in their place
    (`_LayerStack.forward`). Only each layer's input is saved (what remat='full' keeps); at most two layers'
    gathered weights and two layers' full-size gradients are alive at once.
    The first and last iterations are peeled so that no collective is issued twice. Only the inputs being
    differentiated get gradients (the custom_vjp sees symbolic zeros): a frozen weight (`Trainer(trainable=...)`)
    is gathered for each layer but gets no weight gradient and no reduce-scatter."""
    del in_remat  # the layer's own remat is replaced by this schedule
    stack = _LayerStack(eqn, invals)
    run = jax.custom_vjp(lambda *a: stack.forward(*a)[0])
    run.defvjp(stack.forward_marked, lambda res_marks, cts: _Backward(stack, *res_marks, cts).run(),
               symbolic_zeros=True)
    carry, ys = run(stack.consts, stack.init, stack.plain, stack.stacked)
    return list(carry) + list(ys)


class _LayerStack:
    """The scan equation's structure: its body, length and direction; its inputs split into consts, the carry's
    init, the plain scanned inputs and the stacked `Sharded` weights (`slots`: how one layer of each is gathered)."""

    def __init__(self, eqn, invals):
        p = eqn.params
        (n_consts, self.n_carry), self.n, self.reverse = scan_counts(p), p["length"], p["reverse"]
        self.body = p["jaxpr"]
        self.consts = [full(x) for x in invals[:n_consts]]
        self.init = [full(x) for x in invals[n_consts:n_consts + self.n_carry]]
        xs = invals[n_consts + self.n_carry:]
        self.is_w = [isinstance(x, Sharded) for x in xs]
        self.slots = [x.layer() for x in xs if isinstance(x, Sharded)]
        self.plain = [x for x in xs if not isinstance(x, Sharded)]
        self.stacked = [x.local for x in xs if isinstance(x, Sharded)]
        self.layouts = [x.layout for x in xs if isinstance(x, Sharded)]  # their local stacks' (and gradients')

    def position(self, t):
        """The layer iteration t runs."""
        return self.n - 1 - t if self.reverse else t

    def at(self, x, t):
        return jax.lax.dynamic_index_in_dim(x, self.position(t), 0, keepdims=False)

    def gather(self, ws, t):
        return [s.in_blocks(lambda x, s=s: all_gather(x, s.dims, s.dtype, s.int8.weights), self.at(w, t))
                for w, s in zip(ws, self.slots)]

    def layer(self, consts, carry, x_plain, gathered):
        """One layer on gathered weights: (carry out, per-layer outputs)."""
        x_plain, gathered, x = iter(x_plain), iter(gathered), []
        for i, w in enumerate(self.is_w):
            if w:
                x.append(self.slots[sum(self.is_w[:i])].apply_casts(next(gathered)))
            else:
                x.append(next(x_plain))
        outs = _eval_inlined(self.body.jaxpr, self.body.consts, list(consts) + list(carry) + x)
        return outs[:self.n_carry], outs[self.n_carry:]

    def forward(self, consts, init, plain, ws):
        """((carry, stacked outputs), residuals): each layer's input carry is saved, as bits. Two layers an iteration
        (`_forward_pairs`), except in a program lowered for TPU, whose compiler needed more memory for them than for
        the loops of one layer (`_forward_layers`; engine/README.md's ZeRO-3 figures)."""
        return _by_platform(consts, init, plain, ws, tpu=self._forward_layers, default=self._forward_pairs)

    def _forward_layers(self, consts, init, plain, ws):
        def step(state, t, prefetch):
            carry, w = state
            nxt = self.gather(ws, t + 1) if prefetch else None
            carry_out, y = self.layer(consts, carry, [self.at(x, t) for x in plain], w)
            return (carry_out, nxt), (y, [_as_bits(c) for c in carry])

        n = self.n
        state, saved, ys = (init, self.gather(ws, 0)), None, None
        if n > 1:
            state, (ys, saved) = jax.lax.scan(lambda s, t: step(s, t, True), state, jnp.arange(n - 1))
        (carry, _), (y_last, saved_last) = step(state, n - 1, False)
        ys = [y[None] if ys is None else jnp.concatenate([ys[i], y[None]]) for i, y in enumerate(y_last)]
        ys = [y[::-1] if self.reverse else y for y in ys]
        return (carry, ys), (consts, plain, ws, saved, saved_last)

    def _forward_pairs(self, consts, init, plain, ws):
        """The loop runs two layers an iteration and carries one layer's gathered weights (A) into the next: layer
        2i+1's (B) are gathered while layer 2i runs on A, and layer 2i+2's, the next A, while layer 2i+1 runs on B,
        that gather's index tied to layer 2i's output so that it starts after A's last read. The carried A then
        dies before its successor is made, and XLA writes the successor in its place; carried one layer an
        iteration, the next layer's weights were made while the current ones were read, and XLA copied them into
        and out of the loop's state every iteration (weight-sized copies of every layer). The saved inputs and the
        per-layer outputs are written into their stacks in place, whatever layer is left over after the pairs."""
        n, pairs = self.n, (self.n - 1) // 2
        y_avals = [v.aval for v in self.body.jaxpr.outvars[self.n_carry:]]
        # Every slot is written before the backward reads it: uninitialised (an AllocateBuffer on GPU), not zeroed
        # (XLA's own fill elimination skips loops that carry a sharding, as this one does in the shard_map step).
        bufs = ([jax.lax.empty((n - 1, *c.shape), _as_bits(c).dtype) for c in init],  # layers 0 .. n-2's inputs
                [jax.lax.empty((n, *a.shape), a.dtype) for a in y_avals])

        def step(carry, w, bufs, t, prefetch, after=None):
            nxt = self.gather(ws, t + 1 + (0 if after is None else _tie(after))) if prefetch else None
            saved, ys = bufs
            if not isinstance(t, int) or t < n - 1:
                saved = [_put(b, _as_bits(c), t) for b, c in zip(saved, carry)]
            carry_out, y = self.layer(consts, carry, [self.at(x, t) for x in plain], w)
            return carry_out, nxt, (saved, [_put(b, v, t) for b, v in zip(ys, y)])

        def pair(state, i):
            carry, w_a, bufs = state
            carry, w_b, bufs = step(carry, w_a, bufs, 2 * i, True)
            carry, w_a, bufs = step(carry, w_b, bufs, 2 * i + 1, True, after=carry)
            return (carry, w_a, bufs), None

        state = (init, self.gather(ws, 0), bufs)
        if pairs:
            state, _ = jax.lax.scan(pair, state, jnp.arange(pairs))
        carry, w, bufs = state
        for t in range(2 * pairs, n):  # the one or two layers left, the last without a gather
            if t == n - 1:
                saved_last = [_as_bits(c) for c in carry]
            carry, w, bufs = step(carry, w, bufs, t, t < n - 1)
        saved, ys = bufs
        ys = [y[::-1] if self.reverse else y for y in ys]
        return (carry, ys), (consts, plain, ws, saved if n > 1 else None, saved_last)

    def forward_marked(self, consts, init, plain, ws):
        # Which inputs are differentiated, kept as the residuals' tree structure (() differentiated, None not).
        marks = jax.tree.map(lambda a: () if a.perturbed else None, (consts, init, plain, ws))
        out, res = self.forward(*jax.tree.map(lambda a: a.value, (consts, init, plain, ws)))
        return out, (res, marks)


def _pick(xs, mask):
    return [x for x, m in zip(xs, mask) if m]


def _merge(picked, mask, like):
    """The inverse of `_pick`: `like` with its masked entries replaced by `picked`."""
    picked = iter(picked)
    return [next(picked) if m else x for x, m in zip(like, mask)]


def _inexact(xs):
    return [jnp.issubdtype(x.dtype, jnp.inexact) for x in xs]


class _Backward:
    """The backward pass of `pipelined_scan` from its residuals and cotangents. The masks say which consts (c),
    carries (k), plain inputs (x), weights (w) and outputs (y) get or carry a cotangent: inexact and differentiated."""

    def __init__(self, stack, res, marks, cts):
        self.stack = stack
        self.consts, self.plain, self.ws_all, self.saved, self.saved_last = res
        c_perturbed, _, x_perturbed, self.w_mask = [[m is not None for m in ms] for ms in marks]
        zero = lambda ct: jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct  # noqa: E731
        self.ct_carry, self.ct_ys = ([zero(c) if jnp.issubdtype(c.dtype, jnp.inexact) else c for c in ct]
                                     for ct in cts)
        self.c_mask = [a and b for a, b in zip(_inexact(self.consts), c_perturbed)]
        self.k_mask = _inexact(stack.init)
        self.x_mask = [a and b for a, b in zip(_inexact(self.plain), x_perturbed)]
        self.y_mask = [jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in stack.body.jaxpr.outvars[stack.n_carry:]]
        self.ws = _pick(self.ws_all, self.w_mask)  # the weights that get gradients
        self.grad_slots = _pick(stack.slots, self.w_mask)
        self.grad_layouts = _pick(stack.layouts, self.w_mask)

    def constrain(self, bufs):
        """The weight gradients' stacks in their weights' layouts (`Sharded.layout`)."""
        return [b if l is None else with_layout_constraint(b, l) for b, l in zip(bufs, self.grad_layouts)]

    def scatter(self, gs):
        return [s.in_blocks(lambda g, s=s, w=w: reduce_scatter(g, s.dims, s.reduce_dtype, s.grad_dtype or w.dtype,
                                                               s.int8.gradients), g)
                for g, w, s in zip(gs, self.ws, self.grad_slots)]

    def put(self, buffers, values, t):
        return [_put(b, v, self.stack.position(t)) for b, v in zip(buffers, values)]

    def vjp_layer(self, t, carry_in, w, ct_k):
        """Layer t recomputed from its input carry and differentiated: (d consts, d carry, d plain, d weights)."""
        stack, x_t = self.stack, [self.stack.at(x, t) for x in self.plain]

        def f(c, k, x, w_d):
            carry_out, ys = stack.layer(_merge(c, self.c_mask, self.consts), _merge(k, self.k_mask, carry_in),
                                        _merge(x, self.x_mask, x_t), _merge(w_d, self.w_mask, w))
            return _pick(carry_out, self.k_mask), _pick(ys, self.y_mask)

        _, pullback = jax.vjp(f, _pick(self.consts, self.c_mask), _pick(carry_in, self.k_mask),
                              _pick(x_t, self.x_mask), _pick(w, self.w_mask))
        return pullback((ct_k, _pick([stack.at(c, t) for c in self.ct_ys], self.y_mask)))

    def step(self, state, t, carry_in, prefetch, flush, shift, after=None):
        ct_k, w, pending, acc_c, buf_w, buf_x = state
        carry_in = [_from_bits(c, x.dtype) for c, x in zip(carry_in, self.stack.init)]
        if prefetch and after is not None:
            shift = shift + _tie(after)
        nxt = self.stack.gather(self.ws_all, t - 1 + shift) if prefetch else None
        if flush:  # layer t+1's gradient, reduce-scattered while layer t is recomputed and differentiated
            buf_w = self.put(buf_w, self.scatter(pending), t + 1)
        d_c, d_k, d_x, d_w = self.vjp_layer(t, carry_in, w, ct_k)
        acc_c = [a + d.astype(a.dtype) for a, d in zip(acc_c, d_c)]
        return d_k, nxt, d_w, acc_c, buf_w, self.put(buf_x, d_x, t)

    def run(self):
        """The cotangents of (consts, init, plain, stacked weights), None where zero."""
        n, saved = self.stack.n, self.saved
        # A zero the compiler cannot fold, computed from the incoming cotangent (NaN there makes the whole update
        # skipped anyway). The gradient buffers are filled with it (every slot is overwritten) and the backward
        # gathers' layer index is offset by it, so that neither is issued before the backward pass starts: measured
        # on LLaMA-7B, an early full-size gradient buffer, or a forward gather merged with its backward twin and kept
        # alive in between, each cost hundreds of MB.
        late = jnp.zeros((), jnp.float32)
        for c in _pick(self.ct_carry, self.k_mask)[:1]:
            late = jnp.ravel(c)[0].astype(jnp.float32) * 0
        shift = (late != late).astype(jnp.int32)
        buffers = lambda xs, dtypes: [jnp.full(x.shape, late, d or x.dtype) for x, d in zip(xs, dtypes)]  # noqa: E731
        plain = _pick(self.plain, self.x_mask)
        state = (_pick(self.ct_carry, self.k_mask), self.stack.gather(self.ws_all, n - 1 + shift), None,
                 [jnp.zeros(x.shape, jnp.float32) for x in _pick(self.consts, self.c_mask)],
                 self.constrain(buffers(self.ws, [s.grad_dtype for s in self.grad_slots])),
                 buffers(plain, [None] * len(plain)))
        state = self.step(state, n - 1, self.saved_last, n > 1, False, shift)
        index = lambda x, t: jax.lax.dynamic_index_in_dim(x, t, 0, keepdims=False)  # noqa: E731
        middle = lambda s, t, after=None: self.step(s, t, [index(x, t) for x in saved], True, True, shift,  # noqa: E731
                                                    after)

        def layers(state):  # layers n - 2 ... 1, one an iteration (TPU: see `_LayerStack.forward`)
            return jax.lax.scan(lambda s, t: (middle(s, t), None), state, jnp.arange(1, n - 1), reverse=True)[0]

        def pairs(state):  # two an iteration, as the forward's, layer t - 2's gather tied after layer t
            def pair(state, j):
                t = n - 2 - 2 * j
                state = middle(state, t, after=state[0])
                return middle(state, t - 1, after=state[0]), None
            if n > 3:
                state, _ = jax.lax.scan(pair, state, jnp.arange((n - 2) // 2))
            return middle(state, 1) if (n - 2) % 2 else state

        if n > 2:
            state = _by_platform(state, tpu=layers, default=pairs)
        if n > 1:
            state = self.step(state, 0, [x[0] for x in saved], False, True, shift)
        ct_k, _, pending, acc_c, buf_w, buf_x = state
        # Held in the slots' grad_dtype; returned in the weights' (the step's cast back to grad_dtype cancels it).
        buf_w = [b.astype(w.dtype) for b, w in zip(self.constrain(self.put(buf_w, self.scatter(pending), 0)), self.ws)]
        none = lambda xs: [None] * len(xs)  # noqa: E731 - a zero cotangent
        ct_consts = [a.astype(c.dtype) for a, c in zip(acc_c, _pick(self.consts, self.c_mask))]
        return (_merge(ct_consts, self.c_mask, none(self.consts)), _merge(ct_k, self.k_mask, none(self.stack.init)),
                _merge(buf_x, self.x_mask, none(self.plain)), _merge(buf_w, self.w_mask, none(self.ws_all)))


def _by_platform(*args, tpu, default):
    """`tpu(*args)` in a program lowered for TPU, `default(*args)` on any other (chosen when lowered)."""
    return jax.lax.platform_dependent(*args, tpu=tpu, default=default)


def _put(stack, value, t):
    """`stack` with `value` (cast to its dtype) at index t of its first dim."""
    return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), t, 0)


def _tie(values):
    """A zero int32 computed from `values` (the compiler cannot fold it: a NaN makes it 1), added to an index so that
    what the index selects waits for `values`; the NaN would poison the update anyway."""
    leaves = [v for v in jax.tree.leaves(values) if jnp.issubdtype(v.dtype, jnp.inexact)] or jax.tree.leaves(values)
    if not leaves:
        return jnp.zeros((), jnp.int32)
    x = jnp.ravel(leaves[0])[0]
    return (x != x).astype(jnp.int32)


def _as_bits(x):
    """16-bit floats as raw uint16 words: a saved activation stack stays 16-bit whatever a compiler does with the float
    arithmetic around it (the XLA CPU compiler otherwise widens the whole stack to fp32)."""
    # Measured: the widened stack cost 0.5 GB more for LLaMA-7B.
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype in (jnp.bfloat16, jnp.float16) else x


def _from_bits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x
