"""Hopper (sm_90a) flash attention in Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`, JAX >= 0.11): the
FlashAttention-3 schedule, warp-specialised.

Forward: one CTA per (128-query tile, q head, batch row), three warpgroups. The producer (a few registers) issues
TMA loads of the K and V tiles its queries see into a `stages`-deep shared-memory ring, each slot's arrival on an
mbarrier; two consumer warpgroups each own 64 query rows (one wgmma M tile), compute S = Q Kᵀ and O += P V with
wgmma (accumulators in registers, P fed to the second wgmma from registers), the online softmax in registers in the
exp2 domain, and free a slot by arriving on its "consumed" mbarrier (two arrivals: both consumers). A rendezvous
barrier keeps the consumers half a step apart, so one's softmax runs while the other's GEMMs hold the tensor cores
(FA3's ping-pong). Causal masks and sliding windows: the producer loads only the tiles of the CTA's band
(`_band.kv_range`); each consumer computes its own band, the mask applied only on the tiles that straddle an edge
(`_band.inner_range`), and passes through the CTA's other tiles (waiting for each and freeing it, so the barriers'
phases stay in step). The output goes back through shared memory by TMA; the log-sum-exp (base 2, [B, H, T],
+inf where a query sees no key) is the backward's residual.

Grouped-query attention: query heads vary fastest in the grid, so the CTAs of one kv head's group run together and
share its K / V tiles through L2; a K / V tile in shared memory serves the CTA's 128 query rows of one head.

Backward: delta = rowsum(out * do) by XLA, then a dq kernel (the forward's CTAs and K / V ring) and a dk / dv kernel
(one CTA per 128 keys of a kv head; the producer streams the q, do, lse and delta tiles of the band for every q head
of the group, so k and v are read once per group and dk / dv need no sum over heads). At head dim 256 dv and dk
run as two kernels (their accumulators together exceed a consumer's registers), with one-stage rings.

Segment ids (the Triton kernel's semantics): each consumer loads its rows' ids once; the streamed tiles' ids ride
a ring of their own beside the operands' (TMA, ready and free mbarriers), compared on every tile in the wgmma
accumulator's layout. Tiles of other documents are skipped: `_segment_bounds` (XLA, `triton._block_bounds` per CTA
and per consumer) is read as scalars and narrows the producer's and each consumer's range of tiles. Logit soft cap: c * tanh(s / c) before the masks;
the backward's derivative 1 - tanh² is recovered from p and lse (`_capped_gradient`). Dropout: the Triton kernel's
mask bit for bit (`reference.dropout_multiplier`'s hash); XLA computes its per-query half ([B, H, T] int32, read
like lse), the kernels mix in each key position.

Not implemented (refused in one line by `refusal`): float32 inputs, head dims other than 64 / 128 / 256, int8 kv.
`interpret=True` runs the kernels in Mosaic GPU's interpreter (threads, shared memory, TMA, mbarriers and wgmma
simulated on the CPU); there P (and ds) go to wgmma through shared memory and each product lands in a fresh
accumulator that is added (the interpreter reads wgmma's A only from shared memory and has no `pl.run_state`); on a
GPU they are register operands accumulating in place.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention import _band, triton
from kernels.attention.reference import _DROPOUT_BITS, NEG_INF, _mix, attention_mask, soft_cap

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    AVAILABLE = hasattr(plgpu, "kernel") and hasattr(plgpu, "InterpretGPUParams")  # JAX >= 0.11
except ImportError:
    plgpu = None
    AVAILABLE = False

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
ROWS = 64  # query rows per consumer warpgroup: one wgmma M tile
CONSUMERS = 2  # consumer warpgroups per CTA; a CTA's query tile is CONSUMERS * ROWS rows
BLOCK_Q = CONSUMERS * ROWS
HEAD_DIMS = (64, 128, 256)
# The backward's dk and dv accumulators of a 64-row tile take 2 * head_dim / 2 registers a thread: 256 at head dim
# 256, past the 232 a consumer has, so there dv and dk run as two kernels (`_dkv_kernel`'s `grads`).
SPLIT_HEAD_DIMS = (256,)
DTYPES = (jnp.bfloat16, jnp.float16)
# Registers per thread after `setmaxnreg`: consumers take what the producer gives up (65536 per SM / 384 threads is
# 170 each on entry; 2 * 232 + 40 = 504 = 3 * 168).
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40


def backward_stages(head_dim, stages):
    """The backward rings' depth: `stages`, but 1 at head dim 256, where shared memory holds two [128, 256] row
    tiles (q and do in dq, k and v in dk) and the rings' [64, 256] tiles: 128 + 64 KiB at one stage, 256 at two.
    (32-row tiles would keep two stages in 192 KiB, but each is wgmma's B both transposed, in S = Q Kᵀ, and along a
    32-long contraction, in dq += ds K: Mosaic (JAX 0.11.2) issues the latter in groups of swizzle / 2 elements, so
    it needs a 64-byte swizzle, with which layout inference fails on the former.)"""
    return 1 if head_dim in SPLIT_HEAD_DIMS else stages


def default_blocks(head_dim):
    """(block_k, stages) per head dim: K and V rings of `stages` tiles of block_k keys beside 2 x 64 query rows,
    within the 227 KiB of shared memory (head dim 256: 64 + 2 * 2 * 64 KiB = 192 KiB at 64 keys a tile; 128: 32 +
    128 = 160 KiB; 64: 16 + 96 = 112 KiB, three stages)."""
    return {64: (128, 3), 128: (128, 2), 256: (64, 2)}[head_dim]


def refusal(q, k, plan, kv_scales=None, backward=False):
    """Why this module cannot run the call, in one line, or None when it can. q, k: the padded operands (or
    ShapeDtypeStructs)."""
    D = q.shape[3]
    if not AVAILABLE:
        return "implementation='mosaic_gpu' needs JAX >= 0.11 (jax.experimental.pallas.mosaic_gpu.kernel)"
    blocks = plan.blocks
    reasons = [
        (jnp.dtype(q.dtype) not in map(jnp.dtype, DTYPES),
         f"dtype {jnp.dtype(q.dtype).name}; expected bfloat16 or float16"),
        (D not in HEAD_DIMS, f"head_dim {D}; expected one of {HEAD_DIMS}"),
        (kv_scales is not None, "int8 k / v; expected a float cache"),
        (plan.blocks.block_q != BLOCK_Q, f"block_q={plan.blocks.block_q}; expected {BLOCK_Q}"),
        (plan.blocks.block_k % 64, f"block_k={plan.blocks.block_k}; expected a multiple of 64"),
        (q.shape[1] % BLOCK_Q or k.shape[1] % plan.blocks.block_k,
         f"lengths {q.shape[1]} / {k.shape[1]}; expected multiples of {BLOCK_Q} / {plan.blocks.block_k}"),
    ]
    if backward:  # dk / dv: 2 x 64 key rows a CTA
        reasons += [
            (k.shape[1] % BLOCK_Q, f"kv length {k.shape[1]} in the backward; expected a multiple of {BLOCK_Q}"),
            ((blocks.block_q_bwd or 0) % 64 or q.shape[1] % (blocks.block_q_bwd or 1),
             f"block_q_bwd={blocks.block_q_bwd}; expected a multiple of 64 dividing the length"),
            ((blocks.block_k_bwd or 0) % 64 or k.shape[1] % (blocks.block_k_bwd or 1),
             f"block_k_bwd={blocks.block_k_bwd}; expected a multiple of 64 dividing the kv length"),
            (D in SPLIT_HEAD_DIMS and max(blocks.block_q_bwd or 0, blocks.block_k_bwd or 0) > 64,
             f"block_q_bwd / block_k_bwd {blocks.block_q_bwd} / {blocks.block_k_bwd} at head_dim {D}; expected 64 "
             "(shared memory)"),
        ]
    for bad, why in reasons:
        if bad:
            return f"implementation='mosaic_gpu' does not support {why}"
    return None


def _tile_transforms(dtype):
    """128-byte swizzled tiles: what TMA writes and wgmma reads without bank conflicts (rows of >= 64 16-bit
    elements)."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


