"""scripts/bench_gpu_step.py on the CPU: the engine's measurement on the tiny shape, a peer's `RESULT {json}` line
parsed from a subprocess, the figures and table built from them; end to end (slow) with a fake PyTorch peer."""
import json
import os
import re
import runpy
import subprocess
import sys
import types

import pytest
from absl import flags

from engine import compiler
from tests.xla_flags import cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_gpu_step.py")
# A stand-in for torch_llama_step.py: its RESULT line, torch.compile 25 % faster than eager.
FAKE_PEER = """import json, sys
args = dict(a[2:].split("=") for a in sys.argv[1:] if "=" in a)
ms = 80.0 if "--compile" in sys.argv else 100.0
tokens = int(args["tokens"]) // int(args["seq"]) * int(args["seq"])
print("noise before the result")
print("RESULT " + json.dumps(dict(peer="torch.compile" if "--compile" in sys.argv else "torch eager", step_ms=ms,
                                  tokens_per_s=tokens / ms * 1e3, mfu=0.1, peak_gb=1.5, warmup_s=2.0,
                                  seq=int(args["seq"]), layers=int(args["layers"]))))
"""


def _load_script():
    """The script's functions; its absl flags removed again, so that other tests in this process can define theirs."""
    before = set(flags.FLAGS)
    script = types.SimpleNamespace(**runpy.run_path(SCRIPT, run_name="bench_gpu_step"))
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
    return script


