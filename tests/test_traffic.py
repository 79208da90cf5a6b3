"""engine.traffic: what a compiled XLA:GPU program launches and the bytes each launch moves.

A hand-written module in XLA:GPU's printed form checks the counting rule by rule; the compile tier's test (marked
gpu_compile: JAX's CUDA plugin, no GPU) reads a real scanned and an unrolled step."""
import pytest

from engine import compiler
from engine.traffic import KINDS, format_traffic, kernel_traffic

# A loop of 4 trips whose body slices a weight out of a stack, multiplies by it (a GEMM fusion), writes the result
# into a stacked buffer in place and runs a custom kernel; before it a fill of that buffer, after it a copy and a
# conditional whose one branch runs an elementwise fusion and whose other runs nothing.
MODULE = """HloModule m

%fused_fill () -> f32[4,8,16] {
  %c = f32[] constant(0)
  ROOT %b = f32[4,8,16]{2,1,0} broadcast(%c), dimensions={}
}

%gemm_body (p0: f32[8,32], p1: f32[4,32,16], p2: s32[]) -> f32[8,16] {
  %p0 = f32[8,32]{1,0} parameter(0)
  %p1 = f32[4,32,16]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %w = f32[1,32,16]{2,1,0} dynamic-slice(%p1, %p2, %z, %z), dynamic_slice_sizes={1,32,16}
  %w2 = f32[32,16]{1,0} bitcast(%w)
  ROOT %d = f32[8,16]{1,0} dot(%p0, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%dus_body (q0: f32[4,8,16], q1: f32[8,16], q2: s32[]) -> f32[4,8,16] {
  %q0 = f32[4,8,16]{2,1,0} parameter(0)
  %q1 = f32[8,16]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = f32[1,8,16]{2,1,0} bitcast(%q1)
  ROOT %r = f32[4,8,16]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %z, %z)
}

%body (arg: (s32[], f32[8,32], f32[4,32,16], f32[4,8,16])) -> (s32[], f32[8,32], f32[4,32,16], f32[4,8,16]) {
  %arg = (s32[], f32[8,32]{1,0}, f32[4,32,16]{2,1,0}, f32[4,8,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%arg), index=1
  %ws = f32[4,32,16]{2,1,0} get-tuple-element(%arg), index=2
  %acc = f32[4,8,16]{2,1,0} get-tuple-element(%arg), index=3
  %g = f32[8,16]{1,0} fusion(%x, %ws, %i), kind=kCustom, calls=%gemm_body
  %k = f32[8,32]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %s = f32[4,8,16]{2,1,0} fusion(%acc, %g, %i), kind=kLoop, calls=%dus_body
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,32]{1,0}, f32[4,32,16]{2,1,0}, f32[4,8,16]{2,1,0}) tuple(%n, %k, %ws, %s)
}

%cond (carg: (s32[], f32[8,32], f32[4,32,16], f32[4,8,16])) -> pred[] {
  %carg = (s32[], f32[8,32]{1,0}, f32[4,32,16]{2,1,0}, f32[4,8,16]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %lim = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %lim), direction=LT
}

%scale_body (e0: f32[4,8,16]) -> f32[4,8,16] {
  %e0 = f32[4,8,16]{2,1,0} parameter(0)
  ROOT %e1 = f32[4,8,16]{2,1,0} multiply(%e0, %e0)
}

%apply (a0: f32[4,8,16]) -> f32[4,8,16] {
  %a0 = f32[4,8,16]{2,1,0} parameter(0)
  ROOT %a1 = f32[4,8,16]{2,1,0} fusion(%a0), kind=kLoop, calls=%scale_body
}

%skip (s0: f32[4,8,16]) -> f32[4,8,16] {
  ROOT %s0 = f32[4,8,16]{2,1,0} parameter(0)
}

ENTRY %main (x: f32[8,32], ws: f32[4,32,16], ok: pred[]) -> f32[4,8,16] {
  %x = f32[8,32]{1,0} parameter(0)
  %ws = f32[4,32,16]{2,1,0} parameter(1)
  %ok = pred[] parameter(2)
  %zero = s32[] constant(0)
  %f = f32[4,8,16]{2,1,0} fusion(), kind=kLoop, calls=%fused_fill
  %init = (s32[], f32[8,32]{1,0}, f32[4,32,16]{2,1,0}, f32[4,8,16]{2,1,0}) tuple(%zero, %x, %ws, %f)
  %w = (s32[], f32[8,32]{1,0}, f32[4,32,16]{2,1,0}, f32[4,8,16]{2,1,0}) while(%init), condition=%cond, body=%body, TRIPS
  %out = f32[4,8,16]{2,1,0} get-tuple-element(%w), index=3
  %c = f32[4,8,16]{2,1,0} copy(%out)
  ROOT %r = f32[4,8,16]{2,1,0} conditional(%ok, %c, %c), true_computation=%apply, false_computation=%skip
}
""".replace("TRIPS", 'backend_config={"known_trip_count":{"n":"4"}}')