def _rendezvous(barrier):
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _logits(s, plan):
    """The logits in the exp2 domain of a tile of raw scores s = q kᵀ: scaled by sm_scale, then
    `reference.soft_cap`'s c * tanh(s / c) when the plan has a cap (the Triton kernel's order)."""
    if plan.logit_soft_cap is None:
        return s * (plan.sm_scale * _LOG2E)
    return soft_cap(s * plan.sm_scale, plan.logit_soft_cap)[0] * _LOG2E


def _capped_gradient(p, lse, dim, plan):
    """p times the soft cap's derivative 1 - tanh² (p unchanged without a cap), the derivative recovered from p
    itself: the capped logit is c * tanh = (log2(p) + lse) * ln 2. Holding the derivative from the logits' step
    instead kept one more [64, cols] float32 tile alive across the wgmmas and spilled 92 / 176 bytes in the dk / dv
    consumer at head dim 128 (causal, segment ids). lse: the rows' vector along `dim`; p = 0 (masked) stays 0."""
    if plan.logit_soft_cap is None:
        return p
    t = (jnp.log2(p) + lax.broadcast_in_dim(lse, p.shape, [dim])) * (_LN2 / plan.logit_soft_cap)
    return jnp.where(p > 0, p * (1.0 - t * t), 0.0)


def _ids_scratch(stages, block):
    """Shared memory of int32 row vectors (segment ids; dropout's row keys): the consumers' own 64 rows' (loaded
    once, with their barrier) and a ring of the streamed tiles' beside the operands' ring (ready and free barriers
    of its own, so that every ring keeps one TMA copy per barrier phase)."""
    return (plgpu.SMEM((CONSUMERS, ROWS), jnp.int32), plgpu.Barrier(num_barriers=CONSUMERS),
            plgpu.SMEM((stages, block), jnp.int32), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages))


def _own_ids(src, ids, wg, dim):
    """The warpgroup's 64 rows' vector `src` (a [64] int32 slice in global memory; ids `_ids_scratch`'s refs), a
    vector along `dim` of a wgmma tile."""
    own_smem, own_ready = ids[:2]
    plgpu.copy_gmem_to_smem(src, own_smem.at[wg], own_ready.at[wg])
    plgpu.barrier_wait(own_ready.at[wg])
    return _load_row(own_smem.at[wg], dim)


def _load_ids(src, ids, slot):
    """The producer's TMA copy of `src` (a tile's int32 vector in global memory) into ring slot `slot`."""
    plgpu.copy_gmem_to_smem(src, ids[2].at[slot], ids[3].at[slot])


def _ring_ids(ids):
    """(ready, free) barriers of the ids ring, for `_pass_by` and the producer."""
    return ids[3], ids[4]


def _take(smem, ready, free, slot, dim):
    """A vector from ring slot `slot` (waited for, loaded along `dim` of a wgmma tile, the slot freed)."""
    plgpu.barrier_wait(ready.at[slot])
    vector = _load_row(smem.at[slot], dim)
    plgpu.barrier_arrive(free.at[slot])
    return vector