def _table_rows(stdout):
    """{run: [cells]} of the markdown table the script prints last."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return header, [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def test_engine_case_peer_parsing_and_table(tmp_path):
    bench = _load_script()
    result = bench.engine_case("tiny", 32, tokens_per_step=64, steps=2, warmup=1)
    assert result["step_ms"] > 0 and result["tokens_per_s"] > 0 and result["warmup_s"] > 0, result
    assert result["batch"] == 2 and result["peak_tflops"] is None  # a CPU: no peak, no MFU
    assert (result["attention"], result["packed"]) == ("xla", False)  # whole rows: no segment ids, as the peers
    packed = bench.engine_case("tiny", 32, tokens_per_step=64, steps=2, warmup=1, packed=True)
    assert packed["packed"] and packed["loss"] == pytest.approx(result["loss"], rel=1e-6)  # one document a row
    unrolled = bench.engine_case("tiny", 32, tokens_per_step=64, steps=2, warmup=1, scan_layers=False)
    assert (result["scan_layers"], unrolled["scan_layers"]) == (True, False)
    # The same layers one at a time: the bf16 programs round differently, compounded over three AdamW updates.
    assert unrolled["loss"] == pytest.approx(result["loss"], rel=5e-3)
    fp8 = bench.engine_case("tiny", 32, tokens_per_step=64, steps=1, warmup=1, fp8=True)
    assert (result["run"], fp8["run"]) == ("engine", "engine fp8") and fp8["tokens_per_s"] > 0
    assert fp8["loss"] != result["loss"]  # the same data and weights, FP8's rounding
    assert bench.parse_result("x\nRESULT {\"a\": 1}\nRESULT {broken\n") == {"a": 1}
    peer = tmp_path / "peer.py"
    peer.write_text(FAKE_PEER)
    model = bench.make_model("tiny", 32)
    args = bench.peer_args(model.config, 32, 64, 2, 1)
    parsed, note = bench.run_case([sys.executable, str(peer), *args, "--compile"], timeout=60)
    assert note == "" and parsed["step_ms"] == 80.0 and parsed["tokens_per_s"] == 800.0 and parsed["layers"] == 2
    failed, note = bench.run_case([sys.executable, "-c", "raise SystemExit('no cuda here')"], timeout=60)
    assert failed is None and note == "exit 1: no cuda here", note

    flops = {("tiny", 32): bench.flops_per_step(model, 32, 2)}
    base = dict(shape="tiny", seq=32, rows=2)
    records = [dict(base, **result), dict(base, run="torch.compile", **parsed),
               dict(base, run="torch eager", note="timed out after 60 s", tokens_per_s=None)]
    figures = bench.add_figures(records, flops, peak_tflops=1e-3)  # a made-up peak, to exercise the MFU column
    assert figures[1]["vs_compile"] == 1.0 and figures[0]["vs_compile"] == result["tokens_per_s"] / 800.0
    assert figures[0]["mfu"] == pytest.approx(result["tokens_per_s"] / 64 * flops[("tiny", 32)] / 1e9)
    header, rows = _table_rows(bench.format_table(figures))
    assert header[:4] == ["shape", "seq", "rows", "run"] and len(rows) == 3
    assert rows[2][3] == "torch eager (timed out after 60 s)" and rows[2][4] == "n/a"
    assert rows[0][3] == "engine [attention xla]" and rows[1][3] == "torch.compile"
    _, (row,) = _table_rows(bench.format_table(bench.add_figures([dict(base, **unrolled)], flops, None)))
    assert row[3] == "engine [attention xla, layers unrolled]"
    for row in rows[:2]:
        assert float(row[4]) > 0 and float(row[5].replace(",", "")) > 0 and row[6].endswith(" %"), row


def test_target_lines():
    bench = _load_script()
    at = lambda run, tps, **kw: dict(shape="llama3_8b", seq=2048, rows=8, run=run, tokens_per_s=tps,  # noqa: E731
                                     mfu=kw.get("mfu"), vs_compile=kw.get("vs_compile"))
    lines = bench.target_lines([at("engine", 1000.0, mfu=0.45, vs_compile=1.2), at("engine fp8", 1400.0),
                                at("torch.compile", 1000 / 1.2, vs_compile=1.0)])
    assert lines == ["target 1.15x torch.compile, llama3_8b seq 2048: 1.20x (met)",
                     "target 50 % MFU, llama3_8b seq 2048: 45.0 % (not met)",
                     "target 1.3x the bf16 step with FP8, llama3_8b seq 2048: 1.40x (met)"], lines


def test_the_llama3_shapes_layers_follow_the_gpus_memory():
    """8 layers on an H200 (nvidia-smi's 143771 MiB) or where the memory is unknown, 3 on an 80 GB H100 (81559 MiB),
    fewer at more tokens a step, never fewer than 1; each count's peers' estimate within 85 % of the card."""
    bench = _load_script()
    h200, h100 = 143771 * 2**20 / 1e9, 81559 * 2**20 / 1e9
    assert bench.peer_layers(h200, 16384) == 8 and bench.peer_layers(None, 16384) == 8
    assert bench.peer_layers(h100, 16384) == 3 and bench.peer_layers(h100, 32768) == 1
    assert bench.peer_layers(16.0, 16384) == 1
    g = bench.PEER_GB
    for memory in (h100, 100.0, 120.0):
        layers = bench.peer_layers(memory, 16384)
        need = g["fixed"] + g["loss_per_16k"] + layers * (g["layer"] + g["layer_per_16k"])
        assert need <= 0.85 * memory < need + g["layer"] + g["layer_per_16k"], (memory, layers)


def test_gpu_memory_is_nvidia_smis_first_card_or_none(monkeypatch):
    bench = _load_script()
    reply = {"out": "81559\n81559\n", "rc": 0}

    def fake_run(cmd, **_):
        assert cmd[0] == "nvidia-smi" and "--query-gpu=memory.total" in cmd
        if reply["out"] is None:
            raise FileNotFoundError("nvidia-smi")
        return subprocess.CompletedProcess(cmd, reply["rc"], stdout=reply["out"], stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.gpu_memory_gb() == pytest.approx(81559 * 2**20 / 1e9)
    reply.update(rc=9)
    assert bench.gpu_memory_gb() is None
    reply.update(out=None)
    assert bench.gpu_memory_gb() is None


def test_agreement_lines_compare_the_unfilled_stacks_loss_with_the_zero_filled_one():
    bench = _load_script()
    at = lambda run, loss, seq=2048: dict(shape="tinyllama", seq=seq, run=run, loss=loss)  # noqa: E731
    lines = bench.agreement_lines([at("engine", 2.5), at("engine zero fills", 2.5), at("engine", 2.5, 8192),
                                   at("engine zero fills", float("nan"), 8192), at("engine cuBLAS", 2.6),
                                   at("engine zero fills", 3.0, 4096)])
    assert lines == ["stacks unfilled against zero-filled, tinyllama seq 2048: loss 2.500000 against 2.500000, "
                     "relative difference 0.0e+00 (equal)",
                     "stacks unfilled against zero-filled, tinyllama seq 8192: loss 2.500000 against nan, "
                     "relative difference nan (DIFFER)"], lines


def test_an_engine_run_adds_its_xla_flags_to_its_subprocess_only():
    """'cublas' appends XLA's Triton-GEMM switch to the XLA_FLAGS its worker inherits (keeping the user's); the other
    runs and the peers get the environment as it was."""
    bench = _load_script()
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/d", "HOME": "/h"}
    assert bench.run_env(env, "cublas") == {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=false",
                                            "HOME": "/h"}
    assert bench.run_env({}, "cublas") == {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
    assert bench.run_env({}, "fills") == {"XLA_FLAGS": f"--{compiler.FILL_ELIMINATION}=false"}
    assert bench.run_env(env, "bf16") is env and bench.run_env(env, "unrolled") is env
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"


@pytest.mark.slow
def test_script_end_to_end_with_a_fake_peer(tmp_path):
    """The whole script: the engine in its worker subprocess, the fake peer eager and compiled, the JSON-lines log,
    the table's rows and ratios."""
    peer = tmp_path / "peer.py"
    peer.write_text(FAKE_PEER)
    log = tmp_path / "runs.jsonl"
    env = dict(os.environ, XLA_FLAGS=cpu_devices(1), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, SCRIPT, "--shapes=tiny", "--seq_lens=32,64", "--tokens_per_step=128",
                          "--steps=2", "--warmup=1", "--peers=compile,eager", f"--torch_peer={peer}",
                          "--engine_runs=bf16,unrolled,cublas", f"--out={log}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    header, rows = _table_rows(out.stdout)
    assert [(r[1], r[2], r[3]) for r in rows] == [(s, str(128 // int(s)), run) for s in ("32", "64")
                                                  for run in ("engine [attention xla]",
                                                              "engine unrolled [attention xla]",
                                                              "engine cuBLAS [attention xla]", "torch.compile",
                                                              "torch eager")], rows
    ratio = header.index("vs torch.compile")
    for row in rows:
        assert float(row[4]) > 0 and float(row[5].replace(",", "")) > 0, row
        assert row[6] == "n/a" and re.fullmatch(r"\d+\.\d\dx", row[ratio]), row  # no CPU peak: no MFU
    assert [r[ratio] for r in rows if not r[3].startswith("engine")] == ["1.00x", "0.80x"] * 2
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(logged) == 10
    assert [r["scan_layers"] for r in logged if r["run"].startswith("engine")] == [True, False, True] * 2
