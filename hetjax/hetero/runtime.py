"""One process of an island: its settings and its jax.distributed start.

Each island is its own `jax.distributed` world with its own coordinator; processes of
different islands meet only through the transfer primitive, at the addresses listed
here. hetero.scheduler derives the settings from the scheduler's environment (SLURM,
Kubernetes, or launch.local's HETJAX_* variables).

    settings = scheduler.from_env(os.environ, cfg)                  # None: not an islands job
    runtime.initialize(settings, island_cfg, cfg.hetero.timeout_s)  # before jax.devices()
    runtime.link_address(settings, "b", 0, link=0)   # "host:port" of a peer's endpoint
"""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import math
import os
import signal
import socket
import sys

from hetjax.config import Config
from hetjax.errors import ConfigError
from hetjax import stop
from hetjax.hetero.config import IslandConfig
from hetjax.transfer.link import address, retry
from hetjax.errors import IslandStartError  # noqa: F401 - raised here, caught by callers


CPUS_VARIABLE = "HETJAX_CPUS"  # cores this process keeps to (launch.local's stand-in islands)
LAUNCHER_VARIABLE = "HETJAX_LAUNCHER_PID"  # launch.local's pid: its processes end with it


def follow_launcher(environ=None) -> None:
    """Has Linux send this process SIGTERM (hetjax.train saves and exits) when the
    launch.local that started it dies, even of a SIGKILL that leaves the launcher no
    chance to stop its processes. Called first thing in each process it starts."""
    environ = os.environ if environ is None else environ
    launcher = environ.pop(LAUNCHER_VARIABLE, "")  # not for the processes this one starts
    if launcher.isdigit():
        stop.end_with_parent(signal.SIGTERM, int(launcher))
        # The launcher read this process's output: dead, it leaves a pipe without a reader,
        # and the next print would raise BrokenPipeError before the SIGTERM's save.
        sys.stdout, sys.stderr = _Outlives(sys.stdout), _Outlives(sys.stderr)


