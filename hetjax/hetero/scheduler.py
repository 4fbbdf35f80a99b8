"""Where each process of an islands job runs, read from its scheduler's environment.

This is the one place that turns a scheduler's variables into `runtime.ProcessSettings`.
Every source answers the same questions: which island is this process in, what is its
rank there, and on which host does every process of every island run. One function
(`settings`) derives the rest, so SLURM, Kubernetes and launch.local agree on every
coordinator and transfer address:

    hetjax     HETJAX_ISLAND, HETJAX_PROCESS_ID, HETJAX_HOSTS (JSON: island -> host per
               rank; one name per machine, since blocks are counted per name), HETJAX_PORT;
               written by launch.local, or by hand across machines.
    slurm      a heterogeneous job: component k of the `#SBATCH hetjob` script is island k
               of config.hetero.islands (launch/slurm/hetjob.sbatch).
    kubernetes a JobSet with one replicated job per island, named after it
               (launch/k8s/jobset.yaml); pods find each other through its headless service.

A one-mesh job (no islands) over several processes is read the same way, as one island
named `mesh` (`mesh_world`): HETJAX_ISLAND=mesh with HETJAX_NUM_PROCESSES (launch.local
--processes N), a JobSet with one replicated job `mesh` (launch/k8s/mesh.yaml) and
HETJAX_NUM_PROCESSES, or an ordinary SLURM step of several tasks (`srun -n N`,
launch/slurm/mesh.sbatch).

Ports: on each host, the job's processes take consecutive blocks of 1 + num_links ports
from HETJAX_PORT on, in job order (islands in config order, then rank): a block's first
port is its island's coordinator when the process is rank 0, the next ones are its
transfer ports, one per link (runtime.link_address).

    settings = scheduler.from_env(os.environ, cfg)   # None: no islands job here
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

from hetjax.config import Config
from hetjax.errors import ConfigError
from hetjax.hetero.config import PLATFORMS
from hetjax.hetero import runtime
from hetjax.transfer.link import address

ISLAND = "HETJAX_ISLAND"
PROCESS_ID = "HETJAX_PROCESS_ID"
HOSTS = "HETJAX_HOSTS"
PORT = "HETJAX_PORT"
STAND_IN = "HETJAX_STAND_IN"
# Set by launch/k8s/jobset.yaml from the pod's JobSet annotations (the downward API).
K8S_JOBSET = "HETJAX_K8S_JOBSET"
K8S_REPLICATED_JOB = "HETJAX_K8S_REPLICATED_JOB"
K8S_JOB_INDEX = "HETJAX_K8S_JOB_INDEX"
K8S_SUBDOMAIN = "HETJAX_K8S_SUBDOMAIN"
K8S_POD_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job

DEFAULT_PORT = 8476
# SLURM: the job's span of ports (blocks on its busiest node) number job id % (10000 // span)
# from 20000: jobs of one span whose ids are under 10000 // span apart differ (others may
# collide on a shared node: HETJAX_PORT), and all stay below Linux's ephemeral ports.
_SLURM_PORTS = (20000, 10000)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What a scheduler says about one process; `settings` derives everything else."""

    source: str  # hetjax | slurm | kubernetes
    island: str
    rank: int  # within the island
    hosts: dict  # island -> (host of rank 0, host of rank 1, ...)
    port: int  # the job's first port on every host
    stand_in: str = ""  # run on this platform instead of the island's own

    def to_env(self) -> dict[str, str]:
        """The `hetjax` source's variables that describe this placement."""
        return {ISLAND: self.island, PROCESS_ID: str(self.rank), PORT: str(self.port),
                HOSTS: json.dumps({k: list(v) for k, v in self.hosts.items()}), STAND_IN: self.stand_in}


def from_env(environ, cfg: Config) -> runtime.ProcessSettings | None:
    """This process's settings from whichever source is present (HETJAX_ISLAND first, then
    Kubernetes, then a SLURM heterogeneous job); None when none is.

    A variable that does not fit cfg.hetero.islands is a ConfigError naming it, its value
    and the fix.
    """
    placement = placement_from_env(environ, cfg)
    return None if placement is None else settings(placement, cfg)


