"""config.profile_steps=A:B: the trace a run writes holds exactly steps A..B-1, and both of
its files parse: the XSpace TensorBoard's profile plugin reads, and Perfetto's JSON."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from jax.profiler import ProfileData

ROOT = Path(__file__).resolve().parent.parent


def shared_cache(tmp_path_factory) -> str:
    # One compilation cache for the session (all xdist workers): tiny compiles once.
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny1_jax_cache")


# Trains tiny on one device for 5 steps, tracing steps 1..3, with a batch iterator that takes
# 0.1 s per batch, as a starved input pipeline would (test_metrics reads its data waits).
SLOW_TRACED = """
import sys, time
from hetjax import data, train

class Slow:
    def __init__(self, inner):
        self.inner = inner
    def __next__(self):
        time.sleep(0.1)
        return next(self.inner)
    def __getattr__(self, name):
        return getattr(self.inner, name)

build = data.build
def slow_build(cfg):
    ds = build(cfg)
    make = ds.iterator
    ds.iterator = lambda *a, **k: Slow(make(*a, **k))
    return ds
data.build = slow_build
sys.exit(train.main(["--config", "tiny", "--config.run_dir=" + sys.argv[1], "--config.steps=5",
                     "--config.compile.cache_dir=" + sys.argv[2], "--config.profile_steps=1:4",
                     "--config.eval_every=0", "--config.tensorboard=false", "--config.checkpoint.every=0"]))
"""
def slow_traced_run(tmp_path_factory) -> Path:
    """The run directory of SLOW_TRACED, trained once per session (xdist workers share it:
    the first to take the lock trains, the others wait and read)."""
    import fcntl
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    run_dir = shared / "slow_traced"
    with open(shared / "slow_traced.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run_dir / "stdout.txt").exists():
            env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one device: fast
            r = subprocess.run([sys.executable, "-c", SLOW_TRACED, str(run_dir), shared_cache(tmp_path_factory)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            (run_dir / "stdout.txt").write_text(r.stdout)
    return run_dir


def test_a_one_mesh_run_traces_its_window_into_files_tensorboard_and_perfetto_open(tmp_path_factory):
    run_dir = slow_traced_run(tmp_path_factory)
    assert f"profile of steps 1..3 in {run_dir / 'profile'}" in (run_dir / "stdout.txt").read_text()
    # TensorBoard's layout: profile/plugins/profile/<time>/<host>.xplane.pb
    xplanes = list((run_dir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(xplanes) == 1, xplanes
    names = [e.name for plane in ProfileData.from_file(str(xplanes[0])).planes
             for line in plane.lines for e in line.events]
    assert names.count("train") == 3  # one StepTraceAnnotation per traced step: 1, 2, 3
    assert sum("jit(train_step)" in n for n in names) >= 3  # the compiled step, each time
    perfetto = xplanes[0].parent / "perfetto_trace.json.gz"
    events = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    steps = sorted(e["args"]["step_num"] for e in events if e.get("name") == "train")
    assert steps == ["1", "2", "3"], steps
