"""The Mosaic kernels compiled by the real TPU compilers (Mosaic and XLA:TPU in libtpu, on compile-only devices:
`kernels/tpu_compile.py`) for v4, v5e, v5p and v6e with their generation's block tables: each program compiles
under the scoped VMEM its kernels state they need (`tpu_compile.vmem_needs`, at most the generation's default
limit), fits the device's HBM, and no kernel compiles below one copy of its windows.

Run with `make test-tpu` (the `tpu` tier: its own environment with jax[tpu]); skipped without libtpu. Every
program is forward and backward together (`value_and_grad`), so an op's forward and backward kernels compile in one
program. kernels/README.md records the tier's runtime and the report of the same compiles.
"""
import itertools

import pytest

from kernels import tpu_compile
from kernels.attention import BlockSizes
from kernels.tpu_compile import (HBM_BYTES, SCOPED_VMEM_BYTES, KiB, attention_case, compile_case,
                                 context_parallel_case, matmul_cases, vmem_needs)
from tests.tpu_targets import GENERATIONS, tpu_devices

pytestmark = pytest.mark.tpu


def _compiles(generation, case):
    """Compiles `case` for `generation` (skipping without libtpu) under the scoped VMEM its kernels state they need,
    or the default limit where they state more (Mosaic then gives up double buffers: kernels/README.md); asserts it
    fits VMEM and HBM."""
    tpu_devices(generation)
    need = max(need for _, need in vmem_needs(case, generation).values())
    result = compile_case(generation, case, scoped_vmem=min(need, SCOPED_VMEM_BYTES[generation]))
    assert result.overflow is None, f"{case.kernel} {case.label}: {result.overflow}"
    assert result.hbm_bytes <= HBM_BYTES[generation], \
        f"{case.kernel} {case.label}: {result.hbm_bytes / 2**30:.2f} GiB > {HBM_BYTES[generation] / 2**30} GiB"
    return result


# ---- flash attention: every generation a few settings, v5p the whole cross product ----

REPRESENTATIVE = [(1024, 64, "segments"), (8192, 128, "causal"), (32768, 256, "causal+segments")]
CROSS = [setting for setting in itertools.product((1024, 8192, 32768), (64, 128, 256),
                                                 ("causal", "segments", "causal+segments"))
         if setting not in REPRESENTATIVE]


def _id(setting):
    length, head_dim, mask = setting
    return f"T{length}-D{head_dim}-{mask}"


@pytest.mark.parametrize("setting", REPRESENTATIVE, ids=_id)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_attention_compiles(generation, setting):
    _compiles(generation, attention_case(*setting))


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_attention_without_grouped_kv_heads_compiles(generation, head_dim):
    """32 query and 32 kv heads with segment ids at 2048 tokens (LLaMA-7B's packed rows): the forward's VMEM need
    grows with the kv heads' ids and windows, and a tile that fit GQA 32/8 overflowed here (the block tables)."""
    _compiles(generation, attention_case(2048, head_dim, "causal+segments", heads=32, kv_heads=32))


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_windowed_soft_capped_attention_compiles(generation, family):
    """Sliding windows and soft-caps in the Mosaic kernels: Gemma 2's local layers (16 / 8 heads of 256, a window of
    4096 keys, logits capped at 50) and Mistral-7B's (32 / 8 heads of 128, a window of 4096 keys) at 8k tokens."""
    if family == "gemma2":
        case = attention_case(8192, 256, "causal+segments", heads=16, kv_heads=8, window=(4095, 0),
                              logit_soft_cap=50.0)
    else:
        case = attention_case(8192, 128, "causal", window=(4095, 0))
    _compiles(generation, case)


@pytest.mark.parametrize("setting", CROSS, ids=_id)
def test_attention_cross_product_compiles_on_v5p(setting):
    _compiles("v5p", attention_case(*setting))


# ---- the LLaMA MLP and head ----

