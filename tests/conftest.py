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

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 virtual CPU devices; was jax imported before conftest?"
