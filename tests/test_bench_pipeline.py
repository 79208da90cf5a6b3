"""scripts/bench_pipeline.py end to end at a tiny size: a row per schedule, each schedule's idle share the formula's
(1F1B's GPipe's), times, temporaries and bytes sent measured."""
import os
import subprocess
import sys

import pytest

from models import pipeline
from tests.xla_flags import cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("family", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_bench_pipeline_prints_each_schedule(family):
    env = {**os.environ, "XLA_FLAGS": cpu_devices(8)}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_pipeline.py"), "--stages=2", "--microbatches=4",
         "--layers=4", "--hidden_size=64", "--seq_len=16", "--rows=16", "--rounds=1", "--steps=1",
         f"--family={family}"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("schedule"))
    rows = {cells[0]: cells[1:] for cells in (line.split() for line in lines[at + 1:at + 4])}
    assert set(rows) == {"gpipe", "interleaved", "1f1b"}, out.stdout
    assert float(rows["gpipe"][1]) == 1.0
    assert all(float(r[0]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows.values())  # time, memory, bytes
    assert float(rows["gpipe"][2]) == float(rows["1f1b"][2]) == pytest.approx(pipeline.bubble_fraction(2, 4), abs=1e-3)
    assert float(rows["interleaved"][2]) == pytest.approx(pipeline.bubble_fraction(2, 4, 2), abs=1e-3)
