"""Runs many scripts' start-ups at once in children forked from one interpreter that has imported JAX and the engine.

The bad-flag tests start some thirty scripts that each fail during start-up; as separate interpreters each paid
the 4-8 s import of JAX, flax, optax and orbax (most of their cost on a 2-core machine). Here the import is paid once:
this module, run as `python -m tests.prewarmed` with JSON [[[script, arg, ...], ...], seconds each] on stdin,
imports them without starting a JAX backend or a thread (so forking is safe), then forks one child per case, which
runs the script as `__main__` with fresh absl flags (the script defines them after the fork) and its stdout / stderr
in files, and ends by SIGALRM after its seconds. It prints one JSON list of {"returncode", "stdout", "stderr"} in the
order of the cases.

`run_scripts(cases, env, cwd)` is the tests' entry point.
"""
import json
import os
import subprocess
import sys
import tempfile


def run_scripts(cases, env, cwd, timeout=300):
    """[(returncode, stdout, stderr)] of `python scripts/<case[0]> <case[1:]>` for each case, run as above."""
    out = subprocess.run([sys.executable, "-m", "tests.prewarmed"], cwd=cwd, env=env, capture_output=True, text=True,
                         input=json.dumps([[list(c) for c in cases], timeout - 30]), timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"tests.prewarmed failed ({out.returncode}): {out.stderr[-3000:]}")
    return [(r["returncode"], r["stdout"], r["stderr"]) for r in json.loads(out.stdout)]


def _child(script, args, out_path, err_path, timeout):
    import runpy
    import signal
    import traceback
    signal.alarm(timeout)  # a hung start-up ends (SIGALRM) instead of outliving the tests
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        path = os.path.abspath(os.path.join("scripts", script))
        sys.argv = [path, *args]
        sys.path[0] = os.path.dirname(path)  # what `python scripts/x.py` puts first
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    cases, timeout = json.loads(sys.stdin.read())
    import threading

    import flax  # noqa: F401
    import jax  # noqa: F401
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    import engine  # noqa: F401
    import kernels  # noqa: F401
    import models  # noqa: F401
    from engine.tasks import cli, lm, mesh_choice, model_start, planning, run_record  # noqa: F401
    from engine.tasks import script_flags, seq2seq, text_data  # noqa: F401
    from engine.tasks.rlhf import ppo, preference, reward  # noqa: F401
    from jax._src import xla_bridge
    started = getattr(xla_bridge, "_backends", None)
    assert threading.active_count() == 1 and not started, "fork needs one thread and no JAX backend"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for i, (script, *args) in enumerate(cases):
            out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(script, args, out_path, err_path, timeout)
            children.append((pid, out_path, err_path))
        for pid, out_path, err_path in children:
            _, status = os.waitpid(pid, 0)
            with open(out_path) as o, open(err_path) as e:
                results.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": o.read(),
                                "stderr": e.read()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
