"""kernels.default_implementation and its table (kernels/_defaults.py, kernels/defaults.json): the checked-in
entries (issue 44's H200 run) answer their own shape classes and their neighbours', on the H200 and GPUs of its
architecture; every entry carries its provenance, flash_attention(implementation=None) reads the table, and
`scripts/bench_kernels.py --write_defaults` measures, chooses the fastest and merges into a table."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import kernels
from kernels import _defaults
from kernels.attention import api, cudnn
from tests.xla_flags import cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"


def _attention(device_kind, seq_len=4096, head_dim=128, causal=True, dtype="bfloat16", **kwargs):
    return kernels.default_implementation("flash_attention", device_kind=device_kind, head_dim=head_dim,
                                          seq_len=seq_len, causal=causal, dtype=dtype, **kwargs)


def test_the_checked_in_table_answers_what_was_measured_and_its_neighbours():
    """cuDNN at 4k and 8k causal, head_dim 128, bf16, both passes, on an H200, and so on an H100 (the same
    architecture), at the buckets beside them (1025 ... 16384 tokens) and head dims 64 and 256, causal or not; plain
    XLA matmuls for the gated MLP and the loss when trained on either. Everything else: the per-backend rule."""
    for kind in (H200, H100, "NVIDIA GH200 480GB"):
        for seq_len in (1025, 2048, 2049, 4096, 5000, 8192, 16384):
            for training in (True, False):
                for head_dim, causal in ((64, True), (128, True), (256, True), (64, False), (128, False)):
                    assert _attention(kind, seq_len, head_dim, causal, training=training) == "cudnn", (kind, seq_len)
        for other in (dict(seq_len=1024), dict(seq_len=16385), dict(causal=False, seq_len=1024), dict(head_dim=32),
                      dict(head_dim=512), dict(head_dim=64, seq_len=1024), dict(dtype="float16"),
                      dict(dtype=jnp.float32), dict(segments=True)):
            assert _attention(kind, **other) == "triton", (kind, other)
        for op in ("gated_mlp", "linear_cross_entropy"):
            assert kernels.default_implementation(op, device_kind=kind, dtype=jnp.bfloat16) == "plain"
            assert kernels.default_implementation(op, device_kind=kind, dtype="bfloat16", training=False) == "triton"
    for kind, rule in (("NVIDIA A100-SXM4-80GB", "triton"), ("NVIDIA A10", "triton"), ("TPU v5p", "mosaic_tpu"),
                       ("cpu", "xla")):
        assert _attention(kind) == rule, kind
        assert kernels.default_implementation("linear_cross_entropy", device_kind=kind, dtype="bfloat16") == rule
    # A real v5e (scripts/tpu_check.sh bench): the Mosaic attention at every class it timed, and their neighbours;
    # plain XLA matmuls for the gated MLP and the trained loss, the fused loss for its forward alone.
    v5e = "TPU v5 lite"
    for seq_len, head_dim, causal, segments in ((4096, 128, True, True), (16384, 64, False, False),
                                                (2048, 128, True, False), (32768, 64, True, True)):
        assert _attention(v5e, seq_len, head_dim, causal, segments=segments) == "mosaic_tpu", (seq_len, head_dim)
    for op, trained, inference in (("gated_mlp", "plain", "plain"), ("linear_cross_entropy", "plain", "mosaic_tpu")):
        assert kernels.default_implementation(op, device_kind=v5e, dtype="bfloat16") == trained
        assert kernels.default_implementation(op, device_kind=v5e, dtype="bfloat16", training=False) == inference
    assert kernels.default_implementation("gated_mlp", dtype="bfloat16") == "xla"  # this CPU: the per-backend rule


def test_a_class_without_its_own_entry_takes_the_nearest_measured_one(tmp_path, caplog):
    """The kind's own entry first, then one of its architecture's at the same class, then the length buckets beside
    it (shorter first, the kind's own before its architecture's), then a head dim half or twice its own, then both
    steps; never two buckets away, another architecture or a kind that is no known GPU."""
    caplog.set_level("INFO")
    caplog.set_level("INFO", logger="absl")  # whatever verbosity a test before this one left absl at
    _defaults._note_neighbour.cache_clear()  # noqa: SLF001 - logged once per class: this test's classes afresh
    path = str(tmp_path / "table.json")
    _defaults.merge_table(path, [_entry(H200, 1024, {"triton": 1.0, "cudnn": 2.0}),
                                 _entry(H100, 1024, {"triton": 2.0, "cudnn": 1.0}),
                                 _entry(H200, 4096, {"triton": 2.0, "mosaic_gpu": 1.0}),
                                 _entry("NVIDIA A100-SXM4-80GB", 256, {"triton": 2.0, "cudnn": 1.0}),
                                 _entry("TPU v5p", 256, {"mosaic_tpu": 2.0, "xla": 1.0})])
    look = lambda kind, seq_len: _attention(kind, seq_len, 16, dtype="float32", table=path)  # noqa: E731
    assert look(H200, 1024) == "triton" and look(H100, 1024) == "cudnn"  # each kind's own
    assert look("NVIDIA H100 PCIe", 1024) == "cudnn"  # the architecture's others, by name: H100 80GB HBM3 < H200
    assert look(H200, 2048) == "triton" and look(H100, 2048) == "cudnn"  # buckets 1024 and 4096: shorter, own first
    assert look(H100, 4096) == "mosaic_gpu" and look(H100, 8192) == "mosaic_gpu"  # H200's 4096, then its neighbour
    assert look("NVIDIA A100-SXM4-80GB", 1024) == "triton"  # its 256 two buckets away, the H200's another arch
    head = lambda kind, seq_len, head_dim: _attention(kind, seq_len, head_dim, dtype="float32", table=path)  # noqa
    assert head(H200, 1024, 8) == "triton" and head(H100, 1024, 32) == "cudnn"  # a head dim away: the kind's own
    assert head(H100, 2048, 32) == "cudnn" and head(H100, 8192, 32) == "mosaic_gpu"  # a bucket and a head dim away
    assert head(H100, 1024, 64) == "triton" and head(H100, 256, 32) == "triton"  # two steps in one, or three
    assert _defaults.measured_entry("flash_attention", H200, _defaults.shape_class(
        "flash_attention", head_dim=16, seq_len=16384, causal=True, dtype="float32"), table=path) is None
    assert look("NVIDIA A100-SXM4-80GB", 512) == "cudnn" and look("NVIDIA A10", 256) == "triton"
    assert look("TPU v5p", 512) == "xla" and look("TPU v5 lite", 256) == "mosaic_tpu"
    full = lambda kind, seq_len, **kw: _attention(kind, seq_len, 16, False, dtype="float32", table=path, **kw)  # noqa
    assert full(H200, 1024) == "triton" and full(H100, 8192) == "mosaic_gpu"  # causal's answers, steps and kinds alike
    _defaults.merge_table(path, [_entry(H100, 2048, {"triton": 1.0, "cudnn": 2.0}, causal=False)])
    assert full(H100, 2048) == full(H100, 4096) == "triton"  # the masking's own entries before the other's
    assert look(H100, 2048) == "cudnn"  # ... its neighbours (H100's 1024) before the other masking's own class
    assert full(H100, 1024, segments=True) == "triton" == full(H100, 1024, training=False)  # not H100's causal cudnn
    said = [r.getMessage() for r in caplog.records if "as measured on" in r.getMessage()]
    assert any(m.startswith("kernels: flash_attention on NVIDIA H100 PCIe, class ('float32', 16, True, 1024, False, "
                            "'fwd+bwd'): 'cudnn', as measured on NVIDIA H100 80GB HBM3") for m in said), said


def test_every_entry_states_its_measurement():
    entries = _defaults.read_table()
    assert {(e["op"], e["device_kind"]) for e in entries} == {
        (op, kind) for op in ("flash_attention", "gated_mlp", "linear_cross_entropy") for kind in (H200, "TPU v5 lite")}
    for e in entries:
        assert e["choice"] == min(e["times"], key=e["times"].get) and len(e["times"]) >= 2, e
        assert all(e.get(field) for field in ("date", "jax", "command", "shape", "unit", "source")), e
        assert ("issue 44" if e["device_kind"] == H200 else "tpu_check.sh") in e["source"]


@pytest.mark.parametrize("op, shape, match", [
    ("attention", dict(dtype="bfloat16"), "op='attention'; expected one of"),
    ("gated_mlp", {}, r"gated_mlp shape arguments \[\]; expected \['dtype'\]"),
    ("flash_attention", dict(dtype="bfloat16", head_dim=128, causal=True), r"expected \['head_dim', 'seq_len'"),
    ("flash_attention", dict(dtype="bfloat16", head_dim=128, causal=1, seq_len=64), "causal=1; expected a bool"),
    ("flash_attention", dict(dtype="bfloat16", head_dim=128, causal=True, seq_len=0), "seq_len=0; expected a pos"),
    ("gated_mlp", dict(dtype="bfloat16", training="yes"), "training='yes'; expected a bool"),
    ("flash_attention", dict(dtype="bfloat16", head_dim=128, causal=True, seq_len=64, segments=None),
     "segments=None; expected a bool"),
    ("gated_mlp", dict(dtype="bfloat16", segments=True), r"\['dtype', 'segments'\]; expected \['dtype'\] and opt"),
])
def test_bad_lookups_raise_one_line(op, shape, match):
    with pytest.raises(ValueError, match=match):
        kernels.default_implementation(op, **shape)


def test_flash_attention_reads_the_table_for_plain_calls(monkeypatch):
    """implementation=None asks the table about the call's class (the longer length, segment ids or not, its
    forward + backward entry) and runs its answer, here 'cudnn' (jax.nn's 'xla' path standing in for it on this
    CPU) and, for packed segments, 'xla'; calls with what the table does not class (a window, interpret mode, ...)
    keep the per-backend rule."""
    asked, ran = [], []
    answer = lambda op, **shape: asked.append((op, shape)) or ("xla" if shape["segments"] else "cudnn")  # noqa: E731
    monkeypatch.setattr(api, "default_implementation", answer)
    monkeypatch.setattr(cudnn, "check_device", lambda interpret: None)
    monkeypatch.setattr(cudnn, "dot_product_attention", lambda *a, **k: ran.append(k) or jax.nn.dot_product_attention(
        *a, **{**k, "implementation": "xla"}))
    q, kv = (jax.ShapeDtypeStruct((2, n, 4, 64), jnp.bfloat16) for n in (24, 40))
    jax.eval_shape(lambda q, k: kernels.flash_attention(q, k, k, causal=True), q, kv)
    shape = dict(head_dim=64, seq_len=40, causal=True, dtype=jnp.bfloat16, segments=False)
    assert asked == [("flash_attention", shape)]
    assert [r["implementation"] for r in ran] == ["cudnn"]
    ids = (jnp.ones((2, 24), jnp.int32), jnp.ones((2, 40), jnp.int32))
    jax.eval_shape(lambda q, k: kernels.flash_attention(q, k, k, causal=True, segment_ids=ids), q, kv)
    assert asked[1:] == [("flash_attention", {**shape, "segments": True})] and len(ran) == 1
    monkeypatch.setattr(api, "default_implementation", lambda op, **shape: asked.append((op, shape)) or "cudnn")
    jax.eval_shape(lambda q, k: kernels.flash_attention(q, k, k, causal=True, segment_ids=ids), q, kv)
    assert len(asked) == 3 and len(ran) == 1  # the table's cuDNN for a (q, kv) pair of ids: the backend's rule
    monkeypatch.setattr(api, "default_implementation", answer)
    for kwargs in (dict(window=(8, 0)), dict(logit_soft_cap=20.0), dict(interpret=True),
                   dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))):
        jax.eval_shape(lambda q, k: kernels.flash_attention(q, k, k, **kwargs), q, kv)
    assert len(asked) == 3 and len(ran) == 1


def test_a_trace_for_another_target_resolves_that_targets_defaults():
    """Under an abstract mesh naming an H200 (a plan, or a lowering, for a GPU this CPU host is not), None resolves
    as a run on the H200 does: the table's answer for the call's class (cuDNN for whole rows here), the GPU's own
    kernels where the table has none (packed rows) and for every other op; outside it, this host's."""
    from tests import targets

    whole = dict(head_dim=128, seq_len=4096, causal=True, dtype="bfloat16")
    with targets.for_gpu():
        assert kernels.default_implementation("flash_attention", **whole) == "cudnn"
        assert kernels.default_implementation("flash_attention", **whole, segments=True) == "triton"
        assert kernels.default_implementation("linear_cross_entropy", dtype="bfloat16") == "plain"
        assert kernels.resolve_implementation(None) == "triton"
    assert kernels.default_implementation("flash_attention", **whole) == "xla"
    assert kernels.default_implementation("linear_cross_entropy", dtype="bfloat16") == "xla"
    assert kernels.resolve_implementation(None) == "xla"