def _row_keys(keys, length):
    """int32 [B, H, length]: the per-query half _mix(key, q) of `reference.dropout_multiplier`'s hash
    _mix(_mix(key, q), k), from the dropout keys [B, H]; one small XLA computation, so the kernels mix once per
    entry."""
    return _mix(keys[:, :, None], jnp.arange(length, dtype=jnp.int32)[None, None, :])


def _dropped(x, row_keys, k_pos, rate):
    """x times `reference.dropout_multiplier` of its tile (1 / (1 - rate) where kept, 0 where dropped), bit for bit:
    row_keys (`_row_keys` of the tile's queries) and k_pos broadcast to x's shape."""
    bits = _mix(row_keys, k_pos)
    threshold = np.int32(round(rate * (1 << _DROPOUT_BITS)))
    keep = lax.shift_right_logical(bits, np.int32(32 - _DROPOUT_BITS)) >= threshold
    return jnp.where(keep, x * np.float32(1.0 / (1.0 - rate)), 0.0)


def _same_segment(row_ids, col_ids, shape, visible):
    """`visible` (a mask or None) and row id == column id over a wgmma tile of `shape`; `visible` itself without
    segment ids (row_ids None)."""
    if row_ids is None:
        return visible
    same = lax.broadcast_in_dim(row_ids, shape, [0]) == lax.broadcast_in_dim(col_ids, shape, [1])
    return same if visible is None else jnp.logical_and(visible, same)


def _scores(q_tile, k_tile, rows, cols, turn):
    """S = q_tile k_tileᵀ [rows, cols] float32; `turn` (or None): the ping-pong rendezvous, met while the wgmma
    runs."""
    def run(acc):
        plgpu.wgmma(acc, q_tile, plgpu.transpose_ref(k_tile, (1, 0)))
        if turn is not None:
            _rendezvous(turn)
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC((rows, cols), jnp.float32))


def _accumulate(acc, p, v_tile, p_smem):
    """acc + p @ v_tile. On a GPU (p_smem None) p is wgmma's A operand from registers and acc itself the
    accumulator. The interpreter takes A only from shared memory and has no `pl.run_state`: there p goes through
    p_smem and the product lands in a fresh accumulator that is added."""
    if p_smem is not None:
        p_smem[...] = p
        plgpu.commit_smem()

        def fresh(ref):
            plgpu.wgmma(ref, p_smem, v_tile)
            plgpu.wgmma_wait(0)
            return ref[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

    def run(ref):
        plgpu.wgmma(ref, p, v_tile)

    return pl.run_state(run)(plgpu.ACC.init(acc))


def _visible(q0, k0, shape, plan):
    """The [ROWS, block_k] mask of a tile straddling the band's edges (or the padded keys' edge): query rows from
    q0, keys from k0; None when nothing is masked."""
    q_pos = q0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    k_pos = k0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    return attention_mask(q_pos, k_pos, None, None, causal=plan.causal, kv_len=plan.kv_len, window=plan.window)


def _positions(start, shape, dim):
    """start + the index along `dim` of a wgmma tile of `shape`: a vector broadcast over the other dim (a whole
    int32 iota tile took 32 more registers a thread and spilled the dk / dv consumer at head dim 128)."""
    n = shape[dim]
    vector = start + plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=plgpu.Layout.WGMMA.reduce(1 - dim))
    return lax.broadcast_in_dim(vector, shape, [dim])


def _per_step(slot, wg):
    """(slot, wg) made opaque to LLVM, for a backward loop body to index its shared-memory tiles with. A tile
    address the loop does not change (the consumer's own rows; every slot of a one-stage ring) let LLVM hoist its
    wgmma descriptors out of the loop, one 64-bit pair per 16-long k step of every GEMM (68 at head dim 256, 136
    registers), which ptxas then spilled (D256 dq 360 / 372 bytes, D128 causal dk / dv 20 / 40); indexed through
    this, they are rebuilt each step on the uniform datapath beside the wgmmas, and nothing spills."""
    return lax.optimization_barrier((slot, wg))


