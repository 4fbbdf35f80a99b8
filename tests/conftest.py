"""Every test runs on CPU with 8 virtual devices, set before jax initialises.

The suite's programs are tiny: each runs for milliseconds and compiles for seconds, in
this process and in every process a test starts. So the suite compiles at XLA's backend
(LLVM) optimisation level 0, which halves XLA:CPU's compile times. The level changes
float results in their last bits: a test that starts processes passes them these
XLA_FLAGS (launch.local keeps them), so that what it compares bit for bit is compiled
alike. Training runs and the benchmarks keep XLA's default level.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hetjax.compile.backend import with_cpu_device_count  # noqa: E402 - imports no jax

# Set once: pytest-xdist's workers inherit them from the process that starts them.
flags = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), 8)
if "--xla_backend_optimization_level" not in flags:  # a level of the caller's own stands
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 virtual CPU devices; was jax imported before conftest?"


def pytest_collection_finish(session):
    # A module that set XLA_FLAGS when imported would change what every later test's
    # processes compile (tests/transfer_peer.py once did).
    assert os.environ["XLA_FLAGS"] == flags, f"a test module changed XLA_FLAGS to {os.environ['XLA_FLAGS']!r}"