def _entry(device_kind, seq_len, times, training=True, causal=True):
    cls = _defaults.shape_class("flash_attention", head_dim=16, seq_len=seq_len, causal=causal, dtype="float32",
                                training=training)
    return _defaults.make_entry("flash_attention", device_kind, cls, times, command="test", jax=jax.__version__,
                                shape="test")


def test_merge_replaces_its_own_classes_and_keeps_the_others(tmp_path):
    path = str(tmp_path / "table.py")
    _defaults.merge_table(path, [_entry(H200, 32, {"triton": 1.0, "cudnn": 2.0}), _entry("cpu", 64, {"xla": 1.0})])
    assert _attention(H200, 32, 16, dtype="float32", table=path) == "triton"
    merged = _defaults.merge_table(path, [_entry(H200, 32, {"triton": 3.0, "cudnn": 2.0}),
                                          _entry(H200, 32, {"triton": 1.0, "cudnn": 2.0}, training=False)])
    assert len(merged) == 3 and _defaults.read_table(path) == merged
    assert _attention(H200, 32, 16, dtype="float32", table=path) == "cudnn"  # the file re-read after the rewrite
    assert _attention(H200, 32, 16, dtype="float32", table=path, training=False) == "triton"
    assert _attention("cpu", 64, 16, dtype="float32", table=path) == "xla"
    for table, match in (([], 'expected a JSON object with a list of "entries"'),
                         ({"entries": [{**merged[0], "choice": "cuda"}]}, "entry 0 .* expected op in")):
        with open(path, "w") as f:
            json.dump(table, f)
        with pytest.raises(ValueError, match=match):
            _defaults.read_table(path)