class _Outlives:
    """A text stream whose writes go to /dev/null once its reader is gone."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())  # what is still buffered goes there too
        os.close(null)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """Where one process belongs: its island, its rank there, and every transfer address."""

    island: str
    process_id: int  # rank within the island
    num_processes: int  # of this island
    coordinator: str  # "host:port" of this island's jax.distributed coordinator
    # island name -> one "host:port" base address per process of that island; the
    # process listens for link k on base port + k (see link_address).
    transfer: dict
    stand_in: str = ""  # run on this platform instead of the island's own ("cpu" here)
    source: str = "hetjax"  # where these came from: hetjax | slurm | kubernetes (hetero.scheduler)

    @property
    def tag(self) -> str:
        """`island:rank`, how logs and errors name this process."""
        return f"{self.island}:{self.process_id}"

    def platform(self, island: IslandConfig) -> str:
        """The platform this process really runs on."""
        return self.stand_in or island.platform


def split_address(text: str, where: str = "address") -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port); a ConfigError naming `where` otherwise."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}={text!r}: expected host:port, e.g. 127.0.0.1:8476")
    return host, int(port)


def num_links(cfg: Config) -> int:
    """Transfer ports a process needs: one per pair of islands (hetero.links.pair_index
    numbers neighbours k, k+1 as link k, then the other pairs)."""
    n = len(cfg.hetero.islands)
    return max(n * (n - 1) // 2, 1)


def link_address(settings: ProcessSettings, island: str, process: int, link: int) -> str:
    """"host:port" where `process` of `island` listens for link number `link` (base port + link;
    link k joins islands k and k+1)."""
    if island not in settings.transfer or not 0 <= process < len(settings.transfer[island]):
        raise ValueError(f"no transfer address for process {process} of island {island!r}; "
                         f"known: { {k: len(v) for k, v in settings.transfer.items()} }")
    assert link >= 0, link
    host, port = split_address(settings.transfer[island][process], f"transfer address of island {island!r}")
    return address(host, port + link)


def distributed_kwargs(timeout_s: float) -> dict[str, int]:
    """jax.distributed.initialize's timeouts, as far as the installed jax knows them: the
    world must form, notice a dead member and shut down within about timeout_s."""
    import jax
    seconds = max(1, math.ceil(timeout_s))
    # The coordination service notices a silent member up to a heartbeat timeout after
    # the first one passed (measured: 4-8 s for 4 s), so half of timeout_s keeps the
    # whole detection inside it.
    heartbeat = max(2, math.ceil(timeout_s / 2))
    wanted = {"initialization_timeout": seconds, "heartbeat_timeout_seconds": heartbeat,
              "shutdown_timeout_seconds": seconds,
              # Our settings are the whole truth: jax's own SLURM detection would otherwise
              # fill local_device_ids with SLURM_LOCALID and hide all GPUs but one, and its
              # Kubernetes detection would call the API server.
              "cluster_detection_method": "deactivate"}
    known = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in wanted.items() if k in known}


def resolve(text: str, timeout_s: float, what: str) -> str:
    """"host:port" with the host's IP address: jax's transfer server wants addresses, and a
    pod's DNS name exists only once the pod does, so a name is retried up to timeout_s.
    IPv4 first, so that both ends of a dual-stack link pick the same family."""
    host, port = split_address(text, what)
    found = retry(lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s, 0.5,
                  lambda e: IslandStartError(f"{what}: cannot resolve {host!r} within {timeout_s:g}s "
                                             f"(config.hetero.timeout_s): {e}"))
    return address(min(found, key=lambda a: a[0] != socket.AF_INET)[4][0], port)


def listen_address(settings: ProcessSettings, link: int, timeout_s: float) -> str:
    """Where this process listens for `link`: its own advertised name, resolved. A name that
    resolves to loopback (a Debian-style /etc/hosts line) while peers run on other hosts
    would silently refuse them, so that is an error."""
    mine = link_address(settings, settings.island, settings.process_id, link)
    ip, port = split_address(resolve(mine, timeout_s, f"island {settings.tag}'s own address"))
    hosts = {split_address(a)[0] for v in settings.transfer.values() for a in v}
    if ipaddress.ip_address(ip).is_loopback and not all(_is_loopback_name(h) for h in hosts):
        raise ConfigError(f"island {settings.tag}: this host's name in the job ({split_address(mine)[0]!r}) "
                          f"resolves to {ip} here, a loopback address that processes on other hosts cannot "
                          f"reach; map the name to the host's network address (/etc/hosts, DNS) or list "
                          f"the job's hosts by address (HETJAX_HOSTS)")
    return address(ip, port)


def _is_loopback_name(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def wait_for_port(address: str, timeout_s: float, what: str) -> None:
    """Returns once `address` accepts a TCP connection; IslandStartError after timeout_s."""
    host, port = split_address(address, "address")
    retry(lambda: socket.create_connection((host, port), timeout=1.0).close(), timeout_s, 0.1,
          lambda e: IslandStartError(f"{what} at {address} did not answer within {timeout_s:g}s "
                                     f"(config.hetero.timeout_s): {e}; is it running?"))


def _cores(cpus: str) -> set[int]:
    """HETJAX_CPUS's cores ({} when unset), checked against this machine's before jax starts."""
    if not cpus:
        return set()
    try:
        keep = {int(c) for c in cpus.split(",")}
        if not keep <= os.sched_getaffinity(0):
            raise ValueError(f"cores {sorted(keep - os.sched_getaffinity(0))} are not this process's")
    except ValueError as e:
        raise ConfigError(f"{CPUS_VARIABLE}={cpus!r}: expected cores of this machine, e.g. 0,1 ({e})") from None
    return keep


def keep_to(cores: set[int]) -> None:
    """Keeps every thread of this process, and so every thread they start, to `cores`."""
    done: set[str] = set()
    while todo := set(os.listdir("/proc/self/task")) - done:  # again: one not yet kept may start another
        for thread in todo:
            try:
                os.sched_setaffinity(int(thread), cores)
            except ProcessLookupError:  # it ended meanwhile
                pass
        done |= todo


def initialize(settings: ProcessSettings, island: IslandConfig, timeout_s: float) -> None:
    """Joins this process to its island's jax.distributed world (call before jax.devices()).

    On CPU, cross-process collectives inside the island go over gloo (only those: an
    island of one process keeps its collectives in the process). A coordinator that does
    not answer within timeout_s raises IslandStartError naming the island; after the
    start, a member that dies makes the others fail within about timeout_s (heartbeats).
    """
    import jax
    from hetjax.compile import backend
    if backend.backends_started():
        raise IslandStartError(f"island {settings.tag}: jax's backends already exist; call "
                               f"hetero.runtime.initialize before anything touches a device")
    keep = _cores(os.environ.get(CPUS_VARIABLE, ""))
    # XLA:CPU sizes its client's thread pool by the cores the process may use when the
    # backend starts. Kept to more than one core first, the pool fits the share. Kept to
    # one, it would be one thread, which runs a program whole, and `direct` serves a pull
    # from that pool: a pull waited for the whole program the island ran after its send
    # (0.93 s of a 0.98 s program; 5-13 ms with two threads: docs/DESIGN.md). So a process
    # of one core keeps to it only once the backend has started.
    late = len(keep) == 1 and len(os.sched_getaffinity(0)) > 1
    if keep and not late:
        keep_to(keep)
    if settings.platform(island) == "cpu":
        # gloo only where collectives cross processes (jax's default once jax.distributed
        # starts): in a world of one process it would carry even the collectives between
        # the process's own devices over TCP (steps about 6x slower on the tiny islands).
        jax.config.update("jax_cpu_collectives_implementation", "gloo" if settings.num_processes > 1 else None)
    if settings.process_id:
        # jax aborts the process (no exception) when its coordinator never answers; wait
        # for the coordinator's port here so that this case is an error naming the island.
        wait_for_port(settings.coordinator, timeout_s, f"island {settings.tag}: the coordinator "
                      f"(process 0 of island {settings.island!r})")
    try:
        jax.distributed.initialize(settings.coordinator, num_processes=settings.num_processes,
                                   process_id=settings.process_id, **distributed_kwargs(timeout_s))
    except Exception as e:  # jax raises XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
        raise IslandStartError(
            f"island {settings.tag} could not join its jax.distributed world at "
            f"{settings.coordinator} within {timeout_s:g}s (config.hetero.timeout_s): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    check_platform(settings.platform(island), island, settings)
    if late:
        keep_to(keep)
    found = len(jax.local_devices())
    if found != island.devices_per_process:
        raise ConfigError(
            f"island {island.name!r} process {settings.process_id} sees {found} local device(s) but "
            f"config.hetero.islands[{island.name}].devices_per_process={island.devices_per_process}; "
            f"fix the config or the devices visible to the process (XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N on CPU, CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")


def platform_of(device) -> str:
    """cpu, cuda or rocm: jax calls both GPU kinds `gpu`, their client's version tells them apart."""
    if device.platform != "gpu":
        return device.platform
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda" if "cuda" in version else "gpu"


def check_platform(want: str, island: IslandConfig, settings: ProcessSettings) -> None:
    """Refuses an island whose process found other devices than its platform: where jax
    finds no GPU it runs on the CPU, and a cuda or rocm island would train there unnoticed."""
    import jax
    device = jax.local_devices()[0]
    found = platform_of(device)
    if found == want or (found == "gpu" and want in ("cuda", "rocm")):
        return
    raise ConfigError(
        f"config.hetero.islands[{island.name}].platform={island.platform!r}: island {island.name!r} process "
        f"{settings.process_id} found {found} devices ({device.device_kind}), not {want}; install jax's {want} "
        f"plugin or make the GPUs visible to the process, or run the island on CPU on purpose as a stand-in "
        f"(HETJAX_STAND_IN=cpu; launch.local --stand_in cpu)")
