"""Plans for GPUs (`--target=gpu:h100-8`, engine/plan.py): target names and their one-line errors here; the step
compiled by XLA:GPU and the Triton kernels for compile-only H100 / H200 devices (JAX's CUDA plugin: `make
test-gpu-compile`, marked `gpu_compile`), with their memory, budget, collectives and the dtypes of their matmuls."""
import re

import jax
import pytest

import engine
from engine import plan


@pytest.mark.parametrize("target, parsed", [
    ("gpu:h100", ("h100", 1, "1x1x1", 1)),
    ("gpu:h200-2", ("h200", 2, "1x1x2", 1)),
    ("gpu:h100-8", ("h100", 8, "1x1x8", 1)),
    ("gpu:h100-16", ("h100", 16, "1x2x8", 1)),
    ("gpu:h200-512", ("h200", 512, "1x64x8", 1)),
])
def test_gpu_targets_name_gpus_in_hosts_of_eight(target, parsed):
    assert plan.parse_target(target) == parsed


@pytest.mark.parametrize("target, match", [
    ("gpu:h100-12", r"^target='gpu:h100-12'; expected a GPU count n of 1 to 8 or a multiple of 8"),
    ("gpu:h100-0", r"^target='gpu:h100-0'; expected a GPU count n of 1 to 8"),
    ("gpu:a100-8", r"^target='gpu:a100-8'; expected 'cpu', 'gpu:<h100\|h200>\[-<n>\]' or 'tpu:"),
])
def test_bad_gpu_targets_are_refused_in_one_line(target, match):
    with pytest.raises(ValueError, match=match) as e:
        plan.parse_target(target)
    assert "\n" not in str(e.value)


def test_gpu_memory_is_the_share_jax_allocates(monkeypatch):
    """A compile-only GPU reports no memory statistics: its budget is its memory times JAX's preallocated share."""
    class Device:
        platform, device_kind = "gpu", "NVIDIA H200"

        def memory_stats(self):
            raise NotImplementedError

    assert plan.device_memory_bytes(Device()) == int((143771 << 20) * 0.75)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert plan.device_memory_bytes(Device()) == int((143771 << 20) * 0.9)


def _no_cuda_plugin():
    from kernels import mosaic_gpu_compile

    return mosaic_gpu_compile.available()


@pytest.mark.skipif(not _no_cuda_plugin(), reason="this environment has JAX's CUDA plugin")
def test_a_gpu_target_without_the_cuda_plugin_says_what_to_install():
    with pytest.raises(ValueError, match=r"^target='gpu:h100\.\.\.' needs JAX's CUDA plugin .*make "
                                         r"test-gpu-compile"):
        plan.target_devices("gpu:h100-2")


def _compiled_plan(target, mesh, **kwargs):
    from engine.tasks import planning

    why = _no_cuda_plugin()
    if why:
        pytest.skip(why)
    return planning.compile_plan(model="llama", model_config="tiny", target=target, mesh=mesh,
                                 **{"seq_len": 128, "per_device_batch_size": 2, **kwargs})


_TYPE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]", re.M)
_DOT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", re.M)


def _dots(hlo):
    """[(lhs dtype, rhs dtype, output elements)] of every dot of a compiled HLO module (instruction names are unique
    in it)."""
    types = {name: dtype for name, dtype, _ in _TYPE.findall(hlo)}
    out = []
    for dims, lhs, rhs in _DOT.findall(hlo):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        out.append((types[lhs], types[rhs], size))
    assert len(out) == len(re.findall(r" dot\(", hlo)), "a dot the pattern did not read"
    return out


@pytest.mark.gpu_compile
def test_the_step_compiles_for_two_h200s_with_the_triton_kernels_and_bf16_matmuls():
    """FSDP over two H200s: XLA:GPU's buffer assignment under the budget, the gradients reduce-scattered (XLA:CPU
    would run an all-reduce and a slice), the attention and the fused loss as Triton kernels, and every matmul's
    operands bf16 (an fp32 dot only where it yields one number)."""
    result, compiled = _compiled_plan("gpu:h200-2", "1,2,1", loss_implementation="auto")
    assert result["target"] == "gpu:h200-2" and result["step"] == "shard_map"
    assert result["attention_implementation"] == result["loss_implementation"] == "triton"
    assert result["hbm_gb"] == pytest.approx((143771 << 20) * 0.75 / 1e9) and result["fits"]
    assert 0 < result["bytes"]["total"] < 10 << 20
    assert result["collective_bytes"]["reduce-scatter"] > 0 and result["collective_bytes"]["all-gather"] > 0
    hlo = compiled.as_text()
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') >= 3  # attention forward, its backward, the loss
    dots = _dots(hlo)
    assert dots and all(d[:2] == ("bf16", "bf16") or d[2] <= 1 for d in dots), dots
    assert engine.plan.hosts_of(jax.tree.leaves(compiled.input_shardings)[0].mesh.devices.flat) == [0, 0]


