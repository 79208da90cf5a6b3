"""engine.plan and scripts/plan_memory.py: ahead-of-time memory and communication of the real train step."""
import json
import os
import subprocess
import sys

import jax
import pytest

from engine import compiler, plan
from engine.tasks import planning
from tests.test_distributed import ROOT
from tests.xla_flags import FAST_COMPILE

TINY = dict(model="llama", model_config="tiny", num_devices=8, per_device_batch_size=1, seq_len=64)


def test_zero3_plan_matches_the_formulas():
    """1x8x1, bf16 compute: state is 16 bytes per sharded parameter; ZeRO-3 traffic is bf16 gathers (forward, and
    again for the remat'd layers in the backward pass) plus fp32 reduce-scatters, each x (N-1)/N. The embedding table
    is never gathered: its lookup moves the group's ids and looked-up vectors instead, nor is the head with the fused
    head + loss ('auto': its vocabulary-parallel form)."""
    r = planning.plan(mesh="1,8,1", zero_stage=0, hbm_gb=1.0, loss_implementation="auto", **{**TINY, "seq_len": 16})
    n, psi = 8, r["params"]
    assert psi == 90432
    b = r["bytes"]
    assert b["total"] == b["arguments"] + b["outputs"] - b["aliased"] + b["temporaries"]
    assert b["aliased"] > 0.9 * b["arguments"]  # params and optimizer state are donated
    assert r["fits"] is True
    split = psi - (64 + 2 * 2 * 64)  # every matrix is split over fsdp; the norm scales (final + 2 per layer) are not
    layers = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # gathered again in the backward pass (remat)
    # 16 tokens per device: at most the 128 / 8 table rows and head columns a device holds, so the lookup and the
    # head + loss are vocab-parallel: neither the table nor the head is gathered.
    table = head = 128 * 64
    rows = n * 16  # the group's tokens
    vectors = rows * 64  # the group's looked-up embeddings, and the group's hidden states at the head
    c = r["collective_bytes"]
    # lookup: int32 ids, the vectors' cotangent (arrives in bf16); head: bf16 hidden states, int32 labels, fp32 d loss
    lookup, loss = rows * 4 + vectors * 2, vectors * 2 + rows * 4 + rows * 4
    assert c["all-gather"] == ((split - table - head + layers) * 2 + lookup + loss) * (n - 1) // n
    # fp32: the weights' gradients, the looked-up vectors, the hidden states' gradient
    assert c["reduce-scatter"] == ((split - table - head) * 4 + vectors * 4 + vectors * 4) * (n - 1) // n
    assert c["all-to-all"] == c["collective-permute"] == 0


def test_embedding_table_is_gathered_when_the_lookups_outnumber_its_rows():
    """64 tokens per device against 16 table rows per device: gathering the table moves less than the vectors. The
    plan's default kernels are a CPU run's (plain logits, whose head is gathered too, and the 'xla' attention)."""
    r = planning.plan(mesh="1,8,1", zero_stage=0, **TINY)
    assert (r["loss_implementation"], r["attention_implementation"]) == ("plain", "xla")
    split, layers, n = 90432 - (64 + 2 * 2 * 64), 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128), 8
    want = (split + layers) * 2 * (n - 1) // n
    # JAX 0.10's CPU compiler gathers each layer weight twice (forward, remat'd backward); 0.11's gathers one MLP
    # matrix a third time. Never less than the formula, never more than that one matrix over it.
    assert want <= r["collective_bytes"]["all-gather"] <= want + 64 * 128 * 2 * (n - 1) // n
    assert r["collective_bytes"]["reduce-scatter"] == split * 4 * (n - 1) // n


def test_bad_mesh_and_budget_are_reported():
    with pytest.raises(ValueError, match=r"mesh=2,2,1 has 4 devices; expected num_devices=8"):
        planning.plan(mesh="2,2,1", **TINY)
    with pytest.raises(ValueError, match=r"mesh='1,x,1'; expected three or four positive sizes"):
        planning.plan(mesh="1,x,1", **TINY)
    with pytest.raises(ValueError, match=r"diloco_fragments=2, diloco_outer_dtype='float32'; expected "
                                         r"diloco_inner_steps > 0"):
        planning.plan(mesh="8,1,1", diloco_fragments=2, **TINY)
    r = planning.plan(mesh="8,1,1", zero_stage=1, hbm_gb=1e-4, **TINY)
    assert r["fits"] is False  # a result, not a crash


