"""Every test runs on CPU with 8 virtual devices, set before jax initialises.

The suite's programs are tiny: each runs for milliseconds and compiles for seconds, in
this process and in every process a test starts. So the suite compiles at XLA's backend
(LLVM) optimisation level 0, which halves XLA:CPU's compile times, and with XLA:CPU's
older (elemental) fusion emitters, which halve them again: the tiny config's train step
compiled in 2.6-3.6 s against 4.7-6.3 s with the new emitters, alternating, 5 runs each.
Both change float results in their last bits: a test that starts processes passes them
these XLA_FLAGS (launch.local keeps them), so that what it compares bit for bit is
compiled alike. Training runs and the benchmarks keep XLA's defaults. XLA aborts on a
flag it does not know, so the emitters' flag is first tried in a child process: a jaxlib
without it compiles with its defaults.
"""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hetjax.compile.backend import with_cpu_device_count  # noqa: E402 - imports no jax

# Set once: pytest-xdist's workers inherit them from the process that starts them.
flags = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), 8)
if "--xla_backend_optimization_level" not in flags:  # a level of the caller's own stands
    flags += " --xla_backend_optimization_level=0"
EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "--xla_cpu_use_fusion_emitters" not in flags and subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
        env={**os.environ, "XLA_FLAGS": f"{flags} {EMITTERS}", "JAX_PLATFORMS": "cpu"}).returncode == 0:
    flags += " " + EMITTERS
os.environ["XLA_FLAGS"] = flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 virtual CPU devices; was jax imported before conftest?"


def pytest_collection_finish(session):
    # A module that set XLA_FLAGS when imported would change what every later test's
    # processes compile (tests/transfer_peer.py once did).
    assert os.environ["XLA_FLAGS"] == flags, f"a test module changed XLA_FLAGS to {os.environ['XLA_FLAGS']!r}"


# The suite is bound by its two cores, not by waiting: a test's CPU time (its own
# threads and the processes it started and waited for) is what it costs the suite's
# wall time, more than its --durations figure does.
def _cpu_seconds():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _count_cpu(item):
    """Adds a test phase's CPU seconds to the test's (a user property: xdist's workers
    send it to the process that prints the summary)."""
    start = _cpu_seconds()
    try:
        return (yield)
    finally:
        spent = dict(item.user_properties).get("cpu_s", 0.0) + _cpu_seconds() - start
        item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != "cpu_s"] + [("cpu_s", spent)]


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_count_cpu)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_count_cpu)
pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(_count_cpu)
_cpu_by_test = {}


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _cpu_by_test[report.nodeid] = dict(report.user_properties).get("cpu_s", 0.0)


@pytest.hookimpl(trylast=True)  # below --durations
def pytest_terminal_summary(terminalreporter):
    if not _cpu_by_test:
        return
    total = sum(_cpu_by_test.values())
    terminalreporter.write_sep("=", f"most CPU time (of {total:.0f} s in all tests)")
    for nodeid, cpu in sorted(_cpu_by_test.items(), key=lambda kv: -kv[1])[:30]:
        terminalreporter.write_line(f"{cpu:7.1f}s cpu  {nodeid}")


# The costliest tests (the CI log's "most CPU time"), run first: xdist hands tests out in
# collection order, and one of these collected last kept a worker busy for a minute after
# the other had finished. Only tests with no module-scoped fixture move: another module's
# test between two of a module's would set its fixture up twice. A name gone stays harmless.
FIRST = ("test_multiprocess.py::test_4_gloo", "test_multiprocess.py::test_2_gloo",
         "test_hetero_processes.py::test_two_islands_of_two_processes", "test_repro.py::test_layouts_agree",
         "test_hetero.py::test_pipeline_islands_train_like_one_island",
         "test_pipeline_interleave.py::test_interleaved_islands_train_like_one_island",
         "test_train.py::test_tiny_config_trains", "test_checkpoint.py::test_sigkill_and_sigterm",
         "test_hetero.py::test_data_islands_train_like_one_island", "test_hetero.py::test_virtual_islands_save",
         "test_hetero_processes.py::test_an_island_still_busy", "test_repro.py::test_interleaved_pipeline_layout")


def pytest_collection_modifyitems(items):
    def first(item) -> bool:
        shared = any(d.scope in ("module", "package", "class")
                     for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)
        return not shared and any(f in item.nodeid for f in FIRST)
    items.sort(key=lambda item: not first(item))  # stable: the rest keep their order
