"""GPU kernels: Pallas on its Triton backend (the backend interface is described in `reference.py`).

Each program owns one [block_m, block_n] output tile and loops over the contraction in registers, because Triton
programs run concurrently and cannot carry an accumulator along a grid axis. Operands are zero-padded to whole
blocks, so the kernels never mask a load.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu  # CompilerParams(num_warps, num_stages): jax 0.10.2 and 0.11.

from kernels.matmul import _blocks, _cost, reference


def _params(blocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


# Output tiles are visited in groups of this many tile-rows, column after column, so the CTAs running at once share
# their lhs row blocks and rhs column blocks in L2 (Triton's matmul tutorial; row-major order re-reads a 128 MB lhs
# from HBM once per column block at 8192 x 8192).
_GROUP_M = 8


def _tile(pid, num_m, num_n):
    """(row block, column block) of program `pid` in the grouped order."""
    per_group = _GROUP_M * num_n
    first_m = lax.div(pid, per_group) * _GROUP_M
    rows = jnp.minimum(num_m - first_m, _GROUP_M)
    within = lax.rem(pid, per_group)
    return first_m + lax.rem(within, rows), lax.div(within, rows)


def _matmul_kernel(*refs, n_lhs, n_rhs, n_extras, terms, epilogue, trans_lhs, trans_rhs, block_k, num_k, tile):
    lhs_refs, refs = refs[:n_lhs], refs[n_lhs:]
    rhs_refs, refs = refs[:n_rhs], refs[n_rhs:]
    extra_refs, out_refs = refs[:n_extras], refs[n_extras:]
    block_m, block_n = out_refs[0].shape

    def body(kb, accs):
        ks = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
        a = [r[ks, :] if trans_lhs else r[:, ks] for r in lhs_refs]
        b = [r[:, ks] if trans_rhs else r[ks, :] for r in rhs_refs]
        return tuple(acc + sum(reference.dot(a[i], b[j], trans_lhs, trans_rhs) for i, j in term)
                     for acc, term in zip(accs, terms))

    zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in terms)
    accs = lax.fori_loop(0, num_k, body, zeros)
    cols = tile(pl.program_id(0))[1] * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    outs = epilogue(accs, cols, *(r[...] for r in extra_refs))
    for ref, out in zip(out_refs, outs):
        ref[...] = out.astype(ref.dtype)


def matmul(lhs, rhs, extras=(), *, terms, epilogue, extra_kinds=(), out_dtypes, trans_lhs=False, trans_rhs=False,
           blocks, interpret=False, aliases=()):
    lhs, rhs, extras, (m, n), (bm, bn, bk), (mp, np_, kp) = _blocks.pad_operands(
        lhs, rhs, extras, extra_kinds, trans_lhs=trans_lhs, trans_rhs=trans_rhs, blocks=blocks,
        implementation="triton")
    tile = functools.partial(_tile, num_m=mp // bm, num_n=np_ // bn)

    def spec(shape, index):  # index: (row block, column block) -> block index.
        return pl.BlockSpec(shape, lambda pid: index(*tile(pid)))

    # Operands keep their whole contraction in the block; the kernel slices it block_k at a time.
    lhs_spec = spec((kp, bm), lambda i, j: (0, i)) if trans_lhs else spec((bm, kp), lambda i, j: (i, 0))
    rhs_spec = spec((bn, kp), lambda i, j: (j, 0)) if trans_rhs else spec((kp, bn), lambda i, j: (0, j))
    extra_specs = {"row": spec((bm, 1), lambda i, j: (i, 0)), "col": spec((1, bn), lambda i, j: (0, j)),
                   "tile": spec((bm, bn), lambda i, j: (i, j))}
    kernel = functools.partial(_matmul_kernel, n_lhs=len(lhs), n_rhs=len(rhs), n_extras=len(extras), terms=terms,
                               epilogue=epilogue, trans_lhs=trans_lhs, trans_rhs=trans_rhs, block_k=bk,
                               num_k=kp // bk, tile=tile)
    outs = pl.pallas_call(
        kernel,
        grid=((mp // bm) * (np_ // bn),),
        in_specs=[lhs_spec] * len(lhs) + [rhs_spec] * len(rhs) + [extra_specs[kind] for kind in extra_kinds],
        out_specs=[extra_specs["tile"]] * len(out_dtypes),
        out_shape=[jax.ShapeDtypeStruct((mp, np_), d) for d in out_dtypes],
        compiler_params=_params(blocks),
        interpret=interpret,
        input_output_aliases={len(lhs) + len(rhs) + e: o for e, o in aliases},
        name="fused_matmul",
        cost_estimate=_cost.matmul(lhs, rhs, extras, extra_kinds, out_dtypes, terms=terms, epilogue=epilogue,
                                   tiles=(bm, bn, bk), padded=(mp, np_, kp)),
    )(*lhs, *rhs, *extras)
    return tuple(o[:m, :n] for o in outs)


def _lce_forward_kernel(x_ref, w_ref, labels_ref, lse_ref, label_logit_ref, *, vocab, block_v, block_d, num_v,
                        num_d):
    block_n = x_ref.shape[0]
    labels = labels_ref[...]

    def vocab_step(vb, carry):
        vs = pl.ds(pl.multiple_of(vb * block_v, block_v), block_v)

        def model_step(db, acc):
            ds = pl.ds(pl.multiple_of(db * block_d, block_d), block_d)
            return acc + reference.dot(x_ref[:, ds], w_ref[ds, vs], False, False)

        logits = lax.fori_loop(0, num_d, model_step, jnp.zeros((block_n, block_v), jnp.float32))
        cols = vb * block_v + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
        return reference.lse_update(carry, logits, cols, labels, vocab)

    m, l, label_logit = lax.fori_loop(0, num_v, vocab_step, reference.lse_init(block_n))
    lse_ref[...] = m + jnp.log(l)
    label_logit_ref[...] = label_logit


def lce_forward(x, w, labels, *, blocks, interpret=False):
    """One program per block of tokens sweeps the whole vocabulary: [block_m, block_n] logits at a time."""
    n, vocab = x.shape[0], w.shape[1]
    (x,), (w,), (labels,), _, (bm, bv, bd), (np_, vp, dp) = _blocks.pad_operands(
        (x,), (w,), (labels.reshape(n, 1),), ("row",), trans_lhs=False, trans_rhs=False, blocks=blocks,
        implementation="triton")
    kernel = functools.partial(_lce_forward_kernel, vocab=vocab, block_v=bv, block_d=bd, num_v=vp // bv,
                               num_d=dp // bd)
    row_spec = pl.BlockSpec((bm, 1), lambda i: (i, 0))
    lse, label_logit = pl.pallas_call(
        kernel,
        grid=(np_ // bm,),
        in_specs=[pl.BlockSpec((bm, dp), lambda i: (i, 0)), pl.BlockSpec((dp, vp), lambda i: (0, 0)), row_spec],
        out_specs=[row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((np_, 1), jnp.float32)] * 2,
        compiler_params=_params(blocks),
        interpret=interpret,
        name="linear_cross_entropy_fwd",
        cost_estimate=_cost.lce_forward(x, w, vocab=vocab, tiles=(bm, bv, bd)),
    )(x, w, labels)
    return lse[:n, 0], label_logit[:n, 0]
