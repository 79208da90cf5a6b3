"""Every `pallas_call` declares a `pl.CostEstimate`, and its flops are the FLOPs of the op the kernel computes.

The estimates are read off the traced programs (`jax.make_jaxpr`: nothing is lowered or run, so the Triton and
Mosaic kernels are both checked on a CPU) and compared with XLA's own count for a plain-JAX program of the same
math (`jax.jit(f).lower(...).cost_analysis()`), written here apart from the kernels:
- attention: the materialising `mha_reference` forward, and the FlashAttention-2 backward's dq and dk/dv passes as
  einsums. The estimates count matmul flops only; XLA adds the softmax's elementwise work (a few flops per
  (query, key) pair against 4·D = 512 for the forward's matmuls at D = 128: the estimates read 0.990, 0.995 and
  0.996 of XLA's count), hence `ATTENTION_TOLERANCE`. Causal masking halves the visible pairs: T(T + 1) / 2 of T²,
  which the references (computing the whole matrix) cannot show, so it is checked against that count.
- the fused-matmul family: every tiled matmul the public ops issue, forward and backward (bias + activation
  epilogues, the gated MLP's two accumulators, the loss's d logits), recorded as it is issued and replayed through
  the `'xla'` backend (`reference.matmul`, one XLA dot per product and the same epilogue on the whole output), and
  the loss's forward against the materialising `linear_cross_entropy_reference`. The estimates count the epilogues
  by tracing them, so they read 0.997 to 1.005 of XLA's count; `MATMUL_TOLERANCE` covers the sums of two-term
  accumulators and the reductions they leave out.
- the grouped matmul: its forward, dx and dw kernels against the dense product of the same rows.
Bytes accessed are at least every input and output once.
"""
import functools
import math

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core

from kernels.attention import flash_attention, mha_reference
from kernels.attention.api import decode_attention
from kernels.grouped_matmul import grouped_matmul
from kernels.matmul import fused_matmul, gated_mlp, linear_cross_entropy, mosaic_tpu, reference, triton
from kernels.matmul import BlockSizes as MatmulBlocks

ATTENTION_TOLERANCE = 0.02
MATMUL_TOLERANCE = 0.01
IMPLEMENTATIONS = ("mosaic_tpu", "triton")
_BACKENDS = {"mosaic_tpu": mosaic_tpu, "triton": triton}
# Tiles that split the small shapes below into several blocks on either backend.
_MATMUL_BLOCKS = MatmulBlocks(128, 128, 128, num_warps=4, num_stages=2)


def _pallas_calls(fn, *args):
    """[(kernel name, CostEstimate, operand avals)] of every pallas_call in fn's traced program, in order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = eqn.params["name"]
                found.append((name, eqn.params["cost_estimate"], [v.aval for v in eqn.invars],
                              [v.aval for v in eqn.outvars]))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jex_core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _xla(fn, *args):
    """XLA's cost analysis of fn on abstract args: {'flops', 'transcendentals', ...}."""
    return jax.jit(fn).lower(*args).cost_analysis()


def _nbytes(avals):
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in avals)


def _assert_close(estimate, expected, tolerance, what):
    assert abs(estimate - expected) <= tolerance * expected, f"{what}: estimate {estimate:.4g}, expected {expected:.4g}"


def _assert_declared(calls):
    assert calls, "no pallas_call traced"
    for name, cost, ins, outs in calls:
        assert cost is not None, f"{name} declares no CostEstimate"
        assert cost.flops > 0 and cost.transcendentals >= 0, (name, cost)
        assert cost.bytes_accessed >= _nbytes(ins) + _nbytes(outs), f"{name}: bytes below its inputs + outputs"


# ---- attention ----

B, T, H, HKV, D = 1, 1024, 4, 2, 128
_Q = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
_KV = jax.ShapeDtypeStruct((B, T, HKV, D), jnp.float32)


