"""Where the residual stream's tokens are split between blocks: over `context` (context parallelism) and, with
sequence parallelism, over `model` too (Megatron-LM's, Korthikanti et al., 2022)."""
import functools

import jax

import kernels
from kernels import axes


def _token_axes(x, sequence_parallel):
    """(the mesh axes x [B, T, ...]'s tokens are split over between blocks, whether `model` is among them):
    `context` when the ambient mesh's automatic context axis is larger than 1 and divides T (context parallelism),
    then with `sequence_parallel` `model` when that axis is automatic, larger than 1 and divides what is left."""
    context = kernels.context_size(x.shape[1])
    over = (axes.CONTEXT,) if context > 1 else ()
    model = kernels.auto_axis_size(axes.MODEL) if sequence_parallel else 1
    split = model > 1 and x.shape[1] % (context * model) == 0
    return over + ((axes.MODEL,) if split else ()), split


def split_tokens(x, sequence_parallel=False):
    """x [B, T, ...] with its token dim over `_token_axes` (nothing to do when there are none). Called on a
    stack's input: every op until attention is per token, so the split then holds through the layers (attention
    exchanges the context split for heads inside `kernels.flash_attention`); with sequence_parallel also on the
    row-parallel output of each attention and MLP block, which the partitioner then reduce-scatters over `model`
    instead of all-reducing (its gradient is all-gathered back: `_reshard`)."""
    over, split = _token_axes(x, sequence_parallel)
    if not over:
        return x
    if not split:
        unconstrained = jax.sharding.PartitionSpec.UNCONSTRAINED
        return jax.lax.with_sharding_constraint(
            x, jax.sharding.PartitionSpec(unconstrained, over, *[unconstrained] * (x.ndim - 2)))
    return _reshard(x, _token_spec(x, over[:-1]), _token_spec(x, over))


def gather_tokens(x, sequence_parallel):
    """x [B, T, ...] with whole tokens over `model` again (the context split kept) where `split_tokens` split
    them over it: the input of a tensor-parallel attention or MLP block, and of the head, under sequence
    parallelism (an all-gather; its gradient is reduce-scattered)."""
    over, split = _token_axes(x, sequence_parallel)
    return _reshard(x, _token_spec(x, over), _token_spec(x, over[:-1])) if split else x


def _token_spec(x, over):
    """x's layout with its tokens over the mesh axes `over` (whole when there are none), its rows as they are and
    every other dim whole."""
    return jax.sharding.PartitionSpec(jax.sharding.PartitionSpec.UNCONSTRAINED, over or None, *[None] * (x.ndim - 2))


# The backward layouts are stated too: left to itself, the partitioner met a token-split cotangent at a row-parallel
# weight's transposed matmul with all-to-alls and weight gathers (tiny LLaMA, data 4 x model 2: 12 MB of all-to-all,
# +11% temporaries).
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reshard(x, source, target):
    """x laid out as `source`, then as `target` (a sequence-parallel gather or split of its tokens); the gradient
    takes the same two layouts in reverse."""
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, source), target)


def _reshard_fwd(x, source, target):
    return _reshard(x, source, target), None


def _reshard_bwd(source, target, _, g):
    return (jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(g, target), source),)


_reshard.defvjp(_reshard_fwd, _reshard_bwd)
