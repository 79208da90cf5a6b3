"""Every test sees 8 simulated CPU devices. XLA reads the flag once, when JAX initialises its backend, so it is set
here, before any test module imports jax (with the compile-time flags of tests/xla_flags.py).

The suite also shares one persistent compilation cache, fresh for each pytest run: many tests compile the very
programs another test (or a resumed script) compiled before, and XLA:CPU compiling is most of the suite's time.
pytest's own process creates the directory before the xdist workers start; they and every script the tests start
inherit it through the environment (JAX_COMPILATION_CACHE_DIR). Its keys hold the whole HLO, compile options and
XLA flags, so a hit is the program that would have been compiled (a read that races another process's write of
the same entry is a warning and a fresh compile in JAX). JAX_ENABLE_COMPILATION_CACHE=false turns it off."""
import atexit
import os
import shutil
import tempfile

from tests.xla_flags import cpu_devices

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_devices(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="redline-test-compile-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
# Every program, however small or quick to compile (the defaults skip those under a second).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests need 8 simulated devices, got {jax.device_count()}"
