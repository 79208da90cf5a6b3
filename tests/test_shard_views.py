"""The shard_map step's views of ZeRO-3 shards (engine/step/shard_views.py): a loop that slices a stacked weight with
the same index on every device gathers one slice per iteration, and a lookup whose indices differ between devices
(each device's own rows) gathers the table, not the looked-up rows; values and gradients equal the unsplit ones."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import engine
from engine.step.gathering import eval_gathering
from engine.step.shard_views import sliced_in_loop, varying_vars
from engine.step.shards import Sharded

LAYERS, VOCAB, D, ROWS, T = 3, 16, 32, 8, 4


def _loss(table, stack, ids):
    h = table[ids]  # [rows, T, D]: each device's own rows' lookups

    def layer(h, i):
        return jnp.tanh(h @ stack[i]), None  # one layer of the stack [L, D, D] a step, at a loop-counter index

    return jnp.sum(jax.lax.scan(layer, h, jnp.arange(LAYERS))[0] ** 2)


def _inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(keys[0], (VOCAB, D)), jax.random.normal(keys[1], (LAYERS, D, D)) / np.sqrt(D),
            jax.random.randint(keys[2], (ROWS, T), 0, VOCAB))


def test_a_loop_gathers_one_slice_of_a_stack_and_a_lookup_gathers_its_table():
    mesh = engine.make_mesh(fsdp=8)
    table, stack, ids = _inputs()
    closed = jax.make_jaxpr(_loss)(table, stack, ids[:1])  # traced at full size: the weights whole

    def on_device(table, stack, ids):  # both weights split along their last dim over fsdp, the rows too
        def local_loss(table, stack):
            args = [Sharded(table, ((1, ("fsdp",)),), jnp.float32, jnp.float32),
                    Sharded(stack, ((2, ("fsdp",)),), jnp.float32, jnp.float32), ids]
            return eval_gathering(closed.jaxpr, closed.consts, args)[0]
        loss, grads = jax.value_and_grad(local_loss, argnums=(0, 1))(table, stack)
        return jax.lax.psum(loss, "fsdp"), grads

    step = jax.jit(jax.shard_map(on_device, mesh=mesh, in_specs=(P(None, "fsdp"), P(None, None, "fsdp"), P("fsdp")),
                                 out_specs=(P(), (P(None, "fsdp"), P(None, None, "fsdp"))), check_vma=False))
    loss, (d_table, d_stack) = step(table, stack, ids)
    want, (want_table, want_stack) = jax.value_and_grad(_loss, argnums=(0, 1))(table, stack, ids)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(d_table, want_table, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_stack, want_stack, rtol=1e-4, atol=1e-5)
    hlo = step.lower(table, stack, ids).compile().as_text()
    gathered = set(re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} all-gather(?:-start)?\(", hlo))
    # The stack a layer at a time ([D, D] or [1, D, D], never [L, D, D]); the table whole, not rows x tokens of it.
    assert {s.split(",")[-2:] == [str(D), str(D)] and s.split(",")[0] in (str(D), "1") for s in gathered
            if s.count(",") >= 1 and s != f"{VOCAB},{D}"} == {True}, gathered
    assert f"{VOCAB},{D}" in gathered, gathered


def test_varying_values_follow_the_rows_through_loops():
    table, stack, ids = _inputs()
    closed = jax.make_jaxpr(_loss)(table, stack, ids)
    varying = varying_vars(closed.jaxpr, [False, False, True])  # the rows differ between devices, weights do not
    lookup = next(e for e in closed.jaxpr.eqns if e.primitive.name in ("gather", "jit", "pjit"))
    assert lookup.outvars[0] in varying
    scan = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    body = scan.params["jaxpr"].jaxpr
    index = body.invars[-1]  # the loop counter: the same on every device
    assert index not in varying and body.invars[-2] in varying  # the carry (the rows' activations) varies


def test_a_loop_slicing_at_indices_that_differ_between_devices_gathers_the_stack_before_it():
    """A layer picked by each device's rows (an index that varies) cannot be a slice of a shard: the stack stays a
    loop constant gathered once, not gathered whole at every iteration."""
    def picked(table, stack, ids):
        k = ids[0, 0] % LAYERS

        def layer(h, _):
            return jnp.tanh(h @ stack[k]), None

        return jnp.sum(jax.lax.scan(layer, table[ids], None, length=LAYERS)[0] ** 2)

    table, stack, ids = _inputs()
    for fn, sliced in ((_loss, True), (picked, False)):
        closed = jax.make_jaxpr(fn)(table, stack, ids)
        varying = varying_vars(closed.jaxpr, [False, False, True])
        body = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan").params["jaxpr"].jaxpr
        weights = next(v for v in body.invars if v.aval.shape == stack.shape)
        assert sliced_in_loop(body, weights, varying) == sliced, fn
