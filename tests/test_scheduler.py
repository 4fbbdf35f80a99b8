"""hetero.scheduler: recorded SLURM and Kubernetes environments of a 2-island, 4-process
job give every process the right island, rank, coordinator and peers.

The expected addresses are written out by hand from the documented layout (hosts from the
scheduler; on each host, blocks of 1 + num_links ports from the first port, in job order:
the block's first port is the island's coordinator, the next its transfer port)."""

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from hetjax.config import Config, ConfigError, HeteroConfig, IslandConfig, MeshConfig, ModelConfig
from hetjax.hetero import runtime, scheduler

# Island cuda: 2 processes on one 4-GPU node; island rocm: 2 processes on two nodes.
CFG = Config(model=ModelConfig(num_layers=4), batch_size=16, seq_len=16, hetero=HeteroConfig(
    islands=(IslandConfig(name="cuda", platform="cuda", num_processes=2, devices_per_process=2,
                          mesh=MeshConfig(fsdp=4)),
             IslandConfig(name="rocm", platform="rocm", num_processes=2, devices_per_process=2,
                          mesh=MeshConfig(fsdp=4))),
    virtual=False))

# What sbatch and srun put in each task's environment for
#   #SBATCH --partition=h100 --nodes=1 --ntasks-per-node=2 / #SBATCH hetjob / --partition=mi300x --nodes=2
#   srun --distribution=block ... : ...
# (the job's _HET_GROUP_<k> variables, then the step's own, combined over the components).
SLURM_JOB = {
    "SLURM_JOB_ID": "4242", "SLURM_HET_SIZE": "2", "SLURM_JOB_NAME": "hetjax",
    "SLURM_JOB_ID_HET_GROUP_0": "4242", "SLURM_JOB_ID_HET_GROUP_1": "4243",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu017", "SLURM_JOB_NODELIST_HET_GROUP_1": "mi300x-[01-02]",
    "SLURM_JOB_NUM_NODES_HET_GROUP_0": "1", "SLURM_JOB_NUM_NODES_HET_GROUP_1": "2",
    "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "1(x2)",
    "SLURM_JOB_PARTITION_HET_GROUP_0": "h100", "SLURM_JOB_PARTITION_HET_GROUP_1": "mi300x",
    "SLURM_STEP_NODELIST": "gpu017,mi300x-[01-02]", "SLURM_JOB_NODELIST": "gpu017,mi300x-[01-02]",
    "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_TASKS_PER_NODE": "2,1(x2)",
}
SLURM_TASKS = [  # (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURMD_NODENAME)
    ("0", "0", "0", "gpu017"), ("1", "1", "0", "gpu017"), ("2", "0", "1", "mi300x-01"), ("3", "0", "2", "mi300x-02")]

# What a pod of launch/k8s/jobset.yaml sees (JobSet "llm", service "llm", first port 8476).
K8S_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
           "HETJAX_K8S_JOBSET": "llm", "HETJAX_K8S_JOB_INDEX": "0", "HETJAX_K8S_SUBDOMAIN": "llm",
           "HETJAX_PORT": "8476"}


def slurm_env(task):
    procid, localid, nodeid, node = task
    return dict(SLURM_JOB, SLURM_PROCID=procid, SLURM_LOCALID=localid, SLURM_NODEID=nodeid,
                SLURMD_NODENAME=node, SLURM_STEPID="0")


def k8s_env(island, rank):
    return dict(K8S_POD, HETJAX_K8S_REPLICATED_JOB=island, JOB_COMPLETION_INDEX=str(rank),
                HOSTNAME=f"llm-{island}-0-{rank}")


def test_a_slurm_heterogeneous_job_gives_every_process_its_island_rank_coordinator_and_peers():
    got = [scheduler.from_env(slurm_env(t), CFG) for t in SLURM_TASKS]
    assert [(s.island, s.process_id, s.num_processes, s.source) for s in got] == [
        ("cuda", 0, 2, "slurm"), ("cuda", 1, 2, "slurm"), ("rocm", 0, 2, "slurm"), ("rocm", 1, 2, "slurm")]
    # Blocks of 2 ports (coordinator, the one link); gpu017 holds 2 blocks, so the job's span
    # is 4 ports, and job 4242 takes span number 4242 % (10000 // 4) = 1742: first port 26968.
    assert [s.coordinator for s in got] == ["gpu017:26968"] * 2 + ["mi300x-01:26968"] * 2
    peers = {"cuda": ("gpu017:26969", "gpu017:26971"),  # two processes share gpu017: blocks 0 and 1
             "rocm": ("mi300x-01:26969", "mi300x-02:26969")}
    assert all(s.transfer == peers for s in got)
    assert runtime.link_address(got[3], "cuda", 1, link=0) == "gpu017:26971"
    assert all(s.stand_in == "" for s in got)
    # HETJAX_PORT moves the whole block.
    moved = scheduler.from_env(dict(slurm_env(SLURM_TASKS[1]), HETJAX_PORT="30000"), CFG)
    assert moved.coordinator == "gpu017:30000" and moved.transfer["cuda"] == ("gpu017:30001", "gpu017:30003")