def test_mesh_shapes_and_collective_parsing():
    assert sorted(plan.mesh_shapes(4)) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
    # a mixture of 2 experts: also every layout with expert=2 (expert=4 does not divide its experts)
    assert sorted(s for s in plan.mesh_shapes(4, experts=2) if len(s) == 4) == [(1, 1, 2, 2), (1, 2, 1, 2),
                                                                                (2, 1, 1, 2)]
    hlo = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[8]{0} all-gather(%x), replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ag)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = bf16[4]{0} all-reduce(%a), replica_groups=[1,4]<=[4], to_apply=%add
  ROOT %rs = f32[1]{0} reduce-scatter(%b), replica_groups={}, dimensions={0}, to_apply=%add
  %a2a = f32[6]{0} all-to-all(%c), replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, dimensions={0}
  %cp = f32[4]{0} all-gather(%d), replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0':(1)2}, dimensions={0}
}
"""
    got = plan.collective_bytes(hlo, num_devices=4)
    assert got["all-gather"] == 3 * 8 * 4 // 2 + 16 // 2  # 3 trips x 32 bytes x (2-1)/2; a sub-axis of size 2
    assert got["all-reduce"] == int(4 * 2 * 2 * 3 / 4)
    assert got["reduce-scatter"] == int(1 * 4 * 4 * 3 / 4)
    assert got["all-to-all"] == 24 // 2  # groups over axis_1 (2 devices), not all 4
    # XLA:GPU's async collectives: ((operands), results) start types, counted at their results as the sync ones.
    gpu = """HloModule m

ENTRY %main (a: f32[4]) -> f32[4] {
  %rs = ((f32[8,4]{1,0}), f32[2,4]{1,0}) reduce-scatter-start(%a), replica_groups=[1,4]<=[4], dimensions={0}
  %ar = ((bf16[16]{0}, f32[2]{0}), bf16[16]{0}, f32[2]{0}) all-reduce-start(%b, %c), replica_groups=[1,4]<=[4]
  %ag = ((bf16[2]{0}, bf16[1]{0}), (bf16[8]{0}, bf16[4]{0})) all-gather-start(%d, %e), replica_groups=[1,4]<=[4]
  ROOT %a2a = ((f32[8]{0}), f32[8]{0}) all-to-all-start(%f), replica_groups=[1,4]<=[4], dimensions={0}
}
"""
    got = plan.collective_bytes(gpu, num_devices=4)
    assert got["reduce-scatter"] == 8 * 4 * 4 * 3 // 4  # its input x (n-1)/n, not input and result n times
    assert got["all-reduce"] == (16 * 2 + 2 * 4) * 2 * 3 // 4
    assert got["all-gather"] == (8 + 4) * 2 * 3 // 4 and got["all-to-all"] == 8 * 4 * 3 // 4


def test_replica_groups_in_every_spelling_and_the_bytes_across_hosts():
    """XLA's four spellings of a collective's groups read as device ids; with the devices' hosts only the collectives
    whose groups span hosts count; the ranking puts the least cross-host traffic first, before all bytes sent."""
    groups = lambda text: [list(map(int, g)) for g in plan.replica_groups(f"x, replica_groups={text}, y", 8)]  # noqa
    assert groups("{{0,2},{1,3}}") == [[0, 2], [1, 3]]
    assert groups("[2,4]<=[4,2]T(1,0)") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups("[4,2]<=[8]") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1':(1)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # The mesh's devices in the order of an iota: [0, 2, 4, 6, 1, 3, 5, 7] as [2, 4].
    assert groups("mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}") == [[0, 1], [2, 3], [4, 5],
                                                                                          [6, 7]]
    assert groups("{}") == [list(range(8))]
    hlo = """HloModule m

