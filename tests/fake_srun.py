"""A stand-in for SLURM's srun inside a heterogeneous job, for tests/test_launch_recipes.py.

    srun [opts0] PYTHON -m MODULE ARGS... : [opts1] PYTHON -m MODULE ARGS...   (as `srun`)
    python tests/fake_srun.py --task PYTHON MODULE ARGS...                     (one task)

As srun it does what slurmstepd does for a heterogeneous step: component k (the k-th
`:`-separated part) runs one task per slot of job component k, laid out by block
distribution over FAKE_SLURM_NODES (JSON: per component, [[node, tasks], ...], the test's
own expansion of SLURM_JOB_NODELIST/TASKS_PER_NODE_HET_GROUP_k); each task gets the global
SLURM_PROCID and its SLURMD_NODENAME, and its `PYTHON -m MODULE` becomes `--task`. As a
task it prints, as one JSON line, what hetero.scheduler derives from that environment,
without starting jax's backends.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys


def split_component(part: list[str]) -> tuple[dict, list[str]]:
    """(options, command) of one component; options must be written --name=value or -x."""
    opts, i = {}, 0
    while i < len(part) and part[i].startswith("-"):
        name, eq, value = part[i].partition("=")
        if not eq and name not in ("--label", "-l", "--exclusive"):
            sys.exit(f"fake srun: option {part[i]!r} without '=': the fake cannot tell its value from the command")
        opts.setdefault(name, []).append(value)
        i += 1
    return opts, part[i:]


def srun(argv: list[str]) -> int:
    parts, part = [], []
    for arg in argv:
        if arg == ":":
            parts.append(part)
            part = []
        else:
            part.append(arg)
    parts.append(part)
    nodes = json.loads(os.environ["FAKE_SLURM_NODES"])
    if len(parts) != int(os.environ["SLURM_HET_SIZE"]) or len(parts) != len(nodes):
        sys.exit(f"fake srun: {len(parts)} step component(s) for a job of {os.environ['SLURM_HET_SIZE']}")
    tasks, procid = [], 0
    for k, part in enumerate(parts):
        opts, command = split_component(part)
        if opts.get("--distribution") != ["block"]:
            sys.exit(f"fake srun: component {k} lacks --distribution=block")
        if len(command) < 3 or command[1] != "-m":
            sys.exit(f"fake srun: component {k} runs {command!r}, not PYTHON -m MODULE ...")
        for local_node, (node, count) in enumerate(nodes[k]):
            for local in range(count):
                env = dict(os.environ, SLURM_PROCID=str(procid), SLURMD_NODENAME=node,
                           SLURM_NODEID=str(local_node), SLURM_LOCALID=str(local),
                           FAKE_SRUN_COMPONENT=str(k), FAKE_SRUN_OPTIONS=json.dumps(opts))
                cwd = opts.get("--chdir", [None])[-1]
                tasks.append(subprocess.Popen([sys.executable, __file__, "--task", command[0], *command[2:]],
                                              env=env, cwd=cwd, stdout=subprocess.PIPE, text=True))
                procid += 1
    codes = []
    for t in tasks:  # in task order, like srun --label
        out, _ = t.communicate(timeout=120)
        sys.stdout.write(out)
        codes.append(t.returncode)
    return max(codes)


def task(python: str, module: str, args: list[str]) -> int:
    from hetjax import cli
    from hetjax import config as config_lib
    from hetjax.hetero import scheduler
    line = cli.parse_command_line(args)
    cfg = config_lib.load(line.config, line.overrides)
    s = scheduler.from_env(os.environ, cfg)
    secret = os.environ.get(cfg.hetero.link.secret_env, "")
    print(json.dumps({
        "procid": int(os.environ["SLURM_PROCID"]), "node": os.environ["SLURMD_NODENAME"],
        "component": int(os.environ["FAKE_SRUN_COMPONENT"]), "options": json.loads(os.environ["FAKE_SRUN_OPTIONS"]),
        "python": python, "module": module, "cwd": os.getcwd(), "overrides": line.overrides,
        "island": s.island, "rank": s.process_id, "num_processes": s.num_processes, "source": s.source,
        "coordinator": s.coordinator, "transfer": s.transfer,
        "secret_bytes": len(secret.encode()), "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(),
    }), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--task"]:
        sys.exit(task(sys.argv[2], sys.argv[3], sys.argv[4:]))
    sys.exit(srun(sys.argv[1:]))