@pytest.mark.gpu_compile
@pytest.mark.parametrize("packed", [True, False])
def test_a_default_plan_compiles_the_kernels_a_run_on_the_target_takes(packed):
    """A plan's default kernels ('default', plan_memory.py's too) resolve for the target as the training scripts do
    on it: the loss as the
    H200's table measured it (plain logits), each attention call the table's answer for its class: packed rows
    (segment ids, no entry) the Triton kernel, whole rows of 2048 tokens at head dim 128 cuDNN's (the 4096 entry's
    neighbour), compiled by XLA:GPU without the device (make test-gpu-compile installs cuDNN's library)."""
    import importlib.util

    if not packed and importlib.util.find_spec("nvidia.cudnn") is None:
        pytest.skip("cuDNN's library (nvidia-cudnn-cu13) is not installed here: make test-gpu-compile installs it")
    result, compiled = _compiled_plan("gpu:h200", "1,1,1", packed=packed, seq_len=2048,
                                      per_device_batch_size=1,
                                      config_overrides={"hidden_size": 512, "num_heads": 4, "num_kv_heads": 2})
    assert (result["loss_implementation"], result["attention_implementation"], result["packed"]) == (
        "plain", "triton" if packed else "cudnn", packed)
    hlo = compiled.as_text()
    calls = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    assert "linear_cross_entropy" not in hlo
    if packed:
        assert calls == {"__gpu$xla.gpu.triton"}, calls
    else:
        assert calls == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, calls


@pytest.mark.gpu_compile
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_the_gpu_step_guards_its_update_by_select_and_counts_zero_weight_gathers(zero_stage):
    """On GPU the non-finite guard is a `where` per leaf fused into the update (`select_guard`), as on TPU: no
    conditional, so the gradients are not widened to float32 in a pass of their own before it; ZeRO-1 / 2's
    all-gather of the updated weights counts (under the conditional it once did, it had been left out)."""
    result, compiled = _compiled_plan("gpu:h100-2", "2,1,1", zero_stage=zero_stage, step="jit")
    assert "true_computation=" not in compiled.as_text()
    assert result["collective_bytes"]["all-gather"] > 0, result["collective_bytes"]


@pytest.mark.gpu_compile
def test_the_shard_map_step_on_a_context_mesh_compiles_for_h100s():
    """The shard_map step with `context` manual (fsdp 2 x context 2 on four H100s): XLA:GPU compiles it with the
    Triton attention and loss, the tokens exchanged by all-to-all (Ulysses) and the gradients reduce-scattered."""
    result, compiled = _compiled_plan("gpu:h100-4", "1,2,1", context=2)
    assert result["step"] == "shard_map" and result["context"] == 2 and result["fits"]
    assert result["collective_bytes"]["all-to-all"] > 0 and result["collective_bytes"]["reduce-scatter"] > 0
    assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') >= 3


@pytest.mark.gpu_compile
def test_the_step_compiles_with_the_mosaic_gpu_attention_in_it():
    """attention_implementation='mosaic_gpu' (head dim 64, packed rows' segment ids): the Hopper kernels (forward,
    dq, dk / dv) are Mosaic GPU custom calls of the compiled step, beside the Triton loss."""
    result, compiled = _compiled_plan("gpu:h100", "1,1,1", attention_implementation="mosaic_gpu",
                                      config_overrides={"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2})
    assert result["attention_implementation"] == "mosaic_gpu" and result["fits"]
    hlo = compiled.as_text()
    assert hlo.count('custom_call_target="mosaic_gpu_v2"') >= 3, re.findall(r'custom_call_target="([^"]+)"', hlo)


@pytest.mark.gpu_compile
def test_the_zero3_layer_loops_carry_gathered_weights_and_gradients_without_copies():
    """ZeRO-3 over eight H100s with remat='full' (the hand-pipelined layer stack, `engine.step.layer_scan`; six
    layers, so both loops iterate): no loop body copies an array of a gathered weight's shape. Carrying one layer's
    gathered weights (and, backward, its full-size gradient) into the next iteration while the next layer's were
    made, XLA copied them into and out of the loop state every iteration (llama2-7b's step: 26 GB a device). The
    forward's stacks of saved layer inputs are `jax.lax.empty`'s AllocateBuffer, not a zero fill."""
    from engine.traffic import _Module

    _, compiled = _compiled_plan("gpu:h100-8", "1,8,1", remat="full", config_overrides={"num_layers": 6})
    module = _Module(compiled.as_text())
    shapes = lambda line: set(re.findall(r"\w+\[[\d,]*\]", line.split("=", 1)[1].split("(%", 1)[0]))  # noqa: E731
    loops = [b for lines in module.comps.values() for line in lines if " while(" in line
             for b in re.findall(r"\bbody=%([\w.\-]+)", line)]
    bodies = [module.comps[b] for b in loops if any("all-gather" in line for line in module.comps[b])]
    assert len(bodies) == 2, loops
    for lines in bodies:  # the gathered shapes: what each (combined, asynchronous) all-gather yields
        weights = set().union(*[shapes(line) for line in lines if re.search(r" all-gather(-done)?\(", line)])
        copied = [line.strip()[:100] for line in lines
                  if re.search(r" copy(-start)?\(", line) and shapes(line) & weights]
        assert weights and not copied, copied
    # The forward's stacks of layer inputs (5 of them saved) start uninitialised, not zero-filled: every slot is
    # written before the backward reads it, and XLA's own fill elimination skips these loops (they carry shardings).
    allocated = re.findall(r"= (\w+\[[\d,]*\])[^=]* custom-call\(\), custom_call_target=\"AllocateBuffer\"",
                           compiled.as_text())
    assert any(re.match(r"\w+\[5,", shape) for shape in allocated), allocated


@pytest.mark.gpu_compile
def test_two_hosts_of_eight_gpus_send_the_data_axis_between_them():
    """gpu:h100-16 is two hosts of 8: with data 2 over them (fsdp 8 inside each), the step sends bytes between the
    hosts (the gradients' reduction over `data`), far fewer than within them."""
    result, _ = _compiled_plan("gpu:h100-16", "2,8,1")
    assert result["num_devices"] == 16 and result["fits"]
    assert 0 < result["cross_slice_bytes"] < result["collective_bytes_total"]