def _clamp(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _split_band(first, stop, inner, masked_from=None):
    """(first, a, z, stop): a tile's band [first, stop) of other tiles and, inside it, [a, z) the tiles wholly
    inside the band (`_band.inner_range`'s `inner`), which need no mask; masked_from (or None): a tile index from
    which every tile is masked again (the one holding the last real key). a is None where no tile before the inner
    ones is masked, z None where none after is (those loops are not emitted)."""
    first, stop = jnp.int32(first), jnp.int32(stop)
    inner_first, inner_stop = inner
    a = None if inner_first is None else _clamp(inner_first, first, stop)
    z = None if inner_stop is None else _clamp(inner_stop, first if a is None else a, stop)
    if masked_from is not None:
        z = _clamp(jnp.int32(masked_from), first if a is None else a, stop if z is None else z)
    return first, a, z, stop


def _walk(lo, hi, band, step, pass_by, carry):
    """A consumer's pass over the CTA's tiles [lo, hi): step(j, carry, masked) on its own band's (`_split_band`),
    pass_by(j) on the others, so that it waits for and frees every tile the producer loads."""
    first, a, z, stop = band
    lax.fori_loop(lo, first, lambda j, c: (pass_by(j), c)[1], None)
    if a is not None:
        carry = lax.fori_loop(first, a, lambda j, c: step(j, c, True), carry)
    carry = lax.fori_loop(first if a is None else a, stop if z is None else z, lambda j, c: step(j, c, False), carry)
    if z is not None:
        carry = lax.fori_loop(z, stop, lambda j, c: step(j, c, True), carry)
    lax.fori_loop(stop, hi, lambda j, c: (pass_by(j), c)[1], None)
    return carry


def _produce(count, stages, load, frees):
    """The producer warpgroup: load(n, slot) issues the TMA loads of ring position n (of `count`) into `slot`,
    each after the consumers freed the slot (`frees`: the rings' "consumed" barriers)."""
    if count is not None and not isinstance(count, int):
        count = jnp.int32(count)
    for t in range(stages):  # fill the ring
        pl.when(t < count)(lambda t=t: load(jnp.int32(t), t))

    def wait_free(n):
        for free in frees:
            plgpu.barrier_wait(free.at[lax.rem(n, jnp.int32(stages))])

    def refill(n, _):
        wait_free(n)
        load(n, lax.rem(n, jnp.int32(stages)))

    lax.fori_loop(jnp.int32(stages), count, refill, None)
    # The last tiles' frees: every phase of a barrier is observed before it is released.
    lax.fori_loop(jnp.maximum(count - stages, 0), count, lambda n, _: wait_free(n), None)


def _pass_by(slot, *rings):
    """A tile the consumer does not use: wait for each of its operands (rings: (ready, free) barrier pairs) and
    free it, so that every barrier phase is observed in order."""
    for ready, free in rings:
        plgpu.barrier_wait(ready.at[slot])
        plgpu.barrier_arrive(free.at[slot])


def _segment_bounds(ids, other_ids, other_block):
    """int32 [B, len / 128, 2 + 2 * CONSUMERS]: for each CTA's 128 rows of `ids` [B, len], the first and stop tile of
    `other_ids` [B, other_len] (tiles of other_block) whose id range meets theirs, then each consumer's 64 rows'
    (`triton._block_bounds`: for packed ids exactly the tiles sharing an id, for any ids a superset). Read as
    scalars by the kernels, which then load and compute no tile of another document."""
    cta = triton._block_bounds(ids, BLOCK_Q, other_ids, other_block)
    rows = jnp.stack(triton._block_bounds(ids, ROWS, other_ids, other_block), axis=-1)  # [B, len / 64, 2]
    B, n = cta[0].shape
    return jnp.concatenate([jnp.stack(cta, axis=-1), rows.reshape(B, n, 2 * CONSUMERS)], axis=-1)


def _narrow(first, stop, lo, hi, bounds):
    """[first, stop) cut to `bounds` (a (first, stop) pair of `_segment_bounds`, or None: unchanged) inside the
    CTA's [lo, hi): lo <= first <= stop <= hi, empty where no tile meets the rows' ids."""
    if bounds is None:
        return first, stop
    first = _clamp(jnp.maximum(jnp.int32(first), bounds[0]), lo, hi)
    return first, _clamp(jnp.minimum(jnp.int32(stop), bounds[1]), first, hi)


def _cta_bounds(bounds_ref, b, t, wg):
    """(the CTA's (first, stop), its consumer wg's) from `_segment_bounds` (bounds_ref None: (None, None)); the
    producer (wg == CONSUMERS) reads the last consumer's, unused."""
    if bounds_ref is None:
        return None, None
    wg = jnp.minimum(wg, CONSUMERS - 1)
    return ((bounds_ref[b, t, 0], bounds_ref[b, t, 1]),
            (bounds_ref[b, t, 2 + 2 * wg], bounds_ref[b, t, 3 + 2 * wg]))


def _query_cta(plan, bk, groups, stages, num_kv_blocks, bounds_ref=None):
    """A query CTA's indices (q tile, head, batch row, kv head, warpgroup), its band, its kv tiles [lo, hi) (from its
    first row tile's first to its last row tile's stop, cut to the segment-id bounds), the ring slot of kv tile j
    and the warpgroup's segment-id bounds (or None)."""
    qt, h, b, wg = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("wg")
    kvh = lax.div(h, jnp.int32(groups))
    band = _band.edges(plan.causal, plan.window)
    lo, _ = _band.kv_range(CONSUMERS * qt, ROWS, bk, num_kv_blocks, band)
    _, hi = _band.kv_range(CONSUMERS * qt + CONSUMERS - 1, ROWS, bk, num_kv_blocks, band)
    cta, row_bounds = _cta_bounds(bounds_ref, b, qt, wg)
    lo, hi = _narrow(jnp.int32(lo), jnp.int32(hi), jnp.int32(lo), jnp.int32(hi), cta)
    slot_of = lambda j: lax.rem(j - lo, jnp.int32(stages))  # noqa: E731
    return qt, h, b, kvh, wg, band, lo, hi, slot_of, row_bounds


def _kv_producer(k_ref, v_ref, kv_ids_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free, ids, b, kvh, lo, hi,
                 bk, stages, plan):
    """The producer warpgroup of a query CTA: kv tiles lo ... hi - 1 into the K / V rings (and their segment ids
    into the ids ring: kv_ids_ref and ids None without)."""
    if not plan.interpret:
        plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

    def load(n, slot):
        keys = (b, pl.ds((lo + n) * bk, bk), kvh)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])
        if ids is not None:
            _load_ids(kv_ids_ref.at[b, pl.ds((lo + n) * bk, bk)], ids, slot)

    _produce(hi - lo, stages, load, (k_free, v_free) + (() if ids is None else _ring_ids(ids)[1:]))