def test_each_launch_counted_by_its_kind_and_bytes_times_its_loop():
    traffic = kernel_traffic(MODULE)
    kinds = traffic["kinds"]
    assert set(kinds) == set(KINDS)
    # The GEMM reads x [8, 32], only its slice [32, 16] of the stacked weights and the index, writes [8, 16]: 4 times.
    assert kinds["matmul"] == {"launches": 4, "bytes": 4 * (4 * (8 * 32 + 32 * 16 + 8 * 16) + 4)}
    assert kinds["kernel"] == {"launches": 4, "bytes": 4 * 4 * (8 * 32 * 2)}
    # In place: the [8, 16] update read and written, not the [4, 8, 16] buffer it lands in.
    assert kinds["stack write"] == {"launches": 4, "bytes": 4 * 2 * 4 * 8 * 16}
    assert kinds["fill"] == {"launches": 1, "bytes": 4 * 4 * 8 * 16}
    assert kinds["copy"] == {"launches": 1, "bytes": 2 * 4 * 4 * 8 * 16}
    # The loop counter's add (a launch too) and the conditional's costlier branch, counted once.
    assert kinds["elementwise"] == {"launches": 4 + 1, "bytes": 4 * 12 + 2 * 4 * 4 * 8 * 16}
    assert kinds["stack read"]["launches"] == kinds["collective"]["launches"] == 0
    assert traffic["launches"] == 19 and traffic["bytes"] == sum(k["bytes"] for k in kinds.values())
    table = format_traffic(traffic, bandwidth=1e9)
    assert table.splitlines()[0] == "| kind | launches | GB | ms at the memory bandwidth |"
    assert table.splitlines()[-1].startswith("| all | 19 | ")
    assert "| collective |" not in table  # kinds with no launch are left out


def test_an_uninitialised_buffer_launches_nothing():
    """XLA's AllocateBuffer in place of a scanned stack's zero fill (engine.compiler's flags) moves no byte: the same
    module without its fill, everything else counted as before."""
    unfilled = MODULE.replace("fusion(), kind=kLoop, calls=%fused_fill",
                              'custom-call(), custom_call_target="AllocateBuffer"')
    assert unfilled != MODULE
    before, after = kernel_traffic(MODULE), kernel_traffic(unfilled)
    assert after["kinds"]["fill"] == {"launches": 0, "bytes": 0}
    assert after["kinds"]["kernel"] == before["kinds"]["kernel"]
    assert after["launches"] == before["launches"] - 1
    assert after["bytes"] == before["bytes"] - before["kinds"]["fill"]["bytes"]