MESH = "mesh"  # the one island of a one-mesh job's world
NUM_PROCESSES = "HETJAX_NUM_PROCESSES"  # the world's size (hetjax and kubernetes sources)


def mesh_world(environ, cfg: Config) -> runtime.ProcessSettings | None:
    """This process's place in a one-mesh job (no islands) of several processes: its
    settings as rank r of one island named `mesh`; None for a job of one process. (Its
    ports and coordinator depend on the processes only, not on their devices.)"""
    assert not cfg.hetero.islands, "islands jobs read from_env"
    if ISLAND in environ or K8S_JOBSET in environ:
        text = environ.get(NUM_PROCESSES, "")
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"{NUM_PROCESSES}={text!r}: give the number of processes of this one-mesh job "
                              f"(launch.local --processes N and launch/k8s/mesh.yaml set it)")
        count = int(text)
    elif "SLURM_STEP_NUM_TASKS" in environ and "SLURM_HET_SIZE" not in environ:
        count = int(environ["SLURM_STEP_NUM_TASKS"]) if environ["SLURM_STEP_NUM_TASKS"].isdigit() else 0
        if count < 2:
            return None  # srun -n 1, or a batch script's own step: one process
        return settings(_from_slurm_step(environ, cfg, count), one_island(cfg, count, 1))
    else:
        tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
        if "SLURM_HET_SIZE" in environ and tasks.isdigit() and int(tasks) > 1:
            # A one-mesh config in a heterogeneous job's step: each task would train alone.
            raise ConfigError(f"config.hetero.islands is empty, but this is a step of {tasks} tasks of a SLURM "
                              f"heterogeneous job (SLURM_HET_SIZE={environ['SLURM_HET_SIZE']}): each would train "
                              f"alone as process 0, all writing the same run_dir; give a config with islands "
                              f"(launch/slurm/hetjob.sbatch), or run a one-mesh config with launch/slurm/mesh.sbatch")
        if environ.get(NUM_PROCESSES, "1") not in ("", "1"):
            # Each process would train alone as process 0, every one writing the same run_dir.
            raise ConfigError(f"{NUM_PROCESSES}={environ[NUM_PROCESSES]!r} without {ISLAND}: a one-mesh job of "
                              f"several processes also "
                              f"needs {ISLAND}={MESH} (launch.local --processes N sets both), or a Kubernetes "
                              f"JobSet's variables (launch/k8s/mesh.yaml); unset {NUM_PROCESSES} for one process")
        return None
    if count == 1:
        return None
    one = one_island(cfg, count, 1)
    return settings(placement_from_env(environ, one), one)


def mesh_devices_per_process(cfg: Config, processes: int) -> int | None:
    """How many devices each of the `processes` processes of a one-mesh job holds: the
    mesh's size over them; None where config.mesh has a -1 axis (each process's own
    devices decide then)."""
    sizes = [getattr(cfg.mesh, a) for a in ("pipeline", "data", "fsdp", "tensor")]
    if -1 in sizes:
        return None
    if processes < 1 or math.prod(sizes) % processes:
        raise ConfigError(f"config.mesh has {math.prod(sizes)} devices, which do not split evenly over "
                          f"{processes} processes; run a number of processes that divides {math.prod(sizes)}")
    return math.prod(sizes) // processes


def one_island(cfg: Config, num_processes: int, devices_per_process: int, platform: str = "cpu") -> Config:
    """cfg seen as one island `mesh` of num_processes processes (its ports, its coordinator)."""
    from hetjax.hetero.config import IslandConfig
    island = IslandConfig(name=MESH, platform=platform,
                          num_processes=num_processes, devices_per_process=devices_per_process, mesh=cfg.mesh)
    return dataclasses.replace(cfg, hetero=dataclasses.replace(cfg.hetero, islands=(island,)))


