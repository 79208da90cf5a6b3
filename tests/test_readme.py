"""What the documentation shows must run: README.md's Python example executes and its Quickstart has two lines,
every `--flag` the README and the guides name is a real flag of a script, and engine/README.md's two-process command
lines train."""
import os
import re
import subprocess
import sys

import pytest

from tests.xla_flags import FAST_COMPILE, cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
GUIDES = ("engine/README.md", "kernels/README.md", "models/README.md", "scripts/README.md")
OTHER_TOOLS = ("tensorboard", "gcloud")  # commands whose flags are not ours


def test_quickstart_is_two_lines():
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", README, re.S).group(1)
    assert block.strip().splitlines() == ["make train", "make test"]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "make test" in ci


@pytest.mark.parametrize("devices", [8, 1])
def test_three_function_example_runs(devices):
    """On the 8 simulated devices and on a laptop's one."""
    code = re.search(r"## The three-function API\s+```python\n(.*?)```", README, re.S).group(1)
    env = dict(os.environ, XLA_FLAGS=cpu_devices(devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    preds, targets = (eval(x) for x in re.findall(r"\[[^\]]*\]", out.stdout.strip().splitlines()[-1]))
    assert len(preds) == 5 and max(abs(p - t) for p, t in zip(preds, targets)) < 0.1, (preds, targets)


def test_documented_flags_are_real():
    """Every `--flag` in inline code in README.md and the guides is defined by a script or
    engine/tasks/script_flags.py (read from their source: starting every script for --helpfull would take a minute).
    XLA's and other tools' flags are left out."""
    sources = [os.path.join(ROOT, "engine", "tasks", "script_flags.py")] + [
        os.path.join(ROOT, "scripts", f) for f in os.listdir(os.path.join(ROOT, "scripts")) if f.endswith(".py")]
    defined = {"helpfull", "help", "verbosity"}  # absl's own
    for path in sources:
        defined.update(re.findall(r"DEFINE_[a-z_]+\(\s*[\"']([a-z0-9_]+)[\"']", open(path).read()))
    unknown = set()
    for doc in ("README.md",) + GUIDES:
        text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, doc)).read(), flags=re.S)  # inline code only
        spans = [span for span in re.findall(r"`([^`]+)`", text) if span.split()[0] not in OTHER_TOOLS]
        for flag in {f for span in spans for f in re.findall(r"(?<![\w-])--([a-z][a-z0-9_]*)", span)}:
            if flag.startswith("xla_") or flag in defined or (flag.startswith("no") and flag[2:] in defined):
                continue
            unknown.add(f"{doc}: --{flag}")
    assert not unknown, sorted(unknown)


def test_two_process_cpu_example_runs(tmp_path):
    """engine/README.md's two-process command lines, with a free port, a temporary workdir and tiny settings
    appended."""
    import socket
    guide = open(os.path.join(ROOT, "engine", "README.md")).read()
    block = re.search(r"Two processes on one machine.*?```bash\n(.*?)```", guide, re.S).group(1).strip().splitlines()
    env = dict(os.environ, PYTHONPATH=ROOT)
    for assignment in block[0].removeprefix("export ").split():
        key, value = assignment.split("=", 1)
        env[key] = value
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    tiny = ["--max_steps=4", "--log_every=2", "--seq_len=32", "--per_device_batch_size=1", "--prompts=",
            '--model_overrides={"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}']
    procs = []
    for line in block[1:]:
        args = line.rstrip(" &").replace("localhost:12355", f"localhost:{port}").replace("/tmp/mp", str(tmp_path))
        args = args.split()
        assert args[0] == ".venv/bin/python"
        procs.append(subprocess.Popen([sys.executable, *args[1:], *tiny], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "eval loss after training" in outs[0][0] and "at step 4" in outs[0][0]
    assert not any("[Gloo]" in out for out, _ in outs)  # Gloo's per-communicator lines go to the log file
