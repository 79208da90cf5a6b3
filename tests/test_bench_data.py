"""scripts/bench_data.py end to end on a tiny generated corpus (seconds): the rates table, a small LLaMA's step and its
input wait (the model flags `device_check.sh data` sets at TinyLlama's shape), the paced consumer's rate held to its
pace and its wait a share of the time."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(stdout, header):
    """The cells of the markdown table whose header row starts with `header`."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_bench_data_prints_rates_the_step_wait_and_the_paced_wait(tmp_path):
    pytest.importorskip("grain")  # the `data` extra (make test installs it; a bare JAX 0.11 tier may not)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device: batches of any row count
    pace = 20_000
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_data.py"), f"--workdir={tmp_path}", "--corpus_mb=1",
         "--min_words=50", "--max_words=200", "--bpe_vocab=400", "--bpe_train_mb=1", "--tokenizers=bpe",
         "--seq_len=64", "--batch_rows=4", "--batches=3", "--workers=0", "--train_steps=6", "--hidden=32",
         "--heads=4", "--kv_heads=1", "--intermediate=48", "--compute_dtype=bfloat16",
         f"--consume_tokens_per_s={pace}", "--consume_batches=10"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rates = _rows(out.stdout, "| tokenizer | examples | workers | start s |")
    assert [r[1] for r in rates] == ["Mixture (packed, streamed)", "MapDataset (text spans)"]
    assert all(float(r[4].replace(",", "")) > 0 for r in rates)
    (wait,) = _rows(out.stdout, "| workers | s/step (LLaMA, hidden 32, 2 layers, 4 / 1 heads, bfloat16) |")
    step, tokens, share = float(wait[1]), float(wait[2].replace(",", "")), float(wait[3].rstrip("%")) / 100
    assert wait[0] == "0" and step > 0 and abs(tokens - 4 * 64 / step) < 0.01 * tokens + 1 and 0 <= share < 1, wait
    paced = _rows(out.stdout, "| tokenizer | examples | workers | consumed tokens/s")
    assert len(paced) == 2
    for row in paced:
        consumed, share = float(row[3].replace(",", "")), float(re.sub("%$", "", row[4])) / 100
        # Held 256 tokens / 20k tokens/s = 12.8 ms a batch: the rate is the pace less the waits, never above it.
        assert 0.5 * pace < consumed <= pace * 1.01, row
        assert 0 <= share < 0.5, row


def test_bench_data_without_grain_says_so_in_one_line(tmp_path):
    """Where grain is not installed (here: hidden from the script's lookup), one error line naming the extra."""
    script = os.path.join(ROOT, "scripts", "bench_data.py")
    code = ("import importlib.util as u, runpy, sys\n"
            "find = u.find_spec\n"
            "u.find_spec = lambda name, *a: None if name == 'grain' else find(name, *a)\n"
            f"sys.argv = [{script!r}, '--workdir={tmp_path}']\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == ("error: bench_data.py measures Grain's pipeline beside the "
                                                   "engine's, and grain is not installed: pip install -e '.[data]'")
