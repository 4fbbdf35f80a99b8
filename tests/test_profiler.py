"""config.profile_steps=A:B: the trace a run writes holds exactly steps A..B-1, and both of
its files parse: the XSpace TensorBoard's profile plugin reads, and Perfetto's JSON."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from jax.profiler import ProfileData

from hetjax import profiler

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
    assert f"profile of steps 1..3 (config.profile_steps=1:4) in {run_dir / 'profile'}" in (run_dir / "stdout.txt").read_text()
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


def test_a_run_resumed_inside_the_window_traces_its_rest_and_says_which_steps_it_traced(tmp_path):
    """It named steps up to B-1 when it ended first; resumed past the whole window, it says
    at its first step that nothing is traced (it used to say nothing at all)."""
    import jax.numpy as jnp
    for window, steps, traced in (("1:4", range(2, 6), "steps 2..3"), ("2:10", range(0, 5), "steps 2..4"),
                                  ("1:3", range(3, 6), None)):
        said = []
        p = profiler.Profiler(window, tmp_path / window.replace(":", "_"), said.append)
        for s in steps:
            p.before(s)
            with p.step(s):
                x = jnp.ones(4) * s
            p.after(s, x)
        p.close()
        if traced is None:  # the window lies before the run's first step
            assert said == ["no profile: config.profile_steps=1:3 ends before step 3, this run's first step "
                            "(it resumed past the window), so nothing is traced"], said
            assert not (tmp_path / "1_3").exists()
        else:
            assert said == [f"profile of {traced} (config.profile_steps={window}) in {p.directory}"], said
            assert list(p.directory.rglob("*.xplane.pb"))


def test_kernel_summary_counts_overlapping_kernels_once_and_sorts_them_by_kind(tmp_path):
    # A device track as jax's perfetto trace writes it: two streams whose kernels overlap.
    events = [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "tid": 1, "ts": 1000, "dur": 100, "name": "sm90_xmma_gemm_bf16"},
        {"ph": "X", "pid": 7, "tid": 2, "ts": 1050, "dur": 100, "name": "loop_add_fusion"},
        {"ph": "X", "pid": 7, "tid": 1, "ts": 1200, "dur": 30, "name": "ncclDevKernel_AllReduce"},
        {"ph": "X", "pid": 7, "tid": 1, "ts": 1230, "dur": 20, "name": "ncclDevKernel_AllReduce"},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 5000, "name": "PjitFunction(step)"},  # host: not counted
    ]
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    lines = profiler.kernel_summary(tmp_path)
    # busy: 1000..1150 and 1200..1250 = 200 us of the 250 us from the first start to the last end
    assert lines[0] == "/device:GPU:0: kernels busy 0.2 ms of 0.2 ms traced (80.0%), 4 kernels"
    assert lines[1] == "kernel time by kind: matmul 40.0%, other 40.0%, collective 20.0%"
    assert "x1     [matmul] sm90_xmma_gemm_bf16" in lines[2] and len(lines) == 5
    assert lines[4].endswith("x2     [collective] ncclDevKernel_AllReduce"), lines
    assert profiler.kernel_summary(tmp_path / "none") == []
