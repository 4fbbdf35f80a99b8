"""Every test runs on CPU with 8 virtual devices, set before jax initialises."""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 virtual CPU devices; was jax imported before conftest?"
