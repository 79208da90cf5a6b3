"""`flash_attention`: input validation, implementation choice, block sizes, padding and the `custom_vjp` glue.

Every implementation module (`reference`, `triton`, `mosaic_tpu`) provides
`forward(q, k, v, q_ids, kv_ids, keys, plan) -> (out, lse)` and
`backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan) -> (dq, dk, dv)` on inputs already padded to block
multiples; `keys` is None or the int32 [B, H] dropout keys (`reference.dropout_keys`); the lse layout is private to
each. This module owns everything around them. `cudnn` (cuDNN's fused attention through `jax.nn`) is the
exception: any length, its own tiles and VJP, so it runs whole (`_cudnn_on_mesh`), without padding or lse.
"""
import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from absl import logging

from kernels import _partition
from kernels._defaults import default_implementation
from kernels._dispatch import ATTENTION_IMPLEMENTATIONS, IMPLEMENTATIONS, resolve_implementation, tpu_generation
from kernels.attention import cudnn, mosaic_gpu, mosaic_tpu, reference, triton
from kernels.attention.reference import dropout_keys
from kernels.matmul.formats import quantize_int8

_IMPLEMENTATIONS = {"xla": reference, "triton": triton, "mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu}
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes along the sequence axes; None fields take the heuristic default.

    block_q/block_k: forward pass. block_q_bwd/block_k_bwd: both backward passes (dq, and dk/dv).
    num_warps/num_stages (forward) and num_warps_bwd/num_stages_bwd: Triton only. The 'xla' implementation uses
    only block_k (its scan step, both directions).
    """

    block_q: int | None = None
    block_k: int | None = None
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None


# Heuristic defaults per implementation, keyed by the largest head_dim they apply to. Triton numbers follow the
# FlashAttention-2 Triton tutorial's H100 configs (128x64 forward tiles; smaller tiles at head_dim 256 to fit shared
# memory); Mosaic's row is for tracing off TPU (interpret mode, lowering), a TPU takes its generation's row of
# `_MOSAIC_BLOCKS`. Not yet timed on hardware: scripts/bench_kernels.py is the tool for that.
_DEFAULT_BLOCKS = {
    # 'xla' scans over kv only (block_q unused); 512-key steps bound its temporaries to [B, H, T, 512].
    "xla": {1 << 30: BlockSizes(block_q=1, block_k=512, block_q_bwd=1, block_k_bwd=512)},
    "triton": {
        64: BlockSizes(128, 64, 64, 64, num_warps=4, num_stages=3, num_warps_bwd=4, num_stages_bwd=3),
        128: BlockSizes(128, 64, 64, 64, num_warps=8, num_stages=3, num_warps_bwd=8, num_stages_bwd=3),
        # Backward (64, 32): dq's 64 rows reach wgmma (HGMMA) on sm_90a without spilling; no setting also puts
        # dk/dv there without spills (kernels/README.md, Hopper compile tier). Speed not yet timed.
        1 << 30: BlockSizes(64, 32, 64, 32, num_warps=8, num_stages=2, num_warps_bwd=8, num_stages_bwd=2),
    },
    # Hopper (kernels/attention/mosaic_gpu.py): 128 queries a CTA (two 64-row consumer warpgroups), key tiles and
    # ring depths within shared memory; backward tiles of 64 (dq's keys, dk / dv's queries). Not yet timed.
    "mosaic_gpu": {
        64: BlockSizes(128, 128, 64, 64, num_stages=3, num_stages_bwd=2),
        128: BlockSizes(128, 128, 64, 64, num_stages=2, num_stages_bwd=2),
        1 << 30: BlockSizes(128, 64, 64, 64, num_stages=2, num_stages_bwd=2),
    },
    "mosaic_tpu": {
        128: BlockSizes(512, 512, 256, 512),
        1 << 30: BlockSizes(256, 512, 256, 256),
    },
}
# Mosaic tiles per TPU generation (`kernels._dispatch.tpu_generation`), keyed by head dim like `_DEFAULT_BLOCKS`:
# the largest (block_q, block_k) of the forward kernel and of the backward kernels that compile under the
# generation's default scoped VMEM (16 MiB on v4, v5e and v5p; 32 MiB on v6e) with every mask (causal or not, with
# segment ids or not: Mosaic's temporaries differ by mask), with and without grouped kv heads, at head dims 128 and
# 256 and lengths 2048 and 8192 (`scripts/tpu_compile_report.py --search`, then tests/test_tpu_kernels.py: a 2048-key
# forward tile on v5p passed with GQA 32/8 and overflowed by 0.2 MiB in LLaMA-7B's step, 32 kv heads with segments).
_MOSAIC_BLOCKS = {  # head dim 64 takes 128's tiles: a 64-lane tile is padded to 128 lanes in VMEM
    "v4": {128: BlockSizes(1024, 1024, 1024, 1024), 1 << 30: BlockSizes(1024, 512, 1024, 512)},
    "v5e": {128: BlockSizes(1024, 1024, 1024, 1024), 1 << 30: BlockSizes(1024, 512, 1024, 512)},
    "v5p": {128: BlockSizes(1024, 1024, 1024, 1024), 1 << 30: BlockSizes(1024, 512, 1024, 512)},
    "v6e": {128: BlockSizes(2048, 2048, 2048, 1024), 1 << 30: BlockSizes(2048, 1024, 2048, 512)},
}
# What `scripts/bench_kernels.py --tune` times, per implementation, keyed by the pass it times ('fwd', or 'fwd+bwd'
# for the backward tiles). Each candidate is laid over the heuristic default like a `block_sizes` override, so a
# forward candidate leaves the backward settings alone and vice versa. 'xla' has one block_k for both directions.
TUNING_SPACE = {
    "xla": {"fwd+bwd": [BlockSizes(block_k=bk) for bk in (256, 512, 1024, 2048)]},
    "triton": {
        "fwd": [BlockSizes(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
                for bq, bk in ((64, 64), (128, 32), (128, 64), (128, 128)) for w in (4, 8) for s in (2, 3, 4)],
        "fwd+bwd": [BlockSizes(block_q_bwd=bq, block_k_bwd=bk, num_warps_bwd=w, num_stages_bwd=s)
                    for bq, bk in ((32, 64), (64, 64), (64, 128), (128, 64), (128, 128)) for w in (4, 8)
                    for s in (2, 3)],
    },
    "mosaic_tpu": {
        "fwd": [BlockSizes(block_q=bq, block_k=bk)
                for bq, bk in ((256, 512), (512, 512), (512, 1024), (1024, 512), (1024, 1024))],
        "fwd+bwd": [BlockSizes(block_q_bwd=bq, block_k_bwd=bk)
                    for bq, bk in ((256, 256), (256, 512), (512, 256), (512, 512))],
    },
}
# Smallest tile per implementation: Triton's tl.dot needs >= 16 rows; Mosaic's lane dim is 128 wide.
_MIN_BLOCK = {"xla": 1, "triton": 16, "mosaic_tpu": 128, "mosaic_gpu": 64}


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static configuration handed to an implementation (hashable: it is a custom_vjp nondiff argument)."""

    implementation: str
    causal: bool
    sm_scale: float
    kv_len: int | None  # real kv length when kv was padded, else None
    blocks: BlockSizes
    interpret: bool
    dropout_rate: float = 0.0
    window: tuple[int, int] | None = None  # (left, right): query i sees keys i - left ... i + right
    logit_soft_cap: float | None = None


def flash_attention(
    q,
    k,
    v,
    *,
    causal=False,
    segment_ids=None,
    sm_scale=None,
    implementation=None,
    interpret=False,
    block_sizes=None,
    dropout_rate=0.0,
    dropout_rng=None,
    window=None,
    logit_soft_cap=None,
):
    """Multi-head attention softmax(q k^T * sm_scale) v without materialising the [len, kv_len] matrix.

    Args:
      q: [batch, len, heads, head_dim]; float32, bfloat16 or float16.
      k, v: [batch, kv_len, kv_heads, head_dim], same dtype; heads % kv_heads == 0 (grouped-query attention: query
        head h reads kv head h // (heads // kv_heads), as in `jax.nn.dot_product_attention`).
      causal: query i attends to keys j <= i (top-left aligned when len != kv_len).
      segment_ids: None, int [batch, len] (self-attention, len == kv_len) or a pair (int [batch, len],
        int [batch, kv_len]); a query attends only to keys with its id. A query that sees no key outputs zeros.
      sm_scale: logit scale; default 1 / sqrt(head_dim).
      implementation: None, 'xla', 'triton', 'mosaic_tpu', 'cudnn' (cuDNN's fused attention through
        `jax.nn.dot_product_attention`, NVIDIA GPUs; `kernels/attention/cudnn.py` lists what it refuses) or
        'mosaic_gpu' (Hopper, JAX >= 0.11; `kernels/attention/mosaic_gpu.py` lists what it refuses). None: the
        measured default of the device kind and shape class, or of its nearest measured neighbour
        (`kernels.default_implementation`, its forward + backward entry: a call does not know whether it will be
        differentiated; segment ids are a class of their own) for a call without dropout, window, soft cap, block
        sizes or context parallelism; otherwise, and where the table answers nothing, the backend's kernels.
      interpret: run the Pallas kernel in Pallas's interpreter (for CPU tests).
      block_sizes: a `BlockSizes` overriding the heuristic tile sizes.
      dropout_rate: probability in [0, 1) of dropping each attention probability (the kept ones are scaled by
        1 / (1 - rate)), as in Flax's `dot_product_attention` and PyTorch's `scaled_dot_product_attention`.
      dropout_rng: a JAX PRNG key, needed when dropout_rate > 0. The mask is a hash of one 32-bit seed drawn from it
        and of (batch row, head, query, key), so the backward pass regenerates it instead of storing it, and it is the
        same for every implementation, tile size and mesh.
      window: None or a pair (left, right) of ints >= 0: query i attends key j only if i - left <= j <= i + right
        (positions top-left aligned like causal). With causal, window=(W - 1, 0) is Mistral's and Gemma's sliding
        window of W keys, the query's own included. The kernels skip the kv tiles outside it: O(len * window) work.
      logit_soft_cap: None or c > 0: the logits s = sm_scale * q . k become c * tanh(s / c) before masking and
        softmax (Gemma 2's attn_logit_softcapping).
    Returns:
      [batch, len, heads, head_dim] in q's dtype. Differentiable in q, k and v.
    """
    q_ids, kv_ids = _validate(q, k, v, causal, segment_ids, sm_scale, interpret, block_sizes)
    dropout_rate = _validate_dropout(dropout_rate, dropout_rng)
    window, logit_soft_cap = _validate_window(window), _validate_soft_cap(logit_soft_cap)
    context = _partition.context_size(q.shape[1], k.shape[1])
    manual = _partition.manual_context_size()  # inside the shard_map step on a context mesh: q, k, v a token slice
    context = max(context, manual)
    plain = not dropout_rate and window is None and logit_soft_cap is None and block_sizes is None and context == 1
    shape = dict(head_dim=q.shape[3], seq_len=max(q.shape[1], k.shape[1]), causal=causal, dtype=q.dtype,
                 segments=q_ids is not None)
    impl = _implementation(implementation, interpret, ATTENTION_IMPLEMENTATIONS, shape if plain else None)
    if impl == "cudnn" and implementation is None and isinstance(segment_ids, (tuple, list)):
        impl = _implementation(None, interpret)  # the table's cuDNN takes one array of ids, not a (q, kv) pair
    if impl == "cudnn":
        cudnn.check_device(interpret)
        cudnn.check(q, k, segment_ids=segment_ids, dropout_rate=dropout_rate, window=window, causal=causal,
                    logit_soft_cap=logit_soft_cap, block_sizes=block_sizes)
    keys = dropout_keys(dropout_rng, q.shape[0], q.shape[2]) if dropout_rate else None
    settings = dict(impl=impl, causal=causal, sm_scale=sm_scale, interpret=interpret, block_sizes=block_sizes,
                    dropout_rate=dropout_rate, window=window, logit_soft_cap=logit_soft_cap)
    if context > 1:
        return _context_parallel(q, k, v, q_ids, kv_ids, keys, context, settings, manual=manual > 1)
    return _padded_attention(q, k, v, q_ids, kv_ids, keys, **settings)


def _padded_attention(q, k, v, q_ids, kv_ids, keys, *, impl, causal, sm_scale, interpret, block_sizes, dropout_rate,
                      window, logit_soft_cap):
    """The attention of `flash_attention` on inputs of any length: padded to whole tiles, run on the ambient mesh's
    rows and heads, the padding cut off."""
    if impl == "cudnn":
        return _cudnn_on_mesh(q, k, v, q_ids, causal=causal, sm_scale=sm_scale, window=window)
    T, D = q.shape[1], q.shape[3]
    q, k, v, q_ids, kv_ids, plan = _prepared(q, k, v, q_ids, kv_ids, impl, causal, sm_scale, interpret, block_sizes,
                                             dropout_rate, window, logit_soft_cap)
    return _on_mesh(q, k, v, q_ids, kv_ids, keys, plan)[:, :T, :, :D]


def _context_parallel(q, k, v, q_ids, kv_ids, keys, context, settings, manual=False):
    """The attention of `flash_attention` (its `settings`) on sequences split over the mesh's `context` axis, in a
    shard_map manual over `context` and the rows' and heads' axes (each device's block of rows and of `model` heads
    is its own; partly automatic, the partitioner gathered rows and heads onto every device before each exchange),
    for every implementation. Results equal the unsplit attention. `manual`: `context` is manual already (the
    engine's shard_map step; q, k and v are this device's token slice [B, T/C, H, D]): the same exchange, in a
    shard_map over the other axes only.

    DeepSpeed-Ulysses (Jacobs et al., 2023) where the heads allow: an all-to-all turns each device's slice of the
    tokens of its heads into every token of 1/context of those heads, the unchanged attention runs on whole
    sequences, and the inverse all-to-all returns the output's slice. Causal masks, windows, soft caps, segment ids
    (all-gathered: a few ints per token) and dropout (the keys of the device's heads) mean what they mean without
    the split. Grouped-query
    k and v go through the same all-to-all when their heads per device divide by `context`; otherwise they are
    all-gathered and each device keeps the one kv head its query heads read (k and v are heads / kv_heads times
    smaller than q). Where the heads per device do not divide by `context` (or the kv heads do not fit), ring
    attention (`_ring`): no condition on heads."""
    B, T, H, D = q.shape
    KVH = k.shape[2]
    auto = {a: n for a, n in _partition.automatic_axes().items() if a != _partition.CONTEXT_AXIS}
    b, m = _partition.batch_axes(auto, B), _partition.model_axis(auto, H, KVH)
    M = auto[m] if m else 1
    axis = _partition.CONTEXT_AXIS
    args, specs, split = _operands(q, k, v, q_ids, kv_ids, keys, b, None if manual else axis, m)
    hq, G = H // M // context, H // KVH  # query heads per device after the exchange; query heads per kv head
    kv_to_heads = (KVH // M) % context == 0
    if (H // M) % context or (not kv_to_heads and G % hq):
        if settings["impl"] == "cudnn":
            raise ValueError(f"implementation='cudnn' with {H} heads / {KVH} kv heads over model={M} and "
                             f"context={context}; that needs ring attention, which merges blocks by a log-sum-exp "
                             "cuDNN's API does not return: expected heads per device divisible by context (Ulysses), "
                             "or 'xla', 'triton' or 'mosaic_tpu'")
        return _partition.shard(functools.partial(_ring_attention, context=context, has_ids=q_ids is not None,
                                                  **settings), args, specs, split, settings["impl"])
    core = functools.partial(_padded_attention, **settings)
    to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731  [b, T/C, h, D] -> [b, T, h/C, D]

    def run(q, k, v, *rest):
        c = jax.lax.axis_index(axis)
        if kv_to_heads:
            k, v = to_heads(k), to_heads(v)
        else:
            k, v = (jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(x, axis, axis=1, tiled=True), c * hq // G, 1,
                                                 axis=2) for x in (k, v))
        ids = [jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in rest[:2]] if q_ids is not None else [None] * 2
        row_keys = rest[-1] if keys is not None else None
        if row_keys is not None:
            row_keys = jax.lax.dynamic_slice_in_dim(row_keys, c * hq, hq, axis=1)
        out = core(to_heads(q), k, v, *ids, row_keys)  # [b, T, hq, D]
        return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

    return _partition.shard(run, args, specs, split, settings["impl"])


def _ring_attention(q, k, v, *rest, context, has_ids, impl, causal, sm_scale, interpret, block_sizes, dropout_rate,
                    window, logit_soft_cap):
    """Ring attention (Liu et al., 2023) on one device's blocks inside `_context_parallel`'s shard_map: q
    [b, T/C, h, D] stays, the k / v blocks (and their segment ids) pass from device to device round the `context`
    axis, each device attends its queries to every block and merges the partial results by their log-sum-exps.

    Causal with an even number of tokens per device: the zigzag layout (as in Llama 3's context parallelism) so that
    every device does the same work at every step. The tokens are cut into 2C half-blocks and device c attends with
    half-blocks c and 2C - 1 - c (two collective-permutes there, two back for the output): its own pair is causal
    within (the local causal mask is exactly right for [c, 2C - 1 - c]), an earlier device's pair is seen through
    its first half by all of c's queries, a later device's pair wholly by c's second half, half a block of work
    either way. In the contiguous layout (odd tokens per device) device c computes c + 1 of the C blocks and skips
    the rest. A soft cap is per logit, so each block pair applies it; a window is refused (its band would need each
    pair's global offset)."""
    if window is not None:
        raise ValueError(f"flash_attention with window={window} on a mesh with context={context} whose "
                         f"{q.shape[2]} query heads per device do not divide by it (ring attention); expected "
                         "window=None or query heads per device divisible by context")
    if dropout_rate:
        raise ValueError(f"flash_attention with dropout_rate={dropout_rate} on a mesh with context={context} whose "
                         f"{q.shape[2]} query heads per device do not divide by it (ring attention); expected "
                         "dropout_rate=0 or query heads per device divisible by context")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"flash_attention(causal=True) of {q.shape[1] * context} queries to {k.shape[1] * context} "
                         f"keys on a mesh with context={context} (ring attention); expected equal lengths")
    q_ids, kv_ids = rest[:2] if has_ids else (None, None)
    ring = _RingPlan(impl, causal, sm_scale, interpret, block_sizes, context, causal and q.shape[1] % 2 == 0,
                     logit_soft_cap)
    if not ring.zigzag:
        return _ring(q, k, v, q_ids, kv_ids, ring)
    out = _ring(*(None if x is None else ring.to_zigzag(x) for x in (q, k, v, q_ids, kv_ids)), ring)
    return ring.from_zigzag(out)


@dataclasses.dataclass(frozen=True)
class _RingPlan:
    implementation: str
    causal: bool
    sm_scale: float | None
    interpret: bool
    block_sizes: BlockSizes | None
    context: int
    zigzag: bool
    logit_soft_cap: float | None = None

    def shift(self, *xs):
        """Each device's xs passed to the next device round the ring."""
        C = self.context
        pairs = [(i, (i + 1) % C) for i in range(C)]
        return tuple(None if x is None else jax.lax.ppermute(x, _partition.CONTEXT_AXIS, pairs) for x in xs)

    def _zigzag_moves(self):
        """Where the contiguous layout's half-blocks 2d and 2d + 1 of device d go: half-block j belongs to device j
        (slot 0) for j < C, else to device 2C - 1 - j (slot 1). Each list is a permutation of the devices, and an
        even device receives its slot 0 from the first, an odd one from the second."""
        C = self.context
        owner = lambda j: j if j < C else 2 * C - 1 - j  # noqa: E731
        return [(d, owner(2 * d)) for d in range(C)], [(d, owner(2 * d + 1)) for d in range(C)]

    def to_zigzag(self, x):
        """x [b, n, ...] in the contiguous layout -> device c's half-blocks c and 2C - 1 - c."""
        h = x.shape[1] // 2
        first, second = self._zigzag_moves()
        a = jax.lax.ppermute(x[:, :h], _partition.CONTEXT_AXIS, first)
        b = jax.lax.ppermute(x[:, h:], _partition.CONTEXT_AXIS, second)
        even = jax.lax.axis_index(_partition.CONTEXT_AXIS) % 2 == 0
        return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], axis=1)

    def from_zigzag(self, y):
        """`to_zigzag`'s inverse."""
        h = y.shape[1] // 2
        first, second = self._zigzag_moves()
        even = jax.lax.axis_index(_partition.CONTEXT_AXIS) % 2 == 0
        a = jnp.where(even, y[:, :h], y[:, h:])
        b = jnp.where(even, y[:, h:], y[:, :h])
        back = lambda x, moves: jax.lax.ppermute(x, _partition.CONTEXT_AXIS, [(j, i) for i, j in moves])  # noqa
        return jnp.concatenate([back(a, first), back(b, second)], axis=1)

    def _prepared(self, q, k, v, q_ids, kv_ids, causal):
        return _prepared(q, k, v, q_ids, kv_ids, self.implementation, causal, self.sm_scale, self.interpret,
                         self.block_sizes, logit_soft_cap=self.logit_soft_cap)

    def forward(self, q, k, v, q_ids, kv_ids, causal):
        """(out [b, T, h, D] float32, lse [b, T, h], -inf where a query sees no key) of one block pair."""
        out, lse = _forward_with_lse(q, k, v, q_ids, kv_ids, self.implementation, self.sm_scale, self.interpret,
                                     self.block_sizes, causal=causal, logit_soft_cap=self.logit_soft_cap)
        return out.astype(jnp.float32), lse

    def backward(self, q, k, v, q_ids, kv_ids, out, lse, do, causal):
        """float32 (dq, dk, dv) of one block pair, given the global output and lse rows of its queries."""
        T, S, D = q.shape[1], k.shape[1], q.shape[3]
        module = _IMPLEMENTATIONS[self.implementation]
        qp, kp, vp, qi, ki, plan = self._prepared(q, k, v, q_ids, kv_ids, causal)
        like_q = lambda x: _pad(_pad(x, 1, qp.shape[1]), 3, qp.shape[3])  # noqa: E731
        lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # padded queries too: +inf makes every p 0
        lse = jnp.pad(lse, ((0, 0), (0, qp.shape[1] - T), (0, 0)), constant_values=jnp.inf)
        grads = module.backward(qp, kp, vp, qi, ki, None, like_q(out), module.lse_from_rows(lse, k.shape[2]),
                                like_q(do), plan)
        dq, dk, dv = (g[:, :n, :, :D].astype(jnp.float32) for g, n in zip(grads, (T, S, S)))
        return dq, dk, dv

    def step_kind(self, s):
        """Which pair device c meets at step s (the block of device c - s): 0 its own, 1 an earlier device's, 2 a
        later one's (causal only; without causal every pair is 0)."""
        c = jax.lax.axis_index(_partition.CONTEXT_AXIS)
        src = (c - s) % self.context
        return jnp.where(src == c, 0, jnp.where(src < c, 1, 2))

    def pairs(self, T, S):
        """Per `step_kind`: (query slice, key slice, causal) of what device c's T queries attend of a pair of S keys,
        or None for nothing."""
        every = slice(None)
        if not self.causal:
            return [(every, every, False)]
        if self.zigzag:  # an earlier pair through its first half, a later one by the second half of the queries
            return [(every, every, True), (every, slice(0, S // 2), False), (slice(T // 2, None), every, False)]
        return [(every, every, True), (every, every, False), None]

    def on_pairs(self, s, fn, queries, k, v, kv_ids):
        """`fn(pair, k, v, kv_ids)` for the kind of pair met at step s by `queries` queries, a `lax.switch` when
        there are several."""
        branches = [functools.partial(fn, pair) for pair in self.pairs(queries, k.shape[1])]
        if len(branches) == 1:
            return branches[0](k, v, kv_ids)
        return jax.lax.switch(self.step_kind(s), branches, k, v, kv_ids)


def _rows(x, part):
    return None if x is None else x[:, part]


def _into(x, part, n, fill=0.0):
    """x, the rows `part` of n along axis 1, with the other rows `fill`."""
    start = part.start or 0
    widths = [(0, 0)] * x.ndim
    widths[1] = (start, n - start - x.shape[1])
    return jnp.pad(x, widths, constant_values=fill)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, q_ids, kv_ids, ring):
    return _ring_fwd(q, k, v, q_ids, kv_ids, ring)[0]


def _ring_fwd(q, k, v, q_ids, kv_ids, ring):
    """Step s attends to the block of device c - s while the next block is already on its way (its send does not
    depend on the step's work); the merge keeps the output in float32. Residuals: the inputs, the output and the
    log-sum-exp [b, T, h] over every block."""
    T = q.shape[1]

    def attend(pair, k, v, kv_ids):
        if pair is None:
            return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
        qs, ks, causal = pair
        out, lse = ring.forward(q[:, qs], k[:, ks], v[:, ks], _rows(q_ids, qs), _rows(kv_ids, ks), causal)
        return _into(out, qs, T), _into(lse, qs, T, -jnp.inf)

    def merge(acc, part):
        (out, lse), (out_s, lse_s) = acc, part
        new = jnp.logaddexp(lse, lse_s)
        base = jnp.where(jnp.isfinite(new), new, 0.0)
        weight = lambda x: jnp.where(jnp.isfinite(x), jnp.exp(x - base), 0.0)[..., None]  # noqa: E731
        return weight(lse) * out + weight(lse_s) * out_s, new

    def step(s, carry):
        block, acc = carry
        return ring.shift(*block), merge(acc, ring.on_pairs(s, attend, T, *block))

    own = (k, v, kv_ids)
    block, acc = jax.lax.fori_loop(1, ring.context - 1, step, (ring.shift(*own), ring.on_pairs(0, attend, T, *own)))
    out, lse = merge(acc, ring.on_pairs(ring.context - 1, attend, T, *block))
    out = out.astype(q.dtype)
    return out, (q, k, v, q_ids, kv_ids, out, lse)


def _ring_bwd(ring, residuals, do):
    """Step s differentiates device c - s's block with the global output and log-sum-exp (the FlashAttention
    backward of one block needs nothing else); dk and dv of a block travel with it in float32, gathering every
    device's part, and a last pass brings them home. The next block's send does not wait for the step's work."""
    q, k, v, q_ids, kv_ids, out, lse = residuals
    T = q.shape[1]

    def grads(pair, k, v, kv_ids):
        if pair is None:
            return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
        qs, ks, causal = pair
        dq, dk, dv = ring.backward(q[:, qs], k[:, ks], v[:, ks], _rows(q_ids, qs), _rows(kv_ids, ks), out[:, qs],
                                   lse[:, qs], do[:, qs], causal)
        return _into(dq, qs, T), _into(dk, ks, k.shape[1]), _into(dv, ks, k.shape[1])

    def step(s, carry):
        block, (dk, dv), dq = carry
        ahead = ring.shift(*block)
        gq, gk, gv = ring.on_pairs(s, grads, T, *block)
        return ahead, ring.shift(dk + gk, dv + gv), dq + gq

    own = (k, v, kv_ids)
    dq, dk, dv = ring.on_pairs(0, grads, T, *own)
    carry = (ring.shift(*own), ring.shift(dk, dv), dq)
    block, (dk, dv), dq = jax.lax.fori_loop(1, ring.context - 1, step, carry)
    gq, gk, gv = ring.on_pairs(ring.context - 1, grads, T, *block)
    dk, dv = ring.shift(dk + gk, dv + gv)
    return (dq + gq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _implementation(implementation, interpret, allowed=IMPLEMENTATIONS, table_shape=None):
    """The implementation to run: `implementation` (one of `allowed`); for None the defaults table's choice for a
    call of `table_shape` (`kernels.default_implementation('flash_attention', **table_shape)`; None: not read) off
    interpret mode, else the backend's."""
    impl = resolve_implementation(implementation, interpret=interpret, allowed=allowed)
    if implementation is None and table_shape is not None and not interpret:
        impl = default_implementation("flash_attention", **table_shape)
    if impl == "mosaic_gpu" and not mosaic_gpu.AVAILABLE:
        raise ValueError("implementation='mosaic_gpu' needs JAX >= 0.11 (Mosaic GPU's plgpu.kernel); expected another")
    if impl == "triton" and not triton.AVAILABLE:
        if implementation is not None:
            raise ValueError("implementation='triton'; this JAX has no Pallas Triton backend, expected another")
        logging.log_first_n(logging.WARNING, "flash_attention: no Pallas Triton backend; using 'xla'", 1)
        impl = "xla"
    return impl


def _prepared(q, k, v, q_ids, kv_ids, impl, causal, sm_scale, interpret, block_sizes, dropout_rate=0.0, window=None,
              logit_soft_cap=None):
    """(q, k, v, q_ids, kv_ids) padded to whole tiles (and Triton's power-of-two head dim), and the _Plan."""
    B, T, H, D = q.shape
    S = k.shape[1]
    blocks = choose_block_sizes(impl, D, T, S, block_sizes)
    if impl == "xla":
        t_pad, s_pad = T, _round_up(S, blocks.block_k)
    else:
        t_pad = _round_up(T, math.lcm(blocks.block_q, blocks.block_q_bwd))
        s_pad = _round_up(S, math.lcm(blocks.block_k, blocks.block_k_bwd))
    # Triton tiles are powers of two in every dimension, so odd head dims are zero-padded (zeros change no logit).
    d_pad = max(16, 1 << (D - 1).bit_length()) if impl == "triton" else D
    plan = _Plan(
        implementation=impl,
        causal=causal,
        sm_scale=float(D**-0.5 if sm_scale is None else sm_scale),
        kv_len=S if s_pad != S else None,
        blocks=blocks,
        interpret=interpret,
        dropout_rate=dropout_rate,
        window=window,
        logit_soft_cap=logit_soft_cap,
    )
    logging.log_first_n(logging.DEBUG, "flash_attention: %s q%s k%s %s", 1, impl, q.shape, k.shape, blocks)
    q, k, v = _pad(q, 1, t_pad), _pad(k, 1, s_pad), _pad(v, 1, s_pad)
    q, k, v = _pad(q, 3, d_pad), _pad(k, 3, d_pad), _pad(v, 3, d_pad)
    if q_ids is not None:
        q_ids, kv_ids = _pad(q_ids.astype(jnp.int32), 1, t_pad), _pad(kv_ids.astype(jnp.int32), 1, s_pad)
    return q, k, v, q_ids, kv_ids, plan


def decode_attention(q, k, v, *, segment_ids=None, k_scale=None, v_scale=None, sm_scale=None, num_splits=None,
                     implementation=None, interpret=False, block_sizes=None, window=None, logit_soft_cap=None,
                     q_positions=None):
    """Attention of a decoding step's few queries to a long KV cache, split along the cache (flash-decoding).

    Args:
      q: [batch, len, heads, head_dim], len small (the step's new tokens); k, v: [batch, kv_len, kv_heads,
        head_dim], the cache; dtypes and head rules as `flash_attention`. Not causal: `segment_ids` masks.
      segment_ids: None or a pair (int [batch, len], int [batch, kv_len]): a query sees the keys with its id (a
        cache's unfilled slots and left padding carry id 0, which no query has; blocks of them are skipped).
      k_scale, v_scale: with an int8 cache (`quantize_kv`), float [batch, kv_len, kv_heads]: k = k_int8 * k_scale
        per key and head, likewise v. The kernels read int8 tiles (half of bf16's bytes) and apply the scales to
        the logits' and probabilities' columns.
      num_splits: parts of the cache attended in parallel, each a contiguous kv_len / num_splits slice, merged by
        their log-sum-exps; None picks enough for about `_DECODE_PROGRAMS` programs on GPU (1 elsewhere).
      sm_scale, implementation, interpret, block_sizes, logit_soft_cap: as `flash_attention`.
      window: None or a pair (left, right) of ints >= 0, with `q_positions`: the query in cache slot p sees the
        slots p - left ... p + right (a sliding window of W keys: (W - 1, 0)). The slots outside take an id no
        query has, so the kernels skip their tiles like unfilled ones.
      q_positions: int, broadcastable to [batch, len]: each query's cache slot (where its own key was written);
        needed with `window` only.
    Returns:
      [batch, len, heads, head_dim] in q's dtype, equal to `flash_attention(q, k, v, segment_ids=segment_ids)`
      (with a window: `flash_attention`'s over the slots' positions). Forward only (generation does not
      differentiate).

    The G = heads / kv_heads query heads that share a kv head (and the len queries) become one query tile of
    len * G rows against that kv head, so each program reads its slice of k and v once for all of them instead of
    once per query head, and there are batch * kv_heads * num_splits programs instead of batch * heads, each over
    kv_len / num_splits keys: with one sequence and 8 kv heads `flash_attention` runs 32 programs over the whole
    cache, this one 8 * num_splits programs over a slice each.
    """
    scales = _validate_kv_scales(k, v, k_scale, v_scale)
    as_q = lambda a: jax.ShapeDtypeStruct(a.shape, q.dtype)  # noqa: E731  (an int8 cache: checked as q's dtype)
    q_ids, kv_ids = _validate(q, *((k, v) if scales is None else (as_q(k), as_q(v))), False, segment_ids, sm_scale,
                              interpret, block_sizes)
    B, T, H, D = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    window, logit_soft_cap = _validate_window(window), _validate_soft_cap(logit_soft_cap)
    positions = _validate_positions(q_positions, window, (B, T))
    impl = _implementation(implementation, interpret)
    if num_splits is None:
        num_splits = _decode_splits(impl, B * KVH, S)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1 or S % num_splits:
        raise ValueError(f"num_splits={num_splits!r}; expected None or a positive int dividing kv_len={S}")
    if q_ids is None:  # one id for every query and key: the split code below always masks by ids
        q_ids, kv_ids = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    attend = functools.partial(_split_decode, k=k, v=v, scales=scales, num_splits=num_splits, impl=impl,
                               sm_scale=sm_scale, interpret=interpret, block_sizes=block_sizes,
                               logit_soft_cap=logit_soft_cap)
    if window is None:
        return attend(q, q_ids, kv_ids)
    # Each query its own band of slots, as ids: a slot outside takes ~id (never the query's own id). One query at
    # a time, since a tile of rows shares one row of kv ids.
    slots = jnp.arange(S, dtype=jnp.int32)[None, :]
    outs = []
    for t in range(T):
        p, ids = positions[:, t:t + 1], q_ids[:, t:t + 1]
        in_band = (slots >= p - window[0]) & (slots <= p + window[1])
        outs.append(attend(q[:, t:t + 1], ids, jnp.where(in_band, kv_ids, ~ids)))
    return jnp.concatenate(outs, axis=1)


def _split_decode(q, q_ids, kv_ids, *, k, v, scales, num_splits, impl, sm_scale, interpret, block_sizes,
                  logit_soft_cap):
    """`decode_attention` of validated operands (int32 ids [B, T] and [B, S])."""
    B, T, H, D = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G, P = H // KVH, num_splits
    # Query heads of one kv head as rows: [B, T, KVH, G, D] -> [B, T * G, KVH, D]; each split repeats them.
    rows = q.reshape(B, T, KVH, G, D).transpose(0, 1, 3, 2, 4).reshape(B, T * G, KVH, D)
    rows = jnp.broadcast_to(rows[:, None], (B, P, T * G, KVH, D)).reshape(B * P, T * G, KVH, D)
    row_ids = jnp.broadcast_to(jnp.repeat(q_ids, G, axis=1)[:, None], (B, P, T * G))
    split = lambda a: a.reshape(B * P, S // P, *a.shape[2:])  # noqa: E731  contiguous slices of the cache
    scales = None if scales is None else tuple(split(s.astype(jnp.float32)) for s in scales)
    out, lse = _forward_with_lse(rows, split(k), split(v), row_ids.reshape(B * P, T * G), split(kv_ids), impl,
                                 sm_scale, interpret, block_sizes, scales, logit_soft_cap=logit_soft_cap)
    # Merge the splits: weights exp(lse_p - max lse); a split that saw no key (lse -inf) weighs 0.
    out, lse = out.reshape(B, P, T * G, KVH, D), lse.reshape(B, P, T * G, KVH)
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = jnp.sum(weight, axis=1)
    merged = jnp.sum(weight[..., None] * out.astype(jnp.float32), axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    return merged.reshape(B, T, G, KVH, D).transpose(0, 1, 3, 2, 4).reshape(B, T, H, D).astype(q.dtype)


# Programs `decode_attention` aims for on GPU: about two waves of an H100/H200's 132 SMs.
_DECODE_PROGRAMS = 256
# Fewest keys per split: below a few tiles a split's fixed cost (its query tile, its partial output) dominates.
_DECODE_MIN_SPLIT = 512


def _decode_splits(impl, programs, kv_len):
    """The default num_splits: a power of two dividing kv_len, up to _DECODE_PROGRAMS / programs, each split at
    least _DECODE_MIN_SPLIT keys. 1 off GPU: a TPU core runs the grid in order and the 'xla' path is one scan."""
    if impl != "triton":
        return 1
    splits = 1
    while (programs * splits * 2 <= _DECODE_PROGRAMS and kv_len % (splits * 2) == 0
           and kv_len // (splits * 2) >= _DECODE_MIN_SPLIT):
        splits *= 2
    return splits


def _forward_with_lse(q, k, v, q_ids, kv_ids, impl, sm_scale, interpret, block_sizes, kv_scales=None, causal=False,
                      logit_soft_cap=None):
    """(out [B, T, H, D], lse [B, T, H] float32, natural log, -inf where a query sees no key) of the forward kernel,
    on the ambient mesh's rows and heads like `flash_attention`; kv_scales: an int8 k and v's (k_scale, v_scale)."""
    B, T, H, D = q.shape
    q, k, v, q_ids, kv_ids, plan = _prepared(q, k, v, q_ids, kv_ids, impl, causal, sm_scale, interpret, block_sizes,
                                             logit_soft_cap=logit_soft_cap)
    module = _IMPLEMENTATIONS[impl]
    scales = () if kv_scales is None else tuple(_pad(s, 1, k.shape[1]) for s in kv_scales)

    def run(q, k, v, q_ids, kv_ids, *scales):
        out, lse = module.forward(q, k, v, q_ids, kv_ids, None, plan, scales or None)
        return out, module.lse_rows(lse, q.shape)

    axes = _partition.auto_axes(impl)
    b, m = _partition.batch_axes(axes, q.shape[0]), _partition.model_axis(axes, q.shape[2], k.shape[2])
    P = jax.sharding.PartitionSpec
    seq, ids = P(b, None, m, None), P(b, None)
    out, lse = _partition.shard(run, (q, k, v, q_ids, kv_ids, *scales),
                                (seq, seq, seq, ids, ids, *[P(b, None, m)] * len(scales)), (seq, P(b, None, m)),
                                impl)
    lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)  # the kernels' +inf (no visible key) as the merge needs it
    return out[:, :T, :, :D], lse[:, :T]


def _cudnn_on_mesh(q, k, v, ids, **settings):
    """`cudnn.attention(q, k, v, ids, **settings)` on the ambient mesh's rows and heads, in the Pallas kernels'
    shard_map (kernels/_partition.py): XLA's own partitioning of cuDNN's custom call refuses some splits (sequence,
    head dim), and this way every implementation splits alike. ids: the segment ids [B, T] of q and k (`cudnn.check`
    takes one array only), or None."""
    axes = _partition.auto_axes("cudnn")
    b, m = _partition.batch_axes(axes, q.shape[0]), _partition.model_axis(axes, q.shape[2], k.shape[2])
    qkv = jax.sharding.PartitionSpec(b, None, m, None)
    args, specs = (q, k, v), (qkv,) * 3
    if ids is not None:
        args, specs = args + (ids,), specs + (jax.sharding.PartitionSpec(b, None),)
    return _partition.shard(functools.partial(cudnn.attention, **settings), args, specs, qkv, "cudnn")


def _on_mesh(q, k, v, q_ids, kv_ids, keys, plan):
    """A Pallas kernel runs on each device's batch rows and heads (kernels/_partition.py), with the same rows and
    heads of the dropout keys."""
    axes = _partition.auto_axes(plan.implementation)
    b, m = _partition.batch_axes(axes, q.shape[0]), _partition.model_axis(axes, q.shape[2], k.shape[2])
    args, specs, seq = _operands(q, k, v, q_ids, kv_ids, keys, b, None, m)

    def run(q, k, v, *rest):
        ids = rest[:2] if q_ids is not None else (None, None)
        return _attention(q, k, v, *ids, rest[-1] if keys is not None else None, plan)

    return _partition.shard(run, args, specs, seq, plan.implementation)


def _operands(q, k, v, q_ids, kv_ids, keys, rows, tokens, heads):
    """(args, in_specs, the q / k / v / output spec) of an attention shard_map: q, k, v [B, T, H, D] split by `rows`,
    `tokens` and `heads` (axis names or None), then the segment ids [B, T] and dropout keys [B, H] where given."""
    P = jax.sharding.PartitionSpec
    qkv = P(rows, tokens, heads, None)
    args, specs = [q, k, v], [qkv] * 3
    if q_ids is not None:
        args, specs = args + [q_ids, kv_ids], specs + [P(rows, tokens)] * 2
    if keys is not None:
        args, specs = args + [keys], specs + [P(rows, heads)]
    return tuple(args), tuple(specs), qkv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_ids, kv_ids, keys, plan):
    return _IMPLEMENTATIONS[plan.implementation].forward(q, k, v, q_ids, kv_ids, keys, plan)[0]


def _attention_fwd(q, k, v, q_ids, kv_ids, keys, plan):
    out, lse = _IMPLEMENTATIONS[plan.implementation].forward(q, k, v, q_ids, kv_ids, keys, plan)
    return out, (q, k, v, q_ids, kv_ids, keys, out, lse)


def _attention_bwd(plan, residuals, do):
    dq, dk, dv = _IMPLEMENTATIONS[plan.implementation].backward(*residuals, do, plan)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pad(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def choose_block_sizes(impl, head_dim, q_len, kv_len, override=None):
    """The BlockSizes `flash_attention` uses: the heuristic table (Mosaic: the traced-for TPU generation's), then
    `override`'s non-None fields, then clipped to the (tile-rounded) sequence lengths."""
    table = _DEFAULT_BLOCKS[impl]
    if impl == "mosaic_tpu":
        table = _MOSAIC_BLOCKS.get(tpu_generation(), table)
    default = table[min(d for d in table if d >= head_dim)]
    chosen = {f.name: getattr(default, f.name) for f in dataclasses.fields(BlockSizes)}
    if override is not None:
        for name, val in dataclasses.asdict(override).items():
            if val is not None and name.startswith("block_") and not _tile_fits(impl, val):
                raise ValueError(f"block_sizes.{name}={val}; expected {_TILE_RULE[impl]} for implementation={impl!r}")
        chosen.update({name: val for name, val in dataclasses.asdict(override).items() if val is not None})
    # Never tile past the (rounded-up) sequence: a 100-token input gets one 128 tile, not four 512 ones.
    for name, length in (("block_q", q_len), ("block_q_bwd", q_len), ("block_k", kv_len), ("block_k_bwd", kv_len)):
        chosen[name] = min(chosen[name], _fit_length(impl, length))
    return BlockSizes(**chosen)


_TILE_RULE = {"xla": "a positive int", "triton": "a power of two >= 16", "mosaic_tpu": "a multiple of 128",
              "mosaic_gpu": "a multiple of 64"}


def _tile_fits(impl, size):
    if impl == "triton":
        return size >= _MIN_BLOCK[impl] and size & (size - 1) == 0
    return size % _MIN_BLOCK[impl] == 0


def _fit_length(impl, length):
    if impl == "mosaic_gpu":  # a CTA's 2 x 64 query rows (and the backward's 128 keys): never a smaller tile
        return _round_up(length, 128)
    if impl == "triton":
        return max(_MIN_BLOCK[impl], 1 << (length - 1).bit_length())
    return _round_up(length, _MIN_BLOCK[impl])


def _validate_kv_scales(k, v, k_scale, v_scale, *, names=("k", "v"), what="int8 k and v",
                        layout="[batch, kv_len, kv_heads]"):
    """None for a float cache; (k_scale, v_scale) for an int8 one, whose scales must be float over k's first three
    dims (`layout`; `names` and `what` name the cache in the errors: decode_attention's k and v, paged_attention's
    pages)."""
    if getattr(k, "dtype", None) != jnp.int8 and getattr(v, "dtype", None) != jnp.int8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale with {names[0]}.dtype={k.dtype}; expected {what} with them")
        return None
    if k.dtype != jnp.int8 or v.dtype != jnp.int8:
        raise ValueError(f"{names[0]}.dtype={k.dtype}, {names[1]}.dtype={v.dtype}; expected both int8 or neither "
                         "(a quantised cache)")
    want = tuple(k.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or tuple(s.shape) != want or not jnp.issubdtype(s.dtype, jnp.floating):
            raise ValueError(f"{name}={None if s is None else (tuple(s.shape), str(s.dtype))}; {what} need float "
                             f"scales {layout} = {want}")
    return k_scale, v_scale


def quantize_kv(x):
    """(int8 [..., D], float32 scale [...]) of keys or values [..., D]: per row (token and head) absmax / 127, the
    format `decode_attention` reads."""
    return quantize_int8(x, axis=-1)


def _validate_dropout(rate, rng):
    """Returns the rate as a float; raises ValueError on a bad rate or a missing / non-key rng."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate={rate!r}; expected a Python float in [0, 1)")
    if rate and rng is None:
        raise ValueError(f"dropout_rng=None with dropout_rate={rate}; expected a jax.random key")
    if rate:
        dtype, shape = getattr(rng, "dtype", None), getattr(rng, "shape", None)
        typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
        if not (typed or (dtype == jnp.uint32 and shape == (2,))):
            raise ValueError(f"dropout_rng has dtype {dtype} and shape {shape}; expected one jax.random key")
    return float(rate)


def _validate_window(window):
    """The window as a tuple of two ints, or None; raises ValueError on anything else."""
    if window is None:
        return None
    pair = tuple(window) if isinstance(window, (tuple, list)) else None
    if pair is None or len(pair) != 2 or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0
                                             for w in pair):
        raise ValueError(f"window={window!r}; expected None or a pair (left, right) of ints >= 0")
    return int(pair[0]), int(pair[1])


def _validate_soft_cap(cap):
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0):
        raise ValueError(f"logit_soft_cap={cap!r}; expected None or a positive float")
    return None if cap is None else float(cap)


def _validate_positions(q_positions, window, shape):
    """decode_attention's query slots as int32 `shape` (None without a window)."""
    if (q_positions is None) != (window is None):
        raise ValueError(f"q_positions={'None' if q_positions is None else 'given'} with window={window}; expected "
                         "q_positions (each query's cache slot) exactly when a window is given")
    if window is None:
        return None
    dtype = jnp.result_type(q_positions)
    if not jnp.issubdtype(dtype, jnp.integer) or not _broadcasts(jnp.shape(q_positions), shape):
        raise ValueError(f"q_positions of shape {jnp.shape(q_positions)} and dtype {dtype}; expected ints "
                         f"broadcastable to [batch, len] = {shape}")
    return jnp.broadcast_to(jnp.asarray(q_positions, jnp.int32), shape)


def _broadcasts(shape, target):
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _validate(q, k, v, causal, segment_ids, sm_scale, interpret, block_sizes):
    """Raises ValueError on bad input; returns (q_ids, kv_ids), either both None or both arrays."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name}.shape={getattr(x, 'shape', None)}; expected rank 4 [batch, len, heads, head_dim]")
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype}; expected one of float32, bfloat16, float16")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}; expected all equal")
    if k.shape != v.shape:
        raise ValueError(f"k.shape={k.shape}, v.shape={v.shape}; expected equal shapes")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch={k.shape[0]}, q batch={q.shape[0]}; expected equal")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k head_dim={k.shape[3]}, q head_dim={q.shape[3]}; expected equal")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads={q.shape[2]}, kv heads={k.shape[2]}; expected heads divisible by kv_heads")
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r}; expected a bool")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret={interpret!r}; expected a bool")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or sm_scale <= 0):
        raise ValueError(f"sm_scale={sm_scale!r}; expected None or a positive Python float")
    if block_sizes is not None:
        if not isinstance(block_sizes, BlockSizes):
            raise ValueError(f"block_sizes={block_sizes!r}; expected None or a kernels.attention.BlockSizes")
        for name, val in dataclasses.asdict(block_sizes).items():
            if val is not None and (not isinstance(val, int) or val <= 0):
                raise ValueError(f"block_sizes.{name}={val!r}; expected None or a positive int")
    if segment_ids is None:
        return None, None
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids has {len(segment_ids)} entries; expected a pair (q_ids, kv_ids)")
        q_ids, kv_ids = segment_ids
    else:
        if T != S:
            raise ValueError(f"segment_ids is one array but len={T} != kv_len={S}; expected a pair (q_ids, kv_ids)")
        q_ids = kv_ids = segment_ids
    for name, ids, want in (("q segment_ids", q_ids, (B, T)), ("kv segment_ids", kv_ids, (B, S))):
        if tuple(getattr(ids, "shape", ())) != want:
            raise ValueError(f"{name}.shape={getattr(ids, 'shape', None)}; expected [batch, len] = {want}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={ids.dtype}; expected an integer dtype")
    return q_ids, kv_ids