# The label's logit gathered out of bf16 logits [16, 1000] (widened to float32 first, as the loss's fusion does it)
# beside the per-token sum of the same logits, which reads them whole.
GATHERED = """HloModule g

%pick (l0: bf16[16,1000], l1: s32[16,2]) -> f32[16,1] {
  %l0 = bf16[16,1000]{1,0} parameter(0)
  %l1 = s32[16,2]{1,0} parameter(1)
  %w = f32[16,1000]{1,0} convert(%l0)
  ROOT %g = f32[16,1]{1,0} gather(%w, %l1), offset_dims={1}, start_index_map={0,1}, slice_sizes={1,1}
}

%total (t0: bf16[16,1000]) -> f32[16] {
  %t0 = bf16[16,1000]{1,0} parameter(0)
  %w = f32[16,1000]{1,0} convert(%t0)
  %z = f32[] constant(0)
  ROOT %r = f32[16]{0} reduce(%w, %z), dimensions={1}, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (logits: bf16[16,1000], at: s32[16,2]) -> (f32[16,1], f32[16]) {
  %logits = bf16[16,1000]{1,0} parameter(0)
  %at = s32[16,2]{1,0} parameter(1)
  %p = f32[16,1]{1,0} fusion(%logits, %at), kind=kLoop, calls=%pick
  %t = f32[16]{0} fusion(%logits), kind=kInput, calls=%total
  ROOT %r = (f32[16,1]{1,0}, f32[16]{0}) tuple(%p, %t)
}
"""


def test_a_gather_reads_the_elements_it_gathers():
    """A fusion that gathers one logit a row (through a convert) reads those elements, not the logits; a reduction
    over them reads them whole."""
    kinds = kernel_traffic(GATHERED)["kinds"]
    gathered = 16 * 2 + 16 * 2 * 4 + 16 * 4  # the 16 bf16 elements, the indices, the float32 result
    assert kinds["elementwise"] == {"launches": 2, "bytes": gathered + 16 * 1000 * 2 + 16 * 4}


# A fused q, k, v projection's output [8, 48] whose k part [8, 16] a fusion slices and writes into its stack in place.
SLICED_UPDATE = """HloModule s

%dus_k (q0: f32[4,8,16], q1: f32[8,48], q2: s32[]) -> f32[4,8,16] {
  %q0 = f32[4,8,16]{2,1,0} parameter(0)
  %q1 = f32[8,48]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %k = f32[8,16]{1,0} slice(%q1), slice={[0:8], [16:32]}
  %u = f32[1,8,16]{2,1,0} bitcast(%k)
  ROOT %r = f32[4,8,16]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %z, %z)
}

ENTRY %main (acc: f32[4,8,16], qkv: f32[8,48], i: s32[]) -> f32[4,8,16] {
  %acc = f32[4,8,16]{2,1,0} parameter(0)
  %qkv = f32[8,48]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %s = f32[4,8,16]{2,1,0} fusion(%acc, %qkv, %i), kind=kLoop, calls=%dus_k
}
"""


def test_a_stack_write_of_a_slice_reads_the_slice():
    """A stack write whose update a fusion slices out of a larger operand reads that slice, not the operand."""
    assert kernel_traffic(SLICED_UPDATE)["kinds"]["stack write"] == {"launches": 1, "bytes": 2 * 4 * 8 * 16}


@pytest.mark.gpu_compile
def test_a_scanned_step_fills_and_copies_stacks_an_unrolled_one_does_not():
    """A bf16 LLaMA step without remat planned for an H100: scanned, its saved activations go through [layers, ...]
    stacks (zero fills, in-place writes, slices back out); unrolled, none of that, and fewer bytes in all for the same
    matmul launches."""
    from tests.test_gpu_plan import _compiled_plan

    overrides = {"hidden_size": 128, "intermediate_size": 352, "num_heads": 4, "num_kv_heads": 2, "num_layers": 3}
    plans = {scan: _compiled_plan("gpu:h100", "1,1,1", remat="none", loss_implementation=None,
                                  config_overrides=dict(overrides, scan_layers=scan))[0]["traffic"]
             for scan in (True, False)}
    scanned, unrolled = plans[True]["kinds"], plans[False]["kinds"]
    assert scanned["fill"]["bytes"] > 0 and scanned["stack write"]["launches"] > 0
    assert scanned["stack read"]["launches"] > 0
    assert unrolled["stack write"]["launches"] == unrolled["stack read"]["launches"] == 0
    assert scanned["matmul"]["launches"] == unrolled["matmul"]["launches"]
    assert plans[False]["bytes"] < plans[True]["bytes"]