def test_a_kubernetes_jobset_gives_every_pod_its_island_rank_coordinator_and_peers():
    got = [scheduler.from_env(k8s_env(i, r), CFG) for i in ("cuda", "rocm") for r in range(2)]
    assert [(s.island, s.process_id, s.source) for s in got] == [
        ("cuda", 0, "kubernetes"), ("cuda", 1, "kubernetes"), ("rocm", 0, "kubernetes"), ("rocm", 1, "kubernetes")]
    assert [s.coordinator for s in got] == ["llm-cuda-0-0.llm:8476"] * 2 + ["llm-rocm-0-0.llm:8476"] * 2
    peers = {"cuda": ("llm-cuda-0-0.llm:8477", "llm-cuda-0-1.llm:8477"),
             "rocm": ("llm-rocm-0-0.llm:8477", "llm-rocm-0-1.llm:8477")}
    assert all(s.transfer == peers for s in got)
    # No HETJAX_K8S_SUBDOMAIN: JobSet's default service is named after the JobSet.
    env = {k: v for k, v in k8s_env("rocm", 1).items() if k != "HETJAX_K8S_SUBDOMAIN"}
    assert scheduler.from_env(env, CFG).coordinator == "llm-rocm-0-0.llm:8476"


def test_three_islands_take_a_port_per_link():
    three = dataclasses.replace(CFG, hetero=dataclasses.replace(CFG.hetero, islands=CFG.hetero.islands + (
        IslandConfig(name="cpu", num_processes=1, devices_per_process=4, mesh=MeshConfig(fsdp=4)),)))
    env = dict(slurm_env(SLURM_TASKS[1]), SLURM_HET_SIZE="3", SLURM_JOB_NODELIST_HET_GROUP_2="gpu017",
               SLURM_TASKS_PER_NODE_HET_GROUP_2="1")
    s = scheduler.from_env(dict(env, HETJAX_PORT="24242"), three)
    # 3 links: blocks of 4 ports; gpu017 holds cuda:0, cuda:1 and then cpu:0.
    assert s.transfer["cuda"] == ("gpu017:24243", "gpu017:24247") and s.transfer["cpu"] == ("gpu017:24251",)
    assert runtime.link_address(s, "cpu", 0, link=2) == "gpu017:24253"
    # Without HETJAX_PORT: a span of 3 blocks x 4 ports, number 4242 % 833 = 77 from 20000.
    assert scheduler.from_env(env, three).coordinator == f"gpu017:{20000 + 77 * 12}"


def test_slurm_jobs_sharing_a_node_take_disjoint_ports():
    def ports(job):
        envs = [dict(slurm_env(t), SLURM_JOB_ID=str(job)) for t in SLURM_TASKS]
        return {(h, p) for s in (scheduler.from_env(e, CFG) for e in envs)
                for h, p in map(runtime.split_address, [s.coordinator, *s.transfer["cuda"], *s.transfer["rocm"]])}
    for job in (4242, 9999, 123456):
        a, b = ports(job), ports(job + 1)
        lo_a, lo_b = min(p for _, p in a), min(p for _, p in b)
        assert abs(lo_a - lo_b) >= 4 and not a & b  # whole spans of 4 ports apart
        assert all(20000 <= p < 30000 for _, p in a | b)


def test_the_explicit_variables_win_over_the_scheduler():
    # launch.local's form (or a user's own) inside an allocation: HETJAX_ISLAND decides.
    env = dict(slurm_env(SLURM_TASKS[0]), HETJAX_ISLAND="rocm", HETJAX_PROCESS_ID="1", HETJAX_PORT="9000",
               HETJAX_HOSTS='{"cuda": ["10.0.0.1", "10.0.0.1"], "rocm": ["10.0.1.1", "10.0.1.2"]}')
    s = scheduler.from_env(env, CFG)
    assert (s.island, s.process_id, s.source, s.coordinator) == ("rocm", 1, "hetjax", "10.0.1.1:9000")
    assert s.transfer == {"cuda": ("10.0.0.1:9001", "10.0.0.1:9003"), "rocm": ("10.0.1.1:9001", "10.0.1.2:9001")}