def _forward_kernel(q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, row_keys_ref, bounds_ref, o_ref, lse_ref, qo_smem,
                    k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready, k_free, v_free, turn, ids, drop,
                    p_smem=None, *, plan, groups, stages, num_kv_blocks, pingpong):
    bk = plan.blocks.block_k
    D = q_ref.shape[3]
    dtype = q_ref.dtype
    qt, h, b, kvh, wg, band, lo, hi, slot_of, row_bounds = _query_cta(plan, bk, groups, stages, num_kv_blocks,
                                                                       bounds_ref)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        if not plan.interpret:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        i = CONSUMERS * qt + wg  # the warpgroup's 64-row tile
        q0 = i * ROWS
        q_tile = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, ROWS), h], q_tile, q_ready.at[wg])
        own = _split_band(*_narrow(*_band.kv_range(i, ROWS, bk, num_kv_blocks, band), lo, hi, row_bounds),
                          _band.inner_range(i, ROWS, bk, band), _last_key_tile(plan, bk))
        row_ids = None if ids is None else _own_ids(q_ids_ref.at[b, pl.ds(q0, ROWS)], ids, wg, 0)
        row_keys = None if drop is None else _own_ids(row_keys_ref.at[b, h, pl.ds(q0, ROWS)], drop, wg, 0)
        plgpu.barrier_wait(q_ready.at[wg])
        if pingpong:
            pl.when(wg == 1)(lambda: _rendezvous(turn))

        def step(j, carry, masked):
            acc, m, l = carry
            slot = slot_of(j)
            plgpu.barrier_wait(k_ready.at[slot])
            s = _scores(q_tile, k_smem.at[slot], ROWS, bk, turn if pingpong else None)
            plgpu.barrier_arrive(k_free.at[slot])
            s = _logits(s, plan)
            visible = _visible(q0, j * bk, s.shape, plan) if masked else None
            if ids is not None:
                visible = _same_segment(row_ids, _take(*ids[2:], slot, 1), s.shape, visible)
            if visible is not None:
                s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)  # rescales what was summed under the old max
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if drop is not None:  # the sum above is the softmax's own; only the kept terms reach the output
                p = _dropped(p, lax.broadcast_in_dim(row_keys, p.shape, [0]), _positions(j * bk, p.shape, 1),
                             plan.dropout_rate)
            p = p.astype(dtype)
            if pingpong:
                plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may issue its GEMMs
            plgpu.barrier_wait(v_ready.at[slot])
            if pingpong:
                plgpu.barrier_wait(turn)
            acc = _accumulate(acc, p, v_smem.at[slot], None if p_smem is None else p_smem.at[wg])
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def pass_by(j):  # a tile of the CTA's band outside this warpgroup's: freed unread, the ping-pong kept
            slot = slot_of(j)
            _pass_by(slot, (k_ready, k_free), *(() if ids is None else (_ring_ids(ids),)))
            if pingpong:
                _rendezvous(turn)
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)
            _pass_by(slot, (v_ready, v_free))

        carry = (plgpu.layout_cast(jnp.zeros((ROWS, D), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((ROWS,), NEG_INF, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                 plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        carry = _walk(lo, hi, own, step, pass_by, carry)
        if pingpong:
            pl.when(wg == 0)(lambda: _rendezvous(turn))

        acc, m, l = carry
        seen = m > NEG_INF / 2  # False: the query saw no key (output 0, lse +inf)
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        q_tile[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[b, pl.ds(q0, ROWS), h])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == CONSUMERS)(lambda: _kv_producer(k_ref, v_ref, kv_ids_ref, k_smem, v_smem, k_ready, v_ready, k_free,
                                                   v_free, ids, b, kvh, lo, hi, bk, stages, plan))


def _body(kernel, name, absent, **params):
    """`kernel` as `plgpu.kernel`'s body, named `name` (the name of its compiled dumps), with None at the positions
    `absent` of its refs: the operands and outputs a call has not (segment ids, dk or dv)."""
    def body(*refs):
        refs = list(refs)
        for position in sorted(absent):
            refs.insert(position, None)
        kernel(*refs, **params)

    body.__name__ = name
    return body


def _last_key_tile(plan, block):
    """With padded keys, the tile holding the last real one, from which tiles are masked; else None."""
    return None if plan.kv_len is None or plan.kv_len % block == 0 else plan.kv_len // block


def forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales=None):
    """Returns (out [B, T, H, D] in q's dtype, lse [B, H, T] float32, base 2, +inf where a query sees no key)."""
    why = refusal(q, k, plan, kv_scales)
    if why:
        raise ValueError(why)
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    bk = plan.blocks.block_k
    stages = plan.blocks.num_stages or default_blocks(D)[1]
    num_kv_blocks = pl.cdiv(plan.kv_len or S, bk)
    stages = max(1, min(stages, num_kv_blocks))
    tiles = _tile_transforms(q.dtype)
    ids = () if q_ids is None else (q_ids, kv_ids)
    row_keys = () if keys is None else (_row_keys(keys, T),)
    bounds = () if q_ids is None else (_segment_bounds(q_ids, kv_ids, bk),)
    absent = (() if ids else (3, 4, 6)) + (() if row_keys else (5,))  # the id, row-key and bounds refs' positions
    kernel = _body(_forward_kernel, "flash_attention_fwd", absent, plan=plan, groups=H // Hkv, stages=stages,
                   num_kv_blocks=num_kv_blocks, pingpong=True)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)),
        scratch_types=[
            plgpu.SMEM((CONSUMERS, ROWS, D), q.dtype, transforms=tiles),  # q in, then the output out
            plgpu.SMEM((stages, bk, D), k.dtype, transforms=tiles),
            plgpu.SMEM((stages, bk, D), v.dtype, transforms=tiles),
            plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=CONSUMERS),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMERS),
            _ids_scratch(stages, bk) if ids else None,
            _ids_scratch(1, bk) if row_keys else None,  # their own rows' only
            *[plgpu.SMEM((CONSUMERS, ROWS, bk), q.dtype, transforms=tiles)] * plan.interpret,  # P, interpreted
        ],
        grid=(H, T // BLOCK_Q, B),
        grid_names=("heads", "q", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if plan.interpret else None,
    )(q, k, v, *ids, *row_keys, *bounds)


# The Triton kernel's lse layout: [B, H, T], base 2.
lse_rows, lse_from_rows = triton.lse_rows, triton.lse_from_rows


def _load_row(ref, dim):
    """A [ROWS]-long float32 vector from shared memory, laid out along dim 0 (rows) or 1 (columns) of a wgmma
    tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1 - dim))


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_ids_ref, kv_ids_ref, row_keys_ref, bounds_ref, dq_ref,
               q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, row_ready, k_ready, v_ready, k_free, v_free, ids,
               drop, p_smem=None, *, plan, groups, stages, num_kv_blocks):
    """dq = sm_scale * sum_j ds_j k_j, ds = p * (dp - delta) (times the soft cap's derivative), p = exp2(s - lse),
    dp = do vᵀ (times the dropout multiplier): the forward's CTAs and K / V ring (and kv ids ring), each consumer's
    64 rows of q, do, lse, delta (and q ids, dropout row keys) loaded once."""
    bk = plan.blocks.block_k_bwd
    dtype = q_ref.dtype
    qt, h, b, kvh, wg, band, lo, hi, slot_of, row_bounds = _query_cta(plan, bk, groups, stages, num_kv_blocks,
                                                                       bounds_ref)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        if not plan.interpret:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        i = CONSUMERS * qt + wg
        q0 = i * ROWS
        rows = (b, pl.ds(q0, ROWS), h)
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        for src, dst, n in ((q_ref.at[rows], q_tile, 0), (do_ref.at[rows], do_tile, 1),
                            (lse_ref.at[b, h, pl.ds(q0, ROWS)], lse_smem.at[wg], 2),
                            (delta_ref.at[b, h, pl.ds(q0, ROWS)], delta_smem.at[wg], 3)):
            plgpu.copy_gmem_to_smem(src, dst, row_ready.at[CONSUMERS * n + wg])
        for n in range(4):
            plgpu.barrier_wait(row_ready.at[CONSUMERS * n + wg])
        lse, delta = _load_row(lse_smem.at[wg], 0), _load_row(delta_smem.at[wg], 0)
        row_ids = None if ids is None else _own_ids(q_ids_ref.at[b, pl.ds(q0, ROWS)], ids, wg, 0)
        row_keys = None if drop is None else _own_ids(row_keys_ref.at[b, h, pl.ds(q0, ROWS)], drop, wg, 0)
        own = _split_band(*_narrow(*_band.kv_range(i, ROWS, bk, num_kv_blocks, band), lo, hi, row_bounds),
                          _band.inner_range(i, ROWS, bk, band), _last_key_tile(plan, bk))

        def step(j, dq, masked):
            slot, w = _per_step(slot_of(j), wg)
            q_tile, do_tile = q_smem.at[w], do_smem.at[w]
            plgpu.barrier_wait(k_ready.at[slot])
            s = _logits(_scores(q_tile, k_smem.at[slot], ROWS, bk, None), plan)
            visible = _visible(q0, j * bk, s.shape, plan) if masked else None
            if ids is not None:
                visible = _same_segment(row_ids, _take(*ids[2:], slot, 1), s.shape, visible)
            if visible is not None:
                s = jnp.where(visible, s, NEG_INF)
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            plgpu.barrier_wait(v_ready.at[slot])
            dp = _scores(do_tile, v_smem.at[slot], ROWS, bk, None)
            plgpu.barrier_arrive(v_free.at[slot])
            if drop is not None:
                dp = _dropped(dp, lax.broadcast_in_dim(row_keys, dp.shape, [0]), _positions(j * bk, dp.shape, 1),
                              plan.dropout_rate)
            ds = (_capped_gradient(p, lse, 0, plan) * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))).astype(dtype)
            dq = _accumulate(dq, ds, k_smem.at[slot], None if p_smem is None else p_smem.at[wg])
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        id_ring = () if ids is None else (_ring_ids(ids),)
        dq = _walk(lo, hi, own, step, lambda j: _pass_by(slot_of(j), (k_ready, k_free), (v_ready, v_free), *id_ring),
                   plgpu.layout_cast(jnp.zeros(q_tile.shape, jnp.float32), plgpu.Layout.WGMMA))
        q_tile[...] = (dq * plan.sm_scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == CONSUMERS)(lambda: _kv_producer(k_ref, v_ref, kv_ids_ref, k_smem, v_smem, k_ready, v_ready, k_free,
                                                   v_free, ids, b, kvh, lo, hi, bk, stages, plan))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_ids_ref, kv_ids_ref, row_keys_ref, bounds_ref,
                dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, q_ready, do_ready,
                lse_ready, delta_ready, q_free, do_free, lse_free, delta_free, ids, drop, p_smem=None, *, plan, groups,
                stages, num_q_blocks, grads):
    """dv = sum pᵀ do, dk = sm_scale * sum dsᵀ q over the query tiles of every query head of the kv head's group:
    one CTA per (128 keys, kv head, batch row), each consumer 64 key rows; the producer streams (q, do, lse,
    delta) tiles of the CTA's band for each head of the group, so k and v are read once per group and dk / dv
    need no sum over heads (segment ids and dropout's row keys of the queries ride rings of their own beside them;
    p and dp are multiplied by the dropout multiplier, its hash computed for each). Works on transposed
    tiles ([keys, queries]). grads: "dkv" both, or "dk" / "dv" alone (its other output ref None): at head dim 256
    both [64, 256] float32 accumulators exceed a consumer's registers, so dv (no v, no delta) and dk run apart."""
    bq = plan.blocks.block_q_bwd
    dtype = q_ref.dtype
    kt, kvh, b = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
    wg = lax.axis_index("wg")
    band = _band.edges(plan.causal, plan.window)
    lo, _ = _band.q_range(CONSUMERS * kt, bq, ROWS, num_q_blocks, band)
    _, hi = _band.q_range(CONSUMERS * kt + CONSUMERS - 1, bq, ROWS, num_q_blocks, band)
    cta, row_bounds = _cta_bounds(bounds_ref, b, kt, wg)
    lo, hi = _narrow(jnp.int32(lo), jnp.int32(hi), jnp.int32(lo), jnp.int32(hi), cta)
    per_head = hi - lo
    with_dk, with_dv = grads in ("dkv", "dk"), grads in ("dkv", "dv")
    rings = ((q_ready, q_free), (do_ready, do_free), (lse_ready, lse_free),
             *[(delta_ready, delta_free)] * with_dk, *(() if ids is None else (_ring_ids(ids),)),
             *(() if drop is None else (_ring_ids(drop),)))

    @pl.when(wg < CONSUMERS)
    def _consumer():
        if not plan.interpret:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        j = CONSUMERS * kt + wg
        k0 = j * ROWS
        keys = (b, pl.ds(k0, ROWS), kvh)
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_tile, kv_ready.at[wg])
        plgpu.barrier_wait(kv_ready.at[wg])
        if with_dk:  # dv alone needs no v
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_tile, kv_ready.at[CONSUMERS + wg])
            plgpu.barrier_wait(kv_ready.at[CONSUMERS + wg])
        own = _split_band(*_narrow(*_band.q_range(j, bq, ROWS, num_q_blocks, band), lo, hi, row_bounds),
                          _band.inner_range(j, ROWS, bq, band[::-1]))
        row_ids = None if ids is None else _own_ids(kv_ids_ref.at[b, pl.ds(k0, ROWS)], ids, wg, 0)
        p_tile = None if p_smem is None else p_smem.at[wg]

        def per_group_head(g, carry):
            slot_of = lambda i: lax.rem(g * per_head + i - lo, jnp.int32(stages))  # noqa: E731

            def step(i, carry, masked):
                dk, dv = carry
                slot, w = _per_step(slot_of(i), wg)
                k_tile, v_tile = k_smem.at[w], v_smem.at[w]
                plgpu.barrier_wait(q_ready.at[slot])
                s_t = _logits(_scores(k_tile, q_smem.at[slot], ROWS, bq, None), plan)
                visible = None
                if masked:
                    q_pos = _positions(i * bq, s_t.shape, 1)
                    k_pos = _positions(k0, s_t.shape, 0)
                    visible = attention_mask(q_pos, k_pos, None, None, causal=plan.causal, kv_len=None,
                                             window=plan.window)
                if ids is not None:
                    visible = _same_segment(row_ids, _take(*ids[2:], slot, 1), s_t.shape, visible)
                s_t = s_t if visible is None else jnp.where(visible, s_t, NEG_INF)
                plgpu.barrier_wait(lse_ready.at[slot])
                p_t = jnp.exp2(s_t - lax.broadcast_in_dim(_load_row(lse_smem.at[slot], 1), s_t.shape, [1]))
                plgpu.barrier_wait(do_ready.at[slot])

                def kept(x):  # x times the dropout multiplier of the tile (row keys read where used)
                    if drop is None:
                        return x
                    row_keys = lax.broadcast_in_dim(_load_row(drop[2].at[slot], 1), x.shape, [1])
                    return _dropped(x, row_keys, _positions(k0, x.shape, 0), plan.dropout_rate)

                if drop is not None:
                    plgpu.barrier_wait(drop[3].at[slot])
                if with_dv:
                    dv = _accumulate(dv, kept(p_t).astype(dtype), do_smem.at[slot], p_tile)
                if with_dk:
                    # Folded in once dv has read p; lse read again from shared memory rather than held in 16
                    # registers a thread across the wgmma.
                    p_t = _capped_gradient(
                        p_t, None if plan.logit_soft_cap is None else _load_row(lse_smem.at[slot], 1), 1, plan)
                plgpu.barrier_arrive(lse_free.at[slot])
                if with_dk:
                    dp_t = kept(_scores(v_tile, do_smem.at[slot], ROWS, bq, None))
                if drop is not None:
                    plgpu.barrier_arrive(drop[4].at[slot])
                plgpu.barrier_arrive(do_free.at[slot])
                if with_dk:
                    delta = _take(delta_smem, delta_ready, delta_free, slot, 1)
                    ds_t = (p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))).astype(dtype)
                    dk = _accumulate(dk, ds_t, q_smem.at[slot], p_tile)
                plgpu.barrier_arrive(q_free.at[slot])
                return dk, dv

            return _walk(lo, hi, own, step, lambda i: _pass_by(slot_of(i), *rings), carry)

        zeros = plgpu.layout_cast(jnp.zeros(k_tile.shape, jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = lax.fori_loop(0, groups, per_group_head, (zeros if with_dk else None, zeros if with_dv else None))
        if with_dk:
            k_tile[...] = (dk * plan.sm_scale).astype(dtype)
        if with_dv:
            v_tile[...] = dv.astype(dtype)
        plgpu.commit_smem()
        if with_dk:
            plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[keys])
        if with_dv:
            plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[keys])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        if not plan.interpret:
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

        def load(n, slot):
            g, i = lax.div(n, per_head), lo + lax.rem(n, per_head)
            h = kvh * groups + g
            rows = (b, pl.ds(i * bq, bq), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(i * bq, bq)], lse_smem.at[slot], lse_ready.at[slot])
            if with_dk:
                plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(i * bq, bq)], delta_smem.at[slot],
                                        delta_ready.at[slot])
            if ids is not None:
                _load_ids(q_ids_ref.at[b, pl.ds(i * bq, bq)], ids, slot)
            if drop is not None:
                _load_ids(row_keys_ref.at[b, h, pl.ds(i * bq, bq)], drop, slot)

        _produce(groups * per_head, stages, load, tuple(free for _, free in rings))


def backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan):
    """(dq, dk, dv) in q's dtype from the forward's out and lse [B, H, T] (base 2); delta = rowsum(out * do) is one
    XLA reduction. Two kernels: dq over kv tiles, dk / dv over the group's query tiles (at head dim 256 dv and dk
    apart: three kernels)."""
    why = refusal(q, k, plan, backward=True)
    if why:
        raise ValueError(why)
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    bq, bk = plan.blocks.block_q_bwd, plan.blocks.block_k_bwd
    stages = backward_stages(D, plan.blocks.num_stages_bwd or 2)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    tiles = _tile_transforms(q.dtype)
    interpret = plgpu.InterpretGPUParams() if plan.interpret else None
    params = plgpu.CompilerParams(approx_math=True)
    kv_stages = max(1, min(stages, pl.cdiv(plan.kv_len or S, bk)))
    row = lambda: plgpu.SMEM((CONSUMERS, ROWS, D), q.dtype, transforms=tiles)  # noqa: E731
    ids = () if q_ids is None else (q_ids, kv_ids)
    row_keys = () if keys is None else (_row_keys(keys, T),)
    # The id, row-key and bounds refs' positions in both kernels' signatures, where the call has none.
    optional = (() if ids else (6, 7, 9)) + (() if row_keys else (8,))
    dq_kernel = _body(_dq_kernel, "flash_attention_dq", optional, plan=plan, groups=G, stages=kv_stages,
                      num_kv_blocks=pl.cdiv(plan.kv_len or S, bk))
    dq = plgpu.kernel(
        dq_kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=[
            row(), row(), plgpu.SMEM((CONSUMERS, ROWS), jnp.float32), plgpu.SMEM((CONSUMERS, ROWS), jnp.float32),
            plgpu.SMEM((kv_stages, bk, D), k.dtype, transforms=tiles),
            plgpu.SMEM((kv_stages, bk, D), v.dtype, transforms=tiles),
            plgpu.Barrier(num_barriers=4 * CONSUMERS),
            plgpu.Barrier(num_barriers=kv_stages), plgpu.Barrier(num_barriers=kv_stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=kv_stages),
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=kv_stages),
            _ids_scratch(kv_stages, bk) if ids else None,
            _ids_scratch(1, bk) if row_keys else None,  # their own rows' only
            *[plgpu.SMEM((CONSUMERS, ROWS, bk), q.dtype, transforms=tiles)] * plan.interpret,
        ],
        grid=(H, T // BLOCK_Q, B), grid_names=("heads", "q", "batch"), num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=params, interpret=interpret,
    )(q, k, v, do, lse, delta, *ids, *row_keys, *(() if q_ids is None else (_segment_bounds(q_ids, kv_ids, bk),)))

    q_stages = max(1, min(stages, G * (T // bq)))
    ring = lambda: plgpu.SMEM((q_stages, bq, D), q.dtype, transforms=tiles)  # noqa: E731
    vector_ring = lambda: plgpu.SMEM((q_stages, bq), jnp.float32)  # noqa: E731
    types = {"dk": jax.ShapeDtypeStruct(k.shape, k.dtype), "dv": jax.ShapeDtypeStruct(v.shape, v.dtype)}
    grads = {}
    for which in ("dv", "dk") if D in SPLIT_HEAD_DIMS else ("dkv",):
        names = ("dk", "dv") if which == "dkv" else (which,)
        absent = optional + tuple(10 + n for n, name in enumerate(types) if name not in names)  # dk_ref 10, dv_ref 11
        kernel = _body(_dkv_kernel, f"flash_attention_{which}", absent, plan=plan, groups=G, stages=q_stages,
                       num_q_blocks=T // bq, grads=which)
        outs = plgpu.kernel(
            kernel,
            out_type=tuple(types[name] for name in names),
            scratch_types=[
                row(), row(), ring(), ring(), vector_ring(), vector_ring(),
                plgpu.Barrier(num_barriers=2 * CONSUMERS),
                *[plgpu.Barrier(num_barriers=q_stages)] * 4,
                *[plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=q_stages)] * 4,
                _ids_scratch(q_stages, bq) if ids else None,
                _ids_scratch(q_stages, bq) if row_keys else None,  # the ring only
                *[plgpu.SMEM((CONSUMERS, ROWS, bq), q.dtype, transforms=tiles)] * plan.interpret,
            ],
            grid=(Hkv, S // BLOCK_Q, B), grid_names=("heads", "kv", "batch"), num_threads=CONSUMERS + 1,
            thread_name="wg", compiler_params=params, interpret=interpret,
        )(q, k, v, do, lse, delta, *ids, *row_keys, *(() if q_ids is None else (_segment_bounds(kv_ids, q_ids, bq),)))
        grads.update(zip(names, outs))
    return dq, grads["dk"], grads["dv"]
