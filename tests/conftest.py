"""Every test sees 8 simulated CPU devices. XLA reads the flag once, when JAX initialises its backend, so it is set
here, before any test module imports jax (with the compile-time flags of tests/xla_flags.py)."""
import os

from tests.xla_flags import cpu_devices

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_devices(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests need 8 simulated devices, got {jax.device_count()}"
