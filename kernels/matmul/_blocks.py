"""Block sizes: one small table per backend and op, clamped to the problem, overridable per call."""
import dataclasses

import jax.numpy as jnp

from kernels._dispatch import tpu_generation


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of one op. For the loss, m runs over tokens, n over the vocabulary and k over the model dim.

    block_m, block_n, block_k: output rows, output columns and contraction per tile (Triton: powers of two, at
      least 16; Mosaic: multiples of 128, so transposed operands also meet the (8, 128) rule).
    num_warps, num_stages: Triton CompilerParams (ignored elsewhere).
    vocab_chunk: vocabulary columns per step of the loss's chunked backward (and of the 'xla' forward); the
      largest temporary is [N, vocab_chunk]. None: `with_vocab_chunk`'s choice.
    """
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    vocab_chunk: int | None = None


# Starting points, not tuned measurements yet: Triton's H100 matmul tutorial tiles (128x128x64, 8 warps, 3-4 stages),
# halved in m where the kernel holds two float32 accumulators (gated MLP) or an extra epilogue tile; Mosaic's 512
# tiles from jax's ops/tpu/matmul.py, halved for the two-accumulator kernel to stay well inside VMEM. The gated
# kernel runs 8 warps: at 4 its backward epilogue (two accumulators, the dh tile, the activation's derivative) needs
# all 255 registers and spills with int8 weights; at 8 every gated kernel fits in 130 (sm_90a, kernels/README.md).
_TABLE = {
    ("triton", "matmul"): BlockSizes(128, 128, 64, num_warps=8, num_stages=3),
    ("triton", "gated"): BlockSizes(64, 128, 64, num_warps=8, num_stages=3),
    ("triton", "loss"): BlockSizes(64, 128, 64, num_warps=4, num_stages=3),
    ("mosaic_tpu", "matmul"): BlockSizes(512, 512, 512),
    ("mosaic_tpu", "gated"): BlockSizes(256, 512, 512),
    ("mosaic_tpu", "loss"): BlockSizes(256, 512, 512),
    ("xla", "matmul"): BlockSizes(),
    ("xla", "gated"): BlockSizes(),
    ("xla", "loss"): BlockSizes(),
}


# Mosaic tiles per TPU generation (`kernels._dispatch.tpu_generation`; the ('mosaic_tpu', op) rows above serve
# tracing off TPU): per op the largest (block_m, block_n, block_k) whose every forward and backward kernel compiles
# under the generation's default scoped VMEM (16 MiB on v4, v5e and v5p; 32 MiB on v6e), on 4096-wide bf16
# operands (`scripts/tpu_compile_report.py --search`; kernels/README.md records the search and the compiles); v6e's
# loss tile 1024 x 1024 x 512, since 2048 rows overflowed its 32 MiB at LLaMA-70B's 8192-wide rows (35.2 MiB).
_MOSAIC_BY_GENERATION = {
    **{generation: {"matmul": BlockSizes(1024, 1024, 512), "gated": BlockSizes(1024, 512, 256),
                    "loss": BlockSizes(512, 1024, 1024)} for generation in ("v4", "v5e", "v5p")},
    "v6e": {"matmul": BlockSizes(1024, 2048, 1024), "gated": BlockSizes(1024, 1024, 512),
            "loss": BlockSizes(1024, 1024, 512)},
}


# What `scripts/bench_kernels.py --tune` times per (implementation, op), the default first; (block_m, block_n,
# block_k, num_warps, num_stages) for Triton: wider tiles and deeper pipelines for the one-accumulator matmul, fewer
# registers' worth for the two-accumulator gated kernel and the loss. 'xla' has nothing to tune.
_TRITON_CANDIDATES = {
    "matmul": ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
               (128, 128, 32, 4, 4), (64, 256, 32, 4, 4), (128, 256, 32, 8, 4), (256, 128, 32, 8, 4)),
    "gated": ((64, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
              (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 32, 4, 4)),
    "loss": ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 3),
             (128, 128, 32, 8, 4), (64, 128, 32, 4, 4)),
}
_MOSAIC_CANDIDATES = {
    "matmul": ((512, 512, 512), (256, 256, 512), (512, 1024, 512), (1024, 512, 512), (512, 512, 1024)),
    "gated": ((256, 512, 512), (256, 256, 512), (512, 512, 512), (256, 512, 1024)),
    "loss": ((256, 512, 512), (512, 512, 512), (256, 1024, 512), (512, 1024, 256)),
}
TUNING_SPACE = {
    **{("triton", op): [BlockSizes(m, n, k, num_warps=w, num_stages=s) for m, n, k, w, s in c]
       for op, c in _TRITON_CANDIDATES.items()},
    **{("mosaic_tpu", op): [BlockSizes(m, n, k) for m, n, k in c] for op, c in _MOSAIC_CANDIDATES.items()},
}


def default_block_sizes(implementation, op):
    """The table's tiles for `op` ('matmul', 'gated' or 'loss'); Mosaic's for the TPU generation being traced for."""
    if implementation == "mosaic_tpu" and tpu_generation() in _MOSAIC_BY_GENERATION:
        return _MOSAIC_BY_GENERATION[tpu_generation()][op]
    return _TABLE[(implementation, op)]


def fit_vmem(blocks, implementation, *, heavy):
    """`blocks` for a Mosaic kernel whose tiles are `heavy` (float32 operands, int8 weights converted in the kernel,
    an epilogue's backward reading the forward's tile): halved in rows and columns on v4, whose 16 MiB of VMEM
    cannot be raised (`kernels._dispatch.MOSAIC_VMEM_LIMIT`) and whose tiles were searched on bf16 operands."""
    if implementation != "mosaic_tpu" or not heavy or tpu_generation() != "v4":
        return blocks
    return dataclasses.replace(blocks, block_m=max(128, blocks.block_m // 2), block_n=max(128, blocks.block_n // 2))


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def _next_power_of_2(n):
    return 1 << max(n - 1, 0).bit_length()


def fit(block, dim, implementation):
    """The block actually used for a dimension of size `dim`: no larger than the dimension needs, aligned."""
    if implementation == "triton":
        return min(block, max(16, _next_power_of_2(dim)))
    if implementation == "mosaic_tpu":
        return min(block, _round_up(dim, 128))
    return block


# The loss's most vocabulary chunks (and Mosaic TPU's number of them: the tiles of `_MOSAIC_BY_GENERATION` were
# searched with 32; 2048- and 8192-column chunks overflowed v5p's scoped VMEM at 2048 x 4096 x 32000).
LOSS_VOCAB_CHUNKS = 32


def with_vocab_chunk(blocks, vocab, implementation, width, itemsize):
    """`blocks` with `vocab_chunk` filled in for a vocabulary of `vocab` columns, a model `width` wide (the loss's D)
    and its rows' dtype `itemsize` bytes: a chunk's d logits [N, chunk] as large as the float32 d x [N, D] the
    backward accumulates across chunks anyway (2 D columns for 16-bit rows), so that the temporaries stay a small
    fraction of the materialised logits while d x is read and written once a chunk, in as few chunks as that
    allows (kernels/README.md), and at most `LOSS_VOCAB_CHUNKS` of them (a narrow model's); Mosaic TPU's: that
    many."""
    if blocks.vocab_chunk is not None:
        return blocks
    fewest = -(-vocab // LOSS_VOCAB_CHUNKS)
    columns = fewest if implementation == "mosaic_tpu" else min(vocab, max(fewest, -(-4 * width // itemsize)))
    # Chunks are a multiple of the kernel's vocabulary block, so no chunk needs padding inside the kernel.
    return dataclasses.replace(blocks, vocab_chunk=_round_up(columns, fit(blocks.block_n, vocab, implementation)))


def validate(block_sizes, implementation):
    if block_sizes is None:
        return
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes={block_sizes!r}; expected None or kernels.matmul.BlockSizes")
    for field in dataclasses.fields(block_sizes):
        value = getattr(block_sizes, field.name)
        if value is None and field.name == "vocab_chunk":
            continue
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"block_sizes.{field.name}={value!r}; expected a positive int")
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(block_sizes, name)
        if implementation == "triton" and (value < 16 or value & (value - 1)):
            raise ValueError(f"block_sizes.{name}={value}; the Triton backend needs a power of two >= 16")
        if implementation == "mosaic_tpu" and value % 128:
            raise ValueError(f"block_sizes.{name}={value}; the Mosaic TPU backend needs a multiple of 128")


def pad_operands(lhs, rhs, extras, extra_kinds, *, trans_lhs, trans_rhs, blocks, implementation):
    """Fits the blocks to a tiled matmul's dims and zero-pads every operand to whole blocks (zero rows/columns of K
    add nothing; padded M/N rows and columns are sliced off the outputs).

    Returns (lhs, rhs, extras, (m, n), (block_m, block_n, block_k), (padded m, n, k)).
    """
    m, k = lhs[0].shape[::-1] if trans_lhs else lhs[0].shape
    n = rhs[0].shape[0] if trans_rhs else rhs[0].shape[1]
    heavy = (jnp.dtype(lhs[0].dtype).itemsize > 2 or any(b.dtype != lhs[0].dtype for b in rhs)
             or "tile" in extra_kinds)
    blocks = fit_vmem(blocks, implementation, heavy=heavy)
    bm, bn, bk = (fit(b, dim, implementation)
                  for b, dim in ((blocks.block_m, m), (blocks.block_n, n), (blocks.block_k, k)))
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)

    def pad(a, rows, cols):
        if a.shape == (rows, cols):
            return a
        return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))

    lhs = tuple(pad(a, kp, mp) if trans_lhs else pad(a, mp, kp) for a in lhs)
    rhs = tuple(pad(b, np_, kp) if trans_rhs else pad(b, kp, np_) for b in rhs)
    shapes = {"row": (mp, 1), "col": (1, np_), "tile": (mp, np_)}
    extras = tuple(pad(e, *shapes[kind]) for e, kind in zip(extras, extra_kinds))
    return lhs, rhs, extras, (m, n), (bm, bn, bk), (mp, np_, kp)