def _attention_calls(impl, causal):
    """{kernel name: CostEstimate} of flash_attention's forward and backward kernels."""
    loss = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation=impl).sum()  # noqa: E731
    calls = _pallas_calls(jax.grad(loss, argnums=(0, 1, 2)), _Q, _KV, _KV)
    _assert_declared(calls)
    return {name: cost for name, cost, *_ in calls}


def _grouped(q):
    return q.reshape(B, T, HKV, H // HKV, D)


def _dq_reference(q, k, v, do, lse, delta):
    """The dq pass: logits, probabilities from the saved lse, do v^T, ds, ds k (lse, delta: [B, Hkv, G, T])."""
    s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q), k) * D**-0.5
    p = jnp.exp(s - lse[..., None])
    dp = jnp.einsum("btkgd,bskd->bkgts", _grouped(do), v)
    return jnp.einsum("bkgts,bskd->btkgd", p * (dp - delta[..., None]), k)


def _dkv_reference(q, k, v, do, lse, delta):
    """The dk/dv pass: the same logits and probabilities, dv = p^T do, dk = ds^T q."""
    s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q), k) * D**-0.5
    p = jnp.exp(s - lse[..., None])
    dp = jnp.einsum("btkgd,bskd->bkgts", _grouped(do), v)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, _grouped(do))
    dk = jnp.einsum("bkgts,btkgd->bskd", p * (dp - delta[..., None]), _grouped(q))
    return dk, dv


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_attention_estimates_count_the_reference_flops(impl):
    costs = _attention_calls(impl, causal=False)
    assert set(costs) == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}
    ref = _xla(mha_reference, _Q, _KV, _KV)
    _assert_close(costs["flash_attention_fwd"].flops, ref["flops"], ATTENTION_TOLERANCE, "forward flops")
    _assert_close(costs["flash_attention_fwd"].transcendentals, ref["transcendentals"], ATTENTION_TOLERANCE,
                  "forward transcendentals")
    stats = jax.ShapeDtypeStruct((B, HKV, H // HKV, T), jnp.float32)
    for name, reference_pass in (("flash_attention_dq", _dq_reference), ("flash_attention_dkv", _dkv_reference)):
        ref = _xla(reference_pass, _Q, _KV, _KV, _Q, stats, stats)
        _assert_close(costs[name].flops, ref["flops"], ATTENTION_TOLERANCE, f"{name} flops")
        _assert_close(costs[name].transcendentals, ref["transcendentals"], ATTENTION_TOLERANCE,
                      f"{name} transcendentals")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_causal_attention_counts_about_half(impl):
    full, causal = _attention_calls(impl, causal=False), _attention_calls(impl, causal=True)
    for name in full:
        assert causal[name].flops == full[name].flops * (T + 1) // (2 * T), name  # T(T + 1) / 2 pairs of T²
        assert causal[name].bytes_accessed < full[name].bytes_accessed, f"{name}: skipped blocks are not read"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_decode_attention_estimate_counts_the_cache_once_per_query_head(impl):
    # 32 queries x 4 query heads per kv head: one 128-row tile, so no padded row is counted.
    q = jax.ShapeDtypeStruct((1, 32, 8, D), jnp.float32)
    cache = jax.ShapeDtypeStruct((1, 1024, 2, D), jnp.float32)
    calls = _pallas_calls(functools.partial(decode_attention, implementation=impl, num_splits=2), q, cache, cache)
    _assert_declared(calls)
    ref = _xla(mha_reference, q, cache, cache)
    _assert_close(sum(cost.flops for _, cost, *_ in calls), ref["flops"], ATTENTION_TOLERANCE, "decode flops")


# ---- the fused-matmul family ----

M, K, N = 256, 384, 512
V = 32 * 128  # the loss's backward sweeps it in 32 chunks of one 128-column tile: no padded chunk
_X = jax.ShapeDtypeStruct((M, K), jnp.float32)
_W = jax.ShapeDtypeStruct((K, N), jnp.float32)


def _as_abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _recorded_matmuls(monkeypatch, impl, fn, *args):
    """The backend `matmul` calls (abstract operands and settings) fn's value and gradients issue."""
    backend, issued = _BACKENDS[impl], []
    original = backend.matmul

    def record(lhs, rhs, extras=(), **settings):
        issued.append((_as_abstract((tuple(lhs), tuple(rhs), tuple(extras))), settings))
        return original(lhs, rhs, extras, **settings)

    monkeypatch.setattr(backend, "matmul", record)
    grads = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=tuple(range(len(args))))
    calls = _pallas_calls(grads, *args)
    monkeypatch.undo()
    _assert_declared(calls)
    assert len(issued) == sum(name == "fused_matmul" for name, *_ in calls)
    return issued


_OPS = {
    "fused_matmul": (lambda impl: lambda x, w, b: fused_matmul(x, w, b, activation="gelu", implementation=impl,
                                                               block_sizes=_MATMUL_BLOCKS),
                     (_X, _W, jax.ShapeDtypeStruct((N,), jnp.float32))),
    "gated_mlp": (lambda impl: lambda x, wg, wu: gated_mlp(x, wg, wu, implementation=impl, block_sizes=_MATMUL_BLOCKS),
                  (_X, _W, _W)),
    "linear_cross_entropy": (
        lambda impl: lambda x, w: linear_cross_entropy(x, w, jnp.arange(M) % V, implementation=impl,
                                                       block_sizes=_MATMUL_BLOCKS),
        (_X, jax.ShapeDtypeStruct((K, V), jnp.float32))),
}


@pytest.mark.parametrize("op", _OPS)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_every_matmul_kernel_counts_its_xla_reference_flops(monkeypatch, impl, op):
    make, args = _OPS[op]
    issued = _recorded_matmuls(monkeypatch, impl, make(impl), *args)
    assert len(issued) >= 3, "forward and backward kernels"
    for (lhs, rhs, extras), settings in issued:
        (_, cost, *_), = _pallas_calls(
            lambda lhs, rhs, extras: _BACKENDS[impl].matmul(lhs, rhs, extras, **settings), lhs, rhs, extras)
        ref = _xla(lambda lhs, rhs, extras: reference.matmul(lhs, rhs, extras, **settings), lhs, rhs, extras)
        what = f"{op} matmul {[a.shape for a in lhs + rhs]} trans=({settings.get('trans_lhs')}, " \
               f"{settings.get('trans_rhs')})"
        _assert_close(cost.flops, ref["flops"], MATMUL_TOLERANCE, what + " flops")
        _assert_close(cost.transcendentals, ref.get("transcendentals", 0), MATMUL_TOLERANCE, what + " transcendentals")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_loss_forward_counts_the_materialised_logits(impl):
    w = jax.ShapeDtypeStruct((K, 1000), jnp.float32)
    labels = jax.ShapeDtypeStruct((M,), jnp.int32)
    calls = _pallas_calls(
        lambda x, w, labels: linear_cross_entropy(x, w, labels, implementation=impl, block_sizes=_MATMUL_BLOCKS),
        _X, w, labels)
    _assert_declared(calls)
    (name, cost, *_), = calls
    assert name == "linear_cross_entropy_fwd"
    # The kernel sweeps the vocabulary padded to whole 128-column tiles: its logits are [M, 1024], not [M, 1000].
    padded = jax.ShapeDtypeStruct((K, 1024), jnp.float32)
    ref = _xla(reference.linear_cross_entropy_reference, _X, padded, labels)
    _assert_close(cost.flops, ref["flops"], MATMUL_TOLERANCE, "loss forward flops")
    _assert_close(cost.transcendentals, ref["transcendentals"], 0.1, "loss forward transcendentals")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_public_ops_total_the_textbook_matmul_count(impl):
    """A second, analytic count: forward 2MNK per product, then dx and dw; a gated MLP's backward also recomputes its
    two products (nothing is saved), a fused matmul without activation needs no recompute (d acc = dy). So 3 x 2MNK
    and 8 x 2MNK, plus the epilogues (a bias; SwiGLU and its derivative: 0.3% here, at K = 384)."""
    ops = {"fused_matmul": (lambda x, w, b: fused_matmul(x, w, b, implementation=impl, block_sizes=_MATMUL_BLOCKS),
                            _OPS["fused_matmul"][1], 3),
           "gated_mlp": (_OPS["gated_mlp"][0](impl), _OPS["gated_mlp"][1], 8)}
    for op, (fn, args, products) in ops.items():
        calls = _pallas_calls(jax.grad(lambda *a: fn(*a).sum(), argnums=tuple(range(len(args)))), *args)
        total = sum(cost.flops for _, cost, *_ in calls)
        _assert_close(total, products * 2 * M * N * K, MATMUL_TOLERANCE, op)


# ---- the grouped matmul ----

_GROUPED = (jax.ShapeDtypeStruct((512, K), jnp.float32), jax.ShapeDtypeStruct((4, K, N), jnp.float32),
            jax.ShapeDtypeStruct((4,), jnp.int32))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_grouped_matmul_kernels_count_one_product_per_row(impl):
    """The forward, dx and dw kernels each count every row's product with its group's weight once: XLA's count of
    the dense [M, K] x [K, N] product (the extra tile of a group boundary is left out, as _cost.py says)."""
    loss = lambda x, w, sizes: grouped_matmul(x, w, sizes, implementation=impl, block_sizes=_MATMUL_BLOCKS).sum()
    calls = _pallas_calls(jax.grad(loss, (0, 1)), *_GROUPED)
    _assert_declared(calls)
    assert sorted(name for name, *_ in calls) == ["grouped_matmul", "grouped_matmul", "grouped_matmul_transposed"]
    x, w, _ = _GROUPED
    ref = _xla(jnp.dot, x, jax.ShapeDtypeStruct(w.shape[1:], w.dtype))
    for name, cost, *_ in calls:
        _assert_close(cost.flops, ref["flops"], MATMUL_TOLERANCE, f"{name} flops")


# ---- paged attention ----

@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_paged_attention_estimate_counts_the_contiguous_decode(impl):
    """The kernel's flops are decode attention's over the whole table (lengths are runtime values: an upper bound):
    XLA's count of mha_reference of one query per sequence to max_pages * page_size keys; with a window of w keys,
    w of them. One page per block, so the Mosaic kernel takes the pool once and its bytes cover every operand
    (without a window: with one, the pages before it are not read)."""
    from kernels.attention.paged import paged_attention
    batch, pages, page = 4, 16, 16
    q = jax.ShapeDtypeStruct((batch, 8, D), jnp.float32)
    pool = jax.ShapeDtypeStruct((2, batch * pages, page, D), jnp.float32)
    table, lengths = jax.ShapeDtypeStruct((batch, pages), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    costs = {}
    for window, keys in ((None, pages * page), ((99, 0), 100)):
        calls = _pallas_calls(functools.partial(paged_attention, implementation=impl, pages_per_block=1,
                                                window=window), q, pool, pool, table, lengths)
        if window is None:  # with a window the pages before it are not read: bytes below the pool's
            _assert_declared(calls)
        (name, cost, *_), = calls
        cache = jax.ShapeDtypeStruct((batch, keys, 2, D), jnp.float32)
        ref = _xla(mha_reference, jax.ShapeDtypeStruct((batch, 1, 8, D), jnp.float32), cache, cache)
        assert name == "paged_attention"
        _assert_close(cost.flops, ref["flops"], ATTENTION_TOLERANCE, f"paged flops, window {window}")
        _assert_close(cost.transcendentals, ref["transcendentals"], ATTENTION_TOLERANCE, "paged transcendentals")
        costs[window] = cost
    assert costs[(99, 0)].bytes_accessed < costs[None].bytes_accessed / 2