@pytest.mark.parametrize("source, change, names", [
    ("slurm", {"SLURM_HET_SIZE": "3"}, ["SLURM_HET_SIZE='3'", "2 (cuda, rocm)", "#SBATCH hetjob"]),
    ("slurm", {"SLURM_TASKS_PER_NODE_HET_GROUP_1": "1"}, ["SLURM_TASKS_PER_NODE_HET_GROUP_1='1'", "1 node", "lists 2"]),
    ("slurm", {"SLURM_TASKS_PER_NODE_HET_GROUP_1": "2(x2)"}, ["component 1 runs 4 task", "'rocm'", "num_processes=2"]),
    ("slurm", {"SLURM_TASKS_PER_NODE_HET_GROUP_0": "two"}, ["'two'", "2(x3),1"]),
    ("slurm", {"SLURM_JOB_NODELIST_HET_GROUP_1": "mi300x-[02-01]"}, ["'mi300x-[02-01]'", "'02-01'"]),
    ("slurm", {"SLURM_JOB_NODELIST_HET_GROUP_1": None}, ["SLURM_JOB_NODELIST_HET_GROUP_1 is unset", "hetjob"]),
    ("slurm", {"SLURM_PROCID": "7"}, ["SLURM_PROCID='7'", "4 task", "srun ... : ..."]),
    ("slurm", {"SLURMD_NODENAME": "mi300x-01"}, ["rank 1 of island 'cuda'", "'gpu017'", "'mi300x-01'", "--distribution=block"]),
    ("slurm", {"HETJAX_STAND_IN": "tpu"}, ["HETJAX_STAND_IN='tpu'"]),
    ("kubernetes", {"HETJAX_K8S_REPLICATED_JOB": "gpu"}, ["HETJAX_K8S_REPLICATED_JOB='gpu'", "(cuda, rocm)", "name each replicated job"]),
    ("kubernetes", {"HETJAX_K8S_JOB_INDEX": "1"}, ["HETJAX_K8S_JOB_INDEX='1'", "replicas: 1"]),
    ("kubernetes", {"JOB_COMPLETION_INDEX": "2"}, ["JOB_COMPLETION_INDEX='2'", "'cuda' has 2", "0..1"]),
    ("kubernetes", {"JOB_COMPLETION_INDEX": None}, ["JOB_COMPLETION_INDEX=''"]),
    ("kubernetes", {"HETJAX_K8S_JOB_INDEX": None}, ["HETJAX_K8S_JOB_INDEX is unset", "downward API"]),
    ("kubernetes", {"HETJAX_PORT": "http"}, ["HETJAX_PORT='http'"]),
])
def test_an_environment_that_does_not_fit_the_config_is_a_named_error(source, change, names):
    env = slurm_env(SLURM_TASKS[1]) if source == "slurm" else k8s_env("cuda", 1)
    for k, v in change.items():
        env.pop(k) if v is None else env.__setitem__(k, v)
    with pytest.raises(ConfigError) as e:
        scheduler.from_env(env, CFG)
    for name in names:
        assert name in str(e.value)


def test_a_slurm_job_that_is_not_heterogeneous_is_refused():
    env = {k: v for k, v in slurm_env(SLURM_TASKS[0]).items() if "HET" not in k}
    with pytest.raises(ConfigError, match="not heterogeneous.*SLURM_HET_SIZE.*hetjob.sbatch"):
        scheduler.from_env(env, CFG)


def test_an_island_name_that_is_no_dns_label_is_refused_on_kubernetes():
    cfg = dataclasses.replace(CFG, hetero=dataclasses.replace(CFG.hetero, islands=(
        dataclasses.replace(CFG.hetero.islands[0], name="H100_a"), CFG.hetero.islands[1])))
    with pytest.raises(ConfigError, match=r"island 'H100_a'.*'llm-H100_a-0-1'.*DNS label"):
        scheduler.from_env(k8s_env("rocm", 0), cfg)


def test_no_scheduler_means_no_islands_job():
    assert scheduler.from_env({"PATH": "/bin", "HOME": "/root"}, CFG) is None


def test_slurm_notations_expand_like_slurm():
    assert scheduler.expand_hostlist("gpu[001-003,007],amd-[1-2]x,login") == [
        "gpu001", "gpu002", "gpu003", "gpu007", "amd-1x", "amd-2x", "login"]
    assert scheduler.expand_hostlist("rack[0-1]_blade[8-9]") == [
        "rack0_blade8", "rack0_blade9", "rack1_blade8", "rack1_blade9"]
    assert scheduler.expand_counts("2(x3),1") == [2, 2, 2, 1]
    for bad in ("gpu[1-2", "gpu[x]", "gpu[3-1]", ""):
        with pytest.raises(ConfigError, match="host list"):
            scheduler.expand_hostlist(bad)


def _compress(prefix, numbers, width):
    """A plain reference compressor: runs of consecutive numbers as lo-hi."""
    runs, start = [], None
    for a, b in zip(numbers, numbers[1:] + [None]):
        start = a if start is None else start
        if b != a + 1:
            runs.append(f"{start:0{width}d}" + (f"-{a:0{width}d}" if a != start else ""))
            start = None
    return f"{prefix}[{','.join(runs)}]"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 999), min_size=1, max_size=12), min_size=1, max_size=3),
       st.integers(1, 4))
def test_any_compressed_host_list_expands_to_its_hosts(groups, width):
    text = ",".join(_compress(f"n{k}-", sorted(g), width) for k, g in enumerate(groups))
    want = [f"n{k}-{x:0{width}d}" for k, g in enumerate(groups) for x in sorted(g)]
    assert scheduler.expand_hostlist(text) == want
