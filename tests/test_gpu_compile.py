"""The Hopper compile tier (`make test-gpu-compile`): every Triton kernel of the project, at its production shape and
block sizes, lowered by JAX 0.11 for an abstract H200 and compiled to sm_90a by the `triton` package's NVIDIA
backend (kernels/gpu_compile.py). What ptxas reports is what kernels/README.md records; no GPU is needed.

The log parser's test runs in the default suite too (it needs neither triton nor JAX 0.11).
"""
import jax
import pytest

from kernels import gpu_compile

# `ptxas -v` on the flash attention forward before issue 32's tuning (its spill lines made up: it had none).
_LOG = "\n".join([
    "ptxas-blackwell info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
    "non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in "
    "the function 'flash_attention_fwd' in line 1184",
    "ptxas-blackwell info    : 11 bytes gmem",
    "ptxas-blackwell info    : Compiling entry function 'flash_attention_fwd' for 'sm_90a'",
    "ptxas-blackwell info    : Function properties for flash_attention_fwd",
    "    112 bytes stack frame, 108 bytes spill stores, 96 bytes spill loads",
    "ptxas-blackwell info    : Used 180 registers, used 1 barriers",
    "ptxas-blackwell warning : Registers are spilled to local memory in function 'flash_attention_fwd', 108 bytes "
    "spill stores, 96 bytes spill loads",
])


def test_ptxas_log_gives_registers_spills_and_advisories():
    registers, stores, loads, advisories = gpu_compile.parse_ptxas_log(_LOG)
    assert (registers, stores, loads) == (180, 108, 96)
    assert list(advisories) == ["C7515", "warning"]
    assert advisories["warning"].startswith("Registers are spilled to local memory")
    assert advisories["C7515"].endswith("between start and end of the pipeline stage")


@pytest.fixture(scope="module")
def reports():
    pytest.importorskip("triton")
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11):
        pytest.skip("the lowering needs an abstract GPU target: JAX >= 0.11 (make test-gpu-compile)")
    return {r.label: r for r in gpu_compile.report()}


@pytest.mark.gpu_compile
def test_every_triton_kernel_compiles_for_sm_90a_within_hopper_limits(reports):
    labels = [f"{case}: {label}" for case, (_, _, labels) in gpu_compile.production_cases().items()
              for label in labels]
    assert list(reports) == labels
    for label, r in reports.items():
        assert 0 < r.registers <= 255, label
        assert 0 < r.shared_bytes <= gpu_compile.MAX_SHARED_BYTES, label
        # Hopper's wgmma, or mma.sync where a tile has too few rows for it (decoding, paged too: 16-row query tiles).
        assert "wgmma.mma_async" in r.ptx or ("decode" in label and "mma.sync" in r.ptx), f"{label}: no tensor cores"


@pytest.mark.gpu_compile
def test_no_kernel_spills(reports):
    spilled = {label: (r.registers, r.spill_stores, r.spill_loads) for label, r in reports.items() if r.spilled}
    assert not spilled, f"(registers, spill store bytes, spill load bytes): {spilled}"


@pytest.mark.gpu_compile
def test_no_kernel_serializes_its_wgmma_and_attention_stays_pipelined(reports):
    serialized = [label for label, r in reports.items() if r.wgmma_serialized]
    assert not serialized, f"ptxas C7515 (wgmma serialized) in {serialized}"
    # Not by giving the pipelining up: the attention loops copy their kv / q tiles ahead (num_stages; the paged
    # kernel its gathered page rows) and keep their wgmma asynchronous.
    for label, r in reports.items():
        if label.startswith(("attention", "decode", "paged")):
            assert "async_copy_global_to_local" in r.ttgir, label
        if label.startswith("attention"):
            assert "isAsync = true" in r.ttgir, label
