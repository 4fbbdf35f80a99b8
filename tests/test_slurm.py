"""A real one-node SLURM cluster (launch/slurm/cluster.sh: slurmctld, slurmd, munge) runs
the SLURM recipes with CPU stand-ins: mesh.sbatch (`srun -n 2`, one jax.distributed world)
and hetjob.sbatch's two islands (as one step: see its test) train with the losses of the
same job under launch.local and, cancelled (scancel: SIGTERM), resume from a checkpoint.

Skipped where SLURM is not installed (`apt-get install slurm-wlm munge`; CI does not)."""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetjax.compile import backend
from hetjax.launch import local
from tests import test_multiprocess

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "launch" / "slurm"
pytestmark = pytest.mark.skipif(not (shutil.which("slurmctld") or Path("/usr/sbin/slurmctld").exists()),
                                reason="SLURM is not installed (apt-get install slurm-wlm munge)")

# tests/test_multiprocess.py's one-mesh job, longer and saving every 2 steps (for scancel).
MESH = test_multiprocess.CONFIG + """
_shorter = get_config

def get_config():
    import dataclasses
    from hetjax.config import CheckpointConfig
    return dataclasses.replace(_shorter(), steps=30, checkpoint=CheckpointConfig(every=2))
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment to reach the cluster (SLURM_CONF), the cluster brought up for it."""
    run = subprocess.run([str(SLURM / "cluster.sh"), "up"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    conf = re.search(r"export SLURM_CONF=(\S+)", run.stdout)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
    env.update(SLURM_CONF=conf, JAX_PLATFORMS="cpu", HETJAX_REPO=str(ROOT), HETJAX_PYTHON=sys.executable,
               XLA_FLAGS=backend.with_cpu_device_count(os.environ["XLA_FLAGS"], 2), HETJAX_STAND_IN="cpu")
    yield env
    if "already up" not in run.stdout:
        subprocess.run([str(SLURM / "cluster.sh"), "down"], capture_output=True, timeout=60)


def cpu_variant(script: Path, tmp_path: Path) -> Path:
    """The recipe as it is, less what a CPU-only cluster lacks (GPUs, GPU partitions)."""
    text = "\n".join(line for line in script.read_text().splitlines()
                     if not re.match(r"#SBATCH --(gpus-per-node|exclusive|partition)", line))
    path = tmp_path / script.name
    path.write_text(text + "\n")
    return path


def sbatch(env, *args) -> str:
    run = subprocess.run(["sbatch", "--parsable", *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().split(";")[0]


def job_state(env, job: str) -> str:
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    found = re.search(r"JobState=(\w+)", text)
    return found[1] if found else "GONE"


def wait_done(env, job: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while (state := job_state(env, job)) in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout}s"
        time.sleep(0.5)
    return state


def losses(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_mesh_sbatch_trains_as_launch_local_does_and_resumes_after_scancel(slurm, tmp_path):
    cfg = tmp_path / "mesh.py"
    cfg.write_text(MESH)
    script, run_dir = cpu_variant(SLURM / "mesh.sbatch", tmp_path), tmp_path / "slurm"
    env = dict(slurm, CONFIG=str(cfg), RUN_DIR=str(run_dir))
    job = sbatch(env, "--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/%j.out", f"--chdir={tmp_path}",
                 script)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints").is_dir() or not any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir()):
        assert time.monotonic() < deadline and job_state(env, job) in ("PENDING", "RUNNING"), \
            (job_state(env, job), (tmp_path / f"{job}.out").read_text()[-3000:])
        time.sleep(0.1)
    subprocess.run(["scancel", job], env=env, check=True)  # SIGTERM to every task, then SIGKILL
    assert wait_done(env, job) == "CANCELLED"
    out = (tmp_path / f"{job}.out").read_text()
    assert re.search(r"^0: preempted \(SIGTERM\): saved step \d+", out, re.M), out[-3000:]
    assert "process 1 of 2 in one jax.distributed world" in out and "from slurm" in out
    assert max(losses(run_dir)) < 29, "the job ended before scancel: nothing was tested"

    again = sbatch(env, "--nodes=1", "--ntasks-per-node=2", f"--output={tmp_path}/%j.out", f"--chdir={tmp_path}",
                   script)
    assert wait_done(env, again) == "COMPLETED", (tmp_path / f"{again}.out").read_text()[-3000:]
    out = (tmp_path / f"{again}.out").read_text()
    assert re.search(r"^0: resumed from step \d+", out, re.M), out[-3000:]
    # The same job under launch.local (the cores unpinned, as SLURM leaves them here).
    assert local.run(str(cfg), {"run_dir": str(tmp_path / "local")}, processes=2, pin="off",
                     out=io.StringIO()) == 0
    want, got = losses(tmp_path / "local"), losses(run_dir)
    assert sorted(got) == sorted(want) == list(range(30))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), [(s, got[s], want[s]) for s in want]


def test_hetjob_cannot_share_one_node_so_its_components_run_as_one_step(slurm, tmp_path):
    # What SLURM says of a heterogeneous allocation on a cluster of one node: each
    # component takes nodes of its own.
    run = subprocess.run(["salloc", "-n", "2", "srun", "-n", "1", "true", ":", "-n", "1", "true"],
                         env=slurm, capture_output=True, text=True, timeout=120)
    assert "already allocated 1 nodes to previous components" in run.stderr, run.stderr
    # The closest real equivalent: one SLURM step whose task k runs component k of
    # hetjob.sbatch (island k), placed as the heterogeneous job would place it.
    run_dir, islands = tmp_path / "slurm", ("cuda", "rocm")
    common = ["--config", "configs/tiny_hetero.py", "--config.hetero.virtual=False", "--config.steps=40",
              "--config.log_every=1", "--config.eval_every=0", "--config.tensorboard=False",
              "--config.hetero.link.backend=host", "--config.checkpoint.every=2"]
    task = tmp_path / "component.sh"
    task.write_text(f"""#!/bin/bash
islands=({' '.join(islands)})
export HETJAX_ISLAND=${{islands[$SLURM_PROCID]}} HETJAX_PROCESS_ID=0 HETJAX_PORT={local.free_ports(1, 4)[0]}
# By address: on a one-node cluster the node's name resolves to loopback (Debian's
# /etc/hosts), which the islands refuse for a name (runtime.listen_address).
export HETJAX_HOSTS='{{"cuda": ["127.0.0.1"], "rocm": ["127.0.0.1"]}}'
cd {ROOT}
exec {sys.executable} -m hetjax.train {' '.join(common)} --config.run_dir={run_dir}
""")
    task.chmod(0o755)
    env = dict(slurm, HETJAX_TRANSFER_SECRET="s" * 32)

    def submit():
        return sbatch(env, "-n", "2", f"--output={tmp_path}/%j.out", "--wrap",
                      f"exec srun --label {task}")

    def held(island):  # orbax renames a step's directory to its number once it is complete
        d = run_dir / "checkpoints" / island
        return d.is_dir() and any(p.name.isdigit() for p in d.iterdir())

    job, deadline = submit(), time.monotonic() + 300
    while not all(held(i) for i in islands):
        assert time.monotonic() < deadline and job_state(env, job) in ("PENDING", "RUNNING"), \
            (job_state(env, job), (tmp_path / f"{job}.out").read_text()[-3000:])
        time.sleep(0.1)
    subprocess.run(["scancel", job], env=env, check=True)  # SIGTERM to both islands
    assert wait_done(env, job) == "CANCELLED"
    out = (tmp_path / f"{job}.out").read_text()
    assert len(re.findall(r"^\d: preempted \(SIGTERM\): saved step \d+", out, re.M)) == 2, out[-3000:]
    assert max(losses(run_dir)) < 39, "the job ended before scancel: nothing was tested"
    again = submit()
    assert wait_done(env, again) == "COMPLETED", (tmp_path / f"{again}.out").read_text()[-3000:]
    assert re.search(r"resumed", (tmp_path / f"{again}.out").read_text()), (tmp_path / f"{again}.out").read_text()[-3000:]
    assert local.run(str(ROOT / "configs/tiny_hetero.py"),
                     {k.split("=")[0][9:]: k.split("=")[1] for k in common if k.startswith("--config.")}
                     | {"run_dir": str(tmp_path / "local")}, stand_in="cpu", pin="off", out=io.StringIO()) == 0
    want, got = losses(tmp_path / "local"), losses(run_dir)
    assert sorted(got) == sorted(want) == list(range(40))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), [(s, got[s], want[s]) for s in want]