def test_a_choice_the_device_cannot_run_is_not_taken(tmp_path):
    """A CPU entry naming the interpreted Triton kernel (what `--interpret` measures) is no CPU default."""
    path = str(tmp_path / "table.py")
    _defaults.merge_table(path, [_entry("cpu", 64, {"triton": 1.0, "xla": 2.0})])
    assert _attention("cpu", 64, 16, dtype="float32", table=path) == "xla"


def _write_defaults(path, *args):
    out = subprocess.run([sys.executable, "scripts/bench_kernels.py", f"--write_defaults={path}", "--seq_lens=32",
                          "--tokens=32", "--heads=2", "--head_dim=16", "--iters=1", "--warmup=1", "--min_sample_ms=1",
                          "--causal=true", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, XLA_FLAGS=cpu_devices(1), JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_kernels_writes_the_defaults_of_what_it_measured(tmp_path):
    """On this CPU (attention only: 'xla' is its one implementation): an entry per head dim, pass and segments
    setting of the measured classes for the 'cpu' kind, merged beside an H200 entry already there, and read back by
    the lookup."""
    path = str(tmp_path / "table.py")
    _defaults.merge_table(path, [_entry(H200, 32, {"triton": 1.0, "cudnn": 2.0})])
    stdout = _write_defaults(path, "--kernels=attention", "--defaults_head_dims=16,8")
    assert "defaults written to" in stdout
    entries = _defaults.read_table(path)
    mine = [e for e in entries if e["device_kind"] == "cpu"]
    assert len(entries) == 9 and sorted((e["class"]["head_dim"], e["class"]["segments"], e["class"]["pass"])
                                        for e in mine) == [
        (d, s, p) for d in (8, 16) for s in (False, True) for p in ("fwd", "fwd+bwd")]
    for e in mine:
        assert e["choice"] == "xla" and set(e["times"]) == {"xla"} and "--write_defaults" in e["command"]
        assert {k: v for k, v in e["class"].items() if k not in ("pass", "segments", "head_dim")} == dict(
            dtype="float32", causal=True, seq_len=32)
        assert ("packed" in e["shape"]) == e["class"]["segments"]
    assert _attention("cpu", 32, 16, dtype="float32", table=path) == "xla"
    assert _attention("cpu", 32, 16, dtype="float32", table=path, segments=True) == "xla"


@pytest.mark.slow
def test_bench_kernels_chooses_between_kernels_and_plain_matmuls(tmp_path):
    """With --interpret: 'xla' against the interpreted Triton attention, and gated_mlp / linear_cross_entropy's
    interpreted kernels against plain XLA matmuls (the loss also against its chunked sum); every class gets the
    fastest of its candidates."""
    path = str(tmp_path / "table.py")
    _write_defaults(path, "--interpret", "--segments=true")
    entries = _defaults.read_table(path)
    assert sorted((e["op"], e["class"]["pass"]) for e in entries) == [
        (op, p) for op in ("flash_attention", "gated_mlp", "linear_cross_entropy") for p in ("fwd", "fwd+bwd")]
    assert all(e["class"]["segments"] for e in entries if e["op"] == "flash_attention")
    for e in entries:
        assert set(e["times"]) == {"flash_attention": {"xla", "triton"}, "gated_mlp": {"triton", "plain"},
                                   "linear_cross_entropy": {"triton", "plain", "chunked"}}[e["op"]], e
        assert e["choice"] == min(e["times"], key=e["times"].get)


@pytest.mark.parametrize("packed", [False, True])
def test_an_h200_step_runs_the_tables_attention_for_its_rows(monkeypatch, packed):
    """The Trainer's step of a scanned, rematerialised LLaMA (head dim 128, rows of 2048 tokens: the 4096 bucket's
    neighbour), bf16, lowered for cuda with the checked-in table read for an H200: whole rows (no segment ids) run
    cuDNN's forward and backward, packed rows (segment ids) the Triton kernels, whose class has no entry."""
    import optax

    import engine
    import models
    from jax._src.cudnn import fused_attention_stablehlo

    from engine.tasks import lm
    from tests.targets import for_gpu
    try:
        fused_attention_stablehlo.check_cudnn_version()
    except RuntimeError:  # JAX 0.10.2 asks the CUDA plugin while tracing; this host has none
        monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(api, "default_implementation",
                        lambda op, **shape: kernels.default_implementation(op, device_kind=H200, **shape))
    model = models.create_model("llama", "tiny", hidden_size=256, num_heads=2, num_kv_heads=1, intermediate_size=512,
                                num_layers=2, max_position_embeddings=2048, scan_layers=True, remat="full")
    mesh = engine.make_mesh(data=1, devices=jax.devices()[:1])
    trainer = engine.Trainer(mesh=mesh, collate_fn=lm.collate_lm, loss_fn=lm.lm_loss_fn(model),
                             params=models.init_params(model, jax.random.key(0)), optimizer=optax.adamw(1e-3),
                             precision=engine.Precision(compute_dtype=jnp.bfloat16))
    keys = ("input_ids", "labels") + (("segment_ids",) if packed else ())
    batch = {k: jax.ShapeDtypeStruct((1, 1, 2048), jnp.int32) for k in keys}
    with for_gpu(mesh):
        text = trainer.lower(batch, platforms=("cuda",)).as_text()
    cudnn_calls = re.findall(r"custom_call @(__cudnn\$\w+)", text)
    triton_calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)
    if packed:
        assert not cudnn_calls and len(triton_calls) >= 3, (cudnn_calls, len(triton_calls))  # fwd, dq, dk/dv
    else:
        assert sorted(set(cudnn_calls)) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"] and not triton_calls


def test_a_candidate_that_disagrees_is_never_a_default():
    """`bench_kernels._agreeing`: a candidate whose output or any gradient is further from the reference's than the
    dtype's AGREEMENT is dropped (its row says so) however fast; the loss's summed path is compared with the sum."""
    import runpy

    from absl import flags
    before = set(flags.FLAGS)
    bench = runpy.run_path(os.path.join(ROOT, "scripts", "bench_kernels.py"), run_name="bench_kernels")
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
    want = (jnp.arange(1.0, 9.0), jnp.ones(4))
    rows = {name: [name, "", "1.0", "", "", ""] for name in ("xla", "close", "wrong", "fast", "nan")}
    outputs = {"xla": (want, rows["xla"]), "close": ((want[0] * 1.01, want[1]), rows["close"]),
               "wrong": ((want[0], want[1] * 1.1), rows["wrong"]), "fast": ((want[0], -want[1]), rows["fast"]),
               "nan": ((want[0], want[1] * jnp.nan), rows["nan"])}  # exact first leaf, NaN second
    times = {"xla": 3.0, "close": 2.0, "wrong": 1.0, "fast": 0.5, "nan": 0.1}
    assert bench["_agreeing"](times, outputs, "xla", jnp.bfloat16) == {"xla": 3.0, "close": 2.0}
    assert rows["wrong"][5] == "disagrees with xla: 0.1" and rows["fast"][5] == "disagrees with xla: 2"
    assert rows["nan"][5] == "disagrees with xla: inf"
    del times["nan"]
    assert bench["_agreeing"](dict(times), outputs, "xla", jnp.float32) == {"xla": 3.0}  # 1e-2 > fp32's 2e-3
    summed = {"plain": ((want[0],), rows["xla"]), "chunked": ((want[0].sum(),), rows["close"])}
    assert bench["_agreeing"]({"plain": 2.0, "chunked": 1.0}, summed, "plain", jnp.bfloat16) == {
        "plain": 2.0, "chunked": 1.0}


def test_the_splash_baseline_attends_as_jax_nn_does():
    """bench_kernels.py's TPU baseline row (JAX's splash attention as MaxText calls it: GQA through its MQA kernel,
    the queries scaled first, heads-major) computes the attention it is timed against, causal and not (in Pallas's
    interpreter here)."""
    import runpy

    from absl import flags

    before = set(flags.FLAGS)
    bench = runpy.run_path(os.path.join(ROOT, "scripts", "bench_kernels.py"), run_name="bench_kernels")
    try:
        flags.FLAGS["splash_interpret"].parse("true")
        for causal in (True, False):
            (q, k, v), _, _ = bench["_attention_inputs"](jnp.float32, 128, 256, 4, 2, 64, causal)
            got = bench["_splash_attention"](causal, 4, 2, 128)(q, k, v)
            want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
            assert float(jnp.abs(got - want).max()) < 1e-5, causal
    finally:
        for name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, name)
