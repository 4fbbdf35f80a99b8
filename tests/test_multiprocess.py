"""One mesh over several processes (no islands): launch.local --processes N starts one
jax.distributed world (gloo on CPU) whose losses and batches are the one-process run's,
whose checkpoints resume bit-identically after a SIGKILL or a SIGTERM to one process
(every process stops at the same step), and which stops as a whole, with jax's named
heartbeat error, when one process dies."""

import io
import json
import os
import re
import signal
import time

import pytest

from hetjax.errors import ConfigError
from hetjax.hetero import scheduler
from hetjax.launch import local

CONFIG = """
from hetjax.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig

def get_config():
    return Config(
        model=ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, mlp_dim=64, num_heads=2,
                          num_kv_heads=1, head_dim=16, rope_theta=10_000.0),
        optim=OptimConfig(learning_rate=1e-2, warmup_steps=2),
        data=DataConfig(num_states=8, branching=4, mean_doc_length=12, num_documents=500),
        mesh=MeshConfig(fsdp=4),
        steps=8, batch_size=8, seq_len=16, log_every=1, eval_every=0, tensorboard=False,
        peak_tflops=1.0)  # no matmul measured for MFU in each process
"""
# A dead peer is noticed by jax's heartbeats (half of hetero.timeout_s); 30 s stays above
# a first step's compile on a busy 2-core machine.
TIMEOUT = 30.0
STEPS = 8


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh") / "mesh.py"
    path.write_text(CONFIG)
    return str(path)


def rows(run_dir, name="fingerprints.jsonl"):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def steps_of(run_dir):
    """step -> (loss, batch digest) as process 0 recorded them."""
    return {r["step"]: (r["loss"], r["batch"]) for r in rows(run_dir) if r.get("kind") == "step"}


def run_world(cfg_path, run_dir, n, overrides=(), **kw):
    """launch.local --processes n; process 0's (loss, batch digest) per step."""
    code = local.run(cfg_path, {"run_dir": str(run_dir), "hetero.timeout_s": str(TIMEOUT), **dict(overrides)},
                     processes=n, out=io.StringIO(), **kw)
    assert code == 0, (run_dir / "logs" / "mesh-0.log").read_text()[-3000:]
    return steps_of(run_dir)


@pytest.fixture(scope="module")
def one(cfg_path, tmp_path_factory):
    """The same mesh's 4 devices in one process (no jax.distributed)."""
    return run_world(cfg_path, tmp_path_factory.mktemp("one") / "run", 1)


def check_world(one, many, run_dir, n):
    assert sorted(one) == sorted(many) == list(range(STEPS))
    for s in one:
        assert many[s][1] == one[s][1], (s, "batch digests differ")
        assert many[s][0] == pytest.approx(one[s][0], rel=1e-5, abs=1e-5), (s, many[s][0], one[s][0])
    assert one[STEPS - 1][0] < one[0][0] - 0.2  # it trained
    # One world: process 0 writes the run's files, the others their own below processes/.
    for p in range(1, n):
        theirs = [r for r in rows(run_dir / "processes" / str(p), "metrics.jsonl") if "loss" in r]
        assert [r["loss"] for r in theirs] == [many[s][0] for s in range(STEPS)]
    assert f"process 0 of {n} in one jax.distributed world" in (run_dir / "logs" / "mesh-0.log").read_text()


# Two tests, so that `pytest -n 2` runs them side by side (each starts its own processes).
def test_4_gloo_processes_give_the_one_process_losses_and_identical_batches(cfg_path, one, tmp_path):
    """...and a SIGTERM that reaches one process only stops all four at the same step
    (each saves it: a save is collective), from which the job resumes. As data=2 x fsdp=2
    with gradients summed over `data` once a step (config.sharding.grad_sync), against the
    one process's fsdp=4."""
    run_dir, sent = tmp_path / "run", []
    once = {"mesh.data": "2", "mesh.fsdp": "-1", "sharding.grad_sync": "once"}

    def on_line(proc, line):
        if proc.settings.tag == "mesh:3" and line.startswith("step 1:") and not sent:
            sent.append(line)
            os.kill(proc.popen.pid, signal.SIGTERM)

    overrides = {"run_dir": str(run_dir), "hetero.timeout_s": str(TIMEOUT), **once}
    code = local.run(cfg_path, overrides, processes=4, on_line=on_line, out=(out := io.StringIO()))
    assert code == 143, out.getvalue()[-3000:]
    saved = re.findall(r"^\[mesh:(\d)\] preempted \(SIGTERM\): saved step (\d+)", out.getvalue(), re.M)
    assert sorted(p for p, _ in saved) == ["0", "1", "2", "3"], out.getvalue()[-3000:]
    assert len({s for _, s in saved}) == 1 and int(saved[0][1]) < STEPS, saved
    check_world(one, run_world(cfg_path, run_dir, 4, once), run_dir, 4)
    assert "gradients summed over data=2 once a step" in (run_dir / "logs" / "mesh-0.log").read_text()


