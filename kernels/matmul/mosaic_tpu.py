"""TPU kernels: Pallas on Mosaic (the backend interface is described in `reference.py`).

The contraction is the last, sequential ('arbitrary') grid axis with the float32 accumulators in VMEM scratch, the
TPU idiom: Mosaic pipelines the HBM->VMEM copies of consecutive grid steps. Blocks are multiples of 128 in every dim
(see `_blocks.fit`), which meets Mosaic's (8, 128) rule for transposed operands too; row and column vectors travel
as [M, 1] and [1, N] arrays, whose size-1 dim equals the full dim as the rule allows.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels._dispatch import mosaic_vmem_limit
from kernels.matmul import _blocks, _cost, reference


def _interpret(interpret):
    # TPU interpret mode simulates VMEM, DMAs and the grid order, so it checks more than the generic interpreter.
    return pltpu.InterpretParams() if interpret else False


def _matmul_kernel(*refs, n_lhs, n_rhs, n_extras, terms, epilogue, trans_lhs, trans_rhs):
    lhs_refs, refs = refs[:n_lhs], refs[n_lhs:]
    rhs_refs, refs = refs[:n_rhs], refs[n_rhs:]
    extra_refs, refs = refs[:n_extras], refs[n_extras:]
    out_refs, acc_refs = refs[:-len(terms)], refs[-len(terms):]
    block_n = out_refs[0].shape[1]
    kb = pl.program_id(2)

    @pl.when(kb == 0)
    def _init():
        for acc in acc_refs:
            acc[...] = jnp.zeros_like(acc)

    a = [r[...] for r in lhs_refs]
    b = [r[...] for r in rhs_refs]
    for acc, term in zip(acc_refs, terms):
        acc[...] += sum(reference.dot(a[i], b[j], trans_lhs, trans_rhs) for i, j in term)

    @pl.when(kb == pl.num_programs(2) - 1)
    def _epilogue():
        cols = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
        outs = epilogue(tuple(acc[...] for acc in acc_refs), cols, *(r[...] for r in extra_refs))
        for ref, out in zip(out_refs, outs):
            ref[...] = out.astype(ref.dtype)


def matmul(lhs, rhs, extras=(), *, terms, epilogue, extra_kinds=(), out_dtypes, trans_lhs=False, trans_rhs=False,
           blocks, interpret=False, aliases=()):
    lhs, rhs, extras, (m, n), (bm, bn, bk), (mp, np_, kp) = _blocks.pad_operands(
        lhs, rhs, extras, extra_kinds, trans_lhs=trans_lhs, trans_rhs=trans_rhs, blocks=blocks,
        implementation="mosaic_tpu")
    lhs_spec = (pl.BlockSpec((bk, bm), lambda i, j, kb: (kb, i)) if trans_lhs
                else pl.BlockSpec((bm, bk), lambda i, j, kb: (i, kb)))
    rhs_spec = (pl.BlockSpec((bn, bk), lambda i, j, kb: (j, kb)) if trans_rhs
                else pl.BlockSpec((bk, bn), lambda i, j, kb: (kb, j)))
    extra_specs = {"row": pl.BlockSpec((bm, 1), lambda i, j, kb: (i, 0)),
                   "col": pl.BlockSpec((1, bn), lambda i, j, kb: (0, j)),
                   "tile": pl.BlockSpec((bm, bn), lambda i, j, kb: (i, j))}
    kernel = functools.partial(_matmul_kernel, n_lhs=len(lhs), n_rhs=len(rhs), n_extras=len(extras), terms=terms,
                               epilogue=epilogue, trans_lhs=trans_lhs, trans_rhs=trans_rhs)
    outs = pl.pallas_call(
        kernel,
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[lhs_spec] * len(lhs) + [rhs_spec] * len(rhs) + [extra_specs[kind] for kind in extra_kinds],
        out_specs=[pl.BlockSpec((bm, bn), lambda i, j, kb: (i, j))] * len(out_dtypes),
        out_shape=[jax.ShapeDtypeStruct((mp, np_), d) for d in out_dtypes],
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32) for _ in terms],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY),
            vmem_limit_bytes=mosaic_vmem_limit()),
        interpret=_interpret(interpret),
        input_output_aliases={len(lhs) + len(rhs) + e: o for e, o in aliases},
        name="fused_matmul",
        cost_estimate=_cost.matmul(lhs, rhs, extras, extra_kinds, out_dtypes, terms=terms, epilogue=epilogue,
                                   tiles=(bm, bn, bk), padded=(mp, np_, kp)),
    )(*lhs, *rhs, *extras)
    return tuple(o[:m, :n] for o in outs)


def _lce_forward_kernel(x_ref, w_ref, labels_ref, lse_ref, label_logit_ref, acc_ref, m_ref, l_ref, lab_ref, *,
                        vocab):
    vb, db = pl.program_id(1), pl.program_id(2)
    block_v = w_ref.shape[1]

    @pl.when((vb == 0) & (db == 0))
    def _init_row():
        m_ref[...], l_ref[...], lab_ref[...] = reference.lse_init(m_ref.shape[0])

    @pl.when(db == 0)
    def _init_tile():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += reference.dot(x_ref[...], w_ref[...], False, False)

    @pl.when(db == pl.num_programs(2) - 1)
    def _update():
        cols = vb * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
        m_ref[...], l_ref[...], lab_ref[...] = reference.lse_update(
            (m_ref[...], l_ref[...], lab_ref[...]), acc_ref[...], cols, labels_ref[...], vocab)

    @pl.when((vb == pl.num_programs(1) - 1) & (db == pl.num_programs(2) - 1))
    def _store():
        lse_ref[...] = m_ref[...] + jnp.log(l_ref[...])
        label_logit_ref[...] = lab_ref[...]


def lce_forward(x, w, labels, *, blocks, interpret=False):
    """Grid (tokens, vocabulary, model dim); the last two are sequential and carry the online log-sum-exp."""
    n, vocab = x.shape[0], w.shape[1]
    (x,), (w,), (labels,), _, (bm, bv, bd), (np_, vp, dp) = _blocks.pad_operands(
        (x,), (w,), (labels.reshape(n, 1),), ("row",), trans_lhs=False, trans_rhs=False, blocks=blocks,
        implementation="mosaic_tpu")
    row_spec = pl.BlockSpec((bm, 1), lambda i, vb, db: (i, 0))
    lse, label_logit = pl.pallas_call(
        functools.partial(_lce_forward_kernel, vocab=vocab),
        grid=(np_ // bm, vp // bv, dp // bd),
        in_specs=[pl.BlockSpec((bm, bd), lambda i, vb, db: (i, db)), pl.BlockSpec((bd, bv), lambda i, vb, db: (db, vb)),
                  row_spec],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((np_, 1), jnp.float32)] * 2,
        scratch_shapes=[pltpu.VMEM((bm, bv), jnp.float32)] + [pltpu.VMEM((bm, 1), jnp.float32)] * 3,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY, pltpu.ARBITRARY),
            vmem_limit_bytes=mosaic_vmem_limit()),
        interpret=_interpret(interpret),
        name="linear_cross_entropy_fwd",
        cost_estimate=_cost.lce_forward(x, w, vocab=vocab, tiles=(bm, bv, bd)),
    )(x, w, labels)
    return lse[:n, 0], label_logit[:n, 0]
