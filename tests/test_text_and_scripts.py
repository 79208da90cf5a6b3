"""engine.text (packing, loss), engine.cli, and the main job scripts/train_lm.py end to end."""
import os
import subprocess
import sys

import numpy as np
import pytest

from engine import cli, text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pack_segments_and_labels():
    tok = text.ByteTokenizer()
    rows = text.pack(["abc", "defgh", "ij"], tok, seq_len=5)
    # abc<eos> def | gh<eos> ij<eos> | padding
    assert [r["tokens"].tolist() for r in rows] == [
        [97, 98, 99, 258, 100, 101], [102, 103, 104, 258, 105, 106], [258, 256, 256, 256, 256, 256]]
    assert [r["segment_ids"].tolist() for r in rows] == [[1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2], [1, 0, 0, 0, 0, 0]]
    batch = text.collate_lm(rows)
    assert batch["input_ids"].shape == (3, 5)
    # Labels stop at document boundaries and padding.
    assert batch["labels"][0].tolist() == [98, 99, 258, -100, 101]
    assert batch["labels"][2].tolist() == [-100] * 5


def test_read_texts_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n"y"\n\n')
    assert text.read_texts([str(tmp_path / "*")]) == ["hello", "x", "y"]
    with pytest.raises(ValueError, match=r"data: '/nonexistent/\*.txt' matches no file"):
        text.read_texts("/nonexistent/*.txt")
    (tmp_path / "c.jsonl").write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1 has no 'text' field"):
        text.read_texts(str(tmp_path / "c.jsonl"))


def test_default_corpus_is_local_and_sized():
    docs = text.default_corpus(max_bytes=50_000)
    assert sum(map(len, docs)) == 50_000 and "import" in "".join(docs)


def test_parse_mesh():
    assert cli.parse_mesh("2,-1,2") == {"data": 2, "fsdp": -1, "model": 2}
    with pytest.raises(ValueError, match=r"--mesh='2,2'; expected three integers"):
        cli.parse_mesh("2,2")


def test_train_lm_runs_resumes_and_writes_tensorboard(tmp_path):
    cmd = [sys.executable, "scripts/train_lm.py", f"--workdir={tmp_path}", "--max_steps=6", "--log_every=3",
           "--save_every=3", "--seq_len=32", "--per_device_batch_size=2", "--mesh=-1,1,2", "--max_new_tokens=4",
           '--model_overrides={"hidden_size": 32, "intermediate_size": 64}', "--profile_steps=2,4"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval loss after training" in out.stdout and "--- sample for 'def '" in out.stdout
    events = [f for _, _, fs in os.walk(tmp_path / "tensorboard") for f in fs]
    assert any(f.startswith("events.out.tfevents") for f in events)
    assert any(f.endswith(".xplane.pb") for f in events), events  # the profiler trace
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "6"
    again = subprocess.run(cmd[:3] + ["--max_steps=9"] + cmd[4:-1], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 9" in again.stdout
    np.testing.assert_equal(sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())[-1], 9)