def _from_slurm_step(environ, cfg: Config, count: int) -> Placement:
    # An ordinary step (srun -n N): its own node list and tasks per node, block distribution.
    procid = environ.get("SLURM_PROCID", "")
    nodes = expand_hostlist(_need(environ, "SLURM_STEP_NODELIST", "SLURM step"))
    counts = expand_counts(_need(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM step"))
    ranks = [node for node, n in zip(nodes, counts) for _ in range(n)]
    if len(counts) != len(nodes) or len(ranks) != count or not procid.isdigit() or int(procid) >= count:
        raise ConfigError(f"SLURM step: SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']!r}, "
                          f"SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']!r}, "
                          f"SLURM_STEP_NUM_TASKS={count} and SLURM_PROCID={procid!r} disagree; start the "
                          f"processes with srun --distribution=block (launch/slurm/mesh.sbatch)")
    node = environ.get("SLURMD_NODENAME")
    if node and ranks[int(procid)] != node:
        raise ConfigError(f"SLURM_PROCID={procid} belongs on {ranks[int(procid)]!r} under the block distribution, "
                          f"but runs on {node!r} (SLURMD_NODENAME); launch with srun --distribution=block")
    hosts = {MESH: tuple(ranks)}
    port = _port(environ, _slurm_first_port(environ, span(hosts, cfg)))
    return Placement("slurm", MESH, int(procid), hosts, port, _stand_in(environ))


def _slurm_first_port(environ, width: int) -> int:
    # Jobs that share a node take disjoint ranges: whole spans of this job's size.
    job = environ.get("SLURM_JOB_ID", "0")
    return _SLURM_PORTS[0] + (int(job) if job.isdigit() else 0) % max(_SLURM_PORTS[1] // width, 1) * width


def placement_from_env(environ, cfg: Config) -> Placement | None:
    """The Placement of this process, or None when no source's variables are set."""
    if ISLAND in environ:
        return _from_hetjax(environ, cfg)
    if K8S_JOBSET in environ:
        return _from_kubernetes(environ, cfg)
    if "SLURM_HET_SIZE" in environ:
        return _from_slurm(environ, cfg)
    if "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ:
        raise ConfigError("this SLURM job is not heterogeneous (SLURM_HET_SIZE is unset), but "
                          "config.hetero.islands needs one job component per island; submit "
                          "launch/slurm/hetjob.sbatch, or set HETJAX_ISLAND and the other HETJAX_* "
                          "variables yourself")
    return None


def settings(p: Placement, cfg: Config) -> runtime.ProcessSettings:
    """Coordinators and transfer addresses of the job, seen from placement p."""
    islands = cfg.hetero.islands
    per = 1 + runtime.num_links(cfg)  # coordinator port, then one per link
    taken: dict[str, int] = {}  # host -> blocks handed out there
    base = {}
    for i in islands:
        for rank, host in enumerate(p.hosts[i.name]):
            slot = taken.get(host, 0)
            taken[host] = slot + 1
            base[i.name, rank] = (host, p.port + slot * per)
    last = p.port + span(p.hosts, cfg) - 1
    if last > 65535:
        raise ConfigError(f"{PORT}={p.port}: the job needs ports {p.port}..{last} on its busiest host; "
                          f"choose a first port of at most {65535 - last + p.port}")
    coordinator = address(*base[p.island, 0])
    transfer = {i.name: tuple(address(h, port + 1) for h, port in (base[i.name, r] for r in range(i.num_processes)))
                for i in islands}
    island = next(i for i in islands if i.name == p.island)
    return runtime.ProcessSettings(p.island, p.rank, island.num_processes, coordinator, transfer,
                                   p.stand_in, p.source)


def span(hosts: dict, cfg: Config) -> int:
    """Ports the job takes on its busiest host: a block of 1 + links per process there."""
    return max(Counter(h for ranks in hosts.values() for h in ranks).values()) * (1 + runtime.num_links(cfg))


# -- sources ---------------------------------------------------------------------------


def _from_hetjax(environ, cfg: Config) -> Placement:
    islands = _islands(cfg)
    name = environ[ISLAND]
    if name not in islands:
        raise ConfigError(f"{ISLAND}={name!r} is not an island of config.hetero.islands "
                          f"({', '.join(islands) or 'none'}); set it to one of them, or unset it for "
                          f"a single-island run")
    rank = _rank(environ.get(PROCESS_ID, ""), PROCESS_ID, name, islands[name])
    text = environ.get(HOSTS, "")
    try:
        hosts = json.loads(text)
    except json.JSONDecodeError:
        hosts = None
    if not isinstance(hosts, dict) or set(hosts) != set(islands):
        raise ConfigError(f"{HOSTS}={text!r}: give a JSON object with the host of each process, by rank, "
                          f"for every island ({', '.join(islands)}), e.g. "
                          f'{{"{name}": ["10.0.0.1"], ...}}')
    for key, listed in hosts.items():
        n = islands[key].num_processes
        if not isinstance(listed, list) or len(listed) != n or not all(isinstance(h, str) and h for h in listed):
            raise ConfigError(f"{HOSTS}: island {key!r} lists {listed!r} but has {n} process(es) "
                              f"(config.hetero.islands); give one host name or address per process")
    return Placement("hetjax", name, rank, {k: tuple(v) for k, v in hosts.items()},
                     _port(environ, DEFAULT_PORT), _stand_in(environ))


def _from_kubernetes(environ, cfg: Config) -> Placement:
    islands = _islands(cfg)
    jobset = _need(environ, K8S_JOBSET)
    name = _need(environ, K8S_REPLICATED_JOB)
    if name not in islands:
        raise ConfigError(f"{K8S_REPLICATED_JOB}={name!r} (this pod's replicated job) is not an island of "
                          f"config.hetero.islands ({', '.join(islands)}); name each replicated job of the "
                          f"JobSet after its island")
    job_index = _need(environ, K8S_JOB_INDEX)
    if job_index != "0":
        raise ConfigError(f"{K8S_JOB_INDEX}={job_index!r}: an island is one Indexed Job (replicas: 1) "
                          f"with one pod per process (parallelism = completions = num_processes)")
    rank = _rank(environ.get(K8S_POD_INDEX, ""), K8S_POD_INDEX, name, islands[name])
    subdomain = environ.get(K8S_SUBDOMAIN) or jobset
    for key in islands:
        host = f"{jobset}-{key}-0-{islands[key].num_processes - 1}"
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", key) or len(host) > 63:
            raise ConfigError(f"island {key!r}: a JobSet pod is named <jobset>-<island>-0-<rank> ({host!r}), "
                              f"which must be a DNS label (lowercase letters, digits and '-', at most 63 "
                              f"characters); rename the island or shorten the JobSet's name")
    hosts = {key: tuple(f"{jobset}-{key}-0-{r}.{subdomain}" for r in range(i.num_processes))
             for key, i in islands.items()}
    return Placement("kubernetes", name, rank, hosts, _port(environ, DEFAULT_PORT), _stand_in(environ))


def _from_slurm(environ, cfg: Config) -> Placement:
    # A heterogeneous step (srun ... : ...) numbers its tasks across the components in
    # component order (SLURM_PROCID is global), while the per-component node lists and
    # task counts are the job's, suffixed _HET_GROUP_<k>: the component is found by
    # counting ranks, and each rank's host by SLURM's default block distribution.
    islands = cfg.hetero.islands
    size = environ["SLURM_HET_SIZE"]
    if size != str(len(islands)):
        raise ConfigError(f"SLURM_HET_SIZE={size!r}: the job has that many components but config.hetero.islands "
                          f"has {len(islands)} ({', '.join(i.name for i in islands)}); give the batch script "
                          f"one `#SBATCH hetjob` component per island, in the config's order")
    hosts, first, procid = {}, 0, environ.get("SLURM_PROCID", "")
    if not procid.isdigit():
        raise ConfigError(f"SLURM_PROCID={procid!r}: run the processes with srun inside the job "
                          f"(launch/slurm/hetjob.sbatch)")
    mine = None
    for k, island in enumerate(islands):
        nodes = expand_hostlist(_need(environ, f"SLURM_JOB_NODELIST_HET_GROUP_{k}", "SLURM"))
        counts = expand_counts(_need(environ, f"SLURM_TASKS_PER_NODE_HET_GROUP_{k}", "SLURM"))
        if len(counts) != len(nodes):
            raise ConfigError(f"SLURM_TASKS_PER_NODE_HET_GROUP_{k}={environ[f'SLURM_TASKS_PER_NODE_HET_GROUP_{k}']!r} "
                              f"gives {len(counts)} node(s) but SLURM_JOB_NODELIST_HET_GROUP_{k} lists "
                              f"{len(nodes)}")
        ranks = [node for node, n in zip(nodes, counts) for _ in range(n)]
        if len(ranks) != island.num_processes:
            raise ConfigError(f"job component {k} runs {len(ranks)} task(s) (SLURM_TASKS_PER_NODE_HET_GROUP_{k}="
                              f"{environ[f'SLURM_TASKS_PER_NODE_HET_GROUP_{k}']!r}) but island {island.name!r} "
                              f"has num_processes={island.num_processes}; ask for that many tasks in its "
                              f"`#SBATCH hetjob` component (--nodes, --ntasks-per-node)")
        hosts[island.name] = tuple(ranks)
        if first <= int(procid) < first + len(ranks):
            mine = (island.name, int(procid) - first)
        first += len(ranks)
    if mine is None:
        raise ConfigError(f"SLURM_PROCID={procid!r} but the job's components hold {first} task(s); run one "
                          f"heterogeneous step over every component (srun ... : ...)")
    node = environ.get("SLURMD_NODENAME")
    if node and hosts[mine[0]][mine[1]] != node:
        raise ConfigError(f"SLURM_PROCID={procid} is rank {mine[1]} of island {mine[0]!r}, which the block "
                          f"distribution puts on {hosts[mine[0]][mine[1]]!r}, but it runs on {node!r} "
                          f"(SLURMD_NODENAME); launch with srun --distribution=block")
    return Placement("slurm", *mine, hosts, _port(environ, _slurm_first_port(environ, span(hosts, cfg))),
                     _stand_in(environ))


# -- SLURM's notations -----------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, in order: "gpu[001-003,007],amd-[1-2]x" ->
    gpu001 gpu002 gpu003 gpu007 amd-1x amd-2x. A name may hold several bracket groups."""
    hosts: list[str] = []
    for item in _split_top(text):
        names = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            names = [n + literal for n in names]
            if ranges:
                names = [n + r for n in names for r in _expand_ranges(ranges, text)]
        hosts += names
    if not hosts or not all(hosts) or text.count("[") != text.count("]"):
        raise ConfigError(f"SLURM host list {text!r}: expected names like node[01-04,07],other")
    return hosts


def _split_top(text: str) -> list[str]:
    """Splits at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return items + [text[start:]]


def _expand_ranges(ranges: str, text: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ConfigError(f"SLURM host list {text!r}: bad range {part!r} in [{ranges}]")
        out += [str(k).zfill(len(lo)) for k in range(int(lo), int(hi or lo) + 1)]
    return out


def expand_counts(text: str) -> list[int]:
    """SLURM's tasks per node, "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for part in str(text).split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"SLURM tasks per node {text!r}: expected counts like 2(x3),1")
        out += [int(m[1])] * int(m[2] or 1)
    return out


# -- shared checks ---------------------------------------------------------------------


def _islands(cfg: Config) -> dict:
    return {i.name: i for i in cfg.hetero.islands}


def _need(environ, name: str, source: str = "kubernetes") -> str:
    value = environ.get(name, "")
    if value:
        return value
    if source == "SLURM step":
        raise ConfigError(f"{name} is unset; srun sets it for the processes of a step: start them with "
                          f"srun (launch/slurm/mesh.sbatch)")
    if source == "SLURM":
        raise ConfigError(f"{name} is unset; sbatch sets it in a heterogeneous job: submit one "
                          f"`#SBATCH hetjob` component per island (launch/slurm/hetjob.sbatch)")
    raise ConfigError(f"{name} is unset; launch/k8s/jobset.yaml sets it from the pod's JobSet annotations "
                      f"(the downward API); add it to the container's env")


def _rank(text: str, variable: str, name: str, island) -> int:
    if not text.isdigit() or int(text) >= island.num_processes:
        raise ConfigError(f"{variable}={text!r}: island {name!r} has {island.num_processes} "
                          f"process(es); give this process's rank 0..{island.num_processes - 1}")
    return int(text)


def _port(environ, default: int) -> int:
    text = environ.get(PORT, "")
    if not text:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"{PORT}={text!r}: give the job's first port, e.g. {DEFAULT_PORT}")
    return int(text)


def _stand_in(environ) -> str:
    stand_in = environ.get(STAND_IN, "")
    if stand_in and stand_in not in PLATFORMS:
        raise ConfigError(f"{STAND_IN}={stand_in!r}: choose one of {PLATFORMS}, or leave it empty to run "
                          f"on the island's own platform")
    return stand_in
