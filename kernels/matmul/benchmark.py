"""Benchmark cases of the fused-matmul family beside XLA's unfused equivalents, for `scripts/bench_kernels.py`.

The script times every path of a case in the same run and prints the table; this module only builds the cases, so
they can be imported and checked by tests.
"""
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kernels.matmul import fused_matmul, gated_mlp, linear_cross_entropy, quantize_int8, reference
from kernels.matmul.cross_entropy import linear_cross_entropy_sum

CHUNKED = "xla chunked rows, gradients in the forward"  # linear_cross_entropy_sum's path name

# (m, k, n) per kernel and size: "large" are the targets (square 8192 matmul, LLaMA-3-8B MLP and loss with
# m tokens, k model dim, n vocabulary; the int8-weight matmul at the same square size); "small" is a CPU smoke check.
SIZES = {
    "large": {"fused_matmul": (8192, 8192, 8192), "gated_mlp": (8192, 4096, 14336),
              "linear_cross_entropy": (16384, 4096, 128256), "fused_matmul_int8": (8192, 8192, 8192)},
    "small": {"fused_matmul": (256, 256, 256), "gated_mlp": (256, 128, 384),
              "linear_cross_entropy": (256, 128, 4096), "fused_matmul_int8": (256, 256, 256)},
}
KERNELS = ("fused_matmul", "gated_mlp", "linear_cross_entropy", "fused_matmul_int8")


class Case(NamedTuple):
    kernel: str
    shape: str
    direction: str  # "fwd" or "fwd+bwd"
    flops: float  # Useful FLOPs, 2 per multiply-add; the fused backward's recomputation is not counted.
    paths: dict[str, Callable]  # Name -> function of `args`: the fused kernel first, then its XLA baseline (the loss
    # adds linear_cross_entropy_sum's path, CHUNKED, third).
    args: tuple
    retile: Callable  # block_sizes -> the fused path with those block sizes (for the tuner).


def temp_bytes(fn, args):
    """Compiled temporary memory of the jitted `fn(*args)` (the logits, for the loss)."""
    return jax.jit(fn).trace(*args).lower().compile().memory_analysis().temp_size_in_bytes


def _grad_of_sum(fn, argnums):
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums)


def cases(size, dtype, implementation=None, kernels=KERNELS, interpret=False):
    """Forward and forward+backward cases of each kernel at `size` ("large" or "small"), inputs random normal; the
    fused paths run `implementation` (with `interpret`) on the heuristic block sizes."""
    ops = dict(implementation=implementation, interpret=interpret)
    ours = f"[{implementation or 'default'}]"  # The implementation's name, as the script resolves it.
    out = []
    for kernel in kernels:
        m, k, n = SIZES[size][kernel]
        keys = jax.random.split(jax.random.key(0), 4)
        normal = lambda key, s, scale=1.0: (scale * jax.random.normal(key, s, jnp.float32)).astype(dtype)
        if kernel == "fused_matmul":
            args = (normal(keys[0], (m, k)), normal(keys[1], (k, n), k ** -0.5), normal(keys[2], (n,)))
            fused = lambda bs: lambda x, w, b: fused_matmul(x, w, b, activation="gelu_tanh", block_sizes=bs, **ops)
            xla = lambda x, w, b: reference.fused_matmul_reference(x, w, b, activation="gelu_tanh")
            names, flops, argnums = ("fused_matmul", "xla dot+bias+gelu"), 2 * m * k * n, (0, 1, 2)
        elif kernel == "fused_matmul_int8":  # weight-only int8 (models/quantize.py); gradients for x and bias only
            q, scale = quantize_int8(normal(keys[1], (k, n), k ** -0.5).astype(jnp.float32))
            args = (normal(keys[0], (m, k)), normal(keys[2], (n,)))
            fused = lambda bs: lambda x, b: fused_matmul(x, q, b, w_scale=scale, activation="gelu_tanh",
                                                         block_sizes=bs, **ops)

            def xla(x, b):  # what XLA makes of the int8 kernel: convert, dot, scale, bias, activation
                z = jnp.matmul(x, q.astype(x.dtype), preferred_element_type=jnp.float32) * scale + b
                return jax.nn.gelu(z, approximate=True).astype(x.dtype)
            names, flops, argnums = ("fused_matmul int8", "xla convert+dot+scale+gelu"), 2 * m * k * n, (0, 1)
        elif kernel == "gated_mlp":
            args = (normal(keys[0], (m, k)), normal(keys[1], (k, n), k ** -0.5), normal(keys[2], (k, n), k ** -0.5))
            fused = lambda bs: lambda x, wg, wu: gated_mlp(x, wg, wu, block_sizes=bs, **ops)
            xla = reference.gated_mlp_reference
            names, flops, argnums = ("gated_mlp", "xla silu(x@wg)*(x@wu)"), 4 * m * k * n, (0, 1, 2)
        else:
            args = (normal(keys[0], (m, k)), normal(keys[1], (k, n), k ** -0.5),
                    jax.random.randint(keys[3], (m,), 0, n))
            fused = lambda bs: lambda x, w, labels: linear_cross_entropy(x, w, labels, block_sizes=bs, **ops)
            xla = reference.linear_cross_entropy_reference
            names, flops, argnums = ("linear_cross_entropy", "xla materialised logits"), 2 * m * k * n, (0, 1)
            chunked = lambda x, w, labels: linear_cross_entropy_sum(x, w, labels, jnp.ones(labels.shape))  # noqa
        shape = f"{m}x{k}x{n} {jnp.dtype(dtype).name}"
        backward = lambda bs, fused=fused, argnums=argnums: _grad_of_sum(fused(bs), argnums)
        extra = kernel == "linear_cross_entropy"  # and its row-chunked sum, gradients taken in the forward
        out.append(Case(kernel, shape, "fwd", flops, {names[0] + ours: fused(None), names[1]: xla,
                                                      **({CHUNKED: chunked} if extra else {})}, args, fused))
        # The backward is two matmuls per forward one (dx, dw); one for the int8 weight, which gets no gradient.
        out.append(Case(kernel, shape, "fwd+bwd", (2 if kernel == "fused_matmul_int8" else 3) * flops,
                        {names[0] + ours: backward(None), names[1]: _grad_of_sum(xla, argnums),
                         **({CHUNKED: _grad_of_sum(chunked, argnums)} if extra else {})}, args, backward))
    return out