@pytest.mark.gpu_compile
def test_the_gpu_flags_leave_a_scanned_stack_unfilled():
    """plan_memory.py compiles with engine.compiler's GPU flags, as a run on the GPU does: a scanned LLaMA step's
    [layers, ...] stacks start uninitialised (AllocateBuffer), so the plan moves exactly their zero fills less than
    with XLA's default, which a user's XLA_FLAGS entry restores (configure never overrides one); every other launch
    is the same."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_gpu_plan import _no_cuda_plugin

    why = _no_cuda_plugin()
    if why:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "scripts/plan_memory.py", "--target=gpu:h100", "--model=llama", "--model_config=tiny",
           "--seq_len=128", "--per_device_batch_size=2", "--remat=none"]
    plans = {}
    filled_flag = f"--{compiler.FILL_ELIMINATION}=false"
    for flag in ("", filled_flag):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flag, PYTHONPATH=root)
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        plans[flag] = json.loads(out.stdout.strip().splitlines()[-1])["traffic"]
    unfilled, filled = plans[""], plans[filled_flag]
    saved = filled["kinds"]["fill"]["bytes"] - unfilled["kinds"]["fill"]["bytes"]
    assert saved > filled["kinds"]["fill"]["bytes"] / 2 and unfilled["kinds"]["stack write"]["launches"] > 0
    assert unfilled["bytes"] == filled["bytes"] - saved
    for kind in ("matmul", "kernel", "stack write", "stack read", "copy", "elementwise"):
        assert unfilled["kinds"][kind] == filled["kinds"][kind], kind


# cuBLAS as XLA:GPU runs it with its Triton GEMMs off: a top-level call (its result beside a scratch workspace) and, in
# a loop body, XLA's dynamic-slice fusion (a call reading its weight's slice out of a stack and writing its result
# into another in place), beside an elementwise fusion that slices a stack through a bitcast.
CUBLAS = """HloModule c

%dsf (p0: f32[4,32,16], p1: s32[], p2: f32[8,32], p3: f32[4,8,16]) -> (f32[4,8,16], s8[1024]) {
  %p0 = f32[4,32,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[8,32]{1,0} parameter(2)
  %p3 = f32[4,8,16]{2,1,0} parameter(3)
  %z = s32[] constant(0)
  %ds = f32[1,32,16]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,32,16}
  %w = f32[32,16]{1,0} bitcast(%ds)
  %cc = (f32[8,16]{1,0}, s8[1024]{0}) custom-call(%p2, %w), custom_call_target="__cublas$lt$matmul"
  %y = f32[8,16]{1,0} get-tuple-element(%cc), index=0
  %y3 = f32[1,8,16]{2,1,0} bitcast(%y)
  %u = f32[4,8,16]{2,1,0} dynamic-update-slice(%p3, %y3, %p1, %z, %z)
  %ws = s8[1024]{0} get-tuple-element(%cc), index=1
  ROOT %t = (f32[4,8,16]{2,1,0}, s8[1024]{0}) tuple(%u, %ws)
}

%scale (e0: f32[4,32,16], e1: s32[]) -> f32[32,16] {
  %e0 = f32[4,32,16]{2,1,0} parameter(0)
  %e1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %flat = f32[4,512]{1,0} bitcast(%e0)
  %s = f32[1,512]{1,0} dynamic-slice(%flat, %e1, %z), dynamic_slice_sizes={1,512}
  %b = f32[32,16]{1,0} bitcast(%s)
  ROOT %m = f32[32,16]{1,0} multiply(%b, %b)
}