ENTRY %main (a: f32[4]) -> f32[4] {
  %ag = f32[8]{0} all-gather(%x), replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %ar = f32[4]{0} all-reduce(%a), replica_groups=[1,4]<=[4], to_apply=%add
}
"""
    every = plan.collective_bytes(hlo, num_devices=4)
    across = plan.collective_bytes(hlo, num_devices=4, hosts=[0, 0, 1, 1])
    assert every["all-gather"] == 16 and across["all-gather"] == 0  # within each host
    assert across["all-reduce"] == every["all-reduce"] == 24
    assert plan.hosts_of(jax.devices()[:2]) == [0, 0]
    rows = [{"mesh": [2, 1, 1], "collective_bytes_total": 10, "cross_host_bytes": 8, "bytes": {"total": 1}},
            {"mesh": [1, 1, 2], "collective_bytes_total": 30, "cross_host_bytes": 2, "bytes": {"total": 1}}]
    assert [r["mesh"] for r in plan.rank_layouts(rows)] == [[1, 1, 2], [2, 1, 1]]


def test_groups_of_a_compiled_step_are_its_mesh_axes():
    """In the jit step on data 4 x fsdp 2 (fsdp the inner axis: devices 2i, 2i+1), XLA spells its groups by mesh
    axes over a permuted device order too; every all-gather (ZeRO-3's weights) reads as the fsdp pairs and every
    collective's groups cover the 8 devices once."""
    import optax

    import engine
    from tests import trainer_task as task

    mesh = engine.make_mesh(data=4, fsdp=2)
    trainer = engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn,
                             params=jax.eval_shape(task.init_params), optimizer=optax.adam(1e-2),
                             parallelism=engine.Parallelism(step="jit"))
    rows = task.collate_fn(task.make_examples(8))
    hlo = plan.compile_step(trainer, {k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in rows.items()})
    lines = [line for line in hlo.as_text().splitlines() if "replica_groups=" in line]
    assert any("device_ids=" in line for line in lines)
    for line in lines:
        groups = [sorted(map(int, g)) for g in plan.replica_groups(line, 8)]
        assert sorted(i for g in groups for i in g) == list(range(8)), line
        if " all-gather(" in line or "all-gather-start(" in line:
            assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]], line


