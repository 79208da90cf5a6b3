"""How a function with a `jax.custom_vjp` of its own runs where its parameters are still ZeRO-3 shards.

The engine's shard_map step traces the loss once at full size and re-evaluates its equations with each ZeRO-3 shard
gathered at its use. A custom_vjp is one equation, so its parameters are gathered whole before it runs (a 1F1B
pipeline's rules would hold a stage's whole weights and their gradients). Its author may instead register, for the
backward function of the custom_vjp it builds, a rule that runs the equation on the shards itself
(`register_shard_rule`); the step looks it up from the traced equation (`shard_rule`).

`rule(inputs)` gets the custom_vjp's flattened arguments, where each parameter still split is a shard (`is_shard`):
`local`, this device's part (the parameter's rank, split along dims the manual axes divide), and `gather(local)`, the
whole parameter in the loss's compute dtype from `local` or from a slice of it along dims the split leaves alone (a
layer of a stacked parameter, with any leading dims kept), differentiable: its gradient is reduce-scattered back to
the slice's layout, summed over the devices that share the parameter, as the step's own gathers do. The rule
returns the equation's outputs (a flat list), differentiable in the shards' `local` parts and the other inputs, or
None to leave the equation to the step. Imports nothing of ours.
"""
import weakref

import jax
import numpy as np

_RULES = weakref.WeakKeyDictionary()  # backward function -> rule; both live as long as the traced custom_vjp


def register_shard_rule(backward, rule):
    """Runs `rule` for the equations of custom_vjps whose backward function (what `defvjp` took) is `backward`."""
    _RULES[backward] = rule


def shard_rule(eqn):
    """`rule(equation inputs)` for a traced `custom_vjp_call` equation whose backward function has one registered, or
    None (another equation, or a JAX whose equation does not name its backward function as 0.10 and 0.11 do: the step
    then gathers the parameters whole). The equation's leading inputs are the constants its functions close over
    (arrays made while tracing, a rope's frequencies); the rule is handed the arguments after them, and its
    functions, which close over the same constants, must close over no traced value (as the step's re-evaluation
    of the custom_vjp itself requires)."""
    if eqn.primitive.name != "custom_vjp_call":
        return None
    backward = getattr(eqn.params.get("bwd"), "f", None)  # the WrappedFun's function
    try:
        rule = _RULES.get(backward)
    except TypeError:  # not weakly referenceable: none registered
        return None
    consts = eqn.params.get("num_consts", 0)
    return None if rule is None else lambda inputs: rule(inputs[consts:])


def is_shard(x):
    """Whether `x`, one of a rule's inputs, is a parameter still split (the module's protocol), not an array."""
    return not isinstance(x, (jax.Array, np.ndarray)) and hasattr(x, "gather") and hasattr(x, "local")