def test_2_gloo_processes_match_one_and_a_killed_world_stops_then_resumes_bit_identically(cfg_path, one, tmp_path):
    # As CPU stand-ins for a CUDA config (--stand_in cpu): that flag was ignored, and the
    # processes ran under the cuda profile and its compilation cache.
    whole = run_world(cfg_path, tmp_path / "whole", 2, {"compile.platform": "cuda"}, stand_in="cpu")
    check_world(one, whole, tmp_path / "whole", 2)
    log = (tmp_path / "whole" / "logs" / "mesh-0.log").read_text()
    assert "backend profile cpu" in log and "cpu standing in for cuda" in log, log[:2000]
    run_dir, killed = tmp_path / "run", {}

    def saved():  # orbax renames a step's directory to its number once it is complete
        return (run_dir / "checkpoints" / "4").is_dir()

    def on_line(proc, line):  # SIGKILL rank 1 once step 4's checkpoint exists
        if proc.settings.tag == "mesh:1" and line.startswith("step ") and not killed and saved():
            killed["at"] = time.monotonic()
            os.kill(proc.popen.pid, signal.SIGKILL)

    overrides = {"run_dir": str(run_dir), "checkpoint.every": "2", "hetero.timeout_s": str(TIMEOUT)}
    code = local.run(cfg_path, overrides, processes=2, on_line=on_line, out=(out := io.StringIO()))
    took = time.monotonic() - killed["at"]
    assert code == 128 + signal.SIGKILL, out.getvalue()[-3000:]
    assert "[launch] island mesh rank 1 exited with signal 9" in out.getvalue()
    # Rank 0 was blocked in a collective with the dead rank: jax's coordination service
    # names the dead task and ends it, before the launcher's own timeout.
    assert "mesh:0 stopped by itself" in out.getvalue() and took < TIMEOUT, (out.getvalue()[-2000:], took)
    assert "stopped sending heartbeats" in (run_dir / "logs" / "mesh-0.log").read_text()
    assert max(steps_of(run_dir)) < STEPS - 1, "the job ended before the kill: nothing was tested"
    # The newest step damaged where only rank 1 reads it: rank 0 reads the step, rank 1
    # cannot, and the two cannot agree inside orbax's read. The job stops naming the step (it
    # used to crash in mismatched collectives, and again at every start); the next start
    # sets the step aside on every process and resumes from the one before, after the
    # SIGKILL as after any stop: bit-identical to the whole run.
    latest = max(int(d.name) for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit())
    assert latest in (4, 6), latest
    shards = list((run_dir / "checkpoints" / str(latest) / "params").glob("ocdbt.process_1/d/*"))
    assert shards
    for f in shards:
        f.write_bytes(b"damaged" * 100)
    # (rank 1 waits hetero.timeout_s to hear whether rank 0 failed too: it did not)
    assert local.run(cfg_path, dict(overrides, **{"hetero.timeout_s": "10"}), processes=2, out=io.StringIO()) != 0
    assert f"process 1 cannot read checkpoint step {latest}" in (run_dir / "logs" / "mesh-1.log").read_text()
    assert local.run(cfg_path, overrides, processes=2, out=(out := io.StringIO())) == 0, out.getvalue()[-3000:]
    assert "moved the partly unreadable checkpoint" in out.getvalue()
    assert f"[mesh:1] resumed from step {latest - 2}" in out.getvalue(), out.getvalue()[-3000:]
    assert steps_of(run_dir) == whole


