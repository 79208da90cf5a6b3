"""Generation's programs compiled by XLA:GPU for a compile-only H100 (`scripts/bench_rollout.py --target`, JAX's
CUDA plugin: `make test-gpu-compile`, marked `gpu_compile`): under the GPU run's own XLA flags (engine.compiler's,
while-loop double buffering among them) each program holds its layer once, scanned, at any depth."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table(layers):
    """{program: (HLO instructions, Triton kernels, while loops)} of bench_rollout.py --target=gpu:h100 on a tiny
    scanned LLaMA of `layers` layers (its own process: the GPU flags must be set before JAX starts)."""
    from kernels import mosaic_gpu_compile

    why = mosaic_gpu_compile.available()
    if why:
        pytest.skip(why)
    args = ["--target=gpu:h100", f"--layers={layers}", "--scan_layers", "--hidden=64", "--heads=2", "--kv_heads=1",
            "--vocab=256", "--prompts=1", "--samples=2", "--min_prompt=4", "--max_prompt=8", "--min_new=2",
            "--max_new=8", "--max_batch=2", "--page_size=4"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_rollout.py"), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| ((?:static|paged) [\w ]+?) \| [\d.]+ \| [\d.]+ \| ([\d,]+) \| \d+ \(\d+\) \| \d+ \| (\d+) \| "
                      r"(\d+) \|$", out.stdout, re.M)
    return {name: (int(size.replace(",", "")), int(kernels), int(loops)) for name, size, kernels, loops in rows}


@pytest.mark.gpu_compile
def test_generation_programs_hold_one_layer_at_any_depth_under_the_gpu_flags():
    """A scanned LLaMA's paged decode step and prefill, and the static `generate`, compile for an H100 to the same
    HLO at 2 and 6 layers, one Triton attention kernel per attention site (prefill's flash attention, decode's
    paged or cached attention): engine.compiler's while-loop double buffering would copy each loop's body (the
    layer scan, the token loop) and its kernels; models.generate.COMPILER_OPTIONS turns it off for generation."""
    two, six = _table(2), _table(6)
    assert set(two) == {"static generate", "paged prefill 8", "paged decode", "paged sampling", "paged page copy"}, two
    assert two == six
    assert two["paged decode"][1:] == (1, 1)  # one paged-attention kernel, one layer loop
    assert two["paged prefill 8"][1:] == (1, 1)
    assert two["static generate"][1:] == (2, 3)  # prefill's and decode's kernels; prefill's, token and decode loops


@pytest.mark.gpu_compile
def test_a_scanned_model_generates_with_the_triton_decode_kernel_under_jax_0_11():
    """A scanned LLaMA's `generate` with Triton attention, lowered for a GPU outside a mesh (what `generate.py` and
    PPO's rollouts run on one GPU). Under JAX 0.11 a `pallas_call` is never dead-code eliminated, and flax's
    `nn.scan` traces its body once to check that nothing it broadcasts depends on the loop: the cached decode through
    the Triton kernel failed that check ("broadcasted variable has a data dependency on the scan body"); cached calls
    of a scanned stack are a plain lax.scan now (models/layers/stack.py `_cached_scan`)."""
    import importlib

    import jax
    import jax.numpy as jnp

    import models
    from kernels import mosaic_gpu_compile
    from tests import targets

    generate = importlib.import_module("models.generate")  # the module (models.generate is its function)

    why = mosaic_gpu_compile.available()
    if why:
        pytest.skip(why)
    model = models.create_model("llama", "tiny", scan_layers=True, attention_implementation="triton")
    params = jax.eval_shape(lambda: models.init_params(model))
    ids = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    run = generate._compiled(model, 4, 0.0, None, None, None, 0, None)
    with targets.for_gpu():
        text = run.trace(params, ids, ids, jax.random.PRNGKey(0)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 2, "expected the prefill's and the decode's Triton kernels"