@pytest.mark.parametrize("index", range(4), ids=["gated_mlp", "fused_matmul", "loss-32000", "loss-128256"])
@pytest.mark.parametrize("model", ["7B", "70B"])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_llama_mlp_and_head_compile(generation, model, index):
    cases = matmul_cases(model)
    if index >= len(cases):
        pytest.skip(f"LLaMA-{model} has one vocabulary")
    _compiles(generation, cases[index])


# ---- context parallelism over the slice ----

@pytest.mark.parametrize("kind, collective", [("ulysses", "all-to-all"), ("ring", "collective-permute")])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_context_parallel_attention_compiles(generation, kind, collective):
    tpu_devices(generation)  # skips without libtpu, before the case asks for a TPU topology
    case = context_parallel_case(generation, kind)
    compiled = tpu_compile.compile_with(case.lower(generation))
    assert tpu_compile.device_bytes(compiled) <= HBM_BYTES[generation]
    assert collective in compiled.as_text(), f"{kind} attention without {collective}"


# ---- the stated VMEM need against the compiler ----

@pytest.mark.parametrize("generation", GENERATIONS)
def test_no_kernel_compiles_below_one_copy_of_its_windows(generation):
    """The lower end of the bracket the stated need closes from above (`_compiles`): a limit under the largest
    kernel's windows, held once, overflows, and the compiler names a kernel of the program."""
    tpu_devices(generation)
    for case in (attention_case(8192, 128, "causal"), *matmul_cases("7B")[:3]):
        needs = vmem_needs(case, generation)
        windows = max(w for w, _ in needs.values())
        result = compile_case(generation, case, scoped_vmem=windows - 64 * KiB)
        assert result.overflow is not None, f"{case.kernel} compiled in {windows - 64 * KiB} bytes"
        assert result.overflow.kernel in needs, result.overflow


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_default_scoped_vmem_is_the_stated_one(generation):
    """SCOPED_VMEM_BYTES, which the block search and the tables assume, is what libtpu lends a kernel by default:
    a forward kernel on tiles twice the largest that fit overflows it, and the error states the limit."""
    tpu_devices(generation)
    tiles = (4096, 2048) if generation == "v6e" else (2048, 2048)
    case = attention_case(4096, 128, "none", heads=1, kv_heads=1, block_sizes=BlockSizes(*tiles, 128, 128))
    result = compile_case(generation, case)
    assert result.overflow is not None and result.overflow.kernel == "flash_attention_fwd", result
    assert result.overflow.limit == SCOPED_VMEM_BYTES[generation], result.overflow


# ---- the grouped matmul: Mixtral-8x7B's experts ----

# 8192 tokens routed top-2 (16384 rows) through 8 experts: the up (and gate) projection 4096 -> 14336 and the down
# projection 14336 -> 4096, forward, dx and dw in one program; ragged sizes are a runtime input.
MIXTRAL_EXPERTS = {"up": (16384, 4096, 14336), "down": (16384, 14336, 4096)}


def _grouped_case(projection):
    import jax
    import jax.numpy as jnp

    from kernels.grouped_matmul import grouped_matmul

    m, k, n = MIXTRAL_EXPERTS[projection]

    def loss_and_grads(x, w, sizes):
        loss = lambda x, w: grouped_matmul(x, w, sizes, implementation="mosaic_tpu").astype(jnp.float32).sum()
        return jax.value_and_grad(loss, (0, 1))(x, w)

    return tpu_compile.Case("grouped_matmul", f"Mixtral-8x7B {projection} [{m}, {k}] x [8, {k}, {n}]", loss_and_grads,
                            (((m, k), jnp.bfloat16), ((8, k, n), jnp.bfloat16), ((8,), jnp.int32)))


@pytest.mark.parametrize("projection", MIXTRAL_EXPERTS)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_mixtral_grouped_matmul_compiles(generation, projection):
    _compiles(generation, _grouped_case(projection))


# ---- paged attention: a decoding step of 64 sequences of 2048 tokens ----