def test_the_scheduler_reads_a_one_mesh_world_from_each_source(cfg_path):
    from hetjax import config as config_lib
    cfg = config_lib.load(cfg_path)
    assert scheduler.mesh_world({}, cfg) is None
    assert scheduler.mesh_world({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, cfg) is None
    slurm = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURMD_NODENAME": "gpu02"}
    s = scheduler.mesh_world(slurm, cfg)
    assert (s.island, s.process_id, s.num_processes, s.source) == ("mesh", 3, 4, "slurm")
    first = scheduler.mesh_world(dict(slurm, SLURM_PROCID="0", SLURMD_NODENAME="gpu01"), cfg)
    assert s.coordinator.startswith("gpu01:") and first.coordinator == s.coordinator
    k8s = {"HETJAX_K8S_JOBSET": "run", "HETJAX_K8S_REPLICATED_JOB": "mesh", "HETJAX_K8S_JOB_INDEX": "0",
           "JOB_COMPLETION_INDEX": "1", "HETJAX_K8S_SUBDOMAIN": "svc", "HETJAX_NUM_PROCESSES": "2"}
    s = scheduler.mesh_world(k8s, cfg)
    assert (s.process_id, s.num_processes, s.coordinator) == (1, 2, "run-mesh-0-0.svc:8476")
    for env, names in ((dict(k8s, HETJAX_NUM_PROCESSES="x"), "HETJAX_NUM_PROCESSES='x'"),
                       (dict(slurm, SLURM_STEP_TASKS_PER_NODE="1"), "SLURM_STEP_TASKS_PER_NODE='1'"),
                       (dict(slurm, SLURMD_NODENAME="gpu01"), "SLURMD_NODENAME")):
        with pytest.raises(ConfigError, match=names):
            scheduler.mesh_world(env, cfg)
    # A plain Indexed Job, or a hand launch without HETJAX_ISLAND: each process trained alone.
    for env in ({"HETJAX_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": "1"},
                {"HETJAX_NUM_PROCESSES": "2", "HETJAX_PROCESS_ID": "1", "HETJAX_HOSTS": '{"mesh": ["a", "b"]}'}):
        with pytest.raises(ConfigError, match="HETJAX_NUM_PROCESSES='2' without HETJAX_ISLAND: .* HETJAX_ISLAND=mesh"):
            scheduler.mesh_world(env, cfg)
    assert scheduler.mesh_world({"HETJAX_NUM_PROCESSES": "1"}, cfg) is None
    # A one-mesh config in a heterogeneous job's step (hetjob.sbatch given a config without
    # islands): each task trained alone as process 0.
    het = dict(slurm, SLURM_HET_SIZE="2", SLURM_JOB_NODELIST_HET_GROUP_1="mi300x-01")
    with pytest.raises(ConfigError, match=r"config.hetero.islands is empty, but this is a step of 4 tasks of a SLURM "
                                          r"heterogeneous job .*launch/slurm/mesh.sbatch"):
        scheduler.mesh_world(het, cfg)
    assert scheduler.mesh_world(dict(het, SLURM_STEP_NUM_TASKS="1"), cfg) is None
    with pytest.raises(ConfigError, match="--processes=3"):
        local.run(cfg_path, processes=3)  # 4 devices do not split over 3 processes


def test_a_run_dir_that_is_not_shared_is_refused_before_compiling(cfg_path, tmp_path):
    """Each process with its own run_dir (node-local disks): both trained to the first
    save, then hung in orbax's commit, past hetero.timeout_s and deaf to SIGTERM."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update({scheduler.ISLAND: "mesh", scheduler.NUM_PROCESSES: "2", scheduler.PORT: str(local.free_ports(1, 4)[0]),
                scheduler.HOSTS: json.dumps({"mesh": ["127.0.0.1", "127.0.0.1"]}), "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": os.getcwd()})
    procs = [subprocess.Popen([sys.executable, "-m", "hetjax.train", "--config", cfg_path, "--config.steps=4",
                               f"--config.run_dir={tmp_path / f'node{p}'}", f"--config.hetero.timeout_s={TIMEOUT}"],
                              env={**env, scheduler.PROCESS_ID: str(p)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for p in range(2)]
    try:
        outs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        [proc.kill() for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], outs
    assert f"checkpoint directory {tmp_path / 'node0' / 'checkpoints'}: process 1 (" in outs[0], outs[0]
    assert "does not see the file process 0" in outs[0] and "on storage that every node mounts" in outs[0]
    assert f"is not the one process 0 uses ({tmp_path / 'node0' / 'checkpoints'})" in outs[1], outs[1]
    assert not any("compiled the train step" in out for out in outs)
    assert not list((tmp_path / "node0" / "checkpoints").iterdir())  # process 0's file is gone
