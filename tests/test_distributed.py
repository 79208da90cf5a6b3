"""engine.initialize_distributed: 2 processes x 4 CPU devices form one 8-device runtime; bad input fails fast."""
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import engine
from tests import multihost_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "ENGINE_", "SLURM_"))}
    env["PYTHONPATH"] = ROOT
    return subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # CI time: tests/test_trainer.py and test_readme.py run 2 processes fast
def test_two_processes_match_single_process(tmp_path):
    out = tmp_path / "logits.npy"
    address = f"localhost:{_free_port()}"
    procs = [_worker(address, 2, pid, out) for pid in (0, 1)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    module, params = multihost_worker.forward_fn()
    want = jax.jit(lambda p, i: module.apply({"params": p}, i))(params, multihost_worker.IDS)
    np.testing.assert_allclose(np.load(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_unreachable_coordinator_fails_within_timeout(tmp_path):
    start = time.monotonic()
    p = _worker(f"localhost:{_free_port()}", 2, 1, tmp_path / "x.npy", 3)
    log = p.communicate(timeout=60)[0]
    assert p.returncode != 0
    assert "did not answer within 3.0 s" in log, log[-2000:]
    assert time.monotonic() - start < 45


def test_single_process_is_a_noop(monkeypatch):
    for k in ("ENGINE_COORDINATOR_ADDRESS", "ENGINE_NUM_PROCESSES", "ENGINE_PROCESS_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert engine.initialize_distributed() == (0, 1)
    assert engine.initialize_distributed("localhost:1234", 1, 0) == (0, 1)


@pytest.mark.parametrize("args, env, message", [
    (("localhost", 2, 0), {}, r"coordinator_address='localhost'; expected 'host:port'"),
    (("localhost:1", 0, 0), {}, r"num_processes=0; expected a positive integer"),
    (("localhost:1", 2, 2), {}, r"process_id=2; expected 0 <= process_id < 2"),
    ((), {"ENGINE_COORDINATOR_ADDRESS": "localhost:1"},
     r"ENGINE_NUM_PROCESSES, ENGINE_PROCESS_ID not set; expected all of"),
])
def test_bad_arguments(monkeypatch, args, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        engine.initialize_distributed(*args)


def test_slurm_environment(monkeypatch):
    from engine.distributed import _from_slurm
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[003-004]")
    monkeypatch.setenv("ENGINE_COORDINATOR_PORT", "5555")
    assert _from_slurm() == ("gpu003:5555", 4, 3)


def test_an_unresolvable_coordinator_host_fails_at_once():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"host 'no-such-host\.invalid' does not resolve"):
        engine.initialize_distributed("no-such-host.invalid:1234", 2, 1, timeout_s=60)
    assert time.monotonic() - start < 20


def test_a_coordinator_whose_peers_never_join_names_it_within_its_timeout(tmp_path):
    """Process 0 alone of 2: one line naming that not all processes joined, within --coordinator_timeout."""
    start = time.monotonic()
    p = _worker(f"localhost:{_free_port()}", 2, 0, tmp_path / "x.npy", 3)
    log = p.communicate(timeout=90)[0]
    assert p.returncode != 0
    assert "process 0 (the coordinator at localhost:" in log and "not all 2 processes joined within 3.0 s" in log, \
        log[-2000:]
    assert "Check failure" not in log and "Terminating process" not in log, log[-2000:]
    assert time.monotonic() - start < 60