def _paged_case(page, dtype):
    import jax.numpy as jnp

    from kernels import paged_attention

    batch, heads, kv_heads, dim, max_pages = 64, 32, 8, 128, 2048 // page
    pool = ((kv_heads, batch * max_pages, page, dim), jnp.int8 if dtype == "int8" else jnp.bfloat16)
    scale = ((kv_heads, batch * max_pages, page), jnp.float32)

    def step(q, k, v, table, lengths, *scales):
        int8 = dict(k_scale=scales[0], v_scale=scales[1]) if scales else {}
        return paged_attention(q, k, v, table, lengths, **int8, window=(1023, 0), implementation="mosaic_tpu")

    shapes = (((batch, heads, dim), jnp.bfloat16), pool, pool, ((batch, max_pages), jnp.int32), ((batch,), jnp.int32),
              *((scale, scale) if dtype == "int8" else ()))
    return tpu_compile.Case("paged_attention", f"B{batch} 2048 tokens page {page} {dtype}", step, shapes)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("page", [16, 64])
def test_paged_attention_compiles_on_v5p(page, dtype):
    """bf16 pages under the kernel's stated VMEM need; int8 pages under the default limit: XLA gathers the scales
    into each sequence's token order before the kernel, and its copies need more VMEM than the kernel states
    (kernels/README.md, Paged attention)."""
    case = _paged_case(page, dtype)
    if dtype == "bfloat16":
        _compiles("v5p", case)
        return
    tpu_devices("v5p")
    result = compile_case("v5p", case)
    assert result.overflow is None and result.hbm_bytes <= HBM_BYTES["v5p"], result


# ---- the matmuls' heavier tiles: float32 operands, int8 weights, the fused epilogue's backward ----

def _heavy_cases():
    """What overflowed the default scoped VMEM on a real v5e (scripts/check_kernels.py's rows, kernels/README.md),
    forward and backward: bias + GELU in float32 and with int8 weights, the gated MLP with int8 weights in float32,
    the loss in float32."""
    import jax.numpy as jnp
    import numpy as np

    from kernels import fused_matmul, gated_mlp, linear_cross_entropy

    f32, n, k, f = jnp.float32, 4096, 4096, 11008
    q_gate, q_up = (jnp.asarray(np.random.RandomState(i).randint(-127, 128, (k, f)), jnp.int8) for i in (1, 2))
    labels = jnp.zeros(n, jnp.int32)
    mosaic = dict(implementation="mosaic_tpu")
    grads = tpu_compile._value_and_grads  # noqa: SLF001
    return [
        tpu_compile.Case("fused_matmul", "bias+gelu f32", grads(
            lambda x, w, b: fused_matmul(x, w, b, activation="gelu", **mosaic), 3),
            (((n, k), f32), ((k, f), f32), ((f,), f32))),
        tpu_compile.Case("fused_matmul", "int8 bias+gelu bf16", grads(
            lambda x, s, b: fused_matmul(x, q_gate, b, w_scale=s, activation="gelu", **mosaic), 3),
            (((n, k), jnp.bfloat16), ((f,), f32), ((f,), jnp.bfloat16))),
        tpu_compile.Case("gated_mlp", "int8 f32", grads(
            lambda x, sg, su: gated_mlp(x, q_gate, q_up, w_gate_scale=sg, w_up_scale=su, **mosaic), 3),
            (((n, k), f32), ((f,), f32), ((f,), f32))),
        tpu_compile.Case("linear_cross_entropy", "f32 V32000", grads(
            lambda x, w: linear_cross_entropy(x, w, labels, **mosaic), 2), (((n, k), f32), ((k, 32000), f32))),
    ]


@pytest.mark.parametrize("index", range(4), ids=["bias-gelu-f32", "int8-bias-gelu", "gated-int8-f32", "loss-f32"])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_heavy_matmul_tiles_compile(generation, index):
    """Under the VMEM the kernels ask for (kernels._dispatch.MOSAIC_VMEM_LIMIT; v4's default with halved tiles)."""
    tpu_devices(generation)
    case = _heavy_cases()[index]
    result = compile_case(generation, case, own_vmem=True)
    assert result.overflow is None, f"{case.kernel} {case.label}: {result.overflow}"