ENTRY %main (x: f32[8,32], ws: f32[4,32,16], acc: f32[4,8,16], i: s32[], v: f32[32,16]) -> (f32[4,8,16], f32[32,16]) {
  %x = f32[8,32]{1,0} parameter(0)
  %ws = f32[4,32,16]{2,1,0} parameter(1)
  %acc = f32[4,8,16]{2,1,0} parameter(2)
  %i = s32[] parameter(3)
  %v = f32[32,16]{1,0} parameter(4)
  %g = (f32[8,16]{1,0}, s8[1024]{0}) custom-call(%x, %v), custom_call_target="__cublas$lt$matmul"
  %f = (f32[4,8,16]{2,1,0}, s8[1024]{0}) fusion(%ws, %i, %x, %acc), kind=kCustom, calls=%dsf
  %out = f32[4,8,16]{2,1,0} get-tuple-element(%f), index=0
  %e = f32[32,16]{1,0} fusion(%ws, %i), kind=kLoop, calls=%scale
  ROOT %r = (f32[4,8,16]{2,1,0}, f32[32,16]{1,0}) tuple(%out, %e)
}
"""


def test_cublas_calls_count_without_their_workspace_and_read_and_write_stack_slices_in_place():
    kinds = kernel_traffic(CUBLAS)["kinds"]
    # The top-level call: x and v read, [8, 16] written (not its 1 KiB workspace). The fused one: x, the weight's
    # [32, 16] slice and the index read, only its [8, 16] update written into the [4, 8, 16] stack.
    top, fused = 4 * (8 * 32 + 32 * 16 + 8 * 16), 4 * (8 * 32 + 32 * 16 + 8 * 16) + 4
    assert kinds["matmul"] == {"launches": 2, "bytes": top + fused}
    # A slice of the stack read through a bitcast: [512] of it (and the index), not the whole [4, 32, 16].
    assert kinds["elementwise"] == {"launches": 1, "bytes": 4 * 512 + 4 + 4 * 32 * 16}
    assert kinds["stack write"]["launches"] == kinds["stack read"]["launches"] == 0


@pytest.mark.gpu_compile
@pytest.mark.parametrize("n, d, v", [(4096, 1024, 32000), (8192, 2048, 32000)])
def test_the_fused_loss_moves_a_tenth_more_than_plain_logits_and_holds_less(n, d, v):
    """`kernels.linear_cross_entropy` (Triton) and plain bf16 logits with `lm.cross_entropy`, loss and both
    gradients compiled for an H200 (n tokens, width d, vocabulary v; issue 44 timed the second shape): the kernel's
    backward recomputes the logits (x and w read again) and adds each vocabulary chunk's share of d x to the float32
    sum in its epilogue, in place, over chunks sized to that sum (it once summed 32 chunks outside the kernel: 2.9x
    plain's bytes at the second shape); 1.08-1.09x plain's bytes here. `-s` prints the figures kernels/README.md
    quotes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import engine.plan
    import kernels
    from engine.tasks import lm

    mesh = Mesh(engine.plan.target_devices("gpu:h200")[:1], ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    args = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=whole),
            jax.ShapeDtypeStruct((d, v), jnp.bfloat16, sharding=whole),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=whole))
    losses = {"fused": lambda x, w, y: jnp.mean(kernels.linear_cross_entropy(x, w, y, implementation="triton")),
              "plain": lambda x, w, y: jnp.mean(lm.cross_entropy(x @ w, y))}
    out = {}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for name, loss in losses.items():
            compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile()
            out[name] = (kernel_traffic(compiled.as_text()), compiled.memory_analysis().temp_size_in_bytes)
    (fused, fused_temp), (plain, plain_temp) = out["fused"], out["plain"]
    for name, (t, temp) in out.items():
        print(f"{name} {n} x {d} x {v}: {t['launches']} launches, {t['bytes'] / 1e9:.2f} GB, temporaries "
              f"{temp / 1e9:.3f} GB")
    assert fused["bytes"] <= 1.1 * plain["bytes"], (fused["bytes"], plain["bytes"])
    assert fused_temp < 0.5 * plain_temp and fused["launches"] < 150, (fused_temp, plain_temp, fused["launches"])
