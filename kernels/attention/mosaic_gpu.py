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

Not implemented (refused in one line by `refusal`): float32 inputs, head dims other than 64 / 128 / 256, segment
ids, dropout, logit soft-cap, int8 kv, and the backward pass. `interpret=True` runs the kernel in Mosaic GPU's
interpreter (threads, shared memory, TMA, mbarriers and wgmma simulated on the CPU); there the P V accumulation is
a fresh accumulator added to the carry (the interpreter has no `pl.run_state`), on a GPU the carry itself is the
wgmma accumulator.
"""
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.attention import _band, triton
from kernels.attention.reference import NEG_INF, attention_mask

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
DTYPES = (jnp.bfloat16, jnp.float16)
# Registers per thread after `setmaxnreg`: consumers take what the producer gives up (65536 per SM / 384 threads is
# 170 each on entry; 2 * 232 + 40 = 504 = 3 * 168).
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40


def default_blocks(head_dim):
    """(block_k, stages) per head dim: K and V rings of `stages` tiles of block_k keys beside 2 x 64 query rows,
    within the 227 KiB of shared memory (head dim 256: 64 + 2 * 2 * 64 KiB = 192 KiB at 64 keys a tile; 128: 32 +
    128 = 160 KiB; 64: 16 + 96 = 112 KiB, three stages)."""
    return {64: (128, 3), 128: (128, 2), 256: (64, 2)}[head_dim]


def refusal(q, k, plan, has_ids=False, has_keys=False, kv_scales=None, backward=False):
    """Why this module cannot run the call, in one line, or None when it can. q, k: the padded operands (or
    ShapeDtypeStructs)."""
    D = q.shape[3]
    if not AVAILABLE:
        return "implementation='mosaic_gpu' needs JAX >= 0.11 (jax.experimental.pallas.mosaic_gpu.kernel)"
    if backward:
        return "implementation='mosaic_gpu' has no backward pass yet; expected 'triton' or 'xla' to differentiate"
    reasons = [
        (jnp.dtype(q.dtype) not in map(jnp.dtype, DTYPES),
         f"dtype {jnp.dtype(q.dtype).name}; expected bfloat16 or float16"),
        (D not in HEAD_DIMS, f"head_dim {D}; expected one of {HEAD_DIMS}"),
        (has_ids, "segment_ids; expected None"),
        (has_keys, "dropout; expected dropout_rate=0"),
        (plan.logit_soft_cap is not None, "logit_soft_cap; expected None"),
        (kv_scales is not None, "int8 k / v; expected a float cache"),
        (plan.blocks.block_q != BLOCK_Q, f"block_q={plan.blocks.block_q}; expected {BLOCK_Q}"),
        (plan.blocks.block_k % 64, f"block_k={plan.blocks.block_k}; expected a multiple of 64"),
        (q.shape[1] % BLOCK_Q or k.shape[1] % plan.blocks.block_k,
         f"lengths {q.shape[1]} / {k.shape[1]}; expected multiples of {BLOCK_Q} / {plan.blocks.block_k}"),
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


def _clamp(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem, lse_smem, q_ready, k_ready,
                    v_ready, k_free, v_free, turn, p_smem=None, *, plan, groups, stages, num_kv_blocks, pingpong):
    bk = plan.blocks.block_k
    D = q_ref.shape[3]
    dtype = q_ref.dtype
    qt, h, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    kvh = lax.div(h, jnp.int32(groups))
    wg = lax.axis_index("wg")
    band = _band.edges(plan.causal, plan.window)
    # The CTA's tiles: from its first row tile's first to its last row tile's stop.
    lo, _ = _band.kv_range(CONSUMERS * qt, ROWS, bk, num_kv_blocks, band)
    _, hi = _band.kv_range(CONSUMERS * qt + CONSUMERS - 1, ROWS, bk, num_kv_blocks, band)
    lo, hi = jnp.int32(lo), jnp.int32(hi)
    slot_of = lambda j: lax.rem(j - lo, jnp.int32(stages))  # noqa: E731

    @pl.when(wg < CONSUMERS)
    def _consumer():
        if not plan.interpret:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
        i = CONSUMERS * qt + wg  # the warpgroup's 64-row tile
        q0 = i * ROWS
        q_tile = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, ROWS), h], q_tile, q_ready.at[wg])
        first, stop = _band.kv_range(i, ROWS, bk, num_kv_blocks, band)
        inner_first, inner_stop = _band.inner_range(i, ROWS, bk, band)
        first, stop = jnp.int32(first), jnp.int32(stop)
        a = first if inner_first is None else _clamp(inner_first, first, stop)
        z = stop if inner_stop is None else _clamp(inner_stop, a, stop)
        if plan.kv_len is not None and plan.kv_len % bk:  # the tile holding the last real key is masked too
            z = _clamp(jnp.int32(plan.kv_len // bk), a, z)
        scale = plan.sm_scale * _LOG2E
        plgpu.barrier_wait(q_ready.at[wg])
        if pingpong:
            pl.when(wg == 1)(lambda: _rendezvous(turn))

        def step(j, carry, masked):
            acc, m, l = carry
            slot = slot_of(j)
            plgpu.barrier_wait(k_ready.at[slot])
            s = _scores(q_tile, k_smem.at[slot], ROWS, bk, turn if pingpong else None)
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * scale
            visible = _visible(q0, j * bk, s.shape, plan) if masked else None
            if visible is not None:
                s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)  # rescales what was summed under the old max
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(dtype)
            if pingpong:
                plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may issue its GEMMs
            plgpu.barrier_wait(v_ready.at[slot])
            if pingpong:
                plgpu.barrier_wait(turn)
            acc = _accumulate(acc, p, v_smem.at[slot], None if p_smem is None else p_smem.at[wg])
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def pass_by(j, carry):  # a tile of the CTA's band outside this warpgroup's: freed unread
            slot = slot_of(j)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            if pingpong:
                _rendezvous(turn)
                plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            if pingpong:
                plgpu.barrier_wait(turn)
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        carry = (plgpu.layout_cast(jnp.zeros((ROWS, D), jnp.float32), plgpu.Layout.WGMMA),
                 plgpu.layout_cast(jnp.full((ROWS,), NEG_INF, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                 plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        masked_step = lambda j, c: step(j, c, True)  # noqa: E731
        plain_step = lambda j, c: step(j, c, False)  # noqa: E731
        lax.fori_loop(lo, first, pass_by, None)
        carry = lax.fori_loop(first, a, masked_step, carry)
        carry = lax.fori_loop(a, z, plain_step, carry)
        carry = lax.fori_loop(z, stop, masked_step, carry)
        lax.fori_loop(stop, hi, pass_by, None)
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

    @pl.when(wg == CONSUMERS)
    def _producer():
        if not plan.interpret:
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

        def load(j, slot):
            keys = (b, pl.ds(j * bk, bk), kvh)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])

        for t in range(stages):  # fill the ring
            pl.when(lo + t < hi)(lambda t=t: load(lo + t, t))

        def refill(j, _):
            slot = slot_of(j)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            load(j, slot)

        lax.fori_loop(lo + stages, hi, refill, None)

        def drain(j, _):  # the last tiles' frees: every phase of a barrier is observed before it is released
            slot = slot_of(j)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        lax.fori_loop(jnp.maximum(hi - stages, lo), hi, drain, None)


def forward(q, k, v, q_ids, kv_ids, keys, plan, kv_scales=None):
    """Returns (out [B, T, H, D] in q's dtype, lse [B, H, T] float32, base 2, +inf where a query sees no key)."""
    why = refusal(q, k, plan, q_ids is not None, keys is not None, kv_scales)
    if why:
        raise ValueError(why)
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    bk = plan.blocks.block_k
    stages = plan.blocks.num_stages or default_blocks(D)[1]
    num_kv_blocks = pl.cdiv(plan.kv_len or S, bk)
    stages = max(1, min(stages, num_kv_blocks))
    tiles = _tile_transforms(q.dtype)
    kernel = lambda *refs: _forward_kernel(  # noqa: E731
        *refs, plan=plan, groups=H // Hkv, stages=stages, num_kv_blocks=num_kv_blocks, pingpong=True)
    kernel.__name__ = "flash_attention_fwd"
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
            *[plgpu.SMEM((CONSUMERS, ROWS, bk), q.dtype, transforms=tiles)] * plan.interpret,  # P, interpreted
        ],
        grid=(H, T // BLOCK_Q, B),
        grid_names=("heads", "q", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if plan.interpret else None,
    )(q, k, v)


# The Triton kernel's lse layout: [B, H, T], base 2.
lse_rows, lse_from_rows = triton.lse_rows, triton.lse_from_rows


def backward(q, k, v, q_ids, kv_ids, keys, out, lse, do, plan):
    raise ValueError(refusal(q, k, plan, backward=True))