def test_compiler_flags_only_for_their_platform(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert compiler.configure("cpu") == []
    added = compiler.configure("gpu")
    assert "--xla_gpu_enable_pipelined_all_gather=true" in added
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in os.environ["XLA_FLAGS"]  # the user's choice stays
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in os.environ["XLA_FLAGS"]
    assert compiler.configure("gpu") == []  # idempotent
    assert "--xla_tpu_enable_latency_hiding_scheduler=true" in " ".join(compiler.configure("tpu"))
    with pytest.raises(ValueError, match=r"platform='metal'; expected one of"):
        compiler.configure("metal")



class _Config:
    """jax.config's two settings `compiler.use_compilation_cache` reads and writes, without touching the real one
    (JAX opens its cache once per process: the suite's is conftest's)."""

    def __init__(self, cache_dir):
        self.jax_compilation_cache_dir, self.jax_enable_compilation_cache = cache_dir, True

    def update(self, name, value):
        setattr(self, name, value)


def test_compilation_cache_directory_default_and_off(monkeypatch, tmp_path):
    config = _Config(None)
    monkeypatch.setattr(compiler, "jax", type("jax", (), {"config": config}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiler.use_compilation_cache() == str(tmp_path / "xdg" / "redline" / "jax")  # unset: the user's cache
    assert os.path.isdir(config.jax_compilation_cache_dir) and config.jax_enable_compilation_cache
    config.jax_compilation_cache_dir = str(tmp_path / "env")  # JAX_COMPILATION_CACHE_DIR's, as JAX reads it
    assert compiler.use_compilation_cache() == str(tmp_path / "env")
    assert compiler.use_compilation_cache(str(tmp_path / "given")) == str(tmp_path / "given")
    assert compiler.use_compilation_cache("gs://bucket/cache") == "gs://bucket/cache"  # a URL: JAX's to open
    assert compiler.use_compilation_cache("") is None and not config.jax_enable_compilation_cache
    assert compiler.use_compilation_cache() is None  # off stays off (JAX_ENABLE_COMPILATION_CACHE=false) unless given
    assert compiler.use_compilation_cache(str(tmp_path / "given")) and config.jax_enable_compilation_cache
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"cannot create .*file/cache \(Not a directory\); expected a directory"):
        compiler.use_compilation_cache(str(tmp_path / "file" / "cache"))
    # The default directory that cannot be made (a read-only or odd home) leaves the run without the cache.
    config.jax_compilation_cache_dir = None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert compiler.use_compilation_cache() is None and not config.jax_enable_compilation_cache

_START_PROBE = """
import json, os, runpy, sys
import engine, models
from engine import compiler
from engine.tasks import cli, planning
from engine.tasks.rlhf import ppo

def probe(platform=None):  # what cli.run finds when it configures the flags: JAX's backend must not be up yet
    print(json.dumps(compiler.backend_started()), flush=True)
    os._exit(0)

compiler.configure = probe
for script in sys.argv[1:]:
    if os.fork() == 0:
        sys.argv = [script]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        os._exit(3)  # main ran without configuring the flags
    assert os.waitstatus_to_exitcode(os.wait()[1]) == 0, script
"""


def test_every_script_configures_the_compiler_flags_before_jax_starts():
    """`cli.run` calls `engine.compiler.configure()` before the script's `main`; XLA and libtpu read the flags once,
    when JAX starts its backend, so nothing a script does at import (its flags, its module-level code) may start it
    first. Each script runs (forked from one warm interpreter) up to that call."""
    scripts = sorted(os.path.join(ROOT, "scripts", f) for f in os.listdir(os.path.join(ROOT, "scripts"))
                     if f.endswith(".py") and "cli.run(main)" in open(os.path.join(ROOT, "scripts", f)).read())
    assert len(scripts) >= 10
    out = subprocess.run([sys.executable, "-c", _START_PROBE, *scripts], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["false"] * len(scripts), out.stdout


def test_installed_xla_knows_every_gpu_flag():
    """XLA aborts at start-up on an unknown XLA_FLAGS entry, and it parses the GPU flags on any platform: a flag an
    XLA upgrade removed would fail here, not on the first GPU job. (A bogus flag does abort this way.)"""
    flags = " ".join(f"--{name}={value}" for name, value in compiler.GPU_FLAGS.items())
    code = "import jax; print(jax.devices()[0].platform)"
    for extra, ok in (("", True), (" --xla_gpu_no_such_flag=true", False)):
        env = dict(os.environ, XLA_FLAGS=flags + extra, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert (out.returncode == 0 and out.stdout.strip() == "cpu") == ok, out.stderr[-1000:]
        assert ok or "Unknown flag" in out.stderr


def test_script_prints_one_json_line_of_the_run_defaults_and_rejects_a_bad_mesh():
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=FAST_COMPILE)  # the script adds the device count
    cmd = [sys.executable, "scripts/plan_memory.py", "--model=llama", "--model_config=tiny", "--num_devices=4",
           "--seq_len=32"]
    out = subprocess.run(cmd + ["--mesh=1,2,2", "--zero_stage=0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["mesh"] == [1, 2, 2] and result["bytes"]["total"] > 0
    # by default the kernels a run on the target takes (here a CPU's, as train_lm.py's defaults: plain logits)
    assert (result["loss_implementation"], result["attention_implementation"], result["packed"]) == (
        "plain", "xla", True)
    bad = subprocess.run(cmd + ["--mesh=3,1,1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "mesh=3,1,1 has 3 devices; expected num_devices=4" in bad.stderr


@pytest.mark.slow
def test_zero1_on_a_model_split_mesh_adds_only_the_weight_regather():
    """ZeRO-1 on 2x1x4: beyond ZeRO-0's traffic, all-gathers move at most one fp32 copy of the parameters (the
    updated shards gathered back): 66.6 KB here against a bound of 180.9 KB. A data-axis reduce-scatter left to the
    partitioner on `model`-split gradients gathered their whole `model` dimension first (201.7 KB here; 2.9 GB per
    MLP stack at LLaMA-7B on 2x2x2)."""
    zero0, zero1 = (planning.plan(mesh="2,1,4", zero_stage=z, **TINY) for z in (0, 1))
    extra = zero1["collective_bytes"]["all-gather"] - zero0["collective_bytes"]["all-gather"]
    assert 0 < extra <= 4 * zero1["params"] * (2 - 1) // 2, extra


@pytest.mark.slow  # CI time; the LM plans above
def test_rlhf_plans_hold_the_critic_and_its_state_for_ppo_only():
    """The PPO update step takes actor and critic (a RewardModel of the same backbone) with their AdamW moments,
    GRPO's the actor's alone: on one device the arguments differ by exactly the critic's parameters x 3 (weights, two
    moments; fp32) plus PPO's one more float row array (old_values and returns against ref_log_probs); GRPO trains
    the language model's parameters. The score head trains with LoRA."""
    one = dict(TINY, num_devices=1, mesh="1,1,1")
    ppo, grpo = (planning.plan(rlhf=r, **one) for r in ("ppo", "grpo"))
    critic = ppo["trained_params"] - grpo["trained_params"]
    assert grpo["trained_params"] == grpo["params"] == 90432 and critic == 90432 + 64  # backbone + head [64, 1]
    assert ppo["bytes"]["arguments"] - grpo["bytes"]["arguments"] == 3 * 4 * critic + 4 * 64
    assert ppo["bytes"]["temporaries"] > grpo["bytes"]["temporaries"]  # the critic's forward and backward too
    lora = planning.plan(rlhf="ppo", lora_rank=2, **one)
    assert lora["trained_params"] == 2 * planning.plan(rlhf="grpo", lora_rank=2, **one)["trained_params"] + 64
    with pytest.raises(ValueError, match="rlhf='dpo'; expected None, 'ppo' or 'grpo'"):
        planning.plan(rlhf="dpo", **one)


@pytest.mark.slow
def test_sweep_ranks_pipeline_plans_beside_the_others():
    """With max_stages, the sweep adds every stage count that divides the devices, with per_device_batch_size x
    stages rows per data position (the batch of data parallelism over the same devices). On 2
    devices, a 2-stage pipeline of the 2-layer tiny model holds one layer per device: less than replicated data
    parallelism, and its stages exchange activations (collective-permutes), not weights."""
    results = planning.sweep(**{**TINY, "num_devices": 2, "seq_len": 16}, max_stages=2)
    by_layout = {(tuple(r["mesh"]), r["stages"], r["zero_stage"]): r for r in results}
    assert not any("error" in r for r in results) and len(results) == 6
    piped, replicated = by_layout[((1, 1, 1), 2, 0)], by_layout[((2, 1, 1), 1, 0)]
    assert piped["per_device_batch_size"] == 2 and piped["idle_share"] == pytest.approx(1 / 3)
    assert piped["bytes"]["arguments"] < replicated["bytes"]["arguments"]
    assert piped["collective_bytes"]["collective-permute"] > 0 and piped["collective_bytes"]["reduce-scatter"] == 0
    table = plan.format_table(results).splitlines()
    assert "stages" in table[0] and len(table) == 7


@pytest.mark.slow
def test_an_interleaved_pipeline_plan_reports_its_schedules_idle_share():
    """A 2-stage pipeline of the tiny model cut to 4 layers, 2 micro-batches, with 2 virtual stages per device: the
    plan compiles it and reports (S - 1) / (V M + S - 1) = 1/5 idle, against GPipe's 1/3, and gathers no weight."""
    common = {**TINY, "num_devices": 2, "seq_len": 16, "mesh": "1,1,1", "stages": 2, "per_device_batch_size": 2,
              "pipeline_microbatches": 2, "step": "jit", "config_overrides": {"num_layers": 4}}
    gpipe, interleaved = (planning.plan(**common, pipeline_virtual_stages=v) for v in (1, 2))
    assert gpipe["idle_share"] == pytest.approx(1 / 3) and interleaved["idle_share"] == pytest.approx(1 / 5)
    assert interleaved["pipeline_virtual_stages"] == 2 and interleaved["collective_bytes"]["collective-permute"] > 0
    # Its stack stored [V, L / V, ...] with `stage` over the second dim: no weight moves between stages (held [L, ...],
    # the step re-laid the stage's weights out, 296 KB of all-to-all), as with GPipe.
    assert interleaved["collective_bytes"]["all-to-all"] == gpipe["collective_bytes"]["all-to-all"] == 0


def test_a_1f1b_plan_reports_its_schedules_idle_share():
    """The tiny model cut to 4 layers on 2 stages, 2 micro-batches, with pipeline_schedule='1f1b': the plan
    compiles 1F1B's step (M + 2S - 2 ticks, the first forwards only) and reports its idle share, GPipe's
    (S - 1) / (M + S - 1) = 1/3, but (2S - 2) / (M + 2S - 2) = 1/2 beside the jit step's fsdp, where its ticks run
    as one loop of both halves; the schedule given as a config override is the same plan, and given both ways with
    two values is refused."""
    common = {**TINY, "num_devices": 2, "seq_len": 16, "mesh": "1,1,1", "stages": 2, "per_device_batch_size": 2,
              "pipeline_microbatches": 2, "step": "jit", "loss_implementation": None}
    one_f_one_b = planning.plan(**common, pipeline_schedule="1f1b", config_overrides={"num_layers": 4})
    assert one_f_one_b["pipeline_schedule"] == "1f1b" and one_f_one_b["idle_share"] == pytest.approx(1 / 3)
    beside_fsdp = planning.plan(**{**common, "num_devices": 4, "mesh": "1,2,1", "per_device_batch_size": 1},
                                pipeline_schedule="1f1b", config_overrides={"num_layers": 4})
    assert beside_fsdp["idle_share"] == pytest.approx(1 / 2)
    overridden = planning.plan(**common, config_overrides={"num_layers": 4, "pipeline_schedule": "1f1b"})
    assert overridden["idle_share"] == one_f_one_b["idle_share"] and overridden["bytes"] == one_f_one_b["bytes"]
    with pytest.raises(ValueError, match=r"pipeline_virtual_stages=2 and config_overrides=\{'pipeline_virtual_"
                                         r"stages': 3\}; expected one value"):
        planning.plan(**common, pipeline_virtual_stages=2, config_overrides={"pipeline_virtual_stages": 3})


def test_config_overrides_of_the_plans_own_arguments_move_to_them():
    """--model_overrides as the training scripts take them ('scan_layers': true, 'remat', FP8 with its amax
    histories): the plan's own arguments follow them (they collided with a TypeError before), scan_layers=False
    plans the layers unrolled (the same parameters), and one given both ways with two values is refused."""
    common = {**TINY, "num_devices": 2, "seq_len": 16, "mesh": "2,1,1", "per_device_batch_size": 1, "step": "jit"}
    planned = planning.plan(**common, config_overrides={"scan_layers": True, "remat": "dots", "fp8": True,
                                                        "fp8_history": 4})
    assert planned["remat"] == "dots"
    assert planned["params"] - planning.plan(**common)["params"] == 2 * 7 * 3 * 4  # the histories: layers x 7 x 3 x 4
    unrolled = planning.plan(**common, config_overrides={"scan_layers": False})
    assert unrolled["params"] == planned["params"] - 2 * 7 * 3 * 4
    with pytest.raises(ValueError, match=r"^remat='none' and config_overrides=\{'remat': 'dots'\}; expected one"):
        planning.plan(**common, remat="none", config_overrides={"remat": "dots"})


@pytest.mark.slow
def test_a_pipeline_plan_gathers_fsdp_once_a_step_when_asked():
    """Stage 2 x fsdp 2, 4 micro-batches: with pipeline_fsdp_gather='step' (here as a config override) the plan
    reports it and its step sends under half the bytes of the per-tick gathers' outside the stages' permutes."""
    common = {**TINY, "num_devices": 4, "seq_len": 16, "mesh": "1,2,1", "stages": 2, "per_device_batch_size": 4,
              "pipeline_microbatches": 4, "step": "jit"}
    tick = planning.plan(**common, config_overrides={"num_layers": 4})
    step = planning.plan(**common, config_overrides={"num_layers": 4, "pipeline_fsdp_gather": "step"})
    assert (tick["pipeline_fsdp_gather"], step["pipeline_fsdp_gather"]) == ("tick", "step")
    weights = lambda r: r["collective_bytes_total"] - r["collective_bytes"]["collective-permute"]  # noqa: E731
    assert weights(step) < weights(tick) / 2, (step["collective_bytes"], tick["collective_bytes"])


@pytest.mark.slow
def test_diloco_plan_counts_inner_and_outer_steps_apart():
    """DiLoCo on data 4 x fsdp 2 (tiny LLaMA, 90432 parameters): the inner step's bytes are counted apart from the
    outer steps' (the same for both wire formats); each of 2 parts' fp32 outer step all-reduces its half of a device's
    replica shard over the 4 replicas, int4 sends 4 / (0.5 + 4 / 256) times less plus the padding of each leaf."""
    kwargs = dict(mesh="4,2,1", diloco_inner_steps=4, diloco_fragments=2, **TINY)
    fp32, int4 = (planning.plan(diloco_outer_dtype=d, **kwargs) for d in ("float32", "int4"))
    assert fp32["diloco"] == {"inner_steps": 4, "fragments": 2, "outer_dtype": "float32"}
    assert fp32["collective_bytes"] == int4["collective_bytes"]  # the inner step's, whatever the outer format
    local = 90432 / 2  # a device's share of a replica (the norm scales, replicated over fsdp, are < 0.5%)
    assert all(abs(b - 2 * 3 / 4 * 4 * local / 2) < 0.01 * b for b in fp32["outer_step_bytes"])
    assert sum(fp32["outer_step_bytes"]) / sum(int4["outer_step_bytes"]) > 6


def test_rank_meshes_puts_the_layouts_that_fit_first_then_the_least_communication():
    """--mesh=auto's choice on 2 devices for one global batch of 8 rows (the Trainer task's model): every
    (data, fsdp, model) is compiled and ranked by bytes sent; a layout whose Trainer cannot be built comes last with
    its error; with a budget between the two layouts' memory the one that fits comes first, whatever it sends."""
    import jax
    import optax

    import engine
    from tests import trainer_task as task

    abstract = jax.eval_shape(task.init_params)

    def make_trainer(mesh):
        if mesh.shape["model"] == 2:
            raise ValueError("model=2: no layout for this test")
        return engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn, params=abstract,
                              optimizer=optax.adam(1e-2))

    rows = task.collate_fn(task.make_examples(8))
    batch = {k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in rows.items()}
    ranked = plan.rank_meshes(make_trainer, batch, devices=jax.devices()[:2])
    assert [tuple(r["mesh"]) for r in ranked][-1] == (1, 1, 2) and "model=2" in ranked[-1]["error"]
    ok = ranked[:-1]
    assert sorted(tuple(r["mesh"]) for r in ok) == [(1, 2, 1), (2, 1, 1)] and all(r["fits"] for r in ok)
    assert ok[0]["collective_bytes_total"] <= ok[1]["collective_bytes_total"] and ok[0]["collective_bytes_total"] > 0
    data, fsdp = (next(r for r in ok if r["mesh"] == m) for m in ([2, 1, 1], [1, 2, 1]))
    assert fsdp["bytes"]["arguments"] < data["bytes"]["arguments"]  # ZeRO-3 holds half the state
    budget = (fsdp["bytes"]["total"] + data["bytes"]["total"]) // 2
    tight = plan.rank_layouts(ranked, budget)
    assert [(r["mesh"], r["fits"]) for r in tight[:2]] == [([1, 2, 1], True), ([2, 1, 1], False)]
    assert tight[-1] == ranked[-1]
    table = plan.format_table(tight).splitlines()
    assert "total MB" in table[0] and len(table) == 4 and "error: model=2" in table[-1]


def test_rank_meshes_averages_diloco_outer_steps_over_their_round():
    """Under DiLoCo (2 replicas, 4 inner steps) the inner step sends nothing over `data`; its outer step all-reduces
    the fp32 replica (2 x 1/2 x 4 bytes per parameter) once every 4 steps, which the ranking counts per step."""
    import jax
    import numpy as np
    import optax

    import engine
    from tests import trainer_task as task

    abstract = jax.eval_shape(task.init_params)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))

    def make_trainer(mesh):
        if mesh.shape["data"] != 2:
            raise ValueError("one layout")
        return engine.Trainer(mesh=mesh, collate_fn=task.collate_fn, loss_fn=task.loss_fn, params=abstract,
                              optimizer=optax.adam(1e-2), diloco=engine.DiLoCo(inner_steps=4))

    rows = task.collate_fn(task.make_examples(8))
    batch = {k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in rows.items()}
    (ranked, *_) = plan.rank_meshes(make_trainer, batch, devices=jax.devices()[:2])
    assert ranked["mesh"] == [2, 1, 1] and ranked["collective_bytes_total"] == 2 * 0.5 * 4 * n / 4
