"""scripts/bench_step.py's engine worker end to end: every figure it prints for the table, `fit`'s host work a small
fraction of a step, the in-process ratio measured against the floor of ../shared/peers (skipped without it)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, "..", "shared", "peers")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(PEERS, "plain_step.py")), reason="no peers directory")
def test_bench_step_worker_prints_every_figure():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "MP": "2", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--worker=4x1x2",
                          "--worker_step=jit", f"--peers_dir={PEERS}", "--in_process_rounds=1"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    values = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
    figures = {key: float(values[key]) for key in ("STEADY", "DIRECT", "COMPILE", "COMPILES", "INPROCESS", "HOST",
                                                    "HOST_FLOOR")}
    assert figures["COMPILES"] == 1
    assert 0.5 < figures["INPROCESS"] < 2  # the same model and data: within noise of the floor
    step_ms = figures["DIRECT"] / 20 * 1e3
    assert 0 < figures["HOST"] < 0.1 * step_ms and 0 < figures["HOST_FLOOR"] < 0.1 * step_ms
